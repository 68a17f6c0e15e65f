"""``model.generate`` end to end: a tiny random-weight Qwen2 model, the real Qwen2.5 vocabulary.

The model is built from a config (no download). Its outputs are noise, so the schemas bound
every path (maxLength, integer ranges, enums, closed objects): the constrained rows must end
by themselves well inside ``max_new_tokens`` and parse and validate against their schemas.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from transformers import LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

from grammask import Compiler, GrammarSpec, Vocabulary
from grammask.integrations.transformers import GrammarLogitsProcessor

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
ITEMS = {"type": "array", "minItems": 1, "maxItems": 3,
         "items": {"enum": ["red", "green", "blue"]}}
CHOICE = {"type": "object", "properties": {"kind": {"const": "point"},
                                           "x": {"type": "integer", "minimum": -9, "maximum": 9}},
          "required": ["kind", "x"]}
SCHEMAS: list[dict[str, Any] | None] = [PERSON, None, ITEMS, CHOICE]
MAX_NEW = 32


@pytest.fixture(scope="module")
def model() -> Iterator[Qwen2ForCausalLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared 2-core machine: one thread is faster
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    yield Qwen2ForCausalLM(config).eval()
    torch.set_num_threads(threads)


def generate(model: Qwen2ForCausalLM, proc: GrammarLogitsProcessor, vocab: Vocabulary, *,
             sample: bool, copies: int) -> list[list[int]]:
    prompt = vocab.encode("Reply with JSON: ")
    ids = torch.tensor([prompt] * (len(SCHEMAS) * copies))
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             logits_processor=LogitsProcessorList([proc]),
                             max_new_tokens=MAX_NEW, do_sample=sample,
                             eos_token_id=list(vocab.stop_ids),
                             pad_token_id=vocab.stop_ids[0])
    return [row[len(prompt):] for row in out.tolist()]


def check(outputs: list[list[int]], vocab: Vocabulary, copies: int) -> int:
    """Every constrained row ended, parses and validates; returns how many were checked."""
    checked = 0
    for i, tokens in enumerate(outputs):
        schema = SCHEMAS[i // copies]  # k copies of a prompt are adjacent rows
        if schema is None:
            continue
        assert any(t in vocab.stop_ids for t in tokens), f"row {i} did not end: {tokens}"
        body = tokens[:min(tokens.index(s) for s in vocab.stop_ids if s in tokens)]
        value = json.loads(vocab.decode(body))
        jsonschema.Draft202012Validator(schema).validate(value)
        checked += 1
    return checked


def test_generate_sampling_then_greedy(model: Qwen2ForCausalLM, compiler: Compiler,
                                       qwen25: Vocabulary) -> None:
    """Sampling with two copies per prompt, then greedy with the same processor (a new
    generate call starts the rows afresh)."""
    specs = [None if s is None else GrammarSpec.json_schema(s, any_whitespace=False)
             for s in SCHEMAS]
    proc = GrammarLogitsProcessor(compiler, specs)
    sampled = generate(model, proc, qwen25, sample=True, copies=2)
    assert check(sampled, qwen25, 2) == 6
    assert proc.info(2).status == "unconstrained"  # rows 2, 3 are copies of the None spec
    assert all(proc.info(i).error is None for i in range(8))
    # the unconstrained rows are noise: they do not end where a grammar would
    assert not any(t in qwen25.stop_ids for t in sampled[2][:5] + sampled[3][:5])
    greedy = generate(model, proc, qwen25, sample=False, copies=1)
    assert check(greedy, qwen25, 1) == 3
    assert all(proc.info(i).status == "ended" for i in (0, 2, 3))
    with pytest.raises(ValueError, match="multiple"):
        proc(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, qwen25.vocab_size))
    proc.close()
