"""The specs the benchmarks measure, and how they travel to a worker process.

Every system sees the same cases in the same run: a seeded, stratified sample of maskbench's
JSON schemas (every subset gets a share proportional to its size), plus regex, choice and
grammar specs. A ``Case`` is plain text, so any system can take it, and crosses the pipe to a
worker as a plain dict (``case_payload`` / ``case_from``).
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    """One spec to benchmark, in the form every system can take (plain text)."""

    id: str
    group: str  # maskbench subset, or regex / choice / grammar
    kind: str  # json_schema | regex | choice | grammar
    source: str  # schema JSON text, regex, JSON list of choices, or grammar text
    syntax: str | None = None  # ebnf | lark (grammar kind)
    instances: tuple[str, ...] = ()  # valid texts (JSON instances, or a sample input)


def load_maskbench(corpus: Path, sample: int | None, seed: int,
                   subsets: Sequence[str] | None = None, *,
                   need_instances: bool = False) -> list[Case]:
    """A stratified sample: every subset gets a share proportional to its size (at least
    two schemas, when it has them), drawn with a seeded RNG so runs are repeatable.
    ``sample=None`` or 0 takes every schema."""
    pools: dict[str, list[Case]] = {}
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        subset = path.name.removesuffix(".jsonl.gz")
        if subsets and subset not in subsets:
            continue
        cases = []
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh):
                row = json.loads(line)
                valid = tuple(json.dumps(t["data"], ensure_ascii=False)
                              for t in row.get("tests", []) if t.get("valid"))
                if need_instances and not valid:
                    continue
                cases.append(Case(f"{subset}/{row.get('id', lineno)}", subset, "json_schema",
                                  json.dumps(row["schema"], ensure_ascii=False),
                                  instances=valid))
        pools[subset] = cases
    if subsets:
        missing = sorted(set(subsets) - set(pools))
        if missing:
            raise SystemExit(f"unknown maskbench subsets: {missing}; have {sorted(pools)}")
    if not sample:
        return [c for name in sorted(pools) for c in pools[name]]
    return stratified(pools, sample, seed)


def stratified(pools: dict[str, list[Case]], sample: int, seed: int) -> list[Case]:
    """Proportional allocation with a floor of two per stratum, trimmed to ``sample``."""
    total = sum(len(p) for p in pools.values())
    if total == 0:
        return []
    sample = min(sample, total)
    floor = 2 if sample >= 2 * len(pools) else 1 if sample >= len(pools) else 0
    quota = {name: min(len(p), max(floor, round(sample * len(p) / total)))
             for name, p in pools.items()}
    # trim or top up (largest strata first) so the total is exactly ``sample``
    order = sorted(pools, key=lambda n: (-len(pools[n]), n))
    while sum(quota.values()) > sample:
        name = max(order, key=lambda n: (quota[n] - floor, quota[n]))
        quota[name] -= 1
    while sum(quota.values()) < sample:
        name = next(n for n in order if quota[n] < len(pools[n]))
        quota[name] += 1
    out: list[Case] = []
    for name in sorted(pools):
        rng = random.Random(f"{seed}/{name}")
        out.extend(sorted(rng.sample(pools[name], quota[name]), key=lambda c: c.id))
    return out


#: Regexes of the kind users send (formats, identifiers, dates), with a sample each.
EXTRA_REGEXES: dict[str, tuple[str, str]] = {
    "email": (r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}", "jane.doe@example.com"),
    "uuid": (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
             "123e4567-e89b-12d3-a456-426614174000"),
    "iso_date": (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "2024-02-29"),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", "192.168.0.1"),
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
    "semver": (r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?", "1.20.3-rc.1"),
    "sentence": (r"[A-Z][a-z]+( [a-z]+){2,12}\.", "The quick brown fox jumps."),
    "hex_color": (r"#[0-9a-fA-F]{6}", "#a1b2c3"),
}
EXTRA_CHOICES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "yes_no": ["yes", "no"],
    "colors": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"],
    "languages": ["Python", "Rust", "C++", "TypeScript", "Go", "Java", "Kotlin", "Swift",
                  "Haskell", "OCaml", "Elixir", "Zig"],
}


def extra_cases(corpus: Path) -> list[Case]:
    """Regex, choice and grammar specs (the corpus' GBNF and Lark grammars)."""
    out = [Case(f"regex/{name}", "regex", "regex", rx, instances=(sample,))
           for name, (rx, sample) in EXTRA_REGEXES.items()]
    out += [Case(f"choice/{name}", "choice", "choice", json.dumps(opts), instances=(opts[0],))
            for name, opts in EXTRA_CHOICES.items()]
    for path in sorted((corpus / "gbnf").glob("*.gbnf")):
        out.append(Case(f"grammar/{path.name}", "grammar", "grammar",
                        path.read_text(encoding="utf-8"), syntax="ebnf"))
    lark_dir = corpus / "lark"
    samples = {"rfc.lark": lark_dir / "rfc.xml"}
    for path in sorted(lark_dir.glob("*.lark")) + sorted(lark_dir.glob("*.gbnf")):
        sample = samples.get(path.name)
        text = path.read_text(encoding="utf-8")
        out.append(Case(f"grammar/{path.name}", "grammar", "grammar", text,
                        syntax="ebnf" if "::=" in text else "lark",
                        instances=(sample.read_text(encoding="utf-8"),) if sample else ()))
    return out


def case_payload(case: Case) -> dict[str, Any]:
    return asdict(case)


def case_from(payload: dict[str, Any]) -> Case:
    data = dict(payload)
    data["instances"] = tuple(data.get("instances", ()))
    return Case(**data)
