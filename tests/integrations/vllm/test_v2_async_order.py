"""The V2 plugin in vLLM 0.34's own order (``tests/v34_driver.py``): async scheduling,
chunked verification, drafts with rejections, preemption and resume, a slot reused in the
same step, 1,024 slots. Every mask is checked against the raw backend (``RawReference``).

Runs with vLLM 0.34's Python first on the path (``make unit34``); skipped otherwise, and a
failure when ``GRAMMASK_V34_REQUIRED`` is set.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ...vllm_fixtures import (  # first: it sets VLLM_TARGET_DEVICE=cpu before vLLM is imported
    VOCAB,
    cpu_v2,  # noqa: F401 - an autouse fixture: the CPU stand-ins for this module
    spec_config,
    v34_missing,
    vllm_config,
)

# isort: split
if why := v34_missing():
    pytest.skip(why, allow_module_level=True)

from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rsm

from ...v34_driver import Driver


def _chunk_logits(monkeypatch: pytest.MonkeyPatch, rows: int) -> int:
    """``MAX_CHUNK_BYTES`` patched to ``rows`` fp32 logits rows: what
    ``get_max_chunk_logits`` then tells ``_verify_in_chunks``."""
    monkeypatch.setattr(rsm, "MAX_CHUNK_BYTES", rows * VOCAB * 4)
    return int(rsm.get_max_chunk_logits(VOCAB))


def _run(d: Driver, steps: int, *, admit_every: int = 3, preempt_at: tuple[int, ...] = ()
         ) -> None:
    for t in range(steps):
        if t in preempt_at:
            d.preempt(2)
            d.resume()
        live = sum(not r.finished for r in d.reqs.values())
        d.step(admit=max(0, 6 - live) if t % admit_every == 0 else 0)
    d.sync()
    assert not d.device.errors, d.device.errors


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("stand_in", [False, True], ids=["inline", "async"])
def test_a_step_split_into_chunks_masks_as_one_apply(monkeypatch: pytest.MonkeyPatch,
                                                     chunks: int, stand_in: bool) -> None:
    """The rejection sampler's chunks (two or three applies a step, disjoint request
    ranges) give exactly the masks of one apply: no commit dropped, none read twice."""
    d = Driver(vllm_config(max_num_seqs=8), max_reqs=8,
               chunk_logits=_chunk_logits(monkeypatch, -(-6 // chunks)), stand_in=stand_in,
               seed=chunks)
    try:
        _run(d, 40)
        c = d.counts
        assert c.wrong == 0, f"{c.wrong} of {c.masks} masks wrong"
        assert c.masks > 150 and c.finished > 3
        assert max(c.chunks) == chunks
        if stand_in:
            assert d.batch.watch.reads["ordered"] == 0, d.batch.watch.reads
            assert d.batch.watch.reads["watched"] > 20
    finally:
        d.close()


def test_every_case_of_0_34s_order_on_a_thousand_slots(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Async order, drafts with rejections in three verification chunks, preemption and
    resume, slots reused in the same step, slots from the top of 1,024."""
    max_reqs, num_spec = 1024, 2
    d = Driver(spec_config(max_reqs=max_reqs, num_spec=num_spec), max_reqs=max_reqs,
               num_spec=num_spec, chunk_logits=_chunk_logits(monkeypatch, 7), seed=7)
    try:
        _run(d, 40, preempt_at=(12, 25))
        c = d.counts
        assert c.wrong == 0, f"{c.wrong} of {c.masks} masks wrong"
        assert c.draft_rows > 100 and c.accepted > 20 and c.rejected > 20
        assert c.preempted >= 2 and c.resumed >= 2
        assert c.reused_same_step > 0 and c.finished > 3
        assert max(c.chunks) >= 3
        assert min(r.slot for r in d.reqs.values()) > 1000  # slots from the top
        assert d.batch.watch.reads["ordered"] == 0, d.batch.watch.reads
        assert d.batch.draft_reads > 0  # drafts exist on the device only: read in order
    finally:
        d.close()


def test_apply_never_waits_for_the_forward_it_follows() -> None:
    """Each step's forward is held on the device until the host has finished the step's
    applies: an apply that waited for it would hang (the watchdog lets it go and says
    so). The tokens of step t land before forward(t+1) (stream order), so every fill ran
    while the forward it follows had not."""
    release = threading.Event()
    forced: list[int] = []

    def forward() -> None:
        if not release.wait(20):
            forced.append(1)
        release.clear()

    d = Driver(vllm_config(max_num_seqs=8), max_reqs=8, forward=forward, seed=3)
    try:
        for t in range(25):
            d.step(admit=4 if t % 6 == 0 else 0)
            release.set()
        release.set()
        d.sync()
        assert not forced, "an apply waited for the forward it follows"
        assert not any(d.forward_done_at_apply)
        assert d.counts.wrong == 0 and d.counts.masks > 40
        assert d.batch.watch.reads["watched"] > 15 and d.batch.watch.reads["ordered"] == 0
    finally:
        release.set()
        d.close()


def test_a_row_that_did_not_sample_is_read_in_stream_order() -> None:
    """A slot masked but whose step commits nothing (the driver withholds its token): the
    watch cannot see it land, so the next apply that needs it reads it in stream order,
    once, and its masks stay right. This is the only way to an ordered read."""
    d = Driver(vllm_config(max_num_seqs=8), max_reqs=8, seed=5)
    withheld = {"n": 0, "calls": 0}
    post = d._post_update

    def post_update(order: list[Any]) -> None:  # the device's, in step order
        withheld["calls"] += 1
        if withheld["calls"] == 6 and order:  # step 5's: one row commits nothing
            order[0].committing = []
            withheld["n"] += 1
        post(order)

    d._post_update = post_update  # type: ignore[method-assign]
    try:
        _run(d, 14, admit_every=100)
        assert withheld["n"] == 1
        assert d.counts.wrong == 0
        assert d.batch.watch.reads["ordered"] == 1, d.batch.watch.reads
    finally:
        d.close()


def test_start_up_warms_the_kernel_and_binds_the_helpers(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The apply kernel is warmed when the plugin is built (before any step), for the
    model's vocabulary; the helper threads start on the rank's device."""
    from grammask.integrations.vllm import v2 as vllm_v2

    warmed: list[tuple[Any, int]] = []
    monkeypatch.setattr(vllm_v2, "warm_device_apply",
                        lambda device, vocab: warmed.append((device, vocab)) or 0)
    d = Driver(vllm_config(max_num_seqs=8), max_reqs=8, seed=11)
    try:
        assert warmed == [(d.rs.device, VOCAB)] and not d.counts.masks
        for name in ("tokens", "parse"):
            pool = d.batch._helpers.pool(name)
            assert pool._initializer is vllm_v2.bind_device  # type: ignore[attr-defined]
            assert pool._initargs == (d.rs.device,)  # type: ignore[attr-defined]
    finally:
        d.close()


def test_a_watch_that_cannot_start_ends_its_rows_not_the_step() -> None:
    """A failure while marking a step's tokens (a device error) never raises into vLLM's
    step: the rows of that apply end with stop-only masks, and others go on."""
    d = Driver(vllm_config(max_num_seqs=8), max_reqs=8, seed=13)
    mark = d.batch.reader.mark
    calls = {"n": 0}

    def failing(slots: Any, starts: Any, value: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        mark(slots, starts, value)

    d.batch.reader.mark = failing  # type: ignore[method-assign]
    try:
        _run(d, 8, admit_every=100)
        proc = d.plugin.core.proc_or_none
        assert proc is not None
        assert any("watching tokens failed" in (e or "") for e in proc.errors.values())
    finally:
        d.close()


def test_the_drivers_run_does_not_depend_on_the_devices_speed() -> None:
    """The same seed with the device behind the host (a slow forward) and ahead of it (an
    instant forward, a host that pauses between steps): the same steps, finishes and
    checked rows. The host learns each step's outputs as of that step's ``post_update``,
    never what the device ran since (a run that depended on it made comparisons between
    two runs flaky: CI once saw 539 masks against 538)."""
    runs = []
    for forward_s, pause_s in ((0.02, 0.0), (0.0, 0.02)):
        d = Driver(vllm_config(max_num_seqs=16, tiny=True), max_reqs=16, seed=5,
                   forward_s=forward_s)
        try:
            for t in range(30):
                time.sleep(pause_s)
                running = sum(not r.finished for r in d.reqs.values())
                d.step(admit=max(0, 13 - running) if t % 5 == 0 else 0)
            d.sync()
            c = d.counts
            runs.append((c.masks, c.finished, c.reused_same_step, sorted(d.reqs)))
            assert c.wrong == 0
        finally:
            d.close()
    assert runs[0] == runs[1], runs
    assert runs[0][1] > 5, runs  # requests finished and slots were handed out again
