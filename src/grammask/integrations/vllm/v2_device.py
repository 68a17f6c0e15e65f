"""The device half of the V2 token watch: where the runner's work is ordered, and how a
committed token is told apart from one not landed yet.

**Why a watch at all.** vLLM 0.34 schedules asynchronously by default (``config/vllm.py``:
``async_scheduling`` None becomes True on the uni and mp executors). The engine core then
launches forward(t+1) and calls ``sample_tokens`` -- our ``apply(t+1)`` -- before step t's
``post_update`` kernel has run on the device (``worker/gpu/model_runner.py``:
``sample_tokens`` -> ``postprocess_sampled`` -> ``input_batch.post_update``, a Triton kernel
queued behind the sampler; the host never waits for it). Reading the tokens in stream order
would wait for forward(t+1) too. The watch reads them as they land instead.

**The mark.** In ``apply(t)``, after masking, the next ``window`` positions of each
sampling slot's ``all_token_ids`` row (``[total_len, total_len + window)``, those inside the
row) are set to the *mark*, *in stream order*: a tiny write queued on the runner's stream,
after every earlier write to that row (a recycled slot's staged prompt, the previous
occupant's ``post_update``) and before this step's ``post_update``, which then stores the
committed tokens there. So a position that no longer holds the mark holds its committed
token: no false wait when a token equals what was there before (a recycled slot's previous
occupant wrote the same JSON at the same positions).

The mark is a *valid* token id (``unsampleable_id``: a padding id of the model's vocabulary
beyond the tokenizer's, else a special token no grammar allows), because vLLM reads those
positions before ``post_update`` overwrites them: ``compute_prompt_logprobs`` runs between
the processors and ``post_update`` (``model_runner.py``: ``sample_tokens``) and, whenever any
request of the batch wants prompt logprobs, its token-id kernel reads
``all_token_ids[slot, num_computed + 1 + i]`` for every row of the batch
(``sample/prompt_logprob.py``: ``_prompt_logprobs_token_ids_kernel``), which for a decode row
is position ``total_len``; the ids index the logits (``sample/logprob.py``). A valid id is
what vLLM itself leaves there (a recycled slot's stale token); -1 was an out-of-bounds read,
or a device assert in the ``raw_logits`` / ``processed_logits`` modes. A committed token
equal to the mark (only where something overrides the masked sample: thinking-budget
forcing, trace replay; or a thinking row's free sample) looks "not landed" and waits for the
ordered read, which counts it (``TokenWatch.collisions``). docs/vllm.md's contract table
argues every other reader. The setting ``token_marks=false`` writes nothing: every read is
then ordered.

Without drafts a sampling slot commits exactly one token (``get_num_sampled_and_rejected``):
the sentinel alone tells. With drafts it commits 1 to 1 + k: the count is ``total_len``'s
growth, read too (the kernel stores it before the tokens; both must agree).

**The reads.** ``all_token_ids`` lives in pinned host memory by default (``RequestState``:
``uva_instead_of_gpu=not use_dense_all_token_ids``; dense only for drafters that prefer it):
the watch then reads it in numpy, with no CUDA call at all. ``total_len`` and a dense
``all_token_ids`` are copied on a side stream and waited for with a blocking event (vLLM's
own ``async_utils`` does the same "to avoid busy-polling the CUDA driver lock").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...kernels.bitmask import normal_tensors
from .compat import host_view


class DevicePort:
    """The runner's stream as the host sees it. This base class is the synchronous host:
    CPU tensors written in program order, so every marker has passed and stream-ordered work
    runs at once. ``CudaPort`` is the GPU; tests plug in a stand-in device thread."""

    def mark(self) -> Any:
        """A marker after everything queued on the runner's stream so far."""
        return None

    def passed(self, marker: Any) -> bool:
        """Whether the stream has run past ``marker`` (never blocks)."""
        return True

    def wait(self, marker: Any) -> None:
        """Block (without spinning) until the stream has run past ``marker``."""

    def ordered(self, work: Callable[[], None]) -> None:
        """Run ``work`` (tensor writes) in stream order: after everything queued so far."""
        work()

    def side(self, work: Callable[[], None]) -> None:
        """Run ``work`` (copies into host buffers) off stream order and wait for it."""
        work()


class CudaPort(DevicePort):
    """The runner's CUDA stream: blocking events (no spin in the driver), side reads on a
    stream of their own so the forward's stream is never waited for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    # ``ordered`` is the base class's: it runs on the runner's thread (``apply``,
    # ``apply_staged_writes``), whose current stream is the runner's

    def mark(self) -> Any:
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, marker: Any) -> bool:
        return marker is None or bool(marker.query())

    def wait(self, marker: Any) -> None:
        if marker is not None:
            marker.synchronize()

    def side(self, work: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            work()
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(self.stream)
        event.synchronize()


class TokenReader:
    """Sentinels into, and reads out of, the runner's token history (``all_token_ids`` and
    ``total_len`` of vLLM's ``LogitsProcRequestState``), ``window`` positions per slot."""

    def __init__(self, req_states: Any, window: int, port: DevicePort) -> None:
        self.window = window
        self.port = port
        self.ids: torch.Tensor = req_states.all_token_ids.gpu
        self.total: torch.Tensor = req_states.total_len.gpu
        self.cuda = self.ids.device.type == "cuda"
        #: the history as host memory (UVA, or a CPU tensor): read in numpy, no copy
        self.host_ids = host_view(req_states.all_token_ids)
        self.host_total = host_view(req_states.total_len)
        self._columns = np.arange(window, dtype=np.int64)
        self._cached: tuple[tuple[bytes, bytes], torch.Tensor, torch.Tensor] | None = None
        self._last_column = self.ids.shape[1] - 1

    def columns(self, starts: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Each slot's window of positions from ``starts`` (clipped to the row)."""
        cols: np.ndarray[Any, Any] = np.minimum(starts[:, None] + self._columns,
                                                self._last_column)
        return cols

    def mark(self, slots: np.ndarray[Any, Any], starts: np.ndarray[Any, Any],
             value: int) -> None:
        """``value`` at each slot's next ``window`` positions inside its row, in stream
        order (a position past the row's end is never written: it would be a clipped
        column, a committed token's)."""
        cols = self.columns(starts)
        inside = (starts[:, None] + self._columns) <= self._last_column
        if not inside.all():
            rows = np.broadcast_to(slots[:, None], cols.shape)[inside]
            slots, cols = rows[:, None], cols[inside][:, None]
        else:
            slots = slots[:, None]
        if not slots.size:
            return
        if not self.cuda:
            host = self.host_ids
            assert host is not None

            def write_host() -> None:
                host[slots, cols] = value
            self.port.ordered(write_host)
            return
        index = _to_device(slots, self.ids.device)
        at = _to_device(cols, self.ids.device)

        def write() -> None:
            self.ids[index, at] = value
        self.port.ordered(write)

    def read(self, slots: np.ndarray[Any, Any], starts: np.ndarray[Any, Any],
             lengths: bool) -> tuple[np.ndarray[Any, Any] | None, np.ndarray[Any, Any]]:
        """(``total_len`` of each slot when ``lengths``, else None; its ``window`` tokens
        from ``starts``), off stream order: host memory directly, device memory through one
        side copy."""
        cols = self.columns(starts)
        copied: dict[str, torch.Tensor] = {}
        if self.host_ids is None or (lengths and self.host_total is None):

            def copy() -> None:  # on the side stream: the index copies, then the gathers
                index, at = self._indices(slots, cols)
                with normal_tensors():
                    if self.host_ids is None:
                        copied["tokens"] = _host_copy(self.ids[index.unsqueeze(1), at],
                                                      self.cuda)
                    if lengths and self.host_total is None:
                        copied["total"] = _host_copy(self.total.index_select(0, index),
                                                     self.cuda)
            self.port.side(copy)
        tokens = (self.host_ids[slots[:, None], cols] if self.host_ids is not None
                  else copied["tokens"].numpy())
        total = None
        if lengths:
            total = (self.host_total[slots].copy() if self.host_total is not None
                     else copied["total"].numpy())
        return total, tokens

    def _indices(self, slots: np.ndarray[Any, Any], cols: np.ndarray[Any, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` and ``cols`` on the device, queued on the current stream; kept while
        they do not change (a watch polls the same positions until they land), so a poll
        is a gather and a copy back, not two more uploads."""
        key = (slots.tobytes(), cols.tobytes())
        cached = self._cached
        if cached is None or cached[0] != key:
            cached = self._cached = (key, _to_device(slots, self.ids.device),
                                     _to_device(cols, self.ids.device))
        return cached[1], cached[2]

    def read_range(self, slot: int, lo: int, hi: int) -> list[int]:
        """Positions ``lo..hi`` of one slot, off stream order (rare: more tokens than a
        step's window)."""
        if self.host_ids is not None:
            return [int(t) for t in self.host_ids[slot, lo:hi]]
        out: list[list[int]] = []
        self.port.side(lambda: out.append(self.ids[slot, lo:hi].to("cpu").tolist()))
        return out[0]


def unsampleable_id(vocab: Any, width: int) -> int:
    """The watch's mark: a token id in ``[0, width)`` that no constrained row samples, so
    a commit rarely equals it. A padding id beyond the tokenizer's tokens (the model's
    vocabulary is padded: Qwen2.5's 151,936 over 151,665 tokens) is never allowed. Else a
    special token that is not a stop and no grammar starts or forces: a reserved or padding
    one first (Llama 3's ``<|reserved_special_token_N|>``); never a reasoning or tool-call
    marker (structural tags and thinking-budget forcing emit those). Else the last id. A
    commit equal to the mark costs an ordered read, never a wrong token."""
    tokens = vocab.tokens
    if width > len(tokens):
        return width - 1
    stops = set(vocab.stop_ids)
    special = sorted(t for t in vocab.special_ids if t not in stops and t < width)
    spelled = {t: bytes(tokens[t]).lower() for t in special}
    idle = [t for t in special if any(w in spelled[t] for w in _IDLE)]
    quiet = [t for t in special if not any(w in spelled[t] for w in _MARKERS)]
    return int((idle or quiet or [width - 1])[-1])


#: Words of special tokens no model emits (reserved and padding slots) ...
_IDLE = (b"reserved", b"pad", b"unused")
#: ... and of markers that grammars or vLLM's forcing do emit
_MARKERS = (b"think", b"tool", b"call", b"python", b"response", b"function", b"ipython")


def _host_copy(source: torch.Tensor, cuda: bool) -> torch.Tensor:
    """``source`` copied into a (pinned, on CUDA) host tensor, queued without blocking."""
    out = torch.empty(tuple(source.shape), dtype=source.dtype, pin_memory=cuda)
    out.copy_(source, non_blocking=cuda)
    return out


def _to_device(values: np.ndarray[Any, Any], device: torch.device) -> torch.Tensor:
    """A small int64 index on ``device`` (pinned and non-blocking on CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
