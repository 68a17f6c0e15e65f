"""The one walk over a schema's subschemas, and JSON pointers into a schema.

``Walk`` visits every value held under a subschema key (``keys``), depth first, parents
first; a node's children are stacked in ``keys.ORDER``, so the last key's are visited first
(the order features are first found in, and errors reported in). It builds no pointer
per node (one is made only for what a caller reports: ``Walk.pointer``). It runs on every
cold compile, so it looks only at the child keys a node has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote

from .keys import KEYS, LIST_KEYS, MAP_KEYS, NEGATING, ORDER, TUPLES

#: where a visited value hangs: (its parent's index, the key, the map key or list index)
_Slot = tuple[int, str, str | int | None]


class Walk:
    """A depth-first walk from ``root``; ``base`` is the root's pointer ("" for a whole
    schema). Iterate it for ``(index, value, positive)``: the value as found (an object, a
    boolean, or a misplaced array or number: the caller decides what a non-object means;
    only objects' children are walked) and whether no ``not``/``if`` lies above it."""

    __slots__ = ("_pointers", "_trail", "base", "root")

    def __init__(self, root: Any, base: str = "") -> None:
        self.root = root
        self.base = base
        self._trail: list[_Slot] = []
        self._pointers: dict[int, str] = {}

    def __iter__(self) -> Iterator[tuple[int, Any, bool]]:
        trail = self._trail
        stack: list[tuple[Any, int, str, str | int | None, bool]] = [
            (self.root, -1, "", None, True)]
        order = ORDER.__getitem__
        while stack:
            node, parent, key, sub, positive = stack.pop()
            at = len(trail)
            trail.append((parent, key, sub))
            yield at, node, positive
            if not isinstance(node, dict):
                continue
            present = KEYS.intersection(node)
            for key in sorted(present, key=order) if len(present) > 1 else present:
                child = node[key]
                if key in MAP_KEYS:
                    if isinstance(child, dict):
                        stack.extend((v, at, key, k, positive) for k, v in child.items())
                elif key in LIST_KEYS:
                    if isinstance(child, list):
                        stack.extend((v, at, key, i, positive) for i, v in enumerate(child))
                else:
                    keep = positive and key not in NEGATING
                    if isinstance(child, list) and key in TUPLES:
                        stack.extend((v, at, key, i, keep) for i, v in enumerate(child))
                    else:
                        stack.append((child, at, key, None, keep))

    def pointer(self, at: int) -> str:
        """The JSON pointer of the ``at``-th value visited (``base`` for the root)."""
        known = self._pointers.get(at)
        if known is not None:
            return known
        parts: list[str] = []
        index = at
        while index > 0 and index not in self._pointers:
            index, key, sub = self._trail[index]
            parts.append(f"/{key}" if sub is None else
                         f"/{key}/{escape_key(sub) if isinstance(sub, str) else sub}")
        head = self._pointers.get(index, self.base) if index > 0 else self.base
        out = head + "".join(reversed(parts))
        self._pointers[at] = out
        return out


def subschemas(node: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object subschema with its JSON pointer (``pointer`` for the root), parents
    first, in the walk's order."""
    walk = Walk(node, pointer)
    for at, sub, _ in walk:
        if isinstance(sub, dict):
            yield walk.pointer(at), sub


def escape_key(key: str) -> str:
    """A key as a JSON pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")


#: what ``resolve_pointer`` returns for a pointer to nothing
MISSING: Any = object()


def resolve_pointer(schema: Any, ref: str) -> Any:
    """What a local ``$ref`` (``#`` or ``#/a/b``) points to, or ``MISSING``; anchors
    (``#name``) are taken as found (they are not pointers)."""
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return True
    node = schema
    for part in fragment.split("/")[1:] if fragment else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node
