"""``decode/step_apply``: a step's masks into the host's logits along speculative drafts, and a
step's later applies (vLLM 0.34's request chunks) taking that step's masks. Expected masks come
from the raw backend (``RawReference``)."""

from __future__ import annotations

import torch

from grammask import AlongDrafts, Compiler, GrammarSpec, Mapped, Vocabulary
from grammask.decode.processor import BatchProcessor

from ..helpers import PATIENT, RawReference

REGEX = GrammarSpec.regex("(ab|cd)[0-9]{1,3}", backend="xgrammar")


def allowed(row: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(row)


def test_after_a_refused_draft_every_later_position_repeats_the_last_valid_mask(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    grammar = compiler.compile(REGEX)
    ab, refused, digit = qwen25.encode("ab"), qwen25.encode("x"), qwen25.encode("1")
    assert len(ab) == len(refused) == len(digit) == 1
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(0, REGEX, grammar=grammar)
        proc.step()
        logits = torch.zeros(4, qwen25.vocab_size)
        # drafts: "ab" (taken), "x" (refused), "1" (after a refusal), then the bonus row
        proc.apply(logits, AlongDrafts([0, 0, 0, 0], [0, 1, 2, 3],
                                       [0, ab[0], refused[0], digit[0]]))
        start = RawReference.of(grammar, qwen25)
        after_ab = RawReference.of(grammar, qwen25)
        assert after_ab.accept(ab[0])
        assert not bool(after_ab.allowed()[refused[0]])  # the reference refuses the draft
        assert torch.equal(allowed(logits[0]), start.allowed())
        for at in (1, 2, 3):  # the refused draft and everything after: the last valid mask
            assert torch.equal(allowed(logits[at]), after_ab.allowed()), at
        assert proc.errors == {}  # a refused draft is the sampler's to reject, not an error


def test_a_step_applied_in_chunks_masks_as_one_apply(compiler: Compiler,
                                                     qwen25: Vocabulary) -> None:
    grammars = [compiler.compile(REGEX),
                compiler.compile(GrammarSpec.choice(["red", "green"], backend="guidance"))]
    whole = torch.zeros(2, qwen25.vocab_size)
    chunks = torch.zeros(2, qwen25.vocab_size)
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        for row, grammar in enumerate(grammars):
            proc.add(row, grammar.spec, grammar=grammar)
        proc.step()
        proc.apply(whole, Mapped([0, 1], [0, 1]))
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        for row, grammar in enumerate(grammars):
            proc.add(row, grammar.spec, grammar=grammar)
        proc.step()
        proc.apply(chunks[0:1], Mapped([0], [0]))  # one apply per chunk of requests
        proc.apply(chunks[1:2], Mapped([0], [1]))
    for row, grammar in enumerate(grammars):
        expected = RawReference.of(grammar, qwen25).allowed()
        assert torch.equal(allowed(whole[row]), expected)
        assert torch.equal(allowed(chunks[row]), expected)


def test_logits_rows_of_no_sampling_row_are_left_alone(compiler: Compiler,
                                                       qwen25: Vocabulary) -> None:
    grammar = compiler.compile(REGEX)
    with BatchProcessor(compiler, max_batch=2, **PATIENT) as proc:
        proc.add(1, REGEX, grammar=grammar)
        proc.step()
        logits = torch.zeros(3, qwen25.vocab_size)
        proc.apply(logits, AlongDrafts([-1, 1, 0], [0, 0, 0], [0, 0, 0]))
    assert bool(allowed(logits[0]).all()) and bool(allowed(logits[2]).all())
    assert torch.equal(allowed(logits[1]), RawReference.of(grammar, qwen25).allowed())
