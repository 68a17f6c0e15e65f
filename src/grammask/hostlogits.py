"""A step's masks into the host's logits: in batch-row order (``apply``), in the host's own
order (``apply_mapped``: vLLM's V2 runner, where rows are request slots and logits are in
batch order) and at speculative draft positions (``apply_drafts``).

The grammar wins over the host's own processors for rows that asked for it
(``apply.restore_empty_rows``), and with mask digests on each applied row is recorded first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import metrics
from .apply import LogitsLayout, apply_bitmask, apply_pairs, restore_empty_rows
from .digests import MaskDigests, row_key
from .drafts import Drafts
from .masks import MaskBuffers
from .rows import Row
from .stepjob import StepMasks


class HostLogits:
    """Masks logits with a step's bitmask; ``table`` arguments are the batch's rows."""

    def __init__(self, *, max_batch: int, vocab_size: int, buffers: MaskBuffers,
                 drafts: Drafts) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.buffers = buffers  # the step's (row order)
        self.drafts = drafts
        #: per-rank mask digests (a debug setting; ``digests.py``), None: off
        self.digests: MaskDigests | None = None
        #: some row of the table may have ``host_masks`` (set by the facade's ``add``, cleared
        #: by ``_restore`` once none has): while False, the apply skips the restore's pass
        self.risky = False
        # mask rows in a host's own logits order (apply_mapped / apply_drafts), made on use
        self._mapped: MaskBuffers | None = None
        self._retired: list[MaskBuffers] = []

    def apply(self, table: dict[int, Row], logits: torch.Tensor, masks: StepMasks,
              layout: LogitsLayout | None = None) -> None:
        """``layout``: the logits' (``apply.cpu_layout``), when the caller has read it."""
        bitmask, rows, plan = masks
        if rows:
            if self.digests is not None:
                self._record(table, bitmask, rows)
                plan = None if self.digests.fault else plan
            # every row of the logits, in order (``rows`` is sorted and distinct): no index
            every = layout is None and len(rows) == logits.shape[0]
            apply_bitmask(logits, bitmask, vocab_size=self.vocab_size,
                          indices=None if every else rows, buffers=self.buffers, plan=plan,
                          layout=layout)
            if self.risky:
                self._restore(table, logits, bitmask, [(i, i) for i in rows])

    def apply_mapped(self, table: dict[int, Row], logits: torch.Tensor, masks: StepMasks,
                     logits_rows: Sequence[int], rows: Sequence[int],
                     layout: LogitsLayout | None = None) -> None:
        """``logits[logits_rows[i]]`` gets row ``rows[i]``'s mask (rows the step did not
        mask are left alone): ``apply.apply_pairs``, no Python work per row."""
        bitmask, masked, plan = masks
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
        if at.size == 0:
            return
        if self.digests is not None:
            self._record(table, bitmask, mask_rows.tolist())
            plan = None if self.digests.fault else plan
        apply_pairs(logits, bitmask, at, mask_rows, vocab_size=self.vocab_size,
                    buffers=self.buffers, plan=plan, layout=layout)
        if self.risky:
            self._restore(table, logits, bitmask, list(zip(at.tolist(), mask_rows.tolist(),
                                                           strict=True)))

    def apply_drafts(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
                     masked: list[int], sampling: set[int], rows: Sequence[int],
                     positions: Sequence[int], inputs: Sequence[int]) -> None:
        """``sampling``: the rows of ``rows`` in the batch (the others are left alone)."""
        ready = set(masked)
        masks, buffer = self._mapped_buffer(logits.shape[0])
        placed: dict[int, list[tuple[int, int]]] = {}
        for at, (row, pos) in enumerate(zip(rows, positions, strict=True)):
            if int(row) in sampling:
                placed.setdefault(int(row), []).append((int(pos), at))
        indices: list[int] = []
        for row, spots in placed.items():
            out_rows = [at for _, at in sorted(spots)]
            if row in ready:
                buffer[out_rows[0]].copy_(bitmask[row])
            else:
                buffer[out_rows[0]].fill_(-1)
            if len(out_rows) > 1:
                self.drafts.fill(table[row], [int(inputs[at]) for at in out_rows[1:]], buffer,
                                 out_rows)
            if row in ready or len(out_rows) > 1:
                indices += out_rows
        if indices:
            apply_bitmask(logits, buffer, vocab_size=self.vocab_size, indices=sorted(indices),
                          buffers=masks)

    def _record(self, table: dict[int, Row], bitmask: torch.Tensor,
                rows: Sequence[int]) -> None:
        """Mask digests for comparing ranks (``digests.py``; a debug setting)."""
        assert self.digests is not None
        self.digests.observe(bitmask, [
            (i, row_key(r.request.spec.key, r.output[:r.seen]) if r is not None else "?")
            for i in rows for r in [table.get(i)]])

    def _restore(self, table: dict[int, Row], logits: torch.Tensor, bitmask: torch.Tensor,
                 pairs: Sequence[tuple[int, int]]) -> None:
        """The grammar wins over the host's own processors (rows that asked for it)."""
        if not self.risky:
            return
        risky = [(at, row) for at, row in pairs
                 if (r := table.get(row)) is not None and r.host_masks]
        if not risky and not any(r.host_masks for r in table.values()):
            self.risky = False  # the rows that asked have left the batch
        if risky and (n := restore_empty_rows(logits, bitmask, risky,
                                              vocab_size=self.vocab_size)) > 0:
            metrics.HOST_CONFLICTS.inc(n)

    def _mapped_buffer(self, rows: int) -> tuple[MaskBuffers, torch.Tensor]:
        """Mask rows in the host's logits order (``apply_mapped`` / ``apply_drafts``)."""
        masks = self._mapped
        if masks is None or masks.max_batch < rows:
            if masks is not None:  # a device copy may still read it: kept, never reused
                self._retired.append(masks)
            masks = self._mapped = MaskBuffers(max(rows, self.max_batch), self.vocab_size)
        return masks, masks.acquire()
