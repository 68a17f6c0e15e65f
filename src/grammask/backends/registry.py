"""The backends grammask knows, each declared by its own module: the one place names live.

A backend module registers a ``BackendInfo`` when it is imported: its name and aliases, what it
leaves unenforced (``gaps``), its classes, from which the capabilities it has are derived
(``capabilities``: batch fill, disk cache, warnings; declared nowhere else), lenient mode,
and its ``costs``, the router's cost model. The router, compiler, settings, CLI and harness iterate
over ``backends()`` and look names up here; none of them names a backend. Among equals the
lower ``priority`` is preferred, then the earlier registered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import InvalidSpecError
from ..schema.features import Feature
from ..specs import backend_names
from ..specs.backend_names import canonical as canonical  # the name index, kept in its own module
from ..specs.backend_names import resolve as resolve
from .capabilities import batch_calls, has_disk, has_warnings

#: What a spec asks a backend to do, as the cost model sees it (``router.workload``).
Workload = Literal[
    "json_closed",        # a JSON schema without free-form text, objects closed
    "json_free_text",     # a JSON schema with a free string, key or untyped value
    "json_open_objects",  # a JSON schema with extra properties allowed (``extra_properties``)
    "json_object",        # any JSON object
    "regex", "lark", "gbnf", "choice",
    "structural_tag",         # the current structural-tag format
    "structural_tag_legacy",  # the older ``structures``/``triggers`` format
]


#: the gap of a format a backend does not check (``BackendInfo.unchecked_formats``)
UNCHECKED = "not checked"


@dataclass(frozen=True)
class Cost:
    """How well a backend serves one workload: ``rank`` orders backends (lower is cheaper:
    compile and per-step fill together), ``why`` is the fact behind it, never a timing."""

    rank: float
    why: str


@dataclass(frozen=True)
class BackendInfo:
    """One backend, as it declares itself."""

    name: str
    #: builds the adapter, a ``backends.base.Backend`` (called once per process, on first
    #: use; typed loosely here so that this module imports nothing the adapters import).
    #: Its class implementing ``capabilities.DiskBackend`` gives ``disk``.
    adapter: Callable[[], Any]
    #: its matcher class: implementing ``capabilities.BatchCalls`` gives ``batch_fill``
    matcher: type | None = None
    #: its compiled-grammar class: implementing ``capabilities.Warnings`` gives ``warnings``
    compiled: type | None = None
    #: its distribution on PyPI (versions in reports and in disk-cache keys)
    package: str = ""
    #: the tie-break among backends of equal cost: lower first
    priority: int = 100
    #: label in messages ("llguidance" for the backend named ``guidance``)
    label: str = ""
    aliases: tuple[str, ...] = ()
    #: schema feature (``schema.features.Feature``) -> what the backend does with it; the
    #: gaps every JSON backend has are reported apart (``common_gaps``)
    gaps: Mapping[Feature, str] = field(default_factory=dict)
    #: formats (``schema.features.FORMATS``) it does not check at all: each is a gap too
    #: ("not checked"); a format checked in part is a gap with its own detail
    unchecked_formats: frozenset[Feature] = frozenset()
    #: has a lenient mode: ignores the keywords it lacks instead of refusing the spec
    lenient: bool = False
    #: features refused by default only as a formality: lenient mode serves them exactly
    lenient_exact: frozenset[Feature] = frozenset()
    #: gaps even lenient mode refuses
    lenient_cannot: frozenset[Feature] = frozenset()
    #: features its default mode refuses unless it proves them (llguidance: a oneOf whose
    #: branches may overlap) and its lenient mode serves unenforced: listed as gaps of every
    #: lenient attempt
    lenient_gaps: Mapping[Feature, str] = field(default_factory=dict)
    #: the workloads it serves, with their cost; a workload absent here is not served
    costs: Mapping[Workload, Cost] = field(default_factory=dict)
    #: its compiles are bounded by its own limits (llguidance: lexer fuel, grammar size), so
    #: none can run away: a small spec's runs on the compiling thread itself, with no
    #: hand-off to a compile worker (the hand-off is what lets a deadline abandon a compile;
    #: it costs a small share of a cold llguidance compile). Bounded is not short (a large
    #: choice compiles for seconds), so a large spec's goes to a worker all the same
    #: (``compile.slots.may_run_here``; docs/benchmarks.md, Figures: compile routing).
    bounded_compile: bool = False
    #: process memory per cached grammar = scale * the grammar's ``memory_bytes`` + base
    #: (measured with bench/stress.py --calibrate)
    footprint: tuple[float, int] = (1.0, 0)

    def __post_init__(self) -> None:
        if self.unchecked_formats:  # each unchecked format is a gap
            gaps = {**dict.fromkeys(sorted(self.unchecked_formats), UNCHECKED), **self.gaps}
            object.__setattr__(self, "gaps", gaps)

    @property
    def title(self) -> str:
        return self.label or self.name

    @property
    def batch_fill(self) -> bool:
        """Its matchers offer the batch calls (one parallel fill per step for all its rows)."""
        return batch_calls(self.matcher) is not None

    @property
    def disk(self) -> bool:
        """Its compiled grammars can be stored in grammask's disk cache (its adapter is a
        ``DiskBackend``)."""
        return has_disk(self.adapter)

    @property
    def warnings(self) -> bool:
        """Its compiled grammars report what the backend ignored (``Warnings``)."""
        return has_warnings(self.compiled)


_lock = threading.Lock()
_registered: dict[str, BackendInfo] = {}
_adapters: dict[str, Any] = {}
#: kept in step with ``_registered`` (rebuilt under the lock when it changes): every spec
#: and every plan reads them, a sort and a scan each on a cold compile's path
_ordered: tuple[BackendInfo, ...] = ()
_named: frozenset[Feature] = frozenset()
_common: dict[Feature, str] = {}
_unchecked: frozenset[Feature] = frozenset()


def _reindex() -> None:
    """Rebuild the ordered tuple and the name/alias index (``backend_names``; the caller
    holds the lock)."""
    global _ordered, _named, _common, _unchecked
    _ordered = tuple(sorted(_registered.values(), key=lambda b: b.priority))
    _named = frozenset().union(*(
        (*b.gaps, *b.lenient_exact, *b.lenient_cannot, *b.lenient_gaps) for b in _ordered))
    _common, _unchecked = _shared([b for b in _ordered if any(w.startswith("json")
                                                             for w in b.costs)])
    index: dict[str, str] = {}
    for b in _ordered:  # a name before any alias, in preference order, as the scan found
        index.setdefault(b.name, b.name)
    for b in _ordered:
        for alias in b.aliases:
            index.setdefault(alias, b.name)
    backend_names.publish(index, tuple(b.name for b in _ordered))


def register(info: BackendInfo) -> None:
    """Add a backend (a module does this once, at import). A name or alias already taken by
    another backend is an error: two backends answering to one name would route at random."""
    with _lock:
        taken = {n: b.name for b in _registered.values() for n in (b.name, *b.aliases)}
        for n in (info.name, *info.aliases):
            if n in ("auto", "all") or taken.get(n, info.name) != info.name:
                raise ValueError(f"backend name {n!r} is already taken")
        _registered[info.name] = info
        _adapters.pop(info.name, None)
        _reindex()


def unregister(name: str) -> None:
    """Remove a backend (tests register throw-away ones)."""
    with _lock:
        _registered.pop(name, None)
        _adapters.pop(name, None)
        _reindex()


def backends() -> tuple[BackendInfo, ...]:
    """Every registered backend, in preference order (``priority``, then registration)."""
    return _ordered


def _shared(json_backends: Sequence[BackendInfo]
            ) -> tuple[dict[Feature, str], frozenset[Feature]]:
    """The gaps every JSON backend has alike (the same detail: each does the same with the
    feature, so no choice of backend helps) and the formats none checks at all. A gap the
    backends treat differently (one ignores, one refuses) stays each backend's own."""
    if not json_backends:
        return {}, frozenset()
    first, *others = json_backends
    common: dict[Feature, str] = {}
    for feature, detail in first.gaps.items():
        if all(b.gaps.get(feature) == detail for b in others):
            common[feature] = detail
    unchecked = frozenset(first.unchecked_formats).intersection(
        *(b.unchecked_formats for b in others))
    return common, unchecked


def common_gaps() -> Mapping[Feature, str]:
    """What every registered JSON backend leaves unenforced alike, with why: listed in
    ``unenforced``, never a reason to switch backends (nor to refuse in strict mode).
    Derived from the backends' declarations: a backend that closes one removes it."""
    return _common


def unchecked_formats() -> frozenset[Feature]:
    """The formats no registered JSON backend checks at all (a node without
    ``type: string`` loses nothing of them)."""
    return _unchecked


def named_features() -> frozenset[Feature]:
    """Every feature some backend names (its gaps and lenient-mode sets): the others (a
    format every backend checks) do not matter for routing."""
    return _named


def names() -> tuple[str, ...]:
    return tuple(b.name for b in backends())


def info(name: str) -> BackendInfo:
    """A registered backend's declaration (by name or alias); ``InvalidSpecError`` for an
    unknown one."""
    with _lock:
        found = _registered.get(name)
    if found is not None:
        return found
    resolved = resolve(name)
    if resolved is None:
        raise InvalidSpecError("a backend name is needed here, not auto", where="backend")
    return info(resolved)


def footprint(name: str) -> tuple[float, int]:
    """The memory model of a backend, also for one no longer registered (a test's)."""
    with _lock:
        found = _registered.get(name)
    return found.footprint if found is not None else (1.0, 0)


def adapter(name: str) -> Any:
    """The adapter of a registered backend, built once (``backends.get_backend`` types it).
    Built outside the lock: an adapter may wrap another one (and look it up here)."""
    declared = info(name)
    with _lock:
        built = _adapters.get(declared.name)
    if built is None:
        fresh = declared.adapter()
        with _lock:
            built = _adapters.setdefault(declared.name, fresh)
    return built
