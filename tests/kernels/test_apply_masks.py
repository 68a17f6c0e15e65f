"""Mask buffers, the fill worker, batch-parallel fills and the apply kernel (CPU paths).

The CUDA branch of ``apply_bitmask`` cannot run here (no GPU); it is not covered.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from typing import Any

import pytest
import torch

from grammask import Compiler, GrammarSpec, Vocabulary, allocate_bitmask
from grammask.backends import Matcher
from grammask.backends.guidance import tokenizer_view
from grammask.decode.fill import Filler, FillWorker, stop_only_row
from grammask.decode.processor import BatchProcessor
from grammask.kernels.apply import apply_bitmask
from grammask.kernels.buffers import MaskBuffers
from grammask.kernels.cpu_plan import plan_cpu_apply

from ..helpers import ThreadClock, feed

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "n": {"type": "integer"}}, "required": ["name", "n"]}
INSTANCE = json.dumps({"name": "grammask", "tags": ["a", "bc"], "n": 12},
                      separators=(",", ":"))


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Bool (rows, width): bit set = allowed."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.flatten(1)[:, :width].bool()


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, vocab: int,
                    rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    width = logits.shape[1]
    covered = min(width, vocab, bitmask.shape[1] * 32)
    allowed = unpack(bitmask, covered)
    for r in rows:
        out[r, :covered] = torch.where(allowed[r], logits[r, :covered],
                                       torch.tensor(float("-inf"), dtype=logits.dtype))
        out[r, covered:] = float("-inf")
    return out


def test_buffers_are_allocated_once_and_alternate() -> None:
    bufs = MaskBuffers(4, 151_936)
    first, second, third = bufs.acquire(), bufs.acquire(), bufs.acquire()
    assert first.shape == (4, 4748) and first.dtype == torch.int32
    assert first.data_ptr() != second.data_ptr()
    assert third.data_ptr() == first.data_ptr()  # reused, not reallocated
    assert bufs.count == 2


def make_bitmask(kind: str, rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """random: every word mixed; sparse: a few allowed tokens (the save/fill/restore path);
    mixed: sparse and free-text-like rows in one batch."""
    dense = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    if kind == "random":
        return dense
    sparse = torch.zeros(rows, words, dtype=torch.int32)
    for r in range(rows):
        for w in torch.randint(0, words, (3,), generator=gen).tolist():
            sparse[r, w] = int(dense[r, w])
    sparse[:, -1] = -1  # bits past the vocabulary set too: they must not leak
    if kind == "sparse":
        return sparse
    return torch.where(torch.arange(rows).unsqueeze(1) % 2 == 0, sparse, dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("width", "vocab"), [(320, 320), (352, 320), (300, 320), (333, 333)])
@pytest.mark.parametrize("rows", [None, [0, 3], [2]])
@pytest.mark.parametrize("kind", ["random", "sparse", "mixed"])
def test_apply_matches_reference(dtype: torch.dtype, width: int, vocab: int,
                                 rows: list[int] | None, kind: str) -> None:
    gen = torch.Generator().manual_seed(width * 7 + vocab)
    logits = torch.randn(4, width, generator=gen).to(dtype)
    bitmask = make_bitmask(kind, 4, (vocab + 31) // 32, gen)
    expected = reference_apply(logits, bitmask, vocab, rows if rows is not None else [0, 1, 2, 3])
    apply_bitmask(logits, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(logits, expected)


def test_apply_on_real_masks(advanced: list[Matcher], qwen25: Vocabulary) -> None:
    """Masks of real matchers (structural rows allow a few tokens, string rows most)."""
    n = len(advanced)
    bitmask = allocate_bitmask(n, qwen25.vocab_size)
    for row, m in enumerate(advanced):
        m.fill(bitmask, row)
    for width in (qwen25.vocab_size, qwen25.vocab_size + 128):
        logits = torch.randn(n, width, dtype=torch.bfloat16)
        expected = reference_apply(logits, bitmask, qwen25.vocab_size, list(range(n)))
        apply_bitmask(logits, bitmask, vocab_size=qwen25.vocab_size)
        assert torch.equal(logits, expected)


def test_apply_one_dimensional_and_non_contiguous_logits() -> None:
    bitmask = torch.tensor([[0b101, 0]], dtype=torch.int32)
    vec = torch.zeros(40)
    apply_bitmask(vec, bitmask, vocab_size=40)
    assert torch.isfinite(vec).nonzero().flatten().tolist() == [0, 2]
    wide = torch.zeros(40, 2).t()  # stride (1, 2): goes through the torch fallback
    apply_bitmask(wide, bitmask.expand(2, 2).contiguous(), vocab_size=40, indices=[1])
    assert torch.isfinite(wide[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(wide[0]).all()


@pytest.mark.parametrize("kind", ["random", "sparse", "mixed"])
def test_apply_to_row_strided_logits(kind: str) -> None:
    """Logits that are a column slice of a wider buffer (rows strided apart)."""
    gen = torch.Generator().manual_seed(3)
    storage = torch.randn(5, 400, generator=gen)
    logits = storage[1:, 16:336]  # 4 rows of 320, row stride 400
    before = storage.clone()
    bitmask = make_bitmask(kind, 4, 10, gen)
    expected = reference_apply(logits, bitmask, 320, [0, 2, 3])
    apply_bitmask(logits, bitmask, vocab_size=320, indices=[0, 2, 3])
    assert torch.equal(logits, expected)
    outside = torch.ones_like(storage, dtype=torch.bool)
    outside[1:, 16:336] = False
    assert torch.equal(storage[outside], before[outside])  # nothing written around it


def test_apply_rejects_rows_outside_the_logits() -> None:
    with pytest.raises(ValueError, match="outside"):
        apply_bitmask(torch.zeros(2, 64), torch.zeros(4, 2, dtype=torch.int32), vocab_size=64,
                      indices=[3])


def test_stop_only_row(qwen25: Vocabulary) -> None:
    row = stop_only_row(qwen25.stop_ids, qwen25.vocab_size)
    allowed = unpack(row.unsqueeze(0), qwen25.vocab_size)[0]
    assert sorted(allowed.nonzero().flatten().tolist()) == sorted(qwen25.stop_ids)


@pytest.fixture(scope="module")
def advanced(compiler: Compiler, qwen25: Vocabulary) -> list[Matcher]:
    """Matchers of both backends at many different states (one terminated per backend)."""
    matchers = []
    ids = qwen25.encode(INSTANCE)
    for backend in ("xgrammar", "guidance"):
        grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, any_whitespace=False,
                                                         backend=backend))
        for cut in range(0, len(ids) + 1, 2):
            m = grammar.matcher()
            assert all(m.accept(t) for t in ids[:cut])
            matchers.append(m)
        done = grammar.matcher()
        assert all(done.accept(t) for t in ids) and done.accept(qwen25.stop_ids[0])
        matchers.append(done)
    return matchers


@pytest.mark.parametrize("parallel_min", [1, 4, 1000])
def test_batch_parallel_fill_equals_the_loop(advanced: list[Matcher], qwen25: Vocabulary,
                                             parallel_min: int) -> None:
    n = len(advanced)
    rows = [(i * 7) % n for i in range(n)]  # scattered row order
    expected = allocate_bitmask(n, qwen25.vocab_size)
    for m, row in zip(advanced, rows, strict=True):
        m.fill(expected, row)
    got = torch.zeros_like(expected)
    Filler(parallel_min=parallel_min, threads=2).fill(list(zip(advanced, rows, strict=True)),
                                                       got)
    assert torch.equal(got, expected)
    assert not torch.equal(expected[rows[0]], expected[rows[-1]])  # the states differ


def test_worker_runs_jobs_in_order_on_its_own_thread() -> None:
    worker = FillWorker()
    seen: list[tuple[int, int]] = []
    tickets = [worker.run(lambda i=i: seen.append((i, threading.get_ident())) or i)
               for i in range(20)]
    assert [t.result(timeout=10) for t in tickets] == list(range(20))
    assert [i for i, _ in seen] == list(range(20))
    assert {t for _, t in seen} == {worker.thread_id} != {threading.get_ident()}
    worker.close()


def test_worker_tickets_are_each_used_once_and_a_dropped_worker_stops() -> None:
    """``run`` takes the spare ticket the thread made after its last job: jobs queued back
    to back and one at a time each get a ticket of their own, with their own result; a
    worker dropped without ``close`` still stops its thread (it holds the worker weakly)."""
    worker = FillWorker()
    release = threading.Event()
    tickets = [worker.run(release.wait)] + [worker.run(lambda i=i: i) for i in range(5)]
    release.set()
    tickets += [worker.run(lambda i=i: -i) for i in range(1, 4)]
    assert len({id(t) for t in tickets}) == len(tickets)
    assert [t.result(timeout=10) for t in tickets] == [True, 0, 1, 2, 3, 4, -1, -2, -3]
    for i in range(20):  # one at a time: the spare is taken, then made again
        ticket = worker.run(lambda i=i: i)
        assert ticket.result(timeout=10) == i and ticket not in tickets
        tickets.append(ticket)
    thread = worker._thread
    del worker
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_helpers_agree(compiler: Compiler, qwen25: Vocabulary) -> None:
    """The reference unpacker used here reads masks the way the matchers write them."""
    m = compiler.compile(GrammarSpec.regex("ab")).matcher()
    assert feed(m, qwen25, "a")
    bm = allocate_bitmask(1, qwen25.vocab_size)
    m.fill(bm, 0)
    allowed = unpack(bm, qwen25.vocab_size)[0].nonzero().flatten().tolist()
    assert allowed == [qwen25.token_id("b")]


@pytest.mark.parametrize("bad", ["uint8", "narrow", "row"])
def test_batch_fill_keeps_the_fill_contract(advanced: list[Matcher], qwen25: Vocabulary,
                                            bad: str) -> None:
    """The backends' batch fills write through raw pointers too: a bitmask or row outside the
    contract is a ValueError before any write, as for ``Matcher.fill``."""
    words = (qwen25.vocab_size + 31) // 32
    bitmask = (torch.zeros(len(advanced), words * 4, dtype=torch.uint8) if bad == "uint8"
               else torch.zeros(len(advanced), words - 1, dtype=torch.int32) if bad == "narrow"
               else torch.zeros(len(advanced), words, dtype=torch.int32))
    rows = [(m, i if bad != "row" else i + len(advanced)) for i, m in enumerate(advanced)]
    before = bitmask.clone()
    with pytest.raises(ValueError, match="fill"):
        Filler(parallel_min=1).fill(rows, bitmask)
    assert torch.equal(bitmask, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("width", "vocab"), [(320, 320), (352, 320), (300, 320)])
@pytest.mark.parametrize("kind", ["random", "sparse", "mixed"])
def test_planned_apply_matches_reference(dtype: torch.dtype, width: int, vocab: int,
                                         kind: str) -> None:
    """A plan made ahead (as the fill thread does) masks exactly like the reference, NaN and
    inf logits included (the plan writes -inf's bit pattern and restores saved bits)."""
    gen = torch.Generator().manual_seed(width + vocab)
    storage = torch.randn(5, width + 8, generator=gen).to(dtype)
    storage[:, ::7] = float("nan")
    storage[:, 3::11] = float("inf")
    logits = storage[1:, 4:4 + width]  # rows strided apart
    bitmask = make_bitmask(kind, 4, (vocab + 31) // 32, gen)
    rows = [0, 2, 3]
    plan = plan_cpu_apply(bitmask, rows, vocab_size=vocab, width=width,
                          stride=logits.stride(0))
    expected = reference_apply(logits, bitmask, vocab, rows)
    apply_bitmask(logits, bitmask, vocab_size=vocab, indices=rows, plan=plan)
    assert torch.equal(logits.isnan(), expected.isnan())
    assert torch.equal(logits.nan_to_num(0.5), expected.nan_to_num(0.5))


def test_a_plan_for_other_rows_or_layout_is_not_used() -> None:
    gen = torch.Generator().manual_seed(5)
    bitmask = make_bitmask("mixed", 4, 10, gen)
    plan = plan_cpu_apply(bitmask, [0, 1], vocab_size=320, width=320, stride=320)
    for logits, rows in ((torch.randn(4, 320, generator=gen), [0, 1, 2]),
                         (torch.randn(4, 336, generator=gen), [0, 1])):
        expected = reference_apply(logits, bitmask, 320, rows)
        apply_bitmask(logits, bitmask, vocab_size=320, indices=rows, plan=plan)
        assert torch.equal(logits, expected)


def test_a_plan_checks_the_shape_of_another_bitmask() -> None:
    """A plan handed another bitmask than its own (fewer rows than the plan masks) is
    checked against that one's shape and refused, as an apply without a plan is; the logits
    are left as they were."""
    gen = torch.Generator().manual_seed(7)
    bitmask = make_bitmask("mixed", 4, 10, gen)
    plan = plan_cpu_apply(bitmask, [0, 3], vocab_size=320, width=320, stride=320)
    logits = torch.randn(4, 320, generator=gen)
    expected = reference_apply(logits, bitmask, 320, [0, 3])
    apply_bitmask(logits, bitmask, vocab_size=320, indices=[0, 3], plan=plan)
    assert torch.equal(logits, expected)
    other = bitmask[:2].clone()  # rows 0-1 only: row 3 is outside it
    logits = torch.randn(4, 320, generator=gen)
    before = logits.clone()
    with pytest.raises(ValueError, match="outside"):
        apply_bitmask(logits, other, vocab_size=320, indices=[0, 3], plan=plan)
    assert torch.equal(logits, before)


def test_worker_tickets_return_results_and_errors() -> None:
    worker = FillWorker()
    tickets = [worker.run(lambda i=i: i * 2) for i in range(10)]
    assert [t.result(timeout=10) for t in tickets] == [i * 2 for i in range(10)]
    assert all(t.done() for t in tickets)

    def boom() -> None:
        raise RuntimeError("job failed")

    failed = worker.run(boom)
    with pytest.raises(RuntimeError, match="job failed"):
        failed.result(timeout=10)
    with pytest.raises(RuntimeError, match="job failed"):  # raises again, like a Future
        failed.result()
    assert worker.run(lambda: 5).result(timeout=10) == 5
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.run(lambda: 1)


@pytest.mark.timing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processor_apply_with_the_job_plan_equals_a_plain_apply(
        compiler: Compiler, qwen25: Vocabulary, dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second step the fill job plans the CPU apply for the last logits' layout and
    ``apply`` uses that plan; the masked logits are those of an unplanned apply of the same
    masks (a second processor fed the same tokens), step by step, and a layout change (wider
    logits) falls back to the kernels until the plan follows it.

    Timing: the job plans only while it, planning included, fits in 0.9 of the forward it
    overlaps, on the real clock (``planned == 7``). The job (advance, fill, plan) takes
    0.6-2.5 ms a step here, 6.6 ms at worst measured on a loaded two-core machine; the
    stand-in forward is an 80 ms sleep (72 ms allowed): a margin of 10x over that worst
    step, 30x over a typical one."""
    import grammask.kernels.apply as apply_module

    real = apply_module._apply_plan
    used: list[int] = []

    def counted(*args: Any) -> None:
        used.append(1)
        real(*args)

    monkeypatch.setattr(apply_module, "_apply_plan", counted)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    tokens = qwen25.encode(INSTANCE)
    gen = torch.Generator().manual_seed(1)
    with BatchProcessor(compiler, max_batch=3, think_end=None) as proc, \
            BatchProcessor(compiler, max_batch=3, think_end=None) as plain:
        for row in (0, 2):
            proc.add(row, grammar.spec, grammar=grammar)
            plain.add(row, grammar.spec, grammar=grammar)
        planned = 0
        for step, tok in enumerate(tokens[:8]):
            width = qwen25.vocab_size + (64 if step == 5 else 0)
            logits = torch.randn(3, width, generator=gen).to(dtype)
            proc.step()
            plain.step()
            time.sleep(0.08)  # the forward the job overlaps (timing: the margin above)
            got = logits.clone()
            proc.apply(got)
            planned += proc.stats.last_plan_ms > 0
            bitmask, rows = plain.wait_masks()
            want = logits.clone()
            apply_bitmask(want, bitmask, vocab_size=qwen25.vocab_size, indices=rows)
            assert rows == [0, 2]
            assert torch.equal(got, want), step
            for row in rows:
                proc.advance(row, [tok])
                plain.advance(row, [tok])
        assert planned == 7  # every step after the first
        # not at the wider logits (step 5), nor at the next (planned for the wider ones)
        assert len(used) == 5
        assert proc.errors == {}


def test_one_slow_plan_leaves_planning_on(compiler: Compiler, qwen25: Vocabulary,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan far longer than the forward, first (a cold start) or once among fast ones (a
    preempted thread), does not turn planning off: the decision takes the fastest of the
    recent plans, the first two left out. A job that does not plan reports 0 ms.

    On a stand-in clock (``ThreadClock``): each forward is 80 ms, a plan 1 ms, the slow ones
    300 ms; the job's real work takes no time on it, so only the plans' times decide."""
    import grammask.decode.stepjob as stepjob

    clock = ThreadClock(monkeypatch, stepjob)
    real = stepjob.plan_cpu_apply
    calls: list[int] = []

    def plan(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(calls) + 1)
        clock.advance(0.3 if len(calls) in (1, 5) else 0.001)  # on the fill worker's clock
        return real(*args, **kwargs)

    monkeypatch.setattr(stepjob, "plan_cpu_apply", plan)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    tokens = qwen25.encode(INSTANCE)
    with BatchProcessor(compiler, max_batch=2, think_end=None) as proc:
        proc.add(0, grammar.spec, grammar=grammar)
        for step, tok in enumerate(tokens[:9]):
            proc.step()
            clock.advance(0.08)  # the forward the job overlaps (the host's clock)
            proc.apply(torch.zeros(2, qwen25.vocab_size))
            assert (proc.stats.last_plan_ms > 0) == (step > 0), step
            proc.advance(0, [tok])
        assert len(calls) == 8  # every step after the first
        proc.step()  # logits the planned apply does not take (as GPU logits): no plan next
        proc.apply(torch.zeros(2, qwen25.vocab_size, dtype=torch.float64))
        proc.step()
        proc.wait_masks()
        assert proc.stats.last_plan_ms == 0.0 and len(calls) == 9
        assert proc.errors == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "vocab"), [(320, 320), (352, 320), (300, 320)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 0], [2]])
def test_planned_apply_on_back_to_back_rows_matches_reference(
        dtype: torch.dtype, width: int, vocab: int, rows: list[int]) -> None:
    """Contiguous logits (the common layout: the plan's flat view is a reshape of them), rows
    in any order, wiped and scattered rows mixed: masked exactly like the reference."""
    gen = torch.Generator().manual_seed(width + len(rows))
    logits = torch.randn(4, width, generator=gen).to(dtype)
    logits[:, ::9] = float("nan")
    bitmask = make_bitmask("mixed", 4, (vocab + 31) // 32, gen)
    plan = plan_cpu_apply(bitmask, rows, vocab_size=vocab, width=width, stride=width)
    if len(rows) > 1:  # even rows allow few tokens (wiped), odd ones most (scattered)
        assert plan.keep.size and plan.kill.size and plan.runs
    expected = reference_apply(logits, bitmask, vocab, rows)
    apply_bitmask(logits, bitmask, vocab_size=vocab, indices=rows, plan=plan)
    assert torch.equal(logits.isnan(), expected.isnan())
    assert torch.equal(logits.nan_to_num(0.5), expected.nan_to_num(0.5))


def test_a_plan_keeps_the_row_checks() -> None:
    """Rows outside the bitmask are refused when planning; logits with fewer rows than the
    plan's are refused when applying, as without a plan."""
    gen = torch.Generator().manual_seed(3)
    bitmask = make_bitmask("mixed", 4, 10, gen)
    for bad in ([0, 4], [-1, 2]):
        with pytest.raises(ValueError, match="outside"):
            plan_cpu_apply(bitmask, bad, vocab_size=320, width=320, stride=320)
    plan = plan_cpu_apply(bitmask, [0, 3], vocab_size=320, width=320, stride=320)
    short = torch.randn(2, 320, generator=gen)
    before = short.clone()
    with pytest.raises(ValueError, match="outside"):
        apply_bitmask(short, bitmask, vocab_size=320, indices=[0, 3], plan=plan)
    assert torch.equal(short, before)


def test_a_small_batch_fills_on_the_fill_thread(advanced: list[Matcher],
                                               qwen25: Vocabulary) -> None:
    """Fewer matchers than ``parallel_min``: one-thread batch calls on the fill thread (no
    pool of the backends' threads is made: llguidance's one-thread executor at most, which
    fills the rows in one call), with the same masks."""
    n = len(advanced)
    expected = allocate_bitmask(n, qwen25.vocab_size)
    for row, m in enumerate(advanced):
        m.fill(expected, row)
    filler = Filler(parallel_min=n + 1, threads=2)
    got = torch.zeros_like(expected)
    filler.fill([(m, row) for row, m in enumerate(advanced)], got)
    assert torch.equal(got, expected)
    assert set(filler._pools) <= {"xgrammar1", "guidance_exec0"}


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_the_fill_thread_runs_on_the_cpus_it_was_given() -> None:
    """vLLM's CPU worker pins itself to its OpenMP cores, and a thread it starts inherits
    that: the fill thread must be movable off them (read back from /proc, the kernel's own
    view of the thread's affinity)."""
    import os

    from grammask.decode.fill import FillWorker

    def allowed(tid: int) -> str:
        with open(f"/proc/self/task/{tid}/status", encoding="ascii") as f:
            return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))

    mine = sorted(os.sched_getaffinity(0))
    for cpus, expected in ((frozenset({mine[-1]}), str(mine[-1])), (None, allowed(
            threading.get_native_id()))):
        worker = FillWorker(cpus=cpus)
        try:
            tid = worker.run(threading.get_native_id).result()
            assert allowed(tid) == expected
            with open(f"/proc/self/task/{tid}/comm", encoding="ascii") as f:
                assert f.read().strip() == "grammask-fill"  # top -H and py-spy show it
        finally:
            worker.close()


@pytest.fixture(scope="module")
def hf_vocab() -> Vocabulary:
    """A Hugging Face tokenizer's vocabulary: llguidance tokenizes natively."""
    from grammask import load_vocabulary

    from ..vllm_fixtures import model_dir

    return load_vocabulary(str(model_dir()))


def test_guidance_lanes_keep_every_row_exact(hf_vocab: Vocabulary) -> None:
    """A batch fill on 3 threads spreads one grammar's rows over one template per thread
    (rows moved by replaying their tokens): every mask equals a serial twin's, before and
    after more tokens and a rollback, and new matchers are made on the new lanes."""
    qwen25 = hf_vocab
    compiler = Compiler(qwen25, tune_fill=False)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, backend="guidance"))
    tokens = qwen25.encode(INSTANCE)
    rows = [grammar.matcher() for _ in range(12)]
    twins = [grammar.matcher() for _ in range(12)]
    for i, (m, t) in enumerate(zip(rows, twins, strict=True)):
        assert all(m.accept(x) and t.accept(x) for x in tokens[:i])
    filler = Filler(parallel_min=1, threads=3)
    for rollback in (0, 0, 2):
        got = allocate_bitmask(12, qwen25.vocab_size)
        want = allocate_bitmask(12, qwen25.vocab_size)
        filler.fill([(m, i) for i, m in enumerate(rows)], got)
        for i, t in enumerate(twins):
            t.fill(want, i)
        assert torch.equal(got, want)
        for i, (m, t) in enumerate(zip(rows, twins, strict=True)):
            if rollback and m.accepted() >= rollback:  # type: ignore[attr-defined]
                m.rollback(rollback)
                t.rollback(rollback)
            elif i + 1 < len(tokens):
                assert m.accept(tokens[i + 1]) == t.accept(tokens[i + 1])
    assert sorted({m.lane for m in rows}) == [0, 1, 2]  # type: ignore[attr-defined]
    assert {grammar.matcher().lane for _ in range(3)} == {0, 1, 2}  # type: ignore[attr-defined]
    compiler.close()


def test_guidance_batch_fill_stays_on_one_thread_with_a_python_tokenizer(
        compiler: Compiler, qwen25: Vocabulary) -> None:
    """A tokenizer callback takes the GIL inside fills: the batch fill stays serial (no lane
    is made) and its masks are the loop's."""
    assert not tokenizer_view(qwen25).native
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, backend="guidance"))
    tokens = qwen25.encode(INSTANCE)
    rows = [grammar.matcher() for _ in range(8)]
    for i, m in enumerate(rows):
        assert all(m.accept(x) for x in tokens[:i])
    got = allocate_bitmask(8, qwen25.vocab_size)
    want = allocate_bitmask(8, qwen25.vocab_size)
    Filler(parallel_min=1, threads=4).fill([(m, i) for i, m in enumerate(rows)], got)
    for i, m in enumerate(rows):
        m.fill(want, i)
    assert torch.equal(got, want) and {m.lane for m in rows} == {0}  # type: ignore[attr-defined]
