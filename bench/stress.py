"""Stress benchmark of the compile service: deadlines, latency under bad and slow specs, and memory.

Three measurements (``python -m bench.stress``; ``--quick`` for a short run):

1. **deadlines**: each spec of a hostile set (huge choices and enums, deep nesting, 10,000
   properties, nested oneOf, pathological regexes, a huge Lark grammar; some forced onto one
   backend) compiled by a fresh ``Compiler(timeout_s=--deadline)`` in a process of its own,
   on each path (``compile``, ``compile_async``, warm-up): how long the caller was held
   against its budget (the bound: 1.1x), and the outcome.
2. **latency**: ``--threads`` threads (200) send a mix of good, bad (invalid) and slow
   (pathological for xgrammar) specs to one ``Compiler``; the good requests' p50/p99 latency is
   compared with a run that sends only the good ones (ratio printed). Slow specs must not
   starve good requests, and no request may outlive ``timeout_s`` by much.
3. **memory**: ``--schemas`` corpus schemas (3,000) compiled through a Compiler with a
   ``--cache-mib`` limit (64): RSS against the cache's byte count as it fills and evicts, and
   after ``clear()``. Before it, a calibration: per backend, RSS growth per cached grammar
   against ``Grammar.memory_bytes`` (the estimate the cache is bounded by).

Results: a table on stdout and JSON (``--json``, default ``out/bench/stress.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.paths import DEFAULT_CORPUS, REPO_ROOT
from bench.stats import dist, fmt_ms, machine_info, render_table, write_json
from grammask import (
    Compiler,
    GrammarError,
    GrammarSpec,
    ServerFault,
    Vocabulary,
    load_vocabulary,
)
from grammask.backends import get_backend, registry
from grammask.compile.compiler import running_compiles, trim_heap
from grammask.compile.warmup import warm

MIB = 1024 * 1024
#: RSS growth that does not scale with ``cache_bytes`` (qwen2.5, this machine: growth at a
#: 16 and a 64 MiB limit fits 0.99 x limit + 39-46 MiB): both backends' state after their
#: first compiles (~4 MiB), allocator pages freed but not returnable (fragmentation, per-thread
#: arenas: ~20 MiB after ``clear``), and the abandoned compiles still running (at most
#: ``max_abandoned`` per backend; an xgrammar runaway holds 5-35 MiB until it ends).
FIXED_OVERHEAD_MIB = 48
#: The bound on RSS growth while compiling distinct schemas: 1.25 x the cache limit + fixed.
CACHE_RSS_SCALE = 1.25


def rss() -> int:
    """Resident set size in bytes (Linux /proc; after a collection)."""
    gc.collect()
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def prepare_all(vocab: Vocabulary) -> None:
    """Every backend's tokenizer view, built before any timing (a server builds them at
    start-up)."""
    for backend in registry.backends():
        get_backend(backend.name).prepare(vocab)


def corpus_schemas(corpus: Path, n: int, seed: int = 0) -> list[Any]:
    """``n`` maskbench schemas, shuffled across subsets (deterministic)."""
    schemas: list[Any] = []
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as fh:
            schemas += [json.loads(line)["schema"] for line in fh]
    random.Random(seed).shuffle(schemas)
    return schemas[:n]


def nested_one_of(depth: int, width: int, tag: str) -> dict[str, Any]:
    """Seconds to minutes for xgrammar (the product of branches); ms for llguidance."""
    node: dict[str, Any] = {"type": "string", "pattern": "[a-z]{2,8}@[a-z]+\\.com"}
    for d in range(depth):
        node = {"oneOf": [{"type": "object", "properties": {
            f"{tag}{d}_{i}": node, "e": {"type": "string", "format": "email"}},
            "required": [f"{tag}{d}_{i}"]} for i in range(width)]}
    return node


# ------------------------------------------------------------------------- deadlines
def _deep_arrays(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node, "maxItems": 3}
    return node


def _deep_objects(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for d in range(depth):
        node = {"type": "object", "properties": {f"k{d}": node, "s": {"type": "string"}},
                "required": [f"k{d}"]}
    return node


def _huge_lark(rules: int) -> str:
    lines = ["start: " + " | ".join(f"r{i}" for i in range(rules))]
    lines += [f'r{i}: "w{i}" /[a-z]{{1,{1 + i % 30}}}/' for i in range(rules)]
    return "\n".join(lines)


def _props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


#: name -> a hostile spec (built in the probe's process; not timed: a caller builds it first)
HOSTILE: dict[str, Callable[[], GrammarSpec]] = {
    "choice_100k": lambda: GrammarSpec.choice([f"option number {i}" for i in range(100_000)]),
    "choice_100k_guidance": lambda: GrammarSpec.choice(
        [f"option number {i}" for i in range(100_000)], backend="guidance"),
    "choice_100k_xgrammar": lambda: GrammarSpec.choice(
        [f"option number {i}" for i in range(100_000)], backend="xgrammar"),
    "enum_100k": lambda: GrammarSpec.json_schema({"enum": [f"v{i}" for i in range(100_000)]}),
    "props_10k": lambda: GrammarSpec.json_schema(_props(10_000)),
    "props_10k_guidance": lambda: GrammarSpec.json_schema(_props(10_000), backend="guidance"),
    "anyof_5k": lambda: GrammarSpec.json_schema({"anyOf": [
        {"type": "object", "properties": {f"a{i}": {"type": "string", "pattern": "[a-z]+"}},
         "required": [f"a{i}"]} for i in range(5000)]}),
    "deep_arrays_95": lambda: GrammarSpec.json_schema(_deep_arrays(95)),
    "deep_objects_45": lambda: GrammarSpec.json_schema(_deep_objects(45)),
    "nested_oneof_4x4": lambda: GrammarSpec.json_schema(nested_one_of(4, 4, "h")),
    "nested_oneof_4x4_xgrammar": lambda: GrammarSpec.json_schema(nested_one_of(4, 4, "h"),
                                                                 backend="xgrammar"),
    "regex_repeats": lambda: GrammarSpec.regex("[a-z]{1,300}(,[a-z]{1,300}){1,300}"),
    "regex_nested_repeats": lambda: GrammarSpec.regex("((a{1,20}){1,20}){1,20}"),
    "regex_dot_repeats": lambda: GrammarSpec.regex("(.{0,100}x){50}"),
    "regex_email_repeats": lambda: GrammarSpec.regex(
        r"([a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9.-]{1,255}\.[a-zA-Z]{2,63}){1,20}"),
    "regex_hex_5000": lambda: GrammarSpec.regex("[0-9a-f]{5000}"),
    "lark_20k_rules": lambda: GrammarSpec.grammar(_huge_lark(20_000), syntax="lark"),
}
PATHS = ("compile", "async", "warmup")


def probe(vocab: Vocabulary, name: str, path: str, deadline_s: float) -> dict[str, Any]:
    """One hostile spec on one path through a fresh compiler: seconds the caller was held."""
    spec = HOSTILE[name]()
    compiler = Compiler(vocab, timeout_s=deadline_s)
    outcome = "ok"
    backend = None
    t0 = time.perf_counter()
    try:
        if path == "compile":
            backend = compiler.compile(spec).backend
        elif path == "async":
            backend = compiler.compile_async(spec).result().backend
        else:
            with tempfile.TemporaryDirectory() as tmp:
                _spec_file(spec, Path(tmp))
                t0 = time.perf_counter()
                result = warm(compiler, tmp)[0]
                if result.error is not None:
                    outcome = result.error[:120]
                backend = result.backend
    except (GrammarError, ServerFault) as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:120]}"
    held = time.perf_counter() - t0
    return {"spec": name, "path": path, "kind": spec.kind, "chars": len(spec.source),
            "deadline_s": deadline_s, "held_s": round(held, 3),
            "held_over_deadline": round(held / deadline_s, 3), "backend": backend,
            "outcome": outcome}


def _spec_file(spec: GrammarSpec, directory: Path) -> None:
    """Write a spec as warm-up reads it (``grammask.compile.warmup.spec_of_file``)."""
    if spec.kind == "choice":
        (directory / "spec.choice.json").write_text(spec.source)
    elif spec.kind == "json_schema":
        (directory / "spec.json").write_text(spec.source)
    elif spec.kind == "regex":
        (directory / "spec.regex").write_text(spec.source)
    else:
        (directory / "spec.lark").write_text(spec.source)


def _probe_in_child(name: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """A probe in a process of its own (a runaway it abandons must not slow the next one);
    the child leaves with ``os._exit`` rather than wait for its runaways."""
    cmd = [sys.executable, "-m", "bench.stress", "--probe", name, "--probe-path", path,
           "--deadline", str(args.deadline), "--tokenizer", args.tokenizer]
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=args.deadline * 10 + 120)
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
        result = {"spec": name, "path": path, "deadline_s": args.deadline, "held_s": None,
                  "held_over_deadline": None, "outcome": f"probe failed: {exc!r}"[:200]}
    return result


def deadline_run(args: argparse.Namespace) -> dict[str, Any]:
    names = [n for n in HOSTILE if not args.hostile or n in args.hostile.split(",")]
    paths = args.paths.split(",")
    rows = []
    for name in names:
        for path in paths:
            row = _probe_in_child(name, path, args)
            rows.append(row)
            print(f"  {name:28} {path:8} held {row['held_s']} s "
                  f"({row['held_over_deadline']}x) {row.get('backend')} {row['outcome'][:70]}",
                  flush=True)
    held = [r["held_over_deadline"] for r in rows if r["held_over_deadline"] is not None]
    worst = max(held, default=0.0)
    return {"deadline_s": args.deadline, "bound": 1.1, "worst_over_deadline": worst,
            "within_bound": worst <= 1.1 and len(held) == len(rows), "probes": rows}


# --------------------------------------------------------------------------- latency
def good_spec(i: int) -> GrammarSpec:
    kind = i % 4
    if kind == 0:
        return GrammarSpec.json_schema({"type": "object", "properties": {
            f"k{i}": {"type": "integer"}, "n": {"enum": ["a", "b"]}}, "required": [f"k{i}"]})
    if kind == 1:
        return GrammarSpec.regex(f"id-{i}-[0-9]+")
    if kind == 2:
        return GrammarSpec.choice([f"c{i}", "other"])
    return GrammarSpec.grammar(f'start: "g{i}" NUM\nNUM: /[0-9]+/')


def bad_spec(i: int) -> GrammarSpec:
    return [GrammarSpec.regex(f"bad{i}("), GrammarSpec.json_schema({"type": f"strin{i}"}),
            GrammarSpec.grammar(f'start: "b{i}" |\nfoo')][i % 3]


def slow_spec(i: int) -> GrammarSpec:
    return GrammarSpec.json_schema(nested_one_of(3, 3, f"s{i}_"), backend="xgrammar")


def latency_run(vocab: Vocabulary, *, threads: int, per_thread: int, mixed: bool,
                timeout_s: float, workers: int, n_good: int, n_slow: int,
                seed: int) -> dict[str, Any]:
    """One run: every thread sends ``per_thread`` requests; in a mixed run 70% good,
    20% bad, 10% slow (over ``n_slow`` distinct runaways)."""
    compiler = Compiler(vocab, max_workers=workers, timeout_s=timeout_s, max_abandoned=2)
    good_ms: list[float] = []
    over: list[float] = []
    outcome = {"good_ok": 0, "good_failed": 0, "bad_errors": 0, "slow_timeouts": 0,
               "slow_ok": 0}
    failures: dict[str, int] = {}
    lock = threading.Lock()
    start_gate = threading.Barrier(threads)

    def client(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        start_gate.wait()
        for _ in range(per_thread):
            draw = rng.random() if mixed else 0.0
            what = "good" if draw < 0.7 else "bad" if draw < 0.9 else "slow"
            t0 = time.perf_counter()
            err: GrammarError | None = None
            try:  # bad specs may fail as early as GrammarSpec validation
                compiler.compile(good_spec(rng.randrange(n_good)) if what == "good" else
                               bad_spec(rng.randrange(50)) if what == "bad" else
                               slow_spec(rng.randrange(n_slow)))
            except GrammarError as exc:
                err = exc
            ms = (time.perf_counter() - t0) * 1000
            with lock:
                if ms > timeout_s * 1000:
                    over.append(ms - timeout_s * 1000)
                if what == "good":
                    good_ms.append(ms)
                    outcome["good_ok" if err is None else "good_failed"] += 1
                    if err is not None:
                        name = f"{type(err).__name__}: {err.message[:60]}"
                        failures[name] = failures.get(name, 0) + 1
                elif what == "bad":
                    outcome["bad_errors"] += err is not None
                else:
                    outcome["slow_timeouts" if err is not None else "slow_ok"] += 1

    t0 = time.perf_counter()
    pool = [threading.Thread(target=client, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t0
    stats = compiler.stats
    compiler.close()
    return {"mixed": mixed, "wall_s": round(wall, 2), "good": dist(good_ms), **outcome,
            "good_failures": failures, "max_over_timeout_ms": round(max(over, default=0.0), 1),
            "requests_over_timeout": len(over),
            "stats": {"hits": stats.hits, "misses": stats.misses, "joined": stats.joined,
                      "timeouts": stats.timeouts, "abandoned_now": stats.abandoned,
                      "negative_hits": stats.negative_hits, "fallbacks": stats.fallbacks,
                      "late_results": stats.late_results}}


# ---------------------------------------------------------------------------- memory
def calibrate(vocab: Vocabulary, schemas: list[Any], backend: str, n: int) -> dict[str, Any]:
    """RSS growth per cached grammar against the estimate, one backend forced, no evictions.
    xgrammar gets the schemas auto-routing sends it (the others take it seconds each)."""
    compiler = Compiler(vocab, max_workers=2, timeout_s=5, cache_bytes=1 << 40)
    picked = [s for s in schemas
              if backend == "guidance" or _routes_to(compiler, s, "xgrammar")][:n]
    trim_heap()
    before = rss()
    for schema in picked:
        with contextlib.suppress(GrammarError):
            compiler.compile(GrammarSpec.json_schema(schema, backend=backend))
    trim_heap()
    grown = rss() - before
    info = compiler.cache_info()
    compiler.clear()
    compiler.close()
    entries = max(1, info["entries"])
    return {"backend": backend, "grammars": info["entries"],
            "rss_per_grammar_kib": round(grown / entries / 1024, 1),
            "estimate_per_grammar_kib": round(info["bytes"] / entries / 1024, 1),
            "rss_over_estimate": round(grown / max(1, info["bytes"]), 3)}


def _calibrate_in_child(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.stress", "--calibrate-only", backend,
                          "--calibrate", str(args.calibrate), "--corpus", str(args.corpus),
                          "--tokenizer", args.tokenizer, "--seed", str(args.seed)],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _routes_to(compiler: Compiler, schema: Any, backend: str) -> bool:
    try:
        return compiler.route(GrammarSpec.json_schema(schema)).backend == backend
    except GrammarError:
        return False


def memory_run(vocab: Vocabulary, schemas: list[Any], cache_mib: int,
               every: int, runaway_wait_s: float = 180.0) -> dict[str, Any]:
    compiler = Compiler(vocab, max_workers=2, timeout_s=2, cache_bytes=cache_mib * MIB)
    trim_heap()
    base = rss()
    samples: list[dict[str, float]] = []
    errors = 0
    t0 = time.perf_counter()
    for i, schema in enumerate(schemas, 1):
        try:
            compiler.compile(GrammarSpec.json_schema(schema))
        except GrammarError:
            errors += 1
        if i % every == 0 or i == len(schemas):
            info = compiler.cache_info()
            samples.append({"compiled": i, "rss_mib": round(rss() / MIB, 1),
                            "rss_growth_mib": round((rss() - base) / MIB, 1),
                            "cache_mib": round(info["bytes"] / MIB, 1),
                            "entries": info["entries"]})
    wall = time.perf_counter() - t0
    peak = max(s["rss_growth_mib"] for s in samples)
    before_clear = rss()
    held = compiler.cache_info()["bytes"]
    compiler.clear()
    after_clear = rss()
    runaways = running_compiles()
    # the abandoned compiles still running hold their scratch until they end: once they
    # have (bounded wait), what clear() left behind is the fixed part alone
    deadline = time.monotonic() + runaway_wait_s
    while running_compiles() and time.monotonic() < deadline:
        time.sleep(0.5)
    compiler.clear()
    settled = rss()
    stats = compiler.stats
    compiler.close()
    bound = CACHE_RSS_SCALE * cache_mib + FIXED_OVERHEAD_MIB
    return {"schemas": len(schemas), "cache_limit_mib": cache_mib, "errors": errors,
            "wall_s": round(wall, 1), "base_rss_mib": round(base / MIB, 1),
            "peak_growth_mib": peak, "final_growth_mib": samples[-1]["rss_growth_mib"],
            "bound_mib": bound, "fixed_overhead_mib": FIXED_OVERHEAD_MIB,
            "within_bound": peak <= bound,
            "cache_held_mib": round(held / MIB, 1),
            "after_clear_growth_mib": round((after_clear - base) / MIB, 1),
            "clear_returned_mib": round((before_clear - after_clear) / MIB, 1),
            "runaways_at_clear": runaways, "runaways_after_wait": running_compiles(),
            "after_runaways_growth_mib": round((settled - base) / MIB, 1),
            "clear_within_fixed": (after_clear - base) / MIB <= FIXED_OVERHEAD_MIB,
            "evictions": stats.evictions, "trims": stats.trims, "samples": samples}


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", default="qwen2.5")
    ap.add_argument("--schemas", type=int, default=3000, help="corpus schemas in the RSS run")
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--calibrate", type=int, default=300,
                    help="grammars per backend in the calibration (0: skip)")
    ap.add_argument("--threads", type=int, default=200)
    ap.add_argument("--requests", type=int, default=10, help="requests per thread")
    ap.add_argument("--timeout", type=float, default=2.0, help="Compiler timeout_s")
    ap.add_argument("--workers", type=int, default=2, help="Compiler max_workers")
    ap.add_argument("--skip", choices=["deadlines", "latency", "memory"], action="append",
                    default=[])
    ap.add_argument("--deadline", type=float, default=10.0,
                    help="Compiler timeout_s of the hostile-spec probes")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="comma-separated paths the hostile specs take (compile,async,warmup)")
    ap.add_argument("--hostile", default="", help="comma-separated hostile specs (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="300 schemas, 50 threads, hostile specs with a 2 s deadline, 2 paths")
    ap.add_argument("--probe", choices=list(HOSTILE), help=argparse.SUPPRESS)
    ap.add_argument("--probe-path", choices=PATHS, default="compile", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=str(REPO_ROOT / "out" / "bench" /
                                                         "stress.json"))
    ap.add_argument("--calibrate-only", choices=["guidance", "xgrammar"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        vocab = load_vocabulary(args.tokenizer)
        print(json.dumps(probe(vocab, args.probe, args.probe_path, args.deadline)), flush=True)
        os._exit(0)  # abandoned runaways are not waited for
    if args.calibrate_only:
        vocab = load_vocabulary(args.tokenizer)
        prepare_all(vocab)
        schemas = corpus_schemas(args.corpus, 4 * args.calibrate, args.seed)
        print(json.dumps(calibrate(vocab, schemas, args.calibrate_only, args.calibrate)))
        return 0
    if args.quick:
        args.schemas, args.threads, args.calibrate = 300, 50, 100
        args.deadline, args.paths = 2.0, "compile,async"
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               "machine": machine_info()}
    if "deadlines" not in args.skip:
        print(f"hostile specs, deadline {args.deadline} s, each in its own process:")
        dl = deadline_run(args)
        payload["deadlines"] = dl
        print(f"\nworst: held {dl['worst_over_deadline']}x the deadline (bound 1.1x: "
              f"{'met' if dl['within_bound'] else 'NOT met'})\n")
        write_json(args.json_out, payload)
    if "memory" in args.skip and "latency" in args.skip:
        print(f"wrote {args.json_out}")
        return 0
    vocab = load_vocabulary(args.tokenizer)
    prepare_all(vocab)
    if "memory" not in args.skip:
        schemas = corpus_schemas(args.corpus, max(args.schemas, args.calibrate), args.seed)
        if args.calibrate:
            # each backend in a fresh process: a used heap reuses free memory without growing
            cal = [_calibrate_in_child(b, args) for b in ("guidance", "xgrammar")]
            payload["calibration"] = cal
            print(render_table(["backend", "grammars", "RSS KiB/grammar", "estimate KiB",
                                "RSS / estimate"],
                               [[c["backend"], c["grammars"], c["rss_per_grammar_kib"],
                                 c["estimate_per_grammar_kib"], c["rss_over_estimate"]]
                                for c in cal]))
            print()
        mem = memory_run(vocab, schemas[:args.schemas], args.cache_mib,
                         max(1, args.schemas // 10))
        payload["memory"] = mem
        print(render_table(["compiled", "RSS MiB", "RSS growth MiB", "cache MiB", "entries"],
                           [[s["compiled"], s["rss_mib"], s["rss_growth_mib"], s["cache_mib"],
                             s["entries"]] for s in mem["samples"]]))
        print(f"\ncache limit {mem['cache_limit_mib']} MiB; peak RSS growth "
              f"{mem['peak_growth_mib']} MiB (bound {CACHE_RSS_SCALE} x limit + "
              f"{FIXED_OVERHEAD_MIB} = {mem['bound_mib']} MiB: "
              f"{'met' if mem['within_bound'] else 'NOT met'}); after clear() "
              f"{mem['after_clear_growth_mib']} MiB above the start ({mem['clear_returned_mib']} "
              f"MiB returned of {mem['cache_held_mib']} MiB held; {mem['runaways_at_clear']} "
              f"abandoned compiles running; {mem['after_runaways_growth_mib']} MiB once they "
              f"ended); {mem['evictions']} evictions, {mem['trims']} trims, {mem['wall_s']} s")
    if "latency" not in args.skip:
        runs = {}
        for mixed in (False, True):
            runs["mixed" if mixed else "good_only"] = latency_run(
                vocab, threads=args.threads, per_thread=args.requests, mixed=mixed,
                timeout_s=args.timeout, workers=args.workers, n_good=400, n_slow=6,
                seed=args.seed)
        ratio = runs["mixed"]["good"]["p99_ms"] / max(1e-9, runs["good_only"]["good"]["p99_ms"])
        payload["latency"] = {**runs, "good_p99_ratio": round(ratio, 2)}
        print(render_table(
            ["run", "good n", "good p50 ms", "good p99 ms", "good max ms", "good failed",
             "bad errors", "slow timeouts", "max over timeout ms", "wall s"],
            [[name, r["good"]["n"], fmt_ms(r["good"]["p50_ms"]), fmt_ms(r["good"]["p99_ms"]),
              fmt_ms(r["good"]["max_ms"]), r["good_failed"], r["bad_errors"],
              r["slow_timeouts"], r["max_over_timeout_ms"], r["wall_s"]]
             for name, r in runs.items()]))
        print(f"\ngood p99 with bad+slow / good only: {ratio:.2f}x\n")
    write_json(args.json_out, payload)
    print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
