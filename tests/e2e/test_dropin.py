"""The drop-in on a real server: a client sends only standard fields (``response_format``,
``structured_outputs``, tools, the Responses API's ``text.format``, ``/v1/completions``,
the SDK's ``parse``), no grammask key. Every output is checked by an independent validator
(jsonschema, ``regex``, ``lark``, pydantic), and grammask's own counter on vLLM's ``/metrics``
shows that grammask served each request, not vLLM's engine (tiny random Qwen2.5-layout
model: every valid output is the mask's doing)."""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.oracles import check_json, check_lark, check_regex, json_prefix_ok
from tests.e2e.server import MODEL_NAME, Server
from tests.e2e.specs import LLG_SCHEMA, REGEX, XG_SCHEMA
from tests.e2e.standard import (
    PERSON,
    WEATHER_PARAMS,
    response_format,
    served,
    served_by_grammask,
    weather_tool,
)

REPS = 4
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]
GBNF = 'root ::= "x" [0-9] [0-9]? ("+" [0-9])*'
GBNF_REGEX = r"x[0-9][0-9]?(\+[0-9])*"
LARK = 'start: "v" DIGIT+ ("," WORD)?\nWORD: /[a-z]{1,4}/\n%import common.DIGIT'
LARK_REGEX = r"v[0-9]+(,[a-z]{1,4})?"


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server  # shared with the other drop-in module (conftest)


def chat(client: Any, seed: int, *, max_tokens: int = 64, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_tokens=max_tokens, temperature=1.0, seed=seed,
                                          **kw).choices[0]


def chat_reps(client: Any, **kw: Any) -> list[tuple[str, str]]:
    """``REPS`` requests sent together (the server batches them): (finish, content)."""
    with ThreadPoolExecutor(REPS) as pool:
        choices = list(pool.map(lambda s: chat(client, s, **kw), range(1, REPS + 1)))
    return [(c.finish_reason, c.message.content or "") for c in choices]


# ------------------------------------------------------------------- response_format
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_response_format_json_schema(server: Server, client: Any, strict: bool) -> None:
    """Valid and finished every time: the default compact whitespace leaves a weak model
    no room to run to max_tokens on whitespace (vLLM's engine did, 4 of 4)."""
    results, counts = served_by_grammask(server, lambda: chat_reps(
        client, response_format=response_format(PERSON, strict=strict)))
    for finish, text in results:
        check_json(text, finish, PERSON, must_stop=True)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', text)), text  # compact
    assert counts == {"json_schema": REPS}, counts


def test_response_format_json_object(server: Server, client: Any) -> None:
    results, counts = served_by_grammask(server, lambda: chat_reps(
        client, response_format={"type": "json_object"}))
    for finish, text in results:
        assert text.startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:  # free-form strings of a random model may be long: a valid prefix
            assert finish == "length" and json_prefix_ok(text), (finish, text)
    assert counts == {"json_object": REPS}, counts


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    indoor: bool


def test_sdk_parse_with_a_pydantic_model(server: Server, client: Any) -> None:
    """``chat.completions.parse`` (strict json_schema from the model): ``parsed`` is a
    ``Pet`` every time; before the drop-in the SDK raised a length error."""
    def run() -> list[Any]:
        with ThreadPoolExecutor(REPS) as pool:
            return list(pool.map(lambda s: client.chat.completions.parse(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=64, seed=s,
                response_format=Pet).choices[0], range(1, REPS + 1)))
    choices, counts = served_by_grammask(server, run)
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet), choice.message
    assert counts == {"json_schema": REPS}, counts


def test_streamed_json_schema(server: Server, client: Any) -> None:
    def run() -> tuple[str, str | None]:
        parts: list[str] = []
        finish = None
        for chunk in client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=64, seed=3, stream=True,
                response_format=response_format(XG_SCHEMA, strict=True)):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish
    (text, finish), counts = served_by_grammask(server, run)
    check_json(text, str(finish), XG_SCHEMA, must_stop=True)
    assert counts == {"json_schema": 1}, counts


# -------------------------------------------------------- the structured_outputs field
@pytest.mark.parametrize(("field", "check"), [
    ({"regex": REGEX}, ("regex", REGEX)),
    ({"choice": ["alpha", "beta", "gamma delta", "€uro"]},
     ("regex", r"alpha|beta|gamma delta|€uro")),
    ({"grammar": GBNF}, ("regex", GBNF_REGEX)),
    ({"grammar": LARK}, ("lark", LARK)),
    ({"json": LLG_SCHEMA}, ("json", LLG_SCHEMA)),
    ({"json": XG_SCHEMA, "disable_any_whitespace": True}, ("json", XG_SCHEMA)),
    ({"json": {"type": "object", "properties": {"a": {"type": "boolean"}},
               "required": ["a"]}, "disable_additional_properties": True},
     ("json", {"type": "object", "properties": {"a": {"type": "boolean"}},
               "required": ["a"], "additionalProperties": False})),
], ids=["regex", "choice", "gbnf", "lark", "json-llg", "json-compact", "json-no-extra"])
def test_structured_outputs_field(server: Server, client: Any, field: dict[str, Any],
                                  check: tuple[str, Any]) -> None:
    results, counts = served_by_grammask(server, lambda: chat_reps(
        client, extra_body={"structured_outputs": field}))
    kind, what = check
    for finish, text in results:
        if kind == "json":
            check_json(text, finish, what, must_stop=True)
        elif kind == "lark":
            check_lark(what, text, finish, LARK_REGEX)
        else:
            check_regex(what, text, finish)
    assert sum(counts.values()) == REPS, counts


def test_whitespace_pattern_is_honoured(server: Server, client: Any) -> None:
    """``whitespace_pattern`` replaces the compact default (routed to llguidance, which
    reads it as the alphabet of JSON whitespace, repeatable, as vLLM's guidance backend
    does): between JSON tokens only spaces, never the newlines or tabs JSON also allows."""
    results, counts = served_by_grammask(server, lambda: chat_reps(
        client, extra_body={"structured_outputs": {"json": XG_SCHEMA,
                                                   "whitespace_pattern": "[ ]"}}))
    for finish, text in results:
        check_json(text, finish, XG_SCHEMA, must_stop=False)
        outside = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        assert not re.search(r"[\n\r\t]", outside), text
    assert counts == {"json_schema": REPS}, counts


# ------------------------------------------------------------------------------ tools
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_with_a_strict_tool(server: Server, client: Any, choice: str) -> None:
    """vLLM builds a structural tag (hermes ``<tool_call>``); grammask masks it: every reply
    has one tool call (``parallel_tool_calls=False``; with parallel calls a random model
    keeps calling) of the named function, arguments obeying ``parameters``."""
    tool_choice: Any = ("required" if choice == "required" else
                        {"type": "function", "function": {"name": "get_weather"}})
    choices, counts = served_by_grammask(server, lambda: [
        chat(client, s, max_tokens=96, tools=[weather_tool(strict=True)],
             tool_choice=tool_choice, parallel_tool_calls=False)
        for s in range(1, REPS + 1)])
    for c in choices:
        calls = c.message.tool_calls
        assert calls and len(calls) == 1, (c.finish_reason, c.message)
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert counts == {"structural_tag": REPS}, counts


def test_tool_choice_required_with_a_non_strict_tool(server: Server, client: Any) -> None:
    """A tool without ``strict``: vLLM's tag leaves the arguments any JSON value; grammask
    puts the tool's ``parameters`` back (``tool_arguments=parameters``; more cases in
    test_dropin_tools.py): every reply is one call of the function, arguments valid."""
    choices, counts = served_by_grammask(server, lambda: [
        chat(client, s, max_tokens=64, tools=[weather_tool(strict=False)],
             tool_choice="required", parallel_tool_calls=False)
        for s in range(1, REPS + 1)])
    for c in choices:
        assert c.finish_reason == "tool_calls", c
        assert c.message.tool_calls and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert counts == {"structural_tag": REPS}, counts


def test_a_forced_required_call_ends_as_tool_calls(server: Server, client: Any) -> None:
    """Issue 51: ``tool_choice`` ``"required"`` with parallel calls allowed (the default)
    and a tool without ``strict``, fixed seeds: every reply ends with its calls
    (``finish_reason`` ``"tool_calls"``, at most 16 calls, arguments valid), and its raw
    text (the sampled tokens, from logprobs) never holds a run of more than 2 whitespace
    characters (JSON whitespace one at a time, no free text between or after calls)."""
    choices, counts = served_by_grammask(server, lambda: [
        chat(client, s, max_tokens=640, tools=[weather_tool(strict=False)],
             tool_choice="required", logprobs=True)
        for s in range(1, REPS + 1)])
    for c in choices:
        raw = "".join(t.token for t in c.logprobs.content)
        assert c.finish_reason == "tool_calls", (c.finish_reason, raw[-200:])
        assert not re.search(r"\s{3,}", raw), raw
        calls = c.message.tool_calls
        assert calls and len(calls) <= 16, raw
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert counts == {"structural_tag": REPS}, counts


# ---------------------------------------------------------- completions and Responses
def test_completions_structured_outputs(server: Server, client: Any) -> None:
    def run() -> list[Any]:
        return [client.completions.create(
            model=MODEL_NAME, prompt="A person as JSON:", max_tokens=64, seed=s,
            extra_body={"structured_outputs": {"json": PERSON}}).choices[0]
            for s in range(1, REPS + 1)]
    choices, counts = served_by_grammask(server, run)
    for c in choices:
        check_json(c.text, c.finish_reason, PERSON, must_stop=True)
    assert counts == {"json_schema": REPS}, counts


def test_responses_api_text_format(server: Server, client: Any) -> None:
    def run() -> list[Any]:
        return [client.responses.create(
            model=MODEL_NAME, input="A person as JSON.", max_output_tokens=64,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                             "strict": True}}) for _ in range(REPS)]
    replies, counts = served_by_grammask(server, run)
    for reply in replies:
        jsonschema.validate(json.loads(reply.output_text), PERSON)
    assert counts == {"json_schema": REPS}, counts


# ------------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("kwargs", [
    {"extra_body": {"structured_outputs": {"regex": "[a-"}}},
    {"response_format": response_format({"type": "object", "properties": {
        "a": {"type": "nope"}}}, strict=True)},
    {"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}},
    {"tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
     "tool_choice": "required"},
], ids=["regex", "response_format", "grammar", "tool-parameters"])
def test_bad_constraint_is_400_and_the_server_goes_on(client: Any,
                                                      kwargs: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, 1, max_tokens=8, **kwargs)
    assert info.value.status_code == 400
    finish, text = chat_reps(client, extra_body={"structured_outputs": {"regex": REGEX}})[0]
    check_regex(REGEX, text, finish)


# ------------------------------------------------------------- opting out per request
def test_a_request_can_ask_for_vllms_engine(server: Server, client: Any) -> None:
    """``vllm_xargs: {"grammask_structured_outputs": "vllm"}`` (A/B on one server): vLLM's
    engine serves it, grammask's counter does not move."""
    before = served(server)
    finish, text = chat_reps(client, extra_body={
        "structured_outputs": {"regex": REGEX},
        "vllm_xargs": {"grammask_structured_outputs": "vllm"}})[0]
    check_regex(REGEX, text, finish)  # vLLM's engine enforces a regex too
    assert served(server) == before


# ------------------------------------------------------- the host's own processors
CHOICE = ["red", "green"]


def _conflicts(server: Server) -> float:
    base = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("grammask_host_conflicts_total"))


@pytest.mark.parametrize(("options", "pattern", "conflict"), [
    ({"min_tokens": 8}, "red|green", True),
    ({"allowed_token_ids": [87, 88, 89]}, "[a-c]{3}", True),  # x, y, z: none allowed
    ({"bad_words": ["red", "green"]}, "red|green", False),
    ({"ignore_eos": True}, "red|green", False),
], ids=["min_tokens", "allowed_token_ids", "bad_words", "ignore_eos"])
def test_host_processors_never_let_an_invalid_token_through(
        server: Server, client: Any, options: dict[str, Any], pattern: str,
        conflict: bool) -> None:
    """vLLM's own processors run before grammask's mask. Where they leave no token the
    grammar allows, the grammar wins: its tokens come back (and the stop, once it is
    complete); the text is never outside the constraint. (vLLM's engine, same requests:
    min_tokens and bad_words 'green' stop; allowed_token_ids a 500; ignore_eos free text
    after the grammar ended.)"""
    so = ({"regex": pattern} if "allowed_token_ids" in options else {"choice": CHOICE})
    before = _conflicts(server)
    for seed in (1, 2):
        c = chat(client, seed, max_tokens=20, extra_body={"structured_outputs": so, **options})
        text = c.message.content or ""
        assert re.fullmatch(pattern, text), (c.finish_reason, text)
        assert c.finish_reason == ("length" if options.get("ignore_eos") else "stop")
    if conflict:
        assert _conflicts(server) > before  # the grammar-wins path did the work


def test_logit_bias_against_every_allowed_token(client: Any) -> None:
    """The most negative bias vLLM accepts on every first token of the choices: still a
    choice (the bias is finite, so the mask leaves those tokens their relative order)."""
    ids = {str(t) for word in CHOICE for t in _first_tokens(client, word)}
    c = chat(client, 3, max_tokens=8, logit_bias={t: -100 for t in ids},
             extra_body={"structured_outputs": {"choice": CHOICE}})
    assert c.message.content in CHOICE and c.finish_reason == "stop", c


def _first_tokens(client: Any, word: str) -> list[int]:
    """The first token id of ``word`` by the server's own tokenizer (``/tokenize``)."""
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    request = urllib.request.Request(
        f"{base}/tokenize", data=json.dumps({"model": MODEL_NAME, "prompt": word}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return [int(json.loads(reply.read())["tokens"][0])]
