"""Forced tool calls follow each tool's ``parameters`` (the drop-in's tool policy).

For ``tool_choice`` ``"required"`` or a named function, vLLM (0.32 to 0.34) builds a
structural tag for its tool parser (hermes ``<tool_call>``, qwen3_coder's XML, llama's
JSON, ...) in which a tool's arguments follow its ``parameters`` only when the tool is
``strict: true`` (or the server runs ``--tool-strict-level parameter``); otherwise they are
``json_schema: true`` (any JSON) or free text, and the schemas are not in
``SamplingParams`` at all. ``forced_tool_tag`` puts them back:

- the tools come from the chat or Responses request that built the tag: the nearest caller
  frame whose local ``request`` is a vLLM ``ChatCompletionRequest`` or ``ResponsesRequest``
  holding exactly this tag as its ``structured_outputs`` (vLLM validates params
  synchronously inside the request's own coroutine chain). No such frame, or a call that is
  not forced: vLLM's tag is served unchanged;
- each tool's tag is found by regenerating vLLM's own tags (``tool_tags``): vLLM's tag
  for this request with every tool strict at the parameter level gives each tag's
  arguments, matched to the served tag by ``begin``, exactly; a tool's own tag gives which
  tool a ``begin`` is. A non-strict tool's schema gets JSON-Schema semantics: an object
  that does not declare ``additionalProperties`` gets ``additionalProperties: true``
  (xgrammar reads tag schemas with closed objects). A missing schema is ``{"type":
  "object"}``. A strict tool keeps vLLM's schema;
- the calls and the text around them are bounded (``tool_bounds``: at most
  ``MAX_TOOL_CALLS`` calls, each format's separator kept);
- each tool's schema is checked on its own (JSON Schema's meta-schema at any depth, then
  the backend's syntax check), so an invalid one is a ``GrammarError`` naming the tool.

No fault becomes a 500: an invalid schema is the only error raised (a ``GrammarError``:
vLLM's 400); anything else that goes wrong here is grammask's own fault, logged, and
vLLM's tag is served as vLLM built it. The work runs on a fresh thread, so the depth of the
API server's stack does not count against Python's recursion limit (a schema nested 200
deep is valid, and vLLM serves it).

Why a frame walk (vLLM 0.32 to 0.34 alike): the parameters of a tool without ``strict`` are in
no object ``validate_params`` can reach. ``ChatCompletionRequest.to_sampling_params`` copies
neither ``tools`` nor ``tool_choice`` into ``SamplingParams`` (``extra_args`` is the client's
``vllm_xargs`` only); a logits processor's only admission hook is
``validate_params(sampling_params)``; and vLLM sets no context variable for the request.
The request objects exist only in the serving coroutine (``OpenAIServingChat
.create_chat_completion``, the Responses and Anthropic servers) that awaits the engine's
admission, so they are read off that chain. Without patching vLLM (its
``_apply_structural_tag`` or its serving classes) there is no other route. The walk is
narrowed to vLLM's own request types (any other local named ``request`` is skipped) and to
the request whose ``structured_outputs`` holds this very tag, compared whole, within
``_MAX_DEPTH`` frames.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from ...errors import GrammarError, InvalidSchemaError
from . import tool_tags
from .tool_bounds import MAX_TOOL_CALLS, bound
from .tool_schemas import open_objects, schema_problem
from .tool_tags import Tool

__all__ = ["MAX_TOOL_CALLS", "Tool", "forced_request", "forced_tool_tag", "open_objects"]

log = logging.getLogger("grammask")

#: Caller frames searched for the request (vLLM's own chain is about 10 deep).
_MAX_DEPTH = 64
#: Least seconds between two logged faults (a fault that repeats per request).
_LOG_INTERVAL_S = 30.0
_last_log = [0.0]


@cache
def _request_types() -> tuple[type, ...]:
    """vLLM's chat and Responses request classes (the same modules on 0.32 to 0.34); none
    when this vLLM lacks them (then no request is ever found: vLLM's tag is served)."""
    found: list[type] = []
    with contextlib.suppress(ImportError):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        found.append(ChatCompletionRequest)
    with contextlib.suppress(ImportError):
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        found.append(ResponsesRequest)
    return tuple(found)


def forced_request(tag: str, depth: int = _MAX_DEPTH) -> Any | None:
    """The vLLM request that built ``tag`` for a forced call, found on the caller's stack
    (why: the module's docstring); None when no vLLM request there carries this exact
    tag, or its call is not forced (``tool_choice`` ``"auto"`` keeps vLLM's tag)."""
    kinds = _request_types()
    if not kinds:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        request: Any = frame.f_locals.get("request")
        so = getattr(request, "structured_outputs", None)
        if (isinstance(request, kinds) and getattr(request, "tools", None)
                and getattr(so, "structural_tag", None) == tag):
            return request if _forced(getattr(request, "tool_choice", None)) else None
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def _forced(choice: Any) -> bool:
    return choice == "required" or tool_tags.forced_name(choice) is not None


def forced_tool_tag(tag: str, check: Callable[[str], None] | None = None,
                    depth: int = _MAX_DEPTH) -> str | None:
    """``tag`` as grammask serves it (the module's docstring), or None where vLLM's tag
    is served unchanged (not a forced call, or a fault of grammask's, logged).

    ``check`` is given each rewritten tool's own one-tag structural tag (text). Raises only
    ``GrammarError`` (``where`` = ``tools[i].function.parameters``, the message names the
    tool): for a schema JSON Schema's meta-schema refuses, or ``check`` does."""
    try:
        request = forced_request(tag, depth)
    except Exception as exc:
        _log_fault("finding the request of a forced tool call", exc)
        return None
    if request is None:
        return None
    return _on_fresh_stack(lambda: _served(tag, request, check))


def _on_fresh_stack(work: Callable[[], str | None]) -> str | None:
    """``work()`` on a new thread (a new stack, so the caller's depth does not count
    against the recursion limit). Its ``GrammarError`` is raised here; any other fault is
    logged and answers None."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as exc:  # handed to the caller's thread
            box.append(exc)

    try:
        thread = threading.Thread(target=run, name="grammask-tools", daemon=True)
        thread.start()
        thread.join()
    except Exception as exc:  # no thread could be started
        _log_fault("rewriting a forced tool call's tag", exc)
        return None
    result = box[0] if box else RuntimeError("the rewrite thread ended without a result")
    if isinstance(result, GrammarError):
        raise result
    if isinstance(result, BaseException):
        _log_fault("rewriting a forced tool call's tag", result)
        return None
    return result  # type: ignore[no-any-return]


def _log_fault(what: str, exc: BaseException) -> None:
    """A fault of grammask's: logged with its traceback (at most one per interval)."""
    now = time.monotonic()
    if now - _last_log[0] < _LOG_INTERVAL_S:
        return
    _last_log[0] = now
    log.warning("grammask: %s failed; vLLM's tag is served as vLLM built it", what,
                exc_info=(type(exc), exc, exc.__traceback__))


def _served(tag: str, request: Any, check: Callable[[str], None] | None) -> str | None:
    """The rewrite proper (on the fresh stack): None where vLLM's tag stays."""
    reg = tool_tags.registry()
    if reg is None:
        return None
    called = tool_tags.called_tools(request)
    for tool in called:
        _check_schema(tool)
    found = tool_tags.identify(reg, tag, request)
    if found is None:
        log.debug("grammask: a forced tool call's tag no key of vLLM's registry builds is "
                  "served as it is")
        return None
    model, _ = found
    strict = tool_tags.strict_tag(reg, model, request)
    if strict is None:
        return None
    seen: dict[int, tuple[Tool, dict[str, Any]]] = {}
    rewrite = _Rewrite(tool_tags.contents(strict),
                       tool_tags.owners(reg, model, request, called), seen)
    served = rewrite.node(json.loads(tag))
    for tool, node in seen.values():
        _check_tag(tool, node, check)
    return json.dumps(bound(served, model), ensure_ascii=False)


class _Rewrite:
    """The served tag with each tool's tag's content taken from the strict tag (by exact
    ``begin``), for the tool that ``begin`` belongs to."""

    def __init__(self, strict: dict[str, Any], owners: dict[str, Tool],
                 seen: dict[int, tuple[Tool, dict[str, Any]]]) -> None:
        self.strict, self.owners, self.seen = strict, owners, seen

    def node(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.node(v) for v in node]
        if not isinstance(node, dict):
            return node
        before = len(self.seen)
        out = {k: v if k == "json_schema" else self.node(v) for k, v in node.items()}
        begin = out.get("begin")
        if out.get("type") != "tag" or not isinstance(begin, str) or len(self.seen) > before:
            return out  # a tag of one tool was rewritten inside: this one wraps it
        tool = self.owners.get(begin)
        if tool is None or begin not in self.strict:
            return out
        content = _arguments(self.strict[begin], tool)
        if content != out.get("content"):
            out["content"] = content
            self.seen.setdefault(tool.index, (tool, out))
        return out


def _arguments(content: Any, tool: Tool) -> Any:
    """The strict tag's content for ``tool``: a non-strict tool's schemas opened, a
    missing schema any object."""
    if isinstance(content, list):
        return [_arguments(v, tool) for v in content]
    if not isinstance(content, dict):
        return content
    out = {k: v if k == "json_schema" else _arguments(v, tool) for k, v in content.items()}
    if out.get("type") == "json_schema":
        schema = out.get("json_schema")
        if tool.parameters is None and schema is True:
            out["json_schema"] = open_objects({"type": "object"})
        elif not tool.strict:
            out["json_schema"] = open_objects(schema)
    return out


def _check_schema(tool: Tool) -> None:
    if tool.parameters is None:
        return
    problem = schema_problem(tool.parameters)
    if problem:
        raise InvalidSchemaError(f"tool {tool.name!r}: parameters is not a valid JSON "
                                 f"Schema: {problem}", where=tool.field)


def _check_tag(tool: Tool, node: dict[str, Any], check: Callable[[str], None] | None) -> None:
    if check is None:
        return
    try:
        check(json.dumps({"type": "structural_tag", "format": node}, ensure_ascii=False))
    except GrammarError as exc:
        raise InvalidSchemaError(f"tool {tool.name!r}: parameters: {exc.message}",
                                 where=tool.field) from None
