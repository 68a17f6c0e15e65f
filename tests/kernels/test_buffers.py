"""``kernels/buffers.MaskBuffers``: room for draft positions above the batch's rows."""

from __future__ import annotations

import torch

from grammask.kernels.buffers import MaskBuffers


def test_room_for_a_later_chunk_above_a_smaller_buffer() -> None:
    """vLLM 0.34 verifies a speculative batch in chunks: a later chunk places its draft
    rows above the earlier chunks', past the end of the step's buffer. The room it gets
    keeps the step's own rows and has every row it asks for (it raised before: found by
    tests/integrations/vllm/test_v2_safety.py::test_random_configurations)."""
    buffers = MaskBuffers(4, 64)
    step = buffers.acquire()
    step[:4] = torch.arange(4, dtype=torch.int32)[:, None]
    first = buffers.room(step, 4, 10)  # chunk 1: rows 4..13
    assert first.shape[0] >= 14 and torch.equal(first[:4], step[:4])
    later = buffers.room(step, 14, 10)  # chunk 2: rows 14..23, above chunk 1's
    assert later.shape[0] >= 24
    assert torch.equal(later[:4], step[:4])
    assert buffers.acquire().shape[0] >= 4 + 10  # grown for the next steps
