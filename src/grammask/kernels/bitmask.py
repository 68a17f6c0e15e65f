"""Bitmask allocation shared by the API, the mask pipeline and the tests.

Every long-lived tensor grammask writes is created as a *normal* tensor, even when the host
calls us under ``torch.inference_mode()`` (vLLM's ``execute_model`` does): an inference tensor
cannot be written in place outside inference mode, and the fill worker thread does not inherit
the host's mode (torch modes are per thread). ``normal_tensors()`` is that guard.
"""

from __future__ import annotations

import torch


def normal_tensors() -> torch.inference_mode:
    """A context in which new tensors are normal ones, writable from any thread and mode."""
    return torch.inference_mode(False)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, *, pin: bool = False) -> torch.Tensor:
    """An int32 ``(batch, ceil(vocab/32))`` mask, all tokens allowed; bit set = allowed."""
    if batch_size < 0 or vocab_size <= 0:
        raise ValueError(f"bad bitmask shape: batch {batch_size}, vocab {vocab_size}")
    with normal_tensors():
        return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32,
                          pin_memory=pin and torch.cuda.is_available())


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids whose bit is set in one row (tests and audits; not for the hot path)."""
    words = bitmask_row.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int64)) & 1
    flat = bits.flatten()[:vocab_size]
    return [int(i) for i in torch.nonzero(flat).flatten()]
