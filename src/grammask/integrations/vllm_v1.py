"""The plugin's first import path, kept working: ``--logits-processors
grammask.integrations.vllm_v1:GrammaskLogitsProcessor`` lines in the wild name it. The class
lives in ``vllm_plugin`` (it serves both runners); the V1 runner's adapter in
``vllm_v1_batch``."""

from __future__ import annotations

from .vllm_plugin import FQCN, GrammaskLogitsProcessor
from .vllm_v1_batch import V1Batch

__all__ = ["FQCN", "GrammaskLogitsProcessor", "V1Batch"]
