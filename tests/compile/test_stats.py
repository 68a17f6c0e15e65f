"""``compile/stats``: the compile service's counters, one per registered backend, and what
moves them: a cold compile, a hit, a joined flight, a refused spec and its remembered
refusal."""

from __future__ import annotations

from concurrent.futures import wait

import pytest

from grammask import Compiler, GrammarError, GrammarSpec, Vocabulary
from grammask.backends import registry
from grammask.compile.stats import Stats


def test_counters_start_at_zero_for_every_registered_backend() -> None:
    stats = Stats()
    assert stats.compiles == dict.fromkeys(registry.names(), 0)
    assert stats.compile_ms == dict.fromkeys(registry.names(), 0.0)
    assert stats.compiles is not Stats().compiles  # never shared between compilers


def test_what_moves_the_counters(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, tune_fill=False)
    try:
        spec = GrammarSpec.regex("st[a-z]{2}ts", backend="guidance")
        grammar = compiler.compile(spec)
        assert compiler.compile(spec) is grammar
        stats = compiler.stats
        assert (stats.misses, stats.hits, stats.compiles["guidance"]) == (1, 1, 1)
        assert stats.compiles["xgrammar"] == 0 and stats.compile_ms["guidance"] > 0
        bad = GrammarSpec.regex("(unclosed", backend="guidance")
        for _ in range(2):
            with pytest.raises(GrammarError):
                compiler.compile(bad)
        assert (stats.errors, stats.negative_hits) == (1, 1)
        other = GrammarSpec.regex("jo[a-z]{3}ned", backend="xgrammar")
        futures = [compiler.compile_async(other) for _ in range(4)]
        wait(futures, timeout=60)
        assert len({id(f.result()) for f in futures}) == 1
        assert stats.compiles["xgrammar"] == 1
        assert stats.joined + stats.hits == 1 + 3  # one hit above; the rest joined or hit
    finally:
        compiler.close()
