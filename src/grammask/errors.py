"""Typed errors, in two families that never mix:

- ``GrammarError`` (a ``ValueError``): the request's fault. HTTP front ends and the vLLM
  plugin turn it into a 400. ``where`` says which part of the input is wrong (a JSON
  pointer, a regex offset, a grammar line).
- ``ServerFault`` (a ``RuntimeError``): not the request's fault (a compile past its time
  budget, a backend's internal failure, a closed compiler). It never maps to a 400; vLLM
  answers such a fault at admission with a 500.

``CompileFailure`` is both, for code that handles any failed compile alike.
"""

from __future__ import annotations


class _Located(Exception):
    """A message and, optionally, where in the input it applies."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{message} (at {where})" if where else message)


class GrammarError(_Located, ValueError):
    """Base class; a ValueError so frameworks that map ValueError to HTTP 400 do the right thing."""


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


class ServerFault(_Located, RuntimeError):
    """Base class of the server's faults: the same request may succeed later."""


class CompileTimeoutError(ServerFault):
    """Compilation ran past its time budget on every backend that could serve the spec."""


class InternalCompileError(ServerFault):
    """A backend failed for a reason other than the input (out of memory, a backend bug).

    Not remembered in the negative cache: the next request for the spec compiles again."""


class CompilerClosedError(ServerFault):
    """The compiler was closed: pending requests fail with this, and so do new ones."""


#: Every way a compile can fail: the request's fault or the server's.
CompileFailure = (GrammarError, ServerFault)
