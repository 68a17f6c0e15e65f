"""The serving plugin class, built on the logits-processor interfaces the installed vLLM has.

``plugin`` calls ``served_class`` only on a supported vLLM; this module may import
grammask's engine (torch, the backends) freely, since a failure here makes the plugin stand
aside instead of stopping vLLM's server.
"""

from __future__ import annotations

import types
from typing import Any

from .admission import validate_sampling_params
from .compat import runner_of
from .plugin_core import PluginCore
from .v2 import V2Batch


class _Served:
    """Grammar masks for requests whose ``extra_args`` carry a ``grammask`` constraint (vLLM's
    structured outputs are moved there at admission: the drop-in).

    Register it once: installed, it is an entry point (every runner loads it); on the V1
    runner with async scheduling also pass ``--logits-processors`` with ``FQCN`` (the second
    instance this makes stays inert). Requests without grammask keys are untouched.
    """

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        self._v1: Any = None
        self._v2: V2Batch | None = None
        if runner_of(args) == "v1":  # (device, is_pin_memory)
            from .v1_batch import V1Batch  # only vLLM lines with the V1 runner

            self._v1 = V1Batch(vllm_config, args[0])
        else:  # (LogitsProcRequestState,)
            self._v2 = V2Batch(vllm_config, args[0])

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_sampling_params(sampling_params)

    @property
    def core(self) -> PluginCore:
        batch = self._v1 if self._v1 is not None else self._v2
        assert batch is not None
        core: PluginCore = batch.core
        return core

    # ------------------------------------------------------------------ V1 interface
    def is_argmax_invariant(self) -> bool:
        """False while grammask masks (masks change the argmax; True would skip us for
        greedy batches); True for an instance that stands aside or is disabled, which
        changes nothing. Never raises."""
        v1 = self._v1
        return v1 is not None and not v1.active

    def update_state(self, batch_update: Any) -> None:
        assert self._v1 is not None, "update_state is a V1-runner hook"
        self._v1.update_state(batch_update)

    # ------------------------------------------------------------------ V2 interface
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """True for a constrained request: vLLM 0.34 reads it as ``may_mask_logits`` (the
        rejection sampler then never skips this request's masked vocabulary blocks)."""
        assert self._v2 is not None, "add_request is a V2-runner hook"
        return self._v2.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        assert self._v2 is not None, "apply_staged_writes is a V2-runner hook"
        self._v2.apply_staged_writes()

    # ------------------------------------------------------------------------- both
    def apply(self, logits: Any, ctx: Any = None) -> Any:
        if ctx is None:
            assert self._v1 is not None, "the V2 runner passes a LogitsContext"
            return self._v1.apply(logits)
        assert self._v2 is not None, "the V1 runner passes no LogitsContext"
        return self._v2.apply(logits, ctx)

    def close(self) -> None:
        """Stop the fill thread (vLLM never calls this; tests and embedders may)."""
        if self._v2 is not None:
            self._v2.close()
        self.core.close()


def served_class(v1: Any, v2: Any) -> type:
    """``GrammaskLogitsProcessor`` on vLLM's interfaces (``v1`` None from vLLM 0.34)."""
    bases = tuple(b for b in (v1, v2) if b is not None)

    def body(ns: dict[str, Any]) -> None:
        ns.update(__doc__=_Served.__doc__, __module__="grammask.integrations.vllm.plugin",
                  __qualname__="GrammaskLogitsProcessor")

    return types.new_class("GrammaskLogitsProcessor", (_Served, *bases), exec_body=body)
