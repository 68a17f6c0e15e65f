"""Batch-parallel fills (``Filler``): the fill side of a step (``grammask.kernels.apply``
masks the logits; buffers are ``grammask.kernels.buffers``, the thread ``fill_worker``).

``Filler`` fills a set of rows through the backends' batch calls (``BatchCalls``:
xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``), on the backend's threads from
``parallel_min`` rows of one backend, on the fill thread (``fill_worker``). A backend whose
fills take turns on shared locks (``FillLanes``: llguidance) has its rows placed on threads
here, by lock (``fill_placement``), and fills the shares it is handed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..backends.base import BackendMatcher, BatchFills, Matcher, batch_calls, fill_stop_only
from ..backends.capabilities import lane_calls
from ..kernels.bitmask import bitmask_words, normal_tensors
from .fill_placement import place_fills


class Filler:
    """Fills the mask rows of many matchers, batch-parallel where that pays.

    ``parallel_min``: the fewest matchers of one backend filled on the backend's threads;
    fewer fill on the fill thread, in one batch call. None picks by the machine: on 2 cores
    the fill thread already has the only spare core (more threads were no faster:
    docs/benchmarks.md), so the backends' threads are used from 32 rows only where at least
    4 cores are available.
    ``threads``: worker threads of the batch fills (None: the backend's default).
    ``cpus``: the CPUs the fill thread runs on (None: where the host started it).
    """

    def __init__(self, *, parallel_min: int | None = None, threads: int | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        if parallel_min is None:
            parallel_min = 32 if _cores() >= 4 else 2**31
        self.parallel_min = max(1, parallel_min)
        self.threads = threads
        self.cpus = cpus
        self._pools: dict[str, Any] = {}  # the backends' batch-fill pools, made on first use

    def fill(self, entries: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor,
             grouped: BatchFills | None = None) -> None:
        """Write ``bitmask[row]`` for every ``(matcher, row)`` of ``entries`` and ``grouped``;
        rows must be distinct.

        Matchers whose class has batch calls (``backends.base.batch_calls``) are grouped by
        class (``grouped``: rows the caller grouped so already, ``rows.advance_all``; left
        as given); a group goes through its ``batch_fill``, on the backend's threads from
        ``parallel_min`` rows, on this thread below that (one native call, the
        GIL released, still cheaper than a Python loop: the backend keeps the per-row
        choice). On several threads, a class with ``FillLanes`` tells its rows' locks and
        lanes, the rows are placed on threads here (``fill_placement``) and it fills the
        shares. Terminated matchers of those classes (only stop tokens allowed) are copied
        in bulk (``fill_stop_only``); lone rows and other classes take their own ``fill``."""
        groups: BatchFills = {}
        rest: list[tuple[Matcher, int]] = []
        for matcher, row in entries:
            calls = batch_calls(type(matcher))
            if calls is None:
                rest.append((matcher, row))
            else:
                groups.setdefault(calls, []).append((matcher, row))
        for calls, given in (grouped or {}).items():
            groups[calls] = given + groups[calls] if calls in groups else given
        ended: list[tuple[BackendMatcher, int]] = []
        for calls, rows in groups.items():
            live: list[tuple[Matcher, int]] = []
            for matcher, row in rows:
                if not matcher.is_terminated():
                    live.append((matcher, row))
                elif isinstance(matcher, BackendMatcher):
                    ended.append((matcher, row))  # only stop tokens: copied in bulk below
                else:
                    rest.append((matcher, row))
            if len(live) > 1:
                threads = self.threads if len(live) >= self.parallel_min else 1
                lanes = lane_calls(calls) if threads != 1 else None
                plan = lanes.fill_lanes(live, bitmask, threads) if lanes is not None else None
                if lanes is not None and plan is not None:
                    lanes.fill_shares(place_fills(plan[1], plan[0]), bitmask, self._pools)
                else:
                    calls.batch_fill(live, bitmask, threads, self._pools)
            else:
                rest.extend(live)
        if ended:
            fill_stop_only(ended, bitmask)
        for matcher, row in rest:
            matcher.fill(bitmask, row)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def stop_only_row(stop_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A one-row bitmask allowing only ``stop_ids`` (errored rows, forced EOS)."""
    with normal_tensors():
        row = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)
    words = row.numpy().view("uint32")
    for tid in stop_ids:
        words[tid >> 5] |= 1 << (tid & 31)
    return row
