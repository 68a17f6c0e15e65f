"""Offline ``LLM.generate`` with vLLM's own ``SamplingParams(structured_outputs=...)``:
grammask serves it (its counter in the engine's process) and every text validates."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import jsonschema

from tests.e2e.conftest import LOG_DIR
from tests.e2e.oracles import check_regex
from tests.e2e.server import ROOT

SCRIPT = Path(__file__).with_name("offline_generate.py")


def test_offline_generate_with_structured_outputs(vllm_env: Path, qwen25_dir: Path) -> None:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": str(ROOT),
           "GRAMMASK_DISK_CACHE": "off"}
    env = {k: v for k, v in env.items() if not k.startswith("GRAMMASK_") or
           k == "GRAMMASK_DISK_CACHE"}
    proc = subprocess.run([str(vllm_env), str(SCRIPT), str(qwen25_dir)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / "offline-generate.log").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for text, finish in result["json"]:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
    for text, finish in result["regex"]:
        check_regex(r"(ab|cd)[0-9]{1,3}", text, finish)
    for text, finish in result["choice"]:
        assert finish == "stop" and text in ("yes", "no"), (finish, text)
    counts = {k: v for k, v in result["metrics"].items() if "structured_outputs" in k}
    assert sum(counts.values()) == 9, result["metrics"]
