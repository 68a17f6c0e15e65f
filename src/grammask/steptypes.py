"""The decode step's data types, shared by the fill job, the apply and the host adapters.

A leaf: it imports nothing of grammask, so every decode module may use these types without
depending on another one's job (``stepjob``, ``apply``, ``drafts``, ``hostlogits``).
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


class StepMasks(NamedTuple):
    """A step's masks: the bitmask, the rows it masks (sorted), the CPU apply's plan."""

    bitmask: torch.Tensor
    rows: list[int]
    plan: CpuPlan | None  # None: none made, or stale


@dataclass
class FillStats:
    """What the fill jobs did, for metrics, benchmarks and tests (``BatchProcessor.stats``).

    Written by the fill thread and read by the host's: each field is one float or int, so a
    read sees the last job's value or the one before, never a torn one."""

    #: milliseconds the last job spent advancing matchers and filling
    last_advance_ms: float = 0.0
    last_fill_ms: float = 0.0
    #: ... and expanding the masks into the CPU apply's plan (0: the job did not plan)
    last_plan_ms: float = 0.0
    #: mask rows filled by the backends so far (work done), drafts included
    rows_filled: int = 0


class DraftMasks(NamedTuple):
    """A batch's masks at its speculative draft positions, as the apply takes them
    (``drafts.Drafts.place``): one row map into one bitmask, the step's.

    Logits row ``at[i]`` takes bitmask row ``rows[i]`` and belongs to processor row
    ``owners[i]``. The first ``committed`` pairs are committed positions as the step masked
    them (its CPU plan serves them); the others are draft and bonus positions (bitmask rows
    above every row the step uses), and committed positions the step did not mask or whose
    drafts rewrote them. ``stale``: a mask the step planned was rewritten (the plan no longer
    holds)."""

    at: np.ndarray[Any, np.dtype[np.intp]]
    rows: np.ndarray[Any, np.dtype[np.intp]]
    owners: np.ndarray[Any, np.dtype[np.intp]]
    committed: int
    stale: bool
