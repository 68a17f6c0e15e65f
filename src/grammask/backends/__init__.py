"""Backend adapters behind one protocol (``base``), each declared in ``registry``.

Importing this package registers the built-in backends; a third one registers itself the same
way (``registry.register``).
"""

from __future__ import annotations

from . import guidance, xgrammar
from .base import Backend, BackendGrammar, BackendMatcher, DiskBackend, Matcher, Warnings
from .registry import BackendInfo, Cost, Workload, adapter, backends, info, register

__all__ = ["Backend", "BackendGrammar", "BackendInfo", "BackendMatcher", "Cost", "DiskBackend",
           "Matcher", "Warnings", "Workload", "backends", "disk_backend", "get_backend", "info",
           "register"]
assert xgrammar and guidance  # imported for their registration


def get_backend(name: str) -> Backend:
    """The adapter of a registered backend (by name or alias), built once; an unknown name
    is an ``InvalidSpecError`` naming the registered ones."""
    backend: Backend = adapter(name)
    return backend


def disk_backend(name: str) -> DiskBackend | None:
    """The adapter of a backend whose adapter class has the disk capability
    (``BackendInfo.disk``); None for the others."""
    built = adapter(name) if info(name).disk else None
    return built if isinstance(built, DiskBackend) else None
