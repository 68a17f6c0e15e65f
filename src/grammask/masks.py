"""Bitmask buffers, the fill worker thread and batch-parallel fills (the fill side of a step;
``grammask.apply`` masks the logits).

Where each piece runs in a decode step:

- ``MaskBuffers``: int32 ``(max_batch, ceil(V/32))`` buffers allocated once and reused (grown
  when speculative decoding needs rows for draft positions). Two of them alternate step by
  step, so a fill never writes a buffer whose host-to-device copy of the previous step may
  still be in flight (pinned memory, non-blocking copy). On CPU the second buffer is idle but
  keeps a single code path.
- ``FillWorker``: one dedicated daemon thread that runs the step's fill job while the caller's
  thread runs the model forward. Both backends release the GIL inside their fill, so the forward
  (which releases it inside torch kernels) and the fill really run at once.
- ``Filler``: fills a set of rows through the backends' batch calls (``BatchCalls``:
  xgrammar ``BatchGrammarMatcher``, llguidance ``LLExecutor``), on the backend's threads from
  ``parallel_min`` rows of one backend, on the fill thread below.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from . import metrics
from .backends.base import BackendMatcher, BatchFills, Matcher, batch_calls, fill_stop_only
from .bitmask import allocate_bitmask, bitmask_words, normal_tensors

T = TypeVar("T")
log = logging.getLogger("grammask")

class MaskBuffers:
    """``count`` reusable bitmasks; pinned when CUDA is present so device copies can overlap."""

    def __init__(self, max_batch: int, vocab_size: int, *, count: int = 2) -> None:
        if max_batch < 1 or count < 1:
            raise ValueError(f"need max_batch >= 1 and count >= 1, got {max_batch}, {count}")
        self.max_batch = max_batch
        #: each buffer's rows: the batch's, then room for draft positions (``grow``)
        self.rows = max_batch
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.pinned = torch.cuda.is_available()
        self._buffers = [allocate_bitmask(max_batch, vocab_size, pin=self.pinned)
                         for _ in range(count)]
        self._retired: list[torch.Tensor] = []  # outgrown: a device copy may still read one
        # GPU only (untested here): the copy of buffer i to the device, recorded by apply().
        self._copy_done: list[Any | None] = [None] * count
        self._events: list[Any | None] = [None] * count  # made once, recorded per copy
        self._device: torch.Tensor | None = None  # the device copy's buffer
        #: mask rows the last device copy moved (``copy_runs``: the rows in use)
        self.rows_copied = 0
        self._next = 0

    @property
    def count(self) -> int:
        return len(self._buffers)

    def acquire(self) -> torch.Tensor:
        """The next buffer in turn, once no device copy still reads it."""
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._copy_done[index]
        if event is not None:  # GPU path: wait for the copy of two steps ago (releases the GIL)
            event.synchronize()
            self._copy_done[index] = None
        return self._buffers[index]

    def grow(self, rows: int) -> None:
        """Buffers of at least ``rows`` rows from the next ``acquire`` on (speculative
        decoding writes draft positions above the batch's rows); at least doubles, so a
        host's growing drafts reallocate a few times, not every step."""
        if rows <= self.rows:
            return
        self.rows = max(rows, 2 * self.rows)
        self._retired = list(self._buffers)
        self._buffers = [allocate_bitmask(self.rows, self.vocab_size, pin=self.pinned)
                         for _ in self._buffers]
        self._copy_done = [None] * len(self._buffers)
        self._events = [None] * len(self._buffers)

    def room(self, bitmask: torch.Tensor, base: int, extra: int) -> torch.Tensor:
        """``bitmask`` (one of these buffers) with ``extra`` rows from row ``base`` on (draft
        positions above the rows a step uses): itself when it has them; else a larger copy
        of its first ``base`` rows, kept with the outgrown buffers (a device copy may still
        read it), and from the next ``acquire`` on buffers with ``extra`` rows above every
        batch row (``grow``)."""
        need = base + extra
        if bitmask.shape[0] >= need:
            return bitmask
        self.grow(self.max_batch + extra)
        larger = allocate_bitmask(need, self.vocab_size, pin=self.pinned)
        larger[:base].copy_(bitmask[:base])
        self._retired.append(larger)
        return larger

    def to_device(self, bitmask: torch.Tensor, rows: int | Sequence[tuple[int, int]],
                  device: torch.device) -> torch.Tensor:
        """Copy the first ``rows`` rows (or the row ranges ``[lo, hi)`` given,
        ``copy_runs``) to ``device`` without blocking the host, into a device buffer kept
        across steps (stream order keeps it safe; rows not copied hold stale bits), and mark
        the host buffer busy until the copy ran (one event per buffer, made once)."""
        runs = [(0, rows)] if isinstance(rows, int) else list(rows)
        top = max((hi for _, hi in runs), default=0)
        dev = self._device
        if (dev is None or dev.device != device or dev.shape[0] < top
                or dev.shape[1] != bitmask.shape[1]):
            dev = self._device = torch.empty(max(top, self.max_batch), bitmask.shape[1],
                                             dtype=torch.int32, device=device)
        for lo, hi in runs:
            dev[lo:hi].copy_(bitmask[lo:hi], non_blocking=True)
        self.rows_copied = sum(hi - lo for lo, hi in runs)
        if device.type != "cuda":  # a synchronous copy: nothing to wait for
            return dev
        pointer = bitmask.data_ptr()
        for i, buf in enumerate(self._buffers):
            if buf.data_ptr() == pointer:
                event = self._events[i]
                if event is None:
                    event = self._events[i] = torch.cuda.Event(  # type: ignore[no-untyped-call]
                        blocking=True)
                event.record()
                self._copy_done[i] = event
        return dev


def copy_runs(rows: np.ndarray[Any, Any], *, gap: int = 8, most: int = 16
              ) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering ``rows`` for a device copy that follows the rows in
    use, not the highest of them (vLLM 0.34 hands slots out from the top of its free list:
    one request at slot 1023 would copy 1,024 rows). Ranges less than ``gap`` rows apart
    are joined (a copy call costs more than a few rows); at most ``most`` ranges, the
    closest joined first."""
    if rows.size == 0:
        return []
    ordered = np.unique(rows)
    breaks = np.flatnonzero(np.diff(ordered) > gap)
    if breaks.size >= most:  # keep the ``most - 1`` widest gaps as breaks
        widths = np.diff(ordered)[breaks]
        breaks = np.sort(breaks[np.argsort(widths, kind="stable")[-(most - 1):]])
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [ordered.size - 1]))
    return [(int(ordered[a]), int(ordered[b]) + 1) for a, b in zip(starts, ends, strict=True)]


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


class Filler:
    """Fills the mask rows of many matchers, batch-parallel where that pays.

    ``parallel_min``: the fewest matchers of one backend filled on the backend's threads;
    fewer fill on the fill thread, in one batch call. None picks by the machine: on 2 cores
    the fill thread already has the only spare core (``bench/overlap.py``: more threads were
    no faster), so the backends' threads are used from 32 rows only where at least 4 cores
    are available.
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
        choice). Terminated matchers of those classes (only stop tokens allowed) are copied
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
