"""A real vLLM OpenAI server (CPU build) in its own process group, for the e2e tests.

The server runs from the vLLM venv (``GRAMMASK_VLLM_PYTHON``, default ``.venv-vllm`` made by
``make vllm-venv``), binds 127.0.0.1 on a free port, logs to a file, and is always stopped
by its process group (SIGTERM, then SIGKILL after a grace period).

Each server gets a fresh private disk cache for grammask's compiled grammars (a 0700 temp
dir, ``Server.disk_cache``, removed when it stops), so no earlier run's cache can change a
result; a caller that passes ``GRAMMASK_DISK_CACHE`` in ``env`` (a test about the cache)
gets exactly that instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = float(os.environ.get("GRAMMASK_E2E_START_TIMEOUT", "600"))
MODEL_NAME = "tiny"


def vllm_python() -> Path:
    return Path(os.environ.get("GRAMMASK_VLLM_PYTHON", str(DEFAULT_PYTHON)))


def required() -> bool:
    """In CI (``CI`` set) or under ``make e2e`` a missing vLLM venv fails instead of skips."""
    return any(os.environ.get(v, "").strip().lower() not in ("", "0", "false")
               for v in ("CI", "GRAMMASK_E2E_REQUIRED"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, log_path: Path, *, env: Mapping[str, str] | None = None,
                 args: Sequence[str] = (), python: Path | None = None) -> None:
        self.model = model
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.python = python or vllm_python()
        self.extra_env = dict(env or {})
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = 0.0
        self._t0 = 0.0
        #: this server's own disk-cache dir (None until launched, or when ``env`` names one)
        self.disk_cache: Path | None = None
        self._disk_cache_cleanup: weakref.finalize[..., Any] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Server:
        """Launch and wait until healthy (``launch`` + ``wait``)."""
        self.launch()
        return self.wait()

    def launch(self) -> None:
        env = dict(os.environ)
        for var in list(env):  # the test process's own settings must not leak in
            if var.startswith("GRAMMASK_") and var not in self.extra_env:
                del env[var]
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "PYTHONUNBUFFERED": "1",
                    # tests.vllm_fixtures sets WARNING for in-process tests; servers log INFO
                    # (grammask's start-up and routing lines are INFO)
                    "VLLM_LOGGING_LEVEL": "INFO",
                    **self.extra_env})
        if "GRAMMASK_DISK_CACHE" not in self.extra_env:
            # the plugin's disk cache (on by default): this server's own, never $HOME's
            env["GRAMMASK_DISK_CACHE"] = str(self._fresh_disk_cache())
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", MODEL_NAME,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
               "--max-model-len", "1024", "--max-num-seqs", "32", "--dtype", "float32",
               "--seed", "0", *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(ROOT), start_new_session=True)

    def wait(self) -> Server:
        try:
            self._wait_healthy(self._t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - self._t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.port}/health"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} during "
                                   f"start-up; log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"vLLM server not healthy after {START_TIMEOUT_S:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
            time.sleep(1.0)

    def _fresh_disk_cache(self) -> Path:
        """A new private (0700) dir for this launch, removed by ``stop`` (or at exit)."""
        self._remove_disk_cache()
        # no "e2e-" in the name: tests drop log lines naming the tiny model's e2e dir
        path = Path(tempfile.mkdtemp(prefix="gm-server-disk-cache-"))
        path.chmod(0o700)
        self.disk_cache = path
        self._disk_cache_cleanup = weakref.finalize(self, shutil.rmtree, str(path),
                                                    ignore_errors=True)
        return path

    def _remove_disk_cache(self) -> None:
        cleanup, self._disk_cache_cleanup = self._disk_cache_cleanup, None
        self.disk_cache = None
        if cleanup is not None:
            cleanup()

    def stop(self, grace_s: float = 20.0) -> None:
        try:
            self._stop_processes(grace_s)
        finally:
            self._remove_disk_cache()  # after the processes: none is writing to it

    def _stop_processes(self, grace_s: float) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # children (engine core, workers) share the group: make sure none outlives us
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ helpers
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def client(self, **kw: Any) -> Any:
        from openai import DefaultHttpxClient, OpenAI
        kw.setdefault("http_client", DefaultHttpxClient(limits=short_keepalive()))
        return OpenAI(base_url=self.base_url, api_key="-", max_retries=0, timeout=120, **kw)

    def async_client(self, **kw: Any) -> Any:
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient
        kw.setdefault("http_client", DefaultAsyncHttpxClient(limits=short_keepalive()))
        return AsyncOpenAI(base_url=self.base_url, api_key="-", max_retries=0, timeout=120,
                           **kw)


def short_keepalive() -> Any:
    """The OpenAI client's connection limits with idle connections dropped after 1 s.

    Its default keeps them 5 s, as long as the API server (uvicorn) does: a request sent on
    a connection idle for ~5 s can meet the server closing it ("Server disconnected without
    sending a response"; seen after a long test left the pool idle). With ``max_retries=0``
    that was a failed test, not a retry."""
    from openai import DEFAULT_CONNECTION_LIMITS as limits
    return type(limits)(max_connections=limits.max_connections,
                        max_keepalive_connections=limits.max_keepalive_connections,
                        keepalive_expiry=1.0)


def xargs(spec: Mapping[str, Any] | str | None = None, **flat: Any) -> dict[str, Any]:
    """``extra_body`` for a grammask request, as the README shows it; ``flat`` keys get the
    ``grammask_`` prefix unless they have it (``backend=`` or ``grammask_backend=``)."""
    out: dict[str, Any] = {}
    if spec is not None:
        out["grammask"] = spec if isinstance(spec, str) else json.dumps(spec)
    out.update({k if k.startswith("grammask_") else f"grammask_{k}": v
                for k, v in flat.items()})
    return {"vllm_xargs": out}
