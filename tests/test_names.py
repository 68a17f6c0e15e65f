"""One vocabulary: ``Compiler`` is the compile service, a *backend* is xgrammar or llguidance,
a ``Grammar`` is what ``Compiler.compile`` returns and its ``backend_grammar`` the backend's own
compiled form. The old names (deprecation aliases until 0.1.0, CHANGELOG.md) are gone, and
grammask's own code spells none of them (a source scan)."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

import llguidance as llg
import pytest
import xgrammar as xgr

import grammask
from grammask import BatchProcessor, Compiler, Grammar, GrammarSpec
from grammask.backends.base import BackendMatcher
from grammask.errors import CompilerClosedError

SRC = Path(grammask.__file__).resolve().parent

#: Old names no module may mention. ``xgr.CompiledGrammar`` is xgrammar's own class, not
#: grammask's protocol; ``vllm_v1_batch`` is a current module.
OLD = {
    "Engine": re.compile(r"\bEngine\b"),
    "EngineClosedError": re.compile(r"\bEngineClosedError\b"),
    "EngineMatcherBase": re.compile(r"\bEngineMatcherBase\b"),
    "CompiledGrammar": re.compile(r"(?<!xgr\.)(?<!xgrammar\.)\bCompiledGrammar\b"),
    "engine_matcher": re.compile(r"\bengine_matcher\b"),
    "shared_engine": re.compile(r"\bshared_engine\b"),
    "_ENGINES": re.compile(r"\b_ENGINES\b"),
    "vllm_engine": re.compile(r"\bvllm_engine\b"),
    "vllm_v1": re.compile(r"\bvllm_v1\b"),
}


def test_the_old_names_are_gone() -> None:
    import grammask.backends as backends
    import grammask.backends.base as base
    import grammask.compile.compiler as compiler_module
    import grammask.errors as errors
    from grammask.integrations.vllm import plugin_core, process
    from grammask.integrations.vllm import settings as vllm_settings

    gone = [(grammask, "Engine"), (grammask, "EngineClosedError"), (compiler_module, "Engine"),
            (errors, "EngineClosedError"), (backends, "CompiledGrammar"),
            (base, "CompiledGrammar"), (base, "EngineMatcherBase"),
            (process, "shared_engine"), (process, "_ENGINES"),
            (plugin_core, "shared_engine"), (plugin_core, "_ENGINES"),
            (Grammar, "compiled"), (BackendMatcher, "engine_matcher"),
            (BatchProcessor, "engine")]
    assert [f"{getattr(o, '__name__', o)}.{n}" for o, n in gone if hasattr(o, n)] == []
    with pytest.raises(ImportError):
        from grammask import Engine  # type: ignore[attr-defined]  # noqa: F401
    for module in (grammask, backends, errors, plugin_core, process):
        assert not {"Engine", "EngineClosedError", "CompiledGrammar", "shared_engine",
                    "_ENGINES"} & set(getattr(module, "__all__", ())), module.__name__
    for old in ("grammask.integrations.vllm_engine", "grammask.integrations.vllm_v1"):
        sys.modules.pop(old, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    assert "tensor_parallel_size" not in inspect.signature(vllm_settings.load_settings).parameters


def test_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grammask.Compiler is Compiler
        assert grammask.CompilerClosedError is CompilerClosedError
    with pytest.raises(AttributeError):
        grammask.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_backend_grammar_and_native_are_the_backends_own(compiler: Compiler) -> None:
    grammar = compiler.compile(GrammarSpec.regex("ab", backend="xgrammar"))
    assert type(grammar.matcher()) is type(grammar.backend_grammar.matcher())
    for backend in ("xgrammar", "guidance"):
        matcher = compiler.compile(GrammarSpec.regex("ab", backend=backend)).matcher()
        assert isinstance(matcher, BackendMatcher)
        assert isinstance(matcher.native, xgr.GrammarMatcher if backend == "xgrammar"
                          else llg.LLMatcher)


def test_compiler_closed_error_names_the_compiler(qwen25: object) -> None:
    from grammask import Vocabulary

    assert isinstance(qwen25, Vocabulary)
    closed = Compiler(qwen25, backend="guidance")
    closed.close()
    with pytest.raises(CompilerClosedError, match="compiler"):
        closed.compile(GrammarSpec.regex("ab"))


def test_no_module_uses_an_old_name() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{rel}:{number}: {name}" for name, pattern in OLD.items()
                      if pattern.search(line)]
    assert found == []
