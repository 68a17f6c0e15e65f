"""Each tool's own tag in vLLM's forced-call tag, found by regenerating vLLM's tags.

vLLM's chat and Responses servers build the tag with its structural-tag registry
(``vllm/tool_parsers/structural_tag_registry.py`` ``get_model_structural_tag``, called by
``DelegatingParser._apply_structural_tag`` in ``vllm/parser/abstract_parser.py``, the same
on 0.32 to 0.34) from the request's ``tools`` and ``tool_choice``, a model key of the
server's tool parser, and a strict level (``ToolStrictLevel``). The hook sees only the
tag's text, so:

- ``identify``: the model key is the one whose regenerated tag is that text, exactly;
- ``strict_tag``: the same tag with every tool strict at the parameter level (vLLM's own
  ``--tool-strict-level parameter``), so each tool's tag carries its ``parameters`` in the
  form that model's parser reads (JSON, Qwen XML, GLM XML, ...);
- ``owners``: which tool each tag ``begin`` belongs to: the begins of the tag vLLM builds
  for that tool alone that no other tool's tag has. A name is never searched for inside a
  ``begin`` (a tool named ``arguments`` or ``name`` is a word of every other tool's begin).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

#: vLLM's strict levels a forced call's tag may have been built with: below ``PARAMETER``
#: each non-strict tool's arguments are any JSON (``FUNCTION`` and ``AUTO`` build the same
#: tag for a forced call); at ``PARAMETER`` every tool already has its parameters
_LEVELS = ("FUNCTION", "PARAMETER")
#: the model key whose tag matched last: one server has one tool parser
_last: list[str] = []


@dataclass(frozen=True)
class Tool:
    """One function tool of the request, as the client declared it."""

    index: int  # position in the request's ``tools``
    name: str
    parameters: Any  # the schema, or None when the tool declares none
    strict: bool = False  # ``strict: true``: vLLM's tag already holds its schema
    source: Any = field(default=None, compare=False, repr=False)  # vLLM's tool object

    @property
    def field(self) -> str:
        return f"tools[{self.index}].function.parameters"


def registry() -> Any | None:
    """vLLM's structural-tag registry module, or None where this vLLM has none."""
    with contextlib.suppress(ImportError):
        from vllm.tool_parsers import structural_tag_registry

        return structural_tag_registry
    return None


def function_tools(tools: Any) -> list[Tool]:
    """The request's function tools (chat's ``{"function": ...}`` or the Responses API's
    flat ``FunctionTool``), each with its index in ``tools``."""
    out = []
    for i, tool in enumerate(tools or ()):
        function = getattr(tool, "function", None)
        if function is None and getattr(tool, "type", None) == "function":
            function = tool
        name = getattr(function, "name", None)
        if isinstance(name, str):
            out.append(Tool(i, name, getattr(function, "parameters", None),
                            getattr(function, "strict", None) is True, tool))
    return out


def forced_name(choice: Any) -> str | None:
    """The function a named ``tool_choice`` forces (chat or Responses form), else None."""
    function = getattr(choice, "function", None)
    name = getattr(function, "name", None) or (
        getattr(choice, "name", None) if getattr(choice, "type", None) == "function" else None)
    return name if isinstance(name, str) else None


def called_tools(request: Any) -> list[Tool]:
    """The tools a forced call may call: the named one, or every function tool."""
    tools = function_tools(getattr(request, "tools", None))
    name = forced_name(getattr(request, "tool_choice", None))
    return [t for t in tools if t.name == name] if name is not None else tools


def build(reg: Any, model: str, tools: Sequence[Any], choice: Any, level: str,
          single: bool) -> dict[str, Any] | None:
    """vLLM's tag for these arguments, as ``_apply_structural_tag`` builds it (a dict)."""
    strict_level = getattr(reg.ToolStrictLevel, level)
    tag = reg.get_model_structural_tag(model, list(tools), choice, False,
                                       strict_level=strict_level)
    if tag is None:
        return None
    if single:
        reg.limit_to_single_tool_call(tag)
    dumped: dict[str, Any] = tag.model_dump()
    return dumped


def _single(request: Any) -> bool:
    return getattr(request, "parallel_tool_calls", None) is False


def identify(reg: Any, tag: str, request: Any) -> tuple[str, str] | None:
    """(model key, level) whose regenerated tag is ``tag``, text for text; None when no
    key of vLLM's registry builds it (a tool parser with a tag of its own)."""
    models = model_keys(reg)
    for model in [*(m for m in _last if m in models), *models]:
        for level in _LEVELS:
            try:
                built = build(reg, model, request.tools, request.tool_choice, level,
                              _single(request))
            except Exception:  # this key cannot build a tag for these tools: not it
                continue
            if built is not None and json.dumps(built) == tag:
                _last[:] = [model]
                return model, level
    return None


def model_keys(reg: Any) -> list[str]:
    """Every key the registry builds a tag for: xgrammar's builtins and vLLM's own
    (``minimax`` is registered, yet missing from ``SUPPORTED_STRUCTURAL_TAG_MODELS``)."""
    keys = set(getattr(reg, "SUPPORTED_STRUCTURAL_TAG_MODELS", ()))
    keys.update(getattr(reg, "_VLLM_STRUCTURAL_TAG_REGISTRY", {}))
    return sorted(keys)


def strict_tag(reg: Any, model: str, request: Any) -> dict[str, Any] | None:
    """vLLM's tag for the request with every tool strict at the parameter level."""
    return build(reg, model, request.tools, request.tool_choice, "PARAMETER",
                 _single(request))


def owners(reg: Any, model: str, request: Any, tools: list[Tool]) -> dict[str, Tool]:
    """``begin`` -> the tool whose own tag (vLLM's tag built for that tool alone, strict)
    has it, where exactly one tool's has it."""
    choice = request.tool_choice if forced_name(request.tool_choice) else "required"
    holders: dict[str, list[Tool]] = {}
    for tool in tools:
        own = build(reg, model, [tool.source], choice, "PARAMETER", False)
        for begin in set(begins(own)):
            holders.setdefault(begin, []).append(tool)
    return {begin: found[0] for begin, found in holders.items() if len(found) == 1}


def _tags(node: Any) -> Iterator[dict[str, Any]]:
    """Every tag (a dict with a text ``begin``) in a format; schemas are data: not entered."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if item.get("type") == "tag" and isinstance(item.get("begin"), str):
                yield item
            stack.extend(v for k, v in item.items() if k != "json_schema")


def begins(node: Any) -> Iterator[str]:
    """The text ``begin`` of every tag in a format."""
    return (tag["begin"] for tag in _tags(node))


def contents(tag: dict[str, Any]) -> dict[str, Any]:
    """``begin`` -> content of each tag in ``tag`` whose begin has one content only."""
    found: dict[str, list[Any]] = {}
    for item in _tags(tag):
        seen = found.setdefault(item["begin"], [])
        if item.get("content") not in seen:
            seen.append(item.get("content"))
    return {begin: c[0] for begin, c in found.items() if len(c) == 1}
