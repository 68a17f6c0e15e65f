"""Differential: both backends' masks on the same prefix, differences classified.

A walk is sampled under one backend (the leader) while the other follows the same tokens.
At audited steps the two masks are compared whole. Each differing token is put in a class
by where it occurs (JSON context of the prefix) and what it is:

- ``non-canonical``: the forbidding side allows a longer token spelling the same bytes
  (llguidance narrows forced text to its canonical tokens);
- ``special/stop``: a stop or special token;
- ``whitespace``: the token starts with whitespace (backends bound whitespace runs differently);
- ``key``: where an object key starts or continues (property order, undeclared keys);
- ``number``: inside or at the start of a number (``-0``, exponents, ``1.0`` for integers);
- ``string``: inside a string value (escapes, lengths, patterns, formats);
- ``other``.

Then up to ``resolve`` differing tokens per step are *resolved* with an oracle: the side that
allows the token accepts it and finishes the output (finish-mode walk); a complete output the
oracle accepts means the other side over-constrains there, one the oracle rejects means the
allowing side under-constrains (``known gap`` when a declared unenforced keyword explains it).
That is how a real bug is told from a style difference.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends import Matcher
from .oracles import Verdict
from .walk import (
    MAX_EXAMPLES,
    AuditReport,
    LongerPrefixes,
    MaskReader,
    TokenTable,
    choose,
    random_walk,
)

#: A complete-output oracle: (output bytes, the allowing side's unenforced list) -> Verdict.
Judge = Callable[[bytes, tuple[str, ...]], Verdict | None]


def json_context(prefix: bytes) -> str:
    """Where a JSON prefix stands: key, string, number, value, after-value (or other)."""
    stack: list[str] = []
    state = "value"
    in_string = escape = is_key = False
    for ch in prefix.decode("utf-8", "replace"):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                state = "colon" if is_key else "after-value"
            continue
        if ch in " \t\r\n":
            if state == "number":
                state = "after-value"
            continue
        if ch == '"':
            in_string = True
            is_key = state == "key"
        elif ch == "{":
            stack.append("{")
            state = "key"
        elif ch == "[":
            stack.append("[")
            state = "value"
        elif ch in "}]":
            if stack:
                stack.pop()
            state = "after-value"
        elif ch == ":":
            state = "value"
        elif ch == ",":
            state = "key" if stack and stack[-1] == "{" else "value"
        elif ch in "-+.eE0123456789" and state in ("value", "number"):
            state = "number"
        elif state == "number":
            state = "other"
        elif state == "value":
            state = "literal"
    if in_string:
        return "key" if is_key else "string"
    return state


def classify(token_text: bytes, special: bool, context: str) -> str:
    if special:
        return "special/stop"
    if context in ("key", "string"):  # whitespace inside a string is content
        return context
    if token_text[:1] in (b" ", b"\t", b"\n", b"\r"):
        return "whitespace"
    if context == "number" or (context == "value" and token_text[:1].isdigit()) or (
            context == "value" and token_text[:1] == b"-"):
        return "number"
    return "other"


@dataclass
class DiffReport:
    steps: int = 0
    steps_differ: int = 0
    tokens_differ: int = 0
    classes: Counter[str] = field(default_factory=Counter)
    resolved: Counter[str] = field(default_factory=Counter)
    resolved_by_class: Counter[str] = field(default_factory=Counter)
    divergences: int = 0  # the follower refused a token the leader took
    budget_hit: int = 0  # walks cut short by the time budget
    examples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "steps_differ": self.steps_differ,
                "tokens_differ": self.tokens_differ, "classes": dict(self.classes),
                "resolved": dict(self.resolved),
                "resolved_by_class": dict(self.resolved_by_class),
                "divergences": self.divergences,
                "budget_hit": self.budget_hit,
                "examples": self.examples}


def _resolve(allowing: Matcher, token: int, prefix: bytes, table: TokenTable,
             reader: MaskReader, rng: np.random.Generator, judge: Judge,
             unenforced: tuple[str, ...], max_tokens: int) -> str:
    probe = allowing.fork()
    if not probe.accept(token):
        return "unresolved"
    if token in table.stop_set:
        data = prefix
    else:  # the probe's own audit counts are not reported
        walk = random_walk(probe, table, reader, rng, max_tokens=max_tokens, free_steps=0,
                           audit_steps=set(), audit_tokens=0, oracle=None,
                           report=AuditReport())
        if not walk.finished:
            return "unresolved"
        data = prefix + table.text(token) + walk.data
    verdict = judge(data, unenforced)
    if verdict is None:
        return "unresolved"
    if verdict.valid:
        return "other side over-constrains"
    return "allowing side: declared gap" if verdict.known_gap else "allowing side under-constrains"


def differential(leader: Matcher, follower: Matcher, names: tuple[str, str],
                 unenforced: tuple[tuple[str, ...], tuple[str, ...]], table: TokenTable,
                 rng: np.random.Generator, judge: Judge | None, report: DiffReport, *,
                 max_tokens: int, free_steps: int, audit_steps: set[int], resolve: int,
                 is_json: bool, budget_s: float = 20.0, max_resolves: int = 8) -> None:
    """One walk under ``leader`` with ``follower`` in step; masks compared at audit steps.

    Resolution walks are the expensive part on grammars whose masks take tens of ms, so at
    most ``max_resolves`` are made, each at most 64 tokens, and the walk stops comparing once
    ``budget_s`` is spent (``report.budget_hit``)."""
    reader = MaskReader(table.vocab_size)
    prefix = b""
    ids: list[int] = []
    deadline = time.monotonic() + budget_s
    resolves_left = max_resolves
    for step in range(max_tokens + 1):
        if time.monotonic() > deadline:
            report.budget_hit += 1
            return
        bits_l = reader.read(leader)
        if step in audit_steps:
            bits_f = reader.read(follower)
            report.steps += 1
            differ = np.flatnonzero(bits_l != bits_f)
            if differ.size:
                report.steps_differ += 1
                report.tokens_differ += int(differ.size)
                context = json_context(prefix) if is_json else "other"
                sample = differ if differ.size <= 500 else rng.choice(differ, 500, False)
                covered = (LongerPrefixes(bits_l, table), LongerPrefixes(bits_f, table))
                for tid in sample.tolist():
                    forbidding = covered[1] if bits_l[tid] else covered[0]
                    cls = ("non-canonical" if forbidding(tid) else
                           classify(table.text(tid), table.is_special(tid), context))
                    report.classes[cls] += 1
                if judge is not None and resolves_left > 0:
                    real: list[int] = []
                    for t in rng.permutation(differ).tolist():
                        if len(real) >= min(resolve, resolves_left):
                            break
                        if not covered[1 if bits_l[t] else 0](t):
                            real.append(t)
                    resolves_left -= len(real)
                    for tid in real:
                        side = 0 if bits_l[tid] else 1
                        allowing = leader if side == 0 else follower
                        verdict = _resolve(allowing, tid, prefix, table, reader, rng, judge,
                                           unenforced[side], min(64, max_tokens))
                        label = verdict.replace("allowing side", names[side]).replace(
                            "other side", names[1 - side])
                        report.resolved[label] += 1
                        cls = classify(table.text(tid), table.is_special(tid), context)
                        report.resolved_by_class[f"{label} | {cls}"] += 1
                        if "under" in label or "over" in label:
                            _example(report, label, prefix, tid, table, cls, ids)
        token = choose(bits_l, table, rng, finish=step >= free_steps or step == max_tokens)
        if token is None or not leader.accept(token):
            return
        if not follower.accept(token):
            report.divergences += 1
            _example(report, f"{names[1]} refuses a token {names[0]} took", prefix, token,
                     table, "divergence", ids)
            return
        if token in table.stop_set:
            return
        prefix += table.text(token)
        ids.append(token)


def _example(report: DiffReport, label: str, prefix: bytes, token: int, table: TokenTable,
             cls: str, ids: list[int]) -> None:
    """Kept with the prefix's token ids, so the step can be replayed on both backends."""
    if len(report.examples) < MAX_EXAMPLES:
        report.examples.append({
            "label": label, "class": cls,
            "prefix": prefix[-60:].decode("utf-8", "backslashreplace"), "token": token,
            "token_text": table.text(token).decode("utf-8", "backslashreplace"),
            "prefix_ids": list(ids)})
