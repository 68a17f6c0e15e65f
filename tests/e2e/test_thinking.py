"""A thinking model (tiny random Qwen3 layout, ``</think>`` = 151668) on a real server:
the constraint applies after ``</think>``, or from the first token with thinking off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.server import MODEL_NAME, Server, xargs

END_THINK = 151_668
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["n", "ok"], "additionalProperties": False}
SPEC = {"json": SCHEMA, "disable_any_whitespace": True}
MESSAGES = [{"role": "user", "content": "Think, then answer as JSON."}]
#: near-uniform logits over 151,936 tokens: +12 makes </think> likely within a few tokens
BIAS = {str(END_THINK): 12}
REPS = 5


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen3_dir: Path) -> Iterator[Server]:
    yield start_server("qwen3", qwen3_dir)


def ask(server: Server, seed: int, *, thinking: bool | None, bias: bool,
        **flat: Any) -> tuple[str, str]:
    extra = xargs(SPEC, **flat)
    extra["skip_special_tokens"] = False
    if thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": thinking}
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=128, temperature=1.0, seed=seed,
        logit_bias=BIAS if bias else None, extra_body=extra)
    choice = reply.choices[0]
    return choice.finish_reason, choice.message.content or ""


def reps(server: Server, **kw: Any) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(REPS) as pool:
        return list(pool.map(lambda s: ask(server, s, **kw), range(1, REPS + 1)))


def valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def test_thinking_on_free_until_end_marker(server: Server) -> None:
    closed = 0
    for finish, text in reps(server, thinking=None, bias=True):
        if "</think>" not in text:
            assert finish == "length", (finish, text)  # still thinking: free text
            continue
        closed += 1
        _thought, answer = text.split("</think>", 1)
        assert finish == "stop", (finish, text)
        valid(answer)
    assert closed >= 3, "the logit bias should close thinking in most requests"


def test_thinking_on_is_unconstrained_before_marker(server: Server) -> None:
    """Without the bias the random model rarely closes thinking: the text is free (not the
    schema's JSON), which shows the mask waits for the marker."""
    results = reps(server, thinking=True, bias=False)
    assert any(not text.startswith('{"n":') for _, text in results), results


def test_thinking_off_constrained_from_first_token(server: Server) -> None:
    results = reps(server, thinking=False, bias=True)
    bad = [(finish, text) for finish, text in results if finish != "stop" or not _ok(text)]
    assert not bad, f"not constrained from the first token: {bad} (all: {results})"


def test_grammask_thinking_off_constrains_at_once(server: Server) -> None:
    results = reps(server, thinking=None, bias=True, grammask_thinking="off")
    bad = [(finish, text) for finish, text in results if finish != "stop" or not _ok(text)]
    assert not bad, f"not constrained from the first token: {bad} (all: {results})"


def _ok(text: str) -> bool:
    try:
        valid(text)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
