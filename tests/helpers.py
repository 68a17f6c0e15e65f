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

#: First-mask budgets out of reach, for tests about masks rather than latency: on two loaded
#: CI cores a compile may take longer than the production ``wait_s`` / ``hedge_s``, and a
#: hedge would serve another engine's (equally valid, differently styled) grammar.
PATIENT: dict[str, float] = {"wait_s": 120.0, "hedge_s": 60.0}
