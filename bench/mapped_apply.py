"""The V2 runner's apply on the host's critical path: masks in the host's row order.

Side by side in one run, on the same bitmasks and logits (vocab 151,936, fp32, CPU): the
apply at identity rows (the V1 runner's, with the fill thread's plan), the V2 apply as it was
(mask rows picked into a buffer in the logits' order with ``index_select``/``index_copy``,
then the unplanned kernels), and ``apply.apply_pairs`` (the plan moved to the logits' rows).
Rows are half closed JSON (a few allowed tokens: wiped) and half free text (most allowed).
Medians of repeats; prints a table, saves JSON (``--json``).

    python -m bench.mapped_apply [--batch 16,64,256] [--repeats 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from bench.stats import machine_info, percentile, render_table, write_json
from grammask.apply import apply_bitmask, apply_pairs, cpu_layout, plan_cpu_apply

VOCAB = 151_936
WORDS = (VOCAB + 31) // 32


def _bitmask(rows: int, rng: np.random.Generator) -> torch.Tensor:
    words = np.full((rows, WORDS), -1, dtype=np.int32)
    closed = np.arange(rows) % 2 == 0
    words[closed] = 0
    for r in np.flatnonzero(closed):  # ~10 allowed tokens
        for t in rng.choice(VOCAB, 10, replace=False):
            words[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    for r in np.flatnonzero(~closed):  # free text: refuse a few hundred tokens
        for t in rng.choice(VOCAB, 300, replace=False):
            words[r, t // 32] &= ~np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return torch.from_numpy(words)


def _before(logits: torch.Tensor, bitmask: torch.Tensor, at: list[int], rows: list[int],
            buffer: torch.Tensor) -> None:
    """The V2 apply before ``apply_pairs`` (hostlogits.apply_mapped as it was)."""
    pairs = [(int(a), int(r)) for a, r in zip(at, rows, strict=True)]
    picked = bitmask.index_select(0, torch.tensor([r for _, r in pairs]))
    buffer.index_copy_(0, torch.tensor([a for a, _ in pairs]), picked)
    apply_bitmask(logits, buffer, vocab_size=VOCAB, indices=sorted(a for a, _ in pairs))


def run(batches: list[int], repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(3)
    out = []
    for b in batches:
        slots = 2 * b  # slots are spread over a larger table than the batch
        bitmask = _bitmask(slots, rng)
        rows = np.sort(rng.choice(slots, b, replace=False)).astype(np.intp)
        at = rng.permutation(b).astype(np.intp)
        base = torch.randn(b, VOCAB)
        layout = cpu_layout(base)
        assert layout is not None
        plan = plan_cpu_apply(bitmask, rows.tolist(), vocab_size=VOCAB, width=VOCAB,
                              stride=VOCAB)
        ident_mask = bitmask[torch.from_numpy(rows)].contiguous()
        ident_plan = plan_cpu_apply(ident_mask, list(range(b)), vocab_size=VOCAB,
                                    width=VOCAB, stride=VOCAB)
        buffer = torch.full((b, WORDS), -1, dtype=torch.int32)
        times: dict[str, list[float]] = {"v1 identity (plan)": [], "v2 before": [],
                                         "v2 apply_pairs (plan)": []}
        for _ in range(repeats):
            for name in times:
                logits = base.clone()
                started = time.perf_counter()
                if name.startswith("v1"):
                    apply_bitmask(logits, ident_mask, vocab_size=VOCAB,
                                  indices=list(range(b)), plan=ident_plan, layout=layout)
                elif name == "v2 before":
                    _before(logits, bitmask, at.tolist(), rows.tolist(), buffer)
                else:
                    apply_pairs(logits, bitmask, at, rows, vocab_size=VOCAB, plan=plan,
                                layout=layout)
                times[name].append((time.perf_counter() - started) * 1000)
        row = {"batch": b, **{k: round(percentile(v, 50), 3) for k, v in times.items()}}
        row["after/before"] = round(row["v2 apply_pairs (plan)"] / row["v2 before"], 2)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run([int(x) for x in args.batch.split(",")], args.repeats)
    keys = list(rows[0])
    print(render_table(keys, [[row[k] for k in keys] for row in rows]))
    if args.json:
        write_json(args.json, {"benchmark": "mapped_apply", "unit": "ms (median)",
                               "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
