"""A curated library of grammars shipped with grammask (``grammask/grammars/``).

Each grammar is one file in its native syntax, ``NAME.gbnf`` (llama.cpp GBNF as xgrammar's
EBNF parser takes it) or ``NAME.lark`` (Lark as llguidance takes it), beside
``NAME.samples.json`` (``{"valid": [...], "invalid": [...]}``). The grammar's first comment
line is ``NAME: description``; the lines after it say what it accepts and what it does not.

```python
from grammask import library
library.names()                      # ['arithmetic', 'csv', 'date-time', ...]
spec = library.spec("semver")        # a GrammarSpec, ready for Engine.compile
library.load("semver").valid         # sample outputs the grammar accepts
```
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable

from .errors import InvalidSpecError
from .spec import GrammarSpec, Syntax

#: file suffix -> GrammarSpec syntax
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

    def spec(self) -> GrammarSpec:
        return GrammarSpec.grammar(self.text, syntax=self.syntax)


def _folder() -> Traversable:
    return resources.files("grammask").joinpath("grammars")


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


def spec(name: str) -> GrammarSpec:
    """A ``GrammarSpec`` for the named grammar (auto routing; ``.with_backend`` to force)."""
    return load(name).spec()


def _description(name: str, text: str, syntax: Syntax) -> str:
    """The header's first line, ``<comment> NAME: description``, without its prefix."""
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    marker = _COMMENT[syntax]
    line = first[len(marker):].strip() if first.startswith(marker) else ""
    prefix = f"{name}:"
    return line[len(prefix):].strip() if line.startswith(prefix) else line
