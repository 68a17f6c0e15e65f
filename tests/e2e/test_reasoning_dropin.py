"""The drop-in on a reasoning server (tiny random Qwen3 layout, ``--reasoning-parser qwen3``,
hermes tools): standard fields only. Masks start exactly where vLLM's parser ends reasoning:
the ``reasoning``/``content`` split the client sees is the free part and the constrained
part. Also the three cases vLLM's own engine gets wrong (its issue threads): a reasoning
parser with ``/v1/completions`` (#57726), with the Responses API (#44012) and with
``enable_thinking=false``: each is constrained here."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json
from tests.e2e.server import MODEL_NAME, Server
from tests.e2e.standard import (
    WEATHER_PARAMS,
    reasoning_of,
    response_format,
    served_by_grammask,
    weather_tool,
)
from tests.e2e.test_thinking import BIAS, MESSAGES, SCHEMA

OFF = {"chat_template_kwargs": {"enable_thinking": False}}
REPS = 5


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen3_dir: Path) -> Iterator[Server]:
    yield start_server("qwen3-reasoning-dropin", qwen3_dir,
                       env={"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")},
                       args=["--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes"])


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return server.client()


def chat(client: Any, seed: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=kw.pop("max_tokens", 128),
        temperature=1.0, seed=seed, **kw).choices[0]


def chat_reps(client: Any, **kw: Any) -> list[Any]:
    with ThreadPoolExecutor(REPS) as pool:
        return list(pool.map(lambda s: chat(client, s, **kw), range(1, REPS + 1)))


def test_startup_log_names_the_parsers_end_marker(server: Server) -> None:
    lines = [line for line in server.log_text().splitlines()
             if "grammask serves vLLM's structured outputs" in line]
    assert lines and all("'</think>'" in line and "qwen3" in line for line in lines), lines


def test_thinking_on_reasoning_free_content_constrained(server: Server, client: Any) -> None:
    """Reasoning (before ``</think>``) is free; the content after it is the schema's JSON
    from its first character."""
    choices, counts = served_by_grammask(server, lambda: chat_reps(
        client, response_format=response_format(SCHEMA, strict=True), logit_bias=BIAS))
    closed = 0
    for c in choices:
        if not c.message.content:
            assert c.finish_reason == "length", c  # still reasoning at max_tokens
            continue
        closed += 1
        check_json(c.message.content, c.finish_reason, SCHEMA, must_stop=True)
    assert closed >= 3, "the logit bias should close reasoning in most requests"
    assert counts == {"json_schema": REPS}, counts


def test_thinking_on_masks_wait_for_the_parsers_end(client: Any) -> None:
    """Without the bias the random model rarely ends reasoning: the reasoning text is free
    (not the schema's JSON), which shows the masks wait for the parser's end."""
    choices = chat_reps(client, response_format=response_format(SCHEMA, strict=True),
                        max_tokens=32)
    free = [reasoning_of(c.message) for c in choices if not c.message.content]
    assert free and any(not r.lstrip().startswith('{"n":') for r in free), choices


def test_thinking_off_constrained_from_the_first_token(server: Server, client: Any) -> None:
    choices, counts = served_by_grammask(server, lambda: chat_reps(
        client, response_format=response_format(SCHEMA, strict=True), extra_body=OFF))
    for c in choices:
        assert not reasoning_of(c.message), c.message
        check_json(c.message.content or "", c.finish_reason, SCHEMA, must_stop=True)
    assert counts == {"json_schema": REPS}, counts


def test_streamed_thinking_then_json(client: Any) -> None:
    reasoning: list[str] = []
    content: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=128, seed=2, stream=True,
            logit_bias=BIAS, response_format=response_format(SCHEMA, strict=True)):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append(reasoning_of(delta))
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    check_json("".join(content), str(finish), SCHEMA, must_stop=True)


def test_completions_with_a_reasoning_parser_are_constrained(server: Server,
                                                             client: Any) -> None:
    """vLLM #57726: a raw prompt never opens reasoning, so vLLM's engine waits forever for
    ``</think>`` and returns unconstrained text; grammask masks from the first token."""
    def run() -> list[Any]:
        return [client.completions.create(
            model=MODEL_NAME, prompt="Give me JSON:", max_tokens=64, seed=s,
            extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
            for s in range(1, REPS + 1)]
    choices, counts = served_by_grammask(server, run)
    for c in choices:
        check_json(c.text, c.finish_reason, SCHEMA, must_stop=True)
    assert counts == {"json_schema": REPS}, counts


def _responses(client: Any, **kw: Any) -> list[Any]:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                      "strict": True}}
    return [client.responses.create(model=MODEL_NAME, input="Answer as JSON.",
                                    max_output_tokens=128, text=fmt, **kw)
            for _ in range(REPS)]


def test_responses_api_thinking_off(server: Server, client: Any) -> None:
    """vLLM #44012's case (Responses ``text.format`` with a reasoning parser)."""
    replies, counts = served_by_grammask(server, lambda: _responses(client, extra_body=OFF))
    for reply in replies:
        jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert counts == {"json_schema": REPS}, counts


def test_responses_api_thinking_on(client: Any) -> None:
    answered = 0
    for reply in _responses(client, extra_body={"logit_bias": BIAS}):
        if reply.output_text:
            answered += 1
            jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert answered >= 3, "the logit bias should end reasoning in most replies"


def test_named_strict_tool_with_thinking_off(server: Server, client: Any) -> None:
    choices, counts = served_by_grammask(server, lambda: chat_reps(
        client, tools=[weather_tool(strict=True)], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=OFF))
    for c in choices:
        assert c.message.tool_calls and len(c.message.tool_calls) == 1, c
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                            WEATHER_PARAMS)
    assert counts == {"structural_tag": REPS}, counts
