"""The decode step with masks: grammask's ``BatchProcessor`` against vLLM's way, side by side
in one run (issue 32, item 5).

    python -m bench.step [--batch-sizes 1,16,64,256,512] [--forwards wait3,wait10,busy3,py3]
                         [--workloads free,closed,corpus,regex,choice] [--steps 12]
                         [--repeats 3] [--json OUT]

One step, as each host runs it (the masks' apply is left out on both sides: on a GPU it is a
kernel either way, measured by ``bench/gpu.py``):

- grammask: ``proc.step(rows, tokens)`` (the sampled tokens handed over; advance and fill
  start on the fill thread) -> the forward's launch -> ``proc.wait_masks()`` -> the rest of
  the forward (vLLM's sampler runs the logits processors on logits the device is still
  computing, so the host waits for the masks while the device works).
- vLLM's way, with xgrammar and with llguidance (``vllm/v1/structured_output``): the engine
  core accepts each row's token and fills its row, serially up to 128 rows, above that in
  chunks of 16 rows on ``min(cores // 2, 8)`` threads; llguidance matchers are made from
  the grammar per request, as vLLM does. A new request's matcher is made outside the
  timed step: vLLM makes it when the request arrives (``StructuredOutputManager.grammar_init``,
  on its compile thread pool), not in the step. grammask's ``proc.add`` of a new request is
  timed: vLLM's runners hand new requests to a logits processor on the model runner's
  thread before the forward (``update_state``, ``add_request``). Three models, all
  measured in every cell:
  - the issue's model (``vllm-*``, ``ratio``): the fill runs in the engine core, another
    process than the model runner's, while the GPU works: the step is
    ``max(accept + fill, forward)``. This is vLLM with a multi-process executor (tensor
    parallel > 1, or ``--distributed-executor-backend mp``), with the bitmask's way to the
    worker left out;
  - the same with that way (``vllm-rpc-*``, ``ratio_rpc``): the engine core sends the
    bitmask with the ``sample_tokens`` RPC through its shared-memory ``MessageQueue``
    (pickled, copied into the ring), and the worker copies it out and unpickles it once its
    thread is free of the launch (``bench/vllm_rpc.py``; vLLM's own queue costs more);
  - one GPU (``vllm-inproc-*``, ``ratio_inproc``): vLLM's default executor at tensor
    parallel 1 is ``uni`` (``ParallelConfig``), which runs the model runner inside the
    engine core's process and thread. ``EngineCore.step`` launches the forward
    (``execute_model``), then fills (``get_grammar_bitmask``), then waits for the output
    (``sample_tokens``): the step is accept + launch + fill + what is left of the forward.
    With an eager forward the launch is all host work, so the fill comes after it.

Forwards: ``waitN`` a GIL-free wait of N ms (a CUDA-graph replay: the host only waits);
``busyN`` N ms of Python issuing tiny torch ops (an eager launch loop: the model runner's
thread holds the GIL most of the time, which grammask's fill thread shares; each op lets it
go for a moment); ``pyN`` N ms of pure Python that never lets the GIL go (vLLM 0.34's engine
core under async scheduling: ``update_from_output`` and ``schedule`` on the runner's thread
while the device runs the forward). grammask's fill thread needs the GIL to start and after
each native call that released it; vLLM's ``inproc`` side runs that Python, then its accept
and fill on the same thread.

``--repeats`` runs of each cell; besides the medians, each cell reports grammask's ratio to
``inproc`` per repeat (``ratio_inproc_runs``: grammask's median over the better engine's
median of the same repeat), shown as the median and its spread (min-max).

Workloads: ``free`` (objects with free-text strings), ``closed`` (enums, integers,
booleans), ``corpus`` (a mix of ``../shared/corpus`` maskbench schemas walking valid
instances), ``regex``, ``choice``. Every row walks its text one token a step; a row that
samples its stop token has finished (neither side fills it, as a runner's next batch has no
row for it) and starts a new request with the next step. Reported per (workload, B,
forward): median step ms of each side over ``--repeats`` runs of ``--steps`` steps, and
grammask's ratio to the better of vLLM's ways in each model (<= 1.0: never slower).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance as llg
import llguidance.torch as llg_torch
import torch

from bench.cases import load_maskbench
from bench.fillscale import FREE_TEXT, instances
from bench.paths import DEFAULT_CORPUS
from bench.stats import machine_info, render_table, write_json
from bench.vllm_rpc import GrammarOutput, Trip
from grammask import Compiler, Grammar, GrammarError, GrammarSpec, Vocabulary, load_vocabulary
from grammask.backends.guidance import tokenizer as llg_tokenizer
from grammask.decode.processor import BatchProcessor
from grammask.kernels.bitmask import allocate_bitmask

VLLM_CHUNK = 16
ENGINES = {"xgrammar": "xgrammar", "llguidance": "guidance"}
#: vLLM's models (``vllm_steps``' keys) and the series name prefix each is reported under
MODELS = {"engine": "vllm", "rpc": "vllm-rpc", "inproc": "vllm-inproc"}
#: the ratio each model gives grammask, as named in the JSON
RATIOS = {"engine": "ratio_to_better_vllm", "rpc": "ratio_to_better_vllm_rpc",
          "inproc": "ratio_to_better_vllm_inproc"}
VLLM_SERIAL_MAX = 128

CLOSED = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "bird", "fish"]}, "age": {"type": "integer"},
    "ok": {"type": "boolean"}, "scores": {"type": "array", "items": {"type": "integer"}}},
    "required": ["kind", "age", "ok", "scores"]}
REGEX = r"[A-Z][a-z]+( [a-z]+){3,30}\."
CHOICES = ["positive", "negative", "neutral", "mixed feelings about it"]


@dataclass
class Walk:
    """One spec, the grammar grammask serves for it, and a text's tokens (stop included)."""

    spec: GrammarSpec
    grammar: Grammar
    tokens: list[int]
    xgr: Any  # xgrammar's compiled grammar (vLLM's way)
    llg_grammar: str  # llguidance's grammar text (vLLM makes a matcher from it per request)


def vllm_workers() -> int:
    return max(1, min((os.cpu_count() or 1) // 2, 8))


def served(compiler: Compiler, spec: GrammarSpec) -> Grammar:
    """What grammask serves for ``spec`` once warm: compiled, and the fill-cost comparison
    (``Compiler(tune_fill)``) settled."""
    before = compiler.stats.fill_tuned
    cold = compiler.cached(spec) is None
    grammar = compiler.compile(spec)
    if cold and compiler.tune_fill and grammar.reason.startswith("both backends"):
        deadline = time.monotonic() + 30
        while compiler.stats.fill_tuned == before and time.monotonic() < deadline:
            time.sleep(0.002)
        grammar = compiler.compile(spec)
    return grammar


def make_walks(name: str, compiler: Compiler, raw: dict[str, Compiler], vocab: Vocabulary,
               corpus: Path, sample: int) -> list[Walk]:
    """The workload's walks: texts every side accepts to the end."""
    texts: list[tuple[GrammarSpec, str]]
    if name == "free":
        spec = GrammarSpec.json_schema(FREE_TEXT, any_whitespace=False)
        texts = [(spec, t) for t in instances(16)]
    elif name == "closed":
        spec = GrammarSpec.json_schema(CLOSED, any_whitespace=False)
        rng = random.Random(3)
        texts = [(spec, json.dumps({"kind": rng.choice(["cat", "dog", "bird", "fish"]),
                                    "age": rng.randint(0, 99), "ok": rng.random() < 0.5,
                                    "scores": [rng.randint(-999, 9999) for _ in range(4)]},
                                   separators=(",", ":"))) for _ in range(16)]
    elif name == "regex":
        spec = GrammarSpec.regex(REGEX)
        words = ["alpha", "beta", "gamma", "delta", "masks", "fill", "every", "core"]
        rng = random.Random(4)
        texts = [(spec, "The " + " ".join(rng.choice(words) for _ in range(12)) + ".")
                 for _ in range(8)]
    elif name == "choice":
        spec = GrammarSpec.choice(CHOICES)
        texts = [(spec, c) for c in CHOICES]
    else:
        texts = []
        for case in load_maskbench(corpus, sample, 1, need_instances=True):
            s = GrammarSpec.json_schema(case.source)
            texts.append((s, case.instances[0]))
    walks = []
    for spec, text in texts:
        try:
            grammar = served(compiler, spec)
            xgr = raw["xgrammar"].compile(spec.with_backend("xgrammar")).backend_grammar
            llg_text = raw["guidance"].compile(spec.with_backend("guidance")).backend_grammar
        except GrammarError:
            continue
        tokens = [*vocab.encode(text), vocab.stop_ids[0]]
        walk = Walk(spec, grammar, tokens, xgr._compiled,  # type: ignore[attr-defined]
                    llg_text._grammar)  # type: ignore[attr-defined]
        if _all_accept(walk, vocab):
            walks.append(walk)
    if not walks:
        raise SystemExit(f"no walk for workload {name}")
    return walks


def _all_accept(walk: Walk, vocab: Vocabulary) -> bool:
    m = walk.grammar.matcher()
    x = _xgr_matcher(walk, vocab)
    g = llg.LLMatcher(llg_tokenizer(vocab), walk.llg_grammar, log_level=0)
    return all(m.accept(t) and x.accept_token(t) and g.consume_token(t) for t in walk.tokens)


def _xgr_matcher(walk: Walk, vocab: Vocabulary) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(walk.xgr, override_stop_tokens=list(vocab.stop_ids))


@dataclass
class Forward:
    """A forward in two parts, as a host runs one: ``launch`` (the host's share: a CUDA-graph
    replay is ~nothing, an eager launch loop is all of it) and ``finish`` (waiting for the
    device). Calling it runs both."""

    launch: Callable[[], None]
    finish: Callable[[], None]

    def __call__(self) -> None:
        self.launch()
        self.finish()


def make_forward(kind: str) -> Forward:
    """``waitN``: N ms of device work from the launch, the host only waits (no GIL, no CPU:
    a CUDA-graph replay). ``busyN``: N ms of Python launching tiny torch ops (the GIL mostly
    held, as an eager model runner's launch loop; the device keeps up). ``pyN``: N ms of pure
    Python on the host's thread, the GIL held throughout (the engine core's scheduling while
    the device runs the forward)."""
    if kind.startswith("py"):
        span = float(kind[2:]) / 1000

        def python() -> None:
            end = time.perf_counter() + span
            total = 0
            while time.perf_counter() < end:
                for i in range(50):  # bytecode only: no call that lets the GIL go
                    total += i * i

        return Forward(python, lambda: None)
    ms = float(kind[4:]) / 1000
    if kind.startswith("wait"):
        launched = [0.0]

        def launch() -> None:
            launched[0] = time.perf_counter()

        def finish() -> None:
            left = launched[0] + ms - time.perf_counter()
            if left > 0:
                time.sleep(left)

        return Forward(launch, finish)
    x = torch.zeros(4)

    def busy() -> None:
        end = time.perf_counter() + ms
        while time.perf_counter() < end:
            for _ in range(20):
                x.add_(1)

    return Forward(busy, lambda: None)


class Positions:
    """Each row's walk and position; ``next`` gives the tokens sampled this step and the
    rows that start a new request."""

    def __init__(self, walks: list[Walk], batch: int) -> None:
        self.walks = [walks[i % len(walks)] for i in range(batch)]
        self.pos = [(i * 7) % len(self.walks[i].tokens) for i in range(batch)]

    def next(self) -> tuple[list[int], list[int]]:
        sampled, restarts = [], []
        for i, w in enumerate(self.walks):
            if self.pos[i] >= len(w.tokens):
                self.pos[i] = 0
                restarts.append(i)
            sampled.append(w.tokens[self.pos[i]])
            self.pos[i] += 1
        return sampled, restarts


def grammask_steps(compiler: Compiler, walks: list[Walk], batch: int,
                   forward: Forward, steps: int) -> list[float]:
    proc = BatchProcessor(compiler, max_batch=batch, think_end=None)
    at = Positions(walks, batch)
    for row, w in enumerate(at.walks):
        proc.add(row, w.spec, grammar=w.grammar)
        proc.advance(row, w.tokens[:at.pos[row]])
    proc.step()  # the first masks (not timed)
    proc.wait_masks()
    times = []
    try:
        for _ in range(steps + 2):
            sampled, restarts = at.next()
            # a request that just sampled its stop token has finished: its row leaves the
            # step (vLLM's scheduler finishes the request, and its runner's next batch has
            # no row for it), as vLLM's side below does not fill it either
            going = [i for i, (p, w) in enumerate(zip(at.pos, at.walks, strict=True))
                     if p < len(w.tokens)]
            tokens = [sampled[i] for i in going]
            # a new request in the row (its first token comes below): the host's thread
            # adds it before the forward (vLLM's runners: ``update_state`` / ``add_request``)
            t0 = time.perf_counter()
            for row in restarts:
                w = at.walks[row]
                proc.add(row, w.spec, grammar=w.grammar)
            proc.step(going, tokens)
            # the runner's apply comes right after the launch (vLLM's sampler runs the
            # logits processors on logits the device is still computing): the host waits
            # for the masks while the device works, and for the device after
            forward.launch()
            proc.wait_masks()
            forward.finish()
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        proc.close()
    return times[2:]


def vllm_fill(fill_row: Callable[[int], object], rows: Sequence[int],
              pool: ThreadPoolExecutor) -> None:
    """vLLM's structured-output fill of the scheduled ``rows`` (``grammar_bitmask`` without
    drafts): serially up to ``VLLM_SERIAL_MAX`` rows; above it, ``VLLM_CHUNK``-row chunks on
    its thread pool, then a wait for all of them."""
    def chunk(part: Sequence[int]) -> None:
        for i in part:
            fill_row(i)

    if len(rows) <= VLLM_SERIAL_MAX:
        chunk(rows)
        return
    for f in [pool.submit(chunk, rows[i:i + VLLM_CHUNK])
              for i in range(0, len(rows), VLLM_CHUNK)]:
        f.result()


def vllm_steps(engine: str, walks: list[Walk], vocab: Vocabulary, batch: int,
               forward: Forward, steps: int, pool: ThreadPoolExecutor,
               layout: str = "engine") -> dict[str, list[float]]:
    """vLLM's way: accept each row's token, then fill (serial, or 16-row chunks on the pool
    above 128 rows). Returns each model's step times (ms) from the same steps.

    ``layout="engine"``: the fill runs in the engine core, another process than the model
    runner's, as with ``--tensor-parallel-size`` > 1. Each part is timed on its own and
    two models are made of them:
    - ``engine`` (the issue's model): ``max(accept + fill, forward)``;
    - ``rpc``: the same, with the bitmask's trip to the worker (``vllm_rpc.Trip``: the
      ``sample_tokens`` RPC's pickling and copy into shared memory after the fill, and the
      worker's copy out and unpickling once its thread is free of the launch):
      ``max(launch + finish, max(launch, accept + fill + send) + receive)``. With a CUDA-graph
      forward (launch ~0) the receive hides under the device's work when there is room;
      with an eager one it comes after the launch loop.
    ``layout="inproc"`` (one GPU: vLLM's default ``uni`` executor runs the model runner
    inside the engine core, and ``EngineCore.step`` launches the forward, then fills, then
    waits for the output): ``inproc``, accept + launch + fill + the rest of the forward,
    measured end to end."""
    at = Positions(walks, batch)
    bitmask = allocate_bitmask(batch, vocab.vocab_size)
    trip = Trip() if layout == "engine" else None
    ids = [f"req-{i}" for i in range(batch)]

    def new(w: Walk) -> Any:
        if engine == "xgrammar":
            return _xgr_matcher(w, vocab)
        return llg.LLMatcher(llg_tokenizer(vocab), w.llg_grammar, log_level=0)

    matchers = [new(w) for w in at.walks]
    for m, w, p in zip(matchers, at.walks, at.pos, strict=True):
        for t in w.tokens[:p]:
            (m.accept_token if engine == "xgrammar" else m.consume_token)(t)

    ended = [False] * batch  # requests that just sampled their stop token: not filled

    def fill_row(i: int) -> None:
        if engine == "xgrammar":
            matchers[i].fill_next_token_bitmask(bitmask, i)
        else:
            llg_torch.fill_next_token_bitmask(matchers[i], bitmask, i)

    def fill() -> None:
        vllm_fill(fill_row, [i for i in range(batch) if not ended[i]], pool)

    times: dict[str, list[float]] = {"engine": [], "rpc": []} if trip else {"inproc": []}
    try:
        for _ in range(steps + 2):
            sampled, restarts = at.next()
            ended[:] = [p >= len(w.tokens) for p, w in zip(at.pos, at.walks, strict=True)]
            for row in restarts:  # made at admission (``grammar_init``, a thread pool): untimed
                matchers[row] = new(at.walks[row])
            t0 = time.perf_counter()
            for m, tok in zip(matchers, sampled, strict=True):
                (m.accept_token if engine == "xgrammar" else m.consume_token)(tok)
            if trip is None:
                forward.launch()
                fill()
                forward.finish()
                times["inproc"].append((time.perf_counter() - t0) * 1000)
                continue
            fill()
            t1 = time.perf_counter()
            trip.send(GrammarOutput(ids, bitmask.numpy()))
            t2 = time.perf_counter()
            forward.launch()
            t3 = time.perf_counter()
            forward.finish()
            t4 = time.perf_counter()
            trip.receive()
            t5 = time.perf_counter()
            fill_s, send_s, launch_s, fwd_s, receive_s = t1 - t0, t2 - t1, t3 - t2, t4 - t2, t5 - t4
            times["engine"].append(max(fill_s, fwd_s) * 1000)
            times["rpc"].append(max(fwd_s, max(launch_s, fill_s + send_s) + receive_s) * 1000)
    finally:
        if trip is not None:
            trip.close()
    return {k: v[2:] for k, v in times.items()}


def cell(compiler: Compiler, walks: list[Walk], vocab: Vocabulary, batch: int,
         forward: Forward, steps: int, repeats: int, pool: ThreadPoolExecutor
         ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, float]]:
    """One (workload, B, forward) cell: each series' median step ms over ``repeats`` runs
    of ``steps`` steps (the sides take turns, so load hits them alike), the runs, and
    grammask's ratio to the better engine in each of vLLM's models."""
    runs: dict[str, list[float]] = {"grammask": []}
    for _ in range(repeats):
        runs["grammask"].append(statistics.median(
            grammask_steps(compiler, walks, batch, forward, steps)))
        for name, engine in ENGINES.items():
            for layout in ("engine", "inproc"):
                for model, times in vllm_steps(engine, walks, vocab, batch, forward, steps,
                                               pool, layout).items():
                    runs.setdefault(f"{MODELS[model]}-{name}", []).append(
                        statistics.median(times))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {m: med["grammask"] / min(med[f"{prefix}-{e}"] for e in ENGINES)
              for m, prefix in MODELS.items()}
    return med, runs, ratios


def inproc_ratios(runs: dict[str, list[float]]) -> list[float]:
    """grammask's ratio to the better engine of ``inproc`` in each repeat (the same repeat's
    runs: load that hits one repeat hits both sides)."""
    return [g / min(runs[f"{MODELS['inproc']}-{e}"][i] for e in ENGINES)
            for i, g in enumerate(runs["grammask"])]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,16,64,256,512")
    ap.add_argument("--forwards", default="wait3,wait10,busy3",
                    help="waitN (GIL-free), busyN (tiny torch ops), pyN (pure Python, the "
                         "GIL held): N ms each")
    ap.add_argument("--workloads", default="free,closed,corpus,regex,choice")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample", type=int, default=24, help="corpus schemas")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--tokenizer", default="qwen2.5",
                    help="qwen2.5 (embedded: llguidance calls back into Python to tokenize) "
                         "or a Hugging Face tokenizer directory (llguidance tokenizes "
                         "natively, as under vLLM)")
    ap.add_argument("--json")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("grammask").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    vocab = load_vocabulary(args.tokenizer)
    llg_tokenizer(vocab)  # built before any timing
    compiler = Compiler(vocab, timeout_s=60)
    raw = {name: Compiler(vocab, backend=name, timeout_s=60, tune_fill=False)
           for name in ("xgrammar", "guidance")}
    pool = ThreadPoolExecutor(vllm_workers())
    batches = [int(b) for b in args.batch_sizes.split(",")]
    forwards = args.forwards.split(",")
    results: list[dict[str, Any]] = []
    table = []
    for workload in args.workloads.split(","):
        walks = make_walks(workload, compiler, raw, vocab, args.corpus, args.sample)
        backends = sorted({w.grammar.backend for w in walks})
        for batch in batches:
            for fwd in forwards:
                forward = make_forward(fwd)
                med, runs, ratios = cell(compiler, walks, vocab, batch, forward, args.steps,
                                         args.repeats, pool)
                spread = inproc_ratios(runs)
                results.append({"workload": workload, "batch": batch, "forward": fwd,
                                "grammask_backends": backends, "steps_ms": med,
                                "runs_ms": runs, "ratio_inproc_runs": spread,
                                "ratio_inproc_median": statistics.median(spread)} | {
                                    RATIOS[m]: r for m, r in ratios.items()})
                table.append([workload, batch, fwd, f"{med['grammask']:.2f}"] + [
                    f"{v:.2f}" for m in MODELS for v in (
                        min(med[f"{MODELS[m]}-{e}"] for e in ENGINES), ratios[m])] + [
                    f"{statistics.median(spread):.2f} ({min(spread):.2f}-{max(spread):.2f})"])
                print(" ".join(str(c) for c in table[-1]), file=sys.stderr, flush=True)
    pool.shutdown()
    for c in (compiler, *raw.values()):
        c.close()
    print(render_table(["workload", "B", "forward", "grammask_ms", "vllm_ms", "ratio",
                        "rpc_ms", "ratio_rpc", "inproc_ms", "ratio_inproc",
                        "inproc_runs (min-max)"], table))
    print("(median step ms over repeats of median steps; vllm_ms: the better of vLLM's ways "
          "(xgrammar, llguidance) in each model; ratio: grammask / that, <= 1.00 is never "
          "slower. The models: the fill in another process, free (the issue's); the same "
          "with the bitmask's trip to the worker (rpc); one GPU, the fill after the launch "
          "(inproc); inproc_runs: grammask / inproc per repeat, the median (min-max))")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "args": vars(args) | {
            "corpus": str(args.corpus)}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
