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
from collections.abc import Callable, Mapping
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


#: What no registered backend enforces: listed in ``unenforced``, never a reason to switch
#: backends (nor to refuse in strict mode: both backends accept the impossible date
#: 2023-02-29). Kept here with the backends' own gaps; a backend that closes one removes it.
#: Formats no registered backend checks at all (a node without ``type: string`` loses
#: nothing of them).
UNCHECKED_FORMATS = frozenset({Feature.FORMAT_IDN_EMAIL, Feature.FORMAT_IDN_HOSTNAME,
                               Feature.FORMAT_IRI, Feature.FORMAT_IRI_REFERENCE,
                               Feature.FORMAT_REGEX})
COMMON_GAPS: dict[Feature, str] = {
    Feature.FORMAT_DATE: "day-of-month not checked (2023-02-29 passes)",
    **dict.fromkeys(sorted(UNCHECKED_FORMATS), "no backend checks it"),
}


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
    #: schema feature (``schema.features.Feature``) -> what the backend does with it
    gaps: Mapping[Feature, str] = field(default_factory=dict)
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
    #: (``compile_slots.may_run_here``; docs/benchmarks.md, Figures: compile routing).
    bounded_compile: bool = False
    #: process memory per cached grammar = scale * the grammar's ``memory_bytes`` + base
    #: (measured with bench/stress.py --calibrate)
    footprint: tuple[float, int] = (1.0, 0)

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
_named: frozenset[Feature] = frozenset(COMMON_GAPS)


def _reindex() -> None:
    """Rebuild the ordered tuple and the name/alias index (``backend_names``; the caller
    holds the lock)."""
    global _ordered, _named
    _ordered = tuple(sorted(_registered.values(), key=lambda b: b.priority))
    _named = frozenset(COMMON_GAPS).union(*(
        (*b.gaps, *b.lenient_exact, *b.lenient_cannot, *b.lenient_gaps) for b in _ordered))
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


def named_features() -> frozenset[Feature]:
    """Every feature some backend (or ``COMMON_GAPS``) names: the others (a format every
    backend checks) do not matter for routing."""
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
