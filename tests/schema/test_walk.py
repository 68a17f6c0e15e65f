"""The schema layer: one table of subschema keys, one walk, one set of keyword rules.

Every reader of a schema's structure (the keyword checks, the analysis the router decides
from, ``normalize``, the tool-call rewrite) takes the keys from ``grammask.schema.keys`` and
the order from ``Walk``; these tests hold the walk to the table and keep a second table
from growing back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from grammask.errors import InvalidSchemaError
from grammask.schema import keys
from grammask.schema.keywords import check_keywords, check_node, keywords_ok
from grammask.schema.walk import MISSING, Walk, resolve_pointer, subschemas

SRC = Path(__file__).resolve().parents[2] / "src" / "grammask"


def test_the_walk_visits_every_subschema_key_in_the_tables_order_stacked() -> None:
    """Depth first with a stack: a node's children are stacked in ``keys.ORDER``, so the
    last key's come first (the order features are first found in)."""
    node: dict[str, Any] = {}
    for key in keys.MAPS:
        node[key] = {"a/b": {"title": key}}
    for key in keys.LISTS:
        node[key] = [{"title": key}]
    for key in keys.SINGLE:
        node[key] = [{"title": key}] if key in keys.TUPLES else {"title": key}
    node["unknown"] = {"title": "not a keyword: not walked"}
    seen = [(ptr, sub["title"]) for ptr, sub in subschemas(node) if ptr]
    assert [title for _, title in seen] == sorted(
        (title for _, title in seen), key=keys.ORDER.__getitem__, reverse=True)
    assert {title for _, title in seen} == set(keys.KEYS)
    assert ("/properties/a~1b", "properties") in seen and ("/items/0", "items") in seen


def test_negating_keys_turn_the_range_check_off_below_them() -> None:
    walk = Walk({"not": {"anyOf": [{"minimum": 5, "maximum": 1}]},
                 "properties": {"x": {}}})
    positive = {walk.pointer(at): flag for at, value, flag in walk if isinstance(value, dict)}
    assert positive == {"": True, "/properties/x": True, "/not": False, "/not/anyOf/0": False}
    check_keywords({"not": {"minimum": 5, "maximum": 1}})  # a way to say "anything"
    with pytest.raises(InvalidSchemaError, match="minimum 5 is greater than maximum 1") as err:
        check_keywords({"allOf": [{"minimum": 5, "maximum": 1}]})
    assert err.value.where == "/allOf/0/minimum"


def test_pointers_resolve_back_to_what_the_walk_found() -> None:
    schema = {"$defs": {"a~b": {"properties": {"c/d": {"type": "string"}}}}}
    for ptr, sub in subschemas(schema):
        assert resolve_pointer(schema, f"#{ptr}") is sub
    assert resolve_pointer(schema, "#/$defs/nope") is MISSING
    assert resolve_pointer(schema, "#anchor") is True


@pytest.mark.parametrize(("node", "where", "message"), [
    ({"type": "strin"}, "/type", "unknown type 'strin'"),
    ({"minLength": -1, "type": "strin"}, "/type", "unknown type"),  # type first
    ({"minItems": 1.5, "properties": []}, "/minItems", "non-negative integer"),
    ({"properties": [], "required": [1]}, "/properties", "must be an object"),
    ({"required": [1]}, "/required/0", "required names must be strings"),
    ({"multipleOf": 0}, "/multipleOf", "greater than 0"),
    ({"exclusiveMinimum": True, "maximum": "x"}, "/maximum", "must be a number"),
    ({"minimum": 3, "maximum": 1, "items": 3}, "/minimum", "greater than maximum"),
])
def test_the_fast_check_and_the_named_error_read_the_same_rules(
        node: dict[str, Any], where: str, message: str) -> None:
    assert not keywords_ok(node, ranges=True)
    with pytest.raises(InvalidSchemaError, match=re.escape(message)) as err:
        check_node(node, "/x", ranges=True)
    assert err.value.where == f"/x{where}"


def test_no_second_table_of_subschema_keys_in_the_package() -> None:
    """A tuple or set that lists the map keys together is a copy of ``keys.MAPS``."""
    copy = re.compile(r'"properties",\s*"patternProperties",\s*"\$defs"')
    found = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if copy.search(p.read_text(encoding="utf-8"))]
    assert found == ["schema/keys.py"], found
