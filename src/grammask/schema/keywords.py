"""Keyword values JSON Schema's metaschema refuses, refused with the keyword's JSON pointer.

One table of rules (``_RULES``: a key, a test of its value, the problem when the test
fails) serves two readers: ``keywords_ok``, the fast yes/no that runs for every subschema of
every cold compile, and ``check_node``, which names the first failing rule and runs only for
a node already found bad. ``check_keywords`` / ``checked`` walk a whole schema with them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import InvalidSchemaError
from .keys import MAPS, SINGLE, TUPLES
from .walk import MISSING, Walk, resolve_pointer

#: JSON Schema's type names (both backends refuse others with a message that has no location).
SCHEMA_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "multipleOf")
_EXCLUSIVE = ("exclusiveMinimum", "exclusiveMaximum")  # numbers; booleans in draft 4
_RANGES = (("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"), ("minContains", "maxContains"),
           ("minimum", "maximum"))
_RANGE_KEYS = frozenset(k for r in _RANGES for k in r)
_STRINGS = ("pattern", "format", "$ref", "$id", "$anchor", "$dynamicRef")
#: The largest magnitude a bound may have: beyond a double, xgrammar fails with no message.
_MAX_BOUND = 1.7976931348623157e308


def check_keywords(schema: Any) -> None:
    """Refuse keyword values JSON Schema's metaschema refuses (a negative ``minItems``, an
    unknown ``type``, ``minLength`` above ``maxLength``, a local ``$ref`` to nothing), with the
    JSON pointer of the keyword; returns None for a schema that passes. Backends either
    accept such values silently or refuse them without a location. A walk over the
    subschemas only: jsonschema's metaschema validation has a long tail on large schemas
    (docs/benchmarks.md, Figures: cold path)."""
    for _ in checked(Walk(schema)):
        pass


def checked(walk: Walk) -> Iterator[tuple[int, dict[str, Any]]]:
    """The walk's object subschemas ``(index, node)``, each checked before it is yielded;
    ``InvalidSchemaError`` at the first bad one (a non-schema where a subschema belongs, a
    bad keyword value), then, after the last, at a local ``$ref`` to nothing. A caller that
    gathers more per node (the router's analysis) walks the schema once this way."""
    nested_ids = False
    refs: list[tuple[int, str]] = []
    for at, node, positive in walk:
        if not isinstance(node, dict):
            if isinstance(node, bool | Mapping):
                continue
            raise InvalidSchemaError(
                f"a subschema must be an object or a boolean, got {json_type(node)}",
                where=walk.pointer(at) or "/")
        if not keywords_ok(node, ranges=positive):
            check_node(node, walk.pointer(at), ranges=positive)  # raises, naming the keyword
        if at and ("$id" in node or ("id" in node and isinstance(node.get("id"), str))):
            nested_ids = True  # refs resolve against another base: not checked here
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            refs.append((at, ref))
        yield at, node
    if not nested_ids:
        for at, ref in refs:
            if resolve_pointer(walk.root, ref) is MISSING:
                raise InvalidSchemaError(f"$ref {ref!r} points to nothing in this schema",
                                         where=f"{walk.pointer(at)}/$ref")


def keywords_ok(node: Mapping[str, Any], *, ranges: bool) -> bool:
    """Whether ``check_node`` passes this node: the same rules with no message and no
    pointer, looking only at the checked keys the node has. ``ranges``: an empty range
    (``minimum`` above ``maximum``) counts as bad (not under ``not``/``if``)."""
    present = _CHECKED_KEYS.intersection(node)
    if not present:  # most nodes: annotations only
        return True
    for key in present:
        if not _VALID[key](node[key]):
            return False
    return not (ranges and not _RANGE_KEYS.isdisjoint(present) and _empty_range(node))


def check_node(node: Mapping[str, Any], ptr: str, *, ranges: bool) -> None:
    """Raise ``InvalidSchemaError`` for the first rule the node breaks (the value rules,
    then, with ``ranges``, an empty range, then the shape rules), at ``ptr`` and the
    keyword's pointer; return when it breaks none."""
    _first_broken(node, ptr, _VALUE_RULES)
    empty = _empty_range(node) if ranges else None
    if empty is not None:
        (low, lo), (high, hi) = empty
        raise InvalidSchemaError(f"{low} {show(lo)} is greater than {high} {show(hi)}: "
                                 "no value is valid", where=f"{ptr}/{low}")
    _first_broken(node, ptr, _SHAPE_RULES)


def _first_broken(node: Mapping[str, Any], ptr: str, rules: tuple[_Rule, ...]) -> None:
    for key, ok, problem in rules:
        if key in node and not ok(node[key]):
            message, suffix = problem(key, node[key])
            raise InvalidSchemaError(message, where=f"{ptr}{suffix}")


def _empty_range(node: Mapping[str, Any]) -> tuple[tuple[str, Any], tuple[str, Any]] | None:
    """The first declared range with its lower bound above its upper one."""
    for low, high in _RANGES:
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
            return (low, lo), (high, hi)
    return None


# ------------------------------------------------------------------------------ the rules
def _type_ok(typ: Any) -> bool:
    if isinstance(typ, str):
        return typ in SCHEMA_TYPES
    return (isinstance(typ, list) and bool(typ) and len(set(map(str, typ))) == len(typ)
            and all(isinstance(n, str) and n in SCHEMA_TYPES for n in typ))


def _type_problem(_: str, typ: Any) -> tuple[str, str]:
    names = typ if isinstance(typ, list) else [typ]
    if not names or (isinstance(typ, list) and len(set(map(str, names))) != len(names)):
        return ("type must be a type name or a non-empty list of distinct type names",
                "/type")
    for i, name in enumerate(names):
        if not isinstance(name, str) or name not in SCHEMA_TYPES:
            return (f"unknown type {name!r}: expected one of {', '.join(sorted(SCHEMA_TYPES))}",
                    f"/type/{i}" if isinstance(typ, list) else "/type")
    raise AssertionError("a type the rule passes")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count_ok(value: Any) -> bool:
    return _is_number(value) and value == int(value) and value >= 0


def _bounded(value: Any) -> bool:
    return bool(abs(value) <= _MAX_BOUND)


def _is_map(v: object) -> bool:
    """``isinstance(v, Mapping)``, with parsed JSON's dicts first: the ABC's check costs
    far more than a plain type check, on every subschema's keys of every cold compile
    (docs/benchmarks.md, Figures: cold path)."""
    return isinstance(v, (dict, Mapping))


def _is_schema(v: object) -> bool:
    return isinstance(v, (dict, bool, Mapping))


def _names_ok(value: Any) -> bool:
    return not isinstance(value, list) or all(isinstance(n, str) for n in value)


def _names_problem(_: str, value: Any) -> tuple[str, str]:
    i, name = next((i, n) for i, n in enumerate(value) if not isinstance(n, str))
    return f"required names must be strings, got {json_type(name)}", f"/required/{i}"


def _says(text: str) -> Callable[[str, Any], tuple[str, str]]:
    """A problem whose message is ``text`` formatted with the key, the value shown
    (``show``) and the value's JSON type (``json_type``), at the keyword's pointer."""
    return lambda key, value: (text.format(key=key, shown=show(value),
                                           kind=json_type(value)), f"/{key}")


def _shape(want: str) -> Callable[[str, Any], tuple[str, str]]:
    return _says(f"{{key}} must be {want}, got {{kind}}")


#: (key, what its value must pass, the problem as (message, pointer suffix) when it fails)
_Rule = tuple[str, Callable[[Any], bool], Callable[[str, Any], tuple[str, str]]]
_NOT_NUMBER = _says("{key} must be a number, got {shown}")
_BEYOND = _says("{key} {shown} is beyond the range of a double, which both backends compute "
                "with")
#: The rules in the order ``check_node`` reports them: the values', then (after the empty
#: ranges) the shapes'. A key's rules run in order: a later one may assume the earlier passed.
_VALUE_RULES: tuple[_Rule, ...] = (
    ("type", _type_ok, _type_problem),
    *((k, _count_ok, _says("{key} must be a non-negative integer, got {shown}"))
      for k in _COUNTS),
    *(rule for k in _NUMBERS for rule in ((k, _is_number, _NOT_NUMBER), (k, _bounded, _BEYOND))),
    ("multipleOf", lambda v: v > 0, _says("multipleOf must be greater than 0, got {shown}")),
    *(rule for k in _EXCLUSIVE for rule in (
        (k, lambda v: isinstance(v, bool) or _is_number(v), _NOT_NUMBER),
        (k, lambda v: isinstance(v, bool) or _bounded(v), _BEYOND))),
)
_SHAPE_RULES: tuple[_Rule, ...] = (
    *((k, _is_map, _shape("an object")) for k in (*MAPS, "dependentRequired")),
    *((k, lambda v: isinstance(v, list) and bool(v), _shape("a non-empty array"))
      for k in ("allOf", "anyOf", "oneOf")),
    ("prefixItems", lambda v: isinstance(v, list), _shape("an array")),
    ("enum", lambda v: isinstance(v, list), _shape("an array")),
    ("required", lambda v: isinstance(v, list), _shape("an array")),
    ("uniqueItems", lambda v: isinstance(v, bool), _shape("a boolean")),
    *((k, lambda v: isinstance(v, str), _shape("a string")) for k in _STRINGS),
    *((k, _is_schema, _shape("an object or a boolean")) for k in SINGLE if k not in TUPLES),
    *((k, lambda v: _is_schema(v) or isinstance(v, list),
       _shape("an object, a boolean or an array")) for k in SINGLE if k in TUPLES),
    ("required", _names_ok, _names_problem),
)
_RULES = (*_VALUE_RULES, *_SHAPE_RULES)
#: Every key a rule looks at.
_CHECKED_KEYS = frozenset(k for k, _, _ in _RULES)


def _every(*checks: Callable[[Any], bool]) -> Callable[[Any], bool]:
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:  # no generator per call
        first, second = checks
        return lambda value: first(value) and second(value)
    return lambda value: all(ok(value) for ok in checks)


#: per checked key, its rules as one predicate (``keywords_ok``)
_VALID: dict[str, Callable[[Any], bool]] = {
    key: _every(*(ok for k, ok, _ in _RULES if k == key)) for key in _CHECKED_KEYS}


# ------------------------------------------------------------------------- values in text
def show(value: object) -> str:
    """A value as a message quotes it (numbers and strings as JSON, cut at 40 characters)."""
    text = json.dumps(value) if _is_number(value) or isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_type(value: object) -> str:
    """A value's JSON type as a message names it ("the number 5", "an array")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return f"the number {show(value)}"
    if isinstance(value, str):
        return f"the string {show(value)}"
    return "an array" if isinstance(value, list) else type(value).__name__
