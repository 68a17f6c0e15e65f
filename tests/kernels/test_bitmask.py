"""``kernels/bitmask``: the bitmask layout (bit set = allowed, 32 tokens a word, all allowed at
the start) and tensors that stay writable whatever inference mode the host calls under."""

from __future__ import annotations

import threading

import pytest
import torch

from grammask.kernels.bitmask import allocate_bitmask, allowed_ids, bitmask_words


@pytest.mark.parametrize(("vocab", "words"), [(1, 1), (32, 1), (33, 2), (151_665, 4740)])
def test_words_per_row(vocab: int, words: int) -> None:
    assert bitmask_words(vocab) == words
    assert allocate_bitmask(3, vocab).shape == (3, words)


def test_a_new_bitmask_allows_every_token_and_bits_read_back() -> None:
    mask = allocate_bitmask(2, 70)
    assert mask.dtype == torch.int32 and allowed_ids(mask[0], 70) == list(range(70))
    mask[1].zero_()
    for token in (0, 31, 32, 69):  # word boundaries, the sign bit of a word
        mask[1, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    assert allowed_ids(mask[1], 70) == [0, 31, 32, 69]


@pytest.mark.parametrize(("batch", "vocab"), [(-1, 10), (1, 0)])
def test_bad_shapes_are_refused(batch: int, vocab: int) -> None:
    with pytest.raises(ValueError, match="bad bitmask shape"):
        allocate_bitmask(batch, vocab)


def test_made_under_inference_mode_it_is_writable_from_another_thread() -> None:
    with torch.inference_mode():
        mask = allocate_bitmask(1, 64)
    assert not mask.is_inference()
    errors: list[BaseException] = []

    def write() -> None:  # the fill thread: not in the host's mode
        try:
            mask[0, 0] = 0
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert errors == [] and allowed_ids(mask[0], 64) == list(range(32, 64))
