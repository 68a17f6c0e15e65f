"""A step's masks into the host's logits, however the host lays its rows out.

Three layouts, one step: the batch's own rows (vLLM's V1 runner, transformers: ``batch``),
logits rows mapped to mask rows (vLLM's V2 runner, rows are request slots: ``mapped``), and
draft positions along speculative drafts (``drafts``). Each ends the step: it waits for the
step's fill. A later apply of the same step (vLLM 0.34's rejection sampler verifies a large
speculative batch in request chunks, one apply each) takes that step's masks, as long as no
step began and its rows are still theirs (``_Ended``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from .drafts import Drafts
from .hostlogits import HostLogits
from .rows import Row
from .stepjob import StepJobs
from .steptypes import StepMasks


@dataclass
class _Ended:
    """A step whose masks an apply took; later applies of the same step take theirs."""

    step: StepMasks
    rows: set[int]  # its masked rows still held by the request they were filled for
    drafts: int = 0  # draft positions the step's chunks placed so far


class StepApply:
    """The apply side of a step, over the processor's row table (shared, not copied)."""

    def __init__(self, table: dict[int, Row], jobs: StepJobs, logits: HostLogits,
                 drafts: Drafts) -> None:
        self.table = table
        self._jobs = jobs
        self._logits = logits
        self._drafts = drafts
        self._ended: _Ended | None = None

    def end(self) -> None:
        """A new step or a mutation: the ended step's masks no longer hold."""
        self._ended = None

    def forget(self, row: int) -> None:
        """``row`` left: the ended step's mask for it is not its new request's."""
        if self._ended is not None:
            self._ended.rows.discard(row)

    def batch(self, logits: torch.Tensor) -> None:
        """Logits row ``i`` gets row ``i``'s mask (``BatchProcessor.apply``)."""
        self._ended = None
        step, layout = self._jobs.wait_for_apply(self.table, logits)
        self._logits.apply(self.table, logits, step, layout)

    def wait(self, rows: Collection[int] | None) -> tuple[torch.Tensor, list[int]]:
        """The step's bitmask and its rows (``BatchProcessor.wait_masks``)."""
        self._ended = None
        step = self._jobs.wait(self.table, rows)
        return step.bitmask, step.rows

    def mapped(self, logits: torch.Tensor, logits_rows: Sequence[int],
               rows: Sequence[int]) -> None:
        """``logits[logits_rows[i]]`` gets row ``rows[i]``'s mask."""
        ended = self._reusable(rows)
        if ended is not None:
            self._logits.apply_mapped(self.table, logits, ended.step, logits_rows, rows)
            return
        step, layout = self._jobs.wait_for_apply(self.table, logits, rows)
        self._ended = _Ended(step, set(step.rows))
        self._logits.apply_mapped(self.table, logits, step, logits_rows, rows, layout)

    def drafts(self, logits: torch.Tensor, rows: Sequence[int], positions: Sequence[int],
               inputs: Sequence[int]) -> None:
        """Speculative decoding: logits row ``i`` belongs to processor row ``rows[i]`` (-1 or
        a row not sampling: left alone) at draft position ``positions[i]`` (0: the committed
        state; k: after the first k draft tokens; the last: the bonus position), and
        ``inputs[i]`` is the token fed at that logits row (the draft tokens of positions
        1.. are the inputs of the rows before them). Each row's masks follow its drafts
        (``Drafts.place``); the committed positions take the step's masks as ``mapped``
        does. The three sequences have one entry per logits row."""
        self._jobs.admit_now(self.table)
        sampling = {int(r) for r in rows if int(r) in self.table}
        ended = self._reusable(sampling)
        layout = None
        if ended is None:
            step, layout = self._jobs.wait_for_apply(self.table, logits, sorted(sampling))
            ended = self._ended = _Ended(step, set(step.rows))
        step = ended.step
        # draft positions right after the highest row this step uses: a device copy of the
        # bitmask then spans the rows in use, not every row of a sparse batch; a later chunk
        # of the step places its own above the earlier chunks' (a device copy of those may
        # not have run yet)
        base = max(step.rows[-1] if step.rows else -1, max(sampling, default=-1)) + 1
        base += ended.drafts
        ended.drafts += len(rows)
        bitmask = self._jobs.buffers.room(step.bitmask, base, len(rows))
        placed = self._drafts.place(self.table, step.rows, bitmask, base, rows, positions,
                                    inputs, sampling)
        self._logits.apply_drafts(self.table, logits, bitmask, step.plan, placed, layout)

    def _reusable(self, rows: Collection[int]) -> _Ended | None:
        """The ended step, when it still holds every one of ``rows`` (and no step began)."""
        ended = self._ended
        if ended is None or self._jobs.pending is not None or not ended.rows.issuperset(rows):
            return None
        return ended
