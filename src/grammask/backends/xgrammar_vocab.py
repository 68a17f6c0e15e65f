"""xgrammar's view of a vocabulary (its ``TokenizerInfo``), kept on the vocabulary
(``Vocabulary.view``). Its own module because both ``xgrammar`` (compiles) and
``xgrammar_disk`` (loads) need it, and the one imports the other."""

from __future__ import annotations

import xgrammar as xgr

from ..vocab import Vocabulary

_KEY = "xgrammar.tokenizer_info"


def tokenizer_info(vocab: Vocabulary) -> xgr.TokenizerInfo:
    """xgrammar's tokenizer for ``vocab``, built once per vocabulary (seconds)."""
    return vocab.view(_KEY, _make)


def _make(vocab: Vocabulary) -> xgr.TokenizerInfo:
    """Specials other than the stops get an empty spelling (xgrammar then treats them as
    special: never inside constrained text). Stop tokens keep a non-empty spelling so xgrammar
    does not fold them into specials; they are allowed only at the end, through
    ``stop_token_ids``."""
    blank = vocab.special_ids - set(vocab.stop_ids)
    encoded = [b"" if i in blank else tok for i, tok in enumerate(vocab.tokens)]
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
        stop_token_ids=list(vocab.stop_ids), add_prefix_space=False,
    )
