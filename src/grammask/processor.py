"""The batch processor, framework-neutral: rows come and go; masks fill while the forward runs.

One decode step, as a host drives it::

    proc.add(row, request, prompt_ids, output_ids)   # compile starts now (overlaps prefill)
    proc.remove(row) / proc.move(src, dst) / proc.swap(a, b)
    proc.step()            # take new tokens, start advance + fill on the worker thread
    ... model forward ...  # the fill runs meanwhile (both backends release the GIL)
    proc.apply(logits)     # wait for the fill, mask the logits in place

Row semantics (the contract the vLLM / transformers adapters are written against):

- Rows are indices into the batch (``0 <= row < max_batch``); row ``i`` of the logits given
  to ``apply`` belongs to row ``i``. Rows never added (or added with ``None``) are
  unconstrained: never read, never masked, and cost nothing per step.
- Tokens: ``output_ids`` is either a list the host keeps appending to (a *live* list: each step
  reads what was appended since the last one, several tokens at once are fine) or None, in
  which case the processor owns the list and the host calls ``advance(row, tokens)``.
  Negative ids are placeholders of tokens not known yet (vLLM async scheduling): a step stops
  reading at the first one and reads again, before masking, in ``apply``. A live list that got
  shorter since the last step is rolled back by the difference.
- Thinking gate (``reasoning.py``): until the request's thinking section ends, its row is
  neither masked nor advanced.
- Stop tokens are allowed only where the grammar may end; once it has ended, only stop tokens
  are (forced EOS).
- Errors never raise into the host. A token the grammar rejects, a failed compile, an
  exception while attaching or filling one row, or a grammar still compiling ``wait_s``
  seconds after its first mask was needed put that row, and only that row, into a sticky
  error state (``error(row)`` says why). With ``on_error="stop"`` (default) an errored row
  gets a stop-only mask, so the request ends at once instead of running on unconstrained and
  returning text that claims to follow the grammar; ``on_error="free"`` leaves it unmasked.
- First masks (``firstmask.py``): a row whose grammar is late makes the step wait at most
  ``wait_s`` (default 0.5 s), hedged onto the other backend after ``hedge_s``. With tensor
  parallelism pass an ``agreement`` (``agreement.py``): ranks then agree on each such outcome.
- Any mutation (add/remove/move/swap/advance/rollback) after ``step()`` and before
  ``apply()`` discards that fill; ``apply`` then fills synchronously. ``apply`` without
  ``step`` works too (no overlap).

All methods are to be called from one host thread; the worker thread only runs fill jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from . import metrics
from .agreement import Agreement, Solo
from .apply import (
    CpuPlan,
    apply_bitmask,
    cpu_plannable,
    plan_cpu_apply,
    restore_empty_rows,
)
from .backends.base import Matcher
from .compiler import Compiler, Grammar
from .digests import MaskDigests, row_key
from .errors import GrammarError
from .firstmask import (
    READY,
    VIEW,
    PendingGrammar,
    RowView,
    decide,
    hedge_spec,
    wait_for_change,
)
from .masks import Filler, FillWorker, MaskBuffers, Ticket, stop_only_row
from .reasoning import BoundaryGuard, ThinkGate, ThinkMarker
from .request import ConstraintRequest
from .spec import GrammarSpec

log = logging.getLogger("grammask")

RowStatus = Literal["unconstrained", "thinking", "compiling", "active", "ended", "error"]
ErrorPolicy = Literal["stop", "free"]
_FROM_VOCAB = "vocab"


@dataclass(frozen=True)
class RowInfo:
    """A snapshot of one row, for hosts (finish reasons, logs) and tests."""

    status: RowStatus
    error: str | None = None
    backend: str | None = None
    unenforced: tuple[str, ...] = ()
    constrained_tokens: int = 0
    thinking_tokens: int = 0


class _Row:
    """One constrained request."""

    def __init__(self, request: ConstraintRequest, pending: PendingGrammar,
                 gate: ThinkGate | None, output: list[int], owned: bool) -> None:
        self.request = request
        self.pending = pending
        self.gate = gate
        self.output = output
        self.owned = owned
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
        rejected, gate, matcher, fill, host, ...)."""
        if self.error is None:
            self.error = message
            metrics.ROW_ERRORS.labels(cause=cause).inc()
            log.warning("grammask: request %s: %s", self.request.spec.describe(), message)

    @property
    def needs_mask(self) -> bool:
        return self.gate is None or not self.gate.thinking


@dataclass
class _Step:
    future: Ticket[list[int]] | None
    buffer: torch.Tensor
    work: list[tuple[int, _Row, list[int]]]
    #: the CPU apply's index plan for the job's rows, made by the job (None: none made)
    plan: CpuPlan | None = None


class BatchProcessor:
    """Masks for a batch of up to ``max_batch`` rows, filled on a worker thread.

    ``think_end``: the thinking end marker (a token id, a token sequence or text); by default
    the vocabulary's (``</think>`` for Qwen3.x); None disables the thinking gate. A request's
    own ``think_end`` / ``thinking=False`` take precedence.
    ``filler``: how rows are filled (batch-parallel thresholds, threads).
    ``wait_s``: the longest a step waits for a row's grammar at its first mask (the batch
    stalls meanwhile); ``hedge_s``: when the other backend starts compiling a late JSON schema.
    ``agreement``: how tensor-parallel ranks agree on those timing outcomes (``Solo``: none).
    """

    def __init__(self, compiler: Compiler, *, max_batch: int, wait_s: float = 0.5,
                 hedge_s: float = 0.05, on_error: ErrorPolicy = "stop",
                 think_end: str | int | Sequence[int] | None = _FROM_VOCAB,
                 filler: Filler | None = None, agreement: Agreement | None = None) -> None:
        if on_error not in ("stop", "free"):
            raise ValueError(f"on_error must be 'stop' or 'free', got {on_error!r}")
        if wait_s < 0 or hedge_s < 0:
            raise ValueError("wait_s and hedge_s must be >= 0")
        self.compiler = compiler
        self.vocab = compiler.vocab
        self.vocab_size = compiler.vocab.vocab_size
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.hedge_s = hedge_s
        self.agreement: Agreement = agreement or Solo()
        self.on_error: ErrorPolicy = on_error
        self._buffers = MaskBuffers(max_batch, self.vocab_size)
        # mask rows in a host's own logits order (apply_mapped / apply_drafts), made on use
        self._mapped: MaskBuffers | None = None
        self._retired: list[MaskBuffers] = []
        self._worker = FillWorker()
        self._filler = filler or Filler()
        self._stop_row = stop_only_row(self.vocab.stop_ids, self.vocab_size)
        self._rows: dict[int, _Row] = {}
        self._pending: _Step | None = None
        self._default_marker = (ThinkMarker.for_vocab(self.vocab) if think_end == _FROM_VOCAB
                                else None if think_end is None
                                else ThinkMarker.for_vocab(self.vocab, think_end))
        self._markers: dict[str, ThinkMarker | None] = {}
        self._guards: dict[bytes, BoundaryGuard] = {}
        #: Milliseconds the last fill job spent advancing matchers and filling (metrics).
        self.last_advance_ms = 0.0
        self.last_fill_ms = 0.0
        #: ... and expanding the masks into the CPU apply's plan (0 when logits are not CPU).
        self.last_plan_ms = 0.0
        # (width, row stride) of the last CPU logits ``apply`` masked: the fill job plans
        # the next step's CPU apply for that layout (None: GPU logits, none seen yet, or
        # planning would not fit in the forward: see ``_plan_fits``)
        self._cpu_layout: tuple[int, int] | None = None
        self._stepped_at = 0.0  # when the last step's job was handed over
        self._steps = 0
        #: per-rank mask digests (a debug setting; ``digests.py``), None: off
        self.digests: MaskDigests | None = None
        #: Mask rows filled by the backends so far (work done, for metrics and tests).
        self.rows_filled = 0

    # ------------------------------------------------------------------ batch membership
    def add(self, row: int, request: ConstraintRequest | GrammarSpec | None,
            prompt_ids: Sequence[int] = (), output_ids: list[int] | None = None, *,
            grammar: Grammar | Future[Grammar] | None = None, host_masks: bool = False) -> None:
        """Put a request in ``row`` (replacing whatever was there); None = unconstrained.

        The compile starts now unless ``grammar`` (compiled, or a future of one) is given.
        ``output_ids``: a live list the host appends to, or None to use ``advance``.
        ``host_masks``: the host's own processors forbid tokens of this request before ours
        (vLLM's min_tokens, allowed_token_ids, bad_words, logit_bias): when they leave none of
        the grammar's tokens, the grammar's come back (``apply.restore_empty_rows``).
        Raises only for host mistakes (row out of range, wrong request type)."""
        self._check_row(row)
        self._mutate()
        self._rows.pop(row, None)
        if request is None:
            return
        if isinstance(request, GrammarSpec):
            request = ConstraintRequest(request)
        if not isinstance(request, ConstraintRequest):
            raise TypeError(f"expected a ConstraintRequest, GrammarSpec or None, got "
                            f"{type(request).__name__}")
        pending = self._pending_grammar(request.spec, grammar)
        owned = output_ids is None
        self._rows[row] = r = _Row(request, pending, None,
                                   [] if output_ids is None else output_ids, owned)
        r.host_masks = host_masks
        try:
            r.gate = self._gate(request, prompt_ids)
        except Exception as exc:  # a bad marker or prompt: this row alone fails
            r.fail(f"thinking gate failed: {type(exc).__name__}: {exc}", cause="gate")

    def fail(self, row: int, message: str, cause: str = "host") -> None:
        """Put ``row`` into the error state (adapters that lose track of a row's tokens)."""
        r = self._rows.get(row)
        if r is not None:
            self._mutate()
            r.fail(message, cause=cause)

    def remove(self, row: int) -> None:
        self._mutate()
        self._rows.pop(row, None)

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` now lives at ``dst``; ``dst``'s previous request is dropped."""
        self._check_row(src)
        self._check_row(dst)
        self._mutate()
        moved = self._rows.pop(src, None)
        if moved is None:
            self._rows.pop(dst, None)
        else:
            self._rows[dst] = moved

    def swap(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        self._mutate()
        ra, rb = self._rows.pop(a, None), self._rows.pop(b, None)
        if ra is not None:
            self._rows[b] = ra
        if rb is not None:
            self._rows[a] = rb

    def advance(self, row: int, tokens: Sequence[int]) -> None:
        """Append sampled tokens to a row whose output list the processor owns."""
        r = self._rows.get(row)
        if r is None:
            return
        if not r.owned:
            raise ValueError(f"row {row} reads a live output list; append to it instead")
        if self._pending is not None:
            self._mutate()
        r.output.extend(map(int, tokens))

    def rollback(self, row: int, num_tokens: int) -> None:
        """Retract the last ``num_tokens`` tokens of the row's output.

        Owned lists lose them here (unread ones first); for a live list the host truncates
        its list itself and this rewinds what was already read."""
        r = self._rows.get(row)
        if r is None or num_tokens <= 0:
            return
        self._mutate()
        if r.owned:
            unread = min(num_tokens, len(r.output) - r.seen)
            del r.output[max(0, len(r.output) - num_tokens):]
            num_tokens -= unread
        self._rewind(r, num_tokens)

    # ----------------------------------------------------------------------- per step
    def step(self, rows: Collection[int] | None = None) -> None:
        """Read each constrained row's new tokens and start advance + fill on the worker.

        ``rows``: only these rows (those a host will sample this step); the others keep
        their unread tokens for a later step. None: every constrained row."""
        if self._pending is not None:
            self._settle()
            self._pending = None
        take = self._take
        if rows is None:
            work = [(index, r, take(r)) for index, r in self._rows.items()]
        else:
            table = self._rows
            work = [(i, table[i], take(table[i])) for i in sorted(set(rows)) if i in table]
        step = _Step(None, self._buffers.acquire(), work)
        self._stepped_at = time.perf_counter()
        self._steps += 1
        if work:
            layout = self._cpu_layout
            step.future = self._worker.run(lambda: self._job(step, layout))
        self._pending = step

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for this step's fill and mask ``logits`` (rows = batch rows) in place."""
        window_ms = (time.perf_counter() - self._stepped_at) * 1000
        bitmask, rows, plan = self._wait(None)
        self._cpu_layout = ((logits.shape[1], logits.stride(0))
                            if cpu_plannable(logits) and self._plan_fits(window_ms) else None)
        if rows:
            if self.digests is not None:
                self._record(bitmask, rows)
                plan = None if self.digests.fault else plan
            apply_bitmask(logits, bitmask, vocab_size=self.vocab_size, indices=rows,
                          buffers=self._buffers, plan=plan)
            self._restore(logits, bitmask, [(i, i) for i in rows])

    def _record(self, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Mask digests for comparing ranks (``digests.py``; a debug setting)."""
        assert self.digests is not None
        self.digests.observe(bitmask, [
            (i, row_key(r.request.spec.key, r.output[:r.seen]) if r is not None else "?")
            for i in rows for r in [self._rows.get(i)]])

    def _restore(self, logits: torch.Tensor, bitmask: torch.Tensor,
                 pairs: Sequence[tuple[int, int]]) -> None:
        """The grammar wins over the host's own processors (rows that asked for it)."""
        risky = [(at, row) for at, row in pairs
                 if (r := self._rows.get(row)) is not None and r.host_masks]
        if risky and (n := restore_empty_rows(logits, bitmask, risky,
                                              vocab_size=self.vocab_size)) > 0:
            metrics.HOST_CONFLICTS.inc(n)

    def _plan_fits(self, window_ms: float) -> bool:
        """Whether the next job should also plan the CPU apply: only while the job, planning
        included, ends within the forward it overlaps (planning moves the apply's index work
        off the critical path; when the forward is too short it would lengthen the step
        instead). Planning is tried again every 64 steps, as batches and masks change."""
        job_ms = self.last_advance_ms + self.last_fill_ms + self.last_plan_ms
        return job_ms <= 0.9 * window_ms or self._steps % 64 == 0

    def wait_masks(self, rows: Collection[int] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """Wait for this step's fill; the bitmask and the sorted rows it masks.

        For hosts that apply masks themselves (e.g. on the device, in their own sampler).
        ``rows``: rows that must be masked; any the step did not fill are filled now (a host
        that passed ``step(rows)`` a guess). The bitmask is the processor's buffer: valid
        until the next ``step()``; rows not listed hold stale bits and must stay unmasked.
        Ends the step like ``apply``. Never raises for a row's failure."""
        bitmask, masked, _ = self._wait(rows)
        return bitmask, masked

    def _wait(self, rows: Collection[int] | None
              ) -> tuple[torch.Tensor, list[int], CpuPlan | None]:
        """``wait_masks``, plus the job's CPU apply plan when it still holds."""
        if self._pending is None:
            self.step(rows)
        step = self._pending
        assert step is not None
        self._pending = None
        if step.future is None:
            indices: set[int] = set()
        else:
            try:
                result = step.future.result()
            except BaseException as exc:  # a bug in the job: contain it to this step's rows
                indices = self._contain(step.work, step.buffer, exc)
            else:
                if rows is None and not any(r.late for _, r, _ in step.work):
                    return step.buffer, sorted(set(result)), step.plan  # the common case
                indices = set(result)
        late = [(index, r, self._take(r)) for index, r, _ in step.work if r.late]
        done = {index for index, _, _ in step.work}
        if rows is not None:  # rows the step skipped: read and fill them here
            late += [(i, self._rows[i], self._take(self._rows[i])) for i in sorted(set(rows))
                     if i in self._rows and i not in done]
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
                    if self.on_error == "stop":
                        step.buffer[index].copy_(self._stop_row)
                        indices.add(index)
        # rows filled here, after the job planned: its plan is stale
        return step.buffer, sorted(indices), step.plan if not late else None

    def apply_mapped(self, logits: torch.Tensor, logits_rows: Sequence[int],
                     rows: Sequence[int]) -> None:
        """Like ``apply``, for a host whose logits rows are not the processor's rows (vLLM's
        V2 runner: rows are request slots, logits are in batch order): ``logits[logits_rows[i]]``
        gets row ``rows[i]``'s mask. Other logits rows are left alone."""
        bitmask, masked = self.wait_masks(rows)
        ready = set(masked)
        pairs = [(int(at), int(row)) for at, row in zip(logits_rows, rows, strict=True)
                 if row in ready]
        if not pairs:
            return
        if self.digests is not None:
            self._record(bitmask, [row for _, row in pairs])
        masks, buffer = self._mapped_buffer(logits.shape[0])
        picked = bitmask.index_select(0, torch.tensor([row for _, row in pairs]))
        buffer.index_copy_(0, torch.tensor([at for at, _ in pairs]), picked)
        apply_bitmask(logits, buffer, vocab_size=self.vocab_size,
                      indices=sorted(at for at, _ in pairs), buffers=masks)
        self._restore(logits, bitmask, pairs)

    def apply_drafts(self, logits: torch.Tensor, rows: Sequence[int],
                     positions: Sequence[int], inputs: Sequence[int]) -> None:
        """Speculative decoding: logits row ``i`` belongs to processor row ``rows[i]`` (-1 or
        a row not sampling: left alone) at draft position ``positions[i]`` (0: the committed
        state; k: after the first k draft tokens; the last: the bonus position), and
        ``inputs[i]`` is the token fed at that logits row (the draft tokens of positions
        1.. are the inputs of the rows before them). Each row's masks follow its drafts
        (``fill_drafts``)."""
        sampling = {int(r) for r in rows if int(r) in self._rows}
        bitmask, masked = self.wait_masks(sorted(sampling))
        ready = set(masked)
        masks, buffer = self._mapped_buffer(logits.shape[0])
        placed: dict[int, list[tuple[int, int]]] = {}
        for at, (row, pos) in enumerate(zip(rows, positions, strict=True)):
            if int(row) in sampling:
                placed.setdefault(int(row), []).append((int(pos), at))
        indices: list[int] = []
        for row, spots in placed.items():
            out_rows = [at for _, at in sorted(spots)]
            if row in ready:
                buffer[out_rows[0]].copy_(bitmask[row])
            else:
                buffer[out_rows[0]].fill_(-1)
            self.fill_drafts(row, [int(inputs[at]) for at in out_rows[1:]], buffer, out_rows)
            if row in ready or len(out_rows) > 1:
                indices += out_rows
        if indices:
            apply_bitmask(logits, buffer, vocab_size=self.vocab_size, indices=sorted(indices),
                          buffers=masks)

    def _mapped_buffer(self, rows: int) -> tuple[MaskBuffers, torch.Tensor]:
        """Mask rows in the host's logits order (``apply_mapped`` / ``apply_drafts``)."""
        masks = self._mapped
        if masks is None or masks.max_batch < rows:
            if masks is not None:  # a device copy may still read it: kept, never reused
                self._retired.append(masks)
            masks = self._mapped = MaskBuffers(max(rows, self.max_batch), self.vocab_size)
        return masks, masks.acquire()

    def fill_drafts(self, row: int, drafts: Sequence[int], out: torch.Tensor,
                    out_rows: Sequence[int]) -> None:
        """Masks for speculative decoding: ``out[out_rows[k + 1]]`` gets the mask of the
        position after ``drafts[:k + 1]`` (the last one is the bonus position).

        ``out[out_rows[0]]`` must already hold the committed position's mask (from
        ``wait_masks``, or all ones for a row it did not list). Draft tokens are fed
        tentatively and rolled back, so the row keeps its committed state. The rules are
        vLLM's own: a position still inside the thinking section is free (all ones, or the
        marker-boundary guard); after a draft token the grammar refuses, every later position
        repeats the last valid mask (which already refuses that token, so the rejection
        sampler rejects it there and no later row is used); after a placeholder (negative id)
        positions are free; an errored row gets its error mask everywhere."""
        if len(out_rows) != len(drafts) + 1:
            raise ValueError(f"{len(drafts)} draft tokens need {len(drafts) + 1} output rows, "
                             f"got {len(out_rows)}")
        r = self._rows.get(row)
        if r is None or not drafts:
            return
        fed = gated = 0
        prev = out_rows[0]
        refused = free = False
        try:
            for tid, target in zip(drafts, out_rows[1:], strict=True):
                if r.error is not None:
                    self._error_row(out, target)
                elif free or tid < 0:
                    free = True
                    out[target].fill_(-1)
                elif refused:
                    out[target].copy_(out[prev])
                else:
                    accepted, g, f = self._feed_tentatively(r, int(tid))
                    gated += g
                    fed += f
                    if not accepted:
                        refused = True
                        out[target].copy_(out[prev])
                    else:
                        self._fill_position(r, out, target)
                        prev = target
        except Exception as exc:  # a bug of ours: this row alone ends
            r.fail(f"speculative masks failed: {type(exc).__name__}: {exc}", cause="drafts")
            for target in out_rows:
                self._error_row(out, target)
        finally:
            try:
                if fed:
                    assert r.matcher is not None
                    r.matcher.rollback(fed)
                if gated:
                    assert r.gate is not None
                    r.gate.rollback(gated)
            except Exception as exc:
                r.fail(f"undoing draft tokens failed: {type(exc).__name__}: {exc}", cause="drafts")

    def _feed_tentatively(self, r: _Row, tid: int) -> tuple[bool, int, int]:
        """Feed one draft token: (accepted, gate tokens taken, matcher tokens taken)."""
        if r.gate is not None and r.gate.thinking:
            r.gate.feed([tid])
            if r.gate.leftover:  # would end the marker mid-token: refused
                return False, 1, 0
            if not r.gate.thinking and r.matcher is None:
                self._attach_all([r])  # thinking ends inside the window
            return True, 1, 0
        if r.matcher is None:
            return False, 0, 0
        accepted = r.matcher.accept(tid)
        return accepted, 0, int(accepted)

    def _fill_position(self, r: _Row, out: torch.Tensor, target: int) -> None:
        if r.error is not None:
            self._error_row(out, target)
        elif r.gate is not None and r.gate.thinking:
            if not self._guard_row(r.gate, out, target):
                out[target].fill_(-1)
        elif r.matcher is not None:
            r.matcher.fill(out, target)
            self.rows_filled += 1
        else:
            out[target].fill_(-1)

    def _error_row(self, out: torch.Tensor, target: int) -> None:
        if self.on_error == "stop":
            out[target].copy_(self._stop_row)
        else:
            out[target].fill_(-1)

    # ------------------------------------------------------------------------- queries
    def info(self, row: int) -> RowInfo:
        r = self._rows.get(row)
        if r is None:
            return RowInfo("unconstrained")
        self._settle()
        grammar = r.grammar
        return RowInfo(
            status=self._status(r), error=r.error,
            backend=grammar.backend if grammar else None,
            unenforced=grammar.unenforced if grammar else (),
            constrained_tokens=r.fed + len(r.backlog),
            thinking_tokens=r.gate.thinking_tokens if r.gate else 0)

    def status(self, row: int) -> RowStatus:
        return self.info(row).status

    def error(self, row: int) -> str | None:
        return self.info(row).error

    @property
    def errors(self) -> dict[int, str]:
        self._settle()
        return {i: r.error for i, r in self._rows.items() if r.error is not None}

    @property
    def rows(self) -> list[int]:
        """The constrained rows."""
        return sorted(self._rows)

    @property
    def fill_thread_id(self) -> int | None:
        return self._worker.thread_id

    def close(self) -> None:
        self._settle()
        self._pending = None
        self._worker.close()

    def __enter__(self) -> BatchProcessor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------- internals
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch:
            raise IndexError(f"row {row} outside 0..{self.max_batch - 1}")

    def _settle(self) -> None:
        """Wait for an in-flight fill so the host thread may touch matchers again."""
        if self._pending is not None and self._pending.future is not None:
            try:
                self._pending.future.result()
            except BaseException as exc:
                self._pending.future = Ticket.completed(
                    sorted(self._contain(self._pending.work, self._pending.buffer, exc)))
                self._pending.plan = None

    def _mutate(self) -> None:
        self._settle()
        self._pending = None

    def _pending_grammar(self, spec: GrammarSpec,
                         grammar: Grammar | Future[Grammar] | None) -> PendingGrammar:
        if isinstance(grammar, Grammar):
            done: Future[Grammar] = Future()
            done.set_result(grammar)
            return PendingGrammar(done, None, hedge_s=self.hedge_s)
        if isinstance(grammar, Future):
            primary = grammar
        else:
            try:
                primary = self.compiler.compile_async(spec)
            except Exception as exc:  # a closed compiler or a bad spec: an errored row
                primary = Future()
                primary.set_exception(exc)
        def hedge() -> Callable[[], Future[Grammar]] | None:
            try:
                other = hedge_spec(self.compiler, spec)
            except Exception:  # routing refused the spec: its compile reports why
                return None
            return None if other is None else (lambda: self.compiler.compile_async(other))

        return PendingGrammar(primary, hedge, hedge_s=self.hedge_s)

    def _gate(self, request: ConstraintRequest, prompt_ids: Sequence[int]) -> ThinkGate | None:
        if not request.thinking:
            return None
        marker = self._default_marker
        if request.think_end is not None:
            if request.think_end not in self._markers:
                self._markers[request.think_end] = ThinkMarker.for_vocab(
                    self.vocab, request.think_end)
            marker = self._markers[request.think_end]
        if marker is None:
            return None
        gate = ThinkGate(marker, self.vocab.tokens, prompt_ids=prompt_ids)
        return None if gate.from_prompt else gate

    def _take(self, r: _Row) -> list[int]:
        """The tokens appended since the last read, up to the first placeholder."""
        out = r.output
        end = len(out)
        seen = r.seen
        if end < seen:
            self._rewind(r, seen - end)
            seen = r.seen
        r.late = False
        if end == seen:
            return []
        new = list(map(int, out[seen:end]))
        if min(new) < 0:
            for i, tid in enumerate(new):
                if tid < 0:
                    new = new[:i]
                    r.late = True
                    break
        r.seen = seen + len(new)
        return new

    def _rewind(self, r: _Row, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` read tokens: backlog, then matcher, then thinking."""
        k = min(num_tokens, r.seen)
        r.seen -= k
        if r.error is not None:
            return  # errors are sticky
        drop = min(k, len(r.backlog))
        del r.backlog[len(r.backlog) - drop:]
        k -= drop
        undo = min(k, r.fed)
        try:
            if undo:
                assert r.matcher is not None
                r.matcher.rollback(undo)
                r.fed -= undo
                k -= undo
            if k and r.gate is not None:
                r.gate.rollback(k)
        except Exception as exc:
            r.fail(f"rollback of {num_tokens} tokens failed: {exc}", cause="host")

    def _job(self, step: _Step, layout: tuple[int, int] | None) -> list[int]:
        """The worker's job: ``_run``, then (CPU logits) the apply plan for its rows, so the
        apply on the host's critical path is only gather / memset / scatter."""
        indices = self._run(step.work, step.buffer)
        if layout is not None and indices:
            started = time.perf_counter()
            try:
                step.plan = plan_cpu_apply(step.buffer, sorted(indices),
                                           vocab_size=self.vocab_size, width=layout[0],
                                           stride=layout[1])
            except Exception as exc:  # never fatal: apply plans inline instead
                log.debug("grammask: apply plan failed: %s", exc)
            self.last_plan_ms = (time.perf_counter() - started) * 1000
        return indices

    def _run(self, work: list[tuple[int, _Row, list[int]]], buffer: torch.Tensor) -> list[int]:
        """The fill job (worker thread, or the host thread for late rows): advance every row
        by its new tokens, attach grammars that are needed now, fill; returns the rows to
        mask."""
        started = time.perf_counter()
        for _, r, tokens in work:
            try:
                self._advance(r, tokens)
            except Exception as exc:  # the gate or a matcher broke: this row alone fails
                r.fail(f"advancing failed: {type(exc).__name__}: {exc}", cause="matcher")
        # the same rows on every rank: errors and gates follow the (shared) sampled tokens
        self._attach_all([r for _, r, _ in work
                          if r.error is None and r.needs_mask and r.matcher is None])
        advanced = time.perf_counter()
        indices: list[int] = []
        fills: list[tuple[Matcher, int]] = []
        for index, r, _ in work:
            if r.error is not None:
                if self.on_error == "stop":
                    buffer[index].copy_(self._stop_row)
                    indices.append(index)
            elif r.needs_mask and r.matcher is not None:
                fills.append((r.matcher, index))
            elif r.gate is not None and r.gate.thinking and self._guard_row(r.gate, buffer,
                                                                             index):
                indices.append(index)
        try:
            self._filler.fill(fills, buffer)
        except Exception:  # find the culprit row by row; the others still get their masks
            for matcher, index in fills:
                try:
                    matcher.fill(buffer, index)
                except Exception as exc:
                    row = next(r for i, r, _ in work if i == index)
                    row.fail(f"mask fill failed: {exc}", cause="fill")
                    buffer[index].copy_(self._stop_row)
        indices.extend(index for _, index in fills)
        self.rows_filled += len(fills)
        self.last_advance_ms = (advanced - started) * 1000
        finished = time.perf_counter()
        self.last_fill_ms = (finished - advanced) * 1000
        metrics.FILL_SECONDS.observe(finished - started)
        return indices

    def _guard_row(self, gate: ThinkGate, buffer: torch.Tensor, index: int) -> bool:
        """A thinking row with a byte marker: refuse tokens that would end the marker
        inside themselves (``reasoning.BoundaryGuard``). False when nothing is refused."""
        marker = gate.marker.end_bytes
        if marker is None:
            return False
        guard = self._guards.get(marker)
        if guard is None:
            guard = self._guards[marker] = BoundaryGuard(marker, self.vocab.tokens)
        ids = guard.forbidden(gate.marker_prefixes())
        if ids.size == 0:
            return False
        row = buffer[index]
        row.fill_(-1)
        words = row.numpy().view(np.uint32)
        np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return True

    def _advance(self, r: _Row, tokens: list[int]) -> None:
        if r.error is not None or not tokens:
            return
        if r.gate is not None and r.gate.thinking:
            tokens = r.gate.feed(tokens)
            if r.gate.leftover:
                r.fail(f"the thinking end marker ended inside a token: its trailing bytes "
                       f"{r.gate.leftover!r} would be output outside the grammar",
                       cause="gate")
                return
            if not tokens:
                return
        if r.matcher is None:
            r.backlog.extend(tokens)
        else:
            self._feed(r, tokens)

    def _feed(self, r: _Row, tokens: list[int]) -> None:
        assert r.matcher is not None
        for tid in tokens:
            try:
                accepted = r.matcher.accept(tid)
            except Exception as exc:
                accepted = False
                reason = f": {exc}"
            else:
                reason = ""
            if not accepted:
                text = (repr(self.vocab.tokens[tid]) if 0 <= tid < len(self.vocab.tokens)
                        else "out of the vocabulary")
                r.fail(f"token {tid} ({text}) rejected by the grammar after {r.fed} "
                       f"constrained tokens{reason}", cause="rejected")
                return
            r.fed += 1

    def _attach_all(self, rows: list[_Row]) -> None:
        """Give each row its grammar: wait (bounded by ``wait_s``, hedged), agreed by ranks."""
        now = time.monotonic()
        for r in rows:
            if r.need_since is None:
                r.need_since = now
        while rows:
            now = time.monotonic()
            views: list[int] = []
            for r in rows:
                r.pending.tick(now)
                assert r.need_since is not None
                views += r.pending.view(now >= r.need_since + self.wait_s)
            try:
                gathered = self.agreement.gather(views)
            except Exception as exc:  # a lost peer: these rows cannot be agreed on
                for r in rows:
                    r.fail(f"ranks could not agree on the grammar: {exc}", cause="agreement")
                return
            waiting = []
            for i, r in enumerate(rows):
                row_views = [RowView(*view[i * VIEW:(i + 1) * VIEW]) for view in gathered]
                # a grammar ready on every rank needs no hedge: do not route its spec again
                ready = all(v.primary == READY for v in row_views)
                decision = decide(not ready and r.pending.can_hedge, row_views)
                if decision.fail is not None or decision.use is not None:
                    outcome = ("hedge" if decision.use == 1 else "ready"
                               if decision.use == 0 else decision.fail or "failed")
                    metrics.FIRST_MASK_WAIT.labels(outcome=outcome).observe(
                        now - (r.need_since or now))
                    if r.pending.hedged and decision.use is not None:
                        metrics.HEDGES.labels(
                            served_by="hedge" if decision.use else "routed").inc()
                if decision.use is not None:
                    self._attach(r, r.pending.attempt(decision.use).result())
                elif decision.fail == "late":
                    r.fail(f"grammar not compiled within wait_s={self.wait_s:g} s of its "
                           "first mask (it goes on compiling for the cache)", cause="late")
                elif decision.fail is not None:
                    r.fail(f"grammar failed to compile: {self._compile_error(r)}", cause="compile")
                else:
                    if decision.hedge:
                        r.pending.start_hedge()
                    waiting.append(r)
            rows = waiting
            if rows:
                until = min(min(r.need_since or now for r in rows) + self.wait_s,
                            min(r.pending.hedge_at if r.pending.can_hedge and
                                not r.pending.hedged else float("inf") for r in rows))
                wait_for_change([r.pending for r in rows], until,
                                poll_s=None if self.agreement.world_size == 1 else 0.002)

    @staticmethod
    def _compile_error(r: _Row) -> str:
        for future in (r.pending.primary, r.pending.alternate):
            if future is not None and future.done() and not future.cancelled():
                exc = future.exception()
                if isinstance(exc, GrammarError):
                    return str(exc)
                if exc is not None:
                    return f"{type(exc).__name__}: {exc}"
        return "failed on another tensor-parallel rank"

    def _attach(self, r: _Row, grammar: Grammar) -> None:
        """Make the row's matcher and feed it the tokens that arrived before it."""
        try:
            matcher = grammar.matcher()
        except Exception as exc:
            r.fail(f"making the matcher failed: {type(exc).__name__}: {exc}", cause="matcher")
            return
        r.grammar = grammar
        r.matcher = matcher
        backlog, r.backlog = r.backlog, []
        self._feed(r, backlog)

    def _contain(self, work: list[tuple[int, _Row, list[int]]], buffer: torch.Tensor,
                 exc: BaseException) -> set[int]:
        """A bug in a fill job (not one row's failure, which ``_run`` contains): its rows
        fail, the host goes on."""
        log.error("grammask: fill job failed: %s: %s", type(exc).__name__, exc)
        indices = set()
        for index, r, _ in work:
            r.fail(f"fill job failed: {type(exc).__name__}: {exc}", cause="fill")
            if self.on_error == "stop":
                buffer[index].copy_(self._stop_row)
                indices.add(index)
        return indices

    def _status(self, r: _Row) -> RowStatus:
        if r.error is not None:
            return "error"
        if r.gate is not None and r.gate.thinking:
            return "thinking"
        if r.matcher is None:
            return "compiling"
        return "ended" if r.matcher.is_terminated() else "active"
