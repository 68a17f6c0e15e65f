"""Speculative decoding on vLLM 0.33's V2 runner: one mask per draft position, on vLLM's own
``RequestState`` and ``LogitsContext``.

A request with ``n`` draft tokens owns ``n + 1`` logits rows (``expanded_local_pos`` 0..n);
row ``k``'s input is the k-th draft (row 0's is the last committed token) and its mask must
follow the first ``k`` drafts. What the runner commits (accepted drafts plus the bonus token)
is appended on the "device" as V2's post-update kernel does. The reference is a matcher per
request that only ever sees committed tokens, forked per step to walk the drafts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

# first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
from ...vllm_fixtures import (
    CONSTRAINTS,
    END_THINK,
    IM_START,
    STAGED_EVERY_STEP,
    VOCAB,
    allowed,
    cpu_v2,  # noqa: F401 - an autouse fixture: the CPU stand-ins for this module
    post_update,
    ref_allowed,
    spec_config,
    xargs,
)

# isort: split
from vllm import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
)
from vllm.v1.worker.gpu.states import RequestState

from grammask import Vocabulary
from grammask.integrations.vllm.plugin import GrammaskLogitsProcessor

from ...helpers import RawReference

MAX_REQS = 4
NUM_SPEC = 4



class SpecRunner:
    """The V2 runner's per-step calls with draft tokens (no forward, no rejection sampler:
    the test decides what is accepted, as the sampler would from the masked logits)."""

    def __init__(self) -> None:
        config = spec_config(max_reqs=MAX_REQS, num_spec=NUM_SPEC)
        self.rs = RequestState(max_num_reqs=MAX_REQS, max_model_len=256,
                               max_num_batched_tokens=256, num_speculative_steps=NUM_SPEC,
                               vocab_size=VOCAB, device=torch.device("cpu"))
        procs = build_custom_logits_processors(config, self.rs, False, ())
        self.plugin = next(p for p in procs if isinstance(p, GrammaskLogitsProcessor))
        self.slots: dict[str, int] = {}
        self.new = False

    def add(self, rid: str, extra_args: dict[str, Any] | None, prompt: list[int]) -> None:
        self.rs.add_request(rid, prompt_len=len(prompt), all_token_ids=list(prompt),
                            num_computed_tokens=0, max_tokens=64)
        slot = self.rs.req_id_to_index[rid]
        self.slots[rid] = slot
        self.plugin.add_request(slot, SamplingParams(max_tokens=64,
                                                     extra_args=extra_args or None))
        self.new = True

    def remove(self, rid: str) -> None:
        self.rs.remove_request(rid)
        del self.slots[rid]

    def step(self, order: list[str], drafts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Logits rows per request: row k follows the first k drafts."""
        if self.new or STAGED_EVERY_STEP:
            if self.new:
                self.rs.apply_staged_writes()
            self.plugin.apply_staged_writes()
            self.new = False
        expanded, local, inputs, seq_lens = [], [], [], []
        for rid in order:
            slot = self.slots[rid]
            total = int(self.rs.total_len.gpu[slot])
            seq_lens.append(total + len(drafts[rid]))
            last = int(self.rs.all_token_ids.gpu[slot, total - 1])
            for k, tid in enumerate([last, *drafts[rid]]):
                expanded.append(slot)
                local.append(k)
                inputs.append(tid)
        idx = torch.tensor([self.slots[r] for r in order], dtype=torch.int32)
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(expanded, dtype=torch.int32), idx_mapping=idx,
            idx_mapping_np=idx.numpy(),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32),
            input_ids=torch.tensor(inputs, dtype=torch.int64),
            pos=torch.tensor(seq_lens, dtype=torch.int32) - 1,
            seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32))
        logits = self.plugin.apply(torch.zeros(len(expanded), VOCAB), ctx)
        out: dict[str, torch.Tensor] = {}
        at = 0
        for rid in order:
            n = len(drafts[rid]) + 1
            out[rid] = logits[at:at + n]
            at += n
        return out

    def commit(self, rid: str, tokens: list[int]) -> None:
        """One step's ``post_update`` for ``rid``: the accepted drafts and the bonus token."""
        if tokens:
            post_update(self.rs, self.slots[rid], *tokens)


@dataclass
class _Req:
    constraint: int | None
    gate_open: bool
    ref: RawReference | None = None  # accepted only committed tokens
    start: RawReference | None = None  # a fresh matcher (the state when thinking ends)
    committed: int = 0  # constrained tokens committed


def expected_rows(req: _Req, drafts: list[int]) -> list[torch.Tensor | None]:
    """The reference masks, position by position (None: free)."""
    free = None
    gate = req.gate_open
    m = None if req.ref is None else req.ref.fork()
    rows: list[torch.Tensor | None] = [free if gate or m is None else ref_allowed(m)]
    refused = False
    for tid in drafts:
        if m is None:
            rows.append(free)
        elif refused:
            rows.append(rows[-1])
        elif gate:
            if tid == END_THINK:
                gate = False
                rows.append(ref_allowed(m))
            else:
                rows.append(free)
        elif m.accept(tid):
            rows.append(ref_allowed(m))
        else:
            refused = True
            rows.append(rows[-1])
    return rows


def test_masks_at_every_draft_position_match_the_reference() -> None:
    """100 random sequences: draft lengths 0-4, valid and refused drafts, accepted prefixes
    and bonus tokens, thinking that ends inside a draft window, finished and new requests."""
    rng = random.Random(2024)
    r = SpecRunner()
    compiler = r.plugin.core.compiler
    assert compiler is not None
    vocab = compiler.vocab
    grammars = [compiler.compile(spec) for _, spec in CONSTRAINTS]
    stops = set(vocab.stop_ids)
    counts = {"draft_rows": 0, "refused_drafts": 0, "accepted_drafts": 0, "bonus": 0,
              "think_end_in_window": 0, "finished": 0}
    counter = 0
    for _ in range(100):
        live: dict[str, _Req] = {}
        for _ in range(rng.randint(3, 8)):
            while len(live) < MAX_REQS and rng.random() < 0.6:
                counter += 1
                rid = f"r{counter}"
                c = rng.choice([None, 0, 1, 2, 3])
                thinking = c is not None and rng.random() < 0.3
                req = _Req(c, gate_open=thinking)
                if c is not None:
                    req.ref = RawReference.of(grammars[c], vocab)
                live[rid] = req
                r.add(rid, None if c is None else xargs(
                    CONSTRAINTS[c][0], thinking="auto" if thinking else "off"), [IM_START, 1, 2, 3])
            if not live:
                continue
            order = sorted(live)
            rng.shuffle(order)
            drafts = {rid: _drafts(rng, live[rid], vocab) for rid in order}
            logits = r.step(order, drafts)
            for rid in order:
                req = live[rid]
                expected = expected_rows(req, drafts[rid])
                got = [allowed(row) for row in logits[rid]]
                for k, (want, have) in enumerate(zip(expected, got, strict=True)):
                    if want is None:
                        assert have.all(), (rid, k)
                    else:
                        assert torch.equal(have, want), (rid, k, drafts[rid])
                counts["draft_rows"] += len(drafts[rid])
                committed = _commit(rng, req, drafts[rid], got, counts)
                r.commit(rid, committed)
                if req.ref is not None and any(t in stops for t in committed) and not (
                        req.gate_open):
                    r.remove(rid)
                    del live[rid]
                    counts["finished"] += 1
        for rid in list(live):
            r.remove(rid)
    proc = r.plugin.core.processor()
    assert proc.errors == {}
    assert min(counts.values()) > 10, counts


def _drafts(rng: random.Random, req: _Req, vocab: Vocabulary) -> list[int]:
    """Draft tokens a drafter might propose: a valid walk that may go wrong part-way."""
    n = rng.randint(0, NUM_SPEC)
    out: list[int] = []
    gate = req.gate_open
    m = None if req.ref is None else req.ref.fork()
    for _ in range(n):
        if gate:
            tid = END_THINK if rng.random() < 0.4 else rng.randrange(0, 151_643)
            gate = tid != END_THINK
        elif m is None or rng.random() < 0.15:
            tid = rng.randrange(0, 151_643)  # a draft the grammar likely refuses
        else:
            choices = ref_allowed(m).nonzero().flatten().tolist()
            tid = rng.choice(choices)
            m.accept(tid)
        out.append(tid)
    return out


def _commit(rng: random.Random, req: _Req, drafts: list[int], got: list[torch.Tensor],
            counts: dict[str, int]) -> list[int]:
    """What a rejection sampler could commit: a prefix of the drafts each allowed by the
    row before it, then a bonus token allowed by the row after that prefix."""
    valid = 0
    while valid < len(drafts) and bool(got[valid][drafts[valid]]):
        valid += 1
    counts["refused_drafts"] += valid < len(drafts)
    accepted = rng.randint(0, valid)
    counts["accepted_drafts"] += accepted
    row = got[accepted]
    bonus = (END_THINK if req.gate_open and row.all() and rng.random() < 0.3
             else rng.choice(row.nonzero().flatten().tolist()))
    counts["bonus"] += 1
    committed = [*drafts[:accepted], bonus]
    for tid in committed:  # the reference sees committed tokens only
        if req.ref is None:
            continue
        if req.gate_open:
            if tid == END_THINK:
                req.gate_open = False
                counts["think_end_in_window"] += tid != committed[-1]
            continue
        assert req.ref.accept(tid)
        req.committed += 1
    return committed


@pytest.mark.skipif(STAGED_EVERY_STEP is False, reason="vLLM 0.34 has no V1 runner")
def test_v1_runner_with_speculative_decoding_is_a_clear_400(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's V1 runner silently drops entry-point processors under speculative decoding:
    the API server (vLLM's own ``InputProcessor``) refuses grammask requests there, naming
    the V2 runner; on the V2 runner the same request is admitted."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    config = spec_config(max_reqs=MAX_REQS, num_spec=NUM_SPEC)
    params = SamplingParams(extra_args=xargs({"regex": "a+"}))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not config.use_v2_model_runner
    with pytest.raises(VLLMValidationError, match="V2 model runner"):
        InputProcessor(config)._validate_params(params, ("generate",))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert config.use_v2_model_runner
    InputProcessor(config)._validate_params(params, ("generate",))
