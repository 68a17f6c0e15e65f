"""Issue 35 on a real server: the schema vLLM's own structured-output test calls "a schema
xgrammar cannot serve" (``patternProperties`` overlapping ``properties`` under
``additionalProperties: false``) gave invalid JSON with ``finish_reason: "stop"`` (11 of 24),
from llguidance allowing a ``,`` no key can follow. Sampled many times, under grammask's
routing (``response_format``) and with llguidance forced (grammask's own keys), every
``stop`` output must be valid and no row may fail."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.compile.test_router_no_silent_violations import (  # vLLM's own test schema
    ISSUE_SCHEMA as SCHEMA,
)
from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json
from tests.e2e.server import MODEL_NAME, Server, xargs
from tests.e2e.standard import response_format
from tests.e2e.test_features import metric

MESSAGES = [{"role": "user", "content": "Give a score and some tags."}]
SAMPLES = 32


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen25_dir: Path) -> Iterator[Server]:
    yield start_server("qwen25-dead-ends", qwen25_dir,
                       env={"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")})


def _one(server: Server, seed: int, extra: dict[str, Any]) -> tuple[str, str]:
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=160, temperature=1.0, seed=seed,
        **extra)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


@pytest.mark.parametrize("how", ["auto", "guidance"])
def test_every_stop_output_of_the_issue_schema_is_valid(server: Server, how: str) -> None:
    if how == "auto":
        extra: dict[str, Any] = {"response_format": response_format(SCHEMA, strict=True)}
    else:
        extra = {"extra_body": xargs({"json": SCHEMA, "backend": "guidance",
                                      "disable_any_whitespace": True})}
    errors_before = metric(server, "grammask_row_errors_total")
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda s: _one(server, s, extra), range(SAMPLES)))
    stopped = [(text, finish) for text, finish in outputs if finish == "stop"]
    assert len(stopped) >= SAMPLES // 4, outputs  # most end within max_tokens
    for text, finish in outputs:
        check_json(text, finish, SCHEMA, must_stop=False)
    for text, _ in stopped:
        value = json.loads(text)
        assert set(value) == {"score", "tags"} and value["score"] % 5 == 0
    assert metric(server, "grammask_row_errors_total") == errors_before, server.log_tail()
