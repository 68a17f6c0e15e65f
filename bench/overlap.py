"""Overlap of the mask fill with the model forward: what masking adds to a decode step.

    python -m bench.overlap [--quick] [--json OUT] [--corpus PATH] [--sample N] [--seed S]
                            [--forward-ms 2,10,30] [--batch-sizes 1,16,64,256] [--steps N]
                            [--forward-kind idle,matmul] [--handover advance|step]

One decode step is simulated as the host would run it with ``BatchProcessor``:
``step()`` (start advance + fill on the worker) -> forward -> fresh logits (a copy into a
(B, V) fp32 tensor) -> ``apply(logits)`` -> the host hands the sampled tokens over
(``advance`` per row; ``--handover step``: with the next ``step(rows, tokens)``, one pass
that appends and reads). The baseline step is the same without the processor. Both kinds of step
alternate in one run, so background load hits them alike.

Rows walk valid corpus instances (``json.dumps`` of maskbench test data, Qwen2.5 vocabulary):
each step every row receives its instance's next token; a row that reaches the end starts
its instance again (a remove + add, as a new request would).

Reported per (batch, forward): the fill job time per step (``advance_ms``: matchers advanced
by the new tokens; ``fill_ms``: bitmasks filled; ``plan_ms``: the masks expanded into the CPU
apply's indices, fill-thread work that exists only for CPU logits; p50/p99), ``proc.apply``
(``wait_apply_ms``), split into the masking kernel (``apply_kernel_ms``), the wait for the job
(``wait_ms``; ``waited_steps``: steps where it lasted > 50 us) and the rest
(``apply_rest_ms``: apply's own bookkeeping), and ``exposed_ms`` = p50 step time with masks -
p50 step time without. The fills table's ``apply_ms`` (the planned apply alone on the (B, V)
logits, other masks, warm caches) is compared with ``memcpy_ms`` (a plain copy of them).
The exposed cost splits into: the host's own work (``host_ms``: ``step()`` and handing the
tokens over, ``host_step_ms`` + ``host_handover_ms``), the wait of ``apply`` for the job (~0
when the overlap works), the apply (kernel + rest), and the forward's slowdown while the fill
runs beside it (``fwd+fill`` vs ``forward_ms``: CPU contention, large when no core is free).
On CPU logits the kernel is memory-bound; on a GPU it is microseconds, so
``exposed_less_apply_ms`` (per step: the step less its own kernel; then the median, less the
plain step's) is closer to what a GPU host would see.

Two forwards (``--forward-kind``):

- ``idle``: what a GPU host sees. The forward is a GIL-free wait that uses no CPU (the host
  only launches kernels and waits for them), so the fill has the cores to itself and the
  exposed cost is pure host overhead and waiting. Targets: exposed (apply excluded) <= 10% of
  the fill job where the job is shorter than the forward; host overhead < 50 us + 2 us/row.
- ``matmul``: CPU serving. A torch matmul loop sized to take F ms (it releases the GIL), which
  competes with the fill for the cores: ``fwd+fill`` shows the contention.

This machine has 2 cores: the matmul forward runs with ``torch.set_num_threads(1)`` so that
one core is left to the fill thread; the batch-parallel fills are measured with 1 and 2
threads.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.cases import load_maskbench
from bench.paths import DEFAULT_CORPUS
from bench.stats import fmt_ms, machine_info, percentile, render_table, write_json
from grammask import Compiler, Grammar, GrammarError, GrammarSpec, Vocabulary, load_vocabulary
from grammask.apply import apply_bitmask, plan_cpu_apply
from grammask.backends import Matcher
from grammask.bitmask import allocate_bitmask
from grammask.masks import Filler
from grammask.processor import BatchProcessor


@dataclass
class Walk:
    """A compiled schema and the tokens of one valid instance it accepts."""

    case_id: str
    grammar: Grammar
    tokens: list[int]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few schemas and steps (< 60 s)")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--sample", type=int, help="maskbench schemas (default 64, quick 24)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--forward-ms", default="2,10,30")
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--steps", type=int, help="timed steps of each kind (default 60, quick 8)")
    ap.add_argument("--handover", default="advance", choices=["advance", "step"],
                    help="how the host hands the sampled tokens over: advance() per row "
                         "(default), or step(rows, tokens), one pass with the read")
    ap.add_argument("--forward-kind", default="idle,matmul",
                    help="idle (a GPU host: a wait that uses no CPU), matmul (CPU serving), "
                         "or both (default)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("grammask").setLevel(logging.ERROR)
    forwards = [float(x) for x in args.forward_ms.split(",")]
    kinds = [k.strip() for k in args.forward_kind.split(",") if k.strip()]
    if not set(kinds) <= {"idle", "matmul"}:
        ap.error("--forward-kind takes idle, matmul or both")
    batches = [int(x) for x in args.batch_sizes.split(",")]
    steps = args.steps or (8 if args.quick else 60)
    sample = args.sample or (24 if args.quick else 64)

    torch.set_num_threads(1)
    started = time.perf_counter()
    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, timeout_s=10)
    walks = prepare(compiler, vocab, args.corpus, sample, args.seed)
    print(f"# {len(walks)} schemas with a valid instance walk "
          f"({sum(w.grammar.backend == 'guidance' for w in walks)} on llguidance, "
          f"{sum(w.grammar.backend == 'xgrammar' for w in walks)} on xgrammar); "
          f"torch threads for the forward: {torch.get_num_threads()} (2-core machine: one core "
          f"is left to the fill thread)")
    fill_rows = {b: measure_fills(walks, vocab, b, steps) for b in batches}
    print(render_table(
        ["batch", "loop_ms", "par1_ms", "par2_ms", "plan_ms", "apply_planned", "x memcpy",
         "apply_inline", "plan_random", "apply_random", "memcpy_ms", "sparse_rows"],
        [[r["batch"], fmt_ms(r["loop_ms"]), fmt_ms(r["par1_ms"]), fmt_ms(r["par2_ms"]),
          fmt_ms(r["plan_ms"]), fmt_ms(r["apply_planned_ms"]),
          f"{r['apply_planned_ms'] / r['memcpy_ms']:.2f}", fmt_ms(r["apply_ms"]),
          fmt_ms(r["plan_random_ms"]), fmt_ms(r["apply_random_planned_ms"]),
          fmt_ms(r["memcpy_ms"]), r["sparse_rows"]] for r in fill_rows.values()]))
    print("(fill of every row: Matcher.fill loop vs the backends' batch-parallel fills with 1 "
          "and 2 threads; plan: expanding the masks into the CPU apply's indices (the fill "
          "thread's extra work); apply_planned: the apply on the critical path given that plan, "
          "on (batch, V) fp32 logits, and its ratio to a plain copy of them (target <= 1.5); "
          "apply_inline: plan + apply on the critical path (no fill thread); random: every "
          "word mixed, the worst case)\n")
    rows = []
    for kind in kinds:
        for b in batches:
            for f in forwards:
                row = measure_overlap(compiler, vocab, walks, b, f, steps, kind,
                                      args.handover)
                row.update(apply_ms=fill_rows[b]["apply_planned_ms"],
                           apply_inline_ms=fill_rows[b]["apply_ms"],
                           memcpy_ms=fill_rows[b]["memcpy_ms"])
                rows.append(row)
                print(f"  {kind} batch {b:>3} forward {f:>4.0f} ms: exposed "
                      f"{row['exposed_ms']:.3f} ms", file=sys.stderr)
    print(render_table(
        ["forward", "batch", "forward_ms", "fwd+fill", "adv_p50", "fill_p50", "fill_p99",
         "plan_p50", "wait+apply", "kernel", "wait", "apply_rest", "step()", "handover",
         "host_p50", "exposed_ms", "exp-apply", "target"],
        [[r["forward_kind"], r["batch"], fmt_ms(r["forward_ms"]),
          fmt_ms(r["forward_with_fill_ms_p50"]),
          fmt_ms(r["advance_ms_p50"]), fmt_ms(r["fill_ms_p50"]), fmt_ms(r["fill_ms_p99"]),
          fmt_ms(r["plan_ms_p50"]), fmt_ms(r["wait_apply_ms_p50"]),
          fmt_ms(r["apply_kernel_ms_p50"]), fmt_ms(r["wait_ms_p50"]),
          fmt_ms(r["apply_rest_ms_p50"]), fmt_ms(r["host_step_ms_p50"]),
          fmt_ms(r["host_handover_ms_p50"]), fmt_ms(r["host_ms_p50"]),
          fmt_ms(r["exposed_ms"]), fmt_ms(r["exposed_less_apply_ms"]), verdict(r)]
         for r in rows]))
    print("fwd+fill: the forward while the fill job runs beside it (CPU contention when no "
          "core is free); plan: the job expanding the masks for the CPU apply; wait+apply: "
          "proc.apply(), split into the masking kernel, the wait for the job and the rest "
          f"(apply's bookkeeping); host: step() + handing tokens over ({args.handover}); "
          "exp-apply: exposed "
          "less this step's own kernel (per step, then the median)\n"
          "target: exp-apply <= 10% of advance+fill+plan when that is shorter than the "
          "forward; host < 50 us + 2 us/row; apply <= 1.5x memcpy (the table above)")
    payload: dict[str, Any] = {
        "benchmark": "overlap", "machine": machine_info(), "quick": args.quick,
        "steps": steps, "schemas": len(walks), "torch_threads": torch.get_num_threads(),
        "rows": rows, "fill_methods": list(fill_rows.values()),
        "elapsed_s": round(time.perf_counter() - started, 1)}
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    compiler.close()
    return 0


def prepare(compiler: Compiler, vocab: Vocabulary, corpus: Path, sample: int, seed: int
            ) -> list[Walk]:
    """Compile a stratified sample; keep the schemas whose first valid instance walks."""
    cases = load_maskbench(corpus, sample, seed, need_instances=True)
    futures = [(c, compiler.compile_async(GrammarSpec.json_schema(c.source))) for c in cases]
    walks = []
    for case, future in futures:
        try:
            grammar = future.result()
        except GrammarError:
            continue
        tokens = vocab.encode(case.instances[0])
        matcher = grammar.matcher()
        if all(matcher.accept(t) for t in tokens) and matcher.accept(vocab.stop_ids[0]):
            walks.append(Walk(case.id, grammar, [*tokens, vocab.stop_ids[0]]))
    if not walks:
        raise SystemExit("no schema of the sample compiled and walked its instance")
    return walks


def make_forward(ms: float, kind: str = "matmul") -> Callable[[], None]:
    """A GIL-releasing stand-in for the model forward that takes about ``ms``: CPU work
    (``matmul``) or a wait that uses no CPU (``idle``: a GPU host waiting on its kernels)."""
    if kind == "idle":
        def wait() -> None:
            time.sleep(ms / 1000)

        return wait
    a = torch.randn(192, 192)
    for _ in range(3):
        torch.mm(a, a)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    one = (time.perf_counter() - t0) / 20
    reps = max(1, round(ms / 1000 / one))

    def forward() -> None:
        for _ in range(reps):
            torch.mm(a, a)

    return forward


class Probe:
    """Times, inside ``proc.apply``, the masking kernels (``grammask.apply``'s CPU and torch
    paths: the apply proper) and the wait for the fill job (``Ticket.result``), by wrapping
    them for the duration of a ``with`` block. Module-level names are looked up at call
    time, so this holds however the processor is split; ~1 us per step of its own."""

    KERNELS = ("_apply_plan", "_apply_cpu", "_apply_torch")

    def __init__(self) -> None:
        self.kernel_s = 0.0
        self.wait_s = 0.0
        self._saved: list[tuple[object, str, Any]] = []

    def reset(self) -> None:
        self.kernel_s = self.wait_s = 0.0

    def __enter__(self) -> Probe:
        import grammask.apply as ga
        import grammask.masks as gm

        for name in self.KERNELS:
            self._wrap(ga, name, "kernel_s")
        self._wrap(gm.Ticket, "result", "wait_s")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _wrap(self, owner: object, name: str, counter: str) -> None:
        original = getattr(owner, name)
        probe = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(probe, counter, getattr(probe, counter) + time.perf_counter() - t0)

        self._saved.append((owner, name, original))
        setattr(owner, name, timed)


def measure_overlap(compiler: Compiler, vocab: Vocabulary, walks: list[Walk], batch: int,
                    forward_ms: float, steps: int, kind: str = "matmul",
                    handover: str = "advance") -> dict[str, Any]:
    """One (batch, forward) cell: masked and plain steps alternating.

    Fresh logits (a copy of a template into the (B, V) fp32 tensor) come at the end of the
    forward, masked and plain steps alike. (With the ``idle`` forward a GPU host's CPU never
    copies logits, but moving the copy before the wait makes it compete with the fill job's
    start for the cores of a small, loaded machine: the forward then reads up to the job's
    length longer. After the wait the copy costs only caches: ``apply``'s bookkeeping right
    after it runs cold, which ``apply_rest_ms`` shows.)

    The hand-over (the host giving the sampled tokens to the processor: ``add`` for a row
    whose request ended, ``advance`` for every row) is timed; with ``handover="step"`` the
    tokens (one array, as a sampler returns them) go to the next ``step(rows, tokens)``
    instead, timed there. The walk's own bookkeeping (which token is next, which rows
    restart) is prepared outside the timed window, since a host has its sampled tokens at
    hand."""
    forward = make_forward(forward_ms, kind)
    handover_step = handover == "step"
    template = torch.randn(batch, vocab.vocab_size)
    logits = torch.empty_like(template)
    proc = BatchProcessor(compiler, max_batch=batch, think_end=None)
    positions = [0] * batch
    for row in range(batch):
        walk = walks[row % len(walks)]
        proc.add(row, walk.grammar.spec, grammar=walk.grammar)
        positions[row] = (row * 7) % (len(walk.tokens) - 1)  # spread over the instance
        proc.advance(row, walk.tokens[:positions[row]])

    def model() -> None:
        forward()
        logits.copy_(template)

    def next_tokens() -> tuple[list[tuple[int, list[int], Walk | None]], list[int],
                               list[tuple[int, Walk]]]:
        """Per row (row, its sampled tokens, the walk it restarts when its request ended);
        the same tokens as one array (a host's sampler output) and the restarts alone."""
        out = []
        for row in range(batch):
            walk = walks[row % len(walks)]
            restart = positions[row] >= len(walk.tokens)  # a new request takes the row
            if restart:
                positions[row] = 0
            out.append((row, [walk.tokens[positions[row]]], walk if restart else None))
            positions[row] += 1
        return (out, [tokens[0] for _, tokens, _ in out],
                [(row, walk) for row, _, walk in out if walk is not None])

    probe = Probe()
    every = list(range(batch))
    carried: list[int] | None = None  # handover="step": the tokens the next step() takes

    def masked_step() -> dict[str, float]:
        nonlocal carried
        handover, sampled, restarts = next_tokens()  # the walk's bookkeeping: not the host's
        t0 = time.perf_counter()
        if carried is None:
            proc.step()
        else:
            proc.step(every, carried)
        t1 = time.perf_counter()
        model()
        t2 = time.perf_counter()
        probe.reset()
        proc.apply(logits)  # waits for the job, then masks with the plan it made
        t4 = time.perf_counter()
        kernel, wait = probe.kernel_s, probe.wait_s
        if handover_step:  # new requests now; the tokens go with the next step()
            for row, walk in restarts:
                proc.add(row, walk.grammar.spec, grammar=walk.grammar)
            carried = sampled
            t5 = time.perf_counter()
        else:
            for row, tokens, restart in handover:  # the host hands the "sampled" tokens over
                if restart is not None:
                    proc.add(row, restart.grammar.spec, grammar=restart.grammar)
                proc.advance(row, tokens)
            t5 = time.perf_counter()
        return {"step": (t5 - t0) * 1000, "host": (t1 - t0 + t5 - t4) * 1000,
                "host_step": (t1 - t0) * 1000, "host_handover": (t5 - t4) * 1000,
                "forward": (t2 - t1) * 1000, "wait_apply": (t4 - t2) * 1000,
                "apply_kernel": kernel * 1000, "wait": wait * 1000,
                "apply_rest": (t4 - t2 - kernel - wait) * 1000,
                "step_less_kernel": (t5 - t0 - kernel) * 1000,
                "advance": proc.stats.last_advance_ms, "fill": proc.stats.last_fill_ms,
                "plan": proc.stats.last_plan_ms}

    def plain_step() -> float:
        t0 = time.perf_counter()
        model()
        return (time.perf_counter() - t0) * 1000

    with probe:
        for _ in range(3):  # warm up both paths
            masked_step()
            plain_step()
        masked: dict[str, list[float]] = {}
        plain = []
        for _ in range(steps):
            for key, value in masked_step().items():
                masked.setdefault(key, []).append(value)
            plain.append(plain_step())
    errors = proc.errors
    proc.close()
    if errors:  # e.g. llguidance's "lexer error: too many expressions constructed"
        print(f"  warning: {len(errors)} rows errored during the walk (stop-only masks "
              f"from then on): {sorted(set(errors.values()))[:3]}", file=sys.stderr)
    def p(key: str, q: float = 50) -> float:
        return round(percentile(masked[key], q), 4)

    job = [a + f + q for a, f, q in zip(masked["advance"], masked["fill"], masked["plan"],
                                           strict=True)]
    plain_p50 = percentile(plain, 50)
    return {
        "forward_kind": kind, "handover": handover, "batch": batch,
        "forward_ms": round(plain_p50, 3), "forward_target_ms": forward_ms,
        "advance_ms_p50": p("advance"), "fill_ms_p50": p("fill"), "fill_ms_p99": p("fill", 99),
        "job_ms_p50": round(percentile(job, 50), 4),
        "plan_ms_p50": p("plan"), "wait_apply_ms_p50": p("wait_apply"),
        "host_ms_p50": p("host"), "host_step_ms_p50": p("host_step"),
        "host_handover_ms_p50": p("host_handover"), "errored_rows": len(errors),
        # inside proc.apply: the masking kernel, the wait for the job, and the rest
        # (apply's bookkeeping: which rows, the plan's checks, restores)
        "apply_kernel_ms_p50": p("apply_kernel"), "wait_ms_p50": p("wait"),
        "wait_ms_max": round(max(masked["wait"]), 4),
        "waited_steps": sum(w > 0.05 for w in masked["wait"]),
        "apply_rest_ms_p50": p("apply_rest"),
        "forward_with_fill_ms_p50": p("forward"),
        "step_ms_p50": p("step"), "plain_step_ms_p50": round(plain_p50, 3),
        "exposed_ms": round(percentile(masked["step"], 50) - plain_p50, 4),
        # the exposed cost without this step's own apply kernel (the part a GPU makes
        # microseconds): per step, then the median
        "exposed_less_apply_ms": round(percentile(masked["step_less_kernel"], 50) - plain_p50,
                                       4),
    }


def spread_matchers(walks: list[Walk], batch: int) -> list[tuple[Matcher, int]]:
    """``batch`` matchers, row ``i`` at its own position of its own instance."""
    matchers: list[tuple[Matcher, int]] = []
    for row in range(batch):
        walk = walks[row % len(walks)]
        m = walk.grammar.matcher()
        for t in walk.tokens[:(row * 7) % (len(walk.tokens) - 1)]:
            m.accept(t)
        matchers.append((m, row))
    return matchers


def measure_fills(walks: list[Walk], vocab: Vocabulary, batch: int, steps: int
                  ) -> dict[str, Any]:
    """Fill and apply for ``batch`` rows at spread positions.

    Fill: a ``Matcher.fill`` loop vs the backends' batch-parallel fills (1 and 2 threads).
    Apply: the kernel on (batch, V) fp32 logits with these real masks and with random ones
    (every word mixed: the worst case), against a plain copy of the logits. The methods take
    turns within each repetition so background load hits them alike."""
    matchers = spread_matchers(walks, batch)
    bitmask = allocate_bitmask(batch, vocab.vocab_size)
    fillers = {"loop_ms": Filler(parallel_min=10**9),
               "par1_ms": Filler(parallel_min=1, threads=1),
               "par2_ms": Filler(parallel_min=1, threads=2)}
    for filler in fillers.values():
        filler.fill(matchers, bitmask)  # warm up (thread pools)
    src = torch.randn(batch, vocab.vocab_size)
    dst = torch.empty_like(src)
    noise = torch.randint(-2**31, 2**31 - 1, bitmask.shape, dtype=torch.int32)
    rows = list(range(batch))
    times: dict[str, list[float]] = {k: [] for k in [
        *fillers, "apply_ms", "apply_random_ms", "plan_ms", "plan_random_ms",
        "apply_planned_ms", "apply_random_planned_ms", "memcpy_ms"]}
    width = src.shape[1]
    for _ in range(max(10, steps)):
        for name, filler in fillers.items():
            t0 = time.perf_counter()
            filler.fill(matchers, bitmask)
            times[name].append((time.perf_counter() - t0) * 1000)
        for name, mask in (("apply_ms", bitmask), ("apply_random_ms", noise)):
            dst.copy_(src)
            t0 = time.perf_counter()
            apply_bitmask(dst, mask, vocab_size=vocab.vocab_size, indices=rows)
            times[name].append((time.perf_counter() - t0) * 1000)
        for kind, mask in (("", bitmask), ("_random", noise)):
            t0 = time.perf_counter()
            plan = plan_cpu_apply(mask, rows, vocab_size=vocab.vocab_size, width=width,
                                  stride=width)
            times[f"plan{kind}_ms"].append((time.perf_counter() - t0) * 1000)
            dst.copy_(src)
            t0 = time.perf_counter()
            apply_bitmask(dst, mask, vocab_size=vocab.vocab_size, indices=rows, plan=plan)
            times[f"apply{kind}_planned_ms"].append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        dst.copy_(src)
        times["memcpy_ms"].append((time.perf_counter() - t0) * 1000)
    allowed = [(int(bitmask[r].ne(0).sum()), int(bitmask[r].eq(-1).sum())) for r in rows]
    return {"batch": batch, **{k: round(percentile(v, 50), 4) for k, v in times.items()},
            "sparse_rows": sum(nz <= 64 for nz, _ in allowed)}


def verdict(row: dict[str, Any]) -> str:
    job = row["job_ms_p50"]
    checks = []
    if job < row["forward_ms"]:
        checks.append("ok" if row["exposed_less_apply_ms"] <= 0.1 * job else "over")
    else:
        checks.append("fill>fwd")
    checks.append("ok" if row["host_ms_p50"] <= 0.05 + 0.002 * row["batch"] else "host slow")
    checks.append("ok" if row["apply_ms"] <= 1.5 * row["memcpy_ms"] else "apply slow")
    return "/".join(checks)


if __name__ == "__main__":
    raise SystemExit(main())
