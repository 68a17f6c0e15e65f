"""grammask vs vLLM's own structured-output engine: the same standard requests, one server.

    python -m bench.vllm_server [--url http://127.0.0.1:8000/v1 --model NAME]
                                [--reps 4] [--concurrency 32] [--batches 1]
                                [--max-tokens 64] [--json out/bench-vllm-server.json]

or ``make bench-server``. Without ``--url`` it starts the e2e suite's tiny random
Qwen2.5-layout server (needs the vLLM CPU venv: ``make vllm-venv`` or
``GRAMMASK_VLLM_PYTHON``) with ``--enable-auto-tool-choice --tool-call-parser hermes`` and a
fresh ``PROMETHEUS_MULTIPROC_DIR``, and stops it afterwards. With grammask installed its
drop-in serves vLLM's standard structured-output requests; a request that adds
``vllm_xargs: {"grammask_structured_outputs": "vllm"}`` goes to vLLM's own engine instead.
The two systems are that one key apart: every case is the same standard request otherwise
(same prompt, seeds, temperature 1.0, ``max_tokens``):

- ``response_format``: ``json_schema`` strict and not strict (``PERSON``), ``json_object``;
- ``structured_outputs``: ``regex``, ``choice``, ``json`` (``LLG_SCHEMA``);
- tools: a strict ``get_weather`` with ``tool_choice="required"`` and
  ``parallel_tool_calls=False`` (valid: exactly one call of ``get_weather`` whose arguments
  validate against ``WEATHER_PARAMS``);
- ``/v1/completions`` with ``structured_outputs`` ``json`` (``PERSON``).

Every request streams. Per (system, case) and concurrency, after one unmeasured request: at
concurrency 1 ``--reps`` sequential requests, at ``--concurrency`` (32) ``--batches``
batches sent at once. Reported: valid rate (``jsonschema`` and the ``regex`` module, never
grammask; with random weights every valid output is the mask's doing), finish reasons, TTFT
p50 (for tool calls: when vLLM's hermes parser has the function name), output tokens/s and
ms/token; grammask's counter (``grammask_requests_total``) read around each system's runs
must grow for grammask's requests only. Which system goes first alternates per case.
Beyond the mask the systems differ in their defaults: grammask's JSON is compact, vLLM's
allows any whitespace (a weak model may spend its budget on it), and once a grammar has
ended grammask allows only stop tokens. Numbers only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shutil
import statistics
import tempfile
import time
import types
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.specs import LLG_SCHEMA, REGEX

from bench.stats import fmt_ms, machine_info, render_table, write_json

SYSTEMS = ("grammask", "vllm")
#: the per-request opt-out: vLLM's own engine serves this request
OPT_OUT = {"grammask_structured_outputs": "vllm"}
CHOICES = ["alpha", "beta", "gamma delta"]
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]
PROMPT = "A person as JSON:"
SEQ_SEED0, BATCH_SEED0 = 1, 101

# the e2e suite's standard request pieces (loaded by name: tests/ is not type-checked)
_standard: Any = importlib.import_module("tests.e2e.standard")
PERSON: dict[str, Any] = _standard.PERSON
WEATHER_PARAMS: dict[str, Any] = _standard.WEATHER_PARAMS


@dataclass
class Result:
    """One streamed reply."""

    text: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    finish: str = "none"
    tokens: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str  # "chat" or "completions"
    params: dict[str, Any]  # the standard request fields (extra_body included)
    check: Callable[[Result], bool]


def _json(schema: dict[str, Any] | None) -> Callable[[Result], bool]:
    def check(result: Result) -> bool:
        import jsonschema

        try:
            value = json.loads(result.text)
            if schema is None:
                return isinstance(value, dict)
            jsonschema.validate(value, schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return check


def _regex(result: Result) -> bool:
    import regex

    return regex.fullmatch(REGEX, result.text) is not None


def _choice(result: Result) -> bool:
    return result.text in CHOICES


def _one_weather_call(result: Result) -> bool:
    import jsonschema

    if len(result.calls) != 1 or result.calls[0][0] != "get_weather":
        return False
    try:
        jsonschema.validate(json.loads(result.calls[0][1]), WEATHER_PARAMS)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CASES: list[Case] = [
    Case("response_format json_schema strict", "chat",
         {"response_format": _standard.response_format(PERSON, strict=True)}, _json(PERSON)),
    Case("response_format json_schema", "chat",
         {"response_format": _standard.response_format(PERSON, strict=False)}, _json(PERSON)),
    Case("response_format json_object", "chat",
         {"response_format": {"type": "json_object"}}, _json(None)),
    Case("structured_outputs regex", "chat",
         {"extra_body": {"structured_outputs": {"regex": REGEX}}}, _regex),
    Case("structured_outputs choice", "chat",
         {"extra_body": {"structured_outputs": {"choice": CHOICES}}}, _choice),
    Case("structured_outputs json", "chat",
         {"extra_body": {"structured_outputs": {"json": LLG_SCHEMA}}}, _json(LLG_SCHEMA)),
    Case("tools required, strict", "chat",
         {"tools": [_standard.weather_tool(strict=True)], "tool_choice": "required",
          "parallel_tool_calls": False}, _one_weather_call),
    Case("completions structured_outputs json", "completions",
         {"extra_body": {"structured_outputs": {"json": PERSON}}}, _json(PERSON)),
]


def request_fields(case: Case, system: str) -> dict[str, Any]:
    """The case's standard fields; vLLM's engine gets the opt-out key added, nothing else."""
    params = dict(case.params)
    if system == "vllm":
        extra = dict(params.get("extra_body", {}))
        extra["vllm_xargs"] = {**extra.get("vllm_xargs", {}), **OPT_OUT}
        params["extra_body"] = extra
    return params


def one(client: Any, model: str, case: Case, system: str, seed: int,
        max_tokens: int) -> Result:
    """One streamed request: text, tool calls, finish reason, usage, TTFT, wall time."""
    out = Result()
    common = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
              "stream": True, "stream_options": {"include_usage": True},
              **request_fields(case, system)}
    parts: list[str] = []
    calls: dict[int, list[str]] = {}
    t0 = time.perf_counter()
    try:
        if case.endpoint == "chat":
            stream = client.chat.completions.create(messages=MESSAGES, **common)
        else:
            stream = client.completions.create(prompt=PROMPT, **common)
        for chunk in stream:
            if chunk.usage is not None:
                out.tokens = int(chunk.usage.completion_tokens or 0)
            for choice in chunk.choices:
                if case.endpoint == "chat":
                    text = choice.delta.content or ""
                    deltas = choice.delta.tool_calls or []
                else:
                    text, deltas = choice.text or "", []
                if (text or deltas) and out.ttft_ms is None:
                    out.ttft_ms = (time.perf_counter() - t0) * 1000
                parts.append(text)
                for d in deltas:
                    slot = calls.setdefault(d.index, ["", ""])
                    if d.function is not None:
                        slot[0] += d.function.name or ""
                        slot[1] += d.function.arguments or ""
                if choice.finish_reason:
                    out.finish = str(choice.finish_reason)
    except Exception as exc:  # one failed request is a result, not the end of the bench
        out.error, out.finish = f"{type(exc).__name__}: {exc}"[:300], "error"
    out.total_ms = (time.perf_counter() - t0) * 1000
    out.text = "".join(parts)
    out.calls = [(name, args) for _, (name, args) in sorted(calls.items())]
    return out


def measure(client: Any, model: str, case: Case, system: str, concurrency: int, n: int,
            max_tokens: int) -> dict[str, Any]:
    """``n`` requests: sequential at concurrency 1, else batches of ``concurrency``."""
    seed0 = SEQ_SEED0 if concurrency == 1 else BATCH_SEED0
    results: list[Result] = []
    wall_s = 0.0
    if concurrency == 1:
        t0 = time.perf_counter()
        results = [one(client, model, case, system, seed0 + i, max_tokens) for i in range(n)]
        wall_s = time.perf_counter() - t0
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            for start in range(0, n, concurrency):
                seeds = range(seed0 + start, seed0 + min(n, start + concurrency))
                t0 = time.perf_counter()
                results += list(pool.map(
                    lambda s: one(client, model, case, system, s, max_tokens), seeds))
                wall_s += time.perf_counter() - t0
    valid = [case.check(r) for r in results]
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
    per_token = [r.total_ms / r.tokens for r in results if r.tokens]
    return {
        "system": system, "case": case.name, "concurrency": concurrency,
        "requests": len(results), "valid": sum(valid),
        "valid_rate": round(sum(valid) / len(results), 3) if results else None,
        "finish": dict(Counter(r.finish for r in results).most_common()),
        "errors": [r.error for r in results if r.error][:3],
        "ttft_p50_ms": round(statistics.median(ttfts), 2) if ttfts else None,
        "completion_tokens": tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "ms_per_token_p50": round(statistics.median(per_token), 3) if per_token else None,
        "request_p50_ms": round(statistics.median(r.total_ms for r in results), 2)
        if results else None,
        "samples": [_sample(r) for r in results[:2]],
        "invalid_samples": [_sample(r) for r, ok in zip(results, valid, strict=True)
                            if not ok][:4],
    }


def _sample(r: Result) -> dict[str, Any]:
    out: dict[str, Any] = {"finish": r.finish, "tokens": r.tokens, "text": r.text}
    if r.calls:
        out["tool_calls"] = [{"name": name, "arguments": args} for name, args in r.calls]
    if r.error:
        out["error"] = r.error
    return out


def counter(base_url: str) -> dict[str, float] | None:
    """grammask's drop-in counter by kind (``source="structured_outputs"``); None when
    ``/metrics`` cannot be read."""
    try:
        by = _standard.served(types.SimpleNamespace(base_url=base_url))
    except (OSError, ValueError):
        return None
    return {kind: v for (src, kind), v in by.items() if src == "structured_outputs"}


def _delta(before: dict[str, float] | None,
           after: dict[str, float] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: round(v - before.get(k, 0.0)) for k, v in after.items()
            if v - before.get(k, 0.0)}


def run(client: Any, base_url: str, model: str, reps: int, concurrency: int, batches: int,
        max_tokens: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    served: list[dict[str, Any]] = []
    plan = [(1, reps), (concurrency, concurrency * batches)]
    for i, case in enumerate(CASES):
        entry: dict[str, Any] = {"case": case.name}
        for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
            before = counter(base_url)
            one(client, model, case, system, 0, max_tokens)  # warm-up: compile, caches
            for conc, n in plan:
                row = measure(client, model, case, system, conc, n, max_tokens)
                rows.append(row)
                print(f"  {system:8} {case.name:36} c={conc:<3} valid {row['valid']}/"
                      f"{row['requests']} {_finish(row['finish'])}  ttft p50 "
                      f"{fmt_ms(row['ttft_p50_ms'])} ms  {row['tokens_per_s']} tok/s",
                      flush=True)
            entry[system] = {"sent": 1 + sum(n for _, n in plan),
                             "counter_delta": _delta(before, counter(base_url))}
        served.append(entry)
    return rows, served


def _finish(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def table(rows: list[dict[str, Any]]) -> str:
    order = {c.name: i for i, c in enumerate(CASES)}
    body = [[r["system"], r["case"], r["concurrency"], f"{r['valid']}/{r['requests']}",
             _finish(r["finish"]), fmt_ms(r["ttft_p50_ms"]),
             "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}",
             fmt_ms(r["ms_per_token_p50"])]
            for r in sorted(rows, key=lambda r: (order[r["case"]], r["concurrency"],
                                                 SYSTEMS.index(r["system"])))]
    return render_table(["system", "case", "concurrency", "valid", "finish reasons",
                         "TTFT p50 ms", "tok/s", "ms/token"], body)


def served_table(served: list[dict[str, Any]]) -> str:
    def cell(part: dict[str, Any]) -> str:
        d = part["counter_delta"]
        return "skipped" if d is None else f"+{sum(d.values())} of {part['sent']} sent" + (
            f" ({', '.join(f'{k} {v}' for k, v in d.items())})" if d else "")
    return render_table(["case", "grammask counter: grammask runs", "grammask counter: vLLM runs"],
                        [[e["case"], cell(e["grammask"]), cell(e["vllm"])] for e in served])


def server_version(base_url: str) -> str:
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/version",
                                    timeout=5) as reply:
            return str(json.loads(reply.read()).get("version", "?"))
    except (OSError, ValueError):
        return "?"


SERVER_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@contextlib.contextmanager
def server_for(url: str | None, model: str, server_args: Sequence[str] = (),
               log_name: str = "grammask-bench-server.log",
               env: Mapping[str, str] | None = None) -> Iterator[tuple[str, str, Any]]:
    """``(base URL, model name, Server or None)``: ``url`` as given, or the e2e suite's tiny
    Qwen2.5-layout server started here (with ``server_args``, ``env`` and a fresh
    ``PROMETHEUS_MULTIPROC_DIR``) and stopped on exit."""
    if url is not None:
        yield url, model, None
        return
    tiny_model: Any = importlib.import_module("tests.e2e.tiny_model")
    e2e_server: Any = importlib.import_module("tests.e2e.server")
    log = Path(tempfile.gettempdir()) / log_name
    prom_dir = tempfile.mkdtemp(prefix="grammask-bench-prom-")
    try:
        server = e2e_server.Server(
            tiny_model.model_dir("qwen2.5"), log,
            env={**(env or {}), "PROMETHEUS_MULTIPROC_DIR": prom_dir},
            args=list(server_args)).start()
        try:
            print(f"tiny server up in {server.start_s:.0f} s (log {log})", flush=True)
            yield server.base_url, e2e_server.MODEL_NAME, server
        finally:
            server.stop()
    finally:
        shutil.rmtree(prom_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--url", help="an already running server's /v1 URL")
    ap.add_argument("--model", default="tiny", help="served model name (with --url)")
    ap.add_argument("--reps", type=int, default=4,
                    help="sequential requests per (system, case) at concurrency 1")
    ap.add_argument("--concurrency", type=int, default=32,
                    help="requests sent at once in a batch")
    ap.add_argument("--batches", type=int, default=1,
                    help="batches per (system, case) at --concurrency")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default="out/bench-vllm-server.json",
                    help="write the results to this file ('' for none)")
    args = ap.parse_args(argv)

    from openai import OpenAI

    t_start = time.perf_counter()
    with server_for(args.url, args.model, SERVER_ARGS) as (base_url, model, server):
        client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=300)
        version = server_version(base_url)
        t_bench = time.perf_counter()
        rows, served = run(client, base_url, model, args.reps, args.concurrency,
                           args.batches, args.max_tokens)
        bench_s = time.perf_counter() - t_bench
        final = counter(base_url)
    counter_checked = server is not None or bool(final)
    if not counter_checked:  # an external server without grammask's series: no proof
        for entry in served:
            for system in SYSTEMS:
                entry[system]["counter_delta"] = None
    print()
    print(table(rows))
    print()
    print(served_table(served))
    print(f"\nvLLM {version}; bench {bench_s:.0f} s, total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        info = machine_info()
        info["server_vllm"] = version
        write_json(args.json, {
            # the server's vLLM (machine.versions.vllm is this process's venv's, if any)
            "benchmark": "vllm_server", "vllm_version": version, "machine": info,
            "url": args.url,
            "settings": {"reps": args.reps, "concurrency": args.concurrency,
                         "batches": args.batches, "max_tokens": args.max_tokens,
                         "temperature": 1.0, "opt_out": {"vllm_xargs": OPT_OUT},
                         "server_args": None if args.url else SERVER_ARGS},
            "counter_checked": counter_checked, "bench_s": round(bench_s, 1),
            "rows": rows, "served": served})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
