"""The bytes of a Hugging Face token: how a vocabulary spells them, and how to undo it.

A tokenizer's vocabulary (``tokenizer.get_vocab()``) does not hold the bytes a token stands
for but a spelling of them, one of three kinds (``VocabType``, named as xgrammar names them):

- ``BYTE_LEVEL`` (GPT-2, Qwen, Llama-3): every byte is spelled by one of 256 printable
  characters (GPT-2's ``bytes_to_unicode``: the printable Latin-1 bytes ``!``..``~``,
  ``¡``..``¬``, ``®``..``ÿ`` stand for themselves, the other 68 bytes, in order, for
  ``U+0100``..``U+0143``; ``Ġ`` is a space, ``Ċ`` a newline). A token is decoded character by
  character; a token with any character outside that alphabet (an added token with a space,
  ``"a b"``) stands for its own UTF-8 bytes, whole.
- ``BYTE_FALLBACK`` (sentencepiece with byte fallback: Llama-2, Mistral): a token of exactly
  the six characters ``<0xNN>`` (two hex digits) is the byte ``0xNN``; in every other token
  each ``▁`` (U+2581) is a space; the rest is UTF-8.
- ``RAW`` (tiktoken files, vocabularies with no byte spelling): the token's own UTF-8 bytes
  (a token given as ``bytes``, as tiktoken-backed tokenizers give them, stays as it is).

Which kind a vocabulary is follows xgrammar 0.2.8's ``TokenizerInfo.from_huggingface``,
taken apart here so that no low-level module needs the xgrammar engine to learn a token's
bytes: ``vocab_type_from_tokenizer_json`` reads the ``"decoder"`` field of a fast
tokenizer's ``tokenizer.json``, ``vocab_type_from_vocab`` looks at the vocabulary itself and,
where it is decisive, wins (``grammask.vocab`` probes the tokenizer object for the rest).

Where these decoders and xgrammar's C++ ones (``TokenDecoder`` in ``tokenizer_info.cc``)
part, on tokens no real vocabulary has: xgrammar reads the two digits of ``<0xNN>`` as
upper-case hex only (``<0x0a>`` becomes ``*``; ``<0xZZ>`` and the like raise a
``RuntimeError`` for the whole vocabulary), where these read either case as the byte (as the
``tokenizers`` ``ByteFallback`` decoder does) and leave a token that is not two hex digits
as text; xgrammar's byte-level decoder stops at a NUL character (``"a\\x00b"`` becomes
``a``, ``"\\x00"`` empty) and accepts overlong UTF-8 in a token given as ``bytes``, where
these keep such a token's bytes whole, as ``tokenizers``' ``ByteLevel`` decoder does.

Standard library only: this module imports nothing of grammask and no tokenizer library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import Enum
from typing import Any


class VocabType(Enum):
    """How a vocabulary spells its tokens' bytes (xgrammar's ``VocabType``, same names)."""

    RAW = "raw"
    BYTE_FALLBACK = "byte_fallback"
    BYTE_LEVEL = "byte_level"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (``transformers`` ``bytes_to_unicode``)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


#: character of the byte-level alphabet -> the byte it spells (256 entries)
BYTE_LEVEL_CHARS: Mapping[str, int] = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_LEVEL_ALPHABET = frozenset(BYTE_LEVEL_CHARS)
#: ``str.translate`` table: each alphabet character to the Latin-1 character of its byte
_BYTE_LEVEL_TRANSLATE = {ord(c): b for c, b in BYTE_LEVEL_CHARS.items()}
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_SPACE_MARK = "\u2581".encode()  # ▁, sentencepiece's space


def decode_byte_level(token: str | bytes) -> bytes:
    """A byte-level token's bytes: each character of GPT-2's alphabet to its byte; a token
    with any other character (or, given as ``bytes``, not valid UTF-8) stands for itself."""
    if isinstance(token, bytes):
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            return token
    else:
        text = token
    if not _BYTE_LEVEL_ALPHABET.issuperset(text):
        return text.encode("utf-8")
    return text.translate(_BYTE_LEVEL_TRANSLATE).encode("latin-1")


def decode_byte_fallback(token: str | bytes) -> bytes:
    """A byte-fallback token's bytes: ``<0xNN>`` is the byte ``0xNN``; elsewhere ``▁`` is a
    space."""
    raw = token if isinstance(token, bytes) else token.encode("utf-8")
    if (len(raw) == 6 and raw.startswith(b"<0x") and raw.endswith(b">")
            and raw[3] in _HEX_DIGITS and raw[4] in _HEX_DIGITS):
        return bytes([int(raw[3:5], 16)])
    return raw.replace(_SPACE_MARK, b" ")


def decode_token(token: str | bytes, vocab_type: VocabType) -> bytes:
    """The bytes ``token`` (as the vocabulary spells it) stands for."""
    if vocab_type is VocabType.BYTE_LEVEL:
        return decode_byte_level(token)
    if vocab_type is VocabType.BYTE_FALLBACK:
        return decode_byte_fallback(token)
    return token if isinstance(token, bytes) else token.encode("utf-8")


def decode_vocab(vocab: Mapping[Any, int], size: int, vocab_type: VocabType) -> list[bytes]:
    """The bytes of ids ``0..size-1`` of ``vocab`` (``get_vocab()``: spelling -> id), as
    xgrammar lays them out: an id no token has is ``b""``, a token at or past ``size`` is
    left out."""
    spelled: list[str | bytes] = [""] * size
    for token, tid in vocab.items():
        if tid < size:
            spelled[tid] = token
    return [decode_token(t, vocab_type) for t in spelled]


def vocab_type_from_tokenizer_json(text: str) -> VocabType:
    """The kind the ``"decoder"`` of a ``tokenizer.json`` declares: the first ``ByteLevel``
    or ``ByteFallback`` decoder, itself or in a top-level ``Sequence`` (a nested
    ``Sequence`` is not looked into), decides; ``RAW`` when there is neither.

    As xgrammar (which logs a warning there): a missing or malformed ``"decoder"`` (not an
    object, no string ``"type"``, a ``Sequence`` without a ``"decoders"`` list, an entry
    that is not an object with a string ``"type"`` before any byte decoder) gives ``RAW``.
    Text that is not a JSON object raises ``ValueError`` (xgrammar: ``RuntimeError``)."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"tokenizer.json is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError("tokenizer.json is not a JSON object")
    decoder = obj.get("decoder")
    if not isinstance(decoder, dict) or not isinstance(decoder.get("type"), str):
        return VocabType.RAW
    if decoder["type"] == "Sequence":
        decoders = decoder.get("decoders")
        if not isinstance(decoders, list):
            return VocabType.RAW
    else:
        decoders = [decoder]
    for entry in decoders:
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            return VocabType.RAW
        if entry["type"] == "ByteLevel":
            return VocabType.BYTE_LEVEL
        if entry["type"] == "ByteFallback":
            return VocabType.BYTE_FALLBACK
    return VocabType.RAW


def vocab_type_from_vocab(vocab: Mapping[Any, int]) -> VocabType | None:
    """The kind a vocabulary's own tokens prove, or None when they prove neither byte
    spelling (xgrammar's ``_detect_vocab_type_from_vocab``, the same thresholds):

    - ``BYTE_FALLBACK`` when at least 128 of the 256 pieces ``<0x00>``..``<0xFF>`` are tokens;
    - else ``BYTE_LEVEL`` when at least 128 of the 256 alphabet characters are tokens on
      their own and at least 99% of all tokens are spelled in the alphabet alone (added
      tokens such as ``<|im_start|>`` are, a few others need not be).
    """
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        return VocabType.BYTE_FALLBACK
    if sum(c in vocab for c in _BYTE_LEVEL_ALPHABET) < 128:
        return None
    # an empty token counts (as in xgrammar's ``all(...)``), a non-empty ``bytes`` one not
    in_alphabet = sum(1 for t in vocab
                      if not t or (isinstance(t, str) and _BYTE_LEVEL_ALPHABET.issuperset(t)))
    if in_alphabet >= 0.99 * len(vocab):
        return VocabType.BYTE_LEVEL
    return None
