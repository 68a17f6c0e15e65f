"""The thinking gate with the real Qwen3.6 vocabulary (``<think>`` 248068, ``</think>`` 248069)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from grammask import (
    Compiler,
    ConstraintRequest,
    Grammar,
    GrammarSpec,
    Vocabulary,
    allocate_bitmask,
    allowed_ids,
)
from grammask.backends import Matcher
from grammask.decode.processor import BatchProcessor
from grammask.decode.reasoning import RuleGate, ThinkGate, ThinkMarker
from grammask.decode.rows import Row

from ..helpers import PATIENT, RawReference

THINK, END_THINK, IM_START, IM_END = 248068, 248069, 248045, 248046
SPEC = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}, any_whitespace=False)


def chat(vocab: Vocabulary, *parts: str | int) -> list[int]:
    """Token ids of a prompt: strings are encoded as text, ints are special tokens."""
    ids: list[int] = []
    for part in parts:
        ids.extend([part] if isinstance(part, int) else vocab.encode(part))
    return ids


def user_turn(vocab: Vocabulary) -> list[int]:
    return chat(vocab, IM_START, "user\nGive me JSON.", IM_END, "\n")


@pytest.fixture(scope="module")
def marker(qwen36: Vocabulary) -> ThinkMarker:
    m = ThinkMarker.for_vocab(qwen36)
    assert m is not None
    return m


@pytest.fixture(scope="module")
def compiler36(qwen36: Vocabulary) -> Iterator[Compiler]:
    compiler = Compiler(qwen36, timeout_s=60, backend="guidance")
    yield compiler
    compiler.close()


def test_default_marker_is_the_single_token(qwen36: Vocabulary, marker: ThinkMarker) -> None:
    assert qwen36.token_id("<think>") == THINK and qwen36.token_id("</think>") == END_THINK
    assert marker.end_id == END_THINK and marker.end_bytes is None
    assert THINK in marker.start_ids and IM_START in marker.reset_ids


def test_thinking_on_until_the_marker(qwen36: Vocabulary, marker: ThinkMarker) -> None:
    prompt = user_turn(qwen36) + chat(qwen36, IM_START, "assistant\n", THINK, "\n")
    gate = ThinkGate(marker, qwen36.tokens, prompt_ids=prompt)
    assert gate.thinking and not gate.from_prompt
    assert gate.feed(qwen36.encode("Let me think about {\"a\": 1}")) == []
    after = qwen36.encode('\n\n{"a":1}')
    # the marker and the answer in one step: only what follows the marker is returned
    assert gate.feed([*qwen36.encode(" done."), END_THINK, *after]) == after
    assert not gate.thinking
    assert gate.feed([5, 6]) == [5, 6]


def test_marker_text_as_plain_tokens_does_not_end_a_single_token_marker(
        qwen36: Vocabulary, marker: ThinkMarker) -> None:
    gate = ThinkGate(marker, qwen36.tokens)
    assert gate.feed(qwen36.encode("a</think>b")) == []  # "</" "think" ">" are not </think>
    assert gate.thinking


def test_thinking_disabled_in_the_prompt(qwen36: Vocabulary, marker: ThinkMarker) -> None:
    prompt = user_turn(qwen36) + chat(qwen36, IM_START, "assistant\n", THINK, "\n\n",
                                      END_THINK, "\n\n")
    gate = ThinkGate(marker, qwen36.tokens, prompt_ids=prompt)
    assert gate.from_prompt and not gate.thinking
    assert gate.feed([1, 2]) == [1, 2]


def test_think_end_of_an_earlier_turn_does_not_count(qwen36: Vocabulary,
                                                     marker: ThinkMarker) -> None:
    earlier = chat(qwen36, IM_START, "assistant\n", THINK, "\nhm\n", END_THINK, '\n\n{"a":1}',
                   IM_END, "\n")
    prompt = user_turn(qwen36) + earlier + user_turn(qwen36) + chat(qwen36, IM_START,
                                                                     "assistant\n")
    assert ThinkGate(marker, qwen36.tokens, prompt_ids=prompt).thinking
    # ...while the same history ending with the closed block of the last turn is closed
    closed = prompt + chat(qwen36, THINK, "\n\n", END_THINK, "\n\n")
    assert not ThinkGate(marker, qwen36.tokens, prompt_ids=closed).thinking
    # a thinking block opened again after a closed one leaves the model thinking
    reopened = [*closed, THINK]
    assert ThinkGate(marker, qwen36.tokens, prompt_ids=reopened).thinking


@pytest.mark.parametrize(("parts", "thinking"), [
    (("Write one JSON object: ",), False),  # raw /v1/completions text: never entered reasoning
    ((IM_START, "assistant\n"), True),  # a chat template opened the answer: the model thinks
    (("Solve it step by step.", THINK, "\n"), True),  # raw text that opens thinking itself
    ((IM_START, "assistant\n", THINK, "\n"), True),
    ((IM_START, "assistant\n", THINK, "\n\n", END_THINK, "\n\n"), False),  # closed by the template
    ((), True),  # no prompt given: the gate waits for the marker
])
def test_the_prompt_decides_where_the_constraint_starts(
        qwen36: Vocabulary, marker: ThinkMarker, parts: tuple[str | int, ...],
        thinking: bool) -> None:
    prompt = chat(qwen36, *parts)
    if parts and isinstance(parts[0], int):
        prompt = user_turn(qwen36) + prompt
    gate = ThinkGate(marker, qwen36.tokens, prompt_ids=prompt)
    assert gate.thinking is thinking and gate.from_prompt is not thinking
    if not thinking:  # constrained from the first generated token
        assert gate.feed([11, 12]) == [11, 12]


def test_a_raw_prompt_counts_only_where_the_vocabulary_has_turn_tokens(
        qwen36: Vocabulary, marker: ThinkMarker) -> None:
    """Without turn tokens every prompt would look raw: such a vocabulary keeps the old rule."""
    assert marker.reset_ids
    no_turns = ThinkMarker(marker.end_id, None, marker.start_ids, frozenset())
    prompt = qwen36.encode("Write one JSON object: ")
    assert not ThinkGate(marker, qwen36.tokens, prompt_ids=prompt).thinking
    assert ThinkGate(no_turns, qwen36.tokens, prompt_ids=prompt).thinking


def test_per_request_switch_constrains_from_the_start(qwen36: Vocabulary,
                                                      marker: ThinkMarker) -> None:
    prompt = chat(qwen36, IM_START, "assistant\n", THINK, "\n")
    assert not ThinkGate(marker, qwen36.tokens, prompt_ids=prompt, thinking=False).thinking


def test_multi_token_text_marker_matched_on_bytes(qwen36: Vocabulary) -> None:
    marker = ThinkMarker.for_vocab(qwen36, "</reasoning>")
    assert marker is not None and marker.end_bytes == b"</reasoning>"
    ids = qwen36.encode("x</reasoning>\n\n{")  # x, </, reason, ing, >, \n\n, {
    gate = ThinkGate(marker, qwen36.tokens)
    for tid in ids[:4]:  # fed one token per step: the marker spans steps
        assert gate.feed([tid]) == []
    assert gate.feed(ids[4:]) == ids[5:]
    assert gate.leftover == b""
    # the marker ends inside a token ("hmm </reasoning>{" ends with the token ">{")
    ids = qwen36.encode("hmm </reasoning>{")
    assert qwen36.tokens[ids[-1]] == b">{"
    gate = ThinkGate(marker, qwen36.tokens)
    assert gate.feed([*ids, 7]) == [7]
    assert gate.leftover == b"{"  # outside the grammar: constrained from the next token
    # a token sequence is a byte marker too; the prompt scan reads bytes as well
    seq = ThinkMarker.for_vocab(qwen36, qwen36.encode("</reasoning>"))
    assert seq == marker
    prompt = chat(qwen36, IM_START, "assistant\nI thought</reason", "ing>\n")
    assert not ThinkGate(marker, qwen36.tokens, prompt_ids=prompt).thinking


def test_gate_rollback_reopens(qwen36: Vocabulary, marker: ThinkMarker) -> None:
    gate = ThinkGate(marker, qwen36.tokens)
    assert gate.feed([11, 12, END_THINK, 13]) == [13]
    gate.rollback(1)  # the marker token goes: thinking again
    assert gate.thinking and gate.thinking_tokens == 2
    assert gate.feed([END_THINK]) == [] and not gate.thinking
    byte_marker = ThinkMarker.for_vocab(qwen36, "</reasoning>")
    assert byte_marker is not None
    ids = qwen36.encode("x</reasoning>")
    gate = ThinkGate(byte_marker, qwen36.tokens)
    assert gate.feed(ids) == [] and not gate.thinking
    gate.rollback(1)  # drop ">": the byte tail is rebuilt so ">" closes it again
    assert gate.thinking and gate.feed([qwen36.token_id(">")]) == [] and not gate.thinking


def mask_words(m: Matcher, vocab: Vocabulary) -> torch.Tensor:
    bm = allocate_bitmask(1, vocab.vocab_size)
    m.fill(bm, 0)
    return bm[0]


def fill(proc: BatchProcessor) -> tuple[torch.Tensor, list[int]]:
    proc.step()
    return proc.wait_masks()


def test_processor_with_thinking_rows(compiler36: Compiler, qwen36: Vocabulary) -> None:
    open_prompt = user_turn(qwen36) + chat(qwen36, IM_START, "assistant\n", THINK, "\n")
    closed_prompt = open_prompt + chat(qwen36, "\n", END_THINK, "\n\n")
    ref = compiler36.compile(SPEC).matcher()
    answer = qwen36.encode('{"a":7')
    with BatchProcessor(compiler36, max_batch=4, **PATIENT) as proc:
        proc.add(0, SPEC, open_prompt)  # thinking
        proc.add(1, SPEC, closed_prompt)  # thinking disabled by the template
        proc.add(2, ConstraintRequest(SPEC, thinking=False), open_prompt)  # per-request switch
        proc.add(3, ConstraintRequest(SPEC, think_end="</reasoning>"), open_prompt)
        start = mask_words(ref, qwen36)
        bitmask, rows = fill(proc)
        assert rows == [1, 2]
        assert torch.equal(bitmask[1], start) and torch.equal(bitmask[2], start)
        assert proc.status(0) == proc.status(3) == "thinking"
        proc.advance(0, qwen36.encode("I should answer with an object, no markers."))
        proc.advance(3, qwen36.encode("Done thinking</think>"))  # not this row's marker
        logits = torch.zeros(4, qwen36.vocab_size)
        proc.step()
        proc.apply(logits)
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[3]).all()
        # marker and answer tokens in one step: the answer is fed to the matcher
        proc.advance(0, [*qwen36.encode(" ok"), END_THINK, *answer])
        proc.advance(3, [*qwen36.encode("</reasoning>"), *answer])
        assert all(ref.accept(t) for t in answer)
        bitmask, rows = fill(proc)
        assert rows == [0, 1, 2, 3]
        for row in (0, 3):
            assert torch.equal(bitmask[row], mask_words(ref, qwen36))
            assert proc.info(row).constrained_tokens == len(answer)
        # rolling back over the marker reopens the gate; the row is unmasked again
        proc.rollback(0, len(answer) + 1)
        bitmask, rows = fill(proc)
        assert proc.status(0) == "thinking" and 0 not in rows
        assert proc.errors == {}


def test_a_byte_marker_must_end_at_a_token_boundary(compiler36: Compiler,
                                                    qwen36: Vocabulary) -> None:
    """Bytes after the marker inside the marker's last token (``>{``) would reach the output
    without the grammar seeing them: while thinking, such tokens are refused; a host that
    samples one anyway gets that row failed, never text outside the grammar."""
    request = ConstraintRequest(SPEC, think_end="</reasoning>")
    closing = qwen36.token_id(">{")
    with BatchProcessor(compiler36, max_batch=2, **PATIENT) as proc:
        proc.add(0, request)
        proc.add(1, request)
        for row in (0, 1):
            proc.advance(row, qwen36.encode("hmm </reasoning"))
        bitmask, rows = fill(proc)
        assert rows == [0, 1] and proc.status(0) == "thinking"
        permitted = set(allowed_ids(bitmask[0], qwen36.vocab_size))
        refused = [t for t in range(len(qwen36.tokens)) if t not in permitted]
        assert closing in refused and qwen36.token_id(">") not in refused
        assert all(qwen36.tokens[t].startswith(b">") and len(qwen36.tokens[t]) > 1
                   for t in refused)
        proc.advance(0, [qwen36.token_id(">")])  # ends exactly at the boundary
        proc.advance(1, [closing])  # ignores the mask
        bitmask, rows = fill(proc)
        ref = compiler36.compile(SPEC).matcher()
        assert proc.status(0) == "active" and torch.equal(bitmask[0], mask_words(ref, qwen36))
        assert proc.status(1) == "error" and "inside a token" in (proc.error(1) or "")
        # an open gate whose output ends with none of the marker is not masked at all
        proc.add(0, request)
        _, rows = fill(proc)
        assert 0 not in rows


# ------------------------------------------------------------ implicit reasoning ends
class _BraceRule:
    """A host rule (``ReasoningRule``) whose implicit end is ``{``, the JSON grammar's first
    token, and whose explicit end is ``end``: vLLM's Qwen3 ``<tool_call>`` in small."""

    needs_history = False

    def __init__(self, brace: int, end: int) -> None:
        self.implicit_ends = frozenset({brace})
        self._brace, self._end = brace, end

    def prompt_ended(self, prompt_ids: object) -> bool:
        return False

    def grammar_start(self, history: list[int], delta: list[int]) -> tuple[int, bool] | None:
        for i, tid in enumerate(delta):
            if tid in (self._brace, self._end):
                return (i, True) if tid == self._brace else (i + 1, False)
        return None


def _implicit_row(compiler: Compiler, qwen25: Vocabulary,
                  backend: str) -> tuple[Row, _BraceRule, GrammarSpec]:
    from concurrent.futures import Future

    from grammask.decode.rows import PendingGrammar

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}, backend=backend)  # type: ignore[arg-type]
    grammar = compiler.compile(spec)
    assert grammar.backend == backend
    done: Future[Grammar] = Future()
    done.set_result(grammar)
    (brace,) = qwen25.encode("{")
    (end,) = qwen25.encode("###")
    rule = _BraceRule(brace, end)
    row = Row(ConstraintRequest(spec), PendingGrammar(done, None, hedge_s=0.0), [], True,
              qwen25.tokens)
    row.gate = RuleGate(rule, [1, 2], False, lambda ids: [True] * len(ids))
    row.attach(grammar)
    return row, rule, spec


def _take(row: Row, tokens: list[int]) -> None:
    """Commit ``tokens`` to ``row`` as the host's read does (``Row.read``)."""
    row.seen += len(tokens)
    row.advance(tokens)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_rolling_back_exactly_an_implicit_end_reopens_the_gate(
        compiler: Compiler, qwen25: Vocabulary, backend: str) -> None:
    """The implicit end is the grammar's first token and ended reasoning: undoing it (and
    only it) gives the row back to reasoning, with the grammar at its start."""
    row, _, spec = _implicit_row(compiler, qwen25, backend)
    think = qwen25.encode(" hmm ok")
    brace, quote = qwen25.encode("{")[0], qwen25.encode('"')[0]
    _take(row, [*think, brace, quote])
    assert row.status == "active" and row.fed == 2
    row.rewind(1)
    assert row.status == "active" and row.fed == 1  # the brace still ended reasoning
    row.rewind(1)
    assert row.status == "thinking" and row.fed == 0
    assert row.gate is not None and row.gate.thinking_tokens == len(think)
    _take(row, [brace])
    assert row.status == "active" and row.fed == 1
    ref = RawReference(spec, qwen25, backend)  # type: ignore[arg-type]
    assert ref.accept(brace)
    assert row.matcher is not None
    words = torch.zeros((1, (qwen25.vocab_size + 31) // 32), dtype=torch.int32)
    row.matcher.fill(words, 0)
    assert torch.equal(words[0], ref.words())
    row.rewind(2)  # the brace and one thinking token
    assert row.status == "thinking" and row.gate.thinking_tokens == len(think) - 1


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_draft_with_an_implicit_end_masks_after_it_as_the_grammar(
        compiler: Compiler, qwen25: Vocabulary, backend: str) -> None:
    """Speculative decoding: a draft that goes from reasoning straight to the implicit end
    masks the positions after it with the grammar past that token (vLLM's engine feeds it to
    the grammar), and leaves the row as it was."""
    from grammask.decode.fill import RowMasks
    from grammask.decode.firstmask import FirstMasks
    from grammask.decode.step_apply import Drafts
    from grammask.decode.stepjob import FillStats

    row, _, spec = _implicit_row(compiler, qwen25, backend)
    think = qwen25.encode(" so")
    _take(row, think)
    assert row.status == "thinking"
    brace = qwen25.encode("{")[0]
    drafts = [*qwen25.encode(" then"), brace, *qwen25.encode('"a')]
    words = (qwen25.vocab_size + 31) // 32
    out = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
    first = FirstMasks.__new__(FirstMasks)  # unused: the row's matcher is attached
    Drafts(first, RowMasks(qwen25, "stop"), FillStats()).fill(
        row, drafts, out, list(range(len(drafts) + 1)))
    ref = RawReference(spec, qwen25, backend)  # type: ignore[arg-type]
    at = drafts.index(brace)
    for k, tid in enumerate(drafts[at:], start=at):
        assert ref.accept(tid)
        assert torch.equal(out[k + 1], ref.words()), f"position after draft {k}"
    assert row.status == "thinking" and row.fed == 0
    assert row.gate is not None and row.gate.thinking_tokens == len(think)
    fresh = RawReference(spec, qwen25, backend)  # type: ignore[arg-type]
    assert row.matcher is not None
    check = torch.zeros((1, words), dtype=torch.int32)
    row.matcher.fill(check, 0)
    assert torch.equal(check[0], fresh.words())  # the grammar is back at its start
