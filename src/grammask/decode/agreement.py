"""Agreement across tensor-parallel ranks on decisions that depend on timing.

With tensor parallelism every rank runs its own processor and must write identical masks. A
row's first mask depends on *when* its grammar is ready (which backend finished first, whether
the first-mask budget ran out), and clocks and thread schedules differ between ranks. So each
rank shares its local view and every rank applies one pure decision function to the gathered
views (``pending.decide``): the same input on every rank gives the same outcome.

- ``Solo``: one process, nothing to exchange.
- ``TorchGroup``: an all-gather of small int64 vectors over a gloo process group (the
  processor's fill thread calls it, never vLLM's own groups: see ``tp_group_for_vllm``).

Contract: every rank calls ``gather`` the same number of times with vectors of the same length
(rows are the same on every rank because every rank sees the same sampled tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger("grammask")


class Agreement(Protocol):
    """Shares one int vector per rank; returns every rank's vector, in rank order."""

    @property
    def world_size(self) -> int: ...

    def gather(self, values: Sequence[int]) -> list[list[int]]: ...


class Solo:
    """The single-process case."""

    world_size = 1

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        return [list(values)]


class TorchGroup:
    """All-gather over a ``torch.distributed`` process group (gloo: CPU tensors)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._group = group
        self._world = int(dist.get_world_size(group))

    @property
    def world_size(self) -> int:
        return self._world

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        import torch.distributed as dist

        # new tensors, never written in place: safe under any torch mode of any thread
        with torch.inference_mode(False):
            mine = torch.tensor([len(values), *values], dtype=torch.int64)
            out = [torch.empty_like(mine) for _ in range(self._world)]
            dist.all_gather(out, mine, group=self._group)
        views = [t.tolist() for t in out]
        if any(v[0] != len(values) for v in views):
            raise RuntimeError(f"ranks disagree on the rows to agree on: "
                               f"{[v[0] for v in views]}")
        return [v[1:] for v in views]


def tp_group_for_vllm() -> Agreement:
    """A gloo group of this rank's tensor-parallel peers, for grammask's use alone.

    Built the way vLLM builds its own groups (every rank creates every TP group, in the same
    order), so it must be called on every rank at the same point of start-up: the plugin does
    it in its constructor. Our collectives then never interleave with vLLM's on its groups."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size <= 1:
        return Solo()
    mine = None
    for ranks in tp.group_ranks:
        group = dist.new_group(list(ranks), backend="gloo")
        if tp.rank in ranks:
            mine = group
    assert mine is not None
    log.info("grammask: tensor-parallel agreement over a gloo group of ranks %s", tp.ranks)
    return TorchGroup(mine)
