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

Mistral (``test_mistral_*``, where ``mistral_common`` is installed) is no structural tag:
on a grammar-capable Tekken tokenizer vLLM's Mistral parser makes a forced call a lark
grammar (``structured_outputs.grammar``, ``mistral_common``'s ``GrammarFactory``), masked
here over that tokenizer's own vocabulary (a real Tekken vocabulary as a v11 file:
``vllm_fixtures.mistral_dir``) and read back by vLLM's Mistral parser.

Runs with vLLM 0.34's Python first on the path (``make unit34``).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from functools import cache
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from ...vllm_fixtures import mistral_dir, model_dir, v34_missing  # first: CPU platform before vLLM

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

from ...tool_formats import (
    POLICIES,
    Policy,
    capped,
    spacious,
    stand_in_admission,
    texts,
    tool_parsers,
)

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


# ---------------------------------------------------------------------------- Mistral
#: Mistral's grammar follows a tool's ``parameters`` only where the tool is ``strict``
#: (else ``{"type": "object"}`` and, for ``"required"``, any name: mistral_common's
#: ``_convert_tool_calls``), so these tools are strict
MISTRAL_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p, "strict": True}}
                 for n, p in PARAMS.items()]
#: walks per policy, and the calls a walk of a parallel request stops after (Mistral's
#: ``(call)+`` has no bound: its longest walks would never end)
MISTRAL_WALKS, MISTRAL_CALLS = 3, 3


@pytest.fixture(scope="module")
def mistral() -> Iterator[tuple[Any, Vocabulary, Any]]:
    """vLLM's ``MistralTokenizer`` of ``vllm_fixtures.mistral_dir``, grammask's vocabulary
    of it as the plugin builds it (``vocabulary_from_vllm``, vLLM's tokenizer cache standing
    in), and a compiler over it.

    The tokenizer is a real Tekken vocabulary with the version and special tokens of a v11
    file: ``mistral_common``'s own ``tekken_240911.json`` (a v3 file: 131,072 ids, 1,000 of
    them special, no ``special_tokens`` list) with ``config.version`` ``"v11"`` and the
    special tokens of a v11 file (the 20 defaults, ``[TOOL_CALLS]`` = 9, then ``[ARGS]`` =
    32, ``[CALL_ID]`` = 33), so vLLM finds it grammar-capable as it finds Mistral Small 3.2's.
    No network: no real v11 file is at hand."""
    if importlib.util.find_spec("mistral_common") is None:
        pytest.skip("mistral_common is not installed: vLLM's Mistral parser, its lark "
                    "grammar for forced calls and Mistral's tokenizer cannot be loaded")
    import vllm.tokenizers
    from vllm.tokenizers.mistral import MistralTokenizer

    from grammask.integrations.vllm.process import vocabulary_from_vllm

    tok = MistralTokenizer.from_pretrained(str(mistral_dir()))
    assert tok.supports_grammar and tok.version == 11
    config = SimpleNamespace(tokenizer=str(mistral_dir()), tokenizer_mode="mistral",
                             get_vocab_size=lambda: tok.vocab_size, hf_text_config=None,
                             try_get_generation_config=lambda: None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm.tokenizers, "cached_tokenizer_from_config", lambda _: tok)
        vocab = vocabulary_from_vllm(config)
    compiler = Compiler(vocab, timeout_s=60, tune_fill=False)
    yield tok, vocab, compiler
    compiler.close()


def test_mistral_vocabulary_is_tekkens_own_bytes(mistral: tuple[Any, Vocabulary, Any]
                                                 ) -> None:
    """Every token's bytes are the Tekkenizer's own (``get_vocab`` spells the 128 high
    byte tokens, and each token holding part of a character, as U+FFFD, and keeps one id
    per spelling); special tokens are special, spelled as Mistral spells them."""
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

    tok, vocab, _ = mistral
    tekken = tok.tokenizer
    assert len(vocab.tokens) == vocab.vocab_size == tekken.n_words == 131_072
    wrong = [i for i in range(tekken.n_words)
             if vocab.tokens[i] != tekken.id_to_byte_piece(i, SpecialTokenPolicy.KEEP)]
    assert not wrong, wrong[:10]
    assert len(tok.get_vocab()) < tekken.n_words  # the spellings grammask does not use
    assert vocab.special_ids == frozenset(range(tekken.num_special_tokens))
    assert vocab.stop_ids == (tekken.eos_id,)
    assert (vocab.token_id("[TOOL_CALLS]"), vocab.token_id("[ARGS]")) == (9, 32)
    text = 'Zoë {"a": [1, 2]}\n\t中文 😀 [TOOL_CALLS]'
    assert vocab.encode(text) == tekken.encode(text, bos=False, eos=False)
    assert vocab.decode(vocab.encode(text)).decode() == text


def test_mistral_sentencepiece_tokenizer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SentencePiece Mistral tokenizer (older models): grammask stands aside on such a
    server (``compat.unserved``: the drop-in leaves structured outputs to vLLM's engine, the
    processor is inert, the server starts), and refuses to build a vocabulary, rather than
    serve masks over token bytes it has not checked."""
    import vllm.tokenizers

    from grammask.integrations.vllm import compat
    from grammask.integrations.vllm.process import mistral_vocabulary

    spm = type("MistralTokenizer", (), {"IS_MISTRAL_TOKENIZER": True, "is_tekken": False,
                                        "is_spm": True})()
    with pytest.raises(RuntimeError, match="SentencePiece MistralTokenizer"):
        mistral_vocabulary(spm, vocab_size=32_768, stop_ids=[2], name="m")
    monkeypatch.setattr(vllm.tokenizers, "cached_tokenizer_from_config", lambda mc: spm)
    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer_mode="mistral"))
    assert "SentencePiece" in compat.unserved(config, "v2")
    tekken = type("MistralTokenizer", (), {"IS_MISTRAL_TOKENIZER": True, "is_tekken": True})()
    monkeypatch.setattr(vllm.tokenizers, "cached_tokenizer_from_config", lambda mc: tekken)
    assert compat.unserved(config, "v2") == ""


def mistral_request(tok: Any, choice: str, parallel: bool
                    ) -> tuple[ChatCompletionRequest, Any]:
    """A chat request as vLLM's chat server leaves it for the Mistral tool parser on
    Mistral's tokenizer (its lark grammar in ``structured_outputs.grammar``), and vLLM's
    ``DelegatingParser`` around that parser."""
    from vllm.tool_parsers.mistral_tool_parser import MistralToolParser

    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=MISTRAL_TOOLS,
        tool_choice=CHOICES[choice], parallel_tool_calls=parallel)
    composed = type("Composed", (DelegatingParser,), {"tool_parser_cls": MistralToolParser})
    parser = composed(tok, None)
    request = parser.adjust_request(request)
    assert request.structured_outputs is not None
    assert isinstance(request.structured_outputs.grammar, str), request.structured_outputs
    return request, parser


def mistral_problems(request: ChatCompletionRequest, parser: Any, text: str) -> list[str]:
    """What is wrong with ``text`` as the reply to a forced call (empty: valid calls):
    calls of declared tools (of the named one where named), one where the request allows
    one, at most ``MISTRAL_CALLS``, arguments valid against the tool's ``parameters``."""
    calls, _ = parser._extract_tool_calls(text, request, enable_auto_tools=True)
    choice = request.tool_choice
    named = None if isinstance(choice, str) else choice.function.name
    out = [] if calls else ["no tool call"]
    if calls and (len(calls) > MISTRAL_CALLS
                  or (request.parallel_tool_calls is False and len(calls) != 1)):
        out.append(f"{len(calls)} calls")
    for call in calls or ():
        if call.name not in PARAMS or (named and call.name != named):
            out.append(f"a call of {call.name!r}")
            continue
        try:
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            out.append(f"{call.name} {call.arguments!r}: {str(exc).splitlines()[0]}")
    return out


def served_text(tok: Any, tokens: list[int]) -> str:
    """``tokens`` as vLLM's engine detokenizes a Mistral tokenizer's output for the chat
    server: its slow incremental detokenizer, one token at a time, with the server's default
    ``skip_special_tokens=True`` (``MistralTokenizer`` keeps ``[TOOL_CALLS]`` and ``[ARGS]``
    there, for its tool parser)."""
    from vllm.tokenizers.detokenizer_utils import (
        convert_prompt_ids_to_tokens,
        detokenize_incrementally,
    )

    ids = [tok.bos_token_id]
    pieces, prefix, read = convert_prompt_ids_to_tokens(tok, ids, skip_special_tokens=True)
    out = []
    for token in tokens:
        ids.append(token)
        new, text, prefix, read = detokenize_incrementally(
            tok, ids, pieces, prefix, read, skip_special_tokens=True,
            spaces_between_special_tokens=True)
        pieces.extend(new)
        out.append(text)
    return "".join(out)


def mistral_policies(calls: int, parallel: bool) -> dict[str, Policy]:
    """This walk's policies: ``POLICIES``; for a parallel request, each stops after
    ``MISTRAL_CALLS`` calls (token ``calls``)."""
    out = dict(POLICIES)
    if parallel:
        out = {name: capped(policy, calls, MISTRAL_CALLS) for name, policy in out.items()}
    return out


def mistral_grammar(monkeypatch: pytest.MonkeyPatch, tok: Any, compiler: Any, choice: str,
                    parallel: bool) -> tuple[ChatCompletionRequest, Any, Any]:
    """(request, parser, grammask's grammar): the request as vLLM's chat server leaves it,
    taken over by grammask's admission as a server's would, compiled by ``compiler``."""
    stand_in_admission(monkeypatch)
    request, parser = mistral_request(tok, choice, parallel)
    params = admit(request)
    spec = parse_extra_args(params.extra_args)
    assert spec is not None and spec.spec.kind == "grammar", params.extra_args
    assert params.structured_outputs is None  # vLLM's engine leaves it to grammask
    return request, parser, compiler.compile(spec.spec)


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_mistral_walks_parse_back_to_valid_calls(
        monkeypatch: pytest.MonkeyPatch, mistral: tuple[Any, Vocabulary, Any], choice: str,
        parallel: bool) -> None:
    """Mistral's forced calls (vLLM's Mistral parser on a grammar-capable Tekken tokenizer:
    a lark grammar over Mistral's special tokens, ``<[9]>`` = ``[TOOL_CALLS]``, ``<[32]>`` =
    ``[ARGS]``, not a structural tag): grammask's admission takes the grammar over,
    grammask's compiler masks it over the Tekken vocabulary, and walks of the mask (any
    token; the longest; whitespace wherever allowed; a parallel request's walks stop after
    ``MISTRAL_CALLS`` calls) end and parse
    back, through vLLM's serving-layer call over vLLM's own detokenization
    (``served_text``), into valid calls (``mistral_problems``)."""
    tok, vocab, compiler = mistral
    request, parser, grammar = mistral_grammar(monkeypatch, tok, compiler, choice, parallel)
    calls = vocab.token_id("[TOOL_CALLS]")
    seen = 0
    for policy, text, ended in texts(
            grammar.matcher, vocab, seed=11, walks=MISTRAL_WALKS, steps=STEPS,
            policies=lambda: mistral_policies(calls, parallel),
            decode=lambda tokens: served_text(tok, tokens)):
        assert ended, (policy, text[-200:])
        assert text.startswith("[TOOL_CALLS]"), (policy, text)
        found = mistral_problems(request, parser, text)
        assert not found, (policy, found, text)
        seen += 1
    assert seen == MISTRAL_WALKS * len(POLICIES)


def test_mistral_whitespace_in_arguments_is_bounded(
        monkeypatch: pytest.MonkeyPatch, mistral: tuple[Any, Vocabulary, Any]) -> None:
    """``spacious`` walks (whitespace wherever allowed, no bound) of a forced call end: the
    drop-in bounds the whitespace of Mistral's ``%json`` arguments
    (``dropin.bounded_lark_json``), where llguidance alone takes it without bound."""
    tok, vocab, compiler = mistral
    _, _, grammar = mistral_grammar(monkeypatch, tok, compiler, "named", False)
    _, _, ended = next(texts(grammar.matcher, vocab, seed=11, walks=1, steps=STEPS,
                             policies=lambda: {"spacious": spacious}))
    assert ended
