"""A request taken over from vLLM's structured outputs is gated where vLLM's engine would gate
it (its reasoning decision, its parser, implicit ends), counted truthfully, and the plugin
never stops a server or skips a 400 silently (``--skip-tokenizer-init``, a Rust front end).

Runs on the installed vLLM's classes (0.33 in ``make unit``, 0.34 in ``make unit34``); the
grid on 0.32's is in ``tests/e2e/test_reasoning_dropin.py`` (its venv serves the e2e suite).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from grammask import metrics
from grammask.decode.reasoning import RuleGate
from grammask.decode.rows import PendingGrammar
from grammask.integrations.vllm import admission, compat
from grammask.integrations.vllm.dropin import DropIn, status
from grammask.integrations.vllm.plugin_core import PluginCore
from grammask.integrations.vllm.settings import Settings
from grammask.specs.request import parse_extra_args

from ... import reasoning_grid
from ...vllm_fixtures import model_dir, triton_check_stubbed, vllm_config

SCHEMA = {"type": "object"}


def test_the_grid_starts_the_grammar_where_vllms_engine_does() -> None:
    """Every case of ``tests/reasoning_grid.py`` on the installed vLLM: grammask's masks while
    reasoning, where its grammar starts and what it takes are vLLM's."""
    result = reasoning_grid.run(model_dir())
    assert not result["skipped"], result["skipped"]
    assert result["cases"] >= 500
    assert not result["mismatches"], result["mismatches"][:3]


# ------------------------------------------------------------------ the API server side
@pytest.fixture
def fresh() -> Iterator[None]:
    admission._DROPIN.clear()
    admission._LEFT.clear()
    yield
    admission._DROPIN.clear()
    admission._LEFT.clear()


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_an_unknown_decision_leaves_the_request_to_vllm(
        fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Called from outside vLLM's entry points (a caller that processed its request apart),
    a reasoning server's decision cannot be read: vLLM's engine keeps the request."""
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(reasoning_parser="qwen3",
                                                  enable_in_reasoning=False, backend="auto",
                                                  disable_any_whitespace=False),
        speculative_config=None, use_v2_model_runner=True,
        model_config=vllm_config().model_config, additional_config=None)
    monkeypatch.setattr(admission, "admission_config", lambda: config)
    sp = _params()
    with caplog.at_level(logging.WARNING, logger="grammask"):
        admission.validate_sampling_params(sp)
    assert sp.structured_outputs is not None and sp.extra_args is None
    assert "reasoning decision for it is unknown" in caplog.text


def test_a_reused_params_object_gets_each_requests_decision(fresh: None) -> None:
    """Offline generation reuses one params object: the second request's decision replaces
    the first one's (here through vLLM's own ``AsyncLLM.add_request``)."""
    server = reasoning_grid.Server(reasoning_grid.grid_model_dir(model_dir()))
    side = reasoning_grid.Side(server, "qwen3")
    sp = _params()
    saved = SamplingParams._validate_structured_outputs
    SamplingParams._validate_structured_outputs = lambda self, *args: None  # type: ignore
    try:
        import asyncio

        from vllm.v1.engine.async_llm import AsyncLLM

        engine = reasoning_grid._engine_stand_in(side)
        prompt = {"type": "token", "prompt_token_ids": [1, 2]}
        asyncio.run(AsyncLLM.add_request(engine, "a", prompt, sp, reasoning_ended=True))
        assert sp.extra_args is not None and sp.extra_args["grammask_thinking"] == "off"
        asyncio.run(AsyncLLM.add_request(engine, "b", prompt, sp, reasoning_ended=False,
                                         reasoning_parser_kwargs={}))
    finally:
        SamplingParams._validate_structured_outputs = saved  # type: ignore[method-assign]
    request = parse_extra_args(sp.extra_args)
    assert request is not None and request.thinking is True
    assert request.reasoning is not None and request.reasoning.ended is False


def test_the_drop_in_needs_add_requests_two_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_entry_codes", lambda: {})
    assert "reasoning decision" in compat.mismatch()


# ------------------------------------------------------------------------- the gate
class _Rule:
    implicit_ends = frozenset({7})
    needs_history = True

    def prompt_ended(self, prompt_ids: Any) -> bool:
        return False

    def grammar_start(self, history: list[int], delta: Any) -> tuple[int, bool] | None:
        for i, tid in enumerate(delta):
            if tid in (7, 9):
                return (i, True) if tid == 7 else (i + 1, False)
        return None


def test_the_rule_gate_refuses_implicit_ends_until_the_grammar_says() -> None:
    answers: list[list[bool] | None] = [None]
    gate = RuleGate(_Rule(), [1, 2], False, lambda ids: answers[0])
    assert gate.thinking and list(gate.refused()) == [7]  # no grammar yet: refused
    answers[0] = [True]
    assert list(gate.refused()) == []  # the grammar starts with it: allowed
    assert gate.feed([3, 7, 4]) == [7, 4]  # an implicit end is the grammar's first token
    assert not gate.thinking and gate.thinking_tokens == 1
    gate.rollback(1)
    assert gate.thinking and gate.feed([9, 5]) == [5]  # an explicit one is not
    assert RuleGate(_Rule(), [1], True, lambda ids: None).from_prompt


# --------------------------------------------------------------------- the count
def _counts() -> dict[str, float]:
    return {k: v for k, v in metrics.snapshot().items()
            if k.startswith(("grammask_requests_total", "grammask_unserved_requests_total"))}


def test_a_request_that_finished_reasoning_is_not_counted_served() -> None:
    """Served is counted as the row's grammar first masks (its matcher attaches); a row that
    leaves without it is unserved, by why."""
    if metrics._prom is None:
        pytest.skip("prometheus_client is not installed")
    from grammask.decode.rows import Row

    done: Future[Any] = Future()
    spec_req = parse_extra_args({"grammask": '{"regex": "a+"}'})
    assert spec_req is not None
    before = _counts()
    thinking = Row(spec_req, PendingGrammar(done, None, hedge_s=0.0), [], True, [])
    thinking.gate = RuleGate(_Rule(), [1], False, lambda ids: None)
    thinking.count()
    never = Row(spec_req, PendingGrammar(done, None, hedge_s=0.0), [], True, [])
    never.count()
    served = Row(spec_req, PendingGrammar(done, None, hedge_s=0.0), [], True, [])
    served.attach(SimpleNamespace(matcher=lambda: SimpleNamespace()))  # type: ignore[arg-type]
    served.count()
    after = _counts()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('grammask_requests_total{kind="regex",source="grammask"}') == 1
    for why in ("reasoning", "no_mask"):
        assert delta(f'grammask_unserved_requests_total{{kind="regex",reason="{why}",'
                     'source="grammask"}') == 1


# ---------------------------------------------------------- never stop, never skip a 400
def _no_tokenizer_config() -> Any:
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    path = str(model_dir())
    mc = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=256, seed=0,
                     enforce_eager=True, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                         is_encoder_decoder=False)
    with triton_check_stubbed():
        return VllmConfig(model_config=mc, scheduler_config=sc,
                          additional_config={"grammask": {"disk_cache": "off"}})


def test_skip_tokenizer_init_starts_and_stands_aside(
        fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    """The plugin builds no compiler (it would need the tokenizer): it stands aside with a log
    line, vLLM's structured outputs stay vLLM's, and grammask's own keys get a 400 saying
    why."""
    config = _no_tokenizer_config()
    with caplog.at_level(logging.WARNING, logger="grammask"):
        core = PluginCore(config, "v2", 4)
    assert not core.active and "--skip-tokenizer-init" in core.aside
    assert "stands aside" in caplog.text and "--skip-tokenizer-init" in caplog.text
    assert status(config, Settings()).on is False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(admission, "admission_config", lambda: config)
        sp = _params()
        admission.validate_sampling_params(sp)
        assert sp.structured_outputs is not None  # vLLM's engine answers it
        own = SamplingParams(max_tokens=8, extra_args={"grammask": '{"regex": "a+"}'})
        with pytest.raises(VLLMValidationError, match="--skip-tokenizer-init"):
            admission.validate_sampling_params(own)


def test_a_rust_front_end_is_named_and_bad_rows_fail_alone(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No Python front end validates (0.34's ``VLLM_USE_RUST_FRONTEND``): said at start-up;
    a constraint validation would refuse becomes that row's error, logged by name."""
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    config = vllm_config()
    assert "Rust front end" in status(config, Settings()).reason
    core = SimpleNamespace(active=True, dropin=DropIn(False, "off"), _foreign_warned=True,
                           vllm_config=config, compiler=None)
    core._check_foreign = lambda params: None
    core._with_rule = lambda request, resumed: request
    with caplog.at_level(logging.WARNING, logger="grammask"):
        both = SamplingParams(max_tokens=8, extra_args={"grammask": '{"regex": "a+"}'},
                              structured_outputs=StructuredOutputsParams(regex="b"))
        _, grammar = PluginCore.request(core, both)  # type: ignore[arg-type]
        assert grammar is not None and isinstance(grammar.exception(), Exception)
        typo = SamplingParams(max_tokens=8, extra_args={"grammask": '{"regex": "a+"}',
                                                        "grammask_bakend": "x"})
        _, grammar = PluginCore.request(core, typo)  # type: ignore[arg-type]
        assert grammar is not None and "grammask_bakend" in str(grammar.exception())
    assert "refused in the engine" in caplog.text and "grammask_bakend" in caplog.text
    with caplog.at_level(logging.WARNING, logger="grammask"):
        PluginCore(config, "v2", 4).close()
    assert "Rust front end" in caplog.text


def test_refused_is_empty_for_grammasks_own_gate() -> None:
    from grammask.decode.reasoning import ThinkGate, ThinkMarker

    gate = ThinkGate(ThinkMarker(5, None), [b"a"] * 8, prompt_ids=[1])
    assert isinstance(gate.refused(), np.ndarray) and gate.refused().size == 0
