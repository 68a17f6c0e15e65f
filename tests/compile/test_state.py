"""``compile/state``: the one state the compile service's parts share. A compiler's parts
(``Flights``, ``PlanRunner``, the fill tuner) read and write the same counters and memory, and
once ``closed`` flips no lookup registers a flight and no late result is cached."""

from __future__ import annotations

import pytest

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.compile.state import ServiceState
from grammask.errors import CompilerClosedError


def test_the_compilers_parts_share_its_one_state(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, tune_fill=False)
    try:
        state = compiler._state
        assert isinstance(state, ServiceState)
        assert state.stats is compiler.stats and state.memory.stats is compiler.stats
        assert compiler._plans.stats is state.stats and compiler._plans._lock is state.lock
        spec = GrammarSpec.regex("sh[a-z]red", backend="guidance")
        grammar = compiler.compile(spec)
        assert state.memory.get(spec.key) is grammar  # the runner's build, the service's cache
        assert not state.closed
    finally:
        compiler.close()
    assert state.closed
    with pytest.raises(CompilerClosedError):
        compiler.compile(GrammarSpec.regex("after[a-z]", backend="guidance"))
