"""Rewrite a JSON schema so both backends read it the way JSON Schema means it.

Normalizing beats falling back: the two differences that matter most in real schemas have an
exact rewrite.
- ``pattern`` / ``patternProperties`` are *searches* in JSON Schema, while both backends match
  the whole string; an unanchored side gets an explicit ``[\\s\\S]*``.
- "closed objects" (our default, like OpenAI strict mode) are xgrammar's ``strict_mode``;
  llguidance follows JSON Schema (undeclared keys allowed), so for it we add
  ``additionalProperties: false`` where the schema leaves it open. Objects combined through
  ``allOf`` are left open: closing one branch would reject the keys of the others.
- a ``patternProperties`` pattern that matches a declared property name also constrains that
  property (JSON Schema applies both); both backends apply only ``properties`` to a declared
  name, and offer the pattern's other keys. The pattern's schema is folded into the
  property's (``fold_pattern_properties``), and a pattern whose keys are all declared names
  (``^score$``) is dropped: llguidance otherwise offers a ``,`` for a key language it has
  emptied (every word is declared) and dead-ends after it, and xgrammar offers the declared
  key a second time.
- xgrammar reads a node with ``allOf`` as any value, and a node with ``anyOf``/``oneOf`` as
  its branches alone (the node's other keywords dropped). For it (``merge_combinators``)
  ``allOf`` branches are merged into their node, and a node's other keywords into each
  ``anyOf``/``oneOf`` branch, where the merge is exact (``merged_node``); the router
  declares the rest (``combinator_gap``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .keys import LISTS, MAPS, SINGLE
from .walk import escape_key, subschemas

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
                     search_patterns: bool = True, escape_nul: bool = False,
                     merge_combinators: bool = False) -> Any:
    """A rewritten copy; the input is never modified.

    ``search_patterns=False`` leaves ``pattern`` / ``patternProperties`` as written: for
    llguidance, which already reads them as JSON Schema searches (anchors honoured).

    ``explicit_free`` (xgrammar): spell out ``additionalProperties: {}`` / ``items: {}`` on
    containers that declare no members, since xgrammar's strict mode would otherwise leave
    only ``{}`` / ``[]`` once a keyword such as ``required`` or ``maxItems`` is present.

    ``escape_nul`` (xgrammar): a NUL in a pattern (``[^\u0000]`` in the schema's JSON) is
    legal, but xgrammar refuses "null characters" in a regex; the ``\\x00`` escape it reads.

    ``merge_combinators`` (xgrammar): ``allOf`` merged into its node, a node's keywords into
    its ``anyOf``/``oneOf`` branches, where exact (see the module docstring).
    """
    if merge_combinators:
        schema = _merge_walk(schema, 0)
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
#: What each schema-valued key (``schema.keys``) holds, as a rewrite treats it (every
#: other key is copied as is): ``allOf`` branches are not closed, ``items`` may be an array.
_ROLE: dict[str, int] = {
    **{k: _MAP for k in MAPS}, **{k: _LIST for k in LISTS},
    **{k: _SINGLE for k in SINGLE}, "allOf": _ALL_OF, "items": _ITEMS,
}


def _walk(node: Any, close: bool, *, in_all_of: bool, free: bool, search: bool = True,
          nul: bool = False) -> Any:
    """One node rewritten; runs on every node of every cold compile, so it dispatches on
    the keys a node has through one table."""
    if not isinstance(node, dict):
        return node
    if "patternProperties" in node and "properties" in node:
        node = fold_pattern_properties(node)
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


def fold_pattern_properties(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with each ``patternProperties`` schema conjoined into the declared properties
    whose name its pattern matches (a search, as JSON Schema reads it), and the patterns that
    match declared names only dropped (the key left out once none is left). The same node
    when nothing overlaps; a pattern Python's ``re`` cannot read is left as it is."""
    props, pats = node.get("properties"), node.get("patternProperties")
    if not isinstance(props, dict) or not isinstance(pats, dict) or not pats or not props:
        return node
    folded = dict(props)
    kept: dict[str, Any] = {}
    changed = False
    for pattern, sub in pats.items():
        matched = _matching_names(pattern, props) if isinstance(pattern, str) else None
        if not matched:
            kept[pattern] = sub
            continue
        changed = True
        for name in matched:
            folded[name] = conjoin(folded[name], sub)
        words = literal_words(pattern)
        if words is None or not words <= props.keys():
            kept[pattern] = sub
    if not changed:
        return node
    out = {k: v for k, v in node.items() if k != "patternProperties"}
    out["properties"] = folded
    if kept:
        out["patternProperties"] = kept
    return out


def _matching_names(pattern: str, names: dict[str, Any]) -> list[str] | None:
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    return [name for name in names if compiled.search(name)]


def overlapping_pattern_all_of(node: dict[str, Any]) -> bool:
    """Whether folding the node's ``patternProperties`` into its ``properties`` needs an
    ``allOf`` (the schemas could not be merged into one): the router's feature for it."""
    folded = fold_pattern_properties(node)
    if folded is node:
        return False
    before = node.get("properties")
    assert isinstance(before, dict)
    return any(isinstance(v, dict) and "allOf" in v and not (
        isinstance(before[k], dict) and "allOf" in before[k])
        for k, v in folded["properties"].items())


_LITERAL_META = frozenset(".^$*+?{}[]|()")


def literal_words(pattern: str) -> frozenset[str] | None:
    """The finite set of keys an anchored alternation of literals matches (``^a$``,
    ``^(a|b)$``, ``^(?:a|b)$``); None for any other pattern."""
    if not pattern.startswith("^") or not ends_with_anchor(pattern):
        return None
    body = pattern[1:-1]
    for opener in ("(?:", "("):
        if body.startswith(opener) and body.endswith(")"):
            inner = body[len(opener):-1]
            if not any(ch in "()" for ch, _ in structural_chars(inner)):
                body = inner
            break
    words: set[str] = set()
    for alt in body.split("|"):
        word: list[str] = []
        escaped = False
        for ch in alt:
            if escaped:
                if ch.isalnum():
                    return None  # \d, \w, \b ...: a class or an anchor, not a literal
                word.append(ch)
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch in _LITERAL_META:
                return None
            else:
                word.append(ch)
        if escaped:
            return None
        words.add("".join(word))
    return frozenset(words)


#: Keywords that assert on the instance alone (no interplay with other keywords): two
#: schemas made only of them (and annotations) conjoin into one by a union of keys.
_LEAF_KEYS = frozenset({
    "type", "enum", "const", "multipleOf", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "uniqueItems", "minProperties", "maxProperties", "required", "title", "description",
    "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"})
#: Two schemas of these keys merge by naming each property's schemas together.
_OBJECT_KEYS = _LEAF_KEYS | {"properties"}
_LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"})
_UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"})
_NOTES = frozenset({"title", "description", "default", "examples", "$comment"})


def conjoin(a: Any, b: Any) -> Any:
    """A schema an instance satisfies exactly when it satisfies both: one merged schema when
    the keywords allow it (one side structural at most, shared keywords reconciled), else
    ``{"allOf": [a, b]}``."""
    if b is True or b == {}:
        return a
    if a is True or a == {}:
        return b
    if a is False or b is False:
        return False
    if (not isinstance(a, dict) or not isinstance(b, dict)
            or not _UNMERGEABLE.isdisjoint(a) or not _UNMERGEABLE.isdisjoint(b)):
        return {"allOf": [a, b]}  # beside a $ref, drafts disagree (draft 7 ignores them)
    if not (a.keys() <= _LEAF_KEYS or b.keys() <= _LEAF_KEYS
            or (a.keys() <= _OBJECT_KEYS and b.keys() <= _OBJECT_KEYS)):
        return {"allOf": [a, b]}
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value or key in _NOTES:
            out.setdefault(key, value)
            continue
        mine = out[key]
        if key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            # neither side has additionalProperties / patternProperties (_OBJECT_KEYS): each
            # name is held to the schemas that name it
            out[key] = {**mine, **{k: conjoin(mine[k], v) if k in mine else v
                                   for k, v in value.items()}}
            continue
        if key in _LOWER | _UPPER and _number(mine) and _number(value):
            out[key] = max(mine, value) if key in _LOWER else min(mine, value)
        elif key == "required" and isinstance(mine, list) and isinstance(value, list):
            out[key] = list(dict.fromkeys([*mine, *value]))
        elif key == "type":
            both = _type_meet(mine, value)
            if both is None:
                return {"allOf": [a, b]}
            out[key] = both
        else:
            return {"allOf": [a, b]}
    return out


def _merge(a: Any, b: Any) -> Any:
    """``conjoin`` without the ``allOf`` fallback: None when no single schema is exact."""
    out = conjoin(a, b)
    if isinstance(out, dict) and "allOf" in out and not (
            isinstance(a, dict) and out.get("allOf") is a.get("allOf")) and not (
            isinstance(b, dict) and out.get("allOf") is b.get("allOf")):
        return None
    return out


#: Keys a combinator merge leaves on the node as they are (they constrain nothing there).
_STAY = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$anchor", "$comment",
                   "title", "description", "default", "examples", "deprecated", "readOnly",
                   "writeOnly"})


def merged_node(node: dict[str, Any]) -> dict[str, Any] | None:
    """``node`` with its ``allOf`` merged into it, or its other keywords merged into each
    ``anyOf``/``oneOf`` branch (``oneOf(A & R, B & R)`` is ``R & oneOf(A, B)``): the same
    node when there is nothing to merge, None when a merge would not be exact (a ``$ref``,
    keywords that depend on each other on both sides)."""
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        if not all_of:
            return None
        stay = {k: v for k, v in node.items() if k in _STAY}
        merged: Any = {k: v for k, v in node.items() if k not in _STAY and k != "allOf"}
        for branch in all_of:
            if isinstance(branch, dict) and not branch.keys().isdisjoint(_UNMERGEABLE):
                return None
            merged = _merge(merged, branch)
            if merged is None or not isinstance(merged, dict):
                return None
        if "allOf" in merged:
            return None
        return {**stay, **merged}
    keys = [k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    if len(keys) != 1:
        return node if not keys else None
    key = keys[0]
    rest = {k: v for k, v in node.items() if k not in _STAY and k != key}
    if not rest:
        return node
    if not rest.keys().isdisjoint(_UNMERGEABLE):
        return None
    branches = []
    for branch in node[key]:
        if isinstance(branch, dict) and not branch.keys().isdisjoint(_UNMERGEABLE):
            return None
        one = _merge(rest, branch)
        if one is None:
            return None
        branches.append(one)
    return {**{k: v for k, v in node.items() if k in _STAY}, key: branches}


#: Keys that stop a combinator merge: a reference (its target is not at hand), and the
#: keywords whose meaning depends on where their node's other keywords are.
_UNMERGEABLE = frozenset({"$ref", "$dynamicRef", "unevaluatedProperties", "unevaluatedItems"})


def combinator_gap(node: dict[str, Any]) -> bool:
    """Whether the node has an ``allOf``, or an ``anyOf``/``oneOf`` beside other keywords,
    that ``merged_node`` cannot merge away (xgrammar then serves the node wrongly)."""
    if "allOf" not in node and "anyOf" not in node and "oneOf" not in node:
        return False
    all_of = node.get("allOf")
    if (isinstance(all_of, list) and len(all_of) == 1 and len(node) == 1
            and isinstance(all_of[0], dict) and "$ref" in all_of[0]):
        return False  # a lone allOf of one reference: xgrammar follows it
    return merged_node(node) is None


def _merge_walk(node: Any, depth: int) -> Any:
    """Bottom-up: children first, then the node merged (again while it changes)."""
    if not isinstance(node, dict) or depth > 200:
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        role = _ROLE.get(key)
        if role is None:
            out[key] = value
        elif role == _MAP:
            out[key] = {k: _merge_walk(v, depth + 1) for k, v in value.items()} \
                if isinstance(value, dict) else value
        elif isinstance(value, list) and role != _SINGLE:
            out[key] = [_merge_walk(v, depth + 1) for v in value]
        else:
            out[key] = _merge_walk(value, depth + 1)
    for _ in range(4):
        merged = merged_node(out)
        if merged is None or merged is out:
            break
        out = merged
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_meet(one: Any, other: Any) -> Any:
    """The types both allow (``integer`` within ``number``); None when unknown or empty."""
    names = []
    for typ in (one, other):
        listed = typ if isinstance(typ, list) else [typ]
        if not all(isinstance(t, str) for t in listed):
            return None
        names.append(set(listed))
    first, second = names
    meet = (first & second) | {"integer" for x, y in ((first, second), (second, first))
                               if "integer" in x and "number" in y}
    if not meet:
        return None
    ordered = sorted(meet)
    return ordered[0] if len(ordered) == 1 else ordered


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
