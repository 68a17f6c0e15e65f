"""GrammarSpec: one normalized, immutable description of a constraint, from any front end.

Front ends (Python calls, OpenAI ``response_format``, vLLM ``structured_outputs`` and
``extra_args``) disagree on names and defaults; everything downstream (routing, cache keys,
compilation) sees only this one shape. The cache ``key`` is canonical: JSON sources are keyed by
their sorted, whitespace-free form, so equal schemas written differently share one compile,
while the declared key order is kept in ``source`` because xgrammar emits properties in it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, cast
from urllib.parse import unquote

from . import jsontext
from .catalog import Syntax
from .catalog import load as load_library_grammar
from .errors import GrammarError, InvalidGrammarError, InvalidSchemaError, InvalidSpecError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
#: a registered backend's name (``backends.registry``)
BackendName = str

KINDS: tuple[Kind, ...] = (
    "json_schema", "json_object", "regex", "choice", "grammar", "structural_tag",
)

#: Inputs above this many bytes are refused before any backend sees them (configurable per call).
MAX_SOURCE_BYTES = 4 * 1024 * 1024
#: Nesting deeper than this is refused: backends recurse natively and could overflow their stack.
MAX_NESTING = 100


@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """A constraint. Build it with the classmethods; compare and hash by ``key``.

    Options (all part of the key):
    - ``any_whitespace``: JSON may contain any whitespace between tokens (False: compact
      ``json.dumps(..., separators=(",", ":"))`` style, vLLM's ``disable_any_whitespace``).
    - ``whitespace_pattern``: a regex for JSON whitespace (llguidance only; routes there).
    - ``extra_properties``: whether objects that do not declare ``additionalProperties`` accept
      undeclared keys. False (default) closes them, as OpenAI strict mode and vLLM's xgrammar
      path do; True is plain JSON Schema semantics (OpenAI ``strict: false``).
    - ``strict``: refuse a schema some keyword of which no backend enforces (else: serve it
      with a warning and list the keywords in ``Grammar.unenforced``).
    - ``backend``: force a backend instead of per-request auto routing.
    """

    kind: Kind
    source: str
    syntax: Syntax | None = None
    any_whitespace: bool = True
    whitespace_pattern: str | None = None
    extra_properties: bool = False
    strict: bool = False
    backend: BackendName | None = None
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _digest(self._key_material()))

    def _key_material(self) -> str:
        """The text the key hashes. A JSON schema's ``source`` is compact JSON in its declared
        key order, kept as is: the backends emit properties in that order, so two schemas that
        differ only in it are two grammars (a sorted key once served one's order to the
        other)."""
        canonical = self.source
        if self.kind in ("structural_tag", "choice"):
            canonical = canonical_json(json.loads(self.source))
        # the options as one JSON line (a newline inside a value is escaped), then the text
        # as is: quoting it inside the JSON would escape every quote of a schema again
        options = (self.kind, self.syntax, self.any_whitespace, self.whitespace_pattern,
                   self.extra_properties, self.strict, self.backend)
        head = _HEADS.get(options)
        if head is None:
            head = json.dumps(list(options), ensure_ascii=False)
            if len(_HEADS) < _MAX_HEADS:  # a few option sets in practice; patterns are free text
                _HEADS[options] = head
        return f"{head}\n{canonical}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GrammarSpec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def with_backend(self, backend: BackendName | None) -> GrammarSpec:
        """This spec with another backend (itself when it is the same one). Twins are kept
        on the spec: a compiler with a default backend asks on every cache hit, and a twin
        costs a new key (the source serialized and hashed again)."""
        twins: dict[str | None, GrammarSpec] | None = self.__dict__.get("_twins")
        if twins is not None and (backend is None or isinstance(backend, str)):
            known = twins.get(backend)
            if known is not None:
                return known
        name = backend_name(backend)
        if name == self.backend:
            return self
        twin = replace(self, backend=name)
        if "schema" in self.__dict__:  # the parse is shared (read-only), not repeated
            twin.__dict__["schema"] = self.__dict__["schema"]
        if backend is None or isinstance(backend, str):
            self.__dict__.setdefault("_twins", {})[backend] = twin
        return twin

    @cached_property
    def schema(self) -> Any:
        """The parsed JSON schema (json_schema kind only), parsed once and shared: read it,
        never modify it (normalization makes copies)."""
        if self.kind != "json_schema":
            raise InvalidSpecError(f"a {self.kind} spec has no JSON schema")
        return json.loads(self.source)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise InvalidSpecError(f"a {self.kind} spec has no choices")
        return cast(list[str], json.loads(self.source))

    def describe(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind}:{text}"

    # ----------------------------------------------------------------- Python constructors
    @classmethod
    def json_schema(
        cls,
        schema: Mapping[str, Any] | str | bool,
        *,
        any_whitespace: bool = True,
        whitespace_pattern: str | None = None,
        extra_properties: bool = False,
        strict: bool = False,
        backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        parsed = _parse_schema(schema, max_bytes)
        spec = cls(
            "json_schema", jsontext.compact(parsed),
            any_whitespace=_check_bool(any_whitespace, "any_whitespace"),
            whitespace_pattern=_check_opt_str(whitespace_pattern, "whitespace_pattern"),
            extra_properties=_check_bool(extra_properties, "extra_properties"),
            strict=_check_bool(strict, "strict"), backend=backend_name(backend),
        )
        if isinstance(schema, str):  # parsed here, so nobody else holds it: no second parse
            spec.__dict__["schema"] = parsed
        return spec

    @classmethod
    def json_object(
        cls, *, any_whitespace: bool = True, whitespace_pattern: str | None = None,
        backend: BackendName | None = None,
    ) -> GrammarSpec:
        """Any JSON object (OpenAI ``json_object``)."""
        return cls(
            "json_object", "", any_whitespace=_check_bool(any_whitespace, "any_whitespace"),
            whitespace_pattern=_check_opt_str(whitespace_pattern, "whitespace_pattern"),
            backend=backend_name(backend),
        )

    @classmethod
    def regex(
        cls, pattern: str, *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        text = _check_text(pattern, "regex", max_bytes, allow_empty=True)
        return cls("regex", text, backend=backend_name(backend))

    @classmethod
    def choice(
        cls, options: Sequence[str], *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        if isinstance(options, str | bytes) or not isinstance(options, Sequence):
            raise InvalidSpecError(
                f"choice must be a list of strings, got {type(options).__name__}", where="choice"
            )
        if not options:
            raise InvalidSpecError("choice list is empty: nothing could ever be generated",
                                   where="choice")
        for i, opt in enumerate(options):
            if not isinstance(opt, str):
                raise InvalidSpecError(
                    f"choice entries must be strings, got {type(opt).__name__}",
                    where=f"choice[{i}]",
                )
            _check_text(opt, f"choice[{i}]", max_bytes, allow_empty=True)
        return cls("choice", json.dumps(list(options), ensure_ascii=False),
                   backend=backend_name(backend))

    @classmethod
    def named(cls, name: str, *, backend: BackendName | None = None) -> GrammarSpec:
        """A grammar of the shipped library (``grammask.library.names()``), by name.

        Names travel in their own field (``grammar_name``), never inside grammar text, so a
        name can never be mistaken for a grammar or the other way round."""
        if not isinstance(name, str):
            raise InvalidSpecError(f"a library grammar name must be a string, got "
                                   f"{type(name).__name__}", where="grammar_name")
        grammar = load_library_grammar(name)
        return cls.grammar(grammar.text, syntax=grammar.syntax, backend=backend)

    @classmethod
    def grammar(
        cls, text: str, syntax: Syntax | None = None, *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        """An EBNF (GBNF, ``::=``) or Lark (``:``) grammar; ``syntax=None`` detects which."""
        body = _check_text(text, "grammar", max_bytes, allow_empty=False)
        if syntax is None:
            syntax = detect_syntax(body)
        elif syntax not in ("ebnf", "lark"):
            raise InvalidSpecError(f"grammar syntax must be 'ebnf' or 'lark', got {syntax!r}",
                                   where="syntax")
        return cls("grammar", body, syntax=syntax, backend=backend_name(backend))

    @classmethod
    def structural_tag(
        cls, tag: Mapping[str, Any] | str, *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        """An xgrammar structural tag (``{"type": "structural_tag", ...}``), as vLLM takes it."""
        if isinstance(tag, str):
            _check_text(tag, "structural_tag", max_bytes, allow_empty=False)
            try:
                parsed = json.loads(tag)
            except json.JSONDecodeError as exc:
                raise InvalidGrammarError(f"structural tag is not valid JSON: {exc.msg}",
                                          where=f"line {exc.lineno} column {exc.colno}") from exc
        elif isinstance(tag, Mapping):
            parsed = dict(tag)
        else:
            raise InvalidSpecError(
                f"structural_tag must be a JSON string or object, got {type(tag).__name__}",
                where="structural_tag",
            )
        if not isinstance(parsed, dict):
            raise InvalidGrammarError("structural tag must be a JSON object",
                                      where="structural_tag")
        check_structural_tag(parsed)
        return cls("structural_tag", jsontext.compact(parsed), backend=backend_name(backend))

    # -------------------------------------------------------------------- front ends
    @classmethod
    def from_openai(cls, response_format: Mapping[str, Any]) -> GrammarSpec | None:
        """OpenAI ``response_format``. ``text`` means no constraint (None).

        ``strict: true`` closes objects and refuses schemas with keywords no backend enforces
        (OpenAI's guarantee); ``strict: false`` or absent keeps plain JSON Schema semantics
        (undeclared keys allowed) and serves best-effort with the gaps listed.
        """
        if not isinstance(response_format, Mapping):
            raise InvalidSpecError("response_format must be an object", where="response_format")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, Mapping):
                raise InvalidSpecError("json_schema must be an object with a 'schema'",
                                       where="response_format.json_schema")
            if "schema" not in body:
                raise InvalidSpecError("json_schema.schema is missing",
                                       where="response_format.json_schema")
            strict = body.get("strict", False)
            if not isinstance(strict, bool) and strict is not None:
                raise InvalidSpecError("strict must be a boolean",
                                       where="response_format.json_schema.strict")
            return cls.json_schema(body["schema"], strict=bool(strict),
                                   extra_properties=not strict)
        raise InvalidSpecError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            where="response_format.type",
        )

    @classmethod
    def from_vllm(cls, params: Mapping[str, Any]) -> GrammarSpec:
        """A vLLM ``structured_outputs`` object, with its per-request options honoured."""
        if not isinstance(params, Mapping):
            raise InvalidSpecError(
                f"structured outputs must be an object, got {type(params).__name__}")
        known = set(_VLLM_KINDS) | set(_VLLM_OPTIONS) | {"backend", "strict", "extra_properties"}
        unknown = sorted(k for k in params if k not in known and params[k] is not None)
        if unknown:
            raise InvalidSpecError(f"unknown structured-output keys {unknown}",
                                   where=unknown[0])
        given = [k for k in _VLLM_KINDS if params.get(k) not in (None, False)]
        if len(given) != 1:
            raise InvalidSpecError(
                "exactly one of json, regex, choice, grammar, grammar_name, json_object, "
                "structural_tag "
                f"must be given, got {given or 'none'}"
            )
        kind = given[0]
        value = params[kind]
        backend = backend_name(params.get("backend"))
        any_ws = not _check_bool(params.get("disable_any_whitespace", False),
                                 "disable_any_whitespace")
        ws_pattern = _check_opt_str(params.get("whitespace_pattern"), "whitespace_pattern")
        if kind == "json":
            extra = params.get("extra_properties")
            if extra is None:
                extra = not _check_bool(params.get("disable_additional_properties", True),
                                        "disable_additional_properties")
            return cls.json_schema(
                value, any_whitespace=any_ws, whitespace_pattern=ws_pattern,
                extra_properties=_check_bool(extra, "extra_properties"),
                strict=_check_bool(params.get("strict", False), "strict"), backend=backend,
            )
        if kind == "json_object":
            return cls.json_object(any_whitespace=any_ws, whitespace_pattern=ws_pattern,
                                   backend=backend)
        if kind == "regex":
            return cls.regex(value, backend=backend)
        if kind == "choice":
            return cls.choice(value, backend=backend)
        if kind == "grammar":
            return cls.grammar(value, backend=backend)
        if kind == "grammar_name":
            return cls.named(value, backend=backend)
        return cls.structural_tag(value, backend=backend)


_VLLM_KINDS = ("json", "regex", "choice", "grammar", "grammar_name", "json_object",
               "structural_tag")
_VLLM_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                 "disable_fallback", "all_choices", "all_tokens")


# ------------------------------------------------------------------------------ helpers
#: the key's option line per option set (``_key_material``), made once
_HEADS: dict[tuple[Any, ...], str] = {}
_MAX_HEADS = 256


def canonical_json(value: Any) -> str:
    """Sorted, whitespace-free JSON: the form cache keys are computed from."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def detect_syntax(text: str) -> Syntax:
    """GBNF rules use ``::=``; Lark rules use ``:``."""
    return "ebnf" if "::=" in text else "lark"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _check_text(value: object, what: str, max_bytes: int, *, allow_empty: bool) -> str:
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


def _check_bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidSpecError(f"{what} must be a boolean, got {type(value).__name__}",
                               where=what)
    return value


def _check_opt_str(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidSpecError(f"{what} must be a string, got {type(value).__name__}",
                               where=what)
    return value


def backend_name(value: object) -> BackendName | None:
    """A backend as given by a user (``auto``/None, an alias, a name): the registered name,
    None for auto routing; ``InvalidSpecError`` naming the registered ones otherwise."""
    if value is None or value == "auto":
        return None
    return _registry_resolve()(value)


def _registry_resolve() -> Callable[[object], BackendName | None]:
    """The registry's ``resolve``, imported on first use (importing the registry loads the
    backends package, which imports this module) and kept: an import statement per spec
    cost ~10 µs on a cold compile's path."""
    global _RESOLVE
    if _RESOLVE is None:
        from .backends.registry import resolve

        _RESOLVE = resolve
    return _RESOLVE


_RESOLVE: Callable[[object], BackendName | None] | None = None


def _parse_schema(schema: object, max_bytes: int) -> Any:
    if isinstance(schema, str):
        _check_text(schema, "schema", max_bytes, allow_empty=False)
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
    return "".join(f"/{_escape(p)}" for p in path) or "/"


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


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# ------------------------------------------------------------------ structural tags
def check_structural_tag(tag: Mapping[str, Any]) -> None:
    """The shape of a structural tag, checked here so a malformed one is refused naming its
    field (the backends answer ``'triggers'`` or ``'int' object is not iterable``).

    Two forms: vLLM's legacy ``{"structures": [{"begin", "schema", "end"}], "triggers"}`` and
    xgrammar's ``{"type": "structural_tag", "format": {...}}`` (its content xgrammar checks)."""
    def fail(message: str, where: str) -> InvalidGrammarError:
        return InvalidGrammarError(f"structural tag: {message}", where=f"structural_tag{where}")

    if "structures" in tag or "triggers" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise fail("structures must be a non-empty array of objects", "/structures")
        if (not isinstance(triggers, list) or not triggers
                or not all(isinstance(t, str) and t for t in triggers)):
            raise fail("triggers must be a non-empty array of non-empty strings", "/triggers")
        for i, item in enumerate(structures):
            where = f"/structures/{i}"
            if not isinstance(item, Mapping):
                raise fail(f"each structure must be an object with begin, schema and end, got "
                           f"{_json_type(item)}", where)
            unknown = sorted(set(item) - {"begin", "schema", "end"})
            if unknown:
                raise fail(f"unknown structure keys {unknown}", f"{where}/{unknown[0]}")
            begin = item.get("begin")
            if not isinstance(begin, str) or not begin:
                raise fail("begin must be a non-empty string", f"{where}/begin")
            if not isinstance(item.get("end", ""), str):
                raise fail("end must be a string", f"{where}/end")
            if not isinstance(item.get("schema", {}), bool | Mapping):
                raise fail("schema must be a JSON schema (an object or a boolean)",
                           f"{where}/schema")
            if not any(begin.startswith(t) for t in triggers):
                raise fail(f"begin {begin!r} starts with no trigger of {triggers}",
                           f"{where}/begin")
        return
    if tag.get("type") != "structural_tag":
        raise fail("expected type \"structural_tag\" with a format, or structures and "
                   "triggers", "/type")
    fmt = tag.get("format")
    if not isinstance(fmt, Mapping):
        raise fail(f"format must be an object, got {_json_type(fmt)}", "/format")
    if not isinstance(fmt.get("type"), str):
        raise fail("format.type must be a string", "/format/type")


# ------------------------------------------------------------------ schema keyword values
#: JSON Schema's type names (both backends refuse others with a message that has no location).
SCHEMA_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "multipleOf")
_EXCLUSIVE = ("exclusiveMinimum", "exclusiveMaximum")  # numbers; booleans in draft 4
_RANGES = (("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"), ("minContains", "maxContains"),
           ("minimum", "maximum"))
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_STRINGS = ("pattern", "format", "$ref", "$id", "$anchor", "$dynamicRef")
#: The largest magnitude a bound may have: beyond a double, xgrammar fails with no message.
_MAX_BOUND = 1.7976931348623157e308
_SCHEMA_CHILD_ORDER = {k: i for i, k in enumerate((*_SCHEMA_MAPS, *_SCHEMA_LISTS,
                                                     *_SCHEMA_ONE))}
_SCHEMA_CHILD_KEYS = frozenset(_SCHEMA_CHILD_ORDER)
_SCHEMA_MAP_KEYS, _SCHEMA_LIST_KEYS = frozenset(_SCHEMA_MAPS), frozenset(_SCHEMA_LISTS)


def check_keywords(schema: Any) -> None:
    """Refuse keyword values JSON Schema's metaschema refuses (a negative ``minItems``, an
    unknown ``type``, ``minLength`` above ``maxLength``, a local ``$ref`` to nothing), with the
    JSON pointer of the keyword. Backends either accept such values silently or refuse them
    without a location. A walk over the subschemas only: jsonschema's metaschema validation
    measured 1 ms p50 but 50-130 ms p99 and 1 s on a 1 MB corpus schema."""
    nested_ids = False
    stack: list[tuple[str, Any, bool]] = [("", schema, True)]
    refs: list[tuple[str, str]] = []
    while stack:
        ptr, node, positive = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, Mapping):
            raise InvalidSchemaError(
                f"a subschema must be an object or a boolean, got {_json_type(node)}",
                where=ptr or "/")
        if not keywords_ok(node, ranges=positive):
            _check_node(node, ptr, ranges=positive)  # raises, with the keyword's pointer
        if ptr and ("$id" in node or ("id" in node and isinstance(node.get("id"), str))):
            nested_ids = True  # refs resolve against another base: not checked here
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            refs.append((f"{ptr}/$ref", ref))
        present = _SCHEMA_CHILD_KEYS.intersection(node)
        for key in sorted(present, key=_SCHEMA_CHILD_ORDER.__getitem__) \
                if len(present) > 1 else present:
            child = node[key]
            if key in _SCHEMA_MAP_KEYS:
                if isinstance(child, Mapping):
                    stack.extend((f"{ptr}/{key}/{_escape(k)}", v, positive)
                                 for k, v in child.items())
            elif key in _SCHEMA_LIST_KEYS:
                if isinstance(child, list):
                    stack.extend((f"{ptr}/{key}/{i}", v, positive)
                                 for i, v in enumerate(child))
            else:
                # an empty range under ``not`` / ``if`` is a way to say something, not an error
                keep = positive and key not in ("not", "if")
                if isinstance(child, list) and key in ("items", "additionalItems"):
                    stack.extend((f"{ptr}/{key}/{i}", v, keep) for i, v in enumerate(child))
                else:
                    stack.append((f"{ptr}/{key}", child, keep))
    if not nested_ids:
        for where, ref in refs:
            if resolve_pointer(schema, ref) is _MISSING:
                raise InvalidSchemaError(f"$ref {ref!r} points to nothing in this schema",
                                         where=where)


def _check_node(node: Mapping[str, Any], ptr: str, *, ranges: bool) -> None:
    typ = node.get("type")
    if "type" in node:
        names = typ if isinstance(typ, list) else [typ]
        if not names or (isinstance(typ, list) and len(set(map(str, names))) != len(names)):
            raise InvalidSchemaError("type must be a type name or a non-empty list of distinct "
                                     "type names", where=f"{ptr}/type")
        for i, name in enumerate(names):
            if not isinstance(name, str) or name not in SCHEMA_TYPES:
                where = f"{ptr}/type/{i}" if isinstance(typ, list) else f"{ptr}/type"
                raise InvalidSchemaError(
                    f"unknown type {name!r}: expected one of {', '.join(sorted(SCHEMA_TYPES))}",
                    where=where)
    if _CHECKED_KEYS.isdisjoint(node):  # most nodes: a type and annotations only
        return
    for key in _COUNTS:
        if key in node:
            value = node[key]
            if not _is_number(value) or value != int(value) or value < 0:
                raise InvalidSchemaError(f"{key} must be a non-negative integer, got "
                                         f"{_show(value)}", where=f"{ptr}/{key}")
    for key in (*_NUMBERS, *_EXCLUSIVE):
        if key in node:
            value = node[key]
            if key in _EXCLUSIVE and isinstance(value, bool):
                continue
            if not _is_number(value):
                raise InvalidSchemaError(f"{key} must be a number, got {_show(value)}",
                                         where=f"{ptr}/{key}")
            if abs(value) > _MAX_BOUND:
                raise InvalidSchemaError(f"{key} {_show(value)} is beyond the range of a "
                                         "double, which both backends compute with",
                                         where=f"{ptr}/{key}")
            if key == "multipleOf" and value <= 0:
                raise InvalidSchemaError(f"multipleOf must be greater than 0, got "
                                         f"{_show(value)}", where=f"{ptr}/{key}")
    for low, high in _RANGES if ranges else ():
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
            raise InvalidSchemaError(f"{low} {_show(lo)} is greater than {high} {_show(hi)}: "
                                     "no value is valid", where=f"{ptr}/{low}")
    for key, want, ok in _SHAPES:
        if key in node and not ok(node[key]):
            raise InvalidSchemaError(f"{key} must be {want}, got {_json_type(node[key])}",
                                     where=f"{ptr}/{key}")
    required = node.get("required")
    if isinstance(required, list):
        for i, name in enumerate(required):
            if not isinstance(name, str):
                raise InvalidSchemaError(f"required names must be strings, got "
                                         f"{_json_type(name)}", where=f"{ptr}/required/{i}")


def _is_map(v: object) -> bool:
    """``isinstance(v, Mapping)``, with parsed JSON's dicts first: the ABC's check costs
    ~8x a plain type check, on every subschema's keys of every cold compile."""
    return isinstance(v, (dict, Mapping))


def _is_schema(v: object) -> bool:
    return isinstance(v, (dict, bool, Mapping))


_SHAPES: tuple[tuple[str, str, Any], ...] = (
    *((k, "an object", _is_map) for k in
      (*_SCHEMA_MAPS, "dependentRequired")),
    *((k, "a non-empty array", lambda v: isinstance(v, list) and bool(v)) for k in
      ("allOf", "anyOf", "oneOf")),
    ("prefixItems", "an array", lambda v: isinstance(v, list)),
    ("enum", "an array", lambda v: isinstance(v, list)),
    ("required", "an array", lambda v: isinstance(v, list)),
    ("uniqueItems", "a boolean", lambda v: isinstance(v, bool)),
    *((k, "a string", lambda v: isinstance(v, str)) for k in _STRINGS),
    *((k, "an object or a boolean", _is_schema) for k in _SCHEMA_ONE
      if k not in ("items", "additionalItems")),
    *((k, "an object, a boolean or an array", lambda v: _is_schema(v) or isinstance(v, list))
      for k in ("items", "additionalItems")),
)
#: Every key ``_check_node`` looks at beyond ``type``.
_CHECKED_KEYS = frozenset({*_COUNTS, *_NUMBERS, *_EXCLUSIVE, *(k for r in _RANGES for k in r),
                           *(k for k, _, _ in _SHAPES), "required"})


def keywords_ok(node: Mapping[str, Any], *, ranges: bool) -> bool:
    """Whether ``_check_node`` passes this node: the same checks with no message and no
    pointer, looking only at the checked keys the node has (it runs for every subschema of
    every cold compile; the checker that names the error runs only for a bad node)."""
    if "type" in node:
        typ = node["type"]
        if isinstance(typ, str):
            if typ not in SCHEMA_TYPES:
                return False
        elif not isinstance(typ, list) or not typ or len(set(map(str, typ))) != len(typ) \
                or not all(isinstance(n, str) and n in SCHEMA_TYPES for n in typ):
            return False
    present = _CHECKED_KEYS.intersection(node)
    if not present:  # most nodes: a type and annotations only
        return True
    for key in present:
        if not _VALID[key](node[key]):
            return False
    if ranges and not _RANGE_KEYS.isdisjoint(present):
        for low, high in _RANGES:
            lo, hi = node.get(low), node.get(high)
            if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
                return False
    return True


def _count_ok(value: Any) -> bool:
    return _is_number(value) and value == int(value) and value >= 0


def _number_ok(value: Any) -> bool:
    return _is_number(value) and abs(value) <= _MAX_BOUND


def _exclusive_ok(value: Any) -> bool:
    return isinstance(value, bool) or _number_ok(value)


def _multiple_ok(value: Any) -> bool:
    return _number_ok(value) and value > 0


def _names_ok(value: Any) -> bool:
    return not isinstance(value, list) or all(isinstance(n, str) for n in value)


def _every(*checks: Any) -> Any:
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:  # no generator per call
        first, second = checks
        return lambda value: first(value) and second(value)
    return lambda value: all(ok(value) for ok in checks)


_PREDICATES: dict[str, list[Any]] = {k: [] for k in _CHECKED_KEYS}
for _k in _COUNTS:
    _PREDICATES[_k].append(_count_ok)
for _k in _NUMBERS:
    _PREDICATES[_k].append(_multiple_ok if _k == "multipleOf" else _number_ok)
for _k in _EXCLUSIVE:
    _PREDICATES[_k].append(_exclusive_ok)
for _k, _, _ok in _SHAPES:
    _PREDICATES[_k].append(_ok)
_PREDICATES["required"].append(_names_ok)
#: per checked key, what its value must pass (``_check_node``'s checks, as one predicate)
_VALID: dict[str, Any] = {k: _every(*checks) for k, checks in _PREDICATES.items()}
_RANGE_KEYS = frozenset(k for r in _RANGES for k in r)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: object) -> str:
    text = json.dumps(value) if _is_number(value) or isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return f"the number {_show(value)}"
    if isinstance(value, str):
        return f"the string {_show(value)}"
    return "an array" if isinstance(value, list) else type(value).__name__


_MISSING = object()


def resolve_pointer(schema: Any, ref: str) -> Any:
    """What a local ``$ref`` (``#`` or ``#/a/b``) points to, or ``_MISSING``; anchors
    (``#name``) are taken as found (they are not pointers)."""
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return True
    node = schema
    for part in fragment.split("/")[1:] if fragment else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
