"""The V2 model runner's side of the plugin: request slots, device tokens, row mapping.

V2 hands a processor per-*slot* state (slots are recycled with no removal hook) and a
``LogitsContext`` per step whose rows are in batch order. Committed tokens live on the
device (``req_states.all_token_ids`` up to ``total_len``), so getting them to the CPU
matchers is the adapter's job, done without stalling the GPU:

1. ``add_request(slot, params)``: reset the slot, parse, start the compile; True for ours.
2. ``apply_staged_writes()`` (before the forward, after the runner's post-update of the
   previous step was enqueued): gather each tracked slot's ``total_len`` and the token after
   the last one we read, plus a new slot's prompt / resumed output, into pinned host
   buffers with non-blocking copies and record a CUDA event. A helper thread waits for the
   event, appends the tokens to the slots' live lists and starts the processor's fill, so
   the copy and the fill both overlap the forward. (On CPU the copies are plain copies.)
3. ``apply(logits, ctx)``: join the helper; the processor waits for the fill and masks the
   logits rows of the sampling slots (it maps slots to batch rows: ``apply_mapped``). Rows
   of unconstrained slots and chunked-prefill rows
   (their sample is discarded) are left alone.

Which rows are filled: the helper's fill covers the slots that sampled in the previous step
(decode rows); a row sampling for the first time (its final prefill chunk) or one the guess
missed is filled in ``apply`` once the context says it samples. So a finished request's slot
is filled at most once more, a long compile never stalls a chunked prefill, and the set of
rows whose first mask is decided is the same on every tensor-parallel rank.
A resumed request (``prefill_len > prompt_len``) replays its earlier output.
Speculative decoding: a request owns one logits row per draft position plus the bonus row;
the processor fills them along the drafts (``BatchProcessor.apply_drafts``).
Nothing here raises into vLLM's step: a failure of the helper fails the slots it served.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..bitmask import normal_tensors
from ..compiler import Grammar
from ..processor import BatchProcessor
from ..request import ConstraintRequest
from .vllm_common import PluginCore, host_masks

log = logging.getLogger("grammask")



@dataclass
class _Slot:
    request: ConstraintRequest
    grammar: Future[Grammar]
    prompt_len: int
    prefill_len: int
    wants_prompt: bool
    output: list[int] = field(default_factory=list)  # the processor's live list
    prompt: list[int] = field(default_factory=list)
    fetched: bool = False  # prompt / resumed output copied to the host
    known: int = 0  # committed positions already appended to ``output`` (or placeholders)
    added: bool = False  # in the processor
    missing: tuple[int, int] | None = None  # positions left as placeholders (slow path)
    failed: str | None = None  # the helper lost this slot's tokens: fail it in the processor
    host_masks: bool = False  # vLLM's own processors may forbid its tokens (grammar wins)


@dataclass
class _Transfer:
    """One step's device-to-host copies; read by the helper after ``event``."""

    event: Any
    fetches: list[tuple[int, torch.Tensor]]
    slots: list[int]
    total: torch.Tensor
    tokens: torch.Tensor


class V2Batch:
    """The V2 runner's slots mapped onto ``BatchProcessor`` rows (row index = slot)."""

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        n = int(req_states.max_num_reqs)
        spec = getattr(vllm_config, "speculative_config", None)
        #: draft tokens per request and step (0: no speculative decoding)
        self.num_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        #: tokens read per slot per step on the fast path: a step commits up to the accepted
        #: drafts plus the bonus token
        self._window = 1 + self.num_spec
        self.core = PluginCore(vllm_config, "v2", n)
        self.rs = req_states
        self.device: torch.device = req_states.device
        self._cuda = self.device.type == "cuda"
        self._slots: dict[int, _Slot] = {}
        self._tracked = np.zeros(n, dtype=bool)
        self._prefill = np.zeros(n, dtype=np.int64)
        self._helper: ThreadPoolExecutor | None = None
        self._handoff: Future[None] | None = None
        self._live: set[int] = set()  # slots that sampled last step: this step's fill
        pin = self._cuda
        with normal_tensors():
            self._index_host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
            self._known_host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
            self._total_host = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
            self._tokens_host = torch.zeros(n, self._window, dtype=torch.int32,
                                            pin_memory=pin)
        self._event: Any = None
        if not self.core.active:
            return
        if self._cuda:
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ runner hooks
    def add_request(self, slot: int, sampling_params: Any) -> bool:
        """Reset the (recycled) slot; True when the request is constrained."""
        core = self.core
        if not core.active:
            return False
        self._sync()
        if slot in self._slots:
            del self._slots[slot]
            self._tracked[slot] = False
            proc = core.proc_or_none
            if proc is not None:
                proc.remove(slot)
        prompt_len = int(self.rs.prompt_len.np[slot])
        prefill_len = int(self.rs.prefill_len.np[slot])
        # a preempted request comes back with its output to prefill again
        request, grammar = core.request(sampling_params, resumed=prefill_len > prompt_len)
        if request is None or grammar is None:
            return False
        wants_prompt = request.thinking and (request.think_end is not None
                                             or core.default_marker)
        self._slots[slot] = _Slot(request, grammar, prompt_len, prefill_len, wants_prompt,
                                  host_masks=host_masks(sampling_params))
        self._tracked[slot] = True
        self._prefill[slot] = prefill_len
        return True

    def apply_staged_writes(self) -> None:
        """Start this step's token copies and, once they land, the fill (helper thread)."""
        if not self.core.active:
            return
        self._sync()
        if not self._slots:
            return
        transfer = self._start_copies()
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammask-v2-tokens")
        self._handoff = self._helper.submit(self._receive, transfer)

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        core = self.core
        if not core.active or not self._slots:
            return logits
        self._sync()
        slots_np = np.asarray(ctx.idx_mapping_np)
        tracked = (slots_np >= 0) & self._tracked[np.maximum(slots_np, 0)]
        if not tracked.any():
            self._live = set()
            return logits
        # the final prefill chunk and decode rows sample; earlier chunks' samples are dropped
        seq = np.asarray(ctx.seq_lens_upper_bound_np)
        rows = np.flatnonzero(tracked & (seq >= self._prefill[slots_np]))
        slots = [int(s) for s in slots_np[rows]]
        self._live = set(slots)
        if rows.size == 0:
            return logits
        try:
            if logits.shape[0] == slots_np.shape[0] and not self.num_spec:
                return self._mask(logits, rows, slots)
            return self._mask_drafts(logits, ctx, slots)
        except Exception as exc:  # a bug of ours: these rows end, vLLM's step goes on
            log.exception("grammask: masking failed; its rows get stop-only masks")
            for slot in slots:
                self._fail_slot(slot, f"masking failed: {type(exc).__name__}: {exc}")
            expanded = _host(ctx.expanded_idx_mapping)
            _stop_only(logits, [int(r) for r in np.flatnonzero(np.isin(expanded, slots))],
                       core.compiler.vocab.stop_ids if core.compiler is not None else ())
            return logits

    def _prepare(self, slots: list[int]) -> BatchProcessor:
        """Placeholders resolved and every sampling slot in the processor."""
        proc = self.core.processor()
        for slot, st in self._slots.items():  # rare: resolve placeholders before masking
            if st.missing is not None:
                self._fill_missing(st, slot)
        for slot in slots:
            st = self._slots[slot]
            if not st.added:
                self._join(slot, st)
        return proc

    def _mask(self, logits: torch.Tensor, rows: np.ndarray, slots: list[int]) -> torch.Tensor:
        """One logits row per request: the processor maps slots to batch rows."""
        self._prepare(slots).apply_mapped(logits, rows.tolist(), slots)
        return logits

    def _mask_drafts(self, logits: torch.Tensor, ctx: Any, slots: list[int]) -> torch.Tensor:
        """Speculative decoding: a request owns one logits row per draft token plus the
        bonus row (``expanded_local_pos`` 0..n); row k's mask follows the first k drafts,
        which are this step's ``input_ids`` of rows 1..k (row 0's input is committed)."""
        expanded = _host(ctx.expanded_idx_mapping)
        sampling = set(slots)
        rows = [int(s) if int(s) in sampling else -1 for s in expanded.tolist()]
        self._prepare(slots).apply_drafts(logits, rows, _host(ctx.expanded_local_pos).tolist(),
                                          _host(ctx.input_ids).tolist())
        return logits

    # ------------------------------------------------------------------ internals
    def _sync(self) -> None:
        """Join the helper's job: the processor is the host thread's again.

        Never raises: a failed helper leaves the slots' token lists unknown, so each slot
        it served fails (stop-only) instead of being masked from a wrong state."""
        if self._handoff is not None:
            handoff, self._handoff = self._handoff, None
            try:
                handoff.result()
            except Exception as exc:
                log.exception("grammask: reading this step's tokens failed")
                for slot in list(self._slots):
                    self._fail_slot(slot, f"reading tokens failed: {type(exc).__name__}: "
                                          f"{exc}")

    def _fail_slot(self, slot: int, message: str) -> None:
        st = self._slots.get(slot)
        if st is None or st.failed is not None:
            return
        st.failed = message
        proc = self.core.proc_or_none
        if st.added and proc is not None:
            proc.fail(slot, message)

    def _start_copies(self) -> _Transfer:
        """Enqueue this step's gathers and device-to-host copies (no host wait on CUDA)."""
        all_ids = self.rs.all_token_ids.gpu
        max_len = all_ids.shape[1]
        fetches: list[tuple[int, torch.Tensor]] = []
        for slot, st in self._slots.items():
            if not st.fetched:
                lo = 0 if st.wants_prompt else st.prompt_len
                host = torch.empty(st.prefill_len - lo, dtype=all_ids.dtype,
                                   pin_memory=self._cuda)
                host.copy_(all_ids[slot, lo:st.prefill_len], non_blocking=self._cuda)
                fetches.append((slot, host))
        slots = [s for s, st in self._slots.items() if st.fetched]
        n = len(slots)
        if n:
            self._index_host[:n] = torch.tensor(slots)
            self._known_host[:n] = torch.tensor([self._slots[s].known for s in slots])
            index = self._index_host[:n].to(self.device, non_blocking=self._cuda)
            known = self._known_host[:n].to(self.device, non_blocking=self._cuda)
            columns = (known.unsqueeze(1) + torch.arange(self._window, device=self.device)
                       ).clamp_(max=max_len - 1)
            self._total_host[:n].copy_(self.rs.total_len.gpu.index_select(0, index),
                                       non_blocking=self._cuda)
            self._tokens_host[:n].copy_(all_ids[index.unsqueeze(1), columns],
                                        non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()
        return _Transfer(self._event, fetches, slots, self._total_host[:n],
                         self._tokens_host[:n])

    def _receive(self, transfer: _Transfer) -> None:
        """Helper thread: wait for the copies, extend the live lists, start the fill."""
        if transfer.event is not None:
            transfer.event.synchronize()
        for slot, host in transfer.fetches:
            st = self._slots[slot]
            ids = host.tolist()
            if st.wants_prompt:
                st.prompt, replay = ids[:st.prompt_len], ids[st.prompt_len:]
            else:
                replay = ids
            st.output.extend(replay)  # a resumed request's earlier output
            st.known = st.prefill_len
            st.fetched = True
        totals = transfer.total.tolist()
        tokens = transfer.tokens.tolist()
        for i, slot in enumerate(transfer.slots):
            st = self._slots[slot]
            new = int(totals[i]) - st.known
            if new <= 0:
                continue
            take = min(new, self._window)
            st.output.extend(int(t) for t in tokens[i][:take])
            if new > take:  # more than a step's worth: placeholders, read in apply()
                st.output.extend([-1] * (new - take))
                lo = st.known + take if st.missing is None else st.missing[0]
                st.missing = (lo, st.known + new)
            st.known += new
        proc = self.core.processor()
        for slot, st in self._slots.items():
            if not st.added and st.fetched:
                self._join(slot, st)
        live = [slot for slot in self._live if slot in self._slots]
        if live:
            proc.step(live)

    def _join(self, slot: int, st: _Slot) -> None:
        """Put the slot in the processor (its live list replays what it holds)."""
        if not st.fetched:  # needed before any copy ran (no apply_staged_writes yet)
            self._fetch_now(slot, st)
        proc = self.core.processor()
        proc.add(slot, st.request, st.prompt, st.output, grammar=st.grammar,
                 host_masks=st.host_masks)
        st.added = True
        if st.failed is not None:
            proc.fail(slot, st.failed)

    def _fetch_now(self, slot: int, st: _Slot) -> None:
        lo = 0 if st.wants_prompt else st.prompt_len
        ids = self.rs.all_token_ids.gpu[slot, lo:st.prefill_len].tolist()
        if st.wants_prompt:
            st.prompt, replay = ids[:st.prompt_len], ids[st.prompt_len:]
        else:
            replay = ids
        st.output.extend(replay)
        st.known = st.prefill_len
        st.fetched = True

    def _fill_missing(self, st: _Slot, slot: int) -> None:
        """Slow path (host sync): tokens beyond the step's window replace placeholders."""
        assert st.missing is not None
        lo, hi = st.missing
        ids = self.rs.all_token_ids.gpu[slot, lo:hi].tolist()
        start = len(st.output) - (st.known - lo)
        st.output[start:start + len(ids)] = [int(t) for t in ids]
        st.missing = None


def _stop_only(logits: torch.Tensor, rows: list[int], stop_ids: tuple[int, ...] | list[int]
               ) -> None:
    """The emergency mask: only stop tokens in ``rows`` (the request ends now)."""
    index = torch.tensor(rows, device=logits.device)
    stops = torch.tensor(list(stop_ids), dtype=torch.int64, device=logits.device)
    block = logits[index]
    kept = block[:, stops]
    block.fill_(float("-inf"))
    block[:, stops] = kept
    logits[index] = block


def _host(tensor: Any) -> np.ndarray:
    """A small index tensor on the host (a device sync on GPU: after the forward anyway)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    return np.asarray(tensor.detach().to("cpu").numpy())
