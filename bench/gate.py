"""Let a batch reach vLLM's engine whole before it starts, on a machine too small to host both.

On two cores the API server (which parses, renders and tokenizes each request) competes
with the engine core and the worker, both busy-polling once the first request runs. It then
at times hands a batch of 32 to the engine one request at a time, so the engine never runs
at the batch's concurrency and every system looks fast per token. The gate uses vLLM's own
pause (``POST /pause?mode=keep``, a development route: the server needs
``VLLM_SERVER_DEV_MODE=1``): the scheduler queues new requests without running them and the
engine sleeps; the batch is sent; once the API server has gone quiet (its CPU time has not
moved for ``QUIET_POLLS`` polls after every send began: every request has been handed over),
``POST /resume`` lets the engine run them all from its first step. What the benchmark then
times starts at the resume.

Without the server's pid the gate waits ``BLIND_WAIT_S`` instead of watching its CPU time.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

POLL_S = 0.02
#: polls in a row without any CPU time used by the API server: everything was handed over
QUIET_POLLS = 5
#: at most this long for the API server to go quiet (then the batch goes anyway)
MAX_WAIT_S = 10.0
BLIND_WAIT_S = 1.0
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of one process (all its threads), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S


@dataclass
class Gate:
    """The pause/resume pair around one batch (``hold``, send, ``release``)."""

    base_url: str  # the server's root, without /v1
    api_pid: int | None = None

    def _post(self, path: str) -> None:
        req = urllib.request.Request(self.base_url + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as reply:
            reply.read()

    def available(self) -> bool:
        """Whether the server has the pause routes (``VLLM_SERVER_DEV_MODE=1``)."""
        try:
            with urllib.request.urlopen(self.base_url + "/is_paused", timeout=30) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def hold(self) -> None:
        """Pause scheduling; requests sent now queue in the engine (caches kept)."""
        self._post("/pause?mode=keep&clear_cache=false")

    def wait_handed_over(self, started: Callable[[], int], n: int) -> float:
        """Block until the API server has handed the batch over (all ``n`` sends have
        started, and then its CPU time stands still for ``QUIET_POLLS`` polls); seconds
        waited."""
        t0 = time.perf_counter()
        while started() < n and time.perf_counter() - t0 < MAX_WAIT_S:
            time.sleep(POLL_S / 4)
        if self.api_pid is None:
            time.sleep(BLIND_WAIT_S)
            return time.perf_counter() - t0
        last = cpu_seconds(self.api_pid)
        quiet = 0
        while quiet < QUIET_POLLS and time.perf_counter() - t0 < MAX_WAIT_S:
            time.sleep(POLL_S)
            now = cpu_seconds(self.api_pid)
            if now is None or last is None:
                break
            quiet = quiet + 1 if now == last else 0
            last = now
        return time.perf_counter() - t0

    def release(self) -> None:
        self._post("/resume")
