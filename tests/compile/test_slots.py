"""``compile_slots.Runner``: the slots bound compiles on the caller's thread too."""

from __future__ import annotations

import threading
import time

import pytest

from grammask.compile.slots import Runner
from grammask.errors import CompileTimeoutError


def test_a_compile_run_here_holds_a_slot_and_runs_on_the_caller() -> None:
    runner = Runner(max_running=1, max_abandoned=1)
    inside = threading.Event()
    release = threading.Event()
    ran_on: list[str] = []

    def held() -> str:
        ran_on.append(threading.current_thread().name)
        inside.set()
        release.wait(30)
        return "first"

    first = threading.Thread(target=lambda: runner.run_here(held, time.monotonic() + 60, "x"),
                             name="caller-1")
    first.start()
    try:
        assert inside.wait(30)
        # the one slot is taken: a second compile, here or on a worker, waits and times out
        with pytest.raises(CompileTimeoutError, match="no x compile slot"):
            runner.run_here(lambda: "second", time.monotonic() + 0.2, "x")
        with pytest.raises(CompileTimeoutError, match="no x compile slot"):
            runner.run(lambda: "second", time.monotonic() + 0.2, "x")
    finally:
        release.set()
        first.join(30)
    assert ran_on == ["caller-1"]
    # the slot came back (also when the compile raises)
    with pytest.raises(ValueError):
        runner.run_here(lambda: (_ for _ in ()).throw(ValueError("bad")),
                        time.monotonic() + 5, "x")
    assert runner.run_here(lambda: threading.current_thread().name,
                           time.monotonic() + 5, "x") == threading.current_thread().name
    assert runner.run(lambda: threading.current_thread().name,
                      time.monotonic() + 5, "x") == "grammask-compile"
