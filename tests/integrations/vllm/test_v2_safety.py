"""The V2 plugin as vLLM 0.34 runs it on a GPU, read adversarially (issue 50): padded
CUDA-graph batches, vLLM's own reader of the token history between ``apply`` and
``post_update``, the dummy and warm-up sampler runs, a fault at every stage of the path, and
random configurations of all of it. Contexts are built the way vLLM builds them, with its
own host code (``tests/v34_driver.py``: ``decode_cudagraph_capture_grid``,
``InputBatch.make_dummy``, ``_iter_request_chunks``); docs/vllm.md's contract table names
which of its rows each test covers.

Runs with vLLM 0.34's Python first on the path (``make unit34``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from ...vllm_fixtures import (  # first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
    TINY_VOCAB,
    VOCAB,
    cpu_v2,  # noqa: F401 - an autouse fixture: the CPU stand-ins for this module
    spec_config,
    v34_missing,
    vllm_config,
)

# isort: split
if why := v34_missing():
    pytest.skip(why, allow_module_level=True)

from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rsm

from grammask import metrics
from grammask.integrations.vllm import faults

from ...v34_driver import Driver


def _run(d: Driver, steps: int, *, admit_every: int = 2, live: int = 6, free: float = 0.0,
         preempt_at: tuple[int, ...] = (), between: Callable[[int], None] | None = None
         ) -> None:
    for t in range(steps):
        if between is not None:
            between(t)
        if t in preempt_at:
            d.preempt(2)
            d.resume()
        running = sum(not r.finished for r in d.reqs.values())
        d.step(admit=max(0, live - running) if t % admit_every == 0 else 0, free=free)
    d.sync()
    assert not d.device.errors, d.device.errors


def _row_errors() -> float:
    """``grammask_row_errors_total`` over every cause (0 without prometheus_client)."""
    return sum(v for k, v in metrics.snapshot().items()
               if k.startswith("grammask_row_errors_total"))


@pytest.mark.parametrize("dp", [False, True], ids=["full-graph", "dp-padded"])
def test_padded_decode_batches_mask_as_unpadded(dp: bool) -> None:
    """A uniform decode batch under a FULL CUDA graph: ``seq_lens_upper_bound_np`` has the
    graph's size (vLLM's ``decode_cudagraph_capture_grid``: 7 requests run the graph of 8),
    padded with zeros, ``idx_mapping_np`` one entry per request; data parallelism pads to a
    peer's larger count. Batches of 7 to 13: no apply raises, every mask is the raw
    backend's, the same as the unpadded run's. (Today's main raised on every padded apply.)"""
    results = []
    for pad in (False, True):
        d = Driver(vllm_config(max_num_seqs=16, tiny=True), max_reqs=16, pad=pad,
                   dp_pad=dp and pad, seed=5)
        try:
            _run(d, 50, live=13, admit_every=5)
            c = d.counts
            assert c.raised == 0
            assert c.wrong == 0 and c.empty == 0, f"{c.wrong} of {c.masks} wrong"
            results.append((c.masks, c.padded))
        finally:
            d.close()
    (unpadded_masks, none), (padded_masks, padded) = results
    assert none == 0 and padded > 15, results
    assert padded_masks == unpadded_masks  # the same steps, the same rows checked


@pytest.mark.parametrize("reuse", [False, True], ids=["mixed", "same-schema-reuse"])
def test_prompt_logprob_reader_sees_only_vocab_ids(reuse: bool) -> None:
    """A request of the batch asks for prompt logprobs: between the processors and
    ``post_update`` vLLM's token-id kernel reads ``all_token_ids[slot, num_computed + 1 +
    i]`` for every row, position ``total_len`` for a decode row, where the token watch marks.
    Every id it reads is in ``[0, vocab_size)``, recycled slots included, and the watch
    still reads its tokens as they land (the overlap kept). Today's main wrote -1 there."""
    d = Driver(vllm_config(max_num_seqs=8, tiny=True), max_reqs=8, prompt_logprobs=True,
               seed=9)
    if reuse:  # one schema for every request: a recycled slot held the same JSON
        d.rng = _OneConstraint(9)
    try:
        _run(d, 60, free=0.3)
        c = d.counts
        assert c.reads > 300 and c.bad_reads == 0, (c.reads, c.bad_reads)
        assert c.wrong == 0 and c.touched == 0
        assert c.finished > 10
        reads = d.batch.watch.reads
        assert reads["watched"] > 20 and reads["ordered"] == 0, reads
        assert d.batch.mark is not None and d.batch.mark >= len(d.vocab.tokens)  # padding
    finally:
        d.close()


class _OneConstraint(random.Random):
    """The driver's random source, with every request given constraint 0."""

    def randrange(self, *args: Any, **kwargs: Any) -> int:  # type: ignore[override]
        if args == (4,):  # len(CONSTRAINTS): the constraint draw
            return 0
        return super().randrange(*args, **kwargs)


def test_marks_off_reads_are_ordered() -> None:
    """``token_marks=false``: grammask writes nothing into vLLM's token history; every
    step's tokens are read after the stream passed them (ordered), masks stay right."""
    config = vllm_config(max_num_seqs=8, tiny=True,
                         additional_config={"grammask": {"token_marks": False}})
    d = Driver(config, max_reqs=8, prompt_logprobs=True, seed=4)
    written: list[int] = []
    mark = d.batch.reader.mark
    d.batch.reader.mark = lambda *a: (written.append(1), mark(*a))  # type: ignore
    try:
        _run(d, 30)
        c = d.counts
        assert c.wrong == 0 and c.bad_reads == 0 and c.masks > 60
        assert not written and d.batch.mark is None
        reads = d.batch.watch.reads
        assert reads["ordered"] > 10 and reads["watched"] == 0, reads
    finally:
        d.close()


def test_dummy_and_warmup_runs() -> None:
    """``_dummy_sampler_run`` at start-up (and on an elastic-EP re-warm): an apply over
    ``InputBatch.make_dummy``'s layout, warm-up parameters added to slots 0..n-1 with staged
    writes, another apply. Nothing raises, nothing is masked, and the requests that take
    those slots next are masked right. The re-warm comes once the batch drained (its warm-up
    parameters replace whatever a slot held, in vLLM's own states too), while grammask
    still tracks the finished requests' slots (V2 has no removal hook)."""
    d = Driver(vllm_config(max_num_seqs=8, tiny=True), max_reqs=8, seed=2)
    try:
        logits = d.dummy_run(8)
        assert bool(logits.isfinite().all())
        _run(d, 20)
        for _ in range(60):  # drain: no admissions until every request finished
            if all(r.finished for r in d.reqs.values()):
                break
            d.step()
        d.sync()
        assert not d.reqs and d.batch._tracked.any()
        logits = d.dummy_run(8)
        assert bool(logits.isfinite().all())
        _run(d, 20)
        c = d.counts
        assert c.wrong == 0 and c.raised == 0 and c.masks > 60
    finally:
        d.close()


#: Each stage of a constrained request's path, and the function a fault is injected into.
#: A stage whose function is renamed fails here loudly (getattr), and keeps its test id.
STAGES: dict[str, tuple[str, str]] = {
    "add_request": ("grammask.integrations.vllm.v2:V2Batch", "_add"),
    "staged_writes": ("grammask.integrations.vllm.v2:V2Batch", "_stage"),
    "arrival": ("grammask.integrations.vllm.plugin_core:PluginCore", "arrival"),
    "first_mask": ("grammask.decode.firstmask:FirstMasks", "attach_all"),
    "fill": ("grammask.decode.stepjob:StepJobs", "_run"),
    "apply": ("grammask.decode.step_apply:StepApply", "into_logits"),
    "mark": ("grammask.integrations.vllm.v2_device:TokenReader", "mark"),
    "token_read": ("grammask.integrations.vllm.v2_device:TokenReader", "read"),
    "commit": ("grammask.decode.processor:BatchProcessor", "step"),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_faults_at_every_stage_end_only_our_rows(stage: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault of grammask's at ``stage``, from step 8 on: no apply raises (vLLM's step
    completes), grammask's rows end with stop-only masks (never a row without a finite
    logit), the row-error counter counts them, and every unconstrained row's logits are
    bit-identical to what vLLM handed the processors."""
    import importlib

    module, attr = STAGES[stage]
    path, cls_name = module.split(":")
    owner = getattr(importlib.import_module(path), cls_name)
    original = getattr(owner, attr)
    armed = {"on": False, "hits": 0}

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if armed["on"]:
            armed["hits"] += 1
            raise RuntimeError(f"injected fault in {stage}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, faulty)
    faults.reset()
    errors_before = _row_errors()
    d = Driver(vllm_config(max_num_seqs=8, tiny=True), max_reqs=8, seed=21)
    try:
        _run(d, 40, free=0.4, admit_every=1,
             between=lambda t: armed.update(on=t >= 8))
        c = d.counts
        assert armed["hits"] > 0, f"the fault at {stage} was never reached"
        assert c.raised == 0
        assert c.touched == 0 and c.free_rows > 30, (c.touched, c.free_rows)
        assert c.empty == 0
        assert c.wrong == 0, f"{c.wrong} of {c.masks} masks wrong"
        assert c.stop_only > 0, "no row of grammask's ended"
        assert _row_errors() > errors_before
    finally:
        armed["on"] = False
        d.close()


def test_random_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configurations drawn from a fixed seed: slots across the capture grid up to 1,024,
    drafts 0-4, verification chunks 1-3, preemption, prompt logprobs, FULL-graph and
    data-parallel padding, slot reuse; the tiny vocabulary (1,024 rows of Qwen's are 620 MB
    of logits). For each: no apply raises, every mask is the raw backend's, no reader sees
    an id outside the vocabulary. At most ``EXAMPLES`` configurations or ``BUDGET_S``."""
    examples, budget_s = 24, 90.0
    rng = random.Random(50)
    started = time.monotonic()
    seen: list[dict[str, Any]] = []
    for i in range(examples):
        if time.monotonic() - started > budget_s and len(seen) >= 3:
            break
        slots = rng.choice([8, 16, 48, 128, 352, 1024])
        num_spec = rng.randrange(5)
        chunks = rng.randrange(1, 4)
        case: dict[str, Any] = {"slots": slots, "drafts": num_spec, "chunks": chunks,
                "preempt": rng.random() < 0.5, "prompt_logprobs": rng.random() < 0.6,
                "pad": rng.random() < 0.7, "dp": rng.random() < 0.3}
        live = min(slots, rng.choice([6, 13, 40]))
        admit_every = rng.choice([1, 3, 6])
        config = (spec_config(max_reqs=slots, num_spec=num_spec, tiny=True) if num_spec
                  else vllm_config(max_num_seqs=slots, tiny=True))
        chunk_logits = None
        if chunks > 1:
            rows = -(-live * (1 + num_spec) // chunks)
            with monkeypatch.context() as m:
                m.setattr(rsm, "MAX_CHUNK_BYTES", rows * TINY_VOCAB * 4)
                chunk_logits = int(rsm.get_max_chunk_logits(TINY_VOCAB))
        d = Driver(config, max_reqs=slots, num_spec=num_spec, chunk_logits=chunk_logits,
                   pad=case["pad"], dp_pad=case["dp"], prompt_logprobs=case["prompt_logprobs"],
                   seed=i, forward_s=0.0005)
        try:
            _run(d, 24, live=live, admit_every=admit_every, free=0.2,
                 preempt_at=(9, 17) if case["preempt"] else ())
            c = d.counts
            case.update(masks=c.masks, padded=c.padded, reads=c.reads,
                        watched=d.batch.watch.reads["watched"],
                        ordered=d.batch.watch.reads["ordered"],
                        collisions=d.batch.watch.collisions)
            seen.append(case)
            assert c.raised == 0, case
            assert c.wrong == 0 and c.empty == 0 and c.touched == 0, (case, c)
            assert c.stop_only == 0, (case, c)  # no row ended by a fault of grammask's
            assert c.bad_reads == 0, case
        finally:
            d.close()
    print("\nconfigurations:", *seen, sep="\n  ")
    assert len(seen) >= 3
    assert VOCAB > TINY_VOCAB


def test_stop_only_masks_under_min_tokens_keep_a_stop() -> None:
    """The emergency stop-only mask on a row whose stops vLLM already forbade
    (``min_tokens``: its logit-bias stage sets them to -inf before the processors run):
    the stops come back at logit 0, so the row samples a stop (vLLM ignores it until
    ``min_tokens``, then the request finishes "stop"; with ``ignore_eos``, at
    ``max_tokens``, "length") and never an arbitrary token from an all -inf row."""
    import torch

    from grammask.kernels.apply import stop_only

    logits = torch.randn(3, 16)
    logits[1, [3, 5]] = float("-inf")  # row 1: under min_tokens
    before = logits.clone()
    stop_only(logits, [0, 1], [3, 5])
    assert torch.equal(torch.isfinite(logits[0]), torch.isin(torch.arange(16),
                                                              torch.tensor([3, 5])))
    assert torch.equal(logits[0, [3, 5]], before[0, [3, 5]])
    assert logits[1, 3] == 0 and logits[1, 5] == 0
    assert int(torch.isfinite(logits[1]).sum()) == 2
    assert torch.equal(logits[2], before[2])


def test_the_mark_is_a_token_no_constrained_row_samples() -> None:
    """The watch's mark: a padding id where the model pads its vocabulary; else a reserved
    special token; never a stop, a reasoning or a tool-call marker (a structural tag or
    thinking-budget forcing emits those, and each equal commit costs an ordered read)."""
    from grammask.integrations.vllm.v2_device import unsampleable_id
    from grammask.vocab import Vocabulary

    def vocab(*special: bytes) -> Vocabulary:
        tokens = [bytes([b]) for b in range(97, 123)] + list(special)
        n = len(tokens)
        return Vocabulary(tokens, special_ids=range(26, n), stop_ids=[26])

    padded = vocab(b"<|eot|>", b"<think>")
    assert unsampleable_id(padded, 40) == 39
    exact = vocab(b"<|eot|>", b"<|reserved_special_token_0|>", b"<tool_call>", b"</think>")
    assert unsampleable_id(exact, 30) == 27  # reserved, not the later markers
    markers = vocab(b"<|eot|>", b"<|im_start|>", b"<tool_call>", b"</think>")
    assert unsampleable_id(markers, 30) == 27  # <|im_start|>: no marker


def test_configurations_that_commit_unmasked_samples_stand_aside() -> None:
    """0.34 configurations where tokens the processor never masked get committed: batch-
    sharded sampling under tensor parallelism (each rank's processor sees only its share,
    every rank commits every slot) and synthetic acceptance of drafts. grammask stands
    aside on them (both processes decide from the config), and not on the defaults."""
    from types import SimpleNamespace as NS

    from grammask.integrations.vllm.compat import unserved

    def config(sharded: bool = False, tp: int = 1, method: str = "standard") -> Any:
        return NS(parallel_config=NS(enable_batch_sharded_sampling=sharded,
                                     tensor_parallel_size=tp),
                  speculative_config=NS(rejection_sample_method=method),
                  scheduler_config=NS(async_scheduling=True),
                  model_config=NS(logits_processors=None))

    assert unserved(config(), "v2") == ""
    assert unserved(config(sharded=True, tp=1), "v2") == ""  # ignored at TP=1
    assert "batch-sharded" in unserved(config(sharded=True, tp=2), "v2")
    assert "synthetic" in unserved(config(method="synthetic"), "v2")
    assert "batch-sharded" in unserved(config(sharded=True, tp=2))  # the API server's


@pytest.mark.parametrize("drafts", [0, 2], ids=["plain", "drafts"])
def test_the_decode_core_holds_no_callable_of_the_plugin(drafts: int) -> None:
    """Issue 53: on a live V2 batch (requests added, parsed on the parse thread, stepped,
    finished; drafts too), nothing below ``integrations/`` (the processor with everything
    it holds, the compiler) holds a bound method, partial, lambda or closure of the plugin's
    objects: the processor takes the plugin's parse through ``RequestReader`` and returns
    what happened. The walk finds one where one is planted."""
    import functools

    from ...layering import upward_callables

    config = (spec_config(max_reqs=8, num_spec=drafts, tiny=True) if drafts
              else vllm_config(max_num_seqs=8, tiny=True))
    d = Driver(config, max_reqs=8, num_spec=drafts, seed=9)
    found: list[str] = []

    def walk(_: int) -> None:  # between steps: adds queued, fills in flight, rows made
        proc = d.plugin.core.proc_or_none
        if proc is not None:
            found.extend(upward_callables(proc))

    try:
        _run(d, 10, admit_every=1, between=walk)
        core = d.plugin.core
        proc = core.proc_or_none
        assert proc is not None and core.compiler is not None
        walk(0)
        assert found == [] and upward_callables(core.compiler) == []
        proc._planted = [functools.partial(d.batch._fail_slot, 0)]  # type: ignore[attr-defined]
        planted = upward_callables(proc)
        assert planted and all(p.startswith("BatchProcessor._planted[0]") for p in planted)
    finally:
        d.close()
