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
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import metrics
from ..kernels.apply import apply_pairs, cpu_layout, restore_empty_rows
from ..kernels.buffers import MaskBuffers
from ..kernels.cpu_plan import CpuPlan, LogitsLayout
from .digests import MaskDigests, row_key
from .drafts import Drafts
from .rows import Row
from .stepjob import StepJobs
from .steptypes import DraftMasks, StepMasks


class HostLogits:
    """Masks logits with a step's bitmask, with the hooks (digests, the restore);
    ``table`` arguments are the batch's rows."""

    def __init__(self, *, max_batch: int, vocab_size: int, buffers: MaskBuffers,
                 digests: MaskDigests | None = None) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.buffers = buffers  # the step's (row order)
        #: per-rank mask digests (a debug setting; ``digests.py``), None: off
        self.digests = digests
        #: some row of the table may have ``host_masks`` (set when such a row is made,
        #: cleared by ``_restore`` once none has): while False, the apply skips the restore
        self.host_masks_seen = False

    def into_batch(self, table: dict[int, Row], logits: torch.Tensor, step: StepMasks,
              layout: LogitsLayout | None = None) -> None:
        """Logits row ``i`` gets row ``i``'s mask; ``layout``: the logits'
        (``apply.cpu_layout``), when the caller has read it."""
        bitmask, rows, plan = step
        if rows:
            self._pairs(table, logits, bitmask, None, rows, plan, layout)

    def into_mapped(self, table: dict[int, Row], logits: torch.Tensor, step: StepMasks,
                     logits_rows: Sequence[int], rows: Sequence[int],
                     layout: LogitsLayout | None = None) -> None:
        """``logits[logits_rows[i]]`` gets row ``rows[i]``'s mask (rows the step did not
        mask are left alone): no Python work per row."""
        bitmask, masked, plan = step
        if not masked:
            return
        at = np.asarray(logits_rows, dtype=np.intp)
        mask_rows = np.asarray(rows, dtype=np.intp)
        ready = np.zeros(max(self.max_batch, masked[-1] + 1), dtype=bool)
        ready[masked] = True
        keep = ready[mask_rows]
        if not keep.all():
            at, mask_rows = at[keep], mask_rows[keep]
            plan = None  # made for every masked row
        elif len(masked) != len(mask_rows):
            plan = None
        if at.size:
            self._pairs(table, logits, bitmask, at, mask_rows, plan, layout)

    def into_drafts(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
                     plan: CpuPlan | None, placed: DraftMasks,
                     layout: LogitsLayout | None = None) -> None:
        """Masks at draft positions (``drafts.Drafts.place``: pairs into ``bitmask``, the
        step's with room for them, ``MaskBuffers.room``), in one apply as ``into_mapped``'s:
        the step's ``plan`` for the committed positions, digests of those, the restore of
        every pair."""
        if placed.at.size:
            self._pairs(table, logits, bitmask, placed.at, placed.rows,
                        None if placed.stale else plan, layout, placed.owners,
                        placed.committed)

    def _pairs(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
               at: np.ndarray[Any, np.dtype[np.intp]] | None,
               rows: list[int] | np.ndarray[Any, np.dtype[np.intp]], plan: CpuPlan | None,
               layout: LogitsLayout | None,
               owners: np.ndarray[Any, np.dtype[np.intp]] | None = None,
               committed: int | None = None) -> None:
        """``apply_pairs`` with the hooks: digests of the committed masks (the first
        ``committed`` pairs; None: all), then the restore (``owners[i]``: pair ``i``'s row;
        None: its mask row)."""
        # rows as a list only for the per-row hooks (the V2 path has none by default)
        hooks = self.digests is not None or self.host_masks_seen
        listed = (rows if isinstance(rows, list) else rows.tolist()) if hooks else []
        if self.digests is not None:
            self._record(table, bitmask, listed if committed is None else listed[:committed])
            plan = None if self.digests.fault else plan
        apply_pairs(logits, bitmask, at, rows, vocab_size=self.vocab_size,
                    buffers=self.buffers, plan=plan, layout=layout)
        if self.host_masks_seen:
            spots = listed if at is None else at.tolist()
            belong = listed if owners is None else owners.tolist()
            self._restore(table, logits, bitmask, list(zip(spots, listed, belong, strict=True)))

    def _record(self, table: dict[int, Row], bitmask: torch.Tensor,
                rows: Sequence[int]) -> None:
        """Mask digests for comparing ranks (``digests.py``; a debug setting)."""
        assert self.digests is not None
        self.digests.observe(bitmask, [
            (i, row_key(r.request.spec.key, r.output[:r.seen],
                        r.grammar.backend if r.grammar is not None else "")
             if r is not None else "?")
            for i in rows for r in [table.get(i)]])

    def _restore(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
                 spots: Sequence[tuple[int, int, int]]) -> None:
        """The grammar wins over the host's own processors (rows that asked for it);
        ``spots``: (logits row, mask row, the row it belongs to)."""
        if not self.host_masks_seen:
            return
        asked = [(at, mask_row) for at, mask_row, row in spots
                 if (r := table.get(row)) is not None and r.host_masks]
        if not asked and not any(r.host_masks for r in table.values()):
            self.host_masks_seen = False  # the rows that asked have left the batch
        if asked and (n := restore_empty_rows(logits, bitmask, asked,
                                              vocab_size=self.vocab_size)) > 0:
            metrics.HOST_CONFLICTS.inc(n)


class Mapped(NamedTuple):
    """``logits[logits_rows[i]]`` takes row ``rows[i]``'s mask (both distinct, of equal
    length): vLLM's V2 runner, whose rows are request slots and logits in batch order."""

    logits_rows: Sequence[int]
    rows: Sequence[int]


class AlongDrafts(NamedTuple):
    """Speculative decoding: logits row ``i`` belongs to processor row ``rows[i]`` (-1 or a
    row not sampling: left alone) at draft position ``positions[i]`` (0: the committed state;
    k: after the first k draft tokens; the last: the bonus position), and ``inputs[i]`` is
    the token fed at that logits row (the draft tokens of positions 1.. are the inputs of
    the rows before them). One entry per logits row in each."""

    rows: Sequence[int]
    positions: Sequence[int]
    inputs: Sequence[int]


#: How a host's logits rows take the processor's rows: None, logits row ``i`` is row ``i``.
HostRows = Mapped | AlongDrafts | None


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

    def apply(self, logits: torch.Tensor, host_rows: HostRows) -> None:
        """The step's masks into ``logits``, laid out as ``host_rows`` says."""
        if host_rows is None:
            self.batch(logits)
        elif isinstance(host_rows, Mapped):
            self.mapped(logits, host_rows.logits_rows, host_rows.rows)
        else:
            self.drafts(logits, *host_rows)

    def batch(self, logits: torch.Tensor) -> None:
        """Logits row ``i`` gets row ``i``'s mask."""
        self._ended = None
        layout = cpu_layout(logits)
        step = self._jobs.wait_for_apply(self.table, layout)
        self._logits.into_batch(self.table, logits, step, layout)

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
            self._logits.into_mapped(self.table, logits, ended.step, logits_rows, rows)
            return
        layout = cpu_layout(logits)
        step = self._jobs.wait_for_apply(self.table, layout, rows)
        self._ended = _Ended(step, set(step.rows))
        self._logits.into_mapped(self.table, logits, step, logits_rows, rows, layout)

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
            layout = cpu_layout(logits)
            step = self._jobs.wait_for_apply(self.table, layout, sorted(sampling))
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
        self._logits.into_drafts(self.table, logits, bitmask, step.plan, placed, layout)

    def _reusable(self, rows: Collection[int]) -> _Ended | None:
        """The ended step, when it still holds every one of ``rows`` (and no step began)."""
        ended = self._ended
        if ended is None or self._jobs.pending is not None or not ended.rows.issuperset(rows):
            return None
        return ended
