"""Bounds on a forced call's tag: how many calls, and the text around them.

vLLM's tags for ``tool_choice`` ``"required"`` list the calls in one of two ways
(``vllm/tool_parsers/structural_tag_registry.py`` and xgrammar's builtin templates):

- ``tags_with_separator`` (hermes, deepseek, kimi, glm, minimax, ...): calls and their
  separator only, as many calls as the model likes;
- ``triggered_tags`` (llama, qwen3_coder, mimo): after the first call, any text, and a call
  wherever a trigger starts in it. A weak model writes text or calls until ``max_tokens``.
  llama3_json's parser reads the calls only where ``;`` separates them
  (``vllm/parser/llama_json.py`` ``_validate_complete_tool_output``): two calls side by
  side, as the tag allows, parse as content, not calls.

``bound`` turns both into one to ``MAX_TOOL_CALLS`` calls; between two calls of a
``triggered_tags`` list it allows one whitespace character, then that model's separator
(``SEPARATORS``), then one whitespace character, and after the last call one whitespace
character: what each parser reads as the gap between calls. XML-style arguments
(``json_schema`` with a ``style`` other than ``json``: qwen_xml, glm_xml, deepseek_xml,
minimax_xml, ...) get ``max_whitespace_cnt`` 1 where unset: whitespace between parameters
becomes one character at a time. String values keep every character (xgrammar 0.2.8 applies
the bound outside them, in every XML style), so the one newline vLLM's Qwen3 parser strips
around a value stays allowed.
"""

from __future__ import annotations

from typing import Any

#: Most tool calls in one forced reply with parallel calls allowed. Clients and models that
#: call in parallel make a few calls per turn; a weak model would otherwise call until
#: ``max_tokens``.
MAX_TOOL_CALLS = 16
#: what a model's parser needs between two calls of a ``triggered_tags`` list (model key ->
#: text); none elsewhere
SEPARATORS = {"llama": ";"}
#: one whitespace character, or none
_SPACE: dict[str, Any] = {"type": "optional",
                          "content": {"type": "regex", "pattern": "[ \\t\\r\\n]"}}
#: whitespace characters in a row an XML-style ``json_schema`` content (every style but
#: ``json``) allows outside string values
_XML_WHITESPACE = 1


def bound(node: Any, model: str) -> Any:
    """``node`` (a structural tag's format) with its call lists bounded (module doc)."""
    if isinstance(node, list):
        return [bound(v, model) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k == "json_schema" else bound(v, model) for k, v in node.items()}
    kind = out.get("type")
    if (kind == "json_schema" and out.get("style") not in (None, "json")
            and out.get("max_whitespace_cnt") is None):
        out["max_whitespace_cnt"] = _XML_WHITESPACE
    repeats = not out.get("stop_after_first") and isinstance(out.get("tags"), list) and (
        out["tags"])
    if kind == "tags_with_separator" and repeats:
        return _separated(out)
    if kind == "triggered_tags" and repeats and out.get("at_least_one"):
        return _triggered(out, SEPARATORS.get(model, ""))
    return out


def _separated(node: dict[str, Any]) -> dict[str, Any]:
    """A ``tags_with_separator`` list as one to ``MAX_TOOL_CALLS`` of its tags (zero first
    when ``at_least_one`` is not set), separated as before."""
    one = {"type": "or", "elements": node["tags"]}
    least = 1 if node.get("at_least_one") else 0
    separator = node.get("separator") or ""
    if not separator:
        return {"type": "repeat", "min": least, "max": MAX_TOOL_CALLS, "content": one}
    more = _more(one, {"type": "const_string", "value": separator})
    calls = {"type": "sequence", "elements": [one, more]}
    return calls if least else {"type": "optional", "content": calls}


def _triggered(node: dict[str, Any], separator: str) -> dict[str, Any]:
    """A ``triggered_tags`` list that needs a call (``at_least_one``: it starts with one,
    as xgrammar reads it) as one to ``MAX_TOOL_CALLS`` calls, gaps bounded."""
    one = {"type": "or", "elements": node["tags"]}
    gap: dict[str, Any] = _SPACE
    if separator:
        gap = {"type": "sequence", "elements": [
            _SPACE, {"type": "const_string", "value": separator}, _SPACE]}
    return {"type": "sequence", "elements": [one, _more(one, gap), _SPACE]}


def _more(one: dict[str, Any], gap: dict[str, Any]) -> dict[str, Any]:
    return {"type": "repeat", "min": 0, "max": MAX_TOOL_CALLS - 1,
            "content": {"type": "sequence", "elements": [gap, one]}}
