"""Speculative decoding: a row's masks along its draft tokens, from its committed state.

Draft tokens are fed tentatively and rolled back, so the row keeps its committed state. The
rules are vLLM's own: a position still inside the thinking section is free (all ones, or the
marker-boundary guard); after a draft token the grammar refuses, every later position repeats
the last valid mask (which already refuses that token, so the rejection sampler rejects it
there and no later row is used); after a placeholder (negative id) positions are free; an
errored row gets its error mask everywhere.

``Drafts.place`` lays a batch's masks out for the apply (``step_apply``) as one row map into
the step's bitmask: committed positions at their rows' own masks, so the step's CPU plan
serves them, and draft and bonus positions in rows above those the step uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .firstmask import FirstMasks
from .rowmasks import RowMasks
from .rows import Row
from .steptypes import DraftMasks, FillStats


class Drafts:
    """Fills draft positions on the host's thread (between the step's fill and the apply)."""

    def __init__(self, first: FirstMasks, row_masks: RowMasks, stats: FillStats) -> None:
        self.first = first
        self.row_masks = row_masks
        self.stats = stats

    def place(self, table: dict[int, Row], masked: Sequence[int], bitmask: torch.Tensor,
              base: int, rows: Sequence[int], positions: Sequence[int],
              inputs: Sequence[int], sampling: set[int]) -> DraftMasks:
        """Each row's masks along its drafts (``AlongDrafts``: logits row
        ``i`` is row ``rows[i]`` at draft position ``positions[i]``, fed ``inputs[i]``), in
        the step's ``bitmask``: a committed position at its row's own mask (``masked``: the
        rows the step masked), the draft positions in rows ``base``, ``base + 1``, ... (above
        every row of ``masked`` and ``rows``; the bitmask has one for each logits row).
        ``sampling``: the rows of ``rows`` in ``table`` (the others are left alone)."""
        ready = set(masked)
        placed: dict[int, list[tuple[int, int]]] = {}
        for at, (row, pos) in enumerate(zip(rows, positions, strict=True)):
            if int(row) in sampling:
                placed.setdefault(int(row), []).append((int(pos), at))
        committed: list[tuple[int, int]] = []  # (mask row, logits row)
        others: list[tuple[int, int, int]] = []  # (logits row, mask row, owner)
        spare = base
        stale = False
        for row, spots in placed.items():
            ats = [at for _, at in sorted(spots)]
            if len(ats) > 1:
                r = table[row]
                errored = r.error is not None
                if row not in ready:
                    bitmask[row].fill_(-1)  # ``fill`` reads the committed mask here
                mask_rows = [row, *range(spare, spare + len(ats) - 1)]
                spare += len(ats) - 1
                self.fill(r, [int(inputs[at]) for at in ats[1:]], bitmask, mask_rows)
                others += [(at, m, row) for at, m in zip(ats[1:], mask_rows[1:], strict=True)]
                if row not in ready or (r.error is not None) != errored:
                    others.append((ats[0], row, row))  # unmasked by the step, or rewritten
                    stale = stale or row in ready
                    continue
            if row in ready:
                committed.append((row, ats[0]))
        committed.sort()
        pairs = [(at, row, row) for row, at in committed] + others
        n = len(pairs)
        return DraftMasks(np.fromiter((p[0] for p in pairs), np.intp, n),
                          np.fromiter((p[1] for p in pairs), np.intp, n),
                          np.fromiter((p[2] for p in pairs), np.intp, n), len(committed), stale)

    def fill(self, r: Row, drafts: Sequence[int], out: torch.Tensor,
             out_rows: Sequence[int]) -> None:
        """``out[out_rows[k + 1]]`` gets the mask of the position after ``drafts[:k + 1]``;
        ``out[out_rows[0]]`` already holds the committed position's (from ``wait_masks``, or
        all ones for a row it did not list). Draft tokens are fed tentatively and rolled
        back, so the row keeps its committed state. The rules are vLLM's own: a position
        still inside the thinking section is free (all ones, or the marker-boundary guard);
        after a draft token the grammar refuses, every later position repeats the last valid
        mask (which already refuses that token, so the rejection sampler rejects it there and
        no later row is used); after a placeholder (negative id) positions are free; an
        errored row gets its error mask everywhere."""
        fed = 0
        gate = r.gate
        opened = gate is not None and gate.thinking
        thought = gate.thinking_tokens if gate is not None else 0
        prev = out_rows[0]
        refused = free = False
        row_masks = self.row_masks
        try:
            for tid, target in zip(drafts, out_rows[1:], strict=True):
                if r.error is not None:
                    row_masks.error_or_free(out, target)
                elif free or tid < 0:
                    free = True
                    out[target].fill_(-1)
                elif refused:
                    out[target].copy_(out[prev])
                else:
                    accepted, took = self._feed_tentatively(r, int(tid))
                    fed += took
                    if not accepted:
                        refused = True
                        out[target].copy_(out[prev])
                    else:
                        self._fill_position(r, out, target)
                        prev = target
        except Exception as exc:  # a bug of ours: this row alone ends
            r.fail(f"speculative masks failed: {type(exc).__name__}: {exc}", cause="drafts")
            for target in out_rows:
                row_masks.error_or_free(out, target)
        finally:
            try:
                if fed:
                    assert r.matcher is not None
                    r.matcher.rollback(fed)
                if opened:  # every constrained token since is a draft's, undone above
                    assert gate is not None
                    gate.rollback(gate.thinking_tokens - thought, emptied=True)
            except Exception as exc:
                r.fail(f"undoing draft tokens failed: {type(exc).__name__}: {exc}",
                       cause="drafts")

    def _feed_tentatively(self, r: Row, tid: int) -> tuple[bool, int]:
        """Feed one draft token: (accepted, matcher tokens taken). A token that ends
        reasoning and is content (an implicit end) goes on to the matcher, as committed
        tokens do (``Row.advance``)."""
        gate = r.gate
        if gate is not None and gate.thinking:
            taken = gate.feed([tid])
            if gate.leftover:  # would end the marker mid-token: refused
                return False, 0
            if not gate.thinking and r.matcher is None:
                self.first.attach_all([r])  # thinking ends inside the window
            if not taken:
                return True, 0
        if r.matcher is None:
            return False, 0
        accepted = r.matcher.accept(tid)
        return accepted, int(accepted)

    def _fill_position(self, r: Row, out: torch.Tensor, target: int) -> None:
        if r.error is not None:
            self.row_masks.error_or_free(out, target)
        elif r.gate is not None and r.gate.thinking:
            if not self.row_masks.guard(r.gate, out, target):
                out[target].fill_(-1)
        elif r.matcher is not None:
            r.matcher.fill(out, target)
            self.stats.rows_filled += 1
        else:
            out[target].fill_(-1)
