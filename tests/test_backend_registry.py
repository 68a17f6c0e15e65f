"""A third backend, registered by this test alone, is routed to, compiled, cached and reported
without any change outside this file: the registry is the only place backends are named.

The third backend is a stand-in (a thin wrapper over the real xgrammar adapter under another
name): grammask ships two backends, and the point is that nothing else names them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from grammask import metrics
from grammask.backends import get_backend, registry
from grammask.backends.registry import BackendInfo, Cost
from grammask.cli import main
from grammask.compiler import Compiler
from grammask.errors import InvalidSpecError, UnsupportedError
from grammask.harness.report import labels
from grammask.integrations.vllm_settings import load_settings
from grammask.router import plan
from grammask.schema.features import Feature
from grammask.spec import GrammarSpec
from grammask.vocab import Vocabulary

MIRROR = "mirror"


class MirrorBackend:
    """xgrammar under another name: what a third adapter module would register."""

    name = MIRROR

    def __init__(self) -> None:
        self._inner = get_backend("xgrammar")
        self.compiles = 0

    def prepare(self, vocab: Vocabulary) -> None:
        self._inner.prepare(vocab)

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False
                ) -> object:
        self.compiles += 1
        return self._inner.compile(spec, vocab, lenient=lenient)

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        self._inner.check(spec, lenient=lenient)


@pytest.fixture
def mirror() -> Iterator[BackendInfo]:
    xgrammar = registry.info("xgrammar")
    info = BackendInfo(
        name=MIRROR, aliases=("xg-mirror",), adapter=MirrorBackend, gaps=xgrammar.gaps,
        batch_fill=True, footprint=xgrammar.footprint,
        costs={"regex": Cost(0, "is the test's cheapest regex backend"),
               "choice": Cost(5, "is the test's dearest choice backend")})
    registry.register(info)
    yield info
    registry.unregister(MIRROR)


def _mask(grammar_matcher: object, vocab: Vocabulary, text: str) -> list[torch.Tensor]:
    words = (vocab.vocab_size + 31) // 32
    masks = []
    for tid in [*vocab.encode(text), None]:
        out = torch.zeros((1, words), dtype=torch.int32)
        grammar_matcher.fill(out, 0)  # type: ignore[attr-defined]
        masks.append(out.clone())
        if tid is not None:
            assert grammar_matcher.accept(tid)  # type: ignore[attr-defined]
    return masks


def test_the_router_routes_to_the_cheapest_registered_backend(mirror: BackendInfo) -> None:
    regex = plan(GrammarSpec.regex("[a-z]+"))
    assert regex.backend == MIRROR and "mirror is the test's cheapest" in regex.route.reason
    assert [a.backend for a in regex.attempts] == [MIRROR, "guidance"]  # the runner-up
    choice = plan(GrammarSpec.choice(["a", "b"]))
    assert choice.backend == "xgrammar" and MIRROR not in [a.backend for a in choice.attempts
                                                           ][:2]
    # a workload it does not declare is never sent to it
    assert all(a.backend != MIRROR for a in plan(GrammarSpec.json_object()).attempts)


def test_it_is_compiled_cached_and_counted(mirror: BackendInfo, qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25)
    spec = GrammarSpec.regex("[a-z]{2,5}")
    before = metrics.COMPILE_SECONDS.labels(backend=MIRROR, kind="regex",
                                            outcome="ok")._sum.get()  # type: ignore[attr-defined]
    grammar = compiler.compile(spec)
    assert grammar.backend == MIRROR and grammar.fallback_from is None
    assert compiler.compile(spec) is grammar and compiler.stats.hits == 1
    assert compiler.stats.compiles[MIRROR] == 1
    assert get_backend(MIRROR).compiles == 1  # type: ignore[attr-defined]
    assert metrics.COMPILE_SECONDS.labels(backend=MIRROR, kind="regex", outcome="ok"
                                          )._sum.get() > before  # type: ignore[attr-defined]
    assert grammar.memory_bytes > 0 and compiler.cache_info()["entries"] == 1
    # it masks as the backend it wraps does, token by token
    forced = compiler.compile(GrammarSpec.regex("[a-z]{2,5}", backend="xgrammar"))
    for ours, theirs in zip(_mask(grammar.matcher(), qwen25, "abcd"),
                            _mask(forced.matcher(), qwen25, "abcd"), strict=True):
        assert torch.equal(ours, theirs)


def test_its_name_and_alias_are_accepted_where_users_name_backends(
        mirror: BackendInfo, qwen25: Vocabulary) -> None:
    assert GrammarSpec.regex("a", backend="XG-Mirror").backend == MIRROR
    assert Compiler(qwen25, backend="xg-mirror").compile(
        GrammarSpec.choice(["x", "y"])).backend == MIRROR  # forced: any workload
    settings = load_settings({"grammask": {"backend": "xg-mirror", "prefer": MIRROR}}, env={})
    assert (settings.backend, settings.prefer) == (MIRROR, MIRROR)
    assert MIRROR in labels()
    with pytest.raises(InvalidSpecError, match="registered: auto, xgrammar, guidance, mirror"):
        GrammarSpec.regex("a", backend="outlines")


def test_it_is_reported(mirror: BackendInfo, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(MIRROR))
    assert "xg-mirror" in line and "batch-fill" in line and "regex 0" in line
    assert main(["compile", "--kind", "regex", "--backend", "xg-mirror", "--json",
                 "[0-9]+"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == MIRROR


def test_a_name_already_taken_is_refused(mirror: BackendInfo) -> None:
    with pytest.raises(ValueError, match="'llguidance' is already taken"):
        registry.register(BackendInfo(name="other", aliases=("llguidance",),
                                      adapter=MirrorBackend))
    assert registry.canonical("other") is None


def test_unregistered_it_is_unknown_again() -> None:
    assert MIRROR not in registry.names()
    with pytest.raises(InvalidSpecError, match="unknown backend 'mirror'"):
        GrammarSpec.regex("a", backend=MIRROR)


GAPPY = "gappy"


@pytest.fixture
def gappy() -> Iterator[BackendInfo]:
    """A third backend that declares its own gap, keyed by ``Feature`` like the built-in
    ones' (a misspelled feature would be a type error, not a gap that never matches)."""
    info = BackendInfo(
        name=GAPPY, adapter=MirrorBackend,
        gaps={Feature.STRING_LENGTH: "ignored by the test's backend"},
        costs={"json_free_text": Cost(0, "is the test's cheapest free-text backend")})
    registry.register(info)
    yield info
    registry.unregister(GAPPY)


def test_its_own_gaps_keep_a_schema_away_from_it(gappy: BackendInfo) -> None:
    free = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    cheap = plan(GrammarSpec.json_schema(free))
    assert cheap.backend == GAPPY and "gappy is the test's cheapest" in cheap.route.reason
    bounded = {**free, "properties": {"s": {"type": "string", "minLength": 2}}}
    routed = plan(GrammarSpec.json_schema(bounded))
    assert routed.backend == "guidance"  # the one backend that enforces minLength here
    assert "gappy does not enforce string minLength/maxLength" in routed.route.reason
    assert routed.route.features == {Feature.STRING_LENGTH: "/properties/s"}
    forced = plan(GrammarSpec.json_schema(bounded, backend=GAPPY))
    assert forced.attempts[0].unenforced == ("string minLength/maxLength",)
    with pytest.raises(UnsupportedError, match="gappy does not enforce string minLength"):
        plan(GrammarSpec.json_schema(bounded, backend=GAPPY, strict=True))


def test_every_declared_gap_is_a_feature() -> None:
    for backend in registry.backends():
        for table in (backend.gaps, backend.lenient_gaps, backend.lenient_exact,
                      backend.lenient_cannot):
            assert all(isinstance(key, Feature) for key in table), (backend.name, table)
