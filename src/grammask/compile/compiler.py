"""The compile service: runs the router's plan with bounded parallel compiles, single-flight,
an LRU and one deadline per request. Each job is its own module; this one coordinates them:

- the plan: asked of the router once per spec key (``router.plan``), run in order by
  ``plan_runner.PlanRunner`` (each attempt in its mode, within its share of the time left, on
  its backend's compile slots: ``slots``). Nothing here picks a backend or a mode
  (data flows one way: router -> compiler -> backend);
- single flight and the deadline (``flights``): N concurrent requests for one key share one
  compile, each caller with a future of its own; a reaper settles any request still pending
  ``timeout_s`` after submission (slot waits, the routed backend and its fallbacks);
- memory (``cache``): an LRU bounded by calibrated bytes, a bounded negative cache
  that expires (only the request's own errors go there), plans per key; freed memory goes
  back to the OS (``trim_heap``);
- a compile that may run long (a large spec, or an unbounded backend's: xgrammar's) runs on a
  compile worker, because a runaway native compile cannot be killed, only *abandoned*
  (``max_abandoned`` per backend bounds what runaways hold); a small spec of a bounded
  backend compiles on the requesting thread (``slots.may_run_here``);
- the disk (``disk_cache_dir``, off by default; ``diskcache``): tried inside the request's
  flight before compiling; a compile (a late one too) is written in the background;
- fill tuning (``filltune``), after a request is served.

Measured bounds (RSS, deadlines) are in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..backends import get_backend, registry
from ..backends.diskcache import DEFAULT_MAX_BYTES, DiskCache
from ..errors import CompilerClosedError, CompileTimeoutError, InvalidSpecError
from ..specs.grammar_spec import BackendName, GrammarSpec, backend_name
from ..vocab import Vocabulary
from .cache import CompileCache
from .filltune import FillTuner, VerdictMode
from .flights import Flight, Flights
from .grammar import Grammar
from .plan_runner import PlanRunner
from .router import Attempt, Plan, Preference, Route, plan, route
from .slots import HERE_MAX_CHARS, Runners, running_compiles, trim_heap
from .state import ServiceState
from .stats import Stats

__all__ = ["Compiler", "Grammar", "Stats", "running_compiles", "trim_heap"]


def _open_disk(directory: str | os.PathLike[str] | None, max_bytes: int) -> DiskCache | None:
    """The disk cache, or None: off, or its directory was refused (logged)."""
    disk = None if directory is None else DiskCache(directory, max_bytes)
    return disk if disk is not None and disk.enabled else None


class Compiler:
    """Compiles ``GrammarSpec``s into ``Grammar``s for one vocabulary (one per model or
    tokenizer). Thread-safe: any thread may call any method.

    Parameters
    ----------
    vocab : Vocabulary
        The tokenizer's vocabulary every grammar is compiled for.
    backend : str or None, default "auto"
        A backend name or alias forced on every spec without its own, or ``"auto"``/None to
        route each spec (``router``). ``InvalidSpecError`` for an unknown name.
    max_workers, max_abandoned : int, defaults 4 and 2
        Compile slots per backend (``>= 1``), and runaway compiles per backend whose slot is
        handed back (what runaways hold stays bounded).
    cache_bytes : int, default 512 MiB
        The memory cache's bound, in calibrated bytes (``Grammar.memory_bytes``).
    timeout_s : float, default 10.0
        Each request's deadline from submission, fallbacks included (``> 0``).
    negative_ttl_s, max_negative : float and int, defaults 30.0 and 1024
        How long a spec's own error (and a backend's timeout on it) is remembered; how many.
    prefer : str, default "auto"
        A backend to prefer among those that enforce everything.
    disk_cache_dir, disk_cache_bytes : path or None, and int; defaults None and 1 GiB
        A directory (created ``0700``, refused when shared) that keeps compiled grammars
        across processes (None: none), and its size bound.
    rank_invariant : bool, default False
        One of several tensor-parallel ranks, which must all end with the same grammar for a
        spec: no fallback is taken on timing (a slow or busy backend), only on a refusal or
        an internal error, which every rank sees alike.
    tune_fill : bool, default True
        When another backend enforces every keyword of a JSON schema too, compile it in the
        background and let the cheaper to fill here serve the spec's later requests
        (``filltune``). Off with ``rank_invariant``, a forced backend or a ``prefer``ence.
    fill_verdict : "auto" | "rival" | "routed", default "auto"
        The fill tuner's verdict: measured, or forced (tests, where timing must not decide).

    Raises
    ------
    InvalidSpecError
        A bound out of range, an unknown backend or preference.
    """

    def __init__(
        self,
        vocab: Vocabulary,
        *,
        backend: BackendName | str | None = "auto",
        max_workers: int = 4,
        cache_bytes: int = 512 * 1024 * 1024,
        timeout_s: float = 10.0,
        negative_ttl_s: float = 30.0,
        max_abandoned: int = 2,
        prefer: Preference = "auto",
        max_negative: int = 1024,
        disk_cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_bytes: int = DEFAULT_MAX_BYTES,
        rank_invariant: bool = False,
        tune_fill: bool = True,
        fill_verdict: VerdictMode = "auto",
    ) -> None:
        self.default_backend = backend_name(backend)
        if timeout_s <= 0 or max_workers < 1 or cache_bytes < 0 or max_negative < 0:
            raise InvalidSpecError("timeout_s and max_workers must be positive")
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.negative_ttl_s = negative_ttl_s
        self.max_negative = max_negative
        self.prefer: Preference = registry.resolve(prefer, "prefer") or "auto"
        self.rank_invariant = rank_invariant
        self.tune_fill = tune_fill and not rank_invariant and self.prefer == "auto"
        self.stats = Stats()
        # one pool of compile slots per backend: one backend's runaways never starve another's
        self._runners = Runners(max_workers, max_abandoned)
        # builders mostly wait on runners: twice the runners' slots, and the reaper enforces
        # deadlines for builds still queued here
        self._pool = ThreadPoolExecutor(max_workers=max(8, 4 * max_workers),
                                        thread_name_prefix="grammask-route")
        self._state = ServiceState(vocab, self.stats, CompileCache(
            self.stats, cache_bytes, negative_ttl_s, max_negative))
        self._lock = self._state.lock
        self._memory = self._state.memory
        self._flights = Flights(self._state, timeout_s)
        self._disk = _open_disk(disk_cache_dir, disk_cache_bytes)
        self._plans = PlanRunner(self._state, self._runners, self._disk, self._keep_late)
        self._tuner = FillTuner(self._state, compile=self.compile, plan=self.plan,
                                submit=self._pool.submit, verdict=fill_verdict)
        # the backends' tokenizers are built once per vocabulary (seconds, holding the GIL):
        # here, outside every request's deadline
        chosen = self.default_backend
        for name in registry.names() if chosen is None else (chosen,):
            get_backend(name).prepare(vocab)

    # ----------------------------------------------------------------------- public
    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> Grammar:
        """Compile ``spec`` (or find it cached), waiting at most ``timeout`` seconds (default
        and most: ``timeout_s``); returns the ``Grammar``. On a timeout the compile goes on
        for whoever else waits, and its result is cached.

        Raises ``GrammarError`` (a subclass: the spec's own fault, remembered for
        ``negative_ttl_s``), ``CompileTimeoutError``, ``InternalCompileError``,
        ``CompilerClosedError``, or ``InvalidSpecError`` when ``spec`` is no ``GrammarSpec``.

        A caller that waits out the whole deadline builds a small spec on its own thread (one
        thread hop fewer each way); a large one (``HERE_MAX_CHARS``) builds on the pool, so
        nothing of it holds this caller past its deadline."""
        spec = self._effective(spec)
        # a large spec builds on the pool (its plan's walk, its compile): this caller then
        # waits at most its deadline whatever runs
        here = (self._disk is None and (timeout is None or timeout >= self.timeout_s)
                and len(spec.source) <= HERE_MAX_CHARS)
        found, fut, flight = self._flights.lookup(spec.key, here)
        if isinstance(found, Grammar):
            return found
        if found is not None:
            raise found
        if fut is None:
            assert flight is not None
            return self._build_here(spec, flight)
        if flight is not None:
            self._submit(spec, flight)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise CompileTimeoutError(
                f"{spec.describe()} was not compiled within {timeout:.2f} s") from None

    def compile_async(self, spec: GrammarSpec) -> Future[Grammar]:
        """Start compiling ``spec`` now (at request admission: it overlaps the prefill); returns
        a future of this caller's own (``cancel()`` leaves other callers' alone) that holds the
        ``Grammar`` or the error ``compile`` would raise. Raises ``CompilerClosedError`` and
        ``InvalidSpecError`` at once."""
        spec = self._effective(spec)
        found, fut, flight = self._flights.lookup(spec.key, here=False)
        if fut is None:  # a hit or a remembered failure: settled at once
            fut = Future()
            if isinstance(found, Grammar):
                fut.set_result(found)
            else:
                fut.set_exception(found)
            return fut
        if flight is not None:
            self._submit(spec, flight)
        return fut

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        """The grammar cached for ``spec`` now, or None; never compiles."""
        key = self._effective(spec).key
        with self._lock:
            return self._memory.peek(key)

    def route(self, spec: GrammarSpec) -> Route:
        """Which backend ``spec`` goes to and why (``router.route``); never compiles."""
        return route(self._effective(spec), prefer=self.prefer)

    def plan(self, spec: GrammarSpec) -> Plan:
        """The attempts a compile of ``spec`` runs, in order (``grammask.compile.router.plan``).

        Made once per spec key and kept (until ``clear`` or a change of the registered
        backends): admission (``check``), the compile and the first-mask hedge all ask."""
        spec = self._effective(spec)
        key = spec.key
        backends = registry.backends()
        with self._lock:
            known = self._memory.plan(key, backends)
        if known is not None:
            return known
        made = plan(spec, prefer=self.prefer, rank_invariant=self.rank_invariant)
        with self._lock:
            self._memory.keep_plan(key, made, backends)
        return made

    def check(self, spec: GrammarSpec) -> Attempt:
        """Validate ``spec`` without compiling for the tokenizer (request admission); returns
        the plan's first attempt whose backend syntax check passes. Raises the routed
        backend's ``GrammarError`` when none does, so admission refuses exactly what no
        compile could serve (an internal error is not the spec's fault: skipped)."""
        spec = self._effective(spec)
        return self._plans.check(spec, self.plan(spec))

    def cache_info(self) -> dict[str, int]:
        """Entries, bytes, bound, flights, remembered failures and abandoned compiles now."""
        with self._lock:
            return {"entries": len(self._memory), "bytes": self._memory.used,
                    "limit_bytes": self.cache_bytes, "inflight": len(self._flights),
                    "negative": self._memory.failures,
                    "abandoned": self._runners.abandoned()}

    def clear(self, *, trim: bool = True) -> None:
        """Drop every cached grammar, failure and plan (the next request of any spec is cold
        again), and hand the memory back to the OS (``trim``; a benchmark that only wants
        cold compiles keeps it, as a long-running server's heap does). The router's plans
        by shape stay: they hold nothing of any one spec."""
        with self._lock:
            self._memory.clear()
        if trim:
            self._trim(force=True)

    @property
    def disk_cache(self) -> DiskCache | None:
        """The disk cache in use (None: off, or its directory was refused)."""
        return self._disk

    def flush_disk_cache(self, timeout: float | None = None) -> bool:
        """Wait until every queued disk-cache write is done; False on timeout."""
        return True if self._disk is None else self._disk.flush(timeout)

    @property
    def fill_tuner(self) -> FillTuner:
        """The fill tuner (``compile/filltune``): its verdicts for running rows (``offer``,
        ``epoch``, ``offered``) and the running rows' tokens it asks for (``wanting``,
        ``note_walk``)."""
        return self._tuner

    def close(self) -> None:
        """Fail every pending request with ``CompilerClosedError``; later requests fail at once.
        Compiles already running finish in the background and are dropped."""
        with self._lock:
            self._state.closed = True  # from here no lookup registers a flight
        self._flights.close(CompilerClosedError("the compiler was closed"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------- internals
    def _effective(self, spec: GrammarSpec) -> GrammarSpec:
        if not isinstance(spec, GrammarSpec):
            raise InvalidSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        if spec.backend is None and self.default_backend is not None:
            return spec.with_backend(self.default_backend)
        return spec

    def _submit(self, spec: GrammarSpec, flight: Flight) -> None:
        try:
            self._pool.submit(self._build, spec, flight)
        except RuntimeError:  # the pool shut down: close() raced this request
            self._flights.resolve(flight, error=CompilerClosedError("the compiler is closed"))

    def _build_here(self, spec: GrammarSpec, flight: Flight) -> Grammar:
        """Build a flight on the caller's thread; the caller gets what every waiter of the
        flight got (its own result, or the timeout or close that settled it first)."""
        outcome = self._build(spec, flight, here=True)
        if isinstance(outcome, Grammar):
            return outcome
        raise outcome

    def _build(self, spec: GrammarSpec, flight: Flight, here: bool = False
               ) -> Grammar | BaseException:
        """Run the plan of a flight and settle it; returns what settled it. ``here``: on the
        caller's thread, which hands the heap trim (when one is due) to the pool rather than
        wait for it."""
        if flight.done:  # expired or closed while queued
            return flight.error or CompilerClosedError("the compiler is closed")
        try:
            grammar = self._plans.run(spec, self.plan(spec), flight.deadline)
        except BaseException as exc:
            error = self._flights.fail(flight, exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: the caller's
                raise
            return error
        outcome = self._flights.succeed(flight, grammar)
        if self.tune_fill:
            self._tuner.after_compile(spec, grammar)
        if not here:
            self._trim()
        elif self._trim_due():
            with contextlib.suppress(RuntimeError):  # the pool shut down: no trim needed
                self._pool.submit(self._trim)
        return outcome

    def _trim_due(self) -> bool:
        with self._lock:
            return self._memory.trim_due(time.monotonic())

    def _trim(self, force: bool = False) -> None:
        """After inserts and evictions, return freed memory (evicted grammars, compile
        scratch) to the OS, at most once a second: a trim walks the heap."""
        with self._lock:
            due = self._memory.take_trim(time.monotonic(), force)
        if due:
            trim_heap()

    def _keep_late(self, key: str, make: Callable[[], Grammar]) -> bool:
        """Cache an abandoned compile's late result unless the request was served otherwise
        (the work is not lost, and the spec is no longer treated as a runaway)."""
        with self._lock:
            wanted = not self._state.closed and key not in self._memory
        grammar = make() if wanted else None  # (make counts it: only when wanted)
        with self._lock:
            if grammar is None or self._state.closed or key in self._memory:
                return False
            self._memory.insert(key, grammar)
        self._trim()
        return True
