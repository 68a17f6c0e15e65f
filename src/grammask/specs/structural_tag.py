"""The shape of a structural tag, checked before a backend sees it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidGrammarError
from ..schema.keywords import json_type


def check_structural_tag(tag: Mapping[str, Any]) -> None:
    """The shape of a structural tag, checked here so a malformed one is refused naming its
    field (the backends answer ``'triggers'`` or ``'int' object is not iterable``).

    Two forms: vLLM's legacy ``{"structures": [{"begin", "schema", "end"}], "triggers"}`` and
    xgrammar's ``{"type": "structural_tag", "format": {...}}`` (its content xgrammar checks)."""
    def fail(message: str, where: str) -> InvalidGrammarError:
        return InvalidGrammarError(f"structural tag: {message}", where=f"structural_tag{where}")

    if "structures" in tag or "triggers" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise fail("structures must be a non-empty array of objects", "/structures")
        if (not isinstance(triggers, list) or not triggers
                or not all(isinstance(t, str) and t for t in triggers)):
            raise fail("triggers must be a non-empty array of non-empty strings", "/triggers")
        for i, item in enumerate(structures):
            where = f"/structures/{i}"
            if not isinstance(item, Mapping):
                raise fail(f"each structure must be an object with begin, schema and end, got "
                           f"{json_type(item)}", where)
            unknown = sorted(set(item) - {"begin", "schema", "end"})
            if unknown:
                raise fail(f"unknown structure keys {unknown}", f"{where}/{unknown[0]}")
            begin = item.get("begin")
            if not isinstance(begin, str) or not begin:
                raise fail("begin must be a non-empty string", f"{where}/begin")
            if not isinstance(item.get("end", ""), str):
                raise fail("end must be a string", f"{where}/end")
            if not isinstance(item.get("schema", {}), bool | Mapping):
                raise fail("schema must be a JSON schema (an object or a boolean)",
                           f"{where}/schema")
            if not any(begin.startswith(t) for t in triggers):
                raise fail(f"begin {begin!r} starts with no trigger of {triggers}",
                           f"{where}/begin")
        return
    if tag.get("type") != "structural_tag":
        raise fail("expected type \"structural_tag\" with a format, or structures and "
                   "triggers", "/type")
    fmt = tag.get("format")
    if not isinstance(fmt, Mapping):
        raise fail(f"format must be an object, got {json_type(fmt)}", "/format")
    if not isinstance(fmt.get("type"), str):
        raise fail("format.type must be a string", "/format/type")

