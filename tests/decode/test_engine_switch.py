"""The engine switch (``decode/engine_switch``): running rows of a JSON schema move to the
engine the fill tuner finds cheaper, on both engines.

The verdict is forced (``Compiler(fill_verdict="rival")``): these tests must not depend on
which engine fills faster on this machine. Rows run on the routed grammar from a compiler
without tuning (as rows admitted before the verdict do), are fed walks the old engine
accepts, and the verdict lands mid-walk: each row switches with its own history length,
after rollbacks too. Every mask is compared with ``RawReference`` (the raw backend of the
engine the row is on, fed the same tokens: a row that started there), never with grammask's
own matchers.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import jsonschema
import pytest
import torch

from grammask import AlongDrafts, Compiler, GrammarSpec, Vocabulary, load_vocabulary
from grammask.compile.filltune import Verdict
from grammask.decode import engine_switch
from grammask.decode.processor import BatchProcessor

from ..helpers import RawReference, words_to_bool

FREE = {"type": "object", "properties": {"name": {"type": "string"},
                                         "note": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "note", "n"]}
CLOSED = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["kind", "n", "ok"]}
WORDS = ["ada", "lovelace", "the", "engine", "wrote", "notes", "on", "analytical", "é", "ü"]


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return load_vocabulary("qwen2.5")


def _instance(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    if "note" in schema["properties"]:
        return {"name": " ".join(rng.choices(WORDS, k=rng.randint(1, 3))),
                "note": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
                "n": rng.randint(-999, 99999)}
    return {"kind": rng.choice(["alpha", "beta", "gamma"]), "n": rng.randint(0, 9999),
            "ok": rng.random() < 0.5}


def _walks(schema: dict[str, Any], vocab: Vocabulary, spec: GrammarSpec, old: str,
           count: int, seed: int) -> list[list[int]]:
    """Valid instances as token walks the old engine accepts (stop token included)."""
    rng = random.Random(seed)
    walks = []
    while len(walks) < count:
        text = json.dumps(_instance(schema, rng), separators=(",", ":"), ensure_ascii=False)
        walk = [*vocab.encode(text), vocab.stop_ids[0]]
        ref = RawReference(spec, vocab, old)  # type: ignore[arg-type]
        if all(ref.accept(t) for t in walk):
            walks.append(walk)
    return walks


def _verdict(compiler: Compiler, spec: GrammarSpec, backend: str) -> Verdict:
    compiler.compile(spec)  # the tuner compiles the rival and (forced) offers it
    deadline = time.monotonic() + 60
    while (verdict := compiler.fill_tuner.offer(spec.key, backend)) is None:
        assert time.monotonic() < deadline, "no verdict"
        time.sleep(0.02)
    return verdict


@pytest.mark.parametrize("schema", [FREE, CLOSED], ids=["guidance-to-xgrammar",
                                                         "xgrammar-to-guidance"])
def test_rows_switch_at_every_position_and_mask_as_the_new_engine(
        vocab: Vocabulary, schema: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows added one a step, each with its own walk; the verdict lands mid-walk, so rows
    switch with every history length from 0 up (a few right after a rollback, and a few a
    step: the per-job bound is set low; each replay runs on the replay thread and is swapped
    in by a later job, after catching up). Before the switch each mask is the old
    engine's, after it the new engine's for the same history (drafts included), and every
    output validates."""
    monkeypatch.setattr(engine_switch, "SUBMIT_PER_JOB", 3)
    spec = GrammarSpec.json_schema(schema, any_whitespace=False)
    routed = Compiler(vocab, tune_fill=False).compile(spec)  # the grammar running rows have
    old = routed.backend
    new = "xgrammar" if old == "guidance" else "guidance"
    compiler = Compiler(vocab, fill_verdict="rival")
    n_rows = 12
    walks = _walks(schema, vocab, spec, old, n_rows, seed=len(old))
    proc = BatchProcessor(compiler, max_batch=n_rows, think_end=None)
    refs: dict[int, dict[str, RawReference]] = {}
    fed: dict[int, int] = {}
    switched_at: dict[int, int] = {}
    rolled = set()
    checked = {old: 0, new: 0}
    verdict_step = 10
    try:
        for t in range(80):
            if t < n_rows:
                proc.add(t, spec, (), None, grammar=routed)
                refs[t] = {b: RawReference(spec, vocab, b) for b in (old, new)}  # type: ignore
                fed[t] = 0
            if t == verdict_step:
                _verdict(compiler, spec, old)
            live = [r for r in refs if fed[r] < len(walks[r])]
            if not live:
                break
            bitmask, _ = proc.wait_masks(live)
            for r in live:
                backend = proc.info(r).backend
                assert backend is not None
                if backend == new and r not in switched_at:
                    # switched by the job that read its last token: the history replayed
                    switched_at[r] = fed[r] - 1
                want = refs[r][backend].allowed()
                got = words_to_bool(bitmask[r], vocab.vocab_size)
                assert torch.equal(got, want), (r, backend, fed[r])
                checked[backend] += 1
            if t == verdict_step + 3:
                _check_drafts(proc, vocab, refs, walks, fed, switched_at, new)
            tokens = []
            for r in live:
                token = walks[r][fed[r]]
                for ref in refs[r].values():
                    assert ref.accept(token)
                fed[r] += 1
                tokens.append(token)
            proc.step(live, tokens)
            if t == verdict_step - 1:  # rollbacks right before the verdict's step
                for r in live[:3]:
                    if fed[r] >= 3:
                        proc.wait_masks(live)
                        proc.rollback(r, 2)
                        for ref in refs[r].values():
                            ref.rollback(2)
                        fed[r] -= 2
                        rolled.add(r)
    finally:
        proc.close()
        compiler.close()
    assert len(switched_at) == n_rows, (switched_at, checked)
    assert len(set(switched_at.values())) >= 6  # many history lengths, 0 among them
    assert min(switched_at.values()) <= 2 and rolled & set(switched_at)
    assert checked[old] > 20 and checked[new] > 50
    for walk in walks:
        jsonschema.validate(json.loads(vocab.decode(walk[:-1]).decode()), schema)
    verdict = compiler.fill_tuner.offer(spec.key, old)
    assert verdict is not None and verdict.switched == n_rows


def _check_drafts(proc: BatchProcessor, vocab: Vocabulary,
                  refs: dict[int, dict[str, RawReference]], walks: list[list[int]],
                  fed: dict[int, int], switched_at: dict[int, int], new: str) -> None:
    """Masks along two drafts (the walk's next tokens) of the switched rows: the new
    engine's, forked along the drafts (vLLM's rejection-sampler layout)."""
    rows, positions, inputs, expect = [], [], [], []
    for r in switched_at:
        drafts = walks[r][fed[r]:fed[r] + 2]
        if len(drafts) < 2:
            continue
        walk = refs[r][new].fork()
        for k in range(3):
            rows.append(r)
            positions.append(k)
            inputs.append(0 if k == 0 else drafts[k - 1])
            expect.append(walk.allowed())
            if k < 2:
                assert walk.accept(drafts[k])
    if not rows:
        return
    logits = torch.zeros(len(rows), vocab.vocab_size)
    proc.apply(logits, AlongDrafts(rows, positions, inputs))
    for i, want in enumerate(expect):
        assert torch.equal(torch.isfinite(logits[i]), want), (rows[i], positions[i])


def test_a_history_the_new_engine_refuses_leaves_the_row_where_it_was(
        vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row on llguidance whose string holds an escape (``\\n``) that the offered xgrammar
    grammar refuses (a string with ``maxLength``: xgrammar refuses escapes there,
    docs/check-results.md): the row stays on llguidance, its masks unchanged, and the
    refusal is counted; a row without the escape switches."""
    spec = GrammarSpec.json_schema(FREE, any_whitespace=False)
    routed = Compiler(vocab, tune_fill=False).compile(spec)
    assert routed.backend == "guidance"
    strict = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "note": {"type": "string", "maxLength": 40},
                                               "n": {"type": "integer"}},
              "required": ["name", "note", "n"]}
    compiler = Compiler(vocab, fill_verdict="rival")
    rival = compiler.compile(GrammarSpec.json_schema(strict, any_whitespace=False,
                                                     backend="xgrammar"))
    verdict = Verdict(spec.key, "guidance", rival, 10.0, 1.0)
    tuner = compiler.fill_tuner  # the verdict lands once both histories are fed
    monkeypatch.setattr(tuner, "offer", lambda key, backend: (
        verdict if backend == "guidance" and tuner.epoch else None))
    escaped = vocab.encode('{"name":"a\\nb","note":"x"')
    plain = vocab.encode('{"name":"ab","note":"x"')
    proc = BatchProcessor(compiler, max_batch=2, think_end=None)
    refs = [RawReference(spec, vocab, "guidance") for _ in range(2)]
    try:
        for r in (0, 1):
            proc.add(r, spec, (), None, grammar=routed)
        proc.wait_masks([0, 1])
        for i in range(max(len(escaped), len(plain))):
            rows, tokens = [], []
            for r, walk in ((0, escaped), (1, plain)):
                if i < len(walk):
                    rows.append(r)
                    tokens.append(walk[i])
                    assert refs[r].accept(walk[i])
            proc.step(rows, tokens)
            proc.wait_masks(rows)
        tuner.offered = frozenset({spec.key})  # the verdict lands: the next jobs replay
        tuner.epoch += 1  # and swap both rows
        for text in (",", '"'):
            token = vocab.encode(text)[0]
            for ref in refs:
                assert ref.accept(token)
            proc.step([0, 1], [token, token])
            bitmask, _ = proc.wait_masks([0, 1])
            switch = proc._jobs.switch
            assert switch is not None
            switch.settle()  # the replays done: the next job swaps them in
        assert proc.info(0).backend == "guidance"  # refused: stayed
        assert torch.equal(words_to_bool(bitmask[0], vocab.vocab_size), refs[0].allowed())
        assert proc.info(1).backend == "xgrammar"  # the plain one switched
    finally:
        proc.close()
        compiler.close()
    assert verdict.stayed == {"rejected": 1} and verdict.switched == 1


def test_the_switch_off_and_forced_backends_never_switch(vocab: Vocabulary) -> None:
    """``engine_switch=False`` keeps every row on its engine; a request that names its
    backend never switches either."""
    spec = GrammarSpec.json_schema(FREE, any_whitespace=False)
    routed = Compiler(vocab, tune_fill=False).compile(spec)
    compiler = Compiler(vocab, fill_verdict="rival")
    _verdict(compiler, spec, routed.backend)
    forced_spec = spec.with_backend("guidance")
    forced = compiler.compile(forced_spec)
    walk = vocab.encode('{"name":"ab","note":"cd","n":1}')
    off = BatchProcessor(compiler, max_batch=1, think_end=None, engine_switch=False)
    on = BatchProcessor(compiler, max_batch=1, think_end=None)
    try:
        off.add(0, spec, (), None, grammar=routed)
        on.add(0, forced_spec, (), None, grammar=forced)
        for token in walk:
            for proc in (off, on):
                proc.step([0], [token])
                proc.wait_masks([0])
        assert off.info(0).backend == "guidance" and on.info(0).backend == "guidance"
    finally:
        off.close()
        on.close()
        compiler.close()


def test_one_rival_compile_at_a_time_per_backend(vocab: Vocabulary,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A wave of new free-text schemas: their rivals (xgrammar) are compared one at a time,
    the others queued, so they never fill the compile slots that first masks routed to
    that backend wait for; every one is compared in the end. Each comparison is held until
    the whole wave is compiled: one run alongside it would be seen running meanwhile."""
    import threading

    from grammask.compile.filltune import FillTuner

    active, peak, done = [0], [0], []
    lock = threading.Lock()
    all_done = threading.Event()
    running, wave_in = threading.Event(), threading.Event()

    def tune(self: FillTuner, spec: GrammarSpec, grammar: Any, other: str) -> None:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        running.set()
        wave_in.wait(30)  # stands in for the rival's compile and the comparison
        with lock:
            active[0] -= 1
            done.append(spec.key)
            if len(done) == 6:
                all_done.set()

    monkeypatch.setattr(FillTuner, "_tune", tune)
    compiler = Compiler(vocab)
    try:
        for i in range(6):
            compiler.compile(GrammarSpec.json_schema(
                {**FREE, "description": f"wave {i}"}, any_whitespace=False))
        assert running.wait(30)
        with lock:  # the first comparison runs (held), the other five are queued
            assert active[0] == 1 and not done
        wave_in.set()
        assert all_done.wait(30)
    finally:
        compiler.close()
    assert peak[0] == 1 and len(set(done)) == 6


def test_the_comparison_times_both_engines_on_a_running_rows_tokens(
        vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the rival compiles, running rows of the spec hand their tokens over (one row's
    history once it took ``WALK_AFTER``); both engines are then timed along those tokens,
    not a probe walk (the grammar's reason says which). Without rows, a probe walk."""
    import threading

    monkeypatch.setattr(engine_switch, "WALK_AFTER", 8)
    spec = GrammarSpec.json_schema(FREE, any_whitespace=False)
    compiler = Compiler(vocab, fill_verdict="rival")
    tuner = compiler._tuner
    gate = threading.Event()
    compile_rival = tuner._compile

    def slow_rival(s: GrammarSpec) -> Any:
        assert gate.wait(60)  # the rival is still compiling while rows run
        return compile_rival(s)

    monkeypatch.setattr(tuner, "_compile", slow_rival)
    seen: list[list[int]] = []
    note = tuner.note_walk
    monkeypatch.setattr(tuner, "note_walk", lambda k, t: (seen.append(list(t)), note(k, t)))
    (walk,) = _walks(FREE, vocab, spec, "guidance", 1, seed=3)
    proc = BatchProcessor(compiler, max_batch=2, think_end=None, engine_switch=False)
    try:
        proc.add(0, spec, (), None)
        proc.wait_masks([0])  # the routed compile is done: the rival's has started
        deadline = time.monotonic() + 10
        while spec.key not in compiler.fill_tuner.wanting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for token in walk[:20]:
            proc.wait_masks([0])
            proc.step([0], [token])
        proc.wait_masks([0])
        assert seen and seen[-1] == walk[:len(seen[-1])] and len(seen[-1]) >= 8
        gate.set()
        verdict = _verdict(compiler, spec, "guidance")
        assert "a running row's walk of" in verdict.grammar.reason, verdict.grammar.reason
        assert spec.key not in compiler.fill_tuner.wanting
    finally:
        gate.set()
        proc.close()
        compiler.close()
    other = GrammarSpec.json_schema(CLOSED, any_whitespace=False)
    probe_compiler = Compiler(vocab, fill_verdict="rival")
    try:
        routed = probe_compiler.compile(other)
        verdict = _verdict(probe_compiler, other, routed.backend)
        assert "a probe walk of" in verdict.grammar.reason
    finally:
        probe_compiler.close()
