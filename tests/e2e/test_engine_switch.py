"""The engine switch on a real vLLM 0.32 server: a wave of concurrent first requests of one
free-text JSON schema, sent through the standard ``response_format`` field.

The server forces the fill tuner's verdict (``fill_verdict=rival``, a test setting: which
engine fills cheaper is this machine's measurement, and a test must not hang on it), so
when the rival xgrammar grammar is compiled the rows of the wave that are still running
move to it. Every output must be valid: a stopped one complete and valid against the
schema (jsonschema), one cut at ``max_tokens`` a JSON prefix; the metrics (grammask's own
exporter) show rows switched, and the log has the verdict's line.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json
from tests.e2e.server import MODEL_NAME, Server, free_port
from tests.e2e.test_plugin_settings import scrape, total

SCHEMA: dict[str, Any] = {
    "description": "engine-switch wave", "type": "object",
    "properties": {"name": {"type": "string"}, "note": {"type": "string"},
                   "n": {"type": "integer"}},
    "required": ["name", "note", "n"]}
WAVE = 12


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen25_dir: Path) -> Iterator[tuple[Server, int]]:
    port = free_port()
    yield start_server("engine-switch", qwen25_dir, args=[
        "--additional-config", json.dumps({"grammask": {
            "fill_verdict": "rival", "metrics_port": port}})]), port


def test_a_wave_switches_engines_and_every_output_is_valid(
        server: tuple[Server, int]) -> None:
    srv, port = server
    quote = 1  # '"' in Qwen's vocabulary: biased up so that some strings (and outputs) end

    async def one(client: Any, seed: int) -> tuple[str, str]:
        reply = await client.chat.completions.create(
            model=MODEL_NAME, max_tokens=240, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "A record, please."}],
            logit_bias={str(quote): 6},
            response_format={"type": "json_schema", "json_schema": {
                "name": "record", "schema": SCHEMA}})
        choice = reply.choices[0]
        return choice.message.content or "", choice.finish_reason

    async def wave() -> list[tuple[str, str]]:
        client = srv.async_client()
        return list(await asyncio.gather(*(one(client, seed) for seed in range(WAVE))))

    results = asyncio.run(wave())
    for text, finish in results:
        check_json(text, finish, SCHEMA, must_stop=False)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    switched = total(samples, "grammask_engine_switches_total", outcome="switched")
    log = srv.log_text()
    assert "fills cheaper than guidance" in log, srv.log_tail()
    assert switched > 0, (samples, [f for _, f in results])
    stopped = sum(f == "stop" for _, f in results)
    print(f"\n[e2e] wave of {WAVE}: {stopped} stopped (valid JSON), "
          f"{WAVE - stopped} cut at max_tokens (JSON prefixes); {switched:.0f} rows switched")
