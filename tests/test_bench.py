"""The benchmark scripts run end to end on a tiny sample, so they never rot.

No timing is asserted (numbers belong in bench/ and docs/benchmarks.md): only the shape of the
JSON they write, and that every spec is accounted for as served, refused or timed out.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# ``bench`` is the repository's package (not installed): importable because pytest puts the
# root of the checkout (the parent of the ``tests`` package) on sys.path, like ``python -m``
from bench import compile as compile_bench
from bench import vllm_throughput as throughput
from bench.cases import Case, extra_cases, load_maskbench, stratified
from bench.stats import cpu_ticks, dist, percentile, steal_share
from bench.systems import parse_systems

from grammask import Compiler, Vocabulary

DIST_KEYS = {"n", "p50_ms", "p90_ms", "p99_ms", "max_ms"}


# ------------------------------------------------------------------ pure helpers
def _pools(sizes: dict[str, int]) -> dict[str, list[Case]]:
    return {name: [Case(f"{name}/{i}", name, "json_schema", "{}") for i in range(n)]
            for name, n in sizes.items()}


def test_stratified_sample_is_exact_proportional_and_seeded() -> None:
    pools = _pools({"big": 900, "mid": 90, "small": 3, "tiny": 1})
    first = stratified(pools, 40, seed=7)
    assert len(first) == 40
    per = {name: sum(c.group == name for c in first) for name in pools}
    assert per["big"] > per["mid"] > 0 and per["tiny"] == 1 and per["small"] == 2
    assert first == stratified(pools, 40, seed=7)
    assert first != stratified(pools, 40, seed=8)
    assert len({c.id for c in first}) == 40
    assert len(stratified(pools, 10_000, seed=0)) == 994  # capped by the corpus


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    d = dist([float(i) for i in range(1, 101)])
    assert d["n"] == 100 and d["max_ms"] == 100 and d["p50_ms"] == 50.5
    assert abs(d["p99_ms"] - 99.01) < 1e-9


def test_corpus_cases_cover_every_kind(corpus: Path) -> None:
    cases = load_maskbench(corpus, 30, 0, need_instances=True)
    assert len(cases) == 30 and all(c.instances for c in cases)
    assert len({c.group for c in cases}) >= 10  # stratified over the subsets
    for c in cases:
        json.loads(c.source)
    extras = extra_cases(corpus)
    assert {c.kind for c in extras} == {"regex", "choice", "grammar"}
    assert {c.syntax for c in extras if c.kind == "grammar"} == {"ebnf", "lark"}


def test_throughput_summary_rotates_systems_and_takes_per_round_ratios() -> None:
    """The real-server throughput bench's bookkeeping (the server itself: ``make
    bench-server``-style runs, not here)."""
    orders = [throughput._order(r, 0) for r in range(3)]
    assert all(sorted(o) == sorted(throughput.SYSTEMS) for o in orders)
    assert len({o[0] for o in orders}) == 3  # each system goes first once in three rounds
    tpot = {"grammask": [10.0, 12.0, 30.0], "vllm": [20.0, 20.0, 20.0],
            "unconstrained": [5.0, 6.0, 10.0]}
    cells = [{"round": r, "spec": "regex", "concurrency": 32, "system": system,
              "tokens_per_s": 100.0 * (r + 1), "server_tpot_ms": values[r],
              "server_ttft_ms": 1.0, "request_ms_per_token_p50": 2.0, "requests": 4,
              "valid": 4, "not_fixed": 1 if system == "vllm" and r == 0 else 0}
             for system, values in tpot.items() for r in range(3)]
    spec = throughput.SPECS["regex"]
    rows = {r["system"]: r for r in throughput.summarize(cells, [spec], [32])}
    g = rows["grammask"]
    assert g["tokens_per_s"] == {"median": 200.0, "min": 100.0, "max": 300.0, "n": 3,
                                 "spread": 1.0}
    assert g["tpot_vs_vllm"] == {"median": 0.6, "min": 0.5, "max": 1.5, "n": 3,
                                 "spread": round(1.0 / 0.6, 3)}
    assert rows["vllm"]["tpot_ms"]["spread"] == 0.0
    # the bar: <= 1.0 in the median, but grammask's rounds are 0.5-1.5x apart
    assert throughput.verdict(list(rows.values())) == (
        "TPOT grammask/vLLM <= 1.0 at c >= 16: 1/1 cells (in every round: 0/1); its spread "
        "across rounds < 10%: 0/1 (not: regex c=32); both systems' TPOT spreads < 10% too: "
        "0/1")
    assert g["tpot_vs_unconstrained"]["median"] == 2.0  # per round: 2, 2, 3
    assert rows["vllm"]["not_fixed"] == 1 and rows["vllm"]["tpot_vs_vllm"] is None
    assert rows["unconstrained"]["tpot_vs_unconstrained"] is None
    assert "| regex | 32 |" in throughput.table(list(rows.values())).replace("  ", " ")
    # how many requests of a batch the server ran at once: latencies over the wall time
    assert throughput.overlap({"e2e_sum": 30.0, "e2e_count": 16.0}, 2.0) == 15.0
    assert throughput.overlap({"e2e_sum": 0.0, "e2e_count": 0.0}, 2.0) is None
    assert throughput.overlap(None, 2.0) is None
    # every standard request asks for fixed work; only vLLM's carries the opt-out key
    fields = {system: throughput.request_fields(throughput.case_of(spec, system), system)
              for system in throughput.SYSTEMS}
    assert all(f["extra_body"]["ignore_eos"] is True for f in fields.values())
    assert fields["vllm"]["extra_body"]["vllm_xargs"] == throughput.OPT_OUT
    assert "structured_outputs" not in fields["unconstrained"]["extra_body"]
    assert fields["grammask"]["extra_body"].keys() == {"structured_outputs", "ignore_eos"}


def test_throughput_ratio_pairs_chunks_that_ran_next_to_each_other() -> None:
    """A round's ratio is the median of its chunk-by-chunk ratios: one slow spell (both
    systems' second batch 2x slower, but grammask's more) moves the cell means, not it."""
    chunks = {"grammask": [10.0, 30.0, 10.0, 10.0, 10.0], "vllm": [20.0, 40.0, 20.0, 20.0, 20.0]}
    cells = [{"round": 0, "spec": "regex", "concurrency": 32, "system": system,
              "chunk_tpot_ms": values, "server_tpot_ms": sum(values) / len(values)}
             for system, values in chunks.items()]
    assert throughput.tpot_ratio(cells, "regex", 32, "grammask", "vllm") == {
        "median": 0.5, "min": 0.5, "max": 0.5, "n": 1, "spread": 0.0}
    # cells without per-chunk TPOTs (older JSON) fall back to the cell means
    for c in cells:
        del c["chunk_tpot_ms"]
    assert throughput.tpot_ratio(cells, "regex", 32, "grammask", "vllm")["median"] == round(
        14.0 / 24.0, 3)


def test_steal_share_reads_this_machines_cpu_time() -> None:
    """The bench's per-chunk steal: real ``/proc/stat`` counters, which only grow, and the
    share the hypervisor took between two readings."""
    before = cpu_ticks()
    assert before is not None  # Linux: /proc/stat is there
    assert before["total"] >= before["steal"] >= 0
    sum(i * i for i in range(2_000_000))  # some CPU time passes
    after = cpu_ticks()
    assert after is not None and after["total"] >= before["total"]
    assert after["steal"] >= before["steal"]
    share = steal_share(before, after)
    assert share is None or 0.0 <= share <= 1.0
    assert steal_share({"total": 100, "steal": 10}, {"total": 300, "steal": 60}) == 0.25
    assert steal_share(before, before) is None  # no time passed: no share
    assert steal_share(None, after) is None


# ------------------------------------------------------------------- end to end
def _check_summary(summary: dict[str, object], systems: list[str], cases: int) -> None:
    assert list(summary) == systems
    for name in systems:
        s = summary[name]
        assert isinstance(s, dict)
        assert s["ok"] + s["errors"] + s["timeouts"] == s["cases"] == cases, name
        for block in ("cold_compile", "ttfm"):
            assert set(s[block]) >= DIST_KEYS, (name, block)
            assert s[block]["n"] == s["ok"]


def test_compile_bench_tiny_sample(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    systems = ["xgrammar", "llguidance", "grammask-auto", "grammask-guidance"]
    rc = compile_bench.main([
        "--corpus", str(corpus), "--sample", "3", "--subsets", "Glaiveai2K,BFCL_simple",
        "--systems", ",".join(systems), "--repeats", "2", "--timeout", "60",
        "--json", str(out), "--quiet", "--log-dir", str(tmp_path)])
    assert rc == 0
    payload = json.loads(out.read_text())
    cases = payload["config"]["cases"]
    assert cases == 3 + len(extra_cases(corpus))
    _check_summary(payload["summary"], systems, cases)
    rows = payload["rows"]
    assert len(rows) == cases * len(systems)
    assert {r["system"] for r in rows} == set(systems)
    for r in rows:
        assert r["status"] in ("ok", "error", "timeout")
        if r["status"] == "ok":
            assert 0 < r["cold_ms"] <= r["ttfm_ms"] and r["allowed"] > 0
        else:
            assert r["error"]
    auto = [r for r in rows if r["system"] == "grammask-auto" and r["status"] == "ok"]
    assert auto and all(r["backend"] in ("xgrammar", "guidance") and r["reason"] for r in auto)
    assert all("hit_ms" in r for r in auto)  # grammask serves a repeat from its cache
    ratios = payload["ratios"]
    assert "grammask-auto vs the raw backend it routed to (ttfm)" in ratios["overhead"]
    assert ratios["auto"]["n"] > 0
    assert "versions" in payload["machine"]
    # --report re-derives the same summary from the rows, measuring nothing
    again = tmp_path / "again.json"
    assert compile_bench.main(["--report", str(out), "--json", str(again)]) == 0
    assert json.loads(again.read_text())["summary"] == payload["summary"]


def test_compile_bench_counts_timeouts_and_restarts_the_worker(corpus: Path) -> None:
    """A deadline nothing can meet: every spec is a timeout (the worker is killed and
    restarted each time), none is dropped."""
    cases = load_maskbench(corpus, 2, 0, ["Glaiveai2K"])
    result = compile_bench.run(cases, ["llguidance"], {
        "timeout": 1e-6, "grace_s": 0.0, "tokenizer": "qwen2.5"}, quiet=True)
    rows = result["rows"]
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert result["setup"]["llguidance"]["restarts"] >= 1
    summary = compile_bench.summarize(rows, ["llguidance"], result["unavailable"])
    assert summary["llguidance"]["timeouts"] == 2 and summary["llguidance"]["ok"] == 0


def test_unknown_system_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_systems("xgrammar,outlines")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_backends_run_in_the_compile_benchmark(corpus: Path, tmp_path: Path) -> None:
    """vLLM's own backends (about a minute of set-up each on two cores)."""
    systems = ["vllm-xgrammar", "vllm-guidance"]
    assert compile_bench.main([
        "--corpus", str(corpus), "--sample", "1", "--subsets", "Glaiveai2K", "--no-extras",
        "--systems", ",".join(systems), "--json", str(tmp_path / "c.json"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "c.json").read_text())["summary"]
    _check_summary(summary, systems, 1)
    assert summary["vllm-xgrammar"]["ok"] == 1 and "cache_hit" in summary["vllm-xgrammar"]


def test_gate_waits_until_the_api_server_went_quiet(tmp_path: Path) -> None:
    """``bench.gate``: with every send begun, the wait lasts until the watched process has
    stopped using CPU (a real child process that burns CPU, then marks that it stopped)."""
    import subprocess
    import sys

    from bench.gate import Gate, cpu_seconds

    done = tmp_path / "done"
    child = subprocess.Popen([sys.executable, "-c", (
        "import time, pathlib\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.4: pass\n"
        f"pathlib.Path({str(done)!r}).write_text('x')\n"
        "time.sleep(30)\n")])
    try:
        gate = Gate("http://127.0.0.1:9", child.pid)  # nothing listens: only the wait runs
        assert not gate.available()
        gate.wait_handed_over(lambda: 3, 3)
        assert done.exists()  # it did not return while the child was still busy
        assert (cpu_seconds(child.pid) or 0.0) >= 0.3
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None  # gone: no time to read


@pytest.mark.parametrize("name", ["json-xg-long", "json-llg-long"])
def test_long_json_checks_take_real_truncated_outputs_and_refuse_wrong_items(name: str) -> None:
    """The long specs' outputs are cut at max_tokens, so their check is a prefix check. Fed
    what grammask's real masks let a random sampler write in 64 tokens, it must pass; an item
    out of the schema's bounds, or a closing bracket before 200 items, must not."""
    import random

    from bench.vllm_server import Result

    import grammask
    from grammask import GrammarSpec, allocate_bitmask
    from tests.helpers import words_to_bool

    vocab = grammask.load_vocabulary("qwen2.5")
    spec_case = throughput.SPECS[name]
    schema = throughput.XG_LONG if name == "json-xg-long" else throughput.LLG_LONG
    grammar = grammask.Compiler(vocab).compile(GrammarSpec.json_schema(schema))
    assert grammar.backend == ("xgrammar" if name == "json-xg-long" else "guidance")
    rng = random.Random(7)
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    for _ in range(3):
        matcher = grammar.matcher()
        tokens: list[int] = []
        for _ in range(64):
            matcher.fill(bitmask, 0)
            allowed = words_to_bool(bitmask[0], vocab.vocab_size).nonzero().flatten().tolist()
            token = rng.choice(allowed)
            assert matcher.accept(token)
            tokens.append(token)
        text = vocab.decode(tokens).decode("utf-8", errors="replace")
        assert spec_case.check(Result(text=text)), text
    bad = ["[1,2]", "[1000", "[01"] if name == "json-xg-long" else \
        ['["a","b"]', '["abcdefg"', '[""', '["a\n"']
    for text in bad:
        assert not spec_case.check(Result(text=text)), text


def test_gpu_step_cells_run_on_an_eager_cpu_forward(corpus: Path) -> None:
    """``bench.gpu_step`` (the GPU script's decode-step cells) on the CPU with an eager
    forward: every side runs, a ratio comes out, and the budget skips instead of running
    on. Shape only: no timing is asserted."""
    from bench.gpu_step import step_vs_vllm

    out = step_vs_vllm([1, 4], ["eager1"], ["closed"], steps=2, repeats=1, device="cpu",
                       corpus=corpus, budget_s=600)
    assert [(c["batch"], c["forward"]) for c in out["cells"]] == [(1, "eager1"), (4, "eager1")]
    assert all(c["ratio_to_better_vllm"] > 0 and c["ratio_to_better_vllm_inproc"] > 0
               for c in out["cells"])
    none = step_vs_vllm([1], ["eager1"], ["closed"], steps=2, repeats=1, device="cpu",
                        corpus=corpus, budget_s=0)
    assert none["cells"] == [] and none["skipped"] == ["closed B=1 eager1: out of time"]


@pytest.fixture(scope="module")
def closed_walks(compiler: Compiler, qwen25: Vocabulary, corpus: Path) -> Iterator[list[Any]]:
    """``bench.step``'s ``closed`` workload, one schema (its raw engines' grammars too)."""
    from bench import step as step_bench

    raw = {n: Compiler(qwen25, backend=n, timeout_s=60, tune_fill=False)
           for n in ("xgrammar", "guidance")}
    try:
        yield step_bench.make_walks("closed", compiler, raw, qwen25, corpus, 1)
    finally:
        for c in raw.values():
            c.close()


@pytest.mark.parametrize("layout", ["engine", "inproc"])
def test_vllm_step_layouts_order_the_fill_as_vllm_does(
        layout: str, closed_walks: list[Any], qwen25: Vocabulary,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.step``'s model of vLLM: with the fill in another process (``engine``) the
    forward runs after the fill, timed on its own; in one process (``inproc``, vLLM's
    ``uni`` executor) ``EngineCore.step`` launches the forward, fills, then waits."""
    from concurrent.futures import ThreadPoolExecutor

    from bench import step as step_bench

    events: list[str] = []
    real = step_bench._xgr_matcher
    monkeypatch.setattr(step_bench, "_xgr_matcher",
                        lambda w, v: _FillSpy(real(w, v), events))
    forward = step_bench.Forward(lambda: events.append("launch"),
                                 lambda: events.append("finish"))
    with ThreadPoolExecutor(1) as pool:
        step_bench.vllm_steps("xgrammar", closed_walks, qwen25, 1, forward, 1, pool, layout)
    one_step = events[-3:]
    assert one_step == (["launch", "fill", "finish"] if layout == "inproc"
                        else ["fill", "launch", "finish"])


@pytest.mark.parametrize("rows", [1, 64])
def test_bitmask_trip_round_trips_as_vllms_queue(rows: int) -> None:
    """``bench.vllm_rpc.Trip`` hands the worker what vLLM's ``MessageQueue`` does: an equal
    ``GrammarOutput`` whose bitmask (out of band from 1 MiB: 64 rows) no longer reads the
    reused slot, so the next send cannot change it."""
    import numpy as np
    from bench.vllm_rpc import GrammarOutput, Trip

    bitmask = np.arange(rows * 4748, dtype=np.int32).reshape(rows, 4748)
    trip = Trip()
    try:
        trip.send(GrammarOutput([f"r{i}" for i in range(rows)], bitmask))
        got = trip.receive()
        trip.send(GrammarOutput(["x"], np.zeros((rows, 4748), dtype=np.int32)))
        assert got.structured_output_request_ids == [f"r{i}" for i in range(rows)]
        assert np.array_equal(got.grammar_bitmask, bitmask)
        assert not np.shares_memory(got.grammar_bitmask, bitmask)
    finally:
        trip.close()


def test_step_models_order_the_parts(compiler: Compiler, closed_walks: list[Any],
                                     qwen25: Vocabulary,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """grammask's side waits for its masks between the forward's launch and its end (the
    runner's apply follows the launch); vLLM's ``rpc`` model of the same steps costs more
    than the issue's ``engine`` model: with a forward whose host part is all of it, the
    worker's receive comes after the launch loop."""
    from concurrent.futures import ThreadPoolExecutor

    from bench import step as step_bench

    events: list[str] = []
    monkeypatch.setattr(step_bench.BatchProcessor, "wait_masks",
                        _spied(step_bench.BatchProcessor.wait_masks, events, "wait"))
    forward = step_bench.Forward(lambda: events.append("launch"),
                                 lambda: events.append("finish"))
    busy = step_bench.make_forward("busy2")
    step_bench.grammask_steps(compiler, closed_walks, 2, forward, 1)
    with ThreadPoolExecutor(1) as pool:
        times = step_bench.vllm_steps("xgrammar", closed_walks, qwen25, 64, busy, 3, pool)
    assert events[-3:] == ["launch", "wait", "finish"]
    assert all(r > e for r, e in zip(times["rpc"], times["engine"], strict=True))


def test_a_finished_request_leaves_grammasks_step(compiler: Compiler, closed_walks: list[Any],
                                                  qwen25: Vocabulary,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that just sampled its stop token is not stepped (vLLM's side does not fill it:
    its request finished, and the runner's next batch has no row for it); its next request
    comes with the next step."""
    from bench import step as step_bench

    stepped: list[tuple[list[int], list[int]]] = []
    real_step = step_bench.BatchProcessor.step

    def step(self: Any, rows: Any = None, tokens: Any = None) -> None:
        if rows is not None:
            stepped.append((list(rows), list(tokens)))
        real_step(self, rows, tokens)

    monkeypatch.setattr(step_bench.BatchProcessor, "step", step)
    forward = step_bench.Forward(lambda: None, lambda: None)
    length = len(closed_walks[0].tokens)
    step_bench.grammask_steps(compiler, closed_walks, 3, forward, length)
    assert stepped and not any(t in qwen25.stop_ids for _, tokens in stepped for t in tokens)
    assert any(len(rows) < 3 for rows, _ in stepped)


def _spied(method: Any, events: list[str], name: str) -> Any:
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append(name)
        return method(self, *args, **kwargs)
    return spy


class _FillSpy:
    """An xgrammar matcher whose fills are noted in ``events``."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        self._inner = inner
        self._events = events

    def fill_next_token_bitmask(self, *args: Any) -> Any:
        self._events.append("fill")
        return self._inner.fill_next_token_bitmask(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_the_entry_point_lists_every_benchmark_and_runs_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench`` lists each benchmark module of bench/ (the ones with a ``main``)
    and dispatches ``python -m bench NAME ...`` to it."""
    from bench.__main__ import BENCHMARKS, main

    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in BENCHMARKS)
    root = Path(__file__).resolve().parents[1] / "bench"
    runnable = {p.stem for p in root.glob("*.py")
                if "\ndef main(" in p.read_text() and p.stem != "__main__"}
    assert runnable == set(BENCHMARKS)
    with pytest.raises(SystemExit) as exc:
        main(["compile", "--help"])
    assert exc.value.code == 0 and "usage: python -m bench.compile" in capsys.readouterr().out
    assert main(["nonsense"]) == 2


def test_the_wave_runs_its_four_sides_on_one_tiny_wave(tmp_path: Path) -> None:
    """``bench.wave`` on 4 rows of short notes: every side (switch, off, forced xgrammar,
    vLLM's way) times steps, and the JSON carries each side's median and the ratios to
    forced xgrammar and to vLLM's way."""
    from bench import wave

    out = tmp_path / "wave.json"
    assert wave.main(["--batch-sizes", "4", "--repeats", "1", "--steps", "6", "--words", "4",
                      "--verdict", "rival", "--json", str(out)]) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["B"] == 4
    for side in wave.SIDES:
        assert cell[side]["median"] is not None and cell[side]["median"] > 0, side
    assert {"ratio_switch", "ratio_off", "ratio_switch_vllm", "ratio_off_vllm"} <= set(cell)
