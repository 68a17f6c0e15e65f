"""``apply.apply_pairs``: logits row ``at[i]`` masked with bitmask row ``rows[i]``, through a
plan moved to other rows or the kernels, against a reference built bit by bit in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grammask.kernels.apply import apply_pairs, cpu_layout
from grammask.kernels.cpu_plan import plan_cpu_apply

VOCAB, WIDTH = 1000, 1024  # model padding past the mask


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, at: np.ndarray,
               rows: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(
        bitmask.shape[0], -1)
    for a, r in zip(at.tolist(), rows.tolist(), strict=True):
        allowed = torch.from_numpy(bits[r, :VOCAB].astype(bool))
        out[a, :VOCAB][~allowed] = float("-inf")
        out[a, VOCAB:] = float("-inf")
    return out


@pytest.mark.parametrize("planned", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_match_the_reference(planned: bool, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(7)
    for trial in range(20):
        n_mask, n_logits = 12, int(rng.integers(3, 10))
        bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (n_mask, 32), dtype=np.int64)
                                   .astype(np.int32))
        sparse = rng.choice(n_mask, 4, replace=False)  # rows allowing a few tokens: wiped
        bitmask[torch.from_numpy(sparse)] = 0
        bitmask[torch.from_numpy(sparse), 0] = 0b1011
        k = int(rng.integers(1, n_logits + 1))
        rows = np.sort(rng.choice(n_mask, k, replace=False)).astype(np.intp)
        at = rng.choice(n_logits, k, replace=False).astype(np.intp)
        if trial % 5 == 0:
            at = rows.copy() if rows.max() < n_logits else at  # the identity case
        logits = torch.randn(n_logits, WIDTH).to(dtype)
        plan = None
        if planned:
            layout = cpu_layout(logits)
            assert layout is not None
            plan = plan_cpu_apply(bitmask, rows.tolist(), vocab_size=VOCAB, width=WIDTH,
                                  stride=layout.stride)
        expected = _reference(logits, bitmask, at, rows)
        apply_pairs(logits, bitmask, at, rows, vocab_size=VOCAB, plan=plan)
        assert torch.equal(logits, expected), trial


def test_a_plan_serves_its_rows_among_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs of the plan's rows and others (speculative decoding: committed positions and
    draft positions in one bitmask): the plan moves to its rows' logits rows, the kernel
    masks the rest, and every row matches the reference."""
    import grammask.kernels.apply as apply_module

    moved: list[int] = []
    real = apply_module._apply_plan_moved

    def counted(*args: object) -> None:
        moved.append(len(args[3]))  # type: ignore[arg-type]
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(apply_module, "_apply_plan_moved", counted)
    rng = np.random.default_rng(11)
    for trial in range(10):
        bitmask = torch.from_numpy(rng.integers(-2**31, 2**31, (16, 32), dtype=np.int64)
                                   .astype(np.int32))
        bitmask[2] = 0
        bitmask[2, 0] = 0b101  # a wiped row
        planned = np.array([1, 2, 5], dtype=np.intp)  # the step's rows
        drafts = np.array([8, 9, 10, 11], dtype=np.intp)  # rows after the batch's
        rows = np.concatenate([planned, drafts])
        at = rng.permutation(7).astype(np.intp)
        logits = torch.randn(7, WIDTH)
        plan = plan_cpu_apply(bitmask, planned.tolist(), vocab_size=VOCAB, width=WIDTH,
                              stride=WIDTH)
        expected = _reference(logits, bitmask, at, rows)
        apply_pairs(logits, bitmask, at, rows, vocab_size=VOCAB, plan=plan)
        assert torch.equal(logits, expected), trial
    assert moved == [3] * 10


def test_a_plan_for_other_rows_is_not_used() -> None:
    bitmask = torch.zeros(4, 32, dtype=torch.int32)
    bitmask[:, 0] = 1  # token 0 only
    logits = torch.zeros(2, WIDTH)
    stale = plan_cpu_apply(bitmask, [0, 1, 2], vocab_size=VOCAB, width=WIDTH, stride=WIDTH)
    at, rows = np.array([1, 0]), np.array([3, 1])
    apply_pairs(logits, bitmask, at, rows, vocab_size=VOCAB, plan=stale)
    assert torch.isfinite(logits).sum(dim=1).tolist() == [1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairs_on_cuda_match_the_reference(dtype: torch.dtype) -> None:
    """The V2 runner's apply on CUDA logits: the device-side gather into batch order."""
    from grammask.kernels.buffers import MaskBuffers

    rng = np.random.default_rng(11)
    buffers = MaskBuffers(16, VOCAB)
    for trial in range(10):
        bitmask = buffers.acquire()
        bitmask.copy_(torch.from_numpy(rng.integers(-2**31, 2**31, (16, 32), dtype=np.int64)
                                       .astype(np.int32)))
        k = int(rng.integers(1, 9))
        rows = np.sort(rng.choice(16, k, replace=False)).astype(np.intp)
        at = rng.choice(8, k, replace=False).astype(np.intp)
        logits = torch.randn(8, WIDTH).to(dtype)
        expected = _reference(logits, bitmask, at, rows)
        on_device = logits.cuda()
        apply_pairs(on_device, bitmask, at, rows, vocab_size=VOCAB, buffers=buffers)
        assert torch.equal(on_device.cpu(), expected), trial
