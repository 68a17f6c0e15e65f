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
from ..kernels.apply import apply_pairs
from ..kernels.buffers import MaskBuffers
from ..kernels.cpu_plan import CpuPlan, LogitsLayout
from .digests import MaskDigests, row_key
from .drafts import Drafts
from .rows import Row
from .stepjob import StepJobs
from .steptypes import StepMasks


class Pairs(NamedTuple):
    """(logits row, mask row) pairs of one apply: ``at`` None means logits row ``rows[i]``
    (sorted, distinct); ``plan``: the step's CPU plan where it holds; ``owners[i]``: the row
    pair ``i`` belongs to (None: its mask row); ``committed``: how many leading pairs are
    committed positions (None: all), the ones whose digests are recorded."""

    bitmask: torch.Tensor
    at: np.ndarray[Any, np.dtype[np.intp]] | None
    rows: list[int] | np.ndarray[Any, np.dtype[np.intp]]
    plan: CpuPlan | None
    owners: np.ndarray[Any, np.dtype[np.intp]] | None = None
    committed: int | None = None


class HostLogits:
    """Masks logits with a step's pairs, with the hooks (digests, the restore);
    ``table`` arguments are the batch's rows."""

    def __init__(self, *, max_batch: int, vocab_size: int, buffers: MaskBuffers,
                 digests: MaskDigests | None = None) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.buffers = buffers  # the step's (row order)
        #: per-rank mask digests (a debug setting; ``digests.py``), None: off
        self.digests = digests
        #: some row of the table may have ``host_masks`` (set when such a row is made,
        #: cleared once none has): while False, the apply skips the restore
        self.host_masks_seen = False

    def mapped(self, step: StepMasks, logits_rows: Sequence[int], rows: Sequence[int]
               ) -> Pairs | None:
        """``logits[logits_rows[i]]`` takes row ``rows[i]``'s mask; rows the step did not
        mask are left out (no Python work per row)."""
        bitmask, masked, plan = step
        if not masked:
            return None
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
        return Pairs(bitmask, at, mask_rows, plan) if at.size else None

    def mask(self, table: dict[int, Row], logits: torch.Tensor, pairs: Pairs
             ) -> LogitsLayout | None:
        """``apply_pairs`` with the hooks: digests of the committed masks first, and the
        grammar's tokens back in rows whose host left none (rows that asked for it);
        returns the logits' layout, as the apply read it."""
        bitmask, at, rows, plan, owners, committed = pairs
        # rows as a list only for the per-row hooks (the V2 path has none by default)
        hooks = self.digests is not None or self.host_masks_seen
        listed = (rows if isinstance(rows, list) else rows.tolist()) if hooks else []
        if self.digests is not None:
            self._record(table, bitmask, listed if committed is None else listed[:committed])
            plan = None if self.digests.fault else plan
        asked = self._asked(table, listed, at, owners) if self.host_masks_seen else []
        layout, restored = apply_pairs(logits, bitmask, at, rows, vocab_size=self.vocab_size,
                                       buffers=self.buffers, plan=plan, restore=asked)
        if restored > 0:
            metrics.HOST_CONFLICTS.inc(restored)
        return layout

    def _record(self, table: dict[int, Row], bitmask: torch.Tensor,
                rows: Sequence[int]) -> None:
        """Mask digests for comparing ranks (``digests.py``; a debug setting)."""
        assert self.digests is not None
        self.digests.observe(bitmask, [
            (i, row_key(r.request.spec.key, r.output[:r.seen],
                        r.grammar.backend if r.grammar is not None else "")
             if r is not None else "?")
            for i in rows for r in [table.get(i)]])

    def _asked(self, table: dict[int, Row], listed: list[int],
               at: np.ndarray[Any, Any] | None, owners: np.ndarray[Any, Any] | None
               ) -> list[tuple[int, int]]:
        """(logits row, mask row) of the pairs whose row asked that the grammar win over
        the host's own processors (``host_masks``)."""
        spots = listed if at is None else at.tolist()
        belong = listed if owners is None else owners.tolist()
        asked = [(spot, mask_row) for spot, mask_row, row in zip(spots, listed, belong,
                                                                 strict=True)
                 if (r := table.get(row)) is not None and r.host_masks]
        if not asked and not any(r.host_masks for r in table.values()):
            self.host_masks_seen = False  # the rows that asked have left the batch
        return asked


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

    def into_logits(self, logits: torch.Tensor, host_rows: HostRows) -> None:
        """The step's masks into ``logits``, laid out as ``host_rows`` says: the layout
        becomes pairs (waiting for the step's fill), then one masking call."""
        pairs = (self._batch() if host_rows is None
                 else self._mapped(*host_rows) if isinstance(host_rows, Mapped)
                 else self._drafts_of(*host_rows))
        if pairs is not None:
            layout = self._logits.mask(self.table, logits, pairs)
            # the next job plans the CPU apply for these logits when planning fits
            self._jobs.cpu_layout = layout if self._jobs.plan_next else None

    def wait(self, rows: Collection[int] | None) -> tuple[torch.Tensor, list[int]]:
        """The step's bitmask and its rows (``BatchProcessor.wait_masks``)."""
        self._ended = None
        step = self._jobs.wait(self.table, rows)
        return step.bitmask, step.rows

    def _batch(self) -> Pairs | None:
        """Logits row ``i`` takes row ``i``'s mask."""
        self._ended = None
        bitmask, rows, plan = self._jobs.wait_for_apply(self.table)
        return Pairs(bitmask, None, rows, plan) if rows else None

    def _mapped(self, logits_rows: Sequence[int], rows: Sequence[int]) -> Pairs | None:
        """``Mapped``: from the step's masks, or the ended step's for a later chunk."""
        ended = self._reusable(rows)
        if ended is None:
            step = self._jobs.wait_for_apply(self.table, rows)
            ended = self._ended = _Ended(step, set(step.rows))
        return self._logits.mapped(ended.step, logits_rows, rows)

    def _drafts_of(self, rows: Sequence[int], positions: Sequence[int],
                   inputs: Sequence[int]) -> Pairs | None:
        """``AlongDrafts``: each row's masks follow its drafts (``Drafts.place``) in rows of
        the step's bitmask above those it uses; the committed positions take the step's
        masks as ``Mapped`` rows do."""
        self._jobs.admit_now(self.table)
        sampling = {int(r) for r in rows if int(r) in self.table}
        ended = self._reusable(sampling)
        if ended is None:
            step = self._jobs.wait_for_apply(self.table, sorted(sampling))
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
        if not placed.at.size:
            return None
        return Pairs(bitmask, placed.at, placed.rows, None if placed.stale else step.plan,
                     placed.owners, placed.committed)

    def _reusable(self, rows: Collection[int]) -> _Ended | None:
        """The ended step, when it still holds every one of ``rows`` (and no step began)."""
        ended = self._ended
        if ended is None or self._jobs.pending is not None or not ended.rows.issuperset(rows):
            return None
        return ended
