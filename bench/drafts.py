"""Speculative decoding: mask cost per decode step against the number of draft tokens.

    python -m bench.mask --drafts 0,1,2,4 [--batch-sizes 1,16,64,256] [--steps N] [--json OUT]

For each backend (schemas forced onto xgrammar, then onto llguidance) and each batch size B,
B rows walk valid corpus instances through ``BatchProcessor``. Per step: the committed fill
(``step`` + ``wait_masks``), then ``fill_drafts`` with the next ``d`` tokens of each row's
instance as drafts (all valid: the worst case, every position is filled), then every row
commits ``d + 1`` tokens. Reported: ms per step, p50 / p99, and the ratio to ``d = 0`` in the
same run (the drafts' marginal cost), plus microseconds per filled row.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.cases import Case
from bench.stats import dist, fmt_ms, render_table


def measure(cases: list[Case], *, batch_sizes: list[int], drafts: list[int], steps: int,
            tokenizer: str) -> dict[str, Any]:
    import torch

    from grammask import Compiler, GrammarSpec, load_vocabulary
    from grammask.processor import BatchProcessor

    vocab = load_vocabulary(tokenizer)
    compiler = Compiler(vocab, timeout_s=30)
    out: dict[str, Any] = {}
    for backend in ("xgrammar", "guidance"):
        walks: list[tuple[Any, list[int]]] = []
        for case in cases:
            spec = GrammarSpec.json_schema(case.source, any_whitespace=False, backend=backend)
            try:
                grammar = compiler.compile(spec)
            except Exception:  # a refused schema is simply not measured
                continue
            for text in case.instances:  # compact, as any_whitespace=False generates
                ids = vocab.encode(json.dumps(json.loads(text), separators=(",", ":"),
                                              ensure_ascii=False))
                m = grammar.matcher()
                if len(ids) > 8 and all(m.accept(t) for t in ids):
                    walks.append((grammar, ids))
        per_size: dict[str, Any] = {}
        if not walks:
            out[backend] = {"walks": 0, "batches": {}}
            continue
        for size in batch_sizes:
            per_d: dict[str, Any] = {}
            for d in drafts:
                times = _run(BatchProcessor, compiler, walks, size, d, steps, torch)
                per_d[str(d)] = {**dist(times), "rows_per_step": size * (d + 1),
                                 "us_per_row": round(sorted(times)[len(times) // 2] * 1e3
                                                     / (size * (d + 1)), 2)}
            base = per_d[str(drafts[0])]["p50_ms"]
            for stats in per_d.values():
                stats["ratio_to_first"] = round(stats["p50_ms"] / base, 2) if base else None
            per_size[str(size)] = per_d
        out[backend] = {"walks": len(walks), "batches": per_size}
    compiler.close()
    return out


def _run(processor_cls: Any, compiler: Any, walks: list[tuple[Any, list[int]]], size: int,
         d: int, steps: int, torch: Any) -> list[float]:
    """ms per step for ``size`` rows with ``d`` drafts each."""
    rows = [walks[i % len(walks)] for i in range(size)]
    times: list[float] = []
    with processor_cls(compiler, max_batch=size, think_end=None) as proc:
        outs: list[list[int]] = []
        pos = [0] * size
        for i, (grammar, _) in enumerate(rows):
            outs.append([])
            proc.add(i, grammar.spec, output_ids=outs[i], grammar=grammar)
        out = torch.full((size * (d + 1), (compiler.vocab.vocab_size + 31) // 32), -1,
                         dtype=torch.int32)
        for _ in range(steps):
            t0 = time.perf_counter()
            proc.step()
            bitmask, _ = proc.wait_masks()
            for i in range(size):
                base = i * (d + 1)
                out[base].copy_(bitmask[i])
                ids = rows[i][1]
                draft = ids[pos[i] + 0:pos[i] + d] if pos[i] + d < len(ids) else []
                if draft:
                    proc.fill_drafts(i, draft, out, list(range(base, base + len(draft) + 1)))
            times.append((time.perf_counter() - t0) * 1e3)
            for i in range(size):  # commit the drafts and a bonus token, or start over
                ids = rows[i][1]
                take = ids[pos[i]:pos[i] + d + 1]
                if pos[i] + d + 1 >= len(ids):
                    proc.add(i, rows[i][0].spec, output_ids=outs[i], grammar=rows[i][0])
                    outs[i].clear()
                    pos[i] = 0
                else:
                    outs[i].extend(take)
                    pos[i] += len(take)
    return times


def tables(result: dict[str, Any]) -> str:
    rows = []
    for backend, data in result.items():
        for size, per_d in data["batches"].items():
            for d, s in per_d.items():
                rows.append([backend, size, d, f"{fmt_ms(s['p50_ms'])} / {fmt_ms(s['p99_ms'])}",
                             s["ratio_to_first"], s["us_per_row"]])
    return ("Mask cost per decode step with d draft tokens per row (ms p50 / p99; ratio to "
            "the first d; us per filled row)\n"
            + render_table(["backend", "B", "drafts", "ms/step", "ratio", "us/row"], rows))
