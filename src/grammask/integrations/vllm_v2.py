"""The V2 model runner's side of the plugin: request slots, device tokens, row mapping.

V2 hands a processor per-*slot* state (slots are recycled with no removal hook) and a
``LogitsContext`` per step whose rows are in batch order. Committed tokens live on the
device (``req_states.all_token_ids`` up to ``total_len``), so getting them to the CPU
matchers is the adapter's job, done without stalling the GPU. vLLM 0.34 calls
``apply_staged_writes`` only on steps that admit requests, so the only hook of every step is
``apply``; the adapter therefore works from ``apply`` to ``apply``:

1. ``add_request(slot, params)``: a key check, note the slot; True for ours (0.34:
   ``may_mask_logits``). The processor is not touched: the previous step's token watch may
   be running, and the slot's old occupant leaves the processor in ``apply``.
2. ``apply_staged_writes()`` (admission steps, before the forward): start non-blocking
   copies of a new slot's prompt / resumed output to the host, and hand the step's new
   requests to the helper thread, which parses them and starts their compiles while the
   forward runs (the runner's thread pays a key check per new request, not the parse).
3. ``apply(logits, ctx)``: join the token watch, admit the new slots, mask the logits rows
   of the sampling slots (the processor maps slots to batch rows: ``apply_mapped``), then
   start the *token watch* for the slots that sample now: a helper thread polls the device's
   ``total_len`` of those slots until the runner's ``post_update`` has appended this step's
   tokens, reads them (a second read, after the first saw the new lengths: ``post_update``
   stores the length before the tokens), appends them to the slots' live lists and starts
   the processor's fill. So the read and the fill overlap the next forward. A watch that
   cannot finish (no next step yet, a failure) is redone in the next ``apply``, reading with
   stream order (after every queued kernel), which is always right, only not overlapped.

Rows of unconstrained slots and chunked-prefill rows (their sample is discarded) are left
alone. A row sampling for the first time (its final prefill chunk) is filled in ``apply``.
A resumed request (``prefill_len > prompt_len``) replays its earlier output.
Speculative decoding: a request owns one logits row per draft position plus the bonus row;
the processor fills them along the drafts (``BatchProcessor.apply_drafts``); vLLM 0.34 keeps
logits processors active under drafts, and its rejection sampler reads ``add_request``'s
answer to keep masked vocabulary blocks.
Nothing here raises into vLLM's step: a failure of the helper fails the slots it served.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from ..admissions import Admission
from ..bitmask import normal_tensors
from ..processor import BatchProcessor
from ..request import thinking_of
from .vllm_common import PluginCore

log = logging.getLogger("grammask")


#: The longest a token watch polls for a step's tokens (a step this long is not a decode step:
#: the next ``apply`` reads them in stream order instead).
WATCH_S = 5.0
#: Pause between two polls of the device's lengths (the poll itself is a tiny gather), first
#: and at most: it doubles while nothing lands, so a waiting watch leaves the GIL to the
#: runner's thread.
POLL_S = 50e-6
POLL_MAX_S = 1e-3


@dataclass
class _Slot:
    params: Any  # the request's sampling params, parsed off the runner's thread (``_admit``)
    resumed: bool  # a preempted request added again (its output is prefilled again)
    prompt_len: int
    prefill_len: int
    wants_prompt: bool  # its thinking gate reads the prompt (from its keys: ``thinking_of``)
    admission: Admission | None = None  # the parse's result: request, compile, host_masks
    parsing: Future[None] | None = None  # the helper's parse of this slot's step's requests
    output: list[int] = field(default_factory=list)  # the processor's live list
    prompt: list[int] = field(default_factory=list)
    fetched: bool = False  # prompt / resumed output copied to the host
    fetch: tuple[Any, torch.Tensor] | None = None  # (event, host copy) started before forward
    known: int = 0  # committed positions already appended to ``output`` (or placeholders)
    added: bool = False  # in the processor
    missing: tuple[int, int] | None = None  # positions left as placeholders (slow path)
    failed: str | None = None  # the helper lost this slot's tokens: fail it in the processor


@dataclass
class _Watch:
    """One step's token watch: the slots that sampled (device index, known lengths), the
    snapshot of their next positions, and whether their tokens were read."""

    items: list[tuple[int, _Slot]]
    index: torch.Tensor
    start: torch.Tensor
    snapshot: tuple[Any, torch.Tensor]  # (event, the windows' tokens before the step)
    future: Future[bool] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


def _landed(new: int, tokens: list[int], before: list[int], window: int) -> bool:
    """Whether a slot's step has landed: its length grew and each new token in the window
    differs from what the snapshot saw there (the tokens are stored after the length)."""
    if new <= 0:
        return False
    take = min(new, window)
    return all(tokens[i] != before[i] for i in range(take))


class _Windows:
    """The slots' committed lengths and next ``window`` tokens, read to the host (pinned
    buffers; on CUDA on a stream of their own, so the forward's stream is not held)."""

    def __init__(self, req_states: Any, window: int, n: int, *, stream: bool) -> None:
        self.rs = req_states
        self.window = window
        self.device: torch.device = req_states.device
        self.cuda = self.device.type == "cuda"
        with normal_tensors():
            self.total = torch.zeros(n, dtype=torch.int32, pin_memory=self.cuda)
            self.tokens = torch.zeros(n, window, dtype=torch.int32, pin_memory=self.cuda)
        self.stream: Any = None
        if stream and self.cuda:
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def read(self, index: torch.Tensor, start: torch.Tensor, n: int, *, ordered: bool
             ) -> tuple[list[int], list[list[int]]]:
        """(lengths, the ``window`` tokens from ``start``) of the slots ``index``, on the
        host; ``ordered``: after every kernel queued on the runner's stream."""
        stream = self.stream
        if stream is None:
            self.queue(index, start, self.total, self.tokens)
        else:
            if ordered:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.queue(index, start, self.total, self.tokens)
            stream.synchronize()
        return self.total[:n].tolist(), self.tokens[:n].tolist()

    def queue(self, index: torch.Tensor, start: torch.Tensor, total: torch.Tensor | None,
              tokens: torch.Tensor) -> None:
        """Queue the gather of lengths (unless ``total`` is None) and windows into host
        buffers (current stream)."""
        n = index.shape[0]
        all_ids = self.rs.all_token_ids.gpu
        columns = (start.unsqueeze(1) + torch.arange(self.window, device=start.device)
                   ).clamp_(max=all_ids.shape[1] - 1)
        if total is not None:
            total[:n].copy_(self.rs.total_len.gpu.index_select(0, index),
                            non_blocking=self.cuda)
        tokens[:n].copy_(all_ids[index.unsqueeze(1), columns], non_blocking=self.cuda)


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
        self._leaving: set[int] = set()  # slots whose old occupant leaves the processor
        self._unjoined: set[int] = set()  # constrained slots not in the processor yet
        self._missing: set[int] = set()  # slots with placeholders to read before masking
        self._unparsed: list[_Slot] = []  # added this step: parsed by the helper (``_admit``)
        self._tracked = np.zeros(n, dtype=bool)
        self._prefill = np.zeros(n, dtype=np.int64)
        self._helper: ThreadPoolExecutor | None = None
        self._watch: _Watch | None = None
        self._windows = _Windows(req_states, self._window, n,
                                 stream=self.core.active and self._cuda)

    # ------------------------------------------------------------------ runner hooks
    def add_request(self, slot: int, sampling_params: Any) -> bool:
        """Reset the (recycled) slot; True when the request is constrained. Never touches
        the processor (a token watch may be running): ``apply`` removes the old occupant."""
        core = self.core
        if not core.active:
            return False
        if slot in self._slots:
            del self._slots[slot]
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

    def apply_staged_writes(self) -> None:
        """Admission steps (every step before vLLM 0.34): start copying new slots' prompts
        and resumed outputs to the host, so ``apply`` need not wait for them."""
        if not self.core.active:
            return
        if self._unparsed:
            new, self._unparsed = self._unparsed, []
            parsing = self._helper_pool().submit(self._admit, new)
            for st in new:
                st.parsing = parsing
        all_ids = self.rs.all_token_ids.gpu
        for slot in self._unjoined:  # only slots not in the processor yet can need a fetch
            st = self._slots[slot]
            if st.fetched or st.fetch is not None:
                continue
            lo = 0 if st.wants_prompt else st.prompt_len
            host = torch.empty(st.prefill_len - lo, dtype=all_ids.dtype, pin_memory=self._cuda)
            host.copy_(all_ids[slot, lo:st.prefill_len], non_blocking=self._cuda)
            event = None
            if self._cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            st.fetch = (event, host)

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        core = self.core
        if not core.active or not (self._slots or self._leaving):
            return logits
        self._sync()
        if self._leaving:
            proc = core.proc_or_none
            if proc is not None:
                for slot in self._leaving:  # before the new occupant joins (``_prepare``)
                    proc.remove(slot)
            self._leaving.clear()
        slots_np = np.asarray(ctx.idx_mapping_np)
        tracked = (slots_np >= 0) & self._tracked[np.maximum(slots_np, 0)]
        if not tracked.any():
            return logits
        # the final prefill chunk and decode rows sample; earlier chunks' samples are dropped
        seq = np.asarray(ctx.seq_lens_upper_bound_np)
        rows = np.flatnonzero(tracked & (seq >= self._prefill[slots_np]))
        if rows.size == 0:
            return logits
        slots: list[int] = slots_np[rows].tolist()
        try:
            if logits.shape[0] == slots_np.shape[0] and not self.num_spec:
                self._prepare(slots).apply_mapped(logits, rows.tolist(), slots)
            else:
                self._mask_drafts(logits, ctx, slots)
        except Exception as exc:  # a bug of ours: these rows end, vLLM's step goes on
            log.exception("grammask: masking failed; its rows get stop-only masks")
            for slot in slots:
                self._fail_slot(slot, f"masking failed: {type(exc).__name__}: {exc}")
            expanded = _host(ctx.expanded_idx_mapping)
            _stop_only(logits, [int(r) for r in np.flatnonzero(np.isin(expanded, slots))],
                       core.compiler.vocab.stop_ids if core.compiler is not None else ())
            return logits
        self._start_watch(slots)
        return logits

    def _prepare(self, slots: list[int]) -> BatchProcessor:
        """Placeholders resolved and every sampling slot in the processor (the common step
        does neither: two set checks, no work per row)."""
        proc = self.core.processor()
        if self._missing:  # rare: resolve placeholders before masking
            for slot in sorted(self._missing):
                st = self._slots.get(slot)
                if st is not None and st.missing is not None:
                    self._fill_missing(st, slot)
            self._missing.clear()
        if self._unjoined:
            for slot in self._unjoined.intersection(slots):
                self._join(slot, self._slots[slot])
                self._unjoined.discard(slot)
        return proc

    def _mask_drafts(self, logits: torch.Tensor, ctx: Any, slots: list[int]) -> None:
        """Speculative decoding: a request owns one logits row per draft token plus the
        bonus row (``expanded_local_pos`` 0..n); row k's mask follows the first k drafts,
        which are this step's ``input_ids`` of rows 1..k (row 0's input is committed)."""
        expanded = _host(ctx.expanded_idx_mapping)
        sampling = set(slots)
        rows = [int(s) if int(s) in sampling else -1 for s in expanded.tolist()]
        self._prepare(slots).apply_drafts(logits, rows, _host(ctx.expanded_local_pos).tolist(),
                                          _host(ctx.input_ids).tolist())

    # ------------------------------------------------------------------ the token watch
    def _start_watch(self, slots: list[int]) -> None:
        """After this step's masks: read the tokens it commits as soon as they land.

        The watch first takes a *snapshot* of the positions those tokens will fill, in
        stream order before this step's sampler (on CUDA a copy queued now; on CPU a read
        now): the runner's ``post_update`` stores the new length before the tokens, so a
        grown length alone does not mean the tokens are there, but a token that differs
        from the snapshot does. A token that happens to equal its snapshot keeps the watch
        waiting; the next ``apply`` then reads in stream order (right, only not overlapped)."""
        items = [(slot, self._slots[slot]) for slot in slots]
        items = [(slot, st) for slot, st in items if st.failed is None]
        if not items:
            return
        n = len(items)
        index = torch.tensor([slot for slot, _ in items], dtype=torch.int64)
        start = torch.tensor([st.known for _, st in items], dtype=torch.int64)
        if self._cuda:
            index = index.pin_memory().to(self.device, non_blocking=True)
            start = start.pin_memory().to(self.device, non_blocking=True)
        with normal_tensors():
            snap_tokens = torch.empty(n, self._window, dtype=torch.int32,
                                      pin_memory=self._cuda)
        self._windows.queue(index, start, None, snap_tokens)
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        watch = _Watch(items, index, start, (event, snap_tokens))
        watch.future = self._helper_pool().submit(self._read_step, watch, True)
        self._watch = watch

    def _helper_pool(self) -> ThreadPoolExecutor:
        """The helper thread: token watches and new requests' parses, in order."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammask-v2-tokens")
        return self._helper

    def _sync(self) -> None:
        """The last step's tokens read and its fill started (here, in stream order, when
        the watch could not). Never raises: a slot whose tokens cannot be read fails
        (stop-only) instead of being masked from a wrong state."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        assert watch.future is not None
        watch.cancel.set()  # the runner is here: whatever is queued now is in stream order
        try:
            done = watch.future.result()
        except Exception:
            log.exception("grammask: watching this step's tokens failed; reading them now")
            done = False
        if done:
            return
        try:
            self._read_step(watch, False)
        except Exception as exc:
            log.exception("grammask: reading this step's tokens failed")
            for slot, _ in watch.items:
                self._fail_slot(slot, f"reading tokens failed: {type(exc).__name__}: {exc}")

    def _read_step(self, watch: _Watch, poll: bool) -> bool:
        """Append the step's committed tokens to the watched slots' lists and start the
        fill. ``poll`` (helper thread): wait, off stream order, until every slot's length
        grew and its new tokens differ from the snapshot; False when that did not happen
        before ``apply`` came back (or within ``WATCH_S``). Without ``poll`` (the host
        thread): one read ordered after every kernel queued so far."""
        items = watch.items
        n = len(items)
        known = [st.known for _, st in items]
        if poll:
            event, snap_tokens = watch.snapshot
            if event is not None:
                event.synchronize()
            before = snap_tokens.tolist()
            deadline = time.monotonic() + WATCH_S
            pause = POLL_S
            while True:
                totals, tokens = self._windows.read(watch.index, watch.start, n, ordered=False)
                if all(_landed(t - k, row, old, self._window) for t, k, row, old
                       in zip(totals, known, tokens, before, strict=True)):
                    break
                if watch.cancel.is_set() or time.monotonic() > deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        else:
            totals, tokens = self._windows.read(watch.index, watch.start, n, ordered=True)
        for i, (slot, st) in enumerate(items):
            new = totals[i] - st.known
            if new <= 0:
                continue
            take = min(new, self._window)
            st.output.extend(tokens[i][:take])
            if new > take:  # more than a step's worth: placeholders, read in apply()
                st.output.extend([-1] * (new - take))
                lo = st.known + take if st.missing is None else st.missing[0]
                st.missing = (lo, st.known + new)
                self._missing.add(slot)
            st.known += new
        self.core.processor().step([slot for slot, _ in items])
        return True

    # ------------------------------------------------------------------ internals
    def _fail_slot(self, slot: int, message: str) -> None:
        st = self._slots.get(slot)
        if st is None or st.failed is not None:
            return
        st.failed = message
        proc = self.core.proc_or_none
        if st.added and proc is not None:
            proc.fail(slot, message)

    def _admit(self, slots: list[_Slot]) -> None:
        """The helper's parse of a step's new requests (their compiles start here). A parse
        that raises leaves the admission to ``_admitted``, where the processor makes the
        row: raising again there errors that row alone."""
        for st in slots:
            try:
                st.admission = self.core.admission(st.params, st.resumed)
            except Exception:
                log.exception("grammask: admitting a request failed")

    def _admitted(self, st: _Slot) -> Admission:
        """The slot's admission (``BatchProcessor.add_later``'s resolve): the helper's, or
        made now when none came (no staged writes before this step, or its parse raised)."""
        return (st.admission if st.admission is not None
                else self.core.admission(st.params, st.resumed))

    def _join(self, slot: int, st: _Slot) -> None:
        """Put the slot in the processor (its live list replays what it holds). The helper's
        parse is waited for here, on the runner's thread: a fill job that waited for the
        helper could deadlock with the helper's own ``step``."""
        if not st.fetched:
            self._fetch(slot, st)
        if st.parsing is not None:
            try:
                st.parsing.result()
            except Exception:  # the helper's own failure: ``_admitted`` parses instead
                log.exception("grammask: the helper's parse failed; parsing here")
            st.parsing = None
        proc = self.core.processor()
        proc.add_later(slot, partial(self._admitted, st), st.prompt, st.output)
        st.added = True
        if st.failed is not None:
            proc.fail(slot, st.failed)

    def _fetch(self, slot: int, st: _Slot) -> None:
        """The prompt (thinking gate) and resumed output: from the copy started before the
        forward, or read now."""
        if st.fetch is not None:
            event, host = st.fetch
            if event is not None:
                event.synchronize()
            ids = host.tolist()
            st.fetch = None
        else:
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
