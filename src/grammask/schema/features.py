"""What a schema uses that some backend may not enforce: the ``Feature`` enum and the test
of one subschema (``node_features``). Schema knowledge only: which backend enforces what is
each backend's declaration (``grammask.backends``); a format is a feature of its own, so a
backend declares the formats it does not check by name.

Features are the shared vocabulary of the schema analysis (``analysis``), the router and the
backends' declarations: each backend's ``gaps`` is a ``dict[Feature, str]``, so a feature
misspelled there is a type error, not a gap that silently never matches. A ``Feature`` is a
``StrEnum``: its value is the name reports and ``Grammar.unenforced`` print.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from .normalize import (
    combinator_gap,
    ends_with_anchor,
    overlapping_pattern_all_of,
    structural_chars,
)


class Feature(enum.StrEnum):
    """A schema feature some backend may lack, by the name reports give it."""

    UNIQUE_ITEMS = "uniqueItems"
    DEPENDENT_REQUIRED = "dependentRequired"
    DEPENDENT_SCHEMAS = "dependentSchemas"
    DEPENDENCIES = "dependencies"
    NOT = "not"
    PROPERTY_NAMES = "propertyNames"
    UNEVALUATED_PROPERTIES = "unevaluatedProperties"
    UNEVALUATED_ITEMS = "unevaluatedItems"
    ONE_OF = "oneOf"
    IF_THEN_ELSE = "if/then/else"
    CONTAINS = "contains"
    MULTIPLE_OF_FRACTION = "multipleOf (non-integer)"
    ALL_OF = "allOf (several branches)"
    COMBINATOR_SIBLINGS = "anyOf/oneOf beside other keywords"
    REMOTE_REF = "$ref (remote)"
    ROOT_REF = "$ref to the root"
    ANCHOR_REF = "$anchor / $dynamicRef"
    REF_SIBLINGS = "$ref with siblings"
    PATTERN_LENGTH = "pattern with minLength/maxLength"
    STRING_LENGTH = "string minLength/maxLength"
    PATTERN_INNER_ANCHORS = "pattern (inner anchors)"
    PATTERN_LOOKAROUND = "pattern (lookaround)"
    REQUIRED_UNDECLARED = "required (undeclared names)"
    PATTERN_PROPERTIES = "patternProperties"
    #: the formats JSON Schema 2020-12 defines (``FORMATS``), one feature each
    FORMAT_DATE_TIME = "format: date-time"
    FORMAT_DATE = "format: date"
    FORMAT_TIME = "format: time"
    FORMAT_DURATION = "format: duration"
    FORMAT_EMAIL = "format: email"
    FORMAT_IDN_EMAIL = "format: idn-email"
    FORMAT_HOSTNAME = "format: hostname"
    FORMAT_IDN_HOSTNAME = "format: idn-hostname"
    FORMAT_IPV4 = "format: ipv4"
    FORMAT_IPV6 = "format: ipv6"
    FORMAT_URI = "format: uri"
    FORMAT_URI_REFERENCE = "format: uri-reference"
    FORMAT_IRI = "format: iri"
    FORMAT_IRI_REFERENCE = "format: iri-reference"
    FORMAT_UUID = "format: uuid"
    FORMAT_URI_TEMPLATE = "format: uri-template"
    FORMAT_JSON_POINTER = "format: json-pointer"
    FORMAT_RELATIVE_JSON_POINTER = "format: relative-json-pointer"
    FORMAT_REGEX = "format: regex"
    #: a format JSON Schema does not define (an annotation in 2020-12)
    FORMAT_UNKNOWN = "format (unknown)"
    #: a format on a node without ``type: string``
    FORMAT_UNTYPED = "format (untyped)"
    PROPERTY_COUNT = "minProperties/maxProperties"
    #: found by the analysis beside the walk (``analysis.overlapping_one_of``)
    ONE_OF_OVERLAPPING = "oneOf (overlapping branches)"
    ONE_OF_MAY_OVERLAP = "oneOf (may overlap)"
    #: a spec option, not a keyword (``GrammarSpec.whitespace_pattern``)
    WHITESPACE_PATTERN = "whitespace_pattern"


#: The formats JSON Schema 2020-12 defines, by name: each is a feature of its own.
FORMATS: dict[str, Feature] = {
    f.value.removeprefix("format: "): f for f in Feature if f.value.startswith("format: ")}
#: Every format feature: a format JSON Schema defines, or one it does not.
FORMAT_FEATURES = frozenset({*FORMATS.values(), Feature.FORMAT_UNKNOWN})

#: Every key ``node_features`` looks at: a node with none of them has no feature.
FEATURE_KEYS = frozenset({
    "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies", "not",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf", "if", "contains",
    "minContains", "maxContains", "multipleOf", "allOf", "$ref", "$dynamicRef",
    "$dynamicAnchor", "minLength", "maxLength", "pattern", "patternProperties", "required",
    "format", "minProperties", "maxProperties", "anyOf"})

#: ``node_features``' checks by the keys that can trigger them: most nodes have only
#: ``required``, ``format``, ``pattern`` or a length, and skip the rest in one set test
_RARE_KEYS = frozenset({"dependentRequired", "dependentSchemas", "dependencies", "not",
                        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "oneOf",
                        "if", "contains", "minContains", "maxContains", "multipleOf", "allOf"})
#: keywords that are a feature by their presence alone, in the report's order
_PRESENT = tuple((k, Feature(k)) for k in (
    "dependentRequired", "dependentSchemas", "dependencies", "not", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "oneOf"))
_PATTERN_KEYS = frozenset({"minLength", "maxLength", "pattern", "patternProperties"})

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
#: Keys beside a ``$ref`` that constrain nothing (they hold or name definitions).
REF_NEUTRAL = frozenset({"$defs", "definitions", "$schema", "$id", "id", "$comment",
                         "$anchor", "$vocabulary"})


def node_features(node: dict[str, Any]) -> list[Feature]:
    """The features one subschema uses, in a fixed order (the report's order). Each group
    of checks runs only when the node has one of its keys: this runs for nearly every
    object node of every cold compile."""
    present = FEATURE_KEYS.intersection(node)
    out: list[Feature] = []
    if not present:
        return out
    if "uniqueItems" in present and node["uniqueItems"] is True:
        out.append(Feature.UNIQUE_ITEMS)
    if not _RARE_KEYS.isdisjoint(present):
        out.extend(feature for key, feature in _PRESENT if key in present)
        if "if" in present:
            out.append(Feature.IF_THEN_ELSE)
        if "contains" in present or "minContains" in present or "maxContains" in present:
            out.append(Feature.CONTAINS)
        mult = node.get("multipleOf")
        if isinstance(mult, float) and not mult.is_integer():
            out.append(Feature.MULTIPLE_OF_FRACTION)
        if "allOf" in present and combinator_gap(node):
            out.append(Feature.ALL_OF)  # what normalize cannot merge away
    if ("anyOf" in present or "oneOf" in present) and "allOf" not in present and \
            combinator_gap(node):
        out.append(Feature.COMBINATOR_SIBLINGS)
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            out.append(Feature.REMOTE_REF)
        elif ref == "#":
            out.append(Feature.ROOT_REF)
        elif not ref.startswith("#/"):
            out.append(Feature.ANCHOR_REF)
        if any(k not in ANNOTATIONS and k not in REF_NEUTRAL for k in node if k != "$ref"):
            out.append(Feature.REF_SIBLINGS)
    if "$dynamicRef" in present or "$dynamicAnchor" in present:
        out.append(Feature.ANCHOR_REF)
    if not _PATTERN_KEYS.isdisjoint(present):
        _pattern_features(node, present, out)
    required = node.get("required")
    if isinstance(required, list) and required:
        props = node.get("properties")
        declared = props if isinstance(props, dict) else {}
        if any(name not in declared for name in required):
            out.append(Feature.REQUIRED_UNDECLARED)
    if "patternProperties" in present and "additionalProperties" not in node:
        out.append(Feature.PATTERN_PROPERTIES)
    if ("patternProperties" in present and "properties" in node
            and Feature.ALL_OF not in out and overlapping_pattern_all_of(node)):
        out.append(Feature.ALL_OF)  # normalize folds the pattern in as an allOf
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type") in ("string", None):
        out.extend(_format_features(fmt, typed="type" in node))
    if ("minProperties" in present or "maxProperties" in present) and has_optional(node):
        out.append(Feature.PROPERTY_COUNT)
    return out


def _pattern_features(node: dict[str, Any], present: frozenset[str],
                      out: list[Feature]) -> None:
    has_length = "minLength" in present or "maxLength" in present
    pattern = node.get("pattern")
    if "pattern" in present and has_length:
        out.append(Feature.PATTERN_LENGTH)
    elif has_length and may_be_string(node):
        out.append(Feature.STRING_LENGTH)
    patterns = [pattern] if isinstance(pattern, str) else []
    pattern_props = node.get("patternProperties")
    if isinstance(pattern_props, dict):
        patterns += [p for p in pattern_props if isinstance(p, str)]
    if isinstance(pattern, str) and inner_anchor(pattern):
        out.append(Feature.PATTERN_INNER_ANCHORS)
    if any(LOOKAROUND.search(p) for p in patterns):
        out.append(Feature.PATTERN_LOOKAROUND)


def _format_features(fmt: str, *, typed: bool) -> list[Feature]:
    out = [FORMATS.get(fmt, Feature.FORMAT_UNKNOWN)]
    if not typed:
        out.append(Feature.FORMAT_UNTYPED)
    return out


def may_be_string(node: dict[str, Any]) -> bool:
    typ = node.get("type")
    return typ is None or typ == "string" or (isinstance(typ, list) and "string" in typ)


LOOKAROUND = re.compile(r"\(\?<?[=!]|(?<!\\)(?:\\\\)*\\[bB]")


def inner_anchor(pattern: str) -> bool:
    """A ``^`` or ``$`` anchor anywhere but the pattern's two ends."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if ends_with_anchor(body):
        body = body[:-1]
    return any(ch in "^$" for ch, _ in structural_chars(body))


def has_optional(node: dict[str, Any]) -> bool:
    """Declared but not required properties (what llguidance's min/maxProperties refuses)."""
    props = node.get("properties")
    required = node.get("required", [])
    return isinstance(props, dict) and any(name not in required for name in props)
