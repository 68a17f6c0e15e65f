"""The grammar library (``grammask.specs.library``): every shipped grammar against its samples.

Three readings of every sample, none of which is grammask's own code:
1. an independent oracle: ``lark`` (Earley) on the Lark grammar, or on this package's own
   GBNF-to-Lark translation for GBNF (``harness.gbnf``, shares no code with either backend);
2. xgrammar and 3. llguidance, each forced, walking the real Qwen2.5 tokenization of the
   sample with a matcher: a valid sample is accepted token by token and then a stop token is
   accepted; an invalid one is refused somewhere (a token, or the stop token at its end).

Both backends take both syntaxes (xgrammar parses Lark with ``compile_lark``, llguidance
translates GBNF with its ``gbnf_to_lark``), so every grammar is served by both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from fnmatch import fnmatch
from functools import cache
from pathlib import Path

import pytest

from grammask import Compiler, GrammarSpec, InvalidSpecError, Vocabulary
from grammask.backends import Matcher
from grammask.harness.oracles import LarkOracle
from grammask.specs import library
from grammask.specs.frontends import from_vllm
from grammask.specs.grammar_spec import BackendName

from ..conftest import ROOT

NAMES = library.names()
BACKENDS: list[BackendName] = ["xgrammar", "guidance"]
#: what the brief asks the library to hold, at least
REQUIRED = ("json", "sql-select", "arithmetic", "csv", "date-time", "uuid", "email", "semver",
            "tool-call", "tool-calls")


@cache
def oracle(name: str) -> LarkOracle:
    grammar = library.load(name)
    return LarkOracle(grammar.text, grammar.syntax)


def walk(matcher: Matcher, vocab: Vocabulary, text: str) -> str:
    """Feed ``text``'s tokens then a stop token: "ok", or where the matcher refused."""
    tokens = vocab.encode(text)
    for i, token in enumerate(tokens):
        if not matcher.accept(token):
            piece = vocab.decode([token]).decode("utf-8", "replace")
            done = vocab.decode(tokens[:i]).decode("utf-8", "replace")
            return f"token {i} {piece!r} refused after {done!r}"
    if not matcher.accept(vocab.stop_ids[0]):
        return "stop token refused at the end"
    return "ok"


# ----------------------------------------------------------------------------- library API
def test_names_sorted_lower_case_and_complete() -> None:
    assert sorted(NAMES) == NAMES
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in NAMES), NAMES
    assert set(REQUIRED) <= set(NAMES)


def test_unknown_name_is_refused_listing_known_names() -> None:
    with pytest.raises(InvalidSpecError) as info:
        library.load("yaml")
    message = str(info.value)
    assert "'yaml'" in message
    assert all(n in message for n in NAMES)
    with pytest.raises(InvalidSpecError, match="no library grammar named 'sql'"):
        GrammarSpec.named("sql")


def test_every_file_in_the_folder_is_a_loadable_grammar_with_samples() -> None:
    folder = library.folder()
    files = sorted(e.name for e in folder.iterdir() if e.is_file())
    stems = {f.rsplit(".", 1)[0] for f in files if f.endswith((".gbnf", ".lark"))}
    assert sorted(stems) == NAMES
    assert sorted(f for f in files if f.endswith(".samples.json")) == \
        sorted(f"{n}.samples.json" for n in NAMES)  # no orphan sample files
    assert len(files) == 2 * len(NAMES)
    for name in NAMES:
        grammar = library.load(name)
        assert grammar.name == name
        assert grammar.syntax == ("ebnf" if f"{name}.gbnf" in files else "lark")
        assert grammar.description and not grammar.description.startswith(name)
        assert "Accepts:" in grammar.text and "Deliberately not:" in grammar.text
        assert len(grammar.valid) >= 5 and len(grammar.invalid) >= 5
        assert not set(grammar.valid) & set(grammar.invalid)
        raw = json.loads(folder.joinpath(f"{name}.samples.json").read_text(encoding="utf-8"))
        assert set(raw) == {"valid", "invalid"}
        assert list(grammar.valid) == raw["valid"] and list(grammar.invalid) == raw["invalid"]


def test_spec_is_a_grammar_spec_in_the_files_syntax() -> None:
    for name in NAMES:
        grammar = library.load(name)
        spec = GrammarSpec.named(name)
        assert spec == GrammarSpec.grammar(grammar.text, syntax=grammar.syntax)
        assert (spec.kind, spec.syntax, spec.source, spec.backend) == \
            ("grammar", grammar.syntax, grammar.text, None)


def test_loaded_grammar_is_frozen() -> None:
    grammar = library.load("uuid")
    with pytest.raises(AttributeError):
        grammar.text = "start: /x/"  # type: ignore[misc]


def test_checkout_reads_the_top_level_folder() -> None:
    """The layout: the library sits at the repository's top level, not inside ``src/``, and a
    checkout (editable install or ``PYTHONPATH=src``) reads it there."""
    top = ROOT / "grammars"
    assert Path(str(library.folder())).resolve() == top.resolve()
    assert not (ROOT / "src" / "grammask" / "specs" / "grammars").exists()
    assert not (ROOT / "src" / "grammask" / "grammars").exists()  # it would shadow the folder
    files = sorted(p.name for p in top.iterdir())
    assert len(NAMES) == 10
    assert files == sorted([f"{n}.samples.json" for n in NAMES]
                           + [f"{n}.{'gbnf' if library.load(n).syntax == 'ebnf' else 'lark'}"
                              for n in NAMES])


def test_pyproject_lists_every_package_and_maps_the_grammars() -> None:
    """Packages are listed by hand (a find in ``src/`` cannot see ``grammars/``): the list
    must be what ``src/`` holds, plus the grammar folder mapped to ``grammask/grammars``."""
    setuptools = pytest.importorskip("setuptools")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    tool = config["tool"]["setuptools"]
    found = setuptools.find_packages(str(ROOT / "src"))
    assert sorted(tool["packages"]) == sorted([*found, "grammask.grammars"])
    assert tool["package-dir"] == {"": "src", "grammask.grammars": "grammars"}
    globs = tool["package-data"]["grammask.grammars"]
    for entry in (ROOT / "grammars").iterdir():
        assert any(fnmatch(entry.name, g) for g in globs), entry.name


def _build(kind: str, tree: Path, out: Path) -> Path:
    """A wheel or sdist of ``tree`` built in a subprocess by the project's own backend."""
    code = (f"from setuptools import build_meta; import sys; "
            f"print(build_meta.build_{kind}(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=tree, check=True,
                          capture_output=True, text=True, timeout=120)
    return out / done.stdout.strip().splitlines()[-1]


def test_wheel_and_sdist_carry_the_grammars(tmp_path: Path) -> None:
    """Built from a copy of the tree (about a second each): the wheel has every grammar file
    at ``grammask/grammars/`` and every module of ``src/``, and, unpacked alone on the path
    as an installed package, ``grammask.library`` lists and loads all of them; the sdist has
    ``grammars/``."""
    pytest.importorskip("setuptools")
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=skip)
    shutil.copytree(ROOT / "grammars", tree / "grammars")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    grammar_files = sorted(p.name for p in (ROOT / "grammars").iterdir())
    assert len(grammar_files) == 2 * len(NAMES)

    wheel = _build("wheel", tree, tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as archive:
        listed = set(archive.namelist())
    assert sorted(n.rsplit("/", 1)[1] for n in listed
                  if n.startswith("grammask/grammars/")) == grammar_files
    modules = {p.relative_to(ROOT / "src").as_posix()
               for p in (ROOT / "src" / "grammask").rglob("*.py")}
    assert modules <= listed, sorted(modules - listed)
    # installed: the wheel's files alone on the path (no checkout, no editable install)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    probe = ("import grammask, sys; assert grammask.__file__.startswith(sys.argv[1]), "
             "grammask.__file__; print(','.join(grammask.library.names())); "
             "[grammask.library.load(n) for n in grammask.library.names()]")
    done = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, check=True,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert done.stdout.strip().split(",") == sorted(NAMES)

    sdist = _build("sdist", tree, tmp_path / "sdist")
    with tarfile.open(sdist) as archive:
        carried = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {f"grammars/{f}" for f in grammar_files} <= carried


# ----------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("name", NAMES)
def test_oracle_agrees_with_the_samples(name: str) -> None:
    grammar, parser = library.load(name), oracle(name)
    refused = [s for s in grammar.valid if not parser.parses(s.encode()).valid]
    accepted = [s for s in grammar.invalid if parser.parses(s.encode()).valid]
    assert refused == [], f"valid samples the lark oracle refuses: {refused}"
    assert accepted == [], f"invalid samples the lark oracle accepts: {accepted}"


# ----------------------------------------------------------------------------- the backends
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_backends_walk_the_samples(compiler: Compiler, qwen25: Vocabulary, name: str,
                                  backend: BackendName) -> None:
    grammar = library.load(name)
    compiled = compiler.compile(GrammarSpec.named(name).with_backend(backend))
    assert compiled.backend == backend
    refused = {s: r for s in grammar.valid
               if (r := walk(compiled.matcher(), qwen25, s)) != "ok"}
    accepted = [s for s in grammar.invalid if walk(compiled.matcher(), qwen25, s) == "ok"]
    assert refused == {}, f"{backend} refuses valid {name} samples: {refused}"
    assert accepted == [], f"{backend} accepts invalid {name} samples: {accepted}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["tool-call", "tool-calls"])
def test_tool_call_tags_are_text_not_special_tokens(compiler: Compiler, qwen25: Vocabulary,
                                                    name: str, backend: BackendName) -> None:
    """Qwen2.5 has one special token for ``<tool_call>``; grammask's vocabularies leave
    special tokens out of every grammar, so the tag must be spelled in text tokens: a model
    that would emit the single token is steered to the text spelling instead."""
    tag_id = next(i for i, tok in enumerate(qwen25.tokens)
                  if tok == b"<tool_call>" and i in qwen25.special_ids)
    assert tag_id not in qwen25.encode("<tool_call>")  # plain text never yields it
    compiled = compiler.compile(GrammarSpec.named(name).with_backend(backend))
    assert not compiled.matcher().accept(tag_id)
    assert compiled.matcher().accept(qwen25.encode("<tool_call>")[0])


def test_named_grammars_travel_by_their_own_field() -> None:
    """Python, vLLM's structured-outputs object and ``vllm_xargs`` name a library grammar in
    ``grammar_name``; the name never sits inside grammar text, so it cannot clash."""
    from grammask.specs.request import parse_extra_args

    assert GrammarSpec.named("uuid") == GrammarSpec.named("uuid")
    assert from_vllm({"grammar_name": "uuid"}) == GrammarSpec.named("uuid")
    assert GrammarSpec.named("uuid", backend="guidance").backend == "guidance"
    request = parse_extra_args({"grammask": json.dumps({"grammar_name": "semver"})})
    assert request is not None and request.spec == GrammarSpec.named("semver")
    with pytest.raises(InvalidSpecError, match="no library grammar named 'semverr'"):
        from_vllm({"grammar_name": "semverr"})
    with pytest.raises(InvalidSpecError, match="exactly one"):
        from_vllm({"grammar_name": "uuid", "regex": "a"})
