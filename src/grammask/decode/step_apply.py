"""A step's masks into the host's logits, however the host lays its rows out.

Three layouts, one step: the batch's own rows (vLLM's V1 runner, transformers: ``batch``),
logits rows mapped to mask rows (vLLM's V2 runner, rows are request slots: ``mapped``), and
draft positions along speculative drafts (``drafts``). Each ends the step: it waits for the
step's fill. A later apply of the same step (vLLM 0.34's rejection sampler verifies a large
speculative batch in request chunks, one apply each) takes that step's masks, as long as no
step began and its rows are still theirs (``_Ended``).

Speculative decoding: a row's masks along its draft tokens, from its committed state.

Draft tokens are fed tentatively and rolled back, so the row keeps its committed state. The
rules are vLLM's own: a position still inside the thinking section is free (all ones, or the
marker-boundary guard); after a draft token the grammar refuses, every later position repeats
the last valid mask (which already refuses that token, so the rejection sampler rejects it
there and no later row is used); after a placeholder (negative id) positions are free; an
errored row gets its error mask everywhere.

``Drafts.place`` lays a batch's masks out for the apply (``step_apply``) as one row map into
the step's bitmask: committed positions at their rows' own masks, so the step's CPU plan
serves them, and draft and bonus positions in rows above those the step uses.

Mask digests: each tensor-parallel rank records what it masked, so ranks can be compared.

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
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import metrics
from ..kernels.apply import apply_pairs
from ..kernels.buffers import MaskBuffers
from ..kernels.cpu_plan import CpuPlan, LogitsLayout
from .fill import RowMasks
from .firstmask import FirstMasks
from .rows import Row
from .stepjob import DraftMasks, FillStats, StepJobs, StepMasks


class Pairs(NamedTuple):
    """(logits row, mask row) pairs of one apply: ``at`` None means logits row ``rows[i]``
    (sorted, distinct); ``plan``: the step's CPU plan where it holds; ``owners[i]``: the row
    pair ``i`` belongs to (None: its mask row); ``committed``: how many leading pairs are
    committed positions (None: all), the ones whose digests are recorded."""

    bitmask: torch.Tensor
    at: np.ndarray[Any, np.dtype[np.intp]] | None
    rows: list[int] | np.ndarray[Any, np.dtype[np.intp]]
    plan: CpuPlan | None
    owners: np.ndarray[Any, np.dtype[np.intp]] | None = None
    committed: int | None = None


class HostLogits:
    """Masks logits with a step's pairs, with the hooks (digests, the restore);
    ``table`` arguments are the batch's rows."""

    def __init__(self, *, max_batch: int, vocab_size: int, buffers: MaskBuffers,
                 digests: MaskDigests | None = None) -> None:
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.buffers = buffers  # the step's (row order)
        #: per-rank mask digests (a debug setting; ``MaskDigests`` below), None: off
        self.digests = digests
        #: some row of the table may have ``host_masks`` (``host_masks_added``; cleared
        #: here once none has): while False, the apply skips the restore
        self._host_masks_seen = False

    def host_masks_added(self) -> None:
        """A row with ``host_masks`` was made: applies look for such rows again."""
        self._host_masks_seen = True

    def mapped(self, step: StepMasks, logits_rows: Sequence[int], rows: Sequence[int]
               ) -> Pairs | None:
        """``logits[logits_rows[i]]`` takes row ``rows[i]``'s mask; rows the step did not
        mask are left out (no Python work per row)."""
        bitmask, masked, plan = step
        if not masked:
            return None
        at = np.asarray(logits_rows, dtype=np.intp)
        mask_rows = np.asarray(rows, dtype=np.intp)
        ready = np.zeros(max(self.max_batch, masked[-1] + 1), dtype=bool)
        ready[masked] = True
        keep = ready[mask_rows]
        if not keep.all():
            at, mask_rows = at[keep], mask_rows[keep]
            plan = None  # made for every masked row
        elif len(masked) != len(mask_rows):
            plan = None
        return Pairs(bitmask, at, mask_rows, plan) if at.size else None

    def mask_into(self, table: dict[int, Row], logits: torch.Tensor, pairs: Pairs
             ) -> LogitsLayout | None:
        """``apply_pairs`` with the hooks: digests of the committed masks first, and the
        grammar's tokens back in rows whose host left none (rows that asked for it);
        returns the logits' layout, as the apply read it."""
        bitmask, at, rows, plan, owners, committed = pairs
        # rows as a list only for the per-row hooks (the V2 path has none by default)
        hooks = self.digests is not None or self._host_masks_seen
        listed = (rows if isinstance(rows, list) else rows.tolist()) if hooks else []
        if self.digests is not None:
            self._record(table, bitmask, listed if committed is None else listed[:committed])
            plan = None if self.digests.fault else plan
        asked = self._asked(table, listed, at, owners) if self._host_masks_seen else []
        layout, restored = apply_pairs(logits, bitmask, at, rows, vocab_size=self.vocab_size,
                                       buffers=self.buffers, plan=plan, restore=asked)
        if restored > 0:
            metrics.HOST_CONFLICTS.inc(restored)
        return layout

    def _record(self, table: dict[int, Row], bitmask: torch.Tensor,
                rows: Sequence[int]) -> None:
        """Mask digests for comparing ranks (``MaskDigests``; a debug setting)."""
        assert self.digests is not None
        self.digests.observe(bitmask, [
            (i, row_key(r.request.spec.key, r.output[:r.seen],
                        r.grammar.backend if r.grammar is not None else "")
             if r is not None else "?")
            for i in rows for r in [table.get(i)]])

    def _asked(self, table: dict[int, Row], listed: list[int],
               at: np.ndarray[Any, Any] | None, owners: np.ndarray[Any, Any] | None
               ) -> list[tuple[int, int]]:
        """(logits row, mask row) of the pairs whose row asked that the grammar win over
        the host's own processors (``host_masks``)."""
        spots = listed if at is None else at.tolist()
        belong = listed if owners is None else owners.tolist()
        asked = [(spot, mask_row) for spot, mask_row, row in zip(spots, listed, belong,
                                                                 strict=True)
                 if (r := table.get(row)) is not None and r.host_masks]
        if not asked and not any(r.host_masks for r in table.values()):
            self._host_masks_seen = False  # the rows that asked have left the batch
        return asked


class Mapped(NamedTuple):
    """``logits[logits_rows[i]]`` takes row ``rows[i]``'s mask (both distinct, of equal
    length): vLLM's V2 runner, whose rows are request slots and logits in batch order."""

    logits_rows: Sequence[int]
    rows: Sequence[int]


class AlongDrafts(NamedTuple):
    """Speculative decoding: logits row ``i`` belongs to processor row ``rows[i]`` (-1 or a
    row not sampling: left alone) at draft position ``positions[i]`` (0: the committed state;
    k: after the first k draft tokens; the last: the bonus position), and ``inputs[i]`` is
    the token fed at that logits row (the draft tokens of positions 1.. are the inputs of
    the rows before them). One entry per logits row in each."""

    rows: Sequence[int]
    positions: Sequence[int]
    inputs: Sequence[int]


#: How a host's logits rows take the processor's rows: None, logits row ``i`` is row ``i``.
HostRows = Mapped | AlongDrafts | None


@dataclass
class _Ended:
    """A step whose masks an apply took; later applies of the same step take theirs."""

    step: StepMasks
    rows: set[int]  # its masked rows still held by the request they were filled for
    drafts: int = 0  # draft positions the step's chunks placed so far


class StepApply:
    """The apply side of a step. The rows are the processor's row table's (each call is
    handed them: this side keeps none); the CPU layout the next job plans for is the step
    jobs' (``StepJobs.applied`` is told what this apply read)."""

    def __init__(self, jobs: StepJobs, logits: HostLogits, drafts: Drafts) -> None:
        self._jobs = jobs
        self._logits = logits
        self._drafts = drafts
        self._ended: _Ended | None = None

    def end(self) -> None:
        """A new step or a mutation: the ended step's masks no longer hold."""
        self._ended = None

    def forget(self, row: int) -> None:
        """``row`` left: the ended step's mask for it is not its new request's."""
        if self._ended is not None:
            self._ended.rows.discard(row)

    def into_logits(self, table: dict[int, Row], logits: torch.Tensor,
                    host_rows: HostRows) -> None:
        """The step's masks into ``logits``, laid out as ``host_rows`` says: the layout
        becomes pairs (waiting for the step's fill), then one masking call."""
        pairs = (self._batch(table) if host_rows is None
                 else self._mapped(table, *host_rows) if isinstance(host_rows, Mapped)
                 else self._drafts_of(table, *host_rows))
        if pairs is not None:
            layout = self._logits.mask_into(table, logits, pairs)
            self._jobs.applied(layout)

    def wait(self, table: dict[int, Row], rows: Collection[int] | None
             ) -> tuple[torch.Tensor, list[int]]:
        """The step's bitmask and its rows (``BatchProcessor.wait_masks``)."""
        self._ended = None
        step = self._jobs.wait(table, rows)
        return step.bitmask, step.rows

    def _batch(self, table: dict[int, Row]) -> Pairs | None:
        """Logits row ``i`` takes row ``i``'s mask."""
        self._ended = None
        bitmask, rows, plan = self._jobs.wait_for_apply(table)
        return Pairs(bitmask, None, rows, plan) if rows else None

    def _mapped(self, table: dict[int, Row], logits_rows: Sequence[int], rows: Sequence[int]
                ) -> Pairs | None:
        """``Mapped``: from the step's masks, or the ended step's for a later chunk."""
        ended = self._reusable(rows)
        if ended is None:
            step = self._jobs.wait_for_apply(table, rows)
            ended = self._ended = _Ended(step, set(step.rows))
        return self._logits.mapped(ended.step, logits_rows, rows)

    def _drafts_of(self, table: dict[int, Row], rows: Sequence[int],
                   positions: Sequence[int], inputs: Sequence[int]) -> Pairs | None:
        """``AlongDrafts``: each row's masks follow its drafts (``Drafts.place``) in rows of
        the step's bitmask above those it uses; the committed positions take the step's
        masks as ``Mapped`` rows do."""
        self._jobs.make_rows_now(table)
        sampling = {int(r) for r in rows if int(r) in table}
        ended = self._reusable(sampling)
        if ended is None:
            step = self._jobs.wait_for_apply(table, sorted(sampling))
            ended = self._ended = _Ended(step, set(step.rows))
        step = ended.step
        # draft positions right after the highest row this step uses: a device copy of the
        # bitmask then spans the rows in use, not every row of a sparse batch; a later chunk
        # of the step places its own above the earlier chunks' (a device copy of those may
        # not have run yet)
        base = max(step.rows[-1] if step.rows else -1, max(sampling, default=-1)) + 1
        base += ended.drafts
        ended.drafts += len(rows)
        bitmask = self._jobs.buffers.room(step.bitmask, base, len(rows))
        placed = self._drafts.place(table, step.rows, bitmask, base, rows, positions,
                                    inputs, sampling)
        if not placed.at.size:
            return None
        return Pairs(bitmask, placed.at, placed.rows, None if placed.stale else step.plan,
                     placed.owners, placed.committed)

    def _reusable(self, rows: Collection[int]) -> _Ended | None:
        """The ended step, when it still holds every one of ``rows`` (and no step began)."""
        ended = self._ended
        if ended is None or self._jobs.in_flight is not None or not ended.rows.issuperset(rows):
            return None
        return ended


class Drafts:
    """Fills draft positions on the host's thread (between the step's fill and the apply)."""

    def __init__(self, first: FirstMasks, row_masks: RowMasks, stats: FillStats) -> None:
        self.first = first
        self.row_masks = row_masks
        self.stats = stats

    def place(self, table: dict[int, Row], masked: Sequence[int], bitmask: torch.Tensor,
              base: int, rows: Sequence[int], positions: Sequence[int],
              inputs: Sequence[int], sampling: set[int]) -> DraftMasks:
        """Each row's masks along its drafts (``AlongDrafts``: logits row
        ``i`` is row ``rows[i]`` at draft position ``positions[i]``, fed ``inputs[i]``), in
        the step's ``bitmask``: a committed position at its row's own mask (``masked``: the
        rows the step masked), the draft positions in rows ``base``, ``base + 1``, ... (above
        every row of ``masked`` and ``rows``; the bitmask has one for each logits row).
        ``sampling``: the rows of ``rows`` in ``table`` (the others are left alone)."""
        ready = set(masked)
        placed: dict[int, list[tuple[int, int]]] = {}
        for at, (row, pos) in enumerate(zip(rows, positions, strict=True)):
            if int(row) in sampling:
                placed.setdefault(int(row), []).append((int(pos), at))
        committed: list[tuple[int, int]] = []  # (mask row, logits row)
        others: list[tuple[int, int, int]] = []  # (logits row, mask row, owner)
        spare = base
        stale = False
        for row, spots in placed.items():
            ats = [at for _, at in sorted(spots)]
            if len(ats) > 1:
                r = table[row]
                errored = r.error is not None
                if row not in ready:
                    bitmask[row].fill_(-1)  # ``fill`` reads the committed mask here
                mask_rows = [row, *range(spare, spare + len(ats) - 1)]
                spare += len(ats) - 1
                self.fill(r, [int(inputs[at]) for at in ats[1:]], bitmask, mask_rows)
                others += [(at, m, row) for at, m in zip(ats[1:], mask_rows[1:], strict=True)]
                if row not in ready or (r.error is not None) != errored:
                    others.append((ats[0], row, row))  # unmasked by the step, or rewritten
                    stale = stale or row in ready
                    continue
            if row in ready:
                committed.append((row, ats[0]))
        committed.sort()
        pairs = [(at, row, row) for row, at in committed] + others
        n = len(pairs)
        return DraftMasks(np.fromiter((p[0] for p in pairs), np.intp, n),
                          np.fromiter((p[1] for p in pairs), np.intp, n),
                          np.fromiter((p[2] for p in pairs), np.intp, n), len(committed), stale)

    def fill(self, r: Row, drafts: Sequence[int], out: torch.Tensor,
             out_rows: Sequence[int]) -> None:
        """``out[out_rows[k + 1]]`` gets the mask of the position after ``drafts[:k + 1]``;
        ``out[out_rows[0]]`` already holds the committed position's (from ``wait_masks``, or
        all ones for a row it did not list). Draft tokens are fed tentatively and rolled
        back, so the row keeps its committed state. The rules are vLLM's own: a position
        still inside the thinking section is free (all ones, or the marker-boundary guard);
        after a draft token the grammar refuses, every later position repeats the last valid
        mask (which already refuses that token, so the rejection sampler rejects it there and
        no later row is used); after a placeholder (negative id) positions are free; an
        errored row gets its error mask everywhere."""
        fed = 0
        gate = r.gate
        opened = gate is not None and gate.thinking
        thought = gate.thinking_tokens if gate is not None else 0
        prev = out_rows[0]
        refused = free = False
        row_masks = self.row_masks
        try:
            for tid, target in zip(drafts, out_rows[1:], strict=True):
                if r.error is not None:
                    row_masks.error_or_free(out, target)
                elif free or tid < 0:
                    free = True
                    out[target].fill_(-1)
                elif refused:
                    out[target].copy_(out[prev])
                else:
                    accepted, took = self._feed_tentatively(r, int(tid))
                    fed += took
                    if not accepted:
                        refused = True
                        out[target].copy_(out[prev])
                    else:
                        self._fill_position(r, out, target)
                        prev = target
        except Exception as exc:  # a bug of ours: this row alone ends
            r.fail(f"speculative masks failed: {type(exc).__name__}: {exc}", cause="drafts")
            for target in out_rows:
                row_masks.error_or_free(out, target)
        finally:
            try:
                if fed:
                    assert r.matcher is not None
                    r.matcher.rollback(fed)
                if opened:  # every constrained token since is a draft's, undone above
                    assert gate is not None
                    gate.rollback(gate.thinking_tokens - thought, emptied=True)
            except Exception as exc:
                r.fail(f"undoing draft tokens failed: {type(exc).__name__}: {exc}",
                       cause="drafts")

    def _feed_tentatively(self, r: Row, tid: int) -> tuple[bool, int]:
        """Feed one draft token: (accepted, matcher tokens taken). A token that ends
        reasoning and is content (an implicit end) goes on to the matcher, as committed
        tokens do (``Row.advance``)."""
        gate = r.gate
        if gate is not None and gate.thinking:
            taken = gate.feed([tid])
            if gate.leftover:  # would end the marker mid-token: refused
                return False, 0
            if not gate.thinking and r.matcher is None:
                self.first.attach_all([r])  # thinking ends inside the window
            if not taken:
                return True, 0
        if r.matcher is None:
            return False, 0
        accepted = r.matcher.accept(tid)
        return accepted, int(accepted)

    def _fill_position(self, r: Row, out: torch.Tensor, target: int) -> None:
        if r.error is not None:
            self.row_masks.error_or_free(out, target)
        elif r.gate is not None and r.gate.thinking:
            if not self.row_masks.guard(r.gate, out, target):
                out[target].fill_(-1)
        elif r.matcher is not None:
            r.matcher.fill(out, target)
            self.stats.rows_filled += 1
        else:
            out[target].fill_(-1)


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
