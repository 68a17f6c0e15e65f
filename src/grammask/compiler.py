"""The compile service: runs the router's plan with bounded parallel compiles, single-flight,
an LRU and one deadline per request.

- A cold compile asks the router once (``grammask.router.plan``) and ``attempts.PlanRunner``
  runs its attempts in order, each in its mode and within its share of the time left;
  nothing here decides which backend or which mode (data flows one way: router -> compiler
  -> backend).

- ``compile_async`` returns at once; the compile starts immediately so it overlaps the prefill.
  Each caller gets a future of its own: cancelling it drops only that caller.
- N concurrent requests for one key share one compile (single-flight).
- Results live in an LRU bounded by (calibrated) bytes; evictions hand memory back to the OS.
  Failures live in a bounded negative cache that expires; only user errors go there.
- Every request has one deadline (``timeout_s`` from submission) covering slot waits, the
  routed backend and its fallbacks; a reaper resolves any request still pending at its deadline.
- A runaway native compile cannot be killed, so it is *abandoned*: its slot is handed back (up
  to ``max_abandoned`` at once per backend; beyond that it keeps the slot, so the CPU spent on
  runaways stays bounded; ``compile_slots``). Each backend has its own slots, so one backend's
  runaways never hold up another's compiles (fallbacks included). A spec that timed out on
  a backend is not retried there until ``negative_ttl_s`` passes, and a runaway that
  finishes late fills the cache.
- ``disk_cache_dir`` (off by default): grammars of backends that declare ``disk`` persist
  across processes
  (``grammask.diskcache``). On a memory miss the disk is tried inside the request's flight
  (single-flight, and within its deadline) before compiling; a successful compile (a late one
  too) is written by a background thread (``flush_disk_cache`` waits for it).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from . import metrics
from .attempts import PlanRunner
from .backends import get_backend, registry
from .compile_slots import Runners, running_compiles, trim_heap
from .diskcache import DEFAULT_MAX_BYTES, DiskCache
from .errors import (
    CompileFailure,
    CompilerClosedError,
    CompileTimeoutError,
    GrammarError,
    InternalCompileError,
    InvalidSpecError,
)
from .grammar import Grammar, Stats, fresh_error
from .router import Attempt, Plan, Preference, Route, plan, route
from .spec import BackendName, GrammarSpec, backend_name
from .vocab import Vocabulary

__all__ = ["Compiler", "Grammar", "Stats", "running_compiles", "trim_heap"]


class _Flight:
    """One in-flight compile of a key and the callers' futures waiting on it."""

    def __init__(self, key: str, deadline: float) -> None:
        self.key = key
        self.deadline = deadline
        self.waiters: list[Future[Grammar]] = []
        self.done = False


class _Reaper:
    """Resolves flights still pending at their deadline (one daemon thread per compiler), so a
    request's future is done by ``timeout_s`` even when its build waits for a thread."""

    GRACE_S = 0.05

    def __init__(self, fire: Callable[[_Flight], None]) -> None:
        self._fire = fire
        self._heap: list[tuple[float, int, _Flight]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, flight: _Flight) -> None:
        with self._cond:
            heapq.heappush(self._heap, (flight.deadline + self.GRACE_S, next(self._seq), flight))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammask-reaper",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        """Runs while flights are pending, then exits (an idle compiler holds no thread, and
        a dropped one can be collected)."""
        while True:
            with self._cond:
                while not self._stopped:
                    while self._heap and self._heap[0][2].done:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._thread = None
                        return
                    if self._heap[0][0] <= time.monotonic():
                        break
                    self._cond.wait(self._heap[0][0] - time.monotonic())
                if self._stopped:
                    self._thread = None
                    return
                _, _, flight = heapq.heappop(self._heap)
            self._fire(flight)


def _open_disk(directory: str | os.PathLike[str] | None, max_bytes: int) -> DiskCache | None:
    """The disk cache, or None: off, or its directory was refused (logged)."""
    disk = None if directory is None else DiskCache(directory, max_bytes)
    return disk if disk is not None and disk.enabled else None


class Compiler:
    """Compiles specs for one vocabulary; thread-safe; one per model/tokenizer."""

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
    ) -> None:
        """``rank_invariant``: one of several tensor-parallel ranks, which must all end with
        the same grammar for a spec: no fallback is taken on timing (a slow or busy backend),
        only on a refusal or an internal error, which every rank sees alike."""
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
        self.stats = Stats()
        # one pool of compile slots per backend: one backend's runaways never starve another's
        self._runners = Runners(max_workers, max_abandoned)
        # builders mostly wait on runners: twice the runners' slots, and the reaper enforces
        # deadlines for builds still queued here
        self._pool = ThreadPoolExecutor(max_workers=max(8, 4 * max_workers),
                                        thread_name_prefix="grammask-route")
        self._reaper = _Reaper(self._expire)
        self._lock = threading.Lock()
        self._closed = False
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_used = 0
        self._inflight: dict[str, _Flight] = {}
        # key -> (expiry, error without traceback); insertion order = expiry order
        self._failed: OrderedDict[str, tuple[float, GrammarError]] = OrderedDict()
        self._last_trim = 0.0
        self._trim_pending = False
        self._disk = _open_disk(disk_cache_dir, disk_cache_bytes)
        self._plans = PlanRunner(vocab, self.stats, self._lock, self._runners, self._disk,
                                 self._keep_late, lambda: self._closed)
        # the backends' tokenizers are built once per vocabulary (seconds, holding the GIL):
        # here, outside every request's deadline
        chosen = self.default_backend
        for name in registry.names() if chosen is None else (chosen,):
            get_backend(name).prepare(vocab)

    # ----------------------------------------------------------------------- public
    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> Grammar:
        """Blocking compile. A cache hit returns at once; a miss waits at most ``timeout``
        seconds (default: the compiler's ``timeout_s``), then raises ``CompileTimeoutError``
        while the compile goes on for whoever else waits (its result is cached)."""
        fut = self.compile_async(spec)
        if fut.done():
            return fut.result()
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise CompileTimeoutError(
                f"{spec.describe()} was not compiled within {timeout:.2f} s") from None

    def compile_async(self, spec: GrammarSpec) -> Future[Grammar]:
        """Start compiling now (e.g. at request admission, overlapping the prefill).

        The future is this caller's own: ``cancel()`` on it leaves other callers' alone."""
        fut, build = self._lookup(spec)
        if build is not None:
            spec, flight = build
            try:
                self._pool.submit(self._build, spec, flight)
            except RuntimeError:  # the pool shut down: close() raced this request
                self._resolve(flight, error=CompilerClosedError("the compiler is closed"))
        return fut

    def _lookup(self, spec: GrammarSpec
                ) -> tuple[Future[Grammar], tuple[GrammarSpec, _Flight] | None]:
        """The request's future, and the effective spec and flight when the caller must
        build it (a miss: the flight is already registered, so concurrent requests join)."""
        if not isinstance(spec, GrammarSpec):
            raise InvalidSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        spec = self._effective(spec)
        key = spec.key
        fut: Future[Grammar] = Future()
        with self._lock:
            if self._closed:
                raise CompilerClosedError("the compiler is closed")
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                metrics.CACHE_REQUESTS.labels(tier="memory", result="hit").inc()
                fut.set_result(hit)
                return fut, None
            failed = self._failed.get(key)
            if failed is not None:
                if failed[0] > time.monotonic():
                    self.stats.negative_hits += 1
                    fut.set_exception(fresh_error(failed[1]))
                    return fut, None
                del self._failed[key]
            running = self._inflight.get(key)
            if running is not None:
                self.stats.joined += 1
                running.waiters.append(fut)
                return fut, None
            self.stats.misses += 1
            metrics.CACHE_REQUESTS.labels(tier="memory", result="miss").inc()
            flight = _Flight(key, time.monotonic() + self.timeout_s)
            flight.waiters.append(fut)
            self._inflight[key] = flight
        self._reaper.add(flight)
        return fut, (spec, flight)

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        with self._lock:
            return self._cache.get(self._effective(spec).key)

    def route(self, spec: GrammarSpec) -> Route:
        return route(self._effective(spec), prefer=self.prefer)

    def plan(self, spec: GrammarSpec) -> Plan:
        """The attempts a compile of ``spec`` runs, in order (``grammask.router.plan``)."""
        return plan(self._effective(spec), prefer=self.prefer,
                    rank_invariant=self.rank_invariant)

    def check(self, spec: GrammarSpec) -> Attempt:
        """Cheap validation without compiling for the tokenizer (request admission).

        Walks the plan's attempts (refusals only: an internal error is not the spec's
        fault), so admission refuses exactly what no compile could serve; returns the attempt
        that passed. Raises the routed backend's error when none does."""
        spec = self._effective(spec)
        first: GrammarError | None = None
        for step in self.plan(spec).attempts:
            if "refused" not in step.after:
                continue
            try:
                get_backend(step.backend).check(spec, lenient=step.lenient)
            except GrammarError as exc:
                first = first or exc
                continue
            return step
        assert first is not None
        raise first

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._cache), "bytes": self._cache_used,
                    "limit_bytes": self.cache_bytes, "inflight": len(self._inflight),
                    "negative": len(self._failed),
                    "abandoned": self._runners.abandoned()}

    def clear(self) -> None:
        """Drop every cached grammar and failure, and hand the memory back to the OS."""
        with self._lock:
            self._cache.clear()
            self._failed.clear()
            self._cache_used = 0
        self._trim(force=True)

    @property
    def disk_cache(self) -> DiskCache | None:
        """The disk cache in use (None: off, or its directory was refused)."""
        return self._disk

    def flush_disk_cache(self, timeout: float | None = None) -> bool:
        """Wait until every queued disk-cache write is done; False on timeout."""
        return True if self._disk is None else self._disk.flush(timeout)

    def close(self) -> None:
        """Fail every pending request with ``CompilerClosedError``; later requests fail at once.
        Compiles already running finish in the background and are dropped."""
        with self._lock:
            self._closed = True
            flights = list(self._inflight.values())
        for flight in flights:
            self._resolve(flight, error=CompilerClosedError("the compiler was closed"))
        self._reaper.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------- internals
    def _effective(self, spec: GrammarSpec) -> GrammarSpec:
        if spec.backend is None and self.default_backend is not None:
            return spec.with_backend(self.default_backend)
        return spec

    def _resolve(self, flight: _Flight, grammar: Grammar | None = None,
                 error: BaseException | None = None) -> bool:
        """Settle every caller's future of a flight once; False when already settled."""
        with self._lock:
            if flight.done:
                return False
            flight.done = True
            if self._inflight.get(flight.key) is flight:
                del self._inflight[flight.key]
            waiters, flight.waiters = flight.waiters, []
        for fut in waiters:
            if fut.done():  # cancelled by its caller
                continue
            with contextlib.suppress(InvalidStateError):  # cancelled just now
                if error is not None:
                    fut.set_exception(fresh_error(error))
                else:
                    fut.set_result(grammar)  # type: ignore[arg-type]
        return True

    def _expire(self, flight: _Flight) -> None:
        """The reaper's call: a flight reached its deadline with its build still going."""
        error = CompileTimeoutError(f"not compiled within {self.timeout_s:.2f} s")
        if self._resolve(flight, error=error):
            with self._lock:
                self.stats.timeouts += 1

    def _build(self, spec: GrammarSpec, flight: _Flight) -> None:
        if flight.done:  # expired or closed while queued
            return
        try:
            grammar = self._plans.run(spec, self.plan(spec), flight.deadline)
        except BaseException as exc:
            error = exc if isinstance(exc, CompileFailure) else InternalCompileError(
                f"internal error while compiling: {type(exc).__name__}: {exc}")
            with self._lock:
                self.stats.errors += 1
                if isinstance(error, InternalCompileError):
                    self.stats.internal_errors += 1
                elif isinstance(error, GrammarError):  # only the request's own faults
                    self._remember_failure(spec.key, error)
            self._resolve(flight, error=error)
            return
        with self._lock:
            if not self._closed:
                self._insert(spec.key, grammar)
        self._resolve(flight, grammar=grammar)
        self._trim()

    def _remember_failure(self, key: str, error: GrammarError) -> None:
        """Negative cache (under the lock): errors kept without their traceback; expired
        entries purged; at most ``max_negative`` entries, oldest dropped first."""
        now = time.monotonic()
        while self._failed:
            oldest = next(iter(self._failed.values()))
            if oldest[0] > now and len(self._failed) < self.max_negative:
                break
            self._failed.popitem(last=False)
        if self.max_negative:
            self._failed.pop(key, None)
            self._failed[key] = (now + self.negative_ttl_s, fresh_error(error))  # type: ignore[assignment]

    def _insert(self, key: str, grammar: Grammar) -> None:
        size = grammar.memory_bytes
        if size > self.cache_bytes:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_used -= old.memory_bytes
        self._cache[key] = grammar
        self._cache_used += size
        self._trim_pending = True  # compile scratch memory is freed but not yet returned
        while self._cache_used > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cache_used -= evicted.memory_bytes
            self.stats.evictions += 1
            self._trim_pending = True

    def _trim(self, force: bool = False) -> None:
        """After inserts and evictions, return freed memory (evicted grammars, compile
        scratch) to the OS, at most once a second: a trim walks the heap."""
        now = time.monotonic()
        with self._lock:
            if not force and (not self._trim_pending or now - self._last_trim < 1.0):
                return
            self._trim_pending = False
            self._last_trim = now
            self.stats.trims += 1
        trim_heap()

    def _keep_late(self, key: str, make: Callable[[], Grammar]) -> bool:
        """Cache an abandoned compile's late result unless the request was served otherwise
        (the work is not lost, and the spec is no longer treated as a runaway)."""
        with self._lock:
            wanted = not self._closed and key not in self._cache
        grammar = make() if wanted else None  # (make counts it: only when wanted)
        with self._lock:
            if grammar is None or self._closed or key in self._cache:
                return False
            self._insert(key, grammar)
        self._trim()
        return True

