"""The V1 model runner's side of the plugin (``V1Batch``); the plugin class itself lives in
``plugin``.

V1 runner, as vLLM drives it (``InputBatch``):

- ``update_state(batch_update)`` before every forward: rows removed, added (with a *live*
  output-token list, which the processor reads itself) and moved, in that order; then the
  fill of the rows that sampled before starts on the processor's worker thread, overlapping
  the forward.
- ``apply(logits)`` in the sampler: wait for the fill, mask in place.
- Async scheduling appends ``-1`` placeholders to the live lists and resolves them right
  before sampling only if ``--logits-processors`` is non-empty; the processor never feeds a
  placeholder (it re-reads the list in ``apply``). Without that flag the placeholders would
  never resolve, so grammask stands aside there (``compat.unserved``, decided in
  ``PluginCore``): inert, never an error at start-up.

Chunked prefill: V1 samples a token for every chunk of a prompt and drops all but the last
chunk's (``_bookkeeping_sync``), and tells processors nothing. A row that has not sampled a
kept token yet (its output list has not grown since it was added) is never stepped in
``update_state``: its first mask is filled in ``apply``, and only when the runner keeps that
row's sample (``compat.v1_discarded``, the runner's ``discard_request_mask``). So the
first-mask wait (``wait_s``) starts at the row's first kept sample: a discarded chunk never
stalls the batch, and a slow compile never errors a row before that sample. Where the mask
cannot be read (not called from ``GPUModelRunner._sample``), every sample counts as kept.

Nothing here raises into vLLM's step. A fault of grammask's in a hook ends every row of
grammask's (stop-only masks, ``grammask_row_errors_total{cause="fault"}``, a rate-limited
traceback: ``faults``), drops the processor, whose state may be half-updated (the next
constrained request gets a new one), and leaves every other row as vLLM made it. Which rows
are grammask's comes from this class's own table (``_rows``), kept apart from the
processor's; were that table itself lost, logits are left untouched until the batch empties.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from ... import metrics
from ...decode.step_apply import Mapped
from ...kernels.apply import stop_only, warm_device_apply
from .compat import v1_discarded
from .faults import log_fault
from .plugin_core import PluginCore

__all__ = ["V1Batch"]

log = logging.getLogger("grammask")


@dataclass
class _Row:
    """A row of grammask's, as the batch updates alone say it: its request's live output
    list and that list's length when the row was added (a kept sample makes it grow)."""

    output: list[int]
    start: int
    sampled: bool = False  # it sampled a kept token: never a prompt chunk again
    failed: str | None = None  # ended by a fault: stop-only masks until it leaves


class V1Batch:
    """The V1 runner's batch bookkeeping mapped onto ``BatchProcessor`` rows (row = row)."""

    def __init__(self, vllm_config: Any, device: Any = None) -> None:
        max_batch = int(vllm_config.scheduler_config.max_num_seqs)
        self.core = PluginCore(vllm_config, "v1", max_batch)
        #: grammask's rows (None: lost to a fault, until the batch empties)
        self._rows: dict[int, _Row] | None = {}
        self._unknown_noted = False
        if self.core.active and device is not None:
            _warm(vllm_config, torch.device(device))

    @property
    def active(self) -> bool:
        return self.core.active

    # ------------------------------------------------------------------ runner hooks
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch's changes, then start the fill of the rows that sampled. Never
        raises: a fault ends grammask's rows (``_fault``)."""
        if not self.core.active:
            return
        try:
            self._follow(batch_update)
        except Exception as exc:
            log_fault("V1 update_state", "following vLLM's batch", exc)
            self._fault(f"following the batch failed: {type(exc).__name__}: {exc}")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask grammask's rows that sample now, in place. Never raises: a fault gives every
        row of grammask's a stop-only mask."""
        if not self.core.active or not self._rows:
            return logits
        try:
            self._mask(logits)
        except Exception as exc:
            log_fault("V1 apply", "masking", exc)
            self._fault(f"masking failed: {type(exc).__name__}: {exc}")
            self._stop_failed(logits)
        return logits

    # ------------------------------------------------------------------ internals
    def _follow(self, update: BatchUpdate | None) -> None:
        if update is not None:
            added = self._track(update)
            self._to_processor(update, added)
        rows = self._rows
        if not rows:
            return
        stepping = []
        for index, r in rows.items():
            if r.failed is None:
                r.sampled = r.sampled or len(r.output) > r.start
                if r.sampled:
                    stepping.append(index)
        proc = self.core.proc_or_none
        if proc is not None and proc.has_rows:
            proc.step(stepping)  # the fill runs while the forward does

    def _track(self, update: BatchUpdate) -> dict[int, Any]:
        """``_rows`` after ``update`` (removed, added, moved), built apart and then swapped
        in: a failure leaves ``_rows`` None (lost). Returns the added rows of grammask's,
        with their params."""
        old, self._rows = self._rows, None
        if old is None:
            if update.batch_size:  # rows of grammask's may still be out there
                return {}
            old = {}  # the batch emptied: nothing is lost any more
        rows = dict(old)
        for index in update.removed:
            rows.pop(index, None)
        added: dict[int, Any] = {}
        for index, params, _, output in update.added:
            rows.pop(index, None)
            claimed, failed = self._claims(params)
            if claimed:
                rows[index] = _Row(output, len(output), failed=failed)
                if failed is None:
                    added[index] = params
        for a, b, direction in update.moved:
            ra, rb = rows.pop(a, None), rows.pop(b, None)
            if ra is not None:
                rows[b] = ra
            if rb is not None and direction == MoveDirectionality.SWAP:
                rows[a] = rb
        self._rows = rows
        return added

    def _claims(self, params: Any) -> tuple[bool, str | None]:
        """Whether grammask serves the request; a fault in deciding makes it grammask's,
        failed (its keys were not vLLM's to serve)."""
        try:
            return self.core.claims(params), None
        except Exception as exc:
            log_fault("V1 update_state", "admitting a request", exc)
            metrics.ROW_ERRORS.labels(cause="fault").inc()
            return True, f"admitting the request failed: {type(exc).__name__}: {exc}"

    def _to_processor(self, update: BatchUpdate, added: dict[int, Any]) -> None:
        """The same changes, in the processor (made at the first constrained request)."""
        core = self.core
        proc = core.proc_or_none
        if proc is not None:
            for index in update.removed:
                proc.remove(index)
        for index, params, prompt, output in update.added:
            if index in added:
                # the parse, the compile's start and the row are the fill job's, off this
                # thread: here a new request costs a key check and a table entry
                core.processor().add_later(index, params, prompt or (), output,
                                           resumed=bool(output))
            elif (proc := core.proc_or_none) is not None:
                proc.remove(index)  # the row may still hold a previous occupant
        proc = core.proc_or_none
        if proc is not None:
            for a, b, direction in update.moved:
                if direction == MoveDirectionality.SWAP:
                    proc.swap(a, b)
                else:
                    proc.move(a, b)

    def _mask(self, logits: torch.Tensor) -> None:
        rows = self._rows
        assert rows is not None
        live = {i: r for i, r in rows.items() if r.failed is None}
        if live:
            proc = self.core.processor()
            if all(r.sampled for r in live.values()):
                proc.apply(logits)  # every row samples: the step's own rows
            else:
                kept = self._kept(logits.shape[0], live)
                proc.apply(logits, Mapped(kept, kept))
        if len(live) < len(rows):
            self._stop_failed(logits)

    def _kept(self, n: int, live: dict[int, _Row]) -> list[int]:
        """The rows whose sample the runner keeps (a first mask is filled for those only)."""
        discarded = v1_discarded(n)
        if discarded is None:
            if not self._unknown_noted:
                self._unknown_noted = True
                log.info("grammask: not called from vLLM's GPUModelRunner._sample, so which "
                         "samples are prompt chunks vLLM drops is unknown: every sample "
                         "counts as kept (a first mask may wait at a prompt chunk)")
            return sorted(i for i in live if i < n)
        return sorted(i for i in live if i < n and not discarded[i])

    def _fault(self, message: str) -> None:
        """Every row of grammask's ends (counted once each) and the processor goes: its
        state may be half-updated. Never raises."""
        for r in (self._rows or {}).values():
            if r.failed is None:
                r.failed = message
                metrics.ROW_ERRORS.labels(cause="fault").inc()
        try:
            self.core.close()
        except Exception as exc:
            log_fault("V1 fault", "dropping the processor", exc)
        if self._rows is None:
            log.error("grammask: which rows are grammask's is lost; their logits are left "
                      "as vLLM made them until the batch empties")

    def _stop_failed(self, logits: torch.Tensor) -> None:
        """Stop-only masks on grammask's failed rows (from ``_rows``; none when lost)."""
        try:
            failed = [i for i, r in (self._rows or {}).items()
                      if r.failed is not None and i < logits.shape[0]]
            compiler = self.core.compiler
            if failed and compiler is not None:
                stop_only(logits, sorted(failed), compiler.vocab.stop_ids)
        except Exception as exc:
            log_fault("V1 apply", "the stop-only masks of failed rows", exc)


def _warm(vllm_config: Any, device: torch.device) -> None:
    """The device apply kernel compiled now, as V2Batch does (else the first constrained
    step compiles it inside vLLM's sampler). Logits reach processors as float32
    (``Sampler.forward``), as wide as the model's vocabulary (``InputBatch``)."""
    try:
        warm_device_apply(device, int(vllm_config.model_config.get_vocab_size()))
    except Exception as exc:  # never fatal: the first step compiles instead
        log.warning("grammask: warming the apply kernel failed: %s", exc)
