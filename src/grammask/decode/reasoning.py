"""The thinking gate: a request is unconstrained until its thinking section ends.

A reasoning model writes ``<think> ... </think>`` before its answer; only the answer follows
the grammar. Per request a ``ThinkGate`` watches the output tokens for the end marker:

- The marker is one token id (``</think>`` in Qwen3/3.5/3.6, DeepSeek-R1), matched on ids, or
  a text / token sequence that is not one token, matched on the decoded *bytes* so any
  tokenization (even one that splits the marker mid-token) is recognised.
- The prompt decides the start: the last turn of the prompt (the scan restarts at turn
  boundaries such as ``<|im_start|>``) that already closed thinking, e.g. the
  ``<think>\\n\\n</think>\\n\\n`` a chat template writes when thinking is disabled, makes the
  request constrained from its first token. A ``</think>`` of an earlier turn does not count.
  A raw prompt with no turn token and no thinking opener (``/v1/completions``) never entered
  reasoning: constrained from its first token too.
- ``thinking=False`` (per request) constrains from the first token regardless.

That rule is grammask's own, for grammask's own keys. A request taken over from vLLM's
structured outputs carries vLLM's decision instead (``ConstraintRequest.reasoning``) and the
host's ``ReasoningRule`` for it: its ``RuleGate`` starts and ends reasoning exactly where vLLM's
engine would (``StructuredOutputManager._get_constraint_bounds``), implicit ends included (a
Qwen3 ``<tool_call>`` ends reasoning and is the grammar's first token), and while it reasons
refuses the implicit ends the grammar cannot start with (vLLM 0.33+'s
``_masked_reasoning_ends``; until the grammar is at hand, every implicit end).

While thinking the matcher is neither masked nor advanced. The tokens that follow the marker in
the same step go to the matcher. A byte-matched marker must end at a token boundary: the rest
of a token that ends the marker inside itself (``>{`` for ``</reasoning>``) would be output
the grammar never saw. So while such a gate is open its row gets a mask that allows every
token except those (``BoundaryGuard``: a few tokens, depending on how much of the marker the
output already ends with); a host that samples one anyway gets ``leftover`` set, and the
processor fails that row rather than serve text outside the grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidSpecError
from ..specs.request import ReasoningRule
from ..vocab import Vocabulary

#: Turn-opening special tokens of common chat templates; present ones reset the prompt scan.
TURN_TOKENS = ("<|im_start|>", "<｜User｜>", "<｜Assistant｜>", "<|start_header_id|>",
               "<start_of_turn>", "<|start|>", "<|user|>", "<|assistant|>")
#: Thinking-opening tokens: after one, the prompt leaves the model thinking again.
START_TOKENS = ("<think>",)


@dataclass(frozen=True)
class ThinkMarker:
    """How one model marks the end of thinking, and how its prompts separate turns."""

    end_id: int | None
    end_bytes: bytes | None
    start_ids: frozenset[int] = frozenset()
    reset_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if (self.end_id is None) == (self.end_bytes is None) or self.end_bytes == b"":
            raise InvalidSpecError("a thinking end marker is one token id or non-empty text",
                                   where="think_end")

    @classmethod
    def for_vocab(cls, vocab: Vocabulary, end: str | int | Sequence[int] | None = None
                  ) -> ThinkMarker | None:
        """The marker for ``vocab``: ``end`` as a token id, a token sequence, or text
        (one token when the vocabulary has it, else matched on bytes); None uses
        ``vocab.think_end`` and gives None when the vocabulary has no thinking marker."""
        if end is None:
            end = vocab.think_end
            if end is None:
                return None
        starts = frozenset(_ids_of(vocab, START_TOKENS))
        resets = frozenset(_ids_of(vocab, TURN_TOKENS))
        if isinstance(end, int):
            if not 0 <= end < len(vocab.tokens):
                raise InvalidSpecError(f"think_end token id {end} is outside the vocabulary",
                                       where="think_end")
            return cls(end, None, starts, resets)
        if isinstance(end, str):
            if not end:
                raise InvalidSpecError("think_end must be non-empty", where="think_end")
            try:
                return cls(vocab.token_id(end), None, starts, resets)
            except InvalidSpecError:
                return cls(None, end.encode(), starts, resets)
        ids = list(end)
        if len(ids) == 1:
            return cls.for_vocab(vocab, ids[0])
        return cls(None, vocab.decode(ids), starts, resets)


class _Closes:
    """What both gates share: thinking until reasoning ends (``_closed``)."""

    _closed: bool

    @property
    def thinking(self) -> bool:
        return not self._closed


class ThinkGate(_Closes):
    """Per-request state: thinking (no mask) until the end marker, then constrained."""

    def __init__(self, marker: ThinkMarker, tokens: Sequence[bytes], *,
                 prompt_ids: Iterable[int] = (), thinking: bool = True) -> None:
        self._marker = marker
        self._tokens = tokens
        self._thinking_ids: list[int] = []  # output tokens seen while thinking (for rollback)
        self._tail = b""
        self.leftover = b""
        self.from_prompt = not thinking or _closed_in_prompt(marker, tokens, prompt_ids)
        self._closed = self.from_prompt

    @property
    def marker(self) -> ThinkMarker:
        return self._marker

    @property
    def byte_marker(self) -> bytes | None:
        """The marker when it is matched on bytes (its boundary tokens are refused)."""
        return self._marker.end_bytes

    def refused(self) -> np.ndarray:
        """Tokens refused while thinking besides the byte marker's boundary: none here."""
        return _NONE

    @property
    def thinking_tokens(self) -> int:
        """Output tokens that belonged to the thinking section (marker token included)."""
        return len(self._thinking_ids)

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Take newly generated tokens; return those after the end marker (for the matcher)."""
        if self._closed:
            return list(tokens)
        for i, tid in enumerate(tokens):
            self._thinking_ids.append(tid)
            if self._ends_at(tid):
                self._closed = True
                return list(tokens[i + 1:])
        return []

    def rollback(self, num_tokens: int, *, emptied: bool = False) -> None:
        """Forget the last ``num_tokens`` thinking tokens (reopens a gate the output closed).

        Tokens fed after the marker are the caller's to roll back first (``emptied``: all of
        them were; nothing here, since the marker is a thinking token)."""
        if num_tokens <= 0:
            return
        if self.from_prompt:
            raise ValueError("cannot roll back past the start of the output")
        if num_tokens > len(self._thinking_ids):
            raise ValueError(f"rollback of {num_tokens} tokens past the start of the output")
        del self._thinking_ids[len(self._thinking_ids) - num_tokens:]
        self._closed = False
        self.leftover = b""
        self._tail = b""
        if self._marker.end_bytes is not None:  # rebuild the byte tail from the kept tokens
            keep = len(self._marker.end_bytes) - 1
            data = b""
            for tid in reversed(self._thinking_ids):
                if len(data) >= keep:
                    break
                data = self._bytes(tid) + data
            self._tail = data[max(0, len(data) - keep):] if keep else b""

    def marker_prefixes(self) -> list[int]:
        """How much of a byte marker the output ends with: every ``j`` such that the output
        so far ends with the marker's first ``j`` bytes (several when the marker overlaps
        itself). Empty for token markers and closed gates."""
        marker = self._marker.end_bytes
        if marker is None or self._closed:
            return []
        tail = self._tail
        return [j for j in range(1, min(len(marker), len(tail) + 1))
                if tail.endswith(marker[:j])]

    def _ends_at(self, tid: int) -> bool:
        marker = self._marker
        if marker.end_bytes is None:
            return tid == marker.end_id
        data = self._tail + self._bytes(tid)
        at = data.find(marker.end_bytes)
        if at >= 0:
            self.leftover = data[at + len(marker.end_bytes):]
            return True
        keep = len(marker.end_bytes) - 1
        self._tail = data[max(0, len(data) - keep):] if keep else b""
        return False

    def _bytes(self, tid: int) -> bytes:
        return self._tokens[tid] if 0 <= tid < len(self._tokens) else b""


_NONE = np.zeros(0, dtype=np.int64)
#: Answers whether the grammar can start with each token: None while it is not at hand.
FirstTokens = Callable[[Sequence[int]], list[bool] | None]


class RuleGate(_Closes):
    """A request vLLM's engine would gate: reasoning until the host's ``ReasoningRule`` ends
    it, from where vLLM's decision (``VllmReasoning.ended``) starts it.

    The same interface as ``ThinkGate``. An implicit end (a token that ends reasoning and is
    content) goes to the matcher; an explicit one does not. While reasoning, ``refused()``
    holds the implicit ends the grammar cannot start with (asked once the grammar is at
    hand; every implicit end before)."""

    leftover = b""
    byte_marker = None

    def __init__(self, rule: ReasoningRule, prompt_ids: Sequence[int], ended: bool | None,
                 first_tokens: FirstTokens) -> None:
        self._rule = rule
        ids = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
        self.from_prompt = bool(ended) or (ended is None and rule.prompt_ended(ids))
        self._closed = self.from_prompt
        self._keep = rule.needs_history
        self._history = [int(t) for t in ids] if self._keep and not self._closed else []
        self._prompt_len = len(self._history)
        self._thinking = 0
        self._shared = False  # closed by an implicit end: the grammar's first token ended it
        self._implicit = sorted(rule.implicit_ends)
        self._first_tokens = first_tokens
        self._refused: np.ndarray | None = None if self._implicit else _NONE

    @property
    def thinking_tokens(self) -> int:
        return self._thinking

    def marker_prefixes(self) -> list[int]:
        return []

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Take newly committed tokens; return those the grammar takes."""
        if self._closed:
            return list(tokens)
        if not tokens:
            return []
        if self._keep:
            self._history.extend(int(t) for t in tokens)
        found = self._rule.grammar_start(self._history, tokens)
        if found is None:
            self._thinking += len(tokens)
            return []
        start, implicit = found
        self._closed = True
        self._shared = implicit and start < len(tokens)
        self._thinking += min(start, len(tokens))
        return list(tokens[start:])

    def rollback(self, num_tokens: int, *, emptied: bool = False) -> None:
        """Forget the last ``num_tokens`` reasoning tokens (reopens a gate the output
        closed). Tokens the grammar took are the caller's to roll back first; ``emptied``:
        all of them were, so a gate an implicit end closed reopens even for 0 (that end
        was the grammar's first token, and it is gone)."""
        if emptied and self._shared:
            self._shared = False
            self._closed = False
            if self._keep:
                del self._history[self._prompt_len + self._thinking:]
        if num_tokens <= 0:
            return
        if self.from_prompt:
            raise ValueError("cannot roll back past the start of the output")
        if num_tokens > self._thinking:
            raise ValueError(f"rollback of {num_tokens} tokens past the start of the output")
        self._thinking -= num_tokens
        if self._keep:
            del self._history[self._prompt_len + self._thinking:]
        self._closed = False

    def refused(self) -> np.ndarray:
        """The implicit ends refused while reasoning (vLLM's ``_masked_reasoning_ends``)."""
        if self._refused is not None:
            return self._refused
        starts = self._first_tokens(self._implicit)
        if starts is None:  # the grammar is not at hand yet: none may end reasoning
            return np.asarray(self._implicit, dtype=np.int64)
        self._refused = np.asarray([t for t, ok in zip(self._implicit, starts, strict=True)
                                    if not ok], dtype=np.int64)
        return self._refused


#: A row's thinking gate: grammask's own rule or the host's.
Gate = ThinkGate | RuleGate


def _closed_in_prompt(marker: ThinkMarker, tokens: Sequence[bytes],
                      prompt_ids: Iterable[int]) -> bool:
    """Whether the last turn of the prompt already ended thinking, or never opened it.

    Only the part after the last turn boundary or thinking opener is scanned (found from the
    end, so a long conversation costs little). A prompt with neither a turn token nor a
    thinking opener (a raw ``/v1/completions`` prompt, where no chat template ran) never
    entered reasoning: it is constrained from its first token. vLLM's engine waits for an end
    marker that never comes there and serves such requests unconstrained (vLLM #57726). This
    needs the vocabulary to have turn tokens; without any, every prompt would look raw."""
    ids = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
    boundaries = marker.reset_ids | marker.start_ids
    start = len(ids)
    while start > 0 and int(ids[start - 1]) not in boundaries:
        start -= 1
    if start == 0 and ids and marker.reset_ids:
        return True
    last_turn = [int(t) for t in ids[start:]]
    if marker.end_bytes is None:
        return marker.end_id in last_turn
    text = b"".join(tokens[t] for t in last_turn if 0 <= t < len(tokens))
    return marker.end_bytes in text


def _ids_of(vocab: Vocabulary, names: Sequence[str]) -> list[int]:
    ids = []
    for name in names:
        try:
            tid = vocab.token_id(name)
        except InvalidSpecError:
            continue
        if tid in vocab.special_ids:
            ids.append(tid)
    return ids


class BoundaryGuard:
    """The tokens a byte-marker gate must refuse, so the marker ends at a token boundary.

    ``inside``: tokens holding the whole marker with bytes after it. ``after[j]``: tokens
    that complete the marker when the output already ends with its first ``j`` bytes, and
    carry bytes past it. Built once per marker and vocabulary (one pass over the tokens)."""

    def __init__(self, marker: bytes, tokens: Sequence[bytes]) -> None:
        length = len(marker)
        inside: list[int] = []
        after: dict[int, list[int]] = {j: [] for j in range(1, length)}
        for tid, data in enumerate(tokens):
            at = data.find(marker)
            if at >= 0 and at + length < len(data):
                inside.append(tid)
            for j in range(1, length):
                rest = marker[j:]
                if len(data) > len(rest) and data.startswith(rest):
                    after[j].append(tid)
        self.inside = np.asarray(inside, dtype=np.int64)
        self.after = {j: np.asarray(ids, dtype=np.int64) for j, ids in after.items() if ids}

    def forbidden(self, prefixes: Iterable[int]) -> np.ndarray:
        """Token ids to refuse, given ``ThinkGate.marker_prefixes()``."""
        parts = [self.inside, *(self.after[j] for j in prefixes if j in self.after)]
        return np.unique(np.concatenate(parts)) if len(parts) > 1 else self.inside
