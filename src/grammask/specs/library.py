"""A curated library of grammars shipped with grammask (``grammask/specs/grammars/``).

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


def _folder() -> Traversable:
    return resources.files("grammask.specs").joinpath("grammars")


@cache
def _files() -> dict[str, tuple[str, Syntax]]:
    """name -> (file name, syntax), for every grammar file in the package."""
    found: dict[str, tuple[str, Syntax]] = {}
    for entry in _folder().iterdir():
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
    folder = _folder()
    text = folder.joinpath(file_name).read_text(encoding="utf-8")
    samples = json.loads(folder.joinpath(f"{name}.samples.json").read_text(encoding="utf-8"))
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
