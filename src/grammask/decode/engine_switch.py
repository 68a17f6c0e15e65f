"""The engine switch: running rows move to the engine the fill tuner found cheaper.

The fill tuner (``compile/filltune``) compares a JSON schema's routed grammar with a rival
that enforces every keyword of it alike (same mode, same whitespace) and, when the rival
fills cheaper here, serves the spec's later requests with it and offers a ``Verdict``. Rows
of that spec already running switch here, on the fill thread, at the start of a fill job:
after the job read their commit and before it feeds and fills them (never on the apply
path, never during drafts, never while a commit is pending: the job owns its rows).

A switch replays the row's constrained history (the tokens its matcher took, after the
thinking gate) into a matcher of the new grammar; the row then follows the new engine's
language, exactly as a row that started there with the same history. Its rollback reaches
past the switch point (the new matcher took the whole history). It stays on its engine,
counted by why, when the new engine refuses that history (llguidance refuses some escapes
xgrammar accepts), loses the parse (a dead end) or allows no token. Rows still compiling or
thinking switch at the first job after they attach. Finished, errored and forced-backend
rows never switch. At most ``ROWS_PER_STEP`` rows and ``BUDGET_S`` of replay per job: a wave
of hundreds of rows switches over a few steps and never stalls one.

Outputs then depend on when a verdict lands (a timing), so seeded runs reproduce only with
the switch off (``BatchProcessor(engine_switch=False)``; the vLLM setting ``engine_switch``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from .. import metrics
from ..backends import registry
from ..backends.base import Matcher
from ..compile.compiler import Compiler
from ..compile.filltune import Verdict
from ..kernels.bitmask import allocate_bitmask
from .rows import Row, Work

log = logging.getLogger("grammask")

#: most rows a fill job switches, and most replay time it spends on them
ROWS_PER_STEP = 32
BUDGET_S = 0.002


class EngineSwitch:
    """Switches a fill job's rows to the engines the compiler's fill tuner offers."""

    def __init__(self, compiler: Compiler, vocab_size: int, *, enabled: bool = True) -> None:
        self._compiler = compiler
        self.enabled = enabled and compiler.tune_fill
        self._done_epoch = 0  # the compiler's epoch once no row was left to switch
        self._scratch = allocate_bitmask(1, vocab_size)

    def run(self, work: Sequence[Work], table: dict[int, Row]) -> None:
        """Switch rows of ``work`` (the job's rows, commits read, not fed yet) whose grammar
        has an offer; ``table``: every row, to know when a verdict's rows are done. Costs
        one int compare per job while no verdict is open. Never raises: a failure leaves
        the row where it is."""
        if not self.enabled:
            return
        epoch = self._compiler.switch_epoch
        if epoch == self._done_epoch:
            return
        try:
            self._switch(work, table, epoch)
        except Exception as exc:  # never the job's concern: rows stay on their engines
            log.warning("grammask: the engine switch failed: %s: %s", type(exc).__name__, exc)
            self._done_epoch = epoch

    def _switch(self, work: Sequence[Work], table: dict[int, Row], epoch: int) -> None:
        keys = self._compiler.switch_keys
        started = time.perf_counter()
        switched = 0
        for _, r, new in work:
            if switched >= ROWS_PER_STEP or time.perf_counter() - started > BUDGET_S:
                return  # the rest at the next job (the epoch stays open)
            verdict = self._offer(r, keys)
            if verdict is not None:
                self._move(r, len(new), verdict)
                switched += 1
        if not any(self._left(r, keys) for r in table.values()):
            self._done_epoch = epoch
            self._report(keys)

    def _offer(self, r: Row, keys: frozenset[str]) -> Verdict | None:
        """The verdict this row may switch by (None: not a running row of an offered spec)."""
        grammar, matcher = r.grammar, r.matcher
        if (grammar is None or matcher is None or r.error is not None or r.backlog
                or grammar.spec.key not in keys or r.request.spec.backend is not None):
            return None
        verdict = self._compiler.switch_offer(grammar.spec.key, grammar.backend)
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

    def _move(self, r: Row, unread: int, verdict: Verdict) -> None:
        """Replay the row's constrained history (the ``fed`` tokens before this job's
        ``unread`` new ones) into a matcher of the verdict's grammar; swap when it takes all
        of it, has the parse and allows a token."""
        assert r.matcher is not None
        end = r.seen - unread
        history = [int(t) for t in r.output[end - r.fed:end]] if r.fed else []
        started = time.perf_counter()
        outcome = "error"
        matcher: Matcher | None = None
        try:
            if len(history) == r.fed:
                matcher = verdict.grammar.matcher()
                outcome = _replay(matcher, history, self._scratch)
        except Exception as exc:
            log.debug("grammask: switching a row failed: %s", exc)
            outcome = "error"
        metrics.ENGINE_SWITCH_REPLAY.observe(time.perf_counter() - started)
        metrics.ENGINE_SWITCHES.labels(outcome=outcome).inc()
        if outcome != "switched":
            verdict.stayed[outcome] = verdict.stayed.get(outcome, 0) + 1
            if matcher is not None:
                matcher.release()
            return
        assert matcher is not None
        old = r.matcher
        r.matcher, r.grammar = matcher, verdict.grammar
        verdict.switched += 1
        old.release()

    def _report(self, keys: frozenset[str]) -> None:
        """One log line per verdict whose rows are done here."""
        for key in keys:
            for backend in registry.names():
                verdict = self._compiler.switch_offer(key, backend)
                if verdict is not None and not verdict.reported:
                    verdict.reported = True
                    log.info("grammask: engine switch: %s", verdict.describe())


def _replay(matcher: Matcher, history: list[int], scratch: torch.Tensor) -> str:
    """Feed ``history``; the outcome: switched, rejected, dead_end or empty."""
    for token in history:
        if not matcher.accept(token):
            return "rejected"
    if getattr(matcher, "failure", None) is not None:
        return "dead_end"
    matcher.fill(scratch, 0)
    return "switched" if bool(scratch.any()) else "empty"
