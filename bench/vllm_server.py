"""grammask vs vLLM's own structured outputs, on one real vLLM server (CPU, tiny model).

    python -m bench.vllm_server [--url http://127.0.0.1:8000/v1 --model NAME]
                                [--reps N] [--max-tokens N] [--json OUT]

Without ``--url`` it starts the tiny random Qwen2.5-layout server of the e2e suite (needs
the vLLM CPU venv: ``make vllm-venv`` or ``GRAMMASK_VLLM_PYTHON``) and stops it afterwards.
The same specs go through grammask (``vllm_xargs``) and through vLLM's built-in structured
outputs (``structured_outputs`` in the request), sequentially (wall time per request) and
as one concurrent batch of ``--reps`` requests. Outputs are checked by independent oracles
(jsonschema, ``regex``); with random weights validity is entirely the mask's doing. vLLM's
own path has no per-request ``disable_any_whitespace``: the started server gets it
server-wide (``--structured-outputs-config``, which then needs a named backend: xgrammar)
so both paths emit compact JSON; with
``--vllm-whitespace`` (or ``--url``) vLLM's JSON may run to max_tokens on whitespace (counted
invalid: not a complete document). Numbers only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tests.e2e.specs import LLG_SCHEMA, REGEX, XG_SCHEMA

from bench.stats import fmt_ms, machine_info, render_table, write_json

CHOICES = ["alpha", "beta", "gamma delta"]


def _valid_json(schema: dict[str, Any] | None) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        import jsonschema

        try:
            value = json.loads(text)
            if schema is None:
                return isinstance(value, dict)
            jsonschema.validate(value, schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return check


def _valid_regex(text: str) -> bool:
    import regex

    return regex.fullmatch(REGEX, text) is not None


#: name, vLLM structured_outputs object (grammask takes the same one), oracle
CASES: list[tuple[str, dict[str, Any], Callable[[str], bool]]] = [
    ("json: bounded object", {"json": XG_SCHEMA}, _valid_json(XG_SCHEMA)),
    ("json: bounded strings", {"json": LLG_SCHEMA}, _valid_json(LLG_SCHEMA)),
    ("regex", {"regex": REGEX}, _valid_regex),
    ("choice", {"choice": CHOICES}, lambda t: t in CHOICES),
    ("json_object", {"json_object": True}, _valid_json(None)),
]
SYSTEMS = ("grammask", "vllm")


def extra_body(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    if system == "grammask":
        return {"vllm_xargs": {"grammask": json.dumps({**spec, "disable_any_whitespace": True})}}
    return {"structured_outputs": spec}


def one(client: Any, model: str, system: str, spec: dict[str, Any], seed: int,
        max_tokens: int) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=1.0, seed=seed,
        messages=[{"role": "user", "content": "Answer in the requested format."}],
        extra_body=extra_body(system, spec))
    elapsed = (time.perf_counter() - t0) * 1000
    choice = reply.choices[0]
    return elapsed, str(choice.finish_reason), choice.message.content or ""


def run(client: Any, model: str, reps: int, max_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, spec, check in CASES:
        for system in SYSTEMS:
            one(client, model, system, spec, 0, max_tokens)  # compile and cache: warm-up
            seq = [one(client, model, system, spec, s, max_tokens) for s in range(1, reps + 1)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(reps) as pool:
                conc = list(pool.map(partial(one, client, model, system, spec),
                                     range(101, 101 + reps), [max_tokens] * reps))
            batch_ms = (time.perf_counter() - t0) * 1000
            results = seq + conc
            valid = sum(check(text) for _, finish, text in results if finish == "stop")
            times = [ms for ms, _, _ in seq]
            rows.append({
                "case": name, "system": system, "requests": len(results),
                "valid": valid, "valid_rate": round(valid / len(results), 3),
                "stopped": sum(finish == "stop" for _, finish, _ in results),
                "seq_mean_ms": round(statistics.fmean(times), 2),
                "seq_p50_ms": round(statistics.median(times), 2),
                "batch_wall_ms": round(batch_ms, 2),
                "samples": [text for _, _, text in results[:3]],
                "invalid_samples": [text for _, finish, text in results
                                    if finish == "stop" and not check(text)][:5],
            })
            print(f"  {name:22} {system:8} valid {valid}/{len(results)} "
                  f"p50 {rows[-1]['seq_p50_ms']} ms", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["case"], r["system"]): r for r in rows}
    out = []
    for name, _, _ in CASES:
        g, v = by[(name, "grammask")], by[(name, "vllm")]
        out.append([name,
                    f"{g['valid']}/{g['requests']} ({g['stopped']})",
                    f"{v['valid']}/{v['requests']} ({v['stopped']})",
                    fmt_ms(g["seq_p50_ms"]), fmt_ms(v["seq_p50_ms"]),
                    fmt_ms(g["batch_wall_ms"]), fmt_ms(v["batch_wall_ms"])])
    return render_table(["case", "valid (stopped) grammask", "valid (stopped) vLLM",
                         "p50 ms grammask", "p50 ms vLLM", "batch ms grammask",
                         "batch ms vLLM"], out)


def server_version(base_url: str) -> str:
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/version",
                                    timeout=5) as reply:
            return str(json.loads(reply.read()).get("version", "?"))
    except (OSError, ValueError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--url", help="an already running server's /v1 URL")
    ap.add_argument("--model", default="tiny", help="served model name (with --url)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--vllm-whitespace", action="store_true",
                    help="leave vLLM's own JSON whitespace on (the started server)")
    args = ap.parse_args(argv)

    from openai import OpenAI

    server: Any = None
    if args.url is None:
        # the e2e suite's server and model (loaded by name: tests/ is not type-checked)
        tiny_model: Any = importlib.import_module("tests.e2e.tiny_model")
        e2e_server: Any = importlib.import_module("tests.e2e.server")
        MODEL_NAME = e2e_server.MODEL_NAME

        log = Path(tempfile.gettempdir()) / "grammask-bench-server.log"
        compact = {"backend": "xgrammar", "disable_any_whitespace": True}
        server_args = [] if args.vllm_whitespace else [
            "--structured-outputs-config", json.dumps(compact)]
        server = e2e_server.Server(tiny_model.model_dir("qwen2.5"), log,
                                   args=server_args).start()
        print(f"tiny server up in {server.start_s:.0f} s (log {log})", flush=True)
        base_url, model = server.base_url, MODEL_NAME
    else:
        base_url, model = args.url, args.model
    try:
        client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=300)
        rows = run(client, model, args.reps, args.max_tokens)
        version = server_version(base_url)
    finally:
        if server is not None:
            server.stop()
    print()
    print(table(rows))
    if args.json:
        info = machine_info()
        info["server_vllm"] = version
        write_json(args.json, {"benchmark": "vllm_server", "machine": info,
                               "reps": args.reps, "max_tokens": args.max_tokens,
                               "vllm_whitespace": args.vllm_whitespace or args.url is not None,
                               "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
