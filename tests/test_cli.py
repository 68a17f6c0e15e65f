"""The command line: compile prints the decision; a bad spec exits non-zero with the error."""

from __future__ import annotations

import json

import pytest
from bench.stress import nested_one_of

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
    assert main(["compile", "[0-9]+", "--kind", "regex", "--backend", "llguidance",
                 "--json"]) == 0  # the alias, as everywhere else
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


#: ``python -m grammask.cli`` whose xgrammar compiles never end (a runaway on demand, on any
#: machine): the compile blocks forever, so only the program's own exit can end it
_RUNAWAY_CLI = """
import sys, threading
from grammask.backends import get_backend

def never(spec, vocab, *, lenient=False):
    threading.Event().wait()

get_backend("xgrammar").compile = never
from grammask.cli import main

sys.argv = ["grammask", *sys.argv[1:]]
raise SystemExit(main())
"""


def test_compile_exits_promptly_after_a_timeout(tmp_path: object) -> None:
    """A timed-out native compile kept the interpreter alive at exit (error at 7 s, exit at
    22 s, once 150 s). Here the compile never finishes (the real slow schema's compile,
    minutes on xgrammar, is replaced by one that blocks forever), so a program that waited it
    out would never exit (at best after the 120 s bound of the exit hook): the process must
    end once it printed the timeout."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(str(tmp_path)) / "slow.json"
    path.write_text(json.dumps(nested_one_of(6, 3, "k")))
    proc = subprocess.Popen([sys.executable, "-c", _RUNAWAY_CLI, "compile", str(path),
                             "--backend", "xgrammar", "--timeout", "1"],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        while line and "error:" not in line:
            line = proc.stderr.readline()
        code = proc.wait(timeout=60)  # liveness bound only: the old exit never came
    finally:
        proc.kill()
    assert "CompileTimeoutError" in line and code == 2


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


# ------------------------------------------------------- without the check extra, and bench
# A fresh interpreter running ``grammask ARGS`` for each ARGS given (exit code, stdout, stderr
# of each, as JSON on the last line) where importing some modules fails. EARLY ones fail from
# the start, as on a plain install without lark (a meta path finder refuses them). LATE ones
# fail once grammask.cli is loaded: regex cannot be missing from the start, transformers
# (xgrammar's dependency) imports it; ``sys.modules[name] = None`` then makes every further
# ``import regex`` fail.
_WITHOUT = """
import contextlib, io, json, sys
from importlib.abc import MetaPathFinder

EARLY = {m for m in sys.argv[1].split(",") if m}
LATE = [m for m in sys.argv[2].split(",") if m]


class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in EARLY:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Block())
from grammask.cli import main

for name in LATE:
    sys.modules[name] = None
results = []
for args in json.loads(sys.argv[3]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code or 0
    results.append([code, out.getvalue(), err.getvalue()])
print()
print(json.dumps(results))
"""


def _grammask_without(early: str, late: str, *commands: list[str], cwd: object = None,
                      flags: tuple[str, ...] = ()) -> list[tuple[int, str, str]]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, *flags, "-c", _WITHOUT, early, late,
                           json.dumps(commands)], capture_output=True, text=True, timeout=300,
                          cwd=None if cwd is None else str(cwd))
    assert proc.returncode == 0, proc.stderr
    return [(code, out, err) for code, out, err in json.loads(proc.stdout.splitlines()[-1])]


def test_without_the_check_extra_check_says_what_to_install_and_the_rest_works(
        tmp_path: object) -> None:
    """lark blocked from the start (so ``import grammask``, through grammask.cli, never
    imports it) and regex gone once loaded: check exits 2 with what to install (its --help
    still works); compile, grammars and --help work as ever."""
    from pathlib import Path

    spec = Path(str(tmp_path)) / "digits.regex"
    spec.write_text("[0-9]+")
    message = "grammask check needs the check extra: pip install 'grammask[check]' (missing: {})"
    check, check_help, comp, grammars, top_help = _grammask_without(
        "lark", "regex", ["check", str(spec), "--backend", "guidance"], ["check", "--help"],
        ["compile", "[0-9]+", "--kind", "regex", "--backend", "guidance", "--json"],
        ["grammars"], ["--help"])
    assert (check[0], check[2].strip()) == (2, message.format("regex, lark")), check
    assert check_help[0] == 0 and "--corpus" in check_help[1], check_help
    assert comp[0] == 0 and json.loads(comp[1])["backend"] == "guidance", comp
    assert grammars[0] == 0 and "semver" in grammars[1], grammars
    assert top_help[0] == 0 and "check" in top_help[1] and "bench" in top_help[1], top_help
    [(code, _, err)] = _grammask_without("", "regex", ["check", "--corpus", str(tmp_path)])
    assert (code, err.strip()) == (2, message.format("regex"))


def test_the_oracles_say_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Used as a library (no CLI in front), an oracle that needs a missing module raises an
    ImportError that says what to install."""
    import sys

    from grammask.harness.extras import MissingExtraError
    from grammask.harness.oracles import LarkOracle, RegexOracle

    monkeypatch.setitem(sys.modules, "regex", None)
    with pytest.raises(MissingExtraError, match=r"grammask\[check\].*\(missing: regex\)"):
        RegexOracle("[0-9]+")
    monkeypatch.setitem(sys.modules, "lark", None)
    with pytest.raises(ImportError, match=r"\(missing: lark\)"):
        LarkOracle('start: "a"', "lark")


def test_bench_outside_a_checkout_says_where_it_runs(tmp_path: object) -> None:
    outside, usage = _grammask_without("", "", ["bench", "compile", "--sample", "1"],
                                       ["bench", "nonsense"], cwd=tmp_path)
    assert outside[0] == 2 and outside[2].strip() == (
        "grammask bench runs from a source checkout: cd into it and run "
        "python -m bench.compile ...")
    assert usage[0] == 2 and "usage: grammask bench compile|step|stress" in usage[2]


def test_bench_in_a_checkout_runs_the_repository_module() -> None:
    """From the checkout's root, with the working directory *not* on sys.path (as under the
    ``grammask`` console script; ``-P``), ``grammask bench`` runs ``python -m bench.NAME``
    (a child process: its output is not the parent's redirected stdout)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-P", "-c",
                           "import sys; from grammask.cli import main; "
                           "raise SystemExit(main(sys.argv[1:]))", "bench", "compile", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bench.compile")
