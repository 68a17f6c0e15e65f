"""Fill cost measured where grammask runs, per grammar: which of two compiled grammars of one
spec fills its masks cheaper on this machine.

Which engine fills faster depends on the schema and on the machine (on the corpus, xgrammar is
cheaper for most of the free-text schemas both enforce, llguidance for the rest, and the gap
between them differs from one machine to another: docs/benchmarks.md, Figures: compile
routing), so no constant of the router's cost model can decide it. The compiler
(``Compiler(tune_fill=True)``) serves the router's choice at once, compiles the other engine
that enforces every keyword in the background, and ``compare``s them on a probe walk; when the
other fills cheaper by more than ``MARGIN`` it serves that spec's later requests (rows already
running keep theirs). Timing-dependent, so never with tensor parallelism.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..backends.base import Matcher
from ..kernels.bitmask import allocate_bitmask
from .grammar import Grammar

#: the other engine must fill cheaper by more than this share to take the spec over
MARGIN = 0.15
#: tokens of a probe walk
PROBE_TOKENS = 96
#: texts that end strings and walk the structure (a random walk alone stays in a string)
STRUCTURE = ('"', "}", "]", ",", ":", " ", "0", "1", "true", "null")


@dataclass(frozen=True)
class Comparison:
    """Mean fill µs per token of each grammar along one probe walk."""

    a_us: float
    b_us: float
    tokens: int

    def b_cheaper(self) -> bool:
        return self.tokens >= 8 and self.b_us * (1 + MARGIN) < self.a_us


def probe(grammar: Grammar, encode_one: dict[str, int], vocab_size: int, seed: int
          ) -> list[int]:
    """A walk of ``grammar``: at each step an allowed structural token (``STRUCTURE``) one
    time in three, else a random allowed token (free text), until it may stop after
    ``PROBE_TOKENS`` / 2 or has ``PROBE_TOKENS``. Deterministic for a seed."""
    import torch

    rng = random.Random(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    m = grammar.matcher()
    walk: list[int] = []
    structure = list(encode_one.values())
    while len(walk) < PROBE_TOKENS:
        if len(walk) >= PROBE_TOKENS // 2 and m.can_terminate():
            break
        m.fill(bitmask, 0)
        words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
        allowed_structure = [t for t in structure
                             if (int(words[t >> 5]) >> (t & 31)) & 1]
        if allowed_structure and rng.random() < 1 / 3:
            tok = rng.choice(allowed_structure)
        else:
            bits = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).flatten().nonzero()
            if not len(bits):
                break
            tok = int(bits[rng.randrange(len(bits))])
        if tok >= vocab_size or not m.accept(tok):
            break
        walk.append(tok)
    return walk


def compare(a: Grammar, b: Grammar, walk: list[int], vocab_size: int, rounds: int = 3
            ) -> Comparison:
    """Both grammars fill along ``walk`` (turn by turn, so background load hits them alike);
    the best of ``rounds`` (the first warms lazily built lexers, as in service). The walk
    stops where either refuses a token."""
    bitmask = allocate_bitmask(1, vocab_size)
    best = [float("inf"), float("inf")]
    used = len(walk)
    for _ in range(rounds):
        pair: list[Matcher] = [a.matcher(), b.matcher()]
        total = [0.0, 0.0]
        for i, tok in enumerate(walk[:used]):
            ok = True
            for k, m in enumerate(pair):
                t0 = time.perf_counter()
                m.fill(bitmask, 0)
                total[k] += time.perf_counter() - t0
                ok = m.accept(tok) and ok
            if not ok:
                used = i + 1
                break
        for k in range(2):
            best[k] = min(best[k], total[k] / max(1, used) * 1e6)
    return Comparison(round(best[0], 2), round(best[1], 2), used)
