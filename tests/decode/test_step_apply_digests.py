"""Mask digests: two processors fed the same requests record identical digests; one with an
injected fault (one allowed token refused) is caught by ``compare``."""

from __future__ import annotations

from pathlib import Path

import torch

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.decode.processor import BatchProcessor
from grammask.decode.step_apply import MaskDigests, compare

SPECS = [GrammarSpec.regex("(ab|cd)[0-9]{1,3}", backend="guidance"),
         GrammarSpec.choice(["red", "green"], backend="xgrammar")]


def _run(compiler: Compiler, vocab: Vocabulary, digests: MaskDigests) -> list[torch.Tensor]:
    proc = BatchProcessor(compiler, max_batch=2, digests=digests)
    outputs: list[list[int]] = [[], []]
    seen = []
    try:
        for row, spec in enumerate(SPECS):
            proc.add(row, spec, output_ids=outputs[row])
        for text in (("a", "g"), ("b", "r")):
            proc.step()
            logits = torch.zeros(2, vocab.vocab_size)
            proc.apply(logits)
            seen.append(torch.isfinite(logits))
            for row, piece in enumerate(text):
                outputs[row].append(vocab.token_id(piece))
    finally:
        proc.close()
    return seen


def test_agreeing_processors_have_identical_records(compiler: Compiler, qwen25: Vocabulary,
                                                    tmp_path: Path) -> None:
    _run(compiler, qwen25, MaskDigests(tmp_path, 0))
    _run(compiler, qwen25, MaskDigests(tmp_path / "other", 1))
    for path in (tmp_path / "other").iterdir():
        path.rename(tmp_path / path.name)
    found = compare(tmp_path)
    assert found.ranks == 2 and found.shared == 4 and found.agree, found


def test_a_fault_of_one_token_is_caught(compiler: Compiler, qwen25: Vocabulary,
                                        tmp_path: Path) -> None:
    good = _run(compiler, qwen25, MaskDigests(tmp_path, 0))
    bad = _run(compiler, qwen25, MaskDigests(tmp_path / "other", 1, fault=True))
    # the fault is real (one allowed token fewer per row) and the digests see it
    assert all(int(g.sum()) - int(b.sum()) == 2 for g, b in zip(good, bad, strict=True))
    for path in (tmp_path / "other").iterdir():
        path.rename(tmp_path / path.name)
    found = compare(tmp_path)
    assert not found.agree and len(found.differing) == found.shared == 4, found


def test_rows_served_by_two_backends_are_keyed_apart() -> None:
    """A request served by the hedge or a fallback may be masked differently at the same
    prefix than one served as routed: its digests must not be compared with the other's."""
    from grammask.decode.step_apply import row_key

    assert row_key("spec", [1, 2], "xgrammar") != row_key("spec", [1, 2], "guidance")
    assert row_key("spec", [1, 2], "xgrammar") == row_key("spec", [1, 2], "xgrammar")
