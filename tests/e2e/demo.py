"""``make demo``: a real vLLM server (CPU, tiny random Qwen2.5-layout model) with grammask as
its plugin; a JSON schema, a regex and a choice sent with the openai client as the README
shows; each output printed with an independent check (jsonschema, ``regex``); server stopped.

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


CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("json schema", {"json": SCHEMA, "disable_any_whitespace": True}, _json_ok),
    ("regex", {"regex": REGEX}, lambda t: regex.fullmatch(REGEX, t) is not None),
    ("choice", {"choice": CHOICES}, lambda t: t in CHOICES),
]


def main() -> int:
    python = vllm_python()
    if not python.exists():
        print(f"no vLLM venv at {python}: run `make vllm-venv`", file=sys.stderr)
        return 2
    model = tiny_model.model_dir("qwen2.5")
    log = Path(tempfile.gettempdir()) / "grammask-demo-server.log"
    print(f"starting vLLM (CPU) on the tiny random model {model} (log {log}) ...", flush=True)
    server = Server(model, log, python=python).start()
    ok = True
    try:
        print(f"server up in {server.start_s:.0f} s at {server.base_url}\n")
        client = server.client()
        for name, spec, check in CASES:
            for seed in (1, 2):
                reply = client.chat.completions.create(
                    model=MODEL_NAME, max_tokens=96, temperature=1.0, seed=seed,
                    messages=[{"role": "user", "content": f"Give me a {name}."}],
                    extra_body={"vllm_xargs": {"grammask": json.dumps(spec),
                                               "grammask_backend": "auto"}})
                text = reply.choices[0].message.content or ""
                valid = bool(check(text))
                ok &= valid
                print(f"{name:12} seed {seed}: {text!r:60} "
                      f"{'valid' if valid else 'INVALID'} ({reply.choices[0].finish_reason})")
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
