"""What the decode core holds of the layer above it: nothing callable.

``upward_callables(root)`` walks what ``root`` (an object below ``grammask.integrations``:
a ``BatchProcessor``, a ``Compiler``) holds, through grammask's own objects, containers,
futures and threads, and names every bound method, ``functools.partial``, lambda or other
function, or closure, of an ``integrations`` object or module found there (issue 53: a
lower layer returns what happened, or reports it through an interface it declares, such as
``decode.stepjob.RequestReader``; it never holds the upper layer's methods). An
``integrations`` object held as such (the reader a host adapter hands over) is the host's
business: the walk does not look inside it.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

ABOVE = "grammask.integrations"


def _module(obj: Any) -> str:
    return str(getattr(obj, "__module__", "") or "")


def _above(obj: Any) -> bool:
    return _module(type(obj)).startswith(ABOVE)


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    if hasattr(obj, "__dict__"):
        yield from vars(obj).items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                yield name, getattr(obj, name)


def upward_callables(root: Any) -> list[str]:
    """Paths from ``root`` to each callable of the layer above it (empty: none)."""
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, type(root).__name__)]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, str | bytes | int | float):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.MethodType):
            if _above(obj.__self__) or _module(obj.__func__).startswith(ABOVE):
                found.append(f"{path}: bound method {obj.__qualname__}")
            else:
                stack.append((obj.__self__, f"{path}.__self__"))
        elif isinstance(obj, functools.partial):
            stack.append((obj.func, f"{path}.func"))
            stack += [(a, f"{path}.args[{i}]") for i, a in enumerate(obj.args)]
            stack += [(v, f"{path}.keywords[{k}]") for k, v in obj.keywords.items()]
            if _module(obj.func).startswith(ABOVE) or _above(getattr(obj.func, "__self__", 0)):
                found.append(f"{path}: partial of {obj.func!r}")
        elif isinstance(obj, types.FunctionType):
            if _module(obj).startswith(ABOVE):
                found.append(f"{path}: function {obj.__qualname__}")
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if _above(value):
                    found.append(f"{path}: closure over a {type(value).__name__}")
                stack.append((value, f"{path}.<cell {i}>"))
        elif _above(obj):
            continue  # an integrations object held as such: not looked into
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                stack += [(k, f"{path}.key"), (v, f"{path}[{k!r}]")]
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(list(obj))]
        elif isinstance(obj, Future):
            stack += [(cb, f"{path}.<callback>") for cb in getattr(obj, "_done_callbacks", ())]
        elif isinstance(obj, threading.Thread):
            stack.append((getattr(obj, "_target", None), f"{path}.<target>"))
        elif _module(type(obj)).startswith("grammask."):
            stack += [(v, f"{path}.{k}") for k, v in _attributes(obj)]
    return found
