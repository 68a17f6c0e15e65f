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


def _nested_one_of(depth: int, width: int) -> dict[str, object]:
    node: dict[str, object] = {"type": "string", "pattern": "[a-z]{2,8}@[a-z]+\\.com"}
    for d in range(depth):
        node = {"oneOf": [{"type": "object", "properties": {
            f"k{d}_{i}": node, "e": {"type": "string", "format": "email"}},
            "required": [f"k{d}_{i}"]} for i in range(width)]}
    return node


def test_compile_exits_promptly_after_a_timeout(tmp_path: object) -> None:
    """A timed-out native compile kept the interpreter alive at exit (error at 7 s, exit at
    22 s, once 150 s). This schema takes xgrammar far longer than the bound below (depth 5
    alone takes ~10 s unloaded); the process must end right after printing the error, not
    when the abandoned compile finishes."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = Path(str(tmp_path)) / "slow.json"
    path.write_text(json.dumps(_nested_one_of(6, 3)))
    proc = subprocess.Popen([sys.executable, "-m", "grammask.cli", "compile", str(path),
                             "--backend", "xgrammar", "--timeout", "1"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    while line and "error:" not in line:
        line = proc.stderr.readline()
    printed = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert "CompileTimeoutError" in line and code == 2
    assert time.monotonic() - printed < 8  # the old exit waited the compile out


def test_warmup_and_named_grammars(tmp_path: object,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    (root / "id.json").write_text('{"type": "integer"}')
    (root / "zip.regex").write_text("[0-9]{5}\n")
    assert main(["warmup", str(root)]) == 0
    out = capsys.readouterr().out
    assert "| id.json | json_schema |" in out and "2 compiled, 0 failed" in out
    (root / "bad.json").write_text("{oops")
    assert main(["warmup", str(root)]) == 1  # one bad file: reported, the others compiled
    assert "2 compiled, 1 failed" in capsys.readouterr().out
    assert main(["grammars"]) == 0
    assert "semver" in capsys.readouterr().out
    assert main(["compile", "semver", "--kind", "named", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "grammar"
    (root / "bad.json").unlink()
    cache = root / "disk"
    assert main(["warmup", str(root), "--disk-cache", str(cache)]) == 0
    assert len(list(cache.glob("*.xgc"))) == 1  # the xgrammar-routed schema, on disk
