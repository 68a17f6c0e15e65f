"""The drop-in: grammask serves vLLM's own structured outputs, and vLLM's engine stays out.

Whatever vLLM turns into ``SamplingParams.structured_outputs`` (``response_format``, the
``structured_outputs`` body field, tool calling's schemas and structural tags, the Responses
API's ``text.format``, ``/v1/completions``, offline ``LLM.generate``) reaches the logits
processors' ``validate_params`` hook in the API server, on the request's own params, before
``InputProcessor`` copies them for the engine (vLLM 0.32 and 0.33). There ``take_over``
moves the constraint into ``extra_args["grammask"]`` and clears ``structured_outputs``: vLLM's
engine then neither compiles nor masks it, and grammask's plugin does both.

Why this hook: it is the public logits-processor contract (no patched vLLM function), it sees
every entry point, and a refusal there is vLLM's own HTTP 400. ``status`` checks at start-up
that the installed vLLM is one whose flow this relies on (the version line, and exactly the
``StructuredOutputsParams`` fields translated here); otherwise, and where grammask cannot
serve the configuration (``compat.unserved``: speculative decoding, or async scheduling without
``--logits-processors``, on the V1 runner; a vLLM backend grammask does not have; the setting
``structured_outputs=vllm``), the requests stay with vLLM's engine and the start-up log says
why. It never half-works: both processes decide from the same inputs.
What this relies on in vLLM is checked in ``compat``.

Reasoning: a request taken over is gated where vLLM's engine would gate it. ``take_over``
writes vLLM's decision for it (``reasoning_ended`` and ``reasoning_parser_kwargs``, read where
the request enters vLLM's engine: ``compat.engine_call``) under ``grammask_reasoning``; the
engine side builds the server's reasoning parser with those kwargs once per (parser, kwargs)
and follows vLLM's rule (``reasoner.VllmRule``). Where the decision cannot be read, the
request stays with vLLM's engine (``admission``): no guess. grammask's own keys keep
grammask's own thinking rule.

The request's params object is changed in place (vLLM's own ``verify`` does the same to
``_backend``); a params object reused for another request still carries the constraint, now
under ``extra_args``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from ...backends import registry
from ...errors import GrammarError
from ...specs.request import EXTRA_ARGS_KEY, REASONING_KEY, VllmReasoning
from .compat import mismatch as vllm_mismatch
from .compat import rust_frontend, unserved
from .settings import Settings

log = logging.getLogger("grammask")

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: Marks a request that came in through vLLM's structured outputs (metrics, thinking rule).
SOURCE_KEY = "grammask_source"
#: Per request (``vllm_xargs``): leave this request's structured outputs to vLLM's engine.
OPT_OUT_KEY = "grammask_structured_outputs"


@dataclass(frozen=True)
class DropIn:
    """Whether grammask serves vLLM's structured outputs on this server, and why (not)."""

    on: bool
    reason: str
    backend: str | None = None  # the server's vLLM backend as grammask's default, or None
    thinking: bool = False  # a reasoning parser gates the masks (and not enable_in_reasoning)
    think_end: str | None = None  # the parser's end-of-reasoning text (``</think>``)
    parser: str = ""  # the server's --reasoning-parser where ``thinking``
    compact_json: bool = True
    tool_parameters: bool = True  # forced tool calls follow each tool's parameters


def status(vllm_config: Any, settings: Settings) -> DropIn:
    """Decide once per process, from the config alone (the API server and the engine agree)."""
    if settings.structured_outputs != "grammask":
        return DropIn(False, "setting structured_outputs=vllm: vLLM's engine serves them")
    if not settings.enabled:
        return DropIn(False, "grammask is disabled (enabled=false)")
    mismatch = vllm_mismatch()
    if mismatch:
        return DropIn(False, mismatch)
    if vllm_config is None:
        return DropIn(False, "the server's vLLM config was not found at admission")
    if rust := rust_frontend():
        return DropIn(False, f"{rust}: vLLM's engine serves structured outputs")
    aside = unserved(vllm_config)
    if aside:
        return DropIn(False, f"grammask stands aside: {aside}; vLLM's engine serves "
                             "structured outputs")
    so = getattr(vllm_config, "structured_outputs_config", None)
    name = str(getattr(so, "backend", "auto") or "auto")
    named = None if name == "auto" else registry.canonical(name)
    if name != "auto" and named is None:
        return DropIn(False, f"--structured-outputs-config backend={name} is not one of "
                             f"grammask's (auto, {', '.join(registry.names())}); vLLM's "
                             "engine serves it")
    backend = named or (None if settings.backend == "auto" else settings.backend)
    parser = str(getattr(so, "reasoning_parser", "") or "")
    thinking = bool(parser) and not bool(getattr(so, "enable_in_reasoning", False))
    think_end = None
    if thinking:
        think_end, why = reasoning_end(vllm_config, parser)
        if think_end is None:
            return DropIn(False, f"--reasoning-parser {parser}: {why}; vLLM's engine serves "
                                 "structured outputs")
    compact = bool(getattr(so, "disable_any_whitespace", False)) or (
        settings.json_whitespace == "compact")
    gate = (f"masks after {think_end!r}, where reasoning parser {parser} ends reasoning "
            "(vLLM's decision per request)" if thinking else "masks from the first token")
    spaces = "compact" if compact else "any"
    tools = settings.tool_arguments == "parameters"
    how = (f"backend {backend or 'auto'}, {gate}, JSON whitespace {spaces}, forced tool "
           f"calls' arguments {'follow parameters' if tools else 'as vLLM builds them'}")
    return DropIn(True, f"grammask serves vLLM's structured outputs ({how})", backend=backend,
                  thinking=thinking, think_end=think_end, parser=parser if thinking else "",
                  compact_json=compact, tool_parameters=tools)


def reasoning_end(vllm_config: Any, parser: str) -> tuple[str | None, str]:
    """The text at which vLLM's reasoning parser ends reasoning (masks start after it)."""
    try:
        from vllm.reasoning import ReasoningParserManager
        from vllm.tokenizers import cached_tokenizer_from_config

        cls = ReasoningParserManager.get_reasoning_parser(parser)
        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        built = cls(tokenizer)
        end = built.reasoning_end_str
        if not end:  # vLLM 0.34: a parser may name its end by token id only
            ids: frozenset[int] = frozenset(getattr(built, "reasoning_end_token_ids", ()))
            if len(ids) == 1:
                end = tokenizer.decode(list(ids))
    except Exception as exc:  # a parser that cannot be built here
        return None, f"the parser could not be built ({type(exc).__name__}: {exc})"
    if not isinstance(end, str) or not end:
        return None, "the parser ends reasoning without a fixed end text grammask can match"
    return end, ""


def translate(so: Any, drop: DropIn, tag: str | None = None) -> dict[str, Any]:
    """The grammask object (a vLLM ``structured_outputs`` dict) for one request; ``tag``
    replaces its structural tag (``tools.forced_tool_tag``)."""
    given = [k for k in KINDS if getattr(so, k, None) not in (None, False)]
    if len(given) != 1:
        raise GrammarError(f"structured outputs need exactly one of {', '.join(KINDS)}, "
                           f"got {given or 'none'}", where="structured_outputs")
    kind = given[0]
    value = tag if kind == "structural_tag" and tag is not None else getattr(so, kind)
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc.msg}",
                               where=f"structured_outputs.json line {exc.lineno} column "
                                     f"{exc.colno}") from None
    if kind == "structural_tag" and drop.compact_json:
        value = bounded_whitespace(value)
    if kind == "grammar" and drop.compact_json and isinstance(value, str):
        value = bounded_lark_json(value)
    out: dict[str, Any] = {kind: value}
    if kind in ("json", "json_object"):
        pattern = getattr(so, "whitespace_pattern", None)
        if pattern:
            out["whitespace_pattern"] = pattern
        elif getattr(so, "disable_any_whitespace", False) or drop.compact_json:
            out["disable_any_whitespace"] = True
    if kind == "json":  # keys beyond the schema's only where it allows them (both settings)
        out["extra_properties"] = False
    if drop.backend is not None:
        out["backend"] = drop.backend
    return out


#: Whitespace characters a structural tag's JSON content may put between two JSON tokens when
#: it sets no bound: one keeps ``{"a": 1, "b": 2}`` (what models write) and ends the run a
#: weak model would make (xgrammar's structural tags have no compact mode; 0 is refused).
TAG_WHITESPACE = 1


def bounded_whitespace(tag: Any) -> Any:
    """The structural tag with ``max_whitespace_cnt`` set on each JSON content without one
    (vLLM's tool-call tags leave it unset); text stays text, objects stay objects."""
    try:
        parsed = json.loads(tag) if isinstance(tag, str) else tag
    except json.JSONDecodeError:  # the spec check names the error
        return tag

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        # a json_schema's own values (a const, an enum) are data, never tag structure
        out = {k: v if k == "json_schema" else walk(v) for k, v in node.items()}
        if (out.get("type") == "json_schema" and out.get("max_whitespace_cnt") is None
                and out.get("style") in (None, "json")):
            out["max_whitespace_cnt"] = TAG_WHITESPACE
        return out

    try:
        bounded = walk(parsed)
    except RecursionError:  # absurdly deep: left as it is, the spec check refuses it
        return tag
    return json.dumps(bounded, ensure_ascii=False) if isinstance(tag, str) else bounded


#: llguidance's JSON options for a lark grammar's ``%json`` without any: the separators of
#: ``json.dumps``, which is how ``mistral_common`` writes a call's arguments into the prompts
#: Mistral's models learn from (``{"a": 1, "b": 2}``). Not a bound of one whitespace
#: character, as structural tags get: llguidance 1.7's ``whitespace_pattern`` holds only
#: in some places of a ``%json`` (after an enum key, runs of any length pass)
LARK_JSON_WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ",
                        "key_separator": ": "}
_LARK_JSON = re.compile(r"%json\s*(?=\{)")


def bounded_lark_json(grammar: str) -> str:
    """The lark grammar with ``LARK_JSON_WHITESPACE`` set on each ``%json`` schema that sets
    no ``x-guidance`` of its own (Mistral's tool parser writes its calls' arguments so:
    llguidance then takes whitespace without bound, and a weak model writes it until
    ``max_tokens``). Anything that does not read as a JSON object is left as it is."""
    decoder = json.JSONDecoder()
    out, at = [], 0
    for found in _LARK_JSON.finditer(grammar):
        start = found.end()
        if start < at:
            continue
        try:
            schema, end = decoder.raw_decode(grammar, start)
        except (json.JSONDecodeError, RecursionError):
            continue
        if not isinstance(schema, dict) or "x-guidance" in schema:
            continue
        schema["x-guidance"] = dict(LARK_JSON_WHITESPACE)
        out += [grammar[at:start], json.dumps(schema, ensure_ascii=False)]
        at = end
    return "".join(out) + grammar[at:] if out else grammar


#: vLLM's decision for a request: constrained from its first token (True), or reasoning as
#: ``VllmReasoning`` says
Decision = bool | VllmReasoning


def take_over(sampling_params: Any, drop: DropIn, tag: str | None = None,
              decision: Decision | None = None) -> str:
    """Move the request's structured outputs under ``extra_args`` (vLLM's engine skips it);
    returns the kind. Raises ``GrammarError`` naming the field for a malformed one.

    ``decision``: vLLM's reasoning decision where ``drop.thinking``; None means vLLM's
    engine decides from the prompt with no parser kwargs (offline generation's)."""
    so = sampling_params.structured_outputs
    obj = translate(so, drop, tag)
    kind = next(iter(obj))
    extra = dict(sampling_params.extra_args or {})
    extra[EXTRA_ARGS_KEY] = json.dumps(obj, ensure_ascii=False)
    set_decision(extra, drop, decision)
    extra[SOURCE_KEY] = "structured_outputs"
    sampling_params.extra_args = extra
    sampling_params.structured_outputs = None
    return kind


def set_decision(extra: dict[str, Any], drop: DropIn, decision: Decision | None) -> None:
    """Write vLLM's reasoning decision into a taken-over request's ``extra_args`` (the drop-in
    owns these keys); None: vLLM's engine decides from the prompt, with no parser kwargs."""
    if decision is None:
        decision = VllmReasoning(drop.parser, None)
    extra.pop(REASONING_KEY, None)
    extra.pop("grammask_think_end", None)
    extra["grammask_thinking"] = "off"
    if drop.thinking and isinstance(decision, VllmReasoning):
        extra["grammask_thinking"] = "auto"
        extra[REASONING_KEY] = decision.key()
        if drop.think_end is not None:  # the prompt travels to the engine for the gate
            extra["grammask_think_end"] = drop.think_end


def field_of(kind: str) -> str:
    """The request field an error names: vLLM folds every front end into these."""
    return f"structured_outputs.{kind}"


def log_status(drop: DropIn, where: str) -> None:
    (log.info if drop.on else log.warning)("grammask (%s): %s", where, drop.reason)
