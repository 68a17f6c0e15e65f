"""Heavy xgrammar grammars and the disk cache: cold compile vs load, and the writer's memory.

    python -m bench.diskcache_heavy [--props 12 40] [--repeats 5]
                                    [--json out/bench/diskcache_heavy.json]

The schemas are objects of N required string properties, each with its own ``pattern``
(``^[A-Z][a-z]{2,44..52}-[0-9]{3,10..14}$``): xgrammar precomputes a mask for every state of
every pattern, so the compile takes seconds and the grammar tens of MB. Every measurement is a
fresh process (vocabulary and compiler built before anything is measured):

1. ``write``: compile, then the adapter's ``store_compiled`` and wait for it; the serving process's
   peak RSS growth during the write, and the writer child's report (its peak RSS above its
   start-up footprint, the JSON and file sizes).
2. ``--repeats`` rounds of ``cold`` (no disk cache) and ``disk`` (the file from 1), in
   turn: time to first mask from
   ``compiler.compile`` (or the read) to the first fill, its CPU time (all threads: what a
   machine with busy cores would see), and the peak RSS growth.

Medians over the rounds; a speedup is the median of the per-round ratios. Peak RSS growth is
measured by resetting the peak (``/proc/self/clear_refs``) before the measured step.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.paths import REPO_ROOT
from bench.stats import fmt_ms, machine_info, render_table, write_json

#: Per round, each in a fresh process: compile, then load from the disk cache.
MODES = ("cold", "disk")


def patterned_schema(props: int) -> dict[str, Any]:
    """N string properties, each with its own pattern (no two share their mask states)."""
    properties = {
        f"field_{i}": {"type": "string",
                       "pattern": f"^[A-Z][a-z]{{2,{44 + i % 9}}}-[0-9]{{3,{10 + i % 5}}}$"}
        for i in range(props)}
    return {"type": "object", "properties": properties, "required": list(properties)}


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) * 1024 if match else 0


def _start_peak() -> int:
    """Reset this process's peak RSS (Linux ``clear_refs``) and return the RSS now: what the
    work that follows allocates is then ``_kib("VmHWM")`` minus that."""
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS")


def worker(mode: str, directory: str, source: str) -> dict[str, Any]:
    """One measurement in this fresh process."""
    from grammask import Compiler, GrammarSpec, allocate_bitmask, load_vocabulary
    from grammask.backends.diskcache import DiskCache
    from grammask.backends.xgrammar import XGrammarBackend, tokenizer_info

    vocab = load_vocabulary("qwen2.5")
    tokenizer_info(vocab)  # a server builds it at start-up
    spec = GrammarSpec.json_schema(source)
    if mode == "write":
        started = time.perf_counter()
        backend = XGrammarBackend()
        compiled = backend.compile(spec, vocab, lenient=False)
        compile_ms = (time.perf_counter() - started) * 1000
        before = _start_peak()
        out: dict[str, Any] = {"compile_ms": compile_ms,
                               "grammar_bytes": compiled.memory_bytes}
        cache = DiskCache(directory, 1 << 40)
        out["queued"] = backend.store_compiled(cache, spec, vocab, compiled,
                                               compile_ms=compile_ms)
        out["flushed"] = cache.flush(1800)
        out["child"] = cache.last_write
        out["growth_bytes"] = _kib("VmHWM") - before
        return out
    compiler = Compiler(vocab, backend="xgrammar", timeout_s=1800,
                        disk_cache_dir=directory if mode == "disk" else None,
                        disk_cache_bytes=1 << 40)
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    before = _start_peak()
    started, cpu = time.perf_counter(), time.process_time()
    grammar = compiler.compile(spec)
    got = time.perf_counter()
    grammar.matcher().fill(bitmask, 0)
    done, cpu_done = time.perf_counter(), time.process_time()
    compiler.close()
    return {"ttfm_ms": (done - started) * 1000, "grammar_ms": (got - started) * 1000,
            "cpu_ms": (cpu_done - cpu) * 1000, "from_disk": grammar.from_disk,
            "growth_bytes": _kib("VmHWM") - before}


def run_worker(mode: str, directory: Path, source: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.diskcache_heavy", "--worker", mode, "--dir",
         str(directory)], input=source, capture_output=True, text=True, timeout=3600,
        cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} worker failed: {proc.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "disk" and not out.get("from_disk"):
        raise RuntimeError(f"the disk worker compiled: {proc.stderr.strip()[-2000:]}")
    return out


def measure(props: int, repeats: int) -> dict[str, Any]:
    source = json.dumps(patterned_schema(props))
    directory = Path(tempfile.mkdtemp(prefix="grammask-heavybench-"))
    try:
        write = run_worker("write", directory, source)
        child = write["child"] or {}
        if not child.get("written"):
            raise RuntimeError(f"{props} properties: not written: {child.get('why')}")
        rounds = []
        for n in range(repeats):
            one = {mode: run_worker(mode, directory, source) for mode in MODES}
            rounds.append(one)
            print(f"  {props} properties, round {n + 1}/{repeats}: " + ", ".join(
                f"{m} {fmt_ms(one[m]['ttfm_ms'])} ms" for m in MODES),
                file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    def med(mode: str, key: str = "ttfm_ms") -> float:
        return float(statistics.median(r[mode][key] for r in rounds))

    def ratio(mode: str, key: str = "ttfm_ms") -> float:  # median of the per-round ratios
        return float(statistics.median(r["cold"][key] / r[mode][key] for r in rounds))

    return {
        "props": props, "grammar_bytes": write["grammar_bytes"],
        "json_bytes": child["json_bytes"], "file_bytes": child["file_bytes"],
        "cold_ttfm_ms": med("cold"), "disk_ttfm_ms": med("disk"),
        "speedup": ratio("disk"),
        "speedup_min": min(r["cold"]["ttfm_ms"] / r["disk"]["ttfm_ms"] for r in rounds),
        "cold_cpu_ms": med("cold", "cpu_ms"), "disk_cpu_ms": med("disk", "cpu_ms"),
        "speedup_cpu": ratio("disk", "cpu_ms"),
        "child_peak_bytes": child["peak_rss"],
        "child_growth_bytes": child["peak_rss"] - child["base_rss"],
        "serving_write_growth_bytes": write["growth_bytes"],
        "load_growth_bytes": statistics.median(r["disk"]["growth_bytes"] for r in rounds),
        "cold_growth_bytes": statistics.median(r["cold"]["growth_bytes"] for r in rounds),
        "write": write, "rounds": rounds}


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--props", type=int, nargs="+", default=[12, 40])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path,
                    default=REPO_ROOT / "out" / "bench" / "diskcache_heavy.json")
    ap.add_argument("--worker", choices=("cold", "disk", "write"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir or "", sys.stdin.read())))
        return 0
    t0 = time.perf_counter()
    rows = [measure(props, args.repeats) for props in args.props]
    table = [[r["props"], _mb(r["grammar_bytes"]), _mb(r["json_bytes"]), _mb(r["file_bytes"]),
              fmt_ms(r["cold_ttfm_ms"]), fmt_ms(r["disk_ttfm_ms"]),
              f"{r['speedup']:.1f}x (min {r['speedup_min']:.1f}x)",
              f"{fmt_ms(r['cold_cpu_ms'])} / {fmt_ms(r['disk_cpu_ms'])} = "
              f"{r['speedup_cpu']:.1f}x",
              f"{_mb(r['child_peak_bytes'])} (+{_mb(r['child_growth_bytes'])})",
              f"+{_mb(r['serving_write_growth_bytes'])}",
              f"+{_mb(r['load_growth_bytes'])}"] for r in rows]
    print(render_table(["props", "grammar MB", "JSON MB", "file MB", "cold TTFM ms",
                        "disk TTFM ms", "speedup", "CPU ms cold / disk",
                        "writer child peak MB", "serving process during write MB",
                        "load MB"], table))
    print(f"\n{args.repeats} rounds each, medians; fresh processes; "
          f"{time.perf_counter() - t0:.0f} s")
    write_json(args.json, {"benchmark": "diskcache_heavy", "machine": machine_info(),
                           "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
