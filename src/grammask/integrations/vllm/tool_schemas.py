"""A tool's ``parameters`` as a forced call serves them: checked against JSON Schema's
meta-schema at any depth, and with JSON Schema's open objects spelled out.

Both work on schemas as deep as vLLM itself serves (about 250 nested objects: pydantic's
serialization limit in vLLM's tag builder), whatever the depth of the caller's stack: the
check falls back to one subschema at a time where the whole schema would exhaust Python's
recursion limit (``jsonschema`` takes about 8 frames per level).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from ...schema.keys import LISTS, MAPS, SINGLE, TUPLES

#: the single-subschema keys ``open_objects`` descends into: all but
#: ``unevaluatedProperties``, whose subschema it has always left as written
_SCHEMA_ONE = tuple(k for k in SINGLE if k != "unevaluatedProperties")


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (a message with the JSON pointer of the
    fault), or None, for any JSON value, however deep. Answers are cached by the schema's
    text: clients send the same tools with every turn, and the meta-schema check takes
    about 1 ms per subschema."""
    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # not JSON text: not cached
        return _problem(schema)
    return _cached_problem(key)


@lru_cache(maxsize=1024)
def _cached_problem(key: str) -> str | None:
    return _problem(json.loads(key))


def _problem(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return f"parameters must be a JSON Schema object, got {type(schema).__name__}"
    declared = schema.get("$schema")
    if declared is not None and not isinstance(declared, str):
        return f"$schema must be a URI string, got {type(declared).__name__}"
    validator = _validator(schema)
    try:
        return _first(_errors(validator, schema, ""))
    except RecursionError:
        return _first(_shallow_errors(validator, schema))


def _validator(root: dict[str, Any]) -> Any:
    import jsonschema

    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    return cls(cls.META_SCHEMA)


def _errors(validator: Any, node: Any, at: str) -> Iterator[tuple[str, Any]]:
    for error in validator.iter_errors(node):
        yield at, error


def _first(errors: Iterator[tuple[str, Any]]) -> str | None:
    """The best of the first faulty subschema's errors (``jsonschema.best_match``)."""
    import jsonschema

    for at, group in itertools.groupby(errors, key=lambda pair: pair[0]):
        best = jsonschema.exceptions.best_match(error for _, error in group)
        path = at + "".join(f"/{p}" for p in best.absolute_path)
        return f"{best.message} (at {path})" if path else best.message
    return None


def _shallow_errors(validator: Any, root: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The meta-schema's errors, one subschema at a time (each with its children replaced
    by ``{}``, a valid schema), without recursion: what a deep schema needs."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        at, node = stack.pop()
        if not isinstance(node, dict):
            yield from _errors(validator, node, at)
            continue
        shallow = dict(node)
        for key, child_at, child in _children(node):
            stack.append((f"{at}/{child_at}", child))
            _blank(shallow, key)
        yield from _errors(validator, shallow, at)


def _children(node: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(key, pointer below ``node``, subschema) for each subschema ``node`` holds."""
    for key in MAPS:
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                yield key, f"{key}/{_escape(name)}", child
    for key in (*LISTS, *SINGLE):
        value = node.get(key)
        if isinstance(value, list) and (key in LISTS or key in TUPLES):
            for i, child in enumerate(value):
                yield key, f"{key}/{i}", child
        elif key in SINGLE and isinstance(value, dict | bool):
            yield key, key, value


def _blank(shallow: dict[str, Any], key: str) -> None:
    value = shallow[key]
    if isinstance(value, dict) and key in MAPS:
        shallow[key] = {name: {} for name in value}
    elif isinstance(value, list):
        shallow[key] = [{} for _ in value]
    else:
        shallow[key] = {}


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def open_objects(schema: Any) -> Any:
    """A copy where every object schema without ``additionalProperties`` (nor
    ``unevaluatedProperties``) says ``additionalProperties: true``: the same JSON Schema,
    spelled out for a backend whose default closes objects (xgrammar's tags). Data
    keywords are left alone. No recursion: any depth."""
    top: dict[str, Any] = {"_": schema}
    stack: list[tuple[Any, Any, Any]] = [(top, "_", schema)]  # (parent, key, original)
    while stack:
        parent, slot, node = stack.pop()
        if not isinstance(node, dict):
            parent[slot] = node
            continue
        out = dict(node)
        parent[slot] = out
        for key in MAPS:
            if isinstance(out.get(key), dict):
                out[key] = dict(out[key])
                stack.extend((out[key], name, child) for name, child in node[key].items())
        for key in (*LISTS, *_SCHEMA_ONE):
            value = out.get(key)
            if isinstance(value, list):
                out[key] = list(value)
                stack.extend((out[key], i, child) for i, child in enumerate(value))
            elif key in _SCHEMA_ONE and key in out:
                stack.append((out, key, value))
        if _is_object(out) and "additionalProperties" not in out and (
                "unevaluatedProperties" not in out):
            out["additionalProperties"] = True
    return top["_"]


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and ("properties" in node or "required" in node)
