"""The plugin on vLLM's V2 model runner, driven through vLLM's own classes on CPU.

Real: ``build_custom_logits_processors`` (installed entry point and FQCN), the runner's
``RequestState`` (slots from its free list, ``add_request`` / ``remove_request``, staged
writes), the V2 ``Sampler`` (its ``add_request`` / ``apply_staged_writes`` fan-out and its
processor list, built-in states included) and ``LogitsContext``.

Stand-ins, because this machine has no GPU and no Triton (``vllm_fixtures.patch_v2_for_cpu``):
``buffer_utils.is_uva_available`` returns False (pinned memory needs an accelerator) and
``StagedWriteTensor.apply_write`` is a pure-torch copy of the Triton kernel. The runner's
Triton ``post_update`` (append the sampled token, bump ``total_len``) is emulated by
``vllm_fixtures.post_update``. ``Sampler.apply_sampling_params`` itself is not called: after
the processors it runs the Triton temperature kernel; the test runs its processor loop
(``for p in sampler.logits_processors: logits = p.apply(logits, ctx)``) instead. The CUDA
path of the token transfer (pinned buffers, non-blocking copies, the event the helper thread
waits on) needs a GPU and is not exercised; on CPU the same code runs with plain copies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
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
    STAGED_EVERY_STEP,
    THINK,
    VOCAB,
    allowed,
    cpu_v2,  # noqa: F401 - an autouse fixture: the CPU stand-ins for this module
    post_update,
    ref_allowed,
    vllm_config,
    xargs,
)

# isort: split
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
)
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.states import RequestState

from grammask import Compiler, Vocabulary
from grammask.integrations.vllm.plugin import GrammaskLogitsProcessor

from ...helpers import RawReference

MAX_REQS = 4



def ours(procs: list[Any]) -> list[GrammaskLogitsProcessor]:
    return [p for p in procs if isinstance(p, GrammaskLogitsProcessor)]


@dataclass
class _Req:
    slot: int
    prefill_len: int
    computed: int = 0  # tokens the model has processed (prefill progress)


class Runner:
    """The V2 runner's per-step calls around real ``RequestState`` / ``Sampler`` objects."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.rs = RequestState(max_num_reqs=MAX_REQS, max_model_len=256,
                               max_num_batched_tokens=256, num_speculative_steps=0,
                               vocab_size=VOCAB, device=torch.device("cpu"))
        self.procs = build_custom_logits_processors(
            config, self.rs, False, tuple(config.model_config.logits_processors or ()))
        self.sampler = Sampler(config, max_num_reqs=MAX_REQS, vocab_size=VOCAB,
                               device=torch.device("cpu"), req_states=self.rs,
                               custom_logits_processors=self.procs)
        self.reqs: dict[str, _Req] = {}
        self.new = False

    @property
    def plugin(self) -> GrammaskLogitsProcessor:
        active = [p for p in ours(self.procs) if p.core.active]
        assert len(active) == 1
        return active[0]

    def add(self, rid: str, extra_args: dict[str, Any] | None, prompt: list[int],
            output: list[int] | None = None) -> int:
        """``add_requests``: a new (or resumed: ``output``) request takes a free slot."""
        tokens = [*prompt, *(output or [])]
        self.rs.add_request(rid, prompt_len=len(prompt), all_token_ids=tokens,
                            num_computed_tokens=0, max_tokens=64)
        slot = self.rs.req_id_to_index[rid]
        self.sampler.add_request(slot, SamplingParams(max_tokens=64,
                                                      extra_args=extra_args or None))
        self.reqs[rid] = _Req(slot, len(tokens))
        self.new = True
        return slot

    def remove(self, rid: str) -> None:
        """``finish_requests``: the slot goes back to the free list; no processor hook."""
        self.rs.remove_request(rid)
        del self.reqs[rid]

    def step(self, order: list[str], *, chunk: int = 10_000,
             base: torch.Tensor | None = None) -> torch.Tensor:
        """Staged writes, then the sampler's processor stage for rows in ``order``."""
        if self.new or STAGED_EVERY_STEP:
            if self.new:
                self.rs.apply_staged_writes()
            self.sampler.apply_staged_writes()
            self.new = False
        seq_lens = []
        for rid in order:
            req = self.reqs[rid]
            total = int(self.rs.total_len.gpu[req.slot])
            req.computed = min(req.computed + chunk, req.prefill_len) if (
                req.computed < req.prefill_len) else total
            seq_lens.append(req.computed)
        idx = torch.tensor([self.reqs[r].slot for r in order], dtype=torch.int32)
        pos = torch.tensor(seq_lens, dtype=torch.int32) - 1
        ctx = LogitsContext(
            expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=idx.numpy(),
            expanded_local_pos=torch.zeros(len(order), dtype=torch.int32),
            input_ids=self.rs.all_token_ids.gpu[idx.long(), pos.long()], pos=pos,
            seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32))
        logits = torch.zeros(len(order), VOCAB) if base is None else base.clone()
        for processor in self.sampler.logits_processors:
            logits = processor.apply(logits, ctx)
        return logits

    def sampling(self, rid: str) -> bool:
        """Whether the row of ``rid`` sampled in the last step (not a partial prefill)."""
        req = self.reqs[rid]
        return req.computed >= req.prefill_len

    def commit(self, tokens: dict[str, int]) -> None:
        """``postprocess_sampled``: append each sampled token on the 'device'."""
        for rid, tid in tokens.items():
            post_update(self.rs, self.reqs[rid].slot, tid)

    def close(self) -> None:
        for p in ours(self.procs):
            p.close()


@pytest.fixture(scope="module")
def runner() -> Any:
    made: list[Runner] = []

    def make(*, fqcn: bool = False, **config: Any) -> Runner:
        r = Runner(vllm_config(max_num_seqs=MAX_REQS,
                               logits_processors=[FQCN] if fqcn else None, **config))
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


def chat_prompt(vocab: Vocabulary, user: str) -> list[int]:
    return [IM_START, *vocab.encode(f"user\n{user}"), IM_END, *vocab.encode("\n"), IM_START,
            *vocab.encode("assistant\n")]


def test_entry_point_builds_one_instance_and_masks_in_batch_order(
        runner: Any, compiler: Compiler, vocab: Vocabulary) -> None:
    r = runner()
    assert len(ours(r.procs)) == 1  # through the installed entry point
    spec_args, spec = CONSTRAINTS[0]
    r.add("plain", None, [1, 2, 3])
    json_slot = r.add("json", xargs(spec_args, thinking="off"), chat_prompt(vocab, "json"))
    assert r.sampler.needs_logits_processing[json_slot]
    assert not r.sampler.needs_logits_processing[r.reqs["plain"].slot]
    ref = RawReference.of(compiler.compile(spec), compiler.vocab)
    noise = torch.randn(2, VOCAB)
    for step, tid in enumerate([*vocab.encode('{"n":5,"ok":true}'), IM_END]):
        order = ["json", "plain"] if step % 2 else ["plain", "json"]  # rows move every step
        logits = r.step(order, base=noise)
        row = order.index("json")
        assert torch.equal(logits[1 - row], noise[1 - row])  # unconstrained, bit for bit
        assert torch.equal(allowed(logits[row]), ref_allowed(ref))
        assert ref.accept(tid)
        r.commit({"json": tid, "plain": 7})
    logits = r.step(["json", "plain"])
    assert sorted(allowed(logits[0]).nonzero().flatten().tolist()) == sorted(vocab.stop_ids)


@pytest.mark.parametrize("parallel_min", [2, 64], ids=["batch-fill", "row-fill"])
def test_masks_under_the_runners_inference_mode(runner: Any, compiler: Compiler, vocab: Vocabulary,
                                                parallel_min: int) -> None:
    """The runner steps under ``torch.inference_mode()``; the helper and fill threads do
    not. Every backend's fill path must still write its masks (see the V1 test)."""
    r = runner(additional_config={"grammask": {"parallel_min": parallel_min}})
    refs = [RawReference.of(compiler.compile(spec), compiler.vocab) for _, spec in CONSTRAINTS]
    order = [f"r{i}" for i in range(len(CONSTRAINTS))]
    with torch.inference_mode():
        for rid, (args, _) in zip(order, CONSTRAINTS, strict=True):
            r.add(rid, xargs(args, thinking="off"), chat_prompt(vocab, "hi"))
        for _ in range(3):
            logits = r.step(order, base=torch.randn(len(order), VOCAB))
            tokens = {}
            for i, ref in enumerate(refs):
                assert torch.equal(allowed(logits[i]), ref_allowed(ref)), CONSTRAINTS[i][1]
                tid = int(allowed(logits[i]).nonzero()[0])
                assert ref.accept(tid)
                tokens[order[i]] = tid
            r.commit(tokens)
    assert r.plugin.core.processor().errors == {}


def test_finished_requests_are_not_filled(runner: Any, compiler: Compiler,
                                          vocab: Vocabulary) -> None:
    """V2 has no removal hook: a finished request's slot stays tracked until reused. Its
    mask must not be filled on and on meanwhile (at most once more, the step after)."""
    r = runner()
    r.add("json", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    r.add("plain", None, [1, 2])
    for tid in [*vocab.encode("beta"), IM_END]:
        r.step(["json", "plain"])
        r.commit({"json": tid, "plain": 5})
    proc = r.plugin.core.processor()
    filled = proc.stats.rows_filled
    r.remove("json")  # finished: the runner frees the slot, no processor hook
    for _ in range(10):
        r.step(["plain"])
        r.commit({"plain": 5})
    assert proc.stats.rows_filled - filled <= 1


def test_listed_twice_only_one_instance_acts(runner: Any, compiler: Compiler) -> None:
    r = runner(fqcn=True)
    both = ours(r.procs)
    assert len(both) == 2 and [p.core.active for p in both] == [False, True]
    r.add("a", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    assert both[0].core.proc_or_none is None
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    assert torch.equal(allowed(r.step(["a"])[0]), ref_allowed(ref))


def test_recycled_slots_start_afresh(runner: Any, compiler: Compiler, vocab: Vocabulary) -> None:
    r = runner()
    slot = r.add("a", xargs(CONSTRAINTS[2][0], thinking="off"), [1])
    r.step(["a"])
    r.commit({"a": vocab.encode("ab")[0]})
    r.step(["a"])
    r.remove("a")  # finished: V2 tells processors nothing
    assert r.add("b", None, [5, 6]) == slot  # LIFO free list: same slot, unconstrained now
    assert allowed(r.step(["b"])[0]).all()
    assert slot not in r.plugin.core.processor().rows  # its matcher was dropped
    r.remove("b")
    assert r.add("c", xargs(CONSTRAINTS[2][0], thinking="off"), [7]) == slot
    fresh = RawReference.of(compiler.compile(CONSTRAINTS[2][1]), compiler.vocab)
    assert torch.equal(allowed(r.step(["c"])[0]), ref_allowed(fresh))


def test_new_requests_are_parsed_off_the_runners_thread(
        runner: Any, compiler: Compiler, monkeypatch: pytest.MonkeyPatch) -> None:
    """``add_request`` only checks the keys: the parse and the compile's start run on the
    helper thread, handed over in ``apply_staged_writes`` (before the forward). A request
    whose admission fails for a reason not its own (tried again where its row is made)
    errors alone (stop tokens only); the other request of the same step is masked as its
    reference."""
    import threading

    from grammask.integrations.vllm.plugin_core import PluginCore

    r = runner()
    real = PluginCore.arrival
    threads: list[int] = []

    def arrival(self: PluginCore, params: Any, resumed: bool) -> Any:
        threads.append(threading.get_ident())
        if (params.extra_args or {}).get("grammask_source") == "tools":
            raise RuntimeError("boom")
        return real(self, params, resumed)

    monkeypatch.setattr(PluginCore, "arrival", arrival)
    good = r.add("good", xargs(CONSTRAINTS[3][0], thinking="off"), [1, 2])
    bad = r.add("bad", xargs(CONSTRAINTS[3][0], thinking="off") | {"grammask_source": "tools"},
                [1, 2])
    assert r.sampler.needs_logits_processing[good] and r.sampler.needs_logits_processing[bad]
    assert threads == []  # nothing parsed on the runner's thread in add_request
    logits = r.step(["good", "bad"])
    helper = threads[:2]  # both parsed there; the failed one once more where it is made
    assert len(threads) == 3 and threading.get_ident() not in helper
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    assert torch.equal(allowed(logits[0]), ref_allowed(ref))
    stops = sorted(compiler.vocab.stop_ids)
    assert sorted(allowed(logits[1]).nonzero().flatten().tolist()) == stops
    errors = r.plugin.core.processor().errors
    assert list(errors) == [bad] and "boom" in errors[bad]


def test_resumed_request_replays_its_output(runner: Any, compiler: Compiler,
                                            vocab: Vocabulary) -> None:
    r = runner()
    done = vocab.encode('{"n":12')
    r.add("again", xargs(CONSTRAINTS[1][0], thinking="off"), [1, 2, 3], output=done)
    ref = RawReference.of(compiler.compile(CONSTRAINTS[1][1]), compiler.vocab)
    assert all(ref.accept(t) for t in done)
    assert torch.equal(allowed(r.step(["again"])[0]), ref_allowed(ref))


def test_chunked_prefill_rows_are_left_alone(runner: Any, compiler: Compiler) -> None:
    r = runner()
    r.add("long", xargs(CONSTRAINTS[3][0], thinking="off"), list(range(100, 125)))
    assert allowed(r.step(["long"], chunk=10)[0]).all()  # 10 of 25: sample discarded
    assert allowed(r.step(["long"], chunk=10)[0]).all()  # 20 of 25
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    assert torch.equal(allowed(r.step(["long"], chunk=10)[0]), ref_allowed(ref))  # last chunk


def test_tokens_of_skipped_steps_are_read_back(runner: Any, compiler: Compiler,
                                               vocab: Vocabulary) -> None:
    """Two tokens committed in one step (more than the fast path's window of one)."""
    r = runner()
    r.add("a", xargs(CONSTRAINTS[0][0], thinking="off"), [1])
    ref = RawReference.of(compiler.compile(CONSTRAINTS[0][1]), compiler.vocab)
    r.step(["a"])
    ids = vocab.encode('{"n":3')
    post_update(r.rs, r.reqs["a"].slot, ids[0], ids[1])
    assert ref.accept(ids[0]) and ref.accept(ids[1])
    assert torch.equal(allowed(r.step(["a"])[0]), ref_allowed(ref))
    assert r.plugin.core.processor().errors == {}


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_gate_reads_the_prompt_from_the_device(
        runner: Any, compiler: Compiler, vocab: Vocabulary, thinking: bool) -> None:
    r = runner()
    prompt = chat_prompt(vocab, "pick")
    if not thinking:  # Qwen3's template with enable_thinking=False
        prompt += [THINK, *vocab.encode("\n\n"), END_THINK, *vocab.encode("\n\n")]
    r.add("t", xargs(CONSTRAINTS[3][0]), prompt)
    ref = RawReference.of(compiler.compile(CONSTRAINTS[3][1]), compiler.vocab)
    thoughts = [*vocab.encode("so"), END_THINK] if thinking else []
    for tid in thoughts:
        assert allowed(r.step(["t"])[0]).all()
        r.commit({"t": tid})
    for tid in vocab.encode("gamma"):
        assert torch.equal(allowed(r.step(["t"])[0]), ref_allowed(ref))
        assert ref.accept(tid)
        r.commit({"t": tid})


# ------------------------------------------------------------------------ churn
@dataclass
class _Live:
    constraint: int | None
    thinking: bool
    truth: list[int] = field(default_factory=list)
    ref: RawReference | None = None
    gate_open: bool = False


def test_random_batch_churn_matches_reference_matchers(runner: Any, compiler: Compiler,
                                                       vocab: Vocabulary) -> None:
    """100 random sequences: adds into recycled slots, finishes, preempt-and-resume, rows in
    a new order every step, chunked prefills; every row's mask equals its reference's."""
    rng = random.Random(4321)
    grammars = [compiler.compile(spec) for _, spec in CONSTRAINTS]
    stops = set(vocab.stop_ids)
    r = runner()
    counts = {"masked_rows": 0, "resumed": 0, "recycled": 0, "thinking_closed": 0,
              "partial_prefill": 0}
    counter = 0
    for _ in range(100):
        live: dict[str, _Live] = {}
        used_slots: set[int] = set()
        for _ in range(rng.randint(4, 10)):
            if live and rng.random() < 0.25:
                victim = rng.choice(sorted(live))
                r.remove(victim)
                if rng.random() < 0.5:  # preempted, resumed at once (maybe another slot)
                    req = live[victim]
                    r.add(victim, _xargs_of(req), [IM_START, 1, 2], output=list(req.truth))
                    counts["resumed"] += 1
                else:
                    del live[victim]
            while len(live) < MAX_REQS and rng.random() < 0.6:
                counter += 1
                rid = f"r{counter}"
                c = rng.choice([None, 0, 1, 2, 3])
                req = _Live(c, thinking=c is not None and rng.random() < 0.3)
                req.gate_open = req.thinking
                req.ref = None if c is None else RawReference.of(grammars[c], vocab)
                live[rid] = req
                slot = r.add(rid, _xargs_of(req),
                             [IM_START, *range(10, 10 + rng.randint(1, 12))])
                counts["recycled"] += slot in used_slots
                used_slots.add(slot)
            if not live:
                continue
            order = sorted(live)
            rng.shuffle(order)
            logits = r.step(order, chunk=rng.choice([4, 10_000]))
            tokens: dict[str, int] = {}
            for row, rid in enumerate(order):
                req = live[rid]
                got = allowed(logits[row])
                if not r.sampling(rid):  # a partial prefill: unmasked, sample discarded
                    assert got.all()
                    counts["partial_prefill"] += 1
                    continue
                if req.ref is None or req.gate_open:
                    assert got.all(), rid
                    tid = (END_THINK if req.gate_open and rng.random() < 0.4
                           else rng.randrange(0, 151_643))
                else:
                    assert torch.equal(got, ref_allowed(req.ref)), rid
                    counts["masked_rows"] += 1
                    tid = rng.choice(got.nonzero().flatten().tolist())
                    assert req.ref.accept(tid)
                if req.gate_open and tid == END_THINK:
                    req.gate_open = False
                    counts["thinking_closed"] += 1
                tokens[rid] = tid
                req.truth.append(tid)
            r.commit(tokens)
            for rid, tid in tokens.items():
                if tid in stops and live[rid].ref is not None:
                    r.remove(rid)
                    del live[rid]
        for rid in live:
            r.remove(rid)
    proc = r.plugin.core.processor()
    assert proc.errors == {}
    assert counts["masked_rows"] > 300 and min(counts.values()) > 5, counts


def _xargs_of(req: _Live) -> dict[str, Any] | None:
    if req.constraint is None:
        return None
    return xargs(CONSTRAINTS[req.constraint][0], thinking="auto" if req.thinking else "off")
