"""GrammarSpec: constructors, front ends, canonical keys, extra_args."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grammask import (
    Compiler,
    GrammarSpec,
    InvalidGrammarError,
    InvalidSchemaError,
    InvalidSpecError,
    parse_extra_args,
)
from grammask.specs.frontends import from_openai, from_vllm
from grammask.vocab import Vocabulary

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_the_key_ignores_whitespace_but_not_key_order() -> None:
    """The backends emit properties in the declared order, so a reordered schema is another
    grammar: a key that sorted keys served one schema's order to the other."""
    reordered = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
                 "type": "object"}
    spaced = json.dumps(SCHEMA, indent=4)
    assert GrammarSpec.json_schema(SCHEMA).key == GrammarSpec.json_schema(spaced).key
    assert GrammarSpec.json_schema(SCHEMA).key != GrammarSpec.json_schema(reordered).key
    # the declared order is kept for compilation (xgrammar emits properties in it)
    assert GrammarSpec.json_schema(SCHEMA).source.index('"b"') < \
        GrammarSpec.json_schema(SCHEMA).source.index('"a"')


def test_a_cached_grammar_never_serves_another_property_order(qwen25: Vocabulary) -> None:
    """Two schemas equal but for their property order, both properties required: each must
    get its own order (a user puts "reasoning" before "answer" on purpose)."""
    first = {"type": "object", "required": ["answer", "reasoning"], "properties": {
        "reasoning": {"type": "integer"}, "answer": {"type": "integer"}}}
    second = {**first, "properties": dict(reversed(first["properties"].items()))}
    compiler = Compiler(qwen25)
    for backend in ("xgrammar", "guidance"):
        compiler.compile(GrammarSpec.json_schema(first, backend=backend))
        matcher = compiler.compile(GrammarSpec.json_schema(second, backend=backend)).matcher()
        assert all(matcher.accept(t) for t in qwen25.encode('{"answer": 1')), backend


def test_options_are_part_of_the_key() -> None:
    base = GrammarSpec.json_schema(SCHEMA)
    variants = [
        GrammarSpec.json_schema(SCHEMA, any_whitespace=False),
        GrammarSpec.json_schema(SCHEMA, extra_properties=True),
        GrammarSpec.json_schema(SCHEMA, whitespace_pattern=r"[ ]?"),
        GrammarSpec.json_schema(SCHEMA, strict=True),
        GrammarSpec.json_schema(SCHEMA, backend="xgrammar"),
    ]
    assert len({base.key, *(v.key for v in variants)}) == 6
    assert base == GrammarSpec.json_schema(dict(SCHEMA)) and hash(base) == hash(
        GrammarSpec.json_schema(dict(SCHEMA)))


def test_kinds_do_not_collide() -> None:
    specs = [GrammarSpec.regex("a"), GrammarSpec.choice(["a"]), GrammarSpec.grammar('start: "a"'),
             GrammarSpec.json_object(), GrammarSpec.json_schema({"const": "a"})]
    assert len({s.key for s in specs}) == len(specs)


def test_grammar_syntax_detection() -> None:
    assert GrammarSpec.grammar('root ::= "a"').syntax == "ebnf"
    assert GrammarSpec.grammar('start: "a"').syntax == "lark"
    assert GrammarSpec.grammar('root ::= "a"', syntax="lark").syntax == "lark"
    with pytest.raises(InvalidSpecError, match="syntax"):
        GrammarSpec.grammar('root ::= "a"', syntax="bnf")  # type: ignore[arg-type]


def test_openai_response_format() -> None:
    assert from_openai({"type": "text"}) is None
    obj = from_openai({"type": "json_object"})
    assert obj is not None and obj.kind == "json_object"
    strict = from_openai(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    loose = from_openai(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert strict is not None and strict.strict and not strict.extra_properties
    assert loose is not None and not loose.strict and loose.extra_properties
    with pytest.raises(InvalidSpecError, match="schema is missing"):
        from_openai({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(InvalidSpecError, match="response_format.type"):
        from_openai({"type": "yaml"})


def test_vllm_structured_outputs_options_are_honoured() -> None:
    spec = from_vllm({"json": SCHEMA, "disable_any_whitespace": True,
                                  "disable_additional_properties": False,
                                  "whitespace_pattern": " ?"})
    assert spec.kind == "json_schema" and not spec.any_whitespace
    assert spec.extra_properties and spec.whitespace_pattern == " ?"
    assert from_vllm({"regex": "a+"}).kind == "regex"
    assert from_vllm({"choice": ["x", "y"]}).choices == ["x", "y"]
    assert from_vllm({"grammar": 'root ::= "a"'}).syntax == "ebnf"
    assert from_vllm({"json_object": True}).kind == "json_object"
    with pytest.raises(InvalidSpecError, match="exactly one"):
        from_vllm({"regex": "a", "choice": ["a"]})
    with pytest.raises(InvalidSpecError, match="unknown structured-output keys"):
        from_vllm({"regex": "a", "jsonn": {}})


def test_extra_args_round_trip() -> None:
    args = {"grammask": json.dumps({"json": SCHEMA, "disable_any_whitespace": True}),
            "grammask_backend": "xgrammar", "grammask_thinking": "off",
            "grammask_strict": 1, "grammask_think_end": "</think>"}
    req = parse_extra_args(args)
    assert req is not None
    assert req.spec.backend == "xgrammar" and req.spec.strict and not req.spec.any_whitespace
    assert not req.thinking and req.think_end == "</think>"
    assert parse_extra_args({"other": 1}) is None
    assert parse_extra_args(None) is None
    with pytest.raises(InvalidSpecError, match="not valid JSON"):
        parse_extra_args({"grammask": "{nope"})
    with pytest.raises(InvalidSpecError, match="without a 'grammask'"):
        parse_extra_args({"grammask_backend": "xgrammar"})
    with pytest.raises(InvalidSpecError, match="backend"):
        parse_extra_args({"grammask": '{"regex": "a"}', "grammask_backend": "outlines"})


@pytest.mark.parametrize(
    ("make", "error", "fragment", "where"),
    [
        (lambda: GrammarSpec.json_schema("{not json"), InvalidSchemaError, "not valid JSON",
         "line 1 column 2"),
        (lambda: GrammarSpec.json_schema("[1, 2]"), InvalidSchemaError, "object or a boolean",
         "/"),
        (lambda: GrammarSpec.json_schema(42), InvalidSpecError, "got int", "schema"),  # type: ignore[arg-type]
        (lambda: GrammarSpec.json_schema({"a": float("nan")}), InvalidSchemaError, "nan", "/a"),
        (lambda: GrammarSpec.regex(b"ab"), InvalidSpecError, "must be a string", "regex"),  # type: ignore[arg-type]
        (lambda: GrammarSpec.regex("a\x00b"), InvalidSpecError, "NUL", "regex offset 1"),
        (lambda: GrammarSpec.choice([]), InvalidSpecError, "empty", "choice"),
        (lambda: GrammarSpec.choice("abc"), InvalidSpecError, "list of strings", "choice"),
        (lambda: GrammarSpec.choice(["a", 3]), InvalidSpecError, "strings", "choice[1]"),  # type: ignore[list-item]
        (lambda: GrammarSpec.grammar("   "), InvalidSpecError, "empty", "grammar"),
        (lambda: GrammarSpec.json_schema(SCHEMA, any_whitespace="yes"), InvalidSpecError,  # type: ignore[arg-type]
         "boolean", "any_whitespace"),
    ],
)
def test_bad_input_names_what_and_where(make: object, error: type[Exception], fragment: str,
                                        where: str) -> None:
    with pytest.raises(error, match=fragment) as info:
        make()  # type: ignore[operator]
    assert getattr(info.value, "where", None) == where


def test_huge_and_deep_schemas_are_refused_cleanly() -> None:
    huge = {"type": "object", "description": "x" * (10 * 1024 * 1024)}
    with pytest.raises(InvalidSpecError, match="MB"):
        GrammarSpec.json_schema(huge)
    with pytest.raises(InvalidSpecError, match="MB"):
        GrammarSpec.json_schema(json.dumps(huge))
    deep: dict[str, object] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(InvalidSchemaError, match="deeper than"):
        GrammarSpec.json_schema(deep)
    with pytest.raises(InvalidSchemaError, match="deeper than|nests"):
        GrammarSpec.json_schema(json.dumps(deep))


def test_a_nul_inside_a_json_string_is_legal() -> None:
    """JSON strings may hold U+0000 (``[^\\u0000]`` patterns in 6 corpus schemas); only a raw
    NUL in a spec's text framing is refused."""
    spec = GrammarSpec.json_schema('{"pattern": "^/[^\\u0000]+$", "const": "a\\u0000"}')
    assert spec.schema["pattern"] == "^/[^\x00]+$"
    GrammarSpec.json_schema({"properties": {"k\x00": {"enum": ["x\x00y"]}}})
    with pytest.raises(InvalidSpecError, match="NUL"):
        GrammarSpec.regex("a\x00b")


@pytest.mark.parametrize(("tag", "where", "fragment"), [
    ({"structures": [{"begin": "<a>", "end": "</a>", "schema": {}}]},
     "structural_tag/triggers", "triggers must be"),
    ({"structures": 5, "triggers": ["<"]}, "structural_tag/structures", "structures must be"),
    ({"structures": [5], "triggers": ["<"]}, "structural_tag/structures/0", "object"),
    ({"structures": [{"begin": "<a>"}], "triggers": 5}, "structural_tag/triggers", "triggers"),
    ({"structures": [{"end": "x"}], "triggers": ["<"]}, "structural_tag/structures/0/begin",
     "begin must be"),
    ({"structures": [{"begin": "[a]"}], "triggers": ["<"]},
     "structural_tag/structures/0/begin", "no trigger"),
    ({"structures": [{"begin": "<a>", "schema": 5}], "triggers": ["<"]},
     "structural_tag/structures/0/schema", "JSON schema"),
    ({"structures": [{"begin": "<a>", "shema": {}}], "triggers": ["<"]},
     "structural_tag/structures/0/shema", "unknown"),
    ({"type": "structural_tag", "format": 5}, "structural_tag/format", "format must be"),
    ({"type": "structural_tag"}, "structural_tag/format", "format must be"),
    ({"type": "structural_tag", "format": {"type": 3}}, "structural_tag/format/type",
     "format.type"),
    ({"format": {"type": "const_string", "value": "x"}}, "structural_tag/type", "expected type"),
])
def test_malformed_structural_tags_name_the_field(tag: dict[str, object], where: str,
                                                  fragment: str) -> None:
    """They used to reach the backends and read ``'triggers'`` or ``'int' object is not
    iterable``."""
    with pytest.raises(InvalidGrammarError, match=fragment) as info:
        GrammarSpec.structural_tag(tag)
    assert info.value.where == where


def test_a_too_deep_text_schema_names_where_it_is_too_deep() -> None:
    """The depth of a text schema is measured by a walk that names nothing; the place is
    found only for a schema that is too deep."""
    deep: dict[str, object] = {"type": "string"}
    for _ in range(120):
        deep = {"type": "object", "properties": {"x~y": deep}}
    with pytest.raises(InvalidSchemaError, match="deeper than") as info:
        GrammarSpec.json_schema(json.dumps(deep))
    where = info.value.where or ""
    assert where.startswith("/properties/x~0y/properties/x~0y/")
    assert where.count("/") == 101  # 100 levels: properties and x~y fifty times, then a key
    shallow: dict[str, object] = {"type": "string"}
    for _ in range(45):  # 90 levels of nesting
        shallow = {"type": "object", "properties": {"x": shallow}}
    GrammarSpec.json_schema(json.dumps(shallow))


def test_twins_by_backend_are_made_once() -> None:
    """``with_backend`` keeps the twins it makes (a compiler with a default backend asks on
    every hit); the same backend is the spec itself; each twin has its own key."""
    spec = GrammarSpec.json_schema(SCHEMA)
    twin = spec.with_backend("xgrammar")
    assert spec.with_backend("xgrammar") is twin and twin.backend == "xgrammar"
    assert spec.with_backend(None) is spec and twin.with_backend("xgrammar") is twin
    assert twin.key != spec.key and twin.key == GrammarSpec.json_schema(
        SCHEMA, backend="xgrammar").key
    assert twin.with_backend(None) == spec
    assert spec.with_backend("llguidance").backend == "guidance"  # an alias: resolved


def test_every_option_and_the_text_make_the_key() -> None:
    """The key hashes the options (one JSON line) and then the text as it is: every option
    changes it, and a text cannot pass for options (the line ends at the first newline)."""
    base = GrammarSpec.regex("a\nb")
    variants = [base, GrammarSpec.json_schema({"type": "string"}, any_whitespace=False),
                GrammarSpec.regex("a\nb", backend="xgrammar"), GrammarSpec.regex("a\nc"),
                GrammarSpec.json_schema({"type": "string"}),
                GrammarSpec.json_schema({"type": "string"}, strict=True),
                GrammarSpec.json_schema({"type": "string"}, extra_properties=True),
                GrammarSpec.json_schema({"type": "string"}, whitespace_pattern=" ?"),
                GrammarSpec.grammar('start: "a"'), GrammarSpec.grammar('root ::= "a"')]
    assert len({v.key for v in variants}) == len(variants)
    assert GrammarSpec.regex("a\nb").key == base.key
    head, text = base._key_material().split("\n", 1)
    assert json.loads(head)[0] == "regex" and text == "a\nb"


def test_text_schemas_parse_and_key_as_json_loads_and_dumps_did() -> None:
    """The decoder and the compact encoder are made once; the depth walk is skipped for a
    text with at most 100 brackets. Errors and keys are those of ``json.loads`` / ``dumps``."""
    from grammask.schema.jsontext import compact
    from grammask.specs.limits import MAX_NESTING

    for text, fragment in [("\ufeff{}", "BOM"), ('{"a": NaN}', "NaN is not a JSON number"),
                           ('{"a": -Infinity}', "-Infinity is not"), ('{"a": 1} x', "Extra"),
                           ("{", "Expecting property name")]:
        with pytest.raises(InvalidSchemaError, match=fragment):
            GrammarSpec.json_schema(text)
    value = {"b": [1, 2.5, "é\u2028"], "a": {"c": None, "d": True}}
    assert compact(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert GrammarSpec.json_schema(json.dumps(value, indent=2)).source == compact(value)
    # exactly at the bracket bound, and one container deeper: the walk decides
    deep: dict[str, object] = {}
    for _ in range(MAX_NESTING):
        deep = {"a": deep}
    text = json.dumps(deep)  # 100 nested objects under the root (the innermost one empty)
    assert text.count("{") == MAX_NESTING + 1
    GrammarSpec.json_schema(text)
    with pytest.raises(InvalidSchemaError, match="deeper than"):
        GrammarSpec.json_schema(json.dumps({"a": deep}).replace("{}", '{"x": 1}'))
    # brackets inside strings count toward the bound only (never toward the depth)
    GrammarSpec.json_schema(json.dumps({"description": "[" * 500, "type": "string"}))


def test_the_key_line_of_options_is_the_json_of_the_options() -> None:
    """The option line is cached per option set; its text is what ``json.dumps`` made."""
    import hashlib

    for spec in [GrammarSpec.regex("x"), GrammarSpec.json_schema({"type": "string"},
                                                                 whitespace_pattern="[ ]é"),
                 GrammarSpec.grammar("start: \"a\"", backend="guidance")]:
        head = json.dumps([spec.kind, spec.syntax, spec.any_whitespace, spec.whitespace_pattern,
                           spec.extra_properties, spec.strict, spec.backend],
                          ensure_ascii=False)
        material = f"{head}\n{spec.source}"
        assert spec.key == hashlib.sha256(material.encode("utf-8")).hexdigest()[:32]


def test_a_number_beyond_a_double_is_refused_where_it_is() -> None:
    """``1e400`` reads as an infinity, which no JSON text can carry: a clear error at its
    pointer (it used to escape as a bare ``ValueError`` from the compact encoder)."""
    for text, where in [('{"type": "number", "maximum": 1e400}', "/maximum"),
                        ('{"properties": {"a": {"minimum": -1E999}}}', "/properties/a/minimum")]:
        with pytest.raises(InvalidSchemaError, match="out of range") as info:
            GrammarSpec.json_schema(text)
        assert info.value.where == where
    assert GrammarSpec.json_schema('{"maximum": 1.5e3}').schema == {"maximum": 1500.0}


def test_json_text_is_the_standard_encoders_with_or_without_orjson(
        corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``jsontext`` writes what the standard encoder writes (corpus schemas: the same text,
    so the same keys), falls back to it for what orjson refuses (integers beyond 64 bits,
    lone surrogates), and gives native parsers valid UTF-8 either way."""
    import gzip

    from grammask.schema import jsontext

    assert jsontext._orjson is not None  # installed with grammask: the fast path is tested
    schemas = []
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            schemas += [json.loads(line)["schema"] for _, line in zip(range(15), fh,
                                                                       strict=False)]
    edge: list[object] = [{"big": 2 ** 70, "neg": -(2 ** 64)}, {"s": "\ud800x"},
                          {"s": "".join(map(chr, range(0x80))) + "\u2028é😀"}]
    standard = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    keys = [GrammarSpec.json_schema(json.dumps(s)).key for s in schemas]
    for value in [*schemas, *edge]:
        assert jsontext.compact(value) == standard.encode(value), value
        text = jsontext.for_parser(value)
        text.encode("utf-8")  # a lone surrogate comes out escaped
        assert json.loads(text) == value
    monkeypatch.setattr(jsontext, "_orjson", None)
    assert [GrammarSpec.json_schema(json.dumps(s)).key for s in schemas] == keys
    for value in [*schemas, *edge]:
        assert jsontext.compact(value) == standard.encode(value)
        jsontext.for_parser(value).encode("utf-8")
