"""A wave: hundreds of first requests of one free-text JSON schema admitted at once (a batch
job), grammask with the engine switch against grammask with it off, grammask forced to
xgrammar and vLLM's own way with xgrammar, interleaved in one run (issue 52).

    python -m bench.wave [--batch-sizes 256,512] [--forward wait3] [--steps 240]
                         [--repeats 5] [--verdict auto|rival] [--json OUT]

Each repeat starts from a cold compiler (the spec never seen): every row is a first request,
so the router serves the spec's routed engine (llguidance for free text: xgrammar's compile
of free text is slow) and the fill tuner compiles xgrammar in the background and compares
both along a running row's tokens (a probe walk where none came in time). With the switch
on, once its verdict lands (``--verdict auto``: this machine's measurement; ``rival``:
forced, to show the mechanism where this machine prefers llguidance) the running rows move
to xgrammar a bounded number a step. Off, they stay; forced
to xgrammar, the rows run on it from the start (its compile done before the timing).
vLLM's way (``vllm-xgrammar``): what vLLM's structured-output manager does with xgrammar on
one GPU (``bench.step``'s ``inproc`` model): every row a matcher of the compiled grammar (the
compile done before the timing, as vLLM holds the requests until it ends); a step accepts
each row's token, launches the forward, fills the rows still running (serially up to 128
rows, in 16-row chunks on a thread pool above) and waits for the forward.

Every row walks a long instance (a note of ``--words`` words, a few hundred tokens) one token
a step, as one request of the wave; the step is ``proc.step`` -> the forward's launch ->
``wait_masks`` -> the rest of the forward (``bench.step``'s grammask model). Reported per B:
each side's median step over the steps after the switch finished (or after the verdict when
no row switched), with its spread over repeats; the step at which the verdict landed and at
which the last row switched; the ratios to forced xgrammar and to vLLM's way, each the median
of the repeats' paired ratios (xgrammar's fill swings up to 2x between repeats on a small
box; the sides of one repeat run back to back).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fillscale import FREE_TEXT, WORDS
from bench.stats import machine_info, render_table, write_json
from bench.step import make_forward, vllm_fill, vllm_workers
from grammask import Compiler, GrammarSpec, Vocabulary, load_vocabulary
from grammask.decode.processor import BatchProcessor
from grammask.kernels.bitmask import allocate_bitmask

SIDES = ("switch", "off", "xgrammar", "vllm-xgrammar")


def long_walks(vocab: Vocabulary, count: int, words: int, seed: int = 5) -> list[list[int]]:
    """Instances of ``FREE_TEXT`` with a long note, as tokens (stop included)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = json.dumps({"name": " ".join(rng.choices(WORDS, k=3)), "n": rng.randint(0, 999),
                           "note": " ".join(rng.choices(WORDS, k=words))},
                          separators=(",", ":"))
        out.append([*vocab.encode(text), vocab.stop_ids[0]])
    return out


def run_side(side: str, vocab: Vocabulary, xgr: Compiler, walks: list[list[int]], batch: int,
             forward: str, steps: int, verdict: str) -> dict[str, Any]:
    """One wave on a cold compiler: the step times and when the switch happened."""
    spec = GrammarSpec.json_schema(FREE_TEXT, any_whitespace=False)
    compiler = Compiler(vocab, fill_verdict=verdict)  # type: ignore[arg-type]
    fwd = make_forward(forward)
    try:
        grammar = (xgr if side == "xgrammar" else compiler).compile(spec)
        proc = BatchProcessor(compiler, max_batch=batch, think_end=None,
                              engine_switch=side == "switch")
        rows = list(range(batch))
        for row in rows:
            proc.add(row, spec, grammar=grammar)
        pos = [0] * batch
        proc.step()
        proc.wait_masks()
        times: list[float] = []
        landed = switched = None
        for t in range(steps):
            going = [r for r in rows if pos[r] < len(walks[r % len(walks)])]
            if not going:
                break
            tokens = [walks[r % len(walks)][pos[r]] for r in going]
            for r in going:
                pos[r] += 1
            t0 = time.perf_counter()
            proc.step(going, tokens)
            fwd.launch()
            proc.wait_masks()
            fwd.finish()
            times.append((time.perf_counter() - t0) * 1000)
            if landed is None and compiler.fill_tuner.epoch:
                landed = t
            if side == "switch" and landed is not None and switched is None:
                backends = {proc.info(r).backend for r in going}  # outside the timing
                if backends == {"xgrammar"}:
                    switched = t
        proc.close()
    finally:
        compiler.close()
    return {"times": times, "landed": landed, "switched": switched}


def run_vllm(vocab: Vocabulary, xgr: Compiler, walks: list[list[int]], batch: int,
             forward: str, steps: int, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """vLLM's way with xgrammar on the same wave (the module's docstring): the step times."""
    import xgrammar

    spec = GrammarSpec.json_schema(FREE_TEXT, any_whitespace=False)
    compiled = xgr.compile(spec).backend_grammar._compiled  # type: ignore[attr-defined]
    stops = list(vocab.stop_ids)
    matchers = [xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops)
                for _ in range(batch)]
    bitmask = allocate_bitmask(batch, vocab.vocab_size)
    pos = [0] * batch
    fwd = make_forward(forward)

    def fill(rows: list[int]) -> None:
        vllm_fill(lambda r: matchers[r].fill_next_token_bitmask(bitmask, r), rows, pool)

    fill(list(range(batch)))  # the first masks (not timed)
    times: list[float] = []
    for _ in range(steps):
        going = [r for r in range(batch) if pos[r] < len(walks[r % len(walks)])]
        if not going:
            break
        t0 = time.perf_counter()
        for r in going:
            matchers[r].accept_token(walks[r % len(walks)][pos[r]])
            pos[r] += 1
        fwd.launch()
        fill([r for r in going if pos[r] < len(walks[r % len(walks)])])  # not finished
        fwd.finish()
        times.append((time.perf_counter() - t0) * 1000)
    return {"times": times, "landed": None, "switched": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="256,512")
    ap.add_argument("--forward", default="wait3")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--verdict", default="auto", choices=["auto", "rival"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    vocab = load_vocabulary("qwen2.5")
    xgr = Compiler(vocab, backend="xgrammar", timeout_s=120, tune_fill=False)
    walks = long_walks(vocab, 64, args.words)
    pool = ThreadPoolExecutor(vllm_workers())
    cells = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
        for _ in range(args.repeats):
            for side in SIDES:  # interleaved: background load hits every side alike
                runs[side].append(
                    run_vllm(vocab, xgr, walks, batch, args.forward, args.steps, pool)
                    if side == "vllm-xgrammar" else
                    run_side(side, vocab, xgr, walks, batch, args.forward, args.steps,
                             args.verdict))
        cells.append(summarize(batch, runs))
    pool.shutdown()
    xgr.close()
    headers = ["B", "verdict step", "switched by", "switch ms", "off ms", "xgrammar ms",
               "vllm-xgr ms", "switch/xgr", "off/xgr", "switch/vllm"]
    print(render_table(headers, [[c["B"], c["landed"], c["switched"], c["switch"]["median"],
                                  c["off"]["median"], c["xgrammar"]["median"],
                                  c["vllm-xgrammar"]["median"], c["ratio_switch"],
                                  c["ratio_off"], c["ratio_switch_vllm"]] for c in cells]))
    if args.json:
        write_json(args.json, {"benchmark": "wave", "args": vars(args),
                               "machine": machine_info(), "cells": cells})
    return 0


def summarize(batch: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side: the median over repeats of each repeat's median step after the wave
    switched (the same window for every side: from the latest switch of any repeat)."""
    ends = [r["switched"] if r["switched"] is not None else r["landed"]
            for r in runs["switch"]]
    start = max((e for e in ends if e is not None), default=0) + 1
    out: dict[str, Any] = {"B": batch, "window_from_step": start,
                           "landed": _med([r["landed"] for r in runs["switch"]]),
                           "switched": _med([r["switched"] for r in runs["switch"]])}
    per: dict[str, list[float]] = {}
    for side, reps in runs.items():
        per[side] = [statistics.median(r["times"][start:]) for r in reps if r["times"][start:]]
        got = per[side]
        out[side] = {"median": round(statistics.median(got), 3) if got else None,
                     "min": round(min(got), 3) if got else None,
                     "max": round(max(got), 3) if got else None, "repeats": got}
    for name, side, base in (("ratio_switch", "switch", "xgrammar"),
                             ("ratio_off", "off", "xgrammar"),
                             ("ratio_switch_vllm", "switch", "vllm-xgrammar"),
                             ("ratio_off_vllm", "off", "vllm-xgrammar")):
        # paired: each repeat's side over the same repeat's base (they ran back to back,
        # so a swing of the machine between repeats hits both), then the median
        pairs = [a / b for a, b in zip(per[side], per[base], strict=False) if b]
        out[name] = round(statistics.median(pairs), 3) if pairs else None
    return out


def _med(values: list[Any]) -> Any:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


if __name__ == "__main__":
    raise SystemExit(main())
