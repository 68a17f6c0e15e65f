"""Where the fill thread runs: off the forward's cores when the host pinned its worker.

vLLM's CPU worker pins its main thread to the OpenMP cores of its rank, and every thread it
starts inherits that pin, the fill thread included. The fill then takes turns with the
forward it is meant to overlap. ``auto`` finds that case and moves the fill thread onto CPUs
the worker's parent may use that no rank is pinned to (the core vLLM reserves for its
scheduler), on the worker's NUMA node where it has such CPUs. Only where the host is known to
pin its workers to their compute cores (vLLM's CPU platform): a GPU worker bound to a NUMA
node is where its memory is, and is left as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("grammask")

#: ``fill_cpus`` values that never move the fill thread
STAY = frozenset({"none", "off"})


def parse_cpus(text: str) -> frozenset[int] | None:
    """A CPU list as Linux writes one (``"1"``, ``"2-3,6"``); None for ``""``. ValueError
    names the part that is not one."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(f"not a CPU or CPU range: {part!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU or CPU range: {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus) or None


def check_setting(text: str) -> None:
    """Raises ValueError for a ``fill_cpus`` value that is neither a keyword nor a CPU list."""
    if text.strip().lower() in STAY | {"auto", ""}:
        return
    try:
        parse_cpus(text)
    except ValueError as exc:
        raise ValueError(f"{exc}; expected auto, none or a CPU list such as 1 or 2-3") from None


def fill_cpus(setting: str, *, pinning_host: bool) -> frozenset[int] | None:
    """The CPUs for a fill thread the calling thread starts, per the ``fill_cpus`` setting:
    ``auto`` (or empty) picks ``spare_cpus()`` on a ``pinning_host`` (one that pins its
    workers to their compute cores), ``none``/``off`` keeps the caller's, and a CPU list is
    taken as given. None: the thread stays where it starts."""
    text = setting.strip().lower()
    if text in STAY:
        return None
    if text in ("auto", ""):
        return spare_cpus() if pinning_host else None
    return parse_cpus(text)


def spare_cpus() -> frozenset[int] | None:
    """CPUs off the calling thread's pin and off every sibling process's pin, within what the
    parent process and the caller may use; None when the calling thread is not pinned
    tighter than that (nothing to escape), on no Linux, or when no CPU is left."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        own = frozenset(os.sched_getaffinity(0))
        parent = os.getppid()
        # the parent's CPUs are usable here too (one cgroup), even when it is pinned itself
        allowed = frozenset(os.sched_getaffinity(parent)) | own
    except OSError:
        return None
    taken: set[int] = set()
    for pid in _children(parent):
        if pid == os.getpid():
            continue
        try:
            theirs = frozenset(os.sched_getaffinity(pid))
        except OSError:  # gone, or not ours to read
            continue
        if not theirs >= allowed:  # pinned: a rank (an unpinned child pins nothing)
            taken |= theirs
    spare = choose(own, allowed, frozenset(taken))
    if spare is not None:
        spare = same_node(spare, own)
        log.info("grammask: the fill thread runs on CPUs %s: this worker is pinned to %s and "
                 "no sibling process is pinned there", _show(spare), _show(own))
    elif own < allowed:
        log.info("grammask: the fill thread shares this worker's CPUs %s: every other CPU is "
                 "pinned to another rank", _show(own))
    return spare


def choose(own: frozenset[int], allowed: frozenset[int], taken: frozenset[int]
           ) -> frozenset[int] | None:
    """The spare CPUs: what the parent may use, less the caller's pin and the siblings'
    (``taken``); None when the caller is not pinned inside ``allowed`` or none is left."""
    if not own < allowed:
        return None
    return (allowed - own - taken) or None


def same_node(spare: frozenset[int], own: frozenset[int]) -> frozenset[int]:
    """The spare CPUs on a NUMA node of ``own`` (the fill reads the worker's memory), or all
    of them when none is, or the nodes are unknown (``/sys``)."""
    nodes = {_node(c) for c in own} - {None}
    near = frozenset(c for c in spare if _node(c) in nodes)
    return near or spare


def _node(cpu: int) -> int | None:
    found = list(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    return int(found[0].name[4:]) if found else None


def _children(pid: int) -> Iterable[int]:
    """The child processes of ``pid`` (Linux ``/proc``: its threads' ``children`` files, or
    a scan of every process's parent where the kernel has none)."""
    tasks = Path(f"/proc/{pid}/task")
    found: list[int] = []
    try:
        listed = [t / "children" for t in tasks.iterdir()]
    except OSError:
        return found
    if listed and all(f.exists() for f in listed):
        for f in listed:
            try:
                found += [int(p) for p in f.read_text().split()]
            except (OSError, ValueError):
                continue
        return found
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(stat.parent.name))
    return found


def _show(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
