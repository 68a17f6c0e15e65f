"""The token watch: for a host whose sampled tokens stay in device memory and land there
after the host has moved on (vLLM 0.34's V2 runner under async scheduling), each masked
slot's commit is read as it lands and its fill started, overlapped with the next forward.
Hosts that hand tokens over (V1, transformers) call the processor's ``step`` themselves; a
host whose tokens land on a device gives this watch a ``TokenSource`` and a ``StreamPort``
(vLLM's: ``integrations/vllm/v2_device``) and calls ``watch`` and ``settle``.

The rule it keeps holds however the host calls ``apply`` (vLLM 0.34: async scheduling,
``apply(t+1)`` before step t's tokens land; chunked verification, several applies a step on
disjoint request ranges, ``spec_decode/rejection_sampler.py``: ``_verify_in_chunks``):

- a slot masked in an apply commits once (one token, or the accepted drafts plus the bonus
  token) before it is masked again. Its commit is *pending* until read.
- ``watch`` (the host, after masking) marks the slots pending: the positions their commit
  will fill are set to the *mark* in stream order (``v2_device``), then the slots join this
  step's *open* watch. The mark is a token id no constrained row can sample (a valid id:
  whatever else reads those positions before the commit lands sees an id the host itself
  could have left there); a commit that equals it is told apart by an ordered read, never
  taken for "not landed" for good (``collisions``). ``mark=None`` marks nothing: every read
  is then ordered. The chunks of one step join the
  same open watch: their tokens land in one ``post_update``, queued after the last chunk, so
  a chunk is always added before any token of its step can land (a chunk added while the
  watch polls is picked up before it declares the step landed).
- a watch polls off stream order on the helper thread, leaving the GIL between polls (sleeps;
  shorter ones while the host waits). Once every slot's tokens have landed it appends them
  to the slots' live lists and calls ``step`` (the processor's fill starts): a *watched*
  read, overlapped with the forward.
- ``settle(slots)`` (the host, in apply, before masking ``slots``) waits for the watches
  holding those slots' pending commits, and for nothing else: never for the forward the
  host just launched. A watch still waiting once the stream has passed a marker recorded at
  that apply (every kernel queued before it, ``post_update`` included, has run) reads once
  more: an *ordered* read, right by construction (a slot that turned out not to sample keeps
  its state). That is the rare case; so is a watch that failed, redone on the host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ... import metrics

log = logging.getLogger("grammask")

class StreamPort(Protocol):
    """The host's device stream as the watch sees it (vLLM's: ``v2_device.DevicePort``)."""

    def mark(self) -> Any:
        """A marker recorded now in stream order (None: a synchronous host)."""

    def passed(self, marker: Any) -> bool:
        """Whether every kernel queued before ``marker`` has run."""

    def wait(self, marker: Any) -> None:
        """Block (releasing the GIL) until ``passed(marker)``."""


class TokenSource(Protocol):
    """Where the slots' committed tokens land (vLLM's: ``v2_device.TokenReader``)."""

    #: positions a step may commit per slot (1 + drafts)
    window: int

    def mark(self, slots: np.ndarray[Any, Any], starts: np.ndarray[Any, Any],
             value: int) -> None:
        """Set positions ``[starts, starts + window)`` of ``slots`` (those inside the row)
        to ``value``, in stream order (before the host's update that writes the tokens)."""

    def read(self, slots: np.ndarray[Any, Any], starts: np.ndarray[Any, Any], lengths: bool
             ) -> tuple[np.ndarray[Any, Any] | None, np.ndarray[Any, Any]]:
        """The positions ``[starts, starts + window)`` of ``slots`` as they are now (a row
        per slot), with the slots' token counts when ``lengths`` (drafts)."""

    def read_range(self, slot: int, lo: int, hi: int) -> list[int]:
        """Positions ``[lo, hi)`` of ``slot``'s history (a commit longer than the window)."""

#: The longest a watch polls with nobody waiting for it (a step this long is not a decode
#: step: the next ``settle`` reads in stream order instead).
WATCH_S = 5.0
#: Pause between two polls while the host waits in ``apply`` ...
POLL_S = 50e-6
#: ... and at most while it does not (it doubles from ``POLL_S``): the GIL stays the runner's.
POLL_IDLE_S = 1e-3


@dataclass(eq=False)
class SlotTokens:
    """One slot's committed tokens as the processor reads them."""

    output: list[int] = field(default_factory=list)  # the processor's live list
    known: int = 0  # committed positions appended (or fetched with the prompt)
    unread: bool = False  # masked, and its commit not read yet
    gone: bool = False  # its request left the slot: its commit is not waited for


Items = list[tuple[int, SlotTokens]]


class _Watch:
    """One step's pending commits (the slots of every chunk of that step)."""

    def __init__(self) -> None:
        self.items: Items = []
        self.slots: set[int] = set()
        self.version = 0  # bumped by each chunk added
        self.closed = False  # landed, or settled: chunks go to a new watch
        self.lock = threading.Lock()
        self.host_waits = threading.Event()
        self.bound: Any = None  # the marker past which a read is ordered (set before
        # ``host_waits``: the host's own ``DevicePort`` marks with None)
        self.future: Future[str] | None = None


class TokenWatch:
    """Pending commits, their watches on the helper thread, and the reads' counts."""

    def __init__(self, reader: TokenSource, port: StreamPort, *, lengths: bool,
                 step: Callable[[Items], None], fail: Callable[[int, str], None],
                 pool: Callable[[], ThreadPoolExecutor], mark: int | None) -> None:
        self.reader = reader
        self.port = port
        self.lengths = lengths  # drafts: the count of committed tokens is total_len's growth
        #: the token id written where a commit will land (None: no marks, reads ordered)
        self.mark = mark
        self._step = step
        self._fail = fail
        self._pool = pool
        self._watches: deque[_Watch] = deque()  # oldest first
        self._open: _Watch | None = None
        #: token reads by how they were read (the same counts go to Prometheus)
        self.reads = {"watched": 0, "ordered": 0}
        #: committed tokens that equalled the mark (each cost an ordered read)
        self.collisions = 0
        #: seconds the host waited in ``settle``, last call
        self.last_wait_s = 0.0

    # ------------------------------------------------------------------ host thread
    def watch(self, items: Items) -> None:
        """After masking ``items``' slots: their commits are pending (sentinels first, in
        stream order), watched by this step's open watch."""
        items = [(slot, t) for slot, t in items if not t.gone]
        if not items:
            return
        slots = np.fromiter((slot for slot, _ in items), dtype=np.int64, count=len(items))
        starts = np.fromiter((t.known for _, t in items), dtype=np.int64, count=len(items))
        if self.mark is not None:
            self.reader.mark(slots, starts, self.mark)
        for _, t in items:
            t.unread = True
        w = self._open
        if w is not None:
            with w.lock:
                if not w.closed:
                    w.items.extend(items)
                    w.slots.update(slot for slot, _ in items)
                    w.version += 1
                    return
        w = self._open = _Watch()
        w.items.extend(items)
        w.slots.update(slot for slot, _ in items)
        self._watches.append(w)
        w.future = self._pool().submit(self._poll, w)

    def settle(self, slots: Iterable[int]) -> None:
        """Before masking ``slots``: their pending commits read and their fills started.
        Waits for the watches holding them (and older ones), never for the stream beyond
        what has landed. Never raises: a commit that cannot be read fails its slot."""
        wanted = set(slots)
        last = max((i for i, w in enumerate(self._watches) if not w.slots.isdisjoint(wanted)),
                   default=-1)
        if last < 0:
            return
        started = time.perf_counter()
        marker = self.port.mark()
        for _ in range(last + 1):
            w = self._watches.popleft()
            if w is self._open:
                self._open = None
            with w.lock:
                w.closed = True
                if w.bound is None:
                    w.bound = marker
            w.host_waits.set()
            assert w.future is not None
            try:
                how = w.future.result()
            except Exception as exc:  # the helper's failure: read here, in stream order
                log.exception("grammask: watching a step's tokens failed; reading them now")
                self._read_here(w, f"{type(exc).__name__}: {exc}")
            else:
                if how == "late":
                    self._read_here(w, "a late watch")
        self.last_wait_s = time.perf_counter() - started
        metrics.V2_TOKEN_WAIT.observe(self.last_wait_s)

    def forget(self, tokens: SlotTokens) -> None:
        """The slot's request left: its pending commit is not waited for."""
        tokens.gone = True

    # ------------------------------------------------------------------ helper thread
    def _poll(self, w: _Watch) -> str:
        """Poll until every slot's tokens landed (then commit them: ``watched``), or until
        the host waits and the stream has passed its marker (``ordered``); ``late``: nobody
        waited within ``WATCH_S`` (the host reads them when it needs them)."""
        if self.mark is None:
            return self._ordered_only(w)
        deadline = time.monotonic() + WATCH_S
        pause = POLL_S
        window = self.reader.window
        lengths = self.lengths
        while True:
            with w.lock:
                items = [(slot, t) for slot, t in w.items if not t.gone]
                version = w.version
                if not items:  # every request left: nothing to read
                    w.closed = True
                    return "watched"
            starts, totals, tokens = self._read(items, lengths)
            if _all_landed(totals, tokens, starts, window, self.mark):
                if totals is None:  # landed by the sentinels: confirm the count once
                    lengths = True
                    continue
                with w.lock:
                    if w.version != version:  # a chunk came in meanwhile: poll it too
                        lengths = self.lengths
                        continue
                    w.closed = True
                self._commit(items, starts, totals, tokens, "watched")
                return "watched"
            if w.host_waits.is_set() and self.port.passed(w.bound):
                starts, totals, tokens = self._read(items, True)  # now in stream order
                self._commit(items, starts, totals, tokens, "ordered")
                return "ordered"
            if w.host_waits.is_set():
                time.sleep(POLL_S)
            elif time.monotonic() > deadline:
                with w.lock:  # the host reads them in stream order when it needs them
                    w.closed = True
                return "late"
            else:
                w.host_waits.wait(pause)
                pause = min(2 * pause, POLL_IDLE_S)

    def _ordered_only(self, w: _Watch) -> str:
        """No marks: nothing tells a landed token, so the read waits for the host's
        ``settle`` and for the stream to pass its marker (``ordered``; ``late`` as above)."""
        if not w.host_waits.wait(WATCH_S):
            with w.lock:
                if not w.host_waits.is_set():
                    w.closed = True
                    return "late"
        self.port.wait(w.bound)
        with w.lock:
            items = [(slot, t) for slot, t in w.items if not t.gone]
        starts, totals, tokens = self._read(items, True)
        self._commit(items, starts, totals, tokens, "ordered")
        return "ordered"

    # ------------------------------------------------------------------ both
    def _read(self, items: Items, lengths: bool
              ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None,
                         np.ndarray[Any, Any]]:
        """(each slot's start, its ``total_len`` when ``lengths``, the window's tokens)."""
        n = len(items)
        slots = np.fromiter((slot for slot, _ in items), dtype=np.int64, count=n)
        starts = np.fromiter((t.known for _, t in items), dtype=np.int64, count=n)
        if not n:
            return starts, None, np.empty((0, self.reader.window), dtype=np.int64)
        totals, tokens = self.reader.read(slots, starts, lengths)
        return starts, totals, tokens

    def _commit(self, items: Items, starts: np.ndarray[Any, Any],
                totals: np.ndarray[Any, Any] | None, tokens: np.ndarray[Any, Any],
                how: str) -> None:
        """Append each slot's committed tokens (none: it did not sample) and start the
        fill of the slots that moved."""
        window = self.reader.window
        counts = _committed(totals, tokens, starts, self.mark)
        if how == "ordered" and self.mark is not None and len(counts):
            inside = np.arange(tokens.shape[1])[None, :] < counts[:, None]
            hit = int(((tokens == self.mark) & inside).any(axis=1).sum())
            if hit:
                self.collisions += hit
                metrics.V2_MARK_COLLISIONS.inc(hit)
        moved: Items = []
        for i, (slot, t) in enumerate(items):
            t.unread = False
            n = int(counts[i])
            if n <= 0:
                continue
            take = min(n, window)
            t.output.extend(tokens[i, :take].tolist())
            if n > take:  # more than a step's worth (never in 0.34's order): read the rest
                t.output.extend(self.reader.read_range(slot, t.known + take, t.known + n))
            t.known += n
            moved.append((slot, t))
        if items:
            self.reads[how] += 1
            metrics.V2_TOKEN_READS.labels(how).inc()
        if moved:
            self._step(moved)

    def _read_here(self, w: _Watch, why: str) -> None:
        """The host's read of a failed watch, after the stream passed its marker."""
        try:
            self.port.wait(w.bound)
            items = [(slot, t) for slot, t in w.items if not t.gone and t.unread]
            starts, totals, tokens = self._read(items, True)
            self._commit(items, starts, totals, tokens, "ordered")
        except Exception as again:
            log.exception("grammask: reading a step's tokens failed")
            for slot, t in w.items:
                if t.unread:
                    t.unread = False
                    self._fail(slot, f"reading tokens failed: {type(again).__name__}: "
                                     f"{again} (after {why})")


def _committed(totals: np.ndarray[Any, Any] | None, tokens: np.ndarray[Any, Any],
               starts: np.ndarray[Any, Any], mark: int | None) -> np.ndarray[Any, Any]:
    """Tokens each slot committed, as far as visible: ``total_len``'s growth, or without it
    one once the slot's first position no longer holds the mark."""
    if totals is None:
        counts: np.ndarray[Any, Any] = (tokens[:, 0] != mark).astype(np.int64)
        return counts
    grown: np.ndarray[Any, Any] = np.maximum(totals.astype(np.int64) - starts, 0)
    return grown


def _all_landed(totals: np.ndarray[Any, Any] | None, tokens: np.ndarray[Any, Any],
                starts: np.ndarray[Any, Any], window: int, mark: int) -> bool:
    """Every slot committed at most ``window`` tokens (more is never 0.34's order: left to
    the ordered read), and none of its committed positions still holds the mark
    (``post_update`` stores the length before the tokens; a token equal to the mark waits
    for the ordered read)."""
    counts = _committed(totals, tokens, starts, mark)
    if not len(counts):
        return True
    if (counts <= 0).any() or (counts > window).any():
        return False
    inside = np.arange(tokens.shape[1])[None, :] < counts[:, None]
    return not bool(((tokens == mark) & inside).any())
