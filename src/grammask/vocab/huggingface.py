"""How a Hugging Face tokenizer spells its tokens' bytes (``hf_vocab_type``), told apart as
xgrammar 0.2.8 tells them, without importing an engine: ``transformers``, ``tiktoken`` and
``sentencepiece`` are probed only when installed (``isinstance`` checks on the object)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidSpecError
from .token_bytes import VocabType, vocab_type_from_tokenizer_json, vocab_type_from_vocab


def hf_vocab_type(tokenizer: Any, vocab: Mapping[Any, int]) -> VocabType:
    """How a Hugging Face tokenizer spells its tokens' bytes, decided as xgrammar 0.2.8's
    ``TokenizerInfo.from_huggingface`` decides it (same branches, same order):

    - a fast tokenizer (``PreTrainedTokenizerFast``): what its vocabulary proves
      (``vocab_type_from_vocab``: 128+ ``<0xNN>`` pieces, or a byte-level alphabet), else what
      the ``"decoder"`` of its ``backend_tokenizer``'s JSON declares (``RAW`` by default;
      xgrammar reads the JSON either way, and would raise were it not JSON);
    - a tiktoken one (when ``tiktoken`` imports: a ``tokenizer`` attribute that is a
      ``tiktoken.Encoding``, or a ``vocab_files_names["vocab_file"]`` naming ``tiktoken``):
      ``BYTE_LEVEL`` when ``encode(" ")`` (special tokens as the tokenizer adds them) begins
      with the token ``Ġ`` (Kimi-K2), else ``RAW`` (Qwen-7B-Chat, Phi-3-small);
    - a sentencepiece one (when ``sentencepiece`` imports: an ``sp_model``, a
      ``tokenizer.sp_model`` or a ``tok`` that is a ``SentencePieceProcessor``):
      ``BYTE_FALLBACK`` when ``<0x0A>`` is a token, else ``RAW``;
    - anything else raises ``InvalidSpecError`` (a ``ValueError``, as xgrammar's).
    """
    if _is_fast_tokenizer(tokenizer):
        # the vocabulary first: where it proves a spelling, the (large) JSON need not be read
        proven = vocab_type_from_vocab(vocab)
        if proven is not None:
            return proven
        return vocab_type_from_tokenizer_json(tokenizer.backend_tokenizer.to_str())
    encoding = _optional("tiktoken", "Encoding")
    if encoding is not None:
        files = getattr(tokenizer, "vocab_files_names", None)
        if (isinstance(getattr(tokenizer, "tokenizer", None), encoding)
                or (files is not None and "vocab_file" in files
                    and "tiktoken" in files["vocab_file"])):
            ids = tokenizer.encode(" ")
            if len(ids) >= 1 and tokenizer.convert_ids_to_tokens(ids)[0] == "Ġ":
                return VocabType.BYTE_LEVEL
            return VocabType.RAW
    processor = _optional("sentencepiece", "SentencePieceProcessor")
    if processor is not None:
        nested = getattr(tokenizer, "tokenizer", None)
        if (isinstance(getattr(tokenizer, "sp_model", None), processor)
                or isinstance(getattr(nested, "sp_model", None), processor)
                or isinstance(getattr(tokenizer, "tok", None), processor)):
            return VocabType.BYTE_FALLBACK if "<0x0A>" in vocab else VocabType.RAW
    raise InvalidSpecError(f"Unsupported tokenizer type: {type(tokenizer)}",
                           where="tokenizer")


def _is_fast_tokenizer(tokenizer: Any) -> bool:
    fast = _optional("transformers", "PreTrainedTokenizerFast")
    return fast is not None and isinstance(tokenizer, fast)


def _optional(module: str, name: str) -> Any:
    """``module.name``, or None when ``module`` is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None
