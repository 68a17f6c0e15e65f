"""``make demo``: a real vLLM server (CPU, tiny random Qwen2.5-layout model) with grammask as
its plugin; standard requests only, as any OpenAI client sends them (``response_format``,
vLLM's ``structured_outputs`` regex and choice, a strict tool call), each output printed with
an independent check (jsonschema, ``regex``) and grammask's count of the requests it served
(read off vLLM's ``/metrics``); server stopped.

    GRAMMASK_VLLM_PYTHON=.venv-vllm/bin/python python -m tests.e2e.demo
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import regex

from tests.e2e import tiny_model
from tests.e2e.server import MODEL_NAME, Server, vllm_python
from tests.e2e.standard import served

SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Tokyo", "Osaka", "Kyoto"]},
                         "population": {"type": "integer", "minimum": 0,
                                        "maximum": 40_000_000}},
          "required": ["city", "population"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-[0-9]{3,5}"
CHOICES = ["positive", "negative", "neutral"]


def _json_ok(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _tool_ok(message: Any) -> bool:
    calls = message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != "city_facts":
        return False
    try:
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


TOOL = {"type": "function", "function": {"name": "city_facts", "strict": True,
                                         "parameters": SCHEMA}}
#: (name, request fields, check of the message): standard fields only, no grammask key
CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": SCHEMA, "strict": True}}},
     lambda m: _json_ok(m.content or "")),
    ("regex", {"extra_body": {"structured_outputs": {"regex": REGEX}}},
     lambda m: regex.fullmatch(REGEX, m.content or "") is not None),
    ("choice", {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
     lambda m: m.content in CHOICES),
    ("tool call", {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
     _tool_ok),
]


def main() -> int:
    python = vllm_python()
    if not python.exists():
        print(f"no vLLM venv at {python}: run `make vllm-venv`", file=sys.stderr)
        return 2
    model = tiny_model.model_dir("qwen2.5")
    log = Path(tempfile.gettempdir()) / "grammask-demo-server.log"
    print(f"starting vLLM (CPU) on the tiny random model {model} (log {log}) ...", flush=True)
    metrics = tempfile.mkdtemp(prefix="grammask-demo-prom-")
    server = Server(model, log, python=python, env={"PROMETHEUS_MULTIPROC_DIR": metrics},
                    args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).start()
    ok = True
    try:
        print(f"server up in {server.start_s:.0f} s at {server.base_url}\n")
        client = server.client()
        for name, fields, check in CASES:
            for seed in (1, 2):
                reply = client.chat.completions.create(
                    model=MODEL_NAME, max_tokens=96, temperature=1.0, seed=seed,
                    messages=[{"role": "user", "content": "Largest city of Japan?"}],
                    **fields)
                message = reply.choices[0].message
                shown = message.content or (message.tool_calls[0].function.arguments
                                            if message.tool_calls else "")
                valid = bool(check(message))
                ok &= valid
                print(f"{name:15} seed {seed}: {shown!r:60} "
                      f"{'valid' if valid else 'INVALID'} ({reply.choices[0].finish_reason})")
        counts = served(server)
        print(f"\nserved by grammask (grammask_requests_total on /metrics): "
              f"{ {kind: int(n) for (src, kind), n in counts.items() if src != 'grammask'} }")
        free = client.chat.completions.create(
            model=MODEL_NAME, max_tokens=16, temperature=1.0, seed=1,
            messages=[{"role": "user", "content": "Say anything."}])
        print(f"{'unconstrained':12} seed 1: {free.choices[0].message.content!r} "
              "(random weights: noise)")
    finally:
        server.stop()
    print("\nserver stopped")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
