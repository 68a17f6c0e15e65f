"""Oracles: what a correct mask must allow, decided without any backend code.

- ``RegexOracle``: the ``regex`` module's partial matching decides whether a prefix can still
  complete (``fullmatch(p, text, partial=True)``).
- ``ChoiceOracle``: a prefix of some choice, byte by byte.
- ``JsonOracle``: ``jsonschema`` validation (the schema's own draft, Draft 2020-12 by default)
  with format checking for the formats grammask claims to enforce; explains an invalid
  value by the keywords that failed, so a failure covered by a declared gap is told apart
  from a bug.
- ``LarkOracle``: the ``lark`` package parses a complete output (Earley, any tokenization).

Bytes, not text: backends work on bytes, and a token may end inside a UTF-8 character. A prefix
ending in an incomplete (but so far well-formed) UTF-8 sequence is viable when some character
that sequence can still become keeps the text viable; the oracle enumerates those characters
when there are at most 4,096 of them (one or two missing continuation bytes) and otherwise
answers ``None`` (undecided: a four-byte lead alone), which the audit counts separately.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import FormatChecker, validators
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from referencing.jsonschema import SchemaRegistry as _SchemaRegistry

from .extras import require
from .gbnf import START_RULE, gbnf_to_lark

# ----------------------------------------------------------------------------- UTF-8
_MAX_COMPLETIONS = 4096


def split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """(the decoded complete part, an incomplete trailing sequence), or None when ``data``
    can never become valid UTF-8 whatever follows."""
    try:
        return data.decode("utf-8"), b""
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.end == len(data):
            return data[:exc.start].decode("utf-8"), data[exc.start:]
        return None


@lru_cache(maxsize=4096)
def completions(tail: bytes) -> tuple[str, ...] | None:
    """Every character whose UTF-8 encoding starts with ``tail``; None when too many."""
    lead = tail[0]
    need = 2 if lead >= 0xC0 and lead < 0xE0 else 3 if lead < 0xF0 else 4
    missing = need - len(tail)
    if 64 ** missing > _MAX_COMPLETIONS:
        return None
    out: list[str] = []
    for k in range(64 ** missing):
        rest = bytes(0x80 | ((k >> (6 * j)) & 0x3F) for j in reversed(range(missing)))
        try:
            out.append((tail + rest).decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return tuple(out)


def _prefix_viable(data: bytes, viable_text: Callable[[str], bool | None]) -> bool | None:
    split = split_utf8(data)
    if split is None:
        return False
    text, tail = split
    head = viable_text(text)
    if not tail or not head:
        return head
    chars = completions(tail)
    if chars is None:
        return None
    undecided = False
    for ch in chars:
        verdict = viable_text(text + ch)
        if verdict:
            return True
        undecided |= verdict is None
    return None if undecided else False


# ----------------------------------------------------------------------------- regex
class RegexOracle:
    """Prefix viability and completeness for a regex (full-match semantics, as the backends).

    The primary reading is Python ``regex`` with default flags (Unicode classes, ``.`` not
    matching newline). The backends differ among themselves (xgrammar: ASCII ``\\d``/``\\w``,
    ``.`` matches newline; llguidance: Unicode, ``.`` excludes newline), so ``dialects()`` also
    gives the verdict under ASCII and DOTALL readings: a disagreement one of them explains is a
    dialect difference, not a mask bug.
    """

    #: the other readings: a name and the ``regex`` flags (by name) it compiles with
    FLAG_SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("ascii", ("ASCII",)), ("dotall", ("DOTALL",)), ("ascii+dotall", ("ASCII", "DOTALL")),
    )

    def __init__(self, pattern: str, *, timeout_s: float = 1.0) -> None:
        self.pattern = pattern
        self.timeout_s = timeout_s
        regex = _regex()
        self._compiled = regex.compile(pattern)
        self._variants = [
            (name, regex.compile(pattern, sum(getattr(regex, f) for f in flags)))
            for name, flags in self.FLAG_SETS]

    def _partial(self, compiled: Any, text: str) -> bool | None:
        try:
            return compiled.fullmatch(text, partial=True, timeout=self.timeout_s) is not None
        except TimeoutError:
            return None

    def _full(self, compiled: Any, text: str) -> bool | None:
        try:
            return compiled.fullmatch(text, timeout=self.timeout_s) is not None
        except TimeoutError:
            return None

    def viable(self, data: bytes) -> bool | None:
        return _prefix_viable(data, lambda t: self._partial(self._compiled, t))

    def complete(self, data: bytes) -> bool | None:
        split = split_utf8(data)
        if split is None or split[1]:
            return False
        return self._full(self._compiled, split[0])

    def dialects(self, data: bytes, *, complete: bool) -> dict[str, bool | None]:
        """The verdict under each alternative flag set (for classifying disagreements)."""
        out: dict[str, bool | None] = {}
        for name, compiled in self._variants:
            if complete:
                split = split_utf8(data)
                out[name] = (False if split is None or split[1]
                             else self._full(compiled, split[0]))
            else:
                out[name] = _prefix_viable(
                    data, lambda t, c=compiled: self._partial(c, t))  # type: ignore[misc]
        return out


# ----------------------------------------------------------------------------- choice
class ChoiceOracle:
    """A prefix of some choice; complete when equal to one."""

    def __init__(self, choices: Iterable[str]) -> None:
        self.choices = tuple(c.encode("utf-8") for c in choices)

    def viable(self, data: bytes) -> bool | None:
        return any(c.startswith(data) for c in self.choices)

    def complete(self, data: bytes) -> bool | None:
        return data in self.choices

    def dialects(self, data: bytes, *, complete: bool) -> dict[str, bool | None]:
        return {}


# ----------------------------------------------------------------------------- JSON
#: Formats both backends enforce (measured: a junk string is refused), checked on samples.
#: xgrammar also enforces the last three; llguidance refuses them at compile time.
CLAIMED_FORMATS: tuple[str, ...] = (
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uuid", "uri-reference", "json-pointer", "relative-json-pointer",
)

_DATE = r"\d{4}-\d{2}-\d{2}"
_TIME = r"\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})"
_DURATION = re.compile(
    r"P(?:(?:\d+Y(?:\d+M)?(?:\d+D)?|\d+M(?:\d+D)?|\d+D)(?:T(?:\d+H(?:\d+M)?(?:\d+S)?|\d+M(?:\d+S)?"
    r"|\d+S))?|T(?:\d+H(?:\d+M)?(?:\d+S)?|\d+M(?:\d+S)?|\d+S)|\d+W)\Z")
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_URI_CHARS = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*\Z")
_POINTER = re.compile(r"(?:/(?:[^~/]|~[01])*)*\Z")
_REL_POINTER = re.compile(r"(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)\Z")


def _check_time(value: str) -> bool:
    m = re.fullmatch(_TIME, value)
    if m is None:
        return False
    hh, mm, ss = int(value[0:2]), int(value[3:5]), int(value[6:8])
    if hh > 23 or mm > 59 or ss > 60:
        return False
    offset = value[8:].lstrip(".0123456789")
    if offset not in ("Z", "z"):
        oh, om = int(offset[1:3]), int(offset[4:6])
        if oh > 23 or om > 59:
            return False
    return True


def _check_date_time(value: str) -> bool:
    m = re.fullmatch(rf"({_DATE})[Tt](.*)", value)
    if m is None:
        return False
    try:
        datetime.date.fromisoformat(m.group(1))
    except ValueError:
        return False
    return _check_time(m.group(2))


def _check_hostname(value: str) -> bool:
    if not value or len(value) > 253:
        return False
    return all(_HOST_LABEL.match(label) for label in value.rstrip(".").split("."))


def _check_uri(value: str) -> bool:
    return bool(_SCHEME.match(value)) and bool(_URI_CHARS.match(value))


_OWN_CHECKERS: dict[str, Callable[[str], bool]] = {
    "date-time": _check_date_time,
    "time": _check_time,
    "duration": lambda v: bool(_DURATION.match(v)),
    "hostname": _check_hostname,
    "uri": _check_uri,
    "uri-reference": lambda v: bool(_URI_CHARS.match(v)),
    "json-pointer": lambda v: bool(_POINTER.match(v)),
    "relative-json-pointer": lambda v: bool(_REL_POINTER.match(v)),
}


def format_checker(formats: Iterable[str] = CLAIMED_FORMATS) -> FormatChecker:
    """A checker for exactly ``formats``: jsonschema's own checks where it has them without
    optional packages (date, email, ipv4, ipv6, uuid), small RFC 3339/3986 checks otherwise."""
    base = validators.Draft202012Validator.FORMAT_CHECKER.checkers
    checker = FormatChecker(formats=())
    for name in formats:
        if name in _OWN_CHECKERS:
            own = _OWN_CHECKERS[name]
            checker.checks(name)(lambda v, f=own: not isinstance(v, str) or f(v))
        elif name in base:
            func, raises = base[name]
            checker.checks(name, raises)(func)
    return checker


def local_registry(remotes: Path | None) -> _SchemaRegistry:
    """The JSON-Schema-Test-Suite remotes served as ``http://localhost:1234/...`` from disk
    (never over a network); the metaschemas come with ``referencing``'s defaults."""
    resources: list[tuple[str, Resource[Any]]] = []
    if remotes is not None and remotes.is_dir():
        for path in sorted(remotes.rglob("*.json")):
            contents = json.loads(path.read_text(encoding="utf-8"))
            uri = "http://localhost:1234/" + path.relative_to(remotes).as_posix()
            resources.append((uri, Resource.from_contents(
                contents, default_specification=DRAFT202012)))
    registry: _SchemaRegistry = Registry().with_resources(resources)
    return registry


@dataclass(frozen=True)
class Verdict:
    """An oracle's answer on one complete output."""

    valid: bool
    reason: str = ""
    keywords: tuple[str, ...] = ()
    known_gap: bool = False
    detail: str = ""


@dataclass
class JsonOracle:
    """Validates complete JSON outputs against a schema (independently of both backends)."""

    schema: Any
    registry: _SchemaRegistry | None = None
    formats: tuple[str, ...] = CLAIMED_FORMATS
    _validator: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        cls = validators.validator_for(self.schema, default=validators.Draft202012Validator)
        kwargs: dict[str, Any] = {"format_checker": format_checker(self.formats)}
        if self.registry is not None:
            kwargs["registry"] = self.registry
        self._validator = cls(self.schema, **kwargs)

    def errors(self, value: Any) -> list[ValidationError]:
        return list(self._validator.iter_errors(value))

    def check_value(self, value: Any, unenforced: Iterable[str] = ()) -> Verdict:
        try:
            errors = self.errors(value)
        except Exception as exc:  # unresolvable $ref, bad pattern in the schema, recursion
            return Verdict(False, "oracle-error", detail=f"{type(exc).__name__}: {exc}"[:300])
        if not errors:
            return Verdict(True)
        keywords = sorted({kw for err in errors for kw in error_keywords(err)})
        known = all(explained_by_gap(err, unenforced) for err in errors)
        first = errors[0]
        detail = f"{first.validator} at /{'/'.join(map(str, first.absolute_path))}: " \
                 f"{first.message[:200]}"
        return Verdict(False, "schema", tuple(keywords), known, detail)

    def check(self, data: bytes, unenforced: Iterable[str] = ()) -> Verdict:
        """A complete sampled output: UTF-8, one JSON value, valid against the schema."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return Verdict(False, "utf-8", detail=repr(data[-20:]))
        dupes: list[str] = []
        try:
            value = json.loads(text, object_pairs_hook=lambda pairs: _no_dupes(pairs, dupes))
        except (ValueError, RecursionError) as exc:
            return Verdict(False, "json", detail=str(exc)[:200])
        verdict = self.check_value(value, unenforced)
        if dupes and (verdict.valid or set(verdict.keywords) <= _COUNTING):
            # JSON Schema leaves duplicate keys undefined and neither backend prevents them
            # (a repeated key also counts once: minProperties may then fail)
            return Verdict(False, "duplicate-key", ("duplicate-key",), True, dupes[0])
        return verdict


#: Keywords a repeated key can fail alone (it counts once once parsed).
_COUNTING = frozenset({"minProperties"})


def _no_dupes(pairs: list[tuple[str, Any]], dupes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            dupes.append(key)
        out[key] = value
    return out


#: Draft 2020-12 (and older) applicator/assertion keywords; path entries that are not
#: keywords are property names and say nothing about which feature failed.
_KEYWORDS = frozenset({
    "$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentSchemas", "dependentRequired", "dependencies", "prefixItems", "items",
    "additionalItems", "contains", "minContains", "maxContains", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "unevaluatedItems",
    "unevaluatedProperties", "type", "enum", "const", "multipleOf", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern",
    "maxItems", "minItems", "uniqueItems", "maxProperties", "minProperties", "required",
    "format",
})


def error_keywords(err: ValidationError) -> set[str]:
    """The failing keyword, every keyword on its schema path (``$ref``, ``allOf`` ...), and
    those of its sub-errors (an ``anyOf`` fails because of what failed in its branches)."""
    words = {str(err.validator)}
    words.update(p for p in err.schema_path if isinstance(p, str) and p in _KEYWORDS)
    for sub in err.context or ():
        words |= error_keywords(sub)
    return words


_WORD = re.compile(r"[$\w-]+")
#: Validation keywords and the words a router gap uses for them.
_GAP_WORDS: dict[str, tuple[str, ...]] = {
    "if": ("if",), "then": ("if",), "else": ("if",),
    "minContains": ("contains",), "maxContains": ("contains",),
    "$dynamicRef": ("$dynamicRef", "$anchor"), "$ref": ("$ref",),
    "minLength": ("minLength",), "maxLength": ("maxLength",),
}


def explained_by_gap(err: ValidationError, unenforced: Iterable[str]) -> bool:
    """Whether a declared gap (``Grammar.unenforced``) names a keyword of this failure."""
    words: set[str] = set()
    for entry in unenforced:
        words.update(_WORD.findall(entry))
    if not words:
        return False
    for kw in error_keywords(err):
        if kw == "format":
            continue
        if any(w in words for w in _GAP_WORDS.get(kw, (kw,))):
            return True
    if err.validator == "format":
        # a format gap names its format ("format: uri-reference"), or "format (unknown)"
        return "format" in words and (str(err.validator_value) in words or "unknown" in words)
    return _node_gap(err, unenforced)


#: Gaps under which a backend serves the whole node that holds the keyword wrongly (xgrammar
#: reads a node with an allOf it cannot merge as any value, and drops the keywords beside an
#: anyOf/oneOf): any failure of that node's keywords is explained, with the keys it needs.
_NODE_GAPS: dict[str, tuple[str, ...]] = {
    "allOf (several branches)": ("allOf",),
    "anyOf/oneOf beside other keywords": ("anyOf", "oneOf"),
}


def _node_gap(err: ValidationError, unenforced: Iterable[str]) -> bool:
    node = err.schema
    if not isinstance(node, dict):
        return False
    return any(entry.startswith(gap) and any(k in node for k in keys)
               for entry in unenforced for gap, keys in _NODE_GAPS.items())


# ----------------------------------------------------------------------------- Lark
class LarkOracle:
    """Parses complete outputs with ``lark`` (Earley; tries every tokenization if needed).

    ``syntax="ebnf"`` grammars go through this package's own GBNF translation. Two rewrites
    make llguidance-dialect Lark loadable by ``lark``: empty literals ``""`` are dropped,
    and a terminal that can match the empty string becomes a rule (Lark's Earley forbids
    zero-width terminals). Both keep the language; the rule form only adds tokenizations,
    so the oracle may accept an output the backend's greedy lexer would not, never the reverse.
    """

    def __init__(self, text: str, syntax: str) -> None:
        if syntax == "ebnf":
            self.lark_text, self.start = gbnf_to_lark(text), START_RULE
            self.parser = _build_lark(self.lark_text, self.start, "dynamic")
        else:
            self.start = "start"
            self.lark_text, self.parser = _loadable_lark(text)
        self._complete: Any = None

    def parses(self, data: bytes) -> Verdict:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return Verdict(False, "utf-8")
        try:
            self.parser.parse(text)
            return Verdict(True)
        except _lark().exceptions.LarkError as first:
            try:
                if self._complete is None:
                    self._complete = _build_lark(_greedy(self.lark_text), self.start,
                                                 "dynamic_complete")
                self._complete.parse(text)
                return Verdict(True)
            except _lark().exceptions.LarkError:
                return Verdict(False, "parse", detail=str(first).splitlines()[0][:200])


_EMPTY_LITERAL = re.compile(r'(?<=[\s(|:])""(?=[\s)|]|$)', re.MULTILINE)


def _loadable_lark(text: str) -> tuple[str, Any]:
    """The rewritten text and its parser (see ``LarkOracle``)."""
    text = _EMPTY_LITERAL.sub("", text)
    for _ in range(64):
        try:
            return text, _build_lark(text, "start", "dynamic")
        except _lark().exceptions.GrammarError as exc:
            args = exc.args
            term = args[1] if len(args) > 1 else None
            name = getattr(term, "name", None)
            if not name or "zero-width" not in str(args[0]):
                raise
            text = re.sub(rf"(?<![\w]){re.escape(name)}(?![\w])", f"zw_{name.lower()}", text)
    raise _lark().exceptions.GrammarError("too many zero-width terminals")


_REGEX_LITERAL = re.compile(r"/(?!/)(?:\\/|\\\\|[^/\n])*?/[imslux]*")
_LAZY = re.compile(r"(?<!\\)([*+?}])\?")


def _greedy(text: str) -> str:
    """Lazy quantifiers made greedy inside regex literals: Lark's ``dynamic_complete`` lexer
    tries every truncation of the input, so a greedy regex yields every possible match end,
    while a lazy one (``/.*?/``) would always stop at the first."""
    return _REGEX_LITERAL.sub(lambda m: _LAZY.sub(r"\1", m.group(0)), text)


def _build_lark(text: str, start: str, lexer: str) -> Any:
    return _lark().Lark(text, start=start, parser="earley", lexer=lexer)


# the ``check`` extra, imported when an oracle needs it (grammask runs without it)
def _regex() -> Any:
    return require("regex")


def _lark() -> Any:
    return require("lark")


