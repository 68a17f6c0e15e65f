"""Warm-up: a directory of specs compiled before traffic; one bad file harms nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grammask import Compiler, GrammarError, GrammarSpec, Vocabulary
from grammask.compile.warmup import summary_table, warm


def test_warm_up_compiles_each_file_and_reports_the_bad_ones(tmp_path: Path,
                                                              qwen25: Vocabulary) -> None:
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    (tmp_path / "order.json").write_text(json.dumps(schema))
    (tmp_path / "broken.json").write_text('{"type": ')  # not JSON
    (tmp_path / "bad-type.json").write_text('{"type": "strin"}')
    (tmp_path / "zip.regex").write_text("[0-9]{5}\n")
    (tmp_path / "yes-no.choice.json").write_text('["yes", "no"]')
    (tmp_path / "arith.gbnf").write_text('root ::= [0-9]+ ("+" [0-9]+)*\n')
    (tmp_path / "pair.lark").write_text('start: "(" NUMBER "," NUMBER ")"\n'
                                        "%import common.NUMBER\n")
    (tmp_path / "notes.txt").write_text("not a spec")
    compiler = Compiler(qwen25)
    try:
        seen: list[str] = []
        results = {r.file: r for r in warm(compiler, tmp_path,
                                           progress=lambda r: seen.append(r.file))}
        assert sorted(seen) == sorted(results)
        for name in ("order.json", "zip.regex", "yes-no.choice.json", "arith.gbnf",
                     "pair.lark"):
            assert results[name].ok and results[name].backend, results[name]
        assert not results["broken.json"].ok and "JSON" in (results["broken.json"].error or "")
        assert not results["bad-type.json"].ok and "strin" in (
            results["bad-type.json"].error or "")
        assert (results["notes.txt"].error or "").startswith("skipped")
        table = summary_table(results.values())
        assert "5 compiled, 2 failed, 1 skipped" in table and "| order.json |" in table
        hits = compiler.stats.hits
        compiler.compile(GrammarSpec.json_schema(schema))  # what a request sends: a cache hit
        compiler.compile(GrammarSpec.regex("[0-9]{5}"))
        assert compiler.stats.hits == hits + 2
    finally:
        compiler.close()


def test_warm_up_of_a_missing_directory_is_a_clear_error(qwen25: Vocabulary,
                                                         tmp_path: Path) -> None:
    compiler = Compiler(qwen25)
    try:
        with pytest.raises(GrammarError, match="does not exist"):
            warm(compiler, tmp_path / "nope")
    finally:
        compiler.close()
