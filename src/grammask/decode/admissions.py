"""Requests added to the batch, made into rows by the next fill job instead of on the host.

A host adds new requests on its model runner's thread, right before the forward (vLLM's
runners: ``update_state`` / ``add_request``). Making a row there (the request, its pending
compile, its thinking gate, and giving the previous occupant's matcher back) costs a few
microseconds a request on the forward's critical path, and a large batch of short requests
starts many of them a step (docs/benchmarks.md, Figures: decode host path). Here an add is
one dict entry on the host. The next fill job makes the rows on the fill thread, while the
forward runs, and releases the rows that left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

from ..compile.compiler import Grammar
from ..specs.grammar_spec import GrammarSpec
from ..specs.request import ConstraintRequest
from .rows import Row


class Admission(NamedTuple):
    """A request for a row: the request (None: the row stays unconstrained), its grammar
    (compiled, a future of one, or None to compile now) and ``host_masks``
    (``BatchProcessor.add``)."""

    request: ConstraintRequest | GrammarSpec | None
    grammar: Grammar | Future[Grammar] | None = None
    host_masks: bool = False


#: what a queued add holds: the admission, or how to make it (``BatchProcessor.add_later``)
Resolve = Admission | Callable[[], Admission]


class Queued(NamedTuple):
    resolve: Resolve
    prompt_ids: Sequence[int]
    output_ids: list[int] | None


#: makes a queued add's row (None: unconstrained); contains every failure in the row
MakeRow = Callable[[Queued], Row | None]


class Admissions:
    """Adds not yet made into rows, and rows that left the batch not yet released.

    The host thread owns ``queued`` and ``retired`` until ``hand_over`` gives both to a
    fill job; ``admit`` (on the fill thread, or on the host's when it needs a row at once)
    then makes the rows into the table."""

    def __init__(self, make: MakeRow) -> None:
        self._make = make
        self.queued: dict[int, Queued] = {}
        self.retired: list[Row] = []

    def drop(self, row: int) -> Queued | None:
        return self.queued.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        entry = self.queued.pop(src, None)
        self.queued.pop(dst, None)
        if entry is not None:
            self.queued[dst] = entry

    def swap(self, a: int, b: int) -> None:
        ea, eb = self.queued.pop(a, None), self.queued.pop(b, None)
        if ea is not None:
            self.queued[b] = ea
        if eb is not None:
            self.queued[a] = eb

    def hand_over(self) -> tuple[dict[int, Queued], list[Row]] | None:
        """The queued adds and retired rows, for one fill job (None: nothing to do);
        the host starts new ones."""
        if not self.queued and not self.retired:
            return None
        handed = self.queued, self.retired
        self.queued, self.retired = {}, []
        return handed

    def admit(self, table: dict[int, Row], handed: tuple[dict[int, Queued], list[Row]]
              ) -> None:
        """Release the retired rows' matchers, then make the queued rows into ``table``
        (in the order they were added)."""
        queued, retired = handed
        for r in retired:
            r.release()
        make = self._make
        for row, entry in queued.items():
            made = make(entry)
            if made is not None:
                table[row] = made

    def admit_now(self, table: dict[int, Row]) -> None:
        """Make every queued row now, on the calling (host) thread: a host asks about a
        row, or masks it, before a fill job made it."""
        handed = self.hand_over()
        if handed is not None:
            self.admit(table, handed)

    def close(self) -> None:
        """Release what is left (the processor closes)."""
        for r in self.retired:
            r.release()
        self.queued, self.retired = {}, []
