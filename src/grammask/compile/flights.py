"""Single flight and one deadline per compile: where a request for a spec key finds the cached
grammar, a remembered failure, or the flight it joins or starts.

Kept apart from the service (``compiler``), which builds flights: this module keeps the table
of flights and settles each one exactly once, by its build's outcome (a grammar into the
memory cache, the request's own error into its negative cache), its deadline (``Reaper``) or
``close``. Every caller gets a future of its own (cancelling it drops only that caller); an
error reaches each as a fresh copy.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from .. import metrics
from ..errors import (
    CompileFailure,
    CompilerClosedError,
    CompileTimeoutError,
    GrammarError,
    InternalCompileError,
)
from .grammar import Grammar, fresh_error
from .state import ServiceState

#: bound once: ``labels()`` takes a lock and checks its arguments, a cost on every hit
_MEMORY_HITS = metrics.cache_requests("memory", "hit")
_MEMORY_MISSES = metrics.cache_requests("memory", "miss")

class Flight:
    """One in-flight compile of a key and the callers' futures waiting on it."""

    def __init__(self, key: str, deadline: float) -> None:
        self.key = key
        self.deadline = deadline
        self.waiters: list[Future[Grammar]] = []
        self.done = False
        #: handed to the reaper (at once, unless its builder is its only caller: then when
        #: a second caller joins; the builder checks its own deadline)
        self.watched = False
        #: the error that settled the flight (a copy: the flight outlives its request in the
        #: reaper's heap, and must not hold its frames); None when a grammar did
        self.error: BaseException | None = None

    @staticmethod
    def notify(waiters: list[Future[Grammar]], grammar: Grammar | None,
               error: BaseException | None) -> None:
        """Hand every waiting caller the outcome, an error as a fresh copy each (one error
        object raised again and again grows its traceback); cancelled futures are skipped."""
        for fut in waiters:
            if fut.done():  # cancelled by its caller
                continue
            with contextlib.suppress(InvalidStateError):  # cancelled just now
                if error is not None:
                    fut.set_exception(fresh_error(error))
                else:
                    fut.set_result(grammar)  # type: ignore[arg-type]


#: What a lookup found: a hit (the grammar) or a remembered failure, else the caller's future
#: on the flight it joined or registered (no future: it builds on its own thread), and the
#: flight it registered (None when it joined one, or on a hit).
Found = tuple[Grammar | BaseException | None, Future[Grammar] | None, Flight | None]


class Reaper:
    """Resolves flights still pending at their deadline (one daemon thread per compiler), so a
    request's future is done by ``timeout_s`` even when its build waits for a thread."""

    GRACE_S = 0.05

    def __init__(self, fire: Callable[[Flight], None]) -> None:
        self._fire = fire
        self._heap: list[tuple[float, int, Flight]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, flight: Flight) -> None:
        """Woken only for a deadline earlier than the one it sleeps until: flights share one
        timeout, so a cold compile does not wake a thread that competes with it for the GIL."""
        entry = (flight.deadline + self.GRACE_S, next(self._seq), flight)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammask-reaper",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        """Runs while flights are pending, then exits (an idle compiler holds no thread, and
        a dropped one can be collected)."""
        while True:
            with self._cond:
                while not self._stopped:
                    while self._heap and self._heap[0][2].done:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._thread = None
                        return
                    if self._heap[0][0] <= time.monotonic():
                        break
                    self._cond.wait(self._heap[0][0] - time.monotonic())
                if self._stopped:
                    self._thread = None
                    return
                _, _, flight = heapq.heappop(self._heap)
            self._fire(flight)


class Flights:
    """The compiles in flight, by spec key, under the service's one lock (shared with its
    memory: a lookup is one lock acquisition). ``closed`` is read under that lock."""

    def __init__(self, state: ServiceState, timeout_s: float) -> None:
        self._state = state
        self._lock = state.lock
        self._memory = state.memory
        self._stats = state.stats
        self._timeout_s = timeout_s
        self._inflight: dict[str, Flight] = {}
        self._reaper = Reaper(self.expire)

    def __len__(self) -> int:
        """Flights pending now (the caller holds the lock)."""
        return len(self._inflight)

    def lookup(self, key: str, here: bool) -> Found:
        """Under the lock: a hit or a remembered failure (a fresh copy); else the caller's
        future on the flight it joined, or the flight it registered (a miss: the caller
        builds it; with no future when it builds ``here``, on its own thread).
        ``CompilerClosedError`` once closed."""
        with self._lock:
            if self._state.closed:
                raise CompilerClosedError("the compiler is closed")
            hit = self._memory.get(key)
            if hit is not None:
                self._stats.hits += 1
                _MEMORY_HITS.inc()
                return hit, None, None
            failed = self._memory.failure(key, time.monotonic())
            if failed is not None:
                self._stats.negative_hits += 1
                return fresh_error(failed), None, None
            running = self._inflight.get(key)
            if running is not None:
                self._stats.joined += 1
                fut: Future[Grammar] = Future()
                running.waiters.append(fut)
                watch, running.watched = not running.watched, True
            else:
                self._stats.misses += 1
                _MEMORY_MISSES.inc()
                flight = Flight(key, time.monotonic() + self._timeout_s)
                mine: Future[Grammar] | None = None if here else Future()
                flight.waiters.extend(() if mine is None else (mine,))
                # a caller that builds on its own thread waits for nobody's deadline but its
                # own, which its build checks: the reaper (a lock, a heap, a wake-up on a
                # cold compile's path) only once someone joins
                flight.watched = mine is not None
                self._inflight[key] = flight
        if running is not None:
            if watch:
                self._reaper.add(running)
            return None, fut, None
        if flight.watched:
            self._reaper.add(flight)
        return None, mine, flight

    def resolve(self, flight: Flight, grammar: Grammar | None = None,
                error: BaseException | None = None) -> bool:
        """Settle every caller's future of a flight once; False when already settled."""
        with self._lock:
            if flight.done:
                return False
            flight.done = True
            if error is not None:
                flight.error = fresh_error(error)
            if self._inflight.get(flight.key) is flight:
                del self._inflight[flight.key]
            waiters, flight.waiters = flight.waiters, []
        Flight.notify(waiters, grammar, error)
        return True

    def fail(self, flight: Flight, exc: BaseException) -> BaseException:
        """Settle a flight whose build raised ``exc``: anything not a ``CompileFailure``
        becomes an ``InternalCompileError``; only the request's own fault (a
        ``GrammarError``) is remembered for the key. Returns what settled the flight (a
        timeout or close that came first wins)."""
        self.expire_overrun(flight)
        error = exc if isinstance(exc, CompileFailure) else InternalCompileError(
            f"internal error while compiling: {type(exc).__name__}: {exc}")
        with self._lock:
            self._stats.errors += 1
            if isinstance(error, InternalCompileError):
                self._stats.internal_errors += 1
            elif isinstance(error, GrammarError):
                self._memory.remember_failure(flight.key, error, time.monotonic())
        settled = self.resolve(flight, error=error)
        return error if settled or flight.error is None else flight.error

    def succeed(self, flight: Flight, grammar: Grammar) -> Grammar | BaseException:
        """Cache a flight's grammar (unless closed meanwhile) and settle the flight with it;
        returns what settled the flight (a timeout or close that came first wins)."""
        self.expire_overrun(flight)
        with self._lock:
            if not self._state.closed:
                self._memory.insert(flight.key, grammar)
        settled = self.resolve(flight, grammar=grammar)
        return grammar if settled or flight.error is None else flight.error

    def expire(self, flight: Flight) -> None:
        """The reaper's call: a flight reached its deadline with its build still going."""
        error = CompileTimeoutError(f"not compiled within {self._timeout_s:.2f} s")
        if self.resolve(flight, error=error):
            with self._lock:
                self._stats.timeouts += 1

    def expire_overrun(self, flight: Flight) -> None:
        """A build that ended past its flight's deadline settles it as the reaper would have
        (a flight its builder alone waits on is not the reaper's until someone joins)."""
        if time.monotonic() >= flight.deadline + Reaper.GRACE_S:
            self.expire(flight)

    def close(self, error: BaseException) -> None:
        """Settle every pending flight with ``error`` and stop watching deadlines (the
        service closed, so ``lookup`` registers no new flight)."""
        with self._lock:
            left = list(self._inflight.values())
        for flight in left:
            self.resolve(flight, error=error)
        self._reaper.stop()
