"""One vocabulary: ``Compiler`` is the compile service, a *backend* is xgrammar or llguidance,
a ``Grammar`` is what ``Compiler.compile`` returns and its ``backend_grammar`` the backend's own
compiled form. The old names stay as aliases of the very same objects (``Engine`` with a
DeprecationWarning), and grammask's own code uses none of them (a source scan)."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import llguidance as llg
import pytest
import xgrammar as xgr

import grammask
from grammask import Compiler, GrammarSpec
from grammask.backends import BackendGrammar
from grammask.backends.base import BackendMatcher
from grammask.errors import CompilerClosedError

SRC = Path(grammask.__file__).resolve().parent

#: The modules that define the old names as aliases (and may therefore spell them).
SHIMS = {
    "__init__.py",  # grammask.Engine (warns), EngineClosedError
    "compiler.py",  # grammask.compiler.Engine (warns), Grammar.compiled (warns)
    "errors.py",  # EngineClosedError
    "backends/__init__.py",  # CompiledGrammar
    "backends/base.py",  # CompiledGrammar, EngineMatcherBase, engine_matcher (warns)
    "integrations/vllm_engine.py",  # the module's old name
}

#: Old names no module outside ``SHIMS`` may mention. ``xgr.CompiledGrammar`` is xgrammar's own
#: class, not grammask's protocol.
OLD = {
    "Engine": re.compile(r"\bEngine\b"),
    "Engine(": re.compile(r"\bEngine\("),
    "EngineMatcherBase": re.compile(r"\bEngineMatcherBase\b"),
    "CompiledGrammar": re.compile(r"(?<!xgr\.)(?<!xgrammar\.)\bCompiledGrammar\b"),
    "engine_matcher": re.compile(r"\bengine_matcher\b"),
}


def test_engine_is_the_compiler_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"grammask\.Engine is now grammask\.Compiler"):
        old = grammask.Engine
    assert old is Compiler
    with pytest.warns(DeprecationWarning, match="grammask.Compiler"):
        from grammask import Engine
    assert Engine is Compiler
    with pytest.warns(DeprecationWarning, match="grammask.Compiler"):
        from grammask.compiler import Engine as from_module
    assert from_module is Compiler
    assert "Compiler" in grammask.__all__ and "Engine" not in grammask.__all__


def test_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grammask.Compiler is Compiler
        assert grammask.CompilerClosedError is CompilerClosedError
    with pytest.raises(AttributeError):
        grammask.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


def test_old_names_are_the_new_objects() -> None:
    import grammask.backends as backends
    import grammask.backends.base as base
    import grammask.errors as errors
    from grammask.integrations import vllm_common, vllm_compiler

    assert grammask.EngineClosedError is CompilerClosedError
    assert errors.EngineClosedError is CompilerClosedError
    assert backends.CompiledGrammar is BackendGrammar is base.CompiledGrammar
    assert base.EngineMatcherBase is BackendMatcher
    assert vllm_compiler.shared_engine is vllm_compiler.shared_compiler
    assert vllm_compiler._ENGINES is vllm_compiler._COMPILERS
    assert vllm_common.shared_engine is vllm_compiler.shared_compiler
    assert vllm_common._ENGINES is vllm_compiler._COMPILERS


def test_the_old_vllm_module_name_still_imports() -> None:
    from grammask.integrations import vllm_compiler

    sys.modules.pop("grammask.integrations.vllm_engine", None)
    with pytest.warns(DeprecationWarning, match="vllm_compiler"):
        old = importlib.import_module("grammask.integrations.vllm_engine")
    assert old.shared_engine is old.shared_compiler is vllm_compiler.shared_compiler
    assert old.disk_cache_dir is vllm_compiler.disk_cache_dir


def test_deprecated_attributes_read_the_new_ones(compiler: Compiler) -> None:
    grammar = compiler.compile(GrammarSpec.regex("ab", backend="xgrammar"))
    with pytest.warns(DeprecationWarning, match="backend_grammar"):
        assert grammar.compiled is grammar.backend_grammar
    for backend in ("xgrammar", "guidance"):
        matcher = compiler.compile(GrammarSpec.regex("ab", backend=backend)).matcher()
        assert isinstance(matcher, BackendMatcher)
        with pytest.warns(DeprecationWarning, match="native"):
            assert matcher.engine_matcher is matcher.native
        assert isinstance(matcher.native, xgr.GrammarMatcher if backend == "xgrammar"
                          else llg.LLMatcher)


def test_compiler_closed_error_names_the_compiler(qwen25: object) -> None:
    from grammask import Vocabulary

    assert isinstance(qwen25, Vocabulary)
    closed = Compiler(qwen25, backend="guidance")
    closed.close()
    with pytest.raises(CompilerClosedError, match="compiler"):
        closed.compile(GrammarSpec.regex("ab"))
    with pytest.raises(grammask.EngineClosedError):  # the old name catches it too
        closed.compile(GrammarSpec.regex("ab"))


def test_no_module_uses_an_old_name() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in SHIMS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{rel}:{number}: {name}" for name, pattern in OLD.items()
                      if pattern.search(line)]
    assert found == []


def test_the_shims_spell_old_names_only_as_aliases() -> None:
    """Inside the shims the old names appear as the alias itself, never as code built on
    them (nothing is constructed through ``Engine(``)."""
    for rel in SHIMS:
        text = (SRC / rel).read_text()
        assert not OLD["Engine("].search(text), rel
