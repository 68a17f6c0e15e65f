"""Rewrite a JSON schema so both backends read it the way JSON Schema means it.

Normalizing beats falling back: the two differences that matter most in real schemas have an
exact rewrite.
- ``pattern`` / ``patternProperties`` are *searches* in JSON Schema, while both backends match
  the whole string; an unanchored side gets an explicit ``[\\s\\S]*``.
- "closed objects" (our default, like OpenAI strict mode) are xgrammar's ``strict_mode``;
  llguidance follows JSON Schema (undeclared keys allowed), so for it we add
  ``additionalProperties: false`` where the schema leaves it open. Objects combined through
  ``allOf`` are left open: closing one branch would reject the keys of the others.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_SINGLE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
                     "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                     "additionalItems")
_OPEN_MARKERS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "$ref",
                 "allOf", "anyOf", "oneOf", "if", "dependentSchemas")
_OPEN_MARKER_KEYS = frozenset(_OPEN_MARKERS)


def search_pattern(pattern: str) -> str:
    """An equivalent full-match pattern for a JSON Schema (search) pattern."""
    if _has_top_level_alternation(pattern):
        if not (pattern.startswith("^") or ends_with_anchor(pattern)):
            return f"[\\s\\S]*(?:{pattern})[\\s\\S]*"
        return pattern  # anchors inside alternation branches: backends treat them per branch
    body = pattern
    head = "" if body.startswith("^") else "[\\s\\S]*"
    if body.startswith("^"):
        body = body[1:]
    tail = "[\\s\\S]*"
    if ends_with_anchor(body):
        body, tail = body[:-1], ""
    if not head and not tail:
        return body
    return f"{head}(?:{body}){tail}"


def normalize_schema(schema: Any, *, close_objects: bool, explicit_free: bool = False,
                     search_patterns: bool = True, escape_nul: bool = False) -> Any:
    """A rewritten copy; the input is never modified.

    ``search_patterns=False`` leaves ``pattern`` / ``patternProperties`` as written: for
    llguidance, which already reads them as JSON Schema searches (anchors honoured).

    ``explicit_free`` (xgrammar): spell out ``additionalProperties: {}`` / ``items: {}`` on
    containers that declare no members, since xgrammar's strict mode would otherwise leave
    only ``{}`` / ``[]`` once a keyword such as ``required`` or ``maxItems`` is present.

    ``escape_nul`` (xgrammar): a NUL in a pattern (``[^\u0000]`` in the schema's JSON) is
    legal, but xgrammar refuses "null characters" in a regex; the ``\\x00`` escape it reads.
    """
    if escape_nul:
        schema = _walk(schema, False, in_all_of=False, free=False, search=False, nul=True)
    return _walk(schema, close_objects, in_all_of=False, free=explicit_free,
                 search=search_patterns)


def escape_nul_chars(pattern: str) -> str:
    """The pattern with each NUL character written as the regex escape ``\\x00``."""
    if "\x00" not in pattern:
        return pattern
    out: list[str] = []
    escaped = False
    for ch in pattern:
        if ch == "\x00":
            out.append("x00" if escaped else "\\x00")  # an escaped NUL is a NUL too
            escaped = False
        else:
            out.append(ch)
            escaped = ch == "\\" and not escaped
    return "".join(out)


_MAP, _LIST, _SINGLE, _ALL_OF, _ITEMS = range(5)
#: What each schema-valued key holds (every other key is copied as is).
_ROLE: dict[str, int] = {
    **{k: _MAP for k in _SUBSCHEMA_MAPS}, **{k: _LIST for k in _SUBSCHEMA_LISTS},
    **{k: _SINGLE for k in _SUBSCHEMA_SINGLE}, "allOf": _ALL_OF, "items": _ITEMS,
}


def _walk(node: Any, close: bool, *, in_all_of: bool, free: bool, search: bool = True,
          nul: bool = False) -> Any:
    """One node rewritten; runs on every node of every cold compile, so it dispatches on
    the keys a node has through one table."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    rewrite_patterns = nul or search
    for key, value in node.items():
        role = _ROLE.get(key)
        if role is None:
            if key == "pattern" and rewrite_patterns and isinstance(value, str):
                value = _pattern(value, search, nul)
            out[key] = value
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {(_pattern(k, search, nul) if rewrite_patterns and isinstance(k, str)
                         else k): _walk(v, close, in_all_of=False, free=free, search=search,
                                        nul=nul)
                        for k, v in value.items()}
        elif role == _MAP:
            out[key] = {k: _walk(v, close, in_all_of=False, free=free, search=search, nul=nul)
                        for k, v in value.items()} if isinstance(value, dict) else value
        elif role == _SINGLE or (role == _ITEMS and not isinstance(value, list)):
            out[key] = _walk(value, close, in_all_of=False, free=free, search=search, nul=nul)
        elif isinstance(value, list):  # anyOf, oneOf, prefixItems, allOf, items as a list
            out[key] = [_walk(v, close, in_all_of=role == _ALL_OF, free=free, search=search,
                              nul=nul) for v in value]
        else:
            out[key] = value
    if close and not in_all_of and _is_open_object(out):
        out["additionalProperties"] = False
    if free and not in_all_of:
        _spell_out_free_members(out)
    return out


def _pattern(pattern: str, search: bool, nul: bool) -> str:
    if nul:
        return escape_nul_chars(pattern)
    return search_pattern(pattern) if search else pattern


_OBJECT_MEMBER_KEYS = ("properties", "additionalProperties", "patternProperties",
                       "unevaluatedProperties", "$ref", "allOf", "anyOf", "oneOf")
_ARRAY_MEMBER_KEYS = ("items", "unevaluatedItems", "$ref", "allOf", "anyOf", "oneOf")


def _spell_out_free_members(node: dict[str, Any]) -> None:
    typ = node.get("type")
    types = typ if isinstance(typ, list) else [typ]
    if "object" in types and not any(k in node for k in _OBJECT_MEMBER_KEYS):
        node["additionalProperties"] = {}
    if "array" in types and not any(k in node for k in _ARRAY_MEMBER_KEYS):
        node["items"] = {}


def _is_open_object(node: dict[str, Any]) -> bool:
    if "properties" not in node or not _OPEN_MARKER_KEYS.isdisjoint(node):
        return False
    typ = node.get("type")
    # only objects that declare properties: closing a free-form object would leave just {}
    return "properties" in node and (typ in (None, "object") or
                                     (isinstance(typ, list) and "object" in typ))


def ends_with_anchor(pattern: str) -> bool:
    """Whether the pattern ends in a ``$`` anchor (not an escaped dollar)."""
    if not pattern.endswith("$"):
        return False
    backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    return backslashes % 2 == 0


def structural_chars(pattern: str) -> Iterator[tuple[str, int]]:
    """The pattern's unescaped characters outside character classes, with their group depth:
    where anchors and alternations live."""
    depth = 0
    in_class = escaped = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        else:
            depth += (ch == "(") - (ch == ")")
            yield ch, depth


def _has_top_level_alternation(pattern: str) -> bool:
    return any(ch == "|" and depth == 0 for ch, depth in structural_chars(pattern))


_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_CHILD_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")


_CHILD_ORDER = {k: i for i, k in enumerate((*_CHILD_MAPS, *_CHILD_LISTS, *_CHILD_ONE))}
_CHILD_KEYS = frozenset(_CHILD_ORDER)
_CHILD_MAP_KEYS, _CHILD_LIST_KEYS = frozenset(_CHILD_MAPS), frozenset(_CHILD_LISTS)


def subschemas(node: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object subschema with its JSON pointer ("" for the root), parents first.

    Runs for every cold compile (routing, checks): only the keys a node has are looked at
    (most nodes have none of the child keys), in one fixed order."""
    stack: list[tuple[str, Any]] = [(pointer, node)]
    order = _CHILD_ORDER.__getitem__
    while stack:
        ptr, cur = stack.pop()
        if not isinstance(cur, dict):
            continue
        yield ptr, cur
        present = _CHILD_KEYS.intersection(cur)
        for key in sorted(present, key=order) if len(present) > 1 else present:
            child = cur[key]
            if key in _CHILD_MAP_KEYS:
                if isinstance(child, dict):
                    stack.extend((f"{ptr}/{key}/{escape_key(k)}", v) for k, v in child.items())
            elif isinstance(child, list):
                stack.extend((f"{ptr}/{key}/{i}", v) for i, v in enumerate(child))
            elif key not in _CHILD_LIST_KEYS and child is not None:
                stack.append((f"{ptr}/{key}", child))


def escape_key(key: str) -> str:
    """A key as a JSON pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_INT64 = 2**63


def _integer_node(node: dict[str, Any]) -> bool:
    typ = node.get("type")
    return typ == "integer" or (isinstance(typ, list) and "integer" in typ)


#: Compiler messages that name no keyword, and the keywords (with a test) they come from.
_HINTS: tuple[tuple[str, Any], ...] = (
    ("Integer exceeds", lambda n, k: _integer_node(n) and k in _BOUNDS
     and isinstance(n[k], int | float) and abs(n[k]) >= _INT64),
    ("Integer constraint must be a whole number", lambda n, k: _integer_node(n)
     and k in _BOUNDS and isinstance(n[k], float) and not n[k].is_integer()),
    ("integer range", lambda n, k: _integer_node(n) and k in _BOUNDS),
    ("float range", lambda n, k: k in _BOUNDS),
    ("not JSON serializable", lambda n, k: k in _BOUNDS and isinstance(n[k], int)
     and abs(n[k]) >= _INT64),
)
_WORD = re.compile(r"[$A-Za-z]+")
_KEYWORDS = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "uniqueItems", "items", "prefixItems", "contains", "minContains", "maxContains",
    "properties", "patternProperties", "additionalProperties", "required", "minProperties",
    "maxProperties", "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "$ref", "$defs", "definitions", "dependentRequired", "dependentSchemas",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems", "$anchor", "$dynamicRef",
})


def locate(schema: Any, message: str) -> str | None:
    """The JSON pointer of the keyword a backend's error message is about, when it can be
    told: the first keyword the message names (or implies) found in the schema."""
    tests = [test for hint, test in _HINTS if hint in message]
    named = [w for w in _WORD.findall(message) if w in _KEYWORDS]
    if not tests and not named:
        return None
    for ptr, node in subschemas(schema):
        for key in node:
            if any(test(node, key) for test in tests) or (not tests and key in named):
                return f"{ptr}/{escape_key(key)}"
    return None
