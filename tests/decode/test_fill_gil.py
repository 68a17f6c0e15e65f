"""A decode step's fill job takes the GIL at most twice (issue 45, item 7): once when it starts,
and once after its one native call that lets the GIL go (the batch fill). Beside a host thread
that runs pure Python, each take waits for that thread to let go, so the count, not the
native work, decides what the job costs there.

Counted on the fill thread during each job: every call into a native function that lets the
GIL go and so must take it back. xgrammar's calls all go through tvm-ffi, which lets it go
unless the function's ``release_gil`` is off (its Python wrappers are patched to count, and
the batch accept's function is counted when its flag is on at the call); llguidance's mask
computations (its matcher's and its executor's, seen by a profile function on the fill
thread); ``ctypes.memmove`` (a foreign call). No timing is asserted.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import xgrammar as xgr

import grammask.backends.xgrammar as xgr_adapter
from grammask import BatchProcessor, Compiler, GrammarSpec, Vocabulary

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "kind", "age", "tags"], "additionalProperties": False}
TEXTS = ['{"name":"Rex the first","kind":"dog","age":7,"tags":["good","loud"]}',
         '{"name":"Tweety","kind":"bird","age":2,"tags":[]}',
         '{"name":"Tom","kind":"cat","age":11,"tags":["grey","lazy","old"]}',
         '{"name":"A much longer name for a cat","kind":"cat","age":3,"tags":["x"]}']
#: llguidance's calls that compute masks with the GIL let go (pyo3 ``allow_threads``)
LLG_RELEASING = ("LLMatcher.compute_mask", "LLMatcher.unsafe_compute_mask_ptr",
                 "LLMatcher.compute_mask_into", "LLMatcher.compute_bitmask")


class Releases:
    """Native calls that let the GIL go, made on one thread (``thread``), by name."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.calls: collections.Counter[str] = collections.Counter()

    def hit(self, name: str) -> None:
        if threading.get_ident() == self.thread:
            self.calls[name] += 1

    def total(self) -> int:
        return sum(self.calls.values())

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            name = getattr(arg, "__qualname__", "")
            if name in LLG_RELEASING or name.startswith("LLExecutor."):
                self.hit(name)


def _counted(releases: Releases, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        releases.hit(name)
        return func(*args, **kwargs)
    return wrapper


class _CountedFunction:
    """A tvm-ffi function that counts a call made while its ``release_gil`` is on."""

    def __init__(self, releases: Releases, name: str, real: Any) -> None:
        self._releases, self._name, self._real = releases, name, real

    @property
    def release_gil(self) -> bool:
        return bool(self._real.release_gil)

    @release_gil.setter
    def release_gil(self, value: bool) -> None:
        self._real.release_gil = value

    def __call__(self, *args: Any) -> Any:
        if self._real.release_gil:
            self._releases.hit(self._name)
        return self._real(*args)


class _CountedCore:
    def __init__(self, releases: Releases, real: Any) -> None:
        self._releases, self._real = releases, real

    def __getattr__(self, name: str) -> Any:
        return _CountedFunction(self._releases, f"core.{name}", getattr(self._real, name))


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> Iterator[Releases]:
    counted = Releases()
    for cls in (xgr.GrammarMatcher, xgr.BatchGrammarMatcher):
        for name, attr in list(vars(cls).items()):
            if name.startswith("_"):
                continue
            if isinstance(attr, staticmethod):
                monkeypatch.setattr(cls, name, staticmethod(
                    _counted(counted, f"{cls.__name__}.{name}", attr.__func__)))
            elif callable(attr):
                monkeypatch.setattr(cls, name, _counted(counted, f"{cls.__name__}.{name}", attr))
    if xgr_adapter._CORE_BATCH is not None:
        monkeypatch.setattr(xgr_adapter, "_CORE_BATCH",
                            _CountedCore(counted, xgr_adapter._CORE_BATCH))
    monkeypatch.setattr(ctypes, "memmove", _counted(counted, "ctypes.memmove", ctypes.memmove))
    yield counted


def _takes_per_step(compiler: Compiler, vocab: Vocabulary, backend: str,
                    releases: Releases) -> list[int]:
    """Each step's GIL takes on the fill thread: one to start, one per releasing call."""
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False).with_backend(backend)
    grammar = compiler.compile(spec)
    assert grammar.backend == backend
    walks = [[*vocab.encode(TEXTS[i % len(TEXTS)]), vocab.stop_ids[0]] for i in range(8)]
    threading.setprofile(releases.profile)  # the fill thread, started by the processor
    try:
        proc = BatchProcessor(compiler, max_batch=len(walks), think_end=None)
    finally:
        threading.setprofile(None)
    releases.thread = proc.fill_thread_id
    takes = []
    try:
        for row in range(len(walks)):
            proc.add(row, spec, grammar=grammar)
        proc.step()
        proc.wait_masks()  # the first masks: rows made, matchers attached
        at = [0] * len(walks)
        while True:
            going = [i for i, w in enumerate(walks) if at[i] < len(w)]
            if not going:
                break
            before = releases.total()
            proc.step(going, [walks[i][at[i]] for i in going])
            proc.wait_masks()
            takes.append(1 + releases.total() - before)
            for i in going:
                at[i] += 1
    finally:
        proc.close()
        releases.thread = None
    assert proc.stats.rows_filled > 0
    return takes


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_fill_job_takes_the_gil_at_most_twice_a_step(
        compiler: Compiler, qwen25: Vocabulary, backend: str, releases: Releases) -> None:
    takes = _takes_per_step(compiler, qwen25, backend, releases)
    assert len(takes) >= 20
    # every step after the first masks: rows advance by one token (some end on their stop)
    assert max(takes) <= 2, (takes, dict(releases.calls))
    assert releases.total() > 0  # the counting sees the fills (one a step)


def test_counting_sees_a_fill_per_row(compiler: Compiler, qwen25: Vocabulary,
                                      releases: Releases) -> None:
    """A fill per row (each lets the GIL go) is counted: the check above can fail."""
    spec = GrammarSpec.json_schema(SCHEMA, any_whitespace=False).with_backend("guidance")
    grammar = compiler.compile(spec)
    releases.thread = threading.get_ident()
    matchers = [grammar.matcher() for _ in range(4)]
    for m in matchers:
        assert m.accept(qwen25.encode('{"')[0])
    from grammask.kernels.bitmask import allocate_bitmask

    bitmask = allocate_bitmask(4, qwen25.vocab_size)
    sys.setprofile(releases.profile)
    try:
        for row, m in enumerate(matchers):
            m.fill(bitmask, row)
    finally:
        sys.setprofile(None)
    assert releases.total() == 4
