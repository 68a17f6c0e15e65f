"""Fixtures of the end-to-end suite: tiny offline models and real vLLM servers.

Needs the vLLM CPU venv (``make vllm-venv`` -> ``.venv-vllm``, or ``GRAMMASK_VLLM_PYTHON``).
Without it the suite is skipped, except in CI (``CI`` set) or under ``make e2e``
(``GRAMMASK_E2E_REQUIRED=1``), where it fails. Server logs go to ``out/e2e-logs/``
(``GRAMMASK_E2E_LOGS``). Each server gets its own fresh grammask disk cache (``server.py``),
so no earlier run's cache changes a result.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import tiny_model
from tests.e2e.server import ROOT, Server, required, vllm_python

LOG_DIR = Path(os.environ.get("GRAMMASK_E2E_LOGS", ROOT / "out" / "e2e-logs"))
StartServer = Callable[..., Server]


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    python = vllm_python()
    if not python.exists():
        message = (f"vLLM CPU venv not found at {python}: run `make vllm-venv` "
                   "(or set GRAMMASK_VLLM_PYTHON)")
        if required():
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def qwen25_dir() -> Path:
    return tiny_model.model_dir("qwen2.5")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return tiny_model.model_dir("qwen3")


@pytest.fixture(scope="module")
def start_server(vllm_env: Path) -> Iterator[StartServer]:
    """``start_server(name, model_dir, env=..., args=..., wait=True)``; all stopped at
    module end. ``wait=False`` only launches (call ``.wait()``): servers start together."""
    started: list[Server] = []

    def start(name: str, model: Path, *, env: Mapping[str, str] | None = None,
              args: Sequence[str] = (), wait: bool = True) -> Server:
        server = Server(model, LOG_DIR / f"{name}.log", env=env, args=args, python=vllm_env)
        started.append(server)
        server.launch()
        if wait:
            server.wait()
            print(f"\n[e2e] server {name} healthy in {server.start_s:.1f} s "
                  f"(log {server.log_path})")
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    """An OpenAI client of the module's ``server`` fixture (a module may define its own)."""
    return server.client()


#: the running shared servers, by the fixture that started them
_SHARED: dict[str, Server] = {}


@pytest.fixture(scope="module")
def hermes_server(vllm_env: Path, qwen25_dir: Path) -> Server:
    """The drop-in modules' server (Qwen2.5 layout, hermes tools, vLLM's metrics), shared: a
    server start is about a minute of the suite. Started by the first module that asks and
    kept while the next module asks too; stopped once it does not
    (``pytest_runtest_teardown``), so it never runs beside another module's server. The
    modules using it run one after another (name them so) and read only deltas of its
    counters."""
    server = _SHARED.get("hermes_server")
    if server is None:
        server = Server(qwen25_dir, LOG_DIR / "qwen25-hermes.log", python=vllm_env,
                        env={"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")},
                        args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        _SHARED["hermes_server"] = server
        server.launch()
        server.wait()
        print(f"\n[e2e] shared server qwen25-hermes healthy in {server.start_s:.1f} s "
              f"(log {server.log_path})")
    return server


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a module's last test: stop each shared server the next test does not use."""
    if _SHARED and getattr(nextitem, "module", None) is not getattr(item, "module", None):
        wanted = set(getattr(nextitem, "fixturenames", ()))
        for name in [n for n in _SHARED if n not in wanted]:
            _SHARED.pop(name).stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run cut short (``-x``, an interrupt) stops the shared servers too."""
    for name in list(_SHARED):
        _SHARED.pop(name).stop()
