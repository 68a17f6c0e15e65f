"""The registered backends' names and aliases: what a backend name a user gives stands for.

The registry (``backends.registry``) owns the declarations and publishes its name index
here on every change. The index sits below the backends package so that the spec, a plain
value that the backends import, resolves a name without importing back up into them.
"""

from __future__ import annotations

from ..errors import InvalidSpecError

#: name or alias -> registered name, and the registered names in preference order
_index: dict[str, str] = {}
_names: tuple[str, ...] = ()


def publish(index: dict[str, str], names: tuple[str, ...]) -> None:
    """Replace the index (the registry calls this, under its lock, when it changes)."""
    global _index, _names
    _index, _names = index, names


def canonical(value: str) -> str | None:
    """The registered name a user's name or alias stands for; None when unknown."""
    return _index.get(value)


def resolve(value: object, what: str = "backend") -> str | None:
    """A backend as a user gives it (None or ``auto`` for auto routing, a name, an alias):
    the registered name, None for auto; ``InvalidSpecError`` naming the registered ones."""
    if value is None or value == "auto":
        return None
    name = canonical(value.strip().lower()) if isinstance(value, str) else None
    if name is None:
        raise InvalidSpecError(f"unknown {what} {value!r}; registered: auto, "
                               f"{', '.join(_names)}", where=what)
    return name
