"""The batch's rows: those made (index -> ``Row``) and those queued to be made
(``admissions.py``), kept in step with the pending fill job and the ended step.

One object, held by the parts that read the rows (the processor, its step jobs and its apply
side share its ``rows`` dict), instead of a table passed from hand to hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admissions import Admissions, Queued
from .rows import Row
from .step_apply import StepApply
from .stepjob import StepJobs


@dataclass(eq=False)
class RowTable:
    """Rows ``0 .. max_batch - 1``: made or queued; mutations settle what they touch."""

    max_batch: int
    rows: dict[int, Row]  # the made rows, shared with the step jobs and the apply side
    admissions: Admissions  # the queued ones
    jobs: StepJobs
    apply: StepApply
    #: rows added with a live list (``step(rows, tokens)`` refuses them): a hint, which may
    #: count an add that turned out unconstrained until its row is reused
    live: int = 0

    def check(self, row: int) -> None:
        """Raises IndexError for a row out of range."""
        if not 0 <= row < self.max_batch:
            raise IndexError(f"row {row} outside 0..{self.max_batch - 1}")

    def made(self, row: int) -> Row | None:
        """``row``'s request, made now when it was only queued (None: unconstrained)."""
        self.jobs.admit_now(self.rows)
        return self.rows.get(row)

    def queue(self, row: int, entry: Queued | None) -> None:
        """The row's previous request leaves; ``entry`` (None: none) waits for a fill job
        to make its row."""
        self.jobs.drop(row)
        self.pop(row)
        if entry is not None:
            self.admissions.queued[row] = entry
            self.live += entry.output_ids is not None

    def pop(self, row: int) -> None:
        """Drop the row's request, made or queued, if any (the live-list count follows); a
        made row's matcher is released by the next fill job (``Admissions.retired``)."""
        self.apply.forget(row)
        r = self.rows.pop(row, None)
        if r is not None:
            r.count()
            self.live -= not r.owned
            self.admissions.retired.append(r)
        queued = self.admissions.drop(row)
        if queued is not None:
            self.live -= queued.output_ids is not None

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` now lives at ``dst``; ``dst``'s previous request is dropped."""
        self.check(src)
        self.check(dst)
        self.apply.end()
        self.jobs.discard()
        moved = self.rows.pop(src, None)
        self.pop(dst)
        if moved is not None:
            self.rows[dst] = moved
        self.admissions.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade requests."""
        self.check(a)
        self.check(b)
        self.apply.end()
        self.jobs.discard()
        ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
        if ra is not None:
            self.rows[b] = ra
        if rb is not None:
            self.rows[a] = rb
        self.admissions.swap(a, b)
