"""``grammask check``: prove the masks right on a corpus, or on one spec and its instances.

    grammask check --corpus PATH [--subset NAME ...] [--sample N] [--seed S]
                   [--backend auto|BACKEND|all] [--tokenizer T] [--timeout SEC]
                   [--json OUT]
    grammask check SPEC --instances FILE.jsonl [--kind json|regex|choice|grammar] ...

On SIGTERM (``timeout``) the run stops and reports the items finished so far.
Exit status: 0 when no mask audit mismatch, no oracle under-constraint at the mask level and
no sampled output failing its oracle (outside declared gaps) and no dead end (the probe: an
allowed token after which nothing ends, or only an invalid output) was found; 1 otherwise; 2 on
usage errors and without the ``check`` extra (``pip install 'grammask[check]'``: regex, lark).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..backends import registry
from . import extras
from .check import CheckConfig, Checker
from .corpus import GROUPS, Item, ItemKind, load_items, read_instances
from .report import build_report, labels, markdown, render
from .runner import Pool, Results, run_serial

_KINDS: dict[str, ItemKind] = {"json": "json_schema", "regex": "regex", "choice": "choice",
                               "grammar": "grammar"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="grammask check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", help="one spec (inline text or a file) to check")
    p.add_argument("--instances", type=Path, help="JSONL of {valid, data|text} for SPEC")
    p.add_argument("--kind", choices=sorted(_KINDS), help="kind of SPEC (default: guessed)")
    p.add_argument("--corpus", type=Path, help="corpus root (maskbench/, jsts/, gbnf/, lark/)")
    p.add_argument("--subset", action="append", metavar="NAME",
                   help=f"a maskbench subset or one of {', '.join(GROUPS)} (repeatable)")
    p.add_argument("--sample", type=int, help="at most N items per subset (seeded)")
    p.add_argument("--whole", action="append", metavar="NAME", default=[],
                   help="a subset exempt from --sample (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="all", choices=[*labels(), "all"],
                   type=lambda v: registry.canonical(v.strip().lower()) or v.strip().lower(),
                   help="one registered backend (an alias works too), auto routing, or all")
    p.add_argument("--tokenizer", default="qwen2.5")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="compile budget per spec and backend (Compiler timeout_s)")
    p.add_argument("--hard-timeout", type=float,
                   help="kill a worker stuck this long in one backend (default 6x --timeout, "
                        "at least 60 s)")
    p.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    p.add_argument("--walks", type=int, default=2, help="sampled outputs per spec and backend")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--audit-steps", type=int, default=3, help="audited steps per walk")
    p.add_argument("--audit-tokens", type=int, default=2000,
                   help="allowed (and forbidden) tokens offered per audited step")
    p.add_argument("--walk-budget", type=float, default=15.0,
                   help="seconds per sampled walk before it steps back to an end")
    p.add_argument("--probe-states", type=int, default=2,
                   help="states per walk the dead-end probe looks at (0: no probe)")
    p.add_argument("--probe-tokens", type=int, default=8,
                   help="allowed tokens the probe takes per state (one per first byte)")
    p.add_argument("--diff-budget", type=float, default=20.0,
                   help="seconds per item for the differential")
    p.add_argument("--compact-only", action="store_true",
                   help="JSON without free whitespace (compact form only)")
    p.add_argument("--open-objects", action="store_true",
                   help="JSON Schema semantics (undeclared keys allowed) instead of grammask's "
                        "default closed objects")
    p.add_argument("--no-diff", action="store_true", help="skip the differential")
    p.add_argument("--recheck-auto", action="store_true",
                   help="check auto's grammar even when it is the very grammar a forced "
                        "backend row already checked (default: reuse that row)")
    p.add_argument("--json", type=Path, dest="json_out", help="write the full report here")
    p.add_argument("--markdown", type=Path, dest="md_out",
                   help="write the per-subset table as Markdown here")
    p.add_argument("--no-progress", action="store_true")
    ns = p.parse_args(list(argv))
    if ns.spec is None and ns.corpus is None:
        p.error("give a SPEC or --corpus PATH")
    if ns.spec is not None and ns.corpus is not None:
        p.error("SPEC and --corpus are exclusive")
    return ns


def config_of(ns: argparse.Namespace, remotes: Path | None) -> CheckConfig:
    return CheckConfig(
        tokenizer=ns.tokenizer, timeout_s=ns.timeout, walks=ns.walks, max_tokens=ns.max_tokens,
        audit_steps=ns.audit_steps, audit_tokens=ns.audit_tokens,
        any_whitespace=not ns.compact_only, extra_properties=ns.open_objects,
        diff=not ns.no_diff, seed=ns.seed, walk_budget_s=ns.walk_budget,
        diff_budget_s=ns.diff_budget, reuse_auto=not ns.recheck_auto,
        probe_states=ns.probe_states, probe_tokens=ns.probe_tokens,
        remotes=str(remotes) if remotes is not None and remotes.is_dir() else None)


def spec_item(ns: argparse.Namespace) -> Item:
    from ..specs.text import spec_from_text

    text, name = ns.spec, "spec"
    path = Path(ns.spec)
    if len(ns.spec) < 4096 and path.is_file():
        text, name = path.read_text(encoding="utf-8"), path.name
    spec = spec_from_text(text, ns.kind, name=name if name != "spec" else "")
    kind: ItemKind = _KINDS["json"] if spec.kind == "json_schema" else spec.kind  # type: ignore[assignment]
    source: Any = spec.schema if kind == "json_schema" else (
        spec.choices if kind == "choice" else spec.source)
    instances = read_instances(ns.instances, kind) if ns.instances else ()
    return Item(name, "cli", kind, source, spec.syntax, instances)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    backends = [b.package for b in registry.backends() if b.package]
    for pkg in ("grammask", *backends, "jsonschema", "regex", "lark", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "?"
    return out


def main(argv: Sequence[str]) -> int:
    ns = parse_args(argv)
    missing = extras.missing()
    if missing:  # the oracles' packages: a plain install has them only with grammask[check]
        print(extras.message(missing), file=sys.stderr)
        return 2
    backends = labels() if ns.backend == "all" else (ns.backend,)
    started = time.time()
    if ns.corpus is not None:
        try:
            items = load_items(ns.corpus, ns.subset, sample=ns.sample, seed=ns.seed,
                               whole=ns.whole)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        cfg = config_of(ns, ns.corpus / "jsts" / "remotes")
    else:
        try:
            items = [spec_item(ns)]
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        cfg = config_of(ns, None)
    results = _run(items, backends, cfg, ns)
    meta = {"command": "grammask check " + " ".join(argv), "config": cfg.__dict__,
            "backends": list(backends), "items": len(items), "versions": versions(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
            "workers": ns.workers if ns.corpus is not None else 0,
            "worker_restarts": results.restarts, "elapsed_s": round(time.time() - started, 1),
            "interrupted": results.interrupted,
            "items_done": len({(r["subset"], r["id"]) for r in results.rows})}
    report = build_report(results.rows, results.diffs, items, meta)
    print(render(report))
    if ns.spec is not None:
        _print_examples(results.rows)
    if ns.json_out is not None:
        ns.json_out.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        print(f"\nreport written to {ns.json_out}")
    if ns.md_out is not None:
        ns.md_out.write_text(markdown(report), encoding="utf-8")
        print(f"table written to {ns.md_out}")
    return 1 if _found_bugs(report) else 0


def _run(items: list[Item], backends: tuple[str, ...], cfg: CheckConfig,
         ns: argparse.Namespace) -> Results:
    from tqdm import tqdm

    bar = tqdm(total=len(items), unit="spec", disable=ns.no_progress or len(items) < 2,
               file=sys.stderr)
    try:
        if ns.corpus is None:  # one spec: no isolation needed, no worker start-up
            checker = Checker(cfg)
            try:
                return run_serial(checker, items, backends, bar.update)
            finally:
                checker.close()
        hard = ns.hard_timeout or max(60.0, 6 * ns.timeout)
        pool = Pool(cfg, workers=ns.workers, hard_timeout_s=hard)
        # ``timeout 3h grammask check ...`` still writes a report of what was done
        previous = signal.signal(signal.SIGTERM, lambda *_: pool.stop())
        try:
            return pool.run(items, backends, bar.update)
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        bar.close()


def _found_bugs(report: dict[str, Any]) -> bool:
    for s in report["summary"].values():
        a = s["audit"]
        if (a["mismatches"] or a["oracle_under"] or s["samples_invalid"]
                or s.get("dead_ends") or s.get("invalid_ends")):
            return True
    return False


def _print_examples(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        head = f"\n[{row['backend']}] {row['status']}"
        if row["status"] != "ok":
            print(f"{head}: {row['error']}")
            continue
        print(f"{head} (served by {row['served_by']}; {row['reason']})")
        for ex in row["examples"]:
            print(f"  {ex}")
        for ex in row["audit"].get("examples", []):
            print(f"  audit: {ex}")
