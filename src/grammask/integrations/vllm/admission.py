"""Request admission in the API server: parse a request's grammask keys and refuse a bad
constraint with an HTTP 400 naming the key, before it reaches vLLM's engine.

``validate_sampling_params`` (the plugin's ``validate_params``) runs ``Compiler.check``: routing
plus the backend's syntax check, never a tokenizer compile. The server's own settings come from
the config vLLM was started with (found in the calling ``InputProcessor``), then the env.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ... import __version__
from ...compile.compiler import Compiler
from ...errors import GrammarError
from ...specs.request import (
    EXTRA_ARGS_KEY,
    FLAT_KEYS,
    ConstraintRequest,
    VllmReasoning,
    parse_extra_args,
)
from ...vocab import Vocabulary
from .compat import admission_config, engine_call, unserved
from .dropin import (
    OPT_OUT_KEY,
    SOURCE_KEY,
    Decision,
    DropIn,
    field_of,
    log_status,
    set_decision,
    status,
    take_over,
)
from .process import use_vllm_logging
from .reasoner import rule_for
from .settings import Settings, describe_settings, load_settings
from .tools import forced_tool_tag

log = logging.getLogger("grammask")

#: Every ``extra_args`` key grammask reads; a request without any of them is not ours.
REQUEST_KEYS = (EXTRA_ARGS_KEY, *FLAT_KEYS)


# ---------------------------------------------------------------------- requests
def _is_request_key(key: object) -> bool:
    """A key grammask reads, or one with its prefix it does not know (to be refused)."""
    return key != OPT_OUT_KEY and (key in REQUEST_KEYS or (
        isinstance(key, str) and key.startswith(EXTRA_ARGS_KEY)))


def _request_key(extra_args: Mapping[str, Any]) -> str | None:
    """A hashable rendering of the grammask keys of ``extra_args`` (None: not ours); keys
    with the ``grammask`` prefix that grammask does not know are kept, to be refused."""
    present = {k: v for k, v in extra_args.items() if _is_request_key(k)}
    if not present:
        return None
    return json.dumps(present, sort_keys=True, default=repr)


@lru_cache(maxsize=1024)
def _parsed(key: str) -> ConstraintRequest | None:
    return parse_extra_args(json.loads(key))


def carries_request(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether ``request_of`` would find a grammask key (and so not answer None), from the
    keys alone: what a model runner's thread asks per new request before the forward."""
    return bool(extra_args) and any(map(_is_request_key, extra_args or ()))


def request_of(extra_args: Mapping[str, Any] | None) -> ConstraintRequest | None:
    """The request's constraint, or None when it carries no grammask key (cheap then).

    Raises ``GrammarError`` for a malformed one. Parses are cached: many requests share one
    schema."""
    if not extra_args:
        return None
    key = _request_key(extra_args)
    return None if key is None else _parsed(key)


@lru_cache(maxsize=8)
def _checker(backend: str, prefer: str) -> Compiler:
    """A compiler over a one-token vocabulary: ``check`` needs routing and syntax only."""
    vocab = Vocabulary([b"\x00"], special_ids=[0], stop_ids=[0], name="validation")
    return Compiler(vocab, backend=backend, prefer=prefer,
                  max_workers=1)


@lru_cache(maxsize=1024)
def _checked(key: str, backend: str, prefer: str) -> None:
    request = _parsed(key)
    if request is not None:
        _checker(backend, prefer).check(request.spec)


def _frontend_settings(config: Any = None) -> Settings:
    """Settings as the API server process sees them.

    vLLM calls ``validate_params`` (a classmethod) without its config; the ``InputProcessor``
    that calls us holds it (``compat.admission_config``). Without it (another host) only
    the environment counts."""
    config = admission_config() if config is None else config
    extra = getattr(config, "additional_config", None) if config is not None else None
    return _settings_of(json.dumps(extra or {}, sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _settings_of(additional_config: str) -> Settings:
    settings = load_settings(json.loads(additional_config))
    use_vllm_logging()
    log.info("grammask %s: validating requests in the API server; %s", __version__,
             describe_settings(settings))
    return settings


def dropin_for(config: Any, settings: Settings) -> DropIn:
    """The drop-in decision for this server (once per config; logged when first made)."""
    key = (id(config), settings)
    with _DROPIN_LOCK:
        found = _DROPIN.get(key)
        if found is None or found[0] is not config:
            found = (config, status(config, settings))
            _DROPIN[key] = found
            log_status(found[1], "API server")
    return found[1]


def _opt_out(sampling_params: Any, so: Any) -> None:
    """``vllm_xargs: {"grammask_structured_outputs": "vllm"}``: this request's structured
    outputs go to vLLM's engine (A/B comparisons on one server). The key stays (a params
    object vLLM reuses for several prompts keeps opting out); the engine side ignores it."""
    from vllm.exceptions import VLLMValidationError

    extra = dict(sampling_params.extra_args)
    value = extra.pop(OPT_OUT_KEY)
    if value != "vllm":
        raise VLLMValidationError(f"{OPT_OUT_KEY} takes only 'vllm', got {value!r}",
                                  parameter=OPT_OUT_KEY)
    if so is None or _request_key(extra) is not None:
        raise VLLMValidationError(f"{OPT_OUT_KEY} needs vLLM structured outputs and no "
                                  "grammask constraint", parameter=OPT_OUT_KEY)


def _forced_tool_tag(so: Any, drop: DropIn, settings: Settings) -> str | None:
    """A forced tool call's tag with each tool's ``parameters`` (``tools``), or None
    (not a forced call, setting ``tool_arguments=vllm``). A bad schema: a 400 naming the
    tool (``tools[i].function.parameters``)."""
    tag = getattr(so, "structural_tag", None)
    if not drop.tool_parameters or not isinstance(tag, str):
        return None
    from vllm.exceptions import VLLMValidationError

    def check(text: str) -> None:
        obj: dict[str, Any] = {"structural_tag": text}
        if drop.backend is not None:
            obj["backend"] = drop.backend
        _checked(json.dumps({EXTRA_ARGS_KEY: json.dumps(obj, ensure_ascii=False)}),
                 settings.backend, settings.prefer)

    try:
        return forced_tool_tag(tag, check)
    except GrammarError as exc:
        raise VLLMValidationError(f"grammask: {exc.message}",
                                  parameter=exc.where or "tools") from None


_DROPIN: dict[tuple[int, Settings], tuple[Any, DropIn]] = {}
_DROPIN_LOCK = threading.Lock()


def vllm_decision(config: Any, drop: DropIn) -> Decision | str:
    """vLLM's reasoning decision for the request being validated (``Decision``), or why it
    cannot be read or followed (the request then stays with vLLM's engine).

    Read where the request enters vLLM's engine (``compat.engine_call``). vLLM's
    ``reasoning_ended`` True: constrained from the first token; False or None: the engine
    side follows vLLM's rule with the server's parser built with the request's kwargs,
    built here once first so that a parser this server cannot build is refused here."""
    if not drop.thinking:
        return True
    call = engine_call()
    if call is None:
        return ("the request did not come through AsyncLLM.add_request or "
                "LLMEngine.add_request, so vLLM's reasoning decision for it is unknown")
    if call.reasoning_ended is True:
        return True
    try:
        kwargs = json.dumps(call.parser_kwargs or {}, sort_keys=True)
        rule_for(config.model_config, drop.parser, kwargs)
    except Exception as exc:
        return (f"reasoning parser {drop.parser} cannot be built with this request's "
                f"reasoning_parser_kwargs ({type(exc).__name__}: {exc})")
    return VllmReasoning(drop.parser, call.reasoning_ended, kwargs)


def _left_to_vllm(why: str) -> None:
    """Log (once per reason) a request the drop-in leaves to vLLM's engine."""
    if why not in _LEFT:
        _LEFT.add(why)
        log.warning("grammask: a structured-output request stays with vLLM's engine: %s", why)


_LEFT: set[str] = set()


def _redecide(sampling_params: Any, config: Any, settings: Settings) -> None:
    """A params object the drop-in already took over, validated again for another request
    (offline generation reuses one for every prompt): its reasoning keys get this request's
    decision where it can be read (else they keep the first one's)."""
    drop = dropin_for(config, settings)
    if not drop.on or not drop.thinking:
        return
    decision = vllm_decision(config, drop)
    if isinstance(decision, str):
        return
    extra = dict(sampling_params.extra_args)
    set_decision(extra, drop, decision)
    sampling_params.extra_args = extra


def validate_sampling_params(sampling_params: Any) -> None:
    """``validate_params`` of the plugin: takes over vLLM's structured outputs (the drop-in)
    and refuses a bad constraint with a 400 naming the field, before vLLM's engine.

    Cost: nothing for requests without a constraint; else a cached parse and
    ``Compiler.check`` (routing plus the backend's own syntax check, no tokenizer compile)."""
    so = getattr(sampling_params, "structured_outputs", None)
    extra = getattr(sampling_params, "extra_args", None)
    if extra and OPT_OUT_KEY in extra:
        _opt_out(sampling_params, so)
        return
    key = _request_key(extra) if extra else None
    if so is None and key is None:
        return
    from vllm.exceptions import VLLMValidationError

    config = admission_config()
    settings = _frontend_settings(config)
    if so is not None:
        if key is not None:
            raise VLLMValidationError(
                "a request carries either vLLM structured_outputs or a grammask constraint, "
                "not both", parameter=EXTRA_ARGS_KEY)
        drop = dropin_for(config, settings)
        if not drop.on:
            return  # vLLM's engine serves it; the start-up log said why
        decision = vllm_decision(config, drop)
        if isinstance(decision, str):
            _left_to_vllm(decision)
            return
        tag = _forced_tool_tag(so, drop, settings)
        kind = "structured_outputs"
        try:
            kind = field_of(take_over(sampling_params, drop, tag, decision))
            _checked(_request_key(sampling_params.extra_args) or "", settings.backend,
                     settings.prefer)
        except GrammarError as exc:
            raise VLLMValidationError(f"grammask: {kind}: {exc}", parameter=kind) from None
        return
    assert key is not None
    aside = unserved(config)
    if aside:
        raise VLLMValidationError(f"grammask stands aside on this server: {aside}",
                                  parameter=EXTRA_ARGS_KEY)
    if not settings.enabled:
        raise VLLMValidationError(
            "grammask is disabled on this server (setting enabled=false: GRAMMASK_ENABLED=0 "
            "or --additional-config)", parameter=EXTRA_ARGS_KEY)
    try:
        _checked(key, settings.backend, settings.prefer)
    except GrammarError as exc:
        parameter = (exc.where if exc.where and exc.where.startswith(EXTRA_ARGS_KEY + "_")
                     else EXTRA_ARGS_KEY)
        raise VLLMValidationError(f"grammask: {exc}", parameter=parameter) from None
    if extra and extra.get(SOURCE_KEY) == "structured_outputs":
        _redecide(sampling_params, config, settings)
