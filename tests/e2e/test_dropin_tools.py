"""Forced tool calls on a real server: tools declared the way most clients declare them
(no ``strict``), ``tool_choice`` ``"required"`` or naming a function, parallel calls allowed
or not. Every call must name a declared tool (the named one, when named), its arguments
must pass ``jsonschema`` against that tool's ``parameters``, and the reply must end with
``finish_reason == "tool_calls"`` (``"stop"`` for a named function: vLLM answers as OpenAI
does there, whoever masks). The tiny model has random weights: every valid call is the
mask's doing. ``test_vllms_engine_on_the_same_cases`` runs the same cases through vLLM's own
engine (the per-request opt-out) and reports them; it asserts only who served them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.server import MODEL_NAME, Server
from tests.e2e.standard import WEATHER_PARAMS, served, served_by_grammask

#: grammask's bound on calls per forced reply (``vllm_tools.MAX_TOOL_CALLS``; this suite
#: does not import grammask)
MAX_TOOL_CALLS = 16
SEEDS = (1, 2, 3)
MESSAGES = [{"role": "user", "content": "Call the tools."}]
#: closed, as the issue's tools are: an open object is served open (JSON Schema, unit tests),
#: where a random model may write an extra key's free text until max_tokens
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}, "h24": {"type": "boolean"}},
    "required": ["tz"], "additionalProperties": False}
CONVERT_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 999},
                   "to": {"enum": ["EUR", "USD"]}},
    "required": ["amount", "to"], "additionalProperties": False}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS, "convert": CONVERT_PARAMS}


def tool(name: str) -> dict[str, Any]:
    """A function tool without ``strict``."""
    return {"type": "function", "function": {"name": name, "description": f"{name}",
                                             "parameters": PARAMS[name]}}


TOOLS = [tool("get_weather"), tool("get_time"), tool("convert")]
#: id -> (tool_choice, parallel_tool_calls, tools)
CASES: dict[str, tuple[Any, bool, list[dict[str, Any]]]] = {
    "required-single": ("required", False, TOOLS),
    "required-parallel": ("required", True, TOOLS),
    "required-parallel-2": ("required", True, TOOLS[:2]),
    "named-single": ({"type": "function", "function": {"name": "get_time"}}, False, TOOLS),
    "named-parallel": ({"type": "function", "function": {"name": "convert"}}, True, TOOLS),
}


@pytest.fixture(scope="module")
def server(hermes_server: Server) -> Server:
    return hermes_server  # shared with the other drop-in module (conftest)


def ask(client: Any, case: str, seed: int, **extra: Any) -> Any:
    choice, parallel, tools = CASES[case]
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, max_tokens=160 if not parallel else 768,
        temperature=1.0, seed=seed, **extra).choices[0]


def problems(case: str, reply: Any) -> list[str]:
    """What is wrong with one reply for ``case`` (empty: a valid forced tool call)."""
    choice, parallel, tools = CASES[case]
    declared = {t["function"]["name"] for t in tools}
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    calls = reply.message.tool_calls or []
    out = []
    # vLLM follows OpenAI: "tool_calls" for required, "stop" for a named function
    finish = "stop" if named else "tool_calls"
    if reply.finish_reason != finish:
        out.append(f"finish_reason {reply.finish_reason}")
    if not calls:
        out.append(f"no tool call (content {str(reply.message.content)[:80]!r})")
    if calls and (named or not parallel) and len(calls) != 1:
        out.append(f"{len(calls)} calls where one is allowed")
    if len(calls) > MAX_TOOL_CALLS:
        out.append(f"{len(calls)} calls, over the bound {MAX_TOOL_CALLS}")
    for call in calls:
        name = call.function.name
        if name not in declared or (named and name != named):
            out.append(f"call of {name!r}")
            continue
        try:
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, PARAMS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            out.append(f"{name} arguments {call.function.arguments[:60]!r}: "
                       f"{str(exc).splitlines()[0]}")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_forced_calls_follow_each_tools_parameters(server: Server, client: Any,
                                                   case: str) -> None:
    replies, counts = served_by_grammask(server, lambda: [ask(client, case, s)
                                                          for s in SEEDS])
    for seed, reply in zip(SEEDS, replies, strict=True):
        assert not problems(case, reply), (seed, problems(case, reply), reply.message)
    assert counts == {"structural_tag": len(SEEDS)}, counts


def test_a_bad_parameters_schema_is_a_400_naming_the_tool(client: Any) -> None:
    """Refused before the engine, naming the tool; requests before, beside and after it are
    served as usual."""
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}}}}

    def refused() -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=[TOOLS[0], bad],
                tool_choice="required", max_tokens=16)
        return info.value

    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(ask, client, "named-single", s) for s in SEEDS]
        errors = [pool.submit(refused) for _ in range(2)]
        for error in errors:
            exc = error.result()
            assert exc.status_code == 400
            assert "'broken'" in str(exc) and "tools[1].function.parameters" in str(exc), exc
        for reply in good:
            assert not problems("named-single", reply.result())
    assert not problems("named-single", ask(client, "named-single", 4))


def test_vllms_engine_on_the_same_cases(server: Server, client: Any) -> None:
    """The closing note's comparison: each case through vLLM's own engine on this server
    (``grammask_structured_outputs: vllm``) and through grammask, side by side (printed,
    and written to ``out/e2e-logs/tool_calls_vs_vllm.json``: per seed, the problems found
    and the number of calls)."""
    opt_out = {"vllm_xargs": {"grammask_structured_outputs": "vllm"}}
    table: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def row(case: str, **extra: Any) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(len(SEEDS)) as pool:  # the seeds in one batch
            replies = list(pool.map(lambda s: ask(client, case, s, **extra), SEEDS))
        return [{"problems": problems(case, r), "calls": len(r.message.tool_calls or [])}
                for r in replies]

    before = served(server)
    for case in CASES:
        table[case] = {"vllm": row(case, extra_body=opt_out)}
    assert served(server) == before  # vLLM's engine served those
    for case in CASES:
        table[case]["grammask"] = row(case)
    lines = [f"{'case':22} {'grammask (calls)':20} vLLM's engine"]
    for case, by in table.items():
        ok = {who: sum(not r["problems"] for r in by[who]) for who in by}
        calls = ",".join(str(r["calls"]) for r in by["grammask"])
        first = next((r["problems"][0] for r in by["vllm"] if r["problems"]), "")
        lines.append(f"{case:22} {ok['grammask']}/{len(SEEDS)} ({calls}){'':10} "
                     f"{ok['vllm']}/{len(SEEDS)} {first[:80]}")
    print("\n" + "\n".join(lines))
    out = server.log_path.parent / "tool_calls_vs_vllm.json"
    out.write_text(json.dumps(table, indent=1))
    assert all(not r["problems"] for by in table.values() for r in by["grammask"]), table
