"""``compile/grammar``: a compiled spec hands out independent matchers at its start, sizes its
memory by the backend's calibrated footprint, and stored errors are raised as fresh copies
(no traceback, cause or context carried from one raise to the next)."""

from __future__ import annotations

import pytest

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.backends import registry
from grammask.compile.grammar import fresh_error
from grammask.errors import GrammarError, ServerFault


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_matcher_starts_at_the_grammars_start(compiler: Compiler, qwen25: Vocabulary,
                                                   backend: str) -> None:
    grammar = compiler.compile(GrammarSpec.choice(["yes", "no"], backend=backend))
    first, second = grammar.matcher(), grammar.matcher()
    assert first.accept(qwen25.encode("yes")[0])
    assert second.accept(qwen25.encode("no")[0])  # the other matcher is still at the start
    assert grammar.matcher().accept(qwen25.encode("no")[0])
    scale, base = registry.footprint(grammar.backend)
    assert grammar.memory_bytes == int(scale * int(grammar.backend_grammar.memory_bytes)
                                       + base) > 0


def test_a_fresh_error_carries_nothing_of_the_raise_before() -> None:
    def raised(error: BaseException) -> BaseException:
        try:
            try:
                raise KeyError("inner")
            except KeyError as inner:
                raise error from inner
        except BaseException as caught:
            return caught

    stored = raised(GrammarError("bad regex"))
    assert stored.__traceback__ is not None and stored.__cause__ is not None
    twin = fresh_error(stored)
    assert twin is not stored and type(twin) is GrammarError and str(twin) == "bad regex"
    assert twin.__traceback__ is None and twin.__cause__ is None and twin.__context__ is None
    again = raised(twin)
    assert fresh_error(again).__traceback__ is None


def test_an_error_that_does_not_copy_becomes_a_plain_one_of_its_kind() -> None:
    class Stubborn(ServerFault):
        def __copy__(self) -> Stubborn:
            raise TypeError("no copies")

    twin = fresh_error(Stubborn("the backend broke"))
    assert type(twin) is ServerFault and str(twin) == "the backend broke"
    plain = fresh_error(type("Odd", (GrammarError,), {"__copy__": Stubborn.__copy__})("x"))
    assert type(plain) is GrammarError
