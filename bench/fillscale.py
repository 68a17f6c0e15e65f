"""The free-text JSON workload ``bench.step`` (and so ``bench.gpu_step``) walks: a schema of
free-text strings and valid compact instances of it.

Not a benchmark of its own any more: the batch-fill scaling it measured (issue 32, item 2;
serial against 1-8 fill threads) is history in docs/benchmarks.md, and the decode step it
fed is ``bench.step``'s.
"""

from __future__ import annotations

import json
import random

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

