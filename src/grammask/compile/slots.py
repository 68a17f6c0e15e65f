"""Where native compiles run: bounded slots per backend, deadlines, and runaways.

A backend whose compiles are bounded by its own limits (``BackendInfo.bounded_compile``)
compiles a small spec on the calling thread, within the same slots (``Runner.run_here``;
``may_run_here``: bounded is not short, so only a spec sure to end within a tenth of the time
left). Any other native compile runs on a worker. A runaway native compile cannot be killed, so it
is *abandoned*: its slot is handed back (up to ``max_abandoned`` at once per backend; beyond
that it keeps the slot, so the CPU spent on runaways stays bounded) and its threads drop to
the lowest CPU priority. At exit, compiles
still running are let finish (a native compile torn down mid-flight aborts the process).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ..backends import BackendGrammar
from ..errors import CompileTimeoutError

log = logging.getLogger("grammask")
T = TypeVar("T")


_libc: ctypes.CDLL | None = None
with contextlib.suppress(OSError, TypeError):
    _name = ctypes.util.find_library("c")
    if _name:
        _candidate = ctypes.CDLL(_name)
        if hasattr(_candidate, "malloc_trim"):
            _libc = _candidate


def trim_heap() -> bool:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``): freed grammars otherwise
    stay in the process as free-list memory. False where the allocator has no such call."""
    if _libc is None:
        return False
    _libc.malloc_trim(0)
    return True


#: A bounded backend's compile runs on the calling thread only for a spec at most this long
#: (``GrammarSpec.source``, in characters; most of the corpus): a longer one goes to a worker,
#: where a deadline can abandon it. Bounded is not short: llguidance's limits let a
#: 100,000-string choice or 10,000 properties compile for many seconds (docs/benchmarks.md,
#: Figures: compile routing).
HERE_MAX_CHARS = 8192
#: The share of the time left that a compile on the calling thread may be expected to take
#: at worst (``own_thread_cost_s``): the caller then overshoots its deadline by at most this much.
HERE_SHARE = 0.1


def own_thread_cost_s(chars: int) -> float:
    """A pessimistic compile time for a spec of ``chars`` characters (llguidance: a cost a
    character above the corpus' worst, plus a quadratic term for schemas with many
    properties; the figures behind the coefficients: docs/benchmarks.md, Figures: compile
    routing)."""
    return chars * 8e-6 + chars * chars * 1e-10


def may_run_here(chars: int, left_s: float) -> bool:
    """Whether a bounded compile of a spec this long may run on the calling thread with
    ``left_s`` seconds to its deadline: small, and sure to end within ``HERE_SHARE`` of it.
    Past that it goes to a worker (one thread hop each way, a small share of such a compile:
    docs/benchmarks.md, Figures: compile routing)."""
    return chars <= HERE_MAX_CHARS and own_thread_cost_s(chars) <= HERE_SHARE * left_s


class Job:
    """One backend call handed to a compile worker."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.done = threading.Event()
        # the caller's own wake-up: a bare lock, released when the job ends (cheaper to make
        # and to wait on than the event, which other requests joining a runaway wait on)
        self.ready = threading.Lock()
        self.ready.acquire()
        self.value: object = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.keeps_slot = False
        self.on_late: Callable[[object, BaseException | None], None] | None = None
        self.tid = 0  # the worker's native thread id
        self.started = 0  # clock ticks since boot when the job started (threads' start unit)


_RUNNING: set[Job] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _finish_running_compiles() -> None:
    """Workers are daemons (idle ones must not block exit), but a native compile torn down
    mid-flight aborts the process: let running ones finish first (bounded). A program that
    must exit at once flushes its output and calls ``os._exit`` (the CLI does)."""
    deadline = time.monotonic() + 120
    with _RUNNING_LOCK:
        jobs = list(_RUNNING)
    for job in jobs:
        job.done.wait(max(0.0, deadline - time.monotonic()))


def running_compiles() -> int:
    """Native compiles still running in this process (abandoned ones included)."""
    with _RUNNING_LOCK:
        return len(_RUNNING)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _ticks() -> int:
    """Now, in the unit and from the origin of a thread's start time in /proc (clock ticks
    since boot); 0 where there is no boot clock (no thread is then taken for a new one)."""
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    return 0 if boot is None else int(time.clock_gettime(boot) * _CLK_TCK)


def _tasks_since(tick: int) -> set[int]:
    """The process's threads started at or after ``tick`` (read only when a job is
    abandoned: a listing per job would delay every cold compile before it starts;
    docs/benchmarks.md, Figures: cold path)."""
    if not tick:
        return set()
    try:
        names = os.listdir("/proc/self/task")
    except OSError:  # not Linux: nothing to lower
        return set()
    found = set()
    for name in names:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/self/task/{name}/stat", "rb") as fh:
                stat = fh.read()
            # after the command name, in parentheses: state is field 3, starttime field 22
            if int(stat[stat.rindex(b")") + 2:].split()[19]) >= tick:
                found.add(int(name))
    return found


def _deprioritize(job: Job) -> int:
    """Lower an abandoned compile's CPU priority to nice 19 (Linux: per thread): the worker
    and the threads started since the job began (to the clock tick) that are not Python's
    (the backend's own compile threads; a compile that started meanwhile on another worker
    may be caught too, and merely runs at low priority while it competes). Runaways then
    take CPU only when nothing else wants it. Returns how many threads were lowered."""
    if not job.tid or not hasattr(os, "setpriority"):
        return 0
    python = {t.native_id for t in threading.enumerate()} - {job.tid}
    targets = {job.tid} | _tasks_since(job.started)
    lowered = 0
    for tid in targets - python:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            lowered += 1
    return lowered


class Runner:
    """Runs one backend's native compiles on persistent worker threads with a concurrency bound
    and a deadline. A worker whose job is abandoned finishes it and exits; a new worker is
    started on demand, so capacity survives runaways (up to ``max_abandoned`` of them)."""

    def __init__(self, max_running: int, max_abandoned: int) -> None:
        self._slots = threading.BoundedSemaphore(max_running)
        self._max_abandoned = max_abandoned
        self._abandoned = 0
        self._idle = 0
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @property
    def abandoned(self) -> int:
        return self._abandoned

    def run(self, fn: Callable[[], T], deadline: float, what: str,
            on_late: Callable[[object, BaseException | None], None] | None = None,
            can_fall_back: bool = False, slot_deadline: float | None = None,
            on_abandon: Callable[[Job], None] | None = None) -> T:
        """``fn()`` on a worker; CompileTimeoutError when it is not done by ``deadline`` (a
        ``time.monotonic`` value; waiting for a slot counts). ``on_late`` gets the outcome of
        a job that finished after its caller gave up. A request that ``can_fall_back`` does
        not queue behind runaways that kept their slots: it goes to its fallback at once;
        ``slot_deadline`` bounds the wait for a slot (default: ``deadline``); ``on_abandon``
        gets the job when the caller gives up on it (later requests may wait on it)."""
        self._take_slot(deadline, what, can_fall_back, slot_deadline)
        job = Job(fn)
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._work, name="grammask-compile", daemon=True).start()
        self._jobs.put(job)
        if not job.ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not job.done.is_set():
                    job.abandoned = True
                    job.on_late = on_late
                    self._abandoned += 1
                    if self._abandoned <= self._max_abandoned:
                        self._slots.release()  # a fresh compile may start meanwhile
                    else:
                        job.keeps_slot = True
                    abandoned = True
                else:
                    abandoned = False
            if abandoned:
                _deprioritize(job)
                if on_abandon is not None:
                    on_abandon(job)
                raise CompileTimeoutError(f"{what} compile exceeded its time budget")
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    def run_here(self, fn: Callable[[], T], deadline: float, what: str,
                 can_fall_back: bool = False, slot_deadline: float | None = None) -> T:
        """``fn()`` on this thread, within the same slots as ``run`` (for a backend whose
        compiles are bounded: nothing to abandon, so no hand-off to a worker)."""
        self._take_slot(deadline, what, can_fall_back, slot_deadline)
        try:
            return fn()
        finally:
            self._slots.release()

    def _take_slot(self, deadline: float, what: str, can_fall_back: bool,
                   slot_deadline: float | None) -> None:
        if not self._slots.acquire(blocking=False):
            if can_fall_back and self._abandoned > self._max_abandoned:
                raise CompileTimeoutError(f"every {what} compile slot is held by a runaway")
            budget = min(deadline, slot_deadline or deadline) - time.monotonic()
            if budget <= 0 or not self._slots.acquire(timeout=budget):
                raise CompileTimeoutError(f"no {what} compile slot free before the deadline")

    def _work(self) -> None:
        tid = threading.get_native_id()
        while True:
            job = self._jobs.get()
            job.tid = tid
            job.started = _ticks()
            with _RUNNING_LOCK:
                _RUNNING.add(job)
            try:
                job.value = job.fn()
            except BaseException as exc:  # handed to the caller
                job.error = exc
            with _RUNNING_LOCK:
                _RUNNING.discard(job)
            with self._lock:
                # the bookkeeping first, the wake-up last: the caller wakes to a worker with
                # nothing left to do but wait (not to one it must wait for the GIL from)
                if job.abandoned:
                    self._abandoned -= 1
                    if job.keeps_slot:
                        self._slots.release()
                else:
                    self._slots.release()
                    self._idle += 1
                job.done.set()
                job.ready.release()
            if job.abandoned:
                if job.on_late is not None:
                    try:
                        job.on_late(job.value, job.error)
                    except Exception:  # a late result is a bonus; never kill the worker
                        log.exception("grammask: storing a late compile result failed")
                return  # the caller moved on; a fresh worker replaces this one


def join_abandoned(job: Job, deadline: float, what: str) -> BackendGrammar:
    """Wait (until ``deadline``) for a compile an earlier request abandoned."""
    if not job.done.wait(max(0.0, deadline - time.monotonic())):
        raise CompileTimeoutError(f"{what} is still compiling this spec (an earlier "
                                  f"request's compile, past its budget)")
    if job.error is not None:
        raise job.error
    return job.value  # type: ignore[return-value]



class Runners:
    """One ``Runner`` per backend, made on first use (a backend may register after the
    compiler was built): one backend's runaways never hold up another's compiles."""

    def __init__(self, max_running: int, max_abandoned: int) -> None:
        self._args = (max_running, max_abandoned)
        self._runners: dict[str, Runner] = {}
        self._lock = threading.Lock()

    def __getitem__(self, backend: str) -> Runner:
        runner = self._runners.get(backend)  # made once: read without the lock
        if runner is not None:
            return runner
        with self._lock:
            runner = self._runners.get(backend)
            if runner is None:
                runner = self._runners[backend] = Runner(*self._args)
            return runner

    def abandoned(self) -> int:
        with self._lock:
            return sum(r.abandoned for r in self._runners.values())
