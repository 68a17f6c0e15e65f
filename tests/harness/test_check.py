"""The mask-correctness harness: each oracle on cases with known answers, deliberately broken
masks that it must catch, worker isolation, and a small slice of the real corpus."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.backends import Matcher
from grammask.harness import cli as check_cli
from grammask.harness.check import CheckConfig, Checker, Emit, Row, complete_judge
from grammask.harness.corpus import Instance, Item, load_items, read_instances
from grammask.harness.diff import DiffReport, classify, differential, json_context
from grammask.harness.gbnf import GbnfError, gbnf_to_lark
from grammask.harness.oracles import (
    ChoiceOracle,
    JsonOracle,
    LarkOracle,
    RegexOracle,
    completions,
    split_utf8,
)
from grammask.harness.report import build_report
from grammask.harness.runner import Pool, run_serial
from grammask.harness.walk import (
    AuditReport,
    MaskReader,
    audit_step,
    random_walk,
    token_table,
)

FAST = CheckConfig(walks=2, max_tokens=64, audit_steps=2, audit_tokens=300, resolve=1,
                   walk_budget_s=5.0, diff_budget_s=6.0)


@pytest.fixture(scope="module")
def checker(qwen25: Vocabulary) -> Iterator[Checker]:
    ch = Checker(FAST, vocab=qwen25)
    yield ch
    ch.close()


# ------------------------------------------------------------------------ UTF-8 + regex
def test_split_utf8_keeps_incomplete_tail_and_refuses_broken_bytes() -> None:
    assert split_utf8("aé".encode()) == ("aé", b"")
    assert split_utf8(b"ab\xc3") == ("ab", b"\xc3")
    assert split_utf8(b"ab\xe2\x82") == ("ab", b"\xe2\x82")
    assert split_utf8(b"\x80") is None  # a continuation byte cannot start a character
    assert split_utf8(b"\xc3(") is None
    chars = completions(b"\xc3")
    assert chars is not None and len(chars) == 64 and "é" in chars
    assert completions(b"\xf0") is None  # 262,144 candidates: undecided


def test_regex_oracle_decides_byte_prefixes() -> None:
    o = RegexOracle(r"[a-z]+é\d{2}")
    assert o.viable(b"ab") is True
    assert o.viable(b"ab\xc3") is True  # could become é
    assert o.viable("abè".encode()) is False
    assert o.viable(b"ab\xe2") is False  # no 3-byte character fits
    assert o.viable(b"ab\xf0") is None  # too many completions to enumerate
    assert o.viable(b"\xff") is False
    assert o.complete("abé12".encode()) is True
    assert o.complete("abé1".encode()) is False
    assert o.complete(b"ab\xc3") is False
    # xgrammar reads \d as ASCII: the dialect check explains that disagreement
    assert o.viable("abé٣".encode()) is True
    assert o.dialects("abé٣".encode(), complete=False)["ascii"] is False


def test_choice_oracle_is_a_byte_prefix_test() -> None:
    o = ChoiceOracle(["yes", "né"])
    assert o.viable(b"ye") and o.viable(b"n\xc3") and o.viable(b"")
    assert not o.viable(b"yess") and not o.viable(b"x")
    assert o.complete(b"yes") and o.complete("né".encode()) and not o.complete(b"ye")


# --------------------------------------------------------------------------------- JSON
def test_json_oracle_validates_with_claimed_formats_and_explains_by_gaps() -> None:
    schema = {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "uniqueItems": True},
        "host": {"type": "string", "format": "hostname"}}}
    o = JsonOracle(schema)
    assert o.check(b'{"when": "2024-02-29T10:00:00Z", "host": "a.example"}').valid
    bad_time = o.check(b'{"when": "2024-02-29 25:00"}')
    assert not bad_time.valid and "format" in bad_time.keywords and not bad_time.known_gap
    assert not o.check(b'{"host": "-bad-.x"}').valid
    dupe = o.check(b'{"tags": [1, 1]}', ["uniqueItems (ignored)"])
    assert not dupe.valid and dupe.known_gap  # a declared gap
    assert not o.check(b'{"tags": [1, 1]}').known_gap  # not declared: a bug
    assert o.check(b'{"tags": [1], "tags": [2]}').reason == "duplicate-key"
    assert o.check(b'{"when": 1').reason == "json"
    assert o.check(b'"\xff"').reason == "utf-8"


def test_json_oracle_resolves_test_suite_remotes_locally(corpus: Path) -> None:
    from grammask.harness.oracles import local_registry

    schema = {"$ref": "http://localhost:1234/draft2020-12/integer.json"}
    o = JsonOracle(schema, registry=local_registry(corpus / "jsts" / "remotes"))
    assert o.check(b"3").valid
    assert not o.check(b'"a"').valid


# ------------------------------------------------------------------------------ grammars
def test_gbnf_translation_is_exact_on_hand_made_cases() -> None:
    grammar = r'''
        # comment
        root ::= digits "-" word ws? tail
        digits ::= [0-9]{2,4}
        word ::= ([^"\\\x00-\x1F] | "\\" ["\\n])+   # escapes inside classes
        ws ::= | " "
        tail ::= "\u00e9" | "x"{2}
    '''
    lark_oracle = LarkOracle(grammar, "ebnf")
    for good in ("12-ab\\né", '1234-x\\"y xx', "123-a é"):
        assert lark_oracle.parses(good.encode()).valid, good
    for bad in ("1-ab é", "12345-ab é", "12-é", '12-a"b é', "12-ab x"):
        assert not lark_oracle.parses(bad.encode()).valid, bad
    with pytest.raises(GbnfError):
        gbnf_to_lark("root ::= <[1234]>")
    with pytest.raises(GbnfError):
        gbnf_to_lark('start ::= "a"')  # no root


def test_gbnf_json_grammar_from_corpus(corpus: Path) -> None:
    oracle = LarkOracle((corpus / "gbnf" / "json.gbnf").read_text(), "ebnf")
    assert oracle.parses(b'{"a": [1, -2.5e3, "x\\u00e9", true], "b": {}}').valid
    assert not oracle.parses(b'{"a": [1,]}').valid
    assert not oracle.parses(b'{"a": 01x}').valid


def test_lark_oracle_reads_llguidance_dialect(corpus: Path) -> None:
    rfc = LarkOracle((corpus / "lark" / "rfc.lark").read_text(), "lark")
    xml = (corpus / "lark" / "rfc.xml").read_bytes()
    assert rfc.parses(xml).valid
    assert not rfc.parses(b"<rfx>\n").valid
    lark_of_lark = LarkOracle((corpus / "lark" / "lark.lark").read_text(), "lark")
    # ``"\""`` needs the every-tokenization fallback (the grammar's string regex is lazy)
    assert lark_of_lark.parses(b'start: "\\"" name\nname: /[a-z]+/ // note\n').valid
    assert not lark_of_lark.parses(b"start: (((").valid


# ----------------------------------------------------------------------- broken matchers
class LeakyMatcher:
    """Allows (mask and accept alike) one extra token at the first step, as a buggy backend
    might: the output then carries the token's bytes the grammar never allowed."""

    def __init__(self, inner: Matcher, leak: int, started: bool = False,
                 leaked: bool = False) -> None:
        self.inner, self.leak, self.started, self.leaked = inner, leak, started, leaked

    def accept(self, token_id: int) -> bool:
        first = not self.started
        self.started = True
        if first and token_id == self.leak:
            self.leaked = True  # taken without the inner matcher: rollback steps over it
            return True
        return self.inner.accept(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill(bitmask, row)
        if not self.started:
            bitmask[row].zero_()  # only the leaked token: every walk takes it
            bitmask[row, self.leak >> 5] |= _bit(self.leak & 31)

    def rollback(self, num_tokens: int) -> None:
        inner = self.inner.accepted()
        if num_tokens > inner and self.leaked:
            self.leaked = False
            self.started = False
            num_tokens -= 1
        self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def can_terminate(self) -> bool:
        return self.inner.can_terminate()

    def fork(self) -> Matcher:
        return LeakyMatcher(self.inner.fork(), self.leak, self.started, self.leaked)

    def reset(self) -> None:
        self.inner.reset()
        self.started = False


class FlippedBitMatcher(LeakyMatcher):
    """A mask with one bit flipped on (accept is honest): mask and accept disagree."""

    def accept(self, token_id: int) -> bool:
        return self.inner.accept(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill(bitmask, row)
        bitmask[row, self.leak >> 5] |= _bit(self.leak & 31)

    def fork(self) -> Matcher:
        return FlippedBitMatcher(self.inner.fork(), self.leak)


def _bit(i: int) -> int:
    value = 1 << i
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclasses.dataclass
class _WrappedCompiled:
    inner: Any
    wrap: Any
    backend: Any = "xgrammar"
    memory_bytes: int = 0

    def matcher(self) -> Matcher:
        return self.wrap(self.inner.matcher())  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_audit_finds_no_mismatch_on_a_correct_regex_mask(qwen25: Vocabulary, compiler: Compiler,
                                                         backend: str) -> None:
    pattern = r"(ab|c[0-9]{1,3})+é?"
    grammar = compiler.compile(GrammarSpec.regex(pattern, backend=backend))  # type: ignore[arg-type]
    table, reader, report = token_table(qwen25), MaskReader(qwen25.vocab_size), AuditReport()
    walk = random_walk(grammar.matcher(), table, reader, np.random.default_rng(0),
                       max_tokens=20, free_steps=6, audit_steps={0, 1, 2, 3, 5}, audit_tokens=400,
                       oracle=RegexOracle(pattern), report=report)
    assert walk.finished and RegexOracle(pattern).complete(walk.data)
    assert report.steps == 5 and report.oracle_tokens > 1000
    assert report.mismatches == 0 and report.oracle_under == 0 and report.oracle_over == 0


def test_audit_catches_a_flipped_bit(qwen25: Vocabulary, compiler: Compiler) -> None:
    pattern = "[0-9]+"
    grammar = compiler.compile(GrammarSpec.regex(pattern, backend="xgrammar"))
    leak = qwen25.token_id("x")
    broken = FlippedBitMatcher(grammar.matcher(), leak)
    report = AuditReport()
    table = token_table(qwen25)
    bits = MaskReader(qwen25.vocab_size).read(broken)
    audit_step(broken, table, bits, b"", np.random.default_rng(0), 200, RegexOracle(pattern),
               report)
    assert report.allowed_refused == 1 and report.oracle_under == 1
    assert report.examples[0]["token_text"] == "x"


def test_checker_catches_a_consistently_broken_json_mask(checker: Checker) -> None:
    """Mask and accept agree (a forked-accept audit cannot see it), but the outputs are
    wrong: the sampled-output oracle and the instance checks must catch it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    item = Item("broken", "hand", "json_schema", schema, instances=(
        Instance(True, data={"n": 1}), Instance(False, data={"n": "1"})))
    grammar = checker.compiler.compile(GrammarSpec.json_schema(schema, backend="guidance"))
    leak = checker.vocab.token_id("x")
    broken = dataclasses.replace(grammar, backend_grammar=_WrappedCompiled(
        grammar.backend_grammar, lambda m: LeakyMatcher(m, leak)))
    oracle = checker.oracle_for(item)
    row = Row(item.subset, item.id, item.kind, "broken")
    checker.check_grammar(row, item, broken, oracle)
    assert row.samples_total == FAST.walks and row.samples_invalid == FAST.walks
    assert row.examples[0]["reason"] == "json" and row.examples[0]["output"].startswith("x")
    # the leaked token is forbidden by the real mask: the instance path sees it too
    assert row.audit["forbidden_taken"] > 0
    healthy = Row(item.subset, item.id, item.kind, "guidance")
    checker.check_grammar(healthy, item, grammar, oracle)
    assert healthy.samples_invalid == 0 and healthy.audit["mismatches"] == 0
    assert healthy.valid_accepted == 1 and healthy.invalid_rejected == 1


# ------------------------------------------------------------------------------ checker
def test_instances_forms_and_gap_classification(checker: Checker) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "uniqueItems": True}}}
    item = Item("hand", "hand", "json_schema", schema, instances=(
        Instance(True, data={"name": "Zoë", "tags": ["a"]}),
        Instance(True, data={"name": "a", "extra": 1}),  # undeclared key, objects closed
        Instance(True, data={"tags": ["b"], "name": "c"}),  # backends fix the key order
        Instance(False, data={"name": 5}),
        Instance(False, data={"tags": ["a", "a"]}),  # uniqueItems: xgrammar's declared gap
    ))
    row, grammar = checker.check_backend(item, "xgrammar", checker.oracle_for(item))
    assert grammar is not None and row.status == "ok"
    assert row.valid_total == 3 and row.valid_accepted == 1
    assert row.over_closed == 1 and row.over_order == 1 and row.over == 0
    assert row.valid_forms_accepted == {"compact": 1, "default": 1}
    assert row.invalid_rejected == 1 and row.under == 1 and row.under_known == 1
    assert row.samples_total + row.samples_unfinished == FAST.walks
    assert row.samples_invalid == 0


def test_auto_reuses_the_forced_row_of_the_same_grammar(checker: Checker) -> None:
    """Auto routed to a backend with the same mode and gaps compiles the very grammar the
    forced row checked: the row is copied (and says so); a different mode is checked anew."""
    same = Item("same", "hand", "json_schema", {"type": "object", "properties": {
        "s": {"type": "string"}}, "required": ["s"]}, instances=(
        Instance(True, data={"s": "x"}), Instance(False, data={"s": 1})))
    rows: list[dict[str, Any]] = []
    checker.check(same, ("xgrammar", "guidance", "auto"),
                  lambda kind, p: rows.append(p) if kind == "row" else None, diff=False)
    by = {r["backend"]: r for r in rows}
    assert by["auto"]["reused_from"] == "guidance" == by["auto"]["served_by"]
    assert by["auto"]["valid_accepted"] == by["guidance"]["valid_accepted"] == 1
    assert by["auto"]["invalid_rejected"] == 1 and by["auto"]["reason"] != by["guidance"]["reason"]
    # an overlapping oneOf: forced llguidance refuses it, auto's lenient fallback serves it,
    # so there is no forced row to reuse and auto is checked for real
    rescued = Item("rescued", "hand", "json_schema",
                   {"oneOf": [{"type": "integer"}, {"type": "number"}]},
                   instances=(Instance(True, data=1.5),))
    rows.clear()
    checker.check(rescued, ("guidance", "auto"),
                  lambda kind, p: rows.append(p) if kind == "row" else None, diff=False)
    by = {r["backend"]: r for r in rows}
    assert by["auto"]["reused_from"] == "" and by["auto"]["status"] == "ok"


@pytest.mark.parametrize("kind,source", [
    ("choice", ["yes", "no", "maybe"]),
    ("regex", r"[a-c]{2,5}-\d"),
])
def test_prefix_oracles_agree_with_both_backends(checker: Checker, kind: str,
                                                source: Any) -> None:
    item = Item(f"{kind}-case", "hand", kind, source)  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    checker.check(item, ("xgrammar", "guidance", "auto"),
                  lambda k, p: rows.append(p) if k == "row" else None)
    assert [r["status"] for r in rows] == ["ok"] * 3
    for r in rows:
        a = r["audit"]
        assert a["oracle_tokens"] > 0 and a["mismatches"] == 0
        assert a["oracle_under"] == 0 and a["oracle_over"] == 0
        assert r["samples_total"] == r["samples_valid"] == FAST.walks


def test_grammar_samples_parse_with_lark(checker: Checker, corpus: Path) -> None:
    text = (corpus / "gbnf" / "arithmetic.gbnf").read_text()
    item = Item("arithmetic.gbnf", "gbnf", "grammar", text, "ebnf")
    # xgrammar: llguidance's own GBNF conversion folds the trailing ``ws`` into the IDENT/NUM
    # lexemes, so under it this grammar can only end after a parenthesized term
    row, _ = checker.check_backend(item, "xgrammar", checker.oracle_for(item))
    assert row.status == "ok" and row.oracle.startswith("lark")
    assert row.samples_total > 0 and row.samples_valid == row.samples_total


def test_differential_resolves_a_regex_dialect_difference(qwen25: Vocabulary,
                                                          compiler: Compiler) -> None:
    """xgrammar reads ``\\d`` as ASCII, llguidance as Unicode: the masks differ on non-ASCII
    digits, and the resolution (Python ``regex``, Unicode) blames xgrammar's narrower mask."""
    xg = compiler.compile(GrammarSpec.regex(r"\d", backend="xgrammar"))
    ll = compiler.compile(GrammarSpec.regex(r"\d", backend="guidance"))
    oracle = RegexOracle(r"\d")
    report = DiffReport()
    differential(ll.matcher(), xg.matcher(), ("guidance", "xgrammar"), ((), ()),
                 token_table(qwen25), np.random.default_rng(0),
                 complete_judge(oracle), report, max_tokens=4,
                 free_steps=0, audit_steps={0}, resolve=2, is_json=False)
    assert report.steps == 1 and report.tokens_differ > 0
    assert report.resolved == {"xgrammar over-constrains": 2}


def test_json_context_and_classes() -> None:
    assert json_context(b'{"a": 1, "') == "key"
    assert json_context(b'{"a": "x') == "string"
    assert json_context(b'{"a": -1') == "number"
    assert json_context(b'{"a": [') == "value"
    assert json_context(b'{"a": []') == "after-value"
    assert classify(b" ", False, "after-value") == "whitespace"
    assert classify(b"\t", False, "string") == "string"
    assert classify(b"12", False, "value") == "number"
    assert classify(b"<|im_end|>", True, "value") == "special/stop"


# ------------------------------------------------------------------------------ isolation
class ScriptedChecker:
    """Stands in for ``Checker`` inside workers: crashes or hangs on request (the real thing
    cannot be made to crash on demand)."""

    def __init__(self, cfg: CheckConfig) -> None:
        self.cfg = cfg

    def check(self, item: Item, backends: tuple[str, ...], emit: Emit, *,
              diff: bool = True) -> None:
        for label in backends:
            emit("start", {"backend": label})
            if item.id == f"crash-{label}":
                os._exit(3)
            if item.id == f"hang-{label}":
                time.sleep(600)
            emit("row", dataclasses.asdict(Row(item.subset, item.id, item.kind, label)))

    def close(self) -> None:
        pass


def test_pool_records_crashes_and_hangs_and_goes_on() -> None:
    items = [Item(name, "iso", "regex", "a") for name in
             ("ok-1", "crash-guidance", "hang-xgrammar", "ok-2")]
    pool = Pool(FAST, workers=2, hard_timeout_s=3.0, factory=ScriptedChecker)
    results = pool.run(items, ("xgrammar", "guidance"))
    status = {(r["id"], r["backend"]): r["status"] for r in results.rows}
    assert len(results.rows) == 8
    assert status[("crash-guidance", "guidance")] == "crash"
    assert status[("crash-guidance", "xgrammar")] == "ok"
    assert status[("hang-xgrammar", "xgrammar")] == "timeout"
    assert status[("hang-xgrammar", "guidance")] == "ok"  # rerun on a fresh worker
    assert status[("ok-1", "xgrammar")] == status[("ok-2", "guidance")] == "ok"
    assert results.restarts == 2


# ---------------------------------------------------------------------------- corpus + CLI
def test_corpus_sampling_is_stratified_and_seeded(corpus: Path, tmp_path: Path) -> None:
    items = load_items(corpus, ["BFCL_sql", "gbnf", "lark"], sample=3, seed=1, whole=["gbnf"])
    subsets = [i.subset for i in items]
    assert subsets.count("BFCL_sql") == 3 and subsets.count("gbnf") == 8
    assert subsets[:3] == ["BFCL_sql", "gbnf", "lark"]  # round-robin across subsets
    assert [i.id for i in items] == [i.id for i in load_items(
        corpus, ["BFCL_sql", "gbnf", "lark"], sample=3, seed=1, whole=["gbnf"])]
    rfc = next(i for i in items if i.id == "rfc.lark")
    assert rfc.kind == "grammar" and rfc.syntax == "lark" and rfc.instances[0].valid
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data": 1}\n')
    with pytest.raises(ValueError, match="boolean 'valid'"):
        read_instances(bad, "json_schema")


def test_corpus_sample_runs_clean(checker: Checker, corpus: Path) -> None:
    items = load_items(corpus, ["Github_easy", "jsts", "choices"], sample=2, seed=0)
    results = run_serial(checker, items, ("xgrammar", "guidance", "auto"))
    report = build_report(results.rows, results.diffs, items, {})
    assert len(results.rows) == 3 * len(items) == 18
    for backend, s in report["summary"].items():
        assert s["schemas"] == len(items), backend
        assert s["audit"]["mismatches"] == 0 and s["audit"]["oracle_under"] == 0, backend
        assert s["samples_invalid"] == 0, backend
    assert report["targets"]["items"] == len(items)


def test_cli_one_spec_with_instances(tmp_path: Path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]}))
    inst = tmp_path / "i.jsonl"
    inst.write_text('{"valid": true, "data": {"n": 3}}\n{"valid": false, "data": {"n": "3"}}\n'
                    '{"valid": true, "text": "{ \\"n\\" :4}"}\n')
    out, md = tmp_path / "report.json", tmp_path / "table.md"
    code = check_cli.main([str(schema), "--instances", str(inst), "--json", str(out),
                           "--markdown", str(md), "--walks", "1", "--max-tokens", "48",
                           "--audit-tokens", "200", "--no-diff"])
    report = json.loads(out.read_text())
    assert code == 0
    table = md.read_text().splitlines()
    assert table[0].startswith("| subset | backend |") and len(table) == 2 + 3 + 3
    assert "| **TOTAL** | **auto** | 1 | 1 | 100.0 | 100.0 | 0 |" in md.read_text()
    for backend in ("xgrammar", "guidance", "auto"):
        s = report["summary"][backend]
        for key in ("schemas", "compiled", "valid_total", "valid_accepted", "invalid_total",
                    "invalid_rejected", "samples_total", "samples_valid", "timeouts",
                    "crashes"):
            assert key in s
        assert (s["valid_total"], s["valid_accepted"]) == (2, 2)
        assert (s["invalid_total"], s["invalid_rejected"]) == (1, 1)
    assert {r["backend"] for r in report["rows"]} == {"xgrammar", "guidance", "auto"}
