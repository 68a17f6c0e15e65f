"""The contract every backend adapter keeps; the rest of grammask sees only these names.

Semantics shared by both backends (tests/backends/test_base.py holds both to every line):

- ``Matcher.accept(token)`` returns False and leaves the state *unchanged* when the token is not
  allowed, and equally for an id that is no token at all (``< 0``, ``>= vocab_size``, not an
  ``int``): xgrammar would wrap ``2**32 + i`` to token ``i``, llguidance would die on it.
- A stop token (``Vocabulary.stop_ids``) is allowed only where the grammar may end; accepting it
  terminates the matcher. Once terminated, only stop tokens are allowed and accepted (force EOS),
  and ``rollback`` can step back over them. ``is_terminated()`` is True only after a stop token
  was accepted (or llguidance lost the parse); a grammar that is merely complete (``abc``
  after ``abc``) is ``can_terminate()``, on both backends.
- ``rollback(n)`` undoes exactly the last ``n`` accepted tokens; ``n`` must be an ``int`` with
  ``0 <= n <=`` the tokens accepted since the start or last ``reset`` (both adapters say how
  many: ``accepted()``), else ``ValueError`` and the state is unchanged.
- ``fill(bitmask, row)`` writes one row of a CPU, C-contiguous int32 bitmask shaped
  ``(batch, ceil(vocab_size / 32))``, ``0 <= row < batch``; anything else is a ``ValueError``
  raised before any write (backends write through raw pointers: a uint8 or strided tensor
  would be corrupted, or the heap). Bit ``i % 32`` of word ``i // 32`` set means token ``i``
  is allowed. Ids past the tokenizer (model padding) and special tokens are never set. The
  checks are attribute reads only (the fill is the hot path). Both backends release the GIL
  while filling, so a fill thread overlaps the model's forward.
- Matchers are not thread-safe: one thread drives one matcher at a time. ``fork`` gives an
  independent copy in the same state (same mask, same ``accepted()``, same termination).
- ``BackendGrammar`` is immutable and shared across threads; ``matcher()`` is cheap. A grammar
  whose language is empty (no token and no stop is allowed at the start: ``root ::= root``)
  never compiles: ``UnsupportedError`` (a row masked to all zeros would have every logit -inf).
- Batch calls are a capability (``capabilities.BatchCalls``, found by ``batch_calls``): a
  matcher class may offer ``batch_fill(rows, bitmask, threads, state)``, many
  ``(matcher, row)`` of that class filled at once by the backend (xgrammar
  ``BatchGrammarMatcher``, llguidance ``LLExecutor``) under the same bitmask checks as
  ``fill``, and ``batch_accept(matchers, tokens)``, one token each, as ``accept`` would.
  Both exist so that the fill thread's work is a few native calls that release the GIL, not
  Python per row: a model runner's busy thread would otherwise starve it. ``decode.fill.Filler``
  and ``rows.advance_all`` group matchers by class; they never see a concrete class.
- ``native`` (both adapters) is the backend's own matcher, for the batch-parallel fills
  (and benchmarks) only: a caller must not advance it (the adapter's counters would go stale).
- ``BackendMatcher`` keeps what both adapters share (the checks, the counters, ``rollback``,
  ``fork`` and ``reset`` around them); an adapter gives its three ``_native_*`` hooks.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading
from collections.abc import Sequence
from typing import Any, Protocol, Self

import numpy as np
import torch

from ..errors import UnsupportedError
from ..specs.grammar_spec import BackendName, GrammarSpec
from ..vocab import Vocabulary

# the capabilities, typed in their own light module (the registry derives its flags there)
from .capabilities import BatchCalls as BatchCalls
from .capabilities import DiskBackend as DiskBackend
from .capabilities import Warnings as Warnings
from .capabilities import batch_calls as batch_calls


class Matcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the token is not allowed or is
        not a token id of the vocabulary."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]``;
        ``ValueError`` (nothing written) for a bitmask or row outside the contract."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens; ``ValueError`` (state unchanged) when
        ``num_tokens`` is negative or more than were accepted."""

    def is_terminated(self) -> bool:
        """A stop token has been accepted; only stop tokens are allowed from now on."""

    def can_terminate(self) -> bool:
        """The text so far is complete: a stop token would be accepted now."""

    def fork(self) -> Matcher:
        """An independent copy in the same state."""

    def reset(self) -> None:
        """Back to the start state."""

    def release(self) -> None:
        """The owner is done with the matcher: its backend state may go back to its grammar
        for the next request (xgrammar: a reset costs a small fraction of making one;
        docs/benchmarks.md, Figures: decode host path). It must not be
        used again: both adapters then raise RuntimeError on any call."""


class BackendGrammar(Protocol):
    backend: BackendName
    memory_bytes: int

    def matcher(self) -> Matcher:
        """A fresh matcher at the start state."""


class Backend(Protocol):
    name: BackendName

    def prepare(self, vocab: Vocabulary) -> None:
        """Build this backend's view of the vocabulary (kept on it by ``Vocabulary.view``;
        seconds, once), so that no request's deadline pays for it."""

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool) -> BackendGrammar:
        """Compile for one vocabulary; raises a ``GrammarError`` subclass on bad input, and
        ``UnsupportedError`` when the grammar's language is empty.

        ``lenient`` asks the backend to ignore keywords it cannot enforce instead of refusing
        (the router lists them as unenforced)."""

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        """Cheap syntax check without a vocabulary (request validation); raises GrammarError.

        ``lenient`` as in ``compile``: a check must refuse exactly what a compile would."""


#: rows to fill through one matcher class's batch fill: ``(matcher, batch row)`` lists
BatchFills = dict[type[BatchCalls], list[tuple[Matcher, int]]]


class SpareBudget:
    """How many released native matchers (``Matcher.release``) the process keeps, across
    every grammar: the default bounds the memory they hold at worst to a small share of a
    serving process (an xgrammar matcher's size: docs/benchmarks.md, Figures: decode host
    path). A grammar keeps at most ``per_grammar`` (a large batch of short requests gives
    many back a step). Past the budget a released matcher is freed:
    the next request makes one, as without recycling."""

    def __init__(self, limit: int = 2048, per_grammar: int = 512) -> None:
        self.limit = limit
        self.per_grammar = per_grammar
        self.kept = 0
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        """One more kept matcher, if the budget allows."""
        with self._lock:
            if self.kept >= self.limit:
                return False
            self.kept += 1
            return True

    def free(self, count: int = 1) -> None:
        """``count`` kept matchers were taken again or dropped with their grammar."""
        with self._lock:
            self.kept -= count


#: the process's budget of kept matchers (``SpareBudget``)
SPARES = SpareBudget()

#: ``ctypes.memmove`` that keeps the GIL (a ``PYFUNCTYPE`` call: ``ctypes.memmove`` lets it go
#: and takes it back, which beside a host thread running Python waits for that thread): a
#: row's copy is a few microseconds
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t)(ctypes._memmove_addr)  # type: ignore[attr-defined]


class _Released:
    """Stands in for a released matcher's backend state: any use raises, so a stray
    reference to a recycled matcher fails loudly instead of advancing another request."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this matcher was released (Matcher.release) and cannot be used")


RELEASED: Any = _Released()


class BackendMatcher:
    """The shared half of both adapters: argument checks of the contract, and the counters
    backends do not keep (stop tokens accepted after termination are no-ops to the backends;
    tracking them, and the tokens the backend consumed, keeps rollback exact and checkable).

    Subclasses give ``native``, the backend's own matcher."""

    #: why the backend lost the parse (a dead end), once it has; None while it has not. A
    #: class attribute here: asked for every row of every step, found at once for backends
    #: that never set it
    failure: str | None = None

    def __init__(self, stop_ids: tuple[int, ...], vocab_size: int) -> None:
        self._stop_ids = stop_ids
        self._vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._extra_stops = 0
        self._depth = 0  # tokens the backend consumed (stop tokens after the end excluded)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` (checked first: xgrammar raises a bare RuntimeError
        past them, llguidance dies silently): stop tokens accepted after the end are only
        counted, the rest the backend undoes (``_native_rollback``)."""
        n = self._rollback_count(num_tokens)
        undo_extra = min(n, self._extra_stops)
        self._extra_stops -= undo_extra
        if n - undo_extra:
            self._native_rollback(n - undo_extra)
            self._depth -= n - undo_extra

    def release(self) -> None:
        """Nothing to give back by default (``Matcher.release``); an adapter that recycles
        overrides it."""

    def fork(self) -> Self:
        """An independent copy in the same state: the backend's copy (``_native_fork``)
        with these counters."""
        twin = self._native_fork()
        twin._extra_stops = self._extra_stops
        twin._depth = self._depth
        return twin

    def reset(self) -> None:
        """Back to the start state, counters cleared (``_native_reset``)."""
        self._native_reset()
        self._extra_stops = 0
        self._depth = 0

    def _native_rollback(self, num_tokens: int) -> None:
        """Undo ``num_tokens`` (``1 <= num_tokens <= _depth``) tokens the backend consumed;
        ``_depth`` still counts them when called."""
        raise NotImplementedError

    def _native_fork(self) -> Self:
        """A matcher over a copy of the backend's matcher, with the adapter's own state;
        ``fork`` copies the shared counters."""
        raise NotImplementedError

    def _native_reset(self) -> None:
        """Reset the backend's matcher and the adapter's own state."""
        raise NotImplementedError

    def accepted(self) -> int:
        """Tokens accepted since the start (or the last reset): what ``rollback`` can undo."""
        return self._depth + self._extra_stops

    @property
    def native(self) -> object:
        """The backend's own matcher (xgrammar ``GrammarMatcher``, llguidance ``LLMatcher``),
        for batch fills only: advancing it would leave this adapter's counters stale."""
        raise NotImplementedError

    def _token(self, token_id: object) -> int | None:
        """The id as a Python int when it names a token of the vocabulary, else None."""
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            return None
        tid = operator.index(token_id)
        return tid if 0 <= tid < self._vocab_size else None

    def _rollback_count(self, num_tokens: object) -> int:
        if isinstance(num_tokens, bool) or not hasattr(num_tokens, "__index__"):
            raise ValueError(f"rollback: num_tokens must be an int, got "
                             f"{type(num_tokens).__name__}")
        n = operator.index(num_tokens)
        if not 0 <= n <= self.accepted():
            raise ValueError(f"rollback: num_tokens={n} is outside 0..{self.accepted()} "
                             "(the tokens accepted so far)")
        return n

    def _check_fill(self, bitmask: torch.Tensor, row: object) -> int:
        """Refuse what a backend would write wrongly or out of bounds: attribute reads only,
        and the cheap ones (a request's first fill runs on cold caches, where ``device.type``
        alone, which makes a ``torch.device``, costs far more than ``is_cpu``;
        docs/benchmarks.md, Figures: decode host path)."""
        if not isinstance(bitmask, torch.Tensor):
            raise ValueError(f"fill: bitmask must be a torch.Tensor, got "
                             f"{type(bitmask).__name__}")
        if bitmask.dtype is not torch.int32:
            raise ValueError(f"fill: bitmask dtype must be torch.int32, got {bitmask.dtype}")
        if not bitmask.is_cpu:
            raise ValueError(f"fill: bitmask must be on the CPU, got {bitmask.device}")
        shape = bitmask.shape
        if len(shape) != 2 or shape[1] != self._words:
            raise ValueError(f"fill: bitmask shape must be (batch, {self._words}) for vocab_size "
                             f"{self._vocab_size}, got {tuple(shape)}")
        if not bitmask.is_contiguous():
            raise ValueError(f"fill: bitmask must be contiguous, got strides "
                             f"{bitmask.stride()}")
        if isinstance(row, bool) or not hasattr(row, "__index__"):
            raise ValueError(f"fill: row must be an int, got {type(row).__name__}")
        index = operator.index(row)
        if not 0 <= index < shape[0]:
            raise ValueError(f"fill: row {index} is outside 0..{shape[0] - 1}")
        return index

    def _row_ptr(self, bitmask: torch.Tensor, index: int) -> int:
        """The address of row ``index`` of a bitmask ``_check_fill`` passed (C-contiguous,
        ``_words`` int32 words per row): no row tensor is made."""
        return int(bitmask.data_ptr()) + index * self._words * 4

    def _copy_first(self, bitmask: torch.Tensor, index: int, first: FirstMask) -> None:
        """Write the start state's mask, computed once per grammar, into a checked row."""
        _memmove(self._row_ptr(bitmask, index), first.ptr, first.nbytes)

    def _stop_only(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the stop-only row into a checked row: a copy of a row made once per stop
        set and width (terminated rows are common at large batches: three torch ops per
        stop id cost far more than the copy; docs/benchmarks.md, Figures: decode host path)."""
        self._copy_first(bitmask, index, stop_only_first(self._stop_ids, self._words))


class FirstMask:
    """The start state's mask of a grammar, computed once at compile time (the empty-language
    check needs it): a request's first fill is then a copy. Read-only once made.

    A numpy row, not a tensor: on the cold path every framework call runs on cold caches,
    and torch's allocation and reduction cost far more there than numpy's
    (docs/benchmarks.md, Figures: cold path)."""

    __slots__ = ("nbytes", "ptr", "words")

    def __init__(self, words: np.ndarray[Any, np.dtype[np.int32]]) -> None:
        self.words = words  # one C-contiguous int32 bitmask row
        self.ptr = int(words.ctypes.data)
        self.nbytes = int(words.nbytes)

    def tensor(self) -> torch.Tensor:
        """The row as a ``(1, words)`` tensor sharing its memory (for xgrammar's fill)."""
        return torch.from_numpy(self.words).view(1, -1)


def new_first_mask(vocab_size: int) -> FirstMask:
    """A zeroed first mask for a vocabulary, for a backend to fill."""
    return FirstMask(np.zeros((vocab_size + 31) // 32, dtype=np.int32))


def refuse_empty_language(first_mask: FirstMask, backend: str, where: str | None) -> None:
    """A start state that allows no token and no stop: nothing can ever be generated, and a
    served row would mask every logit to -inf. Checked once per compile."""
    if not np.count_nonzero(first_mask.words):
        raise UnsupportedError(f"{backend}: the grammar's language is empty: nothing can be "
                               "generated (no token and no stop is allowed at the start)",
                               where=where)


@functools.lru_cache(maxsize=64)
def stop_only_first(stop_ids: tuple[int, ...], words: int) -> FirstMask:
    """The row that allows only ``stop_ids``, made once per stop set and width (read-only)."""
    row = np.zeros(words, dtype=np.uint32)
    for tid in stop_ids:
        if 0 <= tid < words * 32:
            row[tid >> 5] |= np.uint32(1 << (tid & 31))
    return FirstMask(row.view(np.int32))


def fill_stop_only(rows: Sequence[tuple[BackendMatcher, int]], bitmask: torch.Tensor) -> None:
    """``fill`` for terminated matchers (only their stop tokens are allowed): one indexed
    copy per stop set, not a copy per row (a batch of short requests ends many a step).
    ``ValueError`` (nothing written) as ``fill``."""
    check_batch(rows, bitmask)
    by_stops: dict[tuple[int, ...], list[int]] = {}
    for matcher, row in rows:
        by_stops.setdefault(matcher._stop_ids, []).append(row)
    words = bitmask.shape[1]
    # numpy's fancy assignment: far cheaper than torch's index_put here
    # (docs/benchmarks.md, Figures: decode host path)
    rows_view = bitmask.numpy()
    for stop_ids, indices in by_stops.items():
        rows_view[indices] = stop_only_first(stop_ids, words).words


def check_batch(rows: Sequence[tuple[BackendMatcher, int]], bitmask: torch.Tensor) -> None:
    """The ``fill`` checks for every row of a batch fill, before the backend writes any: the
    tensor's once (with the first row), then each row's index and each matcher's width."""
    if not rows:
        return
    first = rows[0][0]
    first._check_fill(bitmask, rows[0][1])  # the tensor's checks, once
    height, words = bitmask.shape[0], first._words
    for matcher, row in rows:
        if type(row) is not int or not 0 <= row < height or matcher._words != words:
            matcher._check_fill(bitmask, row)  # raises, naming what is wrong
