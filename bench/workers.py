"""Worker processes: one long-lived process per system, driven with deadlines.

Why it looks like this:
- a native compile (xgrammar's above all) cannot be interrupted from Python, so every system
  lives in its own long-lived worker *process*; the parent waits with a deadline and kills and
  restarts a worker that overruns it (the restart is never timed);
- every system sees the same cases in the same run, one measurement at a time (the machine has
  two cores), in an order rotated per case so slow drifts in background load hit all alike.

Workers are spawned, so ``_worker_main`` and the task functions (``"module:function"``
strings) are found by module path in the child.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.systems import _mkdir, hf_model_dir, make_system, warm_up


def _worker_main(conn: Connection, name: str, options: dict[str, Any], log_path: str) -> None:
    """Set the system up once, then serve ``(task, payload)`` messages until told to stop.
    Native libraries print to fds 1/2: both go to a log file so the progress bar stays clean."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.ERROR)
    try:
        system = make_system(name, options)
        t0 = time.perf_counter()
        info = system.setup()
        warm_up(system)
        info["setup_s"] = round(time.perf_counter() - t0, 2)
        conn.send(("ready", info))
    except BaseException as exc:
        traceback.print_exc()
        conn.send(("unavailable", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        task, payload = message
        try:
            module, func = task.split(":")
            result = getattr(importlib.import_module(module), func)(system, payload)
            conn.send(("ok", result))
        except BaseException as exc:
            traceback.print_exc()
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))


@dataclass
class Reply:
    status: str  # ok | error | timeout | unavailable
    result: Any = None
    error: str = ""


@dataclass
class Worker:
    """Parent-side handle of one system's worker process; restarts it after a kill."""

    name: str
    options: dict[str, Any]
    log_path: str
    info: dict[str, Any] = field(default_factory=dict)
    unavailable: str = ""
    restarts: int = 0
    _proc: Any = None
    _conn: Connection | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, name=f"bench-{self.name}",
                                 args=(child, self.name, self.options, self.log_path),
                                 daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def wait_ready(self, timeout: float = 600.0) -> bool:
        if self._conn is None:
            self.start()
        assert self._conn is not None
        if not self._conn.poll(timeout):
            self.kill()
            self.unavailable = f"set-up took over {timeout:.0f} s"
            return False
        try:
            status, info = self._conn.recv()
        except EOFError:
            self.kill()
            self.unavailable = f"worker died during set-up (see {self.log_path})"
            return False
        if status != "ready":
            self.kill()
            self.unavailable = str(info)
            return False
        if not self.info:
            self.info = info
        return True

    def call(self, task: str, payload: Any, timeout: float) -> Reply:
        if self.unavailable:
            return Reply("unavailable", error=self.unavailable)
        if self._conn is None:
            self.restarts += 1
            if not self.wait_ready():
                return Reply("unavailable", error=self.unavailable)
        assert self._conn is not None
        self._conn.send((task, payload))
        if not self._conn.poll(timeout):
            self.kill()
            return Reply("timeout", error=f"no answer within {timeout:.1f} s (worker killed)")
        try:
            status, result = self._conn.recv()
        except EOFError:
            self.kill()
            return Reply("error", error=f"worker crashed (see {self.log_path})")
        if status == "ok":
            if isinstance(result, dict) and result.get("restart"):
                self.kill()  # an abandoned compile may still be running there
            return Reply("ok", result)
        return Reply("error", error=str(result))

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._proc is not None:
                self._proc.join(5)
        self.kill()


class Pool:
    """One worker per system, started together (their set-up overlaps), used one at a time."""

    def __init__(self, systems: Sequence[str], options: dict[str, Any],
                 log_dir: str | None = None) -> None:
        self.log_dir = str(_mkdir(Path(log_dir))) if log_dir else tempfile.mkdtemp(
            prefix="grammask-bench-")
        if any(s.startswith("vllm-") for s in systems):
            with contextlib.suppress(Exception):  # the worker reports a failure itself
                hf_model_dir(str(options.get("tokenizer", "qwen2.5")))
        self.workers = {s: Worker(s, options, os.path.join(self.log_dir, f"{s}.log"))
                        for s in systems}
        for w in self.workers.values():
            w.start()
        for w in self.workers.values():
            w.wait_ready()

    def available(self) -> list[str]:
        return [n for n, w in self.workers.items() if not w.unavailable]

    def unavailable(self) -> dict[str, str]:
        return {n: w.unavailable for n, w in self.workers.items() if w.unavailable}

    def close(self) -> None:
        for w in self.workers.values():
            w.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rotated(items: Sequence[str], shift: int) -> Iterator[str]:
    """``items`` starting at ``shift``: spreads order effects evenly over the systems."""
    n = len(items)
    for i in range(n):
        yield items[(i + shift) % n]


def progress(total: int, desc: str, disable: bool = False) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="spec", disable=disable, dynamic_ncols=True,
                file=sys.stderr)
