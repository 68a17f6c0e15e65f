"""Fill cost decides between backends that both enforce a schema (``Compiler(tune_fill)``)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.compile.fillcost import compare, probe
from grammask.compile.filltune import FillTuner

#: free text: both backends enforce it; the router picks llguidance (compile time)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "n": {"type": "integer"}}, "required": ["name", "n"]}
INSTANCE = {"name": "Ada, countess of Lovelace", "tags": ["math", "engines"], "n": 1843}


def _settled(compiler: Compiler, tuned: int) -> None:
    deadline = time.monotonic() + 60
    while compiler.stats.fill_tuned < tuned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiler.stats.fill_tuned == tuned


def test_the_cheaper_filler_serves_later_requests_and_enforces_the_same(
        qwen25: Vocabulary) -> None:
    """The routed grammar serves at once; the other backend is compiled and compared, and
    whichever serves next enforces every keyword, walks a valid instance, carries the
    original spec, and says why in its reason."""
    compiler = Compiler(qwen25, timeout_s=60)
    try:
        spec = GrammarSpec.json_schema(SCHEMA)
        first = compiler.compile(spec)
        assert first.backend == "guidance" and first.reason.startswith("both backends")
        _settled(compiler, 1)
        served = compiler.compile(spec)
        assert served.spec is first.spec and served.unenforced == first.unenforced
        if served is not first:
            assert compiler.stats.fill_moved == 1 and served.backend == "xgrammar"
            assert "measured cheaper to fill here" in served.reason
        m = served.matcher()
        text = json.dumps(INSTANCE)
        assert all(m.accept(t) for t in qwen25.encode(text)) and m.accept(qwen25.stop_ids[0])
    finally:
        compiler.close()


def test_no_tuning_with_tensor_parallelism_a_forced_backend_or_one_enforcing(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks must agree (no timing), a forced backend is the request's, and a schema only
    one backend enforces has no rival. A comparison is started within ``compile`` (its
    ``after_compile``) or never: none was started when the compiles return."""
    started: list[str] = []
    real_start = FillTuner._start

    def start(self: FillTuner, spec: GrammarSpec, *args: Any) -> None:
        started.append(spec.key)
        real_start(self, spec, *args)

    monkeypatch.setattr(FillTuner, "_start", start)
    ranks = Compiler(qwen25, rank_invariant=True)
    auto = Compiler(qwen25)
    try:
        assert not ranks.tune_fill
        ranks.compile(GrammarSpec.json_schema(SCHEMA))
        auto.compile(GrammarSpec.json_schema(SCHEMA, backend="guidance"))
        auto.compile(GrammarSpec.json_schema({"type": "string", "pattern": "^a+$",
                                              "minLength": 2}))  # llguidance alone
        assert started == [] and not auto.fill_tuner.wanting
        assert ranks.stats.fill_tuned == 0 and auto.stats.fill_tuned == 0
    finally:
        ranks.close()
        auto.close()


def test_a_probe_walk_is_valid_deterministic_and_compared_in_full(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    structure = {t: qwen25.encode(t)[0] for t in ('"', "}", ",", ":")}
    walk = probe(grammar, structure, qwen25.vocab_size, seed=1)
    assert len(walk) >= 8 and walk == probe(grammar, structure, qwen25.vocab_size, seed=1)
    m = grammar.matcher()
    assert all(m.accept(t) for t in walk)
    result = compare(grammar, grammar, walk, qwen25.vocab_size)
    assert result.tokens == len(walk) and result.a_us > 0 and result.b_us > 0
