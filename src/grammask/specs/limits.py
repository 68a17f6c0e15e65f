"""What a spec's inputs must be before any backend sees them: their types, their size and,
for a JSON schema, its depth and that it is JSON at all.

Backends recurse natively and could overflow their stack on a deep schema, and would take
any time on a huge one: both are refused here, with the place (a JSON pointer, a field
name). Every check is the request's fault (a ``GrammarError``: a 400 at admission).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import GrammarError, InvalidSchemaError, InvalidSpecError
from ..schema.walk import escape_key

#: Inputs above this many bytes are refused before any backend sees them (configurable per call).
MAX_SOURCE_BYTES = 4 * 1024 * 1024
#: Nesting deeper than this is refused: backends recurse natively and could overflow their stack.
MAX_NESTING = 100


def check_text(value: object, what: str, max_bytes: int, *, allow_empty: bool) -> str:
    """``value`` when it is a string within ``max_bytes`` of UTF-8 with no NUL (and not
    blank, unless ``allow_empty``); ``InvalidSpecError`` naming ``what`` otherwise."""
    if not isinstance(value, str):
        raise InvalidSpecError(f"{what} must be a string, got {type(value).__name__}", where=what)
    if not allow_empty and not value.strip():
        raise InvalidSpecError(f"{what} is empty", where=what)
    # a code point is at most 4 bytes of UTF-8: most texts need no encoding to be measured
    size = len(value) * 4
    if size > max_bytes:
        size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidSpecError(
            f"{what} is {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.1f} MB limit", where=what
        )
    if "\x00" in value:
        raise InvalidSpecError(f"{what} contains a NUL character",
                               where=f"{what} offset {value.index(chr(0))}")
    return value


def check_bool(value: object, what: str) -> bool:
    """``value`` when it is a boolean; ``InvalidSpecError`` naming ``what`` otherwise."""
    if not isinstance(value, bool):
        raise InvalidSpecError(f"{what} must be a boolean, got {type(value).__name__}",
                               where=what)
    return value


def check_opt_str(value: object, what: str) -> str | None:
    """``value`` when it is None or a string; ``InvalidSpecError`` naming ``what`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidSpecError(f"{what} must be a string, got {type(value).__name__}",
                               where=what)
    return value


def json_object(value: object, *, not_json: Callable[[json.JSONDecodeError], GrammarError],
                wrong_type: Callable[[], GrammarError],
                not_object: Callable[[], GrammarError]) -> dict[str, Any]:
    """A request field that holds a JSON object, given as JSON text or a mapping: the object
    as a new dict. Raises what the caller's factories make (each field words its own
    errors): ``not_json`` for text that is not JSON, ``wrong_type`` for a value neither
    text nor a mapping, ``not_object`` for JSON that is no object."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise not_json(exc) from exc
    elif isinstance(value, Mapping):
        parsed = dict(value)
    else:
        raise wrong_type()
    if not isinstance(parsed, dict):
        raise not_object()
    return parsed


def parse_schema(schema: object, max_bytes: int) -> Any:
    """A JSON schema as given (text, a mapping or a boolean), parsed: the parsed value,
    refused (``InvalidSchemaError`` / ``InvalidSpecError``, with its pointer) when it is not
    JSON, not an object or a boolean, nests deeper than ``MAX_NESTING`` or is over
    ``max_bytes``. A mapping is returned as given (never copied): read it, never modify it."""
    if isinstance(schema, str):
        check_text(schema, "schema", max_bytes, allow_empty=False)
        try:
            if schema.startswith("\ufeff"):  # what json.loads says; the decoder does not check
                raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)",
                                           schema, 0)
            parsed = _SCHEMA_DECODER.decode(schema)
        except json.JSONDecodeError as exc:
            raise InvalidSchemaError(f"schema is not valid JSON: {exc.msg}",
                                     where=f"line {exc.lineno} column {exc.colno}") from exc
        except _OutOfRange as exc:
            raise _out_of_range(schema, exc.text, max_bytes) from None
        except RecursionError as exc:
            raise InvalidSchemaError(f"schema nests deeper than {MAX_NESTING} levels",
                                     where="/") from exc
    elif isinstance(schema, bool | Mapping):
        parsed = schema
    else:
        raise InvalidSpecError(
            f"schema must be a JSON object, a boolean or JSON text, got {type(schema).__name__}",
            where="schema",
        )
    if isinstance(parsed, bool):
        return parsed
    if not isinstance(parsed, Mapping):
        raise InvalidSchemaError(
            f"a JSON schema must be an object or a boolean, got {type(parsed).__name__}",
            where="/",
        )
    if isinstance(schema, str):
        # json.loads made every key a string and every value JSON (NaN refused above), and
        # the text's size bounds the nodes: only the depth is left to check, and a text with
        # no more than MAX_NESTING brackets cannot nest deeper (most schemas: no walk)
        if schema.count("{") + schema.count("[") <= MAX_NESTING:
            return parsed
        deep = _too_deep(parsed)
        if deep is not None:
            raise InvalidSchemaError(f"schema nests deeper than {MAX_NESTING} levels",
                                     where=deep)
        return parsed
    try:
        _check_json_value(parsed, 0, [0], max_bytes)
    except _BadValue as bad:
        raise bad.error() from None
    return parsed


def _no_constant(name: str) -> Any:
    raise InvalidSchemaError(f"{name} is not a JSON number", where="/")


class _OutOfRange(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _finite_float(text: str) -> float:
    """A JSON number beyond a double (``1e400``) reads as an infinity, which no JSON text
    can carry on: refused (a literal is never NaN)."""
    value = float(text)
    if value in (math.inf, -math.inf):
        raise _OutOfRange(text)
    return value


def _out_of_range(text: str, literal: str, max_bytes: int) -> InvalidSchemaError:
    """The error for a number beyond a double, at its pointer (the text parsed again with
    the infinities kept, and walked: only for a refused schema)."""
    where = "/"
    try:
        _check_json_value(json.loads(text, parse_constant=_no_constant), 0, [0], max_bytes)
    except _BadValue as bad:
        where = _pointer(bad.path)
    return InvalidSchemaError(f"{literal} is out of range: a JSON number must fit a double",
                              where=where)


#: ``json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)``, made once
#: (``json.loads`` with options builds a decoder per call)
_SCHEMA_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def _too_deep(root: Any) -> str | None:
    """The pointer of the first value nested deeper than ``MAX_NESTING`` (the root is at 0),
    or None. Iterative (no recursion limit); a first walk only measures the depth, the walk
    that names the place runs only for a schema that is too deep."""
    stack = [(root, 0)]
    while stack:
        value, depth = stack.pop()
        if depth >= MAX_NESTING:  # a non-empty container (only those are pushed) that deep
            return _deep_pointer(root)
        for v in value.values() if isinstance(value, dict) else value:
            if v and isinstance(v, dict | list):
                stack.append((v, depth + 1))
    return None


def _deep_pointer(root: Any) -> str | None:
    containers: list[tuple[Any, int, str]] = [(root, -1, "")]  # value, parent, key
    stack = [(0, 0)]  # (index into containers, depth)
    while stack:
        index, depth = stack.pop()
        value = containers[index][0]
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            if depth >= MAX_NESTING:
                path = [str(k)]
                while index > 0:
                    _, parent, key = containers[index]
                    path.append(key)
                    index = parent
                return _pointer(path[::-1])
            if v and isinstance(v, dict | list):
                containers.append((v, index, str(k)))
                stack.append((len(containers) - 1, depth + 1))
    return None


def _pointer(path: Sequence[str]) -> str:
    return "".join(f"/{escape_key(p)}" for p in path) or "/"


class _BadValue(Exception):
    """Raised deep in the walk; the path is collected on the way up (pointers are built only
    for an error, not for every node of a valid schema)."""

    def __init__(self, kind: type[GrammarError], message: str) -> None:
        self.kind, self.message = kind, message
        self.path: list[str] = []

    def error(self) -> GrammarError:
        return self.kind(self.message, where=_pointer(self.path))


def _check_json_value(value: Any, depth: int, size: list[int], max_bytes: int) -> None:
    """Refuse what JSON cannot carry (NaN, non-string keys) and what is too deep or big."""
    if depth > MAX_NESTING:
        raise _BadValue(InvalidSchemaError, f"schema nests deeper than {MAX_NESTING} levels")
    size[0] += 1
    if size[0] > max_bytes // 2:
        raise _BadValue(InvalidSpecError, f"schema has over {max_bytes // 2} nodes")
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise _BadValue(InvalidSchemaError, f"object key {k!r} is not a string")
            if v is None or isinstance(v, bool | int):
                continue  # the common leaves, without a call
            try:
                _check_json_value(v, depth + 1, size, max_bytes)
            except _BadValue as bad:
                bad.path.insert(0, k)
                raise
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            try:
                _check_json_value(v, depth + 1, size, max_bytes)
            except _BadValue as bad:
                bad.path.insert(0, str(i))
                raise
    elif isinstance(value, str):  # a NUL is legal in a JSON string (`[^\u0000]` patterns)
        size[0] += len(value) // 2
        if size[0] > max_bytes // 2:
            raise _BadValue(InvalidSpecError, f"schema is over the {max_bytes / 1e6:.1f} MB limit")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _BadValue(InvalidSchemaError, f"{value} is not a JSON number")
    elif value is not None and not isinstance(value, bool | int):
        raise _BadValue(InvalidSchemaError, f"{type(value).__name__} is not a JSON value")


