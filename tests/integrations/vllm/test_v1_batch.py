"""The plugin on vLLM's V1 model runner, driven through vLLM's own classes on CPU.

Real: ``build_logitsprocs`` (installed entry point and ``--logits-processors`` FQCN), the
runner's ``InputBatch`` (add_request, remove_request, condense, swap_states,
refresh_metadata, the async-scheduling placeholder repair), ``GPUModelRunner._sample`` (on a
stand-in runner holding the batch, the sampler's processor stage and the runner's
``discard_request_mask``) and ``Sampler.apply_logits_processors``. Not run: the model
forward and the final sampling step (the CPU wheel has no ``vllm._C`` sampling kernels);
tokens are picked by the test from the allowed set, as a sampler would. The discard mask is
computed as ``_prepare_inputs`` computes it (an inline expression there, no function to
call): tokens computed plus tokens scheduled below the request's token count.
"""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

# first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from ...vllm_fixtures import (
    CONSTRAINTS,
    END_THINK,
    FQCN,
    IM_END,
    IM_START,
    SCHEMA,
    THINK,
    VOCAB,
    allowed,
    ref_allowed,
    vllm_config,
    xargs,
)

# isort: split
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from grammask import Compiler, GrammarSpec, Vocabulary, metrics
from grammask.decode.processor import BatchProcessor
from grammask.integrations.vllm import faults, v1_batch
from grammask.integrations.vllm.plugin import GrammaskLogitsProcessor
from grammask.integrations.vllm.plugin_core import PluginCore

from ...helpers import RawReference


class _Ready:
    """Stands in for the CUDA event of the runner's device-to-host copy (already done)."""

    def synchronize(self) -> None:
        pass


def ours(lps: Any) -> list[GrammaskLogitsProcessor]:
    return [p for p in lps.all if isinstance(p, GrammaskLogitsProcessor)]


class Runner:
    """The V1 runner's batch bookkeeping around a real ``InputBatch`` (no forward)."""

    def __init__(self, config: Any, *, use_async: bool = False) -> None:
        self.config = config
        self.lps = build_logitsprocs(config, torch.device("cpu"), False, False,
                                     tuple(config.model_config.logits_processors or ()))
        self.batch = InputBatch(
            max_num_reqs=config.scheduler_config.max_num_seqs, max_model_len=256,
            max_num_batched_tokens=256, device=torch.device("cpu"), vocab_size=VOCAB,
            block_sizes=[16], max_num_blocks_per_req=[16], logitsprocs=self.lps,
            logitsprocs_need_output_token_ids=bool(config.model_config.logits_processors))
        self.use_async = use_async
        self.states: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.computed: dict[str, int] = {}  # the scheduler's num_computed_tokens
        self.discarded: set[str] = set()  # requests whose last sample vLLM dropped

    @property
    def plugin(self) -> GrammaskLogitsProcessor:
        active = [p for p in ours(self.lps) if p.core.active]
        assert len(active) == 1
        return active[0]

    def add(self, rid: str, extra_args: dict[str, Any] | None, prompt: list[int],
            output: list[int] | None = None) -> None:
        state = CachedRequestState(
            req_id=rid, prompt_token_ids=prompt, mm_features=[],
            sampling_params=SamplingParams(max_tokens=64, extra_args=extra_args or None),
            generator=None, block_ids=([0],), num_computed_tokens=0,
            output_token_ids=[] if output is None else output)
        self.states[rid] = state
        self.computed[rid] = 0
        self.batch.add_request(state)

    def remove(self, rid: str) -> None:
        self.batch.remove_request(rid)
        del self.states[rid]
        del self.computed[rid]

    def schedule(self, swap: tuple[int, int] | None = None) -> None:
        """``_update_states``: condense, optional reorder, ``refresh_metadata``."""
        self.batch.condense()
        if swap is not None:
            self.batch.swap_states(*swap)
        self.batch.refresh_metadata()

    def logits(self, base: torch.Tensor | None = None,
               chunks: dict[str, int] | None = None) -> torch.Tensor:
        """One step's sampling: ``_prepare_inputs``' discard mask (``chunks``: tokens
        scheduled for a request this step, else all it has left), then vLLM's ``_sample``
        (async placeholders resolved, the sampler's processor stage)."""
        ids = self.batch.req_ids
        n = self.batch.num_reqs
        total = np.array([self.states[rid].num_tokens for rid in ids])
        done = np.array([self.computed[rid] for rid in ids])
        scheduled = np.array([(chunks or {}).get(rid, max(int(t - c), 0))
                              for rid, t, c in zip(ids, total, done, strict=True)])
        mask = done + scheduled < total  # gpu_model_runner.py, _prepare_inputs
        self.discarded = {rid for rid, dropped in zip(ids, mask, strict=True) if dropped}
        for rid, s in zip(ids, scheduled, strict=True):
            self.computed[rid] += int(s)
        logits = torch.zeros(n, VOCAB) if base is None else base.clone()
        stage = SimpleNamespace(
            input_batch=self.batch, discard_request_mask=SimpleNamespace(np=mask),
            sampler=lambda logits, sampling_metadata: self.sampler.apply_logits_processors(
                logits, sampling_metadata, predict_bonus_token=False))
        out: Any = GPUModelRunner._sample(stage, logits, None)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)  # the stand-in sampler's: the masked logits
        return out

    def commit(self, tokens: dict[str, int]) -> None:
        """``_bookkeeping_sync``: real ids, or ``-1`` placeholders under async scheduling,
        for the requests whose sample was kept."""
        ids = self.batch.req_ids
        kept = [rid for rid in ids if rid in tokens and rid not in self.discarded]
        for rid in kept:
            self.states[rid].output_token_ids.append(-1 if self.use_async else tokens[rid])
        if self.use_async:
            self.batch.prev_req_id_to_index = {rid: i for i, rid in enumerate(ids)
                                               if rid in kept}
            sampled = torch.tensor([[tokens.get(rid, 0)] for rid in ids], dtype=torch.int64)
            self.batch.set_async_sampled_token_ids(sampled, _Ready())

    def close(self) -> None:
        for p in ours(self.lps):
            p.close()


def chat_prompt(vocab: Vocabulary, user: str, *, closed_thinking: bool = False) -> list[int]:
    ids = [IM_START, *vocab.encode(f"user\n{user}"), IM_END, *vocab.encode("\n"), IM_START,
           *vocab.encode("assistant\n")]
    if closed_thinking:  # what Qwen3's template writes with enable_thinking=False
        ids += [THINK, *vocab.encode("\n\n"), END_THINK, *vocab.encode("\n\n")]
    return ids


@pytest.fixture(scope="module")
def runner() -> Any:
    made: list[Runner] = []

    def make(*, use_async: bool = False, fqcn: bool = False, **config: Any) -> Runner:
        r = Runner(vllm_config(logits_processors=[FQCN] if fqcn else None, **config),
                   use_async=use_async)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="module")
def compiler(runner: Any) -> Compiler:
    compiler = runner().plugin.core.compiler
    assert compiler is not None
    return compiler


@pytest.fixture(scope="module")
def vocab(compiler: Compiler) -> Vocabulary:
    return compiler.vocab


def test_entry_point_alone_masks_a_request_and_leaves_others_alone(
        runner: Any, compiler: Compiler, vocab: Vocabulary) -> None:
    r = runner()
    assert len(ours(r.lps)) == 1  # found through the installed entry point only
    assert r.plugin in r.lps.non_argmax_invariant and not r.plugin.is_argmax_invariant()
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    r.add("plain", None, chat_prompt(vocab, "hi"))
    r.add("json", xargs({"json": SCHEMA, "disable_any_whitespace": True}, thinking="off"),
          chat_prompt(vocab, "a json please"))
    ref = RawReference.of(compiler.compile(spec), compiler.vocab)
    noise = torch.randn(2, VOCAB)
    for tid in [*vocab.encode('{"n":12,"ok":true}'), IM_END]:
        r.schedule()
        logits = r.logits(noise)
        assert torch.equal(logits[0], noise[0])  # the unconstrained row, bit for bit
        assert torch.equal(allowed(logits[1]), ref_allowed(ref))
        assert ref.accept(tid)
        r.commit({"plain": 9, "json": tid})
    r.schedule()
    assert sorted(allowed(r.logits()[1]).nonzero().flatten().tolist()) == sorted(
        vocab.stop_ids)  # after the grammar ended only stop tokens
    assert r.plugin.core.processor().errors == {}


def test_start_up_log_names_version_and_settings(runner: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    import grammask

    with caplog.at_level(logging.INFO, logger="grammask"):
        runner(additional_config={"grammask": {"wait_s": 7}})
    line = next(m for m in caplog.messages if "loaded on vLLM" in m)
    assert f"grammask {grammask.__version__}" in line and "V1" in line
    assert "wait_s=7.0" in line and "backend=auto" in line and "enabled=True" in line


def test_listed_twice_only_one_instance_acts(runner: Any, compiler: Compiler) -> None:
    r = runner(fqcn=True)
    both = ours(r.lps)
    assert len(both) == 2 and [p.core.active for p in both] == [False, True]
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    r.schedule()
    logits = torch.zeros(1, VOCAB)
    assert both[0].apply(logits) is logits and allowed(logits[0]).all()  # inert: untouched
    assert both[0].core.proc_or_none is None  # and it never built a processor
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    assert torch.equal(allowed(r.logits()[0]), ref_allowed(ref))


def test_batch_changes_follow_rows(runner: Any, compiler: Compiler, vocab: Vocabulary) -> None:
    """remove + condense moves a row, an add reuses a freed row, swap exchanges two rows."""
    r = runner()
    regex, choice = CONSTRAINTS[2], CONSTRAINTS[3]
    r.add("r0", xargs(regex[0], thinking="off"), [1])
    r.add("r1", None, [2])
    r.add("r2", xargs(choice[0], thinking="off"), [3])
    r.schedule()
    ref_regex = RawReference.of(compiler.compile(regex[1]), compiler.vocab)
    ref_choice = RawReference.of(compiler.compile(choice[1]), compiler.vocab)

    def check(expected: dict[str, RawReference | None]) -> None:
        logits = r.logits()
        for row, rid in enumerate(r.batch.req_ids):
            ref = expected[rid]
            want = torch.ones(VOCAB, dtype=torch.bool) if ref is None else ref_allowed(ref)
            assert torch.equal(allowed(logits[row]), want), (rid, row)

    check({"r0": ref_regex, "r1": None, "r2": ref_choice})
    r.remove("r1")
    r.schedule()  # condense: r2 moves from row 2 to row 1
    assert r.batch.req_ids == ["r0", "r2"]
    check({"r0": ref_regex, "r2": ref_choice})
    r.remove("r0")
    r.add("r3", None, [4])  # takes the freed row 0, which held a constrained request
    r.schedule(swap=(0, 1))
    assert r.batch.req_ids == ["r2", "r3"]
    check({"r2": ref_choice, "r3": None})


def test_resumed_request_replays_its_output(runner: Any, compiler: Compiler,
                                            vocab: Vocabulary) -> None:
    r = runner()
    text = vocab.encode('{"n":4')
    r.add("again", xargs(CONSTRAINTS[0][0], thinking="off"), [1, 2], output=list(text))
    r.schedule()
    ref = RawReference.of(compiler.compile(CONSTRAINTS[0][1]), compiler.vocab)
    assert all(ref.accept(t) for t in text)
    assert torch.equal(allowed(r.logits()[0]), ref_allowed(ref))


def test_async_placeholders_are_never_fed(runner: Any, compiler: Compiler,
                                          vocab: Vocabulary) -> None:
    r = runner(fqcn=True, use_async=True)
    spec_args, spec = CONSTRAINTS[0]
    r.add("a", xargs(spec_args, thinking="off"), [1])
    ref = RawReference.of(compiler.compile(spec), compiler.vocab)
    for tid in vocab.encode('{"n":7,"ok":false}'):
        r.schedule()  # update_state sees the trailing -1 of the previous step
        assert -1 not in r.states["a"].output_token_ids[:-1]
        logits = r.logits()  # the placeholder is resolved just before this
        assert -1 not in r.states["a"].output_token_ids
        assert torch.equal(allowed(logits[0]), ref_allowed(ref))
        assert ref.accept(tid)
        r.commit({"a": tid})
    assert r.plugin.core.processor().errors == {}


def test_async_scheduling_without_the_flag_stands_aside(
        vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The V1 runner with async scheduling and no ``--logits-processors`` (vLLM never
    resolves the placeholders then): vLLM's loader builds the processor (the server starts),
    which stands aside with a log line; the API server decides the same from the config
    (vLLM's own ``InputProcessor``, which picks the V1 validator from the same
    ``use_v2_model_runner``): vLLM's structured outputs stay with vLLM's engine, grammask's
    own keys get a 400 that says why."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.input_processor import InputProcessor

    config = vllm_config()
    config.scheduler_config.async_scheduling = True
    assert not config.use_v2_model_runner
    with caplog.at_level(logging.INFO, logger="grammask"):
        r = Runner(config, use_async=True)
    plugin, = ours(r.lps)
    assert not plugin.core.active and plugin.is_argmax_invariant()
    assert any("grammask stands aside on vLLM's V1 model runner" in m
               and "--logits-processors" in m for m in caplog.messages)
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1])  # reached the engine anyway
    for _ in range(2):
        r.schedule()
        assert allowed(r.logits()[0]).all()  # left as vLLM made it
        r.commit({"a": 7})
    assert plugin.core.proc_or_none is None
    monkeypatch.setattr(SamplingParams, "_validate_structured_outputs",
                        lambda self, *args: None)  # imports every vLLM backend (not here)
    frontend = InputProcessor(config)
    sp = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    frontend._validate_params(sp, ("generate",))
    assert sp.structured_outputs is not None and sp.extra_args is None  # vLLM's engine
    own = SamplingParams(max_tokens=8, extra_args=xargs(CONSTRAINTS[3][0]))
    with pytest.raises(VLLMValidationError, match="stands aside.*--logits-processors"):
        frontend._validate_params(own, ("generate",))
    r.close()


def test_the_device_apply_is_warmed_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on V2: the first constrained step must not compile the apply kernel in the
    sampler (on CPU the warm-up itself does nothing: ``warm_device_apply``)."""
    calls: list[tuple[torch.device, int]] = []

    def warm(device: torch.device, vocab_size: int) -> int:
        calls.append((device, vocab_size))
        return 0

    monkeypatch.setattr(v1_batch, "warm_device_apply", warm)
    Runner(vllm_config()).close()
    assert calls == [(torch.device("cpu"), VOCAB)]


def _fault_count() -> float:
    return metrics.snapshot().get('grammask_row_errors_total{cause="fault"}', 0.0)


@pytest.mark.parametrize("where", ["update_state", "apply", "processor"])
def test_a_fault_in_a_hook_stays_inside(runner: Any, compiler: Compiler, vocab: Vocabulary,
                                        monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture, where: str) -> None:
    """A fault of grammask's in ``update_state`` (the fill's start), in ``apply`` or in the
    processor itself: vLLM's step completes, grammask's rows get stop-only masks and are
    counted, the unconstrained row is bit-identical, the traceback is logged; a request
    after the fault is served by a new processor."""
    faults.reset()
    r = runner()
    r.add("plain", None, chat_prompt(vocab, "hi"))
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    r.add("b", xargs(CONSTRAINTS[2][0], thinking="off"), [3])
    r.schedule()
    first = r.logits()
    r.commit({"plain": 9, "a": int(allowed(first[1]).nonzero()[0]),
              "b": int(allowed(first[2]).nonzero()[0])})
    before = _fault_count()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    target = {"update_state": (BatchProcessor, "step"), "apply": (BatchProcessor, "apply"),
              "processor": (PluginCore, "processor")}[where]
    noise = torch.randn(3, VOCAB)
    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR, logger="grammask"):
        patch.setattr(*target, boom)
        r.schedule()  # update_state: nothing escapes
        logits = r.logits(noise)  # apply: nothing escapes
    assert torch.equal(logits[0], noise[0])
    stops = sorted(vocab.stop_ids)
    for row in (1, 2):
        assert sorted(allowed(logits[row]).nonzero().flatten().tolist()) == stops
        kept = logits[row][stops]
        assert torch.equal(kept, noise[row][stops])  # the stops keep vLLM's logits
    if metrics.snapshot():
        assert _fault_count() == before + 2
    assert any(rec.exc_info and "injected fault" in str(rec.exc_info[1])
               for rec in caplog.records)
    r.commit({"plain": 9, "a": stops[0], "b": stops[0]})
    r.schedule()
    again = r.logits(noise)  # the ended rows stay stop-only until they leave
    assert torch.equal(again[0], noise[0]) and torch.equal(again[1], logits[1])
    r.remove("a")
    r.remove("b")
    r.add("c", xargs(CONSTRAINTS[3][0], thinking="off"), [4])
    r.schedule()
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    served = r.logits()
    assert r.batch.req_ids == ["plain", "c"]
    assert allowed(served[0]).all() and torch.equal(allowed(served[1]), ref_allowed(ref))


def test_a_slow_compile_across_prefill_chunks(runner: Any, compiler: Compiler,
                                              vocab: Vocabulary,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt in three chunks (vLLM drops the samples of the first two), its compile held
    until the last chunk, ``wait_s=0.3``: the dropped chunks' applies do not wait for the
    first mask (the batch does not stall; a wait would end the row as late), the row is not
    errored, and its first kept sample is masked right."""
    import grammask.decode.firstmask as firstmask

    args = {"regex": "(chunk|slow)[0-9]{2}"}
    spec = GrammarSpec.regex("(chunk|slow)[0-9]{2}")
    ref = RawReference.of(compiler.compile(spec), compiler.vocab)  # cached: the hold is all
    release = threading.Event()
    compiles: list[Future[Any]] = []

    def held(spec: GrammarSpec) -> Future[Any]:
        fut: Future[Any] = Future()

        def later() -> None:
            release.wait(60)
            fut.set_result(compiler.compile(spec))

        threading.Thread(target=later, daemon=True).start()
        compiles.append(fut)
        return fut

    monkeypatch.setattr(compiler, "compile_async", held)
    waits: list[int] = []
    real_wait = firstmask.wait_for_change

    def counted_wait(*a: Any, **kw: Any) -> None:
        waits.append(1)
        real_wait(*a, **kw)

    monkeypatch.setattr(firstmask, "wait_for_change", counted_wait)
    r = runner(additional_config={"grammask": {"wait_s": 0.3}})
    r.add("plain", None, [1, 2, 3])
    r.schedule()
    r.logits()
    r.commit({"plain": 9})
    prompt = chat_prompt(vocab, "please write a code for this long prompt, in chunks " * 3)
    chunk = len(prompt) // 3
    r.add("long", xargs(args, thinking="off"), prompt)
    noise = torch.randn(2, VOCAB)
    for _ in range(2):  # chunks whose sample vLLM drops, the compile still held
        r.schedule()
        logits = r.logits(noise, chunks={"long": chunk})
        assert not waits and compiles and not compiles[0].done()  # no first-mask wait
        assert r.discarded == {"long"} and torch.equal(logits[0], noise[0])
        r.commit({"plain": 9, "long": 0})
        assert r.plugin.core.processor().errors == {}
    r.schedule()
    release.set()  # a long last chunk: the compile is done meanwhile
    for fut in compiles:
        fut.result(timeout=60)
    logits = r.logits(noise)  # the last chunk: its sample is kept
    assert not r.discarded
    assert torch.equal(logits[0], noise[0])
    assert torch.equal(allowed(logits[1]), ref_allowed(ref))
    assert r.plugin.core.processor().errors == {}


@pytest.mark.parametrize(("case", "gated"), [
    ("thinking", True), ("request_off", False), ("closed_in_prompt", False),
    ("settings_none", False), ("custom_marker", True)])
def test_thinking_gate(runner: Any, compiler: Compiler, vocab: Vocabulary, case: str,
                       gated: bool) -> None:
    """Unmasked while thinking; masked from the token after the end marker."""
    config: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    closed = case == "closed_in_prompt"
    if case == "request_off":
        flat["thinking"] = "off"
    if case == "settings_none":
        config["additional_config"] = {"grammask": {"think_end": "none"}}
    if case == "custom_marker":
        flat["think_end"] = "DONE:"
    r = runner(**config)
    r.add("t", xargs(CONSTRAINTS[3][0], **flat), chat_prompt(vocab, "pick", closed_thinking=closed))
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    thoughts = (vocab.encode("hmm DONE") + vocab.encode(":") if case == "custom_marker"
                else [*vocab.encode("hmm ok"), END_THINK]) if gated else []
    masked_at = None
    for step, tid in enumerate([*thoughts, *vocab.encode("beta")]):
        r.schedule()
        row = allowed(r.logits()[0])
        if step < len(thoughts) and not row.all():
            # a text marker may only end at a token boundary: while thinking, only tokens
            # that would end it inside themselves are refused (here ":" plus more bytes)
            refused = (~row).nonzero().flatten().tolist()
            assert case == "custom_marker" and row[tid]
            assert all(vocab.tokens[t].startswith(b":") and len(vocab.tokens[t]) > 1
                       for t in refused), [vocab.tokens[t] for t in refused[:5]]
        elif row.all():
            assert masked_at is None, "masked once, masked for good"
        else:
            masked_at = masked_at if masked_at is not None else step
            assert torch.equal(row, ref_allowed(ref))
            assert ref.accept(tid)
        r.commit({"t": tid})
    assert masked_at == len(thoughts)


def test_a_bad_request_past_validation_only_stops_its_own_row(
        runner: Any, compiler: Compiler, vocab: Vocabulary) -> None:
    r = runner()
    r.add("bad", {"grammask": "{not json"}, [1])
    r.add("good", xargs(CONSTRAINTS[3][0], thinking="off"), [1])
    r.schedule()
    logits = r.logits()
    assert sorted(allowed(logits[0]).nonzero().flatten().tolist()) == sorted(vocab.stop_ids)
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    assert torch.equal(allowed(logits[1]), ref_allowed(ref))
    proc = r.plugin.core.processor()
    assert proc.status(0) == "error" and proc.status(1) == "active"


def test_disabled_plugin_is_inert(runner: Any) -> None:
    r = runner(additional_config={"grammask": {"enabled": False}})
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1])
    r.schedule()
    assert allowed(r.logits()[0]).all()
    assert all(not p.core.active for p in ours(r.lps))


@pytest.mark.parametrize("parallel_min", [2, 64], ids=["batch-fill", "row-fill"])
def test_masks_under_the_runners_inference_mode(runner: Any, compiler: Compiler, vocab: Vocabulary,
                                                parallel_min: int) -> None:
    """vLLM's ``execute_model`` runs under ``torch.inference_mode()``: the processor (and its
    buffers) is first built there, while the fill thread runs outside it. Every fill path
    (xgrammar, llguidance's first-mask copy and its own fill, the batch fills, stop rows of
    an errored request) must still write its masks (a real server once served most requests
    empty: "Inplace update to inference tensor outside InferenceMode")."""
    r = runner(max_num_seqs=12, additional_config={"grammask": {"parallel_min": parallel_min}})
    rows = [*CONSTRAINTS, *CONSTRAINTS]  # two rows of each backend: batch fills from 2 rows
    refs = [RawReference.of(compiler.compile(spec), compiler.vocab) for _, spec in rows]
    with torch.inference_mode():
        for i, (args, _) in enumerate(rows):
            r.add(f"r{i}", xargs(args, thinking="off"), [1, 2])
        r.add("bad", {"grammask": "{not json"}, [1])
        for _ in range(3):
            r.schedule()
            logits = r.logits(torch.randn(len(rows) + 1, VOCAB))
            assert logits.is_inference()
            for i, ref in enumerate(refs):
                assert torch.equal(allowed(logits[i]), ref_allowed(ref)), (i, rows[i][1])
            assert sorted(allowed(logits[len(rows)]).nonzero().flatten().tolist()) == sorted(
                vocab.stop_ids)
            tokens = {"bad": vocab.stop_ids[0]}
            for i, ref in enumerate(refs):
                tid = int(allowed(logits[i]).nonzero()[0])
                assert ref.accept(tid)
                tokens[f"r{i}"] = tid
            r.commit(tokens)
    proc = r.plugin.core.processor()
    assert set(proc.errors) == {len(rows)}, proc.errors  # only the bad row failed


# ------------------------------------------------------------------------ churn
@dataclass
class _Req:
    rid: str
    constraint: int | None  # index into CONSTRAINTS
    thinking: bool
    truth: list[int] = field(default_factory=list)  # the real output ids
    ref: RawReference | None = None
    gate_open: bool = True  # thinking not ended yet


def test_random_batch_churn_matches_reference_matchers(runner: Any, compiler: Compiler,
                                                       vocab: Vocabulary) -> None:
    """100 random sequences of adds, removals, resumes, swaps and decode steps (half of them
    under async scheduling): every row's mask equals its own reference matcher's."""
    rng = random.Random(1234)
    grammars = [compiler.compile(spec) for _, spec in CONSTRAINTS]
    stops = set(vocab.stop_ids)
    runners = [runner(fqcn=True), runner(fqcn=True, use_async=True)]
    counter = 0
    counts = {"masked_rows": 0, "async_masked_rows": 0, "resumed": 0, "swaps": 0,
              "thinking_closed": 0, "finished": 0}
    for seq in range(100):
        r = runners[seq % 2]
        live: dict[str, _Req] = {}
        for _ in range(rng.randint(4, 10)):
            # batch changes of this step
            if live and rng.random() < 0.25:
                victim = rng.choice(sorted(live))
                r.remove(victim)
                if rng.random() < 0.5:  # preempted and resumed at once: replay
                    req = live[victim]
                    r.add(victim, _xargs_of(req), [IM_START, 1, 2], output=list(req.truth))
                    counts["resumed"] += 1
                else:
                    del live[victim]
            while len(live) < 4 and rng.random() < 0.6:
                counter += 1
                rid = f"s{seq}r{counter}"
                c = rng.choice([None, 0, 1, 2, 3])
                req = _Req(rid, c, thinking=c is not None and rng.random() < 0.3)
                req.gate_open = req.thinking
                if c is not None:
                    req.ref = RawReference.of(grammars[c], vocab)
                live[rid] = req
                r.add(rid, _xargs_of(req), [IM_START, 1, 2, 3])
            if not live:
                continue
            swap = (0, 1) if len(live) > 1 and rng.random() < 0.3 else None
            counts["swaps"] += swap is not None
            r.schedule(swap)
            logits = r.logits()
            tokens: dict[str, int] = {}
            for row, rid in enumerate(r.batch.req_ids):
                req = live[rid]
                got = allowed(logits[row])
                if req.ref is None or req.gate_open:
                    assert got.all(), (seq, rid)
                    tid = (END_THINK if req.gate_open and rng.random() < 0.4
                           else rng.randrange(0, 151_643))
                else:
                    assert torch.equal(got, ref_allowed(req.ref)), (seq, rid)
                    counts["async_masked_rows" if r.use_async else "masked_rows"] += 1
                    choices = got.nonzero().flatten().tolist()
                    tid = rng.choice(choices)
                    assert req.ref.accept(tid)
                if req.gate_open and tid == END_THINK:
                    req.gate_open = False
                    counts["thinking_closed"] += 1
                tokens[rid] = tid
                req.truth.append(tid)
            r.commit(tokens)
            for rid, tid in tokens.items():  # a request that sampled a stop token finishes
                if tid in stops and live[rid].ref is not None:
                    r.remove(rid)
                    del live[rid]
                    counts["finished"] += 1
        proc = r.plugin.core.proc_or_none
        assert proc is None or proc.errors == {}
        for rid in live:  # the next sequence starts from an empty batch
            r.remove(rid)
        r.schedule()
    assert counts["masked_rows"] > 150 and min(counts.values()) > 5, counts


def _xargs_of(req: _Req) -> dict[str, Any] | None:
    if req.constraint is None:
        return None
    return xargs(CONSTRAINTS[req.constraint][0], thinking="auto" if req.thinking else "off")


def test_the_decode_core_holds_no_callable_of_the_plugin(runner: Any, vocab: Vocabulary) -> None:
    """Issue 53, on a live V1 batch: requests added by ``update_state`` (made into rows by
    the fill job, parsed there through ``RequestReader``), stepped and removed; nothing
    below ``integrations/`` holds a bound method, partial, lambda or closure of the
    plugin's objects, before the fill job made the rows and after."""
    from ...layering import upward_callables

    r = runner()
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    r.add("b", xargs(CONSTRAINTS[2][0], thinking="off"), [3])
    r.schedule()  # the adds are queued: the fill job makes them
    proc = r.plugin.core.proc_or_none
    assert proc is not None
    found = upward_callables(proc)
    for _ in range(3):
        first = r.logits()
        r.commit({"a": int(allowed(first[0]).nonzero()[0]),
                  "b": int(allowed(first[1]).nonzero()[0])})
        r.schedule()
        found += upward_callables(proc)
    r.remove("b")
    r.schedule()
    found += upward_callables(proc) + upward_callables(r.plugin.core.compiler)
    assert found == []
