"""Forced tool calls in every format vLLM 0.34 builds a structural tag for, read back by
vLLM's own parsers (issue 51).

For each model key of vLLM's structural-tag registry that a tool parser uses (hermes,
qwen3_coder/qwen3_xml, llama3_json, deepseek_*, glm47, kimi_k2, longcat, mimo, minimax,
plamo3, ...), ``tool_choice`` ``"required"`` and named: vLLM's own ``DelegatingParser``
builds the request's tag (``adjust_request``, as its chat server does), grammask's
admission hook rewrites it (``validate_sampling_params`` with the request on the stack),
grammask's compiler masks it over the Qwen tokenizer of ``vllm_fixtures.model_dir``, and
random walks of that mask (any token; never a stop token while another is allowed: the
longest paths; whitespace wherever allowed) must each end, and parse back through vLLM's
serving-layer call (``_extract_tool_calls``) into calls of declared tools whose arguments
pass ``jsonschema`` against the tool's ``parameters`` (one call where only one is
allowed, at most ``MAX_TOOL_CALLS``).

The tools' values are enums, bounded integers and booleans: every walk ends. Two faults of
xgrammar 0.2.8's grammars that no tag rewrite reaches: a string with ``minLength`` or
``maxLength`` takes raw control characters, which JSON parsers refuse (left out of the
schemas); an XML-style value may carry one whitespace character next to it (grammask bounds
it to one), which vLLM's parsers keep (``problems`` also reads such a value without it).

Runs with vLLM 0.34's Python first on the path (``make unit34``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from typing import Any

import jsonschema
import pytest

from .vllm_fixtures import model_dir, v34_missing  # first: CPU platform before vLLM

# isort: split
if why := v34_missing():
    pytest.skip(why, allow_module_level=True)

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import DelegatingParser
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

from grammask import Vocabulary
from grammask.compile.compiler import Compiler
from grammask.integrations.vllm import admission as vllm_admission
from grammask.integrations.vllm.tools import MAX_TOOL_CALLS
from grammask.specs.request import parse_extra_args
from grammask.vocab import load_vocabulary

from .tool_formats import stand_in_admission, texts, tool_parsers

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Tokyo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {
    "tz": {"type": "string", "enum": ["UTC", "CET"]}, "h24": {"type": "boolean"}},
    "required": ["tz"], "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}}
         for n, p in PARAMS.items()]
CHOICES: dict[str, Any] = {"required": "required",
                           "named": {"type": "function", "function": {"name": "get_time"}}}
#: walks per policy, and the most tokens one may take (16 calls of these tools: < 900)
WALKS, STEPS = 2, 1500
#: keys left out, and why: tags that hold no argument schema at any strict level (vLLM's
#: own ``--tool-strict-level parameter`` included), and a format no tool parser reads
LEFT_OUT = {
    "hy_v4": "argument values are any_text in vLLM's tags: no parameters to serve",
    "kimi_k3": "argument values and the response text are any_text in vLLM's tags: no "
               "parameters to serve",
    "harmony": "vLLM reads gpt-oss calls with its HarmonyParser over the harmony encoding "
               "(its tool parser is a stub), which the Qwen tokenizer cannot carry"}
MODELS = sorted({model for model, _ in tool_parsers().values()})


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return load_vocabulary(str(model_dir()))


@pytest.fixture(scope="module")
def compiler(vocab: Vocabulary) -> Any:
    compiler = Compiler(vocab, timeout_s=60, tune_fill=False)
    yield compiler
    compiler.close()


@cache
def tokenizer() -> Any:
    return get_tokenizer(str(model_dir()))


def parser_of(cls: type, tag: str) -> Any:
    """vLLM's ``DelegatingParser`` around tool parser ``cls``, as its server composes it.
    A parser that looks its markers up in the vocabulary (deepseek's ``<｜tool▁sep｜>``,
    ...) gets the tag's markers added to its copy of the Qwen tokenizer."""
    composed = type("Composed", (DelegatingParser,), {"tool_parser_cls": cls})
    try:
        return composed(tokenizer(), None)
    except Exception:  # markers missing from the Qwen vocabulary
        from transformers import AutoTokenizer

        marked = AutoTokenizer.from_pretrained(str(model_dir()))
        marked.add_tokens(sorted(set(re.findall(r"<[｜|][^<>]*?[｜|]>", tag))),
                          special_tokens=True)
        return composed(marked, None)


def forced_request(model: str, choice: str) -> tuple[ChatCompletionRequest, list[Any]]:
    """A chat request as vLLM's chat server leaves it for ``model``'s first parser (its
    tag in ``structured_outputs``), and a parser of each tool parser of ``model``."""
    classes = [cls for m, cls in tool_parsers().values() if m == model]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    tools=TOOLS, tool_choice=CHOICES[choice])
    markers = get_model_structural_tag(model, request.tools, request.tool_choice, False)
    text = json.dumps(markers.model_dump(), ensure_ascii=False)
    parsers = [parser_of(cls, text) for cls in classes]
    request = parsers[0].adjust_request(request)
    assert request.structured_outputs is not None, model
    return request, parsers


def admit(request: ChatCompletionRequest) -> SamplingParams:
    """vLLM's flow: params from the request, validated with the request on the stack."""
    params = SamplingParams(max_tokens=8, structured_outputs=request.structured_outputs)
    vllm_admission.validate_sampling_params(params)
    return params


def problems(request: ChatCompletionRequest, parser: Any, text: str, *,
             xml: bool) -> list[str]:
    """What is wrong with ``text`` as the reply to a forced call (empty: valid calls).

    ``xml``: arguments written in an XML style, where xgrammar 0.2.8 lets one whitespace
    character stand next to a value that vLLM's parsers keep (the module doc): a value is
    also read without it."""
    calls, _ = parser._extract_tool_calls(text, request, enable_auto_tools=True)
    choice = request.tool_choice
    named = None if isinstance(choice, str) else choice.function.name
    one = named is not None or request.parallel_tool_calls is False
    out = [] if calls else ["no tool call"]
    if calls and (len(calls) > MAX_TOOL_CALLS or (one and len(calls) != 1)):
        out.append(f"{len(calls)} calls")
    for call in calls or ():
        if call.name not in PARAMS or (named and call.name != named):
            out.append(f"a call of {call.name!r}")
            continue
        try:
            arguments = json.loads(call.arguments)
            if xml and not _valid(arguments, PARAMS[call.name]):
                arguments = {k: _trimmed(v) for k, v in arguments.items()}
            jsonschema.validate(arguments, PARAMS[call.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            out.append(f"{call.name} {call.arguments!r}: {str(exc).splitlines()[0]}")
    return out


def _styles(node: Any) -> list[str]:
    """The ``style`` of each ``json_schema`` content in a tag."""
    if isinstance(node, list):
        return [s for v in node for s in _styles(v)]
    if not isinstance(node, dict):
        return []
    own = [str(node.get("style", "json"))] if node.get("type") == "json_schema" else []
    return own + [s for k, v in node.items() if k != "json_schema" for s in _styles(v)]


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _trimmed(value: Any) -> Any:
    """A string without one whitespace character at either end (xgrammar's XML slack)."""
    if isinstance(value, str) and value[:1].isspace():
        value = value[1:]
    if isinstance(value, str) and value[-1:].isspace():
        value = value[:-1]
    return value


@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("model", MODELS)
def test_walks_of_the_mask_parse_back_to_valid_calls(
        monkeypatch: pytest.MonkeyPatch, vocab: Vocabulary, compiler: Any, model: str,
        choice: str) -> None:
    if model in LEFT_OUT:
        pytest.skip(f"{model}: {LEFT_OUT[model]}")
    stand_in_admission(monkeypatch)
    request, parsers = forced_request(model, choice)
    params = admit(request)
    spec = parse_extra_args(params.extra_args)
    assert spec is not None
    grammar = compiler.compile(spec.spec)
    xml = bool(set(_styles(json.loads(spec.spec.source))) - {"json"})
    for policy, text, ended in texts(grammar.matcher, vocab, seed=7, walks=WALKS,
                                     steps=STEPS):
        assert ended, (policy, text[-200:])
        for parser in parsers:
            found = problems(request, parser, text, xml=xml)
            assert not found, (type(parser._tool_parser).__name__, policy, found, text)


def test_mistral() -> None:
    """Mistral's forced calls are a lark grammar over Mistral's own tokenizer (vLLM's
    Mistral parser; a JSON schema on older or HF tokenizers), not a structural tag."""
    if importlib.util.find_spec("mistral_common") is None:
        pytest.skip("mistral_common is not installed: vLLM's Mistral parser, its lark "
                    "grammar for forced calls and Mistral's tokenizer cannot be loaded")
    pytest.skip("mistral: walks of its lark grammar on Mistral's tokenizer are not built "
                "yet (issue 51)")
