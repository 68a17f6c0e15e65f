"""The entry point never stops a vLLM server from starting: on a vLLM grammask does not
support, or where vLLM never calls custom logits processors (0.34's standalone CPU runner),
vLLM's own loader gets a class it accepts, which stands aside and says why.

Each case runs in a fresh interpreter (the plugin decides once, at import), with the
installed vLLM (0.33 under ``make unit``, 0.34 under ``make unit34``) and one thing changed:
a faked future ``vllm.__version__``, or an interface module made unimportable. The loader is
vLLM's own (``_load_v2_logitsprocs_plugins``; V1's ``_load_logitsprocs_plugins`` where that
runner exists).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = textwrap.dedent('''
    import json, os, sys
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    {change}
    from grammask.integrations.vllm import plugin as p
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_plugins)
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    loaded = _load_v2_logitsprocs_plugins()
    ours = [c for c in loaded if c.__module__ == p.__name__]
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    p.GrammaskLogitsProcessor.validate_params(sp)  # vLLM's engine keeps it
    own = SamplingParams(extra_args={{"grammask": '{{"regex": "a+"}}'}})
    try:
        p.GrammaskLogitsProcessor.validate_params(own)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    aside = p.GrammaskLogitsProcessor is p.StandAside
    inst = p.GrammaskLogitsProcessor(None, None) if aside else None
    print("RESULT " + json.dumps({{
        "stand_aside": aside, "reason": p.STAND_ASIDE_REASON, "ours": len(ours),
        "kept": sp.structured_outputs is not None, "refused": refused,
        "added": inst.add_request(0, own) if inst else None,
        "apply": inst.apply(7, None) if inst else None}}))
''')


def _probe(change: str) -> tuple[dict[str, object], str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-c", PROBE.format(change=change)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT "):]), done.stderr


def test_the_installed_vllm_is_served() -> None:
    result, _ = _probe("")
    assert result["stand_aside"] is False and result["reason"] == ""
    assert result["ours"] == 1


@pytest.mark.parametrize("change", [
    'vllm.__version__ = "0.99.0"',
    # a future vLLM that moved the V1 interface away (0.34 already has) and ours with it
    'sys.modules["vllm.v1.sample.logits_processor"] = None\n'
    'vllm.__version__ = "1.0.0"',
])
def test_a_future_vllm_gets_a_class_that_stands_aside(change: str) -> None:
    result, stderr = _probe(change)
    assert result["stand_aside"] is True and result["ours"] == 1  # the loader accepted it
    assert "is not a line grammask supports" in str(result["reason"])
    assert result["kept"] is True  # vLLM's own structured outputs stay with vLLM's engine
    assert "stands aside" in str(result["refused"])  # grammask's own keys: a clear 400
    assert result["added"] is False and result["apply"] == 7
    assert stderr.count("grammask stands aside on vLLM") == 1  # one start-up line


def test_a_broken_import_of_grammask_stands_aside_too() -> None:
    """A supported vLLM, but grammask's serving module fails to import: still no crash."""
    result, stderr = _probe('sys.modules["grammask.integrations.vllm.served"] = None')
    assert result["stand_aside"] is True and result["ours"] == 1
    assert "loading grammask's plugin failed" in str(result["reason"])
    assert "grammask stands aside" in stderr


def test_a_runner_that_never_calls_processors_stands_aside() -> None:
    """vLLM 0.34 on a CPU without Triton that is not x86 runs its standalone CPU runner,
    whose sampler builds no custom processors (``platforms/cpu.py``:
    ``uses_standalone_cpu_model_runner``; ``v1/worker/cpu/sampler.py``): grammask would be
    loaded and the drop-in would move requests to it, served unconstrained. This x86 machine
    patches the platform's answer; the API server's validation and the engine's class both
    stand aside."""
    if not importlib.metadata.version("vllm").startswith("0.34."):
        pytest.skip("only vLLM 0.34 has the standalone CPU runner (make unit34)")
    result, stderr = _probe(
        "from vllm.platforms import current_platform\n"
        "type(current_platform).uses_standalone_cpu_model_runner = "
        "classmethod(lambda cls: True)")
    assert result["stand_aside"] is True and result["ours"] == 1
    assert "standalone CPU model runner" in str(result["reason"])
    assert result["kept"] is True  # the drop-in leaves vLLM's structured outputs to vLLM
    assert "stands aside" in str(result["refused"])
    assert "standalone CPU model runner" in str(result["refused"])  # the 400 says why
    assert result["added"] is False and result["apply"] == 7
    assert stderr.count("grammask stands aside on vLLM") == 1
