"""The compile service's counters (``Stats``: ``Compiler.stats``), kept in its one state
(``state.ServiceState``) and written under its lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import registry


@dataclass
class Stats:
    """Counters since the compiler started (read them; do not write)."""

    hits: int = 0
    misses: int = 0
    joined: int = 0
    compiles: dict[str, int] = field(default_factory=lambda: dict.fromkeys(registry.names(), 0))
    compile_ms: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(registry.names(), 0.0))
    fallbacks: int = 0
    timeouts: int = 0
    errors: int = 0
    negative_hits: int = 0
    evictions: int = 0
    abandoned: int = 0
    internal_errors: int = 0
    late_results: int = 0
    trims: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_writes: int = 0
    #: JSON schemas whose fill two backends compared (``Compiler(tune_fill=True)``), and
    #: those the other backend then served
    fill_tuned: int = 0
    fill_moved: int = 0
