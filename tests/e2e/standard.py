"""What the drop-in tests send and read: standard OpenAI/vLLM request fields only, and
grammask's own per-request counter from the server's ``/metrics`` (who served it)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from tests.e2e.server import Server

T = TypeVar("T")

#: a ``response_format`` schema without ``additionalProperties`` (a client's usual one)
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"]}
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}


def weather_tool(*, strict: bool) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "the forecast", "strict": strict,
        "parameters": WEATHER_PARAMS}}


def response_format(schema: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


_LINE = re.compile(r'^grammask_requests_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')


def served(server: Server) -> dict[tuple[str, str], float]:
    """grammask's ``grammask_requests_total`` by (source, kind), read off vLLM's /metrics
    (the server runs with ``PROMETHEUS_MULTIPROC_DIR``, so the engine's series show)."""
    base = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
            key = (labels.get("source", ""), labels.get("kind", ""))
            out[key] = out.get(key, 0.0) + float(m.group("value"))
    return out


def served_by_grammask(server: Server, fn: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """Run ``fn``; return its result and how many drop-in requests grammask served meanwhile,
    by spec kind."""
    before = served(server)
    result = fn()
    after = served(server)
    delta = {kind: after[(src, kind)] - before.get((src, kind), 0.0)
             for (src, kind) in after if src == "structured_outputs"}
    return result, {k: v for k, v in delta.items() if v}


def reasoning_of(message: Any) -> str:
    """vLLM's reasoning text of a chat message (``reasoning`` or ``reasoning_content``)."""
    extra = message.model_extra or {}
    return str(extra.get("reasoning") or extra.get("reasoning_content") or "")


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
