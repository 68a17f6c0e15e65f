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
  which case the processor owns the list and the host calls ``advance(row, tokens)``, or
  hands one sampled token per row to ``step(rows, tokens)`` (the hand-over and the read in
  one pass over the rows).
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
  parallelism pass an ``agreement`` (``firstmask.Agreement``): ranks then agree on each such
  outcome.
- Any mutation (add/remove/move/swap/advance/rollback) after ``step()`` and before
  ``apply()`` discards that fill; ``apply`` then fills synchronously. The exception: after
  ``step(rows)``, ``add``/``remove`` of a row keep the others' fill (the V2 runner admits
  requests while the last step's fill runs). ``apply`` without
  ``step`` works too (no overlap).

All methods are to be called from one host thread; the worker thread only runs fill jobs.

``BatchProcessor`` is the facade hosts call; each job lives in its own module: a row and its
lifecycle (``rows.py``), the per-step fill job (``stepjob.py``), first masks
(``firstmask.py``), the fill thread and the masks no grammar fills (``fill.py``), masks
into the host's logits, along speculative drafts too (``step_apply.py``).

The batch's rows (``RowTable``): those made (index -> ``Row``) and those queued to be made
(``stepjob.Arrivals``), kept in step with the in-flight fill job and the ended step. The
table owns the dict of made rows; the step jobs and the apply side keep none: each call the
processor makes hands them the table's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compile.compiler import Compiler, Grammar
from ..specs.grammar_spec import GrammarSpec
from ..specs.request import STAND_IN, ConstraintRequest
from ..vocab import Vocabulary
from .engine_switch import EngineSwitch
from .fill import ErrorPolicy, Filler, RowMasks
from .firstmask import Agreement, FirstMasks, Solo
from .rows import FROM_VOCAB, PendingGrammar, Row, RowInfo, RowMaker, RowStatus
from .step_apply import Drafts, HostLogits, HostRows, MaskDigests, StepApply
from .stepjob import Arrival, Arrivals, FillStats, Queued, RequestReader, StepJobs

__all__ = ["Arrival", "BatchProcessor", "ErrorPolicy", "RequestReader", "RowInfo", "RowStatus"]


class BatchProcessor:
    """Masks for a batch of up to ``max_batch`` rows, filled on a worker thread.

    Parameters
    ----------
    compiler : Compiler
        Compiles each added request's grammar (its vocabulary is the masks').
    max_batch : int
        Rows are ``0 .. max_batch - 1``.
    wait_s : float
        The longest a step waits for a row's grammar at its first mask (the batch stalls
        meanwhile); the row then errors alone.
    hedge_s : float
        When the other backend starts compiling a late JSON schema.
    on_error : "stop" | "free"
        An errored row's mask: stop tokens only, or none.
    think_end : str | int | Sequence[int] | None
        The thinking end marker (text, a token id or a token sequence); by default the
        vocabulary's (``</think>`` for Qwen3.x); None disables the thinking gate. A
        request's own ``think_end`` / ``thinking=False`` take precedence.
    filler : Filler | None
        How rows are filled (batch-parallel thresholds, threads, CPUs).
    agreement : Agreement | None
        How tensor-parallel ranks agree on first-mask timing outcomes (None: ``Solo``).
    digests : MaskDigests | None
        Record a digest of every applied mask, to compare ranks (a debug setting).
    engine_switch : bool
        Running rows move to the engine the compiler's fill tuner finds cheaper
        (``engine_switch.py``); outputs then depend on when its verdict lands, so seeded runs
        reproduce only with it off.
    reader : RequestReader | None
        Parses the host's request parameters for ``add_later`` (a host adapter's).

    Raises
    ------
    ValueError
        For an unknown ``on_error`` or a negative ``wait_s`` / ``hedge_s``.
    """

    def __init__(self, compiler: Compiler, *, max_batch: int, wait_s: float = 0.5,
                 hedge_s: float = 0.05, on_error: ErrorPolicy = "stop",
                 think_end: str | int | Sequence[int] | None = FROM_VOCAB,
                 filler: Filler | None = None, agreement: Agreement | None = None,
                 digests: MaskDigests | None = None, engine_switch: bool = True,
                 reader: RequestReader | None = None) -> None:
        if on_error not in ("stop", "free"):
            raise ValueError(f"on_error must be 'stop' or 'free', got {on_error!r}")
        if wait_s < 0 or hedge_s < 0:
            raise ValueError("wait_s and hedge_s must be >= 0")
        self.compiler = compiler
        self.vocab = compiler.vocab
        self.vocab_size = compiler.vocab.vocab_size
        self.max_batch = max_batch
        self._reader = reader
        #: what the fill jobs did (times of the last job, rows filled): metrics, benchmarks
        self.stats = FillStats()
        self._first = FirstMasks(compiler, wait_s=wait_s, hedge_s=hedge_s,
                                 agreement=agreement or Solo())
        self._row_masks = RowMasks(self.vocab, on_error)
        self._arrivals = Arrivals(self._make)
        self._jobs = StepJobs(max_batch=max_batch, vocab_size=self.vocab_size,
                              filler=filler or Filler(), first=self._first, masks=self._row_masks,
                              stats=self.stats, arrivals=self._arrivals,
                              switch=EngineSwitch(compiler, self.vocab_size,
                                                  enabled=engine_switch))
        self._drafts = Drafts(self._first, self._row_masks, self.stats)
        self._new_row = RowMaker(self.vocab, self._first.compiles, think_end).make
        self._logits = HostLogits(max_batch=max_batch, vocab_size=self.vocab_size,
                                  buffers=self._jobs.buffers, digests=digests)
        #: the apply side: the step's masks into the host's logits, in its layout (a
        #: later apply of the same step, vLLM 0.34's chunks, takes the same masks)
        self._apply = StepApply(self._jobs, self._logits, self._drafts)
        #: the rows, made and queued: the one owner of the row table
        self._table = RowTable(max_batch, self._arrivals, self._jobs, self._apply)

    # ------------------------------------------------------------------ batch membership
    def add(self, row: int, request: ConstraintRequest | GrammarSpec | None,
            prompt_ids: Sequence[int] = (), output_ids: list[int] | None = None, *,
            grammar: Grammar | Future[Grammar] | None = None, host_masks: bool = False) -> None:
        """Put a request in ``row`` (replacing whatever was there); None = unconstrained.

        The row is made by the next step's fill job, on the fill thread (``stepjob.Arrivals``:
        the host's share is a table entry), or at once when the host asks about the row
        first. The compile starts then unless ``grammar`` (compiled, or a future of one) is
        given. ``output_ids``: a live list the host appends to, or None to use ``advance``.
        ``host_masks``: the host's own processors forbid tokens of this request before ours
        (vLLM's min_tokens, allowed_token_ids, bad_words, logit_bias): when they leave none of
        the grammar's tokens, the grammar's come back (``apply.restore_empty_rows``).
        Raises only for host mistakes: IndexError (row out of range), TypeError (another
        request type); a request's own faults (a bad grammar) error its row instead."""
        self._table.check(row)
        if request is not None and not isinstance(request, ConstraintRequest | GrammarSpec):
            raise TypeError(f"expected a ConstraintRequest, GrammarSpec or None, got "
                            f"{type(request).__name__}")
        self._table.queue(row, None if request is None else Queued(
            Arrival(request, grammar, host_masks), prompt_ids, output_ids))

    def add_later(self, row: int, params: Any, prompt_ids: Sequence[int] = (),
                  output_ids: list[int] | None = None, *, resumed: bool = False,
                  parsed: Arrival | None = None) -> None:
        """``add`` with the host's own per-request work (parsing ``params``, starting the
        compile) off the forward's critical path too: the fill job that makes the row asks
        the processor's ``reader`` for ``reader.arrival(params, resumed)``, unless the host
        parsed it already (``parsed``). The reader runs on the fill thread, or on the host's
        when the host asks about the row first; its exception errors the row alone. Raises
        IndexError for a row out of range, TypeError without a reader or for a ``parsed``
        that is no ``Arrival``."""
        self._table.check(row)
        if self._reader is None and parsed is None:
            raise TypeError("add_later needs a reader: BatchProcessor(reader=...)")
        if parsed is not None and not isinstance(parsed, Arrival):
            raise TypeError(f"parsed must be an Arrival, got {type(parsed).__name__}")
        self._table.queue(row, Queued(parsed, prompt_ids, output_ids, params, resumed))

    def fail(self, row: int, message: str, cause: str = "host") -> None:
        """Put ``row`` into the sticky error state (adapters that lose track of a row's
        tokens); ``cause``: the metric label. An unconstrained row is left alone."""
        self._apply.end()
        r = self._table.made(row)
        if r is not None:
            self._jobs.discard()
            r.fail(message, cause=cause)

    def remove(self, row: int) -> None:
        """Drop the row's request (none there: nothing happens). A pending fill over named
        rows (``step(rows)``) holds for the others; one over every row is redone in
        ``apply``."""
        self._jobs.drop(row)
        self._table.pop(row)

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` now lives at ``dst``; ``dst``'s previous request is dropped. Raises
        IndexError for a row out of range."""
        self._table.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade requests. Raises IndexError for a row out of range."""
        self._table.swap(a, b)

    def advance(self, row: int, tokens: Sequence[int]) -> None:
        """Append sampled tokens to a row whose output list the processor owns (an
        unconstrained row ignores them). Raises ValueError for a row reading a live list."""
        self._apply.end()
        r = self._table.made(row)
        if r is None:
            return
        if not r.owned:
            raise ValueError(f"row {row} reads a live output list; append to it instead")
        if self._jobs.in_flight is not None:
            self._jobs.discard()
        r.output.extend(map(int, tokens))

    def rollback(self, row: int, num_tokens: int) -> None:
        """Retract the last ``num_tokens`` tokens of the row's output.

        Owned lists lose them here (unread ones first); for a live list the host truncates
        its list itself and this rewinds what was already read. Never raises: a rewind the
        matcher refuses errors the row."""
        self._apply.end()
        r = self._table.made(row)
        if r is None or num_tokens <= 0:
            return
        self._jobs.discard()
        if r.owned:
            unread = min(num_tokens, len(r.output) - r.seen)
            del r.output[max(0, len(r.output) - num_tokens):]
            num_tokens -= unread
        r.rewind(num_tokens)

    # ----------------------------------------------------------------------- per step
    def step(self, rows: Collection[int] | None = None,
             tokens: Sequence[int] | None = None) -> None:
        """Read each constrained row's new tokens and start advance + fill on the worker.

        ``rows``: only these rows (those a host will sample this step); the others keep
        their unread tokens for a later step. None: every constrained row.
        ``tokens``: the hand-over and the read in one pass, for rows whose output list the
        processor owns: ``tokens[i]`` (one sampled token) is appended to row ``rows[i]``
        first, as ``advance(rows[i], [tokens[i]])`` would (``rows`` then in the tokens'
        order; unconstrained rows are skipped). A row with a live list raises ValueError, as
        ``advance`` does, after the step started for the others."""
        self._apply.end()
        self._jobs.step(self._table.rows, rows, tokens, live_rows=self._table.live > 0)

    def apply(self, logits: torch.Tensor, host_rows: HostRows = None) -> None:
        """Wait for this step's fill and mask ``logits`` in place (2-D, float, CPU or CUDA),
        the one apply of every host; ``host_rows`` says which logits row takes which row's
        mask (``step_apply``): None, logits row ``i`` is row ``i`` (vLLM's V1 runner,
        transformers); ``Mapped`` (vLLM's V2 runner: rows are request slots, logits are in
        batch order); ``AlongDrafts`` (speculative decoding). Logits rows no mask is for are
        left alone. Never raises for a row's failure; ValueError for logits with fewer rows
        than a masked row's index."""
        self._apply.into_logits(self._table.rows, logits, host_rows)

    def wait_masks(self, rows: Collection[int] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """Wait for this step's fill; returns the bitmask and the sorted rows it masks.

        For hosts that apply masks themselves (e.g. on the device, in their own sampler).
        ``rows``: rows that must be masked; any the step did not fill are filled now (a host
        that passed ``step(rows)`` a guess). The bitmask is the processor's buffer: valid
        until the next ``step()``; rows not listed hold stale bits and must stay unmasked.
        Ends the step like ``apply``. Never raises for a row's failure."""
        return self._apply.wait(self._table.rows, rows)

    # ------------------------------------------------------------------------- queries
    def info(self, row: int) -> RowInfo:
        """A snapshot of ``row`` (status, error, backend, gaps, token counts); waits for an
        in-flight fill, which may change them."""
        r = self._table.made(row)
        if r is None:
            return RowInfo("unconstrained")
        self._jobs.settle()
        return r.info()

    def status(self, row: int) -> RowStatus:
        """``info(row).status``."""
        return self.info(row).status

    def error(self, row: int) -> str | None:
        """Why ``row`` is in the error state; None when it is not."""
        return self.info(row).error

    @property
    def errors(self) -> dict[int, str]:
        """Every errored row and why (waits for an in-flight fill)."""
        self._jobs.make_rows_now(self._table.rows)
        self._jobs.settle()
        return {i: r.error for i, r in self._table.rows.items() if r.error is not None}

    @property
    def rows(self) -> list[int]:
        """The constrained rows, those added but not yet made by a fill job included (an
        add whose ``resolve`` turns out unconstrained among them until then)."""
        return sorted(self._table.rows.keys() | self._arrivals.queued.keys()
                      | set(self._jobs.handed_rows()))

    @property
    def has_rows(self) -> bool:
        """Whether any row is constrained (``rows``, without sorting them)."""
        return (bool(self._table.rows) or bool(self._arrivals.queued)
                or bool(self._jobs.handed_rows()))

    @property
    def fill_thread_id(self) -> int | None:
        """The fill thread's ``threading`` ident (placement checks, profiles)."""
        return self._jobs.thread_id

    def close(self) -> None:
        """Wait for an in-flight fill and stop the fill thread; compiles go on in the
        compiler, which the caller owns."""
        self._jobs.close()
        self._arrivals.close()

    def __enter__(self) -> BatchProcessor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self, entry: Queued) -> Row | None:
        """A queued add's row (None: unconstrained). Every failure stays in the row: an
        exception of the host's reader or of making the row errors it."""
        try:
            arrival = entry.arrival
            if arrival is None:
                assert self._reader is not None  # ``add_later`` checked
                arrival = self._reader.arrival(entry.params, entry.resumed)
            if not isinstance(arrival, Arrival):
                raise TypeError(f"the reader returned {type(arrival).__name__}, not an Arrival")
            if arrival.request is None:
                return None
            r = self._new_row(arrival.request, entry.prompt_ids, entry.output_ids,
                              arrival.grammar, arrival.host_masks)
        except Exception as exc:
            return failed_row(entry, f"adding the request failed: {type(exc).__name__}: "
                                     f"{exc}", self.vocab)
        if arrival.host_masks:
            self._logits.host_masks_added()
        return r


def failed_row(entry: Queued, message: str, vocab: Vocabulary) -> Row:
    """An errored row in place of one that could not be made (stop-only masks)."""
    failed: Future[Grammar] = Future()
    failed.set_exception(RuntimeError(message))
    output = entry.output_ids
    r = Row(STAND_IN, PendingGrammar(failed, None, hedge_s=0.0),
            [] if output is None else output, output is None, vocab.tokens)
    r.fail(message, cause="host")
    return r


@dataclass(eq=False)
class RowTable:
    """Rows ``0 .. max_batch - 1``: made or queued; mutations settle what they touch."""

    max_batch: int
    arrivals: Arrivals  # the queued ones
    jobs: StepJobs
    apply: StepApply
    #: the made rows (the step jobs and the apply side are handed them per call)
    rows: dict[int, Row] = field(default_factory=dict)
    #: rows added with a live list (``step(rows, tokens)`` refuses them): a hint, which may
    #: count an add that turned out unconstrained until its row is reused
    live: int = 0

    def check(self, row: int) -> None:
        """Raises IndexError for a row out of range."""
        if not 0 <= row < self.max_batch:
            raise IndexError(f"row {row} outside 0..{self.max_batch - 1}")

    def made(self, row: int) -> Row | None:
        """``row``'s request, made now when it was only queued (None: unconstrained)."""
        self.jobs.make_rows_now(self.rows)
        return self.rows.get(row)

    def queue(self, row: int, entry: Queued | None) -> None:
        """The row's previous request leaves; ``entry`` (None: none) waits for a fill job
        to make its row."""
        self.jobs.drop(row)
        self.pop(row)
        if entry is not None:
            self.arrivals.queued[row] = entry
            self.live += entry.output_ids is not None

    def pop(self, row: int) -> None:
        """Drop the row's request, made or queued, if any (the live-list count follows); a
        made row's matcher is released by the next fill job (``Arrivals.retired``)."""
        self.apply.forget(row)
        r = self.rows.pop(row, None)
        if r is not None:
            r.count()
            self.live -= not r.owned
            self.arrivals.retired.append(r)
        queued = self.arrivals.drop(row)
        if queued is not None:
            self.live -= queued.output_ids is not None

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` now lives at ``dst``; ``dst``'s previous request is dropped."""
        self.check(src)
        self.check(dst)
        self.apply.end()
        self.jobs.discard()
        moved = self.rows.pop(src, None)
        self.pop(dst)
        if moved is not None:
            self.rows[dst] = moved
        self.arrivals.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade requests."""
        self.check(a)
        self.check(b)
        self.apply.end()
        self.jobs.discard()
        ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
        if ra is not None:
            self.rows[b] = ra
        if rb is not None:
            self.rows[a] = rb
        self.arrivals.swap(a, b)
