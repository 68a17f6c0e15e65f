"""The compile service: routing, bounded parallel compiles, single-flight, LRU and timeouts.

- ``compile_async`` returns at once; the compile starts immediately so it overlaps the prefill.
- N concurrent requests for one key share one compile (single-flight).
- Results live in an LRU bounded by bytes; failures in a negative cache that expires.
- Every engine call runs under a time budget. A runaway native compile cannot be killed, so it
  is *abandoned*: its slot is handed back (up to ``max_abandoned`` at once) and the request
  falls back to the other engine when that one can serve the spec, else gets a
  ``CompileTimeoutError``. Beyond ``max_abandoned`` the runaway keeps its slot, so the CPU
  spent on runaways stays bounded.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from .backends import CompiledGrammar, Matcher, get_backend
from .errors import CompileTimeoutError, GrammarError, InvalidSpecError
from .router import Preference, Route, route
from .spec import BackendName, GrammarSpec
from .vocab import Vocabulary

log = logging.getLogger("grammask")
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled spec: makes matchers, and says which engine serves it and why."""

    spec: GrammarSpec
    backend: BackendName
    reason: str
    unenforced: tuple[str, ...]
    compile_ms: float
    compiled: CompiledGrammar = field(repr=False)
    fallback_from: BackendName | None = None

    def matcher(self) -> Matcher:
        return self.compiled.matcher()

    @property
    def memory_bytes(self) -> int:
        return int(self.compiled.memory_bytes)


@dataclass
class Stats:
    """Counters since the engine started (read them; do not write)."""

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


class _Job:
    """One engine call handed to a compile worker."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.keeps_slot = False


_RUNNING: set[_Job] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _finish_running_compiles() -> None:
    """Workers are daemons (idle ones must not block exit), but a native compile torn down
    mid-flight aborts the process: let running ones finish first (bounded)."""
    deadline = time.monotonic() + 120
    with _RUNNING_LOCK:
        jobs = list(_RUNNING)
    for job in jobs:
        job.done.wait(max(0.0, deadline - time.monotonic()))


class _Runner:
    """Runs native compiles on persistent worker threads with a concurrency bound and a
    deadline. A worker whose job is abandoned finishes it and exits; a new worker is started
    on demand, so capacity survives runaways (up to ``max_abandoned`` of them at once)."""

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

    def run(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        start = time.monotonic()
        if not self._slots.acquire(timeout=timeout):
            raise CompileTimeoutError(f"no compile slot free within {timeout:.1f} s for {what}")
        job = _Job(fn)
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="grammask-compile", daemon=True).start()
        self._jobs.put(job)
        if not job.done.wait(max(0.0, timeout - (time.monotonic() - start))):
            with self._lock:
                if not job.done.is_set():
                    job.abandoned = True
                    self._abandoned += 1
                    if self._abandoned <= self._max_abandoned:
                        self._slots.release()  # a fresh compile may start meanwhile
                    else:
                        job.keeps_slot = True
                    raise CompileTimeoutError(f"{what} compile exceeded {timeout:.1f} s")
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
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
                    return  # the caller moved on; a fresh worker replaces this one
                self._slots.release()
                self._idle += 1


class Engine:
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
    ) -> None:
        if backend not in (None, "auto", "xgrammar", "guidance", "llguidance"):
            raise InvalidSpecError(f"backend must be auto, xgrammar or guidance, got {backend!r}")
        if timeout_s <= 0 or max_workers < 1 or cache_bytes < 0:
            raise InvalidSpecError("timeout_s and max_workers must be positive")
        self.vocab = vocab
        self.default_backend: BackendName | None = (
            None if backend in (None, "auto") else
            "guidance" if backend == "llguidance" else backend)  # type: ignore[assignment]
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.negative_ttl_s = negative_ttl_s
        self.prefer: Preference = prefer
        self.stats = Stats()
        self._runner = _Runner(max_workers, max_abandoned)
        self._pool = ThreadPoolExecutor(max_workers=max(8, 4 * max_workers),
                                        thread_name_prefix="grammask-route")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_used = 0
        self._inflight: dict[str, Future[Grammar]] = {}
        self._failed: dict[str, tuple[float, GrammarError]] = {}

    # ----------------------------------------------------------------------- public
    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> Grammar:
        """Blocking compile. A cache hit returns at once; a miss is routed and compiled on the
        calling thread (the engine call itself still runs under the compile deadline)."""
        if isinstance(spec, GrammarSpec):
            spec = self._effective(spec)
            with self._lock:
                hit = self._cache.get(spec.key)
                if hit is not None:
                    self._cache.move_to_end(spec.key)
                    self.stats.hits += 1
                    return hit
        fut, build = self._lookup(spec)
        if build is not None:
            self._build(build, fut)
        return fut.result(timeout)

    def compile_async(self, spec: GrammarSpec) -> Future[Grammar]:
        """Start compiling now (e.g. at request admission, overlapping the prefill)."""
        fut, build = self._lookup(spec)
        if build is not None:
            self._pool.submit(self._build, build, fut)
        return fut

    def _lookup(self, spec: GrammarSpec) -> tuple[Future[Grammar], GrammarSpec | None]:
        """The request's future, and the effective spec when the caller must build it (a
        miss: the future is already registered in flight, so concurrent requests join it)."""
        if not isinstance(spec, GrammarSpec):
            raise InvalidSpecError(f"expected a GrammarSpec, got {type(spec).__name__}")
        spec = self._effective(spec)
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                done: Future[Grammar] = Future()
                done.set_result(hit)
                return done, None
            failed = self._failed.get(key)
            if failed is not None:
                if failed[0] > time.monotonic():
                    self.stats.negative_hits += 1
                    err: Future[Grammar] = Future()
                    err.set_exception(failed[1])
                    return err, None
                del self._failed[key]
            running = self._inflight.get(key)
            if running is not None:
                self.stats.joined += 1
                return running, None
            self.stats.misses += 1
            fut: Future[Grammar] = Future()
            self._inflight[key] = fut
        return fut, spec

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        with self._lock:
            return self._cache.get(self._effective(spec).key)

    def route(self, spec: GrammarSpec) -> Route:
        return route(self._effective(spec), prefer=self.prefer)

    def check(self, spec: GrammarSpec) -> Route:
        """Cheap validation without compiling for the tokenizer (request admission).

        Walks the same attempts as a compile (the route in its mode, then its fallbacks), so
        admission refuses exactly what no compile could serve; returns the attempt that
        passed. Raises the routed engine's error when none does."""
        spec = self._effective(spec)
        decision = self.route(spec)
        try:
            get_backend(decision.backend).check(spec, lenient=decision.lenient)
            return decision
        except GrammarError as first:
            for fallback in self._fallbacks(spec, decision):
                try:
                    get_backend(fallback.backend).check(spec, lenient=fallback.lenient)
                except GrammarError:
                    continue
                return fallback
            raise first from None

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._cache), "bytes": self._cache_used,
                    "limit_bytes": self.cache_bytes, "inflight": len(self._inflight),
                    "negative": len(self._failed), "abandoned": self._runner.abandoned}

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._failed.clear()
            self._cache_used = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------- internals
    def _effective(self, spec: GrammarSpec) -> GrammarSpec:
        if spec.backend is None and self.default_backend is not None:
            return spec.with_backend(self.default_backend)
        return spec

    def _build(self, spec: GrammarSpec, fut: Future[Grammar]) -> None:
        try:
            grammar = self._compile_routed(spec)
        except BaseException as exc:
            error = exc if isinstance(exc, GrammarError) else GrammarError(
                f"internal error while compiling: {type(exc).__name__}: {exc}")
            with self._lock:
                self.stats.errors += 1
                self._inflight.pop(spec.key, None)
                if not isinstance(error, CompileTimeoutError):
                    self._failed[spec.key] = (time.monotonic() + self.negative_ttl_s, error)
            fut.set_exception(error)
            return
        with self._lock:
            self._inflight.pop(spec.key, None)
            self._insert(spec.key, grammar)
        fut.set_result(grammar)

    def _insert(self, key: str, grammar: Grammar) -> None:
        size = grammar.memory_bytes
        if size > self.cache_bytes:
            return
        self._cache[key] = grammar
        self._cache_used += size
        while self._cache_used > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_used -= old.memory_bytes
            self.stats.evictions += 1

    def _compile_routed(self, spec: GrammarSpec) -> Grammar:
        decision = route(spec, prefer=self.prefer)
        try:
            return self._attempt(spec, decision.backend, decision)
        except GrammarError as first:
            for fallback in self._fallbacks(spec, decision):
                log.warning("grammask: %s on %s failed (%s); trying %s%s", spec.describe(),
                            decision.backend, first.message, fallback.backend,
                            " (lenient)" if fallback.lenient else "")
                try:
                    grammar = self._attempt(spec, fallback.backend, fallback)
                except GrammarError:
                    continue
                with self._lock:
                    self.stats.fallbacks += 1
                reason = (f"{decision.backend} failed ({first.message}); "
                          f"fell back to {fallback.backend}")
                return Grammar(spec, grammar.backend, reason, grammar.unenforced,
                               grammar.compile_ms, grammar.compiled,
                               fallback_from=decision.backend)
            raise

    def _fallbacks(self, spec: GrammarSpec, decision: Route) -> list[Route]:
        """What may still serve a spec its routed engine refused, best first.

        Order: the route's own fallback (the other engine enforces everything too); llguidance
        in lenient mode (e.g. overlapping oneOf); the other engine with its gaps listed. Strict
        specs never fall back to an engine with gaps; forced backends never fall back.
        """
        if spec.backend is not None:
            return []
        out: list[Route] = []
        if decision.fallback is not None:
            out.append(Route(decision.fallback, "fallback", unenforced=decision.unenforced))
        if spec.kind == "json_schema":
            if decision.backend == "guidance" and not decision.lenient:
                out.append(Route("guidance", "fallback", unenforced=decision.unenforced,
                                 lenient=True))
            other: BackendName = "xgrammar" if decision.backend == "guidance" else "guidance"
            if all(r.backend != other for r in out):
                gaps = route(spec.with_backend(other)).unenforced
                if not (spec.strict and gaps):
                    out.append(Route(other, "fallback", unenforced=gaps,
                                     lenient=other == "guidance" and bool(gaps)))
        return out

    def _attempt(self, spec: GrammarSpec, backend: BackendName, decision: Route) -> Grammar:
        engine = get_backend(backend)
        # engine tokenizers are built once per vocabulary, outside the compile budget
        _ = self.vocab.xgrammar_info if backend == "xgrammar" else self.vocab.llguidance_tokenizer
        started = time.perf_counter()
        try:
            compiled = self._runner.run(
                lambda: engine.compile(spec, self.vocab, lenient=decision.lenient),
                self.timeout_s, backend)
        except CompileTimeoutError:
            with self._lock:
                self.stats.timeouts += 1
                self.stats.abandoned = self._runner.abandoned
            raise
        elapsed = (time.perf_counter() - started) * 1000
        with self._lock:
            self.stats.compiles[backend] += 1
            self.stats.compile_ms[backend] += elapsed
        unenforced = list(decision.unenforced)
        if decision.lenient and not unenforced:
            # lenient mode was asked for a formality (unknown format) or as a rescue: report
            # whatever llguidance says it ignored
            unenforced += [f"llguidance: {w}" for w in getattr(compiled, "warnings", [])
                           if "format" not in w.lower()]
        if unenforced:
            log.warning("grammask: %s served by %s without enforcing %s", spec.describe(),
                        backend, ", ".join(unenforced))
        log.info("grammask: %s -> %s (%s) in %.1f ms", spec.describe(), backend,
                 decision.reason, elapsed)
        return Grammar(spec, backend, decision.reason, tuple(unenforced), elapsed, compiled)
