"""Adds made into rows by the fill job (``admissions.py``): off the host's thread, in the
order the host gave them, through moves, swaps and removes, with every failure kept to its
row. Masks are checked against raw-backend references (``tests/helpers.py``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from grammask import Compiler, Grammar, GrammarSpec, Mapped, Vocabulary
from grammask.decode.processor import Arrival, BatchProcessor
from grammask.decode.rows import RowMaker

from ..helpers import PATIENT, RawReference

CHOICES = [GrammarSpec.choice(words, backend="xgrammar") for words in
           (["alpha", "beta"], ["gamma", "delta"], ["epsilon", "zeta"], ["eta", "theta"])]


@pytest.fixture(scope="module")
def grammars(compiler: Compiler) -> list[Grammar]:
    return [compiler.compile(s) for s in CHOICES]


def allowed(row: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(row)


def masks(proc: BatchProcessor, batch: int, vocab: Vocabulary) -> torch.Tensor:
    proc.step()
    logits = torch.zeros(batch, vocab.vocab_size)
    proc.apply(logits)
    return logits


def expect(logits: torch.Tensor, row: int, grammar: Grammar | None, vocab: Vocabulary) -> None:
    if grammar is None:
        assert allowed(logits[row]).all(), f"row {row} should be free"
    else:
        assert torch.equal(allowed(logits[row]), RawReference.of(grammar, vocab).allowed()), row


class Calls:
    """A host's reader (``RequestReader``) whose parameters are callables returning the
    row's ``Arrival``: each test says what its host's parse does."""

    def arrival(self, params: Any, resumed: bool) -> Arrival:
        result: Arrival = params()
        return result


def test_rows_are_made_on_the_fill_thread(compiler: Compiler, grammars: list[Grammar],
                                          qwen25: Vocabulary,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``add`` leaves the row to the step's job: the row (request, pending compile, gate) is
    made on the fill thread, and ``add_later``'s parse (the host's reader) runs there too."""
    made_on: list[int] = []
    real = RowMaker.make

    def spy(self: RowMaker, *args: Any) -> Any:
        made_on.append(threading.get_ident())
        return real(self, *args)

    monkeypatch.setattr(RowMaker, "make", spy)
    resolved_on: list[int] = []

    def resolve() -> Arrival:
        resolved_on.append(threading.get_ident())
        return Arrival(CHOICES[1], grammars[1])

    with BatchProcessor(compiler, max_batch=2, think_end=None, reader=Calls(),
                        **PATIENT) as proc:
        proc.add(0, CHOICES[0], grammar=grammars[0])
        proc.add_later(1, resolve)
        assert made_on == [] and resolved_on == []
        assert proc.rows == [0, 1] and proc.has_rows
        logits = masks(proc, 2, qwen25)
        fill_thread = proc.fill_thread_id
        assert fill_thread is not None and fill_thread != threading.get_ident()
        assert made_on == [fill_thread] * 2 and resolved_on == [fill_thread]
        expect(logits, 0, grammars[0], qwen25)
        expect(logits, 1, grammars[1], qwen25)


def test_queued_adds_follow_moves_swaps_and_removes(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """What the host did to rows before the job made them holds, as if each add had been
    made at once: a V1 batch update removes, adds, then moves (condensing the batch)."""
    with BatchProcessor(compiler, max_batch=6, think_end=None, **PATIENT) as proc:
        proc.add(5, CHOICES[3], grammar=grammars[3])
        masks(proc, 6, qwen25)  # row 5 made; the rest queue below
        for row in range(4):
            proc.add(row, CHOICES[row], grammar=grammars[row])
        proc.move(0, 4)  # 0 -> 4 (queued)
        proc.swap(1, 5)  # a queued row and a made one trade places
        proc.remove(2)
        proc.add(3, None)  # None: the queued add leaves, the row is free
        assert proc.rows == [1, 4, 5]
        logits = masks(proc, 6, qwen25)
        for row, grammar in ((0, None), (1, grammars[3]), (2, None), (3, None),
                             (4, grammars[0]), (5, grammars[1])):
            expect(logits, row, grammar, qwen25)
        assert proc.errors == {}


def test_a_failing_resolve_errors_its_row_alone(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """A host's reader that raises, or returns something that is not a request, errors that
    row (stop tokens only); an unconstrained answer leaves the row free; the others are
    masked as usual."""
    def broken() -> Arrival:
        raise KeyError("lost params")

    with BatchProcessor(compiler, max_batch=4, think_end=None, reader=Calls(),
                        **PATIENT) as proc:
        proc.add_later(0, broken)
        proc.add_later(1, lambda: Arrival(42))  # type: ignore[arg-type]
        proc.add_later(2, lambda: Arrival(None))
        proc.add(3, CHOICES[0], grammar=grammars[0])
        logits = masks(proc, 4, qwen25)
        stops = sorted(qwen25.stop_ids)
        for row in (0, 1):
            assert allowed(logits[row]).nonzero().flatten().tolist() == stops
        assert "lost params" in (proc.error(0) or "")
        assert "ConstraintRequest" in (proc.error(1) or "")
        expect(logits, 2, None, qwen25)
        expect(logits, 3, grammars[0], qwen25)
        assert proc.rows == [0, 1, 3]


def test_the_host_may_ask_about_a_row_before_the_job(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """A host that asks about a queued row (or advances it) gets it made on its own thread;
    the next job does not make it again."""
    with BatchProcessor(compiler, max_batch=2, think_end=None, **PATIENT) as proc:
        proc.add(0, CHOICES[0], grammar=grammars[0])
        assert proc.status(0) == "compiling"  # made now, not yet attached
        text = qwen25.encode("alp")
        proc.advance(0, text)
        logits = masks(proc, 2, qwen25)
        ref = RawReference.of(grammars[0], qwen25)
        assert all(ref.accept(t) for t in text)
        assert torch.equal(allowed(logits[0]), ref.allowed())
        assert proc.info(0).constrained_tokens == len(text)


def test_an_add_after_a_named_step_is_masked_in_its_apply(
        compiler: Compiler, grammars: list[Grammar], qwen25: Vocabulary) -> None:
    """vLLM's V2 runner admits requests while the last step's fill runs (``step(rows)``):
    a row added then, and masked in this apply, is made and filled on the host; the job's
    own rows keep their masks."""
    with BatchProcessor(compiler, max_batch=3, think_end=None, **PATIENT) as proc:
        proc.add(0, CHOICES[0], grammar=grammars[0])
        proc.step([0])
        proc.add(2, CHOICES[2], grammar=grammars[2])
        logits = torch.zeros(2, qwen25.vocab_size)
        proc.apply(logits, Mapped([1, 0], [0, 2]))
        expect(logits, 1, grammars[0], qwen25)
        expect(logits, 0, grammars[2], qwen25)


def test_many_zero_waits_observe_as_many_single_waits() -> None:
    """``metrics.observe_many`` (a step's new rows' first-mask waits in one update) leaves
    a histogram exactly as the same observations one by one would."""
    prom = pytest.importorskip("prometheus_client")
    from grammask import metrics

    registry = prom.CollectorRegistry()
    one = prom.Histogram("one_by_one", "", ["outcome"], registry=registry)
    many = prom.Histogram("in_one_update", "", ["outcome"], registry=registry)
    for value, count in ((0.0, 150), (0.02, 3), (7.5, 2), (1e9, 1)):
        for _ in range(count):
            one.labels(outcome="ready").observe(value)
        metrics.observe_many(many.labels(outcome="ready"), value, count)

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name.replace(name, ""), s.labels, s.value) for m in registry.collect()
                if m.name == name for s in m.samples if not s.name.endswith("_created")]

    assert samples("one_by_one") == samples("in_one_update")
    assert samples("one_by_one")[-2][2] == 156  # _count


def test_add_later_refuses_what_it_cannot_call(compiler: Compiler) -> None:
    """A host that calls ``add_later`` without giving the processor a reader, or hands it a
    parse that is no ``Arrival``, hears it at once, and the batch is as before."""
    with BatchProcessor(compiler, max_batch=2, think_end=None, **PATIENT) as proc:
        with pytest.raises(TypeError, match="reader"):
            proc.add_later(0, {"params": 1})
        with pytest.raises(TypeError, match="Arrival"):
            proc.add_later(0, None, parsed=CHOICES[0])  # type: ignore[arg-type]
        with pytest.raises(IndexError):
            proc.add_later(2, None, parsed=Arrival(None))
        assert proc.rows == [] and not proc.has_rows


def test_a_step_is_freed_by_the_next_job_and_steps_never_chain(
        compiler: Compiler, grammars: list[Grammar]) -> None:
    """The step a host waited for is dropped by the next step's job (its per-row work is
    freed on the fill thread, not in the host's wait); a step with no job (an empty batch)
    drops it at once, so an idle processor stepped on and on holds one step, not a chain."""
    with BatchProcessor(compiler, max_batch=2, think_end=None, **PATIENT) as proc:
        jobs = proc._jobs
        proc.add(0, CHOICES[0], grammar=grammars[0])
        proc.step()
        proc.wait_masks()
        waited = jobs._last_waited
        assert waited is not None and waited.work  # the host keeps it until the next job
        proc.step()
        proc.wait_masks()
        assert jobs._last_waited is not None and jobs._last_waited is not waited
        assert jobs._last_waited.before is None  # the job dropped the one before
        proc.remove(0)
        for _ in range(5):  # no rows: no job
            proc.step()
            proc.wait_masks()
            assert jobs._last_waited is not None and jobs._last_waited.before is None
