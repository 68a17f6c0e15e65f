"""``compile/flights``: single flight and one deadline per compile, on a real service state
(``ServiceState``) and real grammars. A lookup finds the cached grammar, a remembered refusal
(a fresh copy each time), or the flight it joins or registers; each flight is settled once,
by its build, its deadline (the reaper) or ``close``; cancelling one caller drops only it."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from grammask import Compiler, GrammarError, GrammarSpec, Vocabulary
from grammask.compile.cache import CompileCache
from grammask.compile.flights import Flights
from grammask.compile.state import ServiceState
from grammask.compile.stats import Stats
from grammask.errors import CompilerClosedError, CompileTimeoutError, InternalCompileError

SPEC = GrammarSpec.regex("fl[a-z]ght", backend="guidance")


def _state(vocab: Vocabulary) -> ServiceState:
    stats = Stats()
    return ServiceState(vocab, stats, CompileCache(stats, 1 << 30, 60.0, 16))


def test_callers_of_one_key_share_one_flight_then_hit(compiler: Compiler,
                                                      qwen25: Vocabulary) -> None:
    grammar = compiler.compile(SPEC)
    state = _state(qwen25)
    flights = Flights(state, timeout_s=600.0)
    found, builder, flight = flights.lookup(SPEC.key, here=False)
    assert found is None and builder is not None and flight is not None
    joined = [flights.lookup(SPEC.key, here=False) for _ in range(2)]
    assert all(j[0] is None and j[2] is None for j in joined) and len(flights) == 1
    dropped = joined[0][1]
    assert dropped is not None and dropped.cancel()  # one caller gives up: only it
    assert flights.succeed(flight, grammar) is grammar
    assert builder.result(0) is grammar and joined[1][1].result(0) is grammar  # type: ignore[union-attr]
    assert dropped.cancelled() and len(flights) == 0
    assert flights.lookup(SPEC.key, here=False) == (grammar, None, None)
    assert (state.stats.misses, state.stats.joined, state.stats.hits) == (1, 2, 1)
    assert not flights.resolve(flight, error=RuntimeError("late"))  # settled once


def test_a_refusal_is_remembered_and_handed_out_as_fresh_copies(qwen25: Vocabulary) -> None:
    state = _state(qwen25)
    flights = Flights(state, timeout_s=600.0)
    _, waiter, flight = flights.lookup("bad", here=False)
    assert flight is not None and waiter is not None
    error = flights.fail(flight, GrammarError("refused"))
    assert isinstance(error, GrammarError)
    with pytest.raises(GrammarError, match="refused"):
        waiter.result(0)
    first, _, _ = flights.lookup("bad", here=False)
    second, _, _ = flights.lookup("bad", here=False)
    assert isinstance(first, GrammarError) and isinstance(second, GrammarError)
    assert first is not second and state.stats.negative_hits == 2


def test_a_broken_build_is_internal_and_never_remembered(qwen25: Vocabulary) -> None:
    state = _state(qwen25)
    flights = Flights(state, timeout_s=600.0)
    _, waiter, flight = flights.lookup("k", here=False)
    assert flight is not None and waiter is not None
    assert isinstance(flights.fail(flight, ValueError("bug")), InternalCompileError)
    with pytest.raises(InternalCompileError, match="ValueError: bug"):
        waiter.result(0)
    found, _, registered = flights.lookup("k", here=False)
    assert found is None and registered is not None  # built again, not a remembered failure
    assert state.stats.internal_errors == 1


def test_the_reaper_settles_a_flight_at_its_deadline(compiler: Compiler,
                                                     qwen25: Vocabulary) -> None:
    state = _state(qwen25)
    flights = Flights(state, timeout_s=0.05)
    _, waiter, flight = flights.lookup(SPEC.key, here=False)
    assert waiter is not None and flight is not None
    with pytest.raises(CompileTimeoutError):
        waiter.result(timeout=30)  # settled by the reaper, the build still "running"
    assert state.stats.timeouts == 1 and len(flights) == 0
    late = compiler.compile(SPEC)
    assert isinstance(flights.succeed(flight, late), CompileTimeoutError)  # the timeout won
    assert flights.lookup(SPEC.key, here=False) == (late, None, None)  # still cached


def test_close_settles_every_flight_and_later_lookups_fail(compiler: Compiler,
                                                           qwen25: Vocabulary) -> None:
    state = _state(qwen25)
    flights = Flights(state, timeout_s=600.0)
    _, waiter, flight = flights.lookup(SPEC.key, here=False)
    assert waiter is not None and flight is not None
    with state.lock:
        state.closed = True
    flights.close(CompilerClosedError("closed"))
    with pytest.raises(CompilerClosedError):
        waiter.result(0)
    with pytest.raises(CompilerClosedError):
        flights.lookup(SPEC.key, here=False)
    flights.succeed(flight, compiler.compile(SPEC))  # a late result: not cached once closed
    assert state.memory.get(SPEC.key) is None


def test_a_caller_building_here_holds_no_future(qwen25: Vocabulary) -> None:
    flights = Flights(_state(qwen25), timeout_s=600.0)
    found, mine, flight = flights.lookup("here", here=True)
    assert found is None and mine is None and flight is not None and not flight.watched
    _, joined, _ = flights.lookup("here", here=False)
    assert isinstance(joined, Future) and flight.watched  # watched once someone joins
    flights.fail(flight, GrammarError("no"))
