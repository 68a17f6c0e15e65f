"""grammask's own faults inside vLLM's hooks: logged with their traceback, rate-limited.

A guest in vLLM's process never lets an exception out of a hook vLLM calls (an exception in
the sampler ends vLLM's engine core, every request on the server with it). The hooks catch,
end only grammask's rows, and log here: one traceback per site and ``INTERVAL_S``, the
rest counted and reported with the next one, so a fault that repeats every step cannot
flood the log or slow the step.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("grammask")

#: The least time between two tracebacks logged for one site.
INTERVAL_S = 30.0

_lock = threading.Lock()
_last: dict[str, float] = {}
_quiet: dict[str, int] = {}


def log_fault(site: str, what: str, exc: BaseException) -> None:
    """Log ``exc`` (raised at ``site``, doing ``what``) with its traceback, unless this
    site logged one within ``INTERVAL_S``: then count it. Never raises."""
    try:
        now = time.monotonic()
        with _lock:
            last = _last.get(site)
            if last is not None and now - last < INTERVAL_S:
                _quiet[site] = _quiet.get(site, 0) + 1
                return
            _last[site] = now
            quiet = _quiet.pop(site, 0)
        more = f" ({quiet} more since the last report)" if quiet else ""
        log.error("grammask: %s failed in %s%s; grammask's rows of it end (stop-only), "
                  "vLLM's step goes on", what, site, more,
                  exc_info=(type(exc), exc, exc.__traceback__))
    except Exception:  # logging itself failed: nothing more to do
        pass


def reset() -> None:
    """Forget the sites' last reports (tests)."""
    with _lock:
        _last.clear()
        _quiet.clear()
