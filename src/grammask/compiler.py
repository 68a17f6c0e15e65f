"""The compile service: runs the router's plan with bounded parallel compiles, single-flight,
an LRU and one deadline per request.

- A cold compile asks the router once (``grammask.router.plan``) and ``attempts.PlanRunner``
  runs its attempts in order, each in its mode and within its share of the time left;
  nothing here decides which backend or which mode (data flows one way: router -> compiler
  -> backend).

- ``compile_async`` returns at once; the compile starts immediately so it overlaps the prefill.
  Each caller gets a future of its own: cancelling it drops only that caller.
- N concurrent requests for one key share one compile (single-flight).
- Results live in an LRU bounded by (calibrated) bytes; evictions, ``clear`` and a long
  compile's freed scratch hand memory back to the OS (``compile_cache``). RSS growth over
  many distinct schemas stays within 1.25x ``cache_bytes`` plus a fixed ~48 MiB (allocator
  pages that cannot be returned, the backends' first-compile state, abandoned compiles still
  running): ``python -m bench.stress`` measures both.
  Failures live in a bounded negative cache that expires; only user errors go there.
- Every request has one deadline (``timeout_s`` from submission) covering slot waits, the
  routed backend and its fallbacks; a reaper resolves any request still pending at its deadline.
- A backend whose own limits bound its compiles (llguidance's parser limits) compiles a
  small spec on the thread that builds the request, within its slots (``compile_slots.
  may_run_here``: sure to end within a tenth of the time left). Any other compile (a large
  spec, or an unbounded backend's: xgrammar's) runs on a compile worker: a runaway native
  compile cannot be killed, so it is *abandoned*: its slot is handed back (up to
  ``max_abandoned`` at once per backend; beyond that it keeps the slot, so the CPU and
  memory spent on runaways stay bounded; ``compile_slots``).
  Each backend has its own slots, so one backend's runaways never hold up another's
  compiles (fallbacks included). A spec that timed out on a backend is not retried there
  until ``negative_ttl_s`` passes, and a runaway that finishes late fills the cache.
- ``disk_cache_dir`` (off by default): grammars of backends that declare ``disk`` persist
  across processes
  (``grammask.diskcache``). On a memory miss the disk is tried inside the request's flight
  (single-flight, and within its deadline) before compiling; a successful compile (a late one
  too) is written by a background thread (``flush_disk_cache`` waits for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from . import fillcost, metrics
from .attempts import PlanRunner
from .backends import get_backend, registry
from .compile_cache import CompileCache
from .compile_slots import HERE_MAX_CHARS, Runners, running_compiles, trim_heap
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

#: bound once: ``labels()`` takes a lock and checks its arguments, a cost on every hit
_MEMORY_HITS = metrics.cache_requests("memory", "hit")
_MEMORY_MISSES = metrics.cache_requests("memory", "miss")
_FILL_TUNED = metrics.FILL_TUNED
log = logging.getLogger("grammask")


class _Flight:
    """One in-flight compile of a key and the callers' futures waiting on it."""

    def __init__(self, key: str, deadline: float) -> None:
        self.key = key
        self.deadline = deadline
        self.waiters: list[Future[Grammar]] = []
        self.done = False
        #: handed to the reaper (at once, unless its builder is its only caller: then when
        #: a second caller joins; the builder checks its own deadline)
        self.watched = False
        #: the error that settled the flight (a copy: the flight outlives its request in the
        #: reaper's heap, and must not hold its frames); None when a grammar did
        self.error: BaseException | None = None

    @staticmethod
    def notify(waiters: list[Future[Grammar]], grammar: Grammar | None,
               error: BaseException | None) -> None:
        """Hand every waiting caller the outcome, an error as a fresh copy each (one error
        object raised again and again grows its traceback); cancelled futures are skipped."""
        for fut in waiters:
            if fut.done():  # cancelled by its caller
                continue
            with contextlib.suppress(InvalidStateError):  # cancelled just now
                if error is not None:
                    fut.set_exception(fresh_error(error))
                else:
                    fut.set_result(grammar)  # type: ignore[arg-type]


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
        """Woken only for a deadline earlier than the one it sleeps until: flights share one
        timeout, so a cold compile does not wake a thread that competes with it for the GIL."""
        entry = (flight.deadline + self.GRACE_S, next(self._seq), flight)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammask-reaper",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
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
        tune_fill: bool = True,
    ) -> None:
        """``rank_invariant``: one of several tensor-parallel ranks, which must all end with
        the same grammar for a spec: no fallback is taken on timing (a slow or busy backend),
        only on a refusal or an internal error, which every rank sees alike.

        ``tune_fill``: when another backend enforces every keyword of a JSON schema too, it
        is compiled in the background and both fill a probe walk; the cheaper on this
        machine serves the spec's later requests (``grammask.fillcost``). Off with
        ``rank_invariant``, a forced backend or a ``prefer``ence."""
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
        self._structure: dict[str, int] | None = None  # probe walks' structural tokens
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
        self._memory = CompileCache(self.stats, cache_bytes, negative_ttl_s, max_negative)
        self._inflight: dict[str, _Flight] = {}
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
        """Blocking compile. A hit returns at once (no future, no thread); a miss waits at most
        ``timeout`` s (default ``timeout_s``), then raises ``CompileTimeoutError`` while the
        compile goes on for whoever else waits (its result is cached). A caller that waits out
        the whole deadline builds a small spec on its own thread: only a compile that may run
        long goes to a compile worker (what a deadline can abandon), one thread hop instead of
        two each way; a small spec's bounded compile (``BackendInfo.bounded_compile``) needs
        none. A large spec (``compile_slots.HERE_MAX_CHARS``) builds on the pool, so nothing
        of it (the plan's walk, a disk load) holds this caller past its deadline."""
        spec = self._effective(spec)
        # a large spec builds on the pool (its plan's walk, its compile): this caller then
        # waits at most its deadline whatever runs
        here = (self._disk is None and (timeout is None or timeout >= self.timeout_s)
                and len(spec.source) <= HERE_MAX_CHARS)
        found, fut, flight = self._lookup(spec, here)
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
        """Start compiling now (e.g. at request admission, overlapping the prefill).

        The future is this caller's own: ``cancel()`` on it leaves other callers' alone."""
        spec = self._effective(spec)
        found, fut, flight = self._lookup(spec, here=False)
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

    def _lookup(self, spec: GrammarSpec, here: bool) -> tuple[
            Grammar | BaseException | None, Future[Grammar] | None, _Flight | None]:
        """Under the lock: a hit (the grammar) or a remembered failure (a fresh copy); else
        the caller's future on the flight it joined, or the flight it registered (a miss: the
        caller builds it; with no future when it builds ``here``, on its own thread)."""
        key = spec.key
        with self._lock:
            if self._closed:
                raise CompilerClosedError("the compiler is closed")
            hit = self._memory.get(key)
            if hit is not None:
                self.stats.hits += 1
                _MEMORY_HITS.inc()
                return hit, None, None
            failed = self._memory.failure(key, time.monotonic())
            if failed is not None:
                self.stats.negative_hits += 1
                return fresh_error(failed), None, None
            running = self._inflight.get(key)
            if running is not None:
                self.stats.joined += 1
                fut: Future[Grammar] = Future()
                running.waiters.append(fut)
                watch, running.watched = not running.watched, True
            else:
                self.stats.misses += 1
                _MEMORY_MISSES.inc()
                flight = _Flight(key, time.monotonic() + self.timeout_s)
                mine: Future[Grammar] | None = None if here else Future()
                flight.waiters.extend(() if mine is None else (mine,))
                # a caller that builds on its own thread waits for nobody's deadline but its
                # own, which its build checks: the reaper (a lock, a heap, a wake-up on a
                # cold compile's path) only once someone joins
                flight.watched = mine is not None
                self._inflight[key] = flight
        if running is not None:
            if watch:
                self._reaper.add(running)
            return None, fut, None
        if flight.watched:
            self._reaper.add(flight)
        return None, mine, flight

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        key = self._effective(spec).key
        with self._lock:
            return self._memory.peek(key)

    def route(self, spec: GrammarSpec) -> Route:
        return route(self._effective(spec), prefer=self.prefer)

    def plan(self, spec: GrammarSpec) -> Plan:
        """The attempts a compile of ``spec`` runs, in order (``grammask.router.plan``).

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
        """Cheap validation without compiling for the tokenizer (request admission).

        Walks the plan's attempts (refusals only: an internal error is not the spec's
        fault), so admission refuses exactly what no compile could serve; returns the attempt
        that passed. Raises the routed backend's error when none does."""
        spec = self._effective(spec)
        return self._plans.check(spec, self.plan(spec))

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._memory), "bytes": self._memory.used,
                    "limit_bytes": self.cache_bytes, "inflight": len(self._inflight),
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
        if not isinstance(spec, GrammarSpec):
            raise InvalidSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        if spec.backend is None and self.default_backend is not None:
            return spec.with_backend(self.default_backend)
        return spec

    def _submit(self, spec: GrammarSpec, flight: _Flight) -> None:
        try:
            self._pool.submit(self._build, spec, flight)
        except RuntimeError:  # the pool shut down: close() raced this request
            self._resolve(flight, error=CompilerClosedError("the compiler is closed"))

    def _build_here(self, spec: GrammarSpec, flight: _Flight) -> Grammar:
        """Build a flight on the caller's thread; the caller gets what every waiter of the
        flight got (its own result, or the timeout or close that settled it first)."""
        outcome = self._build(spec, flight, here=True)
        if isinstance(outcome, Grammar):
            return outcome
        raise outcome

    def _resolve(self, flight: _Flight, grammar: Grammar | None = None,
                 error: BaseException | None = None) -> bool:
        """Settle every caller's future of a flight once; False when already settled."""
        with self._lock:
            if flight.done:
                return False
            flight.done = True
            if error is not None:
                flight.error = fresh_error(error)
            if self._inflight.get(flight.key) is flight:
                del self._inflight[flight.key]
            waiters, flight.waiters = flight.waiters, []
        _Flight.notify(waiters, grammar, error)
        return True

    def _expire_overrun(self, flight: _Flight) -> None:
        """A build that ended past its flight's deadline settles it as the reaper would have
        (a flight its builder alone waits on is not the reaper's until someone joins)."""
        if time.monotonic() >= flight.deadline + _Reaper.GRACE_S:
            self._expire(flight)

    def _expire(self, flight: _Flight) -> None:
        """The reaper's call: a flight reached its deadline with its build still going."""
        error = CompileTimeoutError(f"not compiled within {self.timeout_s:.2f} s")
        if self._resolve(flight, error=error):
            with self._lock:
                self.stats.timeouts += 1

    def _build(self, spec: GrammarSpec, flight: _Flight, here: bool = False
               ) -> Grammar | BaseException:
        """Run the plan of a flight and settle it; returns what settled it. ``here``: on the
        caller's thread, which hands the heap trim (when one is due) to the pool rather than
        wait for it."""
        if flight.done:  # expired or closed while queued
            return flight.error or CompilerClosedError("the compiler is closed")
        try:
            grammar = self._plans.run(spec, self.plan(spec), flight.deadline)
        except BaseException as exc:
            self._expire_overrun(flight)
            error = exc if isinstance(exc, CompileFailure) else InternalCompileError(
                f"internal error while compiling: {type(exc).__name__}: {exc}")
            with self._lock:
                self.stats.errors += 1
                if isinstance(error, InternalCompileError):
                    self.stats.internal_errors += 1
                elif isinstance(error, GrammarError):  # only the request's own faults
                    self._memory.remember_failure(spec.key, error, time.monotonic())
            settled = self._resolve(flight, error=error)
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: the caller's
                raise
            return error if settled or flight.error is None else flight.error
        self._expire_overrun(flight)
        with self._lock:
            if not self._closed:
                self._memory.insert(spec.key, grammar)
        settled = self._resolve(flight, grammar=grammar)
        self._tune_later(spec, grammar)
        if not here:
            self._trim()
        elif self._trim_due():
            with contextlib.suppress(RuntimeError):  # the pool shut down: no trim needed
                self._pool.submit(self._trim)
        return grammar if settled or flight.error is None else flight.error

    def _tune_later(self, spec: GrammarSpec, grammar: Grammar) -> None:
        """Start ``_tune`` when another backend enforces every keyword of this JSON schema
        (the route's fallback: set only then) and nothing forced the choice."""
        if (not self.tune_fill or spec.backend is not None or spec.kind != "json_schema"
                or grammar.fallback_from is not None or grammar.from_disk):
            return
        route = self.plan(spec).route
        other = route.fallback
        if other is None or route.backend != grammar.backend or route.lenient:
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to tune
            self._pool.submit(self._tune, spec, grammar, other)

    def _tune(self, spec: GrammarSpec, grammar: Grammar, other: BackendName) -> None:
        """Compile ``other`` (the normal path: its own key, deadline and cache), compare the
        fills on a probe walk, and serve the cheaper for ``spec`` from now on."""
        try:
            rival = self.compile(spec.with_backend(other))
            if rival.unenforced != grammar.unenforced:
                return
            walk = fillcost.probe(grammar, self._structure_tokens(), self.vocab.vocab_size,
                                  seed=int(spec.key[:8], 16))
            result = fillcost.compare(grammar, rival, walk, self.vocab.vocab_size)
        except Exception as exc:  # never the request's concern: it is served already
            log.debug("grammask: fill tuning of %s skipped: %s", spec.describe(), exc)
            return
        moved = result.b_cheaper()
        _FILL_TUNED.labels(routed=grammar.backend,
                           served=other if moved else grammar.backend).inc()
        with self._lock:
            self.stats.fill_tuned += 1
            if not moved or self._closed or self._memory.peek(spec.key) is not grammar:
                return
            self.stats.fill_moved += 1
            title = registry.info(other).title
            served = dataclasses.replace(
                rival, spec=grammar.spec, fallback_from=None,
                reason=f"{grammar.reason}; {title} then measured cheaper to fill here: "
                       f"{result.b_us:.1f} µs a token against {result.a_us:.1f} "
                       f"(a probe walk of {result.tokens} tokens)")
            self._memory.insert(spec.key, served)

    def _structure_tokens(self) -> dict[str, int]:
        """The probe walks' structural tokens of this vocabulary (texts that are one token)."""
        if self._structure is None:
            found = {}
            for text in fillcost.STRUCTURE:
                ids = self.vocab.encode(text)
                if len(ids) == 1:
                    found[text] = ids[0]
            self._structure = found
        return self._structure

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
            wanted = not self._closed and key not in self._memory
        grammar = make() if wanted else None  # (make counts it: only when wanted)
        with self._lock:
            if grammar is None or self._closed or key in self._memory:
                return False
            self._memory.insert(key, grammar)
        self._trim()
        return True
