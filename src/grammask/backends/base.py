"""The contract every engine adapter keeps; the rest of grammask sees only these names.

Semantics shared by both backends (tests hold both to them):

- ``Matcher.accept(token)`` returns False and leaves the state *unchanged* when the token is not
  allowed (llguidance's own ``consume_token`` would enter a sticky error state instead).
- A stop token (``Vocabulary.stop_ids``) is allowed only where the grammar may end; accepting it
  terminates the matcher. Once terminated, only stop tokens are allowed and accepted (force EOS),
  and ``rollback`` can step back over them.
- ``fill(bitmask, row)`` writes one row of an int32 bitmask shaped
  ``(batch, ceil(vocab_size / 32))`` on the CPU; bit ``i % 32`` of word ``i // 32`` set means
  token ``i`` is allowed. Ids past the tokenizer (model padding) and special tokens are never
  set. Both engines release the GIL while filling, so a fill thread overlaps the model's forward.
- Matchers are not thread-safe: one thread drives one matcher at a time. ``fork`` gives an
  independent copy (used by the mask audit and speculative decoding).
- ``CompiledGrammar`` is immutable and shared across threads; ``matcher()`` is cheap.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..spec import BackendName, GrammarSpec
from ..vocab import Vocabulary


class Matcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the token is not allowed."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]``."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """A stop token has been accepted; only stop tokens are allowed from now on."""

    def can_terminate(self) -> bool:
        """The text so far is complete: a stop token would be accepted now."""

    def fork(self) -> Matcher:
        """An independent copy in the same state."""

    def reset(self) -> None:
        """Back to the start state."""


class CompiledGrammar(Protocol):
    backend: BackendName
    memory_bytes: int

    def matcher(self) -> Matcher:
        """A fresh matcher at the start state."""


class Backend(Protocol):
    name: BackendName

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool) -> CompiledGrammar:
        """Compile for one vocabulary; raises a ``GrammarError`` subclass on bad input.

        ``lenient`` asks the engine to ignore keywords it cannot enforce instead of refusing
        (the router lists them as unenforced)."""

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        """Cheap syntax check without a vocabulary (request validation); raises GrammarError.

        ``lenient`` as in ``compile``: a check must refuse exactly what a compile would."""


class _EndTracking:
    """Stop tokens accepted after termination are no-ops the engines do not count; track them
    so rollback stays exact."""

    def __init__(self, stop_ids: tuple[int, ...]) -> None:
        self._stop_ids = stop_ids
        self._extra_stops = 0

    def _stop_only(self, bitmask: torch.Tensor, row: int) -> None:
        out = bitmask[row]
        out.zero_()
        for tid in self._stop_ids:
            out[tid >> 5] |= _bit(tid & 31)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as the signed value torch stores."""
    value = 1 << i
    return value - (1 << 32) if value >= 1 << 31 else value
