"""The V2 token watch's device side, without a GPU: mask copies that follow the rows in use,
blocking events, helper threads on their rank's device, the apply kernel warmed up front.

CUDA itself is replaced by recorders here (no GPU on this machine); ``bench/gpu_check.sh``
runs the same paths on a real device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from grammask.integrations.vllm import v2 as vllm_v2
from grammask.integrations.vllm import v2_device as vllm_v2_device
from grammask.kernels import apply as apply_mod
from grammask.kernels.apply import copy_runs, copy_to_device
from grammask.kernels.buffers import MaskBuffers

VOCAB = 151_936


@pytest.mark.parametrize(("rows", "runs"), [
    ([1023], [(1023, 1024)]),
    ([1023, 1022, 1019], [(1019, 1024)]),  # gaps under 8 rows: one copy
    ([1023, 600, 5], [(5, 6), (600, 601), (1023, 1024)]),
    ([], []),
])
def test_copy_runs_cover_the_rows_in_use(rows: list[int], runs: list[tuple[int, int]]) -> None:
    assert copy_runs(np.array(rows, dtype=np.int64)) == runs


def test_copy_runs_are_capped_by_joining_the_closest() -> None:
    rows = np.arange(0, 40 * 20, 20)  # 40 rows, 20 apart: more ranges than the cap
    runs = copy_runs(rows, most=16)
    assert len(runs) <= 16
    covered = {r for lo, hi in runs for r in range(lo, hi)}
    assert set(rows.tolist()) <= covered


def test_a_device_copy_moves_the_rows_in_use_not_every_row_below_the_highest() -> None:
    """vLLM 0.34 hands slots out from the top: one request at slot 1023 copies one row."""
    buffers = MaskBuffers(1024, VOCAB)
    bitmask = buffers.acquire()
    bitmask[1023] = 7
    dev = copy_to_device(buffers, bitmask, copy_runs(np.array([1023])), torch.device("cpu"))
    assert buffers.rows_copied == 1 and int(dev[1023, 0]) == 7
    slots = np.array([1023, 1021, 1018, 700, 3])
    copy_to_device(buffers, bitmask, copy_runs(slots), torch.device("cpu"))
    assert buffers.rows_copied == 6 + 1 + 1  # 1018..1023, 700, 3
    copy_to_device(buffers, bitmask, 1024, torch.device("cpu"))  # the old way, for contrast
    assert buffers.rows_copied == 1024


class _Event:
    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        _Event.made.append(kwargs)

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def test_the_ports_events_block_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``async_utils`` uses blocking events "to avoid busy-polling the CUDA
    driver lock": so do the marker and the side reads."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    _Event.made.clear()
    port = vllm_v2_device.CudaPort(torch.device("cuda", 0))
    port.wait(port.mark())
    port.side(lambda: None)
    assert len(_Event.made) == 2 and all(e.get("blocking") for e in _Event.made)


def test_helper_threads_work_on_their_ranks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    vllm_v2.bind_device(torch.device("cuda", 3))
    vllm_v2.bind_device(torch.device("cpu"))
    assert chosen == [torch.device("cuda", 3)]


def test_the_apply_kernel_is_warmed_for_every_variant_a_step_launches() -> None:
    """One launch per (row count Triton specializes apart, with and without an index)."""
    launches: list[tuple[int, int, bool]] = []

    def kernel(logits: torch.Tensor, mask: torch.Tensor, vocab: int, index: Any) -> None:
        launches.append((logits.shape[0] if index is None else len(index), vocab,
                         index is not None))

    n = apply_mod.warm_device_apply(torch.device("cpu"), 1000, kernel=kernel)
    assert n == len(launches) == 2 * len(apply_mod.WARM_ROWS)
    assert {(rows, with_index) for rows, _, with_index in launches} == {
        (r, i) for r in apply_mod.WARM_ROWS for i in (False, True)}
    assert all(vocab == 1000 for _, vocab, _ in launches)
    assert apply_mod.warm_device_apply(torch.device("cpu"), 1000) == 0  # no kernel on CPU
