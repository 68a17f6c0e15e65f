"""Masking logits with a filled bitmask: the apply side of a decode step, everything the
logits pass through.

- ``apply_pairs``: the one entry of the decode path: logits row ``at[i]`` masked with bitmask
  row ``rows[i]``, rows whose host left no token restored.
- ``apply_bitmask``: masks logits in place. CPU logits go through a ``CpuPlan`` (made on the
  fill thread by ``kernels.cpu_plan``) when one is given and fits, else through the CPU kernel
  a backend lent (``kernels.lent``; rows that allow few tokens memset and restored). CUDA
  logits take the mask rows in use to the device (``copy_to_device``) and use the lent device
  kernel (xgrammar's Triton kernel), torch where none is.
  ``llguidance.torch`` is deliberately never used: its first call runs ``torch.compile``.

The measurements behind these choices are in docs/benchmarks.md (CPU apply).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import torch

from .buffers import MaskBuffers
from .cpu_plan import CpuPlan, LogitsLayout
from .lent import LENT

log = logging.getLogger("grammask")

__all__ = ["apply_bitmask", "apply_pairs", "copy_runs", "copy_to_device", "cpu_layout",
           "restore_empty_rows", "stop_only", "warm_device_apply"]

#: Dtypes of the planned CPU apply (as same-width ints: -inf's bit pattern); anything else
#: goes through the torch fallback.
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: rows with at most this many non-zero words (or a quarter of them) take the memset path
_SPARSE_WORDS = 64
_INT_VIEW: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, int(np.array(-np.inf, np.float32).view(np.int32))),
    torch.float16: (torch.int16, int(np.array(-np.inf, np.float16).view(np.int16))),
    torch.bfloat16: (torch.int16, -128),  # 0xFF80
}


def cpu_layout(logits: torch.Tensor) -> LogitsLayout | None:
    """The layout of logits ``apply_bitmask`` masks through a ``CpuPlan``; None for others.

    Runs right after the forward, with cold caches, where attribute reads are dear: four
    reads, taken once and passed on (``is_cpu`` makes no ``torch.device`` object)."""
    shape = logits.shape
    if len(shape) != 2 or not logits.is_cpu:
        return None
    stride = logits.stride()
    dtype = logits.dtype
    if stride[1] != 1 or dtype not in _KERNEL_DTYPES:
        return None
    return LogitsLayout(shape[0], shape[1], stride[0], dtype)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *, vocab_size: int,
                  indices: Sequence[int] | None = None,
                  buffers: MaskBuffers | None = None, plan: CpuPlan | None = None,
                  layout: LogitsLayout | None = None) -> None:
    """Set ``logits[i, j] = -inf`` where bit ``j`` of ``bitmask[i]`` is clear, in place.

    - ``indices``: only these rows of ``logits`` are masked (row ``i`` of the logits uses row
      ``i`` of the bitmask); None masks rows ``0 .. logits.shape[0]-1``.
    - Padding: columns at or past ``vocab_size`` (model padding wider than the mask) become
      -inf in masked rows; a mask wider than the logits is cut to the logits' width.
    - Dtypes: fp32/fp16/bf16 through the kernels; other float dtypes through a torch fallback.
    - Device: CPU logits go through ``plan``, a ``CpuPlan`` made ahead by ``plan_cpu_apply``
      from this bitmask's current contents (the fill thread does, when the forward leaves it
      time), when it fits these logits (``layout``: theirs, from ``cpu_layout``, when the
      caller has read it already) and rows; else through a lent CPU kernel, with
      rows that allow few tokens memset and restored. CUDA logits copy the (pinned) bitmask to the
      device and use the Triton kernel: that branch is untested here (no GPU).
    """
    if plan is not None:  # first: it reads neither the bitmask nor more of the logits
        layout = cpu_layout(logits) if layout is None else layout  # None unless 2-D CPU
        if layout is not None and _plan_holds(layout, bitmask, vocab_size, indices, plan):
            _apply_plan(logits, plan, layout)  # the plan covers the padding columns
            return
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"expected 2-D logits and a 2-D int32 bitmask, got {tuple(logits.shape)}"
                         f" and {tuple(bitmask.shape)} {bitmask.dtype}")
    if not logits.is_cpu:
        _apply_device(logits, bitmask, vocab_size, indices, buffers)
        return
    rows = list(range(logits.shape[0])) if indices is None else list(indices)
    if not rows:
        return
    if max(rows) >= min(logits.shape[0], bitmask.shape[0]) or min(rows) < 0:
        raise ValueError(f"row indices {min(rows)}..{max(rows)} outside logits "
                         f"{tuple(logits.shape)} / bitmask {tuple(bitmask.shape)}")
    width = logits.shape[1]
    covered = min(width, vocab_size, bitmask.shape[1] * 32)
    if logits.dtype in _KERNEL_DTYPES and logits.stride(1) == 1:
        # no plan made ahead (or not for these logits): planning here would cost more than
        # it saves
        _apply_cpu(logits, bitmask, covered, rows)
    else:
        _apply_torch(logits, bitmask, covered, rows)
    if width > covered:
        index = torch.tensor(rows, device=logits.device)
        logits[index, covered:] = float("-inf")


def apply_pairs(logits: torch.Tensor, bitmask: torch.Tensor, at: np.ndarray[Any, Any] | None,
                rows: np.ndarray[Any, Any] | Sequence[int], *, vocab_size: int,
                buffers: MaskBuffers | None = None, plan: CpuPlan | None = None,
                layout: LogitsLayout | None = None,
                restore: Sequence[tuple[int, int]] = ()) -> tuple[LogitsLayout | None, int]:
    """Mask logits row ``at[i]`` with bitmask row ``rows[i]``, in place: the one apply of the
    decode path, whether logits rows are the processor's rows (``at`` None: logits row
    ``rows[i]`` takes bitmask row ``rows[i]``, ``rows`` sorted; the V1 runner, transformers,
    a bitmask laid out in the logits' order) or the host's own order (vLLM's V2 runner: rows
    are request slots, logits are in batch order; draft positions). Both int, distinct, of
    equal length. ``buffers``: ``bitmask``'s owner (its device copies; CUDA only).

    No Python work per row: CPU logits go through ``plan`` (made for ``rows`` on the fill
    thread) with its flat indices moved to the logits rows in one numpy pass; without a
    plan that holds, through ``apply_bitmask``'s kernels on the mask rows gathered into the
    logits' order. CUDA logits: the bitmask is copied once (pinned, non-blocking), gathered
    into the logits' order on the device, and masked by the kernel. Raises ValueError for
    rows outside the logits or the bitmask.

    ``restore``: (logits row, mask row) pairs whose grammar wins over the host's own
    processors (``restore_empty_rows``, after masking). Returns (the logits' layout,
    ``cpu_layout``; rows restored)."""
    _mask_pairs(logits, bitmask, at, rows, vocab_size=vocab_size, buffers=buffers, plan=plan,
                layout=layout)
    restored = restore_empty_rows(logits, bitmask, restore, vocab_size=vocab_size)
    return (cpu_layout(logits) if layout is None else layout), restored


def _mask_pairs(logits: torch.Tensor, bitmask: torch.Tensor, at: np.ndarray[Any, Any] | None,
                rows: np.ndarray[Any, Any] | Sequence[int], *, vocab_size: int,
                buffers: MaskBuffers | None, plan: CpuPlan | None,
                layout: LogitsLayout | None) -> None:
    """``apply_pairs``' masking."""
    if at is None:
        if len(rows) == 0:
            return
        # every row of the logits, in order (``rows`` is sorted and distinct): no index
        every = layout is None and len(rows) == logits.shape[0]
        indices = None if every else rows if isinstance(rows, Sequence) else rows.tolist()
        apply_bitmask(logits, bitmask, vocab_size=vocab_size, indices=indices,
                      buffers=buffers, plan=plan, layout=layout)
        return
    rows = np.asarray(rows, dtype=np.intp)
    if at.size == 0:
        return
    if logits.is_cpu:
        if np.array_equal(at, rows):
            apply_bitmask(logits, bitmask, vocab_size=vocab_size, indices=at.tolist(),
                          plan=plan, layout=layout)
            return
        layout = cpu_layout(logits) if layout is None else layout
        if (plan is not None and layout is not None and plan.stride == layout.stride
                and plan.width == layout.width
                and plan.covered == min(layout.width, vocab_size, bitmask.shape[1] * 32)
                and int(at.max()) < layout.rows):
            if plan.rows == tuple(np.sort(rows).tolist()):
                _apply_plan_moved(logits, plan, layout, at, rows)
                return
            # the plan's rows and others (draft positions): the plan serves its own
            planned = np.isin(rows, plan.rows)
            if plan.rows == tuple(np.sort(rows[planned]).tolist()):
                _apply_plan_moved(logits, plan, layout, at[planned], rows[planned])
                at, rows = at[~planned], rows[~planned]
        ordered = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
        ordered[at] = bitmask.numpy()[rows]
        apply_bitmask(logits, torch.from_numpy(ordered), vocab_size=vocab_size,
                      indices=np.sort(at).tolist())
        return
    if buffers is not None:  # the rows in use, not every row up to the highest
        device_mask = copy_to_device(buffers, bitmask, copy_runs(rows), logits.device)
    else:
        device_mask = bitmask[:int(rows.max()) + 1].to(logits.device, non_blocking=True)
    index = torch.from_numpy(rows.astype(np.int64)).pin_memory().to(logits.device,
                                                                     non_blocking=True)
    spots = torch.from_numpy(at.astype(np.int64)).pin_memory().to(logits.device,
                                                                   non_blocking=True)
    ordered_dev = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32,
                             device=logits.device)
    ordered_dev.index_copy_(0, spots, device_mask.index_select(0, index))
    _apply_device(logits, ordered_dev, vocab_size, np.sort(at), None)


def _apply_plan_moved(logits: torch.Tensor, plan: CpuPlan, layout: LogitsLayout,
                      at: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> None:
    """``_apply_plan`` for a plan made for bitmask rows ``rows``, applied at logits rows
    ``at``: each flat index ``row * stride + token`` becomes ``at_of[row] * stride + token``
    (one vectorized pass over the plan's indices); wiped rows are filled as a row set."""
    stride = plan.stride
    at_of = np.zeros(plan.bound, dtype=np.intp)
    at_of[rows] = at

    def moved(flat: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, np.dtype[np.intp]]:
        row, token = np.divmod(flat, stride)
        return at_of[row] * stride + token

    int_dtype, minus_inf = _INT_VIEW[layout.dtype]
    base = logits.detach() if logits.requires_grad else logits
    view = base.as_strided(((layout.rows - 1) * stride + layout.width,), (1,),
                           logits.storage_offset()).view(int_dtype).numpy()
    keep = moved(plan.keep) if plan.keep.size else None
    saved = view[keep] if keep is not None else None
    if plan.wiped is not None and plan.wiped.size:  # a row fill per wiped row, in numpy
        rows2d = np.lib.stride_tricks.as_strided(
            view, (layout.rows, layout.width), (stride * view.itemsize, view.itemsize))
        rows2d[at_of[plan.wiped]] = minus_inf
    if saved is not None:
        view[keep] = saved
    if plan.kill.size:
        view[moved(plan.kill)] = minus_inf


def _plan_holds(layout: LogitsLayout, bitmask: torch.Tensor, vocab_size: int,
                indices: Sequence[int] | None, plan: CpuPlan) -> bool:
    """Whether ``plan`` masks exactly these rows of logits laid out as ``layout``: checks in
    O(1) plus one compare of the rows (on the critical path, right after the forward)."""
    rows = tuple(range(layout.rows)) if indices is None else tuple(indices)
    words = bitmask.shape
    return (bool(rows) and len(words) == 2 and plan.bound <= words[0]
            and plan.bound <= layout.rows and layout.stride == plan.stride
            and layout.width == plan.width and rows == plan.rows
            and plan.covered == min(layout.width, vocab_size, words[1] * 32))


def restore_empty_rows(logits: torch.Tensor, bitmask: torch.Tensor,
                       pairs: Sequence[tuple[int, int]], *, vocab_size: int) -> int:
    """The grammar wins: a masked logits row with no finite logit left (the host's own
    processors forbade every token the grammar allows: ``min_tokens`` hiding the stop a
    finished grammar needs, ``allowed_token_ids``, ``bad_words``, a ``logit_bias``) gets the
    grammar's tokens back at logit 0, uniform among them, so the sampler never picks an
    arbitrary token. ``pairs``: (logits row, bitmask row), already masked.

    Returns how many rows were restored (CPU); on a device it does not synchronise to count
    and returns -1. Cost: one pass over the listed rows (hosts list only rows whose requests
    carry such options)."""
    if not pairs:
        return 0
    at = torch.tensor([a for a, _ in pairs], device=logits.device)
    sub = logits.index_select(0, at)
    empty = torch.isneginf(sub).all(dim=-1)
    on_cpu = logits.device.type == "cpu"
    if on_cpu and not bool(empty.any()):
        return 0
    width = logits.shape[1]
    covered = min(width, vocab_size, bitmask.shape[1] * 32)
    bits = bitmask.index_select(0, torch.tensor([r for _, r in pairs])).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(pairs), -1)[:, :covered]
    if covered < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - covered), value=False)
    restored = torch.where(empty.unsqueeze(-1) & allowed,
                           torch.zeros((), dtype=sub.dtype, device=sub.device), sub)
    logits.index_copy_(0, at, restored)
    return int(empty.sum()) if on_cpu else -1


def _apply_plan(logits: torch.Tensor, plan: CpuPlan, layout: LogitsLayout) -> None:
    """The critical-path part of the CPU apply: gather, memset, scatter (numpy indexing on
    a same-width integer view of the logits' storage: exact for every value, NaN included;
    numpy's indexing calls cost far less than torch's: docs/benchmarks.md, CPU apply)."""
    int_dtype, minus_inf = _INT_VIEW[layout.dtype]
    stride = plan.stride
    base = logits.detach() if logits.requires_grad else logits
    if stride == layout.width:  # rows back to back: the flat view is a reshape
        view = base.view(int_dtype).numpy().reshape(-1)
    else:  # the rows' storage as one flat view (rows strided apart, columns are not)
        view = base.as_strided(((layout.rows - 1) * stride + layout.width,), (1,),
                               logits.storage_offset()).view(int_dtype).numpy()
    keep = plan.keep
    saved = view[keep] if keep.size else None
    for start, stop in plan.runs:
        logits[start:stop].fill_(float("-inf"))
    if saved is not None:
        view[keep] = saved
    if plan.kill.size:
        view[plan.kill] = minus_inf


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, covered: int,
               rows: list[int]) -> None:
    """CPU apply, split by how much a row allows.

    The lent kernel (xgrammar's) skips all-ones words but writes -inf one element at a time:
    it is fast for rows that allow most tokens (free text) and slow for the common structural
    rows that allow a handful. Those *sparse* rows are instead saved at their allowed ids, filled
    with -inf wholesale (a memset, the cheapest write there is) and restored. The index work
    is done in numpy: its calls cost far less than torch's (docs/benchmarks.md, CPU apply)."""
    nwords = (covered + 31) // 32
    words = bitmask.numpy()[rows, :nwords]
    flags = np.count_nonzero(words, axis=1) <= max(_SPARSE_WORDS, nwords // 4)
    sparse_rows = [r for r, s in zip(rows, flags.tolist(), strict=True) if s]
    if len(sparse_rows) < len(rows):
        dense = [r for r, s in zip(rows, flags.tolist(), strict=True) if not s]
        if LENT.cpu is not None:
            LENT.cpu(logits, bitmask, covered, dense)
        else:
            _apply_torch(logits, bitmask, covered, dense)
        if not sparse_rows:
            return
        words = words[flags]
    at = np.flatnonzero(words != 0)
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


def _apply_device(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                  indices: Sequence[int] | np.ndarray[Any, Any] | None,
                  buffers: MaskBuffers | None) -> None:
    """CUDA logits: the (pinned) bitmask copied without blocking, then the lent device
    kernel called directly (its generic entry point checks and picks a backend on every
    call). Rows are checked in numpy (no Python work per row); no index at all when they are
    every row of the logits in order (the common case), else a pinned index copied without
    blocking."""
    n = logits.shape[0]
    if indices is None:
        index_np = None
        bound = n
    else:
        index_np = np.asarray(indices, dtype=np.int32)
        if index_np.size == 0:
            return
        lo, bound = int(index_np.min()), int(index_np.max()) + 1
        if lo < 0 or bound > min(n, bitmask.shape[0]):
            raise ValueError(f"row indices {lo}..{bound - 1} outside logits "
                             f"{tuple(logits.shape)} / bitmask {tuple(bitmask.shape)}")
        if index_np.size == n and lo == 0 and bound == n and (
                n == 1 or bool((index_np[1:] > index_np[:-1]).all())):
            index_np = None  # 0..n-1 in order: every row
    width = logits.shape[1]
    covered = min(width, vocab_size, bitmask.shape[1] * 32)
    device_mask = (copy_to_device(buffers, bitmask, bound, logits.device)
                   if buffers is not None
                   else bitmask[:bound].to(logits.device, non_blocking=True))
    index = None
    if index_np is not None:
        index = torch.from_numpy(index_np).pin_memory().to(logits.device, non_blocking=True)
    kernel = _device_kernel()
    if kernel is not None:
        kernel(logits, device_mask, covered, index)
    else:
        _apply_torch(logits, device_mask, covered,
                     list(range(n)) if index is None else index.tolist())
    if width > covered:  # model padding past the mask
        if index is None:
            logits[:, covered:] = float("-inf")
        else:
            logits[index.long(), covered:] = float("-inf")


def copy_to_device(buffers: MaskBuffers, bitmask: torch.Tensor,
                   rows: int | Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Copy the first ``rows`` rows of ``bitmask`` (one of ``buffers``; or the row ranges
    ``[lo, hi)`` given, ``copy_runs``) to ``device`` without blocking the host, into a device
    buffer kept across steps on ``buffers`` (stream order keeps it safe; rows not copied hold
    stale bits), and mark the host buffer busy until the copy ran
    (``MaskBuffers.copy_queued``)."""
    runs = [(0, rows)] if isinstance(rows, int) else list(rows)
    top = max((hi for _, hi in runs), default=0)
    dev = buffers.device_copy
    if (dev is None or dev.device != device or dev.shape[0] < top
            or dev.shape[1] != bitmask.shape[1]):
        dev = buffers.device_copy = torch.empty(max(top, buffers.max_batch), bitmask.shape[1],
                                                dtype=torch.int32, device=device)
    for lo, hi in runs:
        dev[lo:hi].copy_(bitmask[lo:hi], non_blocking=True)
    buffers.rows_copied = sum(hi - lo for lo, hi in runs)
    if device.type == "cuda":  # else a synchronous copy: nothing to wait for
        buffers.copy_queued(bitmask)
    return dev


def copy_runs(rows: np.ndarray[Any, Any], *, gap: int = 8, most: int = 16
              ) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering ``rows`` for a device copy that follows the rows in
    use, not the highest of them (vLLM 0.34 hands slots out from the top of its free list:
    one request at slot 1023 would copy 1,024 rows). Ranges less than ``gap`` rows apart
    are joined (a copy call costs more than a few rows); at most ``most`` ranges, the
    closest joined first."""
    if rows.size == 0:
        return []
    ordered = np.unique(rows)
    breaks = np.flatnonzero(np.diff(ordered) > gap)
    if breaks.size >= most:  # keep the ``most - 1`` widest gaps as breaks
        widths = np.diff(ordered)[breaks]
        breaks = np.sort(breaks[np.argsort(widths, kind="stable")[-(most - 1):]])
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [ordered.size - 1]))
    return [(int(ordered[a]), int(ordered[b]) + 1) for a, b in zip(starts, ends, strict=True)]


def stop_only(logits: torch.Tensor, rows: Sequence[int], stop_ids: Sequence[int]) -> None:
    """The emergency mask, in place: only the stop tokens in logits ``rows`` (their
    requests end now; an adapter's own failure, where no bitmask can be trusted). A row
    whose stops the host already forbade (vLLM's ``min_tokens`` masks them before the
    processors run) gets them at logit 0: never a row with no finite logit, from which a
    sampler picks an arbitrary token."""
    if not rows or not stop_ids:
        return
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    stops = torch.tensor(list(stop_ids), dtype=torch.int64, device=logits.device)
    block = logits[index]
    kept = block[:, stops]
    kept = torch.where(torch.isneginf(kept).all(dim=-1, keepdim=True),
                       torch.zeros((), dtype=kept.dtype, device=kept.device), kept)
    block.fill_(float("-inf"))
    block[:, stops] = kept
    logits[index] = block


#: Row counts the apply kernel is warmed for: Triton specializes an int argument that is 1
#: and one divisible by 16 apart from the others, and the kernel with and without an index
#: apart: these counts with both reach every variant a step can launch.
WARM_ROWS = (1, 2, 16)


def warm_device_apply(device: torch.device, vocab_size: int, *,
                      dtype: torch.dtype = torch.float32, kernel: Any = None) -> int:
    """Compile the device apply kernel for ``vocab_size`` logits of ``dtype`` on ``device``
    before the first step (a first constrained step would pay the JIT compile, and each new
    specialization again); returns the launches made (0 off CUDA or without Triton).
    ``kernel``: the one to warm (default: the device kernel a backend lent, on CUDA). A failure is
    logged, never raised: the first step compiles instead."""
    if kernel is None and device.type == "cuda":
        kernel = _device_kernel()
    if kernel is None:
        return 0
    launches = 0
    try:
        words = (vocab_size + 31) // 32
        for rows in WARM_ROWS:
            logits = torch.zeros(rows + 1, vocab_size, dtype=dtype, device=device)
            mask = torch.full((rows + 1, words), -1, dtype=torch.int32, device=device)
            kernel(logits[:rows], mask[:rows], vocab_size, None)
            index = torch.arange(rows, dtype=torch.int32, device=device)
            kernel(logits, mask, vocab_size, index)
            launches += 2
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # never fatal: the first step compiles instead
        log.warning("grammask: warming the apply kernel failed: %s", exc)
    return launches


def _device_kernel() -> Any:
    """The device apply kernel a backend lent (``kernels.lent``), or None."""
    getter = LENT.device
    return None if getter is None else _cached_device(getter)


@cache
def _cached_device(getter: Any) -> Any:
    return getter()
