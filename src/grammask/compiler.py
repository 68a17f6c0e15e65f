"""The compile service: runs the router's plan with bounded parallel compiles, single-flight,
an LRU and one deadline per request.

- A cold compile asks the router once (``grammask.router.plan``) and runs its attempts in
  order, each in its mode and within its share of the time left; nothing here decides which
  backend or which mode (data flows one way: router -> compiler -> backend).

- ``compile_async`` returns at once; the compile starts immediately so it overlaps the prefill.
  Each caller gets a future of its own: cancelling it drops only that caller.
- N concurrent requests for one key share one compile (single-flight).
- Results live in an LRU bounded by (calibrated) bytes; evictions hand memory back to the OS.
  Failures live in a bounded negative cache that expires; only user errors go there.
- Every request has one deadline (``timeout_s`` from submission) covering slot waits, the
  routed backend and its fallbacks; a reaper resolves any request still pending at its deadline.
- A runaway native compile cannot be killed, so it is *abandoned*: its slot is handed back (up
  to ``max_abandoned`` at once per backend; beyond that it keeps the slot, so the CPU spent on
  runaways stays bounded). Each backend has its own slots, so xgrammar runaways never hold up
  llguidance compiles (fallbacks included). A spec that timed out on a backend is not retried
  there until ``negative_ttl_s`` passes, and a runaway that finishes late fills the cache.
- ``disk_cache_dir`` (off by default): xgrammar grammars persist across processes
  (``grammask.diskcache``). On a memory miss the disk is tried inside the request's flight
  (single-flight, and within its deadline) before compiling; a successful compile (a late one
  too) is written by a background thread (``flush_disk_cache`` waits for it).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import ctypes.util
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TypeVar

from . import metrics
from .backends import BackendGrammar, Matcher, get_backend
from .diskcache import DEFAULT_MAX_BYTES, DiskCache
from .errors import (
    CompileFailure,
    CompilerClosedError,
    CompileTimeoutError,
    GrammarError,
    InternalCompileError,
    InvalidSpecError,
    ServerFault,
)
from .router import Attempt, Failure, Plan, Preference, Route, plan, route
from .spec import BackendName, GrammarSpec, backend_name
from .vocab import Vocabulary

log = logging.getLogger("grammask")
T = TypeVar("T")

#: Measured RSS growth per cached grammar = SCALE * the backend's own estimate + BASE bytes
#: (bench/stress.py --calibrate; corpus schemas, Qwen2.5 vocabulary, glibc). xgrammar's
#: ``memory_size_bytes`` misses allocator overhead and the matcher-side structures; the
#: llguidance figure is grammask's own guess (llguidance reports none).
FOOTPRINT: dict[str, tuple[float, int]] = {"xgrammar": (0.57, 180 * 1024),
                                             "guidance": (2.3, 0)}

#: Errors that say nothing about the spec: never cached as the spec's fault, and the other
#: backend is tried.
_INTERNAL = (MemoryError, RecursionError, SystemError, OSError, AssertionError)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled spec: makes matchers, and says which backend serves it and why."""

    spec: GrammarSpec
    backend: BackendName
    reason: str
    unenforced: tuple[str, ...]
    compile_ms: float
    backend_grammar: BackendGrammar = field(repr=False)  #: the backend's own compiled form
    fallback_from: BackendName | None = None
    from_disk: bool = False  #: loaded from the disk cache (compile_ms is the load time)

    def matcher(self) -> Matcher:
        return self.backend_grammar.matcher()

    @property
    def memory_bytes(self) -> int:
        """Estimated process memory this grammar holds (calibrated against measured RSS)."""
        scale, base = FOOTPRINT.get(self.backend, (1.0, 0))
        return int(scale * int(self.backend_grammar.memory_bytes) + base)


@dataclass
class Stats:
    """Counters since the compiler started (read them; do not write)."""

    hits: int = 0
    misses: int = 0
    joined: int = 0
    compiles: dict[str, int] = field(default_factory=lambda: {"xgrammar": 0, "guidance": 0})
    compile_ms: dict[str, float] = field(
        default_factory=lambda: {"xgrammar": 0.0, "guidance": 0.0})
    fallbacks: int = 0
    timeouts: int = 0
    errors: int = 0
    negative_hits: int = 0
    evictions: int = 0
    abandoned: int = 0
    internal_errors: int = 0
    late_results: int = 0
    trims: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_writes: int = 0


def fresh_error(error: BaseException) -> BaseException:
    """A copy without traceback, cause or context: raising a stored error object again and
    again grows its traceback (and keeps every frame alive) on each raise."""
    try:
        twin = copy.copy(error)
    except Exception:  # an exception class that does not copy: a plain one says the same
        twin = (ServerFault if isinstance(error, ServerFault) else GrammarError)(str(error))
    twin.__traceback__ = None
    twin.__cause__ = None
    twin.__context__ = None
    twin.__suppress_context__ = True
    return twin


_libc: ctypes.CDLL | None = None
with contextlib.suppress(OSError, TypeError):
    _name = ctypes.util.find_library("c")
    if _name:
        _candidate = ctypes.CDLL(_name)
        if hasattr(_candidate, "malloc_trim"):
            _libc = _candidate


def trim_heap() -> bool:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``): freed grammars otherwise
    stay in the process as free-list memory. False where the allocator has no such call."""
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


class _Job:
    """One backend call handed to a compile worker."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.keeps_slot = False
        self.on_late: Callable[[object, BaseException | None], None] | None = None
        self.tid = 0  # the worker's native thread id
        self.tasks_before: set[str] = set()  # the process's threads when the job started


_RUNNING: set[_Job] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _finish_running_compiles() -> None:
    """Workers are daemons (idle ones must not block exit), but a native compile torn down
    mid-flight aborts the process: let running ones finish first (bounded). A program that
    must exit at once flushes its output and calls ``os._exit`` (the CLI does)."""
    deadline = time.monotonic() + 120
    with _RUNNING_LOCK:
        jobs = list(_RUNNING)
    for job in jobs:
        job.done.wait(max(0.0, deadline - time.monotonic()))


def running_compiles() -> int:
    """Native compiles still running in this process (abandoned ones included)."""
    with _RUNNING_LOCK:
        return len(_RUNNING)


def _tasks() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: nothing to lower
        return set()


def _deprioritize(job: _Job) -> int:
    """Lower an abandoned compile's CPU priority to nice 19 (Linux: per thread): the worker
    and the threads started since the job began that are not Python's (the backend's own
    compile threads; a compile that started meanwhile on another worker may be caught too,
    and merely runs at low priority while it competes). Runaways then take CPU only when
    nothing else wants it. Returns how many threads were lowered."""
    if not job.tid or not hasattr(os, "setpriority"):
        return 0
    python = {t.native_id for t in threading.enumerate()} - {job.tid}
    targets = {job.tid} | {int(t) for t in _tasks() - job.tasks_before if t.isdigit()}
    lowered = 0
    for tid in targets - python:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            lowered += 1
    return lowered


class _Runner:
    """Runs one backend's native compiles on persistent worker threads with a concurrency bound
    and a deadline. A worker whose job is abandoned finishes it and exits; a new worker is
    started on demand, so capacity survives runaways (up to ``max_abandoned`` of them)."""

    def __init__(self, max_running: int, max_abandoned: int) -> None:
        self._slots = threading.BoundedSemaphore(max_running)
        self._max_abandoned = max_abandoned
        self._abandoned = 0
        self._idle = 0
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @property
    def abandoned(self) -> int:
        return self._abandoned

    def run(self, fn: Callable[[], T], deadline: float, what: str,
            on_late: Callable[[object, BaseException | None], None] | None = None,
            can_fall_back: bool = False, slot_deadline: float | None = None,
            on_abandon: Callable[[_Job], None] | None = None) -> T:
        """``fn()`` on a worker; CompileTimeoutError when it is not done by ``deadline`` (a
        ``time.monotonic`` value; waiting for a slot counts). ``on_late`` gets the outcome of
        a job that finished after its caller gave up. A request that ``can_fall_back`` does
        not queue behind runaways that kept their slots: it goes to its fallback at once;
        ``slot_deadline`` bounds the wait for a slot (default: ``deadline``); ``on_abandon``
        gets the job when the caller gives up on it (later requests may wait on it)."""
        if not self._slots.acquire(blocking=False):
            if can_fall_back and self._abandoned > self._max_abandoned:
                raise CompileTimeoutError(f"every {what} compile slot is held by a runaway")
            budget = min(deadline, slot_deadline or deadline) - time.monotonic()
            if budget <= 0 or not self._slots.acquire(timeout=budget):
                raise CompileTimeoutError(f"no {what} compile slot free before the deadline")
        job = _Job(fn)
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="grammask-compile", daemon=True).start()
        self._jobs.put(job)
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not job.done.is_set():
                    job.abandoned = True
                    job.on_late = on_late
                    self._abandoned += 1
                    if self._abandoned <= self._max_abandoned:
                        self._slots.release()  # a fresh compile may start meanwhile
                    else:
                        job.keeps_slot = True
                    abandoned = True
                else:
                    abandoned = False
            if abandoned:
                _deprioritize(job)
                if on_abandon is not None:
                    on_abandon(job)
                raise CompileTimeoutError(f"{what} compile exceeded its time budget")
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job.tid = threading.get_native_id()
            job.tasks_before = _tasks()
            with _RUNNING_LOCK:
                _RUNNING.add(job)
            try:
                job.value = job.fn()
            except BaseException as exc:  # handed to the caller
                job.error = exc
            with _RUNNING_LOCK:
                _RUNNING.discard(job)
            with self._lock:
                job.done.set()
                if job.abandoned:
                    self._abandoned -= 1
                    if job.keeps_slot:
                        self._slots.release()
            if job.abandoned:
                if job.on_late is not None:
                    try:
                        job.on_late(job.value, job.error)
                    except Exception:  # a late result is a bonus; never kill the worker
                        log.exception("grammask: storing a late compile result failed")
                return  # the caller moved on; a fresh worker replaces this one
            with self._lock:
                self._slots.release()
                self._idle += 1


def _join(job: _Job, deadline: float, what: str) -> BackendGrammar:
    """Wait (until ``deadline``) for a compile an earlier request abandoned."""
    if not job.done.wait(max(0.0, deadline - time.monotonic())):
        raise CompileTimeoutError(f"{what} is still compiling this spec (an earlier "
                                  f"request's compile, past its budget)")
    if job.error is not None:
        raise job.error
    return job.value  # type: ignore[return-value]


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
        self.prefer: Preference = prefer
        self.rank_invariant = rank_invariant
        self.stats = Stats()
        self._runners: dict[str, _Runner] = {
            "xgrammar": _Runner(max_workers, max_abandoned),
            "guidance": _Runner(max_workers, max_abandoned)}
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
        # (key, backend) -> its abandoned compile, still running: later requests wait on it
        # rather than start another runaway
        self._slow: dict[tuple[str, str], _Job] = {}
        self._last_trim = 0.0
        self._trim_pending = False
        self._disk: DiskCache | None = None
        if disk_cache_dir is not None:
            disk = DiskCache(disk_cache_dir, disk_cache_bytes)
            self._disk = disk if disk.enabled else None
        # the backends' tokenizers are built once per vocabulary (seconds, holding the GIL): here,
        # outside every request's deadline
        for name in ("xgrammar", "guidance"):
            if self.default_backend in (None, name):
                self._backend_tokenizer(name)

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
                    "abandoned": sum(r.abandoned for r in self._runners.values())}

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

    def _backend_tokenizer(self, backend: str) -> None:
        _ = self.vocab.xgrammar_info if backend == "xgrammar" else self.vocab.llguidance_tokenizer

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
            grammar = self._compile_routed(spec, flight.deadline)
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

    def _compile_routed(self, spec: GrammarSpec, deadline: float) -> Grammar:
        """Run the router's plan: each attempt in order, within its share of the time left,
        all under the request's one ``deadline``."""
        plan = self.plan(spec)
        steps = plan.attempts
        first = steps[0]
        failures: list[GrammarError | ServerFault] = []
        for i, step in enumerate(steps):
            if failures and _failure_kind(failures[-1]) not in step.after:
                continue
            left = max(0.0, deadline - time.monotonic())
            last = i == len(steps) - 1
            if failures:
                log.warning("grammask: %s on %s failed (%s); trying %s%s", spec.describe(),
                            first.backend, failures[0].message, step.backend,
                            " (lenient)" if step.lenient else "")
            try:
                grammar = self._attempt(
                    spec, step, plan.route.reason,
                    deadline if last else deadline - (1 - step.budget) * left,
                    skip_busy=step.skip_busy and not last,
                    slot_deadline=deadline - (1 - step.slot_budget) * left)
            except CompileFailure as exc:
                failures.append(exc)
                continue
            if not failures:
                return grammar
            with self._lock:
                self.stats.fallbacks += 1
            metrics.FALLBACKS.labels(from_backend=first.backend, to_backend=step.backend,
                                     reason=type(failures[0]).__name__).inc()
            reason = (f"{first.backend} failed ({failures[0].message}); "
                      f"fell back to {step.backend}")
            return Grammar(spec, grammar.backend, reason, grammar.unenforced,
                           grammar.compile_ms, grammar.backend_grammar,
                           fallback_from=first.backend, from_disk=grammar.from_disk)
        raise failures[0]

    def _attempt(self, spec: GrammarSpec, step: Attempt, reason: str, deadline: float,
                 skip_busy: bool = False, slot_deadline: float | None = None) -> Grammar:
        backend = step.backend
        impl = get_backend(backend)
        slow_key = (spec.key, backend)
        with self._lock:
            running = self._slow.get(slow_key)
        self._backend_tokenizer(backend)
        if backend == "xgrammar" and self._disk is not None:
            loaded = self._from_disk(spec, step, reason, deadline)
            if loaded is not None:
                return loaded
        started = time.perf_counter()

        def late(value: object, error: BaseException | None) -> None:
            self._late_result(spec, step, reason, started, value, error)

        def abandoned(job: _Job) -> None:
            with self._lock:  # a job already done has had its late result handled
                if not job.done.is_set():
                    self._slow[slow_key] = job

        try:
            if running is not None:  # an earlier request's compile of it is still going
                backend_grammar: BackendGrammar = _join(running, deadline, backend)
            else:
                backend_grammar = self._runners[backend].run(
                    lambda: impl.compile(spec, self.vocab, lenient=step.lenient),
                    deadline, backend, on_late=late, can_fall_back=skip_busy,
                    slot_deadline=slot_deadline, on_abandon=abandoned)
        except CompileTimeoutError:
            with self._lock:
                self.stats.timeouts += 1
                self.stats.abandoned = sum(r.abandoned for r in self._runners.values())
            _observe(backend, spec, "timeout", started)
            raise
        except GrammarError as exc:
            _observe(backend, spec, "internal" if isinstance(exc.__cause__, _INTERNAL)
                     else "error", started)
            if isinstance(exc.__cause__, _INTERNAL):
                raise InternalCompileError(f"{backend}: internal error: "
                                           f"{type(exc.__cause__).__name__}") from exc
            raise
        except ServerFault:  # an earlier request's compile this one joined failed so
            _observe(backend, spec, "internal", started)
            raise
        except Exception as exc:
            _observe(backend, spec, "internal", started)
            raise InternalCompileError(
                f"{backend}: internal error: {type(exc).__name__}: {exc}") from exc
        _observe(backend, spec, "ok", started)
        elapsed = (time.perf_counter() - started) * 1000
        with self._lock:
            self.stats.compiles[backend] += 1
            self.stats.compile_ms[backend] += elapsed
        self._to_disk(spec, step, backend_grammar, elapsed)
        return self._grammar(spec, step, reason, backend_grammar, elapsed)

    def _from_disk(self, spec: GrammarSpec, step: Attempt, reason: str,
                   deadline: float) -> Grammar | None:
        """A grammar an earlier compile (any process) left on disk. Runs inside the flight
        (joined requests share it) and within the request's deadline: a load never starts
        past it, and the compile that follows a miss gets what is left."""
        disk = self._disk
        if disk is None or time.monotonic() >= deadline:
            return None
        started = time.perf_counter()
        backend_grammar = disk.load_xgrammar(spec, self.vocab, lenient=step.lenient)
        elapsed = (time.perf_counter() - started) * 1000
        with self._lock:
            if backend_grammar is None:
                self.stats.disk_misses += 1
            else:
                self.stats.disk_hits += 1
        metrics.CACHE_REQUESTS.labels(tier="disk",
                                      result="miss" if backend_grammar is None else "hit").inc()
        if backend_grammar is None:
            return None
        log.info("grammask: %s loaded from the disk cache in %.1f ms", spec.describe(),
                 elapsed)
        grammar = self._grammar(spec, step, reason, backend_grammar, elapsed)
        return Grammar(grammar.spec, grammar.backend, grammar.reason, grammar.unenforced,
                       grammar.compile_ms, grammar.backend_grammar, from_disk=True)

    def _to_disk(self, spec: GrammarSpec, step: Attempt, backend_grammar: object,
                 compile_ms: float) -> None:
        """Queue a fresh xgrammar compile for the disk cache (written off the request path)."""
        disk = self._disk
        if disk is None or step.backend != "xgrammar" or self._closed:
            return
        if disk.store_xgrammar(spec, self.vocab, backend_grammar, lenient=step.lenient,
                               compile_ms=compile_ms):
            with self._lock:
                self.stats.disk_writes += 1

    def _grammar(self, spec: GrammarSpec, step: Attempt, reason: str,
                 backend_grammar: BackendGrammar, elapsed: float) -> Grammar:
        backend = step.backend
        unenforced = list(step.unenforced)
        if step.lenient and not unenforced:
            # lenient mode was asked for a formality (unknown format) or as a rescue: report
            # whatever llguidance says it ignored
            unenforced += [f"llguidance: {w}" for w in getattr(backend_grammar, "warnings", [])
                           if "format" not in w.lower()]
        if unenforced:
            metrics.UNENFORCED.labels(backend=backend).inc()
            log.warning("grammask: %s served by %s without enforcing %s", spec.describe(),
                        backend, ", ".join(unenforced))
        log.info("grammask: %s -> %s (%s) in %.1f ms", spec.describe(), backend, reason,
                 elapsed)
        return Grammar(spec, backend, reason, tuple(unenforced), elapsed, backend_grammar)

    def _late_result(self, spec: GrammarSpec, step: Attempt, reason: str, started: float,
                     value: object, error: BaseException | None) -> None:
        """An abandoned compile finished: cache it unless the request was served otherwise,
        so the work is not lost and the spec is no longer treated as a runaway."""
        backend = step.backend
        elapsed = (time.perf_counter() - started) * 1000
        if error is None:  # a runaway's result is what the disk cache is for
            self._to_disk(spec, step, value, elapsed)
        with self._lock:
            self._slow.pop((spec.key, backend), None)
            self.stats.abandoned = sum(r.abandoned for r in self._runners.values())
            if error is not None or self._closed or spec.key in self._cache:
                return
            self.stats.late_results += 1
            self.stats.compiles[backend] += 1
            self.stats.compile_ms[backend] += elapsed
        grammar = self._grammar(spec, step, reason, value, elapsed)  # type: ignore[arg-type]
        with self._lock:
            if not self._closed and spec.key not in self._cache:
                self._insert(spec.key, grammar)
        self._trim()


def _failure_kind(error: GrammarError | ServerFault) -> Failure:
    if isinstance(error, InternalCompileError):
        return "internal"
    return "timeout" if isinstance(error, CompileTimeoutError) else "refused"


def _observe(backend: str, spec: GrammarSpec, outcome: str, started: float) -> None:
    metrics.COMPILE_SECONDS.labels(backend=backend, kind=spec.kind, outcome=outcome).observe(
        time.perf_counter() - started)

