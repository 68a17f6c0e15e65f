"""Plugin pieces both runners share: registration, settings, vocabulary, request validation.

Everything runs against the installed vLLM 0.33 (CPU platform): the entry point is found
by vLLM's own loaders, validation goes through vLLM's own frontend validator
(``InputProcessor``) and its error-to-HTTP mapping.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from ...vllm_fixtures import END_THINK, EOS, FQCN, IM_END, IM_START, VOCAB, vllm_config, xargs

# isort: split
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.sample.logits_processor import (
    _load_logitsprocs_plugins,
    validate_logits_processors_parameters,
)
from vllm.v1.worker.gpu.sample.logits_processor import (
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

from grammask.integrations.vllm import admission, process
from grammask.integrations.vllm.admission import request_of, validate_sampling_params
from grammask.integrations.vllm.plugin import GrammaskLogitsProcessor
from grammask.integrations.vllm.process import vocabulary_from_vllm
from grammask.integrations.vllm.settings import (
    Settings,
    load_settings,
    settings_for,
    settings_table,
)

DOCS = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


# ----------------------------------------------------------------------- registration
def test_the_installed_entry_point_loads_into_both_runners() -> None:
    eps = [e for e in md.entry_points(group="vllm.logits_processors") if e.name == "grammask"]
    assert [e.value for e in eps] == [FQCN]  # the plugin module
    assert eps[0].load() is GrammaskLogitsProcessor
    assert GrammaskLogitsProcessor in _load_logitsprocs_plugins()  # V1 loader
    assert GrammaskLogitsProcessor in _load_v2_logitsprocs_plugins()  # V2: type-checked


# --------------------------------------------------------------------------- settings
def test_settings_defaults_env_and_additional_config() -> None:
    assert load_settings(None, {}) == Settings()
    env = {"GRAMMASK_BACKEND": "llguidance", "GRAMMASK_CACHE_MB": "64",
           "GRAMMASK_ENABLED": "false", "GRAMMASK_THINK_END": "None"}
    s = load_settings(None, env)
    assert (s.backend, s.cache_mb, s.enabled, s.think_end) == ("guidance", 64, False, "none")
    s = load_settings({"grammask": {"cache_mb": 8, "think_end": "</answer>"}}, env)
    assert (s.cache_mb, s.think_end, s.backend) == (8, "</answer>", "guidance")  # config wins


@pytest.mark.parametrize(("config", "env", "message"), [
    ({"grammask": {"cache_mbs": 1}}, {}, "unknown grammask settings"),
    ({"grammask": {"wait_s": -1}}, {}, "grammask.wait_s"),
    ({"grammask": "fast"}, {}, "must be an object"),
    (None, {"GRAMMASK_BACKEND": "outlines"}, "GRAMMASK_BACKEND"),
    (None, {"GRAMMASK_ENABLED": "maybe"}, "GRAMMASK_ENABLED"),
    (None, {"GRAMMASK_FILL_CPUS": "1,two"}, "GRAMMASK_FILL_CPUS.*'two'"),
])
def test_bad_settings_name_their_source(config: Any, env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(config, env)


def test_tensor_parallel_changes_no_setting() -> None:
    """Ranks agree on timing outcomes (agreement.py) instead of long timeouts."""
    tp4 = SimpleNamespace(additional_config=None,
                          parallel_config=SimpleNamespace(tensor_parallel_size=4))
    assert settings_for(tp4) == settings_for(SimpleNamespace(additional_config=None))
    assert load_settings(None, {}).wait_s < 1.0


def test_settings_come_from_the_vllm_config() -> None:
    config = vllm_config(additional_config={"grammask": {"on_error": "free"}})
    assert settings_for(config).on_error == "free"


def test_docs_show_the_current_settings_table() -> None:
    assert settings_table() in DOCS.read_text()


# ------------------------------------------------------------------------- vocabulary
def test_vocabulary_comes_from_the_models_tokenizer() -> None:
    vocab = vocabulary_from_vllm(vllm_config().model_config)
    assert vocab.vocab_size == VOCAB and len(vocab.tokens) == 151_669
    assert vocab.stop_ids == (IM_END, EOS)  # tokenizer EOS, then generation_config's
    assert vocab.think_end == "</think>" and vocab.token_id("</think>") == END_THINK
    assert {IM_START, IM_END, EOS} <= vocab.special_ids and END_THINK not in vocab.special_ids
    text = 'héllo {"a": 1}\n'
    assert vocab.decode(vocab.encode(text)) == text.encode()


# ------------------------------------------------------------------------- requests
def test_request_parsing_is_cached_and_ignores_foreign_keys() -> None:
    args = xargs({"regex": "[ab]+"}, thinking="off")
    first = request_of({**args, "other_plugin": 3})
    assert first is not None and first is request_of(dict(args))
    assert first.spec.kind == "regex" and first.thinking is False
    assert request_of({"other_plugin": 3}) is None and request_of(None) is None
    offline = request_of({"grammask": {"choice": ["x", "y"]}})  # SamplingParams(extra_args=)
    assert offline is not None and offline.spec.choices == ["x", "y"]


GOOD = [
    None,
    {"unrelated": "x"},
    xargs({"json": SCHEMA}),
    xargs({"json": SCHEMA, "disable_any_whitespace": True}, backend="guidance", strict=1),
    xargs({"regex": "[0-9]{3}"}, thinking="off", think_end="</reasoning>"),
    xargs({"choice": ["a", "b"]}),
    xargs({"grammar": 'root ::= "yes" | "no"'}),
    xargs({"json_object": True}),
    # served leniently by the Python API (gaps listed in `unenforced`): admission agrees
    xargs({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
    xargs({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}),
    xargs({"json": {"type": "string", "format": "idn-email"}}),
]
#: strict mode refuses what no backend enforces, at admission too
STRICT_GAP = xargs({"json": {"type": "array", "uniqueItems": True}}, strict=1)
BAD = [
    ({"grammask": "{nope"}, "grammask", "not valid JSON"),
    (xargs({"json": SCHEMA, "colour": 1}), "grammask", "unknown structured-output keys"),
    (xargs({"regex": "(ab"}), "grammask", "(?i)regex"),
    (xargs({"json": {"type": "nope"}}), "grammask", "nope"),
    (xargs({"grammar": "root ::= ("}), "grammask", "."),
    (xargs({"choice": []}), "grammask", "empty"),
    ({"grammask_thinking": "off"}, "grammask_thinking", "without a 'grammask'"),
    (xargs({"regex": "a"}, thinking="maybe"), "grammask_thinking", "auto"),
    (xargs({"regex": "a"}, backend="outlines"), "grammask", "backend"),
    (xargs({"regex": "a"}, bakend="xgrammar"), "grammask_bakend", "unknown grammask key"),
    ({"grammask_thinkng": "off"}, "grammask_thinkng", "unknown grammask key"),
]


def frontend_validators() -> dict[str, Any]:
    """vLLM's own request validators: the frontend's, and each runner's loader-built one."""
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(vllm_config())
    return {
        "frontend": lambda sp: processor._validate_params(sp, ("generate",)),
        "v1": lambda sp: validate_logits_processors_parameters(None, sp),
        "v1+fqcn": lambda sp: validate_logits_processors_parameters([FQCN], sp),
        "v2": build_custom_logits_processors_params_validator(None),
    }


@pytest.fixture(scope="module")
def validators() -> dict[str, Any]:
    return frontend_validators()


@pytest.mark.parametrize("extra", GOOD)
def test_good_requests_pass_validation(validators: dict[str, Any], extra: Any) -> None:
    for validate in validators.values():
        validate(SamplingParams(max_tokens=8, extra_args=extra))


@pytest.mark.parametrize(("extra", "parameter", "message"), BAD)
def test_bad_requests_are_a_400_naming_the_key(validators: dict[str, Any], extra: Any,
                                               parameter: str, message: str) -> None:
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )

    for name, validate in validators.items():
        with pytest.raises(VLLMValidationError, match=message) as info:
            validate(SamplingParams(max_tokens=8, extra_args=extra))
        assert info.value.parameter == parameter, name
        response = create_error_response(info.value)
        assert (response.error.code, response.error.param) == (400, parameter)


def test_validation_never_compiles_for_the_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend compile in this process is counted at the backends (a snapshot of the
    compilers that happen to exist could be empty, and would miss a compiler validation built):
    validation compiles nothing, builds no compiler, and the count is shown to work."""
    from grammask import Compiler, GrammarSpec, Vocabulary
    from grammask.backends import get_backend

    compiles: list[tuple[str, int]] = []
    for name in ("xgrammar", "guidance"):
        backend = get_backend(name)  # type: ignore[arg-type]

        def counted(spec: Any, vocab: Any, *, lenient: bool = False, _name: str = name,
                    _orig: Any = backend.compile) -> Any:
            compiles.append((_name, vocab.vocab_size))
            return _orig(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", counted)
    compilers_before = set(process._COMPILERS)
    for extra in GOOD:
        validate_sampling_params(SamplingParams(max_tokens=8, extra_args=extra))
    assert compiles == [] and set(process._COMPILERS) == compilers_before
    checker = admission._checker("auto", "auto")
    assert len(checker.vocab.tokens) == 1 and checker.stats.compiles == {
        "xgrammar": 0, "guidance": 0}
    # the count sees a real compile (so an empty count means no compile, not a blind spy)
    tiny = Vocabulary([b"a", b"b", b"</s>"], special_ids=[2], stop_ids=[2],
                      encode=lambda text: [{"a": 0, "b": 1}[c] for c in text])
    Compiler(tiny, backend="guidance").compile(GrammarSpec.regex("ab"))
    assert compiles == [("guidance", 3)]


def test_one_constraint_mechanism_per_request() -> None:
    sp = SamplingParams(max_tokens=8, extra_args=xargs({"regex": "a+"}),
                        structured_outputs=StructuredOutputsParams(regex="b+"))
    with pytest.raises(VLLMValidationError, match="not both"):
        validate_sampling_params(sp)


def test_disabled_plugin_refuses_constrained_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAMMASK_ENABLED", "0")
    admission._settings_of.cache_clear()
    try:
        with pytest.raises(VLLMValidationError, match="disabled"):
            validate_sampling_params(SamplingParams(extra_args=xargs({"regex": "a"})))
        validate_sampling_params(SamplingParams(extra_args=None))  # others are fine
    finally:
        monkeypatch.undo()
        admission._settings_of.cache_clear()


def test_disabled_through_additional_config_is_seen_by_the_api_server() -> None:
    """The API server's validator has no env setting here, only the config it was started
    with (``--additional-config``): a request must still be refused, not served free."""
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(vllm_config(additional_config={"grammask": {"enabled": False}}))
    with pytest.raises(VLLMValidationError, match="disabled"):
        processor._validate_params(SamplingParams(extra_args=xargs({"regex": "a"})),
                                   ("generate",))
    processor._validate_params(SamplingParams(extra_args=None), ("generate",))
    enabled = InputProcessor(vllm_config())  # the same process, another config: served
    enabled._validate_params(SamplingParams(extra_args=xargs({"regex": "a"})), ("generate",))


def test_strict_mode_refuses_unenforced_keywords_at_admission(
        validators: dict[str, Any]) -> None:
    for validate in validators.values():
        with pytest.raises(VLLMValidationError, match="uniqueItems"):
            validate(SamplingParams(max_tokens=8, extra_args=STRICT_GAP))



def test_disk_cache_setting_resolves_to_a_directory(tmp_path: Path) -> None:
    from grammask.backends.diskcache import default_cache_dir
    from grammask.integrations.vllm.process import disk_cache_dir

    assert disk_cache_dir(load_settings(None, {})) == default_cache_dir()  # on by default
    assert disk_cache_dir(load_settings(None, {"GRAMMASK_DISK_CACHE": "off"})) is None
    assert disk_cache_dir(load_settings(
        {"grammask": {"disk_cache": str(tmp_path)}}, {})) == tmp_path
