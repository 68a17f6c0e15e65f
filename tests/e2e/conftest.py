"""Fixtures of the end-to-end suite: tiny offline models and real vLLM servers.

Needs the vLLM CPU venv (``make vllm-venv`` -> ``.venv-vllm``, or ``GRAMMASK_VLLM_PYTHON``).
Without it the suite is skipped, except in CI (``CI`` set) or under ``make e2e``
(``GRAMMASK_E2E_REQUIRED=1``), where it fails. Server logs go to ``out/e2e-logs/``
(``GRAMMASK_E2E_LOGS``). Each server gets its own fresh grammask disk cache (``server.py``),
so no earlier run's cache changes a result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

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


#: servers that neighbouring modules share (``SHARED_SERVER``), by name; at most one lives
_SHARED: dict[str, Server] = {}


@pytest.fixture(scope="session")
def shared_server(vllm_env: Path) -> Iterator[StartServer]:
    """``shared_server(name, model_dir, env=..., args=...)``: the server of that name, started
    by the first module that asks and kept for the next modules that name it in their
    ``SHARED_SERVER`` (a server start is about a minute of the suite); stopped once the next
    module does not (``pytest_runtest_teardown``), so it never runs beside other modules'
    servers. The modules sharing one must run one after another (name them so) and measure
    only deltas of its counters."""

    def start(name: str, model: Path, *, env: Mapping[str, str] | None = None,
              args: Sequence[str] = ()) -> Server:
        server = _SHARED.get(name)
        if server is None:
            server = Server(model, LOG_DIR / f"{name}.log", env=env, args=args,
                            python=vllm_env)
            _SHARED[name] = server
            server.launch()
            server.wait()
            print(f"\n[e2e] shared server {name} healthy in {server.start_s:.1f} s "
                  f"(log {server.log_path})")
        return server

    try:
        yield start
    finally:
        _stop_shared(keep=None)


def _stop_shared(keep: str | None) -> None:
    for name in [n for n in _SHARED if n != keep]:
        _SHARED.pop(name).stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a module's last test: stop the shared server unless the next module shares it."""
    module = getattr(item, "module", None)
    following = getattr(nextitem, "module", None)
    if _SHARED and following is not module:
        _stop_shared(keep=getattr(following, "SHARED_SERVER", None))
