"""Fill placement (``decode.fill_placement``): which fill thread fills which row, by lock.

The policy is backend-neutral and pure: rows described by ``(lock group, lane, payload)``,
answered as ``(payload, lane)`` per thread. The decode side's ``Filler`` asks a backend with
``FillLanes`` (llguidance) for its rows' groups and lanes, places them, and hands the shares
back; the end-to-end checks (masks equal row-by-row fills) are at the bottom.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import pytest
import torch

from grammask import Compiler, GrammarSpec, Vocabulary, allocate_bitmask
from grammask.backends.capabilities import LaneRow, batch_calls, lane_calls
from grammask.decode.fill import Filler, place_fills

Row = tuple[Hashable | None, int, str]


def _flat(shares: list[list[tuple[str, int]]]) -> list[str]:
    return [p for share in shares for p, _ in share]


# ---------------------------------------------------------------------------- the policy
def test_one_lock_fills_on_one_thread_in_the_given_order() -> None:
    """Every row once, its payload untouched; the rows of one (group, lane) on one thread, in
    their given order (here no group is past a thread's share: nothing moves)."""
    rows: list[Row] = [("a", 0, "a0"), ("b", 0, "b0"), ("a", 1, "a1"), ("a", 0, "a2"),
                       ("b", 0, "b1"), (None, 0, "x"), ("b", 0, "b2")]
    shares = place_fills(rows, 2)
    assert sorted(_flat(shares)) == sorted(p for *_, p in rows)
    assert [[p for p, _ in s] for s in shares] == [["b0", "b1", "b2", "x"], ["a0", "a2", "a1"]]
    assert {p: lane for s in shares for p, lane in s} == {
        "a0": 0, "a1": 1, "a2": 0, "b0": 0, "b1": 0, "b2": 0, "x": 0}


def test_a_group_within_a_threads_share_keeps_its_lanes() -> None:
    """No moves: 2 rows of a grammar with 6 rows on 3 threads (a share of 2), lanes past n
    kept too."""
    rows: list[Row] = [("a", 0, "a0"), ("a", 5, "a5"), ("b", 0, "b0"), ("b", 0, "b1"),
                       ("c", 1, "c0"), ("c", 2, "c1")]
    shares = place_fills(rows, 3)
    assert {p: lane for share in shares for p, lane in share} == {
        "a0": 0, "a5": 5, "b0": 0, "b1": 0, "c0": 1, "c1": 2}


def test_a_busy_group_is_spread_over_n_lanes() -> None:
    """7 rows of one grammar on 3 threads: lanes of at most 3 rows; a row keeps its lane
    while that lane is under the cap (lane 1's rows, lane 0's first 3), the others (lane 0's
    surplus, a row on lane 7 >= n) move to the lowest lanes with room, once each."""
    rows: list[Row] = [("g", 0, f"r{i}") for i in range(5)] + [("g", 1, "s"),
                                                               ("g", 7, "t")]
    shares = place_fills(rows, 3)
    lanes = {p: lane for share in shares for p, lane in share}
    assert lanes == {"r0": 0, "r1": 0, "r2": 0, "r3": 1, "r4": 1, "s": 1, "t": 2}
    # one lane per thread, the largest lanes first on the least-loaded (lowest) thread
    assert shares == [[("r0", 0), ("r1", 0), ("r2", 0)], [("s", 1), ("r3", 1), ("r4", 1)],
                      [("t", 2)]]


def test_rows_without_a_group_never_move() -> None:
    """A group of None (rows that cannot move: llguidance's rows that lost their grammar)
    keeps its lanes however many rows it has."""
    rows: list[Row] = [(None, 0, f"x{i}") for i in range(6)] + [(None, 1, "y")]
    shares = place_fills(rows, 3)
    assert {lane for share in shares for _, lane in share} == {0, 1}
    assert sorted(len(s) for s in shares) == [0, 1, 6]


def test_units_go_largest_first_to_the_least_loaded_thread() -> None:
    rows: list[Row] = [("a", 0, "a0"), ("b", 0, "b0"), ("b", 0, "b1"), ("c", 0, "c0"),
                       ("c", 0, "c1"), ("c", 0, "c2"), ("d", 0, "d0")]
    shares = place_fills(rows, 3)
    # share 3: no group is spread. c (3) -> thread 0, b (2) -> 1, a (1) -> 2, d (1) -> 2
    assert [[p for p, _ in s] for s in shares] == [["c0", "c1", "c2"], ["b0", "b1"],
                                                    ["a0", "d0"]]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_edges(n: int) -> None:
    assert place_fills([], n) == [[] for _ in range(n)]
    one: list[Row] = [("g", 3, "p")]
    assert _flat(place_fills(one, n)) == ["p"] and place_fills(one, n)[0] == [("p", 3)]
    if n == 1:  # one thread: everything on it, nothing moves
        rows: list[Row] = [("g", i % 3, str(i)) for i in range(9)]
        assert [lane for _, lane in place_fills(rows, 1)[0]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_random_batches_keep_the_contract() -> None:
    """Every row placed once; one lock on one thread; only groups past a thread's share
    move, into lanes ``< n`` of at most ``ceil(len(group) / n)`` rows; a row on a lane
    ``< n`` moves only when its lane is full; same input, same answer."""
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 8)
        groups: list[Hashable | None] = [*"abcd"[:rng.randint(1, 4)], None]
        rows = [(rng.choice(groups), rng.choice([0, 0, 0, 1, 2, rng.randint(0, 10)]), i)
                for i in range(rng.randint(0, 50))]
        shares = place_fills(rows, n)
        assert shares == place_fills(list(rows), n)
        assert len(shares) == n
        assert sorted(p for s in shares for p, _ in s) == list(range(len(rows)))
        thread_of: dict[tuple[Hashable | None, int], int] = {}
        target = {p: (k, lane) for k, s in enumerate(shares) for p, lane in s}
        share = -(-len(rows) // n)
        for key in {g for g, _, _ in rows}:
            group = [(lane, p) for g, lane, p in rows if g == key]
            cap = -(-len(group) // n)
            spread = key is not None and len(group) > share
            per_lane: dict[int, int] = {}
            for lane, p in group:
                k, to = target[p]
                assert thread_of.setdefault((key, to), k) == k  # one lock, one thread
                per_lane[to] = per_lane.get(to, 0) + 1
                if not spread:
                    assert to == lane
                elif to != lane:
                    assert lane >= n or per_lane.get(lane, 0) >= cap
            if spread:
                assert max(per_lane) < n and max(per_lane.values()) <= cap


# ---------------------------------------------------------------------------- the caller
class _Fake:
    """A matcher class with batch calls and fill lanes, recording what the Filler asks."""

    calls: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, group: str, lane: int) -> None:
        self.group, self.lane = group, lane

    def is_terminated(self) -> bool:
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        _Fake.calls.append(("fill", row))

    @classmethod
    def batch_fill(cls, rows: Sequence[tuple[_Fake, int]], bitmask: torch.Tensor,
                   threads: int | None, state: dict[str, Any]) -> None:
        cls.calls.append(("batch_fill", ([r for _, r in rows], threads)))

    @classmethod
    def batch_accept(cls, matchers: Sequence[_Fake], tokens: Sequence[int]) -> list[bool]:
        return [True] * len(matchers)

    @classmethod
    def fill_lanes(cls, rows: Sequence[tuple[_Fake, int]], bitmask: torch.Tensor,
                   threads: int | None) -> tuple[int, Sequence[LaneRow]] | None:
        cls.calls.append(("fill_lanes", threads))
        if threads is None:
            return None
        return threads, [(m.group, m.lane, (m, r)) for m, r in rows]

    @classmethod
    def fill_shares(cls, shares: Sequence[Sequence[tuple[tuple[Any, int], int]]],
                    bitmask: torch.Tensor, state: dict[str, Any]) -> None:
        cls.calls.append(("fill_shares", [[(row[1], lane) for row, lane in s] for s in shares]))


def test_the_filler_places_the_rows_of_a_class_with_fill_lanes() -> None:
    assert batch_calls(_Fake) is _Fake and lane_calls(_Fake) is _Fake
    rows = [(_Fake("g", 0), i) for i in range(4)] + [(_Fake("h", 0), 4)]
    bitmask = torch.zeros(5, 1, dtype=torch.int32)
    _Fake.calls = []
    Filler(parallel_min=1, threads=2).fill(rows, bitmask)
    want = place_fills([(m.group, m.lane, r) for m, r in rows], 2)
    assert _Fake.calls == [("fill_lanes", 2), ("fill_shares", want)]
    assert want == [[(0, 0), (1, 0), (4, 0)], [(2, 1), (3, 1)]]  # g spread: 4 rows > 3
    # one thread (below parallel_min): straight to batch_fill, fill_lanes never asked
    _Fake.calls = []
    Filler(parallel_min=6, threads=2).fill(rows, bitmask)
    assert _Fake.calls == [("batch_fill", ([0, 1, 2, 3, 4], 1))]
    # the backend declines (here: its default thread count): batch_fill with the same args
    _Fake.calls = []
    Filler(parallel_min=1, threads=None).fill(rows, bitmask)
    assert _Fake.calls == [("fill_lanes", None), ("batch_fill", ([0, 1, 2, 3, 4], None))]


def test_only_llguidance_has_fill_lanes() -> None:
    from grammask.backends.guidance import GuidanceMatcher
    from grammask.backends.xgrammar import XGrammarMatcher

    assert lane_calls(GuidanceMatcher) is GuidanceMatcher
    assert lane_calls(XGrammarMatcher) is None and batch_calls(XGrammarMatcher) is not None


# ---------------------------------------------------------------------------- end to end
SCHEMAS = [{"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "n": {"type": "integer"}}, "required": ["name", "n"]},
    {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
     "required": ["id", "ok"]}]
INSTANCES = [json.dumps({"name": "grammask", "tags": ["a", "bc"], "n": 12}, separators=(",", ":")),
             json.dumps({"id": 123456, "ok": True}, separators=(",", ":"))]


@pytest.fixture(scope="module")
def hf_vocab() -> Vocabulary:
    """A Hugging Face tokenizer's vocabulary: llguidance tokenizes natively (parallel)."""
    from grammask import load_vocabulary

    from ..vllm_fixtures import model_dir

    return load_vocabulary(str(model_dir()))


def test_llguidance_batch_fills_on_threads_equal_row_by_row_fills(hf_vocab: Vocabulary
                                                                  ) -> None:
    """Two grammars, one busy (spread over lanes: rows moved by replaying their tokens), one
    not, on 3 threads and then 2 (another pool): every mask equals a serial twin's, step
    after step; the rows end up on lanes of their own grammar."""
    compiler = Compiler(hf_vocab, tune_fill=False)
    try:
        grammars = [compiler.compile(GrammarSpec.json_schema(s, backend="guidance"))
                    for s in SCHEMAS]
        tokens = [hf_vocab.encode(t) for t in INSTANCES]
        kinds = [0] * 10 + [1] * 4
        rows = [grammars[k].matcher() for k in kinds]
        twins = [grammars[k].matcher() for k in kinds]
        for i, (m, t, k) in enumerate(zip(rows, twins, kinds, strict=True)):
            assert all(m.accept(x) and t.accept(x) for x in tokens[k][:i % 6])
        filler = Filler(parallel_min=1, threads=3)
        for step in range(4):
            if step == 2:
                # 3 lanes of at most 4 (10 rows > a share of 5); the other grammar stays
                busy = {m.lane for m in rows[:10]}  # type: ignore[attr-defined]
                assert sorted(busy) == [0, 1, 2]
                assert {m.lane for m in rows[10:]} == {0}  # type: ignore[attr-defined]
                filler.threads = 2  # lane 2's rows move to lanes 0 and 1
            got = allocate_bitmask(len(rows), hf_vocab.vocab_size)
            want = allocate_bitmask(len(rows), hf_vocab.vocab_size)
            filler.fill([(m, i) for i, m in enumerate(rows)], got)
            for i, t in enumerate(twins):
                t.fill(want, i)
            assert torch.equal(got, want), step
            for i, (m, t, k) in enumerate(zip(rows, twins, kinds, strict=True)):
                x = tokens[k][i % 6 + step]
                assert m.accept(x) and t.accept(x)
        assert {"guidance_pool3", "guidance_pool2"} <= set(filler._pools)
        assert {m.lane for m in rows[:10]} == {0, 1}  # type: ignore[attr-defined]
    finally:
        compiler.close()
