"""What a backend can do beyond the ``base`` contract, as typed protocols: the registry
derives a backend's flags from the classes it declares, and callers reach a capability only
through these names (never by probing attributes).

- ``BatchCalls``: its matcher class fills and advances many rows in a few native calls.
- ``FillLanes``: beside ``BatchCalls``, its rows' fills take turns on locks that rows share;
  the caller places the rows on fill threads by lock (``decode.fill.place_fills``).
- ``DiskBackend``: its adapter stores compiled grammars in grammask's disk cache (through a
  ``diskcache.DiskCodec`` of its own).
- ``Warnings``: its compiled grammar says what it ignored (a lenient compile's report).

Light on purpose (no backend, torch or numpy at import): ``registry`` imports it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..specs.grammar_spec import GrammarSpec
    from ..vocab import Vocabulary
    from .diskcache import DiskCache


@runtime_checkable
class BatchCalls(Protocol):
    """A matcher class's batch calls (classmethods; see ``base``'s contract)."""

    @classmethod
    def batch_fill(cls, rows: Sequence[tuple[Any, int]], bitmask: torch.Tensor,
                   threads: int | None, state: dict[str, Any]) -> None:
        """Write ``bitmask[row]`` for every ``(matcher, row)`` (rows distinct, matchers of this
        class, none terminated); ``threads``: 1 fills on the calling thread, None the
        backend's default (a class that offers ``FillLanes`` fills on the calling thread
        here: several threads are the caller's to place); ``state``: the caller's dict for
        the backend's reusable pools. ``ValueError`` (nothing written) for a bitmask or row
        outside ``fill``'s contract."""

    @classmethod
    def batch_accept(cls, matchers: Sequence[Any], tokens: Sequence[int]) -> list[bool]:
        """``[m.accept(t) for m, t in zip(matchers, tokens)]``, in fewer native calls."""


#: a row as ``FillLanes.fill_lanes`` describes it: ``(lock group, lane, (matcher, row))``
LaneRow = tuple[Hashable | None, int, tuple[Any, int]]
#: one fill thread's rows (``FillLanes.fill_shares``): ``((matcher, row), lane to fill on)``
FillShare = Sequence[tuple[tuple[Any, int], int]]


@runtime_checkable
class FillLanes(Protocol):
    """A ``BatchCalls`` matcher class whose fills take turns on locks that several rows
    share (llguidance: the copies of one template share its lexer), so that its rows fill
    on several threads only when placed by lock: the caller asks the backend for each row's
    lock group and lane (``fill_lanes``), places them (``decode.fill.place_fills``: backend
    knowledge stays here, the policy there) and hands the backend the shares
    (``fill_shares``), which moves the rows placed on another lane and fills natively."""

    @classmethod
    def fill_lanes(cls, rows: Sequence[tuple[Any, int]], bitmask: torch.Tensor,
                   threads: int | None) -> tuple[int, Sequence[LaneRow]] | None:
        """How ``rows`` (as ``batch_fill`` takes them) fill on several threads: the thread
        count (``threads``, None: the backend's default) and each row's ``(lock group, lane,
        (matcher, row))`` in the given order (a group of None: a row that cannot move),
        once the rows passed ``batch_fill``'s checks (``ValueError``, nothing written).
        None, nothing checked, when they fill on the calling thread instead (fewer than two
        rows, one thread, or a row whose fills must not run beside others: the caller then
        calls ``batch_fill``, which checks)."""

    @classmethod
    def fill_shares(cls, shares: Sequence[FillShare], bitmask: torch.Tensor,
                    state: dict[str, Any]) -> None:
        """Fill ``shares[k]`` on fill thread ``k`` (0: the calling thread; the backend's pool
        for the others, kept in ``state``): each row moved to its lane first where that is
        not its own (once: it stays there; a row that cannot move fills where it is, its
        mask exact all the same), then one native fill per thread. The rows are those of a
        ``fill_lanes`` answer, already checked."""


#: per protocol: matcher class -> the class, or None where it lacks the protocol's calls
_BATCH_CALLS: dict[type, Any] = {}
_FILL_LANES: dict[type, Any] = {}


def _offering(known: dict[type, Any], protocol: type, matcher_class: type | None) -> Any:
    """``matcher_class`` when it offers ``protocol``'s calls, else None (cached per class in
    ``known``: a structural check is dear, and this is asked once per row per step)."""
    if matcher_class is None:
        return None
    try:
        return known[matcher_class]
    except KeyError:
        found = known[matcher_class] = (matcher_class if issubclass(matcher_class, protocol)
                                        else None)
        return found


def batch_calls(matcher_class: type | None) -> type[BatchCalls] | None:
    """``matcher_class`` when it offers both batch calls, else None."""
    found: type[BatchCalls] | None = _offering(_BATCH_CALLS, BatchCalls, matcher_class)
    return found


def lane_calls(matcher_class: type | None) -> type[FillLanes] | None:
    """``matcher_class`` when it offers ``FillLanes``' calls, else None."""
    found: type[FillLanes] | None = _offering(_FILL_LANES, FillLanes, matcher_class)
    return found


@runtime_checkable
class DiskBackend(Protocol):
    """The disk capability of an adapter: compiled grammars as ``diskcache`` payloads. Both
    calls never raise: the cache is a bonus."""

    def load_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, *,
                      lenient: bool) -> Any:
        """A grammar (``base.BackendGrammar``) an earlier compile (any process) stored, or
        None."""

    def store_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary,
                       grammar: object, *, lenient: bool, compile_ms: float | None) -> bool:
        """Queue ``grammar`` for writing (off the request path); False when not queued."""


def has_disk(adapter_class: object) -> bool:
    """The adapter class offers ``DiskBackend``'s calls."""
    return isinstance(adapter_class, type) and issubclass(adapter_class, DiskBackend)


@runtime_checkable
class Warnings(Protocol):
    """A compiled grammar that reports what its backend ignored (llguidance's grammar
    warnings): read only when asked, after a lenient compile, never on every compile's
    path."""

    def warnings(self) -> list[str]:
        """What the backend ignored in the grammar, one message each."""


def has_warnings(compiled_class: type | None) -> bool:
    """The compiled-grammar class offers ``Warnings``."""
    return compiled_class is not None and issubclass(compiled_class, Warnings)
