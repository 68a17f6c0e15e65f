"""Mask (bitmask fill) latency: per token along real outputs, and per decode step in a batch.

    python -m bench.mask [--corpus PATH] [--sample N] [--seed S] [--timeout SEC]
                         [--systems a,b,...] [--batch-sizes 1,16,64,256] [--steps N]
                         [--quick] [--json OUT]

- Per token: every system compiles the same specs, then walks valid corpus instances
  (``json.dumps(instance)`` tokenized with the vocabulary), timing one fill of a (1, words)
  bitmask before each accepted token. An instance the system refuses part-way (e.g. closed
  objects against an instance with extra keys) stops there and is counted as refused.
- Per step: B requests (B = 1/16/64/256) over the specs every system served, each at its own
  position of its own instance; one step fills all B rows, then every request advances by one
  token. Methods: the plain loop over rows; xgrammar's ``BatchGrammarMatcher``; llguidance's
  ``LLExecutor``; grammask's rows split by backend into those two; vLLM's own
  ``StructuredOutputManager.grammar_bitmask`` over real ``Request`` objects.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.cases import Case, case_from, case_payload, extra_cases, load_maskbench
from bench.paths import DEFAULT_CORPUS
from bench.stats import dist, fmt_ms, machine_info, render_table, write_json
from bench.systems import System, parse_systems
from bench.workers import Pool, progress, rotated

WALK = "bench.mask:walk"
BATCH = "bench.mask:batch"


# ----------------------------------------------------------------------- worker side
def walk(system: System, payload: dict[str, Any]) -> dict[str, Any]:
    """Fill latency (us) before each token of each instance of one case."""
    case = case_from(payload["case"])
    compiled = system.compile(case)
    bitmask = system.bitmask(1)
    row = bitmask[0]
    fills: list[float] = []
    tokens = refused = complete = masked_but_accepted = 0
    first = True
    for ids in payload["token_ids"]:
        matcher = system.matcher(compiled) if first else system.new_matcher(compiled, case)
        first = False
        ok = True
        for tok in ids:
            t0 = time.perf_counter_ns()
            system.fill(matcher, bitmask, 0)
            fills.append((time.perf_counter_ns() - t0) / 1e3)
            allowed = (int(row[tok >> 5]) >> (tok & 31)) & 1
            if not system.accept(matcher, tok):
                refused += 1
                ok = False
                break
            masked_but_accepted += not allowed
            tokens += 1
        if ok:
            t0 = time.perf_counter_ns()
            system.fill(matcher, bitmask, 0)
            fills.append((time.perf_counter_ns() - t0) / 1e3)
            complete += 1
    return {"status": "ok", "fills_us": fills, "tokens": tokens, "refused": refused,
            "complete": complete, "masked_but_accepted": masked_but_accepted}


def batch(system: System, payload: dict[str, Any]) -> dict[str, Any]:
    """Per-step fill time of B rows, for each batch size and each fill method."""
    cases = [case_from(c) for c in payload["cases"]]
    seqs: list[tuple[int, list[int]]] = [(int(i), list(ids)) for i, ids in payload["seqs"]]
    compiled = {i: system.compile(cases[i]) for i in sorted({i for i, _ in seqs})}
    steps = int(payload["steps"])
    out: dict[str, Any] = {}
    for size in payload["batch_sizes"]:
        rows = [seqs[i % len(seqs)] for i in range(size)]
        matchers = [system.new_matcher(compiled[ci], cases[ci]) for ci, _ in rows]
        pos = [0] * size
        for i, (_, ids) in enumerate(rows):  # spread the rows over their outputs
            for tok in ids[: (i * 7) % max(1, len(ids) // 2)]:
                if not system.accept(matchers[i], tok):
                    break
                pos[i] += 1
        methods = system.batch_methods(matchers)
        bitmask = system.bitmask(size)
        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for step in range(steps):
            for name in rotated(names, step):
                t0 = time.perf_counter()
                methods[name](bitmask)
                times[name].append((time.perf_counter() - t0) * 1e3)
            for i, (_, ids) in enumerate(rows):
                if pos[i] >= len(ids) or not system.accept(matchers[i], ids[pos[i]]):
                    system.reset(matchers[i])
                    pos[i] = 0
                else:
                    pos[i] += 1
        out[str(size)] = {name: {**dist(v), "per_row_us": round(
            sorted(v)[len(v) // 2] * 1e3 / size, 3)} for name, v in times.items()}
    return {"status": "ok", "batches": out, "threads": os.cpu_count()}


# ----------------------------------------------------------------------- parent side
def tokenize(cases: list[Case], tokenizer: str, per_case: int, max_tokens: int
             ) -> dict[str, list[list[int]]]:
    from grammask import load_vocabulary

    vocab = load_vocabulary(tokenizer)
    return {c.id: [vocab.encode(text)[:max_tokens] for text in c.instances[:per_case]]
            for c in cases if c.instances}


def run(cases: list[Case], systems: list[str], options: dict[str, Any], *,
        quiet: bool = False, log_dir: str | None = None) -> dict[str, Any]:
    timeout = float(options["timeout"])
    token_ids = tokenize(cases, options["tokenizer"], options["instances"],
                         options["max_tokens"])
    cases = [c for c in cases if c.id in token_ids]
    walks: dict[str, dict[str, Any]] = {}
    started = time.time()
    with Pool(systems, options, log_dir) as pool:
        live = pool.available()
        per_system: dict[str, dict[str, Any]] = {
            n: {"fills_us": [], "tokens": 0, "refused": 0, "complete": 0, "instances": 0,
                "masked_but_accepted": 0, "errors": 0, "timeouts": 0} for n in live}
        served: Counter[str] = Counter()
        bar = progress(len(cases), "walk", disable=quiet)
        for i, case in enumerate(cases):
            for name in rotated(live, i):
                reply = pool.workers[name].call(
                    WALK, {"case": case_payload(case), "token_ids": token_ids[case.id]},
                    timeout)
                acc = per_system[name]
                if reply.status == "ok":
                    r = reply.result
                    acc["fills_us"] += r["fills_us"]
                    acc["instances"] += len(token_ids[case.id])
                    for key in ("tokens", "refused", "complete", "masked_but_accepted"):
                        acc[key] += r[key]
                    if r["tokens"] > 0:
                        served[case.id] += 1
                else:
                    acc["timeouts" if reply.status == "timeout" else "errors"] += 1
            bar.update()
        bar.close()
        common = [c for c in cases if served[c.id] == len(live)]
        batches: dict[str, Any] = {}
        if common and options["batch_sizes"]:
            seqs = [(ci, ids) for ci, c in enumerate(common) for ids in token_ids[c.id]
                    if len(ids) > 4]
            payload = {"cases": [case_payload(c) for c in common], "seqs": seqs,
                       "batch_sizes": options["batch_sizes"], "steps": options["steps"]}
            bar = progress(len(live), "batch", disable=quiet)
            for name in live:
                reply = pool.workers[name].call(BATCH, payload, max(600.0, timeout))
                batches[name] = (reply.result["batches"] if reply.status == "ok"
                                 else {"error": f"{reply.status}: {reply.error}"})
                bar.update()
            bar.close()
        setup = {n: {**w.info, "restarts": w.restarts} for n, w in pool.workers.items()
                 if not w.unavailable}
        unavailable = pool.unavailable()
    for name, acc in per_system.items():
        fills = acc.pop("fills_us")
        acc["fill"] = dist(fills, "us")
        walks[name] = acc
    return {"walk": walks, "batch": batches, "setup": setup, "unavailable": unavailable,
            "cases": len(cases), "batch_cases": len(common) if cases else 0,
            "wall_s": round(time.time() - started, 1)}


def tables(payload: dict[str, Any]) -> str:
    walk_rows = []
    for name, s in payload["summary"]["per_token"].items():
        if "unavailable" in s:
            walk_rows.append([name, "unavailable: " + s["unavailable"][:60], *[""] * 7])
            continue
        f = s["fill"]
        walk_rows.append([name, f["n"], f"{f['p50_us']:.1f}", f"{f['p90_us']:.1f}",
                          f"{f['p99_us']:.1f}", f"{f['max_us']:.0f}",
                          f"{s['complete']}/{s['instances']}", s["refused"],
                          s["errors"] + s["timeouts"]])
    parts = ["Per-token fill latency (us), one (1, words) bitmask row",
             render_table(["system", "fills", "p50", "p90", "p99", "max", "complete",
                           "refused", "failed specs"], walk_rows)]
    batches = payload["summary"]["per_step"]
    sizes = sorted({int(b) for v in batches.values() if "error" not in v for b in v})
    if sizes:
        rows = []
        for name, per in batches.items():
            if "error" in per:
                rows.append([name, per["error"][:60], *[""] * len(sizes)])
                continue
            for method in per[str(sizes[0])]:
                cells = []
                for b in sizes:
                    d = per[str(b)][method]
                    cells.append(f"{fmt_ms(d['p50_ms'])} / {fmt_ms(d['p99_ms'])}")
                rows.append([name, method, *cells])
        parts += ["", "Batch fill per decode step, ms (p50 / p99)",
                  render_table(["system", "method", *(f"B={b}" for b in sizes)], rows)]
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.mask", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--sample", type=int,
                   help="maskbench schemas with valid instances, stratified by subset "
                        "(default 40; --quick: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--subsets", default="", help="comma-separated maskbench subsets")
    p.add_argument("--no-extras", action="store_true", help="leave out regex/choice/grammar")
    p.add_argument("--systems", default="all")
    p.add_argument("--instances", type=int, help="valid instances per spec (default 2)")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens walked per instance")
    p.add_argument("--batch-sizes", help="default 1,16,64,256 (--quick: 1,16)")
    p.add_argument("--steps", type=int, help="decode steps timed per batch size (default 30)")
    p.add_argument("--timeout", type=float, default=10.0, help="per-spec deadline (s)")
    p.add_argument("--tokenizer", default="qwen2.5")
    p.add_argument("--quick", action="store_true",
                   help="defaults for a smoke run: 10 schemas, 1 instance, batch sizes 1,16, "
                        "8 steps (explicit options still win)")
    p.add_argument("--drafts",
                   help="speculative decoding instead: mask cost per step with these draft "
                        "counts per row, e.g. 0,1,2,4 (bench/drafts.py)")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--log-dir")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = ((10, 1, 8, "1,16") if args.quick else (40, 2, 30, "1,16,64,256"))
    for name, value in zip(("sample", "instances", "steps", "batch_sizes"), defaults,
                           strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    subsets = [s for s in args.subsets.split(",") if s] or None
    cases = load_maskbench(args.corpus, args.sample, args.seed, subsets, need_instances=True)
    if args.drafts:
        return _drafts_main(args, cases, argv)
    systems = parse_systems(args.systems)
    if not args.no_extras:
        cases += [c for c in extra_cases(args.corpus) if c.instances]
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    options = {"timeout": args.timeout, "tokenizer": args.tokenizer,
               "instances": args.instances, "max_tokens": args.max_tokens,
               "batch_sizes": sizes, "steps": args.steps}
    machine = machine_info()
    print(f"{len(cases)} specs x {len(systems)} systems; {machine['cpu']}, "
          f"{machine['cores']} cores", file=sys.stderr)
    result = run(cases, systems, options, quiet=args.quiet, log_dir=args.log_dir)
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    per_token: dict[str, Any] = {n: {"unavailable": why}
                                 for n, why in result["unavailable"].items()}
    per_token.update(result["walk"])
    payload = {
        "benchmark": "mask",
        "argv": ["grammask", "bench", "mask", *(argv if argv is not None else sys.argv[1:])],
        "config": {**options, "sample": args.sample, "seed": args.seed, "subsets": subsets,
                   "extras": not args.no_extras, "cases": result["cases"],
                   "batch_cases": result["batch_cases"]},
        "machine": machine, "setup": result["setup"], "wall_s": result["wall_s"],
        "summary": {"per_token": {n: per_token[n] for n in systems if n in per_token},
                    "per_step": result["batch"]},
    }
    print(tables(payload))
    if args.json_out:
        write_json(args.json_out, payload)
    return 0


def _drafts_main(args: argparse.Namespace, cases: list[Case], argv: list[str] | None) -> int:
    from bench import drafts

    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    counts = [int(d) for d in args.drafts.split(",") if d.strip()]
    machine = machine_info()
    started = time.time()
    result = drafts.measure(cases, batch_sizes=sizes, drafts=counts, steps=args.steps,
                            tokenizer=args.tokenizer)
    payload = {"benchmark": "mask-drafts",
               "argv": ["grammask", "bench", "mask", *(argv if argv is not None
                                                        else sys.argv[1:])],
               "config": {"sample": args.sample, "seed": args.seed, "batch_sizes": sizes,
                          "drafts": counts, "steps": args.steps, "cases": len(cases)},
               "machine": machine, "wall_s": round(time.time() - started, 1),
               "summary": result}
    print(drafts.tables(result))
    if args.json_out:
        write_json(args.json_out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
