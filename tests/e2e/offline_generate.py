"""Run by the vLLM venv's python (``test_offline.py``): offline ``LLM.generate`` with vLLM's
own ``SamplingParams(structured_outputs=...)`` on the tiny model, the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so grammask's counter can be read here. Prints one
JSON object: the texts per case and grammask's ``grammask_requests_total`` samples.

    python tests/e2e/offline_generate.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
REGEX = r"(ab|cd)[0-9]{1,3}"


def main(model: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from grammask import metrics

    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              max_num_seqs=8)
    cases = {"json": StructuredOutputsParams(json=SCHEMA),
             "regex": StructuredOutputsParams(regex=REGEX),
             "choice": StructuredOutputsParams(choice=["yes", "no"])}
    out: dict[str, object] = {}
    for name, so in cases.items():
        # one params object for three prompts: vLLM validates each (the drop-in is idempotent)
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=1, structured_outputs=so)
        results = llm.generate(["Answer:", "Another answer:", "One more:"], params)
        out[name] = [[r.outputs[0].text, r.outputs[0].finish_reason] for r in results]
    out["metrics"] = {k: v for k, v in metrics.snapshot().items()
                      if k.startswith("grammask_requests_total")}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
