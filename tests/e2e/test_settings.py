"""Plugin settings on a real server: disabled by env, and ``structured_outputs=vllm`` by
``--additional-config`` (vLLM's engine serves the standard requests, grammask its own keys).
Who served a request is read off grammask's counter on vLLM's ``/metrics``."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_regex
from tests.e2e.server import MODEL_NAME, Server, xargs
from tests.e2e.standard import served

MESSAGES = [{"role": "user", "content": "hi"}]
REGEX = r"(ab|cd)[0-9]{1,3}"


@pytest.fixture(scope="module")
def servers(start_server: StartServer, qwen25_dir: Path) -> Iterator[dict[str, Server]]:
    """Two servers, started together (one start-up time for both)."""
    def prom() -> dict[str, str]:
        return {"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")}
    started = {
        "disabled": start_server("disabled-env", qwen25_dir, wait=False,
                                 env={"GRAMMASK_ENABLED": "0", **prom()}),
        "vllm-engine": start_server(
            "structured-outputs-vllm", qwen25_dir, wait=False, env=prom(),
            args=["--additional-config",
                  json.dumps({"grammask": {"structured_outputs": "vllm"}})]),
    }
    for name, server in started.items():
        server.wait()
        print(f"\n[e2e] server {name} healthy in {server.start_s:.1f} s "
              f"(log {server.log_path})")
    yield started


def _standard(client: Any) -> tuple[str, str]:
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=16, seed=1,
        extra_body={"structured_outputs": {"regex": REGEX}}).choices[0]
    return choice.finish_reason, choice.message.content or ""


def _grammask_lines(server: Server) -> list[str]:
    wanted = version("grammask")
    return [line for line in server.log_text().splitlines()
            if "grammask" in line and wanted in line and "e2e-" not in line]


def test_disabled_server_refuses_grammask_requests(servers: dict[str, Server]) -> None:
    client: Any = servers["disabled"].client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       extra_body=xargs({"regex": "[0-9]+"}))
    assert "disabled" in str(info.value), str(info.value)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8)
    assert reply.choices[0].message.content  # requests without a constraint are served


def test_disabled_server_leaves_standard_requests_to_vllm(
        servers: dict[str, Server]) -> None:
    server = servers["disabled"]
    finish, text = _standard(server.client())
    check_regex(REGEX, text, finish)  # vLLM's engine enforces it
    assert not served(server), "grammask counted a request while disabled"
    lines = _grammask_lines(server)
    assert lines and any("disabled" in line.lower() for line in lines), "\n".join(lines)
    assert any("grammask is disabled" in line for line in server.log_text().splitlines())


def test_structured_outputs_vllm_setting(servers: dict[str, Server]) -> None:
    """``structured_outputs=vllm``: standard requests go to vLLM's engine (grammask's counter
    does not move for them), grammask's own keys are still served by grammask."""
    server = servers["vllm-engine"]
    client: Any = server.client()
    before = served(server)
    finish, text = _standard(client)
    check_regex(REGEX, text, finish)
    assert served(server) == before
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
                                           seed=2, extra_body=xargs({"regex": REGEX}))
    check_regex(REGEX, reply.choices[0].message.content or "", reply.choices[0].finish_reason)
    after = served(server)
    assert after.get(("grammask", "regex"), 0) == before.get(("grammask", "regex"), 0) + 1
    assert not any(src == "structured_outputs" for src, _ in after), after
    assert any("setting structured_outputs=vllm" in line
               for line in server.log_text().splitlines())
