"""A row's first mask: bounded, hedged and agreed across ranks.

A logits processor cannot defer a request the way vLLM's scheduler does: when a row's grammar
is not compiled at its first mask, the whole batch waits. So the wait is bounded and hedged:

- The routed backend's compile starts when the request is added (overlapping its prefill).
- ``hedge_s`` after that, if it is still running and the other backend can serve the spec (a
  JSON schema that was not forced onto one backend and is not strict about gaps the other
  backend has), the other backend compiles it too; the first one ready serves the row, with
  that backend's gaps in ``unenforced``. The loser keeps compiling into the cache.
- ``wait_s`` after the first mask was needed, a row with no grammar goes into the error state
  alone; its compile finishes in the background for the next request with that spec.
- With tensor parallelism each rank shares its view (``Agreement``) and ``decide`` turns the
  gathered views into one outcome, identical on every rank.

``FirstMasks`` runs it: it starts each row's compile (``pending``) and, on the fill thread,
gives the rows that need a mask now their grammar (``attach_all``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from . import metrics
from .agreement import Agreement
from .compiler import Compiler, Grammar
from .errors import GrammarError
from .spec import GrammarSpec

PENDING, READY, FAILED = 0, 1, 2
#: ints per row in an agreement vector: expired, hedged, primary state, hedge state
VIEW = 4
#: pending states kept for grammars given to ``pending`` (``FirstMasks._ready``)
READY_GRAMMARS = 256


def _state(future: Future[Grammar] | None) -> int:
    if future is None or not future.done():
        return PENDING
    if future.cancelled() or future.exception() is not None:
        return FAILED
    return READY


def hedge_spec(compiler: Compiler, spec: GrammarSpec) -> GrammarSpec | None:
    """The spec forced onto the plan's hedge backend (``grammask.router.Plan.hedge``), or None
    when the other backend may not serve it."""
    hedge = compiler.plan(spec).hedge
    return None if hedge is None else spec.with_backend(hedge.backend)


Starter = Callable[[], Future[Grammar]]


class PendingGrammar:
    """The compiles that may serve one row: the routed one and, once started, the hedge.

    ``hedge`` says how to start the hedge (None: the row cannot hedge). It is asked only when
    a row's grammar is late, so the common case (ready in time) never routes the spec twice
    on the host's thread."""

    def __init__(self, primary: Future[Grammar], hedge: Callable[[], Starter | None] | None,
                 *, hedge_s: float, submitted: float | None = None,
                 ready: Grammar | None = None) -> None:
        self.primary = primary
        #: the grammar, when it was at hand from the start (``primary`` is then its done
        #: future and there is no hedge): a row attaches it without asking the futures
        self.ready = ready
        self.alternate: Future[Grammar] | None = None
        self._resolve = hedge
        self._starter: Starter | None = None
        self.hedge_at = (time.monotonic() if submitted is None else submitted) + hedge_s

    @property
    def can_hedge(self) -> bool:
        return self._start_alternate is not None

    @property
    def _start_alternate(self) -> Starter | None:
        if self._resolve is not None:
            resolve, self._resolve = self._resolve, None
            self._starter = resolve()
        return self._starter

    @property
    def hedged(self) -> bool:
        return self.alternate is not None

    def start_hedge(self) -> None:
        if self.alternate is None and self._start_alternate is not None:
            try:
                self.alternate = self._start_alternate()
            except Exception as exc:  # a closed compiler: a failed hedge, not an error here
                self.alternate = Future()
                self.alternate.set_exception(exc)

    def tick(self, now: float) -> None:
        """Start the hedge when it is due (the routed compile is late or failed)."""
        if self.alternate is None and (
                now >= self.hedge_at or _state(self.primary) == FAILED) and self.can_hedge:
            self.start_hedge()

    def view(self, expired: bool) -> RowView:
        return RowView(int(expired), int(self.hedged), _state(self.primary),
                       _state(self.alternate))

    def futures(self) -> list[Future[Grammar]]:
        return [f for f in (self.primary, self.alternate) if f is not None and not f.done()]

    def attempt(self, index: int) -> Future[Grammar]:
        future = self.primary if index == 0 else self.alternate
        assert future is not None
        return future

    def failure(self) -> tuple[str, str]:
        """Why the row has no grammar, and whose fault it is: ``compile`` (the request's own
        grammar was refused: a ``GrammarError``) or ``server`` (a timeout, an internal
        failure, another rank's)."""
        for future in (self.primary, self.alternate):
            if future is not None and future.done() and not future.cancelled():
                exc = future.exception()
                if isinstance(exc, GrammarError):
                    return str(exc), "compile"
                if exc is not None:
                    return f"{type(exc).__name__}: {exc}", "server"
        return "failed on another tensor-parallel rank", "server"


class RowView(NamedTuple):
    """One rank's view of one row, as it travels between ranks (``VIEW`` ints)."""

    expired: int  # its wait_s ran out on this rank
    hedged: int  # the other backend's compile was started
    primary: int  # state of the routed compile (PENDING / READY / FAILED)
    alternate: int  # state of the hedge


def row_views(gathered: Sequence[Sequence[int]], row: int) -> list[RowView]:
    """Every rank's view of the ``row``-th row of a gather (rows of ``VIEW`` ints each)."""
    return [RowView(*view[row * VIEW:(row + 1) * VIEW]) for view in gathered]


@dataclass(frozen=True)
class Decision:
    """What every rank does with one row: use attempt ``use``, ``fail``, ``hedge`` or wait."""

    use: int | None = None
    fail: str | None = None
    hedge: bool = False


def decide(can_hedge: bool, views: Sequence[Sequence[int]]) -> Decision:
    """One row's outcome from every rank's view (a pure function: same on every rank)."""
    rows = [RowView(*v) for v in views]
    if all(v.primary == READY for v in rows):
        return Decision(use=0)
    if all(v.alternate == READY for v in rows):
        return Decision(use=1)
    primary_dead = any(v.primary == FAILED for v in rows)
    hedge_dead = not can_hedge or any(v.alternate == FAILED for v in rows)
    if primary_dead and hedge_dead:
        return Decision(fail="compile")
    if any(v.expired for v in rows):
        return Decision(fail="late")
    if can_hedge and not all(v.hedged for v in rows) and (
            primary_dead or any(v.hedged for v in rows)):
        return Decision(hedge=True)
    return Decision()


def wait_for_change(pending: Sequence[PendingGrammar], until: float, *,
                    poll_s: float | None) -> None:
    """Sleep until a compile finishes or ``until``; ``poll_s`` caps it (other ranks' views
    change without our futures finishing)."""
    timeout = max(0.0, until - time.monotonic())
    if poll_s is not None:
        timeout = min(timeout, poll_s)
    futures = [f for p in pending for f in p.futures()]
    if futures:
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
    elif timeout > 0:
        time.sleep(timeout)


class Waiting(Protocol):
    """A row as the first-mask loop sees it (``rows.Row``)."""

    pending: PendingGrammar
    need_since: float | None  # when its first mask was needed (set by ``attach_all``)

    def fail(self, message: str, cause: str = ...) -> None: ...

    def attach(self, grammar: Grammar) -> None: ...


class FirstMasks:
    """Rows' first masks: each row's compile, and the bounded, hedged, agreed wait for it.

    ``wait_s``: the longest a step waits for a row's grammar at its first mask (the batch
    stalls meanwhile); ``hedge_s``: when the other backend starts compiling a late spec;
    ``agreement``: how tensor-parallel ranks agree on those timing outcomes."""

    def __init__(self, compiler: Compiler, *, wait_s: float, hedge_s: float,
                 agreement: Agreement) -> None:
        self.compiler = compiler
        self.wait_s = wait_s
        self.hedge_s = hedge_s
        self.agreement = agreement
        self._ready_rows: dict[int, tuple[Grammar, PendingGrammar]] = {}  # ``_ready``'s

    def pending(self, spec: GrammarSpec,
                grammar: Grammar | Future[Grammar] | None) -> PendingGrammar:
        """The compiles that may serve a new row: ``grammar`` (compiled, or a future of one)
        or the routed compile, started now; the hedge only when it is late."""
        if isinstance(grammar, Grammar):
            return self._ready(grammar)
        compiler = self.compiler
        if isinstance(grammar, Future):
            primary = grammar
        else:
            try:
                primary = compiler.compile_async(spec)
            except Exception as exc:  # a closed compiler or a bad spec: an errored row
                primary = Future()
                primary.set_exception(exc)

        def hedge() -> Starter | None:
            try:
                other = hedge_spec(compiler, spec)
            except Exception:  # routing refused the spec: its compile reports why
                return None
            return None if other is None else (lambda: compiler.compile_async(other))

        return PendingGrammar(primary, hedge, hedge_s=self.hedge_s)

    def _ready(self, grammar: Grammar) -> PendingGrammar:
        """The pending state of a row whose grammar is at hand, one per grammar: it never
        hedges and its future is done, so nothing in it changes and rows of one request
        after another share it (adding such a row makes no future, lock or condition on the
        host's thread). Bounded: the oldest go first; an entry holds its grammar, so its
        ``id`` is not reused meanwhile."""
        ready = self._ready_rows
        entry = ready.get(id(grammar))
        if entry is not None:
            return entry[1]
        done: Future[Grammar] = Future()
        done.set_result(grammar)
        pending = PendingGrammar(done, None, hedge_s=self.hedge_s, ready=grammar)
        if len(ready) >= READY_GRAMMARS:
            del ready[next(iter(ready))]
        ready[id(grammar)] = (grammar, pending)
        return pending

    def attach_all(self, rows: Sequence[Waiting]) -> None:
        """Give each row its grammar: wait (bounded by ``wait_s``, hedged), agreed by ranks.

        Every rank calls it with the same rows (errors and gates follow the shared sampled
        tokens), so every rank gathers the same number of times."""
        wait_s = self.wait_s
        now = time.monotonic()
        for r in rows:
            if r.need_since is None:
                r.need_since = now
        if self.agreement.world_size == 1:
            rows = _attach_ready(rows, now)
        while rows:
            now = time.monotonic()
            views: list[int] = []
            for r in rows:
                r.pending.tick(now)
                assert r.need_since is not None
                views += r.pending.view(now >= r.need_since + wait_s)
            try:
                gathered = self.agreement.gather(views)
            except Exception as exc:  # a lost peer: these rows cannot be agreed on
                for r in rows:
                    r.fail(f"ranks could not agree on the grammar: {exc}", cause="agreement")
                return
            waiting = []
            for i, r in enumerate(rows):
                ranks = row_views(gathered, i)
                # a grammar ready on every rank needs no hedge: do not route its spec again
                ready = all(v.primary == READY for v in ranks)
                decision = decide(not ready and r.pending.can_hedge, ranks)
                if decision.fail is not None or decision.use is not None:
                    outcome = ("hedge" if decision.use == 1 else "ready"
                               if decision.use == 0 else decision.fail or "failed")
                    metrics.FIRST_MASK_WAIT.labels(outcome=outcome).observe(
                        now - (r.need_since or now))
                    if r.pending.hedged and decision.use is not None:
                        metrics.HEDGES.labels(
                            served_by="hedge" if decision.use else "routed").inc()
                if decision.use is not None:
                    r.attach(r.pending.attempt(decision.use).result())
                elif decision.fail == "late":
                    r.fail(f"grammar not compiled within wait_s={wait_s:g} s of its "
                           "first mask (it goes on compiling for the cache)", cause="late")
                elif decision.fail is not None:
                    why, cause = r.pending.failure()
                    r.fail(f"grammar failed to compile: {why}", cause=cause)
                else:
                    if decision.hedge:
                        r.pending.start_hedge()
                    waiting.append(r)
            rows = waiting
            if rows:
                until = min(min(r.need_since or now for r in rows) + wait_s,
                            min(r.pending.hedge_at if r.pending.can_hedge and
                                not r.pending.hedged else float("inf") for r in rows))
                wait_for_change([r.pending for r in rows], until,
                                poll_s=None if self.agreement.world_size == 1 else 0.002)


def _attach_ready(rows: Sequence[Waiting], now: float) -> list[Waiting]:
    """One rank: rows whose grammar was at hand from the start attach it, as ``decide``
    would have them (``use=0``), without views or futures (a step that starts many requests
    pays microseconds a row for them on the fill thread); the rest are returned."""
    waiting = []
    observe = None
    for r in rows:
        grammar = r.pending.ready
        if grammar is None:
            waiting.append(r)
            continue
        if observe is None:
            observe = metrics.FIRST_MASK_WAIT.labels(outcome="ready").observe
        observe(now - (r.need_since or now))
        r.attach(grammar)
    return waiting
