"""Which fill thread fills which row of a batch fill (``place_fills``): backend-neutral.

Why: some backends serialize fills behind a lock that several matchers share (llguidance:
the copies of one template share its lexer, locked through each mask). Two threads filling
rows of one lock take turns, slower than one thread, so the rows of one lock must fill on one
thread; and a lock with many rows would then leave the other threads idle, so a backend that
can give a row another lock (llguidance: a copy of another template of the same grammar, its
tokens replayed: same state, same masks) spreads such a group over several *lanes*, one lock
each.

The contract. A row is described by ``(group, lane, payload)``:

- ``group``: its lock group (hashable; llguidance: the grammar its template belongs to).
  ``None``: the row has no group it can be spread over (it cannot move): it keeps its lane.
- ``lane``: the lock it fills under now within its group (``0``..; a row's lane is its own
  until it is moved).
- ``payload``: whatever the backend needs to fill it (handed back untouched).

``place_fills(rows, n)`` answers, for each of ``n`` threads, ``[(payload, lane), ...]``: the
rows that thread fills and the lane each must be on when filled (a lane other than the row's
own means: move it there first, once; it stays there for later fills). Thread 0 is the
calling thread's. The rules:

- the rows of one ``(group, lane)`` (one lock) go to one thread, in their given order;
- a group with more rows than a thread's share (``ceil(len(rows) / n)``) is spread over ``n``
  lanes of at most ``ceil(len(group) / n)`` rows each: a row keeps its lane while that lane is
  under the cap (rows on lanes ``>= n`` never do), the others move to the lowest lanes with
  room;
- the lock units go, largest first (ties in first-seen order), to the least-loaded thread
  (the lowest such).

Pure and deterministic: the same rows give the same threads in the same order. The work per
row is two tuple appends and a dict look-up or two, no call: the fill thread runs it with the
GIL held, beside a host thread that wants the GIL (``stepjob``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

P = TypeVar("P")


def place_fills(rows: Sequence[tuple[Hashable | None, int, P]], n: int
                ) -> list[list[tuple[P, int]]]:
    """``rows`` (``(group, lane, payload)`` each) by fill thread: for each of ``n`` threads
    (``n >= 1``), ``(payload, lane to fill it on)``; see the module's contract."""
    share = -(-len(rows) // n)
    groups: dict[Hashable | None, list[tuple[Hashable | None, int, P]]] = {}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
    units: dict[tuple[Hashable | None, int], list[tuple[P, int]]] = {}
    for key, group in groups.items():
        if len(group) <= share or key is None:
            for _, lane, payload in group:
                units.setdefault((key, lane), []).append((payload, lane))
            continue
        cap = -(-len(group) // n)
        count = [0] * n
        surplus: list[P] = []
        for _, lane, payload in group:
            if lane < n and count[lane] < cap:
                count[lane] += 1
                units.setdefault((key, lane), []).append((payload, lane))
            else:
                surplus.append(payload)
        lane = 0
        for payload in surplus:
            while count[lane] >= cap:
                lane += 1
            count[lane] += 1
            units.setdefault((key, lane), []).append((payload, lane))
    out: list[list[tuple[P, int]]] = [[] for _ in range(n)]
    load = [0] * n
    for unit in sorted(units.values(), key=len, reverse=True):
        k = load.index(min(load))
        out[k].extend(unit)
        load[k] += len(unit)
    return out
