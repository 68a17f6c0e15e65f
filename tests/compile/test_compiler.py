"""The compile service: single-flight under concurrency, LRU by bytes, negative cache,
timeouts and fallback, and bad input that harms nothing else."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from grammask import (
    Compiler,
    CompileTimeoutError,
    GrammarError,
    GrammarSpec,
    InternalCompileError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidSchemaError,
    ServerFault,
    Vocabulary,
)
from grammask.backends import get_backend, registry
from grammask.compile.plan_runner import PlanRunner

from ..helpers import accepts_complete, declare_unbounded


def _prepare_all(vocab: Vocabulary) -> None:
    """Every backend's tokenizer view (seconds, once per vocabulary), outside any budget."""
    for backend in registry.backends():
        get_backend(backend.name).prepare(vocab)

def _spec(i: int) -> GrammarSpec:
    kind = i % 4
    if kind == 0:
        return GrammarSpec.json_schema({"type": "object", "properties": {
            f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})
    if kind == 1:
        return GrammarSpec.regex(f"id-{i}-[0-9]+")
    if kind == 2:
        return GrammarSpec.choice([f"c{i}", "other"])
    return GrammarSpec.grammar(f'start: "g{i}" NUM\nNUM: /[0-9]+/')


def _sample(i: int) -> str:
    return [json.dumps({f"k{i}": 7}), f"id-{i}-42", f"c{i}", f"g{i}5"][i % 4]


def test_32_threads_200_specs_compile_each_key_once(qwen25: Vocabulary,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}
    lock = threading.Lock()
    for name in ("xgrammar", "guidance"):
        backend = get_backend(name)  # type: ignore[arg-type]
        original = backend.compile

        def counting(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False,
                     _orig: Any = original) -> Any:
            with lock:
                calls[spec.key] = calls.get(spec.key, 0) + 1
            time.sleep(0.005)  # widen the window in which duplicates arrive
            return _orig(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", counting)
    compiler = Compiler(qwen25, max_workers=4, tune_fill=False)  # no rival compiles
    # 200 requests over 50 distinct specs, in a shuffled order, from 32 threads
    order = [(i * 37) % 50 for i in range(200)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: (i, compiler.compile(_spec(i))), order))
    assert len(calls) == 50 and set(calls.values()) == {1}
    stats = compiler.stats
    assert stats.misses == 50 and stats.hits + stats.joined == 150
    for i, grammar in results:
        assert grammar.spec == _spec(i)
        assert accepts_complete(grammar.matcher(), qwen25, _sample(i)), i


def test_cache_is_bounded_by_bytes(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, cache_bytes=1)  # nothing fits: every compile is a miss
    compiler.compile(GrammarSpec.regex("a"))
    compiler.compile(GrammarSpec.regex("a"))
    assert compiler.stats.misses == 2 and compiler.cache_info()["bytes"] == 0
    patterns = ["x1", "x2", "x3", "x4"]
    roomy = Compiler(qwen25)
    sizes = [roomy.compile(GrammarSpec.regex(p)).memory_bytes for p in patterns]
    budget = sizes[-1] + sizes[-2]
    small = Compiler(qwen25, cache_bytes=budget)
    for pattern in patterns:
        small.compile(GrammarSpec.regex(pattern))
    info = small.cache_info()
    assert info["bytes"] <= budget and small.stats.evictions >= 1
    assert small.cached(GrammarSpec.regex("x4")) is not None  # most recent kept
    assert small.cached(GrammarSpec.regex("x1")) is None  # oldest evicted


class _Clock:
    """The compile service's clock, moved by the test: ``time.monotonic`` as
    ``grammask.compile.compiler`` and ``grammask.compile.flights`` read it (the rest of ``time`` is
    real). Time stands still until ``advance``, however long the real compiles take."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import grammask.compile.compiler as compiler
        import grammask.compile.flights as flights

        self.now = time.monotonic()
        real, clock = compiler.time, self

        class _Time:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def monotonic(self) -> float:
                return clock.now

        # the service remembers failures, its flights' lookup reads them
        for module in (compiler, flights):
            monkeypatch.setattr(module, "time", _Time())

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_negative_cache_expires(qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(monkeypatch)
    compiler = Compiler(qwen25, negative_ttl_s=0.2)
    bad = GrammarSpec.regex("a(b")
    for _ in range(3):
        with pytest.raises(InvalidRegexError):
            compiler.compile(bad)
    assert compiler.stats.misses == 1 and compiler.stats.negative_hits == 2
    clock.advance(0.19)  # still inside the TTL: a hit, no compile
    with pytest.raises(InvalidRegexError):
        compiler.compile(bad)
    assert compiler.stats.misses == 1 and compiler.stats.negative_hits == 3
    clock.advance(0.02)  # past it: compiled again
    with pytest.raises(InvalidRegexError):
        compiler.compile(bad)
    assert compiler.stats.misses == 2 and compiler.stats.negative_hits == 3


def _nested_one_of(depth: int, width: int, key: str = "oneOf") -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string", "pattern": "[a-z]{2,8}@[a-z]+\\.com"}
    for d in range(depth):
        node = {key: [{"type": "object", "properties": {
            f"k{d}_{i}": node, "e": {"type": "string", "format": "email"}},
            "required": [f"k{d}_{i}"]} for i in range(width)]}
    return node


def test_timeout_on_the_only_backend_is_an_error(qwen25: Vocabulary,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A runaway xgrammar compile (this schema takes seconds there; the gate makes it run
    until released, whatever the machine's speed): the request gets a timeout error and the
    compiler keeps serving others while the runaway compile is abandoned."""
    spec = GrammarSpec.json_schema(_nested_one_of(3, 3), backend="xgrammar")
    gate = _Gate(monkeypatch, "xgrammar", only=spec, abort=True)
    get_backend("xgrammar").prepare(qwen25)  # the tokenizer view: once, outside budgets
    compiler = Compiler(qwen25, timeout_s=0.5, max_workers=1, max_abandoned=1)
    try:
        with pytest.raises(CompileTimeoutError, match="xgrammar compile exceeded"):
            compiler.compile(spec)
        assert gate.calls == 1 and not gate.release.is_set()  # still running when it failed
        assert compiler.stats.timeouts == 1 and compiler.cache_info()["abandoned"] == 1
        # the single slot was handed back: another request compiles despite the runaway
        assert compiler.compile(GrammarSpec.regex("ok", backend="xgrammar")).backend == \
            "xgrammar"
    finally:
        gate.release.set()


def test_timeout_falls_back_to_the_other_backend(qwen25: Vocabulary,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One budget covers the request: the routed xgrammar compile (seconds for this schema;
    gated here, so it never finishes in time) gets 70% of it, llguidance (milliseconds) the
    rest, and serves the fallback."""
    spec = GrammarSpec.json_schema(_nested_one_of(4, 3, key="anyOf"))
    gate = _Gate(monkeypatch, "xgrammar", only=spec, abort=True)
    _prepare_all(qwen25)  # the tokenizer views, built outside the budget
    compiler = Compiler(qwen25, timeout_s=2.0, prefer="xgrammar")
    assert compiler.route(spec).backend == "xgrammar"
    try:
        grammar = compiler.compile(spec)
        assert gate.calls == 1 and not gate.release.is_set()
    finally:
        gate.release.set()
    assert grammar.backend == "guidance" and grammar.fallback_from == "xgrammar"
    assert "fell back" in grammar.reason
    assert compiler.stats.timeouts == 1 and compiler.stats.fallbacks == 1


BAD_INPUTS: list[tuple[str, Any, type[GrammarError], str]] = [
    ("unknown type", lambda: GrammarSpec.json_schema({"type": "strin"}), InvalidSchemaError,
     "strin"),
    ("bad $ref", lambda: GrammarSpec.json_schema({"$ref": "#/$defs/missing"}),
     InvalidSchemaError, "missing"),
    ("invalid regex", lambda: GrammarSpec.regex("[a-z"), InvalidRegexError, "[Uu]nclosed"),
    ("grammar syntax", lambda: GrammarSpec.grammar('start: "a" |\nfoo'), InvalidGrammarError,
     "line"),
    ("gbnf syntax", lambda: GrammarSpec.grammar('root ::= "a" (b'), InvalidGrammarError, ""),
]


@pytest.mark.parametrize(("what", "make", "error", "fragment"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_give_clear_errors_and_harm_nothing(compiler: Compiler, qwen25: Vocabulary,
                                                       what: str, make: Any,
                                                       error: type[GrammarError],
                                                       fragment: str) -> None:
    with pytest.raises(error, match=fragment or None):
        compiler.compile(make())
    assert accepts_complete(compiler.compile(GrammarSpec.regex("fine")).matcher(), qwen25, "fine")


def test_wrong_python_types(compiler: Compiler) -> None:
    with pytest.raises(GrammarError, match="GrammarSpec"):
        compiler.compile({"type": "object"})  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="backend"):
        Compiler(compiler.vocab, backend="outlines")


def test_check_is_cheap_and_catches_bad_specs(compiler: Compiler) -> None:
    before = dict(compiler.stats.compiles)
    assert compiler.check(GrammarSpec.regex("a+")).backend == "guidance"
    for bad in (GrammarSpec.regex("(a"), GrammarSpec.grammar('start: "a" |\nfoo'),
                GrammarSpec.json_schema({"type": "strin"})):
        with pytest.raises(GrammarError):
            compiler.check(bad)
    assert compiler.stats.compiles == before  # nothing compiled for the tokenizer


def test_async_compile_and_cache_hit(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25)
    fut = compiler.compile_async(GrammarSpec.choice(["x", "y"]))
    grammar = fut.result(30)
    again = compiler.compile_async(GrammarSpec.choice(["x", "y"]))
    assert again.done() and again.result() is grammar and compiler.stats.hits == 1


# ------------------------------------------------------------- compile-service robustness
class _Gate:
    """Wraps a real backend's compile so it blocks until released (only for the spec ``only``
    when one is given; every other spec compiles as usual).

    A stand-in for a compile that runs as long as the test needs (real slow specs take
    seconds to minutes and vary with load); the compile itself is the real backend's, unless
    ``abort``: then a released compile fails at once instead of burning seconds of CPU on a
    spec whose real compile is slow (the test is over by then)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str,
                 only: GrammarSpec | None = None, abort: bool = False) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        declare_unbounded(monkeypatch, name)  # a stalled compile must be abandonable
        backend = get_backend(name)  # type: ignore[arg-type]
        original = backend.compile

        def gated(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
            if only is not None and spec.with_backend(None) != only.with_backend(None):
                return original(spec, vocab, lenient=lenient)  # not the gated spec
            self.calls += 1
            self.entered.set()
            self.release.wait(60)
            if abort:
                raise RuntimeError("gated compile released without compiling")
            return original(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", gated)


def test_cancel_drops_only_that_callers_future(qwen25: Vocabulary,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Single-flight shares the compile, not the future: one caller's cancel() must not
    cancel the others' (it used to cancel the shared future for everyone)."""
    gate = _Gate(monkeypatch, "guidance")
    compiler = Compiler(qwen25, timeout_s=30)
    spec = GrammarSpec.regex("cancel-[0-9]+", backend="guidance")
    first = compiler.compile_async(spec)
    second = compiler.compile_async(spec)
    assert gate.entered.wait(10)
    assert first.cancel() and first.cancelled()
    third = compiler.compile_async(spec)
    assert not second.cancelled() and not third.cancelled()
    gate.release.set()
    assert second.result(30).backend == "guidance"
    assert third.result(30) is second.result()
    assert gate.calls == 1 and compiler.stats.joined == 2


def test_close_fails_pending_requests_and_later_ones(qwen25: Vocabulary,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """close() used to leave the key in flight: pending and later requests hung forever."""
    gate = _Gate(monkeypatch, "guidance")
    compiler = Compiler(qwen25, timeout_s=30)
    spec = GrammarSpec.regex("close-[0-9]+", backend="guidance")
    try:
        pending = compiler.compile_async(spec)
        assert gate.entered.wait(10)
        compiler.close()
        # a server fault, never the request's (never a 400)
        error = pending.exception(timeout=5)
        assert isinstance(error, ServerFault) and not isinstance(error, GrammarError)
        with pytest.raises(ServerFault, match="closed"):
            compiler.compile(spec, timeout=5)
        with pytest.raises(ServerFault, match="closed"):
            compiler.compile_async(GrammarSpec.regex("other"))
    finally:
        gate.release.set()


def test_negative_cache_hits_do_not_grow_tracebacks(qwen25: Vocabulary) -> None:
    """Re-raising one stored exception object appended frames on every hit (20,000 hits
    gave 80,000 frames and hundreds of MB); each hit must raise a fresh copy."""
    import traceback

    compiler = Compiler(qwen25)
    bad = GrammarSpec.regex("tb(")
    depths, seen = [], set()
    for _ in range(50):
        try:
            compiler.compile(bad)
        except InvalidRegexError as exc:
            depths.append(len(traceback.extract_tb(exc.__traceback__)))
            seen.add(id(exc))
            assert exc.__cause__ is None and "tb(" not in repr(exc.__context__)
            del exc
    assert compiler.stats.negative_hits == 49
    assert max(depths[1:]) <= depths[1]


def test_negative_cache_is_bounded_and_purges_expired(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expired entries were never purged (3,000 bad specs left 3,001 entries)."""
    clock = _Clock(monkeypatch)
    compiler = Compiler(qwen25, negative_ttl_s=2.0)
    for i in range(30):
        with pytest.raises(InvalidRegexError):
            compiler.compile(GrammarSpec.regex(f"x{i}("))
    assert compiler.cache_info()["negative"] == 30
    clock.advance(2.1)
    with pytest.raises(InvalidRegexError):
        compiler.compile(GrammarSpec.regex("last("))
    assert compiler.cache_info()["negative"] == 1
    small = Compiler(qwen25, negative_ttl_s=60, max_negative=10)
    for i in range(30):
        with pytest.raises(InvalidRegexError):
            small.compile(GrammarSpec.regex(f"y{i}("))
    assert small.cache_info()["negative"] == 10


def test_internal_errors_try_the_other_backend_and_are_not_cached(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend running out of memory says nothing about the spec. The fault is injected
    with a wrapper around the real backend: a real MemoryError cannot be caused on demand."""
    backend = get_backend("guidance")
    original = backend.compile
    failures = {"left": 2}

    def flaky(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise MemoryError
        return original(spec, vocab, lenient=lenient)

    monkeypatch.setattr(backend, "compile", flaky)
    compiler = Compiler(qwen25)
    routed = GrammarSpec.regex("mem-[a-z]+")
    assert compiler.route(routed).backend == "guidance"
    grammar = compiler.compile(routed)
    assert grammar.backend == "xgrammar" and grammar.fallback_from == "guidance"
    forced = GrammarSpec.regex("mem2-[a-z]+", backend="guidance")
    with pytest.raises(InternalCompileError, match="MemoryError") as info:
        compiler.compile(forced)
    assert not isinstance(info.value, GrammarError)  # the server's fault, not a 400
    assert compiler.cache_info()["negative"] == 0
    assert compiler.compile(forced).backend == "guidance"  # compiled again, not a cached error
    assert compiler.stats.negative_hits == 0


def test_compile_timeout_argument_is_honoured_on_a_miss(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile(spec, timeout=...) was ignored on a miss: the build ran on the caller."""
    gate = _Gate(monkeypatch, "guidance")
    compiler = Compiler(qwen25, timeout_s=30)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            compiler.compile(GrammarSpec.regex("slow-[0-9]+", backend="guidance"), timeout=0.3)
        except BaseException as exc:
            outcome.append(exc)

    try:
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(10)  # generous; the gate holds the compile for up to 60 s
        assert not caller.is_alive() and not gate.release.is_set()
        assert len(outcome) == 1 and isinstance(outcome[0], CompileTimeoutError)
    finally:
        gate.release.set()
    # the compile went on for whoever waits next: it lands in the cache
    assert compiler.compile(GrammarSpec.regex("slow-[0-9]+", backend="guidance"), timeout=30)


def test_one_deadline_covers_the_route_and_its_fallbacks(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attempt had a budget of its own, so a request whose backends both stalled took
    2x ``timeout_s`` (3x with a slot wait); one deadline from submission covers them all."""
    gates = [_Gate(monkeypatch, "xgrammar"), _Gate(monkeypatch, "guidance")]
    # the deadline each attempt is given, as the compiler computes it (no wall-clock bound:
    # the old code's second deadline was "now + timeout_s" after the first attempt's share)
    given: list[tuple[str, float, float | None]] = []
    attempt = PlanRunner._attempt

    def spy(self: PlanRunner, spec: GrammarSpec, step: Any, reason: str, deadline: float,
            *args: Any, **kwargs: Any) -> Any:
        given.append((step.backend, deadline, kwargs.get("slot_deadline")))
        return attempt(self, spec, step, reason, deadline, *args, **kwargs)

    monkeypatch.setattr(PlanRunner, "_attempt", spy)
    _prepare_all(qwen25)
    timeout_s = 1.0
    compiler = Compiler(qwen25, timeout_s=timeout_s, prefer="xgrammar")
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compiler.route(spec).backend == "xgrammar" and len(compiler.plan(spec).attempts) > 1
    try:
        submitted = time.monotonic()
        fut = compiler.compile_async(spec)
        registered = time.monotonic()  # the request's deadline is set in between
        error = fut.exception(timeout=60)  # liveness only
        assert isinstance(error, CompileTimeoutError)
        assert gates[0].calls == 1 and gates[1].calls == 1  # the fallback was tried
    finally:
        for gate in gates:
            gate.release.set()
    assert [b for b, _, _ in given] == ["xgrammar", "guidance"], given
    for _, deadline, slot_deadline in given:
        assert deadline <= registered + timeout_s, given  # within the request's one deadline
        assert slot_deadline is None or slot_deadline <= registered + timeout_s, given
    # the first attempt gets a share; the last one gets everything up to the deadline
    assert given[0][1] < submitted + timeout_s <= given[1][1], given


def test_xgrammar_runaways_do_not_block_llguidance(qwen25: Vocabulary,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One pool of slots for both backends let xgrammar runaways starve every request
    ('no compile slot free'); each backend has its own slots now."""
    gate = _Gate(monkeypatch, "xgrammar")
    get_backend("guidance").prepare(qwen25)  # built once, outside the 0.5 s budget
    compiler = Compiler(qwen25, timeout_s=0.5, max_workers=1, max_abandoned=0)
    try:
        with pytest.raises(CompileTimeoutError):
            compiler.compile(GrammarSpec.choice(["a", "b"], backend="xgrammar"))
        assert compiler.compile(GrammarSpec.regex("good", backend="guidance")).backend == \
            "guidance"
    finally:
        gate.release.set()


def test_runaway_is_not_restarted_and_its_late_result_is_cached(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec that just ran away is not started again on that backend (each retry used to
    start another runaway); when the abandoned compile finishes, its result is kept."""
    gate = _Gate(monkeypatch, "xgrammar")
    compiler = Compiler(qwen25, timeout_s=0.3, max_workers=2, max_abandoned=2)
    spec = GrammarSpec.choice(["late", "result"], backend="xgrammar")
    for _ in range(3):
        with pytest.raises(CompileTimeoutError):
            compiler.compile(spec)
    assert gate.calls == 1
    gate.release.set()
    waited_until = time.monotonic() + 60  # liveness only: the late result lands in ms
    while compiler.cached(spec) is None and time.monotonic() < waited_until:
        time.sleep(0.01)
    assert compiler.compile(spec).backend == "xgrammar" and compiler.stats.late_results == 1


_MEMORY_PROBE = """
import contextlib, gc, gzip, json, os, sys
from pathlib import Path
from grammask import Compiler, GrammarError, GrammarSpec, load_vocabulary
from grammask.compile.compiler import trim_heap

def rss():
    gc.collect()
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

compiler = Compiler(load_vocabulary("qwen2.5"), max_workers=1)
specs = []
with gzip.open(sys.argv[1], "rt") as fh:
    for line in fh:
        specs.append(GrammarSpec.json_schema(json.loads(line)["schema"], backend="guidance"))
        if len(specs) == 200:
            break
compiler.compile(GrammarSpec.regex("warm", backend="guidance"))
trim_heap()
before = rss()
for spec in specs:
    with contextlib.suppress(GrammarError):
        compiler.compile(spec)
grown = rss() - before
trim_heap()
held = rss() - before
info = compiler.cache_info()
compiler.clear()
print(json.dumps({"grown": grown, "held": held, "estimate": info["bytes"],
                  "entries": info["entries"], "after_clear": rss() - before}))
"""


def test_cache_bytes_track_measured_memory_and_clear_returns_it(corpus: Any) -> None:
    """The byte estimate was half the real RSS growth per llguidance grammar, and clear()
    gave nothing back to the OS. Measured in a fresh process (RSS is process-wide: other
    tests in a shared worker would move it); bounds are loose, bench/stress.py has the
    numbers."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE,
         str(corpus / "maskbench" / "Github_medium.jsonl.gz")],
        capture_output=True, text=True, timeout=300, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["entries"] > 100
    assert 0.6 < m["held"] / m["estimate"] < 1.6, m
    assert m["after_clear"] < 0.5 * max(m["grown"], m["held"]), m


def test_abandoned_compiles_run_at_the_lowest_cpu_priority(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runaway cannot be killed, but it must not take CPU from good requests on a busy
    machine: its threads drop to nice 19 when abandoned (Linux, per thread)."""
    import os

    gate = _Gate(monkeypatch, "xgrammar")
    compiler = Compiler(qwen25, timeout_s=0.3, max_workers=1)
    try:
        with pytest.raises(CompileTimeoutError):
            compiler.compile(GrammarSpec.choice(["nice", "ness"], backend="xgrammar"))
        workers = [t for t in threading.enumerate()
                   if t.name == "grammask-compile" and t.native_id is not None]
        niceness = {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in workers
                    if t.native_id is not None}
        assert 19 in niceness
    finally:
        gate.release.set()


def test_compile_metrics(qwen25: Vocabulary) -> None:
    """Compile seconds by backend/kind/outcome, memory-cache hits and misses, unenforced."""
    from grammask import metrics

    before = metrics.snapshot()
    compiler = Compiler(qwen25)
    try:
        spec = GrammarSpec.json_schema({"type": "array", "uniqueItems": True})
        compiler.compile(spec)
        compiler.compile(spec)
        with pytest.raises(GrammarError):
            compiler.compile(GrammarSpec.regex("(unclosed", backend="guidance"))
    finally:
        compiler.close()
    after = metrics.snapshot()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('grammask_compile_seconds_count{backend="guidance",kind="json_schema",'
                 'outcome="ok"}') == 1
    assert delta('grammask_compile_seconds_count{backend="guidance",kind="regex",'
                 'outcome="error"}') == 1
    assert delta('grammask_cache_requests_total{result="hit",tier="memory"}') == 1
    assert delta('grammask_cache_requests_total{result="miss",tier="memory"}') == 2
    assert delta('grammask_unenforced_requests_total{backend="guidance"}') == 1


# ------------------------------------------------------------------ the cold and hit paths
def test_a_blocking_miss_plans_on_the_caller_and_compiles_where_it_can_be_abandoned(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile()`` whose caller waits out the whole deadline builds on the caller's thread
    (no hand-off to a routing thread). An unbounded backend's native compile (xgrammar) runs
    on a compile worker, the thread a deadline can abandon; a bounded one's (llguidance: its
    parser limits) on the caller too, as ``compile_async``'s runs on the routing thread. A
    shorter caller timeout still goes through the pool."""
    import grammask.compile.compiler as compiler_module

    where: dict[str, str] = {}
    real_plan = compiler_module.plan

    def plan(spec: GrammarSpec, **kwargs: Any) -> Any:
        where["plan"] = threading.current_thread().name
        return real_plan(spec, **kwargs)

    def spy(name: str) -> None:
        backend = get_backend(name)  # type: ignore[arg-type]
        real_compile = backend.compile

        def compile_(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
            where[name] = threading.current_thread().name
            return real_compile(spec, vocab, lenient=lenient)

        monkeypatch.setattr(backend, "compile", compile_)

    monkeypatch.setattr(compiler_module, "plan", plan)
    spy("guidance")
    spy("xgrammar")
    compiler = Compiler(qwen25, timeout_s=30)
    me = threading.current_thread().name
    assert compiler.compile(GrammarSpec.regex("here-[0-9]+")).backend == "guidance"
    assert where == {"plan": me, "guidance": me}
    assert compiler.compile(GrammarSpec.regex("xg-[0-9]+", backend="xgrammar"))
    assert where["xgrammar"] == "grammask-compile"
    compiler.compile(GrammarSpec.regex("pool-[0-9]+"), timeout=10)
    assert where["plan"].startswith("grammask-route") and where["guidance"] == where["plan"]
    compiler.compile_async(GrammarSpec.regex("async-[0-9]+")).result(30)
    assert where["guidance"].startswith("grammask-route")


def test_a_hit_through_compile_makes_no_future(qwen25: Vocabulary,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking hit returns the grammar (a future per hit was most of its cost); a
    blocking miss built on the caller needs none either. ``compile_async`` still returns a
    future, done at once on a hit."""
    import grammask.compile.compiler as compiler_module

    made: list[object] = []

    class Counted(Future):  # type: ignore[type-arg]
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(compiler_module, "Future", Counted)
    compiler = Compiler(qwen25)
    spec = GrammarSpec.choice(["no", "future"])
    grammar = compiler.compile(spec)
    assert compiler.compile(GrammarSpec.choice(["no", "future"])) is grammar
    assert made == [] and compiler.stats.hits == 1 and compiler.stats.misses == 1
    fut = compiler.compile_async(spec)
    assert fut.done() and fut.result() is grammar and len(made) == 1
    with pytest.raises(InvalidRegexError):
        compiler.compile(GrammarSpec.regex("bad("))
    with pytest.raises(InvalidRegexError):  # the negative cache: raised, no future either
        compiler.compile(GrammarSpec.regex("bad("))
    assert len(made) == 1 and compiler.stats.negative_hits == 1
    assert isinstance(compiler.compile_async(GrammarSpec.regex("bad(")).exception(),
                      InvalidRegexError)


def test_a_default_backend_serves_hits_from_the_specs_twin(qwen25: Vocabulary) -> None:
    """A compiler with a default backend looks up the spec with that backend: the twin is
    made once per spec (a new key costs the source serialized and hashed again)."""
    compiler = Compiler(qwen25, backend="guidance")
    spec = GrammarSpec.regex("twin-[0-9]+")
    grammar = compiler.compile(spec)
    assert grammar.backend == "guidance" and compiler.compile(spec) is grammar
    assert spec.with_backend("guidance") is spec.with_backend("guidance")
    assert compiler.stats.hits == 1


def test_threads_started_since_a_job_began_are_found_by_their_start_time() -> None:
    """What an abandoned compile's threads are is read from /proc when it is abandoned (a
    listing per job cost every cold compile before it started): the threads whose start
    time is at or after the job's."""
    import os

    from grammask.compile import slots as compile_slots

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc: nothing is lowered but the worker")
    tick = compile_slots._ticks()
    release = threading.Event()
    later = threading.Thread(target=release.wait)
    later.start()
    try:
        found = compile_slots._tasks_since(tick)
        assert later.native_id in found and threading.get_native_id() not in found
    finally:
        release.set()
        later.join()
    assert later.native_id not in compile_slots._tasks_since(compile_slots._ticks() + 100)


def test_metric_children_are_bound_once_and_count() -> None:
    """The compile path binds its metrics' children once (``labels()`` on every hit cost
    more than the rest of the hit); the counts land in the same series."""
    from grammask import metrics

    if not metrics.available():
        pytest.skip("prometheus_client is not installed")
    child = metrics.cache_requests("memory", "hit")
    assert metrics.cache_requests("memory", "hit") is child
    assert child is metrics.CACHE_REQUESTS.labels(tier="memory", result="hit")
    name = 'grammask_cache_requests_total{result="hit",tier="memory"}'
    before = metrics.snapshot().get(name, 0.0)
    child.inc()
    assert metrics.snapshot()[name] == before + 1


def test_a_build_on_the_callers_thread_keeps_every_callers_deadline(
        qwen25: Vocabulary, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking caller builds a bounded backend's compile on its own thread, and the
    reaper is told of the flight only when a second caller joins it. The joiner (async, no
    timeout of its own) still hears of the timeout at the deadline while the build runs
    on, and the builder, whose compile ends past the deadline, gets the timeout as before;
    the grammar is cached for the next request. A builder alone that overruns also times
    out, and counts it."""
    release, entered = threading.Event(), threading.Event()
    backend = get_backend("guidance")
    real_compile = backend.compile

    def held(spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False) -> Any:
        entered.set()
        release.wait(30)
        return real_compile(spec, vocab, lenient=lenient)

    monkeypatch.setattr(backend, "compile", held)
    compiler = Compiler(qwen25, timeout_s=0.4)
    spec = GrammarSpec.regex("held-[0-9]+", backend="guidance")
    outcome: dict[str, Any] = {}

    def build() -> None:
        try:
            outcome["builder"] = compiler.compile(spec)
        except CompileTimeoutError as exc:
            outcome["builder"] = exc

    builder = threading.Thread(target=build)
    builder.start()
    assert entered.wait(10)
    joiner = compiler.compile_async(spec)
    with pytest.raises(CompileTimeoutError):
        joiner.result(5)  # the reaper settles it at the deadline, not the build's end
    assert builder.is_alive()  # the build is still held
    release.set()
    builder.join(10)
    assert isinstance(outcome["builder"], CompileTimeoutError)
    assert compiler.cached(spec) is not None and compiler.stats.timeouts == 1

    alone = GrammarSpec.regex("alone-[0-9]+", backend="guidance")
    entered.clear()
    release.clear()
    threading.Timer(0.8, release.set).start()
    with pytest.raises(CompileTimeoutError):
        compiler.compile(alone)
    assert compiler.cached(alone) is not None and compiler.stats.timeouts == 2
