"""Isolation and tensor parallelism in a real server: two worker ranks (gloo), one request
whose grammar cannot compile in time beside normal streams, and grammask's metrics on vLLM's
own ``/metrics`` (``PROMETHEUS_MULTIPROC_DIR``).

With ``--tensor-parallel-size 2`` every rank runs its own grammask processor; their masks
must agree or the ranks' tokens diverge. The first-mask outcome of a slow grammar is timing
dependent, so it goes through grammask's agreement (an all-gather over the ranks).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from grammask.decode import step_apply as digests
from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json, check_regex
from tests.e2e.server import MODEL_NAME, ROOT, Server, xargs

MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["n", "ok"], "additionalProperties": False}
SHORT_STRINGS: dict[str, Any] = {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
    "required": ["name"], "additionalProperties": False}
REGEX = r"(ab|cd)[0-9]{1,3}"
LONG = r"[a-z]{300}"


def nested_one_of(depth: int) -> dict[str, Any]:
    """A schema both backends choke on: llguidance refuses it as too large after ~2 s,
    xgrammar compiles it in ~30 s on these cores."""
    schema: dict[str, Any] = {"type": "integer"}
    for i in range(depth):
        schema = {"oneOf": [
            {"type": "object", "properties": {f"a{i}": schema}, "required": [f"a{i}"]},
            {"type": "object", "properties": {f"b{i}": schema}, "required": [f"b{i}"]}]}
    return schema


DIGESTS = Path(tempfile.mkdtemp(prefix="grammask-digests-"))
#: ``GRAMMASK_E2E_TP_FAULT=1``: rank 1's masks refuse one token they allow (a demonstration
#: that ``test_ranks_apply_identical_masks`` catches a disagreement; it must then fail)
FAULT = os.environ.get("GRAMMASK_E2E_TP_FAULT", "") not in ("", "0")


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen25_dir: Path) -> Iterator[Server]:
    metrics_dir = tempfile.mkdtemp(prefix="grammask-prom-")
    yield start_server("qwen25-tp2", qwen25_dir,
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                            "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
                            "GRAMMASK_MASK_DIGEST_DIR": str(DIGESTS),
                            **({"GRAMMASK_DEBUG_MASK_FAULT_RANK": "1"} if FAULT else {})},
                       args=["--tensor-parallel-size", "2", "--enable-auto-tool-choice",
                             "--tool-call-parser", "hermes"])


def ask(client: Any, spec: dict[str, Any], seed: int, **flat: Any) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=seed,
        extra_body=xargs(spec, **flat))
    return reply.choices[0].finish_reason, reply.choices[0].message.content or ""


def test_two_ranks_serve_every_backend(client: Any) -> None:
    """Both ranks mask alike: outputs of each backend validate (a disagreement would make the
    ranks sample different tokens)."""
    specs: list[tuple[dict[str, Any], Any]] = [
        ({"json": SCHEMA, "disable_any_whitespace": True}, ("json", SCHEMA)),
        ({"json": SHORT_STRINGS, "disable_any_whitespace": True}, ("json", SHORT_STRINGS)),
        ({"regex": REGEX}, ("regex", REGEX)),
    ]
    jobs = [(spec, check, seed) for spec, check in specs for seed in range(3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda j: ask(client, j[0], j[2]), jobs))
    for (_, (kind, what), _), (finish, text) in zip(jobs, replies, strict=True):
        assert text, (kind, finish)
        if kind == "json":
            check_json(text, finish, what, must_stop=True)
        else:
            check_regex(what, text, finish)


def test_two_ranks_serve_standard_requests(client: Any, server: Server) -> None:
    """The drop-in at TP=2: response_format, the structured_outputs field and a strict tool
    call, standard fields only; grammask's counter shows it served them."""
    from tests.e2e.standard import (
        WEATHER_PARAMS,
        response_format,
        served_by_grammask,
        weather_tool,
    )

    def one(job: tuple[str, int]) -> Any:
        kind, seed = job
        kw: dict[str, Any] = {
            "json": {"response_format": response_format(SCHEMA, strict=False)},
            "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
            "tool": {"tools": [weather_tool(strict=True)], "tool_choice": "required",
                     "parallel_tool_calls": False},
        }[kind]
        return client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=seed,
            **kw).choices[0]

    jobs = [(kind, seed) for kind in ("json", "regex", "tool") for seed in range(3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices, counts = served_by_grammask(server, lambda: list(pool.map(one, jobs)))
    for (kind, _), c in zip(jobs, choices, strict=True):
        if kind == "json":
            check_json(c.message.content or "", c.finish_reason, SCHEMA, must_stop=True)
        elif kind == "regex":
            check_regex(REGEX, c.message.content or "", c.finish_reason)
        else:
            assert c.message.tool_calls and len(c.message.tool_calls) == 1, c
            jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments),
                                WEATHER_PARAMS)
    # each rank's processor counts the request: both ranks served all nine
    assert counts == {"json_schema": 6, "regex": 6, "structural_tag": 6}, counts


def test_ranks_apply_identical_masks(client: Any) -> None:
    """Each rank records a digest of every mask it applies, keyed by the request's spec and
    the tokens it consumed (``mask_digest_dir``). The scheduler keeps rank 0's tokens, so a
    rank that masked differently would leave no trace in the text: the digests must agree
    for every (request, step) both ranks masked."""
    specs = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": REGEX},
             {"json": SHORT_STRINGS, "disable_any_whitespace": True}]
    jobs = [(spec, seed) for spec in specs for seed in (11, 12)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: ask(client, j[0], j[1]), jobs))
    found = digests.compare(DIGESTS)
    assert found.ranks == 2 and found.shared >= len(jobs), found
    assert not found.differing, (f"{len(found.differing)} of {found.shared} (request, step) "
                                 "masks differ between the ranks")
    assert not found.one_sided, f"{found.one_sided} (request, step) keys on one rank only"


def _stream(client: Any, spec: dict[str, Any], seed: int, max_tokens: int = 48
            ) -> dict[str, Any]:
    started = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    finish = None
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0,
        seed=seed, stream=True, extra_body=xargs(spec))
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta and choice.delta.content:
            times.append(time.perf_counter() - started)
            parts.append(choice.delta.content)
        finish = choice.finish_reason or finish
    return {"text": "".join(parts), "times": times, "finish": finish}


def test_a_pathological_schema_fails_alone_beside_normal_streams(client: Any,
                                                                  server: Server) -> None:
    """One request whose grammar no backend compiles within ``wait_s`` streams beside seven
    normal ones: it ends (empty: stop-only mask) and every other output is valid. Reported,
    not asserted: the normal streams' wall time against the same streams alone, and their
    largest gap between streamed chunks against the median (on two cores shared by two
    ranks the API server coalesces chunks, so gaps are coarse)."""
    normal = {"regex": LONG}  # ~100 tokens: still decoding when the bad one arrives
    bad = {"json": nested_one_of(14), "disable_any_whitespace": True}

    def run(with_bad: bool) -> tuple[float, list[dict[str, Any]], dict[str, Any] | None]:
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream, client, normal, seed, 400) for seed in range(7)]
            slow = None
            if with_bad:
                time.sleep(0.2)
                slow = pool.submit(_stream, client, bad, 99)
            results = [f.result() for f in futures]
            wall = time.perf_counter() - started
            return wall, results, slow.result() if slow else None

    _stream(client, normal, 0, 8)  # the regex compiled: both runs start warm
    alone, _, _ = run(False)
    beside, results, pathological = run(True)
    for r in results:
        assert r["finish"] == "stop", r
        check_regex(LONG, r["text"], r["finish"])
    assert pathological is not None
    assert pathological["text"] == "" and pathological["finish"] == "stop", pathological
    assert "not compiled within wait_s" in server.log_text()
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    report: dict[str, Any] = {"normal_streams": len(results),
                              "normal_wall_alone_s": round(alone, 2),
                              "normal_wall_beside_bad_s": round(beside, 2),
                              "ratio": round(beside / alone, 2), "chunk_gaps": len(gaps)}
    if gaps:
        report.update(median_gap_ms=round(statistics.median(gaps) * 1000, 1),
                      max_gap_ms=round(max(gaps) * 1000, 1))
    out = ROOT / "out" / "e2e-isolation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n[e2e] normal streams beside a pathological schema: {report}")


def test_grammask_metrics_on_vllms_metrics_endpoint(client: Any, server: Server) -> None:
    """A real scrape of vLLM's ``/metrics``: grammask's series from the engine-core
    processes, with their labels."""
    ask(client, {"regex": REGEX}, 7)
    base = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("grammask_")]
    assert any(line.startswith("grammask_first_mask_wait_seconds_count{") and
               'outcome="ready"' in line for line in lines), lines[:20]
    assert any(line.startswith("grammask_fill_seconds_count") for line in lines)
    assert any(line.startswith("grammask_row_errors_total{") and 'cause="late"' in line
               for line in lines), lines[:20]
