"""grammask: structured outputs for LLM servers, routed per request to xgrammar or llguidance.

```python
vocab = grammask.load_vocabulary("qwen2.5")
compiler = grammask.Compiler(vocab)
grammar = compiler.compile(grammask.GrammarSpec.json_schema(schema))
m = grammar.matcher(); m.accept(token_id); m.fill(bitmask, row)
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import compiler
from .bitmask import allocate_bitmask, allowed_ids
from .compiler import Compiler, Grammar, Stats
from .errors import (
    CompilerClosedError,
    CompileTimeoutError,
    EngineClosedError,
    GrammarError,
    InternalCompileError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidSchemaError,
    InvalidSpecError,
    UnsupportedError,
)
from .processor import BatchProcessor, RowInfo
from .reasoning import ThinkGate, ThinkMarker
from .request import ConstraintRequest, parse_extra_args
from .router import Route, route
from .spec import GrammarSpec
from .vocab import Vocabulary, load_vocabulary

__all__ = [
    "BatchProcessor",
    "CompileTimeoutError",
    "Compiler",
    "CompilerClosedError",
    "ConstraintRequest",
    "EngineClosedError",
    "Grammar",
    "GrammarError",
    "GrammarSpec",
    "InternalCompileError",
    "InvalidGrammarError",
    "InvalidRegexError",
    "InvalidSchemaError",
    "InvalidSpecError",
    "Route",
    "RowInfo",
    "Stats",
    "ThinkGate",
    "ThinkMarker",
    "UnsupportedError",
    "Vocabulary",
    "allocate_bitmask",
    "allowed_ids",
    "load_vocabulary",
    "parse_extra_args",
    "route",
]
__version__ = "0.1.0"

# ------------------------------------------------------------------ deprecated names
# ``EngineClosedError`` (above) is ``CompilerClosedError`` under its old name.
if TYPE_CHECKING:
    Engine = Compiler  #: deprecated: ``Compiler`` (at run time ``__getattr__`` warns)


def __getattr__(name: str) -> Any:
    """``grammask.Engine``, the compile service's old name (``grammask.compiler`` warns)."""
    if name == "Engine":
        return compiler.deprecated_engine()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
