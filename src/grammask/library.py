"""A curated library of grammars shipped with grammask (``grammask/grammars/``).

Each grammar is one file in its native syntax, ``NAME.gbnf`` (llama.cpp GBNF as xgrammar's
EBNF parser takes it) or ``NAME.lark`` (Lark as llguidance takes it), beside
``NAME.samples.json`` (``{"valid": [...], "invalid": [...]}``). The grammar's first comment
line is ``NAME: description``; the lines after it say what it accepts and what it does not.

```python
from grammask import library
library.names()                      # ['arithmetic', 'csv', 'date-time', ...]
spec = library.spec("semver")        # a GrammarSpec (= GrammarSpec.named("semver"))
library.load("semver").valid         # sample outputs the grammar accepts
```
"""

from __future__ import annotations

from .catalog import LibraryGrammar, load, names
from .spec import GrammarSpec

__all__ = ["LibraryGrammar", "load", "names", "spec"]


def spec(name: str) -> GrammarSpec:
    """A ``GrammarSpec`` for the named grammar (auto routing; ``.with_backend`` to force)."""
    return GrammarSpec.named(name)
