"""GrammarSpec: one normalized, immutable description of a constraint, the value type.

Front ends (OpenAI ``response_format`` and vLLM ``structured_outputs``: ``spec_frontends``;
vLLM ``extra_args``: ``request``) disagree on names and defaults and build this one shape
through its classmethods; everything downstream (routing, cache keys, compilation) sees only
it. What an input may be (types, size, depth) is ``limits``'; what a schema's keywords may
be is checked by the router (``schema.keywords``), not here. The cache ``key`` hashes the
options and the source text (a JSON schema's compact text in its declared key order, kept
because the backends emit properties in it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Literal, cast

from ..errors import GrammarError, InvalidGrammarError, InvalidSpecError
from ..schema import jsontext
from ..schema.jsontext import canonical_json
from .backend_names import resolve as resolve_backend
from .library import Syntax
from .library import load as load_library_grammar
from .limits import (
    MAX_SOURCE_BYTES,
    check_bool,
    check_opt_str,
    check_text,
    json_object,
    parse_schema,
)
from .structural_tag import check_structural_tag

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
#: a registered backend's name (``backends.registry``)
BackendName = str

KINDS: tuple[Kind, ...] = (
    "json_schema", "json_object", "regex", "choice", "grammar", "structural_tag",
)


@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """A constraint: an immutable value, built with the classmethods (one per kind) and
    compared and hashed by ``key``. Building one checks only what any constraint of its kind
    must be (types, size, depth, JSON); whether a backend can serve it is the router's and
    the compiler's question (``grammask.compile.router.plan``, ``Compiler.compile``).

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
        """This spec with another backend (itself when it is the same one).

        Parameters: ``backend``, a registered name or alias, or None / ``"auto"`` for auto
        routing. Returns the spec forced onto it. Raises ``InvalidSpecError`` for an unknown
        name (the message names the registered ones). Twins are kept
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
        """The parsed JSON schema, parsed once and shared: read it, never modify it
        (normalization makes copies). Raises ``InvalidSpecError`` on a spec of another kind."""
        if self.kind != "json_schema":
            raise InvalidSpecError(f"a {self.kind} spec has no JSON schema")
        return json.loads(self.source)

    @property
    def choices(self) -> list[str]:
        """The options of a choice spec, in order. Raises ``InvalidSpecError`` on a spec of
        another kind."""
        if self.kind != "choice":
            raise InvalidSpecError(f"a {self.kind} spec has no choices")
        return cast(list[str], json.loads(self.source))

    def describe(self) -> str:
        """``kind:source`` with the source cut at 60 characters (for logs and messages)."""
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
        """A JSON schema.

        Parameters:
            schema: JSON text, a mapping or a boolean schema. A mapping is read, never
                modified or kept (the spec holds its compact JSON text).
            any_whitespace, whitespace_pattern, extra_properties, strict: the options above.
            backend: a registered name or alias to force, None / ``"auto"`` to route.
            max_bytes: the largest schema accepted, as UTF-8 JSON text.

        Returns the spec; its keyword values are not checked here (``plan`` does).

        Raises:
            InvalidSchemaError: the text is not JSON, the schema is not an object or a
                boolean, it nests deeper than ``limits.MAX_NESTING``, or holds a value JSON
                cannot carry (NaN, a number beyond a double, a non-string key); the
                ``where`` is a JSON pointer or a line and column.
            InvalidSpecError: the schema is over ``max_bytes``, an option has the wrong
                type, or the backend is unknown.
        """
        parsed = parse_schema(schema, max_bytes)
        spec = cls(
            "json_schema", jsontext.compact(parsed),
            any_whitespace=check_bool(any_whitespace, "any_whitespace"),
            whitespace_pattern=check_opt_str(whitespace_pattern, "whitespace_pattern"),
            extra_properties=check_bool(extra_properties, "extra_properties"),
            strict=check_bool(strict, "strict"), backend=backend_name(backend),
        )
        if isinstance(schema, str):  # parsed here, so nobody else holds it: no second parse
            spec.__dict__["schema"] = parsed
        return spec

    @classmethod
    def json_object(
        cls, *, any_whitespace: bool = True, whitespace_pattern: str | None = None,
        backend: BackendName | None = None,
    ) -> GrammarSpec:
        """Any JSON object (OpenAI ``json_object``). Raises ``InvalidSpecError`` for an option
        of the wrong type or an unknown backend."""
        return cls(
            "json_object", "", any_whitespace=check_bool(any_whitespace, "any_whitespace"),
            whitespace_pattern=check_opt_str(whitespace_pattern, "whitespace_pattern"),
            backend=backend_name(backend),
        )

    @classmethod
    def regex(
        cls, pattern: str, *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        """A regular expression the whole output must match (the empty one matches only "").
        The pattern's syntax is the backend's to check, at compile. Raises
        ``InvalidSpecError`` when it is not a string, is over ``max_bytes`` or holds a NUL,
        or for an unknown backend."""
        text = check_text(pattern, "regex", max_bytes, allow_empty=True)
        return cls("regex", text, backend=backend_name(backend))

    @classmethod
    def choice(
        cls, options: Sequence[str], *, backend: BackendName | None = None,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> GrammarSpec:
        """Exactly one of ``options`` (strings, kept in order). Raises ``InvalidSpecError``
        for anything but a non-empty sequence of strings (the ``where`` names the entry),
        an option over ``max_bytes`` or with a NUL, or an unknown backend."""
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
            check_text(opt, f"choice[{i}]", max_bytes, allow_empty=True)
        return cls("choice", json.dumps(list(options), ensure_ascii=False),
                   backend=backend_name(backend))

    @classmethod
    def named(cls, name: str, *, backend: BackendName | None = None) -> GrammarSpec:
        """A grammar of the shipped library (``grammask.specs.library.names()``), by name.

        Names travel in their own field (``grammar_name``), never inside grammar text, so a
        name can never be mistaken for a grammar or the other way round. Raises
        ``InvalidSpecError`` for a name that is not a string or not in the library."""
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
        """An EBNF (GBNF, ``::=``) or Lark (``:``) grammar; ``syntax=None`` detects which.
        The grammar itself is the backend's to check, at compile. Raises ``InvalidSpecError``
        for a text that is not a string, blank, over ``max_bytes`` or with a NUL, another
        ``syntax``, or an unknown backend."""
        body = check_text(text, "grammar", max_bytes, allow_empty=False)
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
        """A structural tag as vLLM takes it: xgrammar's ``{"type": "structural_tag",
        "format": ...}`` or the legacy ``{"structures": [...], "triggers": [...]}``, as JSON
        text or a mapping. Raises ``InvalidGrammarError`` for text that is not JSON or a tag
        of the wrong shape (the ``where`` names the field: ``structural_tag/triggers``),
        ``InvalidSpecError`` for another type, a text over ``max_bytes``, or an unknown
        backend."""
        if isinstance(tag, str):
            check_text(tag, "structural_tag", max_bytes, allow_empty=False)
        parsed = json_object(tag, not_json=_tag_not_json, not_object=_tag_not_object,
                             wrong_type=lambda: _tag_wrong_type(tag))
        check_structural_tag(parsed)
        return cls("structural_tag", jsontext.compact(parsed), backend=backend_name(backend))


# ------------------------------------------------------------------------------ helpers
#: the key's option line per option set (``_key_material``), made once
_HEADS: dict[tuple[Any, ...], str] = {}
_MAX_HEADS = 256


def _tag_not_json(exc: json.JSONDecodeError) -> GrammarError:
    return InvalidGrammarError(f"structural tag is not valid JSON: {exc.msg}",
                               where=f"line {exc.lineno} column {exc.colno}")


def _tag_wrong_type(tag: object) -> GrammarError:
    return InvalidSpecError(f"structural_tag must be a JSON string or object, got "
                            f"{type(tag).__name__}", where="structural_tag")


def _tag_not_object() -> GrammarError:
    return InvalidGrammarError("structural tag must be a JSON object", where="structural_tag")


def detect_syntax(text: str) -> Syntax:
    """GBNF rules use ``::=``; Lark rules use ``:``."""
    return "ebnf" if "::=" in text else "lark"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def backend_name(value: object) -> BackendName | None:
    """A backend as given by a user (``auto``/None, an alias, a name): the registered name,
    None for auto routing; ``InvalidSpecError`` naming the registered ones otherwise."""
    if value is None or value == "auto":
        return None
    return resolve_backend(value)

