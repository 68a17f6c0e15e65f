"""``compile/filltune``: after a JSON schema's routed compile, the other backend that enforces
every keyword of it is compiled and both fills compared; a verdict for the rival serves the
spec's later requests with it and is offered to running rows (``Verdict``); a verdict for the
routed grammar changes nothing. The verdict is forced (``fill_verdict``): no timing here. The
tuner runs on a real service state with a real compiler's compiles; its work runs inline."""

from __future__ import annotations

from typing import Any

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.compile.cache import CompileCache
from grammask.compile.filltune import FillTuner, VerdictMode
from grammask.compile.state import ServiceState
from grammask.compile.stats import Stats

SCHEMA = GrammarSpec.json_schema({"type": "object", "additionalProperties": False,
                                  "properties": {"city": {"type": "string"},
                                                 "n": {"type": "integer"}},
                                  "required": ["city", "n"]})


def _tuner(compiler: Compiler, verdict: VerdictMode
           ) -> tuple[FillTuner, ServiceState, list[Any]]:
    stats = Stats()
    state = ServiceState(compiler.vocab, stats, CompileCache(stats, 1 << 30, 60.0, 16))
    submitted: list[Any] = []

    def submit(fn: Any, *args: Any) -> None:
        submitted.append(fn)
        fn(*args)

    tuner = FillTuner(state, compile=compiler.compile, plan=compiler.plan, submit=submit,
                      verdict=verdict)
    return tuner, state, submitted


def test_a_verdict_for_the_rival_serves_it_and_offers_it_to_running_rows(
        qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, tune_fill=False)
    try:
        route = compiler.route(SCHEMA)
        assert route.fallback is not None and not route.lenient  # both enforce every keyword
        routed = compiler.compile(SCHEMA)
        tuner, state, submitted = _tuner(compiler, "rival")
        state.memory.insert(SCHEMA.key, routed)
        tuner.after_compile(SCHEMA, routed)
        assert len(submitted) == 1 and (state.stats.fill_tuned, state.stats.fill_moved) == (1, 1)
        served = state.memory.get(SCHEMA.key)
        assert served is not None and served.backend == route.fallback
        assert served.spec == routed.spec and "cheaper to fill" in served.reason
        verdict = tuner.offer(SCHEMA.key, routed.backend)
        assert verdict is not None and verdict.grammar is served
        assert verdict.routed == routed.backend and tuner.epoch == 1
        assert tuner.offer(SCHEMA.key, route.fallback) is None
        assert SCHEMA.key not in tuner.wanting  # the comparison ran: no walk wanted
    finally:
        compiler.close()


def test_a_verdict_for_the_routed_grammar_changes_nothing(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, tune_fill=False)
    try:
        routed = compiler.compile(SCHEMA)
        tuner, state, _ = _tuner(compiler, "routed")
        state.memory.insert(SCHEMA.key, routed)
        tuner.after_compile(SCHEMA, routed)
        assert (state.stats.fill_tuned, state.stats.fill_moved) == (1, 0)
        assert state.memory.get(SCHEMA.key) is routed
        assert tuner.offer(SCHEMA.key, routed.backend) is None and tuner.epoch == 0
    finally:
        compiler.close()


def test_nothing_is_compared_where_the_choice_was_forced_or_not_a_schema(
        qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, tune_fill=False)
    try:
        tuner, state, submitted = _tuner(compiler, "rival")
        forced = SCHEMA.with_backend(compiler.route(SCHEMA).backend)
        regex = GrammarSpec.regex("[a-z]{1,8}")
        for spec in (forced, regex):
            grammar = compiler.compile(spec)
            state.memory.insert(spec.key, grammar)
            tuner.after_compile(spec, grammar)
            assert state.memory.get(spec.key) is grammar
        assert submitted == [] and state.stats.fill_tuned == 0
    finally:
        compiler.close()
