"""Hugging Face ``transformers`` adapter: a ``LogitsProcessor`` for ``model.generate``.

One spec per batch row (None leaves a row unconstrained)::

    proc = GrammarLogitsProcessor(compiler, [spec_a, None, spec_b])
    model.generate(ids, logits_processor=LogitsProcessorList([proc]),
                   eos_token_id=list(vocab.stop_ids), ...)

Pass the vocabulary's stop ids as ``eos_token_id`` so that the forced EOS ends the row.
With ``num_return_sequences=k`` the batch holds ``k`` copies of each prompt in a row; give one
spec per prompt and they are repeated. Greedy search and sampling are supported; beam search
is not (it reorders rows behind the processor's back). ``generate`` calls the processor after
the forward, so the fill cannot overlap it here: ``step`` and ``apply`` run back to back.
A new ``generate`` call (a shorter ``input_ids``) starts the rows afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from ..compile.compiler import Compiler
from ..decode.processor import BatchProcessor, RowInfo
from ..specs.grammar_spec import GrammarSpec
from ..specs.request import ConstraintRequest

Constraint = GrammarSpec | ConstraintRequest | None


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks each row of ``scores`` with its own grammar (``processor.py`` semantics)."""

    def __init__(self, compiler: Compiler, specs: Sequence[Constraint], *,
                 wait_s: float = 30.0) -> None:
        if not specs:
            raise ValueError("give one spec (or None) per batch row")
        self.compiler = compiler
        self.specs = list(specs)
        self.wait_s = wait_s
        self._proc: BatchProcessor | None = None
        self._length = 0
        # compiles start now, while generate() tokenizes and runs the prefill
        for spec in self.specs:
            if spec is not None:
                compiler.compile_async(spec if isinstance(spec, GrammarSpec) else spec.spec)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        length = input_ids.shape[1]
        if self._proc is None or length <= self._length:
            self._start(input_ids)
            assert self._proc is not None
            self._proc.step()
        elif length == self._length + 1:  # one token per row: handed over with the step
            assert self._proc is not None
            rows = self._proc.rows
            self._proc.step(rows, input_ids[rows, -1].tolist())
        else:
            new = input_ids[:, self._length:].tolist()
            assert self._proc is not None
            for row in self._proc.rows:
                self._proc.advance(row, new[row])
            self._proc.step()
        self._length = length
        assert self._proc is not None
        self._proc.apply(scores)
        return scores

    def info(self, row: int) -> RowInfo:
        """The row's state (status, error) in the current generation."""
        if self._proc is None:
            return RowInfo("unconstrained")
        return self._proc.info(row)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def _start(self, input_ids: torch.Tensor) -> None:
        batch = input_ids.shape[0]
        if batch % len(self.specs):
            raise ValueError(f"batch of {batch} rows for {len(self.specs)} specs: the batch "
                             "must be a multiple of the number of specs")
        copies = batch // len(self.specs)
        self.close()
        self._proc = BatchProcessor(self.compiler, max_batch=batch, wait_s=self.wait_s)
        prompts = input_ids.tolist()
        for row in range(batch):
            spec = self.specs[row // copies]
            if spec is not None:
                self._proc.add(row, spec, prompts[row])
