"""Constrained random sampling over real schemas: every output must validate.

273 maskbench schemas (13 per subset, all 21 subsets, fixed seed) are compiled by the Compiler
(auto routing) and sampled through one ``BatchProcessor`` with continuous batching (rows are
added as others finish). The "model" picks a random allowed token each step: a random allowed
mask word, then a random set bit in it. To make every output finish, it always takes a stop
token once the grammar allows one and is pulled toward closing what is open with a
probability growing with the length (see ``RandomModel``); every choice stays inside the mask.

Whitespace is compact (``any_whitespace=False``). Outputs are checked with jsonschema's Draft
2020-12 validator (``format`` is an annotation there, as in the backends' default) whenever
the serving backend enforces every keyword (``grammar.unenforced`` empty): 100% must pass.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from grammask import Compiler, CompileTimeoutError, Grammar, GrammarError, GrammarSpec, Vocabulary
from grammask.decode.processor import BatchProcessor
from grammask.kernels.bitmask import bitmask_words

from ..helpers import PATIENT

PER_SUBSET = 13
SEED = 20250601
MAX_BATCH = 32
CAP = 4000  # tokens; an output reaching it counts as unfinished (a failure of the test design)
CLOSING = frozenset(b'"]}')
PATIENCE = 6  # compile requests per schema before a timeout counts (a true runaway)


@dataclass
class Sample:
    subset: str
    schema_id: str
    schema: Any
    grammar: Grammar | None = None
    error: str | None = None
    hints: list[str] = field(default_factory=list)  # string values of valid instances
    tokens: list[int] = field(default_factory=list)
    typing: list[int] = field(default_factory=list)  # hint tokens the model is writing out
    finished: bool = False
    timeouts: int = 0  # compile requests that ran out of time (asked again)


def pick_schemas(corpus: Path) -> list[Sample]:
    rng = random.Random(SEED)
    samples = []
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            lines = [line for line in fh if line.strip()]
        for line in rng.sample(lines, min(PER_SUBSET, len(lines))):
            item = json.loads(line)
            hints = sorted({v for t in item.get("tests", []) if t.get("valid")
                            for v in strings_in(t.get("data"))})
            samples.append(Sample(path.name.removesuffix(".jsonl.gz"), str(item["id"]),
                                  item["schema"], hints=hints))
    return samples


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings_in(v)


def words_of(vocab: Vocabulary, ids: list[int]) -> torch.Tensor:
    words = torch.zeros(bitmask_words(vocab.vocab_size), dtype=torch.int64)
    for tid in ids:
        words[tid >> 5] |= 1 << (tid & 31)
    return words


class RandomModel:
    """Random allowed tokens, pulled toward an end as the output grows.

    With a probability growing with the length it closes what is open: a string (tokens made
    of ``"`` then ``]``/``}``), else a container (``]``/``}`` tokens, outside free text). Inside
    a string that may not end yet (a pattern or format) it writes out one of the string values
    of the schema's valid test instances (a search pattern is then satisfied at the end), or,
    without such hints, single characters with digits and ``.-:/_@`` favoured.
    """

    def __init__(self, vocab: Vocabulary, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.stop_ids = vocab.stop_ids
        plain = [(tid, tok) for tid, tok in enumerate(vocab.tokens)
                 if tok and tid not in vocab.special_ids]
        self.quote_close = words_of(vocab, [t for t, tok in plain if tok[:1] == b'"'
                                            and all(b in CLOSING for b in tok)])
        self.container_close = words_of(vocab, [t for t, tok in plain
                                                if all(b in b"]}" for b in tok)])
        self.chars: list[tuple[int, int]] = []  # (token id, weight) of printable ASCII chars
        for code in range(32, 127):
            tid = vocab.token_id(chr(code))
            weight = 8 if chr(code).isdigit() else 4 if chr(code) in ".-:/_@" else 1
            self.chars.append((tid, weight))

    def pick(self, row: torch.Tensor, sample: Sample) -> int:
        words = row.to(torch.int64) & 0xFFFFFFFF
        for s in self.stop_ids:
            if self._has(words, s):
                return s
        if sample.typing:
            if self._has(words, sample.typing[0]):
                return sample.typing.pop(0)
            sample.typing.clear()
        if self.rng.random() < min(0.9, len(sample.tokens) / 40):
            closing = words & self.quote_close
            if bool(closing.any()):
                return self._random_bit(closing)
            free_text = int(words.count_nonzero()) > 2000
            closing = words & self.container_close
            if not free_text and bool(closing.any()):
                return self._random_bit(closing)
            if free_text and sample.hints and self.rng.random() < 0.5:
                text = json.dumps(self.rng.choice(sample.hints), ensure_ascii=False)[1:-1]
                sample.typing = self.vocab.encode(text)
                if sample.typing and self._has(words, sample.typing[0]):
                    return sample.typing.pop(0)
                sample.typing.clear()
            chars = [(t, w) for t, w in self.chars if self._has(words, t)]
            if chars:
                return self.rng.choices([t for t, _ in chars], [w for _, w in chars])[0]
        return self._random_bit(words)

    @staticmethod
    def _has(words: torch.Tensor, tid: int) -> bool:
        return bool((int(words[tid >> 5]) >> (tid & 31)) & 1)

    def _random_bit(self, words: torch.Tensor) -> int:
        nz = words.nonzero().flatten().tolist()
        assert nz, "an empty mask"
        w = self.rng.choice(nz)
        value = int(words[w])
        return w * 32 + self.rng.choice([b for b in range(32) if (value >> b) & 1])


def run(compiler: Compiler, vocab: Vocabulary, samples: list[Sample]) -> None:
    """Sample every compiled schema through one processor, rows recycled as they finish."""
    model = RandomModel(vocab, SEED)
    todo = [s for s in samples if s.grammar is not None]
    active: dict[int, Sample] = {}
    with BatchProcessor(compiler, max_batch=MAX_BATCH, think_end=None, **PATIENT) as proc:
        while todo or active:
            for row in range(MAX_BATCH):
                if row not in active and todo:
                    active[row] = todo.pop()
                    grammar = active[row].grammar
                    assert grammar is not None
                    proc.add(row, grammar.spec, grammar=grammar)
            proc.step()
            bitmask, rows = proc.wait_masks()
            assert rows == sorted(active)
            for row, sample in list(active.items()):
                token = model.pick(bitmask[row], sample)
                sample.tokens.append(token)
                sample.finished = token in vocab.stop_ids
                if sample.finished or len(sample.tokens) >= CAP:
                    assert proc.error(row) is None, (sample.schema_id, proc.error(row))
                    proc.remove(row)
                    del active[row]
                else:
                    proc.advance(row, [token])


@pytest.fixture(scope="module")
def sampled(corpus: Path, qwen25: Vocabulary) -> Iterator[list[Sample]]:
    samples = pick_schemas(corpus)
    compiler = Compiler(qwen25, timeout_s=20, max_workers=2)
    specs = [GrammarSpec.json_schema(s.schema, any_whitespace=False) for s in samples]
    futures: list[Future[Grammar]] = [compiler.compile_async(spec) for spec in specs]
    for sample, spec, future in zip(samples, specs, futures, strict=True):
        for _ in range(PATIENCE):
            try:
                sample.grammar = future.result()
            except CompileTimeoutError:
                # the machine was slow, which says nothing about the schema: ask again (the
                # abandoned compiles go on, a new request joins them or finds their result)
                sample.timeouts += 1
                future = compiler.compile_async(spec)
                continue
            except GrammarError as exc:
                sample.error = exc.message  # a refusal: the schema, not the clock
            break
    run(compiler, qwen25, samples)
    yield samples
    compiler.close()


def test_corpus_outputs_validate(sampled: list[Sample], qwen25: Vocabulary) -> None:
    # every schema was decided: compiled, or refused for a reason of its own (never "it took
    # longer than 20 s on this machine")
    undecided = [s.schema_id for s in sampled if s.grammar is None and s.error is None]
    assert not undecided, f"still timing out after {PATIENCE} requests: {undecided}"
    compiled = [s for s in sampled if s.grammar is not None]
    unfinished = [s.schema_id for s in compiled if not s.finished]
    assert not unfinished, f"outputs that hit the {CAP}-token cap: {unfinished}"
    checked, failures, loose = 0, [], 0
    for s in compiled:
        assert s.grammar is not None
        text = qwen25.decode(s.tokens[:-1]).decode("utf-8")
        if s.grammar.unenforced:  # served with known gaps: validity is not promised
            loose += 1
            continue
        value = json.loads(text)
        errors = list(jsonschema.Draft202012Validator(s.schema).iter_errors(value))
        if errors:
            failures.append((s.subset, s.schema_id, s.grammar.backend, text[:200],
                             errors[0].message[:200]))
        checked += 1
    print(f"\nsampled {len(compiled)} of {len(sampled)} schemas (compile refused: "
          f"{len(sampled) - len(compiled)}, served with unenforced keywords: {loose}, "
          f"compile requests asked again after a timeout: {sum(s.timeouts for s in sampled)}); "
          f"validated {checked} with every keyword enforced; failures {len(failures)}; "
          f"mean length {sum(len(s.tokens) for s in compiled) / len(compiled):.1f} tokens")
    assert not failures, failures
    assert checked >= 200


def test_every_subset_is_represented(sampled: list[Sample]) -> None:
    subsets = {s.subset for s in sampled}
    assert len(subsets) == 21
    assert {s.subset for s in sampled if s.grammar is not None} == subsets
    validated = {s.subset for s in sampled if s.grammar is not None and not s.grammar.unenforced}
    # Handwritten and Synthesized exercise exotic keywords (not, uniqueItems, ...) on purpose
    assert len(validated) >= 19, sorted(subsets - validated)
    backends = {s.grammar.backend for s in sampled if s.grammar is not None}
    assert backends == {"guidance", "xgrammar"}  # auto routing used both backends
