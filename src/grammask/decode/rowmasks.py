"""Masks of rows their grammar does not fill: errored rows and thinking rows.

An errored row (``Row.fail``: sticky, never raised into the host) gets a stop-only mask under
``on_error="stop"``, so the request ends at once instead of running on unconstrained and
returning text that claims to follow the grammar; ``on_error="free"`` leaves it unmasked. A
thinking row is free, except with a byte marker: tokens that would end the marker inside
themselves are refused (``reasoning.BoundaryGuard``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from ..vocab import Vocabulary
from .filler import stop_only_row
from .reasoning import BoundaryGuard, Gate

ErrorPolicy = Literal["stop", "free"]


class RowMasks:
    """Writes those masks into a bitmask's rows (the step's buffer or a host-order one)."""

    def __init__(self, vocab: Vocabulary, on_error: ErrorPolicy) -> None:
        self.vocab = vocab
        self.on_error: ErrorPolicy = on_error
        self.stop_row = stop_only_row(vocab.stop_ids, vocab.vocab_size)
        self._guards: dict[bytes, BoundaryGuard] = {}  # one per byte marker

    def error(self, out: torch.Tensor, index: int) -> bool:
        """An errored row's mask: stop-only (True: mask the row), or none (False: ``free``)."""
        if self.on_error == "stop":
            out[index].copy_(self.stop_row)
            return True
        return False

    def error_or_free(self, out: torch.Tensor, index: int) -> None:
        """An errored row's mask where every row is masked (drafts): ``free`` is all ones."""
        if not self.error(out, index):
            out[index].fill_(-1)

    def guard(self, gate: Gate, out: torch.Tensor, index: int) -> bool:
        """A thinking row with a byte marker: refuse tokens that would end the marker inside
        themselves; and those the gate refuses (``RuleGate``: vLLM's masked implicit
        reasoning ends). False when nothing is refused (``out[index]`` is then untouched)."""
        ids = gate.refused()
        marker = gate.byte_marker
        if marker is not None:
            guard = self._guards.get(marker)
            if guard is None:
                guard = self._guards[marker] = BoundaryGuard(marker, self.vocab.tokens)
            ids = guard.forbidden(gate.marker_prefixes())
        if ids.size == 0:
            return False
        row = out[index]
        row.fill_(-1)
        words = row.numpy().view(np.uint32)
        np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return True
