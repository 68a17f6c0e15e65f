"""The vLLM plugin: ``GrammaskLogitsProcessor``, one class for both model runners.

vLLM loads every ``vllm.logits_processors`` entry point into whichever runner it starts, so
the class implements both interfaces and dispatches on the constructor's argument types
(``vllm_compat.runner_of``):
``(vllm_config, device, is_pin_memory)`` is the V1 runner (``vllm_v1_batch.V1Batch``),
``(vllm_config, req_states)`` the V2 runner (``vllm_v2.V2Batch``). It holds no logic of its
own: the adapters map vLLM's batch bookkeeping onto ``BatchProcessor`` rows.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from .vllm_common import FQCN, PluginCore, validate_sampling_params
from .vllm_compat import runner_of
from .vllm_v1_batch import V1Batch
from .vllm_v2 import V2Batch

__all__ = ["FQCN", "GrammaskLogitsProcessor"]


class GrammaskLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):
    """Grammar masks for requests whose ``extra_args`` carry a ``grammask`` constraint.

    Register it once: installed, it is an entry point (both runners load it); on the V1
    runner with async scheduling also pass ``--logits-processors`` with ``FQCN`` (the second
    instance this makes stays inert). Requests without grammask keys are untouched.
    """

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        self._v1: V1Batch | None = None
        self._v2: V2Batch | None = None
        if runner_of(args) == "v1":  # (device, is_pin_memory)
            self._v1 = V1Batch(vllm_config)
        else:  # (LogitsProcRequestState,)
            self._v2 = V2Batch(vllm_config, args[0])

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_sampling_params(sampling_params)

    @property
    def core(self) -> PluginCore:
        batch = self._v1 if self._v1 is not None else self._v2
        assert batch is not None
        return batch.core

    # ------------------------------------------------------------------ V1 interface
    def is_argmax_invariant(self) -> bool:
        return False  # masks change the argmax; True would skip us for greedy batches

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        assert self._v1 is not None, "update_state is a V1-runner hook"
        self._v1.update_state(batch_update)

    # ------------------------------------------------------------------ V2 interface
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        assert self._v2 is not None, "add_request is a V2-runner hook"
        return self._v2.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        assert self._v2 is not None, "apply_staged_writes is a V2-runner hook"
        self._v2.apply_staged_writes()

    # ------------------------------------------------------------------------- both
    def apply(self, logits: torch.Tensor, ctx: LogitsContext | None = None) -> torch.Tensor:
        if ctx is None:
            assert self._v1 is not None, "the V2 runner passes a LogitsContext"
            return self._v1.apply(logits)
        assert self._v2 is not None, "the V1 runner passes no LogitsContext"
        return self._v2.apply(logits, ctx)

    def close(self) -> None:
        """Stop the fill thread (vLLM never calls this; tests and embedders may)."""
        self.core.close()
