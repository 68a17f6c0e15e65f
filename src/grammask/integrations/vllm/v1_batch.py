"""The V1 model runner's side of the plugin (``V1Batch``); the plugin class itself lives in
``plugin``.

V1 runner, as vLLM drives it (``InputBatch``):

- ``update_state(batch_update)`` before every forward: rows removed, added (with a *live*
  output-token list, which the processor reads itself) and moved, in that order; then the
  fill starts on the processor's worker thread, overlapping the forward.
- ``apply(logits)`` in the sampler: wait for the fill, mask in place.
- Async scheduling appends ``-1`` placeholders to the live lists and resolves them right
  before sampling only if ``--logits-processors`` is non-empty; the processor never feeds a
  placeholder (it re-reads the list in ``apply``). Without that flag the placeholders would
  never resolve, so that configuration is refused at start-up.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from .plugin_core import FQCN, PluginCore

__all__ = ["FQCN", "V1Batch"]


class V1Batch:
    """The V1 runner's batch bookkeeping mapped onto ``BatchProcessor`` rows."""

    def __init__(self, vllm_config: Any) -> None:
        max_batch = int(vllm_config.scheduler_config.max_num_seqs)
        self.core = PluginCore(vllm_config, "v1", max_batch)
        if not self.core.active:
            return
        scheduler = vllm_config.scheduler_config
        if getattr(scheduler, "async_scheduling", False) and not (
                vllm_config.model_config.logits_processors):
            self.core.deactivate()
            raise RuntimeError(
                "grammask on vLLM's V1 model runner with async scheduling needs "
                f"`--logits-processors {FQCN}` (vLLM resolves the -1 placeholders of async "
                "scheduling only when that list is non-empty); or pass "
                "--no-async-scheduling, or use the V2 runner, or set GRAMMASK_ENABLED=0")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        core = self.core
        if not core.active:
            return
        if batch_update is not None:
            proc = core.proc_or_none
            if proc is not None:
                for index in batch_update.removed:
                    proc.remove(index)
            for index, params, prompt, output in batch_update.added:
                # the parse, the compile's start and the row are the fill job's, off this
                # thread: here a new request costs a key check and a table entry
                if core.claims(params):
                    core.processor().add_later(
                        index, partial(core.admission, params, bool(output)), prompt or (),
                        output)
                elif proc is not None:
                    proc.remove(index)  # the row may still hold a previous occupant
            proc = core.proc_or_none
            if proc is not None:
                for a, b, direction in batch_update.moved:
                    if direction == MoveDirectionality.SWAP:
                        proc.swap(a, b)
                    else:
                        proc.move(a, b)
        if core.has_rows:
            core.processor().step()  # the fill runs while the forward does

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.core.active and self.core.has_rows:
            self.core.processor().apply(logits)
        return logits

