"""The V2 model runner's side of the plugin: request slots, device tokens, row mapping.

V2 hands a processor per-*slot* state (slots are recycled with no removal hook) and a
``LogitsContext`` per apply whose rows are in batch order. Committed tokens live in the
runner's memory (``req_states.all_token_ids`` up to ``total_len``); getting them to the CPU
matchers without stalling the GPU is the token watch's job (``token_watch.py``, over
vLLM's buffers through ``v2_device``). This class only translates vLLM's calls:

1. ``add_request(slot, params)``: a key check, note the slot; True for ours (0.34:
   ``may_mask_logits``). The processor is not touched: a watch may be stepping it; the
   slot's old occupant leaves the processor in ``apply``.
2. ``apply_staged_writes()`` (admission steps, before the forward): start non-blocking
   copies of a new slot's prompt / resumed output to the host, and hand the step's new
   requests to the parse thread, which parses them and starts their compiles while the
   forward runs (the runner's thread pays a key check per new request, not the parse).
3. ``apply(logits, ctx)``, once or several times a step (vLLM 0.34's rejection sampler
   verifies a large speculative batch in request chunks): settle the pending commits of the
   slots this call samples (``TokenWatch.settle``: their tokens read and fill started, never
   waiting for the forward the host just launched), admit new slots, mask the logits rows of
   the sampling slots (``BatchProcessor.apply`` with ``Mapped`` rows, or ``AlongDrafts``), then
   hand those slots to the watch (``TokenWatch.watch``).

Rows of unconstrained slots and chunked-prefill rows (their sample is discarded) are left
alone. A row sampling for the first time (its final prefill chunk) is filled in ``apply``.
A resumed request (``prefill_len > prompt_len``) replays its earlier output.
Speculative decoding: a request owns one logits row per draft position plus the bonus row;
the processor fills them along the drafts; vLLM 0.34 keeps logits processors active under
drafts, and its rejection sampler reads ``add_request``'s answer to keep masked vocabulary
blocks. The processor is touched under one lock by the host and the watch.
Nothing here raises into vLLM's step: a failure fails the slots it concerns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from ... import metrics
from ...decode.processor import BatchProcessor
from ...decode.step_apply import AlongDrafts, Mapped
from ...decode.stepjob import Arrival
from ...kernels.apply import stop_only, warm_device_apply
from ...specs.request import thinking_of
from .faults import log_fault
from .plugin_core import PluginCore
from .token_watch import Items, SlotTokens, TokenWatch
from .v2_device import CudaPort, DevicePort, TokenReader, unsampleable_id

log = logging.getLogger("grammask")


@dataclass
class _Slot:
    params: Any  # its sampling params, parsed off the runner's thread (``_parse_arrivals``)
    resumed: bool  # a preempted request added again (its output is prefilled again)
    prompt_len: int
    prefill_len: int
    wants_prompt: bool  # its thinking gate reads the prompt (from its keys: ``thinking_of``)
    arrival: Arrival | None = None  # the parse's result: request, compile, host_masks
    parsing: Future[None] | None = None  # the parse thread's parse of this step's requests
    tokens: SlotTokens = field(default_factory=SlotTokens)  # the live list and its reads
    prompt: list[int] = field(default_factory=list)
    fetched: bool = False  # prompt / resumed output copied to the host
    fetch: tuple[Any, torch.Tensor] | None = None  # (event, host copy) started before forward
    added: bool = False  # in the processor
    failed: str | None = None  # lost track of this slot's tokens: fail it in the processor


def bind_device(device: torch.device) -> None:
    """A helper thread's initializer: its CUDA calls go to the rank's device (under tensor
    parallelism each rank's threads would otherwise make a context on GPU 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class V2Batch:
    """The V2 runner's slots mapped onto ``BatchProcessor`` rows (row index = slot)."""

    def __init__(self, vllm_config: Any, req_states: Any, *,
                 port: DevicePort | None = None) -> None:
        n = int(req_states.max_num_reqs)
        spec = getattr(vllm_config, "speculative_config", None)
        #: draft tokens per request and step (0: no speculative decoding)
        self.num_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        self.core = PluginCore(vllm_config, "v2", n)
        self.rs = req_states
        self.device: torch.device = req_states.device
        self._cuda = self.device.type == "cuda"
        self._slots: dict[int, _Slot] = {}
        self._leaving: set[int] = set()  # slots whose old occupant leaves the processor
        self._unjoined: set[int] = set()  # constrained slots not in the processor yet
        self._unparsed: list[_Slot] = []  # added this step: parsed on the parse thread
        self._tracked = np.zeros(n, dtype=bool)
        self._prefill = np.zeros(n, dtype=np.int64)
        self._helpers = _HelperThreads(self.device)
        #: the processor is touched by the host's apply and the watch's step: one at a time
        self._lock = threading.Lock()
        if port is None:
            port = CudaPort(self.device) if self._cuda and self.core.active else DevicePort()
        self.port = port
        # a step commits up to the accepted drafts plus the bonus token
        self.reader = TokenReader(req_states, 1 + self.num_spec, port)
        compiler = self.core.compiler
        #: the watch's mark (``v2_device``): a valid token id no constrained row samples;
        #: None (setting ``token_marks=false``): nothing written, every read ordered
        self.mark = (unsampleable_id(compiler.vocab, int(req_states.vocab_size))
                     if compiler is not None and self.core.settings.token_marks else None)
        self.watch = TokenWatch(self.reader, port,
                                lengths=self.num_spec > 0, step=self._step_rows,
                                fail=self._fail_slot, pool=partial(self._helpers.pool, "tokens"),
                                mark=self.mark)
        #: applies that read draft inputs in stream order (speculative decoding)
        self.draft_reads = 0
        if self.core.active:
            warm_device_apply(self.device, int(req_states.vocab_size))

    # ------------------------------------------------------------------ runner hooks
    # Each hook vLLM calls catches every exception of grammask's (an exception in the
    # sampler ends vLLM's engine core): a fault ends grammask's rows it concerns, with
    # stop-only masks, ``grammask_row_errors_total{cause="fault"}`` and a rate-limited
    # traceback (``faults``); every other row is left as vLLM made it.

    def add_request(self, slot: int, sampling_params: Any) -> bool:
        """Reset the (recycled) slot; True when the request is constrained. Never touches
        the processor (a watch may be stepping it): ``apply`` removes the old occupant.
        A fault makes the slot ours, failed: its rows get stop-only masks."""
        if not self.core.active:
            return False
        try:
            return self._add(slot, sampling_params)
        except Exception as exc:
            log_fault("add_request", "adding a request", exc)
            ours = self._ours(sampling_params)
            self._add_failed(slot, sampling_params if ours else None,
                             f"adding the request failed: {type(exc).__name__}: {exc}")
            return ours  # another's request is left as vLLM made it

    def apply_staged_writes(self) -> None:
        """Arrival steps (every step before vLLM 0.34): start copying new slots' prompts
        and resumed outputs to the host, so ``apply`` need not wait for them. A fault
        fails the slots not in the processor yet."""
        if not self.core.active:
            return
        try:
            self._stage()
        except Exception as exc:
            log_fault("apply_staged_writes", "staging new requests", exc)
            for slot in self._unjoined:
                self._slots[slot].failed = (f"staging the request failed: "
                                            f"{type(exc).__name__}: {exc}")

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Mask the sampling rows of grammask's slots in ``logits`` (in place). Never
        raises: a fault gives this apply's rows of grammask's slots stop-only masks."""
        if not self.core.active or not (self._slots or self._leaving):
            return logits
        started = time.perf_counter()
        try:
            self._apply(logits, ctx)
        except Exception as exc:
            log_fault("apply", "masking", exc)
            self._fault(logits, ctx, exc)
        metrics.V2_APPLY_SECONDS.observe(time.perf_counter() - started)
        return logits

    def _add_failed(self, slot: int, sampling_params: Any, message: str) -> None:
        """After a fault in ``add_request``: the slot's old occupant leaves; its new
        request, when grammask's (``sampling_params`` not None), joins failed (stop-only
        masks, counted when it joins)."""
        try:
            old = self._slots.pop(slot, None)
            self._tracked[slot] = False
            self._unjoined.discard(slot)
            if old is not None:
                self.watch.forget(old.tokens)
                self._leaving.add(slot)
            if sampling_params is None:
                return
            self._slots[slot] = _Slot(sampling_params, False, 0, 0, False, fetched=True,
                                      failed=message)
            self._tracked[slot] = True
            self._prefill[slot] = 0
            self._unjoined.add(slot)
        except Exception as again:
            log_fault("add_request", "recording a failed request", again)

    def _ours(self, sampling_params: Any) -> bool:
        """Whether the request is grammask's, after a fault: the key check, or when even
        that fails, whether any ``grammask`` key is there."""
        try:
            return bool(self.core.claims(sampling_params))
        except Exception:
            extra = getattr(sampling_params, "extra_args", None) or {}
            return any(isinstance(k, str) and k.startswith("grammask") for k in extra)

    def _add(self, slot: int, sampling_params: Any) -> bool:
        core = self.core
        old = self._slots.pop(slot, None)
        if old is not None:
            self.watch.forget(old.tokens)
            self._tracked[slot] = False
            self._leaving.add(slot)
            self._unjoined.discard(slot)
        if not core.claims(sampling_params):
            return False
        prompt_len = int(self.rs.prompt_len.np[slot])
        prefill_len = int(self.rs.prefill_len.np[slot])
        thinking, think_end = thinking_of(sampling_params.extra_args)
        # a preempted request comes back with its output to prefill again
        st = _Slot(sampling_params, prefill_len > prompt_len, prompt_len, prefill_len,
                   thinking and (think_end is not None or core.default_marker))
        self._slots[slot] = st
        self._unparsed.append(st)
        self._tracked[slot] = True
        self._prefill[slot] = prefill_len
        self._unjoined.add(slot)
        return True

    def _stage(self) -> None:
        if self._unparsed:
            new, self._unparsed = self._unparsed, []
            parsing = self._helpers.pool("parse").submit(self._parse_arrivals, new)
            for st in new:
                st.parsing = parsing
        all_ids = self.rs.all_token_ids.gpu
        for slot in self._unjoined:  # only slots not in the processor yet can need a fetch
            st = self._slots[slot]
            if st.fetched or st.fetch is not None or st.failed is not None:
                continue
            lo = 0 if st.wants_prompt else st.prompt_len
            host = torch.empty(st.prefill_len - lo, dtype=all_ids.dtype, pin_memory=self._cuda)
            source = all_ids[slot, lo:st.prefill_len]
            # after the runner's staged write of the prompt (stream order)
            self.port.ordered(partial(_copy_into, host, source, self._cuda))
            st.fetch = (self.port.mark(), host)

    def _apply(self, logits: torch.Tensor, ctx: Any) -> None:
        core = self.core
        slots_np, rows = sampling_rows(ctx.idx_mapping_np, ctx.seq_lens_upper_bound_np,
                                       self._tracked, self._prefill)
        slots: list[int] = slots_np[rows].tolist()
        self.watch.settle(slots)
        with self._lock:
            if self._leaving:
                proc = core.proc_or_none
                if proc is not None:
                    for slot in self._leaving:  # before the new occupant joins (``_prepare``)
                        proc.remove(slot)
                self._leaving.clear()
            if not slots:
                return
            # the rows as the processor takes them, then one apply: a logits row per
            # request (no drafts this step, whatever the speculative config) is in batch
            # order; otherwise a request owns a row per draft (read in stream order)
            host_rows = (Mapped(rows.tolist(), slots)
                         if logits.shape[0] == slots_np.shape[0]
                         else self._draft_rows(ctx, slots))
            self._prepare(slots).apply(logits, host_rows)
        try:
            self.watch.watch([(slot, self._slots[slot].tokens) for slot in slots
                              if self._slots[slot].failed is None])
        except Exception as exc:  # the step's tokens cannot be watched: these rows end
            log_fault("apply", "watching this step's tokens", exc)
            with self._lock:
                for slot in slots:
                    self._fail_slot(slot, f"watching tokens failed: {type(exc).__name__}: "
                                          f"{exc}")

    def _fault(self, logits: torch.Tensor, ctx: Any, exc: Exception) -> None:
        """A fault in ``apply``: grammask's slots of this apply fail (their processor rows
        error, so later steps mask them stop-only too) and their logits rows get stop-only
        masks now. Never raises: what cannot be done is logged."""
        message = f"masking failed: {type(exc).__name__}: {exc}"
        try:
            slots_np = np.asarray(ctx.idx_mapping_np)
            ours = [int(s) for s in slots_np.tolist() if s >= 0 and self._tracked[s]]
            for slot in ours:
                try:
                    self._fail_slot(slot, message)
                except Exception as again:
                    log_fault("apply", "failing a slot", again)
            compiler = self.core.compiler
            _stop_only_slots(logits, ctx, slots_np, ours, self.port,
                             compiler.vocab.stop_ids if compiler is not None else ())
        except Exception as again:
            log_fault("apply", "the stop-only masks of a failed apply", again)

    def close(self) -> None:
        """Stop the helper threads (after their queued work)."""
        self._helpers.close()

    def _prepare(self, slots: list[int]) -> BatchProcessor:
        """Every sampling slot in the processor (the common step: one set check)."""
        proc = self.core.processor()
        if self._unjoined:
            for slot in self._unjoined.intersection(slots):
                self._join(slot, self._slots[slot])
                self._unjoined.discard(slot)
        return proc

    def _draft_rows(self, ctx: Any, slots: list[int]) -> AlongDrafts:
        """Speculative decoding: a request owns one logits row per draft token plus the
        bonus row (``expanded_local_pos`` 0..n); row k's mask follows the first k drafts,
        which are this step's ``input_ids`` of rows 1..k (row 0's input is committed)."""
        # the drafts exist on the device only (0.34's drafter proposes there, and
        # ``prepare_inputs`` writes them into ``input_ids`` before the forward): they are
        # read in stream order, which waits for the forward (``draft_reads``)
        self.port.wait(self.port.mark())
        self.draft_reads += 1
        expanded = _host(ctx.expanded_idx_mapping)
        sampling = set(slots)
        rows = [int(s) if int(s) in sampling else -1 for s in expanded.tolist()]
        return AlongDrafts(rows, _host(ctx.expanded_local_pos).tolist(),
                           _host(ctx.input_ids).tolist())

    # ------------------------------------------------------------------ internals
    def _step_rows(self, items: Items) -> None:
        """The watch's hand-over: the fill of the slots whose tokens it read starts (those
        still held by the request it read them for)."""
        with self._lock:
            rows = [slot for slot, t in items
                    if (st := self._slots.get(slot)) is not None and st.tokens is t
                    and st.added]
            if not rows:
                return
            try:
                self.core.processor().step(rows)
            except Exception as exc:  # their fill cannot start: these rows end (a stale
                # mask must never stand in for the one their new tokens call for)
                log_fault("the token watch", "starting a step's fill", exc)
                for slot in rows:
                    self._fail_slot(slot, f"starting the fill failed: "
                                          f"{type(exc).__name__}: {exc}")


    def _fail_slot(self, slot: int, message: str) -> None:
        """The slot's request ends (stop-only masks from now on): in the processor, or at
        its join (``_join``)."""
        st = self._slots.get(slot)
        if st is None or st.failed is not None:
            return
        st.failed = message
        proc = self.core.proc_or_none
        if st.added and proc is not None:
            proc.fail(slot, message, cause="fault")

    def _parse_arrivals(self, slots: list[_Slot]) -> None:
        """The parse thread's parse of a step's new requests (their compiles start here). A
        parse that raises leaves the slot's parse to the processor's reader (``PluginCore``)
        on the fill job that makes the row: raising again there errors that row alone."""
        for st in slots:
            try:
                st.arrival = self.core.arrival(st.params, st.resumed)
            except Exception:
                log.exception("grammask: admitting a request failed")

    def _join(self, slot: int, st: _Slot) -> None:
        """Put the slot in the processor (its live list replays what it holds). The parse
        is waited for here, on the runner's thread: a fill job that waited for it could
        deadlock with a watch's ``step``."""
        if not st.fetched:
            _fetch(st, slot, self.rs, self.port)
        if st.parsing is not None:
            try:
                st.parsing.result()
            except Exception:  # the parse thread's own failure: the fill job parses instead
                log.exception("grammask: the helper's parse failed; parsing here")
            st.parsing = None
        proc = self.core.processor()
        proc.add_later(slot, st.params, st.prompt, st.tokens.output, resumed=st.resumed,
                       parsed=st.arrival)
        st.added = True
        if st.failed is not None:
            proc.fail(slot, st.failed, cause="fault")



def sampling_rows(idx_mapping_np: Any, seq_lens_upper_bound_np: Any,
                  tracked: np.ndarray[Any, Any], prefill: np.ndarray[Any, Any]
                  ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(the batch's slots, the batch positions of tracked slots that sample now), from a
    ``LogitsContext``'s host arrays. ``seq_lens_upper_bound_np`` may be longer than the
    batch: a FULL CUDA graph pads a decode batch to its capture size, and data parallelism
    to a peer's count (0.34 ``model_runner.py``: ``prepare_inputs``, "padded entries left at
    zero"); only its first ``len(idx_mapping_np)`` entries are requests. A chunked prefill's
    rows before its last chunk do not sample (vLLM drops that sample): their upper bound is
    below the slot's prefill length."""
    slots_np = np.asarray(idx_mapping_np)
    seq = np.asarray(seq_lens_upper_bound_np)[:slots_np.shape[0]]
    known = np.maximum(slots_np, 0)
    mine = (slots_np >= 0) & tracked[known]
    return slots_np, np.flatnonzero(mine & (seq >= prefill[known]))


def _copy_into(host: torch.Tensor, source: torch.Tensor, cuda: bool) -> None:
    host.copy_(source, non_blocking=cuda)


def _host(tensor: Any) -> np.ndarray:
    """A small index tensor on the host (a device sync on GPU: after the forward anyway)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    return np.asarray(tensor.detach().to("cpu").numpy())


def _fetch(st: _Slot, slot: int, rs: Any, port: DevicePort) -> None:
    """The prompt (thinking gate) and resumed output: from the copy started before the
    forward, or read now."""
    if st.fetch is not None:
        marker, host = st.fetch
        port.wait(marker)
        ids = host.tolist()
        st.fetch = None
    else:  # no staged writes before this step: read in stream order
        lo = 0 if st.wants_prompt else st.prompt_len
        port.wait(port.mark())
        ids = rs.all_token_ids.gpu[slot, lo:st.prefill_len].tolist()
    if st.wants_prompt:
        st.prompt, replay = ids[:st.prompt_len], ids[st.prompt_len:]
    else:
        replay = ids
    st.tokens.output.extend(replay)
    st.tokens.known = st.prefill_len
    st.fetched = True


class _HelperThreads:
    """The batch's helper threads, one a job, on the rank's device: ``tokens`` (the
    watches, in step order) or ``parse`` (new requests' parses; apart, so a parse never
    waits behind a watch)."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def pool(self, name: str) -> ThreadPoolExecutor:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = ThreadPoolExecutor(
                1, thread_name_prefix=f"grammask-v2-{name}", initializer=bind_device,
                initargs=(self._device,))
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=False)
        self._pools.clear()


def _stop_only_slots(logits: torch.Tensor, ctx: Any, slots: np.ndarray[Any, Any],
                     ours: list[int], port: DevicePort, stop_ids: Sequence[int]) -> None:
    """Stop-only masks on the logits rows of the slots ``ours`` (a failed apply's)."""
    if logits.shape[0] == slots.shape[0]:  # a row per request, in batch order
        rows = np.flatnonzero(np.isin(slots, ours)).tolist()
    else:  # drafts: the layout is device-only, read in stream order
        port.wait(port.mark())
        rows = np.flatnonzero(np.isin(_host(ctx.expanded_idx_mapping), ours)).tolist()
    if rows:
        stop_only(logits, rows, stop_ids)
