"""Fill cost per schema: grammask's routed backend against the cheaper engine that enforces
every keyword of the schema (issue 32, item 1), on corpus schemas walking a valid instance.

    python -m bench.fillcost [--sample 80] [--seed 1] [--json OUT]

For each schema that compiles: every backend that enforces all its keywords (the router's
gaps) walks the instance; before each token one fill is timed (the backends take turns token
by token, so background load hits them alike), twice; a backend's cost is its mean fill per
token (the lower of the two walks). Reported: the ratio of grammask's choice (``Compiler``
in auto mode, as served) to the cheapest eligible backend: geometric mean, median, p90,
share over 2x, and the routes' reasons. By default the compiler tunes (``tune_fill``: it
compares both engines on a probe walk of the grammar and serves the cheaper); ``--no-tune``
measures the router's choice alone.

The first wave (issue 52): a schema's first requests, admitted before the tuner's verdict,
run on the routed engine. Without the engine switch they stay there to their last token
(regret: the routed engine's cost over the cheapest's); with it they move to the tuned
choice once the verdict lands (regret: the tuned choice's, after the steps the switch takes,
which ``bench.wave`` measures). Both are reported: geomean and p90.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.cases import load_maskbench
from bench.paths import DEFAULT_CORPUS
from bench.stats import machine_info, percentile, write_json
from grammask import Compiler, GrammarError, GrammarSpec, load_vocabulary
from grammask.backends import registry
from grammask.compile import router
from grammask.kernels.bitmask import allocate_bitmask


def eligible(spec: GrammarSpec) -> list[str]:
    """The backends that enforce every keyword of ``spec`` (no gap of their own)."""
    features = router.route(spec).features
    common = registry.common_gaps()
    return [b.name for b in registry.backends() if "json_closed" in b.costs
            and not any(f in b.gaps and f not in common for f in features)]


def walk_costs(grammars: dict[str, Any], tokens: list[int], vocab_size: int,
               walks: int = 2) -> dict[str, float]:
    """Mean fill µs per token of each grammar along ``tokens`` (the best of ``walks``)."""
    bitmask = allocate_bitmask(1, vocab_size)
    best: dict[str, float] = {}
    for _ in range(walks):
        matchers = {name: g.matcher() for name, g in grammars.items()}
        total = dict.fromkeys(grammars, 0.0)
        for tok in tokens:
            for name, m in matchers.items():
                t0 = time.perf_counter()
                m.fill(bitmask, 0)
                total[name] += time.perf_counter() - t0
                if not m.accept(tok):
                    raise ValueError(f"{name} refused a token of a valid instance")
        for name, t in total.items():
            mean = t / len(tokens) * 1e6
            best[name] = min(best.get(name, mean), mean)
    return best


def run(sample: int, seed: int, corpus: Path, tune: bool = True) -> dict[str, Any]:
    vocab = load_vocabulary("qwen2.5")
    auto = Compiler(vocab, timeout_s=30, tune_fill=tune)
    forced = {name: Compiler(vocab, backend=name, timeout_s=30)
              for name in registry.names()}
    rows: list[dict[str, Any]] = []
    for case in load_maskbench(corpus, sample, seed, need_instances=True):
        spec = GrammarSpec.json_schema(case.source)
        try:
            names = eligible(spec)
            if not names:
                continue
            before = auto.stats.fill_tuned
            chosen = auto.compile(spec)
            routed = chosen.backend  # what a first wave runs on until the verdict
            if len(names) > 1 and auto.tune_fill:  # let the compiler compare, then ask again
                waited = time.monotonic() + 60
                while auto.stats.fill_tuned == before and time.monotonic() < waited:
                    time.sleep(0.005)
                chosen = auto.compile(spec)
            grammars = {n: forced[n].compile(spec) for n in names}
            tokens = vocab.encode(case.instances[0])[:400]
            costs = walk_costs({**grammars, "auto": chosen}, tokens, vocab.vocab_size)
        except (GrammarError, ValueError):
            continue
        cheapest = min(names, key=lambda n: costs[n])
        rows.append({"case": case.id, "chosen": chosen.backend, "cheapest": cheapest,
                     "eligible": names, "costs_us": {k: round(v, 2) for k, v in costs.items()},
                     "ratio": costs[chosen.backend] / costs[cheapest],
                     "ratio_measured": costs["auto"] / costs[cheapest],
                     "routed": routed, "first_wave_stays": costs[routed] / costs[cheapest],
                     "reason": chosen.reason})
    for c in (auto, *forced.values()):
        c.close()
    ratios: list[float] = [float(r["ratio"]) for r in rows]
    stays = [float(r["first_wave_stays"]) for r in rows]
    summary = {
        "schemas": len(rows),
        "geomean": math.exp(statistics.mean(math.log(x) for x in ratios)) if ratios else None,
        "median": statistics.median(ratios) if ratios else None,
        "p90": percentile(ratios, 90) if ratios else None,
        "over_2x": sum(x > 2 for x in ratios) / len(ratios) if ratios else None,
        "chosen": dict(Counter(r["chosen"] for r in rows)),
        "cheapest": dict(Counter(r["cheapest"] for r in rows)),
        "both_eligible": sum(len(r["eligible"]) > 1 for r in rows),
        "first_wave_regret": {
            "without_switch": {"geomean": _geomean(stays),
                               "p90": percentile(stays, 90) if stays else None},
            "with_switch": {"geomean": _geomean(ratios),
                            "p90": percentile(ratios, 90) if ratios else None}},
    }
    return {"machine": machine_info(), "summary": summary, "rows": rows}


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.mean(math.log(x) for x in values)) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fillcost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--no-tune", action="store_true",
                    help="the router's choice alone (Compiler(tune_fill=False))")
    ap.add_argument("--json")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("grammask").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    out = run(args.sample, args.seed, args.corpus, tune=not args.no_tune)
    s = out["summary"]
    print(f"{s['schemas']} schemas ({s['both_eligible']} where both backends enforce every "
          f"keyword): grammask's fill / the cheaper engine's: geomean {s['geomean']:.2f}, "
          f"median {s['median']:.2f}, p90 {s['p90']:.2f}, over 2x {s['over_2x']:.0%}; "
          f"chosen {s['chosen']}, cheapest {s['cheapest']}")
    wave = s["first_wave_regret"]
    print(f"first wave's regret: without the engine switch geomean "
          f"{wave['without_switch']['geomean'] or 0:.2f}, p90 "
          f"{wave['without_switch']['p90'] or 0:.2f}; with it (once switched) geomean "
          f"{wave['with_switch']['geomean'] or 0:.2f}, p90 {wave['with_switch']['p90'] or 0:.2f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
