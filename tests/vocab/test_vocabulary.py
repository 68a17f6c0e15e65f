"""Vocabularies: sizes, special and stop ids, and that specials never leak into text."""

from __future__ import annotations

import pytest
import torch

from grammask import Compiler, GrammarSpec, InvalidSpecError, Vocabulary, load_vocabulary
from grammask.backends.guidance import native_tokenizer, tokenizer_view
from grammask.specs.grammar_spec import BackendName

from ..helpers import bit, feed, mask_of


def test_qwen25_embedded_default(qwen25: Vocabulary) -> None:
    assert len(qwen25.tokens) == 151_665 and qwen25.vocab_size == 151_936
    assert qwen25.token_id("<|endoftext|>") == 151_643
    assert qwen25.token_id("<|im_start|>") == 151_644
    assert qwen25.token_id("<|file_sep|>") == 151_664  # the 22nd real Qwen2.5 special
    assert qwen25.stop_ids == (151_645, 151_643)
    assert qwen25.think_end is None
    assert qwen25.decode(qwen25.encode('{"a": 1}')) == b'{"a": 1}'


def test_qwen36_embedded(qwen36: Vocabulary) -> None:
    assert len(qwen36.tokens) == 248_077 and qwen36.vocab_size == 248_320
    assert qwen36.token_id("<think>") == 248_068 and qwen36.token_id("</think>") == 248_069
    assert qwen36.think_end == "</think>"
    assert qwen36.stop_ids == (248_046, 248_044)


def test_digest_separates_vocabularies(qwen25: Vocabulary, qwen36: Vocabulary) -> None:
    assert qwen25.digest != qwen36.digest
    assert load_vocabulary("qwen2.5") is qwen25  # built once, cached


def test_bad_vocabulary_inputs() -> None:
    with pytest.raises(InvalidSpecError, match="unknown tokenizer"):
        load_vocabulary("no-such-model")
    with pytest.raises(InvalidSpecError, match="smaller than"):
        Vocabulary([b"a", b"b"], special_ids=[], stop_ids=[1], vocab_size=1)
    with pytest.raises(InvalidSpecError, match="stop token"):
        Vocabulary([b"a", b"b"], special_ids=[], stop_ids=[])
    with pytest.raises(InvalidSpecError, match="outside"):
        Vocabulary([b"a", b"b"], special_ids=[], stop_ids=[7])


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("vocab_name", ["qwen25", "qwen36"])
def test_specials_and_padding_never_allowed_in_json_strings(
        backend: BackendName, vocab_name: str, request: pytest.FixtureRequest) -> None:
    vocab: Vocabulary = request.getfixturevalue(vocab_name)
    grammar = Compiler(vocab).compile(GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "string"}}}, backend=backend))
    m = grammar.matcher()
    assert feed(m, vocab, '{"a": "')
    row = mask_of(m, vocab)
    assert bit(row, vocab.encode("hello")[0])
    for tid in sorted(vocab.special_ids):
        assert not bit(row, tid), f"special token {vocab.tokens[tid]!r} allowed in a string"
    for tid in range(len(vocab.tokens), vocab.vocab_size):
        assert not bit(row, tid), f"padding id {tid} allowed"
    for tid in vocab.special_ids:
        assert not m.fork().accept(tid)


def test_a_hugging_face_vocabulary_gives_llguidance_a_native_tokenizer() -> None:
    """From a fast tokenizer llguidance tokenizes natively (vLLM's way: no Python callback,
    so no GIL, inside a fill). Along a free-text walk its masks equal the callback's, but
    for the added tokens (``<think>``, ``<tool_call>``: non-special in Qwen3), which the
    native tokenizer never allows inside text (stricter, as in vLLM)."""
    from ..vllm_fixtures import model_dir

    vocab = load_vocabulary(str(model_dir()))
    native = tokenizer_view(vocab)
    assert native.native and native_tokenizer(vocab) is not None
    callback = Vocabulary(vocab.tokens, special_ids=vocab.special_ids, stop_ids=vocab.stop_ids,
                          vocab_size=vocab.vocab_size, encode=vocab.encode)
    assert native_tokenizer(callback) is None and not tokenizer_view(callback).native
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name"]}
    text = '{"name": "Zoë, in \\"quotes\\"", "tags": ["a b", "c"]}'
    walks = []
    for v in (vocab, callback):
        compiler = Compiler(v, backend="guidance")
        try:
            m = compiler.compile(GrammarSpec.json_schema(schema)).matcher()
            masks = []
            for t in v.encode(text):
                masks.append(mask_of(m, v))
                assert m.accept(t)
            walks.append(masks)
        finally:
            compiler.close()
    assert native is tokenizer_view(vocab)  # built once per vocabulary
    added = 151_643  # Qwen's added tokens start here
    for a, b in zip(*walks, strict=True):
        assert torch.equal(a[:added // 32], b[:added // 32])
        assert torch.equal(a & b, a)  # the native mask is a subset
