"""The ``check`` extra: the packages the harness's independent oracles need (``regex`` for
partial matching, ``lark`` for grammars; ``tqdm`` for its progress bar). grammask itself never
imports them; the harness imports them when an oracle is built, so ``import grammask`` and
every other command work on a plain install, and ``grammask check`` says what to install
instead of a traceback."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType

#: the modules of the ``check`` extra (pyproject.toml ``[project.optional-dependencies]``)
CHECK_MODULES: tuple[str, ...] = ("regex", "lark", "tqdm")


class MissingExtraError(ImportError):
    """A module of the ``check`` extra is not installed."""


def message(missing: Iterable[str]) -> str:
    return ("grammask check needs the check extra: pip install 'grammask[check]' "
            f"(missing: {', '.join(missing)})")


def missing() -> list[str]:
    """The modules of the extra that do not import (absent or broken), in order."""
    out = []
    for name in CHECK_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def require(name: str) -> ModuleType:
    """``import name`` (a module of the extra), or a ``MissingExtraError`` that says what to
    install."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtraError(message([name]), name=name) from exc
