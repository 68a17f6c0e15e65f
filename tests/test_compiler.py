"""The compile service: single-flight under concurrency, LRU by bytes, negative cache,
timeouts and fallback, and bad input that harms nothing else."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from grammask import (
    CompileTimeoutError,
    Engine,
    GrammarError,
    GrammarSpec,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidSchemaError,
    Vocabulary,
)
from grammask.backends import get_backend

from .helpers import accepts_complete


def _spec(i: int) -> GrammarSpec:
    kind = i % 4
    if kind == 0:
        return GrammarSpec.json_schema({"type": "object", "properties": {
            f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
    if kind == 1:
        return GrammarSpec.regex(f"id-{i}-[0-9]+")
    if kind == 2:
        return GrammarSpec.choice([f"c{i}", "other"])
    return GrammarSpec.grammar(f'start: "g{i}" NUM\nNUM: /[0-9]+/')


def _sample(i: int) -> str:
    return [json.dumps({f"k{i}": 7}), f"id-{i}-42", f"c{i}", f"g{i}5"][i % 4]


def test_32_threads_200_specs_compile_each_key_once(qwen25: Vocabulary,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}
    lock = threading.Lock()
    for name in ("xgrammar", "guidance"):
        backend = get_backend(name)  # type: ignore[arg-type]
        original = backend.compile

        def counting(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False,
                     _orig: Any = original) -> Any:
            with lock:
                calls[spec.key] = calls.get(spec.key, 0) + 1
            time.sleep(0.005)  # widen the window in which duplicates arrive
            return _orig(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", counting)
    engine = Engine(qwen25, max_workers=4)
    # 200 requests over 50 distinct specs, in a shuffled order, from 32 threads
    order = [(i * 37) % 50 for i in range(200)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: (i, engine.compile(_spec(i))), order))
    assert len(calls) == 50 and set(calls.values()) == {1}
    stats = engine.stats
    assert stats.misses == 50 and stats.hits + stats.joined == 150
    for i, grammar in results:
        assert grammar.spec == _spec(i)
        assert accepts_complete(grammar.matcher(), qwen25, _sample(i)), i


def test_cache_is_bounded_by_bytes(qwen25: Vocabulary) -> None:
    engine = Engine(qwen25, cache_bytes=1)  # nothing fits: every compile is a miss
    engine.compile(GrammarSpec.regex("a"))
    engine.compile(GrammarSpec.regex("a"))
    assert engine.stats.misses == 2 and engine.cache_info()["bytes"] == 0
    patterns = ["x1", "x2", "x3", "x4"]
    roomy = Engine(qwen25)
    sizes = [roomy.compile(GrammarSpec.regex(p)).memory_bytes for p in patterns]
    budget = sizes[-1] + sizes[-2]
    small = Engine(qwen25, cache_bytes=budget)
    for pattern in patterns:
        small.compile(GrammarSpec.regex(pattern))
    info = small.cache_info()
    assert info["bytes"] <= budget and small.stats.evictions >= 1
    assert small.cached(GrammarSpec.regex("x4")) is not None  # most recent kept
    assert small.cached(GrammarSpec.regex("x1")) is None  # oldest evicted


def test_negative_cache_expires(qwen25: Vocabulary) -> None:
    engine = Engine(qwen25, negative_ttl_s=0.2)
    bad = GrammarSpec.regex("a(b")
    for _ in range(3):
        with pytest.raises(InvalidRegexError):
            engine.compile(bad)
    assert engine.stats.misses == 1 and engine.stats.negative_hits == 2
    time.sleep(0.25)
    with pytest.raises(InvalidRegexError):
        engine.compile(bad)
    assert engine.stats.misses == 2


def _nested_one_of(depth: int, width: int, key: str = "oneOf") -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string", "pattern": "[a-z]{2,8}@[a-z]+\\.com"}
    for d in range(depth):
        node = {key: [{"type": "object", "properties": {
            f"k{d}_{i}": node, "e": {"type": "string", "format": "email"}},
            "required": [f"k{d}_{i}"]} for i in range(width)]}
    return node


def test_timeout_on_the_only_backend_is_an_error(qwen25: Vocabulary) -> None:
    """xgrammar needs ~6 s for this schema here; the request gets a timeout error quickly and
    the engine keeps serving others while the runaway compile is abandoned."""
    engine = Engine(qwen25, timeout_s=0.5, max_workers=1, max_abandoned=1)
    spec = GrammarSpec.json_schema(_nested_one_of(3, 3), backend="xgrammar")
    with pytest.raises(CompileTimeoutError, match="xgrammar compile exceeded"):
        engine.compile(spec)
    assert engine.stats.timeouts == 1 and engine.cache_info()["abandoned"] == 1
    # the single slot was handed back: another request compiles despite the runaway
    assert engine.compile(GrammarSpec.regex("ok", backend="xgrammar")).backend == "xgrammar"


def test_timeout_falls_back_to_the_other_backend(qwen25: Vocabulary) -> None:
    engine = Engine(qwen25, timeout_s=0.5, prefer="xgrammar")
    spec = GrammarSpec.json_schema(_nested_one_of(3, 3, key="anyOf"))
    assert engine.route(spec).backend == "xgrammar"
    grammar = engine.compile(spec)
    assert grammar.backend == "guidance" and grammar.fallback_from == "xgrammar"
    assert "fell back" in grammar.reason
    assert engine.stats.timeouts == 1 and engine.stats.fallbacks == 1


BAD_INPUTS: list[tuple[str, Any, type[GrammarError], str]] = [
    ("unknown type", lambda: GrammarSpec.json_schema({"type": "strin"}), InvalidSchemaError,
     "strin"),
    ("bad $ref", lambda: GrammarSpec.json_schema({"$ref": "#/$defs/missing"}),
     InvalidSchemaError, "missing"),
    ("invalid regex", lambda: GrammarSpec.regex("[a-z"), InvalidRegexError, "[Uu]nclosed"),
    ("grammar syntax", lambda: GrammarSpec.grammar('start: "a" |\nfoo'), InvalidGrammarError,
     "line"),
    ("gbnf syntax", lambda: GrammarSpec.grammar('root ::= "a" (b'), InvalidGrammarError, ""),
]


@pytest.mark.parametrize(("what", "make", "error", "fragment"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_give_clear_errors_and_harm_nothing(engine: Engine, qwen25: Vocabulary,
                                                       what: str, make: Any,
                                                       error: type[GrammarError],
                                                       fragment: str) -> None:
    with pytest.raises(error, match=fragment or None):
        engine.compile(make())
    assert accepts_complete(engine.compile(GrammarSpec.regex("fine")).matcher(), qwen25, "fine")


def test_wrong_python_types(engine: Engine) -> None:
    with pytest.raises(GrammarError, match="GrammarSpec"):
        engine.compile({"type": "object"})  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="backend"):
        Engine(engine.vocab, backend="outlines")


def test_check_is_cheap_and_catches_bad_specs(engine: Engine) -> None:
    before = dict(engine.stats.compiles)
    assert engine.check(GrammarSpec.regex("a+")).backend == "guidance"
    for bad in (GrammarSpec.regex("(a"), GrammarSpec.grammar('start: "a" |\nfoo'),
                GrammarSpec.json_schema({"type": "strin"})):
        with pytest.raises(GrammarError):
            engine.check(bad)
    assert engine.stats.compiles == before  # nothing compiled for the tokenizer


def test_async_compile_and_cache_hit(qwen25: Vocabulary) -> None:
    engine = Engine(qwen25)
    fut = engine.compile_async(GrammarSpec.choice(["x", "y"]))
    grammar = fut.result(30)
    again = engine.compile_async(GrammarSpec.choice(["x", "y"]))
    assert again.done() and again.result() is grammar and engine.stats.hits == 1
