"""The compile service's one state, shared by its parts.

``Compiler`` (the facade), ``Flights`` (single flight and deadlines), ``PlanRunner`` (a
plan's attempts) and ``FillTuner`` (the fill comparison) are one service cut by job. What
they share is here, in one object, so its concurrency reads in one place: the memory cache,
the counters and the ``closed`` flag are read and written under ``lock``; ``closed`` flips
once (``Compiler.close``), after which no lookup registers a flight and no late result is
cached.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..vocab import Vocabulary
from .cache import CompileCache
from .stats import Stats


@dataclass(eq=False)
class ServiceState:
    """What the compile service's parts share (read and written under ``lock``)."""

    vocab: Vocabulary
    stats: Stats
    memory: CompileCache  # compiled grammars, remembered failures, plans (LRU by bytes)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
