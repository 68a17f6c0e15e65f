"""The apply path on every device there is: the same assertions on CPU (always) and CUDA (on
a GPU machine: ``bench/gpu_check.sh``; skipped here, where no GPU exists).

- ``apply_bitmask`` on (B, V) logits of each dtype equals a reference computed bit by bit,
  including model padding (logits wider than the vocabulary) and a row subset;
- ``BatchProcessor.apply`` on the device's logits under ``torch.inference_mode()`` (as vLLM
  calls it) equals the masks of lone reference matchers, over several steps, so the
  double-buffered pinned bitmasks and their copy events are exercised on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from grammask import Compiler, GrammarSpec, Vocabulary, allocate_bitmask
from grammask.decode.processor import BatchProcessor
from grammask.kernels.apply import apply_bitmask

from ..helpers import PATIENT

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run bench/gpu_check.sh)"))]
_BITS = torch.tensor([(1 << i) - (1 << 32) if i == 31 else 1 << i for i in range(32)],
                     dtype=torch.int32)


def reference(logits: torch.Tensor, bitmask: torch.Tensor, vocab: int,
              rows: list[int]) -> torch.Tensor:
    out = logits.detach().float().cpu().clone()
    bits = (bitmask.cpu().unsqueeze(-1) & _BITS).ne(0).flatten(1)[:, :vocab]
    for r in rows:
        out[r, :vocab][~bits[r]] = float("-inf")
        out[r, vocab:] = float("-inf")
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_matches_the_bitwise_reference(device: str, dtype: torch.dtype) -> None:
    vocab, width, batch = 151_936, 152_064, 7  # a model's logits padded past its vocabulary
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    bitmask[2] = 0  # nothing allowed
    bitmask[3] = -1  # everything allowed
    logits = torch.randn(batch, width, generator=gen).to(device=device, dtype=dtype)
    rows = [0, 2, 3, 5]
    want = reference(logits, bitmask, vocab, rows)
    with torch.inference_mode():
        got = logits.clone()
        apply_bitmask(got, bitmask, vocab_size=vocab, indices=rows)
    assert got.device.type == device
    assert torch.equal(got.float().cpu().isinf(), want.isinf())
    finite = ~want.isinf()
    assert torch.equal(got.float().cpu()[finite], want[finite])


@pytest.mark.parametrize("device", DEVICES)
def test_processor_masks_device_logits_under_inference_mode(device: str, compiler: Compiler,
                                                            qwen25: Vocabulary) -> None:
    specs = [GrammarSpec.regex("(ab|cd)[0-9]{1,3}(-[a-z]+)?"),
             GrammarSpec.choice(["alpha", "beta gamma delta"]),
             GrammarSpec.json_schema({"type": "object", "properties": {
                 "n": {"type": "integer"}}, "required": ["n"]}, any_whitespace=False)]
    walks = [qwen25.encode("cd12-xyz"), qwen25.encode("beta gamma delta"),
             qwen25.encode('{"n":42}')]
    steps = min(len(w) for w in walks)
    assert steps >= 3
    refs = [compiler.compile(s).matcher() for s in specs]
    with torch.inference_mode(), BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        for row, spec in enumerate(specs):
            proc.add(row, spec)
        for step in range(steps):
            proc.step()
            logits = torch.zeros(4, qwen25.vocab_size, device=device)
            proc.apply(logits)
            for row, ref in enumerate(refs):
                bm = allocate_bitmask(1, qwen25.vocab_size)
                ref.fill(bm, 0)
                want = (bm[0].unsqueeze(-1) & _BITS).ne(0).flatten()[:qwen25.vocab_size]
                assert torch.equal(torch.isfinite(logits[row]).cpu(), want), (step, row)
                assert ref.accept(walks[row][step])
                proc.advance(row, [walks[row][step]])
            assert torch.isfinite(logits[3]).all()  # the unconstrained row
        assert proc.errors == {}
