"""Statistics, tables and the JSON report the benchmarks share.

Percentiles of timings, Markdown tables for the terminal and the docs, and what the numbers
were measured on (CPU, cores, memory, load, library versions, the grammask source digest), so
every benchmark writes its results the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.paths import REPO_ROOT


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def dist(values: Sequence[float], unit: str = "ms") -> dict[str, float | int]:
    """p50/p90/p99/max (and the count) of a list of timings."""
    out: dict[str, float | int] = {"n": len(values)}
    for q in (50, 90, 99):
        out[f"p{q}_{unit}"] = _round(percentile(values, q))
    out[f"max_{unit}"] = _round(max(values) if values else math.nan)
    return out


def _round(x: float) -> float:
    return x if math.isnan(x) else round(x, 4)


def fmt_ms(x: float | None) -> str:
    """Milliseconds for a table cell, with enough digits for microsecond values."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (readable in a terminal too)."""
    body = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    rest = ["| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                              for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |"
            for r in body]
    return "\n".join([line, sep, *rest])


def cpu_ticks() -> dict[str, int] | None:
    """The machine's CPU time so far, in clock ticks, from ``/proc/stat`` (all CPUs):
    ``total`` and ``steal`` (time the hypervisor gave this VM's CPUs to someone else: on a
    shared VM, the slow spells a benchmark cannot control). None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    fields += [0] * (8 - len(fields))
    return {"total": sum(fields[:8]), "steal": fields[7]}


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """The share of the CPU time between two ``cpu_ticks`` that the hypervisor stole."""
    if before is None or after is None or after["total"] <= before["total"]:
        return None
    return (after["steal"] - before["steal"]) / (after["total"] - before["total"])


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, load, library versions."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        mem_gb = round(int(first.split()[1]) / 1024 / 1024, 1)
    versions: dict[str, str] = {"python": platform.python_version()}
    for pkg in ("grammask", "xgrammar", "llguidance", "vllm", "torch", "transformers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = "not installed"
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {"cpu": cpu, "cores": cores, "memory_gb": mem_gb,
            "gpu": "none (CPU only)", "platform": platform.platform(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "versions": versions, "grammask_commit": commit,
            "grammask_src_digest": source_digest()}


def source_digest() -> str:
    """A digest of src/grammask/**.py: the commit alone misses uncommitted work."""
    h = hashlib.sha256()
    for path in sorted((REPO_ROOT / "src" / "grammask").rglob("*.py")):
        h.update(path.relative_to(REPO_ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)
