"""Specs the real-server suite and bench/vllm_server.py both send (one definition)."""

from __future__ import annotations

from typing import Any

#: both backends enforce every keyword, no free text: auto routes it to xgrammar
XG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["n", "ok", "color"], "additionalProperties": False}
#: length-bounded strings: auto routes it to llguidance (xgrammar admits raw control chars)
LLG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                   "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
    "required": ["name", "code"], "additionalProperties": False}
REGEX = r"(ab|cd)[0-9]{1,3}(-[a-z]{2})?"
