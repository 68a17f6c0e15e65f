"""The bitmask's trip from vLLM's engine core to its model runner, as ``bench.step`` charges it.

With a multi-process executor (tensor parallel > 1), vLLM fills the step's bitmask in the
engine core and sends it to the workers with the ``sample_tokens`` RPC
(``MultiprocExecutor.collective_rpc``): the ``GrammarOutput`` (request ids and the bitmask as a
numpy array) is pickled with protocol 5 and written into a shared-memory ring slot
(``shm_broadcast.MessageQueue.enqueue``); the worker reads it back after its forward
(``MessageQueue.dequeue``), copying each out-of-band buffer out of the reusable slot, before it
can apply the mask. ``Trip`` does the same work in one process, with the same rules (buffers of
1 MiB and more out of band, the 24 MiB chunk, the slot's length-prefixed layout), so the
copies and the pickling cost what they cost there; it leaves out what one process cannot show
(the ring's flags and spin waits, a second process's caches), so it charges vLLM no more than
its real queue does.
"""

from __future__ import annotations

import copyreg
import io
import mmap
import pickle
from dataclasses import dataclass
from pickle import PickleBuffer
from typing import Any

import numpy as np

#: ``MessageQueue``'s default chunk (``max_chunk_bytes``) and its in-line threshold
CHUNK_BYTES = 24 * 1024 * 1024
INLINE_BELOW = 1024 * 1024


@dataclass
class GrammarOutput:
    """What vLLM 0.32's ``Scheduler.get_grammar_bitmask`` returns (``v1/core/sched/output.py``)."""

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray[Any, np.dtype[np.int32]]
    num_acceptable_drafts: list[int] | None = None


class Trip:
    """One ring slot: ``send`` on the engine core's side, ``receive`` on the worker's."""

    def __init__(self) -> None:
        self._slot = mmap.mmap(-1, CHUNK_BYTES)
        self._view = memoryview(self._slot)

    def send(self, obj: object) -> None:
        """``MessageQueue.enqueue`` for one local reader: pickle (large buffers out of band),
        then copy every buffer into the slot behind its 4-byte length."""
        buffers: list[Any] = [b""]

        def oob(buf: PickleBuffer) -> bool:
            raw = buf.raw()
            if len(raw) < INLINE_BELOW:
                return True
            buffers.append(raw)
            return False

        with io.BytesIO() as bio:
            pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL,
                                     buffer_callback=oob)
            pickler.dispatch_table = dict(copyreg.dispatch_table)
            pickler.dump(obj)
            buffers[0] = bio.getvalue()
        view = self._view
        if 3 + sum(4 + len(b) for b in buffers) > CHUNK_BYTES:
            raise ValueError("message over the chunk: vLLM sends it over a socket instead")
        view[0] = 0
        view[1:3] = len(buffers).to_bytes(2, "big")
        offset = 3
        for b in buffers:
            view[offset:offset + 4] = len(b).to_bytes(4, "big")
            offset += 4
            view[offset:offset + len(b)] = b
            offset += len(b)

    def receive(self) -> Any:
        """``MessageQueue.dequeue``: out-of-band buffers copied out of the slot, then
        unpickled."""
        view = self._view
        count = int.from_bytes(view[1:3], "big")
        offset = 3
        buffers: list[Any] = []
        for i in range(count):
            size = int.from_bytes(view[offset:offset + 4], "big")
            offset += 4
            chunk = view[offset:offset + size]
            offset += size
            buffers.append(chunk if i == 0 else bytearray(chunk))
        return pickle.loads(buffers[0], buffers=buffers[1:])

    def close(self) -> None:
        self._view.release()
        self._slot.close()
