"""Carrying out a router plan: each attempt on its backend's compile slots, the disk cache
around it, fallbacks under one deadline, and what a runaway leaves behind when it finishes.

The plan decides which backend and mode (``grammask.compile.router``); this only runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .. import metrics
from ..backends import BackendGrammar, DiskBackend, Warnings, disk_backend, get_backend, registry
from ..backends.diskcache import DiskCache
from ..errors import (
    CompileFailure,
    CompileTimeoutError,
    GrammarError,
    InternalCompileError,
    ServerFault,
)
from ..specs.grammar_spec import GrammarSpec
from .grammar import Grammar
from .router import Attempt, Failure, Plan
from .slots import Job, Runners, join_abandoned, may_run_here
from .state import ServiceState

log = logging.getLogger("grammask")

#: Errors that say nothing about the spec: never cached as the spec's fault, and the next
#: attempt is tried.
_INTERNAL = (MemoryError, RecursionError, SystemError, OSError, AssertionError)


class PlanRunner:
    """Runs plans for one compile service (its vocabulary, counters and lock)."""

    def __init__(self, state: ServiceState, runners: Runners, disk: DiskCache | None,
                 keep: Callable[[str, Callable[[], Grammar]], bool]) -> None:
        """``keep(key, make)``: the service caches a late result (``make()``) when nobody
        was served otherwise."""
        self._state = state
        self.vocab = state.vocab
        self.stats = state.stats
        self._lock = state.lock
        self._runners = runners
        self._disk = disk
        self._keep = keep
        # (key, backend) -> its abandoned compile, still running: later requests wait on it
        # rather than start another runaway
        self._abandoned: dict[tuple[str, str], Job] = {}

    def run(self, spec: GrammarSpec, plan: Plan, deadline: float) -> Grammar:
        """Run the router's plan: each attempt in order, within its share of the time left,
        all under the request's one ``deadline``."""
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
            metrics.fallbacks(first.backend, step.backend, type(failures[0]).__name__).inc()
            reason = (f"{first.backend} failed ({failures[0].message}); "
                      f"fell back to {step.backend}")
            return Grammar(spec, grammar.backend, reason, grammar.unenforced,
                           grammar.compile_ms, grammar.backend_grammar,
                           fallback_from=first.backend, from_disk=grammar.from_disk)
        raise failures[0]

    def check(self, spec: GrammarSpec, plan: Plan) -> Attempt:
        """The first attempt whose backend's cheap check passes (refusals only: an internal
        error is not the spec's fault); the first refusal is raised when none does."""
        first: GrammarError | None = None
        for step in plan.attempts:
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

    def _attempt(self, spec: GrammarSpec, step: Attempt, reason: str, deadline: float,
                 skip_busy: bool = False, slot_deadline: float | None = None) -> Grammar:
        backend = step.backend
        impl = get_backend(backend)
        abandoned_key = (spec.key, backend)
        with self._lock:
            running = self._abandoned.get(abandoned_key)
        impl.prepare(self.vocab)
        codec = disk_backend(backend) if self._disk is not None else None
        if codec is not None:
            loaded = self._from_disk(codec, spec, step, reason, deadline)
            if loaded is not None:
                return loaded
        started = time.perf_counter()

        def late(value: object, error: BaseException | None) -> None:
            self._late_result(spec, step, reason, started, value, error)

        def abandoned(job: Job) -> None:
            with self._lock:  # a job already done has had its late result handled
                if not job.done.is_set():
                    self._abandoned[abandoned_key] = job

        try:
            if running is not None:  # an earlier request's compile of it is still going
                backend_grammar: BackendGrammar = join_abandoned(running, deadline, backend)
            elif registry.info(backend).bounded_compile and may_run_here(
                    len(spec.source), deadline - time.monotonic()):
                # bounded and small: sure to end well within the deadline, so no hand-off (a
                # large bounded compile may still take seconds: a worker's, abandonable)
                backend_grammar = self._runners[backend].run_here(
                    lambda: impl.compile(spec, self.vocab, lenient=step.lenient),
                    deadline, backend, can_fall_back=skip_busy, slot_deadline=slot_deadline)
                # (one that ends past the request's deadline serves no one who gave up: the
                # flight told them at the deadline; it is cached for the next request)
            else:
                backend_grammar = self._runners[backend].run(
                    lambda: impl.compile(spec, self.vocab, lenient=step.lenient),
                    deadline, backend, on_late=late, can_fall_back=skip_busy,
                    slot_deadline=slot_deadline, on_abandon=abandoned)
        except CompileTimeoutError:
            with self._lock:
                self.stats.timeouts += 1
                self.stats.abandoned = self._runners.abandoned()
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
            self.stats.compiles[backend] = self.stats.compiles.get(backend, 0) + 1
            self.stats.compile_ms[backend] = self.stats.compile_ms.get(backend, 0) + elapsed
        self._to_disk(spec, step, backend_grammar, elapsed)
        return self._grammar(spec, step, reason, backend_grammar, elapsed)

    def _from_disk(self, codec: DiskBackend, spec: GrammarSpec, step: Attempt, reason: str,
                   deadline: float) -> Grammar | None:
        """A grammar an earlier compile (any process) left on disk. Runs inside the flight
        (joined requests share it) and within the request's deadline: a load never starts
        past it, and the compile that follows a miss gets what is left."""
        disk = self._disk
        if disk is None or time.monotonic() >= deadline:
            return None
        started = time.perf_counter()
        backend_grammar = codec.load_compiled(disk, spec, self.vocab, lenient=step.lenient)
        elapsed = (time.perf_counter() - started) * 1000
        with self._lock:
            if backend_grammar is None:
                self.stats.disk_misses += 1
            else:
                self.stats.disk_hits += 1
        metrics.cache_requests("disk", "miss" if backend_grammar is None else "hit").inc()
        if backend_grammar is None:
            return None
        log.info("grammask: %s loaded from the disk cache in %.1f ms", spec.describe(),
                 elapsed)
        grammar = self._grammar(spec, step, reason, backend_grammar, elapsed)
        return Grammar(grammar.spec, grammar.backend, grammar.reason, grammar.unenforced,
                       grammar.compile_ms, grammar.backend_grammar, from_disk=True)

    def _to_disk(self, spec: GrammarSpec, step: Attempt, backend_grammar: BackendGrammar,
                 compile_ms: float) -> None:
        """Queue a fresh compile for the disk cache (written off the request path), when its
        backend declares the disk capability."""
        disk = self._disk
        codec = None if disk is None or self._state.closed else disk_backend(step.backend)
        if disk is None or codec is None:
            return
        if codec.store_compiled(disk, spec, self.vocab, backend_grammar, lenient=step.lenient,
                                compile_ms=compile_ms):
            with self._lock:
                self.stats.disk_writes += 1

    def _grammar(self, spec: GrammarSpec, step: Attempt, reason: str,
                 backend_grammar: BackendGrammar, elapsed: float) -> Grammar:
        backend = step.backend
        unenforced = list(step.unenforced)
        if step.lenient and not unenforced:
            # lenient mode was asked for a formality (unknown format) or as a rescue: report
            # whatever the backend says it ignored
            title = registry.info(backend).title
            said = backend_grammar.warnings() if isinstance(backend_grammar, Warnings) else []
            unenforced += [f"{title}: {w}" for w in said if "format" not in w.lower()]
        if unenforced:
            metrics.unenforced(backend).inc()
            log.warning("grammask: %s served by %s without enforcing %s", spec.describe(),
                        backend, ", ".join(unenforced))
        if log.isEnabledFor(logging.INFO):  # describe() slices the source: only when logged
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
            self._to_disk(spec, step, value, elapsed)  # type: ignore[arg-type]
        with self._lock:
            self._abandoned.pop((spec.key, backend), None)
            self.stats.abandoned = self._runners.abandoned()
        if error is not None:
            return

        def made() -> Grammar:
            with self._lock:
                self.stats.late_results += 1
                self.stats.compiles[backend] = self.stats.compiles.get(backend, 0) + 1
                self.stats.compile_ms[backend] = self.stats.compile_ms.get(backend, 0) + elapsed
            return self._grammar(spec, step, reason, value, elapsed)  # type: ignore[arg-type]

        self._keep(spec.key, made)


def _failure_kind(error: GrammarError | ServerFault) -> Failure:
    if isinstance(error, InternalCompileError):
        return "internal"
    return "timeout" if isinstance(error, CompileTimeoutError) else "refused"


def _observe(backend: str, spec: GrammarSpec, outcome: str, started: float) -> None:
    metrics.compile_seconds(backend, spec.kind, outcome).observe(time.perf_counter() - started)

