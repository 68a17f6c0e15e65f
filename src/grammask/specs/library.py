"""A curated library of grammars shipped with grammask (the repository's top-level
``grammars/``; ``grammask/grammars/`` in the wheel, see ``folder``).

Each grammar is one file in its native syntax, ``NAME.gbnf`` (llama.cpp GBNF as xgrammar's
EBNF parser takes it) or ``NAME.lark`` (Lark as llguidance takes it), beside
``NAME.samples.json`` (``{"valid": [...], "invalid": [...]}``). The grammar's first comment
line is ``NAME: description``; the lines after it say what it accepts and what it does not.

It reads files and knows nothing of specs, so ``GrammarSpec.named`` can use it:

```python
from grammask.specs import library
library.names()                      # ['arithmetic', 'csv', 'date-time', ...]
spec = GrammarSpec.named("semver")   # a GrammarSpec of a library grammar
library.load("semver").valid         # sample outputs the grammar accepts
```
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from ..errors import InvalidSpecError

#: A grammar text's syntax: GBNF (xgrammar's EBNF) or Lark (``grammask.specs.grammar_spec``
#: re-exports it).
Syntax = Literal["ebnf", "lark"]

#: file suffix -> syntax
_SUFFIXES: dict[str, Syntax] = {".gbnf": "ebnf", ".lark": "lark"}
_COMMENT = {"ebnf": "#", "lark": "//"}


@dataclass(frozen=True)
class LibraryGrammar:
    """One library grammar: its text, syntax, one-line description and samples."""

    name: str
    text: str
    syntax: Syntax
    description: str
    valid: tuple[str, ...]
    invalid: tuple[str, ...]


def folder() -> Traversable:
    """The folder of grammar files: ``grammask/grammars/`` inside the package when there is
    one, else the checkout's top-level ``grammars/``.

    The files live at the repository's top level (the project's layout: ``pyproject.toml``,
    ``src/``, ``grammars/``, ``tests/``, ``bench/``), outside the package, so an installed
    wheel carries them as package data at ``grammask/grammars/`` (``pyproject.toml`` maps the
    folder there) while a checkout, run as ``PYTHONPATH=src`` or installed editable, has only
    the top-level folder, three levels above this file (``src/grammask/specs/``)."""
    packaged = resources.files("grammask").joinpath("grammars")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "grammars"


@cache
def _files() -> dict[str, tuple[str, Syntax]]:
    """name -> (file name, syntax), for every grammar file in the folder."""
    found: dict[str, tuple[str, Syntax]] = {}
    for entry in folder().iterdir():
        for suffix, syntax in _SUFFIXES.items():
            if entry.is_file() and entry.name.endswith(suffix):
                name = entry.name[: -len(suffix)]
                if name in found:  # json.gbnf and json.lark: which one would be ambiguous
                    raise RuntimeError(f"grammar library: two files for {name!r}")
                found[name] = (entry.name, syntax)
    return found


def names() -> list[str]:
    """The library's grammar names, sorted."""
    return sorted(_files())


@cache
def load(name: str) -> LibraryGrammar:
    """The named grammar; ``InvalidSpecError`` (listing the known names) when there is none."""
    files = _files()
    if not isinstance(name, str) or name not in files:
        raise InvalidSpecError(
            f"no library grammar named {name!r}; known: {', '.join(sorted(files))}",
            where="grammar_name")
    file_name, syntax = files[name]
    base = folder()
    text = base.joinpath(file_name).read_text(encoding="utf-8")
    samples = json.loads(base.joinpath(f"{name}.samples.json").read_text(encoding="utf-8"))
    return LibraryGrammar(
        name=name, text=text, syntax=syntax, description=_description(name, text, syntax),
        valid=tuple(samples["valid"]), invalid=tuple(samples["invalid"]),
    )


def _description(name: str, text: str, syntax: Syntax) -> str:
    """The header's first line, ``<comment> NAME: description``, without its prefix."""
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    marker = _COMMENT[syntax]
    line = first[len(marker):].strip() if first.startswith(marker) else ""
    prefix = f"{name}:"
    return line[len(prefix):].strip() if line.startswith(prefix) else line
