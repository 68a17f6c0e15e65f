"""The compiles that may serve one row, and the rule tensor-parallel ranks agree by.

``PendingGrammar``: the routed compile (started when the request is added) and, once it is
late, the hedge: the other backend compiling the same JSON schema. ``decide`` turns every
rank's view of a row (``RowView``) into one outcome, the same on every rank.
``firstmask.FirstMasks`` runs the bounded wait over them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import NamedTuple

from ..compile.compiler import Compiler, Grammar
from ..errors import GrammarError
from ..specs.grammar_spec import GrammarSpec

PENDING, READY, FAILED = 0, 1, 2
#: ints per row in an agreement vector: expired, hedged, primary state, hedge state
VIEW = 4


def _state(future: Future[Grammar] | None) -> int:
    if future is None or not future.done():
        return PENDING
    if future.cancelled() or future.exception() is not None:
        return FAILED
    return READY


def hedge_spec(compiler: Compiler, spec: GrammarSpec) -> GrammarSpec | None:
    """The spec forced onto the plan's hedge backend (``compile.router.Plan.hedge``), or None
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
