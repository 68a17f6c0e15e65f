"""Where the benchmarks find the repository, the corpus and their own cache.

A module of its own so every other ``bench`` module can import these locations without
importing each other (``cases``, ``stats``, ``systems`` and ``workers`` all sit above it).
The corpus and cache can be moved with ``GRAMMASK_CORPUS`` and ``GRAMMASK_BENCH_CACHE``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = Path(os.environ.get("GRAMMASK_CORPUS", REPO_ROOT.parent / "shared" / "corpus"))
CACHE_DIR = Path(os.environ.get("GRAMMASK_BENCH_CACHE",
                                Path.home() / ".cache" / "grammask-bench"))
