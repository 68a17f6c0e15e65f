"""A driver of vLLM 0.34's V2 order for the tests, on vLLM's own classes, on CPU.

Real (vLLM's wheel): ``RequestState`` (its free list hands slots out from the top, staged
writes), ``Sampler`` (the processors' ``add_request`` fan-out, ``may_mask_logits``, its
processor list), ``LogitsContext``, and the rejection sampler's request chunks
(``rejection_sampler._iter_request_chunks`` over ``get_max_chunk_logits``, with
``MAX_CHUNK_BYTES`` patched small instead of gigabytes of logits).

The order is 0.34's default, async scheduling (``engine/core.py``:
``step_with_batch_queue``; ``worker/gpu/model_runner.py``: ``execute_model`` then
``sample_tokens``): the host queues step t's staged writes and forward, then calls every
processor's ``apply`` once per verification chunk and queues that chunk's sampling, then
queues ``post_update(t)``; it learns step t's tokens only one step later (its
``update_from_output``), so ``apply(t+1)`` runs before step t's tokens land.

**The stand-in device.** A thread that runs queued work in order: the runner's stream. The
forward (a sleep), the sampling (the rejection sampler's rule over the masked logits, and
the check of every mask against an independent reference), ``post_update`` in the kernel's
store order (``last_sampled_tokens``, then ``total_len``, then the tokens), the staged
writes and the drafter's proposals all run there, in queue order. The plugin's
``DevicePort`` is pointed at it (``StandInPort``): its markers, its stream-ordered writes
(sentinels, prompt fetches) and its waits go through the same queue. Host memory is shared
as UVA memory is on a GPU host: the watch reads ``all_token_ids`` while the device writes it.

**What vLLM builds around the processors, built here with its own host code:**

- ``pad``: FULL decode CUDA graphs. A uniform decode batch runs the graph captured for the
  next size of ``decode_cudagraph_capture_grid`` (``config/compilation.py``), and
  ``prepare_inputs`` gives ``seq_lens_upper_bound_np`` that many entries, the padded ones
  zero, while ``idx_mapping_np`` keeps one per request (``model_runner.py``). ``dp_pad``
  pads further, as data parallelism pads every rank to the largest count across ranks.
  Batches with drafts are not padded (the rejection sampler slices the array).
- ``prompt_logprobs``: a request of the batch asks for prompt logprobs, so between the
  processors and ``post_update`` vLLM's ``_prompt_logprobs_token_ids_kernel`` reads
  ``all_token_ids[slot, num_computed + 1 + i]`` for every row of the batch
  (``sample/prompt_logprob.py``); the device replays that read, in stream order, and
  counts every id outside ``[0, vocab_size)`` (``Counts.bad_reads``).
- ``dummy_run``: ``_dummy_sampler_run``'s hooks (``model_runner.py``): warm-up parameters
  added to slots ``0..n-1``, staged writes, an apply over ``InputBatch.make_dummy``'s
  layout.

What it does not model: CUDA graphs' kernels and timing; the drafter's and
``prepare_inputs``' device-only tensors (here the device writes them into CPU tensors the
context holds, which the plugin reads in stream order as it does on CUDA).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .vllm_fixtures import CONSTRAINTS, IM_START, VOCAB, ref_allowed, xargs

# isort: split
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
)
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.states import RequestState

from grammask.integrations.vllm.plugin import GrammaskLogitsProcessor
from grammask.integrations.vllm.v2_device import DevicePort

from .helpers import RawReference


class StandInDevice:
    """A thread that runs queued work in order (the runner's stream); markers count it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = (
            queue.SimpleQueue())
        self._cond = threading.Condition()
        self._queued = 0
        self._done = 0
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="stand-in-device", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> int:
        with self._cond:
            self._queued += 1
            n = self._queued
        self._queue.put((n, work))
        return n

    def passed(self, marker: int) -> bool:
        return self._done >= marker

    def wait(self, marker: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._done >= marker)

    def sync(self) -> None:
        self.wait(self.submit(lambda: None))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            n, work = item
            try:
                work()
            except BaseException as exc:  # a failed check: reported by the test
                self.errors.append(exc)
            with self._cond:
                self._done = n
                self._cond.notify_all()


class InlineDevice(StandInDevice):
    """The synchronous order of the older tests: queued work runs at once, on the host."""

    def __init__(self) -> None:
        self.errors = []
        self._done = self._queued = 0

    def submit(self, work: Callable[[], None]) -> int:
        self._queued += 1
        work()
        self._done = self._queued
        return self._queued

    def wait(self, marker: int) -> None:
        pass

    def close(self) -> None:
        pass


class StandInPort(DevicePort):
    """The plugin's view of the stand-in device (``DevicePort``)."""

    def __init__(self, device: StandInDevice) -> None:
        self.device = device

    def mark(self) -> Any:
        return self.device.submit(lambda: None)

    def passed(self, marker: Any) -> bool:
        return self.device.passed(marker)

    def wait(self, marker: Any) -> None:
        self.device.wait(marker)

    def ordered(self, work: Callable[[], None]) -> None:
        self.device.submit(work)


@dataclass
class Req:
    """One request as the driver (host) and the device (its reference) see it."""

    rid: str
    constraint: int  # -1: unconstrained (its logits must stay as vLLM made them)
    prompt: list[int]
    max_tokens: int
    ref: RawReference | None  # device side: accepted only committed tokens
    output: list[int] = field(default_factory=list)  # device side: committed tokens
    known: int = 0  # host side: output tokens the host has learnt (update_from_output)
    slot: int = -1
    computed: int = 0  # host side: prefill progress
    prefill_len: int = 0
    finished: bool = False  # host side
    drafts: list[int] = field(default_factory=list)  # device side: proposed for next step
    committing: list[int] = field(default_factory=list)  # device side: this step's tokens
    ended: bool = False  # device side: got a stop-only mask its grammar did not call for


@dataclass
class Counts:
    masks: int = 0  # logits rows checked against the reference
    wrong: int = 0
    draft_rows: int = 0
    accepted: int = 0
    rejected: int = 0
    chunks: list[int] = field(default_factory=list)  # applies per step
    preempted: int = 0
    resumed: int = 0
    reused_same_step: int = 0
    finished: int = 0
    padded: int = 0  # applies whose context was padded (FULL graphs, data parallelism)
    reads: int = 0  # positions the prompt-logprob reader read
    bad_reads: int = 0  # ... that held an id outside [0, vocab_size)
    raised: int = 0  # applies that raised (into vLLM's sampler: its engine would end)
    stop_only: int = 0  # rows of constrained requests ended with a stop-only mask
    free_rows: int = 0  # rows of unconstrained requests checked
    touched: int = 0  # ... whose logits differed from what vLLM handed the processors
    empty: int = 0  # rows with no finite logit left (a sampler picks garbage there)


class Driver:
    """vLLM 0.34's V2 order over real ``RequestState`` / ``Sampler`` objects."""

    def __init__(self, config: Any, *, max_reqs: int, num_spec: int = 0,
                 chunk_logits: int | None = None, forward_s: float = 0.002,
                 seed: int = 0, stand_in: bool = True,
                 forward: Callable[[], None] | None = None, pad: bool = False,
                 dp_pad: bool = False, prompt_logprobs: bool = False,
                 check_masks: bool = True) -> None:
        self.width = int(config.model_config.get_vocab_size())
        self.rs = RequestState(max_num_reqs=max_reqs, max_model_len=256,
                               max_num_batched_tokens=max(4096, max_reqs * (1 + num_spec)),
                               num_speculative_steps=num_spec,
                               vocab_size=self.width, device=torch.device("cpu"))
        self.procs = build_custom_logits_processors(config, self.rs, False, ())
        self.sampler = Sampler(config, max_num_reqs=max_reqs, vocab_size=self.width,
                               device=torch.device("cpu"), req_states=self.rs,
                               custom_logits_processors=self.procs)
        self.plugin = next(p for p in self.procs if isinstance(p, GrammaskLogitsProcessor))
        self.device = StandInDevice() if stand_in else InlineDevice()
        batch = self.plugin._v2
        assert batch is not None
        self.batch = batch
        if stand_in:
            # the stand-in device's stream model, where the plugin built its own (the
            # reader and the watch order their reads through the batch's port)
            batch.port = batch.watch.port = batch.reader.port = StandInPort(self.device)
        #: the forward's stand-in (default: a sleep of ``forward_s``)
        self.forward = forward or (lambda: time.sleep(self.forward_s))
        #: markers after each step's forward, and whether the forward had run when the
        #: step's last apply returned
        self.forward_done_at_apply: list[bool] = []
        compiler = self.plugin.core.compiler
        assert compiler is not None
        self.vocab = compiler.vocab
        self.im_start = (IM_START if self.width == VOCAB
                         else self.vocab.tokens.index(b"<|im_start|>"))
        from vllm.config.compilation import decode_cudagraph_capture_grid

        #: the FULL decode graphs' batch sizes (vLLM's own grid for this many slots)
        self.grid = decode_cudagraph_capture_grid(max_reqs) if pad else []
        self.dp_pad = dp_pad
        self.prompt_logprobs = prompt_logprobs
        self.check_masks = check_masks
        self.max_reqs = max_reqs
        self.grammars = [compiler.compile(spec) for _, spec in CONSTRAINTS]
        self.num_spec = num_spec
        self.chunk_logits = chunk_logits
        self.forward_s = forward_s
        self.rng = random.Random(seed)
        self._logits_rng = torch.Generator().manual_seed(seed)
        self._dp_rng = random.Random(seed + 2)
        self.dev_rng = random.Random(seed + 1)  # the device thread's own
        self.reqs: dict[str, Req] = {}
        self.waiting: list[Req] = []  # preempted, to resume
        self.counts = Counts()
        self._new = False
        self._counter = 0
        self._step_markers: list[int] = []  # after each step's post_update
        #: per step, each of its requests' output length after its post_update (device
        #: side): what the host learns of that step, whatever the device did since
        self._known_after: dict[int, dict[str, int]] = {}
        self._freed: list[int] = []  # slots the host freed at its last update

    # ------------------------------------------------------------------ scheduling (host)
    def admit(self, n: int, *, max_tokens: int = 24, free: float = 0.0) -> None:
        """Up to ``n`` new requests, as many as the free list has slots for: constrained
        (a random constraint each), or with probability ``free`` unconstrained."""
        for _ in range(min(n, len(self.rs.free_indices))):
            self._counter += 1
            c = -1 if self.rng.random() < free else self.rng.randrange(len(CONSTRAINTS))
            prompt = [self.im_start, *self.vocab.encode(f"user {self._counter}")]
            ref = None if c < 0 else RawReference.of(self.grammars[c], self.vocab)
            self._add(Req(f"r{self._counter}", c, prompt, max_tokens, ref))

    def _add(self, req: Req, resumed: list[int] | None = None) -> None:
        tokens = [*req.prompt, *(resumed or [])]
        self.rs.add_request(req.rid, prompt_len=len(req.prompt), all_token_ids=tokens,
                            num_computed_tokens=0, max_tokens=req.max_tokens)
        req.slot = self.rs.req_id_to_index[req.rid]
        req.prefill_len = len(tokens)
        req.computed = 0
        self.sampler.add_request(req.slot, SamplingParams(
            max_tokens=req.max_tokens,
            extra_args=(xargs(CONSTRAINTS[req.constraint][0], thinking="off")
                        if req.constraint >= 0 else None)))
        self.reqs[req.rid] = req
        self._new = True

    def dummy_run(self, n: int) -> torch.Tensor:
        """``_dummy_sampler_run``'s hooks (``model_runner.py``), as vLLM makes them at
        start-up and on an elastic-EP re-warm: the sampler over
        ``InputBatch.make_dummy(n, n, ...)`` (slots ``0..n-1``, one token each), then
        ``SamplingParams.for_sampler_warmup()`` added to those slots, staged writes, and the
        sampler again. Returns the second pass's logits (the processors' output)."""
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

        buffers = InputBuffers(self.max_reqs, max(n, 1), torch.device("cpu"))
        batch = InputBatch.make_dummy(n, n, buffers)
        out = torch.zeros(n, self.width)
        for second in (False, True):
            if second:
                for slot in range(n):
                    self.sampler.add_request(slot, SamplingParams.for_sampler_warmup())
                self.device.submit(self.rs.apply_staged_writes)
                # the penalties' staged bincount is a Triton kernel: not run here
                self.sampler.penalties_state._new_penalties_reqs.clear()
                self.sampler.apply_staged_writes()
            ctx = LogitsContext(
                expanded_idx_mapping=batch.expanded_idx_mapping, idx_mapping=batch.idx_mapping,
                idx_mapping_np=batch.idx_mapping_np,
                expanded_local_pos=batch.expanded_local_pos,
                input_ids=batch.input_ids[batch.logits_indices],
                pos=batch.positions[batch.logits_indices],
                seq_lens_upper_bound_np=batch.seq_lens_cpu_upper_bound.numpy())
            logits = torch.zeros(n, self.width)
            for processor in self.sampler.logits_processors:
                if processor in self.procs:  # vLLM's own stages need its kernels
                    logits = processor.apply(logits, ctx)
            out = logits
        # vLLM's own stages would run Triton kernels for the warm-up slots at the next step
        # (none here): they are reset, as a slot taken by a plain request resets them
        for slot in range(n):
            self.sampler.add_request(slot, SamplingParams())
        self.sampler.apply_staged_writes()
        self.device.sync()
        return out

    def _remove(self, req: Req) -> int:
        slot = self.rs.remove_request(req.rid)
        assert slot is not None
        del self.reqs[req.rid]
        return slot

    def preempt(self, k: int) -> None:
        """Preempt ``k`` running requests (after a full sync: the host knows their output)
        and queue them for resumption."""
        self.sync()
        for req in self.rng.sample(sorted(self.reqs.values(), key=lambda r: r.rid),
                                   min(k, len(self.reqs))):
            if req.finished:
                continue
            self._remove(req)
            req.drafts = []
            self.waiting.append(req)
            self.counts.preempted += 1

    def resume(self) -> None:
        for req in self.waiting:
            self._add(req, resumed=req.output[:req.known])
            self.counts.resumed += 1
        self.waiting.clear()

    def sync(self) -> None:
        """Wait for the device and learn every output (a synchronous point)."""
        self.device.sync()
        self._learn(len(self._step_markers))

    def _learn(self, upto: int) -> None:
        """``update_from_output``: the host learns the outputs of steps before ``upto``
        (waiting for them), finishes requests that ended and frees their slots."""
        if upto <= 0:
            return
        self.device.wait(self._step_markers[upto - 1])
        learnt = self._known_after.get(upto - 1, {})
        stops = set(self.vocab.stop_ids)
        freed: list[int] = []
        for req in list(self.reqs.values()):
            # that step's outputs only: the device may have run later steps by now, and
            # what the host learns must not depend on how far it got (a race otherwise)
            req.known = learnt.get(req.rid, req.known)
            known = req.output[:req.known]
            if not req.finished and (stops.intersection(known)
                                     or len(known) >= req.max_tokens):
                req.finished = True
        for req in [r for r in self.reqs.values() if r.finished]:
            freed.append(self._remove(req))
            self.counts.finished += 1
        self._freed = freed

    # ------------------------------------------------------------------ one step
    def step(self, *, admit: int = 0, free: float = 0.0) -> None:
        """One engine step in 0.34's async order."""
        t = len(self._step_markers)
        self._learn(t - 1)  # the host knows outputs up to step t-2 only... then t-1 below
        freed = set(self._freed)
        self._freed = []
        if admit:
            before = set(self.reqs)
            self.admit(admit, free=free)
            self.counts.reused_same_step += sum(
                1 for rid in set(self.reqs) - before if self.reqs[rid].slot in freed)
        order = [r for r in self.reqs.values() if not r.finished]
        self.rng.shuffle(order)
        if not order:
            self._step_markers.append(self.device.submit(lambda: None))
            return
        # execute_model(t): staged writes, then the forward
        if self._new:
            self.device.submit(self.rs.apply_staged_writes)
            self.sampler.apply_staged_writes()
            self._new = False
        forward_marker = self.device.submit(self.forward)
        # sample_tokens(t): the layout (device tensors: filled by the device), chunks
        rows_of: list[int] = []
        seq_lens: list[int] = []
        starts: list[int] = []  # a prefill's num_computed_tokens before this step (-1: decode)
        was_prefill = False
        for req in order:
            if req.computed < req.prefill_len:  # one prefill chunk: the whole prompt
                starts.append(req.computed)
                req.computed = req.prefill_len
                n_rows, seq = 1, req.prefill_len
                was_prefill = True
            else:
                n_rows = 1 + (self.num_spec if self.num_spec else 0)
                seq = req.prefill_len + req.known + (n_rows - 1)  # an upper bound
                starts.append(-1)  # a decode row: total_len - 1, read on the device
            rows_of.append(n_rows)
            seq_lens.append(seq)
        cu = np.concatenate(([0], np.cumsum(rows_of)))
        total_rows = int(cu[-1])
        expanded = torch.zeros(total_rows, dtype=torch.int64)
        local = torch.zeros(total_rows, dtype=torch.int32)
        inputs = torch.zeros(total_rows, dtype=torch.int64)
        draft_of: dict[str, list[int]] = {}

        def prepare_inputs() -> None:  # the device's: drafts proposed at step t-1
            for i, req in enumerate(order):
                lo, hi = int(cu[i]), int(cu[i + 1])
                drafts = (req.drafts + [0] * self.num_spec)[:hi - lo - 1]
                draft_of[req.rid] = drafts
                for k in range(hi - lo):
                    expanded[lo + k] = req.slot
                    local[lo + k] = k
                    inputs[lo + k] = (req.output[-1] if req.output else req.prompt[-1]) \
                        if k == 0 else drafts[k - 1]
        self.device.submit(prepare_inputs)
        idx = np.array([r.slot for r in order], dtype=np.int32)
        chunks = self._chunks(cu)
        self.counts.chunks.append(len(chunks))
        decode_only = all(n == 1 for n in rows_of) and not was_prefill
        for start, end in chunks:
            lo, hi = int(cu[start]), int(cu[end])
            bound = np.array(seq_lens[start:end], dtype=np.int32)
            if decode_only and len(chunks) == 1:
                bound = self._padded(bound)
            ctx = LogitsContext(
                expanded_idx_mapping=expanded[lo:hi], idx_mapping=torch.from_numpy(idx[start:end]),
                idx_mapping_np=idx[start:end], expanded_local_pos=local[lo:hi],
                input_ids=inputs[lo:hi], pos=torch.tensor(seq_lens[start:end]) - 1,
                seq_lens_upper_bound_np=bound)
            logits = torch.randn(hi - lo, self.width, generator=self._logits_rng)
            base = logits.clone()
            for processor in self.sampler.logits_processors:
                try:
                    logits = processor.apply(logits, ctx)
                except Exception:
                    self.counts.raised += 1  # vLLM's sampler would end its engine here
                    raise
            chunk = order[start:end]
            rows = rows_of[start:end]
            self.device.submit(lambda logits=logits, base=base, chunk=chunk, rows=rows,
                               draft_of=draft_of: self._sample(logits, base, chunk, rows,
                                                               draft_of))
        if self.prompt_logprobs:  # sample_tokens: compute_prompt_logprobs, then post_update
            scheduled = list(rows_of)
            self.device.submit(lambda: self._prompt_logprob_read(order, scheduled, starts))
        self.forward_done_at_apply.append(self.device.passed(forward_marker))
        self._step_markers.append(self.device.submit(lambda: self._post_update_of(t, order)))

    def _post_update_of(self, t: int, order: list[Req]) -> None:
        """Step ``t``'s ``post_update``, then what the host will learn of it."""
        self._post_update(order)
        self._known_after[t] = {req.rid: len(req.output) for req in order}

    def _padded(self, bound: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``prepare_inputs``' upper bounds for a FULL decode graph: padded with zeros to
        the graph's batch size (the next size of vLLM's grid; with ``dp_pad``, the size a
        larger peer rank needs)."""
        if not self.grid:
            return bound
        n = len(bound)
        if self.dp_pad:  # its own random source: the run's draws stay the unpadded run's
            n = self._dp_rng.randint(n, self.max_reqs)
        size = next((g for g in self.grid if g >= n), None)
        if size is None or size == len(bound):
            return bound
        out = np.zeros(size, dtype=np.int32)
        out[:len(bound)] = bound
        self.counts.padded += 1
        return out

    def _prompt_logprob_read(self, order: list[Req], scheduled: list[int],
                             starts: list[int]) -> None:
        """``_prompt_logprobs_token_ids_kernel``'s read, on the device between the
        processors and ``post_update``: for every request of the batch and ``i`` below its
        query length, ``all_token_ids[slot, num_computed + 1 + i]`` (clipped to the row,
        as its masked load never reads past the buffer)."""
        ids = self.rs.all_token_ids.gpu
        last = ids.shape[1] - 1
        for req, n, computed in zip(order, scheduled, starts, strict=True):
            if computed < 0:  # a decode row's num_computed, as the device has it now
                computed = int(self.rs.total_len.gpu[req.slot]) - 1
            for i in range(n):
                pos = computed + 1 + i
                if pos > last:
                    continue
                token = int(ids[req.slot, pos])
                self.counts.reads += 1
                if not 0 <= token < self.width:
                    self.counts.bad_reads += 1

    def _chunks(self, cu: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
        """The rejection sampler's request chunks (``_verify_in_chunks``)."""
        if self.chunk_logits is None or cu[-1] <= self.chunk_logits:
            return [(0, len(cu) - 1)]
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rsm

        return list(rsm._iter_request_chunks(cu, self.chunk_logits))

    # ------------------------------------------------------------------ device side
    def _sample(self, logits: torch.Tensor, base: torch.Tensor, chunk: list[Req],
                rows: list[int], draft_of: dict[str, list[int]]) -> None:
        """The rejection sampler over one chunk: every row's mask checked against the
        reference (forked along the drafts), every unconstrained row against the logits
        vLLM handed the processors, then the committed tokens chosen. A constrained row
        whose mask is stop-only where its grammar is not (grammask ended it: a fault)
        counts in ``stop_only``, and its request is not checked further."""
        at = 0
        stops = torch.zeros(self.width, dtype=torch.bool)
        stops[list(self.vocab.stop_ids)] = True
        empty = ~torch.isfinite(logits).any(dim=1)
        self.counts.empty += int(empty.sum())
        for req, n in zip(chunk, rows, strict=True):
            drafts = draft_of.get(req.rid, [])[:n - 1]
            if req.ref is None:
                self.counts.free_rows += n
                self.counts.touched += sum(not torch.equal(logits[at + k], base[at + k])
                                           for k in range(n))
            elif self.check_masks and not req.ended:
                walk = req.ref.fork()  # every row whose drafts the grammar took is checked
                for k in range(n):
                    self.counts.masks += 1
                    self.counts.draft_rows += k > 0
                    finite = torch.isfinite(logits[at + k])
                    if not torch.equal(finite, ref_allowed(walk)):
                        if torch.equal(finite, stops):
                            self.counts.stop_only += 1
                            req.ended = True
                            break
                        self.counts.wrong += 1
                    if k == len(drafts) or not walk.accept(drafts[k]):
                        break
            committed: list[int] = []
            if req.ref is None:  # an unconstrained request: any token of the tokenizer
                stop = self.dev_rng.random() < 0.1
                req.committing = [self.vocab.stop_ids[0] if stop
                                  else self.dev_rng.randrange(len(self.vocab.tokens))]
                at += n
                continue
            for k in range(n):  # the target's rule: a draft it allows is often accepted
                allowed = torch.isfinite(logits[at + k]).nonzero().flatten().tolist()
                if k < len(drafts) and drafts[k] in allowed and self.dev_rng.random() < 0.8:
                    committed.append(drafts[k])
                    self.counts.accepted += 1
                    continue
                committed.append(self._pick(allowed))
                self.counts.rejected += k < len(drafts)
                break
            req.committing = committed
            at += n

    def _pick(self, allowed: list[int]) -> int:
        stop_ids = set(self.vocab.stop_ids)
        stops = [t for t in allowed if t in stop_ids]
        if stops and self.dev_rng.random() < 0.5:
            return stops[0]
        text = [t for t in allowed if t not in stop_ids]
        return self.dev_rng.choice(text or allowed)

    def _post_update(self, order: list[Req]) -> None:
        """``_post_update_kernel``'s stores, in its order, then the drafter's proposals."""
        for req in order:
            tokens, req.committing = req.committing, []
            if not tokens:
                continue
            slot = req.slot
            n = int(self.rs.total_len.gpu[slot])
            self.rs.last_sampled_tokens[slot, 0] = tokens[-1]
            self.rs.total_len.gpu[slot] = n + len(tokens)
            for i, token in enumerate(tokens):
                self.rs.all_token_ids.gpu[slot, n + i] = token
            for token in tokens:  # a token the grammar refuses: a wrong mask let it by
                if req.ref is None or req.ended:
                    break
                if not req.ref.accept(token) and token not in self.vocab.stop_ids:
                    self.counts.wrong += 1
            req.output.extend(tokens)
        if self.num_spec:  # the drafter: a walk of the reference, sometimes off it
            for req in order:
                drafts: list[int] = []
                if req.ref is None or req.ended:
                    req.drafts = [self.dev_rng.randrange(len(self.vocab.tokens))
                                  for _ in range(self.num_spec)]
                    continue
                walk = req.ref.fork()
                for _ in range(self.num_spec):
                    allowed = ref_allowed(walk).nonzero().flatten().tolist()
                    if not allowed or self.dev_rng.random() < 0.2:
                        drafts.append(self.dev_rng.randrange(min(1000, self.width)))
                        continue
                    token = self._pick(allowed)
                    drafts.append(token)
                    walk.accept(token)
                req.drafts = drafts

    def close(self) -> None:
        self.device.sync()
        self.device.close()
        self.plugin.close()
