"""Backend adapters (xgrammar, llguidance) behind one protocol (see ``base``)."""

from __future__ import annotations

from functools import cache

from ..spec import BackendName
from .base import Backend, BackendGrammar, BackendMatcher, Matcher
from .guidance import GuidanceBackend
from .xgrammar import XGrammarBackend

__all__ = ["Backend", "BackendGrammar", "BackendMatcher", "Matcher", "get_backend"]


_BACKENDS: dict[str, type[Backend]] = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}


@cache
def get_backend(name: BackendName) -> Backend:
    """The adapter of a canonical backend name; an unknown name is an error naming the known
    ones (never silently another backend)."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_BACKENDS)}") from None
