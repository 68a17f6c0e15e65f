"""Per-request constraint as it arrives through vLLM ``extra_args`` (OpenAI ``vllm_xargs``).

``vllm_xargs`` carries only strings, numbers and flat lists, so the structured-output object
travels as a JSON string under one key and the switches as flat keys beside it:

| key                   | value                                                            |
|-----------------------|------------------------------------------------------------------|
| ``grammask``          | JSON text of a vLLM ``structured_outputs`` object, e.g.          |
|                       | ``{"json": {...}, "disable_any_whitespace": true}``              |
| ``grammask_backend``  | ``auto`` (default), ``xgrammar`` or ``guidance``                 |
| ``grammask_strict``   | 1/true: refuse schemas with keywords no backend enforces         |
| ``grammask_thinking`` | ``auto`` (default: mask after the thinking end marker) or        |
|                       | ``off`` (constrain from the first generated token)               |
| ``grammask_think_end``| override the thinking end marker (text, e.g. ``</think>``)       |
| ``grammask_source``   | set by the drop-in: ``structured_outputs`` (vLLM's own fields)   |
| ``grammask_reasoning``| set by the drop-in: vLLM's reasoning decision for the request,   |
|                       | JSON ``{"parser", "ended", "kwargs"}`` (``VllmReasoning``)         |

Only the drop-in sets ``grammask_reasoning``: a request taken over from vLLM's structured
outputs is gated where vLLM's engine would gate it (its reasoning parser, its decision);
grammask's own keys keep grammask's own thinking rule (``decode/reasoning.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import InvalidSpecError
from .frontends import from_vllm
from .grammar_spec import GrammarSpec
from .limits import json_object

EXTRA_ARGS_KEY = "grammask"
FLAT_KEYS = ("grammask_backend", "grammask_strict", "grammask_thinking", "grammask_think_end",
             "grammask_source", "grammask_reasoning")
#: The drop-in's key for vLLM's reasoning decision (``VllmReasoning.key``).
REASONING_KEY = "grammask_reasoning"
#: Where a request's constraint came from: grammask's own keys, or vLLM's structured outputs.
SOURCES = ("grammask", "structured_outputs")


@dataclass(frozen=True)
class VllmReasoning:
    """vLLM's reasoning decision for a request the drop-in took over: the server's
    ``--reasoning-parser``, ``reasoning_ended`` as the front end passed it to the engine
    (False: reasoning; None: the engine decides from the prompt; True never travels: that
    request is constrained from its first token) and ``reasoning_parser_kwargs`` (canonical
    JSON: the engine builds its parser with them)."""

    parser: str
    ended: bool | None
    kwargs: str = "{}"

    def key(self) -> str:
        """The ``grammask_reasoning`` value."""
        return json.dumps({"parser": self.parser, "ended": self.ended,
                           "kwargs": json.loads(self.kwargs)}, sort_keys=True)

    @classmethod
    def of(cls, value: object) -> VllmReasoning:
        """Parse a ``grammask_reasoning`` value; ``InvalidSpecError`` naming the key."""
        try:
            obj = json.loads(value) if isinstance(value, str) else None
        except json.JSONDecodeError:
            obj = None
        if (not isinstance(obj, dict) or set(obj) != {"parser", "ended", "kwargs"}
                or not isinstance(obj["parser"], str) or not obj["parser"]
                or obj["ended"] not in (False, None) or not isinstance(obj["kwargs"], dict)):
            raise InvalidSpecError(f"{REASONING_KEY} must be JSON text of {{\"parser\": name, "
                                   "\"ended\": false or null, \"kwargs\": object}",
                                   where=REASONING_KEY)
        return cls(obj["parser"], obj["ended"], json.dumps(obj["kwargs"], sort_keys=True))


class ReasoningRule(Protocol):
    """Where a host's engine ends reasoning, for requests it decides itself (vLLM's engine:
    ``integrations.vllm.reasoner``); the thinking gate (``decode.reasoning.RuleGate``)
    follows it instead of grammask's own marker."""

    #: tokens that end reasoning and are also the answer's first token (Qwen3's
    #: ``<tool_call>``): refused while reasoning where the grammar cannot start with them
    implicit_ends: frozenset[int]
    #: whether ``grammar_start`` reads ``history`` (else the gate keeps none)
    needs_history: bool

    def prompt_ended(self, prompt_ids: Sequence[int]) -> bool:
        """The engine's decision from the prompt alone (``reasoning_ended`` None)."""
        ...

    def grammar_start(self, history: list[int], delta: Sequence[int]) -> tuple[int, bool] | None:
        """Where in ``delta`` (tokens committed in one step; ``history`` is the prompt and
        output up to and including them, where ``needs_history``) the grammar's tokens
        start, and whether the token there also ended reasoning (an implicit end); None:
        still reasoning after them."""
        ...


@dataclass(frozen=True)
class ConstraintRequest:
    """What one request asks for: the grammar, and how the thinking gate treats it.

    ``reasoning``: vLLM's decision, for a request taken over from vLLM's structured outputs;
    ``rule`` is what the host made of it (set by the host, never parsed); ``resumed``: a
    preempted request added again (counted once: ``metrics.REQUESTS``)."""

    spec: GrammarSpec
    thinking: bool = True
    think_end: str | None = None
    source: str = "grammask"
    reasoning: VllmReasoning | None = None
    rule: ReasoningRule | None = field(default=None, compare=False, repr=False)
    resumed: bool = field(default=False, compare=False)


#: the request of a row that carries only an error (a request that could not be parsed or
#: made): it is never compiled
STAND_IN = ConstraintRequest(GrammarSpec.json_object(), thinking=False)


def parse_extra_args(extra_args: Mapping[str, Any] | None) -> ConstraintRequest | None:
    """None when the request carries no grammask constraint (it is then left untouched).

    A ``grammask``-prefixed key grammask does not know (a typo such as ``grammask_bakend``)
    is an error, not silently ignored."""
    unknown = sorted(k for k in (extra_args or {})
                     if isinstance(k, str) and k.startswith(EXTRA_ARGS_KEY)
                     and k != EXTRA_ARGS_KEY and k not in FLAT_KEYS)
    if unknown:
        raise InvalidSpecError(f"unknown grammask key {unknown[0]!r}; known: "
                               f"{', '.join((EXTRA_ARGS_KEY, *FLAT_KEYS))}", where=unknown[0])
    if not extra_args or EXTRA_ARGS_KEY not in extra_args:
        stray = [k for k in FLAT_KEYS if extra_args and k in extra_args]
        if stray:
            raise InvalidSpecError(f"{stray[0]} given without a '{EXTRA_ARGS_KEY}' constraint",
                                   where=stray[0])
        return None
    raw = extra_args[EXTRA_ARGS_KEY]
    obj = json_object(
        raw, not_json=lambda exc: InvalidSpecError(
            f"'{EXTRA_ARGS_KEY}' is not valid JSON: {exc.msg}",
            where=f"{EXTRA_ARGS_KEY} column {exc.colno}"),
        wrong_type=lambda: InvalidSpecError(
            f"'{EXTRA_ARGS_KEY}' must be a JSON string, got {type(raw).__name__}",
            where=EXTRA_ARGS_KEY),
        not_object=lambda: InvalidSpecError(f"'{EXTRA_ARGS_KEY}' must hold a JSON object",
                                            where=EXTRA_ARGS_KEY))
    if "grammask_backend" in extra_args:
        obj["backend"] = extra_args["grammask_backend"]
    if "grammask_strict" in extra_args:
        obj["strict"] = _flag(extra_args["grammask_strict"], "grammask_strict")
    spec = from_vllm(obj)
    if extra_args.get("grammask_thinking", "auto") not in ("auto", "off", "on", 0, 1, True,
                                                           False):
        raise InvalidSpecError("grammask_thinking must be 'auto' or 'off'",
                               where="grammask_thinking")
    thinking, think_end = thinking_of(extra_args)
    if think_end is not None and (not isinstance(think_end, str) or not think_end):
        raise InvalidSpecError("grammask_think_end must be a non-empty string",
                               where="grammask_think_end")
    source = extra_args.get("grammask_source", "grammask")
    if source not in SOURCES:
        raise InvalidSpecError(f"grammask_source must be one of {', '.join(SOURCES)}",
                               where="grammask_source")
    reasoning = (VllmReasoning.of(extra_args[REASONING_KEY]) if REASONING_KEY in extra_args
                 else None)
    return ConstraintRequest(spec, thinking=thinking, think_end=think_end, source=source,
                             reasoning=reasoning)


def thinking_of(extra_args: Mapping[str, Any]) -> tuple[bool, Any]:
    """The thinking gate a request asks for, from its keys alone: (gated, its own end marker
    or None), unchecked (``parse_extra_args`` checks them). For a model runner that must
    decide before the forward whether to copy the prompt (the gate reads it), without the
    parse."""
    return (extra_args.get("grammask_thinking", "auto") not in ("off", 0, False),
            extra_args.get("grammask_think_end"))


def _flag(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise InvalidSpecError(f"{what} must be true/false or 1/0, got {value!r}", where=what)
