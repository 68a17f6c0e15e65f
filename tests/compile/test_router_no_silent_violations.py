"""No silent violations (issue 35): a masked response is valid, or it falls in a declared gap.

- the schema of the issue (``patternProperties`` overlapping ``properties`` under
  ``additionalProperties: false``) has no dead end on either backend, and no invalid walk;
- the normalizations behind it (patterns folded into properties, ``allOf`` and the keywords
  beside ``anyOf`` merged for xgrammar) and the gaps the router now declares;
- a dead end that still happens at run time fails its row (cause ``dead_end``), never a
  quiet stop;
- the harness's sampled walks and dead-end probe on a sample of the shared corpus, with the
  count of invalid outputs outside declared gaps as a ceiling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llguidance as llg
import numpy as np
import pytest

from grammask import Compiler, GrammarSpec, Vocabulary, metrics
from grammask.backends.guidance import GuidanceMatcher, json_options, tokenizer
from grammask.compile.router import plan, route
from grammask.decode.rows import Row
from grammask.errors import UnsupportedError
from grammask.harness.check import CheckConfig, Checker
from grammask.harness.corpus import load_items
from grammask.harness.oracles import JsonOracle
from grammask.harness.walk import (
    AuditReport,
    MaskReader,
    ProbeReport,
    probe_state,
    probe_walk,
    random_walk,
    token_table,
)
from grammask.schema.analysis import schema_features
from grammask.schema.normalize import (
    combinator_gap,
    conjoin,
    literal_words,
    merged_node,
    normalize_schema,
)
from grammask.specs.request import ConstraintRequest

ISSUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"score": {"type": "integer", "multipleOf": 5},
                   "tags": {"type": "array", "items": {"type": "string", "minLength": 10,
                                                       "maxLength": 20}}},
    "required": ["score", "tags"], "additionalProperties": False,
    "patternProperties": {"^score$": {"type": "integer"}}}
AFTER_TAGS = '{"score":45,"tags":["abcdefghijk"],'


@pytest.fixture(scope="module")
def fresh(qwen25: Vocabulary) -> Iterator[Compiler]:
    c = Compiler(qwen25, timeout_s=30.0, negative_ttl_s=0.0)
    yield c
    c.close()


# ------------------------------------------------------------------------- normalize
def test_pattern_overlapping_a_property_is_folded_in_and_dropped() -> None:
    out = normalize_schema(ISSUE_SCHEMA, close_objects=True, search_patterns=False)
    assert "patternProperties" not in out  # ^score$ names declared keys only
    assert out["properties"]["score"] == {"type": "integer", "multipleOf": 5}
    assert out["additionalProperties"] is False
    # a pattern with other keys too stays, and still constrains the declared name it matches
    schema = {"type": "object", "properties": {"tag": {"type": "string"}},
              "patternProperties": {"^t": {"maxLength": 3}}}
    out = normalize_schema(schema, close_objects=True, search_patterns=False)
    assert out["properties"]["tag"] == {"type": "string", "maxLength": 3}
    assert out["patternProperties"] == {"^t": {"maxLength": 3}}
    assert ISSUE_SCHEMA["patternProperties"] == {"^score$": {"type": "integer"}}  # untouched


def test_literal_words_and_conjoin() -> None:
    assert literal_words("^score$") == {"score"}
    assert literal_words("^(a|b\\.c)$") == {"a", "b.c"}
    assert literal_words("^(?:x|y)$") == {"x", "y"}
    for pattern in ("score", "^s.*$", "^\\d$", "^a|b$x"):
        assert literal_words(pattern) is None, pattern
    assert conjoin({"type": "integer", "maximum": 9}, {"type": "number", "maximum": 5}) == {
        "type": "integer", "maximum": 5}
    assert conjoin({"type": "string"}, {"type": "integer"}) == {
        "allOf": [{"type": "string"}, {"type": "integer"}]}
    assert conjoin({"$ref": "#/a"}, {"type": "object"}) == {
        "allOf": [{"$ref": "#/a"}, {"type": "object"}]}
    assert conjoin({"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                   {"properties": {"a": {"minimum": 1}, "b": {}}, "required": ["b"]}) == {
        "properties": {"a": {"type": "integer", "minimum": 1}, "b": {}},
        "required": ["a", "b"]}


def test_combinators_merged_for_xgrammar_where_exact() -> None:
    node = {"type": "object", "properties": {"shape": {"enum": ["a", "b"]}},
            "required": ["shape"],
            "anyOf": [{"properties": {"shape": {"const": "a"}, "r": {"type": "number"}},
                       "required": ["r"]},
                      {"properties": {"shape": {"const": "b"}}}]}
    merged = merged_node(node)
    assert merged is not None and set(merged) == {"anyOf"}
    assert merged["anyOf"][0]["required"] == ["shape", "r"]
    assert merged["anyOf"][0]["properties"]["shape"] == {"enum": ["a", "b"], "const": "a"}
    assert not combinator_gap(node)
    assert merged_node({"type": "integer", "allOf": [{"minimum": 3}, {"maximum": 5}]}) == {
        "type": "integer", "minimum": 3, "maximum": 5}
    assert combinator_gap({"allOf": [{"$ref": "#/$defs/a"}, {"type": "object"}]})
    assert not combinator_gap({"allOf": [{"$ref": "#/$defs/a"}]})


# ------------------------------------------------------------------------ routing gaps
def test_router_declares_what_xgrammar_and_lenient_llguidance_do_not_enforce() -> None:
    # a oneOf llguidance's lenient mode serves as anyOf (here lenient because of `not`)
    one_of = {"type": "integer", "not": {"const": 0},
              "oneOf": [{"multipleOf": 3}, {"multipleOf": 5}]}
    r = route(GrammarSpec.json_schema(one_of, backend="guidance"))
    assert r.lenient and "oneOf (may overlap)" in r.unenforced
    # keywords found only through a $ref into a non-keyword container
    stray = {"$ref": "#/ddd/a", "ddd": {"a": {"type": "object", "not": {"required": ["x"]}}}}
    assert "not" in schema_features(stray)
    with pytest.raises(UnsupportedError, match="not"):
        plan(GrammarSpec.json_schema(stray, strict=True))
    # an allOf xgrammar reads as any value: declared, and strict requests refused on it
    unmerged = {"type": "object", "allOf": [{"$ref": "#/$defs/a"}, {"required": ["b"]}],
                "$defs": {"a": {"properties": {"b": {"type": "integer"}}}}}
    forced = route(GrammarSpec.json_schema(unmerged, backend="xgrammar"))
    assert "allOf (several branches)" in forced.unenforced
    with pytest.raises(UnsupportedError, match="allOf"):
        route(GrammarSpec.json_schema(unmerged, backend="xgrammar", strict=True))
    # a merged allOf is enforced by xgrammar: no gap left
    merged = {"type": "integer", "allOf": [{"minimum": 3}, {"maximum": 5}]}
    assert route(GrammarSpec.json_schema(merged, backend="xgrammar")).unenforced == ()


# --------------------------------------------------------------------- sampled walks
def _walks(compiler: Compiler, vocab: Vocabulary, schema: Any, backend: str, n: int,
           **kw: Any) -> tuple[int, int, ProbeReport]:
    """(finished walks, invalid ones outside declared gaps, the probe's report)."""
    grammar = compiler.compile(GrammarSpec.json_schema(schema, backend=backend, **kw))
    table, reader = token_table(vocab), MaskReader(vocab.vocab_size)
    oracle = JsonOracle(schema)
    gaps = tuple(grammar.unenforced)
    probe = ProbeReport()
    finished = invalid = 0
    for w in range(n):
        rng = np.random.default_rng([35, w])
        walk = random_walk(grammar.matcher(), table, reader, rng, max_tokens=96,
                           free_steps=int(rng.integers(0, 40)), audit_steps=set(),
                           audit_tokens=0, oracle=None, report=AuditReport(), budget_s=5.0)
        if w % 3 == 0:
            probe_walk(grammar.matcher, table, reader, walk, rng, oracle.check, gaps, probe,
                       states=2, tokens=6, depth=96)
        if walk.finished:
            finished += 1
            verdict = oracle.check(walk.data, gaps)
            invalid += not (verdict.valid or verdict.known_gap)
    return finished, invalid, probe


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
@pytest.mark.parametrize("any_whitespace", [False, True])
def test_issue_schema_has_no_dead_end_and_no_invalid_walk(
        fresh: Compiler, qwen25: Vocabulary, backend: str, any_whitespace: bool) -> None:
    grammar = fresh.compile(GrammarSpec.json_schema(ISSUE_SCHEMA, backend=backend,
                                                    any_whitespace=any_whitespace))
    m = grammar.matcher()
    assert all(m.accept(t) for t in qwen25.encode(AFTER_TAGS[:-1]))
    bits = MaskReader(qwen25.vocab_size).read(m)
    comma = qwen25.encode(",")[0]
    assert not bits[comma], "`,` after the last property: no key can follow it"
    # every allowed token of that state has a valid way to end
    report = ProbeReport()
    probe_state(m, token_table(qwen25), MaskReader(qwen25.vocab_size),
                AFTER_TAGS[:-1].encode(), np.random.default_rng(0),
                JsonOracle(ISSUE_SCHEMA).check, tuple(grammar.unenforced), report, tokens=12)
    assert report.tokens and report.dead_ends == 0 and report.invalid_ends == 0, report
    finished, invalid, probe = _walks(fresh, qwen25, ISSUE_SCHEMA, backend, 24,
                                      any_whitespace=any_whitespace)
    assert finished >= 12
    assert invalid == 0
    assert probe.dead_ends == 0 and probe.invalid_ends == 0, probe.examples


def test_probe_finds_the_dead_end_of_the_raw_schema(qwen25: Vocabulary) -> None:
    """The probe must be able to fail: llguidance on the schema as written (no normalize)."""
    matcher = _raw_guidance(qwen25, ISSUE_SCHEMA)
    assert all(matcher.accept(t) for t in qwen25.encode(AFTER_TAGS[:-1]))
    report = ProbeReport()
    probe_state(matcher, token_table(qwen25), MaskReader(qwen25.vocab_size),
                AFTER_TAGS[:-1].encode(), np.random.default_rng(0),
                JsonOracle(ISSUE_SCHEMA).check, (), report, tokens=12)
    assert report.dead_ends + report.invalid_ends >= 1, report
    assert any(ex["token_text"] == "," for ex in report.examples)


def test_xgrammar_enforces_keywords_beside_any_of(fresh: Compiler, qwen25: Vocabulary) -> None:
    schema = {"type": "object", "required": ["shape"],
              "properties": {"shape": {"enum": ["circle", "square"]},
                             "r": {"type": "integer"}},
              "anyOf": [{"properties": {"shape": {"const": "circle"}, "r": {"minimum": 1}},
                         "required": ["r"]},
                        {"properties": {"shape": {"const": "square"}}}]}
    assert route(GrammarSpec.json_schema(schema, backend="xgrammar")).unenforced == ()
    finished, invalid, probe = _walks(fresh, qwen25, schema, "xgrammar", 18,
                                      any_whitespace=False)
    assert finished >= 9 and invalid == 0
    assert probe.dead_ends == 0 and probe.invalid_ends == 0, probe.examples


# ------------------------------------------------------------------------- run time
def _raw_guidance(vocab: Vocabulary, schema: Any) -> GuidanceMatcher:
    grammar = llg.LLMatcher.grammar_from_json_schema(
        json.dumps(schema),
        defaults=json_options(GrammarSpec.json_schema(schema, any_whitespace=False),
                              lenient=False))
    inner = llg.LLMatcher(tokenizer(vocab), grammar, log_level=0)
    return GuidanceMatcher(inner, vocab.stop_ids, vocab.vocab_size)


def test_a_dead_end_at_run_time_fails_the_row(qwen25: Vocabulary) -> None:
    """Not a quiet stop: the row errors with cause dead_end (metric and log)."""
    matcher = _raw_guidance(qwen25, ISSUE_SCHEMA)
    row = Row(ConstraintRequest(GrammarSpec.json_schema(ISSUE_SCHEMA)), None,  # type: ignore[arg-type]
              [], True, qwen25.tokens)
    row.matcher = matcher
    before = metrics.snapshot().get('grammask_row_errors_total{cause="dead_end"}', 0.0)
    row.feed(qwen25.encode(AFTER_TAGS))
    assert row.error is None  # the `,` itself is taken
    MaskReader(qwen25.vocab_size).read(matcher)  # the mask after it: stop only
    row.feed([sorted(qwen25.stop_ids)[0]])
    assert row.status == "error" and row.error is not None and "dead end" in row.error
    assert matcher.failure is not None
    if metrics.available():
        after = metrics.snapshot()['grammask_row_errors_total{cause="dead_end"}']
        assert after == before + 1


# ---------------------------------------------------------------------- the corpus
#: subsets with the issue's families (allOf/anyOf, patternProperties, oneOf, not)
CORPUS_SUBSETS = ["Handwritten", "JsonSchemaStore", "WashingtonPost", "Github_ultra",
                  "Glaiveai2K"]
#: sampled outputs invalid outside declared gaps, plus dead and invalid ends found by the
#: probe, on the sample below (auto routing): a ceiling that may only go down
CEILING = 0


def test_corpus_sample_walks_and_probe_stay_under_the_ceiling(
        corpus: Path, qwen25: Vocabulary) -> None:
    cfg = CheckConfig(walks=2, max_tokens=96, audit_steps=1, audit_tokens=200, diff=False,
                      walk_budget_s=4.0, seed=11, probe_states=2, probe_tokens=6,
                      probe_depth=128, mask_instances=False)
    items = load_items(corpus, CORPUS_SUBSETS, sample=10, seed=11, whole=[])
    checker = Checker(cfg, vocab=qwen25)
    found: list[str] = []
    probed = 0
    try:
        for item in items:
            if item.kind != "json_schema":
                continue
            oracle = checker.oracle_for(item)
            row, _ = checker.check_backend(item, "auto", oracle)
            checker.compiler.clear()
            probed += row.probe_tokens
            bad = row.samples_invalid + row.dead_ends + row.invalid_ends
            if bad:
                found.append(f"{item.id} ({row.served_by}, {row.unenforced}): "
                             f"{row.examples[:2]}")
    finally:
        checker.close()
    assert probed > 50  # the probe ran
    assert len(found) <= CEILING, "\n".join(found)
