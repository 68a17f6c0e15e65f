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
import re
import tomllib
from fnmatch import fnmatch
from functools import cache
from importlib import resources

import pytest

from grammask import Compiler, GrammarSpec, InvalidSpecError, Vocabulary
from grammask.backends import Matcher
from grammask.harness.oracles import LarkOracle
from grammask.specs import library
from grammask.specs.frontends import from_vllm
from grammask.specs.grammar_spec import BackendName

from .conftest import ROOT

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
    folder = resources.files("grammask.specs").joinpath("grammars")
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


def test_package_data_ships_every_grammar_file() -> None:
    """The wheel carries the folder: each file matches a package-data glob."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = config["tool"]["setuptools"]["package-data"]["grammask"]
    folder = resources.files("grammask.specs").joinpath("grammars")
    for entry in folder.iterdir():
        assert any(fnmatch(f"specs/grammars/{entry.name}", g) for g in globs), entry.name


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
