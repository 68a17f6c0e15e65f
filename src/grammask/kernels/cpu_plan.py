"""The CPU apply's plan and the logits layout it holds for (``apply.plan_cpu_apply``).

A leaf: it imports nothing of grammask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch


class LogitsLayout(NamedTuple):
    """2-D CPU logits the planned apply takes: read once per apply (``apply.cpu_layout``)."""

    rows: int
    width: int
    stride: int  # of a row
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class CpuPlan:
    """A bitmask turned into flat logit indices for one logits layout
    (``apply.plan_cpu_apply``).

    ``keep``: flat indices (``row * stride + token``) of the allowed logits of the *wiped*
    rows: rows that allow few tokens, which are filled with -inf wholesale (``runs``: their
    consecutive runs, ``[start, stop)``) after their allowed logits are saved, then restored.
    ``kill``: flat indices of the refused logits of the other rows, model padding included.
    Valid for ``rows`` of logits with row stride ``stride`` and width ``width`` only;
    ``bound``: ``max(rows) + 1``, the rows the logits and the bitmask need."""

    rows: tuple[int, ...]
    stride: int
    width: int
    covered: int
    keep: np.ndarray[Any, np.dtype[np.intp]]
    kill: np.ndarray[Any, np.dtype[np.intp]]
    runs: tuple[tuple[int, int], ...]
    bound: int = 0
    #: the wiped rows themselves (``runs`` as rows), for a plan applied at other rows
    wiped: np.ndarray[Any, np.dtype[np.intp]] | None = None

    def holds(self, layout: LogitsLayout, rows: tuple[int, ...], covered: int) -> bool:
        """Whether the plan masks exactly ``rows`` of logits laid out as ``layout``."""
        return (layout.stride == self.stride and layout.width == self.width
                and covered == self.covered and rows == self.rows
                and self.bound <= layout.rows)
