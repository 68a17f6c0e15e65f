"""vLLM's engine-side reasoning rule, for the requests the drop-in takes over.

vLLM's engine decides per request where structured outputs start
(``v1/structured_output/__init__.py``, ``StructuredOutputManager``):

- ``_get_constraint_bounds``: a request whose ``reasoning_ended`` is True is constrained from
  its first token; None: the engine asks its reasoning parser about the prompt
  (``is_reasoning_end``); False: it reasons. Each step's committed tokens then end reasoning
  where ``find_reasoning_end`` says (a parser that knows its end tokens: 0.32-0.33 the
  engine-based parsers, ``ParserEngineReasoningAdapter``; 0.34 any), an implicit end (Qwen3's
  ``<tool_call>``) being the grammar's first token; else where ``is_reasoning_end_streaming``
  first holds over a prefix of the step's tokens.
- ``_masked_reasoning_ends`` (0.33+): while the request reasons, the implicit ends its grammar
  cannot start with are masked.
- ``_get_reasoner``: the parser is built per request as
  ``reasoner_cls(tokenizer, **reasoning_parser_kwargs)``.

``VllmRule`` is that rule, over one parser instance per (parser, kwargs) (``rule_for``: an
LRU, not one per request; these methods keep no state between calls).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from .compat import V2_ONLY_FROM, version_tuple

#: (parser, kwargs) pairs whose rule is kept: kwargs carry each request's chat-template
#: kwargs, so a server may see many
RULES_KEPT = 256
#: the first line that masks implicit reasoning ends while a request reasons
MASKS_IMPLICIT_FROM = (0, 33)


class VllmRule:
    """vLLM's rule for one reasoning parser instance (``ReasoningRule``)."""

    def __init__(self, reasoner: Any, line: tuple[int, int] | None = None) -> None:
        line = version_tuple() if line is None else line
        self._reasoner = reasoner
        engine_based = _engine_based(reasoner)
        by_ids = (line >= V2_ONLY_FROM or engine_based) and bool(
            getattr(reasoner, "reasoning_end_token_ids", None))
        self._find = reasoner.find_reasoning_end if by_ids else None
        self.needs_history = self._find is None
        masks = line >= V2_ONLY_FROM or (line >= MASKS_IMPLICIT_FROM and engine_based)
        implicit = getattr(reasoner, "implicit_reasoning_end_token_ids", None) if masks else None
        self.implicit_ends: frozenset[int] = frozenset(int(t) for t in implicit or ())

    def prompt_ended(self, prompt_ids: Sequence[int]) -> bool:
        return bool(self._reasoner.is_reasoning_end(list(prompt_ids)))

    def grammar_start(self, history: list[int], delta: Sequence[int]) -> tuple[int, bool] | None:
        if self._find is not None:
            end = self._find(delta)
            if end is not None:
                implicit = bool(end.implicit)
                at = int(end.offset) if implicit else int(end.offset) + 1
                return (at, implicit) if at <= len(delta) else None
        start = self._streaming_start(history, delta)
        return None if start is None else (start, False)

    def _streaming_start(self, history: list[int], delta: Sequence[int]) -> int | None:
        """The fallback of ``_get_constraint_bounds`` for committed tokens: the shortest
        prefix of ``delta`` after which reasoning has ended (``history`` ends with it)."""
        streaming = self._reasoner.is_reasoning_end_streaming
        if not delta or not streaming(history, list(delta)):
            return None
        ids, tail = list(history), list(delta)
        for i in range(len(delta) - 1, 0, -1):
            ids.pop()
            tail.pop()
            if not streaming(ids, tail):
                return i + 1
        return 1


def _engine_based(reasoner: Any) -> bool:
    try:
        from vllm.parser.engine.adapters import ParserEngineReasoningAdapter
    except ImportError:
        return False
    return isinstance(reasoner, ParserEngineReasoningAdapter)


_RULES: OrderedDict[tuple[int, str, str], tuple[Any, VllmRule]] = OrderedDict()
_RULES_LOCK = threading.Lock()


def rule_for(model_config: Any, parser: str, kwargs: str) -> VllmRule:
    """The rule of ``parser`` built with ``kwargs`` (JSON) over the model's tokenizer, as
    vLLM's engine builds it; raises what building it raises."""
    tokenizer = _tokenizer(model_config)
    key = (id(tokenizer), parser, kwargs)
    with _RULES_LOCK:
        found = _RULES.get(key)
        if found is not None and found[0] is tokenizer:
            _RULES.move_to_end(key)
            return found[1]
    from vllm.reasoning import ReasoningParserManager

    cls = ReasoningParserManager.get_reasoning_parser(parser)
    rule = VllmRule(cls(tokenizer, **json.loads(kwargs)))
    with _RULES_LOCK:
        _RULES[key] = (tokenizer, rule)  # the tokenizer kept: its id stays unique
        while len(_RULES) > RULES_KEPT:
            _RULES.popitem(last=False)
    return rule


def _tokenizer(model_config: Any) -> Any:
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config)
    if tokenizer is None:
        raise RuntimeError("the server has no tokenizer (--skip-tokenizer-init)")
    return tokenizer
