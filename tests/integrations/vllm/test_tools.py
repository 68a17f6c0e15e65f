"""Forced tool calls follow the tool's ``parameters`` (``vllm_tools`` in the admission hook).

The tags are vLLM's own (its hermes builder, as its chat server calls it for tools without
``strict``), the request is vLLM's ``ChatCompletionRequest``, and what grammask serves is
compiled by grammask's compiler over the real Qwen2.5 vocabulary and read token by token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

# first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from ...vllm_fixtures import vllm_config  # noqa: F401

# isort: split
from vllm.config import StructuredOutputsConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.tool_parsers.structural_tag_registry import (
    get_model_structural_tag,
    limit_to_single_tool_call,
)
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

from grammask.integrations.vllm import admission as vllm_admission
from grammask.integrations.vllm import tool_tags
from grammask.integrations.vllm import tools as tools_module
from grammask.integrations.vllm.tools import MAX_TOOL_CALLS, open_objects
from grammask.specs.request import parse_extra_args

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}


def tool(name: str, parameters: Any, **more: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **more}}


TOOLS = [tool("get_weather", WEATHER), tool("get_time", TIME)]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.fixture
def admission(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The admission hook with a stand-in server config (``holder.config``)."""
    holder = SimpleNamespace(config=SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(backend="auto"),
        speculative_config=None, use_v2_model_runner=False, model_config=None,
        additional_config=None))
    monkeypatch.setattr(vllm_admission, "admission_config", lambda: holder.config)
    vllm_admission._settings_of.cache_clear()
    vllm_admission._DROPIN.clear()
    yield holder
    vllm_admission._settings_of.cache_clear()
    vllm_admission._DROPIN.clear()


def chat_request(tool_choice: Any, tools: list[dict[str, Any]] = TOOLS,
                 parallel: bool = True, model: str = "hermes") -> ChatCompletionRequest:
    """A chat request as vLLM's chat server leaves it: the tag of ``model`` (a key of
    vLLM's structural-tag registry) in its ``structured_outputs``
    (``DelegatingParser._apply_structural_tag``)."""
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    tools=tools, tool_choice=tool_choice,
                                    parallel_tool_calls=parallel)
    tag = get_model_structural_tag(model, request.tools, request.tool_choice, False,
                                   strict_level=ToolStrictLevel.FUNCTION)
    assert tag is not None
    if not parallel:
        limit_to_single_tool_call(tag)
    request.structured_outputs = StructuredOutputsParams(
        structural_tag=json.dumps(tag.model_dump()))
    return request


def admit(request: ChatCompletionRequest) -> SamplingParams:
    """vLLM's flow: params made from the request, validated while the request is on the
    stack (the chat server awaits the engine's admission in the request's coroutine)."""
    params = SamplingParams(max_tokens=8, structured_outputs=request.structured_outputs)
    vllm_admission.validate_sampling_params(params)
    return params


def served_tag(params: SamplingParams) -> dict[str, Any]:
    request = parse_extra_args(params.extra_args)
    assert request is not None and request.spec.kind == "structural_tag"
    return dict(json.loads(request.spec.source))


def accepts(compiler: Any, params: SamplingParams, text: str, *, complete: bool = True) -> bool:
    request = parse_extra_args(params.extra_args)
    assert request is not None
    matcher = compiler.compile(request.spec).matcher()
    ok = all(matcher.accept(t) for t in compiler.vocab.encode(text))
    return ok and (matcher.can_terminate() or not complete)


def test_required_calls_follow_each_tools_parameters(admission: SimpleNamespace,
                                                     compiler: Any) -> None:
    params = admit(chat_request("required"))
    assert accepts(compiler, params, call("get_weather", '{"city": "Paris", "days": 3}'))
    assert accepts(compiler, params, call("get_time", '{"tz": "UTC"}'))
    # what vLLM's tag let through for a tool without strict: any JSON value
    assert not accepts(compiler, params, call("get_time", "false"), complete=False)
    assert not accepts(compiler, params, call("get_weather", '"Paris"'), complete=False)
    assert not accepts(compiler, params, call("get_weather", '{"city": "Paris", "days": 9}'),
                       complete=False)
    assert not accepts(compiler, params, call("get_weather", '{"city": "Paris"}'))
    assert not accepts(compiler, params, call("get_lost", "{}"), complete=False)
    # JSON-Schema semantics: get_time does not close its object, get_weather does
    assert accepts(compiler, params, call("get_time", '{"tz": "UTC", "more": [1]}'))
    assert not accepts(compiler, params, call("get_weather",
                                              '{"city": "Paris", "days": 3, "more": 1}'),
                       complete=False)


def test_parallel_calls_are_bounded(admission: SimpleNamespace, compiler: Any) -> None:
    one = call("get_time", '{"tz": "CET"}')
    params = admit(chat_request("required"))
    assert accepts(compiler, params, one * MAX_TOOL_CALLS)
    assert not accepts(compiler, params, one * (MAX_TOOL_CALLS + 1), complete=False)
    single = admit(chat_request("required", parallel=False))
    assert accepts(compiler, single, one)
    assert not accepts(compiler, single, one * 2, complete=False)


def test_a_named_function_gets_its_parameters(admission: SimpleNamespace,
                                              compiler: Any) -> None:
    params = admit(chat_request({"type": "function", "function": {"name": "get_weather"}}))
    assert accepts(compiler, params, call("get_weather", '{"city": "Tokyo", "days": 1}'))
    assert not accepts(compiler, params, call("get_weather", "false"), complete=False)
    assert not accepts(compiler, params, call("get_time", '{"tz": "UTC"}'), complete=False)


def test_a_tool_without_parameters_takes_an_object(admission: SimpleNamespace,
                                                   compiler: Any) -> None:
    params = admit(chat_request("required", [tool("ping", None)]))
    assert accepts(compiler, params, call("ping", '{"any": 1}'))
    assert not accepts(compiler, params, call("ping", "1"), complete=False)


@pytest.mark.parametrize(("bad", "words"), [
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}},
     "not a valid JSON Schema"),
    ({"type": "objekt"}, "not a valid JSON Schema"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(a"}}},
     "parenthesis"),
], ids=["meta-schema", "type", "pattern"])
def test_a_bad_parameters_schema_is_a_400_naming_the_tool(admission: SimpleNamespace,
                                                          bad: dict[str, Any],
                                                          words: str) -> None:
    with pytest.raises(VLLMValidationError) as info:
        admit(chat_request("required", [TOOLS[0], tool("broken", bad)]))
    assert info.value.parameter == "tools[1].function.parameters"
    assert "'broken'" in str(info.value) and words in str(info.value)
    # a named call of another tool does not use the broken schema
    params = admit(chat_request({"type": "function", "function": {"name": "get_weather"}},
                                [TOOLS[0], tool("broken", bad)]))
    assert served_tag(params)["format"]["tags"][0]["content"]["json_schema"] == WEATHER


def test_the_setting_vllm_keeps_vllms_tag(admission: SimpleNamespace) -> None:
    admission.config.additional_config = {"grammask": {"tool_arguments": "vllm"}}
    request = chat_request("required")
    params = admit(request)
    assert served_tag(params)["format"]["type"] == "tags_with_separator"
    contents = [t["content"]["json_schema"] for t in served_tag(params)["format"]["tags"]]
    assert contents == [True] * 4


def test_vllms_tag_is_kept_without_the_request_or_with_auto(admission: SimpleNamespace) -> None:
    """No request with this very tag on the stack (another caller), or ``tool_choice``
    ``auto``: vLLM's tag is served as it is."""
    request = chat_request("required")
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        structural_tag=request.structured_outputs.structural_tag))
    del request  # no frame holds it now
    vllm_admission.validate_sampling_params(params)
    assert served_tag(params)["format"]["type"] == "tags_with_separator"
    auto = chat_request("required")
    auto.tool_choice = "auto"
    params = admit(auto)
    assert served_tag(params)["format"]["type"] == "tags_with_separator"


def test_only_vllms_own_request_types_are_read(admission: SimpleNamespace) -> None:
    """The stack walk reads a ``request`` only when it is vLLM's chat or Responses request:
    another object of that name that carries the same tag and tools is not a source."""
    real = chat_request("required")
    request = SimpleNamespace(tools=real.tools, tool_choice="required",
                              structured_outputs=real.structured_outputs)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        structural_tag=real.structured_outputs.structural_tag))
    del real
    vllm_admission.validate_sampling_params(params)
    assert request.tools  # on the stack all along
    assert served_tag(params)["format"]["type"] == "tags_with_separator"


def test_a_strict_tool_keeps_vllms_schema(admission: SimpleNamespace) -> None:
    tools = [tool("get_weather", WEATHER, strict=True), TOOLS[1]]
    tags = served_tag(admit(chat_request("required", tools)))["format"]["content"]["elements"]
    schemas = {t["begin"]: t["content"]["json_schema"] for t in tags}
    assert list(schemas.values()) == [WEATHER, WEATHER, open_objects(TIME), open_objects(TIME)]


def test_open_objects_spells_out_what_json_schema_means() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"type": "object"}},
        "d": {"type": "object", "additionalProperties": False},
        "e": {"const": {"type": "object"}},  # data, not a schema
        "f": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
        "$defs": {"x": {"type": "object", "unevaluatedProperties": False}}}
    out = open_objects(schema)
    assert out["additionalProperties"] is True
    props = out["properties"]
    assert props["a"]["additionalProperties"] is True
    assert props["c"]["items"] == {"type": "object", "additionalProperties": True}
    assert props["d"] == {"type": "object", "additionalProperties": False}
    assert props["e"] == {"const": {"type": "object"}}
    assert props["f"]["anyOf"] == [{"type": "object", "additionalProperties": True},
                                   {"type": "null"}]
    assert out["$defs"]["x"] == schema["$defs"]["x"]
    assert "additionalProperties" not in schema  # the input is not modified



# ------------------------------------------------------------------ issue 51: tools
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
ECHO = {"type": "object", "properties": {"text": {"enum": ["hi", "yo"]}},
        "required": ["text"], "additionalProperties": False}


def schemas_by_begin(tag: Any) -> dict[str, Any]:
    """``begin`` -> the ``json_schema`` of each tool tag in a served tag."""
    out: dict[str, Any] = {}
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            content = node.get("content")
            if node.get("type") == "tag" and isinstance(content, dict) and (
                    content.get("type") == "json_schema"):
                out[node["begin"]] = content["json_schema"]
            stack.extend(v for k, v in node.items() if k != "json_schema")
    return out


@pytest.mark.parametrize(("model", "word", "other"), [
    ("hermes", "arguments", '{{"name": "{name}", "arguments": '),
    ("llama", "name", '{{"name": "{name}", "parameters": '),
], ids=["hermes-arguments", "llama-name"])
def test_a_tool_named_like_the_tags_words_takes_only_its_own_calls(
        admission: SimpleNamespace, model: str, word: str, other: str) -> None:
    """Each tool's tag is matched by its whole ``begin`` (vLLM's tag regenerated for that
    tool), never by the name standing somewhere in it: a tool named ``arguments`` (a word
    of every hermes begin) or ``name`` (of every llama begin) takes none of ``add``'s
    calls. Before: ``add``'s calls took the longer name's schema."""
    tools = [tool("add", ADD), tool(word, ECHO)]
    schemas = schemas_by_begin(served_tag(admit(chat_request("required", tools,
                                                             model=model))))
    for begin, schema in schemas.items():
        owner = "add" if other.format(name="add") in begin else word
        assert other.format(name=owner) in begin, begin
        assert schema == (ADD if owner == "add" else ECHO), (begin, schema)
    assert len(schemas) == (4 if model == "hermes" else 2)


@pytest.mark.parametrize("schema", [{"type": "object", "$schema": []},
                                    {"type": "object", "$schema": 7}], ids=["list", "number"])
def test_a_schema_dialect_that_is_not_a_uri_is_a_400_naming_the_tool(
        admission: SimpleNamespace, schema: dict[str, Any]) -> None:
    """Before: ``TypeError: unhashable type: 'list'`` from jsonschema's dialect lookup,
    which vLLM turns into a 500."""
    with pytest.raises(VLLMValidationError) as info:
        admit(chat_request("required", [TOOLS[0], tool("broken", schema)]))
    assert info.value.parameter == "tools[1].function.parameters"
    assert "'broken'" in str(info.value) and "$schema" in str(info.value)


def nested(levels: int) -> dict[str, Any]:
    """A valid schema ``levels`` subschemas deep (arrays of arrays of ... integers)."""
    schema: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return schema


def under_frames(frames: int, work: Any) -> Any:
    """``work()`` called ``frames`` Python frames deeper than here (the API server's stack
    under the request's coroutine)."""
    return work() if frames == 0 else under_frames(frames - 1, work)


def test_a_schema_200_levels_deep_is_served_under_200_more_frames(
        admission: SimpleNamespace, compiler: Any) -> None:
    """Valid, and vLLM serves it (its own tag builder takes ~250 levels): grammask serves
    its parameters. Before: ``RecursionError`` from the meta-schema check (about 85
    levels under the API server's stack), a 500."""
    deep = nested(200)

    def request_and_admit() -> SamplingParams:
        return admit(chat_request("required", [tool("deep", deep)], parallel=False))

    params = under_frames(200, request_and_admit)
    assert set(map(json.dumps, schemas_by_begin(served_tag(params)).values())) == {
        json.dumps(deep)}
    two_deep = "[" * 200 + "1" + "]" * 200
    assert accepts(compiler, params, call("deep", two_deep))
    assert not accepts(compiler, params, call("deep", "[" * 201 + "1" + "]" * 201),
                       complete=False)


def test_a_fault_of_grammask_serves_vllms_tag_and_logs_it(
        admission: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Anything but an invalid schema that goes wrong in the rewrite is grammask's own
    fault: logged, and vLLM's tag is served unchanged (never a 500)."""
    def broken(*_: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(tool_tags, "strict_tag", broken)
    monkeypatch.setattr(tools_module, "_last_log", [0.0])
    request = chat_request("required")
    with caplog.at_level(logging.WARNING, logger="grammask"):
        params = admit(request)
    served = served_tag(params)["format"]  # vLLM's tag (JSON whitespace bounded as ever)
    assert served["type"] == "tags_with_separator"
    assert set(map(json.dumps, schemas_by_begin(served).values())) == {"true"}
    assert "vLLM's tag is served as vLLM built it" in caplog.text


def llama_call(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def test_llama_calls_are_bounded_and_separated_as_its_parser_reads_them(
        admission: SimpleNamespace, compiler: Any) -> None:
    """llama's ``triggered_tags`` for ``required``: vLLM's tag lets any text follow a
    call (a weak model writes until ``max_tokens``) and two calls side by side, which
    llama3_json's parser reads as content. Served: 1 to ``MAX_TOOL_CALLS`` calls, ``;``
    between two (one whitespace character either side), one after the last."""
    params = admit(chat_request("required", model="llama"))
    one = llama_call("get_time", '{"tz": "UTC"}')
    assert accepts(compiler, params, one)
    assert accepts(compiler, params, one + "\n")
    assert accepts(compiler, params, ";".join([one] * MAX_TOOL_CALLS))
    assert accepts(compiler, params, f"{one} ;\n{one}")
    assert not accepts(compiler, params, ";".join([one] * (MAX_TOOL_CALLS + 1)),
                       complete=False)
    assert not accepts(compiler, params, one + one, complete=False)
    assert not accepts(compiler, params, one + "  ;" + one, complete=False)
    assert not accepts(compiler, params, one + " and then", complete=False)
    assert not accepts(compiler, params, "Sure: " + one, complete=False)


def qwen_call(name: str, **values: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen_xml_calls_get_bounded_gaps_and_untouched_values(
        admission: SimpleNamespace, compiler: Any) -> None:
    """qwen3_coder's tag: between and after calls one whitespace character, between
    parameters one at a time; a string value keeps every character, the newlines around
    it that vLLM's Qwen3 parser strips included."""
    note = {"type": "object", "properties": {"text": {"type": "string"}},
            "required": ["text"], "additionalProperties": False}
    params = admit(chat_request("required", [*TOOLS, tool("note", note)],
                                model="qwen_3_coder"))
    one = qwen_call("get_time", tz="UTC")
    assert accepts(compiler, params, one + "\n" + qwen_call("note", text="a  \n\n b  ") + "\n")
    assert accepts(compiler, params, qwen_call("note", text="\n\n  x  \n\n"))
    assert not accepts(compiler, params, one + "\n\n" + one, complete=False)
    assert not accepts(compiler, params, one + " text", complete=False)
    assert not accepts(compiler, params, qwen_call("get_time", tz=" UTC"), complete=False)
    assert not accepts(compiler, params, one.replace("\n<parameter", "\n\n\n<parameter"),
                       complete=False)
    assert not accepts(compiler, params, (one + "\n") * MAX_TOOL_CALLS + one,
                       complete=False)
