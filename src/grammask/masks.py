"""Bitmask buffers, the fill worker thread, batch-parallel fills and the apply kernels.

Where each piece runs in a decode step:

- ``MaskBuffers``: int32 ``(max_batch, ceil(V/32))`` buffers allocated once and reused. Two of
  them alternate step by step, so a fill never writes a buffer whose host-to-device copy of the
  previous step may still be in flight (pinned memory, non-blocking copy). On CPU the second
  buffer is idle but keeps a single code path.
- ``FillWorker``: one dedicated daemon thread that runs the step's fill job while the caller's
  thread runs the model forward. Both engines release the GIL inside their fill, so the forward
  (which releases it inside torch kernels) and the fill really run at once.
- ``Filler``: fills a set of rows; above ``parallel_min`` matchers of one engine it hands them
  to that engine's batch-parallel fill (the backends' ``batch_fill`` capability: xgrammar
  ``BatchGrammarMatcher``, llguidance ``LLExecutor``), below it loops ``Matcher.fill``.
- ``apply_bitmask``: masks logits in place. CPU logits use xgrammar's CPU kernel (measured the
  fastest here). CUDA logits use the Triton kernel (untested: no GPU where this was written).
  ``llguidance.torch`` is deliberately never used: its first call runs ``torch.compile`` (~24 s).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import torch

from .backends.base import Matcher
from .bitmask import allocate_bitmask, bitmask_words, normal_tensors

T = TypeVar("T")

#: Dtypes xgrammar's CPU kernel handles; anything else goes through the torch fallback.
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Rows with at most this many non-zero mask words take the save / fill / restore path.
_SPARSE_WORDS = 64


class MaskBuffers:
    """``count`` reusable bitmasks; pinned when CUDA is present so device copies can overlap."""

    def __init__(self, max_batch: int, vocab_size: int, *, count: int = 2) -> None:
        if max_batch < 1 or count < 1:
            raise ValueError(f"need max_batch >= 1 and count >= 1, got {max_batch}, {count}")
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.pinned = torch.cuda.is_available()
        self._buffers = [allocate_bitmask(max_batch, vocab_size, pin=self.pinned)
                         for _ in range(count)]
        # GPU only (untested here): the copy of buffer i to the device, recorded by apply().
        self._copy_done: list[Any | None] = [None] * count
        self._next = 0

    @property
    def count(self) -> int:
        return len(self._buffers)

    def acquire(self) -> torch.Tensor:
        """The next buffer in turn, once no device copy still reads it."""
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._copy_done[index]
        if event is not None:  # GPU path: wait for the copy of two steps ago (releases the GIL)
            event.synchronize()
            self._copy_done[index] = None
        return self._buffers[index]

    def to_device(self, bitmask: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
        """Copy the first ``rows`` rows to ``device`` without blocking the host.

        GPU path, untested here (no CUDA on the development machine)."""
        copy = bitmask[:rows].to(device, non_blocking=True)
        for i, buf in enumerate(self._buffers):
            if buf.data_ptr() == bitmask.data_ptr():
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                self._copy_done[i] = event
        return copy


class FillWorker:
    """A dedicated thread that runs submitted jobs in order; results come back as futures.

    Jobs run without any lock of ours held, so the caller's thread is free to run the forward.
    """

    def __init__(self, name: str = "grammask-fill") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=_work, args=(self._jobs,), name=name,
                                        daemon=True)
        self._thread.start()
        # stop the thread when the worker is dropped without close()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def submit(self, job: Callable[[], T]) -> Future[T]:
        if not self._finalizer.alive:
            raise RuntimeError("the fill worker is closed")
        future: Future[T] = Future()
        self._jobs.put((job, future))
        return future

    def close(self, timeout: float | None = 5.0) -> None:
        if self._finalizer.alive:
            self._finalizer()
            self._thread.join(timeout)


def _work(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        job, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(job())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)


class Filler:
    """Fills the mask rows of many matchers, batch-parallel where that pays.

    ``parallel_min``: the fewest matchers of one engine that go through the engine's batch fill.
    None picks by the machine: ``bench/overlap.py`` measured the plain loop as fast or faster at
    every batch size on 2 cores (the fill thread already has the only spare core), so the batch
    fills are used from 32 rows only where at least 4 cores are available (not measured here).
    ``threads``: worker threads of the batch fills (None: the engine's default).
    """

    def __init__(self, *, parallel_min: int | None = None, threads: int | None = None) -> None:
        if parallel_min is None:
            parallel_min = 32 if _cores() >= 4 else 2**31
        self.parallel_min = max(1, parallel_min)
        self.threads = threads
        self._pools: dict[str, Any] = {}  # the engines' batch-fill pools, made on first use

    def fill(self, entries: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Write ``bitmask[row]`` for every ``(matcher, row)``; rows must be distinct.

        Matchers whose class offers ``batch_fill`` (the backend protocol's capability) are
        grouped by it; a group of at least ``parallel_min`` goes through it at once."""
        groups: dict[Any, list[tuple[Matcher, int]]] = {}
        rest: list[tuple[Matcher, int]] = []
        for matcher, row in entries:
            batch = getattr(type(matcher), "batch_fill", None)
            # terminated matchers take the adapters' stop-only path
            if batch is not None and not matcher.is_terminated():
                groups.setdefault(batch, []).append((matcher, row))
            else:
                rest.append((matcher, row))
        for batch, rows in groups.items():
            if len(rows) >= self.parallel_min:
                batch(rows, bitmask, self.threads, self._pools)
            else:
                rest.extend(rows)
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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *, vocab_size: int,
                  indices: Sequence[int] | None = None,
                  buffers: MaskBuffers | None = None) -> None:
    """Set ``logits[i, j] = -inf`` where bit ``j`` of ``bitmask[i]`` is clear, in place.

    - ``indices``: only these rows of ``logits`` are masked (row ``i`` of the logits uses row
      ``i`` of the bitmask); None masks rows ``0 .. logits.shape[0]-1``.
    - Padding: columns at or past ``vocab_size`` (model padding wider than the mask) become
      -inf in masked rows; a mask wider than the logits is cut to the logits' width.
    - Dtypes: fp32/fp16/bf16 through the kernels; other float dtypes through a torch fallback.
    - Device: CPU logits use xgrammar's CPU kernel. CUDA logits copy the (pinned) bitmask to
      the device and use the Triton kernel: that branch is untested here (no GPU).
    """
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"expected 2-D logits and a 2-D int32 bitmask, got {tuple(logits.shape)}"
                         f" and {tuple(bitmask.shape)} {bitmask.dtype}")
    rows = list(range(logits.shape[0])) if indices is None else list(indices)
    if not rows:
        return
    if max(rows) >= min(logits.shape[0], bitmask.shape[0]) or min(rows) < 0:
        raise ValueError(f"row indices {min(rows)}..{max(rows)} outside logits "
                         f"{tuple(logits.shape)} / bitmask {tuple(bitmask.shape)}")
    width = logits.shape[1]
    covered = min(width, vocab_size, bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        if logits.dtype in _KERNEL_DTYPES and logits.stride(1) == 1:
            _apply_cpu(logits, bitmask, covered, rows)
        else:
            _apply_torch(logits, bitmask, covered, rows)
    else:  # GPU path: untested here (no CUDA device on the development machine)
        device_mask = (buffers.to_device(bitmask, max(rows) + 1, logits.device)
                       if buffers is not None else
                       bitmask[:max(rows) + 1].to(logits.device, non_blocking=True))
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=covered,
                                        indices=None if indices is None else rows,
                                        backend="triton" if _has_triton() else "torch_native")
    if width > covered:
        index = torch.tensor(rows, device=logits.device)
        logits[index, covered:] = float("-inf")


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, covered: int,
               rows: list[int]) -> None:
    """CPU apply, split by how much a row allows.

    xgrammar's kernel skips all-ones words but writes -inf one element at a time, so it is
    fast for rows that allow most tokens (free text) and slow for the common structural rows
    that allow a handful. Those *sparse* rows are instead saved at their allowed ids, filled
    with -inf wholesale (a memset, the cheapest write there is) and restored. The index work
    is done in numpy: its calls cost ~1 us where torch's cost ~10 us."""
    nwords = (covered + 31) // 32
    words = bitmask.numpy()[rows, :nwords]
    flags = np.count_nonzero(words, axis=1) <= max(_SPARSE_WORDS, nwords // 4)
    sparse_rows = [r for r, s in zip(rows, flags.tolist(), strict=True) if s]
    if len(sparse_rows) < len(rows):
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )

        apply_token_bitmask_inplace_cpu(
            logits, bitmask, covered, [r for r, s in zip(rows, flags.tolist(), strict=True)
                                       if not s])
        if not sparse_rows:
            return
        words = words[flags]
    at = np.flatnonzero(words)
    bits = np.unpackbits(words.ravel()[at].view(np.uint8), bitorder="little").reshape(-1, 32)
    pair, bit = np.nonzero(bits)
    at = at[pair]
    token = (at % nwords) * 32 + bit
    if covered % 32:
        keep = token < covered
        token, at = token[keep], at[keep]
    stride = logits.stride(0)
    index = np.asarray(sparse_rows, dtype=np.int64)[at // nwords] * stride + token
    # the rows' storage as one flat view (rows may be strided apart, columns are not)
    flat = logits.as_strided(((logits.shape[0] - 1) * stride + logits.shape[1],), (1,),
                             logits.storage_offset())
    index_t = torch.from_numpy(index)
    saved = flat.take(index_t)
    start = prev = sparse_rows[0]
    for r in [*sparse_rows[1:], -1]:  # fill runs of consecutive rows at once
        if r != prev + 1:
            logits[start:prev + 1].fill_(float("-inf"))
            start = r
        prev = r
    flat.put_(index_t, saved)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, covered: int,
                 rows: list[int]) -> None:
    """Reference path for dtypes or layouts the kernel does not take."""
    index = torch.tensor(rows, device=logits.device)
    words = bitmask.to(logits.device)[index].to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :covered].bool()
    block = logits[index, :covered]
    block.masked_fill_(~allowed, float("-inf"))
    logits[index, :covered] = block


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
