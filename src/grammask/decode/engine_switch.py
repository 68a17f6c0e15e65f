"""The engine switch: running rows move to the engine the fill tuner found cheaper.

The fill tuner (``compile/filltune``) compares a JSON schema's routed grammar with a rival
that enforces every keyword of it alike (same mode, same whitespace) and, when the rival
fills cheaper here, serves the spec's later requests with it and offers a ``Verdict``. Rows
of that spec already running switch to it.

A switch replays the row's constrained history (the tokens its matcher took, after the
thinking gate) into a matcher of the new grammar; the row then follows the new engine's
language, exactly as a row that started there with the same history. Its rollback reaches
past the switch point (the new matcher took the whole history). It stays on its engine,
counted by why, when the new engine refuses that history (llguidance refuses some escapes
xgrammar accepts), loses the parse (a dead end) or allows no token. Rows still compiling or
thinking switch once they attach. Finished, errored and forced-backend rows never switch.

Where: the replay of a long history runs on a thread of its own (``REPLAY_THREADS``), off
the fill job and the apply; a fill job only snapshots a row's history for it (at most
``SUBMIT_PER_JOB`` rows a job) and, for rows whose replay is done, feeds the few tokens
that came since and swaps the matcher: at the start of the job, after it read the rows'
commits and before it feeds and fills them (the job owns its rows: no commit pending, no
draft being fed). A row rolled back behind its replay is replayed again. A wave of hundreds
of rows switches within a few steps and never stalls one.

Outputs then depend on when a verdict lands (a timing), so seeded runs reproduce only with
the switch off (``BatchProcessor(engine_switch=False)``; the vLLM setting ``engine_switch``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .. import metrics
from ..backends import registry
from ..backends.base import Matcher
from ..compile import fillcost
from ..compile.compiler import Compiler, Grammar
from ..compile.filltune import Verdict
from ..kernels.bitmask import allocate_bitmask
from .rows import Row, Work

log = logging.getLogger("grammask")

#: rows whose history a fill job hands to the replay thread, and replays in flight at most
SUBMIT_PER_JOB = 64
IN_FLIGHT = 256
#: threads that replay histories (off the fill thread)
REPLAY_THREADS = 1
#: a row hands its history to the fill comparison once it took this many tokens
WALK_AFTER = 48


@dataclass(eq=False)
class _Replay:
    """A row's history being replayed into a matcher of the verdict's grammar."""

    row: Row
    verdict: Verdict
    tokens: list[int]
    future: Future[tuple[str, Matcher | None]]


class EngineSwitch:
    """Switches a fill job's rows to the engines the compiler's fill tuner offers."""

    def __init__(self, compiler: Compiler, vocab_size: int, *, enabled: bool = True) -> None:
        self._compiler = compiler
        self.enabled = enabled and compiler.tune_fill
        self._vocab_size = vocab_size
        self._done_epoch = 0  # the compiler's epoch once no row was left to switch
        self._replays: dict[int, _Replay] = {}  # by id(row), the row kept in the entry
        self._stayed: dict[int, Row] = {}  # rows the new engine refused: never again
        self._pool: ThreadPoolExecutor | None = None

    def run(self, work: Sequence[Work], table: dict[int, Row]) -> None:
        """At the start of a fill job (its rows' commits read, not fed yet): swap in the
        rows whose replay is done, hand more rows' histories to the replay thread;
        ``table``: every row, to know when a verdict's rows are done. Costs one int compare
        a job while no verdict is open. Never raises: a failure leaves rows where they are.
        Before any verdict, hands the fill comparison a running row's tokens
        (``Compiler.note_walk``), so both engines are timed on the tokens rows take."""
        wanting = self._compiler.fill_tuner.wanting
        if wanting:
            self._hand_walks(work, wanting)
        if not self.enabled:
            return
        epoch = self._compiler.fill_tuner.epoch
        if epoch == self._done_epoch:
            return
        try:
            self._switch(work, table, epoch)
        except Exception as exc:  # never the job's concern: rows stay on their engines
            log.warning("grammask: the engine switch failed: %s: %s", type(exc).__name__, exc)
            self._done_epoch = epoch

    def _hand_walks(self, work: Sequence[Work], wanting: frozenset[str]) -> None:
        """One row's history per spec the comparison waits on (those with ``WALK_AFTER``
        tokens or more)."""
        handed: set[str] = set()
        for _, r, new in work:
            grammar = r.grammar
            if (grammar is None or r.fed < WALK_AFTER or r.error is not None
                    or grammar.spec.key not in wanting or grammar.spec.key in handed):
                continue
            start = r.seen - len(new) - r.fed
            history = [int(t) for t in r.output[start:start + fillcost.PROBE_TOKENS]]
            handed.add(grammar.spec.key)
            self._compiler.fill_tuner.note_walk(grammar.spec.key, history)

    def settle(self) -> None:
        """Wait for the replays in flight (tests, benchmarks; a job never waits)."""
        for replay in list(self._replays.values()):
            replay.future.exception()

    def close(self) -> None:
        """Stop the replay thread (replays in flight are dropped with their matchers)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _switch(self, work: Sequence[Work], table: dict[int, Row], epoch: int) -> None:
        keys = self._compiler.fill_tuner.offered
        submitted = 0
        for _, r, new in work:
            verdict = self._offer(r, keys)
            if verdict is None:
                continue
            replay = self._replays.get(id(r))
            if replay is not None and replay.row is r:
                if replay.future.done():
                    del self._replays[id(r)]
                    self._finish(r, len(new), replay)
                continue
            if submitted < SUBMIT_PER_JOB and len(self._replays) < IN_FLIGHT:
                self._submit(r, len(new), verdict)
                submitted += 1
        live = {id(r) for r in table.values()}
        for gone in [k for k in self._replays if k not in live]:
            self._drop(self._replays.pop(gone))
        for gone in [k for k in self._stayed if k not in live]:
            del self._stayed[gone]
        if not self._replays and not any(self._left(r, keys) for r in table.values()):
            self._done_epoch = epoch
            self._report(keys)

    def _offer(self, r: Row, keys: frozenset[str]) -> Verdict | None:
        """The verdict this row may switch by (None: not a running row of an offered spec)."""
        grammar, matcher = r.grammar, r.matcher
        if (grammar is None or matcher is None or r.error is not None or r.backlog
                or grammar.spec.key not in keys or r.request.spec.backend is not None
                or id(r) in self._stayed):
            return None
        verdict = self._compiler.fill_tuner.offer(grammar.spec.key, grammar.backend)
        if verdict is None or matcher.is_terminated():
            return None
        return verdict

    def _left(self, r: Row, keys: frozenset[str]) -> bool:
        """Whether the row may still switch: running on an offered spec's routed engine, or
        not attached yet (compiling, thinking) to one of an offered spec."""
        if r.error is not None or r.request.spec.key not in keys:
            return False
        if r.matcher is None:
            return True
        return self._offer(r, keys) is not None

    @staticmethod
    def _history(r: Row, unread: int) -> list[int] | None:
        """The row's constrained history: the ``fed`` tokens before this job's ``unread``
        new ones (None: the output does not hold them, which never happens)."""
        end = r.seen - unread
        history = [int(t) for t in r.output[end - r.fed:end]] if r.fed else []
        return history if len(history) == r.fed else None

    def _submit(self, r: Row, unread: int, verdict: Verdict) -> None:
        history = self._history(r, unread)
        if history is None:
            self._stay(r, verdict, "error")
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(REPLAY_THREADS,
                                            thread_name_prefix="grammask-switch")
        future = self._pool.submit(_replay, verdict.grammar, history, self._vocab_size)
        self._replays[id(r)] = _Replay(r, verdict, history, future)

    def _finish(self, r: Row, unread: int, replay: _Replay) -> None:
        """A done replay: catch up with the tokens the row took since, then swap (or the
        row stays, counted; rolled back behind the replay: replayed again later)."""
        outcome, matcher = replay.future.result()
        if outcome != "switched" or matcher is None:
            self._stay(r, replay.verdict, outcome)
            return
        history = self._history(r, unread)
        done = len(replay.tokens)
        if history is None or len(history) < done or history[:done] != replay.tokens:
            matcher.release()  # rolled back behind the replay: a new one next job
            return
        for token in history[done:]:
            if not matcher.accept(token):
                matcher.release()
                self._stay(r, replay.verdict, "rejected")
                return
        if getattr(matcher, "failure", None) is not None:
            matcher.release()
            self._stay(r, replay.verdict, "dead_end")
            return
        assert r.matcher is not None
        old = r.matcher
        r.matcher, r.grammar = matcher, replay.verdict.grammar
        replay.verdict.switched += 1
        metrics.ENGINE_SWITCHES.labels(outcome="switched").inc()
        old.release()

    def _stay(self, r: Row, verdict: Verdict, why: str) -> None:
        self._stayed[id(r)] = r
        verdict.stayed[why] = verdict.stayed.get(why, 0) + 1
        metrics.ENGINE_SWITCHES.labels(outcome=why).inc()

    @staticmethod
    def _drop(replay: _Replay) -> None:
        """A replay whose row left: its matcher goes back (or is dropped with the thread)."""
        if replay.future.done() and not replay.future.cancelled():
            _, matcher = replay.future.result()
            if matcher is not None:
                matcher.release()
        else:
            replay.future.cancel()

    def _report(self, keys: frozenset[str]) -> None:
        """One log line per verdict whose rows are done here."""
        for key in keys:
            for backend in registry.names():
                verdict = self._compiler.fill_tuner.offer(key, backend)
                if verdict is not None and not verdict.reported:
                    verdict.reported = True
                    log.info("grammask: engine switch: %s", verdict.describe())


def _replay(grammar: Grammar, history: list[int], vocab_size: int
            ) -> tuple[str, Matcher | None]:
    """The replay thread's work: a matcher of ``grammar`` fed ``history``; the outcome
    (switched, rejected, dead_end, empty, error) and the matcher when switched."""
    started = time.perf_counter()
    matcher: Matcher | None = None
    try:
        matcher = grammar.matcher()
        outcome = "switched"
        for token in history:
            if not matcher.accept(token):
                outcome = "rejected"
                break
        if outcome == "switched" and getattr(matcher, "failure", None) is not None:
            outcome = "dead_end"
        if outcome == "switched":
            scratch = allocate_bitmask(1, vocab_size)
            matcher.fill(scratch, 0)
            if not bool(scratch.any()):
                outcome = "empty"
    except Exception as exc:
        log.debug("grammask: replaying a row's history failed: %s", exc)
        outcome = "error"
    metrics.ENGINE_SWITCH_REPLAY.observe(time.perf_counter() - started)
    if outcome != "switched" and matcher is not None:
        matcher.release()
        matcher = None
    return outcome, matcher
