"""Mask digests: each tensor-parallel rank records what it masked, so ranks can be compared.

With tensor parallelism every rank applies its own masks, and the scheduler keeps rank 0's
tokens. A rank whose mask differs leaves no trace in the text. Its sampled token is thrown
away, and the next step feeds it rank 0's token again. Comparing the ranks' masks is the only
way to see such a fault. A debug setting (``mask_digest_dir``) makes each rank append one
line per masked row and step to ``rank<R>-<pid>.jsonl``:
``{"key": ..., "mask": ...}``. ``key`` is a digest of the row's spec and of the output
tokens it has consumed (what the mask is a function of, on every rank), ``mask`` a digest
of the mask's bits. ``compare`` reads a directory: agreeing ranks have identical records.

``fault=True`` (setting ``debug_mask_fault``, tests only) makes this rank's masks refuse the
first token they allow, one token off, to show that the comparison catches it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


class MaskDigests:
    """Appends (key, mask digest) lines for one rank; thread-safe, flushed per step."""

    def __init__(self, directory: str | Path, rank: int, *, fault: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = self.directory / f"rank{rank}-{os.getpid()}.jsonl"
        self.fault = fault
        self._lock = threading.Lock()

    def observe(self, bitmask: torch.Tensor, rows: Iterable[tuple[int, str]]) -> None:
        """Record (and with ``fault``, first corrupt) ``bitmask`` rows about to be applied;
        ``rows``: (bitmask row, key)."""
        lines = []
        for index, key in rows:
            row = bitmask[index]
            if self.fault:
                _refuse_first_allowed(row)
            digest = hashlib.blake2b(row.numpy().tobytes(), digest_size=12).hexdigest()
            lines.append(json.dumps({"key": key, "mask": digest}) + "\n")
        if lines:
            with self._lock, self.path.open("a") as out:
                out.writelines(lines)


def row_key(spec_key: str, tokens: Iterable[int], backend: str = "") -> str:
    """What a row's mask is a function of: its spec, the backend serving it and the output
    tokens it consumed (two backends may allow different tokens at the same prefix: a
    request served by the hedge or a fallback is keyed apart from one served as routed)."""
    h = hashlib.blake2b(f"{spec_key}|{backend}".encode(), digest_size=12)
    h.update(b"|" + ",".join(str(int(t)) for t in tokens).encode())
    return h.hexdigest()


def _refuse_first_allowed(row: torch.Tensor) -> None:
    nonzero = row.nonzero().flatten()
    if len(nonzero):
        word = int(nonzero[0])
        value = int(row[word])
        row[word] = value & (value - 1)  # clears the lowest set bit


@dataclass(frozen=True)
class Comparison:
    """What the ranks' digests say: ``shared`` keys seen by every rank, ``differing`` keys
    whose masks differ, ``one_sided`` keys only some ranks saw (on vLLM's V1 runner each rank
    appends its own sampled tokens, so a rank that masked differently drifts onto other
    keys: agreeing ranks have identical records)."""

    ranks: int
    shared: int
    differing: list[str]
    one_sided: int

    @property
    def agree(self) -> bool:
        return self.ranks > 1 and not self.differing and not self.one_sided


def compare(directory: str | Path) -> Comparison:
    """Compare the ``rank*.jsonl`` records in ``directory``."""
    masks: dict[str, set[str]] = {}
    seen: dict[str, set[str]] = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        rank = path.name.split("-", 1)[0]
        for line in path.read_text().splitlines():
            item = json.loads(line)
            masks.setdefault(item["key"], set()).add(item["mask"])
            seen.setdefault(item["key"], set()).add(rank)
    ranks = len(set().union(*seen.values())) if seen else 0
    shared = [k for k, r in seen.items() if len(r) == ranks]
    return Comparison(ranks, len(shared), sorted(k for k in shared if len(masks[k]) > 1),
                      sum(1 for r in seen.values() if len(r) < ranks))
