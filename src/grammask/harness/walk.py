"""Driving a matcher: feed known texts, take random walks under the mask, audit masks.

The audit checks a mask against the matcher's own ``accept`` (a fork is offered each sampled
token, so the two code paths of each backend, mask computation and token consumption, are
held against each other) and, when the spec has a prefix oracle (regex, choice), against the
oracle. Offering all 151,936 tokens at every step would cost seconds per step, so an audited
step offers every allowed token up to ``audit_tokens`` (a random subset beyond that), a
random ``audit_tokens`` of the forbidden ones, every stop token and a few special tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..backends import Matcher
from ..kernels.bitmask import allocate_bitmask
from ..vocab import Vocabulary

#: Examples kept per report (the counts are exact; examples are for reading).
MAX_EXAMPLES = 5


class PrefixOracle(Protocol):
    def viable(self, data: bytes) -> bool | None: ...

    def complete(self, data: bytes) -> bool | None: ...

    def dialects(self, data: bytes, *, complete: bool) -> dict[str, bool | None]: ...


# ----------------------------------------------------------------------- token table
TIER_CLOSER, TIER_OTHER, TIER_OPENER, TIER_SPACE, TIER_SPECIAL = 1, 2, 3, 4, 5


@dataclass
class TokenTable:
    """Per-vocabulary arrays the walks need (built once per vocabulary)."""

    vocab: Vocabulary
    tokens: tuple[bytes, ...]
    vocab_size: int
    stop_ids: np.ndarray[Any, np.dtype[np.int64]]
    special: np.ndarray[Any, np.dtype[np.bool_]]
    tier: np.ndarray[Any, np.dtype[np.int8]]
    stop_set: frozenset[int]
    nonstop_special: np.ndarray[Any, np.dtype[np.bool_]]
    length: np.ndarray[Any, np.dtype[np.int64]]
    closers: np.ndarray[Any, np.dtype[np.int64]]  # ids of the closer tier
    separators: np.ndarray[Any, np.dtype[np.int64]]  # ids of a lone "," or ":"

    @classmethod
    def build(cls, vocab: Vocabulary) -> TokenTable:
        n = vocab.vocab_size
        special = np.zeros(n, dtype=bool)
        special[[i for i in vocab.special_ids if i < n]] = True
        special[len(vocab.tokens):] = True  # model padding: never text
        tier = np.full(n, TIER_SPECIAL, dtype=np.int8)
        for i, tok in enumerate(vocab.tokens):
            if special[i]:
                continue
            if tok and all(b in b'"}]' for b in tok):
                tier[i] = TIER_CLOSER
            elif tok and all(b in b" \t\r\n" for b in tok):
                tier[i] = TIER_SPACE
            elif b"[" in tok or b"{" in tok:
                tier[i] = TIER_OPENER
            else:
                tier[i] = TIER_OTHER
        stops = np.array(sorted(vocab.stop_ids), dtype=np.int64)
        nonstop = special.copy()
        nonstop[stops] = False
        length = np.zeros(n, dtype=np.int64)
        length[: len(vocab.tokens)] = [len(t) for t in vocab.tokens]
        closers = np.flatnonzero(tier == TIER_CLOSER)
        separators = np.array([i for i, t in enumerate(vocab.tokens)
                               if t in (b",", b":") and not special[i]], dtype=np.int64)
        return cls(vocab, tuple(vocab.tokens), n, stops, special, tier,
                   frozenset(int(s) for s in stops), nonstop, length, closers, separators)

    def is_special(self, token: int) -> bool:
        return bool(self.special[token])

    def text(self, token: int) -> bytes:
        return self.tokens[token] if token < len(self.tokens) else b""


_TABLES: dict[int, TokenTable] = {}


def token_table(vocab: Vocabulary) -> TokenTable:
    table = _TABLES.get(id(vocab))
    if table is None or table.vocab is not vocab:
        table = _TABLES[id(vocab)] = TokenTable.build(vocab)
    return table


class MaskReader:
    """Fills one bitmask row and unpacks it to a bool array (bit set = allowed)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.buf: torch.Tensor = allocate_bitmask(1, vocab_size)

    def read(self, matcher: Matcher) -> np.ndarray[Any, np.dtype[np.bool_]]:
        self.buf.fill_(0)
        matcher.fill(self.buf, 0)
        raw = self.buf[0].numpy().view(np.uint8)
        return np.unpackbits(raw, bitorder="little")[: self.vocab_size].astype(bool)


# ----------------------------------------------------------------------------- report
@dataclass
class AuditReport:
    """Counts over every audited step and fed token of one (spec, backend)."""

    steps: int = 0
    tokens: int = 0
    allowed_refused: int = 0  # mask allows, accept refuses
    forbidden_taken: int = 0  # mask forbids, accept takes
    special_allowed: int = 0  # a non-stop special or padding id allowed
    stop_inconsistent: int = 0  # stop bit disagrees with can_terminate()
    empty_masks: int = 0  # nothing allowed, not even a stop token
    oracle_tokens: int = 0
    oracle_over: int = 0  # oracle: viable; mask: forbidden
    oracle_under: int = 0  # oracle: not viable; mask: allowed
    oracle_dialect: int = 0  # disagreement explained by a regex dialect flag
    oracle_undecided: int = 0
    noncanonical: int = 0  # forbidden, but a longer allowed token spells it (see below)
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def mismatches(self) -> int:
        return (self.allowed_refused + self.forbidden_taken + self.special_allowed
                + self.stop_inconsistent + self.empty_masks)

    def example(self, kind: str, prefix: bytes, token: int, table: TokenTable) -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"kind": kind, "prefix": _show(prefix[-60:]), "token": token,
                                  "token_text": _show(table.text(token))})

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "examples"}
        out["mismatches"] = self.mismatches
        out["examples"] = list(self.examples)
        return out


def _show(data: bytes) -> str:
    return data.decode("utf-8", "backslashreplace")


# ------------------------------------------------------------------------------ audit
class LongerPrefixes:
    """Whether the mask forbids a token that spells the same forced text as an allowed one.

    llguidance allows only the canonical tokenization of forced text (after ``{"`` with one
    possible key it allows ``name`` and forbids ``nam``; for ``GeometryPresentation`` it may
    allow ``ent`` and forbid ``enta``) while ``accept`` takes the others: a deliberate
    narrowing, counted apart from mismatches. The token counts as such when an allowed token
    starts with it or is a proper prefix of it. Decided only for masks allowing at most
    ``limit`` tokens (forced text allows few); the sets are built on first use."""

    def __init__(self, bits: np.ndarray[Any, np.dtype[np.bool_]], table: TokenTable,
                 limit: int = 5000) -> None:
        self._bits, self._table, self._limit = bits, table, limit
        self._prefixes: set[bytes] | None = None
        self._allowed: set[bytes] = set()

    def __call__(self, token: int) -> bool:
        if self._prefixes is None:
            self._prefixes = set()
            allowed = np.flatnonzero(self._bits)
            if allowed.size <= self._limit:
                for a in allowed.tolist():
                    u = self._table.text(a)
                    self._allowed.add(u)
                    self._prefixes.update(u[:k] for k in range(1, len(u)))
        text = self._table.text(token)
        if not text:
            return False
        return text in self._prefixes or any(
            text[:k] in self._allowed for k in range(1, len(text)))


def audit_step(matcher: Matcher, table: TokenTable, bits: np.ndarray[Any, np.dtype[np.bool_]],
               prefix: bytes, rng: np.random.Generator, audit_tokens: int,
               oracle: PrefixOracle | None, report: AuditReport) -> None:
    """Hold one mask against forked ``accept`` calls and, if given, a prefix oracle.

    Special (non-stop) tokens and padding ids are checked on the mask alone (all of them):
    offering them to xgrammar's ``accept`` only makes it log a warning per token."""
    report.steps += 1
    banned = bits & table.nonstop_special
    if banned.any():
        report.special_allowed += int(banned.sum())
        report.example("special token or padding id allowed", prefix,
                       int(np.argmax(banned)), table)
    text_ok = ~table.nonstop_special
    allowed = np.flatnonzero(bits & text_ok)
    forbidden = np.flatnonzero(~bits & text_ok)
    if allowed.size > audit_tokens:
        allowed = rng.choice(allowed, audit_tokens, replace=False)
    if forbidden.size > audit_tokens:
        forbidden = rng.choice(forbidden, audit_tokens, replace=False)
    candidates = np.unique(np.concatenate([allowed, forbidden, table.stop_ids]))
    can_end = matcher.can_terminate()
    covered = LongerPrefixes(bits, table)
    probe = matcher.fork()
    complete = oracle.complete(prefix) if oracle is not None else None
    for tid in candidates.tolist():
        bit = bool(bits[tid])
        report.tokens += 1
        taken = probe.accept(tid)
        if taken:
            probe.rollback(1)
        if bit and not taken:
            report.allowed_refused += 1
            report.example("mask allows, accept refuses", prefix, tid, table)
        elif taken and not bit:
            if covered(tid):
                report.noncanonical += 1
            else:
                report.forbidden_taken += 1
                report.example("mask forbids, accept takes", prefix, tid, table)
        is_stop = tid in table.stop_set
        if is_stop and bit != can_end:
            report.stop_inconsistent += 1
            report.example("stop bit != can_terminate()", prefix, tid, table)
        if oracle is None:
            continue
        report.oracle_tokens += 1
        data = prefix if is_stop else prefix + table.text(tid)
        verdict = complete if is_stop else oracle.viable(data)
        if verdict is None:
            report.oracle_undecided += 1
        elif verdict != bit:
            if any(v == bit for v in oracle.dialects(data, complete=is_stop).values()):
                report.oracle_dialect += 1
            elif bit:
                report.oracle_under += 1
                report.example("oracle: not viable, mask allows", prefix, tid, table)
            elif covered(tid):
                report.noncanonical += 1
            else:
                report.oracle_over += 1
                report.example("oracle: viable, mask forbids", prefix, tid, table)


# ------------------------------------------------------------------------------- feed
@dataclass(frozen=True)
class FeedResult:
    accepted: bool  # every token and then a stop token accepted
    rejected_at: int | None  # index of the refused token (len(ids) = the stop token)
    context: str = ""


def feed(matcher: Matcher, table: TokenTable, ids: Sequence[int], reader: MaskReader | None,
         report: AuditReport, *, mask_tokens: int = 128) -> FeedResult:
    """Offer ``ids`` then a stop token; with ``reader``, also check the mask bit of each of
    the first ``mask_tokens`` tokens and of the stop token (a fill per token is the cost)."""
    prefix = b""
    last = len(ids)
    for i, tid in enumerate([*ids, int(table.stop_ids[0])]):
        check = reader is not None and (i < mask_tokens or i == last)
        bits = reader.read(matcher) if reader is not None and check else None
        ok = matcher.accept(tid)
        if bits is not None:
            bit = bool(bits[tid])
            report.tokens += 1
            if bit and not ok:
                report.allowed_refused += 1
                report.example("mask allows, accept refuses", prefix, tid, table)
            elif ok and not bit:
                if LongerPrefixes(bits, table)(tid):
                    report.noncanonical += 1
                else:
                    report.forbidden_taken += 1
                    report.example("mask forbids, accept takes", prefix, tid, table)
        if not ok:
            return FeedResult(False, i, _show(prefix[-40:]) + " >>" + _show(table.text(tid)))
        prefix += table.text(tid)
    return FeedResult(True, None)


# ------------------------------------------------------------------------------- walk
@dataclass
class Walk:
    ids: list[int]
    data: bytes
    finished: bool  # ended with an accepted stop token
    broken: bool = False  # the mask allowed a token accept refused, or allowed nothing
    truncated: bool = False  # ended by stepping back to the latest point it could end


def choose(bits: np.ndarray[Any, np.dtype[np.bool_]], table: TokenTable,
           rng: np.random.Generator, *, finish: bool, matcher: Matcher | None = None) -> int | None:
    """A random allowed token. Free mode: uniform over allowed non-stop tokens. Finish mode:
    a stop token if allowed; else (with ``matcher``) a token after which the grammar could
    end, looked for among the allowed one-byte tokens and a few others; else the first
    non-empty tier (closers, one-byte plain, plain, openers, whitespace). Walks then end
    within a few hundred tokens for almost every spec."""
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        return None
    tiers = table.tier[allowed]
    if finish:
        stops = [int(s) for s in table.stop_ids if bits[s]]
        if stops:
            return int(rng.choice(stops))
        if matcher is not None:
            ending = _ending_token(matcher, allowed[tiers != TIER_SPECIAL], table, rng)
            if ending is not None:
                return ending
        closers = allowed[tiers == TIER_CLOSER]
        if closers.size:
            return int(rng.choice(closers))
        plain = allowed[tiers == TIER_OTHER]
        short = plain[table.length[plain] == 1]
        for pool in (short, plain, allowed[tiers == TIER_OPENER], allowed[tiers == TIER_SPACE]):
            if pool.size:
                return int(rng.choice(pool))
    pool = allowed[tiers != TIER_SPECIAL]
    if pool.size:
        return int(rng.choice(pool))
    return int(rng.choice(allowed))


def _ending_token(matcher: Matcher, pool: np.ndarray[Any, np.dtype[np.int64]],
                  table: TokenTable, rng: np.random.Generator, limit: int = 64) -> int | None:
    """One-step lookahead: an allowed token after which a stop token would be allowed."""
    if pool.size == 0:
        return None
    short = pool[table.length[pool] == 1].tolist()
    rest = rng.choice(pool, min(16, pool.size), replace=False).tolist()
    candidates = list(dict.fromkeys([*short, *rest]))
    rng.shuffle(candidates)
    probe = matcher.fork()
    for tid in candidates[:limit]:
        if probe.accept(tid):
            ends = probe.can_terminate()
            probe.rollback(1)
            if ends:
                return int(tid)
    return None


def random_walk(matcher: Matcher, table: TokenTable, reader: MaskReader,
                rng: np.random.Generator, *, max_tokens: int, free_steps: int,
                audit_steps: set[int], audit_tokens: int, oracle: PrefixOracle | None,
                report: AuditReport, prefix_ids: Sequence[int] = (),
                budget_s: float | None = None) -> Walk:
    """Sample under the mask (auditing the steps in ``audit_steps``) until a stop token, or
    until ``max_tokens`` / ``budget_s`` run out (then see ``_end_at``)."""
    ids = list(prefix_ids)
    data = b"".join(table.text(t) for t in ids)
    last_end: int | None = None  # the latest length at which a stop token was allowed
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for step in range(max_tokens + 1):
        if deadline is not None and time.monotonic() > deadline:
            break
        bits = reader.read(matcher)
        if step in audit_steps:
            audit_step(matcher, table, bits, data, rng, audit_tokens, oracle, report)
        if bits[table.stop_ids].any():
            last_end = len(ids)
        if step == max_tokens:
            break
        token = choose(bits, table, rng, finish=step >= free_steps, matcher=matcher)
        if token is None:
            report.empty_masks += 1
            report.example("empty mask", data, -1, table)
            return Walk(ids, data, False, broken=True)
        if not matcher.accept(token):
            report.allowed_refused += 1
            report.example("mask allows, accept refuses", data, token, table)
            return Walk(ids, data, False, broken=True)
        if token in table.stop_set:
            return Walk(ids, data, True)
        ids.append(token)
        data += table.text(token)
    return _end_at(matcher, table, ids, last_end)


def _end_at(matcher: Matcher, table: TokenTable, ids: list[int], end: int | None) -> Walk:
    """Out of tokens: step back to the latest point where the grammar could end, and end
    there (grammars such as ``root ::= (expr "=" term "\\n")+`` rarely end by chance)."""
    data = b"".join(table.text(t) for t in ids)
    if end is None:
        return Walk(ids, data, False)
    if end < len(ids):
        matcher.rollback(len(ids) - end)
        ids = ids[:end]
        data = b"".join(table.text(t) for t in ids)
    stop = int(table.stop_ids[0])
    if not matcher.accept(stop):
        return Walk(ids, data, False, broken=True)
    return Walk(ids, data, True, truncated=True)


# ------------------------------------------------------------------------ dead ends
Judge = Any  # ``diff.Judge``: (complete output, declared gaps) -> Verdict | None


@dataclass
class ProbeReport:
    """The dead-end probe over sampled states of the walks of one (spec, backend).

    At a probed state each token of a sample of the allowed ones (one per distinct first
    byte, so ``,`` and ``}`` after a value are both tried) is taken on a fork, and a
    finishing walk (``choose(finish=True)``) looks for a way to end from there. A token after
    which a try meets an empty mask, a backend that lost the parse (llguidance's error
    state, which then allows only the stop token), or only whitespace once its tokens run
    out (what llguidance offers after a ``,`` that no key can follow) is a ``dead_end``; one
    whose ending fails the item's oracle outside the declared gaps is an ``invalid_end``.
    A token after which every try ran out of tokens while its text still moved on (a large
    schema's required members) is ``unfinished``: not a finding."""

    states: int = 0
    tokens: int = 0
    dead_ends: int = 0
    invalid_ends: int = 0
    unjudged: int = 0
    unfinished: int = 0  # no try ended within the tokens, while the text still moved on
    examples: list[dict[str, Any]] = field(default_factory=list)

    def example(self, kind: str, prefix: bytes, token: int, table: TokenTable,
                detail: str = "") -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"kind": kind, "prefix": _show(prefix[-80:]), "token": token,
                                  "token_text": _show(table.text(token)), "detail": detail})

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if k == "examples" else v) for k, v in self.__dict__.items()}


def probe_tokens(bits: np.ndarray[Any, np.dtype[np.bool_]], table: TokenTable,
                 rng: np.random.Generator, limit: int) -> list[int]:
    """Allowed tokens to probe: one per distinct first byte (the stop tokens apart), the
    structural bytes ``,:}]"`` first, at most ``limit``."""
    allowed = np.flatnonzero(bits & ~table.special)
    by_byte: dict[int, list[int]] = {}
    for tid in rng.permutation(allowed).tolist():
        text = table.text(tid)
        if text:
            by_byte.setdefault(text[0], []).append(tid)
    firsts = list(by_byte)
    rng.shuffle(firsts)
    firsts.sort(key=lambda b: b not in b',:}]"')
    return [by_byte[b][0] for b in firsts[:limit]]


def probe_state(matcher: Matcher, table: TokenTable, reader: MaskReader, prefix: bytes,
                rng: np.random.Generator, judge: Judge | None, gaps: tuple[str, ...],
                report: ProbeReport, *, tokens: int = 12, depth: int = 160,
                tries: int = 2) -> None:
    """Probe one state (``matcher`` is left as it was: forks do the work)."""
    report.states += 1
    bits = reader.read(matcher)
    for tid in probe_tokens(bits, table, rng, tokens):
        report.tokens += 1
        outcome, detail = "long", ""
        for _ in range(tries):
            fork = matcher.fork()
            if not fork.accept(tid):
                outcome = "refused"  # the audit's business (mask allows, accept refuses)
                break
            ended, how = _finish(fork, table, reader, rng, depth)
            failure = getattr(fork, "failure", None)
            if failure is not None:
                outcome, detail = "dead", f"the backend lost the parse: {failure}"[:200]
                break
            if ended is None:
                if how != "long":
                    outcome, detail = "dead", how
                    break
                continue  # out of tokens while the text still moves on: try again
            data = prefix + table.text(tid) + ended
            verdict = judge(data, gaps) if judge is not None else None
            if verdict is None or verdict.reason == "oracle-error":
                outcome = "unjudged"
                break
            if verdict.valid or verdict.known_gap:
                outcome = "ok"
                break
            outcome, detail = "invalid", f"{verdict.reason}: {verdict.detail}"[:200]
            break
        if outcome == "dead":
            report.dead_ends += 1
            report.example("no way to end after the token", prefix, tid, table, detail)
        elif outcome == "invalid":
            report.invalid_ends += 1
            report.example("the only ending after the token is invalid", prefix, tid, table,
                           detail)
        elif outcome == "unjudged":
            report.unjudged += 1
        elif outcome == "long":
            report.unfinished += 1


def _finish(matcher: Matcher, table: TokenTable, reader: MaskReader,
            rng: np.random.Generator, depth: int) -> tuple[bytes | None, str]:
    """The text of a finishing walk that ends (a stop token accepted), or None and why:
    ``empty mask``, ``refused``, ``only whitespace`` (the mask allows nothing else when the
    tokens run out: text that can never end) or ``long`` (the text still moved on)."""
    out = b""
    for _ in range(depth):
        bits = reader.read(matcher)
        token = _separator(bits, table) if not bits[table.stop_ids].any() else None
        if token is None:
            token = choose(bits, table, rng, finish=True, matcher=matcher)
        if token is None:
            return None, "empty mask"
        if not matcher.accept(token):
            return None, "refused"
        if token in table.stop_set:
            return out, "ended"
        out += table.text(token)
    bits = reader.read(matcher)
    text = bits & ~table.special
    if text.any() and not bits[table.stop_ids].any() and (
            table.tier[np.flatnonzero(text)] == TIER_SPACE).all():
        return None, "only whitespace"
    return None, "long"


def _separator(bits: np.ndarray[Any, np.dtype[np.bool_]], table: TokenTable) -> int | None:
    """A lone ``,`` or ``:`` when the mask allows one and no closer: it moves on to the next
    required member, where digits or letters could go on for long (``multipleOf``)."""
    if bits[table.closers].any():
        return None
    for tid in table.separators:
        if bits[tid]:
            return int(tid)
    return None


def probe_walk(grammar_matcher: Any, table: TokenTable, reader: MaskReader, walk: Walk,
               rng: np.random.Generator, judge: Judge | None, gaps: tuple[str, ...],
               report: ProbeReport, *, states: int = 2, tokens: int = 12,
               depth: int = 160) -> None:
    """Probe ``states`` states of a walk (finished or not): about half right after a token
    that ends a value (``"``, ``]``, ``}``, a digit, a literal's last letter: where ``,``
    and closers compete), the rest anywhere; ``grammar_matcher`` makes fresh matchers."""
    ids = walk.ids
    if states <= 0:
        return
    ends = [i + 1 for i, t in enumerate(ids)
            if table.text(t)[-1:] in (b'"', b"]", b"}", b"e", b"l") or
            table.text(t)[-1:].isdigit()]
    picks: list[int] = []
    if ends:
        picks += rng.choice(ends, min(len(ends), (states + 1) // 2), replace=False).tolist()
    rest = states - len(picks)
    if rest > 0:
        picks += rng.choice(len(ids) + 1, min(rest, len(ids) + 1), replace=False).tolist()
    for at in sorted(set(int(p) for p in picks)):
        matcher = grammar_matcher()
        if not all(matcher.accept(t) for t in ids[:at]):
            continue
        prefix = b"".join(table.text(t) for t in ids[:at])
        probe_state(matcher, table, reader, prefix, rng, judge, gaps, report, tokens=tokens,
                    depth=depth)
