"""``kernels/lent``: the kernels a backend lends to the backend-neutral apply. xgrammar lends
its CPU kernel when imported, the last lender of each kind wins, and with nothing lent the
apply's torch fallback masks the same logits."""

from __future__ import annotations

import torch

import grammask.backends.xgrammar  # noqa: F401 - lends its kernels when imported
from grammask.kernels import lent
from grammask.kernels.apply import apply_bitmask
from grammask.kernels.lent import LENT, lend


def test_xgrammar_lends_a_cpu_kernel() -> None:
    assert LENT.cpu is not None and LENT.device is not None


def test_the_last_lender_of_each_kind_wins(monkeypatch: object) -> None:
    saved = lent.LentKernels(LENT.cpu, LENT.device)
    calls: list[str] = []
    try:
        lend(cpu=lambda *a: calls.append("first"))
        lend(cpu=lambda *a: calls.append("second"))
        lend(device=None)  # lends nothing: the device kernel stays
        assert LENT.device is saved.device
        assert LENT.cpu is not None
        LENT.cpu(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int32), 32, [0])
        assert calls == ["second"]
    finally:
        LENT.cpu, LENT.device = saved.cpu, saved.device


def test_with_nothing_lent_the_fallback_masks_alike() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 100, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    lent_out, plain_out = logits.clone(), logits.clone()
    apply_bitmask(lent_out, bitmask, vocab_size=100)
    saved = LENT.cpu
    LENT.cpu = None
    try:
        apply_bitmask(plain_out, bitmask, vocab_size=100)
    finally:
        LENT.cpu = saved
    assert torch.equal(lent_out, plain_out)
    words = [[int(w) & 0xFFFFFFFF for w in row] for row in bitmask.tolist()]
    for r in range(3):
        for t in range(100):
            allowed = words[r][t // 32] >> (t % 32) & 1
            assert (plain_out[r, t] == float("-inf")) != bool(allowed), (r, t)
