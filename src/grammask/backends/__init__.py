"""Backend adapters (xgrammar, llguidance) behind one protocol (see ``base``)."""

from __future__ import annotations

from functools import cache

from ..spec import BackendName
from .base import Backend, BackendGrammar, BackendMatcher, Matcher
from .guidance import GuidanceBackend
from .xgrammar import XGrammarBackend

__all__ = ["Backend", "BackendGrammar", "BackendMatcher", "Matcher", "get_backend"]


@cache
def get_backend(name: BackendName) -> Backend:
    if name == "xgrammar":
        return XGrammarBackend()
    return GuidanceBackend()
