"""``decode/rows``: a row's pending grammar (``PendingGrammar``): the routed compile, the hedge
started only when it is due (late, or the routed compile failed) and at most once, each
rank's view of it, and whose fault a row without a grammar is. Compiles are the real
compiler's; a routed compile that never ends is a plain ``Future`` nobody resolves."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from grammask import Compiler, GrammarSpec
from grammask.compile.grammar import Grammar
from grammask.decode.rows import COMPILING, FAILED, READY, PendingGrammar, RowView, hedge_spec
from grammask.errors import CompileTimeoutError

SCHEMA = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]})


def _pending(compiler: Compiler, primary: Future[Grammar], asked: list[int], *,
             hedge_s: float) -> PendingGrammar:
    def resolve() -> object:
        asked.append(1)
        other = hedge_spec(compiler, SCHEMA)
        assert other is not None
        return lambda: compiler.compile_async(other)
    return PendingGrammar(primary, resolve, hedge_s=hedge_s)  # type: ignore[arg-type]


def test_the_hedge_starts_when_due_and_once(compiler: Compiler) -> None:
    routed = compiler.route(SCHEMA).backend
    never: Future[Grammar] = Future()  # the routed compile, late
    asked: list[int] = []
    pending = _pending(compiler, never, asked, hedge_s=30.0)
    pending.tick(time.monotonic())
    assert not pending.hedged and asked == []  # not due: the hedge is not even routed
    assert pending.view(expired=False) == RowView(0, 0, COMPILING, COMPILING)
    pending.tick(pending.hedge_at)
    assert pending.hedged and asked == [1]
    grammar = pending.attempt(1).result(timeout=60)
    assert grammar.backend != routed  # the other backend serves the hedge
    pending.tick(pending.hedge_at + 1)
    pending.start_hedge()
    assert asked == [1] and pending.attempt(1).result() is grammar  # one hedge, asked once
    assert pending.view(expired=True) == RowView(1, 1, COMPILING, READY)
    assert pending.futures() == [never]


def test_a_failed_routed_compile_hedges_at_once(compiler: Compiler) -> None:
    failed: Future[Grammar] = Future()
    failed.set_exception(CompileTimeoutError("not compiled within 0.01 s"))
    asked: list[int] = []
    pending = _pending(compiler, failed, asked, hedge_s=3600.0)
    pending.tick(time.monotonic())
    assert pending.hedged and asked == [1]
    pending.attempt(1).result(timeout=60)
    assert pending.view(expired=False) == RowView(0, 1, FAILED, READY)


def test_without_a_hedge_nothing_starts(compiler: Compiler) -> None:
    never: Future[Grammar] = Future()
    pending = PendingGrammar(never, None, hedge_s=0.0)
    assert not pending.can_hedge
    pending.tick(time.monotonic() + 10)
    pending.start_hedge()
    assert not pending.hedged and pending.futures() == [never]


def test_whose_fault_a_row_without_a_grammar_is(compiler: Compiler) -> None:
    refused = compiler.compile_async(GrammarSpec.regex("(unclosed"))
    with pytest.raises(Exception):  # noqa: B017 - the compile's own refusal
        refused.result(timeout=60)
    message, cause = PendingGrammar(refused, None, hedge_s=0.0).failure()
    assert cause == "compile" and message
    late: Future[Grammar] = Future()
    late.set_exception(CompileTimeoutError("not compiled within 1.00 s"))
    message, cause = PendingGrammar(late, None, hedge_s=0.0).failure()
    assert cause == "server" and "CompileTimeoutError" in message
    never: Future[Grammar] = Future()  # nothing failed here: another rank's verdict
    assert PendingGrammar(never, None, hedge_s=0.0).failure() == (
        "failed on another tensor-parallel rank", "server")
