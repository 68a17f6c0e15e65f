"""Prometheus metrics: what an operator needs to see grammar waits and failures.

Names follow SGLang's and vLLM's style (``grammask_...``; seconds as histograms, events as
counters). Without ``prometheus_client`` installed every metric is a no-op, so the library
never depends on it.

In a vLLM server the processor runs in vLLM's engine-core process, not the API server that
answers ``/metrics``. Two ways to see them:

- start the server with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty directory: every process
  writes its metrics there and vLLM's ``/metrics`` (which uses prometheus_client's
  multiprocess collector then) serves grammask's beside its own;
- or the plugin setting ``metrics_port``: grammask's own exporter in vLLM's engine core
  (tensor-parallel rank 0), ``http://host:PORT/metrics``.

Every metric is also readable in Python through ``snapshot()`` (tests, embedders).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

_prom: Any
try:
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - prometheus_client is optional
    _prom = None

#: seconds buckets from 100 us to 60 s: compiles span five orders of magnitude
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


def _histogram(name: str, doc: str, labels: Sequence[str] = (),
               buckets: Sequence[float] = _BUCKETS) -> Any:
    if _prom is None:
        return _Noop()
    return _prom.Histogram(name, doc, list(labels), buckets=tuple(buckets))


def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> Any:
    if _prom is None:
        return _Noop()
    return _prom.Counter(name, doc, list(labels))


COMPILE_SECONDS = _histogram(
    "grammask_compile_seconds", "Grammar compile time per backend attempt",
    ("backend", "kind", "outcome"))
CACHE_REQUESTS = _counter(
    "grammask_cache_requests", "Compiled-grammar cache lookups", ("tier", "result"))
FALLBACKS = _counter(
    "grammask_fallbacks", "Compiles served by another backend than the routed one",
    ("from_backend", "to_backend", "reason"))
UNENFORCED = _counter(
    "grammask_unenforced_requests", "Grammars served with keywords the backend does not enforce",
    ("backend",))
ROW_ERRORS = _counter(
    "grammask_row_errors", "Rows put into the error state (stop-only mask)", ("cause",))
FIRST_MASK_WAIT = _histogram(
    "grammask_first_mask_wait_seconds",
    "How long a row's first mask waited for its grammar (the batch waits too)", ("outcome",))
FILL_TUNED = _counter(
    "grammask_fill_tuned", "JSON schemas whose fill cost two backends compared on this "
    "machine: the routed backend and the one now serving the spec", ("routed", "served"))
HEDGES = _counter(
    "grammask_hedges", "First masks that started the other backend's compile", ("served_by",))
HOST_CONFLICTS = _counter(
    "grammask_host_conflicts", "Rows the host's own processors (min_tokens, allowed_token_ids, "
    "bad_words, logit_bias) left with no token the grammar allows: its tokens were restored "
    "(counted on CPU logits only)")
REQUESTS = _counter(
    "grammask_requests", "Constrained requests the plugin served (counted as their grammar "
    "first masks a token; one that never got a mask is in grammask_unserved_requests), by "
    "where the constraint came from (structured_outputs: vLLM's own fields, the drop-in; "
    "grammask: its own keys)", ("source", "kind"))
FILL_SECONDS = _histogram(
    "grammask_fill_seconds", "Mask work per decode step on the fill thread (advance + fill)")
V2_TOKEN_READS = _counter(
    "grammask_v2_token_reads", "Steps' committed tokens read on vLLM's V2 runner, by how: "
    "watched (as they landed, the fill overlapping the forward) or ordered (after the "
    "runner's stream passed the apply that needed them: the rare case)", ("how",))
V2_MARK_COLLISIONS = _counter(
    "grammask_v2_mark_collisions", "Committed tokens on vLLM's V2 runner that equalled the "
    "token watch's mark (each cost an ordered read; only a sample the processors did not "
    "decide, such as thinking-budget forcing, can)")
V2_TOKEN_WAIT = _histogram(
    "grammask_v2_token_wait_seconds", "The host's wait in a V2 apply for the tokens its rows "
    "committed in the step before (their landing, then the hand-over to the fill)")
V2_APPLY_SECONDS = _histogram(
    "grammask_v2_apply_seconds", "The host's time in a V2 apply: tokens, fill, mask")
ENGINE_SWITCHES = _counter(
    "grammask_engine_switches", "Running rows moved to the engine the fill tuner found "
    "cheaper (outcome=switched), or left on theirs, by why (outcome=rejected: the new engine "
    "refused the row's history; dead_end; empty: no token allowed; error)", ("outcome",))
ENGINE_SWITCH_REPLAY = _histogram(
    "grammask_engine_switch_replay_seconds", "One running row's history replayed into the new "
    "engine's matcher (on the engine switch's own thread)")
FILL_SECONDS_PER_TOKEN = _histogram(
    "grammask_fill_seconds_per_token", "The fill tuner's measured fill time of one row per "
    "token, by engine (a probe walk, both engines on the same tokens)", ("backend",),
    buckets=(1e-6, 2e-6, 4e-6, 8e-6, 16e-6, 32e-6, 64e-6, 128e-6, 256e-6, 512e-6, 1e-3, 4e-3))
UNSERVED = _counter(
    "grammask_unserved_requests", "Constrained requests that left without a grammar mask, "
    "by why: reasoning (still reasoning when they finished), no_mask (their grammar never "
    "masked a token: still compiling, or failed first); not in grammask_requests",
    ("source", "kind", "reason"))


class Children:
    """A labelled metric's children, each looked up once. ``labels()`` takes the metric's lock
    and checks its arguments on every call: a few microseconds on the cache-hit path, which
    has nothing else that slow. Values are positional, in the metric's label order."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:  # a race makes it twice: labels() hands both the same child
            child = self._children[values] = self._metric.labels(*values)
        return child


#: the children of the compile path's metrics (backend, kind, outcome / tier, result /
#: from_backend, to_backend, reason / backend)
compile_seconds = Children(COMPILE_SECONDS)
cache_requests = Children(CACHE_REQUESTS)
fallbacks = Children(FALLBACKS)
unenforced = Children(UNENFORCED)

_exporter_lock = threading.Lock()
_exporter_port: int | None = None


class Later:
    """Metric updates a fill job defers until its masks are handed over (``defer``): a
    Prometheus update takes a lock, and a step that starts many requests made enough of them
    on the fill thread to show inside the window the host waits on (docs/benchmarks.md,
    Figures: decode host path). A thread enters a scope with ``with Later() as later`` and
    runs them with ``later.flush()``."""

    _current = threading.local()

    def __init__(self) -> None:
        self.calls: list[tuple[Any, float]] = []

    def __enter__(self) -> Later:
        Later._current.scope = self
        return self

    def __exit__(self, *exc: object) -> None:
        Later._current.scope = None

    def flush(self) -> None:
        calls, self.calls = self.calls, []
        for fn, value in calls:
            fn(value)


def defer(fn: Any, value: float) -> None:
    """``fn(value)`` (a metric's ``observe`` or ``inc``) now, or at the end of the calling
    thread's ``Later`` scope."""
    scope = getattr(Later._current, "scope", None)
    if scope is None:
        fn(value)
    else:
        scope.calls.append((fn, value))


def observe_many(child: Any, value: float, count: int) -> None:
    """``child.observe(value)`` ``count`` times as one update: a step that starts many rows
    observes as many zero first-mask waits, a lock each on the fill thread, which then
    takes turns with the host's apply. prometheus_client's histogram child takes the sum
    and the one bucket in one ``inc`` each; anything else (another client version, the
    no-op) gets the loop."""
    if count <= 0:
        return
    buckets = getattr(child, "_buckets", None)
    bounds = getattr(child, "_upper_bounds", None)
    total = getattr(child, "_sum", None)
    if buckets is None or bounds is None or total is None:
        for _ in range(count):
            child.observe(value)
        return
    total.inc(value * count)
    for bucket, bound in zip(buckets, bounds, strict=True):
        if value <= bound:
            bucket.inc(count)
            break


def available() -> bool:
    return _prom is not None


def start_exporter(port: int, addr: str = "0.0.0.0") -> bool:
    """grammask's own ``/metrics`` endpoint (once per process); False without prometheus."""
    global _exporter_port
    if _prom is None:
        return False
    with _exporter_lock:
        if _exporter_port is None:
            _prom.start_http_server(port, addr=addr)
            _exporter_port = port
    return True


def snapshot() -> dict[str, float]:
    """Every grammask sample in this process, ``name{label="v",...}`` -> value."""
    if _prom is None:
        return {}
    out: dict[str, float] = {}
    for metric in _prom.REGISTRY.collect():
        if not metric.name.startswith("grammask_"):
            continue
        for sample in metric.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
