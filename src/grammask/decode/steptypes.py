"""The decode step's data types, shared by the fill job, the apply and the host adapters.

It imports nothing of the decode side, so every decode module may use these types without
depending on another one's job (``stepjob``, ``drafts``, ``step_apply``); the apply's own
types (``CpuPlan``, ``LogitsLayout``) are ``grammask.kernels.cpu_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..kernels.cpu_plan import CpuPlan


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
