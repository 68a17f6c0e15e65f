"""The CUDA form of the V2 driver (issue 45, item 8): vLLM 0.34's async order on a real
stream, without vLLM (the GPU machine has none). Run by ``bench/gpu_check.sh``.

    python -m tests.v2_gpu_check --device cuda --json OUT [--batch-sizes 1,64,256,512]
                                 [--forwards 3,10,30] [--steps 20] [--budget-s 90]
    python -m tests.v2_gpu_check --device cpu --batch-sizes 1,64 --forwards 3 --steps 6

The pieces are grammask's own, composed as ``V2Batch.apply`` composes them
(``integrations/vllm_v2.py``): ``Compiler`` and ``BatchProcessor(max_batch=1024)`` over the
Qwen2.5 vocabulary, a ``TokenReader`` / ``TokenWatch`` on a ``CudaPort`` (on ``--device
cpu``: the base ``DevicePort``, the synchronous host), one lock around the processor, and a
stand-in of vLLM's ``LogitsProcRequestState``: ``all_token_ids.gpu`` ``[1024, L]`` and
``total_len.gpu`` ``[1024]`` int32 on the device (the dense layout: no host view on CUDA).
Slots are handed out from the top (1023, 1022, ...), as 0.34's free list does; the positions
past each prompt hold stale tokens (a recycled slot's earlier occupant).

Each step t, in 0.34's async order, with no host sync in the runner's part:

1. forward(t): ``torch.cuda._sleep`` calibrated to F ms, then the logits ``[B, 151936]``
   fp32 (on CPU: a sleep of F ms, run in sequence);
2. apply(t): the sampling rows from the context's host arrays (``v2.sampling_rows``) with
   ``seq_lens_upper_bound_np`` padded as a FULL decode CUDA graph pads it (zeros up to the
   graph's batch size; ``idx_mapping_np`` one entry per request), ``TokenWatch.settle``
   (step t-1's tokens read, their fill started), the mask under the lock
   (``BatchProcessor.apply``, ``Mapped`` rows), ``TokenWatch.watch`` (the mark, a valid
   token id, in stream order). One more row of the batch is an unconstrained request that
   asks for prompt logprobs (issue 50): left alone by the apply;
3. vLLM's prompt-logprob token-id read, queued between the processors and ``post_update``
   as 0.34's ``sample_tokens`` orders them: ``all_token_ids[slot, num_computed + 1]`` for
   every row of the batch (``sample/prompt_logprob.py``: ``_prompt_logprobs_token_ids_kernel``;
   a decode row's ``num_computed`` is ``total_len - 1``), each id checked on the device to
   lie in ``[0, vocab_size)`` (a device counter, read once at the end: no host sync);
4. the sampler, queued: argmax of the masked logits, then ``post_update`` as device ops in
   the kernel's store order (``last_sampled_tokens``, ``total_len[slots] += 1``, then
   ``all_token_ids[slots, old_total] = tokens``); a timing event after it.

The host then launches forward(t+1) and calls apply(t+1) before step t's tokens land.

Per (B, F) cell, medians over the steps after 3 warm-up steps:

- ``wait``: the host's wait in apply(t), counted from when step t-1's ``post_update`` event
  completed (a helper thread synchronizes each blocking event and notes the time): apply's
  return minus the later of its start and that time. The goal (issue 45): at most the fill's
  time plus 0.2 ms, flat across F;
- ``overlap``: the share of steps whose forward had not ended when apply returned;
- bytes copied per step (``MaskBuffers.rows_copied`` x words x 4);
- token reads by how they were read (``TokenWatch.reads``: watched / ordered);
- the step (device time between consecutive ``post_update`` events) beside vLLM's way:
  xgrammar ``GrammarMatcher`` per row on the host; after launching forward(t+1) it waits
  for step t's tokens (a pinned copy after ``post_update``, its event synchronized), accepts
  them and fills a pinned bitmask (serially up to 128 rows, else 16-row chunks on a pool, as
  ``bench.step`` models vLLM), copies it without blocking and runs xgrammar's kernel.

Correctness, every cell: the committed tokens (``all_token_ids`` up to ``total_len``) must
equal the tokens the watch handed the processor (exact reads on a real stream, what the
older ``test_v2_watch_cuda.py`` checked), and each row's committed tokens must be a valid
prefix for a raw backend matcher (``tests.helpers.RawReference``, not grammask's adapters).
Any difference makes the exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: make ``tests`` and ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import render_table, write_json
from bench.step import VLLM_CHUNK, VLLM_SERIAL_MAX, vllm_workers

from grammask import Compiler, Grammar, GrammarSpec, Mapped, Vocabulary, load_vocabulary
from grammask.decode.processor import BatchProcessor
from grammask.integrations.vllm.token_watch import Items, SlotTokens, TokenWatch
from grammask.integrations.vllm.v2 import bind_device, sampling_rows
from grammask.integrations.vllm.v2_device import (
    CudaPort,
    DevicePort,
    TokenReader,
    unsampleable_id,
)
from grammask.kernels.apply import _device_kernel, warm_device_apply
from grammask.kernels.bitmask import allocate_bitmask, bitmask_words
from tests.helpers import RawReference

log = logging.getLogger("v2_gpu_check")

SLOTS = 1024  # max_num_reqs
HISTORY = 256  # all_token_ids columns (max_model_len)
PROMPT = 8
WARM = 3
#: a closed schema whose fields keep rows in structure for a few dozen tokens; the free
#: ``note`` last keeps a row from ending within the cell (random logits seldom close it)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["user", "admin", "guest", "service"]},
        "active": {"type": "boolean"},
        "level": {"enum": [1, 2, 3, 5, 8, 13]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "cyan"]}},
        "owner": {"type": "object",
                  "properties": {"team": {"enum": ["core", "infra", "ml"]},
                                 "on_call": {"type": "boolean"}},
                  "required": ["team", "on_call"], "additionalProperties": False},
        "note": {"type": "string"},
    },
    "required": ["kind", "active", "level", "tags", "owner", "note"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------------- the device
class Device:
    """The runner's stream: the forward's stand-in, markers, timing."""

    def __init__(self, name: str) -> None:
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(0)
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        n = 2_000_000
        torch.cuda._sleep(n)
        rates = []
        for _ in range(5):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(n)
            end.record()
            end.synchronize()
            rates.append(n / start.elapsed_time(end))
        return statistics.median(rates)

    def forward(self, logits: torch.Tensor, ms: float) -> Any:
        """forward(t): F ms of device work, then its logits; returns its end marker."""
        if self.cuda:
            torch.cuda._sleep(int(self.cycles_per_ms * ms))
        else:
            time.sleep(ms / 1000)
        logits.uniform_(generator=self.gen)
        return self.mark()

    def mark(self) -> Any:
        """A (timing, blocking) event after everything queued; None on CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


class Landings:
    """When each step's ``post_update`` ran, as the host learns it: a helper thread
    synchronizes each step's blocking event in turn and notes ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.times: dict[int, float] = {}
        self._queue: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(device,), daemon=True,
                                        name="landings")
        self._thread.start()

    def note(self, step: int, marker: Any) -> None:
        if marker is None:  # CPU: the sampler ran in sequence, just now
            self.times[step] = time.perf_counter()
        else:
            self._queue.put((step, marker))

    def _run(self, device: torch.device) -> None:
        bind_device(device)
        while (item := self._queue.get()) is not None:
            step, event = item
            event.synchronize()
            self.times[step] = time.perf_counter()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(60)


def request_state(dev: Device, vocab: Vocabulary, slots: list[int], prompt: list[int],
                  seed: int) -> SimpleNamespace:
    """vLLM 0.34's ``LogitsProcRequestState`` as the adapter reads it (dense layout), with
    ``slots`` admitted: their prompt, and stale tokens past it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(vocab.tokens) - 1000, (SLOTS, HISTORY), dtype=torch.int32,
                        generator=g)
    total = torch.zeros(SLOTS, dtype=torch.int32)
    index = torch.tensor(slots, dtype=torch.int64)
    ids[index, :PROMPT] = torch.tensor(prompt, dtype=torch.int32)
    total[index] = PROMPT
    return SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=ids.to(dev.device)),
        total_len=SimpleNamespace(gpu=total.to(dev.device)),
        last_sampled_tokens=torch.zeros(SLOTS, dtype=torch.int32, device=dev.device),
        device=dev.device, max_num_reqs=SLOTS, vocab_size=vocab.vocab_size)


def padded(n: int) -> int:
    """The FULL decode graph's batch size for ``n`` requests: every count up to 6, then
    even counts (0.34's ``decode_cudagraph_capture_grid`` up to 16; coarser above, which
    only pads more)."""
    return n if n <= 6 else n + (n % 2)


def prompt_logprob_read(rs: SimpleNamespace, slot_index: torch.Tensor,
                        bad: torch.Tensor) -> None:
    """``_prompt_logprobs_token_ids_kernel``'s read for decode rows (query length 1):
    ``all_token_ids[slot, num_computed + 1]`` with ``num_computed = total_len - 1``, queued
    on the stream; ids outside ``[0, vocab_size)`` are counted into ``bad`` on the device."""
    at = rs.total_len.gpu.index_select(0, slot_index).long()
    ids = rs.all_token_ids.gpu[slot_index, at.clamp(max=HISTORY - 1)]
    bad += ((ids < 0) | (ids >= rs.vocab_size)).sum()


def sample(logits: torch.Tensor, rs: SimpleNamespace, slot_index: torch.Tensor) -> torch.Tensor:
    """The sampler and ``post_update``, queued as device ops in ``_post_update_kernel``'s
    store order; no host sync."""
    tokens = logits.argmax(dim=1).to(torch.int32)
    rs.last_sampled_tokens.index_copy_(0, slot_index, tokens)
    total: torch.Tensor = rs.total_len.gpu
    old = total.index_select(0, slot_index)
    total.index_copy_(0, slot_index, old + 1)
    rs.all_token_ids.gpu.index_put_((slot_index, old.long()), tokens)
    return tokens


# ---------------------------------------------------------------------- grammask's side
class V2Apply:
    """``V2Batch.apply``'s sequence over one processor (no vLLM): settle the slots' pending
    commits, mask under the lock, hand the slots to the watch; the watch's step fills."""

    def __init__(self, proc: BatchProcessor, rs: SimpleNamespace, port: DevicePort,
                 device: torch.device, vocab: Vocabulary) -> None:
        self.proc = proc
        self.tracked = np.zeros(SLOTS, dtype=bool)
        self.prefill = np.zeros(SLOTS, dtype=np.int64)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammask-v2-tokens",
                                       initializer=bind_device, initargs=(device,))
        self.failed: dict[int, str] = {}
        self.tokens: dict[int, SlotTokens] = {}
        self.watch = TokenWatch(TokenReader(rs, 1, port), port, lengths=False,
                                step=self._step, fail=self._fail, pool=lambda: self.pool,
                                mark=unsampleable_id(vocab, int(rs.vocab_size)))

    def add(self, slot: int, spec: GrammarSpec, grammar: Grammar, prompt: list[int]) -> None:
        t = self.tokens[slot] = SlotTokens(known=len(prompt))
        self.proc.add(slot, spec, prompt, t.output, grammar=grammar)
        self.tracked[slot] = True
        self.prefill[slot] = len(prompt)

    def apply(self, logits: torch.Tensor, idx_mapping_np: np.ndarray[Any, Any],
              seq_lens_upper_bound_np: np.ndarray[Any, Any]) -> None:
        batch_slots, at = sampling_rows(idx_mapping_np, seq_lens_upper_bound_np,
                                        self.tracked, self.prefill)
        rows: list[int] = at.tolist()
        slots: list[int] = batch_slots[at].tolist()
        self.watch.settle(slots)
        with self.lock:
            self.proc.apply(logits, Mapped(rows, slots))
        self.watch.watch([(s, self.tokens[s]) for s in slots if s not in self.failed])

    def _step(self, items: Items) -> None:
        with self.lock:
            self.proc.step([slot for slot, _ in items])

    def _fail(self, slot: int, message: str) -> None:
        self.failed[slot] = message
        self.proc.fail(slot, message)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.proc.close()


def committed(rs: SimpleNamespace, slots: list[int]) -> dict[int, list[int]]:
    """Each slot's committed tokens, from the device's history (after a sync)."""
    ids = rs.all_token_ids.gpu.cpu().numpy()
    total = rs.total_len.gpu.cpu().numpy()
    return {s: ids[s, PROMPT:int(total[s])].tolist() for s in slots}


def invalid_rows(grammar: Grammar, vocab: Vocabulary, outputs: dict[int, list[int]]) -> int:
    """Rows whose committed tokens a raw backend matcher refuses somewhere."""
    bad = 0
    for tokens in outputs.values():
        ref = RawReference.of(grammar, vocab)
        if not all(ref.accept(t) for t in tokens):
            bad += 1
    return bad


def run_grammask(dev: Device, compiler: Compiler, spec: GrammarSpec, grammar: Grammar,
                 vocab: Vocabulary, batch: int, ms: float, steps: int) -> dict[str, Any]:
    slots = [SLOTS - 1 - i for i in range(batch)]  # from the top, as 0.34's free list
    free = SLOTS - 1 - batch  # the unconstrained request that asks for prompt logprobs
    prompt = [vocab.stop_ids[0], *vocab.encode("user: a record")][:PROMPT]
    prompt += [prompt[-1]] * (PROMPT - len(prompt))
    rs = request_state(dev, vocab, [*slots, free], prompt, seed=batch)
    batch_slots = [*slots, free]
    slot_index = torch.tensor(batch_slots, dtype=torch.int64, device=dev.device)
    idx_mapping_np = np.array(batch_slots, dtype=np.int32)
    proc = BatchProcessor(compiler, max_batch=SLOTS, think_end=None)
    buffers = proc._jobs.buffers  # the step's MaskBuffers (its device copies)
    port: DevicePort = CudaPort(dev.device) if dev.cuda else DevicePort()
    v2 = V2Apply(proc, rs, port, dev.device, vocab)
    for s in slots:
        v2.add(s, spec, grammar, prompt)
    logits = torch.empty(batch + 1, vocab.vocab_size, dtype=torch.float32, device=dev.device)
    bad_reads = torch.zeros((), dtype=torch.int64, device=dev.device)
    untouched = 0
    landings = Landings(dev.device)
    dev.sync()
    recs: list[dict[str, Any]] = []
    try:
        for t in range(WARM + steps):
            forward_end = dev.forward(logits, ms)  # forward(t)
            checked = t < WARM  # the free row compared (a host sync: warm-up steps only)
            free_row = logits[batch].clone() if checked else None
            upper = np.zeros(padded(batch + 1), dtype=np.int32)  # FULL graph: padded
            upper[:batch + 1] = PROMPT + t  # every row commits one token a step
            a0 = time.perf_counter()
            v2.apply(logits, idx_mapping_np, upper)  # apply(t): t-1's tokens not landed yet
            a1 = time.perf_counter()
            untouched += int(free_row is None or torch.equal(logits[batch], free_row))
            prompt_logprob_read(rs, slot_index, bad_reads)  # compute_prompt_logprobs
            busy = None if forward_end is None else not forward_end.query()
            stats = proc.stats
            recs.append({"a0": a0, "a1": a1, "busy": busy,
                         "settle_ms": v2.watch.last_wait_s * 1000,
                         "fill_ms": stats.last_advance_ms + stats.last_fill_ms,
                         "rows": buffers.rows_copied})
            sample(logits, rs, slot_index)  # sampler + post_update(t), queued
            done = dev.mark()
            landings.note(t, done)
            recs[-1]["done"] = done
            recs[-1]["end"] = time.perf_counter()
        dev.sync()
        v2.watch.settle(slots)  # the last step's tokens, read as the next apply would
        truth = committed(rs, slots)
        bad = int(bad_reads.item())
    finally:
        landings.close()
        v2.close()
    read = {s: list(v2.tokens[s].output) for s in slots}
    mismatched = sum(read[s] != truth[s] for s in slots)
    out = _timings(dev, recs, landings.times)
    out.update(
        bytes_per_step=int(statistics.median(r["rows"] for r in recs[WARM:]))
        * bitmask_words(vocab.vocab_size) * 4,
        reads=dict(v2.watch.reads), failed=len(v2.failed), watch_mismatches=mismatched,
        bad_prompt_logprob_ids=bad, free_row_touched=(WARM + steps) - untouched,
        invalid_rows=invalid_rows(grammar, vocab, truth),
        tokens_per_row=statistics.median(len(v) for v in truth.values()))
    return out


# ---------------------------------------------------------------------- vLLM's way
def run_vllm(dev: Device, xgr_grammar: Any, vocab: Vocabulary, batch: int, ms: float,
             steps: int, pool: ThreadPoolExecutor) -> dict[str, Any]:
    import xgrammar as xgr

    slots = [SLOTS - 1 - i for i in range(batch)]
    prompt = [vocab.stop_ids[0]] * PROMPT
    rs = request_state(dev, vocab, slots, prompt, seed=batch + 1)
    slot_index = torch.tensor(slots, dtype=torch.int64, device=dev.device)
    stops = list(vocab.stop_ids)
    matchers = [xgr.GrammarMatcher(xgr_grammar, override_stop_tokens=stops)
                for _ in range(batch)]
    bitmask = allocate_bitmask(batch, vocab.vocab_size, pin=dev.cuda)
    sampled = torch.zeros(batch, dtype=torch.int32, pin_memory=dev.cuda)
    logits = torch.empty(batch, vocab.vocab_size, dtype=torch.float32, device=dev.device)
    kernel = _device_kernel() if dev.cuda else None
    landings = Landings(dev.device)
    rejects = 0

    def fill_rows(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            if not matchers[i].is_terminated():
                matchers[i].fill_next_token_bitmask(bitmask, i)

    def fill() -> None:
        if batch <= VLLM_SERIAL_MAX:
            fill_rows(0, batch)
            return
        for f in [pool.submit(fill_rows, i, min(i + VLLM_CHUNK, batch))
                  for i in range(0, batch, VLLM_CHUNK)]:
            f.result()

    dev.sync()
    recs: list[dict[str, Any]] = []
    done: Any = None
    try:
        for t in range(WARM + steps):
            forward_end = dev.forward(logits, ms)  # forward(t)
            a0 = time.perf_counter()
            if t:  # step t-1's tokens: wait for them, then accept
                if done is not None:
                    done.synchronize()
                for m, token in zip(matchers, sampled.tolist(), strict=True):
                    if not m.is_terminated() and not m.accept_token(token):
                        rejects += 1
            f0 = time.perf_counter()
            fill()
            f1 = time.perf_counter()
            if dev.cuda:
                mask = bitmask.to(dev.device, non_blocking=True)
                if kernel is not None:
                    kernel(logits, mask, vocab.vocab_size, None)
                else:
                    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab.vocab_size)
            else:
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab.vocab_size)
            a1 = time.perf_counter()
            busy = None if forward_end is None else not forward_end.query()
            tokens = sample(logits, rs, slot_index)
            sampled.copy_(tokens, non_blocking=dev.cuda)
            done = dev.mark()
            landings.note(t, done)
            recs.append({"a0": a0, "a1": a1, "busy": busy, "fill_ms": (f1 - f0) * 1000,
                         "settle_ms": (f0 - a0) * 1000, "done": done,
                         "end": time.perf_counter()})
        dev.sync()
    finally:
        landings.close()
    out = _timings(dev, recs, landings.times)
    out["rejects"] = rejects
    return out


def _timings(dev: Device, recs: list[dict[str, Any]], landed: dict[int, float]
             ) -> dict[str, Any]:
    """Medians over the measured steps (after the warm-up)."""
    waits, steps, overlaps = [], [], []
    for t in range(max(WARM, 1), len(recs)):
        r, prev = recs[t], recs[t - 1]
        waits.append((r["a1"] - max(r["a0"], landed[t - 1])) * 1000)
        if dev.cuda:
            steps.append(prev["done"].elapsed_time(r["done"]))
        else:
            steps.append((r["end"] - prev["end"]) * 1000)
        if r["busy"] is not None:
            overlaps.append(bool(r["busy"]))
    measured = recs[max(WARM, 1):]
    return {
        "steps": len(measured),
        "wait_ms": _med(waits), "wait_p90_ms": _pct(waits, 0.9),
        "fill_ms": _med(r["fill_ms"] for r in measured),
        "settle_ms": _med(r["settle_ms"] for r in measured),
        "apply_ms": _med((r["a1"] - r["a0"]) * 1000 for r in measured),
        "overlap": round(sum(overlaps) / len(overlaps), 3) if overlaps else None,
        "step_ms": _med(steps),
    }


def _med(values: Any) -> float:
    v = list(values)
    return round(statistics.median(v), 3) if v else float("nan")


def _pct(values: list[float], q: float) -> float:
    return round(float(np.quantile(values, q)), 3) if values else float("nan")


# ---------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--batch-sizes", default="1,64,256,512")
    ap.add_argument("--forwards", default="3,10,30", help="forward times, ms")
    ap.add_argument("--steps", type=int, default=20,
                    help="measured steps per cell (fewer from 20 ms forwards)")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="cells start only within this time; the rest are listed as skipped")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    started = time.perf_counter()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    forwards = [float(f) for f in args.forwards.split(",")]
    dev = Device(args.device)
    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, timeout_s=60)
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    grammar = compiler.compile(spec)
    raw = Compiler(vocab, backend="xgrammar", timeout_s=60, tune_fill=False)
    xgr_grammar = raw.compile(spec.with_backend("xgrammar")).backend_grammar._compiled
    if dev.cuda:
        warm_device_apply(dev.device, vocab.vocab_size)
    RawReference.of(grammar, vocab)  # the raw vocabulary built before any cell
    setup_s = time.perf_counter() - started
    print(f"device {dev.device} ({torch.cuda.get_device_name(dev.device) if dev.cuda else 'cpu'})"
          f", grammask serves {grammar.backend}, setup {setup_s:.1f} s", file=sys.stderr)
    cells: list[dict[str, Any]] = []
    skipped: list[str] = []
    errors: list[str] = []
    pool = ThreadPoolExecutor(vllm_workers(), thread_name_prefix="vllm-fill")
    try:
        for batch in batches:
            if errors and dev.cuda:
                break
            for ms in forwards:
                if time.perf_counter() - started > args.budget_s:
                    skipped.append(f"B={batch} F={ms:g}")
                    continue
                steps = args.steps if ms < 20 else max(4, args.steps * 3 // 5)
                try:
                    ours = run_grammask(dev, compiler, spec, grammar, vocab, batch, ms, steps)
                    theirs = run_vllm(dev, xgr_grammar, vocab, batch, ms, steps, pool)
                except Exception as exc:  # kept in the JSON; a CUDA error ends the run
                    log.exception("cell B=%d F=%g failed", batch, ms)
                    errors.append(f"B={batch} F={ms:g}: {type(exc).__name__}: {exc}")
                    if dev.cuda:
                        break
                    continue
                cell = {"B": batch, "F_ms": ms, **ours,
                        "vllm": theirs,
                        "ratio": round(ours["step_ms"] / theirs["step_ms"], 3)}
                cells.append(cell)
                print(f"B={batch} F={ms:g}: wait {ours['wait_ms']} ms, fill {ours['fill_ms']}"
                      f" ms, step {ours['step_ms']} vs {theirs['step_ms']} ms",
                      file=sys.stderr)
    finally:
        pool.shutdown(wait=True)
    words = bitmask_words(vocab.vocab_size)
    headers = ["B", "F ms", "steps", "wait ms", "fill ms", "apply ms", "overlap",
               "bytes/step", "reads w/o", "step ms", "vLLM step", "vLLM fill", "ratio",
               "bad"]
    table = [[c["B"], f"{c['F_ms']:g}", c["steps"], c["wait_ms"], c["fill_ms"], c["apply_ms"],
              "-" if c["overlap"] is None else f"{100 * c['overlap']:.0f}%",
              c["bytes_per_step"], f"{c['reads']['watched']}/{c['reads']['ordered']}",
              c["step_ms"], c["vllm"]["step_ms"], c["vllm"]["fill_ms"], c["ratio"],
              c["watch_mismatches"] + c["invalid_rows"] + c["failed"]
              + c["bad_prompt_logprob_ids"] + c["free_row_touched"]] for c in cells]
    print(render_table(headers, table))
    if skipped:
        print("skipped (budget):", ", ".join(skipped))
    if errors:
        print("errors:", *errors, sep="\n  ")
    valid = not errors and all(
        c["watch_mismatches"] == 0 and c["invalid_rows"] == 0 and c["failed"] == 0
        and c["bad_prompt_logprob_ids"] == 0 and c["free_row_touched"] == 0 for c in cells)
    flat = {}
    for batch in {c["B"] for c in cells}:
        waits = [c["wait_ms"] for c in cells if c["B"] == batch]
        flat[batch] = round(max(waits) - min(waits), 3)
    proved = {
        "masks_and_reads_exact": valid,
        "ordered_reads": sum(c["reads"]["ordered"] for c in cells),
        "padded_contexts_and_prompt_logprob_reader_safe": all(
            c["bad_prompt_logprob_ids"] == 0 and c["failed"] == 0 for c in cells),
        "vllm_rejects": sum(c["vllm"]["rejects"] for c in cells),
        "wait_within_fill_plus_0.2ms": all(c["wait_ms"] <= c["fill_ms"] + 0.2 for c in cells),
        "wait_spread_across_forwards_ms": flat,
        "bytes_follow_rows": all(c["bytes_per_step"] == c["B"] * words * 4 for c in cells)
        if dev.cuda else None,
        "fill_overlapped_share_min": min((c["overlap"] for c in cells
                                          if c["overlap"] is not None), default=None),
        "worst_ratio_to_vllm": max((c["ratio"] for c in cells), default=None),
    }
    result = {"benchmark": "v2_gpu_check", "device": str(dev.device),
              "device_name": torch.cuda.get_device_name(dev.device) if dev.cuda else "cpu",
              "torch": torch.__version__, "backend": grammar.backend,
              "vocab_size": vocab.vocab_size, "cycles_per_ms": round(dev.cycles_per_ms),
              "cells": cells, "skipped": skipped, "errors": errors, "proved": proved,
              "wall_s": round(time.perf_counter() - started, 1)}
    print(proved)
    if args.json:
        write_json(args.json, result)
    return 0 if valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
