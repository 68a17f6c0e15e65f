"""A step's masks into the host's logits: in batch-row order (``apply``), in the host's own
order (``apply_mapped``: vLLM's V2 runner, where rows are request slots and logits are in
batch order) and at speculative draft positions (``apply_drafts``: draft positions in the
step's bitmask above the rows it uses), each as (logits row, mask row) pairs through
``apply.apply_pairs``: one apply, with the step's CPU plan where it holds.

The grammar wins over the host's own processors for rows that asked for it
(``apply.restore_empty_rows``), and with mask digests on each applied row is recorded first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import metrics
from ..kernels.apply import apply_pairs, restore_empty_rows
from ..kernels.buffers import MaskBuffers
from ..kernels.cpu_plan import CpuPlan, LogitsLayout
from .digests import MaskDigests, row_key
from .rows import Row
from .steptypes import DraftMasks, StepMasks


class HostLogits:
    """Masks logits with a step's bitmask; ``table`` arguments are the batch's rows."""

    def __init__(self, *, max_batch: int, vocab_size: int, buffers: MaskBuffers,
                 digests: MaskDigests | None = None) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.buffers = buffers  # the step's (row order)
        #: per-rank mask digests (a debug setting; ``digests.py``), None: off
        self.digests = digests
        #: some row of the table may have ``host_masks`` (set by the facade's ``add``, cleared
        #: by ``_restore`` once none has): while False, the apply skips the restore's pass
        self.risky = False

    def apply(self, table: dict[int, Row], logits: torch.Tensor, step: StepMasks,
              layout: LogitsLayout | None = None) -> None:
        """Logits row ``i`` gets row ``i``'s mask; ``layout``: the logits'
        (``apply.cpu_layout``), when the caller has read it."""
        bitmask, rows, plan = step
        if rows:
            self._pairs(table, logits, bitmask, None, rows, plan, layout)

    def apply_mapped(self, table: dict[int, Row], logits: torch.Tensor, step: StepMasks,
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

    def apply_drafts(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
                     plan: CpuPlan | None, placed: DraftMasks,
                     layout: LogitsLayout | None = None) -> None:
        """Masks at draft positions (``drafts.Drafts.place``: pairs into ``bitmask``, the
        step's with room for them, ``MaskBuffers.room``), in one apply as ``apply_mapped``'s:
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
        hooks = self.digests is not None or self.risky
        listed = (rows if isinstance(rows, list) else rows.tolist()) if hooks else []
        if self.digests is not None:
            self._record(table, bitmask, listed if committed is None else listed[:committed])
            plan = None if self.digests.fault else plan
        apply_pairs(logits, bitmask, at, rows, vocab_size=self.vocab_size,
                    buffers=self.buffers, plan=plan, layout=layout)
        if self.risky:
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
        if not self.risky:
            return
        risky = [(at, mask_row) for at, mask_row, row in spots
                 if (r := table.get(row)) is not None and r.host_masks]
        if not risky and not any(r.host_masks for r in table.values()):
            self.risky = False  # the rows that asked have left the batch
        if risky and (n := restore_empty_rows(logits, bitmask, risky,
                                              vocab_size=self.vocab_size)) > 0:
            metrics.HOST_CONFLICTS.inc(n)
