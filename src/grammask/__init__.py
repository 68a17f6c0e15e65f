"""grammask: structured outputs for LLM servers, routed per request to xgrammar or llguidance.

```python
vocab = grammask.load_vocabulary("qwen2.5")
compiler = grammask.Compiler(vocab)
grammar = compiler.compile(grammask.GrammarSpec.json_schema(schema))
m = grammar.matcher(); m.accept(token_id); m.fill(bitmask, row)
```
"""

from __future__ import annotations

from .compile.compiler import Compiler, Grammar, Stats
from .compile.router import Route, route
from .decode.processor import BatchProcessor, RowInfo
from .decode.reasoning import ThinkGate, ThinkMarker
from .decode.step_apply import AlongDrafts, Mapped
from .errors import (
    CompileFailure,
    CompilerClosedError,
    CompileTimeoutError,
    GrammarError,
    InternalCompileError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidSchemaError,
    InvalidSpecError,
    ServerFault,
    UnsupportedError,
)
from .kernels.bitmask import allocate_bitmask, allowed_ids
from .specs import library
from .specs.grammar_spec import GrammarSpec
from .specs.request import ConstraintRequest, parse_extra_args
from .vocab import Vocabulary, load_vocabulary

__all__ = [
    "AlongDrafts",
    "BatchProcessor",
    "CompileFailure",
    "CompileTimeoutError",
    "Compiler",
    "CompilerClosedError",
    "ConstraintRequest",
    "Grammar",
    "GrammarError",
    "GrammarSpec",
    "InternalCompileError",
    "InvalidGrammarError",
    "InvalidRegexError",
    "InvalidSchemaError",
    "InvalidSpecError",
    "Mapped",
    "Route",
    "RowInfo",
    "ServerFault",
    "Stats",
    "ThinkGate",
    "ThinkMarker",
    "UnsupportedError",
    "Vocabulary",
    "allocate_bitmask",
    "allowed_ids",
    "library",
    "load_vocabulary",
    "parse_extra_args",
    "route",
]
__version__ = "0.1.0"

