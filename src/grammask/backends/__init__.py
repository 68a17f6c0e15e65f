"""Backend adapters (xgrammar, llguidance) behind one protocol (see ``base``)."""

from __future__ import annotations

from functools import cache

from ..spec import BackendName
from .base import Backend, BackendGrammar, BackendMatcher, CompiledGrammar, Matcher
from .guidance import GuidanceBackend
from .xgrammar import XGrammarBackend

__all__ = ["Backend", "BackendGrammar", "BackendMatcher", "CompiledGrammar", "Matcher",
           "get_backend"]  # CompiledGrammar: the old name of BackendGrammar


@cache
def get_backend(name: BackendName) -> Backend:
    if name == "xgrammar":
        return XGrammarBackend()
    return GuidanceBackend()
