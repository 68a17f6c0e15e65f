"""Per-request backend choice, decided from the spec alone (never from timing).

Tensor-parallel ranks must build identical masks, so the route is a pure function of the spec:
the same request gives the same backend on every rank. The policy:

1. a forced backend (``spec.backend``) wins;
2. JSON schemas: find the keywords each backend does not enforce (``GAPS`` below, measured on
   xgrammar 0.2.8 / llguidance 1.7); take the backend that enforces everything. When both do,
   xgrammar first -- unless its compile would stall the request. Measured on corpus schemas
   with the Qwen2.5 vocabulary: xgrammar compiles schemas without free-form text (no plain
   string, free key or untyped value) in 1-2 ms, but any free-form string costs ~25 ms and the
   tail reaches seconds, while llguidance compiles in ~1.4 ms at p50. Open objects
   (``extra_properties=True``, xgrammar's non-strict mode) cost xgrammar 864 ms p50 on 300
   corpus schemas, 2-10 s for single schemas that take 20-60 ms closed. So free-form text and
   open objects go to llguidance (``free_text_pointer`` decides; deterministic), the rest to
   xgrammar. Reasons name the keyword and the backend, never a timing (timings are facts of
   this machine and this release, kept here);
3. when neither enforces everything: the one with fewer gaps (ties to llguidance), the gaps
   listed in ``Route.unenforced``; in strict mode that is an ``UnsupportedError`` instead;
4. other kinds: xgrammar for choice lists, structural tags and GBNF (its native syntax; the
   llguidance conversion changes the language), llguidance for regexes and Lark (measured:
   xgrammar's regex/Lark compiles are 5-80x slower).

``plan`` turns the decision into the ordered attempts a compile runs (fallbacks, lenient
retries, budget shares, the hedge a batch processor may start) from the same single walk of
the schema; the compiler carries it out and never asks again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .errors import InvalidSchemaError, UnsupportedError
from .normalize import ends_with_anchor, escape_key, structural_chars, subschemas
from .spec import BackendName, GrammarSpec, canonical_json, check_keywords, resolve_pointer

#: What xgrammar 0.2.8 ignores, gets wrong or refuses, keyword by keyword (measured with
#: bench/keyword_probe.py; table in docs/keyword-probe.md).
XGRAMMAR_GAPS: dict[str, str] = {
    "uniqueItems": "ignored",
    "contains": "wrong: accepts only []",
    "dependentRequired": "ignored",
    "dependentSchemas": "ignored",
    "dependencies": "ignored",
    "if/then/else": "ignored",
    "not": "ignored",
    "multipleOf (non-integer)": "ignored",
    "allOf (several branches)": "ignored",
    "oneOf": "treated as anyOf",
    "$ref (remote)": "matches anything",
    "$ref with siblings": "siblings ignored",
    "$anchor / $dynamicRef": "matches anything",
    "pattern with minLength/maxLength": "length ignored",
    "patternProperties": "refuses keys that match when additionalProperties is absent",
    "whitespace_pattern": "not supported",
    "required (undeclared names)": "ignored for names not in properties",
    "string minLength/maxLength": "admits raw control characters (invalid JSON)",
    "format (untyped)": "ignored without type: string",
    "pattern (inner anchors)": "^ and $ inside the pattern are ignored",
    "pattern (lookaround)": "look-around and \\b are ignored",
    "$ref to the root": "mask forbids tokens accept takes (`}}` after `{\"x\":{`)",
}

#: What llguidance 1.7 refuses by default ("Unimplemented keys"); lenient mode ignores them.
GUIDANCE_GAPS: dict[str, str] = {
    "uniqueItems": "refused",
    "contains": "refused",
    "propertyNames": "refused",
    "dependentRequired": "refused",
    "dependentSchemas": "refused",
    "dependencies": "refused",
    "if/then/else": "refused",
    "not": "refused",
    "unevaluatedProperties": "refused",
    "unevaluatedItems": "refused",
    "$ref (remote)": "refused",
    "$anchor / $dynamicRef": "refused ($dynamicRef)",
    "minProperties/maxProperties": "refused unless every property is required",
    "format (llguidance unknown)": "refused as unknown (lenient mode ignores it)",
    "pattern (lookaround)": "refused, even in lenient mode",
    "oneOf (overlapping branches)": "refused; lenient mode treats it as anyOf (an instance "
                                    "matching several branches passes)",
}

#: llguidance gaps lenient mode cannot serve: when both backends have gaps, xgrammar then
#: serves (with its gaps listed) instead of a doomed llguidance attempt.
GUIDANCE_HARD = frozenset({"pattern (lookaround)"})

#: Refused by llguidance's default mode only as a formality: lenient mode serves them exactly
#: (unknown formats are annotations in JSON Schema 2020-12).
GUIDANCE_LENIENT_SAFE = frozenset({"format (unknown)", "format (neither backend)"})

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


Preference = Literal["auto", "xgrammar", "guidance"]


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

    After the routed backend, for JSON schemas: the other backend when it enforces everything
    too; llguidance in lenient mode (e.g. overlapping oneOf); the other backend with its gaps
    listed (the ``hedge``). Other kinds: the route's fallback, else the other backend after an
    internal error only. Strict specs never fall back to a backend with gaps; forced backends
    never fall back.

    ``rank_invariant`` (tensor parallelism: every rank must end with the same grammar): no step
    depends on timing. The first attempt gets the whole budget and waits for its slot, and
    only a refusal or an internal error, which every rank sees alike, moves to the next."""
    features = _features(spec)
    decision = _decide(spec, features, prefer)
    hedge = _hedge(spec, features, decision)
    after = NOT_TIMING if rank_invariant else ALL_FAILURES
    rest: list[Attempt] = []
    if spec.backend is None and spec.kind == "json_schema":
        if hedge is not None and decision.fallback == hedge.backend:
            rest.append(replace(hedge, after=after))
        if decision.backend == "guidance" and not decision.lenient:
            rest.append(Attempt("guidance", lenient=True, unenforced=decision.unenforced,
                                after=after))
        if hedge is not None and all(a.backend != hedge.backend for a in rest):
            rest.append(replace(hedge, after=after))
    elif spec.backend is None:
        if decision.fallback is not None:
            rest.append(Attempt(decision.fallback, after=after))
        else:
            other: BackendName = "xgrammar" if decision.backend == "guidance" else "guidance"
            rest.append(Attempt(other, after=frozenset({"internal"})))
    timed = bool(rest) and not rank_invariant
    first = Attempt(decision.backend, decision.lenient, decision.unenforced,
                    budget=FIRST_BUDGET if timed else 1.0,
                    slot_budget=FIRST_SLOT_BUDGET if timed else 1.0, skip_busy=timed)
    return Plan(decision, (first, *rest), hedge)


def _hedge(spec: GrammarSpec, features: dict[str, str], decision: Route) -> Attempt | None:
    """The other backend for a JSON schema, when it may serve it (not forced; not strict about
    gaps it has). Only JSON schemas: their compile times differ by orders of magnitude
    between the backends; grammars do not (llguidance's GBNF conversion refuses valid
    texts)."""
    if spec.kind != "json_schema" or spec.backend is not None:
        return None
    other: BackendName = "guidance" if decision.backend == "xgrammar" else "xgrammar"
    gaps, lenient = _on_backend(other, features)
    if spec.strict and _real_gaps(gaps):
        return None
    return Attempt(other, lenient=lenient, unenforced=tuple(gaps))


def _on_backend(backend: BackendName, features: dict[str, str]) -> tuple[list[str], bool]:
    """What ``backend`` leaves unenforced of these features, and whether llguidance needs its
    lenient mode for them (a forced backend, or the other backend of a plan)."""
    gaps = _gaps(features, XGRAMMAR_GAPS if backend == "xgrammar" else GUIDANCE_GAPS)
    lenient = backend == "guidance" and (bool(gaps) or any(
        n in GUIDANCE_LENIENT_SAFE for n in features))
    return gaps + [f"{n} ({COMMON_GAPS[n]})" for n in features if n in COMMON_GAPS], lenient


def _real_gaps(gaps: list[str]) -> bool:
    """Gaps a backend has (strict mode refuses them), not the ones both share."""
    return any(g in XGRAMMAR_GAPS or g in GUIDANCE_GAPS for g in gaps)


def route(spec: GrammarSpec, *, prefer: Preference = "auto") -> Route:
    """The routed backend for a spec, with its reason and gaps (the first step of ``plan``)."""
    return _decide(spec, _features(spec), prefer)


def _features(spec: GrammarSpec) -> dict[str, str]:
    """The schema's routing features (one walk); raises for what no backend may serve."""
    features = schema_features(spec.schema) if spec.kind == "json_schema" else {}
    if "$ref (remote)" in features:
        raise InvalidSchemaError(
            "remote $ref is not supported: grammask never fetches schemas over the network; "
            "inline the referenced schema under $defs", where=features["$ref (remote)"])
    if spec.kind == "json_schema":
        # keyword values are checked here, not at spec construction: the route runs for
        # every check and compile (cache misses only), and a GrammarSpec stays a plain value
        check_keywords(spec.schema)
        empty = empty_ref_cycle(spec.schema)
        if empty is not None:
            raise UnsupportedError(
                f"the schema's language is empty: nothing can be generated ($ref at {empty} "
                "leads back to itself without a value)", where=empty)
        if spec.extra_properties:  # closed objects keep llguidance's own disjointness proof
            overlap = overlapping_one_of(spec.schema)
            if overlap is not None:
                features.setdefault("oneOf (overlapping branches)", overlap)
    if spec.whitespace_pattern is not None:
        features["whitespace_pattern"] = "options"
    return features


def _decide(spec: GrammarSpec, features: dict[str, str], prefer: Preference) -> Route:
    if spec.backend is not None:
        return _forced(spec, features)
    if spec.kind != "json_schema":
        return _route_other(spec, features)
    common = tuple(f"{n} ({COMMON_GAPS[n]})" for n in features if n in COMMON_GAPS)
    lenient_safe = any(n in GUIDANCE_LENIENT_SAFE for n in features)
    xg_gaps = _gaps(features, XGRAMMAR_GAPS)
    ll_gaps = _gaps(features, GUIDANCE_GAPS)
    if not xg_gaps and not ll_gaps:
        free = None if prefer == "xgrammar" else free_text_pointer(spec.schema)
        open_objects = spec.extra_properties and prefer != "xgrammar"
        if prefer != "guidance" and free is None and not open_objects:
            why = ("xgrammar preferred by configuration" if prefer == "xgrammar" else
                   "no free-form text, so xgrammar compiles fast and fills fastest")
            return Route("xgrammar", f"both backends enforce every keyword; {why}",
                         unenforced=common, fallback="guidance", features=features)
        if open_objects:
            why = ("open objects (extra_properties=True) put xgrammar in its non-strict mode, "
                   "whose compile is slow; llguidance compiles them lazily")
        elif free is None:
            why = "llguidance preferred by configuration"
        else:
            why = (f"free-form text at {free} makes xgrammar precompute string masks at "
                   "compile time; llguidance computes masks lazily")
        return Route("guidance", f"both backends enforce every keyword; {why}",
                     unenforced=common, lenient=lenient_safe, fallback="xgrammar",
                     features=features)
    if not ll_gaps:
        return Route("guidance", f"xgrammar does not enforce {_names(xg_gaps)}; llguidance "
                     "does", unenforced=common, lenient=lenient_safe, features=features)
    if not xg_gaps:
        return Route("xgrammar", f"llguidance refuses {_names(ll_gaps)}; xgrammar enforces it",
                     unenforced=common, features=features)
    if spec.strict:
        raise UnsupportedError(
            f"no backend enforces every keyword (xgrammar lacks {_names(xg_gaps)}; "
            f"llguidance lacks {_names(ll_gaps)})",
            where=_first_pointer(features, sorted(set(xg_gaps) | set(ll_gaps))))
    if len(xg_gaps) < len(ll_gaps) or any(g in GUIDANCE_HARD for g in ll_gaps):
        return Route("xgrammar", f"neither backend enforces everything; xgrammar misses fewer "
                     f"({_names(xg_gaps)})", unenforced=(*xg_gaps, *common), features=features)
    return Route("guidance", f"neither backend enforces everything; llguidance (lenient) misses "
                 f"{_names(ll_gaps)}", unenforced=(*ll_gaps, *common), lenient=True,
                 features=features)


def _forced(spec: GrammarSpec, features: dict[str, str]) -> Route:
    backend = spec.backend
    assert backend is not None
    gaps, lenient = _on_backend(backend, features)
    if spec.strict and _real_gaps(gaps):
        raise UnsupportedError(f"{backend} does not enforce {_names(gaps)}",
                               where=_first_pointer(features, gaps))
    return Route(backend, "backend forced by the request", unenforced=tuple(gaps),
                 lenient=lenient, features=features)


def _route_other(spec: GrammarSpec, features: dict[str, str]) -> Route:
    if spec.kind == "json_object":
        if spec.whitespace_pattern is not None:
            return Route("guidance", "whitespace_pattern needs llguidance", features=features)
        return Route("guidance", "json_object is free-form JSON: xgrammar precomputes its string "
                     "masks at compile time, llguidance computes masks lazily",
                     fallback="xgrammar", features=features)
    if spec.kind == "grammar" and spec.syntax == "ebnf":
        return Route("xgrammar", "GBNF is native to xgrammar; llguidance's GBNF-to-Lark "
                     "conversion folds trailing whitespace into terminals and refuses some "
                     "valid texts",
                     fallback="guidance", features=features)
    if spec.kind == "grammar":
        return Route("guidance", "Lark is native to llguidance (xgrammar compiles it eagerly)",
                     fallback="xgrammar", features=features)
    if spec.kind == "structural_tag":
        legacy = "structures" in json.loads(spec.source)
        return Route("xgrammar", "structural tags are native to xgrammar",
                     fallback="guidance" if legacy else None, features=features)
    if spec.kind == "regex":
        return Route("guidance", "regex: llguidance compiles it lazily; xgrammar's compile "
                     "grows with the pattern",
                     fallback="xgrammar", features=features)
    return Route("xgrammar", "choice: a finite set, xgrammar compiles it eagerly and fills "
                 "fastest", fallback="guidance", features=features)


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


def _gaps(features: dict[str, str], table: dict[str, str]) -> list[str]:
    return [name for name in features if name in table]


def _names(names: list[str]) -> str:
    return ", ".join(names)


def _first_pointer(features: dict[str, str], names: list[str]) -> str | None:
    return next((features[n] for n in names if n in features), None)


# ------------------------------------------------------------------------ schema analysis
def schema_features(schema: Any) -> dict[str, str]:
    """Routing-relevant features of a schema, each with the JSON pointer of its first use."""
    found: dict[str, str] = {}
    for pointer, node in _subschemas(schema, ""):
        if _FEATURE_KEYS.isdisjoint(node):  # most nodes: nothing a backend lacks
            continue
        for name in _node_features(node):
            found.setdefault(name, pointer or "/")
    return found


#: Every key ``_node_features`` looks at: a node with none of them has no feature.
_FEATURE_KEYS = frozenset({
    "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies", "not",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf", "if", "contains",
    "minContains", "maxContains", "multipleOf", "allOf", "$ref", "$dynamicRef",
    "$dynamicAnchor", "minLength", "maxLength", "pattern", "patternProperties", "required",
    "format", "minProperties", "maxProperties"})


def _node_features(node: dict[str, Any]) -> Iterator[str]:
    if node.get("uniqueItems") is True:
        yield "uniqueItems"
    for key in ("dependentRequired", "dependentSchemas", "dependencies", "not",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf"):
        if key in node:
            yield key
    if "if" in node:
        yield "if/then/else"
    if any(k in node for k in ("contains", "minContains", "maxContains")):
        yield "contains"
    mult = node.get("multipleOf")
    if isinstance(mult, float) and not mult.is_integer():
        yield "multipleOf (non-integer)"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield "allOf (several branches)"
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            yield "$ref (remote)"
        elif ref == "#":
            yield "$ref to the root"
        elif ref != "#" and not ref.startswith("#/"):
            yield "$anchor / $dynamicRef"
        if any(k not in _ANNOTATIONS and k not in _REF_NEUTRAL for k in node if k != "$ref"):
            yield "$ref with siblings"
    if "$dynamicRef" in node or "$dynamicAnchor" in node:
        yield "$anchor / $dynamicRef"
    has_length = "minLength" in node or "maxLength" in node
    pattern = node.get("pattern")
    if "pattern" in node and has_length:
        yield "pattern with minLength/maxLength"
    elif has_length and _may_be_string(node):
        yield "string minLength/maxLength"
    patterns = [pattern] if isinstance(pattern, str) else []
    pattern_props = node.get("patternProperties")
    if isinstance(pattern_props, dict):
        patterns += [p for p in pattern_props if isinstance(p, str)]
    if isinstance(pattern, str) and _inner_anchor(pattern):
        yield "pattern (inner anchors)"
    if any(_LOOKAROUND.search(p) for p in patterns):
        yield "pattern (lookaround)"
    required = node.get("required")
    if isinstance(required, list):
        props = node.get("properties")
        declared = props if isinstance(props, dict) else {}
        if any(name not in declared for name in required):
            yield "required (undeclared names)"
    if "patternProperties" in node and "additionalProperties" not in node:
        yield "patternProperties"
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type") in ("string", None):
        if fmt == "date":
            yield "format: date"
        elif fmt in _XGRAMMAR_ONLY_FORMATS:
            yield "format (llguidance unknown)"
        elif fmt in _UNENFORCED_FORMATS:
            yield "format (neither backend)"
        elif fmt not in _KNOWN_FORMATS:
            yield "format (unknown)"
        if "type" not in node and fmt not in _UNENFORCED_FORMATS:
            yield "format (untyped)"
    if ("minProperties" in node or "maxProperties" in node) and _has_optional(node):
        yield "minProperties/maxProperties"


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
