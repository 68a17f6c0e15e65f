"""Per-request backend choice, decided from the spec alone (never from timing).

Tensor-parallel ranks must build identical masks, so the route is a pure function of the spec:
the same request gives the same backend on every rank. The router names no backend: it reads
the declarations in ``backends.registry`` (gaps, lenient mode, cost model). The policy:

1. a forced backend (``spec.backend``) wins;
2. the spec's ``workload`` (a JSON schema with or without free-form text or open objects, a
   regex, GBNF, ...) and, for JSON schemas, the keywords each backend does not enforce (its
   ``gaps``, measured with bench/keyword_probe.py) decide: of the backends that enforce
   everything, the cheapest for the workload by its declared ``Cost`` (``prefer`` first);
   the runner-up is the fallback. Measured facts behind the costs (corpus schemas, Qwen2.5
   vocabulary): xgrammar compiles schemas without free-form text (no plain string, free key
   or untyped value) in 1-2 ms, but any free-form string costs ~25 ms and the tail reaches
   seconds, while llguidance compiles in ~1.4 ms at p50; open objects (xgrammar's non-strict
   mode) cost xgrammar 864 ms p50 on 300 corpus schemas; xgrammar's regex/Lark compiles are
   5-80x slower. Reasons name the keyword and the backend, never a timing;
3. when none enforces everything: the one that misses fewest (a backend with a lenient mode
   first on a tie: it knows its gaps), the gaps listed in ``Route.unenforced``; in strict
   mode that is an ``UnsupportedError`` instead.

``plan`` turns the decision into the ordered attempts a compile runs (fallbacks, lenient
retries, budget shares, the hedge a batch processor may start) from the same single walk of
the schema; the compiler carries it out and never asks again.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .backends import registry
from .backends.registry import BackendInfo, Workload
from .errors import InvalidSchemaError, UnsupportedError
from .normalize import _CHILD_KEYS as _WALK_KEYS
from .normalize import _CHILD_LIST_KEYS as _WALK_LISTS
from .normalize import _CHILD_MAP_KEYS as _WALK_MAPS
from .normalize import _CHILD_ORDER as _WALK_ORDER
from .normalize import (
    combinator_gap,
    ends_with_anchor,
    escape_key,
    overlapping_pattern_all_of,
    structural_chars,
    subschemas,
)
from .spec import (
    _MISSING,
    BackendName,
    GrammarSpec,
    canonical_json,
    check_keywords,
    keywords_ok,
    resolve_pointer,
)

#: Formats both backends enforce (``date`` with the common gap below).
_KNOWN_FORMATS = frozenset({
    "date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid",
})
#: xgrammar enforces these; llguidance 1.7 calls them unknown (measured by the harness).
_XGRAMMAR_ONLY_FORMATS = frozenset({
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
#: Neither backend enforces these: xgrammar ignores them, llguidance calls them unknown.
_UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})

#: Neither backend enforces these; listed in ``unenforced`` but not a reason to switch backends
#: (nor to refuse in strict mode: both backends accept the impossible date 2023-02-29).
COMMON_GAPS: dict[str, str] = {
    "format: date": "day-of-month not checked (2023-02-29 passes)",
    "format (neither backend)": "idn-email, idn-hostname, iri, iri-reference and regex are "
                               "not checked",
}

@dataclass(frozen=True)
class Route:
    """The decision for one spec: which backend, why, and what it will not enforce."""

    backend: BackendName
    reason: str
    unenforced: tuple[str, ...] = ()
    lenient: bool = False
    fallback: BackendName | None = None
    features: dict[str, str] = field(default_factory=dict, compare=False)


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


#: The first attempt's shares when others follow (measured: llguidance, the usual fallback,
#: compiles in milliseconds, so most of the budget may go to the first backend).
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
    only a refusal or an internal error, which every rank sees alike, moves to the next."""
    features, work = _analysis(spec)
    key = (tuple(features), work[0], prefer, rank_invariant, spec.strict, spec.backend,
           spec.kind)
    backends = registry.backends()
    known = _PLANS.get(key)
    if known is not None and known[0] is backends:
        _, shape, attempts, hedge = known
        return Plan(replace(shape, reason=shape.reason.replace(_LABEL, _label(work)),
                            features=features), attempts, hedge)
    made = _plan(spec, features, work, prefer, rank_invariant)
    # the same plan for every spec with these feature names and this workload: only the
    # reason's label (a pointer) and the features' pointers differ, filled in per spec
    template = _decide(spec, features, prefer, work, label=_LABEL)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (backends, replace(template, features={}), made.attempts, made.hedge)
    return made


#: decided plans by (feature names, workload, options): (the registry they were made
#: with, the route with ``_LABEL`` for the workload's label, the attempts, the hedge). The
#: decision costs ~60 µs on a cold compile's path; a service sees a few dozen shapes.
_PLANS: dict[tuple[Any, ...], tuple[Any, Route, tuple[Attempt, ...], Attempt | None]] = {}
_MAX_PLANS = 4096
_LABEL = "\x00label\x00"


def _plan(spec: GrammarSpec, features: dict[str, str], work: tuple[Workload, str | None],
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


def _hedge(spec: GrammarSpec, features: dict[str, str], decision: Route,
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


def _gaps(features: dict[str, str], backend: BackendInfo) -> list[str]:
    """The features ``backend`` does not enforce (the gaps every backend shares excluded)."""
    return [name for name in features if name in backend.gaps]


def _common(features: dict[str, str]) -> tuple[str, ...]:
    return tuple(f"{n} ({COMMON_GAPS[n]})" for n in features if n in COMMON_GAPS)


def _on_backend(backend: BackendInfo, features: dict[str, str]) -> tuple[tuple[str, ...], bool]:
    """What ``backend`` leaves unenforced of these features, and whether it needs its lenient
    mode for them (a forced backend, or the hedge of a plan)."""
    gaps = _gaps(features, backend)
    lenient = backend.lenient and (bool(gaps) or any(
        n in backend.lenient_exact for n in features))
    extra = _lenient_gaps(backend, features, gaps) if lenient else []
    return (*gaps, *extra, *_common(features)), lenient


def _lenient_gaps(backend: BackendInfo, features: dict[str, str],
                  listed: tuple[str, ...] | list[str]) -> list[str]:
    """The features a backend's lenient mode serves unenforced (``lenient_gaps``), those
    not already ``listed``."""
    return [n for n in features if n in backend.lenient_gaps and n not in listed]


def route(spec: GrammarSpec, *, prefer: Preference = "auto") -> Route:
    """The routed backend for a spec, with its reason and gaps (the first step of ``plan``)."""
    features, work = _analysis(spec)
    return _decide(spec, features, prefer, work)


def _analysis(spec: GrammarSpec) -> tuple[dict[str, str], tuple[Workload, str | None]]:
    """The spec's routing features and workload, from one walk of a JSON schema (features,
    keyword checks and the first free-form text together: ``_schema_walk``); raises for what
    no backend may serve, the same error the separate walks raise."""
    if spec.kind != "json_schema":
        return _features(spec), workload(spec)
    walked = _schema_walk(spec.schema, free=not spec.extra_properties)
    if walked is None:  # a keyword check failed: the separate walks name the error
        return _features(spec), workload(spec)
    features, free = walked
    _refuse(spec, features, checked=True)
    if spec.extra_properties:
        return features, ("json_open_objects", None)
    return features, (("json_closed", None) if free is None else ("json_free_text", free))


def _features(spec: GrammarSpec) -> dict[str, str]:
    """The schema's routing features (one walk); raises for what no backend may serve."""
    features = schema_features(spec.schema) if spec.kind == "json_schema" else {}
    _refuse(spec, features, checked=False)
    return features


def _refuse(spec: GrammarSpec, features: dict[str, str], *, checked: bool) -> None:
    """What no backend may serve (raised), and the features found beside the walk.
    ``checked``: the keyword values were checked already (by ``_schema_walk``)."""
    if "$ref (remote)" in features:
        raise InvalidSchemaError(
            "remote $ref is not supported: grammask never fetches schemas over the network; "
            "inline the referenced schema under $defs", where=features["$ref (remote)"])
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
        if "oneOf" in features:
            overlap = overlapping_one_of(spec.schema)
            if overlap is not None and spec.extra_properties:
                features.setdefault("oneOf (overlapping branches)", overlap)
            elif overlap is not None:  # closed objects keep llguidance's own disjointness
                # proof (a gap of its lenient mode only: it serves such a oneOf as anyOf)
                features.setdefault("oneOf (may overlap)", overlap)
    if spec.whitespace_pattern is not None:
        features["whitespace_pattern"] = "options"


def _decide(spec: GrammarSpec, features: dict[str, str], prefer: Preference,
            work: tuple[Workload, str | None], label: str | None = None) -> Route:
    """The cheapest backend that enforces every keyword (``prefer`` among those first);
    when none does, the one that misses fewest (strict specs: refused). ``label``: the
    workload's label in the reason (default: ``_label(work)``)."""
    if spec.backend is not None:
        return _forced(spec, features)
    serving = _serving(work[0])
    if not serving:
        raise UnsupportedError(f"no registered backend serves {_label(work)}", where="kind")
    label = _label(work) if label is None else label
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


def _forced(spec: GrammarSpec, features: dict[str, str]) -> Route:
    assert spec.backend is not None
    backend = registry.info(spec.backend)
    gaps, lenient = _on_backend(backend, features)
    real = _gaps(features, backend)
    if spec.strict and real:
        raise UnsupportedError(f"{backend.title} does not enforce {_names(real)}",
                               where=_first_pointer(features, real))
    return Route(backend.name, "backend forced by the request", unenforced=gaps,
                 lenient=lenient, features=features)


def free_text_pointer(schema: Any) -> str | None:
    """Where the schema first admits free-form text (the xgrammar compile-cost driver)."""
    for pointer, node in _subschemas(schema, ""):
        if _admits_free_text(node):
            return pointer or "/"
    return None


_STRUCTURE_KEYS = ("properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref",
                   "enum", "const", "type", "additionalProperties", "patternProperties")


def _admits_free_text(node: dict[str, Any]) -> bool:
    if "enum" in node or "const" in node:
        return False
    typ = node.get("type")
    types = typ if isinstance(typ, list) else [typ]
    if "string" in types:
        return True
    if "object" in types or "properties" in node:
        extra = node.get("additionalProperties")
        if extra is True or isinstance(extra, dict) or "patternProperties" in node:
            return True  # free keys are strings
        if "properties" not in node and extra is None:
            return True  # a free-form object
    if "array" in types and "items" not in node and "prefixItems" not in node:
        return True
    return not any(key in node for key in _STRUCTURE_KEYS)  # untyped: any value


def empty_ref_cycle(schema: Any) -> str | None:
    """The pointer of a ``$ref`` the root reaches through nothing but ``$ref``s and comes back
    to: such a schema has no instance (``{"$ref": "#"}``), and every token would be masked."""
    node, seen, pointer = schema, set(), ""
    while isinstance(node, dict):
        ref = node.get("$ref")
        others = [k for k in node if k != "$ref" and k not in _ANNOTATIONS
                  and k not in _REF_NEUTRAL]
        if not isinstance(ref, str) or not ref.startswith("#") or others:
            return None
        if ref in seen:
            return f"{pointer}/$ref"
        seen.add(ref)
        pointer = ref[1:]
        node = resolve_pointer(schema, ref)
    return None


def overlapping_one_of(schema: Any) -> str | None:
    """The pointer of the first ``oneOf`` whose branches an instance may match together when
    objects are open (two objects requiring different keys: ``{"a", "b"}`` matches both).
    Branches count as disjoint only when proven: different types, a shared required key with
    disjoint ``const``/``enum`` values, or a closed branch that lacks a key the other
    requires."""
    for pointer, node in _subschemas(schema, ""):
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            continue
        resolved = [_deref(schema, b) for b in branches]
        for i, a in enumerate(resolved):
            if any(not _disjoint(a, b) for b in resolved[i + 1:]):
                return pointer or "/"
    return None


def _deref(schema: Any, node: Any) -> Any:
    for _ in range(32):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)
                and node["$ref"].startswith("#") and len(node) == 1):
            return node
        node = resolve_pointer(schema, node["$ref"])
    return node


def _types(node: dict[str, Any]) -> set[str] | None:
    typ = node.get("type")
    if "const" in node or "enum" in node or typ is None:
        return None
    names = set(typ if isinstance(typ, list) else [typ])
    return names | {"number"} if "integer" in names else names


def _values(node: Any) -> list[Any] | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return enum if isinstance(enum, list) else None


def _disjoint(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:  # integer counts as a number
        return True
    pa, pb = a.get("properties"), b.get("properties")
    pa, pb = (pa if isinstance(pa, dict) else {}), (pb if isinstance(pb, dict) else {})
    ra, rb = a.get("required"), b.get("required")
    ra, rb = (ra if isinstance(ra, list) else []), (rb if isinstance(rb, list) else [])
    for key in set(ra) & set(rb):
        va, vb = _values(pa.get(key)), _values(pb.get(key))
        if va is not None and vb is not None and not any(
                canonical_json(x) == canonical_json(y) for x in va for y in vb):
            return True
    for one, other_required in ((a, rb), (b, ra)):
        props = one.get("properties")
        declared = props if isinstance(props, dict) else {}
        if (one.get("additionalProperties") is False and "patternProperties" not in one
                and any(k not in declared for k in other_required)):
            return True
    return False


def _names(names: list[str]) -> str:
    return ", ".join(names)


def _first_pointer(features: dict[str, str], names: list[str]) -> str | None:
    return next((features[n] for n in names if n in features), None)


# ------------------------------------------------------------------------ schema analysis
def schema_features(schema: Any) -> dict[str, str]:
    """Routing-relevant features of a schema, each with the JSON pointer of its first use."""
    found: dict[str, str] = {}
    refs: list[str] = []
    for pointer, node in _subschemas(schema, ""):
        ref = node.get("$ref")
        if isinstance(ref, str) and _stray(ref):
            refs.append(ref)
        if _FEATURE_KEYS.isdisjoint(node):  # most nodes: nothing a backend lacks
            continue
        for name in _node_features(node):
            found.setdefault(name, pointer or "/")
    with contextlib.suppress(Exception):  # a malformed pointer: the checker names it
        _stray_features(schema, refs, found)
    return found


def _schema_walk(schema: Any, *, free: bool) -> tuple[dict[str, str], str | None] | None:
    """``schema_features``, ``check_keywords`` and (``free``) ``free_text_pointer`` of a
    schema in one walk, the three walks' results alike: subschemas in ``subschemas``' order,
    and no pointer per node (one is made only for what is reported: a feature's first use,
    the free-form text). None when a keyword check fails, or the schema has a shape only
    the checker names: the separate walks then raise their exact error."""
    if not isinstance(schema, dict):
        return {}, None
    found: dict[str, str] = {}
    free_at: str | None = None
    # per visited node: (its parent's index, the child key it hangs from, the map key or
    # list index under that key)
    trail: list[tuple[int, str, str | int | None]] = []
    refs: list[str] = []
    nested_ids = False
    stack: list[tuple[dict[str, Any], int, str, str | int | None, bool]] = [
        (schema, -1, "", None, True)]
    order = _WALK_ORDER.__getitem__
    try:
        while stack:
            node, parent, key, sub, positive = stack.pop()
            at = len(trail)
            trail.append((parent, key, sub))
            if not keywords_ok(node, ranges=positive):
                return None
            if not _FEATURE_KEYS.isdisjoint(node):
                pointer = None
                for name in _node_features(node):
                    if name not in found:
                        pointer = pointer or _trail_pointer(trail, at) or "/"
                        found[name] = pointer
            if free and free_at is None and _admits_free_text(node):
                free_at = _trail_pointer(trail, at) or "/"
            if at and ("$id" in node or ("id" in node and isinstance(node.get("id"), str))):
                nested_ids = True  # refs resolve against another base: not checked
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.append(ref)
            present = _WALK_KEYS.intersection(node)
            for child_key in sorted(present, key=order) if len(present) > 1 else present:
                child = node[child_key]
                if child_key in _WALK_MAPS:
                    if isinstance(child, dict):
                        for k, v in child.items():
                            if isinstance(v, dict):
                                stack.append((v, at, child_key, k, positive))
                            elif not isinstance(v, bool):
                                return None
                elif isinstance(child, list):
                    if child_key not in _WALK_LISTS and child_key not in _WALK_ARRAYS:
                        return None
                    for i, v in enumerate(child):
                        if isinstance(v, dict):
                            stack.append((v, at, child_key, i, positive))
                        elif not isinstance(v, bool):
                            return None
                elif child_key not in _WALK_LISTS:
                    if isinstance(child, dict):
                        stack.append((child, at, child_key, None,
                                      positive and child_key not in ("not", "if")))
                    elif not isinstance(child, bool):
                        return None
        if not nested_ids and any(resolve_pointer(schema, r) is _MISSING for r in refs):
            return None
        _stray_features(schema, refs, found)
    except Exception:  # whatever the checker makes of it, it says so itself
        return None
    return found, free_at


def _stray_features(schema: Any, refs: list[str], found: dict[str, str]) -> None:
    """The features of subschemas the walk does not reach but a ``$ref`` does: those kept
    under a key that is no keyword (``{"$ref": "#/ddd/x", "ddd": {"x": {"not": ...}}}``),
    followed from ref to ref."""
    todo = [r for r in refs if _stray(r)]
    seen: set[str] = set()
    while todo and len(seen) < 256:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        node = resolve_pointer(schema, ref)
        for pointer, sub in _subschemas(node, ref[1:]):
            if not _FEATURE_KEYS.isdisjoint(sub):
                for name in _node_features(sub):
                    found.setdefault(name, pointer or "/")
            inner = sub.get("$ref")
            if isinstance(inner, str) and _stray(inner):
                todo.append(inner)


def _stray(ref: str) -> bool:
    """A local ``$ref`` into a part of the schema the feature walk does not visit."""
    return ref.startswith("#/") and ref[2:].split("/", 1)[0] not in _WALK_KEYS


def _trail_pointer(trail: list[tuple[int, str, str | int | None]], at: int) -> str:
    """The JSON pointer of the ``at``-th node of a walk ("" for the root)."""
    parts: list[str] = []
    while at > 0:
        at, key, sub = trail[at]
        parts.append(f"/{key}" if sub is None else
                     f"/{key}/{_esc(sub) if isinstance(sub, str) else sub}")
    return "".join(reversed(parts))


#: single-subschema keys that may also hold an array of subschemas (the walk's child keys and
#: their order are ``subschemas``': features are first found in the same place)
_WALK_ARRAYS = frozenset({"items", "additionalItems"})


#: Every key ``_node_features`` looks at: a node with none of them has no feature.
_FEATURE_KEYS = frozenset({
    "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies", "not",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf", "if", "contains",
    "minContains", "maxContains", "multipleOf", "allOf", "$ref", "$dynamicRef",
    "$dynamicAnchor", "minLength", "maxLength", "pattern", "patternProperties", "required",
    "format", "minProperties", "maxProperties", "anyOf"})


#: ``_node_features``' checks by the keys that can trigger them: most nodes have only
#: ``required``, ``format``, ``pattern`` or a length, and skip the rest in one set test
_RARE_KEYS = frozenset({"dependentRequired", "dependentSchemas", "dependencies", "not",
                        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf",
                        "if", "contains", "minContains", "maxContains", "multipleOf", "allOf"})
_PATTERN_KEYS = frozenset({"minLength", "maxLength", "pattern", "patternProperties"})


def _node_features(node: dict[str, Any]) -> list[str]:
    """The features one node uses, in a fixed order (the report's order). Each group of
    checks runs only when the node has one of its keys: this runs for nearly every object
    node of every cold compile."""
    present = _FEATURE_KEYS.intersection(node)
    out: list[str] = []
    if not present:
        return out
    if "uniqueItems" in present and node["uniqueItems"] is True:
        out.append("uniqueItems")
    if not _RARE_KEYS.isdisjoint(present):
        out.extend(key for key in ("dependentRequired", "dependentSchemas", "dependencies",
                                   "not", "propertyNames", "unevaluatedProperties",
                                   "unevaluatedItems", "oneOf") if key in present)
        if "if" in present:
            out.append("if/then/else")
        if "contains" in present or "minContains" in present or "maxContains" in present:
            out.append("contains")
        mult = node.get("multipleOf")
        if isinstance(mult, float) and not mult.is_integer():
            out.append("multipleOf (non-integer)")
        if "allOf" in present and combinator_gap(node):
            out.append("allOf (several branches)")  # what normalize cannot merge away
    if ("anyOf" in present or "oneOf" in present) and "allOf" not in present and \
            combinator_gap(node):
        out.append("anyOf/oneOf beside other keywords")
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            out.append("$ref (remote)")
        elif ref == "#":
            out.append("$ref to the root")
        elif not ref.startswith("#/"):
            out.append("$anchor / $dynamicRef")
        if any(k not in _ANNOTATIONS and k not in _REF_NEUTRAL for k in node if k != "$ref"):
            out.append("$ref with siblings")
    if "$dynamicRef" in present or "$dynamicAnchor" in present:
        out.append("$anchor / $dynamicRef")
    if not _PATTERN_KEYS.isdisjoint(present):
        has_length = "minLength" in present or "maxLength" in present
        pattern = node.get("pattern")
        if "pattern" in present and has_length:
            out.append("pattern with minLength/maxLength")
        elif has_length and _may_be_string(node):
            out.append("string minLength/maxLength")
        patterns = [pattern] if isinstance(pattern, str) else []
        pattern_props = node.get("patternProperties")
        if isinstance(pattern_props, dict):
            patterns += [p for p in pattern_props if isinstance(p, str)]
        if isinstance(pattern, str) and _inner_anchor(pattern):
            out.append("pattern (inner anchors)")
        if any(_LOOKAROUND.search(p) for p in patterns):
            out.append("pattern (lookaround)")
    required = node.get("required")
    if isinstance(required, list) and required:
        props = node.get("properties")
        declared = props if isinstance(props, dict) else {}
        if any(name not in declared for name in required):
            out.append("required (undeclared names)")
    if "patternProperties" in present and "additionalProperties" not in node:
        out.append("patternProperties")
    if ("patternProperties" in present and "properties" in node
            and "allOf (several branches)" not in out and overlapping_pattern_all_of(node)):
        out.append("allOf (several branches)")  # normalize folds the pattern in as an allOf
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type") in ("string", None):
        if fmt == "date":
            out.append("format: date")
        elif fmt in _XGRAMMAR_ONLY_FORMATS:
            out.append("format (llguidance unknown)")
        elif fmt in _UNENFORCED_FORMATS:
            out.append("format (neither backend)")
        elif fmt not in _KNOWN_FORMATS:
            out.append("format (unknown)")
        if "type" not in node and fmt not in _UNENFORCED_FORMATS:
            out.append("format (untyped)")
    if ("minProperties" in present or "maxProperties" in present) and _has_optional(node):
        out.append("minProperties/maxProperties")
    return out


def _may_be_string(node: dict[str, Any]) -> bool:
    typ = node.get("type")
    return typ is None or typ == "string" or (isinstance(typ, list) and "string" in typ)


_LOOKAROUND = re.compile(r"\(\?<?[=!]|(?<!\\)(?:\\\\)*\\[bB]")


def _inner_anchor(pattern: str) -> bool:
    """A ``^`` or ``$`` anchor anywhere but the pattern's two ends."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if ends_with_anchor(body):
        body = body[:-1]
    return any(ch in "^$" for ch, _ in structural_chars(body))


def _has_optional(node: dict[str, Any]) -> bool:
    """Declared but not required properties (what llguidance's min/maxProperties refuses)."""
    props = node.get("properties")
    required = node.get("required", [])
    return isinstance(props, dict) and any(name not in required for name in props)


_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
#: Keys beside a ``$ref`` that constrain nothing (they hold or name definitions).
_REF_NEUTRAL = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$comment",
                          "$anchor", "$vocabulary"})
_subschemas = subschemas
_esc = escape_key
