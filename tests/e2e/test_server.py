"""A real vLLM server (CPU, tiny random Qwen2.5-layout model) with grammask as its plugin,
driven with the openai client exactly as the README shows. Every output is checked by an
independent oracle; with random weights every valid output is the mask's doing."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import StartServer
from tests.e2e.oracles import check_json, check_lark, check_regex, json_prefix_ok
from tests.e2e.server import MODEL_NAME, Server, xargs
from tests.e2e.specs import LLG_SCHEMA, REGEX, XG_SCHEMA

REPS = 5
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]

CHOICES = ["alpha", "beta", "gamma delta", "€uro"]
GBNF = 'root ::= "x" [0-9] [0-9]? ("+" [0-9])*'
GBNF_REGEX = r"x[0-9][0-9]?(\+[0-9])*"
LARK = 'start: "v" DIGIT+ ("," WORD)?\nWORD: /[a-z]{1,4}/\n%import common.DIGIT'
LARK_REGEX = r"v[0-9]+(,[a-z]{1,4})?"
ST_SCHEMA: dict[str, Any] = {"enum": [1, 2, 3]}
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<answer>", "end": "</answer>",
    "content": {"type": "json_schema", "json_schema": ST_SCHEMA}}}


@pytest.fixture(scope="module")
def server(start_server: StartServer, qwen25_dir: Path) -> Iterator[Server]:
    yield start_server("qwen25", qwen25_dir)


def ask(client: Any, spec: dict[str, Any] | str | None, *, seed: int = 0,
        max_tokens: int = 96, **flat: Any) -> tuple[str, str]:
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0,
        seed=seed, extra_body=xargs(spec, **flat) if spec is not None or flat else None)
    choice = reply.choices[0]
    return choice.finish_reason, choice.message.content or ""


def ask_reps(client: Any, spec: dict[str, Any] | str, *, max_tokens: int = 96,
             **flat: Any) -> list[tuple[str, str]]:
    """``REPS`` requests (seeds 1..REPS) sent together, so the server batches them."""
    with ThreadPoolExecutor(REPS) as pool:
        return list(pool.map(lambda s: ask(client, spec, seed=s, max_tokens=max_tokens,
                                           **flat), range(1, REPS + 1)))


def routing(server: Server, marker: str) -> list[str]:
    """Backends grammask's auto-routing lines name for specs containing ``marker`` (INFO
    level: absent when the server's logging does not show grammask's INFO records)."""
    found = []
    for line in server.log_text().splitlines():
        m = re.search(r"grammask: (.*) -> (xgrammar|guidance|llguidance) ", line)
        if m and marker in m.group(1) and "forced" not in line:
            found.append(m.group(2))
    return found


# --------------------------------------------------------------------------- start-up
def test_startup_log_names_grammask_and_version(server: Server) -> None:
    wanted = version("grammask")
    lines = [line for line in server.log_text().splitlines()
             if "grammask" in line and wanted in line and "e2e-" not in line]
    assert lines, (f"no start-up line naming grammask {wanted} in {server.log_path}:\n"
                   f"{server.log_tail(30)}")


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process ended
        return []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # the thread ended between the listing and the read
        return ""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in _tasks(todo.pop()):
            kids = [int(k) for k in _read(task / "children").split()]
            found += kids
            todo += kids
    return found


def _thread_cpus(pid: int) -> dict[str, set[int]]:
    """Thread name -> the CPUs its threads may run on (``/proc``, the kernel's view)."""
    from grammask.decode.fill import parse_cpus

    out: dict[str, set[int]] = {}
    for task in _tasks(pid):
        status = dict(line.split(":", 1) for line in _read(task / "status").splitlines()
                      if ":" in line)
        if "Name" not in status:
            continue
        cpus = parse_cpus(status["Cpus_allowed_list"].strip()) or frozenset()
        out.setdefault(status["Name"].strip(), set()).update(cpus)
    return out


def test_the_fill_thread_does_not_take_turns_with_the_forward(client: Any,
                                                              server: Server) -> None:
    """vLLM's CPU worker pins itself and every thread it starts to its OpenMP core; with the
    default ``fill_cpus=auto`` grammask's fill thread runs on another CPU (the one vLLM
    reserved), so it overlaps the forward instead of time-slicing with it."""
    import os

    if len(os.sched_getaffinity(server.proc.pid)) < 2:
        pytest.skip("one CPU: there is no other CPU to move to")
    finish, text = ask(client, {"regex": REGEX}, seed=3)  # makes the fill thread
    check_regex(REGEX, text, finish)
    workers = [p for p in _descendants(server.proc.pid)
               if "grammask-fill" in _thread_cpus(p)]
    assert len(workers) == 1, f"no single worker with a fill thread: {workers}"
    threads = _thread_cpus(workers[0])
    fill = threads.pop("grammask-fill")
    others = set().union(*threads.values())
    assert fill and fill.isdisjoint(others), (fill, threads)


# ---------------------------------------------------------------------- JSON schemas
@pytest.mark.parametrize(("schema", "routed"), [(XG_SCHEMA, "xgrammar"),
                                                (LLG_SCHEMA, "guidance")],
                         ids=["auto-xgrammar", "auto-llguidance"])
def test_json_schema_auto(client: Any, server: Server, schema: dict[str, Any],
                          routed: str) -> None:
    spec = {"json": schema, "disable_any_whitespace": True}
    for finish, text in ask_reps(client, spec):
        check_json(text, finish, schema, must_stop=True)
    backends = routing(server, '"required":["n","ok","color"]' if schema is XG_SCHEMA
                       else '"name"')
    if backends:  # only when grammask's INFO lines reach the log
        assert {b.replace("llguidance", "guidance") for b in backends} == {routed}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("schema", [XG_SCHEMA, LLG_SCHEMA], ids=["xg-schema", "llg-schema"])
def test_json_schema_forced_backend(client: Any, schema: dict[str, Any],
                                    backend: str) -> None:
    spec = {"json": schema, "disable_any_whitespace": True}
    for finish, text in ask_reps(client, spec, grammask_backend=backend):
        if backend == "xgrammar" and schema is LLG_SCHEMA:
            # xgrammar's length-bounded strings may admit raw control characters (README)
            assert finish in ("stop", "length") and text, text
            continue
        check_json(text, finish, schema, must_stop=True)


def test_json_schema_backend_in_spec(client: Any) -> None:
    """The ``backend`` option inside the ``grammask`` object, as docs/vllm.md lists it."""
    spec = {"json": XG_SCHEMA, "disable_any_whitespace": True, "backend": "guidance"}
    for finish, text in ask_reps(client, spec):
        check_json(text, finish, XG_SCHEMA, must_stop=True)


LENIENT: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("uniqueItems", {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3,
                     "uniqueItems": True},
     {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}),
    ("not", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["a"], "additionalProperties": False, "not": {"required": ["b"]}},
     {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
      "required": ["a"], "additionalProperties": False}),
    ("idn-email", {"type": "string", "format": "idn-email", "maxLength": 12},
     {"type": "string", "maxLength": 12}),
]


@pytest.mark.parametrize(("keyword", "schema", "enforced"), LENIENT,
                         ids=[k for k, _, _ in LENIENT])
def test_lenient_schema_served_and_gap_logged(client: Any, server: Server, keyword: str,
                                              schema: dict[str, Any],
                                              enforced: dict[str, Any]) -> None:
    spec = {"json": schema, "disable_any_whitespace": True}
    try:
        results = ask_reps(client, spec)
    except openai.BadRequestError as exc:
        pytest.fail(f"a schema using {keyword} (no backend enforces it) got 400, not 200: {exc}")
    for finish, text in results:
        check_json(text, finish, enforced, must_stop=True)
    gaps = [line for line in server.log_text().splitlines()
            if "without enforcing" in line and keyword in line]
    assert gaps, f"no 'served by ... without enforcing {keyword}' line in {server.log_path}"


# ------------------------------------------------------------------ other constraints
def test_regex(client: Any) -> None:
    for finish, text in ask_reps(client, {"regex": REGEX}):
        check_regex(REGEX, text, finish)


def test_choice(client: Any) -> None:
    for finish, text in ask_reps(client, {"choice": CHOICES}):
        assert finish == "stop" and text in CHOICES, (finish, text)


def test_gbnf_grammar(client: Any) -> None:
    for finish, text in ask_reps(client, {"grammar": GBNF}, max_tokens=64):
        check_regex(GBNF_REGEX, text, finish)


def test_lark_grammar(client: Any) -> None:
    for finish, text in ask_reps(client, {"grammar": LARK}, max_tokens=64):
        check_lark(LARK, text, finish, LARK_REGEX)


def test_json_object(client: Any) -> None:
    for finish, text in ask_reps(client, {"json_object": True,
                                          "disable_any_whitespace": True}, max_tokens=64):
        if finish == "length":
            assert json_prefix_ok(text), text
        else:
            assert finish == "stop" and isinstance(json.loads(text), dict), (finish, text)


def test_structural_tag(client: Any) -> None:
    import jsonschema

    for finish, text in ask_reps(client, {"structural_tag": json.dumps(STRUCTURAL_TAG)}):
        assert finish == "stop", (finish, text)
        assert text.startswith("<answer>") and text.endswith("</answer>"), text
        jsonschema.validate(json.loads(text[len("<answer>"):-len("</answer>")]), ST_SCHEMA)


# ----------------------------------------------------------------------- concurrency
def test_concurrent_mixed_batch(server: Server, client: Any) -> None:
    """32 requests at once, some unconstrained; a seeded unconstrained request gives the
    same text alone and inside the constrained batch."""
    seeded = {"seed": 4242, "max_tokens": 24}
    alone = ask(client, None, **seeded)  # type: ignore[arg-type]
    specs: list[tuple[str, dict[str, Any] | None]] = [
        ("xg", {"json": XG_SCHEMA, "disable_any_whitespace": True}),
        ("llg", {"json": LLG_SCHEMA, "disable_any_whitespace": True}),
        ("regex", {"regex": REGEX}),
        ("choice", {"choice": CHOICES}),
        ("gbnf", {"grammar": GBNF}),
        ("lark", {"grammar": LARK}),
        ("object", {"json_object": True, "disable_any_whitespace": True}),
        ("free", None),
    ]
    jobs = [(specs[i % len(specs)], i) for i in range(31)]
    aclient = server.async_client()

    async def one(spec: dict[str, Any] | None, seed: int,
                  max_tokens: int) -> tuple[str, str]:
        reply = await aclient.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=1.0,
            seed=seed, extra_body=xargs(spec) if spec is not None else None)
        return reply.choices[0].finish_reason, reply.choices[0].message.content or ""

    async def batch() -> list[tuple[str, str]]:
        tasks = [one(spec, 100 + i, 64) for (_, spec), i in jobs]
        tasks.insert(16, one(None, seeded["seed"], seeded["max_tokens"]))
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await aclient.close()

    results = asyncio.run(batch())
    together = results.pop(16)
    failures = []
    for ((name, spec), i), (finish, text) in zip(jobs, results, strict=True):
        try:
            if name in ("xg", "llg"):
                assert spec is not None
                check_json(text, finish, spec["json"], must_stop=True)
            elif name == "regex":
                check_regex(REGEX, text, finish)
            elif name == "choice":
                assert finish == "stop" and text in CHOICES, (finish, text)
            elif name == "gbnf":
                check_regex(GBNF_REGEX, text, finish)
            elif name == "lark":
                check_lark(LARK, text, finish, LARK_REGEX)
            elif name == "object":
                assert json_prefix_ok(text) and (finish == "length" or isinstance(
                    json.loads(text), dict)), (finish, text)
        except Exception as exc:
            failures.append(f"#{i} {name}: {finish} {text!r}: {exc}")
    assert not failures, "\n".join(failures)
    assert together == alone, f"seeded request differs in the batch: {alone} vs {together}"


# ------------------------------------------------------------------------ bad specs
BAD: list[tuple[str, dict[str, Any] | str, dict[str, Any], str]] = [
    ("schema", {"json": {"type": "object", "properties": {"n": {"type": "foo"}}}}, {},
     "foo"),
    ("regex", {"regex": "(ab"}, {}, "regex"),
    ("grammar", {"grammar": "root ::= ("}, {}, "grammar"),
    ("empty-choice", {"choice": []}, {}, "choice"),
    ("backend", {"regex": "a+"}, {"grammask_backend": "nope"}, "backend"),
    ("malformed-json", '{"regex": "a+"', {}, "JSON"),
]


@pytest.mark.parametrize(("spec", "flat", "word"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_spec_is_400_and_server_lives(client: Any, spec: dict[str, Any] | str,
                                          flat: dict[str, Any], word: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
            extra_body={"vllm_xargs": {
                "grammask": spec if isinstance(spec, str) else json.dumps(spec), **flat}})
    message = str(info.value)
    assert "grammask" in message and word.lower() in message.lower(), message
    finish, text = ask(client, {"regex": "[0-9]{3}"}, seed=7)
    check_regex("[0-9]{3}", text, finish)
    assert finish == "stop"
