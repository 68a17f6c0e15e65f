"""Where the fill thread runs: ``fill_cpus`` and the ``auto`` escape from a host's pin.

The process test pins real processes and reads the kernel's view back (``/proc``): the
parent here is pytest, and the "ranks" are its child processes, as vLLM's workers are the
children of its engine core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from grammask.decode.fill import check_setting, choose, fill_cpus, parse_cpus, same_node

LINUX = hasattr(os, "sched_setaffinity")


def test_cpu_lists_read_as_linux_writes_them() -> None:
    assert parse_cpus("1") == {1}
    assert parse_cpus(" 0, 2-3 ") == {0, 2, 3}
    assert parse_cpus("") is None
    for bad in ("a", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="not a CPU"):
            parse_cpus(bad)


def test_settings_take_keywords_or_a_list() -> None:
    for ok in ("auto", "none", "OFF", "", "1", "0-3,6"):
        check_setting(ok)
    with pytest.raises(ValueError, match="'two'.*expected auto, none or a CPU list"):
        check_setting("1,two")
    assert fill_cpus("none", pinning_host=True) is None
    assert fill_cpus("2-3", pinning_host=False) == {2, 3}
    assert fill_cpus("auto", pinning_host=False) is None  # a GPU host: left where it is


def test_spare_cpus_are_what_no_pin_holds() -> None:
    every = frozenset(range(4))
    # a TP=1 CPU worker pinned to core 0 of 2: the reserved core is spare
    assert choose(frozenset({0}), frozenset({0, 1}), frozenset()) == {1}
    # two ranks pinned '0|1' on 2 cores: nothing is spare, the fill stays
    assert choose(frozenset({0}), frozenset({0, 1}), frozenset({1})) is None
    # not pinned tighter than the parent (a GPU worker): nothing to escape
    assert choose(every, every, frozenset()) is None
    assert choose(frozenset({0, 5}), every, frozenset()) is None  # outside the parent's set
    assert choose(frozenset({0}), every, frozenset({1})) == {2, 3}


def test_spare_cpus_prefer_the_workers_numa_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from grammask.decode import fill as cpu_placement

    nodes = {0: 0, 1: 0, 2: 1, 3: 1}
    monkeypatch.setattr(cpu_placement, "_node", nodes.get)
    assert same_node(frozenset({1, 3}), frozenset({0})) == {1}
    assert same_node(frozenset({2, 3}), frozenset({0})) == {2, 3}  # none near: all
    monkeypatch.setattr(cpu_placement, "_node", lambda cpu: None)
    assert same_node(frozenset({1, 3}), frozenset({0})) == {1, 3}  # nodes unknown


_PROBE = """
import os, sys
os.sched_setaffinity(0, {%d})
from grammask.decode.fill import fill_cpus
got = fill_cpus("auto", pinning_host=True)
print("none" if got is None else ",".join(map(str, sorted(got))))
"""


def _probe(cpu: int) -> str:
    """``fill_cpus("auto")`` in a child process pinned to ``cpu``."""
    done = subprocess.run([sys.executable, "-c", _PROBE % cpu], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not LINUX or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_auto_leaves_the_pin_for_a_cpu_no_sibling_holds() -> None:
    """A child pinned to one CPU moves its fill thread to the parent's other CPUs; once a
    sibling process is pinned to those, it stays put (it would slow that rank's forward)."""
    mine = sorted(os.sched_getaffinity(0))
    first, others = mine[0], mine[1:]
    assert _probe(first) == ",".join(map(str, others))
    sibling = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
         f"os.sched_setaffinity(0, {set(others)!r}); print('pinned', flush=True)\n"
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert sibling.stdout is not None and sibling.stdout.readline().strip() == "pinned"
        deadline = time.monotonic() + 30
        while set(os.sched_getaffinity(sibling.pid)) != set(others):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _probe(first) == "none"
    finally:
        sibling.kill()
        sibling.wait()
