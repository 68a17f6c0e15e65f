"""Aggregation: per-backend and per-subset summaries, the ``auto`` targets, a text table.

Denominators: ``valid accepted %`` is over every valid instance (a schema a backend cannot
compile accepts none of its instances: coverage counts); ``invalid rejected %`` is over the
invalid instances of the schemas the backend compiled (refusing to compile is not rejecting).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from ..backends import registry
from ..schema.analysis import schema_features
from .corpus import Item

SUM_KEYS = ("valid_total", "valid_accepted", "invalid_total", "invalid_rejected", "over",
            "over_label", "over_closed", "over_order", "under", "under_known", "under_label",
            "label_disagree", "instances_skipped", "samples_total", "samples_valid",
            "samples_invalid", "samples_known_gap", "samples_unfinished", "samples_unchecked",
            "samples_truncated", "probe_states", "probe_tokens", "dead_ends", "invalid_ends",
            "probe_unfinished")
AUDIT_KEYS = ("steps", "tokens", "mismatches", "allowed_refused", "forbidden_taken",
              "special_allowed", "stop_inconsistent", "empty_masks", "oracle_tokens",
              "oracle_over", "oracle_under", "oracle_dialect", "oracle_undecided",
              "noncanonical")


def summarize(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One backend's totals over ``rows``."""
    out: dict[str, Any] = {"schemas": 0, "compiled": 0, "invalid_total_compiled": 0,
                           "timeouts": 0, "crashes": 0, "compile_errors": 0,
                           "harness_errors": 0, **dict.fromkeys(SUM_KEYS, 0)}
    forms_total: Counter[str] = Counter()
    forms_ok: Counter[str] = Counter()
    audit: Counter[str] = Counter()
    for row in rows:
        out["schemas"] += 1
        status = row["status"]
        if status == "ok":
            out["compiled"] += 1
            out["invalid_total_compiled"] += row["invalid_total"]
        elif status == "timeout":
            out["timeouts"] += 1
        elif status == "crash":
            out["crashes"] += 1
        elif status == "harness_error":
            out["harness_errors"] += 1
        else:
            out["compile_errors"] += 1
        for key in SUM_KEYS:
            out[key] += int(row.get(key, 0))
        forms_total.update(row.get("valid_forms_total", {}))
        forms_ok.update(row.get("valid_forms_accepted", {}))
        audit.update({k: int(row.get("audit", {}).get(k, 0)) for k in AUDIT_KEYS})
    out["valid_forms"] = {f: {"total": forms_total[f], "accepted": forms_ok[f]}
                          for f in sorted(forms_total)}
    out["audit"] = {k: audit[k] for k in AUDIT_KEYS}
    return out


def by_backend(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["backend"]].append(row)
    return {b: summarize(groups[b]) for b in labels() if b in groups}


def by_subset(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["subset"]].append(row)
    return {s: by_backend(groups[s]) for s in sorted(groups)}


def _pct(num: int, den: int) -> str:
    return f"{100.0 * num / den:.1f}" if den else "-"


def table(subsets: dict[str, dict[str, dict[str, Any]]], total: dict[str, dict[str, Any]]
          ) -> str:
    """The text table: one line per subset and backend, then the totals."""
    head = (f"{'subset':<22} {'backend':<8} {'items':>6} {'compiled':>8} {'valid acc%':>10} "
            f"{'inval rej%':>10} {'over':>5} {'under(known)':>12} {'samples ok%':>11} "
            f"{'audit mism':>10} {'oracle o/u':>10} {'dead/bad end':>12} {'t/o':>4} {'crash':>5}")
    lines = [head, "-" * len(head)]

    def line(name: str, backend: str, s: dict[str, Any]) -> str:
        under = f"{s['under']}({s['under_known']})"
        oracle = f"{s['audit']['oracle_over']}/{s['audit']['oracle_under']}"
        ends = f"{s.get('dead_ends', 0)}/{s.get('invalid_ends', 0)}"
        return (f"{name[:22]:<22} {backend:<8} {s['schemas']:>6} {s['compiled']:>8} "
                f"{_pct(s['valid_accepted'], s['valid_total']):>10} "
                f"{_pct(s['invalid_rejected'], s['invalid_total_compiled']):>10} "
                f"{s['over']:>5} {under:>12} "
                f"{_pct(s['samples_valid'] + s['samples_known_gap'], s['samples_total']):>11} "
                f"{s['audit']['mismatches']:>10} {oracle:>10} {ends:>12} {s['timeouts']:>4} "
                f"{s['crashes']:>5}")

    for name, per in subsets.items():
        for backend, s in per.items():
            lines.append(line(name, backend, s))
    lines.append("-" * len(head))
    for backend, s in total.items():
        lines.append(line("TOTAL", backend, s))
    return "\n".join(lines)


# --------------------------------------------------------------------------- targets
def targets(rows: list[dict[str, Any]], items: dict[str, Item]) -> dict[str, Any]:
    """The three ``auto`` targets, over items that have all three rows, with the items that
    miss them and the router features those items have (feedback for router.py)."""
    per_item: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        per_item[(row["subset"], row["id"])][row["backend"]] = row
    named = registry.names()
    full = {k: v for k, v in per_item.items() if set(labels()) <= v.keys()}
    union = auto_compiled = 0
    totals = Counter[str]()
    misses: dict[str, list[dict[str, Any]]] = {"compiled": [], "valid": [], "under": []}
    for (subset, item_id), r in full.items():
        au = r["auto"]
        ok = {b: r[b]["status"] == "ok" for b in r}
        if any(ok[b] for b in named):
            union += 1
            if not ok["auto"]:
                misses["compiled"].append(_miss(subset, item_id, r, items))
        auto_compiled += ok["auto"]
        for b in labels():
            totals[f"valid_{b}"] += r[b]["valid_accepted"]
            totals[f"under_{b}"] += r[b]["under"]
        bound = max(r[b]["valid_accepted"] for b in named)
        totals["valid_bound"] += bound
        if au["valid_accepted"] < bound:
            misses["valid"].append(_miss(subset, item_id, r, items))
        compiled_unders = [r[b]["under"] for b in named if ok[b]]
        if ok["auto"] and compiled_unders:
            totals["under_bound"] += min(compiled_unders)
            totals["under_auto_bounded"] += au["under"]
            if au["under"] > min(compiled_unders):
                misses["under"].append(_miss(subset, item_id, r, items))
    best_valid = max(totals[f"valid_{b}"] for b in named)
    best_under = min(totals[f"under_{b}"] for b in named)
    common = _common(full)
    return {
        "items": len(full),
        "compiled": {"auto": auto_compiled, "union": union,
                     "met": auto_compiled >= union and not misses["compiled"],
                     "missing": misses["compiled"]},
        "valid_accepted": {"auto": totals["valid_auto"],
                           **{b: totals[f"valid_{b}"] for b in named}, "best": best_valid,
                           "met": totals["valid_auto"] >= best_valid,
                           "per_item_bound": totals["valid_bound"],
                           "items_below_best": misses["valid"]},
        "invalid_accepted": {"auto": totals["under_auto"],
                             **{b: totals[f"under_{b}"] for b in named}, "best": best_under,
                             "met": totals["under_auto"] <= best_under,
                             "per_item_bound": totals["under_bound"],
                             "auto_where_bounded": totals["under_auto_bounded"],
                             "items_above_best": misses["under"]},
        "common": common,
        "feedback": feedback(misses, items),
    }


def _common(full: dict[tuple[str, str], dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Totals over the items every backend compiled: the fair comparison of quality, since
    raw totals also count coverage (a schema not compiled accepts no invalid instance)."""
    rows = [r for r in full.values() if all(r[b]["status"] == "ok" for b in r)]
    out: dict[str, Any] = {"items": len(rows)}
    for b in labels():
        out[b] = {k: sum(r[b][k] for r in rows) for k in
                  ("valid_total", "valid_accepted", "invalid_total", "under", "under_known",
                   "samples_total", "samples_valid", "samples_invalid")}
    return out


def _miss(subset: str, item_id: str, r: dict[str, dict[str, Any]], items: dict[str, Item]
          ) -> dict[str, Any]:
    item = items.get(item_id)
    features = sorted(schema_features(item.source)) if item and item.kind == "json_schema" \
        else []
    return {"subset": subset, "id": item_id, "features": features,
            "auto_served_by": r["auto"].get("served_by") or r["auto"]["status"],
            "auto_reason": r["auto"].get("reason", "")[:200],
            "auto_error": r["auto"].get("error", "")[:200],
            **{f"{b}_{k}": r[b][k] for b in labels()
               for k in ("status", "valid_accepted", "under")}}


def feedback(misses: dict[str, list[dict[str, Any]]], items: dict[str, Item]
             ) -> dict[str, Any]:
    """Which router features the target-missing items share, per target."""
    out: dict[str, Any] = {}
    for target, entries in misses.items():
        feats: Counter[str] = Counter()
        served: Counter[str] = Counter()
        for e in entries:
            feats.update(e["features"] or ["(no routing feature)"])
            served[e["auto_served_by"]] += 1
        out[target] = {"items": len(entries), "features": dict(feats.most_common()),
                       "auto_served_by": dict(served)}
    return out


def differential_summary(diffs: list[dict[str, Any]]) -> dict[str, Any]:
    classes: Counter[str] = Counter()
    resolved: Counter[str] = Counter()
    by_class: Counter[str] = Counter()
    out: dict[str, Any] = {"items": 0, "steps": 0, "steps_differ": 0, "divergences": 0,
                           "failed": 0}
    examples: list[dict[str, Any]] = []
    for d in diffs:
        if "status" in d:
            out["failed"] += 1
            continue
        out["items"] += 1
        for key in ("steps", "steps_differ", "divergences"):
            out[key] += d[key]
        classes.update(d["classes"])
        resolved.update(d["resolved"])
        by_class.update(d.get("resolved_by_class", {}))
        for ex in d["examples"]:
            if ("under" in ex["label"] or "over" in ex["label"]) and len(examples) < 20:
                examples.append({"id": d["id"], **ex})
    out["classes"] = dict(classes.most_common())
    out["resolved"] = dict(resolved.most_common())
    out["resolved_by_class"] = dict(by_class.most_common())
    out["examples"] = examples
    return out


def build_report(rows: list[dict[str, Any]], diffs: list[dict[str, Any]], items: list[Item],
                 meta: dict[str, Any]) -> dict[str, Any]:
    index = {item.id: item for item in items}
    summary = by_backend(rows)
    subsets = by_subset(rows)
    return {"meta": meta, "summary": summary, "subsets": subsets,
            "targets": targets(rows, index), "differential": differential_summary(diffs),
            "rows": rows, "diffs": diffs}


def markdown(report: dict[str, Any]) -> str:
    """The per-subset table as Markdown (for docs/), with the over-constraint split: refusals
    by design (declared key order, closed objects) and disputed labels apart from ``over``."""
    head = ("| subset | backend | items | compiled | valid acc % | invalid rej % | over | "
            "over (order / closed / label) | under (known gap) | samples valid % | "
            "audit mismatches | oracle over/under | dead / invalid ends | timeouts | crashes |\n"
            "|---|---|" + "---:|" * 13)

    def line(name: str, backend: str, s: dict[str, Any]) -> str:
        a = s["audit"]
        cells = [name, backend, s["schemas"], s["compiled"],
                 _pct(s["valid_accepted"], s["valid_total"]),
                 _pct(s["invalid_rejected"], s["invalid_total_compiled"]), s["over"],
                 f"{s['over_order']} / {s['over_closed']} / {s['over_label']}",
                 f"{s['under']} ({s['under_known']})",
                 _pct(s["samples_valid"] + s["samples_known_gap"], s["samples_total"]),
                 a["mismatches"], f"{a['oracle_over']}/{a['oracle_under']}",
                 f"{s.get('dead_ends', 0)} / {s.get('invalid_ends', 0)}", s["timeouts"],
                 s["crashes"]]
        return "| " + " | ".join(str(c) for c in cells) + " |"

    lines = [head]
    for name, per in report["subsets"].items():
        lines += [line(name, backend, s) for backend, s in per.items()]
    lines += [line("**TOTAL**", f"**{backend}**", s)
              for backend, s in report["summary"].items()]
    return "\n".join(lines) + "\n"


def labels() -> tuple[str, ...]:
    """The rows of one item: each registered backend, forced, and auto routing."""
    return (*registry.names(), "auto")


def _each(values: dict[str, Any], key: str | None = None, first: str | None = None) -> str:
    """``name value`` for each registered backend (``first`` before them)."""
    names = ((first,) if first else ()) + registry.names()
    return ", ".join(f"{b} {values[b] if key is None else values[b][key]}" for b in names)


def render(report: dict[str, Any]) -> str:
    """The human summary printed at the end of a run."""
    parts = [table(report["subsets"], report["summary"])]
    t = report["targets"]
    if t["items"]:
        c, v, u = t["compiled"], t["valid_accepted"], t["invalid_accepted"]
        parts.append(
            f"\nauto targets over {t['items']} items:\n"
            f"  compiled          auto {c['auto']} vs union {c['union']}: "
            f"{'met' if c['met'] else 'MISSED'} ({len(c['missing'])} items missing)\n"
            f"  valid accepted    auto {v['auto']} vs best {v['best']} ({_each(v)}): "
            f"{'met' if v['met'] else 'MISSED'}"
            f" ({len(v['items_below_best'])} items below the better backend)\n"
            f"  invalid accepted  auto {u['auto']} vs best {u['best']} ({_each(u)}): "
            f"{'met' if u['met'] else 'MISSED'}"
            f" ({len(u['items_above_best'])} items above the better backend)")
        cm = t["common"]
        if cm["items"]:
            parts.append(
                f"  on the {cm['items']} items every row compiled: valid accepted "
                f"{_each(cm, 'valid_accepted', first='auto')} (of "
                f"{cm['auto']['valid_total']}); invalid accepted "
                f"{_each(cm, 'under', first='auto')} (of {cm['auto']['invalid_total']})\n"
                f"  per-item bound (the better backend on each item): valid "
                f"{v['per_item_bound']} vs auto {v['auto']}; invalid accepted "
                f"{u['per_item_bound']} vs auto {u['auto_where_bounded']}")
    d = report["differential"]
    if d["items"]:
        parts.append(f"\ndifferential: {d['items']} items, {d['steps_differ']}/{d['steps']} "
                     f"compared steps differ; token classes {d['classes']}; "
                     f"resolved {d['resolved']}; divergences {d['divergences']}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """``python -m grammask.harness.report REPORT.json``: the Markdown table and the targets
    of a saved report (e.g. one a long run wrote when it was stopped)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m grammask.harness.report REPORT.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        report = json.load(f)
    print(markdown(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
