"""The apply kernels a backend lends to the backend-neutral apply (``kernels.apply``).

``kernels/`` knows no engine: a backend that ships mask kernels registers them here when it
is imported (``backends/xgrammar.py`` does, for xgrammar's CPU and Triton kernels), and the
apply falls back to plain torch for what nobody lent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: ``(logits, bitmask, vocab_size, rows)``: mask these CPU rows in place (fast for rows that
#: allow most tokens)
CpuKernel = Callable[[torch.Tensor, torch.Tensor, int, list[int]], None]
#: ``(logits, bitmask, vocab_size, index or None)``: mask device rows in place
DeviceKernel = Callable[[torch.Tensor, torch.Tensor, int, Any], None]


@dataclass
class LentKernels:
    """What the backends lent; None: nobody (the torch fallback runs)."""

    cpu: CpuKernel | None = None
    #: returns the device kernel, or None where it cannot run (no Triton): called once
    device: Callable[[], DeviceKernel | None] | None = None


LENT = LentKernels()


def lend(*, cpu: CpuKernel | None = None,
         device: Callable[[], DeviceKernel | None] | None = None) -> None:
    """Register a backend's kernels (the last lender of each kind wins)."""
    if cpu is not None:
        LENT.cpu = cpu
    if device is not None:
        LENT.device = device
