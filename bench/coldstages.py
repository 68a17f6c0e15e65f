"""Where a cold compile's time goes when the caches are cold, stage by stage, beside raw
llguidance's whole time to first mask.

``bench.compile`` runs every system in its own process and rotates them spec by spec, so
each one starts a spec on caches the others evicted; every Python step then costs several
times its warm cost. This bench reproduces that in one process (a buffer of ``--evict-mb``
rewritten before each TTFM; 0 keeps the caches warm) and times the stages of grammask's
path by wrapping its functions (a wrapper adds ~1 µs). Per spec, the median over
``--rounds``; the table gives the median over specs. Run::

    python -m bench.coldstages [--backend guidance|auto] [--rounds 5] [--evict-mb 48]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cases import extra_cases, load_maskbench
from bench.paths import DEFAULT_CORPUS
from bench.stats import render_table
from bench.systems import Grammask, RawGuidance

#: (module, attribute, stage): the functions timed, by where grammask looks them up
_STAGES = (
    ("grammask.spec", "parse_schema", "spec: JSON parse"),
    ("grammask.jsontext", "compact", "spec: compact re-encode"),
    ("grammask.spec", "_digest", "spec: key (sha256)"),
    ("grammask.compiler", "plan", "plan (router)"),
    ("grammask.flights.Flights", "lookup", "lookup, flight"),
    ("grammask.compile_cache.CompileCache", "insert", "cache insert"),
    ("grammask.flights.Flights", "resolve", "settle the flight"),
    ("grammask.attempts", "_observe", "compile metrics"),
    ("grammask.attempts.PlanRunner", "_grammar", "Grammar record"),
    ("grammask.backends.guidance", "grammar_text", "grammar text"),
    ("grammask.backends.guidance", "normalize_schema", "grammar text: normalize"),
    ("grammask.backends.guidance", "_first_mask", "first mask (copy, mask, check)"),
)


def _resolve(path: str) -> Any:
    """A module, or a class of one, by its dotted path."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def instrument(marks: dict[str, float]) -> Callable[[], None]:
    """Wrap every stage's function to add its time to ``marks``; returns the undo."""
    undo: list[tuple[Any, str, Any]] = []
    for owner_path, name, label in _STAGES:
        owner = _resolve(owner_path)
        original = getattr(owner, name)

        def timed(*args: Any, _f: Any = original, _label: str = label, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                marks[_label] = marks.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        undo.append((owner, name, original))

    def restore() -> None:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    return restore


def run(backend: str | None, rounds: int, evict_mb: int, corpus: Path) -> dict[str, Any]:
    import numpy as np

    cases = load_maskbench(corpus, 29, 2) + extra_cases(corpus)
    options = {"tokenizer": "qwen2.5", "timeout": 10.0}
    raw, ours = RawGuidance(options), Grammask(options, backend)
    raw.setup()
    ours.setup()
    junk = np.zeros(max(evict_mb, 0) << 20, dtype=np.uint8)
    marks: dict[str, float] = {}
    per_spec: dict[str, dict[str, list[float]]] = {}
    restore = instrument(marks)
    try:
        for _ in range(rounds):
            for case in cases:
                times = _one_case(case, raw, ours, junk, marks)
                if times is None:
                    continue
                row = per_spec.setdefault(case.id, {})
                for key, value in times.items():
                    row.setdefault(key, []).append(value)
    finally:
        restore()
    both = {cid: row for cid, row in per_spec.items()
            if "raw TTFM" in row and "grammask TTFM" in row}
    seen = {k for row in both.values() for k in row}
    stages = [k for k in ("raw TTFM", "grammask TTFM", *(label for _, _, label in _STAGES))
              if k in seen]
    table = {k: statistics.median(statistics.median(row[k]) for row in both.values()
                                  if k in row) * 1e6 for k in stages}
    ratio = statistics.median(statistics.median(row["grammask TTFM"])
                              / statistics.median(row["raw TTFM"]) for row in both.values())
    return {"backend": backend or "auto", "rounds": rounds, "evict_mb": evict_mb,
            "specs": len(both), "stages_us_p50": table, "ttfm_ratio_per_spec_p50": ratio}


def _one_case(case: Any, raw: RawGuidance, ours: Grammask, junk: Any,
              marks: dict[str, float]) -> dict[str, float] | None:
    """Raw llguidance's TTFM, then grammask's with its stages; None when either fails, or
    grammask routed the spec to another backend."""
    out: dict[str, float] = {}
    for name, system in (("raw", raw), ("grammask", ours)):
        if junk.size:
            junk[::64] += 1  # evict the caches, as the bench's other workers do
        bitmask = system.bitmask(1)
        marks.clear()
        t0 = time.perf_counter()
        try:
            compiled = system.compile(case)
            matcher = system.matcher(compiled)
            system.fill(matcher, bitmask, 0)
        except Exception:
            system.forget()
            return None
        if system is ours and getattr(compiled, "backend", None) != "guidance":
            system.forget()  # auto routed it to another backend: no raw system to compare
            return None
        out[f"{name} TTFM"] = time.perf_counter() - t0
        system.forget()
    out.update(marks)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("guidance", "auto"), default="guidance")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--evict-mb", type=int, default=48,
                   help="buffer rewritten before each TTFM (0: warm caches)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--json", type=Path, default=Path("out/bench/coldstages.json"))
    args = p.parse_args(argv)
    result = run(None if args.backend == "auto" else args.backend, args.rounds,
                 args.evict_mb, args.corpus)
    rows = [[stage, f"{us:.1f}"] for stage, us in result["stages_us_p50"].items()]
    print(render_table(["stage", "µs (p50 over specs)"], rows))
    print(f"grammask-{result['backend']} / raw llguidance TTFM, per spec p50: "
          f"{result['ttfm_ratio_per_spec_p50']:.3f} ({result['specs']} specs)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
