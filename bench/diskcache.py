"""Time to first mask: cold xgrammar compile versus loaded from the disk cache, fresh process.

    python -m bench.diskcache [--corpus PATH] [--sample 300] [--top 20] [--seed 0]
                              [--timeout 60] [--json out/bench/diskcache.json]

1. Selection: a stratified sample of maskbench schemas is compiled with the backend forced to
   xgrammar (one backend, disk cache on, so every grammar is also written); the ``--top``
   slowest that compiled are kept. Errors and timeouts are counted, not measured.
2. For every kept schema, two fresh processes (vocabulary and compiler built before the clock
   starts): ``cold`` (no disk cache: compile, matcher, first fill of a (1, words) bitmask) and
   ``disk`` (the same request served from the file phase 1 wrote).

Heavy grammars (patterned properties, tens of MB) and the writer's memory:
bench/diskcache_heavy.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cases import load_maskbench
from bench.paths import DEFAULT_CORPUS, REPO_ROOT
from bench.stats import dist, fmt_ms, machine_info, percentile, render_table, write_json


def worker(mode: str, directory: str, source: str) -> dict[str, Any]:
    """One request in this fresh process: TTFM from ``compiler.compile`` to the first fill."""
    from grammask import Compiler, GrammarSpec, allocate_bitmask, load_vocabulary

    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, backend="xgrammar", timeout_s=600,
                    disk_cache_dir=directory if mode == "disk" else None,
                    disk_cache_bytes=1 << 40)
    spec = GrammarSpec.json_schema(source)
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    started = time.perf_counter()
    grammar = compiler.compile(spec)
    got = time.perf_counter()
    grammar.matcher().fill(bitmask, 0)
    done = time.perf_counter()
    return {"ttfm_ms": (done - started) * 1000, "grammar_ms": (got - started) * 1000,
            "from_disk": grammar.from_disk, "disk_hits": compiler.stats.disk_hits}


def _run_worker(mode: str, directory: Path, source: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.diskcache", "--worker", mode, "--dir",
         str(directory)], input=source, capture_output=True, text=True, timeout=timeout,
        cwd=REPO_ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or [f"rc {proc.returncode}"]}
    out = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    if mode == "disk" and not out.get("from_disk"):
        out["error"] = [line for line in proc.stderr.splitlines()
                        if "disk" in line or "rror" in line][-3:] or ["not in the disk cache"]
    return out


def select(args: argparse.Namespace, directory: Path) -> tuple[list[dict[str, Any]],
                                                               dict[str, int]]:
    """Compile the sample with xgrammar forced (filling the disk cache); the slowest."""
    from grammask import Compiler, CompileTimeoutError, GrammarError, GrammarSpec, load_vocabulary

    cases = load_maskbench(args.corpus, args.sample, args.seed)
    compiler = Compiler(load_vocabulary("qwen2.5"), backend="xgrammar", timeout_s=args.timeout,
                    disk_cache_dir=directory, disk_cache_bytes=1 << 40)
    timed: list[dict[str, Any]] = []
    counts = {"sampled": len(cases), "compiled": 0, "errors": 0, "timeouts": 0}
    for i, case in enumerate(cases, 1):
        try:
            grammar = compiler.compile(GrammarSpec.json_schema(case.source))
        except CompileTimeoutError:
            counts["timeouts"] += 1
            continue
        except GrammarError:
            counts["errors"] += 1
            continue
        counts["compiled"] += 1
        timed.append({"id": case.id, "source": case.source, "select_ms": grammar.compile_ms})
        if i % 50 == 0:
            print(f"  selection: {i}/{len(cases)}", file=sys.stderr, flush=True)
    compiler.flush_disk_cache()
    compiler.close()
    timed.sort(key=lambda r: -r["select_ms"])
    return timed[:args.top], counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--sample", type=int, default=300)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="per compile, selection")
    ap.add_argument("--json", type=Path, default=REPO_ROOT / "out" / "bench" / "diskcache.json")
    ap.add_argument("--worker", choices=("cold", "disk"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir or "", sys.stdin.read())))
        return 0

    from grammask.backends.xgrammar_disk import key_material
    from grammask.diskcache import DiskCache

    directory = Path(tempfile.mkdtemp(prefix="grammask-diskbench-"))
    try:
        t0 = time.perf_counter()
        chosen, counts = select(args, directory)
        select_s = time.perf_counter() - t0
        from grammask import GrammarSpec, load_vocabulary

        vocab = load_vocabulary("qwen2.5")
        cache = DiskCache(directory, 1 << 40)
        rows: list[dict[str, Any]] = []
        for n, item in enumerate(chosen, 1):
            path = cache.path_for(key_material(GrammarSpec.json_schema(item["source"]), vocab))
            cold = _run_worker("cold", directory, item["source"], args.timeout * 3)
            disk = _run_worker("disk", directory, item["source"], args.timeout * 3)
            row = {"id": item["id"], "select_ms": item["select_ms"],
                   "cold_ttfm_ms": cold.get("ttfm_ms"), "disk_ttfm_ms": disk.get("ttfm_ms"),
                   "disk_load_ms": disk.get("grammar_ms"),
                   "from_disk": disk.get("from_disk"),
                   "file_bytes": path.stat().st_size if path.exists() else None,
                   "errors": [e for e in (cold.get("error"), disk.get("error")) if e]}
            rows.append(row)
            print(f"  {n}/{len(chosen)} {item['id']}: cold {fmt_ms(row['cold_ttfm_ms'])} ms, "
                  f"disk {fmt_ms(row['disk_ttfm_ms'])} ms", file=sys.stderr, flush=True)
        files, used = cache.usage()
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    ok = [r for r in rows if r["cold_ttfm_ms"] is not None and r["disk_ttfm_ms"] is not None
          and r["from_disk"]]
    table = [[r["id"], fmt_ms(r["cold_ttfm_ms"]), fmt_ms(r["disk_ttfm_ms"]),
              f"{r['cold_ttfm_ms'] / r['disk_ttfm_ms']:.1f}x",
              f"{(r['file_bytes'] or 0) / 1e6:.2f}"] for r in ok]
    cold_ms = [r["cold_ttfm_ms"] for r in ok]
    disk_ms = [r["disk_ttfm_ms"] for r in ok]
    speedups = [c / d for c, d in zip(cold_ms, disk_ms, strict=True)]
    table.append(["**p50**", fmt_ms(percentile(cold_ms, 50)), fmt_ms(percentile(disk_ms, 50)),
                  f"{percentile(speedups, 50):.1f}x", ""])
    table.append(["**total**", fmt_ms(sum(cold_ms)), fmt_ms(sum(disk_ms)),
                  f"{sum(cold_ms) / max(sum(disk_ms), 1e-9):.1f}x",
                  f"{sum((r['file_bytes'] or 0) for r in ok) / 1e6:.1f}"])
    print(render_table(["schema (xgrammar forced)", "cold TTFM ms", "disk TTFM ms", "speedup",
                        "file MB"], table))
    print(f"\nselection: {counts} in {select_s:.0f} s; the disk held {files} files, "
          f"{used / 1e6:.1f} MB; {len(rows) - len(ok)} rows failed")
    write_json(args.json, {"benchmark": "diskcache", "machine": machine_info(),
                           "args": {k: str(v) for k, v in vars(args).items()},
                           "selection": counts, "selection_s": round(select_s, 1),
                           "disk_files": files, "disk_bytes": used,
                           "cold_ttfm": dist(cold_ms), "disk_ttfm": dist(disk_ms),
                           "speedup_p50": round(percentile(speedups, 50), 2),
                           "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
