"""Compile latency, cache hits and time to first mask, per spec and per system.

    python -m bench.compile [--corpus PATH] [--sample N] [--seed S] [--timeout SEC]
                            [--systems a,b,...] [--subsets A,B] [--no-extras]
                            [--json OUT]

For every spec, every system (raw xgrammar, raw llguidance, vLLM's two backends, grammask
with each backend forced and with auto routing) measures, in its own worker process:
- cold compile: spec -> compiled grammar, nothing cached;
- time to first mask (TTFM): cold compile + the request's matcher + the first fill of a
  (1, words) int32 bitmask, i.e. how long a new schema stalls its request;
- cache hit: the same spec again (grammask: ``compiler.compile`` of the compiled spec, and of
  a freshly built equal spec; vLLM-xgrammar: its compiler cache; others: none).
A spec whose TTFM exceeds ``--timeout`` is a timeout (the worker is killed and restarted when
it does not answer); errors and timeouts are counted, never dropped.

The cold-path and cache-hit check (docs/benchmarks.md, "Cold path and cache hits"): 52 specs,
29 maskbench schemas of seed 2 (a sample no earlier round was tuned on) and the 23 others::

    python -m bench.compile --sample 29 --seed 2 \
        --systems xgrammar,llguidance,vllm-guidance,grammask-guidance,grammask-auto
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cases import Case, case_from, case_payload, extra_cases, load_maskbench
from bench.paths import DEFAULT_CORPUS
from bench.stats import dist, fmt_ms, machine_info, percentile, render_table, write_json
from bench.systems import RAW_OF_BACKEND, System, parse_systems
from bench.workers import Pool, progress, rotated

TASK = "bench.compile:measure"
GRACE_S = 5.0  # beyond --timeout, for the cache-hit measurement and the reply itself
TARGET_OVERHEAD = 1.25  # grammask TTFM over the raw backend it routed to, per-spec p50
TARGET_HIT_US = 50.0
TARGET_AUTO = 1.2


# --------------------------------------------------------------- worker side (one case)
def measure(system: System, payload: dict[str, Any]) -> dict[str, Any]:
    """Cold compile, TTFM and cache hit of one case on one system (runs in the worker).

    A spec whose first TTFM is under ``repeat_below_ms`` is measured ``repeats`` times (the
    system's caches dropped in between) and the medians are kept: on a shared two-core
    machine one run of a 2 ms compile is at the mercy of the scheduler."""
    case: Case = case_from(payload["case"])
    repeats = int(payload.get("repeats", 1))
    below = float(payload.get("repeat_below_ms", 100.0))
    bitmask = system.bitmask(1)
    colds: list[float] = []
    ttfms: list[float] = []
    compiled: Any = None
    while True:
        t0 = time.perf_counter()
        try:
            compiled = system.compile(case)
            t1 = time.perf_counter()
            matcher = system.matcher(compiled)
            system.fill(matcher, bitmask, 0)
            t2 = time.perf_counter()
        except Exception as exc:
            elapsed = (time.perf_counter() - t0) * 1e3
            status = "timeout" if "Timeout" in type(exc).__name__ else "error"
            return {"status": status, "error": f"{type(exc).__name__}: {exc}"[:300],
                    "elapsed_ms": elapsed, "restart": system.needs_restart()}
        colds.append((t1 - t0) * 1e3)
        ttfms.append((t2 - t0) * 1e3)
        if len(ttfms) >= repeats or ttfms[0] >= below:
            break
        system.forget()
    row: dict[str, Any] = {"status": "ok", "cold_ms": statistics.median(colds),
                           "ttfm_ms": statistics.median(ttfms), "runs": len(ttfms),
                           "allowed": _popcount(bitmask)}
    row.update(system.describe(compiled))
    try:
        row.update(system.cache_hit(case))
    except Exception as exc:  # a failed re-serve is worth knowing, not worth the row
        row["hit_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["restart"] = system.needs_restart()
    return row


def _popcount(bitmask: Any) -> int:
    import numpy as np

    return int(np.unpackbits(bitmask.numpy()[0].view(np.uint8)).sum())


# ---------------------------------------------------------------------- parent side
def run(cases: list[Case], systems: list[str], options: dict[str, Any], *,
        quiet: bool = False, log_dir: str | None = None) -> dict[str, Any]:
    timeout = float(options["timeout"])
    grace = float(options.get("grace_s", GRACE_S))
    rows: list[dict[str, Any]] = []
    started = time.time()
    with Pool(systems, options, log_dir) as pool:
        live = pool.available()
        bar = progress(len(cases), "compile", disable=quiet)
        failures: Counter[str] = Counter()
        for i, case in enumerate(cases):
            for name in rotated(live, i):
                reply = pool.workers[name].call(
                    TASK, {"case": case_payload(case), "repeats": options.get("repeats", 1)},
                    timeout + grace)
                row = _row(case, name, reply.status, reply.result, reply.error, timeout)
                rows.append(row)
                if row["status"] != "ok":
                    failures[f"{row['status']}s"] += 1
            bar.set_postfix(failures, refresh=False)
            bar.update()
        bar.close()
        setup = {n: {**w.info, "restarts": w.restarts} for n, w in pool.workers.items()
                 if not w.unavailable}
        unavailable = pool.unavailable()
    return {"rows": rows, "setup": setup, "unavailable": unavailable,
            "wall_s": round(time.time() - started, 1)}


def _row(case: Case, system: str, status: str, result: Any, error: str,
         timeout: float) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.id, "group": case.group, "kind": case.kind,
                           "system": system}
    if status == "ok":
        result = dict(result)
        result.pop("restart", None)
        row.update(result)
        if row["status"] == "ok" and row["ttfm_ms"] > timeout * 1e3:
            row["status"] = "timeout"
            row["error"] = f"first mask after {row['ttfm_ms'] / 1e3:.1f} s > {timeout} s"
    else:  # a crash, or a worker that could not be restarted, is an error of that spec
        row.update(status="timeout" if status == "timeout" else "error", error=error)
    return row


# ------------------------------------------------------------------------- summaries
def summarize(rows: list[dict[str, Any]], systems: list[str],
              unavailable: dict[str, str]) -> dict[str, Any]:
    """Per system: counts, and p50/p90/p99/max of cold compile, TTFM and cache hits (over
    the specs it served; its errors and timeouts are counted beside)."""
    out: dict[str, Any] = {}
    for name in systems:
        if name in unavailable:
            out[name] = {"unavailable": unavailable[name]}
            continue
        mine = [r for r in rows if r["system"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        entry: dict[str, Any] = {
            "cases": len(mine), "ok": len(ok),
            "errors": sum(r["status"] == "error" for r in mine),
            "timeouts": sum(r["status"] == "timeout" for r in mine),
            "cold_compile": dist([r["cold_ms"] for r in ok]),
            "ttfm": dist([r["ttfm_ms"] for r in ok]),
        }
        for key, label in (("hit_ms", "cache_hit"), ("hit_spec_ms", "cache_hit_new_spec"),
                           ("hit_ttfm_ms", "cache_hit_ttfm")):
            values = [r[key] for r in ok if key in r]
            if values:
                entry[label] = dist(values)
        entry["ttfm_by_kind"] = {
            kind: dist([r["ttfm_ms"] for r in ok if r["kind"] == kind])
            for kind in sorted({r["kind"] for r in mine})}
        routed = Counter(r["backend"] for r in ok if "backend" in r)
        if routed:
            entry["routed"] = dict(routed)
            entry["fallbacks"] = sum(1 for r in ok if r.get("fallback_from"))
        out[name] = entry
    return out


def _by_case(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        table[r["case"]][r["system"]] = r
    return table


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios the targets are stated in."""
    cases = _by_case(rows)
    out: dict[str, Any] = {"overhead": {}, "auto": {}}
    pairs: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
        "grammask-xgrammar vs xgrammar": ("grammask-xgrammar", lambda r: "xgrammar"),
        "grammask-guidance vs llguidance": ("grammask-guidance", lambda r: "llguidance"),
        "grammask-auto vs the raw backend it routed to": (
            "grammask-auto", lambda r: RAW_OF_BACKEND.get(r.get("backend", ""), "")),
    }
    for label, (mine, raw_of) in pairs.items():
        for metric in ("cold_ms", "ttfm_ms"):
            ours, theirs = [], []
            for per in cases.values():
                r = per.get(mine)
                if r is None or r["status"] != "ok":
                    continue
                raw = per.get(raw_of(r))
                if raw is None or raw["status"] != "ok":
                    continue
                ours.append(r[metric])
                theirs.append(raw[metric])
            if ours:
                out["overhead"][f"{label} ({metric[:-3]})"] = _ratio(ours, theirs)
    out["auto"] = _auto_vs_best(cases)
    return out


def _ratio(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    per_case = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
    p50_ours, p50_theirs = percentile(ours, 50), percentile(theirs, 50)
    return {"n": len(ours), "p50_ms": round(p50_ours, 4), "raw_p50_ms": round(p50_theirs, 4),
            "ratio_of_p50": round(p50_ours / p50_theirs, 3),
            "per_case_ratio_p50": round(percentile(per_case, 50), 3),
            "per_case_ratio_p90": round(percentile(per_case, 90), 3),
            "diff_p50_ms": round(percentile([a - b for a, b in zip(ours, theirs,
                                                                   strict=True)], 50), 4)}


def _auto_vs_best(cases: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """grammask-auto's TTFM against, per spec, the faster raw backend (a spec one backend
    cannot serve counts the other's time), and against each raw backend on the specs both
    served."""
    auto, best, losers = [], [], []
    pairs: dict[str, tuple[list[float], list[float]]] = {"xgrammar": ([], []),
                                                         "llguidance": ([], [])}
    auto_failed = 0
    for case, per in cases.items():
        a = per.get("grammask-auto")
        raws = {s: per.get(s) for s in pairs}
        times = [r["ttfm_ms"] for r in raws.values() if r is not None and r["status"] == "ok"]
        if a is None or not times:
            continue
        if a["status"] != "ok":
            auto_failed += 1
            continue
        auto.append(a["ttfm_ms"])
        best.append(min(times))
        for name, raw in raws.items():
            if raw is not None and raw["status"] == "ok":
                pairs[name][0].append(a["ttfm_ms"])
                pairs[name][1].append(raw["ttfm_ms"])
        if a["ttfm_ms"] > TARGET_AUTO * min(times) and a["ttfm_ms"] - min(times) > 1.0:
            losers.append({"case": case, "auto_ms": round(a["ttfm_ms"], 2),
                           "best_ms": round(min(times), 2), "backend": a.get("backend"),
                           "reason": a.get("reason", "")})
    if not auto:
        return {}
    per_case = [a / b for a, b in zip(auto, best, strict=True) if b > 0]
    losers.sort(key=lambda d: d["auto_ms"] - d["best_ms"], reverse=True)
    out: dict[str, Any] = {
        "n": len(auto), "auto_failed_where_a_raw_backend_served": auto_failed,
        "auto_p50_ms": round(percentile(auto, 50), 3),
        "auto_p99_ms": round(percentile(auto, 99), 3),
        "best_p50_ms": round(percentile(best, 50), 3),
        "best_p99_ms": round(percentile(best, 99), 3),
        "p99_vs_best": round(percentile(auto, 99) / percentile(best, 99), 3),
        "per_case_ratio_p50": round(percentile(per_case, 50), 3),
        "per_case_ratio_p99": round(percentile(per_case, 99), 3),
        "slower_than_target": len(losers), "worst": losers[:15],
    }
    for name, (ours, theirs) in pairs.items():
        if ours:
            out[f"vs_{name}"] = {"n": len(ours), "auto_p99_ms": round(percentile(ours, 99), 3),
                                 f"{name}_p99_ms": round(percentile(theirs, 99), 3),
                                 "p99_ratio": round(percentile(ours, 99)
                                                    / percentile(theirs, 99), 3)}
    return out


# ----------------------------------------------------------------------------- output
def tables(payload: dict[str, Any]) -> str:
    summary, ratios = payload["summary"], payload["ratios"]
    head = ["system", "ok", "err", "t/o", "cold p50", "p90", "p99", "max",
            "TTFM p50", "p90", "p99", "max", "hit p50 us", "hit p99 us"]
    body = []
    for name, s in summary.items():
        if "unavailable" in s:
            body.append([name, "unavailable: " + s["unavailable"][:60], *[""] * 12])
            continue
        c, t = s["cold_compile"], s["ttfm"]
        hit = s.get("cache_hit", {})
        body.append([name, s["ok"], s["errors"], s["timeouts"],
                     *(fmt_ms(c[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                     *(fmt_ms(t[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                     _us(hit.get("p50_ms")), _us(hit.get("p99_ms"))])
    parts = ["Cold compile and time to first mask (ms, over the specs each system served)",
             render_table(head, body)]
    ohead = ["comparison", "n", "ours p50", "raw p50", "ratio of p50s", "per-spec ratio p50",
             "per-spec p90", "target", "met"]
    obody = []
    for label, r in ratios["overhead"].items():
        obody.append([label, r["n"], fmt_ms(r["p50_ms"]), fmt_ms(r["raw_p50_ms"]),
                      f"{r['ratio_of_p50']:.3f}", f"{r['per_case_ratio_p50']:.3f}",
                      f"{r['per_case_ratio_p90']:.3f}", f"<= {TARGET_OVERHEAD}",
                      _met(r["per_case_ratio_p50"] <= TARGET_OVERHEAD)])
    for name in ("grammask-auto", "grammask-xgrammar", "grammask-guidance"):
        hit = summary.get(name, {}).get("cache_hit")
        if hit:
            obody.append([f"{name} cache hit p99 (us)", hit["n"], _us(hit["p99_ms"]), "",
                          "", "", "", f"<= {TARGET_HIT_US:.0f} us",
                          _met(hit["p99_ms"] * 1e3 <= TARGET_HIT_US)])
    auto = ratios.get("auto") or {}
    if auto:
        obody.append(["grammask-auto TTFM p99 vs per-spec best raw backend", auto["n"],
                      fmt_ms(auto["auto_p99_ms"]), fmt_ms(auto["best_p99_ms"]),
                      f"{auto['p99_vs_best']:.3f}", f"{auto['per_case_ratio_p50']:.3f}",
                      "", f"<= {TARGET_AUTO}", _met(auto["p99_vs_best"] <= TARGET_AUTO)])
        for raw in ("xgrammar", "llguidance"):
            vs = auto.get(f"vs_{raw}")
            if vs:
                obody.append([f"grammask-auto TTFM p99 vs {raw} (specs both served)",
                              vs["n"], fmt_ms(vs["auto_p99_ms"]), fmt_ms(vs[f"{raw}_p99_ms"]),
                              f"{vs['p99_ratio']:.3f}", "", "", "", ""])
    parts += ["", "Ratios against the targets", render_table(ohead, obody)]
    kinds = sorted({k for s in summary.values() for k in s.get("ttfm_by_kind", {})})
    if kinds:
        khead = ["system", *(f"{k} p50 / p99" for k in kinds)]
        kbody = []
        for name, s in summary.items():
            if "unavailable" in s:
                continue
            by = s["ttfm_by_kind"]
            kbody.append([name, *(f"{fmt_ms(by[k]['p50_ms'])} / {fmt_ms(by[k]['p99_ms'])}"
                                  f" (n={by[k]['n']})" if k in by else "-" for k in kinds)])
        parts += ["", "Time to first mask by spec kind (ms)", render_table(khead, kbody)]
    return "\n".join(parts)


def _us(ms: float | None) -> str:
    return "-" if ms is None or math.isnan(ms) else f"{ms * 1e3:.1f}"


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


# ------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--sample", type=int, default=80,
                   help="maskbench schemas, stratified by subset (0: all of them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--subsets", default="", help="comma-separated maskbench subsets")
    p.add_argument("--no-extras", action="store_true",
                   help="leave out the regex / choice / grammar specs")
    p.add_argument("--systems", default="all", help="comma-separated; default: all")
    p.add_argument("--timeout", type=float, default=10.0, help="per-spec deadline (s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs (median kept) of specs whose first TTFM is under 100 ms")
    p.add_argument("--tokenizer", default="qwen2.5")
    p.add_argument("--json", dest="json_out", help="write rows + summary here")
    p.add_argument("--log-dir", help="workers' stderr logs (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", metavar="JSON",
                   help="measure nothing: recompute summary, ratios, tables (and "
                        "--json) from the rows of an earlier run")
    return p


def report(args: argparse.Namespace) -> int:
    payload = json.loads(Path(args.report).read_text())
    rows = payload["rows"]
    systems = list(payload["summary"])
    unavailable = {n: s["unavailable"] for n, s in payload["summary"].items()
                   if "unavailable" in s}
    payload["summary"] = summarize(rows, systems, unavailable)
    payload["ratios"] = compare(rows)
    print(tables(payload))
    if args.json_out:
        write_json(args.json_out, payload)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return report(args)
    systems = parse_systems(args.systems)
    subsets = [s for s in args.subsets.split(",") if s] or None
    cases = load_maskbench(args.corpus, args.sample, args.seed, subsets)
    if not args.no_extras:
        cases += extra_cases(args.corpus)
    options = {"timeout": args.timeout, "tokenizer": args.tokenizer,
               "repeats": max(1, args.repeats)}
    machine = machine_info()
    print(f"{len(cases)} specs x {len(systems)} systems; timeout {args.timeout} s; "
          f"{machine['cpu']}, {machine['cores']} cores", file=sys.stderr)
    result = run(cases, systems, options, quiet=args.quiet, log_dir=args.log_dir)
    rows = result["rows"]
    machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    payload: dict[str, Any] = {
        "benchmark": "compile",
        "argv": ["grammask", "bench", "compile", *(argv if argv is not None else sys.argv[1:])],
        "config": {"sample": args.sample, "seed": args.seed, "subsets": subsets,
                   "extras": not args.no_extras, "timeout_s": args.timeout,
                   "repeats": args.repeats,
                   "tokenizer": args.tokenizer, "cases": len(cases)},
        "machine": machine, "setup": result["setup"], "wall_s": result["wall_s"],
        "summary": summarize(rows, systems, result["unavailable"]),
        "ratios": compare(rows), "rows": rows,
    }
    print(tables(payload))
    if args.json_out:
        write_json(args.json_out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
