"""Deprecated: the old name of ``grammask.integrations.vllm_compiler`` (re-exported here)."""

from __future__ import annotations

import warnings

from .vllm_compiler import (
    _COMPILERS,
    _ENGINES,
    disk_cache_dir,
    shared_compiler,
    shared_engine,
    use_vllm_logging,
    vocabulary_from_vllm,
)

__all__ = ["_COMPILERS", "_ENGINES", "disk_cache_dir", "shared_compiler", "shared_engine",
           "use_vllm_logging", "vocabulary_from_vllm"]

warnings.warn("grammask.integrations.vllm_engine is now grammask.integrations.vllm_compiler",
              DeprecationWarning, stacklevel=2)
