"""vLLM 0.34 (V2 runner only) through its own classes: the loader, the params validator that
``InputProcessor`` builds, the sampler's ``may_mask_logits``, the admission order.

Runs only with vLLM 0.34's Python ahead of ``.venv``'s 0.33 (``make unit34``: the wheel
installed ``--no-deps`` into ``.vllm34/site``, put first on ``PYTHONPATH``); skipped
otherwise, and a failure when ``GRAMMASK_V34_REQUIRED`` is set. The V2 runner suites
(``test_v2.py``, ``test_v2_spec.py``) run there too, with ``apply_staged_writes``
called only on admission steps as 0.34 does.

Stand-ins (no CUDA, no Triton on this machine): ``vllm_fixtures.triton_check_stubbed`` lets
0.34's CPU platform build a ``VllmConfig`` without triton-cpu (only that flag, only while
building); ``vllm_fixtures.patch_v2_for_cpu`` as in the V2 suites; vLLM's own
structured-output check in ``verify`` is skipped where it imports backends this venv lacks.
The rejection sampler's Triton kernel cannot run here: the flag it reads
(``may_mask_logits``) is checked, and the masks along drafts are checked in
``test_v2_spec.py``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from ...vllm_fixtures import (  # first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
    CONSTRAINTS,
    VOCAB,
    cpu_v2,  # noqa: F401 - an autouse fixture: the CPU stand-ins for this module
    v34_missing,
    vllm_config,
    xargs,
)

# isort: split
if why := v34_missing():
    pytest.skip(why, allow_module_level=True)

import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from grammask.integrations.vllm import admission as vllm_admission
from grammask.integrations.vllm.plugin import STAND_ASIDE_REASON, GrammaskLogitsProcessor

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_the_v1_interface_is_gone_and_grammask_serves_on_v2() -> None:
    with pytest.raises(ImportError):
        import vllm.v1.sample.logits_processor  # noqa: F401
    assert STAND_ASIDE_REASON == ""
    assert issubclass(GrammaskLogitsProcessor, V2LogitsProcessor)


def test_the_plugin_loader_returns_grammask_as_a_v2_processor() -> None:
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_plugins,
    )

    classes = _load_v2_logitsprocs_plugins()
    assert GrammaskLogitsProcessor in classes
    assert all(issubclass(c, V2LogitsProcessor) for c in classes)


def test_admission_checks_run_in_the_order_the_drop_in_relies_on() -> None:
    """0.34's ``InputProcessor``: vLLM's own ``verify`` (its structured-output check) runs
    before the logits processors' validator, and validation before the engine's copy."""
    from vllm.v1.engine.input_processor import InputProcessor

    validate = inspect.getsource(InputProcessor._validate_params)
    assert validate.index("params.verify(") < validate.index(
        "self.validate_logits_processors_params(params)")
    process = inspect.getsource(InputProcessor.process_inputs)
    assert process.index("self._validate_params(params") < process.index("params.clone()")


def test_the_validator_input_processor_builds_refuses_a_bad_constraint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The params validator 0.34's ``InputProcessor`` builds from the installed plugins: a bad
    constraint is vLLM's own 400 (``VLLMValidationError``) naming grammask, before the engine.
    (That it takes a good request over is ``test_vllm_dropin``'s InputProcessor test, which
    ``make unit34`` runs on 0.34 too.)"""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setattr(SamplingParams, "_validate_structured_outputs",
                        lambda self, *args: None)  # imports backends this venv lacks
    vllm_admission._DROPIN.clear()
    processor = InputProcessor(vllm_config())
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(a"))
    with pytest.raises(VLLMValidationError, match="grammask"):
        processor._validate_params(bad, ("generate",))
    good = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    processor._validate_params(good, ("generate",))  # the bad one harmed nothing
    assert good.structured_outputs is None


def test_add_request_feeds_may_mask_logits() -> None:
    """0.34's sampler ORs ``add_request``'s answer into ``may_mask_logits`` (the rejection
    sampler then keeps masked vocabulary blocks): True for a constrained request only."""
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    config = vllm_config()
    rs = RequestState(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256,
                      num_speculative_steps=0, vocab_size=VOCAB, device=torch.device("cpu"))
    procs = build_custom_logits_processors(config, rs, False, ())
    sampler = Sampler(config, max_num_reqs=4, vocab_size=VOCAB, device=torch.device("cpu"),
                      req_states=rs, custom_logits_processors=procs)
    try:
        for rid, extra in (("plain", None), ("json", xargs(CONSTRAINTS[0][0]))):
            rs.add_request(rid, prompt_len=3, all_token_ids=[1, 2, 3],
                           num_computed_tokens=0, max_tokens=8)
            sampler.add_request(rs.req_id_to_index[rid],
                                SamplingParams(max_tokens=8, extra_args=extra))
        assert sampler.may_mask_logits[rs.req_id_to_index["json"]]
        assert not sampler.may_mask_logits[rs.req_id_to_index["plain"]]
    finally:
        for p in procs:
            if isinstance(p, GrammaskLogitsProcessor):
                p.close()


def test_speculative_decoding_is_served_on_034(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34 keeps logits processors active under drafts: the drop-in serves them."""
    from types import SimpleNamespace

    from grammask.integrations.vllm.compat import _speculative_on_v1

    assert not _speculative_on_v1(SimpleNamespace(speculative_config=object()))


def _unused(_: Any) -> None:  # pragma: no cover - keeps the fixture import visible
    pass


def test_a_parser_that_names_its_end_by_token_id_only_still_gates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34's parsers can name the end of reasoning by token id (``reasoning_end_token_ids``)
    instead of text: the drop-in masks after that token's text."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

    from grammask.integrations.vllm.dropin import reasoning_end

    from ...vllm_fixtures import END_THINK

    class ByToken(DeepSeekR1ReasoningParser):
        @property
        def reasoning_end_str(self) -> str | None:  # type: ignore[override]
            return None

        @property
        def reasoning_end_token_ids(self) -> frozenset[int]:
            return frozenset({END_THINK})

    monkeypatch.setitem(ReasoningParserManager.reasoning_parsers, "grammask_test_by_token",
                        ByToken)
    end, why = reasoning_end(vllm_config(), "grammask_test_by_token")
    assert end == "</think>", why
