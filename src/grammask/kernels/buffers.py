"""Bitmask buffers for the decode step (``MaskBuffers``).

``MaskBuffers``: int32 ``(max_batch, ceil(V/32))`` buffers allocated once and reused (grown
when speculative decoding needs rows for draft positions). Two of them alternate step by
step, so a fill never writes a buffer whose host-to-device copy of the previous step may
still be in flight (pinned memory, non-blocking copy). On CPU the second buffer is idle but
keeps a single code path.
"""

from __future__ import annotations

from typing import Any

import torch

from .bitmask import allocate_bitmask, bitmask_words


class MaskBuffers:
    """``count`` reusable bitmasks; pinned when CUDA is present so device copies can overlap."""

    def __init__(self, max_batch: int, vocab_size: int, *, count: int = 2) -> None:
        if max_batch < 1 or count < 1:
            raise ValueError(f"need max_batch >= 1 and count >= 1, got {max_batch}, {count}")
        self.max_batch = max_batch
        #: each buffer's rows: the batch's, then room for draft positions (``grow``)
        self.rows = max_batch
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.pinned = torch.cuda.is_available()
        self._buffers = [allocate_bitmask(max_batch, vocab_size, pin=self.pinned)
                         for _ in range(count)]
        self._retired: list[torch.Tensor] = []  # outgrown: a device copy may still read one
        # GPU only: the copy of buffer i to the device (``copy_queued``)
        self._copy_done: list[Any | None] = [None] * count
        self._events: list[Any | None] = [None] * count  # made once, recorded per copy
        #: the device copy's buffer, kept across steps (``kernels.apply.copy_to_device``)
        self.device_copy: torch.Tensor | None = None
        #: mask rows the last device copy moved (``apply.copy_runs``: the rows in use)
        self.rows_copied = 0
        self._next = 0

    @property
    def count(self) -> int:
        return len(self._buffers)

    def acquire(self) -> torch.Tensor:
        """The next buffer in turn, once no device copy still reads it."""
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._copy_done[index]
        if event is not None:  # GPU path: wait for the copy of two steps ago (releases the GIL)
            event.synchronize()
            self._copy_done[index] = None
        return self._buffers[index]

    def grow(self, rows: int) -> None:
        """Buffers of at least ``rows`` rows from the next ``acquire`` on (speculative
        decoding writes draft positions above the batch's rows); at least doubles, so a
        host's growing drafts reallocate a few times, not every step."""
        if rows <= self.rows:
            return
        self.rows = max(rows, 2 * self.rows)
        self._retired = list(self._buffers)
        self._buffers = [allocate_bitmask(self.rows, self.vocab_size, pin=self.pinned)
                         for _ in self._buffers]
        self._copy_done = [None] * len(self._buffers)
        self._events = [None] * len(self._buffers)

    def room(self, bitmask: torch.Tensor, base: int, extra: int) -> torch.Tensor:
        """``bitmask`` (one of these buffers) with ``extra`` rows from row ``base`` on (draft
        positions above the rows a step uses): itself when it has them; else a larger copy
        of its first ``base`` rows (those it has: a later chunk of a step places its drafts
        above the earlier chunks', whose rows it does not read), kept with the outgrown
        buffers (a device copy may still read it), and from the next ``acquire`` on buffers
        with ``extra`` rows above every batch row (``grow``)."""
        need = base + extra
        if bitmask.shape[0] >= need:
            return bitmask
        self.grow(self.max_batch + extra)
        larger = allocate_bitmask(need, self.vocab_size, pin=self.pinned)
        kept = min(base, bitmask.shape[0])
        larger[:kept].copy_(bitmask[:kept])
        self._retired.append(larger)
        return larger

    def copy_queued(self, bitmask: torch.Tensor) -> None:
        """A device copy of ``bitmask`` (one of these buffers) was just queued on the current
        CUDA stream: ``acquire`` hands that buffer out again only once it ran (one event per
        buffer, made once)."""
        pointer = bitmask.data_ptr()
        for i, buf in enumerate(self._buffers):
            if buf.data_ptr() == pointer:
                event = self._events[i]
                if event is None:
                    event = self._events[i] = torch.cuda.Event(  # type: ignore[no-untyped-call]
                        blocking=True)
                event.record()
                self._copy_done[i] = event
