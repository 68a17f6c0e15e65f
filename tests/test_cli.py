"""The command line: compile prints the decision; a bad spec exits non-zero with the error."""

from __future__ import annotations

import json

import pytest

from grammask.cli import main


def test_compile_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    schema = json.dumps({"type": "object", "properties": {"t": {"type": "array",
                                                               "uniqueItems": True}}})
    assert main(["compile", schema, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "guidance" and out["unenforced"] == ["uniqueItems"]
    assert out["compile_ms"] >= 0 and "uniqueItems" in out["reason"]


def test_compile_kinds_and_forced_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "[0-9]+", "--kind", "regex", "--backend", "guidance",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "guidance"
    assert main(["compile", '["a", "b"]', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "choice"


def test_compile_grammar_file(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "g.gbnf"
    path.write_text('root ::= "yes" | "no"')
    assert main(["compile", str(path)]) == 0
    assert "backend" in capsys.readouterr().out


def test_bad_spec_exits_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "[a-z", "--kind", "regex"]) == 2
    assert "InvalidRegexError" in capsys.readouterr().err
    assert main(["compile", '{"type": "strin"}', "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "InvalidSchemaError"
