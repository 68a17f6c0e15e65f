"""The fill worker thread (``FillWorker``) and its tickets.

``FillWorker``: one dedicated daemon thread that runs the step's fill job while the caller's
thread runs the model forward. Both backends release the GIL inside their fill, so the forward
(which releases it inside torch kernels) and the fill really run at once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .. import metrics

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
