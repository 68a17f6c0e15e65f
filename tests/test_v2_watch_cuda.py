"""The V2 adapter's token watch on a real CUDA stream (run by ``bench/gpu_check.sh``).

vLLM is not installed on the GPU machine, so the adapter is built without its plugin core:
the runner's buffers are plain CUDA tensors laid out as vLLM 0.34's ``RequestState`` holds
them, and the runner's step is replayed on the default stream in its order: this step's
sampler work, then ``post_update`` (the new length stored *before* the tokens, as the Triton
kernel does), then the next forward. The watch polls from its own thread and stream meanwhile;
``_sync`` (the next ``apply``) must then hold exactly the committed tokens, read either by the
watch (overlapped) or in stream order (its fallback). Skipped without CUDA.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from grammask.integrations.vllm_v2 import V2Batch, _Slot, _Windows


class _Proc:
    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.thread: set[str] = set()

    def step(self, rows: list[int]) -> None:
        self.steps.append(list(rows))
        self.thread.add(threading.current_thread().name)


def _batch(n: int, length: int) -> tuple[V2Batch, Any, _Proc]:
    device = torch.device("cuda")
    rs = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=torch.zeros(
        n, length, dtype=torch.int32, device=device)),
        total_len=SimpleNamespace(gpu=torch.zeros(n, dtype=torch.int32, device=device)),
        device=device)
    proc = _Proc()
    b = V2Batch.__new__(V2Batch)
    b.num_spec, b._window, b.rs, b.device, b._cuda = 0, 1, rs, device, True
    b.core = SimpleNamespace(processor=lambda: proc, active=True)  # type: ignore[assignment]
    b._slots, b._leaving, b._helper, b._watch = {}, set(), None, None
    b._tracked = np.zeros(n, dtype=bool)
    b._prefill = np.zeros(n, dtype=np.int64)
    b._windows = _Windows(rs, 1, n, stream=True)
    return b, rs, proc


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_the_watch_reads_exactly_the_committed_tokens(rows: int) -> None:
    n, length, prompt = max(rows, 4), 512, 8
    b, rs, proc = _batch(n, length)
    rng = random.Random(rows)
    slots = list(range(rows))
    for s in slots:
        st = _Slot(params=None, resumed=False, prompt_len=prompt,
                   prefill_len=prompt, wants_prompt=False, fetched=True, known=prompt,
                   added=True)
        b._slots[s] = st
    rs.total_len.gpu[:rows] = prompt
    # stale values where the tokens will land (a recycled slot's previous occupant)
    rs.all_token_ids.gpu[:rows] = torch.randint(0, 1000, (rows, length), dtype=torch.int32,
                                                device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    idx = torch.tensor(slots, device="cuda")
    overlapped = 0
    truth: dict[int, list[int]] = {s: [] for s in slots}
    for _ in range(40):
        b._start_watch(slots)  # end of apply(t)
        for _ in range(3):  # the sampler's kernels
            a = (a @ a).tanh_()
        tokens = [rng.randrange(0, 1000) for _ in slots]
        for s, t in zip(slots, tokens, strict=True):
            truth[s].append(t)
        old = rs.total_len.gpu[idx].long()
        rs.total_len.gpu[idx] += 1  # post_update: the length first ...
        a = (a @ a).tanh_()
        rs.all_token_ids.gpu[idx, old] = torch.tensor(tokens, dtype=torch.int32,
                                                      device="cuda")  # ... then the tokens
        for _ in range(10):  # the next forward
            a = (a @ a).tanh_()
        watch = b._watch
        b._sync()  # apply(t + 1)
        assert watch is not None and watch.future is not None
        overlapped += bool(watch.future.result())
    torch.cuda.synchronize()
    for s in slots:
        assert b._slots[s].output == truth[s], s
    assert len(proc.steps) == 40
    print(f"rows {rows}: {overlapped}/40 steps read by the watch (overlapped)")
    assert overlapped >= 20  # most steps overlap; the rest fell back, still exact
