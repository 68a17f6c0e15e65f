"""Batch-fill scaling: free-text JSON rows advancing one token a step, filled serially and
on 1, 2, 4, 8 threads, per backend (issue 32, item 2).

    python -m bench.fillscale [--rows 64] [--steps 60] [--threads 1,2] [--json OUT]

Methods, taking turns within each step (background load hits them alike), each over its own
rows of one grammar: ``loop`` (``Matcher.fill`` row by row), ``tN`` (``Filler`` batch fill on
N threads: llguidance's lanes, xgrammar's ``BatchGrammarMatcher``), and for llguidance
``shared-tN`` (the former batch fill: one ``LLExecutor(N)`` over copies of one template).
Reported: p50 wall ms per fill and the speed-up of t2 over t1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance as llg
import torch

from bench.stats import machine_info, write_json
from grammask import Compiler, GrammarSpec, Vocabulary, load_vocabulary
from grammask.backends import Matcher
from grammask.backends.guidance import tokenizer as llg_tokenizer
from grammask.bitmask import allocate_bitmask
from grammask.masks import Filler

#: objects with free-text strings: what extraction and tool arguments look like
FREE_TEXT = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"},
    "note": {"type": "string"}}, "required": ["name", "n"]}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "structured", "output", "engines", "fill", "masks", "on", "every", "core", "of",
         "the", "host", "for", "each", "request", "of", "the", "batch"]


def instances(count: int, seed: int = 1) -> list[str]:
    """Valid compact instances of ``FREE_TEXT`` with varied free text."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return [json.dumps({"name": text(3), "city": text(1), "tags": [text(1) for _ in range(3)],
                        "n": rng.randint(0, 10**6), "note": text(6)}, separators=(",", ":"))
            for _ in range(count)]


class Rows:
    """``n`` rows of one grammar at spread positions of their instances; ``advance`` gives
    each its next token (a row at its end starts again: a new request)."""

    def __init__(self, make: Callable[[], Matcher], walks: list[list[int]], n: int) -> None:
        self.walks = [walks[i % len(walks)] for i in range(n)]
        self.pos = [(i * 7) % len(self.walks[i]) for i in range(n)]
        self.matchers = [make() for _ in range(n)]
        for m, w, p in zip(self.matchers, self.walks, self.pos, strict=True):
            assert all(m.accept(t) for t in w[:p])

    def advance(self) -> None:
        for i, m in enumerate(self.matchers):
            if self.pos[i] >= len(self.walks[i]):
                m.reset()
                self.pos[i] = 0
            assert m.accept(self.walks[i][self.pos[i]])
            self.pos[i] += 1

    def entries(self) -> list[tuple[Matcher, int]]:
        return [(m, i) for i, m in enumerate(self.matchers)]


def measure(vocab: Vocabulary, backend: str, rows: int, steps: int, threads: Sequence[int]
            ) -> dict[str, float]:
    spec = GrammarSpec.json_schema(FREE_TEXT, any_whitespace=False, backend=backend)
    walks = [vocab.encode(t) for t in instances(8)]
    bitmask = allocate_bitmask(rows, vocab.vocab_size)
    fills: dict[str, Callable[[list[tuple[Matcher, int]]], None]] = {}

    def loop(entries: list[tuple[Matcher, int]]) -> None:
        for m, r in entries:
            m.fill(bitmask, r)

    fills["loop"] = loop
    for n in threads:
        filler = Filler(parallel_min=1, threads=n)

        def batch(e: list[tuple[Matcher, int]], f: Filler = filler) -> None:
            f.fill(e, bitmask)

        fills[f"t{n}"] = batch
        if backend == "guidance":
            ex = llg.LLExecutor(n)

            def shared(e: list[tuple[Matcher, int]], ex: Any = ex) -> None:
                ex.unsafe_compute_mask_ptr([(m.native, r) for m, r in e],  # type: ignore[attr-defined]
                                           bitmask.data_ptr(), bitmask.shape[1] * 4, rows)

            fills[f"shared-t{n}"] = shared
    # one compile per method: a grammar's matchers share lazily built states (llguidance's
    # lexer), which one method would otherwise build for the next
    compilers = {name: Compiler(vocab, timeout_s=60, tune_fill=False) for name in fills}
    sets = {name: Rows(compilers[name].compile(spec).matcher, walks, rows) for name in fills}
    times: dict[str, list[float]] = {name: [] for name in fills}
    for _ in range(steps):
        for name, fill in fills.items():
            sets[name].advance()
            entries = sets[name].entries()
            t0 = time.perf_counter()
            fill(entries)
            times[name].append((time.perf_counter() - t0) * 1000)
    for c in compilers.values():
        c.close()
    skip = min(10, steps // 3)  # lanes made, rows moved, lexers warmed
    return {name: statistics.median(t[skip:]) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fillscale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--backends", default="guidance,xgrammar")
    ap.add_argument("--tokenizer", default="qwen2.5",
                    help="qwen2.5 (embedded: llguidance calls back into Python to tokenize) "
                         "or a Hugging Face tokenizer directory (llguidance tokenizes "
                         "natively, as under vLLM)")
    ap.add_argument("--json")
    args = ap.parse_args(list(argv) if argv is not None else None)
    torch.set_num_threads(1)
    vocab = load_vocabulary(args.tokenizer)
    llg_tokenizer(vocab)  # built before any timing
    threads = [int(x) for x in args.threads.split(",")]
    out: dict[str, Any] = {"machine": machine_info(), "rows": args.rows, "results": {}}
    for backend in args.backends.split(","):
        res = measure(vocab, backend, args.rows, args.steps, threads)
        out["results"][backend] = res
        cells = "  ".join(f"{k} {v:.3f}" for k, v in res.items())
        line = f"{backend}: ms per fill of {args.rows} rows: {cells}"
        if "t1" in res and "t2" in res:
            line += (f"  | t1/t2 {res['t1'] / res['t2']:.2f}x, "
                     f"loop/t2 {res['loop'] / res['t2']:.2f}x")
        print(line, flush=True)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
