"""Tensor-parallel agreement on first masks: two real processes over gloo, and the decision rule.

Each process is one "rank" with its own ``Compiler`` and ``BatchProcessor`` (as vLLM's TP workers
have). The ranks' compiles are made to finish at different times -- a ``Future`` resolved by a
timer stands in for a compile that is slower on one rank, since real compile times cannot be
steered -- and every rank must still give every row the same status, backend and mask.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from grammask import GrammarSpec
from grammask.decode.rows import COMPILING, FAILED, READY, Decision, decide

XGR_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"]}


# ------------------------------------------------------------------ the decision rule
@pytest.mark.parametrize(("can_hedge", "views", "expected"), [
    (False, [[0, 0, READY, COMPILING], [0, 0, READY, COMPILING]], Decision(use=0)),
    (False, [[0, 0, READY, COMPILING], [0, 0, COMPILING, COMPILING]], Decision()),
    (False, [[0, 0, READY, COMPILING], [1, 0, COMPILING, COMPILING]], Decision(fail="late")),
    (False, [[0, 0, FAILED, COMPILING], [0, 0, READY, COMPILING]], Decision(fail="compile")),
    (True, [[0, 0, FAILED, COMPILING], [0, 0, READY, COMPILING]], Decision(hedge=True)),
    (True, [[0, 0, READY, COMPILING], [0, 1, COMPILING, COMPILING]], Decision(hedge=True)),
    (True, [[0, 1, READY, READY], [0, 1, COMPILING, READY]], Decision(use=1)),
    (True, [[0, 1, READY, READY], [0, 1, READY, READY]], Decision(use=0)),
    (True, [[0, 1, FAILED, FAILED], [0, 1, READY, COMPILING]], Decision(fail="compile")),
])
def test_decision_rule(can_hedge: bool, views: list[list[int]], expected: Decision) -> None:
    assert decide(can_hedge, views) == expected
    assert decide(can_hedge, views[::-1]) == expected  # rank order does not matter


# ------------------------------------------------------------------ two real ranks
#: scenario -> (spec kind, what each rank's routed compile does, wait_s, hedge_s)
SCENARIOS: dict[str, tuple[str, tuple[str, str], float, float]] = {
    # rank 1's compile finishes 0.3 s later than rank 0's, well within wait_s: both wait
    "one-rank-slower": ("forced", ("ready", "after:0.3"), 10.0, 10.0),
    # rank 1's finishes after wait_s ran out: both fail the row, although rank 0 had it
    "late-on-one-rank": ("forced", ("ready", "after:3.0"), 0.3, 10.0),
    # rank 1's never finishes: it hedges, rank 0 follows, both serve llguidance's grammar
    "hedged-on-one-rank": ("auto", ("ready", "never"), 10.0, 0.05),
    # rank 0's compile failed (say, a timeout), rank 1's succeeded: both fail the row
    "failed-on-one-rank": ("forced", ("error", "ready"), 10.0, 10.0),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, scenario: str, agree: bool, out: str) -> None:
    """One rank: a real compiler and processor; writes each row's outcome to ``out``."""
    import torch.distributed as dist

    from grammask import Compiler, load_vocabulary
    from grammask.compile.compiler import Grammar
    from grammask.decode.firstmask import Solo, TorchGroup
    from grammask.decode.processor import BatchProcessor
    from grammask.errors import CompileTimeoutError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    kind, behaviours, wait_s, hedge_s = SCENARIOS[scenario]
    vocab = load_vocabulary("qwen2.5")
    compiler = Compiler(vocab, timeout_s=60)
    spec = GrammarSpec.json_schema(XGR_SCHEMA, any_whitespace=False,
                                   backend="xgrammar" if kind == "forced" else None)
    compiled = compiler.compile(spec)
    # row 1 is compiled before the clocks start: no real compile races a short wait_s
    other = compiler.compile(GrammarSpec.choice(["alpha", "beta"]))
    future: Future[Grammar] = Future()
    behaviour = behaviours[rank]
    if behaviour == "ready":
        future.set_result(compiled)
    elif behaviour == "error":
        future.set_exception(CompileTimeoutError("compile ran past its budget"))
    dist.barrier()  # both ranks start their steps together (and their clocks)
    if behaviour.startswith("after:"):
        threading.Timer(float(behaviour[6:]), future.set_result, [compiled]).start()
    agreement = TorchGroup(dist.group.WORLD) if agree else Solo()
    result: dict[str, Any] = {}
    with BatchProcessor(compiler, max_batch=2, wait_s=wait_s, hedge_s=hedge_s,
                        agreement=agreement) as proc:
        proc.add(0, spec, grammar=future)
        proc.add(1, other.spec, grammar=other)
        proc.step()
        logits = torch.zeros(2, vocab.vocab_size)
        proc.apply(logits)
        for row in range(2):
            info = proc.info(row)
            mask = torch.isfinite(logits[row]).numpy().tobytes()
            result[str(row)] = {"status": info.status, "backend": info.backend,
                                "mask": hashlib.sha256(mask).hexdigest()}
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(tmp_path: Path, scenario: str, *, agree: bool) -> list[dict[str, Any]]:
    outs = [str(tmp_path / f"{scenario}-{agree}-rank{r}.json") for r in range(2)]
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, scenario, agree, outs[r]))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], f"a rank crashed in {scenario}"
    return [json.loads(Path(o).read_text()) for o in outs]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_ranks_agree_on_first_masks(tmp_path: Path, scenario: str) -> None:
    rank0, rank1 = _run_ranks(tmp_path, scenario, agree=True)
    assert rank0 == rank1
    expected = {"one-rank-slower": ("active", "xgrammar"), "late-on-one-rank": ("error", None),
                "hedged-on-one-rank": ("active", "guidance"),
                "failed-on-one-rank": ("error", None)}[scenario]
    assert (rank0["0"]["status"], rank0["0"]["backend"] if expected[0] == "active"
            else None) == expected
    assert rank0["1"]["status"] == "active"  # the other row never noticed


def test_without_agreement_the_ranks_diverge(tmp_path: Path) -> None:
    """The same late compile, each rank deciding alone: rank 0 masks, rank 1 fails the row.
    This is what the agreement prevents (and shows the two-rank test can fail)."""
    rank0, rank1 = _run_ranks(tmp_path, "late-on-one-rank", agree=False)
    assert rank0["0"]["status"] == "active" and rank1["0"]["status"] == "error"

