"""Typed errors: every failure a request can cause is a ``GrammarError``.

Callers (HTTP front ends, the vLLM plugin) catch one base class and turn it into a 400;
``where`` says which part of the input is wrong (a JSON pointer, a regex offset, a grammar line).
"""

from __future__ import annotations


class GrammarError(ValueError):
    """Base class; a ValueError so frameworks that map ValueError to HTTP 400 do the right thing."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{message} (at {where})" if where else message)


class InvalidSpecError(GrammarError):
    """The request itself is malformed: wrong Python types, unknown keys, empty choice list."""


class InvalidSchemaError(GrammarError):
    """The JSON schema is not valid JSON or not a valid schema."""


class InvalidRegexError(GrammarError):
    """The regular expression does not parse."""


class InvalidGrammarError(GrammarError):
    """The EBNF / Lark grammar or structural tag does not parse."""


class UnsupportedError(GrammarError):
    """Valid input that no available backend can enforce (in strict routing mode)."""


class CompileTimeoutError(GrammarError):
    """Compilation ran past its time budget on every backend that could serve the spec."""


class InternalCompileError(GrammarError):
    """A backend failed for a reason other than the input (out of memory, a backend bug).

    Not remembered in the negative cache: the next request for the spec compiles again."""


class CompilerClosedError(GrammarError):
    """The compiler was closed: pending requests fail with this, and so do new ones."""

