"""Fixed-work throughput on one real vLLM server: grammask, vLLM's engine, unconstrained.

    python -m bench.vllm_throughput [--url http://127.0.0.1:8000/v1 --model NAME --pid PID]
        [--rounds 3] [--concurrency 1,16,32] [--reps 4] [--batches 5] [--max-tokens 64]
        [--specs json-xg,json-llg,regex,choice] [--json out/bench-vllm-throughput.json]

Without ``--url`` it starts the e2e suite's tiny random Qwen2.5-layout server (the vLLM CPU
venv: ``make vllm-venv`` or ``GRAMMASK_VLLM_PYTHON``; ``bench.vllm_server.server_for``).
Every request does the same work: ``ignore_eos`` (``extra_body``) and a fixed
``max_tokens``, so each one produces exactly ``max_tokens`` tokens whatever its constraint
(checked against ``usage.completion_tokens``; any request that did not is reported). Three
systems on the one server, the same standard chat request otherwise (prompt, seeds,
temperature 1.0):

- ``grammask``: the standard structured-output fields (grammask's drop-in serves them);
- ``vllm``: the same request plus ``vllm_xargs: {"grammask_structured_outputs": "vllm"}``
  (vLLM's own engine, its ``auto`` backend);
- ``unconstrained``: no constraint at all (the model's own speed on this server).

Specs: ``json-xg`` (``XG_SCHEMA`` as ``response_format`` ``json_schema``: grammask routes it
to xgrammar), ``json-llg`` (``LLG_SCHEMA`` as ``structured_outputs`` ``json``: llguidance),
``regex``, ``choice``; not by default ``words`` (lowercase words, rarely ends) and
``json-xg-long`` / ``json-llg-long`` (arrays of at least 200 items: a prefix is checked, with
``regex``'s partial matching), which keep both engines masking every token.

Per round, spec and concurrency each system sends ``--reps`` sequential requests at
concurrency 1, above it ``--batches`` batches sent at once; the same requests (and seeds)
every round; the systems take turns chunk by chunk (a request, a batch), their order
rotating per round and spec, after one unmeasured request each. Each batch goes through a
gate (``bench/gate.py``; ``--no-gate`` to skip): vLLM's engine is paused
(``/pause?mode=keep``, ``VLLM_SERVER_DEV_MODE=1``), the batch is sent, and once the API
server has handed every request over the engine resumes and runs the whole batch from its
first step; timing starts at the resume. Per cell, from the server's ``/metrics`` read around
each chunk: vLLM's per-request time per output token (TPOT) and TTFT, how many requests ran
at once (``overlaps``), grammask's ``grammask_requests_total``; also client tokens/s, the
CPU time the hypervisor stole per chunk, and up to three outputs that failed their check.
Reported per (spec, concurrency, system): median over rounds, min-max and spread ((max -
min) / median), and the TPOT ratios grammask/vLLM and grammask/unconstrained (a round's
ratio: the median of its chunk-by-chunk ratios); then the verdict against the bar (ratio
<= 1.0 at concurrency 16 and 32, its spread under 10%).

Requests are not streamed: on a loaded two-core machine the API server at times delivered a
whole stream in one burst at its end, which makes a client's TTFT and inter-token times
meaningless; the engine's own timestamps are not affected.

What differs between the systems beyond the mask (each system's defaults, left as they
are; docs/benchmarks.md has the details): after the grammar ends grammask allows only stop
tokens, while vLLM's engine lets free text through (more to detokenize, and its CPU sampler
samples the whole vocabulary instead of a few tokens); grammask's JSON is compact, vLLM's
allows any whitespace; vLLM fills in the engine core, grammask on a thread of the worker.
``words`` and the two long specs keep both engines masking every token.

Numbers only: nothing is asserted. On a shared machine read the load averages in the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.e2e.specs import LLG_SCHEMA, REGEX, XG_SCHEMA

from bench.gate import Gate
from bench.stats import cpu_ticks, fmt_ms, machine_info, render_table, steal_share, write_json
from bench.vllm_server import (
    CHOICES,
    MESSAGES,
    OPT_OUT,
    Case,
    Result,
    _choice,
    _json,
    _regex,
    request_fields,
    server_for,
    server_version,
)

SYSTEMS = ("grammask", "vllm", "unconstrained")
FIXED = {"ignore_eos": True}
WORDS = r"[a-z]+( [a-z]+)*"
#: JSON that never ends within max_tokens: grammask routes the first to xgrammar (no
#: free-form text), the second to llguidance (length-bounded strings)
XG_LONG: dict[str, Any] = {"type": "array", "minItems": 200,
                           "items": {"type": "integer", "minimum": 0, "maximum": 999}}
LLG_LONG: dict[str, Any] = {"type": "array", "minItems": 200,
                            "items": {"type": "string", "minLength": 1, "maxLength": 6}}
_WS = r"[ \t\n\r]*"  # vLLM's engine allows any whitespace between JSON tokens
_INT = r"(0|[1-9][0-9]{0,2})"
_STR = r'"([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4})){1,6}"'
#: what a truncated output of each must be a prefix of (200 items, then the closing bracket)
XG_LONG_PREFIX = rf"{_WS}\[{_WS}{_INT}({_WS},{_WS}{_INT}){{199,}}{_WS}\]{_WS}"
LLG_LONG_PREFIX = rf"{_WS}\[{_WS}{_STR}({_WS},{_WS}{_STR}){{199,}}{_WS}\]{_WS}"

_standard: Any = importlib.import_module("tests.e2e.standard")


def _re_full(pattern: str, text: str) -> bool:
    import regex

    return regex.fullmatch(pattern, text) is not None


def _prefix_of(pattern: str) -> Any:
    """A check that the text is a prefix of something ``pattern`` matches whole (the output
    was cut at ``max_tokens``)."""
    def check(result: Result) -> bool:
        import regex

        return regex.fullmatch(pattern, result.text, partial=True) is not None
    return check


def _fixed(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "extra_body": {**params.get("extra_body", {}), **FIXED}}


SPECS: dict[str, Case] = {
    "json-xg": Case("json-xg", "chat", _fixed(
        {"response_format": _standard.response_format(XG_SCHEMA, strict=True)}),
        _json(XG_SCHEMA)),
    "json-llg": Case("json-llg", "chat", _fixed(
        {"extra_body": {"structured_outputs": {"json": LLG_SCHEMA}}}), _json(LLG_SCHEMA)),
    "regex": Case("regex", "chat", _fixed(
        {"extra_body": {"structured_outputs": {"regex": REGEX}}}), _regex),
    "choice": Case("choice", "chat", _fixed(
        {"extra_body": {"structured_outputs": {"choice": CHOICES}}}), _choice),
    # not a default: a grammar that rarely ends within max_tokens (both engines mask every
    # token, with many tokens allowed), so the sampler's cost is alike for both systems
    "words": Case("words", "chat", _fixed(
        {"extra_body": {"structured_outputs": {"regex": WORDS}}}),
        lambda r: _re_full(WORDS, r.text)),
    "json-xg-long": Case("json-xg-long", "chat", _fixed(
        {"response_format": _standard.response_format(XG_LONG, strict=True)}),
        _prefix_of(XG_LONG_PREFIX)),
    "json-llg-long": Case("json-llg-long", "chat", _fixed(
        {"extra_body": {"structured_outputs": {"json": LLG_LONG}}}),
        _prefix_of(LLG_LONG_PREFIX)),
}
DEFAULT_SPECS = ("json-xg", "json-llg", "regex", "choice")
UNCONSTRAINED = Case("unconstrained", "chat", _fixed({}), lambda r: True)


def case_of(spec: Case, system: str) -> Case:
    """The request a system gets for ``spec`` (``request_fields`` adds the opt-out key for
    ``vllm``)."""
    return UNCONSTRAINED if system == "unconstrained" else spec


def request(client: Any, model: str, case: Case, system: str, seed: int,
            max_tokens: int) -> Result:
    """One chat request, not streamed: text, finish reason, completion tokens, wall time."""
    out = Result()
    t0 = time.perf_counter()
    try:
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0,
            seed=seed, **request_fields(case, system))
        out.text = reply.choices[0].message.content or ""
        out.finish = str(reply.choices[0].finish_reason)
        out.tokens = int(reply.usage.completion_tokens or 0) if reply.usage else 0
    except Exception as exc:  # one failed request is a result, not the end of the bench
        out.error, out.finish = f"{type(exc).__name__}: {exc}"[:300], "error"
    out.total_ms = (time.perf_counter() - t0) * 1000
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$")
#: vLLM's request histograms (sum and count), stamped by the engine core
HISTOGRAMS = {"tpot": "vllm:request_time_per_output_token_seconds",
              "ttft": "vllm:time_to_first_token_seconds",
              "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds"}


def scrape(base_url: str) -> dict[str, float] | None:
    """The server's ``/metrics``: vLLM's request histograms (``<key>_sum``, ``<key>_count``
    summed over label sets) and grammask's drop-in counter (``grammask:<kind>``); None when
    it cannot be read."""
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics",
                                    timeout=30) as reply:
            text = reply.read().decode()
    except (OSError, ValueError):
        return None
    names = {f"{metric}_{part}": f"{key}_{part}" for key, metric in HISTOGRAMS.items()
             for part in ("sum", "count")}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name in names:
            key = names[name]
        elif name == "grammask_requests_total" and 'source="structured_outputs"' in (
                labels or ""):
            kind = re.search(r'kind="([^"]*)"', labels or "")
            key = f"grammask:{kind.group(1) if kind else '?'}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def metric_delta(before: dict[str, float] | None, after: dict[str, float] | None
                 ) -> dict[str, float] | None:
    """What the server's metrics grew by between two scrapes (None: one is missing)."""
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def server_side(delta: dict[str, float] | None, requests: int) -> dict[str, Any]:
    """What the server recorded for one cell's requests (the metrics' deltas, summed over
    its chunks): the mean of vLLM's per-request TPOT, TTFT and end-to-end latency (ms), and
    grammask's counter."""
    if delta is None:
        return {"metrics": None}
    out: dict[str, Any] = {"metrics_requests": round(delta.get("tpot_count", 0.0))}
    for key in HISTOGRAMS:
        n = delta.get(f"{key}_count", 0.0)
        out[f"server_{key}_ms"] = round(1000 * delta[f"{key}_sum"] / n, 3) if n else None
    out["grammask_served"] = {k.split(":", 1)[1]: round(v) for k, v in delta.items()
                              if k.startswith("grammask:") and round(v)}
    if out["metrics_requests"] != requests:
        out["metrics_mismatch"] = True
    return out


def chunk(client: Any, base_url: str, model: str, spec: Case, system: str,
          concurrency: int, seeds: list[int], max_tokens: int,
          pool: ThreadPoolExecutor | None = None, gate: Gate | None = None
          ) -> dict[str, Any]:
    """One piece of a cell: ``seeds`` requests of one system, sequential at concurrency 1,
    else sent at once (one batch, through ``gate`` when given: its wall time then starts at
    the release); its results, wall time and the server's metric deltas."""
    case = case_of(spec, system)

    def send(seed: int) -> Result:
        return request(client, model, case, system, seed, max_tokens)

    before = scrape(base_url)
    ticks = cpu_ticks()
    t0 = time.perf_counter()
    gated_s = None
    if concurrency == 1 or pool is None:
        results = [send(s) for s in seeds]
        t_go = t0
    elif gate is None:
        results = list(pool.map(send, seeds))
        t_go = t0
    else:
        began: list[int] = []

        def send_counted(seed: int) -> Result:
            began.append(seed)
            return send(seed)

        gate.hold()
        try:  # a paused engine left paused would hang every later request
            t0 = time.perf_counter()
            futures = [pool.submit(send_counted, s) for s in seeds]
            gated_s = gate.wait_handed_over(lambda: len(began), len(seeds))
        finally:
            gate.release()
        t_go = time.perf_counter()
        results = [f.result() for f in futures]
        for r in results:  # a request's own time starts at the release too
            r.total_ms = max(0.0, r.total_ms - (t_go - t0) * 1000)
    t_end = time.perf_counter()
    stolen = steal_share(ticks, cpu_ticks())
    wall_s = t_end - t_go
    after = scrape(base_url)
    for _ in range(10):  # the API server records a request's stats as it answers it
        if after is None or before is None or round(
                after.get("tpot_count", 0) - before.get("tpot_count", 0)) >= len(seeds):
            break
        time.sleep(0.1)
        after = scrape(base_url)
    delta = metric_delta(before, after)
    return {"seeds": seeds, "results": results, "wall_s": wall_s, "delta": delta,
            "gated_s": gated_s, "overlap": overlap(delta, t_end - t0), "steal": stolen}


def overlap(delta: dict[str, float] | None, wall_s: float) -> float | None:
    """How many of a chunk's requests the server ran at once, on average: their end-to-end
    latencies (its metrics) over the chunk's wall time (None: no metrics)."""
    if delta is None or wall_s <= 0 or not delta.get("e2e_count"):
        return None
    return delta.get("e2e_sum", 0.0) / wall_s


def cell_of(chunks: list[dict[str, Any]], spec: Case, system: str, concurrency: int,
            max_tokens: int) -> dict[str, Any]:
    """A cell (one system, spec and concurrency in one round) from its chunks: the
    client's view (tokens/s over the chunks' wall time) and the server's (its metrics)."""
    case = case_of(spec, system)
    seeds = [s for c in chunks for s in c["seeds"]]
    results: list[Result] = [r for c in chunks for r in c["results"]]
    wall_s = sum(c["wall_s"] for c in chunks)
    deltas = [c["delta"] for c in chunks]
    delta: dict[str, float] | None = None
    if all(d is not None for d in deltas):
        delta = {}
        for d in deltas:
            assert d is not None
            for k, v in d.items():
                delta[k] = delta.get(k, 0.0) + v
    tokens = sum(r.tokens for r in results)
    passed = [case.check(r) for r in results]
    per_token = [r.total_ms / r.tokens for r in results if r.tokens]
    not_fixed = [{"seed": s, "tokens": r.tokens, "finish": r.finish, "error": r.error}
                 for s, r in zip(seeds, results, strict=True) if r.tokens != max_tokens]
    return {
        "spec": spec.name, "system": system, "concurrency": concurrency,
        "requests": len(results), "chunks": len(chunks), "completion_tokens": tokens,
        "overlaps": [c.get("overlap") for c in chunks],
        "gated_s": [None if c.get("gated_s") is None else round(c["gated_s"], 3)
                    for c in chunks],
        # each chunk's own mean TPOT (the ratio pairs chunks that ran next to each other)
        "chunk_tpot_ms": [server_side(c["delta"], len(c["seeds"])).get("server_tpot_ms")
                          for c in chunks],
        "overlap_min": min((c["overlap"] for c in chunks if c.get("overlap") is not None),
                           default=None),
        "chunk_steal_pct": [None if c.get("steal") is None else round(100 * c["steal"], 2)
                            for c in chunks],
        "valid": sum(passed),
        "invalid_samples": [{"seed": s, "text": r.text[:400]}
                            for s, r, ok in zip(seeds, results, passed, strict=True)
                            if not r.error and not ok][:3],
        "finish": dict(Counter(r.finish for r in results).most_common()),
        "not_fixed": len(not_fixed), "not_fixed_samples": not_fixed[:5],
        "errors": [r.error for r in results if r.error][:3],
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "request_ms_per_token_p50": round(statistics.median(per_token), 3)
        if per_token else None,
        **server_side(delta, len(results)),
        "sample": results[0].text[:120] if results else "",
    }


def _order(round_: int, offset: int) -> tuple[str, ...]:
    k = (round_ + offset) % len(SYSTEMS)
    return SYSTEMS[k:] + SYSTEMS[:k]


def run(client: Any, base_url: str, model: str, specs: list[Case], *, rounds: int,
        concurrencies: list[int], reps: int, batches: int, max_tokens: int,
        gate: Gate | None = None
        ) -> tuple[list[dict[str, Any]], dict[str, dict[str, dict[str, int] | None]],
                   list[list[float]]]:
    """Warm-up, then ``rounds`` rounds; the cells, grammask's counter delta per (spec,
    system), and the load average at the start of each round."""
    top = max(concurrencies)
    with ThreadPoolExecutor(top) as pool:  # warm the server itself: threads, allocator
        list(pool.map(lambda s: request(client, model, UNCONSTRAINED, "unconstrained", s,
                                        max_tokens), range(top)))
    for spec in specs:
        for system in SYSTEMS:
            request(client, model, case_of(spec, system), system, 0, max_tokens)
    cells: list[dict[str, Any]] = []
    served: dict[str, dict[str, Counter[str]]] = {
        s.name: {system: Counter() for system in SYSTEMS} for s in specs}
    checked = True
    loads: list[list[float]] = []
    with ThreadPoolExecutor(top) as pool:
        for rnd in range(rounds):
            loads.append([round(x, 2) for x in os.getloadavg()])
            print(f"round {rnd + 1}/{rounds} (load {loads[-1]})", flush=True)
            for si, spec in enumerate(specs):
                for conc in concurrencies:
                    order = _order(rnd, si)
                    n = reps if conc == 1 else conc * batches
                    size = 1 if conc == 1 else conc
                    # the same requests every round (seeds too): with a grammar that ends
                    # early, another seed is other work (more or fewer stop-only tokens)
                    seeds = list(range(1 + 1_000 * conc, 1 + 1_000 * conc + n))
                    # the systems take turns chunk by chunk (a request at concurrency 1, a
                    # batch above it), so a change of load hits all three alike
                    chunks: dict[str, list[dict[str, Any]]] = {s: [] for s in order}
                    for i in range(0, n, size):
                        for system in order:
                            chunks[system].append(chunk(
                                client, base_url, model, spec, system, conc,
                                seeds[i:i + size], max_tokens, pool, gate))
                    for system in order:
                        row = cell_of(chunks[system], spec, system, conc, max_tokens)
                        if row.get("grammask_served") is None:
                            checked = False
                        else:
                            served[spec.name][system].update(row["grammask_served"])
                        row["round"] = rnd
                        cells.append(row)
                        warn = f"  NOT {max_tokens} TOKENS: {row['not_fixed']}" if (
                            row["not_fixed"]) else ""
                        stolen = [x for x in row["chunk_steal_pct"] if x is not None]
                        steal = f"  steal {max(stolen):.1f}%" if stolen else ""
                        print(f"  {system:13} {spec.name:8} c={conc:<3} "
                              f"{row['tokens_per_s']:>7} tok/s  server TPOT "
                              f"{fmt_ms(row.get('server_tpot_ms'))} ms  valid "
                              f"{row['valid']}/{row['requests']}{warn}{steal}",
                              flush=True)
    counts: dict[str, dict[str, dict[str, int] | None]] = {
        spec: {system: dict(c) if checked else None for system, c in by.items()}
        for spec, by in served.items()}
    return cells, counts, loads


def _spread(values: list[float]) -> dict[str, float] | None:
    """Median, min, max and the spread across rounds: (max - min) / median."""
    if not values:
        return None
    median = statistics.median(values)
    return {"median": round(median, 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values),
            "spread": round((max(values) - min(values)) / median, 3) if median else 0.0}


def tpot_ratio(cells: list[dict[str, Any]], spec: str, concurrency: int, system: str,
               other: str) -> dict[str, float] | None:
    """Each round's TPOT ratio of ``system`` over ``other`` (same spec and concurrency):
    the median over the round's chunks of chunk-by-chunk ratios (the two systems took turns
    chunk by chunk, so each pair ran seconds apart and a slow spell of the machine is one
    outlying pair, not a shifted mean); median and min-max over rounds."""
    at = {(c["round"], c["system"]): c for c in cells
          if c["spec"] == spec and c["concurrency"] == concurrency}
    ratios = []
    for (r, s), mine in at.items():
        theirs = at.get((r, other))
        if s != system or theirs is None:
            continue
        pairs = [a / b for a, b in zip(mine.get("chunk_tpot_ms") or [],
                                       theirs.get("chunk_tpot_ms") or [], strict=False)
                 if a and b]
        if pairs:
            ratios.append(statistics.median(pairs))
        elif mine.get("server_tpot_ms") and theirs.get("server_tpot_ms"):
            ratios.append(mine["server_tpot_ms"] / theirs["server_tpot_ms"])
    return _spread(ratios)


def summarize(cells: list[dict[str, Any]], specs: list[Case],
              concurrencies: list[int]) -> list[dict[str, Any]]:
    """Per (spec, concurrency, system): medians and min-max over rounds, TPOT ratios."""
    out = []
    for spec in specs:
        for conc in concurrencies:
            for system in SYSTEMS:
                mine = [c for c in cells if c["spec"] == spec.name
                        and c["concurrency"] == conc and c["system"] == system]
                out.append({
                    "spec": spec.name, "concurrency": conc, "system": system,
                    "rounds": len(mine),
                    "tokens_per_s": _spread([c["tokens_per_s"] for c in mine
                                             if c["tokens_per_s"] is not None]),
                    "tpot_ms": _spread([c["server_tpot_ms"] for c in mine
                                        if c.get("server_tpot_ms") is not None]),
                    "ttft_ms": _spread([c["server_ttft_ms"] for c in mine
                                        if c.get("server_ttft_ms") is not None]),
                    "request_ms_per_token": _spread(
                        [c["request_ms_per_token_p50"] for c in mine
                         if c["request_ms_per_token_p50"] is not None]),
                    "requests": sum(c["requests"] for c in mine),
                    "valid": sum(c["valid"] for c in mine),
                    "not_fixed": sum(c["not_fixed"] for c in mine),
                    "tpot_vs_vllm": tpot_ratio(cells, spec.name, conc, system, "vllm")
                    if system == "grammask" else None,
                    "tpot_vs_unconstrained": tpot_ratio(cells, spec.name, conc, system,
                                                        "unconstrained")
                    if system != "unconstrained" else None,
                })
    return out


def _fmt(s: dict[str, float] | None, digits: int = 0) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _pct(s: dict[str, float] | None) -> str:
    return "-" if s is None else f"{100 * s['spread']:.0f}%"


def table(summary: list[dict[str, Any]]) -> str:
    return render_table(
        ["spec", "c", "system", "tok/s median (min-max)",
         "TPOT ms (server) median (min-max)", "TPOT spread", "TTFT ms (server)", "valid",
         "not fixed", "TPOT / vLLM", "ratio spread", "TPOT / unconstrained"],
        [[s["spec"], s["concurrency"], s["system"], _fmt(s["tokens_per_s"]),
          _fmt(s["tpot_ms"], 2), _pct(s["tpot_ms"]),
          fmt_ms(s["ttft_ms"]["median"]) if s["ttft_ms"] else "-",
          f"{s['valid']}/{s['requests']}", s["not_fixed"], _fmt(s["tpot_vs_vllm"], 2),
          _pct(s["tpot_vs_vllm"]), _fmt(s["tpot_vs_unconstrained"], 2)] for s in summary])


def verdict(summary: list[dict[str, Any]], floor: int = 16) -> str:
    """The issue's bar, cell by cell: grammask's TPOT <= vLLM's at concurrency >= ``floor``
    (and how many cells hold it in their worst round too: a verdict the spread cannot
    overturn), and the ratio's spread across rounds under 10%; then, stricter, how many
    cells also have both systems' own TPOT that steady (a slow spell of the machine moves
    both TPOTs and not their ratio)."""
    ratios = [s for s in summary if s["system"] == "grammask" and s["concurrency"] >= floor
              and s["tpot_vs_vllm"] is not None]
    tpots = {(s["spec"], s["concurrency"], s["system"]): s["tpot_ms"] for s in summary}
    at_most_1 = [s for s in ratios if s["tpot_vs_vllm"]["median"] <= 1.0]
    worst_too = [s for s in ratios if s["tpot_vs_vllm"]["max"] <= 1.0]
    steady = [s for s in ratios if s["tpot_vs_vllm"]["spread"] < 0.10]
    both = [s for s in steady if all(
        (t := tpots.get((s["spec"], s["concurrency"], system))) is not None
        and t["spread"] < 0.10 for system in ("grammask", "vllm"))]
    wide = ", ".join(f"{s['spec']} c={s['concurrency']}" for s in ratios if s not in steady)
    return (f"TPOT grammask/vLLM <= 1.0 at c >= {floor}: {len(at_most_1)}/{len(ratios)} "
            f"cells (in every round: {len(worst_too)}/{len(ratios)}); its spread across "
            f"rounds < 10%: {len(steady)}/{len(ratios)}"
            + (f" (not: {wide})" if wide else "")
            + f"; both systems' TPOT spreads < 10% too: {len(both)}/{len(ratios)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--url", help="an already running server's /v1 URL")
    ap.add_argument("--model", default="tiny", help="served model name (with --url)")
    ap.add_argument("--pid", type=int,
                    help="the server's root process (with --url: the gate watches it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,32",
                    help="comma-separated concurrencies")
    ap.add_argument("--reps", type=int, default=4,
                    help="sequential requests per cell at concurrency 1")
    ap.add_argument("--batches", type=int, default=5,
                    help="batches per cell above concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-gate", action="store_true",
                    help="send batches straight in (no pause/resume around them)")
    ap.add_argument("--fill-cpus", default="",
                    help="GRAMMASK_FILL_CPUS for the bench's own server ('' unset)")
    ap.add_argument("--specs", default=",".join(DEFAULT_SPECS),
                    help=f"from {', '.join(SPECS)}")
    ap.add_argument("--json", default="out/bench-vllm-throughput.json",
                    help="write the results to this file ('' for none)")
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    try:
        specs = [SPECS[k] for k in args.specs.split(",")]
    except KeyError as exc:
        ap.error(f"unknown spec {exc}; known: {', '.join(SPECS)}")

    from openai import DefaultHttpxClient, OpenAI
    from tests.e2e.server import short_keepalive

    load_before = [round(x, 2) for x in os.getloadavg()]
    print(f"load average before: {load_before}", flush=True)
    t_start = time.perf_counter()
    server_env = {} if args.no_gate else {"VLLM_SERVER_DEV_MODE": "1"}
    if args.fill_cpus:
        server_env["GRAMMASK_FILL_CPUS"] = args.fill_cpus
    with server_for(args.url, args.model, log_name="grammask-bench-throughput.log",
                    env=server_env) as (base_url, model, server):
        client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600,
                        http_client=DefaultHttpxClient(limits=short_keepalive()))
        version = server_version(base_url)
        pid = args.pid if server is None else server.proc.pid
        gate: Gate | None = None
        if not args.no_gate:
            gate = Gate(base_url.removesuffix("/v1"), pid)
            if not gate.available():
                print("no gate: the server has no /pause (VLLM_SERVER_DEV_MODE=1); batches "
                      "go straight in", flush=True)
                gate = None
        t_bench = time.perf_counter()
        cells, served, round_loads = run(
            client, base_url, model, specs, rounds=args.rounds, concurrencies=concurrencies,
            reps=args.reps, batches=args.batches, max_tokens=args.max_tokens, gate=gate)
        bench_s = time.perf_counter() - t_bench
        load_after = [round(x, 2) for x in os.getloadavg()]
    load_end = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(cells, specs, concurrencies)
    print()
    print(table(summary))
    print(verdict(summary))
    bad = [c for c in cells if c["not_fixed"]]
    print(f"\nrequests that did not produce exactly {args.max_tokens} tokens: "
          + (", ".join(f"{c['system']} {c['spec']} c={c['concurrency']} round "
                       f"{c['round'] + 1}: {c['not_fixed']} {c['not_fixed_samples'][:2]}"
                       for c in bad) or "none"))
    print("grammask counter (requests grammask served) per spec: " + "; ".join(
        f"{spec}: " + ", ".join(f"{system} +{sum(d.values()) if d is not None else '?'}"
                                for system, d in by.items()) for spec, by in served.items()))
    print(f"\nvLLM {version}; load average before {load_before}, after the rounds "
          f"{load_after}, at the end {load_end}; rounds {bench_s:.0f} s, "
          f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        info = machine_info()
        info["server_vllm"] = version
        write_json(args.json, {
            "benchmark": "vllm_throughput", "vllm_version": version, "machine": info,
            "load_avg_before": load_before, "load_avg_after": load_after,
            "load_avg_end": load_end,
            "load_avg_per_round": round_loads, "url": args.url,
            "settings": {"rounds": args.rounds, "concurrency": concurrencies,
                         "reps": args.reps, "batches": args.batches,
                         "max_tokens": args.max_tokens, "temperature": 1.0,
                         "gate": gate is not None, "fill_cpus": args.fill_cpus or None,
                         "fixed": FIXED, "opt_out": {"vllm_xargs": OPT_OUT},
                         "specs": {s.name: s.params for s in specs},
                         "unconstrained": UNCONSTRAINED.params},
            "bench_s": round(bench_s, 1),
            "summary": summary, "served": served, "cells": cells})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
