"""``compile/plan_runner``: a router plan carried out as given, on a real service state and
the real backends: the first attempt that compiles serves (with the route's reason), a step
runs only after the failures it lists (``Attempt.after``), a fallback names the backend that
failed first, and when every step fails the first failure is raised."""

from __future__ import annotations

import time

import pytest

from grammask import GrammarError, GrammarSpec, Vocabulary
from grammask.compile.cache import CompileCache
from grammask.compile.plan_runner import PlanRunner
from grammask.compile.router import Attempt, Plan, Route
from grammask.compile.slots import Runners
from grammask.compile.state import ServiceState
from grammask.compile.stats import Stats

from ..conftest import CORPUS
from ..helpers import accepts_complete

SPEC = GrammarSpec.regex("pl[a-z]n[0-9]")
BAD = GrammarSpec.regex("(unclosed")


def _runner(vocab: Vocabulary) -> PlanRunner:
    stats = Stats()
    state = ServiceState(vocab, stats, CompileCache(stats, 1 << 30, 60.0, 16))
    return PlanRunner(state, Runners(2, 2), None, lambda key, make: False)


def _plan(*attempts: Attempt) -> Plan:
    return Plan(Route(attempts[0].backend, "the test's route"), attempts)


def test_the_plans_first_attempt_serves(qwen25: Vocabulary) -> None:
    runner = _runner(qwen25)
    for backend in ("guidance", "xgrammar"):  # whatever the router would pick
        grammar = runner.run(SPEC, _plan(Attempt(backend)), time.monotonic() + 60)
        assert grammar.backend == backend and grammar.reason == "the test's route"
        assert grammar.fallback_from is None and grammar.matcher().accept(
            qwen25.encode("pl")[0])
    assert runner.stats.compiles["guidance"] == runner.stats.compiles["xgrammar"] == 1


def test_a_step_runs_only_after_the_failures_it_lists(qwen25: Vocabulary) -> None:
    runner = _runner(qwen25)
    plan = _plan(Attempt("xgrammar"), Attempt("guidance", after=frozenset({"timeout"})))
    with pytest.raises(GrammarError) as first:
        runner.run(BAD, plan, time.monotonic() + 60)
    assert runner.stats.compiles["guidance"] == 0  # a refusal is not a timeout: skipped
    both = _plan(Attempt("guidance"), Attempt("xgrammar"))
    with pytest.raises(GrammarError) as raised:
        runner.run(BAD, both, time.monotonic() + 60)
    assert first.value.message and raised.value.message
    assert runner.stats.fallbacks == 0


def test_a_fallback_names_the_backend_that_failed_first(qwen25: Vocabulary) -> None:
    """xgrammar refuses the corpus's ``json.gbnf`` (tests/backends/test_base_protocol.py), and
    llguidance takes it."""
    spec = GrammarSpec.grammar((CORPUS / "gbnf" / "json.gbnf").read_text())
    runner = _runner(qwen25)
    with pytest.raises(GrammarError):
        runner.run(spec, _plan(Attempt("xgrammar")), time.monotonic() + 60)
    grammar = runner.run(spec, _plan(Attempt("xgrammar"), Attempt("guidance")),
                         time.monotonic() + 60)
    assert grammar.backend == "guidance" and grammar.fallback_from == "xgrammar"
    assert "fell back to guidance" in grammar.reason and runner.stats.fallbacks == 1
    assert accepts_complete(grammar.matcher(), qwen25, '{"a": [1, 2]}')


def test_check_returns_the_first_step_whose_cheap_check_passes(qwen25: Vocabulary) -> None:
    runner = _runner(qwen25)
    plan = _plan(Attempt("xgrammar"), Attempt("guidance"))
    assert runner.check(SPEC, plan) == plan.attempts[0]
    with pytest.raises(GrammarError):
        runner.check(BAD, plan)
