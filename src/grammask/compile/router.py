"""Per-request backend choice, decided from the spec alone (never from timing): the policy.

Tensor-parallel ranks must build identical masks, so the route is a pure function of the spec:
the same request gives the same backend on every rank. The router names no backend: it reads
the declarations in ``backends.registry`` (gaps, lenient mode, cost model), and it reads the
schema only through ``schema.analysis`` (features, keyword checks, free-form text). The
policy:

1. a forced backend (``spec.backend``) wins;
2. the spec's ``workload`` (a JSON schema with or without free-form text or open objects, a
   regex, GBNF, ...) and, for JSON schemas, the features each backend does not enforce (its
   ``gaps``, docs/keyword-probe.md) decide: of the backends that enforce
   everything, the cheapest for the workload by its declared ``Cost`` (``prefer`` first);
   the runner-up is the fallback. The costs follow measured compile times (corpus schemas,
   Qwen2.5 vocabulary; docs/benchmarks.md, Figures: compile routing): xgrammar compiles
   schemas without free-form text (no plain string, free key or untyped value) about as fast
   as llguidance, but any free-form string costs it far more and its tail reaches seconds;
   open objects (xgrammar's non-strict mode) cost it more still; its regex/Lark compiles are
   slower than llguidance's. Reasons name the keyword and the backend, never a timing;
3. when none enforces everything: the one that misses fewest (a backend with a lenient mode
   first on a tie: it knows its gaps), the gaps listed in ``Route.unenforced``; in strict
   mode that is an ``UnsupportedError`` instead.

``plan`` turns the decision into the ordered attempts a compile runs (fallbacks, lenient
retries, budget shares, the hedge a batch processor may start) from the same single walk of
the schema; the compiler carries it out and never asks again. Plans are kept by the
compiler's cache (``compile.cache``), per spec key: the router keeps nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..backends import registry
from ..backends.registry import BackendInfo, Workload
from ..errors import InvalidSchemaError, UnsupportedError
from ..schema.analysis import (
    Features,
    analyse,
    empty_ref_cycle,
    free_text_pointer,
    overlapping_one_of,
    schema_features,
)
from ..schema.features import FORMAT_FEATURES, Feature
from ..schema.keywords import check_keywords
from ..specs.grammar_spec import BackendName, GrammarSpec


@dataclass(frozen=True)
class Route:
    """The decision for one spec: which backend, why, and what it will not enforce."""

    backend: BackendName
    reason: str
    unenforced: tuple[str, ...] = ()
    lenient: bool = False
    fallback: BackendName | None = None
    features: Features = field(default_factory=dict, compare=False)


#: "auto" or a registered backend's name (``Compiler(prefer=...)``)
Preference = str


Failure = Literal["refused", "timeout", "internal"]
ALL_FAILURES: frozenset[Failure] = frozenset({"refused", "timeout", "internal"})
NOT_TIMING: frozenset[Failure] = frozenset({"refused", "internal"})


@dataclass(frozen=True)
class Attempt:
    """One step of a plan: a backend in a mode, what it leaves unenforced, and its budget."""

    backend: BackendName
    lenient: bool = False
    unenforced: tuple[str, ...] = ()
    #: share of the request's time left that this step may use (the rest is kept for the
    #: steps after it: a runaway first step still leaves time to fall back)
    budget: float = 1.0
    #: share of the time left this step waits for a free compile slot before moving on
    slot_budget: float = 1.0
    #: skip the queue behind runaway compiles holding every slot: the next step may be free
    skip_busy: bool = False
    #: the failures of the step before that lead here: "refused" (the backend refused the
    #: spec), "timeout" (slow or busy: a timing outcome), "internal" (the backend broke)
    after: frozenset[Failure] = ALL_FAILURES


@dataclass(frozen=True)
class Plan:
    """What a compile tries, in order, under one deadline: the router's whole policy.

    ``route`` is the decision (backend, reason, gaps) the first attempt carries out. ``hedge``
    is the attempt a batch processor may start beside the first one when a first mask is late
    (the first ready serves); None where the other backend may not serve the spec."""

    route: Route
    attempts: tuple[Attempt, ...]
    hedge: Attempt | None = None

    @property
    def backend(self) -> BackendName:
        return self.route.backend


#: The first attempt's shares when others follow (llguidance, the usual fallback, compiles
#: in a small share of a budget, so most of it may go to the first backend; docs/benchmarks.md,
#: Figures: compile routing).
FIRST_BUDGET, FIRST_SLOT_BUDGET = 0.7, 0.2


def plan(spec: GrammarSpec, *, prefer: Preference = "auto",
         rank_invariant: bool = False) -> Plan:
    """The attempts that may serve ``spec``, best first, from one walk of the schema.

    After the routed backend, for JSON schemas: the runner-up when it enforces everything
    too; the routed backend in lenient mode (e.g. llguidance with overlapping oneOf); the best
    other backend with its gaps listed (the ``hedge``). Other kinds: the route's fallback.
    Strict specs never fall back to a backend with gaps; forced backends never fall back.

    ``rank_invariant`` (tensor parallelism: every rank must end with the same grammar): no step
    depends on timing. The first attempt gets the whole budget and waits for its slot, and
    only a refusal or an internal error, which every rank sees alike, moves to the next.

    Raises what no backend may serve: ``InvalidSchemaError`` (a bad keyword value, a remote
    ``$ref``), ``UnsupportedError`` (an empty language; a strict spec no backend enforces)."""
    features, work = _analysis(spec)
    return _plan(spec, features, work, prefer, rank_invariant)


def _plan(spec: GrammarSpec, features: Features, work: tuple[Workload, str | None],
          prefer: Preference, rank_invariant: bool) -> Plan:
    decision = _decide(spec, features, prefer, work)
    hedge = _hedge(spec, features, decision, work)
    after = NOT_TIMING if rank_invariant else ALL_FAILURES
    rest: list[Attempt] = []
    if spec.backend is None:
        if decision.fallback is not None:
            rest.append(Attempt(decision.fallback, after=after))
        if hedge is not None and decision.fallback == hedge.backend:
            rest[-1] = replace(hedge, after=after)
        chosen = registry.info(decision.backend)
        if chosen.lenient and not decision.lenient and work[0] in _JSON:
            rest.append(Attempt(decision.backend, lenient=True, unenforced=(
                *_lenient_gaps(chosen, features, decision.unenforced), *decision.unenforced),
                after=after))
        if hedge is not None and all(a.backend != hedge.backend for a in rest):
            rest.append(replace(hedge, after=after))
    timed = bool(rest) and not rank_invariant
    first = Attempt(decision.backend, decision.lenient, decision.unenforced,
                    budget=FIRST_BUDGET if timed else 1.0,
                    slot_budget=FIRST_SLOT_BUDGET if timed else 1.0, skip_busy=timed)
    return Plan(decision, (first, *rest), hedge)


#: The JSON-schema workloads: the ones whose compile times differ by orders of magnitude
#: between backends (what a hedge is for).
_JSON = frozenset({"json_closed", "json_free_text", "json_open_objects"})


def workload(spec: GrammarSpec) -> tuple[Workload, str | None]:
    """What the spec asks of a backend, as the backends' cost models name it, with the
    pointer of the free-form text that makes a schema ``json_free_text``."""
    if spec.kind == "json_schema":
        if spec.extra_properties:
            return "json_open_objects", None
        free = free_text_pointer(spec.schema)
        return ("json_closed", None) if free is None else ("json_free_text", free)
    if spec.kind == "grammar":
        return ("gbnf" if spec.syntax == "ebnf" else "lark"), None
    if spec.kind == "structural_tag":
        legacy = "structures" in json.loads(spec.source)
        return ("structural_tag_legacy" if legacy else "structural_tag"), None
    return spec.kind, None


def _label(work: tuple[Workload, str | None]) -> str:
    name, pointer = work
    return {"json_closed": "no free-form text",
            "json_free_text": f"free-form text at {pointer}",
            "json_open_objects": "open objects (extra_properties=True)",
            "json_object": "json_object is free-form JSON",
            "gbnf": "GBNF", "lark": "Lark", "choice": "a choice list",
            "structural_tag": "structural tags",
            "structural_tag_legacy": "legacy structural tags"}.get(name, name)


def _hedge(spec: GrammarSpec, features: Features, decision: Route,
           work: tuple[Workload, str | None]) -> Attempt | None:
    """The best other backend for a JSON schema, when one may serve it (not forced; not
    strict about gaps it has). Only JSON schemas: their compile times differ by orders of
    magnitude between the backends; grammars do not (llguidance's GBNF conversion refuses
    valid texts)."""
    if work[0] not in _JSON or spec.backend is not None:
        return None
    others = [b for b in _serving(work[0]) if b.name != decision.backend
              and not (spec.strict and _gaps(features, b))]
    if not others:
        return None
    best = min(others, key=lambda b: (len(_gaps(features, b)), b.costs[work[0]].rank))
    gaps, lenient = _on_backend(best, features)
    return Attempt(best.name, lenient=lenient, unenforced=gaps)


def _serving(work: Workload) -> list[BackendInfo]:
    return [b for b in registry.backends() if work in b.costs]


def _gaps(features: Features, backend: BackendInfo) -> list[str]:
    """The features ``backend`` does not enforce (the gaps every backend shares excluded),
    by name: what ``unenforced`` lists (plain strings, whatever prints them)."""
    common = registry.common_gaps()
    return [name.value for name in features if name in backend.gaps and name not in common]


def _common(features: Features) -> tuple[str, ...]:
    common = registry.common_gaps()
    return tuple(f"{n} ({common[n]})" for n in features if n in common)


def _on_backend(backend: BackendInfo, features: Features) -> tuple[tuple[str, ...], bool]:
    """What ``backend`` leaves unenforced of these features, and whether it needs its lenient
    mode for them (a forced backend, or the hedge of a plan)."""
    gaps = _gaps(features, backend)
    lenient = backend.lenient and (bool(gaps) or any(
        n in backend.lenient_exact for n in features))
    extra = _lenient_gaps(backend, features, gaps) if lenient else []
    return (*gaps, *extra, *_common(features)), lenient


def _lenient_gaps(backend: BackendInfo, features: Features,
                  listed: Sequence[str]) -> list[str]:
    """The features a backend's lenient mode serves unenforced (``lenient_gaps``), those
    not already ``listed``."""
    return [n.value for n in features if n in backend.lenient_gaps and n not in listed]


def route(spec: GrammarSpec, *, prefer: Preference = "auto") -> Route:
    """The routed backend for a spec, with its reason and gaps (the first step of ``plan``)."""
    features, work = _analysis(spec)
    return _decide(spec, features, prefer, work)


def _analysis(spec: GrammarSpec) -> tuple[Features, tuple[Workload, str | None]]:
    """The spec's routing features and workload, from one walk of a JSON schema (features,
    keyword checks and the first free-form text together: ``schema.analysis.analyse``);
    raises for what no backend may serve, the same error the separate walks raise."""
    if spec.kind != "json_schema":
        return _features(spec), workload(spec)
    walked = analyse(spec.schema, free=not spec.extra_properties)
    if walked is None:  # a keyword check failed: the separate walks name the error
        return _features(spec), workload(spec)
    features, free = walked
    _refuse(spec, features, checked=True)
    features = _named(features)
    if spec.extra_properties:
        return features, ("json_open_objects", None)
    return features, (("json_closed", None) if free is None else ("json_free_text", free))


def _features(spec: GrammarSpec) -> Features:
    """The schema's routing features (one walk); raises for what no backend may serve."""
    features = schema_features(spec.schema) if spec.kind == "json_schema" else {}
    _refuse(spec, features, checked=False)
    return _named(features)


def _named(features: Features) -> Features:
    """The features some backend names (``registry.named_features``), in their order: a
    format every backend checks is no reason to choose, nor a gap to report. A missing
    ``type: string`` costs nothing where every format used is one no backend checks
    (``registry.unchecked_formats``); with such formats beside checked ones it is kept,
    wherever it was (said, never silent)."""
    named = registry.named_features()
    kept = {f: at for f, at in features.items() if f in named}
    if Feature.FORMAT_UNTYPED in kept and all(
            f in registry.unchecked_formats() for f in features
            if f in FORMAT_FEATURES):
        del kept[Feature.FORMAT_UNTYPED]
    return kept


def _refuse(spec: GrammarSpec, features: Features, *, checked: bool) -> None:
    """What no backend may serve (raised), and the features found beside the walk.
    ``checked``: the keyword values were checked already (by ``analyse``)."""
    if Feature.REMOTE_REF in features:
        raise InvalidSchemaError(
            "remote $ref is not supported: grammask never fetches schemas over the network; "
            "inline the referenced schema under $defs", where=features[Feature.REMOTE_REF])
    if spec.kind == "json_schema":
        # keyword values are checked here, not at spec construction: the route runs for
        # every check and compile (cache misses only), and a GrammarSpec stays a plain value
        if not checked:
            check_keywords(spec.schema)
        empty = empty_ref_cycle(spec.schema)
        if empty is not None:
            raise UnsupportedError(
                f"the schema's language is empty: nothing can be generated ($ref at {empty} "
                "leads back to itself without a value)", where=empty)
        if Feature.ONE_OF in features:
            overlap = overlapping_one_of(spec.schema)
            if overlap is not None and spec.extra_properties:
                features.setdefault(Feature.ONE_OF_OVERLAPPING, overlap)
            elif overlap is not None:  # closed objects keep llguidance's own disjointness
                # proof (a gap of its lenient mode only: it serves such a oneOf as anyOf)
                features.setdefault(Feature.ONE_OF_MAY_OVERLAP, overlap)
    if spec.whitespace_pattern is not None:
        features[Feature.WHITESPACE_PATTERN] = "options"


def _decide(spec: GrammarSpec, features: Features, prefer: Preference,
            work: tuple[Workload, str | None]) -> Route:
    """The cheapest backend that enforces every keyword (``prefer`` among those first);
    when none does, the one that misses fewest (strict specs: refused)."""
    if spec.backend is not None:
        return _forced(spec, features)
    serving = _serving(work[0])
    if not serving:
        raise UnsupportedError(f"no registered backend serves {_label(work)}", where="kind")
    label = _label(work)
    gaps = {b.name: _gaps(features, b) for b in serving}
    gapped = "; ".join(f"{b.title} does not enforce {_names(gaps[b.name])}"
                       for b in serving if gaps[b.name])
    full = [b for b in serving if not gaps[b.name]]
    if full:
        ranked = sorted(full, key=lambda b: (b.name != prefer, b.costs[work[0]].rank))
        chosen, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        if chosen.name == prefer:
            why = f"{chosen.title} preferred by configuration"
        else:
            why = f"{label}: {chosen.title} {chosen.costs[work[0]].why}"
            if runner_up is not None:
                why += f"; {runner_up.title} {runner_up.costs[work[0]].why}"
        if gapped:
            why = f"{gapped}; {chosen.title} does; {why}"
        elif spec.kind == "json_schema":
            everyone = "both backends" if len(serving) == 2 else "every backend"
            why = f"{everyone} enforce every keyword; {why}"
        lenient = chosen.lenient and any(n in chosen.lenient_exact for n in features)
        extra = _lenient_gaps(chosen, features, ()) if lenient else []
        return Route(chosen.name, why, unenforced=(*extra, *_common(features)),
                     lenient=lenient,
                     fallback=None if runner_up is None else runner_up.name, features=features)
    if spec.strict:
        lacks = "; ".join(f"{b.title} lacks {_names(gaps[b.name])}" for b in serving)
        raise UnsupportedError(f"no backend enforces every keyword ({lacks})",
                               where=_first_pointer(features, sorted(set().union(*gaps.values()))))
    # a lenient mode that cannot serve a gap would only refuse: such a backend goes last, and
    # on a tie the backend that knows its gaps (lenient mode) goes before one that ignores them
    chosen = min(serving, key=lambda b: (
        b.lenient and any(g in b.lenient_cannot for g in gaps[b.name]),
        len(gaps[b.name]), not b.lenient))
    mode = " (lenient)" if chosen.lenient else ""
    return Route(chosen.name, f"no backend enforces everything; {chosen.title}{mode} misses "
                 f"fewest ({_names(gaps[chosen.name])})",
                 unenforced=(*gaps[chosen.name], *(_lenient_gaps(chosen, features, gaps[
                     chosen.name]) if chosen.lenient else ()), *_common(features)),
                 lenient=chosen.lenient,
                 features=features)


def _forced(spec: GrammarSpec, features: Features) -> Route:
    assert spec.backend is not None
    backend = registry.info(spec.backend)
    gaps, lenient = _on_backend(backend, features)
    real = _gaps(features, backend)
    if spec.strict and real:
        raise UnsupportedError(f"{backend.title} does not enforce {_names(real)}",
                               where=_first_pointer(features, real))
    return Route(backend.name, "backend forced by the request", unenforced=gaps,
                 lenient=lenient, features=features)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def _first_pointer(features: Features, names: Sequence[str]) -> str | None:
    return next((features[Feature(n)] for n in names if n in features), None)


