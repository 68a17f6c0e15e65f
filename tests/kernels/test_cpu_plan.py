"""``kernels/cpu_plan``: a bitmask expanded into flat logit indices, checked bit by bit: rows
that allow few tokens are wiped and their allowed logits kept, the other rows' refused logits
(model padding included) killed; bits at or past the vocabulary never count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grammask.kernels.cpu_plan import plan_cpu_apply

VOCAB, WIDTH, STRIDE = 70, 80, 96  # 3 words a row; logits wider than the vocabulary


def _bits(row: torch.Tensor) -> list[bool]:
    words = [int(w) & 0xFFFFFFFF for w in row.tolist()]
    return [bool(words[t // 32] >> (t % 32) & 1) for t in range(32 * len(words))]


def test_the_plan_keeps_or_kills_exactly_the_reference_bits() -> None:
    rng = np.random.default_rng(3)
    bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (4, 3), dtype=np.int64)
                               .astype(np.int32))
    bitmask[1] = 0
    bitmask[1, 0] = 0b101  # row 1: two tokens allowed (0 and 2): wiped
    bitmask[1, 2] = -64  # bits 6..31 of word 2: tokens 70..95, past the vocabulary: never count
    bitmask[2] = -1  # row 2: everything allowed: only the padding dies
    rows = [1, 2, 3]
    plan = plan_cpu_apply(bitmask, rows, vocab_size=VOCAB, width=WIDTH, stride=STRIDE)
    assert plan.covered == VOCAB and plan.rows == (1, 2, 3) and plan.bound == 4
    keep, kill = set(plan.keep.tolist()), set(plan.kill.tolist())
    wiped = {r for start, stop in plan.runs for r in range(start, stop)}
    assert wiped == {1}
    for r in rows:
        allowed = _bits(bitmask[r])[:VOCAB]
        ok = {r * STRIDE + t for t in range(VOCAB) if allowed[t]}
        refused = {r * STRIDE + t for t in range(VOCAB) if not allowed[t]}
        padding = {r * STRIDE + t for t in range(VOCAB, WIDTH)}
        in_row = range(r * STRIDE, (r + 1) * STRIDE)
        if r in wiped:
            assert {i for i in keep if i in in_row} == ok
            assert not any(i in in_row for i in kill)
        else:
            assert {i for i in kill if i in in_row} == refused | padding
            assert not any(i in in_row for i in keep)
    assert {i for i in keep if i in range(STRIDE, 2 * STRIDE)} == {STRIDE, STRIDE + 2}


def test_rows_outside_the_bitmask_are_refused() -> None:
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside bitmask"):
        plan_cpu_apply(bitmask, [0, 2], vocab_size=VOCAB, width=WIDTH, stride=STRIDE)


def test_no_rows_plan_nothing() -> None:
    plan = plan_cpu_apply(torch.zeros((2, 3), dtype=torch.int32), [], vocab_size=VOCAB,
                          width=WIDTH, stride=STRIDE)
    assert plan.keep.size == plan.kill.size == 0 and plan.runs == () and plan.bound == 0
