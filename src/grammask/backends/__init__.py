"""Backend adapters behind one protocol (``base``), each declared in ``registry``.

Importing this package registers the built-in backends; a third one registers itself the same
way (``registry.register``).
"""

from __future__ import annotations

from . import guidance, xgrammar
from .base import Backend, BackendGrammar, BackendMatcher, Matcher
from .registry import BackendInfo, Cost, Workload, adapter, backends, info, register

__all__ = ["Backend", "BackendGrammar", "BackendInfo", "BackendMatcher", "Cost", "Matcher",
           "Workload", "backends", "get_backend", "info", "register"]
assert xgrammar and guidance  # imported for their registration


def get_backend(name: str) -> Backend:
    """The adapter of a registered backend (by name or alias), built once; an unknown name
    is an ``InvalidSpecError`` naming the registered ones."""
    backend: Backend = adapter(name)
    return backend
