"""The router's plan: what a compile tries, in order, and that the compiler runs it as given.

The compiler asks the router once per cold compile and never climbs back up: the attempts,
their modes, gaps and budget shares all come from ``grammask.compile.router.plan``."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import grammask.compile.compiler as compiler_module
import grammask.compile.router as router_module
from grammask import Compiler, GrammarSpec
from grammask.backends import get_backend
from grammask.compile.router import ALL_FAILURES, FIRST_BUDGET, NOT_TIMING, Attempt, plan
from grammask.errors import CompileTimeoutError, UnsupportedError
from grammask.vocab import Vocabulary

from ..helpers import declare_unbounded

FREE_TEXT = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
NO_TEXT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
#: xgrammar ignores uniqueItems, llguidance refuses it by default (a tie: llguidance, lenient)
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
#: xgrammar does not enforce patternProperties; llguidance does
PATTERN_KEYS = {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}}


def test_a_free_text_schema_plans_llguidance_then_xgrammar() -> None:
    steps = plan(GrammarSpec.json_schema(FREE_TEXT)).attempts
    assert [s.backend for s in steps] == ["guidance", "xgrammar", "guidance"]
    assert [s.lenient for s in steps] == [False, False, True]
    first = steps[0]
    assert (first.budget, first.skip_busy) == (FIRST_BUDGET, True)
    assert all(s.budget == 1.0 and s.after == ALL_FAILURES for s in steps[1:])


def test_the_hedge_is_the_other_backend_with_its_gaps() -> None:
    p = plan(GrammarSpec.json_schema(UNIQUE))
    assert p.backend == "guidance" and p.route.lenient and p.route.unenforced
    assert p.hedge is not None
    assert p.hedge == Attempt("xgrammar", unenforced=p.hedge.unenforced)
    assert any("uniqueItems" in g for g in p.hedge.unenforced)
    assert p.attempts[-1] == p.hedge  # and it is the last fallback


def test_strict_specs_never_plan_a_backend_with_gaps() -> None:
    loose = plan(GrammarSpec.json_schema(PATTERN_KEYS))
    assert loose.backend == "guidance" and loose.hedge is not None
    assert loose.hedge.backend == "xgrammar" and loose.hedge.unenforced
    strict = plan(GrammarSpec.json_schema(PATTERN_KEYS, strict=True))
    assert strict.backend == "guidance" and strict.hedge is None
    assert all(step.backend == "guidance" and not step.unenforced
               for step in strict.attempts)


def test_a_strict_spec_no_backend_enforces_is_refused_by_the_plan() -> None:
    with pytest.raises(UnsupportedError, match="no backend enforces"):
        plan(GrammarSpec.json_schema({"type": "array", "uniqueItems": True,
                                      "items": {"type": "integer"},
                                      "contains": {"const": 1}, "not": {"const": []}},
                                     strict=True))


def test_forced_backends_plan_one_attempt_and_no_hedge() -> None:
    p = plan(GrammarSpec.json_schema(FREE_TEXT, backend="xgrammar"))
    assert [s.backend for s in p.attempts] == ["xgrammar"] and p.hedge is None
    assert p.attempts[0].budget == 1.0 and not p.attempts[0].skip_busy


def test_other_kinds_fall_back_by_their_route_and_never_hedge() -> None:
    regex = plan(GrammarSpec.regex("[a-z]+"))
    assert [s.backend for s in regex.attempts] == ["guidance", "xgrammar"]
    assert regex.hedge is None
    structural = plan(GrammarSpec.structural_tag({
        "type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}))
    # llguidance serves only the legacy form: an attempt there could only refuse
    assert [(s.backend, s.after) for s in structural.attempts] == [("xgrammar", ALL_FAILURES)]


def test_rank_invariant_plans_have_no_timing_step() -> None:
    """With tensor parallelism a fallback taken because one rank was slower would give the
    ranks different grammars: the first attempt gets the whole budget and waits its turn."""
    for schema in (FREE_TEXT, NO_TEXT, UNIQUE):
        p = plan(GrammarSpec.json_schema(schema), rank_invariant=True)
        assert len(p.attempts) > 1 and p.hedge is not None  # refusals still fall back
        assert all((s.budget, s.slot_budget, s.skip_busy) == (1.0, 1.0, False)
                   for s in p.attempts)
        assert all("timeout" not in s.after for s in p.attempts[1:])
        assert all(s.after == NOT_TIMING for s in p.attempts[1:])


def test_the_plan_is_the_same_in_every_order_of_calls() -> None:
    specs = [GrammarSpec.json_schema(s) for s in (FREE_TEXT, NO_TEXT, UNIQUE)]
    first = [plan(s) for s in specs]
    assert [plan(s) for s in reversed(specs)][::-1] == first


class _Gate:
    """A real backend whose compile blocks until the test releases it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.release = threading.Event()
        self.calls = 0
        declare_unbounded(monkeypatch, name)  # a stalled compile must be abandonable
        backend = get_backend(name)
        original = backend.compile

        def gated(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
            self.calls += 1
            self.release.wait(60)
            return original(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", gated)


def test_a_compile_asks_the_router_once_and_runs_its_plan(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """One way: compiler -> router (once) -> backends. The fallback's mode and gaps are the
    plan's, not recomputed by the compiler."""
    calls = _counting_plan(monkeypatch)
    monkeypatch.setattr(router_module, "route", lambda *a, **k: pytest.fail("route climbed"))
    refusing = get_backend("xgrammar")

    def refuse(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
        raise UnsupportedError("refused by the test")

    monkeypatch.setattr(refusing, "compile", refuse)
    compiler = Compiler(qwen25, prefer="xgrammar")
    grammar = compiler.compile(GrammarSpec.json_schema(NO_TEXT))
    assert len(calls) == 1
    assert grammar.backend == "guidance" and grammar.fallback_from == "xgrammar"
    assert "refused by the test" in grammar.reason


def test_rank_invariant_compilers_do_not_fall_back_on_timing(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled first backend: a single-rank compiler moves to the fallback within the budget;
    a rank-invariant one waits for the routed backend, so every rank ends alike."""
    gate = _Gate(monkeypatch, "xgrammar")
    fallback = _Gate(monkeypatch, "guidance")
    fallback.release.set()
    spec = GrammarSpec.json_schema(NO_TEXT)
    try:
        solo = Compiler(qwen25, timeout_s=1.0)
        assert solo.route(spec).backend == "xgrammar"
        assert solo.compile(spec).backend == "guidance" and fallback.calls == 1
        ranked = Compiler(qwen25, timeout_s=1.0, rank_invariant=True)
        with pytest.raises(CompileTimeoutError):
            ranked.compile(GrammarSpec.json_schema({**NO_TEXT, "title": "another key"}))
        assert fallback.calls == 1  # the rank-invariant compiler never tried llguidance
    finally:
        gate.release.set()


def test_check_walks_the_plan(qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrival refuses exactly what no attempt could serve: when the routed backend's check
    refuses, the next attempt of the plan that passes is the answer."""
    compiler = Compiler(qwen25, backend="auto")
    spec = GrammarSpec.json_schema(FREE_TEXT)
    assert compiler.check(spec) == compiler.plan(spec).attempts[0]

    def refuse(spec: GrammarSpec, *, lenient: bool = False) -> None:
        raise UnsupportedError("refused by the test")

    monkeypatch.setattr(get_backend("guidance"), "check", refuse)
    assert compiler.check(spec).backend == "xgrammar"
    with pytest.raises(UnsupportedError, match="refused by the test"):
        compiler.check(GrammarSpec.json_schema(FREE_TEXT, backend="guidance"))


def test_reasons_name_keywords_and_backends_never_timings() -> None:
    """Timings are facts of one machine and one release: they live in the benchmark docs.
    A reason that quotes one ("~25 ms") goes stale the day either backend changes."""
    import re

    specs = [GrammarSpec.json_schema(s) for s in (FREE_TEXT, NO_TEXT, UNIQUE, PATTERN_KEYS)]
    specs += [GrammarSpec.json_schema(FREE_TEXT, extra_properties=True),
              GrammarSpec.regex("[a-z]+@[a-z]+"), GrammarSpec.choice(["a", "b"]),
              GrammarSpec.grammar('root ::= "a"'), GrammarSpec.grammar('start: "a"'),
              GrammarSpec.json_object()]
    timing = re.compile(r"\d\s*(ms|s|µs|us)\b|\d+(\.\d+)?x\b|faster|slower")
    for spec in specs:
        reason = plan(spec).route.reason
        assert reason and not timing.search(reason), (spec.kind, reason)


# ------------------------------------------------------------------ the compiler's plans
def _counting_plan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The router's plan as the compiler calls it, recording each spec key it plans."""
    calls: list[str] = []
    real_plan = router_module.plan

    def counted(spec: GrammarSpec, **kwargs: Any) -> Any:
        calls.append(spec.key)
        return real_plan(spec, **kwargs)

    monkeypatch.setattr(compiler_module, "plan", counted)
    return calls


def test_admission_the_compile_and_the_hedge_share_one_plan(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new schema is planned at admission (``check``), at compile and by the first-mask
    hedge; the router is pure, so the compiler plans it once and hands out that plan."""
    calls = _counting_plan(monkeypatch)
    compiler = Compiler(qwen25, tune_fill=False)  # no rival compile planning its own spec
    spec = GrammarSpec.json_schema(FREE_TEXT)
    step = compiler.check(spec)
    grammar = compiler.compile(GrammarSpec.json_schema(FREE_TEXT))  # an equal spec, rebuilt
    again = compiler.plan(GrammarSpec.json_schema(FREE_TEXT))
    assert calls == [spec.key]
    assert again is compiler.plan(spec) and again.attempts[0] == step
    assert grammar.backend == again.backend
    assert again == plan(spec)  # what the router itself says
    compiler.clear()  # nothing cached: the next compile is cold, its plan too
    compiler.plan(spec)
    assert calls == [spec.key, spec.key]


def test_the_plan_cache_never_serves_a_spec_with_another_key(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option a plan depends on is part of the key: specs that differ in any of them
    get their own plan, each the one the router makes for that spec."""
    calls = _counting_plan(monkeypatch)
    compiler = Compiler(qwen25)
    variants = [GrammarSpec.json_schema(FREE_TEXT),
                GrammarSpec.json_schema(FREE_TEXT, backend="xgrammar"),
                GrammarSpec.json_schema(FREE_TEXT, extra_properties=True),
                GrammarSpec.json_schema(PATTERN_KEYS),
                GrammarSpec.json_schema(PATTERN_KEYS, strict=True),
                GrammarSpec.json_schema(FREE_TEXT, whitespace_pattern=r"[ ]?"),
                GrammarSpec.json_schema(FREE_TEXT, any_whitespace=False),
                GrammarSpec.regex("[a-z]+")]
    assert len({s.key for s in variants}) == len(variants)
    plans = [compiler.plan(s) for s in variants]
    assert [compiler.plan(s) for s in reversed(variants)][::-1] == plans  # now from the cache
    assert len(calls) == len(variants)
    for spec, made in zip(variants, plans, strict=True):
        assert made == plan(spec), spec
    assert plans[1].attempts[0].backend == "xgrammar" and len(plans[1].attempts) == 1
    assert plans[3].hedge is not None and plans[4].hedge is None  # strict: no gapped hedge


def test_a_change_of_the_registered_backends_drops_the_plans(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend registered after the compiler was built may change any route: plans made
    before it are not served."""
    import dataclasses

    from grammask.backends import registry

    calls = _counting_plan(monkeypatch)
    compiler = Compiler(qwen25)
    spec = GrammarSpec.json_schema(NO_TEXT)
    compiler.plan(spec)
    compiler.plan(spec)
    assert len(calls) == 1
    real = registry.backends
    changed = tuple(dataclasses.replace(b, priority=b.priority + 1) for b in real())
    monkeypatch.setattr(registry, "backends", lambda: changed)
    compiler.plan(spec)
    compiler.plan(spec)
    assert len(calls) == 2
