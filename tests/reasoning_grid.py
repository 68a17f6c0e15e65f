"""The reasoning grid: where the drop-in starts a taken-over request's grammar, against vLLM's
own code as the oracle, on the installed vLLM's classes.

For each reasoning parser the installed vLLM has (qwen3, deepseek_r1, gemma4, mistral), each
prompt (a reasoning block left open, an empty one closed, none, a raw prompt), each way the
request comes in and each output (reasoning ended explicitly, implicitly, not at all):

- **vLLM**: the decision its front end makes (``ChatCompletionRequest.resolve_reasoning_ended``
  with the chat template kwargs ``build_chat_params`` makes, ``include_reasoning: false``,
  ``reasoning_effort: none``; Responses: None plus kwargs; offline and raw prompts: neither),
  then its engine step by step: ``StructuredOutputManager._get_constraint_bounds`` (masked or
  not), ``_masked_reasoning_ends`` where the line has it, ``accept_tokens`` (the tokens its
  grammar takes). The manager's state is a stand-in; every method that decides is vLLM's.
- **grammask**: the same request through vLLM's real ``AsyncLLM.add_request`` (or
  ``LLMEngine.add_request``; a raw prompt on its thread pool) into the plugin's
  ``validate_params``, then the engine side (``PluginCore._with_rule``, ``RowMaker``) and the
  row's gate, fed the same tokens.

Two grammars: one that cannot start with an implicit end (JSON), one that starts with it (a
forced tool call). Runs without pytest (vLLM 0.32's venv has none)::

    python -m tests.reasoning_grid MODEL_DIR     # JSON: version, cases, mismatches
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

#: parser -> (reasoning opener, end, implicit end or None, turn opener) as token texts
PARSERS: dict[str, tuple[str, str, str | None, str]] = {
    "qwen3": ("<think>", "</think>", "<tool_call>", "<|im_start|>"),
    "deepseek_r1": ("<think>", "</think>", None, "<|im_start|>"),
    "gemma4": ("<|channel>", "<channel|>", "<|tool_call>", "<|turn>"),
    "mistral": ("[THINK]", "[/THINK]", None, "<|im_start|>"),
}
#: tokens the grid model's tokenizer adds to Qwen3's layout (gemma4's and mistral's markers)
ADDED = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|turn>",
         "<|tool_response>", "[THINK]", "[/THINK]", "[TOOL_CALLS]")
_LAYOUT = "grammask-vllm-grid-v1"
SCHEMA = {"type": "object"}


def grid_model_dir(base: Path) -> Path:
    """``base`` (the Qwen3-layout model dir of ``tests/vllm_fixtures.py``) with ``ADDED``
    as special tokens, built once into the temp dir."""
    target = Path(tempfile.gettempdir()) / _LAYOUT
    if (target / "config.json").is_file():
        return target
    work = Path(tempfile.mkdtemp(prefix="grammask-grid-build-"))
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, work / name)
    data = json.loads((base / "tokenizer.json").read_text())
    next_id = max(t["id"] for t in data["added_tokens"]) + 1
    for i, text in enumerate(ADDED):
        data["added_tokens"].append({"id": next_id + i, "content": text, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
    (work / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    try:
        work.rename(target)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return target


@contextmanager
def _triton_stubbed() -> Iterator[None]:
    """As ``tests.vllm_fixtures.triton_check_stubbed`` (0.34 builds no CPU config without)."""
    import vllm

    if not str(vllm.__version__).startswith("0.34."):
        yield
        return
    import vllm.triton_utils as tu

    saved, tu.HAS_TRITON = tu.HAS_TRITON, True
    try:
        yield
    finally:
        tu.HAS_TRITON = saved


class Server:
    """The grid model's config and vLLM's ``InputProcessor`` (built once: its renderer copies
    the tokenizer for a thread pool, seconds)."""

    def __init__(self, path: Path) -> None:
        from vllm.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig, VllmConfig
        from vllm.tokenizers import cached_tokenizer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        mc = ModelConfig(model=str(path), tokenizer=str(path), dtype="float32",
                         max_model_len=256, seed=0, enforce_eager=True)
        sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                             is_encoder_decoder=False)
        with _triton_stubbed():
            self.config = VllmConfig(
                model_config=mc, scheduler_config=sc,
                structured_outputs_config=StructuredOutputsConfig(reasoning_parser="qwen3"),
                additional_config={"grammask": {"disk_cache": "off"}})
        self.processor = InputProcessor(self.config)
        self.tokenizer = cached_tokenizer_from_config(mc)


class Side:
    """One ``--reasoning-parser`` on the grid server: the parser class and its tokens."""

    def __init__(self, server: Server, parser: str) -> None:
        from vllm.reasoning import ReasoningParserManager

        from grammask.integrations.vllm import admission

        self.cls = ReasoningParserManager.get_reasoning_parser(parser)
        server.config.structured_outputs_config.reasoning_parser = parser
        admission._DROPIN.clear()  # the drop-in's decision is cached per config
        self.config, self.processor = server.config, server.processor
        self.tokenizer = server.tokenizer
        self.parser = parser
        self._reasoners: dict[str, Any] = {}
        opener, end, implicit, turn = PARSERS[parser]
        ids = self.tokenizer.convert_tokens_to_ids
        self.open, self.end, self.turn = ids(opener), ids(end), ids(turn)
        self.implicit = None if implicit is None else ids(implicit)

    def reasoner(self, kwargs: dict[str, Any] | None) -> Any:
        """vLLM's parser built as its engine builds it, one per kwargs (its methods that
        decide keep no state)."""
        key = json.dumps(kwargs or {}, sort_keys=True)
        if key not in self._reasoners:
            self._reasoners[key] = self.cls(tokenizer=self.tokenizer, **(kwargs or {}))
        return self._reasoners[key]

    def prompts(self) -> dict[str, list[int]]:
        head = self.tokenizer.encode("user\nhi\n", add_special_tokens=False)
        turn = [self.turn, *head, self.turn,
                *self.tokenizer.encode("assistant\n", add_special_tokens=False)]
        nl = self.tokenizer.encode("\n", add_special_tokens=False)
        return {"open": [*turn, self.open, *nl], "closed": [*turn, self.open, *nl, self.end, *nl],
                "bare": turn, "raw": self.tokenizer.encode("Give me JSON:",
                                                          add_special_tokens=False)}

    def outputs(self) -> dict[str, list[int]]:
        a, b, c = self.tokenizer.encode("ab cd ef", add_special_tokens=False)[:3]
        out = {"explicit": [a, b, self.end, c, a], "end_first": [self.end, c, a],
               "none": [a, b, c, a]}
        if self.implicit is not None:
            out["implicit"] = [a, self.implicit, b, c]
        return out


# ------------------------------------------------------------------------------- vLLM
def entries(side: Side, prompt: list[int]) -> dict[str, tuple[str, bool | None, Any]]:
    """How a request comes in: (entry point, vLLM's reasoning_ended, its parser kwargs),
    each decided by vLLM's own front-end code."""
    out: dict[str, tuple[str, bool | None, Any]] = {}
    chats: dict[str, dict[str, Any]] = {
        "chat": {}, "chat_thinking": {"chat_template_kwargs": {"enable_thinking": True}},
        "chat_no_thinking": {"chat_template_kwargs": {"enable_thinking": False}},
        "chat_no_reasoning_output": {"include_reasoning": False},
        "chat_effort_none": {"reasoning_effort": "none"}}
    for name, body in chats.items():
        decided = _chat_decision(side, prompt, body)
        if decided is not None:
            out[name] = ("add_request", *decided)
    out["responses"] = ("add_request", None, {"chat_template_kwargs": {}})
    out["responses_no_thinking"] = ("add_request", None,
                                    {"chat_template_kwargs": {"enable_thinking": False}})
    out["offline"] = ("llm_engine", None, None)
    out["raw_prompt"] = ("raw", None, None)
    return out


def _chat_decision(side: Side, prompt: list[int], body: dict[str, Any]
                   ) -> tuple[bool | None, Any] | None:
    """``OpenAIServingChat._engine_reasoning_kwargs`` for a chat request with ``body``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                        **body)
    except Exception:  # a field this line does not have (reasoning_effort "none")
        return None
    build = getattr(request, "build_chat_params", None)
    kwargs = dict(request.chat_template_kwargs or {})
    if build is not None:
        kwargs = dict(build(None, "auto").chat_template_kwargs or {})
        kwargs = {k: v for k, v in kwargs.items() if k == "enable_thinking" or k in (
            request.chat_template_kwargs or {})}
    parser_kwargs = {"chat_template_kwargs": kwargs}
    reasoner = side.reasoner(parser_kwargs)
    parser = SimpleNamespace(reasoning_parser=reasoner, is_reasoning_end=reasoner.is_reasoning_end)
    return request.resolve_reasoning_ended(parser, prompt), parser_kwargs


def _grammar(first: set[int]) -> Any:
    """A stand-in for the engine's grammar: it starts with the tokens in ``first`` only and
    records what the engine feeds it."""
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    class Grammar(StructuredOutputGrammar):  # type: ignore[misc]
        def __init__(self) -> None:
            self.fed: list[int] = []

        def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
            self.fed.extend(tokens)
            return True

        def validate_tokens(self, tokens: list[int]) -> list[int]:
            return [t for t in tokens[:1] if t in first]

        def rollback(self, num_tokens: int) -> None:
            del self.fed[len(self.fed) - num_tokens:]

        def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
            pass

        def is_terminated(self) -> bool:
            return False

        def reset(self) -> None:
            self.fed.clear()

    return Grammar()


def vllm_steps(side: Side, ended: bool | None, kwargs: Any, prompt: list[int],
               output: list[int], first: set[int]) -> tuple[list[Any], list[int]]:
    """vLLM's engine on one request: per output token, (masked by the grammar, the implicit
    ends masked while reasoning); and the tokens its grammar took."""
    from vllm.v1.structured_output import StructuredOutputManager

    manager = object.__new__(StructuredOutputManager)
    manager.enable_in_reasoning = False
    manager.reasoner_cls = side.cls
    manager.tokenizer = side.tokenizer
    grammar = _grammar(first)
    structured = SimpleNamespace(reasoning_ended=ended, reasoner=side.reasoner(kwargs),
                                 reasoning_parser_kwargs=kwargs, grammar=grammar,
                                 masked_reasoning_end_ids=None)
    history = _buffer(prompt)
    request = SimpleNamespace(structured_output_request=structured, use_structured_output=True,
                              prompt_token_ids=list(prompt), all_token_ids=history,
                              _all_token_ids=history, request_id="r")
    masks = getattr(manager, "_masked_reasoning_ends", None)
    steps = []
    for tid in output:
        constrained = manager._get_constraint_bounds(request, ()).constraint_start == 0
        masked = () if constrained or masks is None else tuple(masks(request))
        steps.append([constrained, sorted(masked)])
        history.append(tid)
        manager.accept_tokens(request, [tid])
    return steps, grammar.fed


def _buffer(prompt: list[int]) -> Any:
    try:
        from vllm.v1.token_buffer import TokenBuffer
    except ImportError:
        return list(prompt)
    return TokenBuffer(prompt)


# --------------------------------------------------------------------------- grammask
def taken_over(side: Side, entry: str, ended: bool | None, kwargs: Any,
               prompt: list[int]) -> dict[str, Any]:
    """The request's ``extra_args`` after vLLM's own entry point ran the plugin's
    ``validate_params`` on it."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(max_tokens=8,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine_input: Any = {"type": "token", "prompt_token_ids": list(prompt)}
    if entry == "llm_engine":
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = _engine_stand_in(side)
        engine.get_supported_tasks = lambda: ("generate",)
        LLMEngine.add_request(engine, "r", engine_input, params)
    else:
        from vllm.v1.engine.async_llm import AsyncLLM

        if entry == "raw":
            engine_input = side.tokenizer.decode(prompt)
        asyncio.run(AsyncLLM.add_request(_engine_stand_in(side), "r", engine_input, params,
                                         reasoning_ended=ended,
                                         reasoning_parser_kwargs=kwargs))
    assert params.structured_outputs is None, "not taken over"
    return dict(params.extra_args or {})


def _engine_stand_in(side: Side) -> Any:
    """What ``AsyncLLM.add_request`` / ``LLMEngine.add_request`` touch besides their
    ``InputProcessor`` (the real one): nothing is sent to an engine."""
    async def tasks() -> tuple[str, ...]:
        return ("generate",)

    async def add(*args: Any) -> None:
        return None

    config = side.config
    return SimpleNamespace(
        errored=False, observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        vllm_config=config, model_config=config.model_config, input_processor=side.processor,
        get_supported_tasks=tasks, _run_output_handler=lambda: None, _add_request=add,
        output_processor=SimpleNamespace(add_request=lambda *a, **k: None),
        engine_core=SimpleNamespace(add_request=lambda *a, **k: None))


def grammask_steps(side: Side, vocab: Any, extra: dict[str, Any], prompt: list[int],
                   output: list[int], first: set[int]) -> tuple[list[Any], list[int]]:
    """The engine side on the same request: (masked by the grammar, the tokens refused
    while reasoning) per output token, and the tokens its grammar took (the row's backlog:
    its matcher is never attached here)."""
    from concurrent.futures import Future

    from grammask.decode.rows import FROM_VOCAB, PendingGrammar, RowMaker
    from grammask.integrations.vllm.admission import request_of
    from grammask.integrations.vllm.plugin_core import PluginCore

    request = request_of(extra)
    assert request is not None
    request = PluginCore._with_rule(SimpleNamespace(vllm_config=side.config), request, False)
    done: Future[Any] = Future()
    done.set_result(_FirstOnly(first))
    maker = RowMaker(vocab, lambda spec, grammar: PendingGrammar(done, None, hedge_s=0.0),
                     FROM_VOCAB)
    row = maker.make(request, prompt, None, None, False)
    steps = []
    for tid in output:
        gate = row.gate
        thinking = gate is not None and gate.thinking
        refused = sorted(int(t) for t in gate.refused()) if gate is not None and thinking else []
        steps.append([not thinking, refused])
        row.advance([tid])
        if row.error is not None:
            raise AssertionError(row.error)
    return steps, list(row.backlog)


class _FirstOnly:
    """A compiled grammar's stand-in for the gate's first-token question."""

    def __init__(self, first: set[int]) -> None:
        self.first = first

    def matcher(self) -> Any:
        first = self.first

        class M:
            def accept(self, tid: int) -> bool:
                return tid in first

            def rollback(self, n: int) -> None:
                pass

            def release(self) -> None:
                pass

        return M()


def vocab_for(side: Side) -> Any:
    """grammask's vocabulary of the model (its default thinking marker: ``</think>``)."""
    from grammask.integrations.vllm.process import vocabulary_from_vllm

    return vocabulary_from_vllm(side.config.model_config)


# ------------------------------------------------------------------------------ the grid
def run(base: Path, parsers: tuple[str, ...] = tuple(PARSERS)) -> dict[str, Any]:
    """Every case on the installed vLLM; ``mismatches`` lists where grammask differs.

    vLLM's own structured-output check in ``SamplingParams`` is skipped (it imports every
    vLLM backend, and a venv of vLLM without its dependencies lacks ``lmformatenforcer``)."""
    from vllm.sampling_params import SamplingParams

    saved = SamplingParams._validate_structured_outputs
    SamplingParams._validate_structured_outputs = lambda self, *args: None
    try:
        return _run(base, parsers)
    finally:
        SamplingParams._validate_structured_outputs = saved


def _run(base: Path, parsers: tuple[str, ...]) -> dict[str, Any]:
    import vllm

    path = grid_model_dir(base)
    mismatches: list[dict[str, Any]] = []
    cases = 0
    skipped: dict[str, str] = {}
    vocab = None
    server = Server(path)
    for parser in parsers:
        try:
            side = Side(server, parser)
        except Exception as exc:
            skipped[parser] = f"{type(exc).__name__}: {exc}"
            continue
        vocab = vocab or vocab_for(side)
        for pname, prompt in side.prompts().items():
            for entry, (via, ended, kwargs) in entries(side, prompt).items():
                extra = taken_over(side, via, ended, kwargs, prompt)
                for oname, output in side.outputs().items():
                    grammars = [("json", set())]
                    if oname == "implicit":  # the grammar decides only there
                        grammars.append(("tool", {side.implicit}))
                    for gname, first in grammars:
                        cases += 1
                        want = vllm_steps(side, ended, kwargs, prompt, output, first)
                        got = grammask_steps(side, vocab, extra, prompt, output, first)
                        if list(want) != list(got):
                            mismatches.append({
                                "parser": parser, "prompt": pname, "entry": entry,
                                "output": oname, "grammar": gname, "vllm": want,
                                "grammask": got, "extra_args": extra})
    return {"version": vllm.__version__, "cases": cases, "skipped": skipped,
            "mismatches": mismatches}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    result = run(Path(args[0]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
