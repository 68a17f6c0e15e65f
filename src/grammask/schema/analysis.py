"""What the router decides from, read off a JSON schema: its features (each with the JSON
pointer of its first use), the first free-form text (the workload), and the shapes no
backend may serve (an empty ``$ref`` cycle, overlapping ``oneOf`` branches).

``analyse`` does the features, the keyword checks and the free-form text in one walk (the
one ``Walk``, through ``keywords.checked``); the separate functions give the same answers
and serve where one is wanted alone (the harness, the fallback that names an error).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .features import ANNOTATIONS, FEATURE_KEYS, REF_NEUTRAL, Feature, node_features
from .jsontext import canonical_json
from .keys import KEYS
from .keywords import checked
from .walk import Walk, resolve_pointer, subschemas

Features = dict[Feature, str]


def analyse(schema: Any, *, free: bool) -> tuple[Features, str | None] | None:
    """``schema_features``, ``check_keywords`` and (``free``) ``free_text_pointer`` in one
    walk, with the three's results. None when the check fails (or anything else goes
    wrong): the separate functions then raise their exact error, in their order."""
    if not isinstance(schema, dict):
        return {}, None
    found: Features = {}
    free_at: str | None = None
    strays: list[str] = []
    walk = Walk(schema)
    try:
        for at, node in checked(walk):
            if not FEATURE_KEYS.isdisjoint(node):
                _note(node, walk, at, found, strays)
            if free and free_at is None and allows_free_text(node):
                free_at = walk.pointer(at) or "/"
        _stray_features(schema, strays, found)
    except Exception:  # whatever the checker makes of it, it says so itself
        return None
    return found, free_at


def schema_features(schema: Any) -> Features:
    """Routing-relevant features of a schema, each with the JSON pointer of its first use
    (the keyword values unchecked: a malformed ``$ref`` target is passed over)."""
    found: Features = {}
    strays = _collect(schema, "", found)
    with contextlib.suppress(Exception):  # a malformed pointer: the checker names it
        _stray_features(schema, strays, found)
    return found


def _collect(root: Any, base: str, found: Features) -> list[str]:
    """The features of every subschema under ``root`` into ``found``; the ``$ref``s into
    parts of the schema the walk does not reach."""
    strays: list[str] = []
    walk = Walk(root, base)
    for at, node, _ in walk:
        if isinstance(node, dict) and not FEATURE_KEYS.isdisjoint(node):
            _note(node, walk, at, found, strays)
    return strays


def _note(node: dict[str, Any], walk: Walk, at: int, found: Features,
          strays: list[str]) -> None:
    """One node's features, each kept at its first pointer, and its stray ``$ref``."""
    pointer = None
    for name in node_features(node):
        if name not in found:
            pointer = pointer or walk.pointer(at) or "/"
            found[name] = pointer
    ref = node.get("$ref")
    if isinstance(ref, str) and _stray(ref):
        strays.append(ref)


def _stray_features(schema: Any, refs: list[str], found: Features) -> None:
    """The features of subschemas the walk does not reach but a ``$ref`` does: those kept
    under a key that is no keyword (``{"$ref": "#/ddd/x", "ddd": {"x": {"not": ...}}}``),
    followed from ref to ref."""
    todo = list(refs)
    seen: set[str] = set()
    while todo and len(seen) < 256:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        todo += _collect(resolve_pointer(schema, ref), ref[1:], found)


def _stray(ref: str) -> bool:
    """A local ``$ref`` into a part of the schema the walk does not visit."""
    return ref.startswith("#/") and ref[2:].split("/", 1)[0] not in KEYS


# ---------------------------------------------------------------------- free-form text
def free_text_pointer(schema: Any) -> str | None:
    """Where the schema first admits free-form text (the xgrammar compile-cost driver)."""
    for pointer, node in subschemas(schema):
        if allows_free_text(node):
            return pointer or "/"
    return None


_STRUCTURE_KEYS = ("properties", "items", "prefixItems", "anyOf", "oneOf", "allOf", "$ref",
                   "enum", "const", "type", "additionalProperties", "patternProperties")


def allows_free_text(node: dict[str, Any]) -> bool:
    """Whether this node admits a free string, a free key or any value."""
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


# --------------------------------------------------------------- shapes no backend serves
def empty_ref_cycle(schema: Any) -> str | None:
    """The pointer of a ``$ref`` the root reaches through nothing but ``$ref``s and comes back
    to: such a schema has no instance (``{"$ref": "#"}``), and every token would be masked."""
    node, seen, pointer = schema, set(), ""
    while isinstance(node, dict):
        ref = node.get("$ref")
        others = [k for k in node if k != "$ref" and k not in ANNOTATIONS
                  and k not in REF_NEUTRAL]
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
    for pointer, node in subschemas(schema):
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


