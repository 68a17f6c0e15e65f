"""The V2 token watch's reads, this tree against another (today's main), in one run.

    python -m bench.v2_reads --baseline-src /path/to/main/src [--json out/v2-reads.json]

Each tree runs ``tests/v34_driver.py`` (vLLM 0.34's async order on its own classes: needs
``.vllm34/site``, as ``make unit34``) in a fresh interpreter, on the same scenarios and
seeds: a mix of constraints, and one schema for every request with slots reused (a
recycled slot held the same JSON at the same positions: the case a snapshot comparison
would mistake for "not landed"). It reports how each step's tokens were read: watched (as
they landed, the fill overlapping the next forward) or ordered (after the stream passed
them), the masks checked and the wrong ones. This tree also runs with ``token_marks``
off, where every read is ordered by design.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.paths import REPO_ROOT
from bench.stats import render_table, write_json

#: (name, one schema for every request, slots, live requests)
SCENARIOS = [("mixed", False, 8, 6), ("same-schema reuse", True, 8, 6),
             ("same-schema reuse", True, 64, 40)]
STEPS = 80

_PROBE = r'''
import json, random, sys
import pytest
from tests.vllm_fixtures import vllm_config, patch_v2_for_cpu
mp = pytest.MonkeyPatch(); patch_v2_for_cpu(mp)
from tests.v34_driver import Driver

class One(random.Random):
    def randrange(self, *a, **k):
        return 0 if a == (4,) else super().randrange(*a, **k)

marks = sys.argv[1] == "on"
out = []
for name, reuse, slots, live in json.loads(sys.argv[2]):
    extra = None if marks else {"grammask": {"token_marks": False}}
    d = Driver(vllm_config(max_num_seqs=slots, tiny=True, additional_config=extra),
               max_reqs=slots, seed=9, prompt_logprobs=True)
    if reuse:
        d.rng = One(9)
    for t in range(STEPS):
        running = sum(not r.finished for r in d.reqs.values())
        d.step(admit=max(0, live - running) if t % 2 == 0 else 0)
    d.sync()
    c = d.counts
    out.append(dict(d.batch.watch.reads, masks=c.masks, wrong=c.wrong, bad_reads=c.bad_reads,
                    reused=c.reused_same_step, finished=c.finished))
    d.close()
print("RESULT " + json.dumps(out))
'''.replace("STEPS", str(STEPS))


def run_tree(src: Path, marks: bool) -> list[dict[str, Any]]:
    """The scenarios on the grammask in ``src``, in a fresh interpreter."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(src), str(REPO_ROOT / ".vllm34" / "site"),
                                           str(REPO_ROOT)]))
    done = subprocess.run([sys.executable, "-c", _PROBE, "on" if marks else "off",
                           json.dumps(SCENARIOS)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{src}: no result\n{done.stderr[-3000:]}")
    result: list[dict[str, Any]] = json.loads(line[len("RESULT "):])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the other tree's src/ directory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = {"baseline": run_tree(Path(args.baseline_src), True),
            "this tree": run_tree(REPO_ROOT / "src", True),
            "this tree, token_marks off": run_tree(REPO_ROOT / "src", False)}
    headers = ["tree", "scenario", "slots", "watched", "ordered", "masks", "wrong",
               "bad reads", "reused", "finished"]
    rows = []
    for tree, results in runs.items():
        for (name, _, slots, _), r in zip(SCENARIOS, results, strict=True):
            rows.append([tree, name, slots, r["watched"], r["ordered"], r["masks"],
                         r["wrong"], r["bad_reads"], r["reused"], r["finished"]])
    print(render_table(headers, rows))
    if args.json:
        write_json(args.json, {"benchmark": "v2_reads", "steps": STEPS,
                               "scenarios": SCENARIOS, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
