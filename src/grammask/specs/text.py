"""A spec from plain text: what the command line and the harness take (a file or inline text).

The kind is given (``json``, ``regex``, ``choice``, ``grammar``, ``named``) or guessed: a
``.gbnf``/``.lark``/``.ebnf`` file name or text with ``::=`` / ``start:`` is a grammar, a JSON
object or boolean a schema, a JSON list a choice, anything else a regex.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidSpecError
from .grammar_spec import GrammarSpec


def spec_from_text(text: str, kind: str | None, *, backend: str | None = None,
                   name: str = "") -> GrammarSpec:
    """Guess the kind from a file name or the text when ``kind`` is None."""
    be: Any = None if backend in (None, "auto") else backend
    if kind is None:
        if name.endswith((".gbnf", ".lark", ".ebnf")):
            kind = "grammar"
        else:
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            kind = ("json" if isinstance(value, dict | bool) else
                    "choice" if isinstance(value, list) else
                    "grammar" if "::=" in text or "start:" in text else "regex")
    if kind == "json":
        return GrammarSpec.json_schema(text, backend=be)
    if kind == "choice":
        try:
            options = json.loads(text)
        except ValueError as exc:
            raise InvalidSpecError("a choice spec must be a JSON list of strings") from exc
        return GrammarSpec.choice(options, backend=be)
    if kind == "grammar":
        return GrammarSpec.grammar(text, backend=be)
    if kind == "named":
        return GrammarSpec.named(text.strip(), backend=be)
    return GrammarSpec.regex(text, backend=be)
