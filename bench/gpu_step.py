"""The decode step against vLLM's way on a real CUDA forward (issue 32, item 6); run by
``bench/gpu.py`` (and so by ``bench/gpu_check.sh``).

    python -m bench.gpu_step [--batch-sizes 1,16,64,256,512] [--forwards graph3,graph10,eager3]
                             [--workloads free,closed,corpus,choice] [--budget-s 240]

The sides and workloads are ``bench.step``'s (grammask's ``BatchProcessor`` against vLLM's
way with xgrammar and with llguidance, in its three models: the fill in another process,
whose step is ``max(forward, fill)``; the same with the bitmask's trip to the worker; one
GPU's in-process launch, fill, wait); only the forward is a real one on the GPU:

- ``graphN``: a CUDA graph of small matmuls replayed, about N ms on the GPU; the host only
  waits (``synchronize`` releases the GIL): what a host running CUDA graphs sees.
- ``eagerN``: the same kind of kernels launched one by one from Python for about N ms (the
  model runner's thread holds the GIL between launches, as under ``--enforce-eager``).

Each kind is calibrated on the device first. Cells run until ``--budget-s`` is spent (the
GPU script has minutes, not hours); the cells left are listed as skipped.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.paths import DEFAULT_CORPUS
from bench.stats import render_table, write_json
from bench.step import RATIOS, Forward, cell, make_walks, vllm_workers

SIDE = 256  # small matmuls: launch-bound when eager, like a small model's decode kernels


def cuda_forward(kind: str, device: str = "cuda") -> Forward:
    """A forward of about N ms (``graphN`` or ``eagerN``), calibrated on ``device``."""
    ms = float(kind[5:])
    a = torch.randn(SIDE, SIDE, device=device) / SIDE**0.5

    def chain(n: int) -> torch.Tensor:
        x: torch.Tensor = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        return x

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1000

    if kind.startswith("eager"):
        chain(8)
        per = statistics.median(timed(lambda: chain(64)) for _ in range(5)) / 64
        n = max(1, round(ms / per))

        def launch() -> None:
            chain(n)

        return Forward(launch, sync)
    if device != "cuda":
        raise ValueError("graph forwards need CUDA")
    n = 64
    graph = _capture(chain, n)
    per = statistics.median(timed(graph.replay) for _ in range(5)) / n
    n = max(1, round(ms / per))
    graph = _capture(chain, n)

    return Forward(graph.replay, torch.cuda.synchronize)


def _capture(chain: Callable[[int], torch.Tensor], n: int) -> Any:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(n)  # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(n)
    return graph


def step_vs_vllm(batches: Sequence[int], forwards: Sequence[str], workloads: Sequence[str],
                 *, steps: int = 8, repeats: int = 2, budget_s: float = 240.0,
                 device: str = "cuda", corpus: Path = DEFAULT_CORPUS) -> dict[str, Any]:
    """Every (workload, B, forward) cell the budget allows: median step ms per side and
    grammask's ratio to the better of vLLM's ways."""
    from grammask import Compiler, load_vocabulary

    logging.getLogger("grammask").setLevel(logging.ERROR)
    started = time.monotonic()
    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, timeout_s=60)
    raw = {name: Compiler(vocab, backend=name, timeout_s=60, tune_fill=False)
           for name in ("xgrammar", "guidance")}
    pool = ThreadPoolExecutor(vllm_workers())
    made = {kind: cuda_forward(kind, device) for kind in forwards}
    cells: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        for workload in workloads:
            try:
                walks = make_walks(workload, compiler, raw, vocab, corpus, 24)
            except (SystemExit, OSError) as exc:  # no corpus on this machine
                skipped.append(f"{workload}: {exc}")
                continue
            for batch in batches:
                for kind in forwards:
                    if time.monotonic() - started > budget_s:
                        skipped.append(f"{workload} B={batch} {kind}: out of time")
                        continue
                    forward = made[kind]
                    med, _, ratios = cell(compiler, walks, vocab, batch, forward, steps,
                                          repeats, pool)
                    cells.append({"workload": workload, "batch": batch, "forward": kind,
                                  "steps_ms": med} | {
                                      RATIOS[m]: round(r, 3) for m, r in ratios.items()})
                    print(f"step {workload} B={batch} {kind}: grammask {med['grammask']:.2f} "
                          f"ms, ratio {ratios['engine']:.2f}, with the bitmask's trip "
                          f"{ratios['rpc']:.2f}, in-process {ratios['inproc']:.2f}",
                          file=sys.stderr, flush=True)
    finally:
        pool.shutdown()
        for c in (compiler, *raw.values()):
            c.close()
    return {"cells": cells, "skipped": skipped,
            "worst_ratio": max((c["ratio_to_better_vllm"] for c in cells), default=None),
            "worst_ratio_rpc": max((c["ratio_to_better_vllm_rpc"] for c in cells),
                                   default=None)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16,64,256,512")
    ap.add_argument("--forwards", default="graph3,graph10,eager3")
    ap.add_argument("--workloads", default="free,closed,corpus,choice")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (eager forwards only)")
    ap.add_argument("--json")
    args = ap.parse_args(list(argv) if argv is not None else None)
    torch.set_num_threads(1)
    result = step_vs_vllm([int(b) for b in args.batch_sizes.split(",")],
                          args.forwards.split(","), args.workloads.split(","),
                          budget_s=args.budget_s, device=args.device)
    print(render_table(["workload", "B", "forward", "grammask_ms", "ratio", "ratio_rpc",
                        "ratio_inproc"], [
        [c["workload"], c["batch"], c["forward"], f"{c['steps_ms']['grammask']:.2f}",
         f"{c['ratio_to_better_vllm']:.2f}", f"{c['ratio_to_better_vllm_rpc']:.2f}",
         f"{c['ratio_to_better_vllm_inproc']:.2f}"]
        for c in result["cells"]]))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
