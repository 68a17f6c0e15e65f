"""The batch processor: masks, stop handling, churn against reference matchers, errors, overlap."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from grammask import AlongDrafts, Compiler, Grammar, GrammarError, GrammarSpec, Mapped, Vocabulary
from grammask.backends import Matcher
from grammask.backends.base import BatchFills
from grammask.decode.fill import Filler
from grammask.decode.processor import BatchProcessor

from ..helpers import PATIENT, RawReference, ThreadClock, raw_reference

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3},
    "n": {"type": "integer"}}, "required": ["name", "n"]}
INSTANCE = json.dumps({"name": "grammask", "tags": ["x"], "n": 12}, separators=(",", ":"))
SPECS = [
    GrammarSpec.json_schema(SCHEMA, any_whitespace=False, backend="guidance"),
    GrammarSpec.json_schema(SCHEMA, any_whitespace=False, backend="xgrammar"),
    GrammarSpec.regex(r"(ab|cd)[0-9]{1,4}", backend="guidance"),
    GrammarSpec.choice(["alpha", "beta", "gamma"], backend="xgrammar"),
    GrammarSpec.json_schema({"type": "array", "items": {"type": "boolean"}, "maxItems": 4}),
]


def failed_compile(compiler: Compiler, spec: GrammarSpec) -> Future[Grammar]:
    """A done future holding the backend's real error for ``spec`` (so a row's compile error
    never races a short ``wait_s``)."""
    out: Future[Grammar] = Future()
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec)
    out.set_exception(info.value)
    return out


def allowed(logits_row: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits_row)


def ref_allowed(ref: RawReference, vocab: Vocabulary) -> torch.Tensor:
    """The expected mask, from the raw backend (tests/helpers.py ``RawReference``), never from
    the adapter under test."""
    assert ref.vocab is vocab
    return ref.allowed()


def run_step(proc: BatchProcessor, batch: int, vocab: Vocabulary) -> torch.Tensor:
    proc.step()
    logits = torch.zeros(batch, vocab.vocab_size)
    proc.apply(logits)
    return logits


def only(logits_row: torch.Tensor) -> list[int]:
    return sorted(allowed(logits_row).nonzero().flatten().tolist())


@pytest.fixture(scope="module")
def grammars(compiler: Compiler) -> list[Grammar]:
    return [compiler.compile(s) for s in SPECS]


def test_masks_follow_the_grammar_and_force_eos(compiler: Compiler, qwen25: Vocabulary) -> None:
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ref = RawReference.of(compiler.compile(spec), qwen25)
    out: list[int] = []
    with BatchProcessor(compiler, max_batch=3, **PATIENT) as proc:
        proc.add(1, spec, prompt_ids=[1, 2, 3], output_ids=out)
        for tid in qwen25.encode(INSTANCE):
            logits = run_step(proc, 3, qwen25)
            assert torch.equal(allowed(logits[1]), ref_allowed(ref, qwen25))
            assert allowed(logits[1])[tid]
            if not ref.can_terminate():
                assert not any(allowed(logits[1])[s] for s in qwen25.stop_ids)
            assert allowed(logits[0]).all() and allowed(logits[2]).all()  # unconstrained rows
            out.append(tid)
            assert ref.accept(tid)
        logits = run_step(proc, 3, qwen25)
        assert all(allowed(logits[1])[s] for s in qwen25.stop_ids)  # the grammar may end here
        out.append(qwen25.stop_ids[0])
        for _ in range(2):  # after the end only stop tokens, and they keep being accepted
            logits = run_step(proc, 3, qwen25)
            assert only(logits[1]) == sorted(qwen25.stop_ids)
            assert proc.status(1) == "ended"
            out.append(qwen25.stop_ids[1])
        assert proc.errors == {}


def test_several_tokens_per_step_and_unconstrained_rows_untouched(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ids = qwen25.encode(INSTANCE)
    ref = RawReference.of(compiler.compile(spec), qwen25)
    with BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        proc.add(2, spec)
        proc.add(3, None)
        noise = torch.randn(4, qwen25.vocab_size)
        for chunk in (ids[:3], ids[3:4], ids[4:9]):
            proc.advance(2, chunk)
            assert all(ref.accept(t) for t in chunk)
            logits = noise.clone()
            proc.step()
            proc.apply(logits)
            assert torch.equal(logits[[0, 1, 3]], noise[[0, 1, 3]])  # bit for bit
            assert torch.equal(allowed(logits[2]), ref_allowed(ref, qwen25))
        assert proc.info(2).constrained_tokens == 9
        assert proc.rows == [2]


def test_placeholders_are_read_when_resolved(compiler: Compiler, qwen25: Vocabulary) -> None:
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ids = qwen25.encode(INSTANCE)
    ref = RawReference.of(compiler.compile(spec), qwen25)
    live: list[int] = []
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(0, spec, output_ids=live)
        run_step(proc, 2, qwen25)
        live.extend([ids[0], -1])  # async scheduling: the last token is not known yet
        proc.step()
        live[1] = ids[1]  # resolved before the logits are masked
        logits = torch.zeros(2, qwen25.vocab_size)
        proc.apply(logits)
        assert ref.accept(ids[0]) and ref.accept(ids[1])
        assert torch.equal(allowed(logits[0]), ref_allowed(ref, qwen25))
        live.append(-1)
        proc.step()
        logits = torch.zeros(2, qwen25.vocab_size)
        proc.apply(logits)  # still unknown when the mask is needed: an error, not a guess
        assert proc.status(0) == "error" and "placeholder" in (proc.error(0) or "")
        assert only(logits[0]) == sorted(qwen25.stop_ids)


def _two_references(compiler: Compiler, qwen25: Vocabulary
                    ) -> tuple[GrammarSpec, list[int], Grammar, list[RawReference]]:
    """The schema, its instance's tokens, its grammar and two independent references."""
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    g = compiler.compile(spec)
    return spec, qwen25.encode(INSTANCE), g, [RawReference.of(g, qwen25) for _ in range(2)]


def test_one_and_several_tokens_per_read_follow_the_reference(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """Reads of one token (``Row.take``'s fast path) and of several alternate, on a live
    list and an owned one: every token is fed once, in order."""
    spec, ids, g, refs = _two_references(compiler, qwen25)
    live: list[int] = []
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(1, spec, grammar=g)  # the table's order is not the rows' order
        proc.add(0, spec, output_ids=live, grammar=g)
        at = 0
        for n in (1, 2, 1, 1, 3, 1, 2, 1):
            chunk = ids[at:at + n]
            at += n
            live.extend(chunk)
            proc.advance(1, chunk)
            for ref in refs:
                assert all(ref.accept(t) for t in chunk)
            logits = run_step(proc, 2, qwen25)
            for row, ref in enumerate(refs):
                assert torch.equal(allowed(logits[row]), ref_allowed(ref, qwen25)), (row, at)
        assert proc.info(0).constrained_tokens == at == proc.info(1).constrained_tokens
        proc.step()
        assert proc.wait_masks()[1] == [0, 1]  # sorted, as documented
        assert proc.errors == {}


def test_a_lone_placeholder_is_read_again_before_the_mask(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """One new entry that is a placeholder (the one-token read must not take it): the row
    is read again in ``apply`` / ``wait_masks(rows)`` once resolved, beside a row that is
    not late; still unresolved when its mask is needed, it errors."""
    spec, ids, g, refs = _two_references(compiler, qwen25)
    outs: list[list[int]] = [[], []]
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        for row in (0, 1):
            proc.add(row, spec, output_ids=outs[row], grammar=g)
        for at, rows in ((0, None), (1, [0, 1]), (2, None)):
            outs[0].append(-1)  # async scheduling: row 0's token is not known yet
            outs[1].append(ids[at])
            proc.step(rows)
            outs[0][-1] = ids[at]  # resolved before the mask is needed
            for ref in refs:
                assert ref.accept(ids[at])
            if rows is None:
                logits = torch.zeros(2, qwen25.vocab_size)
                proc.apply(logits)
                for row, ref in enumerate(refs):
                    assert torch.equal(allowed(logits[row]), ref_allowed(ref, qwen25)), at
            else:
                bitmask, masked = proc.wait_masks(rows)
                assert masked == [0, 1]
                for row, ref in enumerate(refs):
                    assert torch.equal(bitmask[row], ref.words()), at
        outs[0].append(-1)
        outs[1].append(ids[3])
        logits = run_step(proc, 2, qwen25)
        assert proc.status(0) == "error" and "placeholder" in (proc.error(0) or "")
        assert only(logits[0]) == sorted(qwen25.stop_ids)
        assert refs[1].accept(ids[3])
        assert torch.equal(allowed(logits[1]), ref_allowed(refs[1], qwen25))


def test_step_with_tokens_hands_over_and_reads_in_one_pass(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """``step(rows, tokens)`` is ``advance(rows[i], [tokens[i]])`` for each row, then
    ``step(rows)``: rows in any order, unread tokens first, a row listed twice gets both
    tokens in order, unconstrained rows are skipped. A live row raises as ``advance``
    does, and the other rows' step still runs; rows and tokens must pair up."""
    spec, ids, g, refs = _two_references(compiler, qwen25)
    live: list[int] = []
    with BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        for row in (0, 1):
            proc.add(row, spec, grammar=g)
        proc.add(3, spec, output_ids=live, grammar=g)
        noise = torch.randn(4, qwen25.vocab_size)

        def check(steps: list[tuple[list[int], list[int]]]) -> None:
            for rows, tokens in steps:
                for row, tid in zip(rows, tokens, strict=True):
                    if row in (0, 1):
                        assert refs[row].accept(tid)
                proc.step(rows, tokens)
                logits = noise.clone()
                proc.apply(logits)
                for row in range(4):  # only the step's constrained rows are masked
                    if row in rows and row in (0, 1):
                        assert torch.equal(allowed(logits[row]), ref_allowed(refs[row], qwen25))
                    else:
                        assert torch.equal(logits[row], noise[row])

        check([([0, 1, 2], [ids[0], ids[0], 7]), ([1, 0], [ids[1], ids[1]])])
        proc.advance(0, [ids[2]])  # unread: read before the step's own token
        assert refs[0].accept(ids[2])
        check([([0, 1], [ids[3], ids[2]]), ([1, 1], [ids[3], ids[4]])])
        with pytest.raises(ValueError, match="live"):
            proc.step([3, 0, 1], [ids[0], ids[4], ids[5]])
        for row, tid in ((0, ids[4]), (1, ids[5])):
            assert refs[row].accept(tid)
        logits = noise.clone()
        proc.apply(logits)  # the step of the other rows ran
        for row, ref in enumerate(refs):
            assert torch.equal(allowed(logits[row]), ref_allowed(ref, qwen25))
        assert torch.equal(logits[3], noise[3]) and live == []
        assert proc.info(0).constrained_tokens == 5 and proc.info(1).constrained_tokens == 6
        proc.step([1, 0, 1], [ids[6], ids[5], ids[7]])
        bitmask, masked = proc.wait_masks()
        assert masked == [0, 1]  # sorted and distinct
        for row, fed in ((0, [ids[5]]), (1, [ids[6], ids[7]])):
            assert all(refs[row].accept(t) for t in fed)
            assert torch.equal(bitmask[row], refs[row].words())
        for rows, tokens in ((None, [ids[5]]), ([0, 1], [ids[5]])):
            with pytest.raises(ValueError, match="one row per token"):
                proc.step(rows, tokens)
        assert proc.info(0).constrained_tokens == 6 and proc.errors == {}


def test_rollback_explicit_and_by_shrinking_list(compiler: Compiler, qwen25: Vocabulary) -> None:
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ids = qwen25.encode(INSTANCE)
    g = compiler.compile(spec)
    live: list[int] = []
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(0, spec)
        proc.add(1, spec, output_ids=live)
        proc.advance(0, ids[:6])
        live.extend(ids[:6])
        run_step(proc, 2, qwen25)
        proc.advance(0, ids[6:8])  # unread tokens are dropped first
        proc.rollback(0, 4)
        del live[4:]  # a live list that got shorter is rolled back by itself
        logits = run_step(proc, 2, qwen25)
        ref = RawReference.of(g, qwen25)
        assert all(ref.accept(t) for t in ids[:4])
        assert torch.equal(allowed(logits[0]), ref_allowed(ref, qwen25))
        assert torch.equal(allowed(logits[1]), ref_allowed(ref, qwen25))
        assert proc.info(0).constrained_tokens == 4 == proc.info(1).constrained_tokens


def test_row_errors_are_isolated(compiler: Compiler, qwen25: Vocabulary) -> None:
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ids = qwen25.encode(INSTANCE)
    g = compiler.compile(spec)
    never: Future[Grammar] = Future()  # a compile that does not finish in time
    bad = GrammarSpec.regex("(unclosed")
    with BatchProcessor(compiler, max_batch=6, wait_s=0.05) as proc:
        for row in (0, 2, 4):
            proc.add(row, spec)  # a cache hit: ready at once
        proc.add(1, bad, grammar=failed_compile(compiler, bad))  # failed before the first mask
        proc.add(3, spec.with_backend("guidance"), grammar=never)  # forced: no hedge
        proc.add(5, spec, grammar=g)
        proc.advance(0, ids[:2])
        proc.advance(2, [ids[0], qwen25.encode("zz")[0], ids[1]])  # a token the grammar refuses
        proc.advance(4, ids[:2])
        proc.advance(5, ids[:2])
        logits = run_step(proc, 6, qwen25)  # no exception reaches the host
        ref = RawReference.of(g, qwen25)
        assert all(ref.accept(t) for t in ids[:2])
        for row in (0, 4, 5):
            assert proc.status(row) == "active"
            assert torch.equal(allowed(logits[row]), ref_allowed(ref, qwen25))
        errors = proc.errors
        assert set(errors) == {1, 2, 3}
        # the compile error itself (its backend message), not a late compile's "not compiled
        # within wait_s" (which also contains "compile")
        assert "failed to compile" in errors[1] and "unclosed" in errors[1].lower()
        assert "wait_s" not in errors[1] and "wait_s" not in errors[2]
        assert "rejected" in errors[2] and "not compiled within wait_s" in errors[3]
        for row in (1, 2, 3):
            assert only(logits[row]) == sorted(qwen25.stop_ids)
        never.set_result(g)  # too late: errors are sticky
        logits = run_step(proc, 6, qwen25)
        assert proc.status(3) == "error" and only(logits[3]) == sorted(qwen25.stop_ids)
        assert torch.equal(allowed(logits[0]), ref_allowed(ref, qwen25))


#: routed to xgrammar; llguidance enforces it too, so it may hedge there
XGR_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}


def test_a_late_schema_is_served_by_the_hedge(compiler: Compiler, qwen25: Vocabulary) -> None:
    """The routed (xgrammar) compile never finishes -- a Future stands in for a stalled
    native compile, which cannot be produced on demand -- so after ``hedge_s`` llguidance
    compiles the schema and serves the row; the batch never waits ``wait_s``."""
    spec = GrammarSpec.json_schema(XGR_SCHEMA, any_whitespace=False)
    assert compiler.route(spec).backend == "xgrammar"
    stalled: Future[Grammar] = Future()
    with BatchProcessor(compiler, max_batch=2, wait_s=30, hedge_s=0.01) as proc:
        proc.add(0, spec, grammar=stalled)
        proc.add(1, GrammarSpec.choice(["a", "b"]))
        logits = run_step(proc, 2, qwen25)
        info = proc.info(0)
        assert info.status == "active" and info.backend == "guidance", info
        ref = RawReference.of(compiler.compile(spec.with_backend("guidance")), qwen25)
        assert torch.equal(allowed(logits[0]), ref_allowed(ref, qwen25))
        assert proc.status(1) == "active"
    assert not stalled.done()  # the routed compile was left alone (it would fill the cache)


def test_no_hedge_where_the_other_backend_may_not_serve(compiler: Compiler,
                                                      qwen25: Vocabulary) -> None:
    """Strict about a gap llguidance has, or forced onto one backend: the row waits out
    ``wait_s`` alone and fails; the other rows are masked."""
    strict = GrammarSpec.json_schema({"type": "object", "properties": {
        "k": {"type": "integer"}}, "propertyNames": {"enum": ["k", "j"]}}, strict=True)
    assert compiler.route(strict).backend == "xgrammar"
    forced = GrammarSpec.json_schema(XGR_SCHEMA, backend="xgrammar")
    ready = compiler.compile(GrammarSpec.choice(["a", "b"]))  # row 2 never waits on a compile
    with BatchProcessor(compiler, max_batch=3, wait_s=0.2, hedge_s=0.0) as proc:
        proc.add(0, strict, grammar=Future())
        proc.add(1, forced, grammar=Future())
        proc.add(2, ready.spec, grammar=ready)
        logits = run_step(proc, 3, qwen25)
        for row in (0, 1):
            assert proc.status(row) == "error" and "wait_s" in (proc.error(row) or "")
            assert only(logits[row]) == sorted(qwen25.stop_ids)
        assert proc.status(2) == "active" and only(logits[2]) != sorted(qwen25.stop_ids)


class _BrokenGrammar(Grammar):
    """Fault injection: a compiled grammar whose ``matcher()`` raises (stands in for an
    backend bug at attach time, which real grammars do not produce on demand)."""

    def matcher(self) -> Matcher:
        raise RuntimeError("backend exploded")


def test_a_failure_while_attaching_one_row_fails_only_that_row(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    good = compiler.compile(GrammarSpec.choice(["alpha", "beta"]))
    broken = _BrokenGrammar(good.spec, good.backend, good.reason, good.unenforced,
                            good.compile_ms, good.backend_grammar)
    with BatchProcessor(compiler, max_batch=3, **PATIENT) as proc:
        proc.add(0, good.spec, grammar=broken)
        proc.add(1, good.spec, grammar=good)
        from grammask.specs.request import ConstraintRequest

        proc.add(2, ConstraintRequest(good.spec, think_end="\udcff"))  # unencodable marker
        logits = run_step(proc, 3, qwen25)
        assert proc.status(0) == "error" and "exploded" in (proc.error(0) or "")
        assert proc.status(2) == "error" and "thinking gate" in (proc.error(2) or "")
        assert proc.status(1) == "active"
        assert torch.equal(allowed(logits[1]), raw_reference(good, qwen25))


def test_step_on_some_rows_fills_the_rest_when_they_are_needed(
        compiler: Compiler, qwen25: Vocabulary, grammars: list[Grammar]) -> None:
    """``step(rows)`` fills only the rows a host expects to sample; ``wait_masks(rows)``
    fills any it missed, from their unread tokens."""
    with BatchProcessor(compiler, max_batch=3, **PATIENT) as proc:
        outs: list[list[int]] = [[], [], []]
        for row in range(3):
            proc.add(row, SPECS[3], output_ids=outs[row], grammar=grammars[3])
        ids = qwen25.encode("alpha")
        outs[0].append(ids[0])
        outs[2].append(ids[0])
        proc.step([0])
        _, rows = proc.wait_masks([0, 2])
        assert rows == [0, 2] and proc.info(1).constrained_tokens == 0
        ref = RawReference.of(grammars[3], qwen25)
        assert ref.accept(ids[0])
        assert proc.info(0).constrained_tokens == 1 == proc.info(2).constrained_tokens
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.step([1])
        proc.apply(logits)
        assert allowed(logits[0]).all() and allowed(logits[2]).all()  # not this step's rows
        assert torch.equal(allowed(logits[1]), raw_reference(grammars[3], qwen25))


def test_free_policy_leaves_errored_rows_unmasked(compiler: Compiler, qwen25: Vocabulary) -> None:
    with BatchProcessor(compiler, max_batch=2, on_error="free", **PATIENT) as proc:
        proc.add(0, GrammarSpec.regex("(unclosed"))
        proc.add(1, GrammarSpec.regex("[0-9]+"))
        logits = run_step(proc, 2, qwen25)
        assert proc.status(0) == "error" and allowed(logits[0]).all()
        assert not allowed(logits[1]).all()


def test_grammar_compiled_meanwhile_is_used(compiler: Compiler, qwen25: Vocabulary) -> None:
    """A compile that finishes within wait_s: the step waits for it (bounded), no error."""
    spec = GrammarSpec.regex("[a-f]{2,9}z")
    pending: Future[Grammar] = Future()
    with BatchProcessor(compiler, max_batch=1, wait_s=60) as proc:
        proc.add(0, spec, grammar=pending)
        proc.step()
        threading.Thread(target=lambda: pending.set_result(compiler.compile(spec))).start()
        logits = torch.zeros(1, qwen25.vocab_size)
        proc.apply(logits)
        assert proc.status(0) == "active"
        ref = RawReference.of(compiler.compile(spec), qwen25)
        assert torch.equal(allowed(logits[0]), ref_allowed(ref, qwen25))


def ref_words(ref: RawReference, vocab: Vocabulary) -> torch.Tensor:
    assert ref.vocab is vocab
    return ref.words()


def test_churn_against_reference_matchers(grammars: list[Grammar], qwen25: Vocabulary,
                                          compiler: Compiler) -> None:
    """1,000 steps of add/remove/move/swap/rollback and 1-3 tokens per step; every mask of
    every row must equal its own reference matcher's, bit for bit (every 100th step through
    ``apply`` on full logits, else by comparing the bitmask words)."""
    rng = random.Random(20240601)
    batch = 8
    refs: dict[int, RawReference] = {}
    lives: dict[int, list[int] | None] = {}
    counts = {"add": 0, "remove": 0, "move": 0, "swap": 0, "rollback": 0, "multi": 0,
              "ended": 0}

    def pick(words: torch.Tensor) -> int:
        """A random allowed token (stop tokens favoured where allowed)."""
        good = [s for s in qwen25.stop_ids if (int(words[s >> 5]) >> (s & 31)) & 1]
        if good and rng.random() < 0.3:
            return rng.choice(good)
        nz = words.nonzero().flatten().tolist()
        w = rng.choice(nz)
        bits = [b for b in range(32) if (int(words[w]) >> b) & 1]
        return w * 32 + rng.choice(bits)

    with BatchProcessor(compiler, max_batch=batch, think_end=None, **PATIENT) as proc:
        for step in range(1000):
            op = rng.random()
            free = [r for r in range(batch) if r not in refs]
            taken = sorted(refs)
            if op < 0.12 and free:
                row = rng.choice(free)
                g = rng.choice(grammars)
                live: list[int] | None = [] if rng.random() < 0.5 else None
                proc.add(row, g.spec, prompt_ids=[1, 2], output_ids=live)
                refs[row], lives[row] = RawReference.of(g, qwen25), live
                counts["add"] += 1
            elif op < 0.18 and taken:
                row = rng.choice(taken)
                proc.remove(row)
                del refs[row], lives[row]
                counts["remove"] += 1
            elif op < 0.24 and taken:
                src, dst = rng.choice(taken), rng.randrange(batch)
                proc.move(src, dst)
                if src != dst:
                    refs[dst], lives[dst] = refs.pop(src), lives.pop(src)
                counts["move"] += 1
            elif op < 0.30 and taken:
                a, b = rng.choice(taken), rng.randrange(batch)
                proc.swap(a, b)
                ra, la = refs.pop(a), lives.pop(a)
                if b in refs:
                    refs[a], lives[a] = refs.pop(b), lives.pop(b)
                refs[b], lives[b] = ra, la
                counts["swap"] += 1
            proc.step()
            if step % 100 == 0:
                logits = torch.zeros(batch, qwen25.vocab_size)
                proc.apply(logits)
                for row in range(batch):
                    expected = (ref_allowed(refs[row], qwen25) if row in refs else
                                torch.ones(qwen25.vocab_size, dtype=torch.bool))
                    assert torch.equal(allowed(logits[row]), expected), (row, step)
            else:
                bitmask, rows = proc.wait_masks()
                assert rows == sorted(refs), step
                for row in rows:
                    assert torch.equal(bitmask[row], ref_words(refs[row], qwen25)), (row, step)
            for row, ref in refs.items():
                tokens = [pick(ref_words(ref, qwen25))]
                assert ref.accept(tokens[0])
                while rng.random() < 0.25:  # speculative-style: more than one token per step
                    tokens.append(pick(ref_words(ref, qwen25)))
                    assert ref.accept(tokens[-1])
                    counts["multi"] += 1
                counts["ended"] += ref.is_terminated()
                live = lives[row]
                if live is None:
                    proc.advance(row, tokens)
                else:
                    live.extend(tokens)
                if rng.random() < 0.04:
                    n = rng.randint(1, len(tokens) + 1)
                    if proc.info(row).constrained_tokens + len(tokens) >= n:
                        ref.rollback(n)
                        if live is None:
                            proc.rollback(row, n)
                        else:
                            del live[len(live) - n:]
                        counts["rollback"] += 1
        assert proc.errors == {}
    assert min(counts.values()) > 5, counts


class SpyFiller(Filler):
    """The real filler, recording which thread fills and whether the host thread was busy."""

    def __init__(self) -> None:
        super().__init__()
        self.host_busy = threading.Event()
        self.done = threading.Event()
        self.thread: int | None = None
        self.saw_host_busy = False

    def fill(self, entries: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor,
             grouped: BatchFills | None = None) -> None:
        self.thread = threading.get_ident()
        # a fill run inline by step() would wait here in vain: the host is not busy yet
        self.saw_host_busy = self.host_busy.wait(timeout=20)
        super().fill(entries, bitmask, grouped)
        self.done.set()


def test_fill_runs_on_the_worker_during_the_forward(compiler: Compiler, qwen25: Vocabulary) -> None:
    spy = SpyFiller()
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    ref = RawReference.of(compiler.compile(spec), qwen25)
    a = torch.randn(256, 256)
    with BatchProcessor(compiler, max_batch=4, filler=spy, **PATIENT) as proc:
        for row in range(4):
            proc.add(row, spec)
        proc.step()  # returns while the fill job waits for the host to be busy
        spy.host_busy.set()
        matmuls = 0
        while not spy.done.is_set() and matmuls < 1_000_000:
            a = torch.tanh(a @ a)  # the "forward": torch kernels, GIL released inside
            matmuls += 1
        logits = torch.zeros(4, qwen25.vocab_size)
        proc.apply(logits)
        assert spy.saw_host_busy and spy.done.is_set()
        assert spy.thread == proc.fill_thread_id != threading.get_ident()
        assert matmuls >= 1
        assert torch.equal(allowed(logits[3]), ref_allowed(ref, qwen25))


def test_host_mistakes_raise(compiler: Compiler) -> None:
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        with pytest.raises(IndexError):
            proc.add(2, GrammarSpec.regex("a"))
        with pytest.raises(TypeError):
            proc.add(0, "a")  # type: ignore[arg-type]
        proc.add(0, GrammarSpec.regex("a"), output_ids=[])
        with pytest.raises(ValueError, match="live"):
            proc.advance(0, [1])
        with pytest.raises(ValueError, match="outside"):
            proc.step()
            proc.apply(torch.zeros(0, 8))


def test_metrics_count_errors_waits_and_fills(compiler: Compiler, qwen25: Vocabulary) -> None:
    from grammask import metrics

    bad = GrammarSpec.regex("(unclosed")
    failed = failed_compile(compiler, bad)
    ready = compiler.compile(GrammarSpec.choice(["a", "b"]))
    before = metrics.snapshot()
    with BatchProcessor(compiler, max_batch=3, wait_s=0.05) as proc:
        # outcomes known before the step (no real compile races the 50 ms wait_s)
        proc.add(0, bad, grammar=failed)
        proc.add(1, GrammarSpec.choice(["a", "b"], backend="xgrammar"), grammar=Future())
        proc.add(2, ready.spec, grammar=ready)
        run_step(proc, 3, qwen25)
    after = metrics.snapshot()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('grammask_row_errors_total{cause="compile"}') == 1
    assert delta('grammask_row_errors_total{cause="late"}') == 1
    assert delta('grammask_first_mask_wait_seconds_count{outcome="ready"}') == 1
    assert delta('grammask_first_mask_wait_seconds_count{outcome="late"}') == 1
    assert delta("grammask_fill_seconds_count") >= 1



def test_a_server_fault_is_counted_apart_from_the_requests_own_error(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """A compile that timed out or broke inside a backend is the server's fault: its row
    error cause is ``server``, and ``compile`` stays the request's own grammar refused."""
    from grammask import metrics
    from grammask.errors import CompileTimeoutError, InternalCompileError

    faults = []
    for error in (CompileTimeoutError("not compiled within 0.30 s"),
                  InternalCompileError("xgrammar: internal error: MemoryError")):
        future: Future[Grammar] = Future()
        future.set_exception(error)
        faults.append(future)
    before = metrics.snapshot()
    with BatchProcessor(compiler, max_batch=2, wait_s=0.05) as proc:
        for row, future in enumerate(faults):
            proc.add(row, GrammarSpec.regex(f"fault{row}"), grammar=future)
        run_step(proc, 2, qwen25)
        assert "not compiled within" in (proc.error(0) or "")
        assert "MemoryError" in (proc.error(1) or "")
    after = metrics.snapshot()
    key = 'grammask_row_errors_total{cause="%s"}'
    assert after.get(key % "server", 0.0) - before.get(key % "server", 0.0) == 2
    assert after.get(key % "compile", 0.0) == before.get(key % "compile", 0.0)


def test_mapped_and_draft_rows_place_masks_in_the_hosts_row_order(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """A host whose logits rows are not the processor's rows (vLLM V2: slots vs batch order)
    gets each row's mask where it says, and the rows of drafts follow the draft tokens."""
    regex, choice = grammars[2], grammars[3]
    with BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        proc.add(3, regex.spec, grammar=regex)
        proc.add(0, choice.spec, grammar=choice)
        proc.step()
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.apply(logits, Mapped([2, 0], [0, 3]))  # logits row 1: unconstrained
        assert torch.equal(allowed(logits[2]), RawReference.of(choice, qwen25).allowed())
        assert torch.equal(allowed(logits[0]), RawReference.of(regex, qwen25).allowed())
        assert bool(allowed(logits[1]).all())
        a, b = qwen25.encode("ab"), qwen25.encode("1")  # row 3's drafts, then the bonus row
        assert len(a) == 1 and len(b) == 1
        proc.step()
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.apply(logits, AlongDrafts([3, 3, 3], [0, 1, 2], [0, a[0], b[0]]))
        for at, fed in enumerate([[], a, a + b]):
            expected = RawReference.of(regex, qwen25)
            assert all(expected.accept(t) for t in fed)
            assert torch.equal(allowed(logits[at]), expected.allowed()), at
        proc.step()  # the drafts were tentative: the row is still at its start
        logits = torch.zeros(1, qwen25.vocab_size)
        proc.apply(logits, Mapped([0], [3]))
        assert torch.equal(allowed(logits[0]), RawReference.of(regex, qwen25).allowed())


def test_drafts_outgrowing_the_step_bitmask_keep_every_mask(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """Draft positions live in the step's bitmask after the batch's rows. More drafts than
    it has room for: that step takes a larger copy, later steps grown buffers, and every
    position (committed, drafts, bonus) still gets the reference's mask, in logits rows
    the host chose."""
    regex = grammars[2]
    drafts = qwen25.encode("ab") + qwen25.encode("1")  # two draft tokens the regex takes
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(0, regex.spec, grammar=regex)
        proc.add(1, regex.spec, grammar=regex)
        for _ in range(3):
            proc.step()
            logits = torch.zeros(6, qwen25.vocab_size)
            # row 1 at logits rows 5, 3, 1; row 0 at 0, 2, 4 (positions 0, 1, 2)
            proc.apply(logits, AlongDrafts([0, 1, 0, 1, 0, 1], [0, 2, 1, 1, 2, 0],
                              [0, drafts[1], drafts[0], drafts[0], drafts[1], 0]))
            for at, fed in ((0, []), (2, drafts[:1]), (4, drafts), (5, []),
                            (3, drafts[:1]), (1, drafts)):
                expected = RawReference.of(regex, qwen25)
                assert all(expected.accept(t) for t in fed)
                assert torch.equal(allowed(logits[at]), expected.allowed()), at
        assert proc.errors == {}


def test_draft_positions_sit_right_above_the_rows_in_use(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse batch (one request in slot 1 of 64) with drafts: the draft positions take
    the bitmask rows right above slot 1, so the apply (and a device copy of the rows it
    reads) spans 4 rows, not the 64 of every slot; the masks match the reference."""
    import grammask.decode.step_apply as step_apply_module

    seen: list[list[int]] = []
    real = step_apply_module.apply_pairs

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, at: Any, rows: Any,
            **kwargs: Any) -> Any:
        seen.append([int(r) for r in rows])
        return real(logits, bitmask, at, rows, **kwargs)

    monkeypatch.setattr(step_apply_module, "apply_pairs", spy)
    regex = grammars[2]
    drafts = qwen25.encode("ab") + qwen25.encode("1")
    with BatchProcessor(compiler, max_batch=64, **PATIENT) as proc:
        proc.add(1, regex.spec, grammar=regex)
        proc.step()
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.apply(logits, AlongDrafts([1, 1, 1], [0, 1, 2], [0, *drafts]))
        for at, fed in enumerate([[], drafts[:1], drafts]):
            expected = RawReference.of(regex, qwen25)
            assert all(expected.accept(t) for t in fed)
            assert torch.equal(allowed(logits[at]), expected.allowed()), at
    assert seen == [[1, 2, 3]]


def test_draft_rows_mask_committed_positions_through_the_steps_plan(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the fill job plans (CPU logits, a forward long enough), the committed positions
    of an ``AlongDrafts`` apply take the step's plan moved to their logits rows (``apply_pairs``),
    beside draft positions from the drafts' own buffer, with the masks of the reference.
    The forward is 80 ms on a stand-in clock (``ThreadClock``), on which the job takes
    none: it plans from the second step, however long it really takes."""
    import grammask.decode.stepjob as stepjob
    import grammask.kernels.apply as apply_module

    clock = ThreadClock(monkeypatch, stepjob)
    real = apply_module._apply_plan_moved
    moved: list[int] = []

    def counted(*args: Any) -> None:
        moved.append(1)
        real(*args)

    monkeypatch.setattr(apply_module, "_apply_plan_moved", counted)
    regex, choice = grammars[2], grammars[3]
    a, b = qwen25.encode("ab"), qwen25.encode("1")
    with BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        proc.add(3, regex.spec, grammar=regex)
        proc.add(1, choice.spec, grammar=choice)
        for _ in range(3):
            proc.step([1, 3])
            clock.advance(0.08)  # the forward the job overlaps (planning fits in it)
            logits = torch.zeros(5, qwen25.vocab_size)
            # row 1 at logits row 0 (no drafts); logits row 1: no request; row 3 at 2, 3, 4
            proc.apply(logits, AlongDrafts([1, -1, 3, 3, 3], [0, 0, 0, 1, 2],
                              [0, 0, 0, a[0], b[0]]))
            assert torch.equal(allowed(logits[0]), RawReference.of(choice, qwen25).allowed())
            assert bool(allowed(logits[1]).all())
            for at, fed in zip((2, 3, 4), ([], a, a + b), strict=True):
                expected = RawReference.of(regex, qwen25)
                assert all(expected.accept(t) for t in fed)
                assert torch.equal(allowed(logits[at]), expected.allowed()), at
        assert len(moved) == 2  # the first job had no logits layout to plan for
        assert proc.errors == {}


def test_a_draft_failure_masks_the_committed_position_too(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while filling a row's draft positions fails that row alone: every one of its
    positions, the committed one included, gets the error mask (stop only), whatever the
    step had filled there; the other row keeps its mask."""
    from grammask.decode.step_apply import Drafts

    regex, choice = grammars[2], grammars[3]
    real = Drafts._fill_position

    def broken(self: Drafts, r: Any, out: torch.Tensor, target: int) -> None:
        if r.grammar is regex:
            raise RuntimeError("injected")
        real(self, r, out, target)

    monkeypatch.setattr(Drafts, "_fill_position", broken)
    a = qwen25.encode("ab")
    stops = torch.zeros(qwen25.vocab_size, dtype=torch.bool)
    stops[list(qwen25.stop_ids)] = True
    with BatchProcessor(compiler, max_batch=4, **PATIENT) as proc:
        proc.add(3, regex.spec, grammar=regex)
        proc.add(1, choice.spec, grammar=choice)
        proc.step([1, 3])
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.apply(logits, AlongDrafts([3, 3, 1], [0, 1, 0], [0, a[0], 0]))
        assert "injected" in (proc.error(3) or "")
        assert torch.equal(allowed(logits[0]), stops)
        assert torch.equal(allowed(logits[1]), stops)
        assert torch.equal(allowed(logits[2]), RawReference.of(choice, qwen25).allowed())


def test_a_removed_rows_matcher_serves_the_next_request_from_the_start(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """A row that leaves gives its xgrammar matcher back (``Matcher.release``); the next
    request of the grammar gets it reset: its masks follow its own reference from the start,
    and the old row's matcher refuses any use."""
    spec = GrammarSpec.choice(["alpha", "beta", "gamma"], backend="xgrammar")
    grammar = compiler.compile(spec)
    with BatchProcessor(compiler, max_batch=2, think_end=None, **PATIENT) as proc:
        proc.add(0, spec, grammar=grammar)
        proc.advance(0, qwen25.encode("beta"))
        proc.step()
        proc.wait_masks()
        made = proc._table.made(0)
        assert made is not None
        old = made.matcher
        assert old is not None
        native = old.native  # type: ignore[attr-defined]
        proc.remove(0)
        proc.add(1, spec, grammar=grammar)
        ref = RawReference.of(grammar, qwen25)
        for text in ["", "g", "amma"]:
            if text:
                proc.advance(1, qwen25.encode(text))
                assert all(ref.accept(t) for t in qwen25.encode(text))
            proc.step()
            bitmask, rows = proc.wait_masks()
            assert rows == [1]
            assert torch.equal(bitmask[1], ref_words(ref, qwen25)), text
        with pytest.raises(RuntimeError, match="released"):  # by the first job after it left
            old.accept(qwen25.stop_ids[0])
        again = proc._table.made(1)
        assert again is not None and again.matcher is not None
        assert again.matcher.native is native  # type: ignore[attr-defined]
