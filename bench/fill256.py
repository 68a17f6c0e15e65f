"""Large-batch fill: 256 rows per step, per backend, every way to fill them, side by side.

    python -m bench.fill256 [--rows 256] [--steps 30] [--sample 64] [--seed 1] [--json OUT]

Rows walk valid corpus instances (as ``bench/overlap.py``: maskbench schemas, Qwen2.5
vocabulary), split by the backend grammask routed each schema to; each backend gets ``--rows``
rows of its own schemas at spread positions, and every step all rows advance by one token.
Methods, taking turns within each step so background load hits them alike:

- ``loop``: ``Matcher.fill`` row by row on one thread (grammask's default on < 4 cores);
- ``backend-tN``: the backend's batch-parallel fill with N threads (``Filler(parallel_min=1)``:
  xgrammar ``BatchGrammarMatcher.batch_fill_next_token_bitmask``, llguidance
  ``LLExecutor.unsafe_compute_mask_ptr``);
- ``vllm-pool-wN``: vLLM's own scheme (``vllm/v1/structured_output/__init__.py``): above 128
  rows, chunks of 16 rows go to a ``ThreadPoolExecutor`` of ``min(cpus // 2, 8)`` workers
  (N; 1 on this 2-core machine, 2 for comparison), each chunk a plain fill loop.

Reported per (backend, method): p50 wall ms per step, rows/s (wall), CPU ms per step (process
CPU time, all threads) and rows per CPU-second ("rows/s/core": what one core buys).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.overlap import Walk, prepare
from bench.paths import DEFAULT_CORPUS
from bench.stats import fmt_ms, machine_info, percentile, render_table, write_json
from grammask import Compiler, load_vocabulary
from grammask.backends import Matcher
from grammask.bitmask import allocate_bitmask
from grammask.masks import Filler

VLLM_CHUNK = 16  # vLLM's fill_bitmask_parallel_batch_size


def vllm_workers() -> int:
    """vLLM's pool size: ``max(1, min(cpu_count // 2, 8))``."""
    return max(1, min((os.cpu_count() or 1) // 2, 8))


def methods(rows: list[tuple[Matcher, int]], pools: list[ThreadPoolExecutor],
            threads: list[int]) -> dict[str, tuple[Callable[[torch.Tensor], None], int]]:
    """name -> (fill all rows into the bitmask, threads it may use)."""
    def loop(bitmask: torch.Tensor) -> None:
        for m, r in rows:
            m.fill(bitmask, r)

    out: dict[str, tuple[Callable[[torch.Tensor], None], int]] = {"loop": (loop, 1)}
    for n in threads:
        filler = Filler(parallel_min=1, threads=n)

        def batch_fill(bitmask: torch.Tensor, filler: Filler = filler) -> None:
            filler.fill(rows, bitmask)

        out[f"backend-t{n}"] = (batch_fill, n)
    chunks = [rows[i:i + VLLM_CHUNK] for i in range(0, len(rows), VLLM_CHUNK)]

    def chunk_fill(chunk: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        for m, r in chunk:
            m.fill(bitmask, r)

    for pool in pools:
        def pooled(bitmask: torch.Tensor, pool: ThreadPoolExecutor = pool) -> None:
            for f in [pool.submit(chunk_fill, c, bitmask) for c in chunks]:
                f.result()

        out[f"vllm-pool-w{pool._max_workers}"] = (pooled, pool._max_workers)
    return out


def measure(walks: list[Walk], vocab_size: int, n_rows: int, steps: int,
            threads: list[int]) -> dict[str, Any]:
    rows: list[tuple[Matcher, int]] = []
    pos: list[int] = []
    for i in range(n_rows):
        walk = walks[i % len(walks)]
        m = walk.grammar.matcher()
        p = (i * 7) % (len(walk.tokens) - 1)
        for t in walk.tokens[:p]:
            m.accept(t)
        rows.append((m, i))
        pos.append(p)
    bitmask = allocate_bitmask(n_rows, vocab_size)
    sizes = sorted({1, 2, vllm_workers()})
    pools = [ThreadPoolExecutor(max_workers=w) for w in sizes]
    try:
        table = methods(rows, pools, threads)
        for fill, _ in table.values():
            fill(bitmask)  # warm up the pools
        wall: dict[str, list[float]] = {k: [] for k in table}
        cpu: dict[str, list[float]] = {k: [] for k in table}
        names = list(table)
        for step in range(steps):
            for name in names[step % len(names):] + names[:step % len(names)]:
                c0, t0 = time.process_time(), time.perf_counter()
                table[name][0](bitmask)
                wall[name].append((time.perf_counter() - t0) * 1000)
                cpu[name].append((time.process_time() - c0) * 1000)
            for i, (m, _) in enumerate(rows):  # every row advances by one token
                walk = walks[i % len(walks)]
                if pos[i] >= len(walk.tokens) or not m.accept(walk.tokens[pos[i]]):
                    m.reset()
                    pos[i] = 0
                else:
                    pos[i] += 1
    finally:
        for pool in pools:
            pool.shutdown()
    out: dict[str, Any] = {}
    for name, (_, used) in table.items():
        w50, c50 = percentile(wall[name], 50), percentile(cpu[name], 50)
        out[name] = {"threads": used, "wall_ms_p50": round(w50, 4),
                     "wall_ms_p90": round(percentile(wall[name], 90), 4),
                     "cpu_ms_p50": round(c50, 4),
                     "rows_per_s": round(n_rows / w50 * 1000),
                     "rows_per_cpu_s": round(n_rows / c50 * 1000) if c50 > 0 else None,
                     "rows_per_s_per_core": round(n_rows / w50 * 1000 / min(
                         used, os.cpu_count() or 1))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fill256", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", default="1,2", help="backend batch-fill threads to try")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    logging.getLogger("grammask").setLevel(logging.ERROR)
    started = time.perf_counter()
    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, timeout_s=10)
    walks = prepare(compiler, vocab, args.corpus, args.sample, args.seed)
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    results: dict[str, Any] = {}
    for backend in ("xgrammar", "guidance"):
        mine = [w for w in walks if w.grammar.backend == backend]
        if not mine:
            results[backend] = {"error": "no schema of the sample routed here"}
            continue
        results[backend] = {"schemas": len(mine),
                            "methods": measure(mine, vocab.vocab_size, args.rows, args.steps,
                                               threads)}
    compiler.close()
    table = []
    for backend, res in results.items():
        if "error" in res:
            table.append([backend, res["error"], *[""] * 6])
            continue
        loop = res["methods"]["loop"]["wall_ms_p50"]
        for name, r in res["methods"].items():
            table.append([backend, name, r["threads"], fmt_ms(r["wall_ms_p50"]),
                          f"{loop / r['wall_ms_p50']:.2f}x", r["rows_per_s"],
                          r["rows_per_s_per_core"], r["rows_per_cpu_s"]])
    print(f"# {args.rows} rows per step, {args.steps} steps, {os.cpu_count()} cores; "
          f"vLLM's pool on this machine: {vllm_workers()} worker(s)")
    print(render_table(["backend", "method", "threads", "wall_ms_p50", "vs loop", "rows/s",
                        "rows/s/core", "rows/cpu-s"], table))
    payload = {"benchmark": "fill256", "machine": machine_info(), "rows": args.rows,
               "steps": args.steps, "vllm_workers": vllm_workers(), "results": results,
               "elapsed_s": round(time.perf_counter() - started, 1)}
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
