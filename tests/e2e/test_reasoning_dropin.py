"""The drop-in on a reasoning server (tiny random Qwen3 layout, ``--reasoning-parser qwen3``,
hermes tools): standard fields only. Masks start exactly where vLLM's engine would start
them, from vLLM's own decision per request: the ``reasoning``/``content`` split the client
sees is the free part and the constrained part. Also the Responses API (#44012) and
``enable_thinking=false``, with the model's template and with one that ignores the switch
(sent per request: ``--trust-request-chat-template``), and a forced tool call whose
``<tool_call>`` ends reasoning implicitly. And the reasoning grid on vLLM 0.32's classes
(``tests/reasoning_grid.py``; 0.33's and 0.34's run in ``tests/test_reasoning_vllm.py``)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json
from tests.e2e.server import MODEL_NAME, ROOT, Server
from tests.e2e.standard import (
    WEATHER_PARAMS,
    reasoning_of,
    response_format,
    served_by_grammask,
    weather_tool,
)
from tests.e2e.test_thinking import BIAS, MESSAGES, SCHEMA
from tests.e2e.tiny_model import TEMPLATES

OFF = {"chat_template_kwargs": {"enable_thinking": False}}
REPS = 5
#: ChatML without any thinking switch: ``enable_thinking`` changes nothing in the prompt
IGNORES_THINKING = {"chat_template": TEMPLATES["qwen2.5"]}
TOOL_CALL = 151_657  # <tool_call>, an implicit end of reasoning for vLLM's qwen3 parser


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen3_dir: Path) -> Iterator[Server]:
    yield start_server("qwen3-reasoning-dropin", qwen3_dir,
                       env={"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")},
                       args=["--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes", "--trust-request-chat-template"])


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


def test_completions_with_a_reasoning_parser_follow_vllms_engine(server: Server,
                                                                  client: Any) -> None:
    """A raw prompt passes no decision: vLLM's engine asks qwen3's parser (default kwargs:
    thinking) about the prompt, which has not ended reasoning, so the text is free until
    ``</think>`` and the schema's JSON after it, as vLLM's engine would serve it."""
    def run() -> list[Any]:
        return [client.completions.create(
            model=MODEL_NAME, prompt="Give me JSON:", max_tokens=64, seed=s, logit_bias=BIAS,
            extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
            for s in range(1, REPS + 1)]
    choices, counts = served_by_grammask(server, run)
    closed = [c for c in choices if "</think>" in c.text]
    for c in closed:
        check_json(c.text.split("</think>", 1)[1], c.finish_reason, SCHEMA, must_stop=True)
    assert len(closed) >= 3, "the logit bias should end reasoning in most requests"
    assert counts == {"json_schema": len(closed)}, counts  # served: its grammar masked


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


def _forced_call(client: Any, **kw: Any) -> list[Any]:
    return chat_reps(client, tools=[weather_tool(strict=True)], parallel_tool_calls=False,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                     **kw)


def _one_valid_call(c: Any) -> None:
    assert c.message.tool_calls and len(c.message.tool_calls) == 1, c
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                        WEATHER_PARAMS)


def test_a_tool_call_that_ends_reasoning_implicitly_is_constrained(server: Server,
                                                                   client: Any) -> None:
    """Thinking on, the model pushed to ``<tool_call>`` while it reasons: vLLM's qwen3 parser
    ends reasoning there and the forced call's grammar starts with that token."""
    choices, counts = served_by_grammask(server, lambda: _forced_call(
        client, logit_bias={str(TOOL_CALL): 30}, extra_body=IGNORES_THINKING))
    for c in choices:
        _one_valid_call(c)
    assert counts == {"structural_tag": REPS}, counts


def test_thinking_off_with_a_template_that_ignores_it(server: Server, client: Any) -> None:
    """``enable_thinking: false`` with a template that writes no empty think block: vLLM
    decides reasoning has ended (its parser built with the switch), so the forced call is
    constrained from its first token."""
    choices, counts = served_by_grammask(server, lambda: _forced_call(
        client, extra_body={**IGNORES_THINKING, **OFF}))
    for c in choices:
        assert not reasoning_of(c.message), c.message
        _one_valid_call(c)
    assert counts == {"structural_tag": REPS}, counts


def test_the_reasoning_grid_on_vllm_032(vllm_env: Path) -> None:
    """``tests/reasoning_grid.py`` run by the vLLM 0.32 venv's python (its classes)."""
    from tests.vllm_fixtures import model_dir

    done = subprocess.run([str(vllm_env), "-m", "tests.reasoning_grid", str(model_dir())],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"].startswith("0.32."), result["version"]
    assert not result["skipped"] and result["cases"] >= 500, result
    assert not result["mismatches"], result["mismatches"][:3]
