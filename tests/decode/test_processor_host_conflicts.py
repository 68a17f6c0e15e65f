"""The grammar wins over the host's own processors: a row they left with no token the
grammar allows gets the grammar's tokens back, never an arbitrary one (``host_masks`` rows).
Expected masks come from the raw backend (``RawReference``), not from grammask."""

from __future__ import annotations

import torch

from grammask import AlongDrafts, Compiler, ConstraintRequest, GrammarSpec, Vocabulary
from grammask.decode.processor import BatchProcessor

from ..helpers import RawReference

CHOICE = GrammarSpec.choice(["red", "green"], backend="xgrammar")


def _host_forbids(logits: torch.Tensor, row: int, ids: list[int]) -> None:
    """What vLLM's min_tokens / allowed_token_ids / bad_words do before our mask."""
    logits[row, ids] = float("-inf")


def test_min_tokens_against_a_finished_grammar(compiler: Compiler, qwen25: Vocabulary) -> None:
    """Row 0 finished "green" (only stops allowed) and the host hides the stops (min_tokens):
    the stops come back. Row 1, the same without ``host_masks``, is left as the host made
    it (the documented cost: hosts flag rows whose options can forbid tokens). Row 2 keeps
    an allowed token the host did not touch: unchanged."""
    grammar = compiler.compile(CHOICE)
    done = [*qwen25.encode("green")]
    proc = BatchProcessor(compiler, max_batch=3)
    try:
        for row, flag in ((0, True), (1, False)):
            proc.add(row, CHOICE, output_ids=list(done), grammar=grammar, host_masks=flag)
        proc.add(2, CHOICE, output_ids=[], grammar=grammar, host_masks=True)
        ref_done = RawReference.of(grammar, qwen25)
        for t in done:
            assert ref_done.accept(t)
        stops = sorted(ref_done.allowed().nonzero().flatten().tolist())
        assert stops and all(t in qwen25.stop_ids for t in stops)
        proc.step()
        logits = torch.zeros(3, qwen25.vocab_size)
        _host_forbids(logits, 0, list(qwen25.stop_ids))
        _host_forbids(logits, 1, list(qwen25.stop_ids))
        _host_forbids(logits, 2, qwen25.encode("red")[:1])
        proc.apply(logits)
        assert sorted(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == stops
        assert float(logits[0, stops[0]]) == 0.0
        assert not torch.isfinite(logits[1]).any()
        fresh = RawReference.of(grammar, qwen25).allowed()
        fresh[qwen25.encode("red")[0]] = False
        assert torch.equal(torch.isfinite(logits[2]), fresh)
    finally:
        proc.close()


def test_allowed_token_ids_disjoint_from_the_grammar(compiler: Compiler,
                                                     qwen25: Vocabulary) -> None:
    """The host allows only tokens the grammar refuses: the grammar's first tokens come back
    (uniform), the host's tokens stay out."""
    spec = GrammarSpec.regex("[a-c]{3}", backend="guidance")
    grammar = compiler.compile(spec)
    host_ids = [qwen25.token_id(t) for t in ("x", "y", "z")]
    proc = BatchProcessor(compiler, max_batch=1)
    try:
        proc.add(0, spec, output_ids=[], grammar=grammar, host_masks=True)
        proc.step()
        logits = torch.full((1, qwen25.vocab_size), float("-inf"))
        logits[0, host_ids] = 1.0
        proc.apply(logits)
        want = RawReference.of(grammar, qwen25).allowed()
        assert torch.equal(torch.isfinite(logits[0]), want)
        assert not torch.isfinite(logits[0, host_ids]).any()
    finally:
        proc.close()


def test_rows_that_ask_are_restored_whatever_else_the_batch_holds(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """The apply skips the restore's pass while no row asks for it
    (``HostLogits.host_masks_added``); a row that asks is still restored when it joins after a
    plain row, when a plain row joins after it, after a move, and after a step where it was
    not masked (thinking) and only a plain row was. Once the rows that asked have left, the
    pass is skipped again."""
    grammar = compiler.compile(CHOICE)
    done = [*qwen25.encode("green")]
    stops = list(qwen25.stop_ids)
    marker = "Z"
    assert len(qwen25.encode(marker)) == 1
    thinking = ConstraintRequest(CHOICE, think_end=marker)
    proc = BatchProcessor(compiler, max_batch=4)

    def step(restored: list[int], plain: list[int]) -> None:
        """Every constrained row is finished (stop-only) and the host hides the stops."""
        proc.step()
        logits = torch.zeros(4, qwen25.vocab_size)
        for row in restored + plain:
            _host_forbids(logits, row, stops)
        proc.apply(logits)
        for row in restored:
            assert only_finite(logits[row]) == sorted(stops), row
        for row in plain:
            assert not torch.isfinite(logits[row]).any(), row

    try:
        proc.add(0, CHOICE, output_ids=list(done), grammar=grammar)
        step([], [0])
        assert not proc._logits._host_masks_seen
        proc.add(1, CHOICE, output_ids=list(done), grammar=grammar, host_masks=True)
        step([1], [0])
        proc.add(2, CHOICE, output_ids=list(done), grammar=grammar)
        step([1], [0, 2])
        proc.move(1, 0)  # row 0's plain request is dropped
        step([0], [2])
        proc.add(3, thinking, grammar=grammar, host_masks=True)
        proc.remove(0)
        step([], [2])  # row 3 thinks (not masked): only plain row 2 is
        proc.advance(3, [qwen25.token_id(marker), *done])
        step([3], [2])
        proc.remove(3)
        step([], [2])
        assert not proc._logits._host_masks_seen
    finally:
        proc.close()


def only_finite(row: torch.Tensor) -> list[int]:
    return sorted(torch.isfinite(row).nonzero().flatten().tolist())


def test_draft_positions_are_restored_too(compiler: Compiler, qwen25: Vocabulary) -> None:
    """Speculative decoding (``AlongDrafts``): at the committed position and at each draft
    position of a ``host_masks`` row, logits the host left with no grammar token get the
    grammar's tokens of that position back; a row without the flag is left as the host made
    it."""
    spec = GrammarSpec.regex("[a-c]{3}", backend="xgrammar")
    grammar = compiler.compile(spec)
    drafts = [qwen25.token_id("a"), qwen25.token_id("c")]
    proc = BatchProcessor(compiler, max_batch=2)
    try:
        proc.add(0, spec, output_ids=[], grammar=grammar, host_masks=True)
        proc.add(1, spec, output_ids=[], grammar=grammar, host_masks=False)
        proc.step()
        # row 0 at logits rows 0 (committed), 1 (after "a") and 2 (the bonus, after "ac");
        # row 1 at logits row 3 (committed)
        logits = torch.full((4, qwen25.vocab_size), float("-inf"))
        proc.apply(logits, AlongDrafts([0, 0, 0, 1], [0, 1, 2, 0], [0, *drafts, 0]))
        for at in range(3):
            want = RawReference.of(grammar, qwen25)
            assert all(want.accept(t) for t in drafts[:at])
            assert torch.equal(torch.isfinite(logits[at]), want.allowed()), at
        assert not torch.isfinite(logits[3]).any()
    finally:
        proc.close()
