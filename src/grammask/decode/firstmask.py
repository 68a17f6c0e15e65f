"""A row's first mask: bounded, hedged and agreed across ranks.

A logits processor cannot defer a request the way vLLM's scheduler does: when a row's grammar
is not compiled at its first mask, the whole batch waits. So the wait is bounded and hedged:

- The routed backend's compile starts when the request is added (overlapping its prefill).
- ``hedge_s`` after that, if it is still running and the other backend can serve the spec (a
  JSON schema that was not forced onto one backend and is not strict about gaps the other
  backend has), the other backend compiles it too; the first one ready serves the row, with
  that backend's gaps in ``unenforced``. The loser keeps compiling into the cache.
- ``wait_s`` after the first mask was needed, a row with no grammar goes into the error state
  alone; its compile finishes in the background for the next request with that spec.
- With tensor parallelism each rank shares its view (``Agreement``) and ``decide`` turns the
  gathered views into one outcome, identical on every rank.

``FirstMasks`` runs it: it starts each row's compile (``compiles``) and, on the fill thread,
gives the rows that need a mask now their grammar (``attach_all``).

Agreement across tensor-parallel ranks on decisions that depend on timing.

With tensor parallelism every rank runs its own processor and must write identical masks. A
row's first mask depends on *when* its grammar is ready (which backend finished first, whether
the first-mask budget ran out), and clocks and thread schedules differ between ranks. So each
rank shares its local view and every rank applies one pure decision function to the gathered
views (``rows.decide``): the same input on every rank gives the same outcome.

- ``Solo``: one process, nothing to exchange.
- ``TorchGroup``: an all-gather of small int64 vectors over a gloo process group (the
  processor's fill thread calls it, never vLLM's own groups: see ``tp_group_for_vllm``).

Contract: every rank calls ``gather`` the same number of times with vectors of the same length
(rows are the same on every rank because every rank sees the same sampled tokens).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Protocol

import torch

from .. import metrics
from ..compile.compiler import Compiler, Grammar
from ..specs.grammar_spec import GrammarSpec
from .rows import (
    READY,
    PendingGrammar,
    Row,
    Starter,
    decide,
    hedge_spec,
    row_views,
    wait_for_change,
)

#: pending states kept for grammars given to ``compiles`` (``FirstMasks._ready``)
READY_GRAMMARS = 256


class FirstMasks:
    """Rows' first masks: each row's compile, and the bounded, hedged, agreed wait for it.

    ``wait_s``: the longest a step waits for a row's grammar at its first mask (the batch
    stalls meanwhile); ``hedge_s``: when the other backend starts compiling a late spec;
    ``agreement``: how tensor-parallel ranks agree on those timing outcomes."""

    def __init__(self, compiler: Compiler, *, wait_s: float, hedge_s: float,
                 agreement: Agreement) -> None:
        self.compiler = compiler
        self.wait_s = wait_s
        self.hedge_s = hedge_s
        self.agreement = agreement
        self._ready_rows: dict[int, tuple[Grammar, PendingGrammar]] = {}  # ``_ready``'s

    def compiles(self, spec: GrammarSpec,
                grammar: Grammar | Future[Grammar] | None) -> PendingGrammar:
        """The compiles that may serve a new row: ``grammar`` (compiled, or a future of one)
        or the routed compile, started now; the hedge only when it is late."""
        if isinstance(grammar, Grammar):
            return self._ready(grammar)
        compiler = self.compiler
        if isinstance(grammar, Future):
            primary = grammar
        else:
            try:
                primary = compiler.compile_async(spec)
            except Exception as exc:  # a closed compiler or a bad spec: an errored row
                primary = Future()
                primary.set_exception(exc)

        def hedge() -> Starter | None:
            try:
                other = hedge_spec(compiler, spec)
            except Exception:  # routing refused the spec: its compile reports why
                return None
            return None if other is None else (lambda: compiler.compile_async(other))

        return PendingGrammar(primary, hedge, hedge_s=self.hedge_s)

    def _ready(self, grammar: Grammar) -> PendingGrammar:
        """The pending state of a row whose grammar is at hand, one per grammar: it never
        hedges and its future is done, so nothing in it changes and rows of one request
        after another share it (adding such a row makes no future, lock or condition on the
        host's thread). Bounded: the oldest go first; an entry holds its grammar, so its
        ``id`` is not reused meanwhile."""
        ready = self._ready_rows
        entry = ready.get(id(grammar))
        if entry is not None:
            return entry[1]
        done: Future[Grammar] = Future()
        done.set_result(grammar)
        pending = PendingGrammar(done, None, hedge_s=self.hedge_s, ready=grammar)
        if len(ready) >= READY_GRAMMARS:
            del ready[next(iter(ready))]
        ready[id(grammar)] = (grammar, pending)
        return pending

    def attach_at_hand(self, rows: Sequence[Row]) -> Sequence[Row]:
        """Note when each row first needed its grammar; with one rank, rows whose grammar
        is at hand attach it now (called before the step's tokens too, so they advance
        with the batch's other rows in one batch accept, not through their backlogs).
        Returns the rows still waiting: all of them with several ranks, which must agree
        on every attach (``attach_all``)."""
        now = time.monotonic()
        for r in rows:
            if r.need_since is None:
                r.need_since = now
        if self.agreement.world_size == 1 and rows:
            return _attach_ready(rows, now)
        return rows

    def attach_all(self, rows: Sequence[Row]) -> None:
        """Give each row its grammar: wait (bounded by ``wait_s``, hedged), agreed by ranks.

        Every rank calls it with the same rows (errors and gates follow the shared sampled
        tokens), so every rank gathers the same number of times."""
        wait_s = self.wait_s
        rows = self.attach_at_hand(rows)
        while rows:
            now = time.monotonic()
            views: list[int] = []
            for r in rows:
                r.pending.tick(now)
                assert r.need_since is not None
                views += r.pending.view(now >= r.need_since + wait_s)
            try:
                gathered = self.agreement.gather(views)
            except Exception as exc:  # a lost peer: these rows cannot be agreed on
                for r in rows:
                    r.fail(f"ranks could not agree on the grammar: {exc}", cause="agreement")
                return
            waiting = []
            for i, r in enumerate(rows):
                ranks = row_views(gathered, i)
                # a grammar ready on every rank needs no hedge: do not route its spec again
                ready = all(v.primary == READY for v in ranks)
                decision = decide(not ready and r.pending.can_hedge, ranks)
                if decision.fail is not None or decision.use is not None:
                    outcome = ("hedge" if decision.use == 1 else "ready"
                               if decision.use == 0 else decision.fail or "failed")
                    metrics.FIRST_MASK_WAIT.labels(outcome=outcome).observe(
                        now - (r.need_since or now))
                    if r.pending.hedged and decision.use is not None:
                        metrics.HEDGES.labels(
                            served_by="hedge" if decision.use else "routed").inc()
                if decision.use is not None:
                    r.attach(r.pending.attempt(decision.use).result())
                elif decision.fail == "late":
                    r.fail(f"grammar not compiled within wait_s={wait_s:g} s of its "
                           "first mask (it goes on compiling for the cache)", cause="late")
                elif decision.fail is not None:
                    why, cause = r.pending.failure()
                    r.fail(f"grammar failed to compile: {why}", cause=cause)
                else:
                    if decision.hedge:
                        r.pending.start_hedge()
                    waiting.append(r)
            rows = waiting
            if rows:
                until = min(min(r.need_since or now for r in rows) + wait_s,
                            min(r.pending.hedge_at if r.pending.can_hedge and
                                not r.pending.hedged else float("inf") for r in rows))
                wait_for_change([r.pending for r in rows], until,
                                poll_s=None if self.agreement.world_size == 1 else 0.002)


def _attach_ready(rows: Sequence[Row], now: float) -> list[Row]:
    """One rank: rows whose grammar was at hand from the start attach it, as ``decide``
    would have them (``use=0``), without views or futures (a step that starts many requests
    pays microseconds a row for them on the fill thread); the rest are returned."""
    waiting = []
    child = None
    at_once = 0  # rows that needed their grammar first now: a zero wait each, observed once
    for r in rows:
        grammar = r.pending.ready
        if grammar is None:
            waiting.append(r)
            continue
        if child is None:
            child = metrics.FIRST_MASK_WAIT.labels(outcome="ready")
        waited = now - (r.need_since or now)
        if waited == 0.0:
            at_once += 1
        else:
            metrics.defer(child.observe, waited)
        r.attach(grammar)
    if at_once:
        metrics.defer(partial(metrics.observe_many, child, 0.0), at_once)
    return waiting


log = logging.getLogger("grammask")


class Agreement(Protocol):
    """Shares one int vector per rank; returns every rank's vector, in rank order."""

    @property
    def world_size(self) -> int: ...

    def gather(self, values: Sequence[int]) -> list[list[int]]: ...


class Solo:
    """The single-process case."""

    world_size = 1

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        return [list(values)]


class TorchGroup:
    """All-gather over a ``torch.distributed`` process group (gloo: CPU tensors)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._group = group
        self._world = int(dist.get_world_size(group))

    @property
    def world_size(self) -> int:
        return self._world

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        import torch.distributed as dist

        # new tensors, never written in place: safe under any torch mode of any thread
        with torch.inference_mode(False):
            mine = torch.tensor([len(values), *values], dtype=torch.int64)
            out = [torch.empty_like(mine) for _ in range(self._world)]
            dist.all_gather(out, mine, group=self._group)
        views = [t.tolist() for t in out]
        if any(v[0] != len(values) for v in views):
            raise RuntimeError(f"ranks disagree on the rows to agree on: "
                               f"{[v[0] for v in views]}")
        return [v[1:] for v in views]


def tp_group_for_vllm() -> Agreement:
    """A gloo group of this rank's tensor-parallel peers, for grammask's use alone.

    Built the way vLLM builds its own groups (every rank creates every TP group, in the same
    order), so it must be called on every rank at the same point of start-up: the plugin does
    it in its constructor. Our collectives then never interleave with vLLM's on its groups."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size <= 1:
        return Solo()
    mine = None
    for ranks in tp.group_ranks:
        group = dist.new_group(list(ranks), backend="gloo")
        if tp.rank in ranks:
            mine = group
    assert mine is not None
    log.info("grammask: tensor-parallel agreement over a gloo group of ranks %s", tp.ranks)
    return TorchGroup(mine)
