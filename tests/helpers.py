"""Small test helpers: feed text through a matcher, read mask bits."""

from __future__ import annotations

import torch

from grammask import Vocabulary, allocate_bitmask
from grammask.backends import Matcher


def feed(matcher: Matcher, vocab: Vocabulary, text: str) -> bool:
    """Accept the tokenization of ``text``; True when every token was accepted."""
    return all(matcher.accept(t) for t in vocab.encode(text))


def accepts_complete(matcher: Matcher, vocab: Vocabulary, text: str) -> bool:
    """``text`` is accepted to the end and a stop token is allowed after it."""
    return feed(matcher, vocab, text) and matcher.accept(vocab.stop_ids[0])


def mask_of(matcher: Matcher, vocab: Vocabulary) -> torch.Tensor:
    bm = allocate_bitmask(1, vocab.vocab_size)
    matcher.fill(bm, 0)
    return bm[0]


def bit(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
