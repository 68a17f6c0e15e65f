"""The drop-in under vLLM's other request features: ``n`` choices, logprobs, stop strings,
greedy decoding, client aborts, preemption and many new schemas at once. Standard fields only
(``response_format``, the ``structured_outputs`` body field, ``n``, ``logprobs``, ``stop``,
``temperature``, ``stream``), no grammask key. Every output is checked by an independent
validator (jsonschema, ``regex``); grammask's own counter on ``/metrics`` shows who served.

The server runs with a small KV pool (48 blocks of 32 tokens: 1,536 tokens) so that a few
long requests together make vLLM preempt (``vllm:num_preemptions_total``); the other tests
here use short requests that never need more than a few blocks each."""

from __future__ import annotations

import math
import re
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import regex

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json, check_regex
from tests.e2e.server import MODEL_NAME, Server
from tests.e2e.standard import PERSON, response_format, served_by_grammask

MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]
ABC = "[a-c]{6}"
#: one letter a token at most (" x" pairs): a random model needs ~300 tokens for it
LONG = "[a-z]( [a-z]){299}"
LONG_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen25_dir: Path) -> Iterator[Server]:
    yield start_server("qwen25-features", qwen25_dir,
                       env={"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="gm-prom-")},
                       args=["--num-gpu-blocks-override", "48", "--block-size", "32"])


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return server.client().with_options(timeout=LONG_TIMEOUT_S)


# ----------------------------------------------------------------------------- helpers
def metric(server: Server, name: str) -> float:
    """The sum of every series of ``name`` on vLLM's ``/metrics`` (0 when absent)."""
    base = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{", 1)[0] == name:
            total += float(value)
    return total


def row_errors(server: Server) -> float:
    return metric(server, "grammask_row_errors_total")


def wait_idle(server: Server, deadline_s: float = 600) -> None:
    """Until vLLM runs and queues nothing (aborted requests leave the engine)."""
    end = time.monotonic() + deadline_s
    while (metric(server, "vllm:num_requests_running")
           or metric(server, "vllm:num_requests_waiting")):
        assert time.monotonic() < end, "requests still in the engine"
        time.sleep(0.5)


def together(fn: Callable[[int], Any], seeds: range) -> list[Any]:
    """``fn(seed)`` for every seed at once (the server batches them)."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(fn, seeds))


def chat(client: Any, seed: int, *, max_tokens: int = 64, **kw: Any) -> Any:
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_tokens=max_tokens, seed=seed,
                                          **kw).choices[0]


def so(field: dict[str, Any]) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": field}}


# --------------------------------------------------------------------------- n choices
def test_n_choices_each_follow_the_schema(server: Server, client: Any) -> None:
    """``n=3``: vLLM fans one request out into 3 engine requests, each with its own grammar
    state (grammask counts 3): every choice is valid and finished."""
    reply, counts = served_by_grammask(server, lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=7, n=3,
        response_format=response_format(PERSON, strict=True)))
    assert sorted(c.index for c in reply.choices) == [0, 1, 2], reply.choices
    for c in reply.choices:
        check_json(c.message.content or "", c.finish_reason, PERSON, must_stop=True)
    assert counts == {"json_schema": 3}, counts


# ---------------------------------------------------------------------------- logprobs
CHOICES = ["alpha", "beta", "gamma delta"]
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def _positions(endpoint: str, client: Any) -> tuple[str, str, str, list[Any]]:
    """(pattern, text, finish, [(token, logprob, [(top token, logprob), ...]), ...])."""
    if endpoint == "chat":
        c = chat(client, 1, max_tokens=16, logprobs=True, top_logprobs=5, **so({"regex": ABC}))
        rows = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                for t in c.logprobs.content]
        return ABC, c.message.content or "", c.finish_reason, rows
    c = client.completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=16,
                                  temperature=1.0, seed=2, logprobs=5,
                                  **so({"choice": CHOICES})).choices[0]
    lp = c.logprobs
    rows = [(tok, val, list(top.items()))
            for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                     strict=True)]
    return "|".join(map(re.escape, CHOICES)), c.text, c.finish_reason, rows


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_logprobs_are_the_raw_model_distribution(server: Server, client: Any,
                                                 endpoint: str) -> None:
    """vLLM (0.32, default ``--logprobs-mode raw_logprobs``) computes logprobs from the
    model's logits *before* any logits processor (``Sampler.forward``: ``compute_logprobs``
    runs before ``apply_logits_processors``), and grammask's mask is a logits processor. So:
    the output obeys the constraint and every sampled token's logprob is finite (its raw
    value), but ``top_logprobs`` are the unmasked distribution and list, with finite
    logprobs, tokens the constraint forbids at that position (with processed logprobs they
    would be absent or -inf). The tokens' text is the output's text."""
    (pattern, text, finish, rows), counts = served_by_grammask(
        server, lambda: _positions(endpoint, client))
    check_regex(pattern, text, finish)
    assert rows, "no logprobs"
    assert "".join(tok for tok, _, _ in rows if not _SPECIAL.fullmatch(tok)) == text, rows
    prefix = ""
    forbidden: list[tuple[int, str, float]] = []
    for i, (tok, logprob, top) in enumerate(rows):
        assert logprob is not None and math.isfinite(logprob) and logprob <= 0, (i, tok, logprob)
        assert len(top) >= 5, (i, top)
        assert dict(top).get(tok, logprob) == pytest.approx(logprob), (i, tok, top)
        for alt, alt_lp in top:
            if (not _SPECIAL.fullmatch(alt) and alt_lp > -1000  # vLLM writes -inf as -9999
                    and not regex.fullmatch(pattern, prefix + alt, partial=True)):
                forbidden.append((i, alt, alt_lp))
        if not _SPECIAL.fullmatch(tok):
            prefix += tok
    assert forbidden, f"every top_logprobs token was allowed: {rows}"
    assert sum(counts.values()) == 1, counts


# ---------------------------------------------------------------------- stop strings
def test_completions_stop_string_inside_the_language(server: Server, client: Any) -> None:
    """``/v1/completions`` with a regex and ``stop=["b"]``, a letter of the language: the
    text ends before the first "b" (vLLM's stop check cuts it), is a prefix of the language,
    and finishes with "stop" (``stop_reason`` "b" when cut, the EOS when it completed)."""
    def one(seed: int) -> Any:
        return client.completions.create(model=MODEL_NAME, prompt="Letters:", max_tokens=16,
                                         temperature=1.0, seed=seed, stop=["b"],
                                         **so({"regex": ABC})).choices[0]
    choices, counts = served_by_grammask(server, lambda: together(one, range(1, 7)))
    cut = 0
    for c in choices:
        assert c.finish_reason == "stop", c
        assert "b" not in c.text, c
        assert regex.fullmatch(ABC, c.text, partial=True), c
        stop_reason = (c.model_extra or {}).get("stop_reason")
        if regex.fullmatch(ABC, c.text):
            assert stop_reason in (None, "b"), c  # the EOS after six letters (or a "b" cut)
        else:
            assert stop_reason == "b", c
            cut += 1
    assert cut, f"no output was cut by the stop string: {[c.text for c in choices]}"
    assert counts == {"regex": 6}, counts


# ---------------------------------------------------------------------------- greedy
GREEDY_OTHER = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                 "n": {"type": "integer", "minimum": -5,
                                                       "maximum": 5}},
                "required": ["ok", "n"], "additionalProperties": False}


def test_greedy_is_valid_and_repeatable(server: Server, client: Any) -> None:
    """``temperature=0``: the masked argmax (grammask says it is not argmax-invariant, so
    vLLM applies it on greedy batches too). Valid and finished; the same request again,
    this time batched with sampled requests of other constraints, gives the same text."""
    def greedy() -> Any:
        return chat(client, 0, temperature=0, response_format=response_format(PERSON,
                                                                              strict=True))

    first, counts = served_by_grammask(server, greedy)
    check_json(first.message.content or "", first.finish_reason, PERSON, must_stop=True)
    assert counts == {"json_schema": 1}, counts

    def mixed(seed: int) -> Any:
        if seed == 0:
            return greedy()
        if seed % 2:
            return chat(client, seed, **so({"regex": ABC}))
        return chat(client, seed, response_format=response_format(GREEDY_OTHER, strict=True))
    again, *others = together(mixed, range(5))
    assert (again.message.content, again.finish_reason) == (
        first.message.content, first.finish_reason)
    for seed, c in enumerate(others, start=1):
        if seed % 2:
            check_regex(ABC, c.message.content or "", c.finish_reason)
        else:
            check_json(c.message.content or "", c.finish_reason, GREEDY_OTHER, must_stop=True)


# ---------------------------------------------------------------------- client aborts
def test_client_aborts_mid_stream_leave_the_rows_clean(server: Server, client: Any) -> None:
    """6 constrained streams (~300 tokens each) closed by the client after a few chunks:
    vLLM aborts them (they never finish: ``vllm:request_success_total`` does not count
    them all) and grammask drops their rows. A following batch of 6 constrained requests is
    all valid, and no row went into grammask's error state (``grammask_row_errors_total``)."""
    errors_before = row_errors(server)
    success_before = metric(server, "vllm:request_success_total")

    def abandon(seed: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=seed,
            stream=True, **so({"regex": LONG}))
        parts: list[str] = []
        try:
            for i, chunk in enumerate(stream):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                if i >= 4:
                    break
        finally:
            stream.close()
        return "".join(parts)

    # on a loaded 2-core machine the API server at times delivers a whole stream in one
    # burst at its end, so the client's close comes after the engine finished: such a batch
    # aborted nothing and is sent again (other seeds), at most 3 times in all
    for attempt in range(3):
        seeds = range(1 + 10 * attempt, 7 + 10 * attempt)
        for text in together(abandon, seeds):
            assert regex.fullmatch(LONG, text, partial=True), text
        wait_idle(server)
        finished = metric(server, "vllm:request_success_total") - success_before
        success_before += finished
        print(f"\n[e2e] of 6 closed streams {finished:.0f} finished anyway, the rest aborted")
        if finished < 6:
            break
    assert finished < 6, "no stream was aborted in 3 batches: the engine finished them all"

    def clean(seed: int) -> Any:
        if seed % 2:
            return chat(client, seed, **so({"regex": ABC}))
        return chat(client, seed, response_format=response_format(PERSON, strict=True))
    choices, counts = served_by_grammask(server, lambda: together(clean, range(1, 7)))
    for seed, c in enumerate(choices, start=1):
        if seed % 2:
            check_regex(ABC, c.message.content or "", c.finish_reason)
        else:
            check_json(c.message.content or "", c.finish_reason, PERSON, must_stop=True)
    assert counts == {"regex": 3, "json_schema": 3}, counts
    assert row_errors(server) == errors_before, server.log_tail()


# ------------------------------------------------------------------------- preemption
def _long_batch(server: Server, client: Any, attempts: int = 3
                ) -> tuple[list[Any], dict[str, float], float]:
    """16 long constrained requests at once on the small KV pool: (choices, grammask's
    counts, preemptions meanwhile). vLLM preempts only when enough of them run at once; on
    two loaded cores the API server at times hands a batch to the engine one by one, and
    then none is preempted: the batch is sent again (at most ``attempts`` times in all), so
    a test fails for "no preemption" only when it never happens."""
    for _ in range(attempts):
        before = metric(server, "vllm:num_preemptions_total")
        choices, counts = served_by_grammask(server, lambda: together(
            lambda s: chat(client, s, max_tokens=320, **so({"regex": LONG})), range(1, 17)))
        preemptions = metric(server, "vllm:num_preemptions_total") - before
        if preemptions:
            break
    return choices, counts, preemptions


def test_preempted_requests_stay_valid(server: Server, client: Any) -> None:
    """16 requests of ~300 tokens need ~5,000 KV tokens; the pool has 1,536: vLLM preempts
    (frees a request's blocks and recomputes it later). A resumed request comes back to
    grammask with its earlier output, which it replays: every output still matches the
    regex (a prefix of it if cut at max_tokens)."""
    errors_before = row_errors(server)
    choices, _, preemptions = _long_batch(server, client)
    print(f"\n[e2e] {preemptions:.0f} preemptions")
    assert preemptions > 0, "no preemption: the test did not test it"
    for c in choices:
        check_regex(LONG, c.message.content or "", c.finish_reason)
    assert row_errors(server) == errors_before, server.log_tail()


def test_a_preempted_request_is_counted_once(server: Server, client: Any) -> None:
    """grammask's counter counts requests served, so preemption must not change it."""
    choices, counts, preemptions = _long_batch(server, client)
    if not preemptions:
        pytest.fail("no preemption happened: the test did not test it")
    for c in choices:
        check_regex(LONG, c.message.content or "", c.finish_reason)
    assert counts == {"regex": 16}, f"{counts} with {preemptions:.0f} preemptions"


# -------------------------------------------------------------- many new schemas at once
def _schema(i: int, nonce: str) -> dict[str, Any]:
    """Schema ``i`` of a run: its own property names and bounds, and the run's ``nonce`` as
    its title (a new schema text: no memory or disk cache of an earlier run has it)."""
    return {"title": nonce, "type": "object",
            "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": i + 9},
                           f"q{i}": {"enum": ["x", "y", i]}},
            "required": [f"p{i}", f"q{i}"], "additionalProperties": False}


def test_many_new_schemas_at_once(server: Server, client: Any) -> None:
    """24 schemas never seen before sent together: 24 compiles at once (grammask's compile
    counter grows by at least 24; a hedge may add the other backend's), and each output
    follows its own schema (the property names differ, so a row masked by another row's
    grammar fails). Short replies (one KV block each, 24 of the 48), so no preemption."""
    nonce = f"run-{uuid.uuid4().hex}"
    schemas = [_schema(i, nonce) for i in range(24)]
    compiles = metric(server, "grammask_compile_seconds_count")
    preemptions = metric(server, "vllm:num_preemptions_total")
    choices, counts = served_by_grammask(server, lambda: together(
        lambda i: client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "JSON."}], max_tokens=32,
            temperature=1.0, seed=i,
            response_format=response_format(schemas[i], strict=True)).choices[0],
        range(24)))
    for schema, c in zip(schemas, choices, strict=True):
        check_json(c.message.content or "", c.finish_reason, schema, must_stop=True)
    preemptions = metric(server, "vllm:num_preemptions_total") - preemptions
    assert counts == {"json_schema": 24}, (
        f"{counts} with {preemptions:.0f} preemptions (see "
        "test_a_preempted_request_is_counted_once)")
    assert metric(server, "grammask_compile_seconds_count") - compiles >= 24
