"""A constrained row and its lifecycle: the tokens read from its output, its grammar once it
arrives, its thinking gate, and its sticky error state.

Only a row's own state changes here. When rows are read and filled is ``stepjob.py``'s job;
how a row waits for its grammar is ``firstmask.py``'s.

The compiles that may serve one row, and the rule tensor-parallel ranks agree by.

``PendingGrammar``: the routed compile (started when the request is added) and, once it is
late, the hedge: the other backend compiling the same JSON schema. ``decide`` turns every
rank's view of a row (``RowView``) into one outcome, the same on every rank.
``firstmask.FirstMasks`` runs the bounded wait over them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .. import metrics
from ..backends.base import BatchCalls, BatchFills, Matcher, batch_calls
from ..compile.compiler import Compiler, Grammar
from ..errors import GrammarError
from ..specs.grammar_spec import GrammarSpec
from ..specs.request import STAND_IN, ConstraintRequest, ReasoningRule, VllmReasoning
from ..vocab import Vocabulary
from .reasoning import Gate, RuleGate, ThinkGate, ThinkMarker

COMPILING, READY, FAILED = 0, 1, 2
#: ints per row in an agreement vector: expired, hedged, primary state, hedge state
VIEW = 4


def _state(future: Future[Grammar] | None) -> int:
    if future is None or not future.done():
        return COMPILING
    if future.cancelled() or future.exception() is not None:
        return FAILED
    return READY


def hedge_spec(compiler: Compiler, spec: GrammarSpec) -> GrammarSpec | None:
    """The spec forced onto the plan's hedge backend (``compile.router.Plan.hedge``), or None
    when the other backend may not serve it."""
    hedge = compiler.plan(spec).hedge
    return None if hedge is None else spec.with_backend(hedge.backend)


Starter = Callable[[], Future[Grammar]]


class PendingGrammar:
    """The compiles that may serve one row: the routed one and, once started, the hedge.

    ``hedge`` says how to start the hedge (None: the row cannot hedge). It is asked only when
    a row's grammar is late, so the common case (ready in time) never routes the spec twice
    on the host's thread."""

    def __init__(self, primary: Future[Grammar], hedge: Callable[[], Starter | None] | None,
                 *, hedge_s: float, submitted: float | None = None,
                 ready: Grammar | None = None) -> None:
        self.primary = primary
        #: the grammar, when it was at hand from the start (``primary`` is then its done
        #: future and there is no hedge): a row attaches it without asking the futures
        self.ready = ready
        self.alternate: Future[Grammar] | None = None
        self._resolve = hedge
        self._starter: Starter | None = None
        self.hedge_at = (time.monotonic() if submitted is None else submitted) + hedge_s

    @property
    def can_hedge(self) -> bool:
        return self._start_alternate is not None

    @property
    def _start_alternate(self) -> Starter | None:
        if self._resolve is not None:
            resolve, self._resolve = self._resolve, None
            self._starter = resolve()
        return self._starter

    @property
    def hedged(self) -> bool:
        return self.alternate is not None

    def start_hedge(self) -> None:
        if self.alternate is None and self._start_alternate is not None:
            try:
                self.alternate = self._start_alternate()
            except Exception as exc:  # a closed compiler: a failed hedge, not an error here
                self.alternate = Future()
                self.alternate.set_exception(exc)

    def tick(self, now: float) -> None:
        """Start the hedge when it is due (the routed compile is late or failed)."""
        if self.alternate is None and (
                now >= self.hedge_at or _state(self.primary) == FAILED) and self.can_hedge:
            self.start_hedge()

    def view(self, expired: bool) -> RowView:
        return RowView(int(expired), int(self.hedged), _state(self.primary),
                       _state(self.alternate))

    def futures(self) -> list[Future[Grammar]]:
        return [f for f in (self.primary, self.alternate) if f is not None and not f.done()]

    def attempt(self, index: int) -> Future[Grammar]:
        future = self.primary if index == 0 else self.alternate
        assert future is not None
        return future

    def failure(self) -> tuple[str, str]:
        """Why the row has no grammar, and whose fault it is: ``compile`` (the request's own
        grammar was refused: a ``GrammarError``) or ``server`` (a timeout, an internal
        failure, another rank's)."""
        for future in (self.primary, self.alternate):
            if future is not None and future.done() and not future.cancelled():
                exc = future.exception()
                if isinstance(exc, GrammarError):
                    return str(exc), "compile"
                if exc is not None:
                    return f"{type(exc).__name__}: {exc}", "server"
        return "failed on another tensor-parallel rank", "server"


class RowView(NamedTuple):
    """One rank's view of one row, as it travels between ranks (``VIEW`` ints)."""

    expired: int  # its wait_s ran out on this rank
    hedged: int  # the other backend's compile was started
    primary: int  # state of the routed compile (COMPILING / READY / FAILED)
    alternate: int  # state of the hedge


def row_views(gathered: Sequence[Sequence[int]], row: int) -> list[RowView]:
    """Every rank's view of the ``row``-th row of a gather (rows of ``VIEW`` ints each)."""
    return [RowView(*view[row * VIEW:(row + 1) * VIEW]) for view in gathered]


@dataclass(frozen=True)
class Decision:
    """What every rank does with one row: use attempt ``use``, ``fail``, ``hedge`` or wait."""

    use: int | None = None
    fail: str | None = None
    hedge: bool = False


def decide(can_hedge: bool, views: Sequence[Sequence[int]]) -> Decision:
    """One row's outcome from every rank's view (a pure function: same on every rank)."""
    rows = [RowView(*v) for v in views]
    if all(v.primary == READY for v in rows):
        return Decision(use=0)
    if all(v.alternate == READY for v in rows):
        return Decision(use=1)
    primary_dead = any(v.primary == FAILED for v in rows)
    hedge_dead = not can_hedge or any(v.alternate == FAILED for v in rows)
    if primary_dead and hedge_dead:
        return Decision(fail="compile")
    if any(v.expired for v in rows):
        return Decision(fail="late")
    if can_hedge and not all(v.hedged for v in rows) and (
            primary_dead or any(v.hedged for v in rows)):
        return Decision(hedge=True)
    return Decision()


def wait_for_change(pending: Sequence[PendingGrammar], until: float, *,
                    poll_s: float | None) -> None:
    """Sleep until a compile finishes or ``until``; ``poll_s`` caps it (other ranks' views
    change without our futures finishing)."""
    timeout = max(0.0, until - time.monotonic())
    if poll_s is not None:
        timeout = min(timeout, poll_s)
    futures = [f for p in pending for f in p.futures()]
    if futures:
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
    elif timeout > 0:
        time.sleep(timeout)


log = logging.getLogger("grammask")

RowStatus = Literal["unconstrained", "thinking", "compiling", "active", "ended", "error"]
#: ``think_end``'s default: the vocabulary's own marker
FROM_VOCAB = "vocab"


@dataclass(frozen=True)
class RowInfo:
    """A snapshot of one row, for hosts (finish reasons, logs) and tests."""

    status: RowStatus
    error: str | None = None
    backend: str | None = None
    unenforced: tuple[str, ...] = ()
    constrained_tokens: int = 0
    thinking_tokens: int = 0


class Row:
    """One constrained request."""

    # slots: a step touches every row right after the forward, with cold caches; the
    # attributes then sit in the object itself, not in a separate values array
    __slots__ = ("backlog", "error", "fed", "gate", "grammar", "host_masks", "late", "matcher",
                 "need_since", "output", "owned", "pending", "request", "seen", "vocab_tokens")

    def __init__(self, request: ConstraintRequest, pending: PendingGrammar,
                 output: list[int], owned: bool, vocab_tokens: Sequence[bytes]) -> None:
        self.request = request
        self.pending = pending
        self.gate: Gate | None = None
        self.output = output
        self.owned = owned
        self.vocab_tokens = vocab_tokens  # to name a rejected token
        self.grammar: Grammar | None = None
        self.matcher: Matcher | None = None
        self.seen = 0  # output entries consumed
        self.fed = 0  # tokens accepted by the matcher
        self.backlog: list[int] = []  # constrained tokens that arrived before the grammar
        self.error: str | None = None
        self.need_since: float | None = None
        self.late = False  # a placeholder stopped the last read
        self.host_masks = False  # the host's own processors may forbid its tokens too

    def fail(self, message: str, cause: str = "other") -> None:
        """Enter the sticky error state; ``cause`` is the metric label (compile, late,
        rejected, dead_end, gate, matcher, fill, host, ...)."""
        if self.error is None:
            self.error = message
            metrics.ROW_ERRORS.labels(cause=cause).inc()
            log.warning("grammask: request %s: %s", self.request.spec.describe(), message)

    @property
    def needs_mask(self) -> bool:
        return self.gate is None or not self.gate.thinking

    def take(self, late: list[Row] | None = None) -> list[int]:
        """The tokens appended since the last read, up to the first placeholder; a read that
        stops at one marks the row ``late`` and appends it to ``late`` (so the step knows
        without scanning its rows again)."""
        out = self.output
        end = len(out)
        seen = self.seen
        if end == seen + 1:  # the common case, one token per step: no slice, no scan
            tid = int(out[seen])
            if tid >= 0:
                self.late = False
                self.seen = end
                return [tid]
        if end < seen:
            self.rewind(seen - end)
            seen = self.seen
        self.late = False
        if end == seen:
            return []
        new = list(map(int, out[seen:end]))
        if min(new) < 0:
            for i, tid in enumerate(new):
                if tid < 0:
                    new = new[:i]
                    self.late = True
                    if late is not None:
                        late.append(self)
                    break
        self.seen = seen + len(new)
        return new

    def rewind(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` read tokens: backlog, then matcher, then thinking."""
        k = min(num_tokens, self.seen)
        self.seen -= k
        if self.error is not None:
            return  # errors are sticky
        constrained = self.fed + len(self.backlog)
        drop = min(k, len(self.backlog))
        del self.backlog[len(self.backlog) - drop:]
        k -= drop
        undo = min(k, self.fed)
        emptied = constrained > 0 and drop + undo == constrained
        try:
            if undo:
                assert self.matcher is not None
                self.matcher.rollback(undo)
                self.fed -= undo
                k -= undo
            if (k or emptied) and self.gate is not None:
                self.gate.rollback(k, emptied=emptied)
        except Exception as exc:
            self.fail(f"rollback of {num_tokens} tokens failed: {exc}", cause="host")

    def advance(self, tokens: list[int]) -> None:
        """Take new tokens: the gate's while thinking, then the matcher's (or the backlog's)."""
        if self.error is not None or not tokens:
            return
        gate = self.gate
        if gate is not None and gate.thinking:
            tokens = gate.feed(tokens)
            if gate.leftover:
                self.fail(f"the thinking end marker ended inside a token: its trailing bytes "
                          f"{gate.leftover!r} would be output outside the grammar",
                          cause="gate")
                return
            if not tokens:
                return
        if self.matcher is None:
            self.backlog.extend(tokens)
        else:
            self.feed(tokens)

    def feed(self, tokens: list[int]) -> None:
        """Feed the matcher; the first token it refuses fails the row."""
        assert self.matcher is not None
        for tid in tokens:
            try:
                accepted = self.matcher.accept(tid)
            except Exception as exc:
                self.refused(tid, f": {exc}")
                return
            if not accepted:
                self.refused(tid)
                return
            self.fed += 1
        self.check_dead_end(tokens)

    def refused(self, tid: int, reason: str = "") -> None:
        """The matcher refused ``tid``: the row fails, naming the token."""
        vocab = self.vocab_tokens
        text = repr(vocab[tid]) if 0 <= tid < len(vocab) else "out of the vocabulary"
        self.fail(f"token {tid} ({text}) rejected by the grammar after {self.fed} "
                  f"constrained tokens{reason}", cause="rejected")

    def check_dead_end(self, tokens: list[int]) -> None:
        """After accepted ``tokens``: fail the row if the backend lost the parse."""
        failure = getattr(self.matcher, "failure", None)
        if failure is not None:
            # the backend lost the parse (an allowed token with no way on): the output ends
            # in a stop the grammar did not give; never a quiet "stop"
            tail = b"".join(self.vocab_tokens[t] for t in tokens[-8:]
                            if 0 <= t < len(self.vocab_tokens))
            self.fail(f"the grammar reached a dead end after {self.fed} constrained tokens "
                      f"(last text {tail[-60:]!r}): {failure}", cause="dead_end")

    def attach(self, grammar: Grammar) -> None:
        """Make the row's matcher and feed it the tokens that arrived before it."""
        try:
            matcher = grammar.matcher()
        except Exception as exc:
            self.fail(f"making the matcher failed: {type(exc).__name__}: {exc}",
                      cause="matcher")
            return
        self.grammar = grammar
        self.matcher = matcher
        request = self.request
        if not request.resumed:  # served: its grammar masks from here on
            metrics.defer(metrics.REQUESTS.labels(source=request.source,
                                                  kind=request.spec.kind).inc, 1)
        if self.backlog:
            backlog, self.backlog = self.backlog, []
            self.feed(backlog)

    def count(self) -> None:
        """The row leaves the batch: a request whose grammar never masked a token (no matcher
        attached: still reasoning, still compiling, failed first) counts as unserved, by why;
        a served one was counted as its matcher attached (``attach``). A preempted request
        counts once: rows of ``ConstraintRequest.resumed`` are not counted."""
        request = self.request
        if self.matcher is not None or request.resumed or request is STAND_IN:
            return
        why = "reasoning" if self.gate is not None and self.gate.thinking else "no_mask"
        metrics.UNSERVED.labels(source=request.source, kind=request.spec.kind,
                                reason=why).inc()

    def release(self) -> None:
        """The row left the batch (settled: no fill job holds it): its matcher goes back to
        its grammar for a later request (``Matcher.release``); any later use of it raises."""
        if self.matcher is not None:
            self.matcher.release()

    @property
    def status(self) -> RowStatus:
        if self.error is not None:
            return "error"
        if self.gate is not None and self.gate.thinking:
            return "thinking"
        if self.matcher is None:
            return "compiling"
        return "ended" if self.matcher.is_terminated() else "active"

    def info(self) -> RowInfo:
        grammar = self.grammar
        return RowInfo(
            status=self.status, error=self.error,
            backend=grammar.backend if grammar else None,
            unenforced=grammar.unenforced if grammar else (),
            constrained_tokens=self.fed + len(self.backlog),
            thinking_tokens=self.gate.thinking_tokens if self.gate else 0)


#: one row's share of a step: (batch row, the row, its new tokens); a plain tuple, since one
#: is made per row per step
Work = tuple[int, Row, list[int]]


def advance_all(work: Sequence[Work]) -> tuple[BatchFills, list[Work]]:
    """``Row.advance`` for each row's new tokens; a row's failure stays its own.

    Rows taking one token into a matcher past its gate go together, one ``batch_accept``
    per matcher class (``backends.base.batch_calls``): a few native calls instead of Python
    per row, so a model runner's busy thread, which shares the GIL, delays the fill less.
    Returns those rows that took their token, grouped by class for the batch fill (each one
    fillable: no error, past its gate), and the rest of ``work`` (new rows, rows with several
    tokens or none, refusals, failures), which the caller attaches and fills one by one:
    the batch's common rows are looked at once, not again for the fill."""
    groups: dict[type[BatchCalls], tuple[list[Matcher], list[int], list[Work]]] = {}
    rest: list[Work] = []
    for item in work:
        _, r, tokens = item
        matcher = r.matcher
        if len(tokens) == 1 and matcher is not None and r.error is None and (
                r.gate is None or not r.gate.thinking):
            calls = batch_calls(type(matcher))
            if calls is not None:
                group = groups.get(calls)
                if group is None:
                    group = groups[calls] = ([], [], [])
                group[0].append(matcher)
                group[1].append(tokens[0])
                group[2].append(item)
                continue
        _advance_one(r, tokens)
        rest.append(item)
    fills: BatchFills = {}
    for calls, (matchers, tokens, items) in groups.items():
        try:
            accepted = calls.batch_accept(matchers, tokens)
        except Exception:  # find the row: each alone, as if there were no batch call
            for item, tid in zip(items, tokens, strict=True):
                _advance_one(item[1], [tid])
            rest.extend(items)
            continue
        filled = fills[calls] = []
        for (index, r, _), matcher, tid, ok in zip(items, matchers, tokens, accepted,
                                                    strict=True):
            if not ok:
                r.refused(tid)
                rest.append((index, r, []))
                continue
            r.fed += 1
            if getattr(matcher, "failure", None) is not None:
                r.check_dead_end([tid])
                rest.append((index, r, []))
                continue
            filled.append((matcher, index))
    return fills, rest


def _advance_one(r: Row, tokens: list[int]) -> None:
    try:
        r.advance(tokens)
    except Exception as exc:  # the gate or a matcher broke: this row alone fails
        r.fail(f"advancing failed: {type(exc).__name__}: {exc}", cause="matcher")


#: a new row's compiles (``firstmask.FirstMasks.compiles``): from its spec and the grammar the
#: host may hand over (compiled, or a future of one)
Compiles = Callable[[GrammarSpec, Grammar | Future[Grammar] | None], PendingGrammar]


class RowMaker:
    """Rows for requests added to the batch: the compile (``compiles``) and the thinking gate
    (one marker per ``think_end``, made once)."""

    def __init__(self, vocab: Vocabulary, compiles: Compiles,
                 think_end: str | int | Sequence[int] | None) -> None:
        self.vocab = vocab
        self.compiles = compiles
        self._default = (ThinkMarker.for_vocab(vocab) if think_end == FROM_VOCAB
                         else None if think_end is None
                         else ThinkMarker.for_vocab(vocab, think_end))
        self._markers: dict[str, ThinkMarker | None] = {}

    def make(self, request: ConstraintRequest | GrammarSpec, prompt_ids: Sequence[int],
             output_ids: list[int] | None, grammar: Grammar | Future[Grammar] | None,
             host_masks: bool) -> Row:
        if isinstance(request, GrammarSpec):
            request = ConstraintRequest(request)
        if not isinstance(request, ConstraintRequest):
            raise TypeError(f"expected a ConstraintRequest, GrammarSpec or None, got "
                            f"{type(request).__name__}")
        pending = self.compiles(request.spec, grammar)
        r = Row(request, pending, [] if output_ids is None else output_ids,
                output_ids is None, self.vocab.tokens)
        r.host_masks = host_masks
        try:
            r.gate = self._gate(request, prompt_ids, pending)
        except Exception as exc:  # a bad marker or prompt: this row alone fails
            r.fail(f"thinking gate failed: {type(exc).__name__}: {exc}", cause="gate")
        return r

    def _gate(self, request: ConstraintRequest, prompt_ids: Sequence[int],
              pending: PendingGrammar) -> Gate | None:
        if not request.thinking:
            return None
        if request.rule is not None:  # the host's engine decides (vLLM's reasoning parser)
            return rule_gate(request.rule, request.reasoning, prompt_ids, pending)
        marker = self._default
        if request.think_end is not None:
            if request.think_end not in self._markers:
                self._markers[request.think_end] = ThinkMarker.for_vocab(
                    self.vocab, request.think_end)
            marker = self._markers[request.think_end]
        if marker is None:
            return None
        gate = ThinkGate(marker, self.vocab.tokens, prompt_ids=prompt_ids)
        return None if gate.from_prompt else gate


def rule_gate(rule: ReasoningRule, reasoning: VllmReasoning | None,
              prompt_ids: Sequence[int], pending: PendingGrammar) -> RuleGate | None:
    """The row's ``RuleGate`` (None: constrained from its first token)."""
    gate = RuleGate(rule, prompt_ids, None if reasoning is None else reasoning.ended,
                    lambda ids: first_tokens(pending, ids))
    return None if gate.from_prompt else gate


def first_tokens(pending: PendingGrammar, ids: Sequence[int]) -> list[bool] | None:
    """Whether the row's grammar can start with each of ``ids`` (vLLM's
    ``grammar.validate_tokens([id])``); None while no compile has finished."""
    grammar = pending.ready
    for future in (pending.primary, pending.alternate):
        if grammar is None and future is not None and future.done() and (
                not future.cancelled() and future.exception() is None):
            grammar = future.result()
    if grammar is None:
        return None
    matcher = grammar.matcher()
    try:
        out = []
        for tid in ids:
            ok = bool(matcher.accept(tid))
            if ok:
                matcher.rollback(1)
            out.append(ok)
        return out
    finally:
        matcher.release()
