"""The CPU apply's plan, made on the fill thread: ``plan_cpu_apply`` expands a filled
bitmask into the flat logit indices ``kernels.apply`` masks CPU logits with, for one logits
layout (``LogitsLayout``), so that the apply on the critical path is only a memset of the
rows that allow few tokens, a gather/scatter of their allowed logits and a scatter of -inf
at the refused tokens of the other rows.

A leaf: it imports nothing of grammask. Whether a plan fits the logits of a step is the
apply's check (``kernels.apply``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

#: Cost model of the planned apply, per logit: a memset costs this fraction of one scattered
#: index, a kept logit two indexed accesses (gather before the memset, scatter after).
_WIPE_DIVISOR = 32
#: mask words the plan expands at a time (a chunk of rows; see ``plan_cpu_apply``)
_PLAN_CHUNK_BYTES = 1 << 18


class LogitsLayout(NamedTuple):
    """2-D CPU logits the planned apply takes: read once per apply (``apply.cpu_layout``)."""

    rows: int
    width: int
    stride: int  # of a row
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class CpuPlan:
    """A bitmask turned into flat logit indices for one logits layout (``plan_cpu_apply``).

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


def _flat_bits(words: np.ndarray[Any, np.dtype[np.uint32]]
               ) -> np.ndarray[Any, np.dtype[np.intp]]:
    """The position (``32 * word + bit``, words in row-major order) of every set bit of a
    2-D uint32 array, ascending.

    Only non-zero words are unpacked; ``nonzero`` runs on bool arrays (numpy's fast path)."""
    at = np.flatnonzero(words != 0)
    bits = np.unpackbits(words.ravel()[at].view(np.uint8), bitorder="little").view(np.bool_)
    found = np.flatnonzero(bits)
    flat: np.ndarray[Any, np.dtype[np.intp]] = (at[found >> 5] << 5) | (found & 31)
    return flat


def _logit_indices(words: np.ndarray[Any, np.dtype[np.uint32]],
                   rows: np.ndarray[Any, np.dtype[np.intp]],
                   counts: np.ndarray[Any, np.dtype[np.int64]],
                   stride: int) -> np.ndarray[Any, np.dtype[np.intp]]:
    """Flat logit indices (``rows[i] * stride + token``) of the set bits of ``words``: row
    ``i`` of it belongs to logits row ``rows[i]`` and has ``counts[i]`` bits set.

    Bit ``token`` of row ``i`` sits at ``i * 32 * nwords + token`` of ``words``: its index is
    that plus one offset per row, repeated over the row's bits (no division per bit to find
    its row)."""
    offsets = rows * stride - np.arange(len(rows), dtype=np.intp) * (words.shape[1] * 32)
    flat = _flat_bits(words)
    flat += np.repeat(offsets, counts)
    return flat


def plan_cpu_apply(bitmask: torch.Tensor, rows: Sequence[int], *, vocab_size: int, width: int,
                   stride: int) -> CpuPlan:
    """Expand ``bitmask[rows]`` into the indices ``apply_bitmask`` masks CPU logits with.

    The logits' layout (``width`` columns, rows ``stride`` elements apart) is fixed here.
    Each row takes the cheaper way by its allowed count ``k`` and refused count ``d``:
    wipe and restore (a memset of the row plus ``2k`` indexed accesses) or scatter -inf at
    the ``d`` refused tokens. Costs O(rows x words) numpy work; made on the fill thread, a
    few rows at a time (``_PLAN_CHUNK_BYTES`` of mask words): the temporaries then stay in
    cache and in the allocator's free lists, where whole-batch ones came back as fresh pages
    (page faults on every plan)."""
    covered = min(width, vocab_size, bitmask.shape[1] * 32)
    nwords = (covered + 31) // 32
    order = tuple(rows)
    index = np.asarray(order, dtype=np.intp)
    if index.size and (index.min() < 0 or index.max() >= bitmask.shape[0]):
        raise ValueError(f"row indices {index.min()}..{index.max()} outside bitmask "
                         f"{tuple(bitmask.shape)}")
    source = bitmask.numpy().view(np.uint32)
    tail = np.uint32((1 << (covered % 32)) - 1) if covered % 32 else np.uint32(0xFFFFFFFF)
    keeps: list[np.ndarray[Any, np.dtype[np.intp]]] = []
    kills: list[np.ndarray[Any, np.dtype[np.intp]]] = []
    wiped_rows: list[int] = []
    chunk = max(1, _PLAN_CHUNK_BYTES // (4 * max(1, nwords)))
    for lo in range(0, len(index), chunk):
        part = index[lo:lo + chunk]
        words = source[part, :nwords]  # a copy
        if nwords:
            words[:, -1] &= tail  # bits at or past ``covered`` never count
        allowed = np.bitwise_count(words).sum(axis=1, dtype=np.int64)
        wipe = 2 * allowed + width // _WIPE_DIVISOR < covered - allowed
        if wipe.any():
            wiped = part[wipe]
            keeps.append(_logit_indices(words[wipe], wiped, allowed[wipe], stride))
            wiped_rows += wiped.tolist()
        if not wipe.all():
            scattered = part[~wipe]
            refused = words[~wipe]  # a copy: inverted in place
            np.invert(refused, out=refused)
            if nwords:
                refused[:, -1] &= tail
            # ``words`` has no bit at or past ``covered``: each row refuses the rest
            kills.append(_logit_indices(refused, scattered, covered - allowed[~wipe], stride))
            if width > covered:  # model padding past the mask
                pad = np.arange(covered, width, dtype=np.intp)
                kills.append((scattered[:, None] * stride + pad).ravel())
    empty = np.zeros(0, dtype=np.intp)
    runs: list[tuple[int, int]] = []
    start = prev = -2
    for r in sorted(set(wiped_rows)):  # fill runs of consecutive rows at once
        if r != prev + 1:
            if prev >= 0:
                runs.append((start, prev + 1))
            start = r
        prev = r
    if wiped_rows:
        runs.append((start, prev + 1))
    return CpuPlan(order, stride, width, covered,
                   _joined(keeps, empty), _joined(kills, empty), tuple(runs),
                   int(index.max()) + 1 if index.size else 0,
                   np.asarray(wiped_rows, dtype=np.intp))


def _joined(parts: list[np.ndarray[Any, np.dtype[np.intp]]],
            empty: np.ndarray[Any, np.dtype[np.intp]]) -> np.ndarray[Any, np.dtype[np.intp]]:
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else empty
