"""The routing table, keyword by keyword, checked end to end on the real backends.

For every row: the route (backend, what is unenforced), and that the routed grammar accepts a
valid instance and -- when nothing is listed as unenforced -- rejects the invalid one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from grammask import (
    Compiler,
    GrammarError,
    GrammarSpec,
    InvalidSchemaError,
    UnsupportedError,
    Vocabulary,
    route,
)
from grammask.schema.normalize import combinator_gap, overlapping_pattern_all_of

from ..helpers import accepts_complete

OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# (id, schema, backend, unenforced-substring or "", valid, invalid)
TABLE: list[tuple[str, Any, str, str, Any, Any]] = [
    ("no-free-text", {**OBJ_AB, "required": ["a"]}, "xgrammar", "", {"a": 1}, {"b": 1}),
    ("free-text", {"type": "object", "properties": {"s": {"type": "string"}},
                   "required": ["s"]}, "guidance", "", {"s": "hi"}, {"s": 1}),
    ("enum-strings", {"type": "object", "properties": {"s": {"enum": ["x", "y"]}},
                      "required": ["s"]}, "xgrammar", "", {"s": "x"}, {"s": "z"}),
    ("propertyNames", {"type": "object", "additionalProperties": {"type": "integer"},
                       "propertyNames": {"pattern": "^[a-z]+$"}},
     "xgrammar", "", {"ab": 1}, {"AB": 1}),
    ("minProperties-optional", {**OBJ_AB, "minProperties": 1}, "xgrammar", "", {"a": 1}, {}),
    ("unevaluatedProperties", {**OBJ_AB, "unevaluatedProperties": False}, "xgrammar", "",
     {"a": 1}, {"a": 1, "c": 2}),
    # branches xgrammar gets merged into one node (normalize.merged_node)
    ("allOf-merged", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     "xgrammar", "", {"a": 1, "b": 2}, {"a": 1}),
    # a reference cannot be merged: xgrammar would read the node as any value
    ("allOf-several", {"allOf": [{"$ref": "#/$defs/a"}, {"maximum": 10}],
                       "$defs": {"a": {"type": "integer", "minimum": 1}}},
     "guidance", "", 5, 11),
    ("multipleOf-fraction", {"type": "number", "multipleOf": 0.5}, "guidance", "", 1.5, 1.3),
    ("multipleOf-integer", {"type": "integer", "multipleOf": 3}, "xgrammar", "", 9, 10),
    ("oneOf-disjoint", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "guidance", "",
     1, True),
    ("pattern-search", {"type": "string", "pattern": "abc"}, "guidance", "", "xxabcyy", "ab"),
    ("pattern+maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
     "guidance", "", "abc", "abcd"),
    ("$ref-siblings", {"$defs": {"n": {"type": "integer"}},
                       "properties": {"x": {"$ref": "#/$defs/n", "minimum": 5}},
                       "type": "object", "required": ["x"]}, "guidance", "", {"x": 6}, {"x": 4}),
    ("format-unknown", {"type": "string", "format": "x-custom"}, "guidance", "", "any", 5),
    ("format-date", {"type": "string", "format": "date"}, "guidance", "format: date",
     "2024-01-31", "2024-01-3x"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "guidance", "uniqueItems", [1, 2], [1, 1]),
    ("dependentRequired", {**OBJ_AB, "dependentRequired": {"a": ["b"]}}, "guidance",
     "dependentRequired", {"a": 1, "b": 2}, {"a": 1}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "guidance", "contains",
     [1], ["x"]),
    ("not", {"type": "integer", "not": {"const": 3}}, "guidance", "not", 2, 3),
    ("if-then-else", {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}},
     "guidance", "if/then/else", 12, 13),
    # found by `grammask check`: xgrammar lets raw control characters into length-bounded
    # strings, ignores an untyped format and anchors inside a pattern
    ("string-maxLength", {"type": "string", "maxLength": 5}, "guidance", "", "a b", "abcdef"),
    ("string-minLength", {"type": "string", "minLength": 2}, "guidance", "", "ab", "a"),
    ("format-untyped", {"format": "email"}, "guidance", "", "a@b.co", "not-an-email"),
    ("pattern-inner-anchor", {"type": "string", "pattern": "^(a|b$)"}, "guidance", "",
     "b", "bc"),
    ("format-xgrammar-only", {"type": "string", "format": "json-pointer"}, "xgrammar", "",
     "/a/b", "abc"),
    ("format-neither", {"type": "string", "format": "iri"}, "guidance",
     "format: iri (not checked)", "http://x.org/a", 5),
    # llguidance refuses look-around even leniently; xgrammar ignores it: said, not silent
    ("ref-root", {"type": "object", "properties": {"x": {"$ref": "#"}}}, "guidance", "",
     {"x": {}}, {"x": 1}),
    ("pattern-lookaround", {"type": "string", "pattern": "^a(?!b)"}, "xgrammar",
     "pattern (lookaround)", "ac", "ab"),
]


@pytest.fixture(scope="module")
def compiler(qwen25: Vocabulary) -> Compiler:
    return Compiler(qwen25, timeout_s=60)


def _complete(grammar: Any, vocab: Vocabulary, value: Any) -> bool:
    return any(accepts_complete(grammar.matcher(), vocab, text)
               for text in {json.dumps(value), json.dumps(value, separators=(",", ":"))})


@pytest.mark.parametrize(("name", "schema", "backend", "gap", "valid", "invalid"), TABLE,
                         ids=[row[0] for row in TABLE])
def test_routing_table(compiler: Compiler, qwen25: Vocabulary, name: str, schema: Any, backend: str,
                       gap: str, valid: Any, invalid: Any) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    assert grammar.backend == backend, grammar.reason
    assert grammar.reason
    listed = " ".join(grammar.unenforced)
    if gap:
        assert gap in listed
    else:
        assert not grammar.unenforced
    assert _complete(grammar, qwen25, valid)
    if not gap:
        assert not _complete(grammar, qwen25, invalid), f"{name}: invalid instance accepted"


def test_overlapping_oneof_is_served_leniently_and_says_so(compiler: Compiler) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(
        {"oneOf": [{"type": "integer"}, {"type": "number"}]}))
    assert grammar.backend == "guidance" and grammar.fallback_from == "guidance"
    assert grammar.unenforced


def test_strict_mode_refuses_with_pointer(compiler: Compiler) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedError, match="uniqueItems") as info:
        compiler.compile(GrammarSpec.json_schema(schema, strict=True))
    assert info.value.where == "/properties/tags"
    with pytest.raises(UnsupportedError):
        compiler.check(GrammarSpec.json_schema(schema, strict=True))


def test_remote_ref_is_a_clear_error(compiler: Compiler) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "http://example.com/s.json"}}}
    with pytest.raises(GrammarError, match="never fetches") as info:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert info.value.where == "/properties/x"
    with pytest.raises(GrammarError, match="never fetches"):
        compiler.check(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_closed_objects_by_default_open_on_request(compiler: Compiler, qwen25: Vocabulary,
                                                   backend: str) -> None:
    closed = compiler.compile(GrammarSpec.json_schema(OBJ_AB, backend=backend))  # type: ignore[arg-type]
    opened = compiler.compile(GrammarSpec.json_schema(OBJ_AB, extra_properties=True,
                                                 backend=backend))  # type: ignore[arg-type]
    assert not _complete(closed, qwen25, {"a": 1, "zz": 2})
    assert _complete(opened, qwen25, {"a": 1, "zz": 2})


def test_xgrammar_free_form_containers_stay_free(compiler: Compiler, qwen25: Vocabulary) -> None:
    """xgrammar's strict mode alone would allow only {} here (measured); we spell it out.
    It still ignores ``required`` names it has no property for, which routing knows."""
    schema = {"type": "object", "required": ["a"], "maxProperties": 2}
    grammar = compiler.compile(GrammarSpec.json_schema(schema, backend="xgrammar"))
    assert _complete(grammar, qwen25, {"a": [1]})
    assert "required (undeclared names)" in grammar.unenforced
    auto = compiler.compile(GrammarSpec.json_schema(schema))
    assert auto.backend == "guidance" and not auto.unenforced
    assert _complete(auto, qwen25, {"a": [1]}) and not _complete(auto, qwen25, {})


def test_pattern_search_semantics_on_xgrammar(compiler: Compiler, qwen25: Vocabulary) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": "abc"},
                                                  backend="xgrammar"))
    assert _complete(grammar, qwen25, "xxabcyy") and not _complete(grammar, qwen25, "xxab")


def test_guidance_refusal_falls_back_to_xgrammar(compiler: Compiler, qwen25: Vocabulary) -> None:
    """llguidance cannot decide whether this pattern is empty; xgrammar serves it."""
    schema = {"type": "object", "patternProperties": {"^a": {"type": "integer"},
                                                      "^ab": {"type": "string"}},
              "additionalProperties": False}
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    assert grammar.fallback_from == "guidance" and grammar.backend == "xgrammar"
    assert _complete(grammar, qwen25, {"a1": 1})


def test_xgrammar_refusal_falls_back(compiler: Compiler, qwen25: Vocabulary) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": False}}
    with pytest.raises(GrammarError, match="xgrammar"):
        compiler.compile(GrammarSpec.json_schema(schema, backend="xgrammar"))
    pref = Compiler(qwen25, prefer="xgrammar")
    grammar = pref.compile(GrammarSpec.json_schema(schema))
    assert grammar.backend == "guidance" and grammar.fallback_from == "xgrammar"
    assert pref.stats.fallbacks == 1


@pytest.mark.parametrize(
    ("spec", "backend"),
    [(GrammarSpec.regex("a+"), "guidance"), (GrammarSpec.choice(["a", "b"]), "xgrammar"),
     (GrammarSpec.grammar('start: "a"'), "guidance"),
     (GrammarSpec.grammar('root ::= "a"', "ebnf"), "xgrammar"),
     (GrammarSpec.json_object(), "guidance"),
     (GrammarSpec.json_object(whitespace_pattern=" ?"), "guidance"),
     (GrammarSpec.json_schema(OBJ_AB, whitespace_pattern=" ?"), "guidance"),
     (GrammarSpec.json_schema(OBJ_AB, extra_properties=True), "guidance"),
     (GrammarSpec.structural_tag({"type": "structural_tag", "triggers": ["<a"], "structures": [
         {"begin": "<a>", "schema": {}, "end": "</a>"}]}), "xgrammar")],
)
def test_other_kinds_route(spec: GrammarSpec, backend: str) -> None:
    assert route(spec).backend == backend


def test_preference_is_configurable(qwen25: Vocabulary) -> None:
    text = GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}})
    assert route(text).backend == "guidance" and "/properties/s" in route(text).reason
    assert Compiler(qwen25, prefer="xgrammar").route(text).backend == "xgrammar"
    numbers = GrammarSpec.json_schema(OBJ_AB)
    assert route(numbers).backend == "xgrammar"
    assert Compiler(qwen25, prefer="guidance").route(numbers).backend == "guidance"


def test_length_bounded_strings_refuse_raw_control_characters(compiler: Compiler,
                                                              qwen25: Vocabulary) -> None:
    """xgrammar 0.2.8 accepts a raw tab inside a string with minLength/maxLength (invalid
    JSON); the route avoids it, and the forced xgrammar grammar shows why."""
    schema = {"type": "string", "maxLength": 5}
    raw = '"a\tb"'
    assert not accepts_complete(compiler.compile(GrammarSpec.json_schema(schema)).matcher(),
                                qwen25, raw)
    forced = compiler.compile(GrammarSpec.json_schema(schema, backend="xgrammar"))
    assert "string minLength/maxLength" in " ".join(forced.unenforced)
    assert accepts_complete(forced.matcher(), qwen25, raw)  # the backend bug, still there


def test_inner_anchor_detection() -> None:
    from grammask.schema.features import inner_anchor

    assert not inner_anchor("^[^a-z]+$") and not inner_anchor("a\\$") and not inner_anchor("x")
    assert inner_anchor("(^a|b)") and inner_anchor("a$|b") and inner_anchor("^(a|b$)")
    assert not inner_anchor("a\\\\$")  # an escaped backslash, then the end anchor


def _route_probe(schemas: list[Any]) -> list[Any]:
    """Routes, plans, cache keys and canonical JSON of many schemas, as one process sees
    them (JSON-ready)."""
    from grammask.compile.router import plan
    from grammask.schema.jsontext import canonical_json

    def plain(value: Any) -> Any:
        """Dataclasses field by field; sets sorted (equal sets may print in any order),
        sequences and dict items in their own order (an order that differs is a finding)."""
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, set | frozenset):
            return sorted(plain(v) for v in value)
        if isinstance(value, dict):
            return [[plain(k), plain(v)] for k, v in value.items()]
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    out: list[Any] = []
    for schema in schemas:
        try:
            spec = GrammarSpec.json_schema(schema)
            out.append([spec.key, canonical_json(schema), plain(route(spec)), plain(plan(spec)),
                        plain(plan(spec, rank_invariant=True)),
                        spec.with_backend("guidance").key])
        except GrammarError as exc:
            out.append([type(exc).__name__, str(exc)])
    return json.loads(json.dumps(out))


_PROBE_MAIN = ("import json, sys; from tests.compile.test_router import _route_probe; "
               "print(json.dumps(_route_probe(json.loads(sys.stdin.read()))))")


def test_route_is_deterministic() -> None:
    """Every process (every tensor-parallel rank, every server replica) must route, plan and
    key a spec alike; a set or dict iterated in hash order would differ between processes
    with different hash seeds, never inside one. So: the same probe in two interpreters
    with different ``PYTHONHASHSEED`` values, and in this one (a third seed)."""
    import os
    import subprocess
    import sys

    schema = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True},
                                               "d": {"type": "string", "format": "date"}}}
    schemas = [schema, *(row[1] for row in TABLE)]
    root = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE_MAIN], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=root, env={**os.environ, "PYTHONHASHSEED": seed})
             for seed in ("0", "2718")]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(json.dumps(schemas), timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert len(outputs[0]) == len(TABLE) + 1
    assert sum(len(entry) > 2 for entry in outputs[0]) >= len(TABLE) // 2  # mostly routed
    assert outputs[1] == outputs[0], "PYTHONHASHSEED=2718 differs from 0"
    assert _route_probe(schemas) == outputs[0], (
        f"this process (PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')}) differs")


@pytest.mark.parametrize(("pattern", "full_match"), [
    ("a|b", "[\\s\\S]*(?:a|b)[\\s\\S]*"),  # top-level alternation: wrapped whole
    ("(a|b)$", "[\\s\\S]*(?:(a|b))"),  # alternation inside a group, end anchor kept
    ("[|]x", "[\\s\\S]*(?:[|]x)[\\s\\S]*"),  # '|' in a class is a literal
    ("^a\\$", "(?:a\\$)[\\s\\S]*"),  # an escaped dollar is not an anchor
])
def test_search_pattern_reads_regex_structure(pattern: str, full_match: str) -> None:
    from grammask.schema.normalize import search_pattern

    assert search_pattern(pattern) == full_match


# ------------------------------------------------------------------ invalid keyword values
@pytest.mark.parametrize(("schema", "where", "fragment"), [
    ({"type": "strin"}, "/type", "unknown type 'strin'"),
    ({"type": ["string", 5]}, "/type/1", "unknown type 5"),
    ({"properties": {"a": {"type": "foo"}}}, "/properties/a/type", "unknown type"),
    ({"$ref": "#/$defs/missing"}, "/$ref", "points to nothing"),
    ({"properties": {"a": {"$ref": "#/definitions/x"}}}, "/properties/a/$ref", "nothing"),
    ({"type": "array", "minItems": -1}, "/minItems", "non-negative integer"),
    ({"type": "array", "maxItems": 1.5}, "/maxItems", "non-negative integer"),
    ({"type": "string", "minLength": -2}, "/minLength", "non-negative"),
    ({"type": "string", "maxLength": "3"}, "/maxLength", "non-negative"),
    ({"type": "object", "minProperties": -1}, "/minProperties", "non-negative"),
    ({"type": "object", "maxProperties": True}, "/maxProperties", "non-negative"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "/minLength", "greater than"),
    ({"type": "array", "items": {"minItems": 3, "maxItems": 1}}, "/items/minItems",
     "greater than"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "/minimum", "greater than"),
    ({"type": "array", "items": {"type": "integer", "maximum": "x"}}, "/items/maximum",
     "must be a number"),
    ({"type": "number", "multipleOf": 0}, "/multipleOf", "greater than 0"),
    ({"type": "number", "minimum": 10**400}, "/minimum", "range of a double"),
    ({"enum": 5}, "/enum", "enum must be an array"),
    ({"required": "a"}, "/required", "required must be an array"),
    ({"required": [1]}, "/required/0", "strings"),
    ({"anyOf": []}, "/anyOf", "non-empty array"),
    ({"properties": {"a": 5}}, "/properties/a", "object or a boolean"),
    ({"properties": []}, "/properties", "an object"),
])
@pytest.mark.parametrize("backend", [None, "xgrammar", "guidance"])
def test_invalid_keyword_values_name_the_pointer(compiler: Compiler, schema: Any, where: str,
                                                 fragment: str, backend: Any) -> None:
    """Each used to compile on one backend (``minItems: -1`` on xgrammar) or fail without a
    location (``xgrammar: RuntimeError`` for a bound past a double)."""
    spec = GrammarSpec.json_schema(schema, backend=backend)
    with pytest.raises(InvalidSchemaError, match=fragment) as info:
        compiler.compile(spec)
    assert info.value.where == where
    with pytest.raises(InvalidSchemaError):
        compiler.check(spec)


def test_an_empty_range_under_not_is_not_an_error(compiler: Compiler, qwen25: Vocabulary) -> None:
    """``not: {minLength: 5, maxLength: 3}`` is a (silly) way to say anything: valid."""
    grammar = compiler.compile(GrammarSpec.json_schema(
        {"type": "integer", "not": {"minLength": 5, "maxLength": 3}}))
    assert _complete(grammar, qwen25, 7)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_backend_errors_are_located(compiler: Compiler, backend: Any) -> None:
    """Valid schemas the backends cannot compile: the message names the keyword's pointer."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1e30}}}
    with pytest.raises(InvalidSchemaError) as info:
        compiler.compile(GrammarSpec.json_schema(schema, backend=backend))
    assert info.value.where == "/properties/n/minimum"
    assert "RuntimeError" not in str(info.value)


# ------------------------------------------------------------------ NUL inside patterns
NUL_SCHEMA = json.loads('{"type": "object", "properties": {"path": {"type": "string", '
                        '"pattern": "^/[^\\u0000]+$"}}, "required": ["path"]}')


@pytest.mark.parametrize("backend", [None, "xgrammar", "guidance"])
@pytest.mark.parametrize("form", ["nul-char", "escape-text"])
def test_a_nul_in_a_pattern_compiles_on_both_backends(compiler: Compiler, qwen25: Vocabulary,
                                                     backend: Any, form: str) -> None:
    """``[^\\u0000]`` (6 corpus schemas) was refused as "string contains a NUL character";
    xgrammar refuses a NUL in a regex, so it gets the ``\\x00`` escape instead."""
    schema = json.loads(json.dumps(NUL_SCHEMA))
    if form == "escape-text":
        schema["properties"]["path"]["pattern"] = "^/[^\\u0000]+$"
    assert "\x00" in NUL_SCHEMA["properties"]["path"]["pattern"]  # a real U+0000
    grammar = compiler.compile(GrammarSpec.json_schema(schema, backend=backend))
    assert not grammar.unenforced
    assert _complete(grammar, qwen25, {"path": "/usr/bin"})
    assert not _complete(grammar, qwen25, {"path": "/a\x00b"})
    assert not _complete(grammar, qwen25, {"path": "usr"})


# ------------------------------------------------------------------ oneOf with open objects
ONE_OF_KEYS = {"oneOf": [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}


def test_overlapping_one_of_with_open_objects_is_listed(compiler: Compiler,
                                                       qwen25: Vocabulary) -> None:
    """Open objects let ``{"a": 1, "b": 2}`` match both branches; llguidance serves the oneOf
    as anyOf, so the gap is listed (and strict mode refuses)."""
    spec = GrammarSpec.json_schema(ONE_OF_KEYS, extra_properties=True)
    decision = route(spec)
    assert decision.backend == "guidance" and decision.lenient
    assert any("oneOf (overlapping branches)" in g for g in decision.unenforced)
    grammar = compiler.compile(spec)
    assert any("oneOf" in g for g in grammar.unenforced)
    assert _complete(grammar, qwen25, {"a": 1, "b": 2})  # the listed gap
    for forced in ("guidance", "xgrammar"):
        assert any("oneOf" in g for g in route(spec.with_backend(forced)).unenforced)
    with pytest.raises(UnsupportedError, match="oneOf") as info:
        compiler.compile(GrammarSpec.json_schema(ONE_OF_KEYS, extra_properties=True, strict=True))
    assert info.value.where == "/"
    closed = compiler.compile(GrammarSpec.json_schema(ONE_OF_KEYS))  # closed: truly disjoint
    assert not closed.unenforced and not _complete(closed, qwen25, {"a": 1, "b": 2})


@pytest.mark.parametrize("branches", [
    [{"type": "string"}, {"type": "integer"}],
    [{"type": "object", "properties": {"k": {"const": "x"}, "a": {"type": "integer"}},
      "required": ["k"]},
     {"type": "object", "properties": {"k": {"enum": ["y", "z"]}}, "required": ["k"]}],
    [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False},
     {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}],
])
def test_provably_disjoint_one_of_is_not_listed(branches: list[Any]) -> None:
    spec = GrammarSpec.json_schema({"oneOf": branches}, extra_properties=True)
    assert "oneOf (overlapping branches)" not in route(spec).features


# ------------------------------------------------------------------ open objects cost
def test_open_objects_route_to_guidance_with_a_factual_reason() -> None:
    """xgrammar's non-strict mode compiles open objects slowly (864 ms p50 on 300 corpus
    schemas): open objects go to llguidance, and the reason names the cause, no timing."""
    schema = {**OBJ_AB, "required": ["a"]}  # no free-form text: closed, it is xgrammar's
    assert route(GrammarSpec.json_schema(schema)).backend == "xgrammar"
    decision = route(GrammarSpec.json_schema(schema, extra_properties=True))
    assert decision.backend == "guidance" and decision.fallback == "xgrammar"
    assert "extra_properties" in decision.reason and "xgrammar" in decision.reason
    for spec in (GrammarSpec.json_schema(schema, extra_properties=True),
                 GrammarSpec.json_schema({"type": "object", "properties": {
                     "s": {"type": "string"}}}), GrammarSpec.regex("a+"),
                 GrammarSpec.json_object(), GrammarSpec.choice(["a"]),
                 GrammarSpec.grammar('root ::= "a"'), GrammarSpec.grammar('start: "a"')):
        assert not re.search(r"\d+(\.\d+)? ?(ms|s\b)|\d+-\d+x", route(spec).reason), spec


# ------------------------------------------------------------------ empty languages
def test_ref_cycle_is_an_empty_language_with_its_pointer(compiler: Compiler) -> None:
    schema = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
              "$ref": "#/$defs/a"}
    for backend in (None, "xgrammar", "guidance"):
        with pytest.raises(UnsupportedError, match="nothing can be generated") as info:
            compiler.compile(GrammarSpec.json_schema(schema, backend=backend))
        assert info.value.where == "/$defs/b/$ref"
    decision_features = route(GrammarSpec.json_schema(
        {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"})).features
    assert "$ref with siblings" not in decision_features  # $defs constrains nothing


# ------------------------------------------------------------------ one walk for a plan
def _mutants(schema: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """Copies of a schema with bad or unusual keyword values planted in its subschemas."""
    import copy
    import random

    from grammask.schema.walk import subschemas

    planted: list[tuple[str, Any]] = [
        ("minLength", -1), ("type", "strin"), ("maxItems", 1.5), ("minimum", "x"),
        ("required", [1]), ("properties", []), ("items", 3), ("not", [1]),
        ("$ref", "#/nope"), ("minItems", 5), ("maxItems", 2), ("anyOf", []),
        ("multipleOf", 0), ("type", ["string", "string"]), ("additionalProperties", None),
        ("exclusiveMinimum", True), ("$ref", "http://example.com/s"), ("$id", "x"),
        ("format", 3), ("uniqueItems", True), ("pattern", "(?=a)"), ("minLength", 3),
        ("maxLength", 1), ("type", "string"), ("enum", ["a"]), ("items", [{"type": "x"}])]
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        twin = copy.deepcopy(schema)
        nodes = [node for _, node in subschemas(twin)]
        for _ in range(rng.randint(1, 2)):
            key, value = rng.choice(planted)
            rng.choice(nodes)[key] = copy.deepcopy(value)
        out.append(twin)
    return out


def test_one_walk_finds_what_the_three_walks_find(corpus: Path) -> None:
    """A plan walks a schema once (features, keyword checks, the first free-form text): the
    same features at the same pointers, the same free-form pointer, and a failed check
    wherever the checker raises (the plan then raises the checker's own error); the check
    per node agrees with the checker on every subschema."""
    import gzip

    from grammask.schema import analysis
    from grammask.schema.keywords import check_keywords, check_node, keywords_ok
    from grammask.schema.walk import subschemas

    schemas: list[Any] = []
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if i == 25:
                    break
                schemas.append(json.loads(line)["schema"])
    checked = refused = 0
    for n, original in enumerate(schemas):
        for schema in [original, *(_mutants(original, n) if isinstance(original, dict)
                                   else [])]:
            try:
                check_keywords(schema)
                ok = True
            except GrammarError:
                ok = False
            walked = analysis.analyse(schema, free=True)
            if not ok:
                refused += 1
                assert walked is None, schema
                continue
            checked += 1
            assert walked == (analysis.schema_features(schema),
                              analysis.free_text_pointer(schema)), schema
            assert list(walked[0]) == list(analysis.schema_features(schema))  # in their order
            for _, node in subschemas(schema):
                for ranges in (True, False):
                    try:
                        check_node(node, "", ranges=ranges)
                        passes = True
                    except GrammarError:
                        passes = False
                    assert keywords_ok(node, ranges=ranges) == passes, node
    assert checked > 500 and refused > 300


def test_a_refused_schema_gets_the_checkers_own_error() -> None:
    """Where the single walk finds a bad keyword, the plan raises what the checker raises:
    its message and its pointer (the first of several, in the checker's order)."""
    from grammask.compile.router import plan
    from grammask.schema.keywords import check_keywords

    schema = {"type": "object", "properties": {
        "a": {"type": "string", "minLength": -1}, "b": {"type": "array", "maxItems": 1.5}}}
    with pytest.raises(InvalidSchemaError) as via_plan:
        plan(GrammarSpec.json_schema(schema))
    with pytest.raises(InvalidSchemaError) as via_checker:
        check_keywords(schema)
    assert str(via_plan.value) == str(via_checker.value)
    assert via_plan.value.where == via_checker.value.where
    with pytest.raises(InvalidSchemaError, match="remote"):  # before any keyword error
        plan(GrammarSpec.json_schema({**schema, "$ref": "http://example.com/s"}))




_SPEC_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex"})

def _features_as_written_before(node: dict[str, Any]) -> list[str]:
    """``node_features`` before it skipped groups by the node's keys (commit 5fbaca5),
    kept as the reference the faster one must agree with."""
    from grammask.schema import features as r

    out: list[str] = []
    if node.get("uniqueItems") is True:
        out.append("uniqueItems")
    for key in ("dependentRequired", "dependentSchemas", "dependencies", "not",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf"):
        if key in node:
            out.append(key)
    if "if" in node:
        out.append("if/then/else")
    if any(k in node for k in ("contains", "minContains", "maxContains")):
        out.append("contains")
    mult = node.get("multipleOf")
    if isinstance(mult, float) and not mult.is_integer():
        out.append("multipleOf (non-integer)")
    if "allOf" in node and combinator_gap(node):
        out.append("allOf (several branches)")
    if ("anyOf" in node or "oneOf" in node) and "allOf" not in node and combinator_gap(node):
        out.append("anyOf/oneOf beside other keywords")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            out.append("$ref (remote)")
        elif ref == "#":
            out.append("$ref to the root")
        elif ref != "#" and not ref.startswith("#/"):
            out.append("$anchor / $dynamicRef")
        if any(k not in r.ANNOTATIONS and k not in r.REF_NEUTRAL for k in node
               if k != "$ref"):
            out.append("$ref with siblings")
    if "$dynamicRef" in node or "$dynamicAnchor" in node:
        out.append("$anchor / $dynamicRef")
    has_length = "minLength" in node or "maxLength" in node
    pattern = node.get("pattern")
    if "pattern" in node and has_length:
        out.append("pattern with minLength/maxLength")
    elif has_length and r.may_be_string(node):
        out.append("string minLength/maxLength")
    patterns = [pattern] if isinstance(pattern, str) else []
    pattern_props = node.get("patternProperties")
    if isinstance(pattern_props, dict):
        patterns += [p for p in pattern_props if isinstance(p, str)]
    if isinstance(pattern, str) and r.inner_anchor(pattern):
        out.append("pattern (inner anchors)")
    if any(r.LOOKAROUND.search(p) for p in patterns):
        out.append("pattern (lookaround)")
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties")
        declared = props if isinstance(props, dict) else {}
        if any(name not in declared for name in required):
            out.append("required (undeclared names)")
    if "patternProperties" in node and "additionalProperties" not in node:
        out.append("patternProperties")
    if ("patternProperties" in node and "properties" in node
            and "allOf (several branches)" not in out and overlapping_pattern_all_of(node)):
        out.append("allOf (several branches)")
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type") in ("string", None):
        # JSON Schema 2020-12's formats (its validation vocabulary, section 7.3)
        out.append(f"format: {fmt}" if fmt in _SPEC_FORMATS else "format (unknown)")
        if "type" not in node:
            out.append("format (untyped)")
    if ("minProperties" in node or "maxProperties" in node) and r.has_optional(node):
        out.append("minProperties/maxProperties")
    return out


def test_node_features_agree_with_the_checks_as_written_before(corpus: Path) -> None:
    """The features of every subschema of 100 corpus schemas per maskbench subset, and of
    copies with the rarer feature keywords planted, come out as the plain checks give them,
    in their order (the report lists them so)."""
    import copy
    import gzip
    import random

    from grammask.schema.features import node_features
    from grammask.schema.walk import subschemas

    planted: list[tuple[str, Any]] = [
        ("uniqueItems", True), ("uniqueItems", False), ("dependentRequired", {"a": ["b"]}),
        ("if", {"type": "string"}), ("contains", {"type": "integer"}), ("minContains", 1),
        ("multipleOf", 0.5), ("multipleOf", 2.0), ("allOf", [{}, {}]), ("allOf", [{}]),
        ("$ref", "#"), ("$ref", "#anchor"), ("$ref", "http://x/s"), ("$dynamicRef", "#a"),
        ("pattern", "a(?=b)"), ("pattern", "a^b"), ("maxLength", 3), ("format", "date"),
        ("format", "uri"), ("format", "nonsense"), ("patternProperties", {"^x": {}}),
        ("minProperties", 1), ("required", ["undeclared"]), ("oneOf", [{}, {}]), ("not", {})]
    rng = random.Random(7)
    nodes = planted_nodes = 0
    seen: set[str] = set()
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if i == 100:
                    break
                schema = json.loads(line)["schema"]
                if not isinstance(schema, dict):
                    continue
                twin = copy.deepcopy(schema)
                for _, node in list(subschemas(twin)):
                    if rng.random() < 0.3:
                        for _ in range(rng.randint(1, 3)):
                            key, value = rng.choice(planted)
                            node[key] = copy.deepcopy(value)
                        planted_nodes += 1
                for tree in (schema, twin):
                    for _, node in subschemas(tree):
                        got = node_features(node)
                        assert got == _features_as_written_before(node), node
                        seen.update(got)
                        nodes += 1
    assert nodes > 20_000 and planted_nodes > 2_000
    assert len(seen) >= 20, seen  # the planted keywords reached nearly every check


def test_the_router_keeps_no_plans() -> None:
    """One plan cache: the compiler's (``compile_cache``, by spec key). The router is a
    pure function of the spec and keeps nothing between calls: specs with the same features
    at other pointers get their own reasons, made afresh."""
    from grammask.compile import router

    def spec(name: str) -> GrammarSpec:
        return GrammarSpec.json_schema({"type": "object", "properties": {
            name: {"type": "string"}}, "required": [name]})

    first, second = router.plan(spec("a")), router.plan(spec("b"))
    assert "free-form text at /properties/a" in first.route.reason
    assert "free-form text at /properties/b" in second.route.reason
    assert router.plan(spec("a")) == first
    kept = [name for name, value in vars(router).items()
            if isinstance(value, dict) and not name.startswith("__")]
    assert kept == [], kept
