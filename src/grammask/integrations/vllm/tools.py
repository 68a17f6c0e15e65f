"""Forced tool calls follow the tool's ``parameters`` (the drop-in's tool policy).

For ``tool_choice`` ``"required"`` or a named function, vLLM (0.32, 0.33) builds a structural
tag per tool parser (hermes ``<tool_call>``, ...) whose ``arguments`` are the tool's
``parameters`` only when the tool is ``strict: true`` (or the server runs
``--tool-strict-level parameter``); otherwise they are ``json_schema: true``, any JSON value,
and the schemas are not in ``SamplingParams`` at all. ``forced_tool_tag`` puts them back:

- the tools come from the chat or Responses request that built the tag: the nearest caller
  frame whose local ``request`` is a vLLM ``ChatCompletionRequest`` or ``ResponsesRequest``
  holding exactly this tag as its ``structured_outputs`` (vLLM validates params
  synchronously inside the request's own coroutine chain). No such frame, or a tag that is
  not a forced call: vLLM's tag is served unchanged;
- each tag whose content is ``json_schema: true`` and whose ``begin`` names one tool gets that
  tool's ``parameters`` with JSON-Schema semantics: an object that does not declare
  ``additionalProperties`` gets ``additionalProperties: true`` (xgrammar reads tag schemas
  with closed objects), which JSON Schema means anyway. A missing schema is ``{"type":
  "object"}``;
- a call list that may repeat (parallel calls) repeats at most ``MAX_TOOL_CALLS`` times;
- each tool's schema is checked on its own (JSON Schema's meta-schema, then the backend's
  syntax check), so a bad one is a ``GrammarError`` that names the tool.

Why a frame walk (vLLM 0.32 to 0.34 alike): the parameters of a tool without ``strict`` are in
no object ``validate_params`` can reach. vLLM's tag holds ``"json_schema": true`` for them;
``ChatCompletionRequest.to_sampling_params`` copies neither ``tools`` nor ``tool_choice``
into ``SamplingParams`` (``extra_args`` is the client's ``vllm_xargs`` only); a logits
processor's only admission hook is ``validate_params(sampling_params)``; and vLLM sets no
context variable for the request. The request objects exist only in the serving coroutine
(``OpenAIServingChat.create_chat_completion``, the Responses and Anthropic servers) that
awaits the engine's admission, so they are read off that chain. Without patching vLLM (its
``_apply_structural_tag`` or its serving classes) there is no other route. The walk is
narrowed to vLLM's own request types (any other local named ``request`` is skipped) and to
the request whose ``structured_outputs`` holds this very tag, compared whole, within
``_MAX_DEPTH`` frames.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from ...errors import GrammarError, InvalidSchemaError
from ...schema.keys import LISTS, MAPS, SINGLE

#: Most tool calls in one forced reply with parallel calls allowed. Clients and models that
#: call in parallel make a few calls per turn; a weak model would otherwise call until
#: ``max_tokens``.
MAX_TOOL_CALLS = 16
#: Caller frames searched for the request (vLLM's own chain is about 10 deep).
_MAX_DEPTH = 64
_LISTS = ("tags_with_separator",)
#: the single-subschema keys ``open_objects`` descends into: all but
#: ``unevaluatedProperties``, whose subschema it has always left as written
_SCHEMA_ONE = tuple(k for k in SINGLE if k != "unevaluatedProperties")


@dataclass(frozen=True)
class Tool:
    """One function tool of the request, as the client declared it."""

    index: int  # position in the request's ``tools``
    name: str
    parameters: Any  # the schema, or None when the tool declares none

    @property
    def field(self) -> str:
        return f"tools[{self.index}].function.parameters"


@cache
def _request_types() -> tuple[type, ...]:
    """vLLM's chat and Responses request classes (the same modules on 0.32 to 0.34); none
    when this vLLM lacks them (then no request is ever found: vLLM's tag is served)."""
    found: list[type] = []
    with contextlib.suppress(ImportError):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        found.append(ChatCompletionRequest)
    with contextlib.suppress(ImportError):
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        found.append(ResponsesRequest)
    return tuple(found)


def request_tools(tag: str, depth: int = _MAX_DEPTH) -> list[Tool] | None:
    """The function tools of the forced-call request that built ``tag``, found on the
    caller's stack (why: the module's docstring); None when no vLLM request there carries
    this exact tag, or it is not forced (``tool_choice`` ``"auto"`` keeps vLLM's tag)."""
    kinds = _request_types()
    if not kinds:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        request: Any = frame.f_locals.get("request")
        so = getattr(request, "structured_outputs", None)
        tools = getattr(request, "tools", None)
        if isinstance(request, kinds) and tools and getattr(so, "structural_tag", None) == tag:
            return _tools(tools) if _forced(getattr(request, "tool_choice", None)) else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def _forced(choice: Any) -> bool:
    if choice == "required":
        return True
    function = getattr(choice, "function", None)  # chat: {"type": "function", "function": ...}
    name = getattr(function, "name", None) or (  # Responses: {"type": "function", "name": ...}
        getattr(choice, "name", None) if getattr(choice, "type", None) == "function" else None)
    return isinstance(name, str)


def _tools(tools: Any) -> list[Tool]:
    out = []
    for i, tool in enumerate(tools):
        function = getattr(tool, "function", None)
        if function is None and getattr(tool, "type", None) == "function":
            function = tool  # the Responses API's flat FunctionTool
        name = getattr(function, "name", None)
        if isinstance(name, str):
            out.append(Tool(i, name, getattr(function, "parameters", None)))
    return out


def forced_tool_tag(tag: str, tools: list[Tool],
                    check: Callable[[str], None] | None = None) -> str:
    """``tag`` with each non-strict tool's ``parameters`` and the call count bounded.

    ``check`` is given each tool's own one-tag structural tag (text); its ``GrammarError``,
    and a schema JSON Schema's meta-schema refuses, become a ``GrammarError`` whose
    ``where`` is ``tools[i].function.parameters``, naming the tool."""
    try:
        parsed = json.loads(tag)
    except json.JSONDecodeError:
        return tag  # the spec check names the error
    seen: dict[str, tuple[Tool, dict[str, Any]]] = {}
    rewritten = _rewrite(parsed, tools, seen)
    for tool, node in seen.values():
        _check_tool(tool, node, check)
    return json.dumps(rewritten, ensure_ascii=False)


def _rewrite(node: Any, tools: list[Tool], seen: dict[str, tuple[Tool, dict[str, Any]]]) -> Any:
    if isinstance(node, list):
        return [_rewrite(v, tools, seen) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k == "json_schema" else _rewrite(v, tools, seen) for k, v in node.items()}
    content = out.get("content")
    if (out.get("type") == "tag" and isinstance(content, dict)
            and content.get("type") == "json_schema" and content.get("json_schema") is True):
        tool = _named(str(out.get("begin", "")), tools)
        if tool is not None:
            schema = {"type": "object"} if tool.parameters is None else tool.parameters
            out["content"] = {**content, "json_schema": open_objects(schema)}
            seen.setdefault(tool.name, (tool, out))
    if (out.get("type") in _LISTS and not out.get("stop_after_first")
            and isinstance(out.get("tags"), list) and out["tags"]):
        return _bounded(out)
    return out


def _named(begin: str, tools: list[Tool]) -> Tool | None:
    """The tool whose name stands in ``begin`` as a whole word (the longest, if several)."""
    found = [t for t in tools
             if re.search(rf"(?<![\w.-]){re.escape(t.name)}(?![\w.-])", begin)]
    return max(found, key=lambda t: len(t.name)) if found else None


def _bounded(node: dict[str, Any]) -> dict[str, Any]:
    """A ``tags_with_separator`` list as one to ``MAX_TOOL_CALLS`` of its tags (zero first
    when ``at_least_one`` is not set), separated as before."""
    one = {"type": "or", "elements": node["tags"]}
    least = 1 if node.get("at_least_one") else 0
    separator = node.get("separator") or ""
    if not separator:
        return {"type": "repeat", "min": least, "max": MAX_TOOL_CALLS, "content": one}
    more = {"type": "repeat", "min": 0, "max": MAX_TOOL_CALLS - 1, "content": {
        "type": "sequence", "elements": [{"type": "const_string", "value": separator}, one]}}
    calls = {"type": "sequence", "elements": [one, more]}
    return calls if least else {"type": "optional", "content": calls}


def open_objects(schema: Any) -> Any:
    """A copy where every object schema without ``additionalProperties`` (nor
    ``unevaluatedProperties``) says ``additionalProperties: true``: the same JSON Schema,
    spelled out for a backend whose default closes objects. Data keywords are left alone."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: open_objects(v) for k, v in out[key].items()}
    for key in LISTS:
        if isinstance(out.get(key), list):
            out[key] = [open_objects(v) for v in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            value = out[key]
            out[key] = ([open_objects(v) for v in value] if isinstance(value, list)
                        else open_objects(value))
    if _is_object(out) and "additionalProperties" not in out and (
            "unevaluatedProperties" not in out):
        out["additionalProperties"] = True
    return out


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and ("properties" in node or "required" in node)


def _check_tool(tool: Tool, node: dict[str, Any], check: Callable[[str], None] | None) -> None:
    schema = tool.parameters
    if schema is not None:
        if not isinstance(schema, dict):
            raise InvalidSchemaError(f"tool {tool.name!r}: parameters must be a JSON Schema "
                                     f"object, got {type(schema).__name__}", where=tool.field)
        problem = _meta_schema_error(schema)
        if problem:
            raise InvalidSchemaError(f"tool {tool.name!r}: parameters is not a valid JSON "
                                     f"Schema: {problem}", where=tool.field)
    if check is None:
        return
    try:
        check(json.dumps({"type": "structural_tag", "format": node}, ensure_ascii=False))
    except GrammarError as exc:
        raise InvalidSchemaError(f"tool {tool.name!r}: parameters: {exc.message}",
                                 where=tool.field) from None


def _meta_schema_error(schema: dict[str, Any]) -> str | None:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    errors: Iterator[Any] = cls(cls.META_SCHEMA).iter_errors(schema)
    best = jsonschema.exceptions.best_match(errors)
    if best is None:
        return None
    path = "/".join(str(p) for p in best.absolute_path)
    return f"{best.message} (at /{path})" if path else best.message
