"""The per-step fill job: read each row's new tokens, then advance, attach and fill on the
worker thread while the model's forward runs; collect the masks when the host needs them.

A fill job's failures stay inside it: one row's (a refused token, a broken matcher) fail that
row alone; a bug in the job itself fails the job's rows, never the host (``_contain``).

Requests added to the batch, made into rows by the next fill job instead of on the host.

A host adds new requests on its model runner's thread, right before the forward (vLLM's
runners: ``update_state`` / ``add_request``). Making a row there (the request, its pending
compile, its thinking gate, and giving the previous occupant's matcher back) costs a few
microseconds a request on the forward's critical path, and a large batch of short requests
starts many of them a step (docs/benchmarks.md, Figures: decode host path). Here an add is
one dict entry on the host. The next fill job makes the rows on the fill thread, while the
forward runs, and releases the rows that left.

The decode step's data types, shared by the fill job, the apply and the host adapters.

It imports nothing of the decode side, so every decode module may use these types without
depending on another one's job (``stepjob``, ``drafts``, ``step_apply``); the apply's own
types (``CpuPlan``, ``LogitsLayout``) are ``grammask.kernels.cpu_plan``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .. import metrics
from ..backends.base import Matcher
from ..compile.compiler import Grammar
from ..kernels.buffers import MaskBuffers
from ..kernels.cpu_plan import CpuPlan, LogitsLayout, plan_cpu_apply
from ..specs.grammar_spec import GrammarSpec
from ..specs.request import ConstraintRequest
from .engine_switch import EngineSwitch
from .fill import Filler, FillWorker, RowMasks, Ticket
from .firstmask import FirstMasks
from .rows import Row, Work, advance_all

log = logging.getLogger("grammask")



@dataclass
class Step:
    """One step's job: its rows and tokens, its buffer, and its result once handed over."""

    future: Ticket[StepMasks] | None
    buffer: torch.Tensor
    work: list[Work]
    #: the CPU apply's index plan for the job's rows, made by the job (None: none made)
    plan: CpuPlan | None = None
    #: some row's read stopped at a placeholder (``Row.take``): ``wait`` reads it again
    late: bool = False
    #: the rows the host asked for (``step(rows)``); None: every row of the table
    rows: frozenset[int] | None = None
    #: rows replaced or removed after the job read them: their masks are not handed out
    dropped: set[int] | None = None
    #: the queued adds the job makes into rows first, and the rows it releases
    #: (``Arrivals``); None: none
    handed_adds: tuple[dict[int, Queued], list[Row]] | None = None
    #: the step before, ended: dropped by this step's job, so that freeing its work (a
    #: tuple and a token list per row) costs the fill thread, not the host's ``wait``
    before: Step | None = None


class StepJobs:
    """Runs one fill job per step on the worker thread, and hands its masks to the host."""

    def __init__(self, *, max_batch: int, vocab_size: int, filler: Filler,
                 first: FirstMasks, masks: RowMasks, stats: FillStats,
                 arrivals: Arrivals, switch: EngineSwitch | None = None) -> None:
        self.vocab_size = vocab_size
        self.arrivals = arrivals
        self.buffers = MaskBuffers(max_batch, vocab_size)
        self.first = first
        self.masks = masks
        self.stats = stats
        self._filler = filler
        #: running rows moved to a cheaper engine, at the start of a job (None: never)
        self.switch = switch
        self._worker = FillWorker(cpus=filler.cpus)
        self.in_flight: Step | None = None
        self._last_waited: Step | None = None  # the last step waited for (``Step.before``)
        #: the CPU logits the next job plans the apply for (None: GPU logits, none seen yet,
        #: or planning would not fit in the forward: see ``_plan_fits``)
        self._cpu_layout: LogitsLayout | None = None
        #: the job's own ``_plan_fits`` verdict for the job after it (off the critical path)
        self.plan_next = True
        self._window_ms = float("inf")  # from the last step's hand-over to its apply
        self._stepped_at = 0.0  # when the last step's job was handed over
        self._steps = 0
        # plan times (ms) of the last jobs that planned, the first two left out (cold
        # caches, first allocations): ``_plan_fits`` takes their min
        self._plan_ms: deque[float] = deque(maxlen=4)
        self._plans = 0  # jobs that planned

    @property
    def thread_id(self) -> int | None:
        return self._worker.thread_id

    def step(self, table: dict[int, Row], rows: Collection[int] | None,
             tokens: Sequence[int] | None = None, *, live_rows: bool = True) -> None:
        """Hand the step's job to the worker: read the rows' new tokens (``rows``: only
        these), advance, fill; ``tokens``: first append ``tokens[i]`` to row ``rows[i]``'s
        (owned) output (``BatchProcessor.step``).

        The reads run on the worker too, so the host's share of a step does not grow with
        the batch: here only the arguments are copied (C loops). The worker owns the rows
        until the job is waited for (every mutation settles it first); a live list may have
        its placeholders replaced meanwhile (a read that still sees one is redone in
        ``wait``). ``live_rows``: whether any row of ``table`` reads a live list (only then
        does ``step(rows, tokens)`` look for one to refuse)."""
        if tokens is not None and (rows is None or len(rows) != len(tokens)):
            raise ValueError("step(rows, tokens) needs one row per token")
        if self.in_flight is not None:
            self.settle()
            self.in_flight = None
        live: int | None = None  # a row of ``rows`` whose list the host appends to itself
        order: list[int] | None = None
        handed: list[int] | None = None
        if rows is not None:
            order = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        if tokens is not None:
            assert order is not None
            handed = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
            if live_rows:
                queued = self.arrivals.queued
                live = next((i for i in order if (i in table and not table[i].owned) or (
                    i in queued and queued[i].output_ids is not None)), None)
        step = Step(None, self.buffers.acquire(), [],
                    rows=frozenset(order) if order is not None else None,
                    handed_adds=self.arrivals.hand_over(), before=self._last_waited)
        self._last_waited = None
        self._stepped_at = time.perf_counter()
        self._steps += 1
        if table or step.handed_adds is not None:
            step.future = self._worker.run(
                partial(self._job, step, self._cpu_layout, table, order, handed))
        else:  # no job to drop it: steps of an empty batch must not chain
            step.before = None
        self.in_flight = step
        if live is not None:  # the other rows' job runs: the host's mistake is this row's
            raise ValueError(f"row {live} reads a live output list; append to it instead")

    def settle(self) -> None:
        """Wait for an in-flight fill so the host thread may touch matchers again."""
        step = self.in_flight
        if step is not None and step.future is not None:
            try:
                step.future.result()
            except BaseException as exc:
                step.plan = None
                step.future = Ticket.completed(StepMasks(
                    step.buffer, sorted(self._contain(step.work, step.buffer, exc)), None))

    def discard(self) -> None:
        """A mutation of the batch: the pending fill no longer holds."""
        self.settle()
        self.in_flight = None

    def drop(self, row: int) -> None:
        """``row`` is removed or replaced: the pending fill holds for the other rows. A job
        over named rows that neither names nor makes ``row`` never touches it; one that does
        is waited for and ``row``'s mask left out. A job over every row is discarded."""
        step = self.in_flight
        if step is None:
            return
        if step.rows is None:
            self.discard()
        elif row in step.rows or (step.handed_adds is not None and row in step.handed_adds[0]):
            self.settle()
            step.dropped = (step.dropped or set()) | {row}

    def make_rows_now(self, table: dict[int, Row]) -> None:
        """Every added row in ``table`` now: an in-flight job that makes some is waited for
        (the table then has one writer at a time), and rows added since are made on the
        host's thread (the host asks about a row, or masks it, before a fill job made it)."""
        step = self.in_flight
        if self.arrivals.queued or (step is not None and step.handed_adds is not None):
            self.settle()
            self.arrivals.make_rows_now(table)

    def handed_rows(self) -> Collection[int]:
        """The rows whose adds the in-flight job is making."""
        step = self.in_flight
        return () if step is None or step.handed_adds is None else step.handed_adds[0].keys()

    def applied(self, layout: LogitsLayout | None) -> None:
        """The layout of the logits an apply just masked: the next job plans the CPU apply
        for it when planning fit (``plan_next``: decided by the job, not on the critical
        path), else for none."""
        self._cpu_layout = layout if self.plan_next else None

    def wait_for_apply(self, table: dict[int, Row], rows: Collection[int] | None = None
                       ) -> StepMasks:
        """``wait``, for an apply into the host's logits (which then tells ``applied`` its
        layout): notes how long the forward left the job (``_plan_fits``). The plan is made
        for the job's rows; an apply at other rows moves it (``apply.apply_pairs``)."""
        self._window_ms = (time.perf_counter() - self._stepped_at) * 1000
        return self.wait(table, rows)

    def wait(self, table: dict[int, Row], rows: Collection[int] | None) -> StepMasks:
        """Wait for this step's fill (``step`` now, when none is pending); rows read late and
        ``rows`` the step skipped are filled here. Ends the step."""
        if self.in_flight is None:
            self.step(table, rows)
        step = self.in_flight
        assert step is not None
        self.in_flight = None
        self._last_waited = step
        if step.future is None:
            indices: set[int] = set()
        else:
            try:
                result = step.future.result()
            except BaseException as exc:  # a bug in the job: contain it to this step's rows
                indices = self._contain(step.work, step.buffer, exc)
            else:
                if not step.late and not step.dropped and (  # the common cases: as made
                        rows is None or (step.rows is not None and step.rows.issuperset(rows))):
                    return result
                indices = set(result.rows)
        if rows is not None:  # rows added since the step, which the host masks now
            self.arrivals.make_rows_now(table)
        dropped = step.dropped or set()
        if dropped:  # rows the job filled for an occupant that left: not theirs now
            indices.difference_update(dropped)
            step.work = [w for w in step.work if w[0] not in dropped]
        late = [(index, r, r.take()) for index, r, _ in step.work if r.late] if step.late else []
        done = {index for index, _, _ in step.work}
        if rows is not None:  # rows the step skipped: read and fill them here
            late += [(i, table[i], table[i].take()) for i in sorted(set(rows))
                     if i in table and i not in done]
        if late:  # placeholders resolved since step(): advance and fill these rows here
            indices.difference_update(index for index, _, _ in late)
            try:
                indices.update(self._run(late, step.buffer))
            except BaseException as exc:
                indices.update(self._contain(late, step.buffer, exc))
            for index, r, _ in late:
                if r.late and r.needs_mask and r.error is None:
                    r.fail("an output token was still a placeholder (negative id) when its "
                           "mask was needed", cause="host")
                    indices.discard(index)
                    if self.masks.error(step.buffer, index):
                        indices.add(index)
        # rows filled here, after the job planned: its plan is stale (and so when it
        # covers a dropped row)
        plan = step.plan if not late and not dropped else None
        return StepMasks(step.buffer, sorted(indices), plan)

    def close(self) -> None:
        self.settle()
        self.in_flight = None
        self._worker.close()
        if self.switch is not None:
            self.switch.close()

    def _plan_fits(self, window_ms: float) -> bool:
        """Whether the next job should also plan the CPU apply: only while the job, planning
        included, ends within the forward it overlaps (planning moves the apply's index work
        off the critical path; when the forward is too short it would lengthen the step
        instead). The plan's share is the fastest of the last four plans, the first two
        plans left out: one slow plan (a cold start, a preempted thread) must not turn
        planning off, and a job that did not plan leaves no stale time behind. Planning is
        tried again every 64 steps, as batches and masks change. Each job decides for the
        next one, against the last step's window (forwards of a batch take alike)."""
        stats = self.stats
        job_ms = stats.last_advance_ms + stats.last_fill_ms + min(self._plan_ms, default=0.0)
        return job_ms <= 0.9 * window_ms or self._steps % 64 == 0

    def _job(self, step: Step, layout: LogitsLayout | None, table: dict[int, Row],
             rows: list[int] | None, tokens: list[int] | None) -> StepMasks:
        """The worker's job: ``_read``, ``_run``, then (CPU logits) the apply plan for its
        rows, so the apply on the host's critical path is only gather / memset / scatter.
        The rows come back sorted and distinct (``step(rows, tokens)`` may list a row twice),
        so ``wait`` has nothing left to do but return them."""
        step.before = None
        try:
            if step.handed_adds is not None:
                self.arrivals.make_rows(table, step.handed_adds)
            _read_rows(step, table, rows, tokens)
        except BaseException:  # a bug in the read: every row it was to read fails
            step.work[:] = [(i, r, []) for i, r in table.items()
                            if rows is None or i in rows]
            raise
        if self.switch is not None:  # commits read, not fed: the one point rows may switch
            self.switch.run(step.work, table)
        indices = sorted(set(self._run(step.work, step.buffer)))
        plan_ms = 0.0
        if layout is not None and indices:
            started = time.perf_counter()
            try:
                step.plan = plan_cpu_apply(step.buffer, indices, vocab_size=self.vocab_size,
                                           width=layout.width, stride=layout.stride)
            except Exception as exc:  # never fatal: apply plans inline instead
                log.debug("grammask: apply plan failed: %s", exc)
            plan_ms = (time.perf_counter() - started) * 1000
            self._plans += 1
            if self._plans > 2:
                self._plan_ms.append(plan_ms)
        self.stats.last_plan_ms = plan_ms
        self.plan_next = self._plan_fits(self._window_ms)
        return StepMasks(step.buffer, indices, step.plan)

    def _run(self, work: list[Work], buffer: torch.Tensor) -> list[int]:
        """The fill job (worker thread, or the host thread for late rows): advance every row
        by its new tokens, attach grammars that are needed now, fill; returns the rows to
        mask."""
        started = time.perf_counter()
        first = self.first
        # new rows with no thinking gate whose grammar is at hand: attached first, they
        # advance with the others (a batch accept) instead of through their backlogs
        first.attach_at_hand([r for _, r, _ in work
                              if r.matcher is None and r.gate is None and r.error is None])
        # rows that took their token in a batch accept come back grouped for the batch
        # fill; only the rest are looked at again here
        batched, rest = advance_all(work)
        # the same rows on every rank: errors and gates follow the (shared) sampled tokens
        first.attach_all([r for _, r, _ in rest
                          if r.error is None and r.needs_mask and r.matcher is None])
        advanced = time.perf_counter()
        masks = self.masks
        indices: list[int] = []
        fills: list[tuple[Matcher, int]] = []
        for index, r, _ in rest:
            if r.error is not None:
                if masks.error(buffer, index):
                    indices.append(index)
            elif r.needs_mask and r.matcher is not None:
                fills.append((r.matcher, index))
            elif r.gate is not None and r.gate.thinking and masks.guard(r.gate, buffer, index):
                indices.append(index)
        try:
            self._filler.fill(fills, buffer, batched)
        except Exception:  # find the culprit row by row; the others still get their masks
            for matcher, index in chain(fills, *batched.values()):
                try:
                    matcher.fill(buffer, index)
                except Exception as exc:
                    row = next(r for i, r, _ in work if i == index)
                    row.fail(f"mask fill failed: {exc}", cause="fill")
                    buffer[index].copy_(masks.stop_row)
        indices.extend(index for _, index in fills)
        for group in batched.values():
            indices.extend(index for _, index in group)
        stats = self.stats
        stats.rows_filled += len(fills) + sum(map(len, batched.values()))
        stats.last_advance_ms = (advanced - started) * 1000
        finished = time.perf_counter()
        stats.last_fill_ms = (finished - advanced) * 1000
        metrics.defer(metrics.FILL_SECONDS.observe, finished - started)
        return indices

    def _contain(self, work: list[Work], buffer: torch.Tensor,
                 exc: BaseException) -> set[int]:
        """A bug in a fill job (not one row's failure, which ``_run`` contains): its rows
        fail, the host goes on."""
        log.error("grammask: fill job failed: %s: %s", type(exc).__name__, exc)
        indices = set()
        for index, r, _ in work:
            r.fail(f"fill job failed: {type(exc).__name__}: {exc}", cause="fill")
            if self.masks.error(buffer, index):
                indices.add(index)
        return indices


def _read_rows(step: Step, table: dict[int, Row], rows: list[int] | None,
          tokens: list[int] | None) -> None:
    """The job's first part: each row's share of the step into ``step.work`` (the
    hand-over of ``tokens`` first); rows whose read stopped at a placeholder are noted
    (``step.late``), so ``wait`` does not scan every row for them."""
    take = Row.take
    late: list[Row] = []
    work = step.work
    if tokens is not None:
        assert rows is not None
        for i, tid in zip(rows, tokens, strict=True):
            r = table.get(i)
            if r is None or not r.owned:  # a live row: ``step`` refused it
                continue
            r.output.append(int(tid))
            work.append((i, r, take(r, late)))
    elif rows is None:
        work.extend([(index, r, take(r, late)) for index, r in table.items()])
    else:
        work.extend([(i, table[i], take(table[i], late)) for i in sorted(set(rows))
                     if i in table])
    step.late = bool(late)


class Arrival(NamedTuple):
    """A request for a row: the request (None: the row stays unconstrained), its grammar
    (compiled, a future of one, or None to compile now) and ``host_masks``
    (``BatchProcessor.add``)."""

    request: ConstraintRequest | GrammarSpec | None
    grammar: Grammar | Future[Grammar] | None = None
    host_masks: bool = False


class RequestReader(Protocol):
    """A host's parse of its own request parameters into an ``Arrival`` (where its compile
    starts), run by the fill job that makes the row (``BatchProcessor.add_later``), off the
    host's thread. Declared here, implemented by the host's adapter (vLLM's ``PluginCore``):
    the decode side holds the reader it was given, never a method or a closure of the
    host's, so nothing here calls back up into code it cannot see."""

    def arrival(self, params: Any, resumed: bool) -> Arrival:
        """The row's ``Arrival`` for the host's ``params``; raising errors that row."""
        ...


class Queued(NamedTuple):
    """A queued add: its ``Arrival`` (``add``, or a host's parse done already), else the
    host's ``params`` for the reader to parse (``add_later``)."""

    arrival: Arrival | None
    prompt_ids: Sequence[int]
    output_ids: list[int] | None
    params: Any = None
    resumed: bool = False


#: makes a queued add's row (None: unconstrained); contains every failure in the row
MakeRow = Callable[[Queued], Row | None]


class Arrivals:
    """Adds not yet made into rows, and rows that left the batch not yet released.

    The host thread owns ``queued`` and ``retired`` until ``hand_over`` gives both to a
    fill job; ``make_rows`` (on the fill thread, or on the host's when it needs a row at once)
    then makes the rows into the table."""

    def __init__(self, make: MakeRow) -> None:
        self._make = make
        self.queued: dict[int, Queued] = {}
        self.retired: list[Row] = []

    def drop(self, row: int) -> Queued | None:
        return self.queued.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        entry = self.queued.pop(src, None)
        self.queued.pop(dst, None)
        if entry is not None:
            self.queued[dst] = entry

    def swap(self, a: int, b: int) -> None:
        ea, eb = self.queued.pop(a, None), self.queued.pop(b, None)
        if ea is not None:
            self.queued[b] = ea
        if eb is not None:
            self.queued[a] = eb

    def hand_over(self) -> tuple[dict[int, Queued], list[Row]] | None:
        """The queued adds and retired rows, for one fill job (None: nothing to do);
        the host starts new ones."""
        if not self.queued and not self.retired:
            return None
        handed = self.queued, self.retired
        self.queued, self.retired = {}, []
        return handed

    def make_rows(self, table: dict[int, Row], handed: tuple[dict[int, Queued], list[Row]]
              ) -> None:
        """Release the retired rows' matchers, then make the queued rows into ``table``
        (in the order they were added)."""
        queued, retired = handed
        for r in retired:
            r.release()
        make = self._make
        for row, entry in queued.items():
            made = make(entry)
            if made is not None:
                table[row] = made

    def make_rows_now(self, table: dict[int, Row]) -> None:
        """Make every queued row now, on the calling (host) thread: a host asks about a
        row, or masks it, before a fill job made it."""
        handed = self.hand_over()
        if handed is not None:
            self.make_rows(table, handed)

    def close(self) -> None:
        """Release what is left (the processor closes)."""
        for r in self.retired:
            r.release()
        self.queued, self.retired = {}, []


class StepMasks(NamedTuple):
    """A step's masks: the bitmask, the rows it masks (sorted), the CPU apply's plan."""

    bitmask: torch.Tensor
    rows: list[int]
    plan: CpuPlan | None  # None: none made, or stale


@dataclass
class FillStats:
    """What the fill jobs did, for metrics, benchmarks and tests (``BatchProcessor.stats``).

    Written by the fill thread and read by the host's: each field is one float or int, so a
    read sees the last job's value or the one before, never a torn one."""

    #: milliseconds the last job spent advancing matchers and filling
    last_advance_ms: float = 0.0
    last_fill_ms: float = 0.0
    #: ... and expanding the masks into the CPU apply's plan (0: the job did not plan)
    last_plan_ms: float = 0.0
    #: mask rows filled by the backends so far (work done), drafts included
    rows_filled: int = 0


class DraftMasks(NamedTuple):
    """A batch's masks at its speculative draft positions, as the apply takes them
    (``drafts.Drafts.place``): one row map into one bitmask, the step's.

    Logits row ``at[i]`` takes bitmask row ``rows[i]`` and belongs to processor row
    ``owners[i]``. The first ``committed`` pairs are committed positions as the step masked
    them (its CPU plan serves them); the others are draft and bonus positions (bitmask rows
    above every row the step uses), and committed positions the step did not mask or whose
    drafts rewrote them. ``stale``: a mask the step planned was rewritten (the plan no longer
    holds)."""

    at: np.ndarray[Any, np.dtype[np.intp]]
    rows: np.ndarray[Any, np.dtype[np.intp]]
    owners: np.ndarray[Any, np.dtype[np.intp]]
    committed: int
    stale: bool
