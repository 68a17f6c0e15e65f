"""The compile cache's heap-trim policy: a trim is due after evictions or enough inserted
grammar bytes, not after every small compile (each trim hands back pages the next compiles
fault in again)."""

from __future__ import annotations

from dataclasses import replace

from grammask import Compiler, GrammarSpec
from grammask.compile.cache import (
    TRIM_AFTER_BYTES,
    TRIM_AFTER_COMPILE_MS,
    TRIM_INTERVAL_S,
    CompileCache,
)
from grammask.compile.stats import Stats


def test_a_trim_is_due_after_enough_bytes_or_an_eviction(compiler: Compiler) -> None:
    grammar = compiler.compile(GrammarSpec.regex("[a-z]{1,8}", backend="guidance"))
    size = grammar.memory_bytes
    assert 0 < size < TRIM_AFTER_BYTES // 4
    later = TRIM_INTERVAL_S + 1.0  # the interval since the last trim is not what is tested
    cache = CompileCache(Stats(), max_bytes=1 << 40, negative_ttl_s=1.0, max_negative=8)
    inserts = 0
    while (inserts + 1) * size < TRIM_AFTER_BYTES:  # small compiles: no trim yet
        assert cache.insert(f"k{inserts}", grammar)
        inserts += 1
        assert not cache.trim_due(later), inserts
    assert cache.insert("last", grammar) and cache.trim_due(later)
    assert cache.take_trim(later) and not cache.trim_due(2 * later)
    assert cache.insert("again", grammar) and not cache.trim_due(3 * later)  # count restarts

    small = CompileCache(Stats(), max_bytes=2 * size, negative_ttl_s=1.0, max_negative=8)
    for key in ("a", "b"):
        assert small.insert(key, grammar) and not small.trim_due(later)
    assert small.insert("c", grammar) and small.trim_due(later)  # "a" was evicted
    assert small.stats.evictions == 1 and small.peek("a") is None


def test_a_long_compile_makes_a_trim_due_at_once(compiler: Compiler) -> None:
    """A long compile leaves much freed scratch resident (measured: 17 MiB after a 650 ms
    llguidance compile): the trim is due at once, not a ``TRIM_INTERVAL_S`` later; a short
    compile or a disk load waits as before."""
    grammar = compiler.compile(GrammarSpec.regex("[a-z]{2,9}", backend="guidance"))
    short = replace(grammar, compile_ms=1.0)
    long = replace(grammar, compile_ms=TRIM_AFTER_COMPILE_MS)
    cache = CompileCache(Stats(), max_bytes=1 << 40, negative_ttl_s=1.0, max_negative=8)
    assert cache.take_trim(100.0, force=True)  # a trim just happened
    soon = 100.0 + TRIM_INTERVAL_S / 10
    assert cache.insert("short", short) and not cache.trim_due(soon)
    assert cache.insert("disk", replace(long, from_disk=True)) and not cache.trim_due(soon)
    assert cache.insert("long", long) and cache.trim_due(soon)
    assert cache.take_trim(soon) and not cache.trim_due(soon)
    assert cache.insert("short2", short) and not cache.trim_due(soon)  # urgency is spent
