"""The matcher contract (``grammask.backends.base``), row by row, on both backends.

Every misuse must leave the matcher as it was: each test records the state (mask, accepted
count, termination) before the misuse, checks it after, and then finishes a valid output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from grammask import Compiler, GrammarSpec, UnsupportedError, Vocabulary, allocate_bitmask
from grammask.backends.guidance import GuidanceMatcher
from grammask.backends.xgrammar import XGrammarMatcher
from grammask.decode.fill import Filler
from grammask.specs.grammar_spec import BackendName

from ..helpers import RawReference, bit, feed, mask_of, words_to_bool

BACKENDS: list[BackendName] = ["xgrammar", "guidance"]
PATTERN = "abc|abd"  # "ab" then one of two endings; complete (but not stopped) after "abc"


@pytest.fixture(scope="module")
def compiler(qwen25: Vocabulary) -> Compiler:
    return Compiler(qwen25, timeout_s=60)


AdapterMatcher = XGrammarMatcher | GuidanceMatcher


def _matcher(compiler: Compiler, backend: BackendName) -> AdapterMatcher:
    m = compiler.compile(GrammarSpec.regex(PATTERN, backend=backend)).matcher()
    assert isinstance(m, XGrammarMatcher | GuidanceMatcher)
    return m


def _state(m: AdapterMatcher, vocab: Vocabulary) -> tuple[Any, ...]:
    if isinstance(m, XGrammarMatcher):  # the adapter keeps termination itself: check it
        assert m.is_terminated() == m.native.is_terminated()
    return (mask_of(m, vocab).clone().tolist(), m.accepted(), m.is_terminated(),
            m.can_terminate())


def _finishes(m: AdapterMatcher, vocab: Vocabulary, rest: str) -> bool:
    """The matcher still works: it takes ``rest``, then a stop, and is then terminated."""
    return (feed(m, vocab, rest) and m.accept(vocab.stop_ids[0]) and m.is_terminated()
            and not m.accept(vocab.encode("a")[0]))


def _after_ab(compiler: Compiler, vocab: Vocabulary, backend: BackendName) -> AdapterMatcher:
    m = _matcher(compiler, backend)
    assert feed(m, vocab, "a") and feed(m, vocab, "b")  # two tokens, one at a time
    assert m.accepted() == 2
    return m


# ---------------------------------------------------------------------------- accept(id)
def _bad_ids(vocab: Vocabulary) -> list[object]:
    c = vocab.encode("c")[0]
    return [vocab.vocab_size, vocab.vocab_size + 5, -1, -(2**31), 2**32 + c, 2**32, 2**63,
            2**64 + c, True, float(c), str(c), None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_accept_of_a_non_token_is_false_and_changes_nothing(compiler: Compiler, qwen25: Vocabulary,
                                                            backend: BackendName) -> None:
    for bad in _bad_ids(qwen25):
        m = _after_ab(compiler, qwen25, backend)
        before = _state(m, qwen25)
        assert m.accept(bad) is False, bad  # type: ignore[arg-type]
        assert _state(m, qwen25) == before, bad
        assert _finishes(m, qwen25, "c"), bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_accept_takes_numpy_and_torch_integers(compiler: Compiler, qwen25: Vocabulary,
                                               backend: BackendName) -> None:
    import numpy as np

    m = _matcher(compiler, backend)
    a, b = qwen25.encode("a")[0], qwen25.encode("b")[0]
    assert m.accept(np.int64(a))  # type: ignore[arg-type]
    assert m.accept(torch.tensor(b))  # type: ignore[arg-type]
    assert m.accepted() == 2 and _finishes(m, qwen25, "d")


# ---------------------------------------------------------------------------- rollback(n)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [3, 100, -1, -5, 1.0, "1", None])
def test_bad_rollback_is_a_value_error_and_changes_nothing(
        compiler: Compiler, qwen25: Vocabulary, backend: BackendName, count: object) -> None:
    m = _after_ab(compiler, qwen25, backend)
    before = _state(m, qwen25)
    with pytest.raises(ValueError, match="rollback"):
        m.rollback(count)  # type: ignore[arg-type]
    assert _state(m, qwen25) == before
    m.rollback(1)  # the counter is intact: exactly one token comes off
    assert m.accepted() == 1 and _finishes(m, qwen25, "bd")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_past_the_stop_tokens_is_bounded_too(compiler: Compiler, qwen25: Vocabulary,
                                                      backend: BackendName) -> None:
    m = _after_ab(compiler, qwen25, backend)
    assert feed(m, qwen25, "c") and m.accept(qwen25.stop_ids[0]) and m.accept(qwen25.stop_ids[1])
    accepted = m.accepted()
    with pytest.raises(ValueError):
        m.rollback(accepted + 1)
    m.rollback(0)
    m.rollback(accepted)
    assert m.accepted() == 0 and not m.is_terminated()
    assert _finishes(m, qwen25, "abd")


# ---------------------------------------------------------------------------- fill(bitmask, row)
BAD_MASKS = ["uint8", "int64", "float32", "narrow", "wide", "one-dim", "three-dim", "strided",
             "transposed", "row -1", "row 2", "row float"]


def _bad_masks(vocab: Vocabulary) -> dict[str, tuple[torch.Tensor, int]]:
    words = (vocab.vocab_size + 31) // 32
    good = allocate_bitmask(2, vocab.vocab_size)
    return {
        "uint8": (torch.full((2, words * 4), 7, dtype=torch.uint8), 0),
        "int64": (torch.full((2, words), 7, dtype=torch.int64), 0),
        "float32": (torch.full((2, words), 7.0), 0),
        "narrow": (torch.full((2, words - 1), 7, dtype=torch.int32), 0),
        "wide": (torch.full((2, words + 1), 7, dtype=torch.int32), 0),
        "one-dim": (torch.full((words,), 7, dtype=torch.int32), 0),
        "three-dim": (torch.full((1, 2, words), 7, dtype=torch.int32), 0),
        "strided": (torch.full((2, words * 2), 7, dtype=torch.int32)[:, ::2], 0),
        "transposed": (torch.full((words, 2), 7, dtype=torch.int32).t(), 0),
        "row -1": (good, -1),
        "row 2": (good, 2),
        "row float": (good, 0.0),  # type: ignore[dict-item]
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_MASKS)
def test_bad_fill_is_a_value_error_before_any_write(compiler: Compiler, qwen25: Vocabulary,
                                                    backend: BackendName, case: str) -> None:
    for fresh in (True, False):  # llguidance copies its first mask; later fills compute
        m = _matcher(compiler, backend) if fresh else _after_ab(compiler, qwen25, backend)
        before = _state(m, qwen25)
        bitmask, row = _bad_masks(qwen25)[case]
        snapshot = bitmask.clone()
        with pytest.raises(ValueError, match="fill"):
            m.fill(bitmask, row)
        assert torch.equal(bitmask, snapshot), case
        assert _state(m, qwen25) == before
        assert _finishes(m, qwen25, "abc" if fresh else "d")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_writes_only_its_row(compiler: Compiler, qwen25: Vocabulary,
                                  backend: BackendName) -> None:
    m = _after_ab(compiler, qwen25, backend)
    bitmask = allocate_bitmask(3, qwen25.vocab_size)
    m.fill(bitmask, 1)
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
    assert bit(bitmask[1], qwen25.encode("c")[0]) and not bit(bitmask[1], qwen25.encode("a")[0])


# ---------------------------------------------------------------------------- is_terminated
@pytest.mark.parametrize("backend", BACKENDS)
def test_terminated_only_after_a_stop_token(compiler: Compiler, qwen25: Vocabulary,
                                            backend: BackendName) -> None:
    """``abc`` is complete: llguidance calls that stopped, the contract does not."""
    m = _matcher(compiler, backend)
    assert not m.is_terminated()
    assert feed(m, qwen25, "abc")
    assert not m.is_terminated() and m.can_terminate()
    count = m.accepted()
    row = mask_of(m, qwen25)
    assert bit(row, qwen25.stop_ids[0]) and not bit(row, qwen25.encode("a")[0])
    assert m.accept(qwen25.stop_ids[0]) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.can_terminate() and m.accepted() == count
    twin = m.fork()
    assert m.accept(qwen25.stop_ids[1]) and m.is_terminated()
    assert not twin.is_terminated()


# ---------------------------------------------------------------------------- fork
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix", ["", "a", "ab", "abc", "abc<stop>"])
def test_fork_is_identical_and_independent(compiler: Compiler, qwen25: Vocabulary,
                                           backend: BackendName, prefix: str) -> None:
    m = _matcher(compiler, backend)
    assert feed(m, qwen25, prefix.replace("<stop>", ""))
    if prefix.endswith("<stop>"):
        assert m.accept(qwen25.stop_ids[0])
    twin = m.fork()
    assert _state(twin, qwen25) == _state(m, qwen25)
    before = _state(m, qwen25)
    rest = {"": "abd", "a": "bd", "ab": "d", "abc": "", "abc<stop>": ""}[prefix]
    if prefix.endswith("<stop>"):
        twin.rollback(1)
        assert not twin.is_terminated()
    else:
        assert _finishes(twin, qwen25, rest)
    assert _state(m, qwen25) == before  # advancing the twin left the original alone
    if prefix.endswith("<stop>"):
        m.rollback(1)
    assert _finishes(m, qwen25, rest)


# ---------------------------------------------------------------------------- release
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefix", ["", "ab", "abc<stop>"])
def test_a_released_matcher_raises_and_the_next_one_starts_fresh(
        compiler: Compiler, qwen25: Vocabulary, backend: BackendName, prefix: str) -> None:
    """After ``release`` every call raises; the grammar's next matcher (xgrammar: the same
    native matcher, reset) is at the start state, as a fresh one from another compiler."""
    grammar = compiler.compile(GrammarSpec.regex(PATTERN, backend=backend))
    m = grammar.matcher()
    assert feed(m, qwen25, prefix.replace("<stop>", ""))
    if prefix.endswith("<stop>"):
        assert m.accept(qwen25.stop_ids[0])
    native = m.native
    m.release()
    m.release()  # twice: still nothing handed out twice
    for call in (lambda: m.accept(qwen25.encode("a")[0]), m.is_terminated,
                 lambda: mask_of(m, qwen25)):
        with pytest.raises(RuntimeError, match="released"):
            call()
    fresh = Compiler(qwen25, timeout_s=60).compile(
        GrammarSpec.regex(PATTERN, backend=backend)).matcher()
    again, other = grammar.matcher(), grammar.matcher()
    if backend == "xgrammar":
        assert again.native is native and other.native is not native
    assert isinstance(again, XGrammarMatcher | GuidanceMatcher)
    assert isinstance(fresh, XGrammarMatcher | GuidanceMatcher)
    assert _state(again, qwen25) == _state(fresh, qwen25)
    assert _finishes(again, qwen25, "abd")


def test_released_matchers_kept_are_bounded(compiler: Compiler, qwen25: Vocabulary) -> None:
    """A grammar keeps at most ``per_grammar`` released matchers, the process at most
    ``limit``; they leave the budget when taken again or when the grammar is dropped."""
    import gc

    from grammask.backends.base import SPARES
    from grammask.backends.xgrammar import XGrammarCompiled

    native = compiler.compile(GrammarSpec.regex("x+|y", backend="xgrammar")).backend_grammar
    gc.collect()  # earlier tests' grammars leave the budget now, not in the middle of this one
    before = SPARES.kept
    old = (SPARES.limit, SPARES.per_grammar)
    SPARES.limit, SPARES.per_grammar = before + 30, 20
    try:
        grammars = [XGrammarCompiled(native._compiled,  # type: ignore[attr-defined]
                                     qwen25.stop_ids, qwen25.vocab_size) for _ in range(2)]
        for g in grammars:
            many = [g.matcher() for _ in range(25)]
            for m in many:
                m.release()
        assert [len(g._spare) for g in grammars] == [20, 10]
        assert SPARES.kept == before + 30
        grammars[0].matcher()
        assert SPARES.kept == before + 29
    finally:
        SPARES.limit, SPARES.per_grammar = old
    del grammars, g, m, many
    gc.collect()
    assert SPARES.kept == before


# ---------------------------------------------------------------------------- empty language
EMPTY: list[Callable[[], GrammarSpec]] = [
    lambda: GrammarSpec.grammar("root ::= root"),
    lambda: GrammarSpec.grammar("start: start"),
    lambda: GrammarSpec.json_schema({"$ref": "#"}),
    lambda: GrammarSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"}),
]


@pytest.mark.parametrize("backend", [*BACKENDS, None])
@pytest.mark.parametrize("make", EMPTY, ids=["gbnf", "lark", "ref-root", "ref-cycle"])
def test_empty_language_is_refused_at_compile(compiler: Compiler, backend: BackendName | None,
                                              make: Callable[[], GrammarSpec]) -> None:
    spec = make().with_backend(backend)
    with pytest.raises(UnsupportedError, match="nothing can be generated") as info:
        compiler.compile(spec)
    assert "siblings" not in str(info.value)


# ---------------------------------------------------------------------------- batch fill
def _ended(compiler: Compiler, vocab: Vocabulary, backend: BackendName) -> AdapterMatcher:
    m = _after_ab(compiler, vocab, backend)
    assert m.accept(vocab.encode("c")[0]) and m.accept(vocab.stop_ids[0])
    return m


def test_batch_fill_still_drives_native_matchers(compiler: Compiler, qwen25: Vocabulary) -> None:
    """``Filler`` fills through ``native``: same rows as the adapters' own fills, ended
    rows (copied in bulk) included."""
    makers = [lambda c, v, b: _matcher(c, b), _after_ab, _ended]
    rows = [(makers[i % 3](compiler, qwen25, b), i) for i, b in enumerate(BACKENDS * 4)]
    batch = allocate_bitmask(len(rows), qwen25.vocab_size)
    Filler(parallel_min=1, threads=1).fill(rows, batch)
    for m, i in rows:
        assert torch.equal(batch[i], mask_of(m, qwen25)), i


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_row", [2, -1, True], ids=["past", "negative", "bool"])
def test_batch_fill_refuses_a_bad_row_before_writing(compiler: Compiler, qwen25: Vocabulary,
                                                     backend: BackendName,
                                                     bad_row: object) -> None:
    """A batch fill checks every row as ``fill`` does, and writes none when one is bad (the
    backends write through raw pointers: a row past the tensor would be heap memory)."""
    first, second = _matcher(compiler, backend), _matcher(compiler, backend)
    bitmask = torch.zeros(2, (qwen25.vocab_size + 31) // 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="row"):
        type(first).batch_fill([(first, 0), (second, bad_row)],  # type: ignore[list-item]
                               bitmask, 1, {})
    assert not bitmask.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_accept_is_accept_row_by_row(compiler: Compiler, qwen25: Vocabulary,
                                           backend: BackendName) -> None:
    """``batch_accept`` answers and leaves every matcher as ``accept`` one by one does: an
    allowed token, a refused one, a stop where the grammar may end, a stop after the end,
    a token after the end, an id past the vocabulary (the whole batch then goes row by
    row). Checked against twins advanced with ``accept``."""
    a, b, c, d = (qwen25.encode(x)[0] for x in "abcd")
    stop = qwen25.stop_ids[0]

    def states() -> list[AdapterMatcher]:
        ended = _after_ab(compiler, qwen25, backend)
        assert ended.accept(c) and ended.accept(stop)
        complete = _after_ab(compiler, qwen25, backend)
        assert complete.accept(c)
        return [_matcher(compiler, backend), _matcher(compiler, backend),
                _after_ab(compiler, qwen25, backend), complete, ended, ended.fork()]

    for tokens in ([a, b, d, stop, stop, a], [a, b, d, stop, stop, qwen25.vocab_size + 5]):
        batched, single = states(), states()
        cls = type(batched[0])
        got = cls.batch_accept(batched, tokens)  # type: ignore[arg-type]
        want = [m.accept(t) for m, t in zip(single, tokens, strict=True)]
        assert got == want == [True, False, True, True, True, False]
        for x, y in zip(batched, single, strict=True):
            assert _state(x, qwen25) == _state(y, qwen25)
    every = [_matcher(compiler, backend) for _ in range(3)]  # all accepted: one answer
    assert type(every[0]).batch_accept(every, [a, a, a]) == [True] * 3  # type: ignore[arg-type]
    assert [m.accepted() for m in every] == [1, 1, 1]


def test_rows_advance_together_as_alone(compiler: Compiler, qwen25: Vocabulary) -> None:
    """``rows.advance_all`` (batch calls per backend) leaves rows as ``Row.advance`` does:
    the same tokens fed, the same refusals failing the same rows with the same message."""
    from grammask.decode.rows import Row, advance_all
    from grammask.specs.request import ConstraintRequest

    a, b, x = (qwen25.encode(t)[0] for t in "abx")

    def rows() -> list[Row]:
        out = []
        for backend in BACKENDS * 2:
            spec = GrammarSpec.regex(PATTERN, backend=backend)
            row = Row(ConstraintRequest(spec), None, [], True,  # type: ignore[arg-type]
                      qwen25.tokens)
            row.attach(compiler.compile(spec))
            out.append(row)
        return out

    work = [[a], [x], [a, b], [b]]
    together, alone = rows(), rows()
    fills, rest = advance_all([(i, r, tokens) for i, (r, tokens)
                               in enumerate(zip(together, work, strict=True))])
    for r, tokens in zip(alone, work, strict=True):
        r.advance(tokens)
    assert [(r.fed, r.error) for r in together] == [(r.fed, r.error) for r in alone]
    assert [r.error is None for r in together] == [True, False, True, False]
    # each row comes back once: those that took one token in a batch accept for the batch
    # fill (their own matcher, their index), the rest (a refusal, two tokens) for the caller
    batched = sorted(i for group in fills.values() for _, i in group)
    assert batched == [i for i, (r, t) in enumerate(zip(together, work, strict=True))
                       if len(t) == 1 and r.error is None]
    assert all(together[i].matcher is m for group in fills.values() for m, i in group)
    assert sorted(batched + [i for i, _, _ in rest]) == list(range(len(together)))


# ------------------------------------------------------------ adapters vs the raw backends
RAW_SPECS = [
    GrammarSpec.json_schema({"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"},
        "e": {"enum": ["x", "yy"]}}, "required": ["s", "n"]}, any_whitespace=False),
    GrammarSpec.regex(PATTERN),
    GrammarSpec.choice(["alpha", "beta", "al"]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", RAW_SPECS, ids=["json", "regex", "choice"])
def test_adapter_masks_equal_the_raw_backends(compiler: Compiler, qwen25: Vocabulary,
                                             backend: BackendName, spec: GrammarSpec) -> None:
    """The adapter's mask at every step of seeded random walks equals the raw backend's with
    the documented rules applied by the test (``helpers.RawReference``): inside a JSON string
    the raw backend allows special tokens' text and the padding ids are its own, so blanking,
    padding and stop handling are all on the adapter. Special and padding ids are offered
    at every step and must be refused by both."""
    import random

    grammar = compiler.compile(spec.with_backend(backend))
    specials = sorted(set(qwen25.special_ids) - set(qwen25.stop_ids))[:3]
    rng = random.Random(7)
    for walk in range(2):
        ref, m = RawReference.of(grammar, qwen25), grammar.matcher()
        for step in range(30):
            want = ref.words()
            assert torch.equal(mask_of(m, qwen25), want), (walk, step, ref.history)
            for tid in (*specials, qwen25.vocab_size - 1):
                assert not ref.accept(tid) and not m.accept(tid), (tid, ref.history)
            allowed = words_to_bool(want, qwen25.vocab_size).nonzero().flatten().tolist()
            if not allowed:
                break
            stops = [t for t in allowed if t in qwen25.stop_ids]
            tid = rng.choice(stops if stops and rng.random() < 0.2 else allowed)
            assert ref.accept(tid) and m.accept(tid), (tid, ref.history)
            assert m.is_terminated() == ref.is_terminated()
        assert ref.history, "the walk went nowhere"
