"""The fill side of a step: the fill thread, which rows fill on which thread and on which CPUs,
the batch fill through the backends, and the masks of rows no grammar fills.

The fill worker thread (``FillWorker``) and its tickets.

``FillWorker``: one dedicated daemon thread that runs the step's fill job while the caller's
thread runs the model forward. Both backends release the GIL inside their fill, so the forward
(which releases it inside torch kernels) and the fill really run at once.

Which fill thread fills which row of a batch fill (``place_fills``): backend-neutral.

Why: some backends serialize fills behind a lock that several matchers share (llguidance:
the copies of one template share its lexer, locked through each mask). Two threads filling
rows of one lock take turns, slower than one thread, so the rows of one lock must fill on one
thread; and a lock with many rows would then leave the other threads idle, so a backend that
can give a row another lock (llguidance: a copy of another template of the same grammar, its
tokens replayed: same state, same masks) spreads such a group over several *lanes*, one lock
each.

The contract. A row is described by ``(group, lane, payload)``:

- ``group``: its lock group (hashable; llguidance: the grammar its template belongs to).
  ``None``: the row has no group it can be spread over (it cannot move): it keeps its lane.
- ``lane``: the lock it fills under now within its group (``0``..; a row's lane is its own
  until it is moved).
- ``payload``: whatever the backend needs to fill it (handed back untouched).

``place_fills(rows, n)`` answers, for each of ``n`` threads, ``[(payload, lane), ...]``: the
rows that thread fills and the lane each must be on when filled (a lane other than the row's
own means: move it there first, once; it stays there for later fills). Thread 0 is the
calling thread's. The rules:

- the rows of one ``(group, lane)`` (one lock) go to one thread, in their given order;
- a group with more rows than a thread's share (``ceil(len(rows) / n)``) is spread over ``n``
  lanes of at most ``ceil(len(group) / n)`` rows each: a row keeps its lane while that lane is
  under the cap (rows on lanes ``>= n`` never do), the others move to the lowest lanes with
  room;
- the lock units go, largest first (ties in first-seen order), to the least-loaded thread
  (the lowest such).

Pure and deterministic: the same rows give the same threads in the same order. The work per
row is two tuple appends and a dict look-up or two, no call: the fill thread runs it with the
GIL held, beside a host thread that wants the GIL (``stepjob``).

Where the fill thread runs: off the forward's cores when the host pinned its worker.

vLLM's CPU worker pins its main thread to the OpenMP cores of its rank, and every thread it
starts inherits that pin, the fill thread included. The fill then takes turns with the
forward it is meant to overlap. ``auto`` finds that case and moves the fill thread onto CPUs
the worker's parent may use that no rank is pinned to (the core vLLM reserves for its
scheduler), on the worker's NUMA node where it has such CPUs. Only where the host is known to
pin its workers to their compute cores (vLLM's CPU platform): a GPU worker bound to a NUMA
node is where its memory is, and is left as it is.

Batch-parallel fills (``Filler``): the fill side of a step (``grammask.kernels.apply``
masks the logits; buffers are ``grammask.kernels.buffers``, the thread ``FillWorker``).

``Filler`` fills a set of rows through the backends' batch calls (``BatchCalls``:
xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``), on the backend's threads from
``parallel_min`` rows of one backend, on the fill thread (``FillWorker``). A backend whose
fills take turns on shared locks (``FillLanes``: llguidance) has its rows placed on threads
here, by lock (``place_fills``), and fills the shares it is handed.

Masks of rows their grammar does not fill: errored rows and thinking rows.

An errored row (``Row.fail``: sticky, never raised into the host) gets a stop-only mask under
``on_error="stop"``, so the request ends at once instead of running on unconstrained and
returning text that claims to follow the grammar; ``on_error="free"`` leaves it unmasked. A
thinking row is free, except with a byte marker: tokens that would end the marker inside
themselves are refused (``reasoning.BoundaryGuard``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import torch

from .. import metrics
from ..backends.base import BackendMatcher, BatchFills, Matcher, batch_calls, fill_stop_only
from ..backends.capabilities import lane_calls
from ..kernels.bitmask import bitmask_words, normal_tensors
from ..vocab import Vocabulary
from .reasoning import BoundaryGuard, Gate

T = TypeVar("T")
log = logging.getLogger("grammask")


class Ticket(Generic[T]):
    """The result of a job run by ``FillWorker.run``: a ``Future`` cut to ``result()``.

    One bare lock, held until the job ends: cheaper to make, complete and wait on than a
    ``Future`` (its condition variable and state machine), which matters once per step."""

    __slots__ = ("_done", "_error", "_finished", "_value")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._finished = False

    @classmethod
    def completed(cls, value: T) -> Ticket[T]:
        ticket: Ticket[T] = cls()
        ticket._finish(value, None)
        return ticket

    def _finish(self, value: T | None, error: BaseException | None) -> None:
        self._value = value
        self._error = error
        self._finished = True
        self._done.release()

    def done(self) -> bool:
        return self._finished

    def result(self, timeout: float | None = None) -> T:
        """The job's return value (raises what it raised); waits for it to end."""
        if not self._finished:
            if not self._done.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError("the fill job did not finish in time")
            self._done.release()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class FillWorker:
    """A dedicated thread that runs queued jobs in order; results come back as ``Ticket``s.

    Jobs run without any lock of ours held, so the caller's thread is free to run the forward.
    """

    def __init__(self, name: str = "grammask-fill", cpus: frozenset[int] | None = None
                 ) -> None:
        """``cpus``: the CPUs the thread runs on (Linux; None: the creating thread's). vLLM's
        CPU worker pins itself and every thread it starts to its OpenMP cores, so a fill
        thread left alone time-slices with the forward it is meant to overlap."""
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], Ticket[Any]] | None] = queue.SimpleQueue()
        #: a ticket the thread made after its last job, for the next ``run`` to take (making
        #: one, a lock, is dear on the host's critical path when cold)
        self.spare: Ticket[Any] | None = Ticket()
        self._closed = False
        self._thread = threading.Thread(target=_work,
                                        args=(self._jobs, weakref.ref(self), cpus, name),
                                        name=name, daemon=True)
        self._thread.start()
        # stop the thread when the worker is dropped without close()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def run(self, job: Callable[[], T]) -> Ticket[T]:
        """Queue ``job``; its result (or exception) comes back through the ``Ticket``."""
        if self._closed:
            raise RuntimeError("the fill worker is closed")
        # each spare is taken once: the thread only ever replaces it with a new one
        ticket: Ticket[T] | None = self.spare
        self.spare = None
        if ticket is None:
            ticket = Ticket()
        self._jobs.put((job, ticket))
        return ticket

    def close(self, timeout: float | None = 5.0) -> None:
        self._closed = True
        if self._finalizer.alive:
            self._finalizer()
            self._thread.join(timeout)


def _work(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Ticket[Any]] | None],
          ref: weakref.ref[FillWorker], cpus: frozenset[int] | None = None,
          name: str = "") -> None:
    """The thread's loop. It holds its ``FillWorker`` weakly, so that dropping the worker
    still runs its finalizer (which stops the loop)."""
    _name_os_thread(name)
    if cpus:
        _run_on(cpus)
    while True:
        item = jobs.get()
        if item is None:
            return
        job, ticket = item
        later = metrics.Later()  # the job's metric updates: after its result is handed over
        try:
            with later:
                value = job()
        except BaseException as exc:  # handed to whoever waits on the ticket
            ticket._finish(None, exc)
        else:
            ticket._finish(value, None)
        later.flush()
        del job, ticket, item
        owner = ref()
        if owner is not None and owner.spare is None:
            owner.spare = Ticket()
        del owner


def _name_os_thread(name: str) -> None:
    """Give the calling thread its name in the kernel too (Linux, 15 bytes), so ``top -H``,
    ``py-spy`` and ``/proc/<pid>/task/*/comm`` show which thread is the fill."""
    if not name or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _run_on(cpus: frozenset[int]) -> None:
    """Move the calling thread onto ``cpus``; a refusal (a CPU outside the process's cgroup,
    no such call on this OS) is logged and the thread stays where it was."""
    try:
        os.sched_setaffinity(0, cpus)  # 0: this thread (Linux sets affinity per thread)
    except (AttributeError, OSError, ValueError) as exc:
        log.warning("grammask: fill thread not moved to CPUs %s: %s", sorted(cpus), exc)


P = TypeVar("P")


def place_fills(rows: Sequence[tuple[Hashable | None, int, P]], n: int
                ) -> list[list[tuple[P, int]]]:
    """``rows`` (``(group, lane, payload)`` each) by fill thread: for each of ``n`` threads
    (``n >= 1``), ``(payload, lane to fill it on)``; see the module's contract."""
    share = -(-len(rows) // n)
    groups: dict[Hashable | None, list[tuple[Hashable | None, int, P]]] = {}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
    units: dict[tuple[Hashable | None, int], list[tuple[P, int]]] = {}
    for key, group in groups.items():
        if len(group) <= share or key is None:
            for _, lane, payload in group:
                units.setdefault((key, lane), []).append((payload, lane))
            continue
        cap = -(-len(group) // n)
        count = [0] * n
        surplus: list[P] = []
        for _, lane, payload in group:
            if lane < n and count[lane] < cap:
                count[lane] += 1
                units.setdefault((key, lane), []).append((payload, lane))
            else:
                surplus.append(payload)
        lane = 0
        for payload in surplus:
            while count[lane] >= cap:
                lane += 1
            count[lane] += 1
            units.setdefault((key, lane), []).append((payload, lane))
    out: list[list[tuple[P, int]]] = [[] for _ in range(n)]
    load = [0] * n
    for unit in sorted(units.values(), key=len, reverse=True):
        k = load.index(min(load))
        out[k].extend(unit)
        load[k] += len(unit)
    return out



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


class Filler:
    """Fills the mask rows of many matchers, batch-parallel where that pays.

    ``parallel_min``: the fewest matchers of one backend filled on the backend's threads;
    fewer fill on the fill thread, in one batch call. None picks by the machine: on 2 cores
    the fill thread already has the only spare core (more threads were no faster:
    docs/benchmarks.md), so the backends' threads are used from 32 rows only where at least
    4 cores are available.
    ``threads``: worker threads of the batch fills (None: the backend's default).
    ``cpus``: the CPUs the fill thread runs on (None: where the host started it).
    """

    def __init__(self, *, parallel_min: int | None = None, threads: int | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        if parallel_min is None:
            parallel_min = 32 if _cores() >= 4 else 2**31
        self.parallel_min = max(1, parallel_min)
        self.threads = threads
        self.cpus = cpus
        self._pools: dict[str, Any] = {}  # the backends' batch-fill pools, made on first use

    def fill(self, entries: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor,
             grouped: BatchFills | None = None) -> None:
        """Write ``bitmask[row]`` for every ``(matcher, row)`` of ``entries`` and ``grouped``;
        rows must be distinct.

        Matchers whose class has batch calls (``backends.base.batch_calls``) are grouped by
        class (``grouped``: rows the caller grouped so already, ``rows.advance_all``; left
        as given); a group goes through its ``batch_fill``, on the backend's threads from
        ``parallel_min`` rows, on this thread below that (one native call, the
        GIL released, still cheaper than a Python loop: the backend keeps the per-row
        choice). On several threads, a class with ``FillLanes`` tells its rows' locks and
        lanes, the rows are placed on threads here (``place_fills``) and it fills the
        shares. Terminated matchers of those classes (only stop tokens allowed) are copied
        in bulk (``fill_stop_only``); lone rows and other classes take their own ``fill``."""
        groups: BatchFills = {}
        rest: list[tuple[Matcher, int]] = []
        for matcher, row in entries:
            calls = batch_calls(type(matcher))
            if calls is None:
                rest.append((matcher, row))
            else:
                groups.setdefault(calls, []).append((matcher, row))
        for calls, given in (grouped or {}).items():
            groups[calls] = given + groups[calls] if calls in groups else given
        ended: list[tuple[BackendMatcher, int]] = []
        for calls, rows in groups.items():
            live: list[tuple[Matcher, int]] = []
            for matcher, row in rows:
                if not matcher.is_terminated():
                    live.append((matcher, row))
                elif isinstance(matcher, BackendMatcher):
                    ended.append((matcher, row))  # only stop tokens: copied in bulk below
                else:
                    rest.append((matcher, row))
            if len(live) > 1:
                threads = self.threads if len(live) >= self.parallel_min else 1
                lanes = lane_calls(calls) if threads != 1 else None
                plan = lanes.fill_lanes(live, bitmask, threads) if lanes is not None else None
                if lanes is not None and plan is not None:
                    lanes.fill_shares(place_fills(plan[1], plan[0]), bitmask, self._pools)
                else:
                    calls.batch_fill(live, bitmask, threads, self._pools)
            else:
                rest.extend(live)
        if ended:
            fill_stop_only(ended, bitmask)
        for matcher, row in rest:
            matcher.fill(bitmask, row)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def stop_only_row(stop_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A one-row bitmask allowing only ``stop_ids`` (errored rows, forced EOS)."""
    with normal_tensors():
        row = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)
    words = row.numpy().view("uint32")
    for tid in stop_ids:
        words[tid >> 5] |= 1 << (tid & 31)
    return row


ErrorPolicy = Literal["stop", "free"]


class RowMasks:
    """Writes those masks into a bitmask's rows (the step's buffer or a host-order one)."""

    def __init__(self, vocab: Vocabulary, on_error: ErrorPolicy) -> None:
        self.vocab = vocab
        self.on_error: ErrorPolicy = on_error
        self.stop_row = stop_only_row(vocab.stop_ids, vocab.vocab_size)
        self._guards: dict[bytes, BoundaryGuard] = {}  # one per byte marker

    def error(self, out: torch.Tensor, index: int) -> bool:
        """An errored row's mask: stop-only (True: mask the row), or none (False: ``free``)."""
        if self.on_error == "stop":
            out[index].copy_(self.stop_row)
            return True
        return False

    def error_or_free(self, out: torch.Tensor, index: int) -> None:
        """An errored row's mask where every row is masked (drafts): ``free`` is all ones."""
        if not self.error(out, index):
            out[index].fill_(-1)

    def guard(self, gate: Gate, out: torch.Tensor, index: int) -> bool:
        """A thinking row with a byte marker: refuse tokens that would end the marker inside
        themselves; and those the gate refuses (``RuleGate``: vLLM's masked implicit
        reasoning ends). False when nothing is refused (``out[index]`` is then untouched)."""
        ids = gate.refused()
        marker = gate.byte_marker
        if marker is not None:
            guard = self._guards.get(marker)
            if guard is None:
                guard = self._guards[marker] = BoundaryGuard(marker, self.vocab.tokens)
            ids = guard.forbidden(gate.marker_prefixes())
        if ids.size == 0:
            return False
        row = out[index]
        row.fill_(-1)
        words = row.numpy().view(np.uint32)
        np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return True
