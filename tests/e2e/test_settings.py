"""Plugin settings on a real server: disabled by env and by ``--additional-config``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.server import MODEL_NAME, Server, xargs

MESSAGES = [{"role": "user", "content": "hi"}]
HOW = ["env", "additional-config"]


@pytest.fixture(scope="module")
def disabled(start_server: StartServer, qwen25_dir: Path) -> Iterator[dict[str, Server]]:
    """Two disabled servers, started together (one start-up time for both)."""
    servers = {
        "env": start_server("disabled-env", qwen25_dir, env={"GRAMMASK_ENABLED": "0"},
                            wait=False),
        "additional-config": start_server(
            "disabled-additional-config", qwen25_dir, wait=False,
            args=["--additional-config", json.dumps({"grammask": {"enabled": False}})]),
    }
    for name, server in servers.items():
        server.wait()
        print(f"\n[e2e] server disabled-{name} healthy in {server.start_s:.1f} s "
              f"(log {server.log_path})")
    yield servers


@pytest.mark.parametrize("how", HOW)
def test_disabled_server_refuses_grammask_requests(disabled: dict[str, Server],
                                                   how: str) -> None:
    client: Any = disabled[how].client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       extra_body=xargs({"regex": "[0-9]+"}))
    assert "disabled" in str(info.value), str(info.value)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8)
    assert reply.choices[0].message.content  # requests without grammask keys are served


@pytest.mark.parametrize("how", HOW)
def test_disabled_server_logs_it(disabled: dict[str, Server], how: str) -> None:
    text = disabled[how].log_text()
    wanted = version("grammask")
    lines = [line for line in text.splitlines() if "grammask" in line and wanted in line
             and "e2e-" not in line]
    assert lines, f"no grammask {wanted} line in {disabled[how].log_path}"
    assert any("disabled" in line.lower() for line in lines), "\n".join(lines)
