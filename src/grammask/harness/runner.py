"""Work isolation: items run in long-lived worker processes under a hard per-phase deadline.

A native backend can crash the process or spin for minutes inside a compile that cannot be
interrupted. Each worker builds its vocabulary and compiler once (seconds) and then checks items
one at a time, reporting each backend's row as soon as it is done. The parent waits on all
workers with a deadline per phase (one backend of one item): a worker that dies or overruns
is killed and replaced, the phase is recorded as ``crash`` or ``timeout``, and the item's
remaining backends are queued again on a fresh worker. A worker whose compile timed out
inside the Compiler (the runaway thread keeps burning CPU) is replaced after its item.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from .check import CheckConfig, Checker, Emit, Row, count_instances
from .corpus import Item

#: Seconds a fresh worker may take to build its vocabulary and compiler.
STARTUP_S = 180.0


class ItemChecker(Protocol):
    def check(self, item: Item, backends: tuple[str, ...], emit: Emit, *,
              diff: bool = True) -> None: ...

    def close(self) -> None: ...


CheckerFactory = Callable[[CheckConfig], ItemChecker]


@dataclass
class Results:
    rows: list[dict[str, Any]] = field(default_factory=list)
    diffs: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    interrupted: bool = False


def _worker_main(conn: Connection, cfg: CheckConfig, factory: CheckerFactory) -> None:
    # A group signal (``timeout`` stopping the run) must reach the parent only: it stops the
    # workers itself and still writes its report. An orphaned worker exits on EOF.
    os.setpgrp()
    checker = factory(cfg)
    conn.send(("ready", {}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        task, item, backends, no_diff = msg

        def emit(kind: str, payload: dict[str, Any], task: int = task) -> None:
            conn.send((kind, {"task": task, **payload}))

        try:
            checker.check(item, backends, emit, diff=not no_diff)
        except Exception:
            emit("error", {"error": traceback.format_exc()[-2000:]})
        emit("done", {})
    checker.close()


@dataclass
class _Task:
    id: int
    item: Item
    backends: tuple[str, ...]
    done: set[str] = field(default_factory=set)
    phase: str = ""
    recycle: bool = False
    no_diff: bool = False


class _Worker:
    def __init__(self, ctx: Any, cfg: CheckConfig, factory: CheckerFactory) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, cfg, factory), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: _Task | None = None
        self.deadline = time.monotonic() + STARTUP_S

    def kill(self) -> None:
        """Terminate, then kill if it ignores that (a native hang may)."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc.join(2)
        self.conn.close()

    def stop(self) -> None:
        """Ask politely (the worker closes its Compiler), then make sure."""
        try:
            self.conn.send(None)
            self.proc.join(10)
        except (OSError, BrokenPipeError):
            pass
        self.kill()


def failed_row(item: Item, backend: str, status: str, error: str, cfg: CheckConfig
               ) -> dict[str, Any]:
    """The row of a phase that never reported (its instances still count as totals)."""
    row = Row(item.subset, item.id, item.kind, backend, status=status, error=error)
    count_instances(row, item, cfg)
    return asdict(row)


class Pool:
    """Runs items on ``workers`` processes; ``hard_timeout_s`` bounds each backend phase."""

    def __init__(self, cfg: CheckConfig, *, workers: int, hard_timeout_s: float,
                 factory: CheckerFactory = Checker) -> None:
        self.cfg = cfg
        self.workers = max(1, workers)
        self.hard_timeout_s = hard_timeout_s
        self.factory = factory
        self._ctx = mp.get_context("spawn")
        self._stopping = False

    def stop(self) -> None:
        """Finish early (from a signal handler): running items are abandoned, the results
        so far are returned."""
        self._stopping = True

    def run(self, items: list[Item], backends: tuple[str, ...],
            progress: Callable[[int], None] | None = None) -> Results:
        self._stopping = False
        results = Results()
        queue: deque[_Task] = deque(_Task(i, item, backends) for i, item in enumerate(items))
        tasks_left = len(items)
        pool = [_Worker(self._ctx, self.cfg, self.factory)
                for _ in range(min(self.workers, len(items)))]
        try:
            while tasks_left and not self._stopping:
                for w in pool:
                    if w.ready and w.task is None and queue:
                        w.task = queue.popleft()
                        w.deadline = time.monotonic() + self.hard_timeout_s
                        w.conn.send((w.task.id, w.task.item, w.task.backends,
                                     w.task.no_diff))
                now = time.monotonic()
                ready = wait([w.conn for w in pool],
                             timeout=max(0.05, min(w.deadline for w in pool) - now))
                for i, w in enumerate(pool):
                    finished: _Task | None = None
                    replace = False
                    if w.conn in ready:
                        try:
                            kind, payload = w.conn.recv()
                        except (EOFError, OSError):
                            w.proc.join(1)  # reap it, so the exit code (or signal) is known
                            code = w.proc.exitcode
                            finished = self._lost(w, results, queue, "crash",
                                                  f"worker died (exit code {code})")
                            replace = True
                        else:
                            finished, replace = self._message(w, kind, payload, results)
                    elif time.monotonic() > w.deadline:
                        what = "startup" if not w.ready else w.task.phase if w.task else "idle"
                        finished = self._lost(w, results, queue, "timeout",
                                              f"hard deadline {self.hard_timeout_s:.0f} s "
                                              f"passed in {what}")
                        replace = True
                    if finished is not None:
                        tasks_left -= 1
                        if progress is not None:
                            progress(1)
                    if replace:
                        w.kill()
                        results.restarts += 1
                        pool[i] = _Worker(self._ctx, self.cfg, self.factory)
        finally:
            for w in pool:
                if self._stopping:
                    w.kill()
                else:
                    w.stop()
        results.interrupted = self._stopping
        return results

    def _message(self, w: _Worker, kind: str, payload: dict[str, Any], results: Results
                 ) -> tuple[_Task | None, bool]:
        task = w.task
        if kind == "ready":
            w.ready = True
            w.deadline = float("inf") if task is None else time.monotonic() + self.hard_timeout_s
            return None, False
        if task is None:
            return None, False
        if kind == "start":
            task.phase = str(payload["backend"])
            w.deadline = time.monotonic() + self.hard_timeout_s
        elif kind == "row":
            payload.pop("task", None)
            results.rows.append(payload)
            task.done.add(str(payload["backend"]))
            task.recycle |= bool(payload.get("recycle"))
        elif kind == "diff":
            payload.pop("task", None)
            results.diffs.append(payload)
        elif kind == "error":
            for label in task.backends:
                if label not in task.done:
                    results.rows.append(failed_row(task.item, label, "harness_error",
                                                   str(payload.get("error", "")), self.cfg))
                    task.done.add(label)
        elif kind == "done":
            w.task = None
            w.deadline = float("inf")
            task.done.update(task.backends)
            return task, task.recycle
        return None, False

    def _lost(self, w: _Worker, results: Results, queue: deque[_Task], status: str,
              error: str) -> _Task | None:
        """The worker died or overran: record the running phase, requeue the rest."""
        task = w.task
        w.task = None
        if task is None:
            if not w.ready and status == "crash" and not self._stopping:
                raise RuntimeError(f"a harness worker failed to start ({error})")
            return None
        phase = task.phase
        if not phase:  # lost while setting up the item's oracle: nothing ran, nothing to retry
            for label in task.backends:
                results.rows.append(failed_row(task.item, label, status,
                                               f"{error} (before any backend ran)", self.cfg))
            return task
        if phase in task.backends and phase not in task.done:
            results.rows.append(failed_row(task.item, phase, status, error, self.cfg))
            task.done.add(phase)
        elif phase == "diff":
            results.diffs.append({"subset": task.item.subset, "id": task.item.id,
                                  "kind": task.item.kind, "status": status, "error": error})
        rest = tuple(b for b in task.backends if b not in task.done)
        if rest:  # the same item goes on, on a fresh worker, without the differential
            queue.appendleft(_Task(task.id, task.item, rest, no_diff=True))
            return None
        return task


def run_serial(checker: ItemChecker, items: list[Item], backends: tuple[str, ...],
               progress: Callable[[int], None] | None = None) -> Results:
    """No isolation (tests, one spec): the same messages, handled in-process."""
    results = Results()
    for item in items:
        def emit(kind: str, payload: dict[str, Any]) -> None:
            if kind == "row":
                results.rows.append(payload)
            elif kind == "diff":
                results.diffs.append(payload)

        checker.check(item, backends, emit)
        if progress is not None:
            progress(1)
    return results
