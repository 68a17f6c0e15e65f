"""A third backend, registered by this test alone, is routed to, compiled, cached and reported
without any change outside this file: the registry is the only place backends are named, its
capabilities are derived from the classes it declares (``backends.capabilities``), its
tokenizer view lives on the vocabulary through ``Vocabulary.view`` and its gaps are keyed by
``Feature``.

The third backend is a stand-in (a thin wrapper over the real xgrammar adapter under another
name): grammask ships two backends, and the point is that nothing else names them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from grammask import metrics
from grammask.backends import Warnings, disk_backend, get_backend, registry
from grammask.backends.diskcache import DiskCache
from grammask.backends.registry import BackendInfo, Cost
from grammask.cli import main
from grammask.compile.compiler import Compiler
from grammask.compile.router import plan
from grammask.errors import InvalidSpecError, UnsupportedError
from grammask.harness.report import labels
from grammask.integrations.vllm.settings import load_settings
from grammask.schema.features import Feature
from grammask.specs.grammar_spec import GrammarSpec
from grammask.vocab import Vocabulary

MIRROR = "mirror"
_VIEW = "mirror.view"
#: the vocabularies a mirror view was made for (one entry per view made)
VIEWS_MADE: list[int] = []


@dataclass(frozen=True)
class MirrorView:
    """The third backend's own view of a vocabulary (a real one would hold its tokenizer)."""

    words: int


def mirror_view(vocab: Vocabulary) -> MirrorView:
    """Its view, kept on the vocabulary by the generic hook: no change to ``Vocabulary``."""
    return vocab.view(_VIEW, _make_view)


def _make_view(vocab: Vocabulary) -> MirrorView:
    VIEWS_MADE.append(id(vocab))
    return MirrorView((vocab.vocab_size + 31) // 32)


class MirrorBackend:
    """xgrammar under another name: what a third adapter module would register."""

    name = MIRROR

    def __init__(self) -> None:
        self._inner = get_backend("xgrammar")
        self.compiles = 0

    def prepare(self, vocab: Vocabulary) -> None:
        mirror_view(vocab)
        self._inner.prepare(vocab)

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False
                ) -> object:
        assert mirror_view(vocab).words == (vocab.vocab_size + 31) // 32
        self.compiles += 1
        return self._inner.compile(spec, vocab, lenient=lenient)

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        self._inner.check(spec, lenient=lenient)


@pytest.fixture
def mirror() -> Iterator[BackendInfo]:
    xgrammar = registry.info("xgrammar")
    info = BackendInfo(
        name=MIRROR, aliases=("xg-mirror",), adapter=MirrorBackend, gaps=xgrammar.gaps,
        matcher=xgrammar.matcher, compiled=xgrammar.compiled, footprint=xgrammar.footprint,
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


# ------------------------------------------------------------------ its own pieces
def test_it_keeps_its_own_tokenizer_view_on_the_vocabulary(mirror: BackendInfo,
                                                           qwen25: Vocabulary) -> None:
    """``prepare`` builds the view (every compile service prepares every backend), once per
    vocabulary: a second service finds it there."""
    for _ in range(2):
        Compiler(qwen25).close()
    assert VIEWS_MADE.count(id(qwen25)) == 1
    assert mirror_view(qwen25) is mirror_view(qwen25)


def test_a_view_is_made_once_whatever_the_threads() -> None:
    vocab = Vocabulary([b"a", b"b", b"<eos>"], special_ids=[2], stop_ids=[2], vocab_size=64)
    start = threading.Barrier(8)
    seen: list[MirrorView] = []

    def ask() -> None:
        start.wait()
        seen.append(mirror_view(vocab))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert VIEWS_MADE.count(id(vocab)) == 1
    assert len(seen) == 8 and all(v is seen[0] for v in seen) and seen[0].words == 2


def test_its_capabilities_are_derived_from_its_classes(mirror: BackendInfo) -> None:
    """Batch fill from its matcher class, the disk cache from its adapter class, warnings
    from its compiled class: declared nowhere else (the built-ins are derived alike)."""
    assert mirror.batch_fill and not mirror.disk and not mirror.warnings
    assert disk_backend(MIRROR) is None
    bare = BackendInfo(name="bare", adapter=MirrorBackend)
    assert not bare.batch_fill and not bare.disk and not bare.warnings
    xgrammar, guidance = registry.info("xgrammar"), registry.info("guidance")
    assert xgrammar.batch_fill and xgrammar.disk and not xgrammar.warnings
    assert guidance.batch_fill and not guidance.disk and guidance.warnings


class DiskMirrorBackend(MirrorBackend):
    """The mirror with the disk capability (``capabilities.DiskBackend``): xgrammar's codec."""

    def load_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, *,
                      lenient: bool = False) -> object:
        return self._inner.load_compiled(cache, spec, vocab,  # type: ignore[attr-defined]
                                         lenient=lenient)

    def store_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary,
                       grammar: object, *, lenient: bool = False,
                       compile_ms: float | None = None) -> bool:
        # no compile time: xgrammar's write policy would skip a grammar that compiled as
        # fast as it loads (timing-dependent; that policy is test_diskcache's business)
        stored: bool = self._inner.store_compiled(  # type: ignore[attr-defined]
            cache, spec, vocab, grammar, lenient=lenient, compile_ms=None)
        return stored


class Warned:
    """A compiled grammar that says what it ignored (``capabilities.Warnings``)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def warnings(self) -> list[str]:
        return ["the test's backend ignored nothing"]


def test_a_disk_capable_third_backend_is_stored_and_loaded(qwen25: Vocabulary,
                                                          tmp_path: Path) -> None:
    info = BackendInfo(name="diskmirror", adapter=DiskMirrorBackend,
                       matcher=registry.info("xgrammar").matcher, compiled=Warned,
                       costs={"regex": Cost(9, "is the test's disk backend")})
    registry.register(info)
    try:
        assert info.disk and info.warnings and info.batch_fill
        assert isinstance(disk_backend("diskmirror"), DiskMirrorBackend)
        assert isinstance(Warned(None), Warnings)
        spec = GrammarSpec.regex("[a-z]{3}", backend="diskmirror")
        first = Compiler(qwen25, backend="diskmirror", disk_cache_dir=tmp_path / "c")
        try:
            assert not first.compile(spec).from_disk
            assert first.flush_disk_cache(60) and first.stats.disk_writes == 1
        finally:
            first.close()
        again = Compiler(qwen25, backend="diskmirror", disk_cache_dir=tmp_path / "c")
        try:
            grammar = again.compile(spec)
            assert grammar.from_disk and grammar.backend == "diskmirror"
        finally:
            again.close()
    finally:
        registry.unregister("diskmirror")


def test_the_gaps_all_share_follow_the_registered_backends(gappy: BackendInfo) -> None:
    """The common gaps are derived from the declarations: a third JSON backend that checks
    ``regex`` (``gappy`` declares no unchecked format) takes it out of them, and the
    backends that do not check it then have it as a gap of their own."""
    assert registry.common_gaps() == {}  # gappy checks every format
    assert registry.unchecked_formats() == frozenset()
    schema = {"type": "object", "properties": {"s": {"type": "string", "format": "regex"}},
              "required": ["s"]}
    routed = plan(GrammarSpec.json_schema(schema))
    assert routed.backend == GAPPY
    assert routed.route.unenforced == ()
    forced = plan(GrammarSpec.json_schema(schema, backend="xgrammar"))
    assert forced.attempts[0].unenforced == ("format: regex",)


def test_the_gaps_all_share_are_those_each_declares_alike() -> None:
    """Without a third backend: the formats neither built-in backend checks, and the date
    check both lack, each reported once and never a reason to switch."""
    common = registry.common_gaps()
    unchecked = {Feature.FORMAT_IDN_EMAIL, Feature.FORMAT_IDN_HOSTNAME, Feature.FORMAT_IRI,
                 Feature.FORMAT_IRI_REFERENCE, Feature.FORMAT_REGEX}
    assert set(common) == {*unchecked, Feature.FORMAT_DATE}
    assert registry.unchecked_formats() == unchecked
    # uniqueItems: both lack it, but one ignores it and one refuses it: each its own gap
    assert Feature.UNIQUE_ITEMS not in common
    schema = {"type": "string", "format": "regex"}
    routed = plan(GrammarSpec.json_schema(schema))
    assert routed.route.unenforced == ("format: regex (not checked)",)
    assert "enforce every keyword" in routed.route.reason
