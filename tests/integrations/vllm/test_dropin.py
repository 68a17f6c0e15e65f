"""The drop-in: grammask serves vLLM's own ``structured_outputs`` (``vllm_dropin``), and the
API-server hook that takes them over (``vllm_admission.validate_sampling_params``).

Requests are vLLM's real ``SamplingParams`` / ``StructuredOutputsParams``; what a request
becomes is read back through grammask's own request parser (``parse_extra_args``), the path the
engine-side plugin takes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

# first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from ...vllm_fixtures import vllm_config

# isort: split
import vllm
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from grammask import GrammarSpec
from grammask.errors import GrammarError
from grammask.integrations.vllm import admission as vllm_admission
from grammask.integrations.vllm import compat as vllm_compat
from grammask.integrations.vllm.dropin import (
    DropIn,
    bounded_lark_json,
    status,
    take_over,
    translate,
)
from grammask.integrations.vllm.settings import Settings
from grammask.specs.frontends import from_vllm
from grammask.specs.request import ConstraintRequest, VllmReasoning, parse_extra_args

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
ON = DropIn(True, "test: on")  # compact JSON, no backend, no thinking: the defaults


def stand_in(*, backend: Any = "auto", speculative: Any = None, v2: bool = False,
             model_config: Any = None, additional_config: Any = None,
             **structured: Any) -> SimpleNamespace:
    """A stand-in for vLLM's ``VllmConfig``: ``status`` and the admission hook read only
    ``structured_outputs_config`` (here vLLM's real ``StructuredOutputsConfig``),
    ``speculative_config``, ``use_v2_model_runner``, ``model_config`` (for a reasoning parser)
    and ``additional_config``; building a full ``VllmConfig`` with a speculative config or
    the V2 runner is not possible on this CPU-only machine."""
    return SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(backend=backend, **structured),
        speculative_config=speculative, use_v2_model_runner=v2, model_config=model_config,
        additional_config=additional_config)


def spec_of(obj: dict[str, Any]) -> GrammarSpec:
    return from_vllm(obj)


# ------------------------------------------------------------------------ translate
@pytest.mark.parametrize(("so", "expected", "kind"), [
    (StructuredOutputsParams(json=SCHEMA),
     {"json": SCHEMA, "disable_any_whitespace": True, "extra_properties": False}, "json_schema"),
    (StructuredOutputsParams(json=json.dumps(SCHEMA)),  # JSON text: parsed into the schema
     {"json": SCHEMA, "disable_any_whitespace": True, "extra_properties": False}, "json_schema"),
    (StructuredOutputsParams(regex="(ab|cd)[0-9]+"), {"regex": "(ab|cd)[0-9]+"}, "regex"),
    (StructuredOutputsParams(choice=["yes", "no"]), {"choice": ["yes", "no"]}, "choice"),
    (StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
     {"grammar": 'root ::= "yes" | "no"'}, "grammar"),
    (StructuredOutputsParams(json_object=True),
     {"json_object": True, "disable_any_whitespace": True}, "json_object"),
    (StructuredOutputsParams(structural_tag=json.dumps(TAG)),
     {"structural_tag": json.dumps(TAG)}, "structural_tag"),
])
def test_each_kind_becomes_its_grammask_object(so: StructuredOutputsParams,
                                               expected: dict[str, Any], kind: str) -> None:
    obj = translate(so, ON)
    assert obj == expected
    spec = spec_of(obj)
    assert spec.kind == kind and spec.backend is None
    if kind in ("json_schema", "json_object"):
        assert spec.any_whitespace is False  # compact by default
    if kind == "json_schema":
        assert json.loads(spec.source) == SCHEMA and spec.extra_properties is False
    if kind == "choice":
        assert spec.choices == ["yes", "no"]
    if kind == "grammar":
        assert spec.syntax == "ebnf"


def test_a_whitespace_pattern_is_kept_instead_of_compact() -> None:
    pattern = r"[ \n]{0,2}"
    for so in (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=pattern),
               StructuredOutputsParams(json_object=True, whitespace_pattern=pattern)):
        obj = translate(so, ON)
        assert obj["whitespace_pattern"] == pattern and "disable_any_whitespace" not in obj
        spec = spec_of(obj)
        assert spec.whitespace_pattern == pattern and spec.any_whitespace is True


def test_json_whitespace_any_leaves_whitespace_flexible() -> None:
    drop = status(stand_in(), Settings(json_whitespace="any"))
    assert drop.on and drop.compact_json is False and "whitespace any" in drop.reason
    obj = translate(StructuredOutputsParams(json=SCHEMA), drop)
    assert "disable_any_whitespace" not in obj and spec_of(obj).any_whitespace is True
    obj = translate(StructuredOutputsParams(json_object=True), drop)
    assert "disable_any_whitespace" not in obj and spec_of(obj).any_whitespace is True
    # ...while the request's own option, or the server's, still makes it compact
    obj = translate(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), drop)
    assert spec_of(obj).any_whitespace is False
    # (vLLM's config accepts disable_any_whitespace with a named backend only)
    server = status(stand_in(backend="xgrammar", disable_any_whitespace=True),
                    Settings(json_whitespace="any"))
    assert server.compact_json is True
    assert spec_of(translate(StructuredOutputsParams(json=SCHEMA), server)).any_whitespace is False


def tag_around(content: dict[str, Any]) -> dict[str, Any]:
    """A structural tag as vLLM's tool calling writes one: JSON content between markers."""
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<a>"],
        "tags": [{"begin": "<a>", "content": content, "end": "</a>"}]}}


def test_a_structural_tags_json_content_gets_bounded_whitespace(compiler: Any) -> None:
    """vLLM's tool-call tags set no whitespace bound; compact (the default) bounds it to one
    character, which the compiled grammar enforces; the setting ``any`` leaves the tag as is,
    and a bound the tag sets itself is kept."""
    tag = tag_around({"type": "json_schema", "json_schema": SCHEMA})
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    obj = translate(so, ON)
    assert isinstance(obj["structural_tag"], str)  # text stays text
    content = json.loads(obj["structural_tag"])["format"]["tags"][0]["content"]
    assert content == {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}
    loose = DropIn(True, "test: any", compact_json=False)
    assert translate(so, loose) == {"structural_tag": json.dumps(tag)}
    own = tag_around({"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 4})
    assert json.loads(translate(StructuredOutputsParams(structural_tag=json.dumps(own)), ON)[
        "structural_tag"]) == own

    def accepts(obj: dict[str, Any], text: str) -> bool:
        matcher = compiler.compile(spec_of(obj)).matcher()
        return all(matcher.accept(t) for t in compiler.vocab.encode(text))

    assert accepts(obj, 'x<a>{"n": 1}</a>') and not accepts(obj, 'x<a>{"n":   1}</a>')
    assert accepts(translate(so, loose), 'x<a>{"n":   1}</a>')


def test_bounded_whitespace_leaves_the_schemas_own_values_alone() -> None:
    value = {"type": "json_schema"}  # data the output must equal, not a tag node
    schema = {"type": "object", "properties": {"kind": {"const": value}}, "required": ["kind"]}
    tag = tag_around({"type": "json_schema", "json_schema": schema})
    obj = translate(StructuredOutputsParams(structural_tag=json.dumps(tag)), ON)
    content = json.loads(obj["structural_tag"])["format"]["tags"][0]["content"]
    assert content["json_schema"] == schema


def test_a_lark_grammars_json_arguments_get_json_dumps_separators(compiler: Any) -> None:
    """A lark grammar's ``%json`` (Mistral's forced calls) takes whitespace without bound in
    llguidance: the drop-in sets ``json.dumps``'s separators on each one that sets no
    ``x-guidance`` of its own; one that does, and text that is no JSON object, stay."""
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    lark = 'start: "<" %json ' + json.dumps(schema) + ' ">"\n'
    obj = translate(StructuredOutputsParams(grammar=lark), ON)

    def accepts(grammar: str, text: str) -> bool:
        matcher = compiler.compile(GrammarSpec.grammar(grammar, syntax="lark")).matcher()
        return all(matcher.accept(t) for t in compiler.vocab.encode(text))

    assert accepts(obj["grammar"], '<{"n": 1}>')
    assert not accepts(obj["grammar"], '<{"n"   : 1}>') and accepts(lark, '<{"n"   : 1}>')
    own = 'start: %json {"x-guidance": {"whitespace_flexible": true}, "type": "object"}'
    assert bounded_lark_json(own) == own
    assert bounded_lark_json('start: %json {"type": ') == 'start: %json {"type": '


def test_extra_properties_are_closed_even_when_vllm_would_allow_them() -> None:
    so = StructuredOutputsParams(json=SCHEMA, disable_additional_properties=False)
    obj = translate(so, ON)
    assert obj["extra_properties"] is False and spec_of(obj).extra_properties is False


def test_the_servers_backend_is_passed_through() -> None:
    drop = status(stand_in(backend="guidance"), Settings())
    assert drop.on and drop.backend == "guidance"
    for so in (StructuredOutputsParams(regex="a+"), StructuredOutputsParams(json=SCHEMA)):
        obj = translate(so, drop)
        assert obj["backend"] == "guidance" and spec_of(obj).backend == "guidance"
    assert "backend" not in translate(StructuredOutputsParams(regex="a+"), ON)


def test_invalid_json_text_names_the_field() -> None:
    with pytest.raises(GrammarError, match="not valid JSON") as info:
        translate(StructuredOutputsParams(json='{"type": "object",'), ON)
    assert info.value.where is not None
    assert info.value.where.startswith("structured_outputs.json")


def test_exactly_one_kind_is_translated() -> None:
    so = StructuredOutputsParams(regex="a")
    so.choice = ["x"]  # vLLM checks this at construction only
    with pytest.raises(GrammarError, match="exactly one") as info:
        translate(so, ON)
    assert info.value.where == "structured_outputs"


# ------------------------------------------------------------------------ take_over
def taken(so: StructuredOutputsParams, drop: DropIn = ON,
          extra: dict[str, Any] | None = None) -> tuple[SamplingParams, ConstraintRequest]:
    sp = SamplingParams(max_tokens=8, structured_outputs=so, extra_args=extra)
    take_over(sp, drop)
    request = parse_extra_args(sp.extra_args)
    assert request is not None
    return sp, request


def test_take_over_moves_the_constraint_under_extra_args() -> None:
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA),
                        extra_args={"other_plugin": 3, "note": "keep"})
    assert take_over(sp, ON) == "json"
    assert sp.structured_outputs is None  # vLLM's engine neither compiles nor masks it
    assert sp.extra_args is not None
    assert sp.extra_args["other_plugin"] == 3 and sp.extra_args["note"] == "keep"
    assert json.loads(sp.extra_args["grammask"]) == {
        "json": SCHEMA, "disable_any_whitespace": True, "extra_properties": False}
    request = parse_extra_args(sp.extra_args)
    assert request is not None and request.source == "structured_outputs"
    assert request.spec.kind == "json_schema" and request.spec.any_whitespace is False
    assert request.thinking is False and request.think_end is None  # no reasoning parser


@pytest.mark.parametrize(("so", "kind"), [
    (StructuredOutputsParams(regex="[0-9]+"), "regex"),
    (StructuredOutputsParams(choice=["a", "b"]), "choice"),
    (StructuredOutputsParams(grammar='root ::= "x"'), "grammar"),
    (StructuredOutputsParams(json_object=True), "json_object"),
    (StructuredOutputsParams(structural_tag=json.dumps(TAG)), "structural_tag"),
])
def test_take_over_keeps_the_kind(so: StructuredOutputsParams, kind: str) -> None:
    sp, request = taken(so)
    assert sp.structured_outputs is None and sp.extra_args is not None
    assert request.spec.kind == kind and request.source == "structured_outputs"
    assert set(sp.extra_args) == {"grammask", "grammask_thinking", "grammask_source"}


def test_take_over_with_a_reasoning_parser_carries_vllms_decision() -> None:
    """With no decision given (offline generation's: none), vLLM's engine would decide from
    the prompt with no parser kwargs: the request carries that for the engine side."""
    drop = DropIn(True, "test: thinking", thinking=True, think_end="</think>", parser="qwen3")
    _, request = taken(StructuredOutputsParams(regex="a+"), drop)
    assert request.thinking is True and request.think_end == "</think>"
    assert request.reasoning == VllmReasoning("qwen3", None, "{}")
    assert request.source == "structured_outputs"
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    take_over(sp, drop, decision=True)  # vLLM: reasoning already ended
    request = parse_extra_args(sp.extra_args)
    assert request is not None and request.thinking is False and request.reasoning is None


def test_the_engines_copy_still_carries_the_constraint() -> None:
    """vLLM's ``InputProcessor`` clones the params for the engine after validation."""
    sp, request = taken(StructuredOutputsParams(regex="a+"), extra={"other_plugin": 1})
    copy = sp.clone()
    assert copy is not sp and copy.structured_outputs is None
    assert copy.extra_args == sp.extra_args and copy.extra_args is not None
    assert copy.extra_args["other_plugin"] == 1
    assert parse_extra_args(copy.extra_args) == request


# --------------------------------------------------------------------------- status
# The configs below are ``stand_in`` objects (types.SimpleNamespace) in place of vLLM's
# VllmConfig: status needs only structured_outputs_config, speculative_config,
# use_v2_model_runner and model_config.
@pytest.mark.parametrize(("config", "settings", "words"), [
    (stand_in(), Settings(structured_outputs="vllm"), "structured_outputs=vllm"),
    (stand_in(), Settings(enabled=False), "enabled=false"),
    (stand_in(speculative=SimpleNamespace(method="ngram")), Settings(), "speculative decoding"),
    (stand_in(backend="outlines"), Settings(), "outlines"),
    (stand_in(backend="lm-format-enforcer"), Settings(), "lm-format-enforcer"),
    (None, Settings(), "config was not found"),
])
def test_status_off(config: Any, settings: Settings, words: str) -> None:
    drop = status(config, settings)
    assert drop.on is False and words in drop.reason


@pytest.mark.parametrize(("config", "settings", "backend"), [
    (stand_in(), Settings(), None),
    (stand_in(speculative=SimpleNamespace(method="ngram"), v2=True), Settings(), None),
    (stand_in(backend="guidance"), Settings(), "guidance"),
    (stand_in(backend="xgrammar"), Settings(backend="guidance"), "xgrammar"),  # server wins
    (stand_in(), Settings(backend="xgrammar"), "xgrammar"),  # auto: grammask's setting
])
def test_status_on(config: Any, settings: Settings, backend: str | None) -> None:
    drop = status(config, settings)
    assert drop.on is True and drop.backend == backend
    assert drop.thinking is False and drop.think_end is None
    assert "masks from the first token" in drop.reason


@pytest.fixture(scope="module")
def model_config() -> Any:
    """A real vLLM ``ModelConfig`` of the Qwen3-layout offline model (real tokenizer)."""
    return vllm_config().model_config


# "deepseek_r1" ends reasoning at the same ``</think>`` as "qwen3"; both are built here for
# real from the model's tokenizer.
def test_status_with_a_reasoning_parser_masks_after_its_end(model_config: Any) -> None:
    config = stand_in(model_config=model_config, reasoning_parser="deepseek_r1")
    drop = status(config, Settings())
    assert drop.on and drop.thinking is True and drop.think_end == "</think>"
    assert "'</think>'" in drop.reason and "deepseek_r1" in drop.reason
    _, request = taken(StructuredOutputsParams(regex="a+"), drop)
    assert request.thinking is True and request.think_end == "</think>"
    assert request.reasoning is not None and request.reasoning.parser == "deepseek_r1"
    # enable_in_reasoning: vLLM masks reasoning too, so grammask does from the first token
    config = stand_in(model_config=model_config, reasoning_parser="deepseek_r1",
                      enable_in_reasoning=True)
    drop = status(config, Settings())
    assert drop.on and drop.thinking is False and drop.think_end is None
    _, request = taken(StructuredOutputsParams(regex="a+"), drop)
    assert request.thinking is False


def test_a_parser_without_an_end_text_keeps_vllms_engine(model_config: Any,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

    class Endless(DeepSeekR1ReasoningParser):
        @property
        def reasoning_end_str(self) -> str | None:  # type: ignore[override]
            return None

        @property
        def reasoning_end_token_ids(self) -> frozenset[int]:  # vLLM 0.34's other way
            return frozenset()

    monkeypatch.setitem(ReasoningParserManager.reasoning_parsers, "grammask_test_endless",
                        Endless)
    drop = status(stand_in(model_config=model_config, reasoning_parser="grammask_test_endless"),
                  Settings())
    assert drop.on is False
    assert "grammask_test_endless" in drop.reason and "end text" in drop.reason


def test_a_parser_that_cannot_be_built_keeps_vllms_engine(model_config: Any) -> None:
    drop = status(stand_in(model_config=model_config, reasoning_parser="grammask_test_none"),
                  Settings())
    assert drop.on is False and "could not be built" in drop.reason


# -------------------------------------------------------------------- version check
def test_the_installed_vllm_is_one_the_drop_in_was_built_for() -> None:
    assert vllm_compat.mismatch() == ""


def test_another_vllm_line_turns_the_drop_in_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    reason = vllm_compat.mismatch()
    assert reason and "0.99.0" in reason
    drop = status(stand_in(), Settings())
    assert drop.on is False and drop.reason == reason


def test_an_untranslated_field_turns_the_drop_in_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "KNOWN_FIELDS",
                        vllm_compat.KNOWN_FIELDS - {"whitespace_pattern"})
    reason = vllm_compat.mismatch()
    assert "whitespace_pattern" in reason
    assert status(stand_in(), Settings()).on is False


# --------------------------------------------------------------------- admission hook
@pytest.fixture
def admission(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """``validate_sampling_params`` called directly: there is no calling InputProcessor frame
    for it to find the server's config in, so ``admission_config`` returns the stand-in
    (``holder.config``, which a test may replace). Cached settings and decisions are cleared
    around each test."""
    holder = SimpleNamespace(config=stand_in())
    monkeypatch.setattr(vllm_admission, "admission_config", lambda: holder.config)
    vllm_admission._settings_of.cache_clear()
    vllm_admission._DROPIN.clear()
    yield holder
    vllm_admission._settings_of.cache_clear()
    vllm_admission._DROPIN.clear()


def test_a_standard_request_is_taken_over(admission: SimpleNamespace) -> None:
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+b"))
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is None
    request = parse_extra_args(sp.extra_args)
    assert request is not None and request.source == "structured_outputs"
    assert request.spec.kind == "regex" and request.spec.source == "a+b"
    # a params object reused for the next request (LLM.generate over many prompts) is
    # validated again: it now carries a grammask constraint only, which is served
    vllm_admission.validate_sampling_params(sp)
    assert parse_extra_args(sp.extra_args) == request


def test_both_mechanisms_in_one_request_are_refused(admission: SimpleNamespace) -> None:
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a"),
                        extra_args={"grammask": json.dumps({"regex": "b"})})
    with pytest.raises(VLLMValidationError, match="not both") as info:
        vllm_admission.validate_sampling_params(sp)
    assert info.value.parameter == "grammask"


@pytest.mark.parametrize(("so", "parameter"), [
    (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
    (StructuredOutputsParams(json={"type": "nope"}), "structured_outputs.json"),
    (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
    (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(admission: SimpleNamespace,
                                                    so: StructuredOutputsParams,
                                                    parameter: str) -> None:
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )

    with pytest.raises(VLLMValidationError) as info:
        vllm_admission.validate_sampling_params(SamplingParams(max_tokens=8,
                                                               structured_outputs=so))
    assert info.value.parameter == parameter
    response = create_error_response(info.value)
    assert (response.error.code, response.error.param) == (400, parameter)


def test_a_server_fault_at_admission_is_never_a_400(admission: SimpleNamespace,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's check failing for a reason of its own (here: a stand-in that raises
    what the compiler raises for a MemoryError, since a real one cannot be caused on demand)
    is a server fault: it reaches vLLM as a RuntimeError, which vLLM answers with a 500."""
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )

    from grammask.errors import InternalCompileError, ServerFault

    def broken(key: str, backend: str, prefer: str) -> None:
        raise InternalCompileError("guidance: internal error: MemoryError")

    monkeypatch.setattr(vllm_admission, "_checked", broken)
    with pytest.raises(ServerFault) as info:
        vllm_admission.validate_sampling_params(SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not isinstance(info.value, ValueError)  # vLLM maps ValueError to a 400
    assert create_error_response(info.value).error.code == 500


def test_invalid_json_text_is_a_400_naming_structured_outputs(
        admission: SimpleNamespace) -> None:
    so = StructuredOutputsParams(json="{nope")
    with pytest.raises(VLLMValidationError, match="structured_outputs.json") as info:
        vllm_admission.validate_sampling_params(SamplingParams(structured_outputs=so))
    assert info.value.parameter is not None
    assert info.value.parameter.startswith("structured_outputs")


def test_the_per_request_opt_out_leaves_vllms_engine_serving(
        admission: SimpleNamespace) -> None:
    so = StructuredOutputsParams(regex="a+")
    sp = SamplingParams(structured_outputs=so,
                        extra_args={"grammask_structured_outputs": "vllm", "other": 1})
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is so and sp.structured_outputs.regex == "a+"
    # the key stays (a reused params object keeps opting out) and the engine side reads it
    # as no grammask constraint
    assert sp.extra_args == {"grammask_structured_outputs": "vllm", "other": 1}
    assert vllm_admission.request_of(sp.extra_args) is None


@pytest.mark.parametrize(("so", "extra"), [
    (StructuredOutputsParams(regex="a"), {"grammask_structured_outputs": "grammask"}),
    (None, {"grammask_structured_outputs": "vllm"}),  # nothing to leave to vLLM
    (StructuredOutputsParams(regex="a"), {"grammask_structured_outputs": "vllm",
                                          "grammask": json.dumps({"regex": "b"})}),
])
def test_a_wrong_opt_out_is_refused(admission: SimpleNamespace,
                                    so: StructuredOutputsParams | None,
                                    extra: dict[str, Any]) -> None:
    with pytest.raises(VLLMValidationError) as info:
        vllm_admission.validate_sampling_params(SamplingParams(structured_outputs=so,
                                                               extra_args=extra))
    assert info.value.parameter == "grammask_structured_outputs"


def test_the_opt_out_holds_for_a_reused_params_object(admission: SimpleNamespace) -> None:
    """``LLM.generate(prompts, params)`` validates one params object once per prompt
    (vLLM's ``_params_to_seq`` repeats it): every prompt asked for vLLM's engine."""
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"),
                        extra_args={"grammask_structured_outputs": "vllm"})
    vllm_admission.validate_sampling_params(sp)
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is not None


@pytest.mark.parametrize("env", [{"GRAMMASK_STRUCTURED_OUTPUTS": "vllm"},
                                 {"GRAMMASK_ENABLED": "0"}])
def test_settings_that_leave_vllms_engine_serving(admission: SimpleNamespace,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    vllm_admission._settings_of.cache_clear()
    vllm_admission._DROPIN.clear()
    so = StructuredOutputsParams(regex="a+")
    sp = SamplingParams(structured_outputs=so)
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is so and sp.extra_args is None
    # a bad one is vLLM's to judge then, not grammask's
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
    vllm_admission.validate_sampling_params(bad)
    assert bad.structured_outputs is not None and bad.extra_args is None


def test_the_servers_additional_config_can_leave_vllms_engine_serving(
        admission: SimpleNamespace) -> None:
    admission.config = stand_in(additional_config={"grammask": {"structured_outputs": "vllm"}})
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is not None and sp.extra_args is None


def test_speculative_decoding_on_v1_leaves_vllms_engine_serving(
        admission: SimpleNamespace) -> None:
    admission.config = stand_in(speculative=SimpleNamespace(method="ngram"))
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is not None and sp.extra_args is None
    admission.config = stand_in(speculative=SimpleNamespace(method="ngram"), v2=True)
    vllm_admission.validate_sampling_params(sp)
    assert sp.structured_outputs is None and parse_extra_args(sp.extra_args) is not None


def test_vllms_own_input_processor_hands_the_request_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real flow: vLLM's ``InputProcessor`` verifies the request, calls the plugin's
    ``validate_params`` (which finds the server's config in the calling frames), then clones
    the params for the engine. One stand-in: vLLM's own structured-output check in ``verify``
    is skipped, as it imports every vLLM backend and this venv (vLLM installed without its
    dependencies) lacks ``lmformatenforcer``."""
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setattr(SamplingParams, "_validate_structured_outputs",
                        lambda self, *args: None)
    vllm_admission._DROPIN.clear()
    processor = InputProcessor(vllm_config())
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    processor._validate_params(sp, ("generate",))
    assert sp.structured_outputs is None
    request = parse_extra_args(sp.clone().extra_args)
    assert request is not None and request.source == "structured_outputs"
    assert request.spec.kind == "json_schema" and request.spec.any_whitespace is False
    # the same process, a server started with structured_outputs=vllm: left to vLLM
    off = InputProcessor(vllm_config(additional_config={
        "grammask": {"structured_outputs": "vllm"}}))
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    off._validate_params(sp, ("generate",))
    assert sp.structured_outputs is not None and sp.extra_args is None
