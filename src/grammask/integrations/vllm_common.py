"""What the vLLM V1 and V2 adapters share: settings, the engine, request parsing, validation.

- Settings come from ``--additional-config '{"grammask": {...}}'`` first, then ``GRAMMASK_*``
  environment variables, then defaults (``SETTINGS`` lists them; docs/vllm.md has the table).
- One ``Engine`` per process and tokenizer (``shared_engine``): the vocabulary is built from
  the model's own tokenizer (``cached_tokenizer_from_config``), sized by the model's vocab.
- ``validate_sampling_params`` runs in the API server before a request reaches the engine:
  it parses the request and runs ``Engine.check`` (routing plus the engine's syntax check),
  never a tokenizer compile, and raises ``VLLMValidationError`` (an HTTP 400).
- ``claim`` makes sure only one plugin instance acts per runner: vLLM instantiates a class
  that is both an installed entry point and listed in ``--logits-processors`` twice.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Literal

from .. import __version__, metrics
from ..agreement import Agreement, Solo, tp_group_for_vllm
from ..compiler import Engine, Grammar
from ..errors import GrammarError
from ..masks import Filler
from ..processor import BatchProcessor
from ..request import EXTRA_ARGS_KEY, FLAT_KEYS, ConstraintRequest, parse_extra_args
from ..spec import GrammarSpec, canonical_backend
from ..vocab import Vocabulary

log = logging.getLogger("grammask")

#: The class vLLM loads (entry point and ``--logits-processors``).
FQCN = "grammask.integrations.vllm_v1:GrammaskLogitsProcessor"
#: Every ``extra_args`` key grammask reads; a request without any of them is not ours.
REQUEST_KEYS = (EXTRA_ARGS_KEY, *FLAT_KEYS)
RunnerKind = Literal["v1", "v2"]


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """Plugin settings; each field ``x`` is also env ``GRAMMASK_X`` and
    ``--additional-config '{"grammask": {"x": ...}}'`` (which wins over the env)."""

    enabled: bool = True
    backend: str = "auto"
    prefer: str = "auto"
    cache_mb: int = 512
    compile_threads: int = 4
    compile_timeout_s: float = 10.0
    wait_s: float = 0.5
    hedge_s: float = 0.05
    fill_threads: int | None = None
    parallel_min: int = 16
    on_error: str = "stop"
    think_end: str = "auto"
    metrics_port: int = 0
    warmup_dir: str = ""

    @property
    def think_end_arg(self) -> str | None:
        """The ``BatchProcessor(think_end=...)`` value; "auto" is the processor default."""
        return None if self.think_end == "none" else self.think_end


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _choice(*options: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = str(canonical_backend(str(value).strip().lower()))
        if text not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return text
    return parse


def _positive(kind: type[int] | type[float]) -> Callable[[object], float]:
    def parse(value: object) -> float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        number = kind(value) if isinstance(value, int | float) else kind(str(value))
        if number <= 0:
            raise ValueError(f"expected a positive number, got {value!r}")
        return number
    return parse


def _optional_int(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    return int(_positive(int)(value))


def _port(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a port number, got {value!r}")
    number = int(value) if isinstance(value, int) else int(str(value))
    if not 0 <= number <= 65535:
        raise ValueError(f"expected a port 0..65535, got {value!r}")
    return number


def _think_end(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected 'auto', 'none' or the marker text, got {value!r}")
    return value.strip() if value.strip().lower() not in ("auto", "none") else (
        value.strip().lower())


#: field -> (parser, one-line meaning); the docs table is generated from the same words.
SETTINGS: dict[str, tuple[Callable[[object], Any], str]] = {
    "enabled": (_bool, "0 makes the plugin inert; requests with grammask keys get a 400"),
    "backend": (_choice("auto", "xgrammar", "guidance"),
                "engine for requests that do not name one (auto: per-request routing)"),
    "prefer": (_choice("auto", "xgrammar", "guidance"),
               "tie-break when both engines enforce a schema"),
    "cache_mb": (_positive(int), "compiled-grammar LRU cache size, MiB"),
    "compile_threads": (_positive(int), "concurrent grammar compiles"),
    "compile_timeout_s": (_positive(float), "compile budget per engine (the compile goes on "
                          "failing only its own requests past it)"),
    "wait_s": (_positive(float), "longest the batch waits for a row's grammar at its first "
               "mask; past it that row alone fails (stop-only) and the compile finishes for "
               "the cache"),
    "hedge_s": (_positive(float), "after this, a JSON schema whose routed engine is still "
                "compiling is compiled by the other engine too; the first ready serves"),
    "fill_threads": (_optional_int, "threads of the batch-parallel mask fill (auto)"),
    "parallel_min": (_positive(int), "fewest rows of one engine that use the batch fill"),
    "on_error": (_choice("stop", "free"),
                 "a failed row gets a stop-only mask (stop) or none (free)"),
    "think_end": (_think_end, "thinking end marker: auto (from the tokenizer, e.g. "
                  "</think>), none, or the marker text"),
    "warmup_dir": (lambda v: str(v).strip(), "a directory of specs compiled at start-up, "
                   "before the server reports healthy (grammask.warmup; empty: none)"),
    "metrics_port": (_port, "grammask's own Prometheus exporter in the engine core (0: off; "
                     "or set PROMETHEUS_MULTIPROC_DIR to see them on vLLM's /metrics)"),
}


def load_settings(additional_config: object = None, env: Mapping[str, str] | None = None,
                  *, tensor_parallel_size: int = 1) -> Settings:
    """Settings from ``--additional-config`` (key ``grammask``), then env, then defaults.

    ``tensor_parallel_size`` is accepted for compatibility: ranks now agree on timing outcomes
    (``agreement.py``), so no setting changes with it."""
    env = os.environ if env is None else env
    section: Mapping[str, Any] = {}
    if isinstance(additional_config, Mapping) and additional_config.get("grammask") is not None:
        raw = additional_config["grammask"]
        if not isinstance(raw, Mapping):
            raise ValueError("--additional-config: 'grammask' must be an object")
        unknown = sorted(set(raw) - set(SETTINGS))
        if unknown:
            raise ValueError(f"--additional-config: unknown grammask settings {unknown}; "
                             f"known: {sorted(SETTINGS)}")
        section = raw
    values: dict[str, Any] = {}
    for name, (parse, _) in SETTINGS.items():
        var = f"GRAMMASK_{name.upper()}"
        source, value = ((f"--additional-config grammask.{name}", section[name])
                         if name in section else (var, env.get(var)))
        if value is None:
            continue
        try:
            values[name] = parse(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"grammask setting {source}: {exc}") from None
    return Settings(**values)


def settings_for(vllm_config: Any) -> Settings:
    return load_settings(getattr(vllm_config, "additional_config", None),
                         tensor_parallel_size=_tp_size(vllm_config))


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # not initialised (tests, one process): the only rank
        return 0


def _tp_size(vllm_config: Any) -> int:
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def settings_table() -> str:
    """The markdown table of settings (docs/vllm.md embeds it; a test keeps them equal)."""
    rows = ["| setting | env | default | meaning |", "|---|---|---|---|"]
    defaults = Settings()
    for f in fields(Settings):
        default = getattr(defaults, f.name)
        shown = "auto" if default is None else str(default).lower() if isinstance(
            default, bool) else str(default)
        rows.append(f"| `{f.name}` | `GRAMMASK_{f.name.upper()}` | `{shown}` | "
                    f"{SETTINGS[f.name][1]} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------- requests
def _request_key(extra_args: Mapping[str, Any]) -> str | None:
    """A hashable rendering of the grammask keys of ``extra_args`` (None: not ours); keys
    with the ``grammask`` prefix that grammask does not know are kept, to be refused."""
    present = {k: v for k, v in extra_args.items()
               if k in REQUEST_KEYS or (isinstance(k, str) and k.startswith(EXTRA_ARGS_KEY))}
    if not present:
        return None
    return json.dumps(present, sort_keys=True, default=repr)


@lru_cache(maxsize=1024)
def _parsed(key: str) -> ConstraintRequest | None:
    return parse_extra_args(json.loads(key))


def request_of(extra_args: Mapping[str, Any] | None) -> ConstraintRequest | None:
    """The request's constraint, or None when it carries no grammask key (cheap then).

    Raises ``GrammarError`` for a malformed one. Parses are cached: many requests share one
    schema."""
    if not extra_args:
        return None
    key = _request_key(extra_args)
    return None if key is None else _parsed(key)


@lru_cache(maxsize=8)
def _checker(backend: str, prefer: str) -> Engine:
    """An engine over a one-token vocabulary: ``check`` needs routing and syntax only."""
    vocab = Vocabulary([b"\x00"], special_ids=[0], stop_ids=[0], name="validation")
    return Engine(vocab, backend=backend, prefer=prefer,  # type: ignore[arg-type]
                  max_workers=1)


@lru_cache(maxsize=1024)
def _checked(key: str, backend: str, prefer: str) -> None:
    request = _parsed(key)
    if request is not None:
        _checker(backend, prefer).check(request.spec)


def _frontend_settings(config: Any = None) -> Settings:
    """Settings as the API server process sees them.

    vLLM calls ``validate_params`` (a classmethod) without its config, and the API server
    sets no current config; the ``InputProcessor`` that calls us holds it, so it is looked up
    in the calling frames. Without it (another host) only the environment counts."""
    config = _caller_vllm_config() if config is None else config
    extra = getattr(config, "additional_config", None) if config is not None else None
    return _settings_of(json.dumps(extra or {}, sort_keys=True, default=str),
                        _tp_size(config) if config is not None else 1)


def _speculative_on_v1(config: Any) -> bool:
    """vLLM's V1 runner drops entry-point logits processors when speculative decoding is
    on (without a word), so a grammask request there would be served unconstrained."""
    if config is None or not getattr(config, "speculative_config", None):
        return False
    return not bool(getattr(config, "use_v2_model_runner", False))


@lru_cache(maxsize=8)
def _settings_of(additional_config: str, tensor_parallel_size: int) -> Settings:
    settings = load_settings(json.loads(additional_config),
                             tensor_parallel_size=tensor_parallel_size)
    use_vllm_logging()
    log.info("grammask %s: validating requests in the API server; %s", __version__,
             describe_settings(settings))
    return settings


def _caller_vllm_config(max_depth: int = 12) -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # an older vLLM
        current = None
    else:
        current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "vllm_config", None) if owner is not None else None
        if config is not None and hasattr(config, "additional_config"):
            return config
    return None


def describe_settings(settings: Settings) -> str:
    """One log line: every setting and its value."""
    return "settings: " + ", ".join(f"{f.name}={getattr(settings, f.name)}"
                                    for f in fields(Settings))


def validate_sampling_params(sampling_params: Any) -> None:
    """``validate_params`` of the plugin: a 400 for a bad constraint, before the engine.

    Cost: nothing for requests without grammask keys; else a cached parse and
    ``Engine.check`` (routing plus the engine's own syntax check, no tokenizer compile)."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return
    key = _request_key(extra)
    if key is None:
        return
    from vllm.exceptions import VLLMValidationError

    config = _caller_vllm_config()
    settings = _frontend_settings(config)
    if _speculative_on_v1(config):
        raise VLLMValidationError(
            "grammask cannot mask speculative decoding on vLLM's V1 model runner (vLLM skips "
            "custom logits processors there); run the V2 model runner (the default, or "
            "VLLM_USE_V2_MODEL_RUNNER=1), or start without --speculative-config",
            parameter=EXTRA_ARGS_KEY)
    if not settings.enabled:
        raise VLLMValidationError(
            "grammask is disabled on this server (setting enabled=false: GRAMMASK_ENABLED=0 "
            "or --additional-config)", parameter=EXTRA_ARGS_KEY)
    if getattr(sampling_params, "structured_outputs", None) is not None:
        raise VLLMValidationError(
            "a request carries either vLLM structured_outputs or a grammask constraint, "
            "not both", parameter=EXTRA_ARGS_KEY)
    try:
        _checked(key, settings.backend, settings.prefer)
    except GrammarError as exc:
        parameter = (exc.where if exc.where and exc.where.startswith(EXTRA_ARGS_KEY + "_")
                     else EXTRA_ARGS_KEY)
        raise VLLMValidationError(f"grammask: {exc}", parameter=parameter) from None


def use_vllm_logging() -> None:
    """Send grammask's log records through vLLM's handlers (an operator's one log).

    vLLM configures only its own ``vllm`` logger; without this, grammask's INFO lines (the
    start-up line, routing decisions) would go nowhere in a server."""
    ours = logging.getLogger("grammask")
    if ours.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.getLogger("vllm").getEffectiveLevel())


# ---------------------------------------------------------------------------- engine
def vocabulary_from_vllm(model_config: Any) -> Vocabulary:
    """The model's vocabulary: vLLM's (cached) tokenizer, the model config's vocab size, and
    the stop ids vLLM stops on (tokenizer EOS plus ``generation_config`` EOS ids)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config)
    if tokenizer is None:
        raise RuntimeError("grammask needs the model's tokenizer; --skip-tokenizer-init is set")
    if not hasattr(tokenizer, "get_vocab") or not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise RuntimeError(f"grammask supports Hugging Face tokenizers, got "
                           f"{type(tokenizer).__name__} (tokenizer_mode="
                           f"{getattr(model_config, 'tokenizer_mode', '?')})")
    n_tokens = len(tokenizer.get_vocab())
    stops: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    generation = getattr(model_config, "try_get_generation_config", None)
    if generation is not None:
        candidates.append((generation() or {}).get("eos_token_id"))
    text_config = getattr(model_config, "hf_text_config", None)
    candidates.append(getattr(text_config, "eos_token_id", None))
    for value in candidates:
        for tid in value if isinstance(value, list | tuple) else [value]:
            if isinstance(tid, int) and 0 <= tid < n_tokens and tid not in stops:
                stops.append(tid)
    vocab_size = max(int(model_config.get_vocab_size()), n_tokens)
    return Vocabulary.from_huggingface(tokenizer, vocab_size=vocab_size,
                                       stop_ids=stops or None,
                                       name=str(model_config.tokenizer))


_ENGINES: dict[tuple[Any, ...], Engine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(vllm_config: Any, settings: Settings) -> Engine:
    """The process's engine for this tokenizer and these settings (built once: ~5-10 s)."""
    mc = vllm_config.model_config
    key = (mc.tokenizer, getattr(mc, "tokenizer_revision", None),
           getattr(mc, "tokenizer_mode", None), mc.get_vocab_size(), settings.backend,
           settings.prefer, settings.cache_mb, settings.compile_threads,
           settings.compile_timeout_s)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            vocab = vocabulary_from_vllm(mc)
            engine = Engine(vocab, backend=settings.backend, prefer=settings.prefer,  # type: ignore[arg-type]
                            max_workers=settings.compile_threads,
                            cache_bytes=settings.cache_mb * 1024 * 1024,
                            timeout_s=settings.compile_timeout_s)
            # both engines' tokenizer views (~1 s for Qwen's 152k tokens): built before the
            # server reports healthy, so no first request waits on them past its budget
            _ = vocab.xgrammar_info
            _ = vocab.llguidance_tokenizer
            if settings.warmup_dir:
                _warm_up(engine, settings.warmup_dir)
            _ENGINES[key] = engine
    return engine


def _warm_up(engine: Engine, directory: str) -> None:
    from ..warmup import summary_table, warm

    started = time.perf_counter()
    try:
        results = warm(engine, directory)
    except GrammarError as exc:
        log.error("grammask: warm-up skipped: %s", exc)
        return
    log.info("grammask: warm-up of %s in %.1f s\n%s", directory,
             time.perf_counter() - started, summary_table(results))


# ------------------------------------------------------------------------- the core
_ACTIVE: dict[tuple[int, RunnerKind], weakref.ref[PluginCore]] = {}
_ACTIVE_LOCK = threading.Lock()


class PluginCore:
    """Per-instance state both adapters share: settings, engine, processor, inertness.

    Only the newest instance per (``vllm_config``, runner) is active: vLLM builds a class
    listed both as entry point and in ``--logits-processors`` twice, in one go, and a
    rebuild replaces the old instances. Inert instances return at once from every hook.
    """

    def __init__(self, vllm_config: Any, kind: RunnerKind, max_batch: int) -> None:
        self.vllm_config = vllm_config  # held so id(vllm_config) stays unique while we live
        self.kind: RunnerKind = kind
        self.max_batch = max_batch
        self.settings = settings_for(vllm_config)
        self.active = self.settings.enabled
        self.engine: Engine | None = None
        self.agreement: Agreement = Solo()
        self._proc: BatchProcessor | None = None
        use_vllm_logging()
        log.info("grammask %s loaded on vLLM's %s model runner (%s); %s", __version__,
                 kind.upper(), "active" if self.active else "DISABLED",
                 describe_settings(self.settings))
        if not self.active:
            return
        self.engine = shared_engine(vllm_config, self.settings)
        # a collective: every rank builds its plugin at the same point of start-up
        self.agreement = tp_group_for_vllm() if _tp_size(vllm_config) > 1 else Solo()
        port = self.settings.metrics_port
        if port and _tp_rank() == 0 and metrics.start_exporter(port):
            log.info("grammask: metrics on http://0.0.0.0:%d/metrics", port)
        key = (id(vllm_config), kind)
        with _ACTIVE_LOCK:
            ref = _ACTIVE.get(key)
            previous = ref() if ref is not None else None
            _ACTIVE[key] = weakref.ref(self)
        if previous is not None and previous is not self:
            previous.deactivate()
            log.info("grammask: a second plugin instance for this %s runner (entry point and "
                     "--logits-processors): the newest one acts, the other is inert", kind)

    @property
    def has_rows(self) -> bool:
        return self._proc is not None and bool(self._proc.rows)

    @property
    def proc_or_none(self) -> BatchProcessor | None:
        return self._proc

    def processor(self) -> BatchProcessor:
        """The batch processor (made at the first constrained request: a fill thread)."""
        if self._proc is None:
            assert self.engine is not None
            kwargs: dict[str, Any] = {}
            if self.settings.think_end != "auto":
                kwargs["think_end"] = self.settings.think_end_arg
            self._proc = BatchProcessor(
                self.engine, max_batch=self.max_batch, wait_s=self.settings.wait_s,
                hedge_s=self.settings.hedge_s, agreement=self.agreement,
                on_error=self.settings.on_error,  # type: ignore[arg-type]
                filler=Filler(parallel_min=self.settings.parallel_min,
                              threads=self.settings.fill_threads), **kwargs)
        return self._proc

    @property
    def default_marker(self) -> bool:
        """Whether requests without their own ``grammask_think_end`` get a thinking gate."""
        if self.settings.think_end == "none":
            return False
        if self.settings.think_end != "auto":
            return True
        return self.engine is not None and self.engine.vocab.think_end is not None

    def request(self, sampling_params: Any) -> tuple[ConstraintRequest | None,
                                                     Future[Grammar] | None]:
        """The request's constraint and its compile (started now), or (None, None).

        A malformed constraint that got past validation becomes a failed compile, so that
        row alone errors (stop-only mask) and the batch goes on."""
        if not self.active:
            return None, None
        try:
            request = request_of(getattr(sampling_params, "extra_args", None))
        except GrammarError as exc:
            return _invalid(exc)
        if request is None:
            return None, None
        assert self.engine is not None
        try:
            return request, self.engine.compile_async(request.spec)
        except GrammarError as exc:
            return _invalid(exc)

    def deactivate(self) -> None:
        self.active = False
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None


def _invalid(exc: GrammarError) -> tuple[ConstraintRequest, Future[Grammar]]:
    failed: Future[Grammar] = Future()
    failed.set_exception(exc)
    # a stand-in spec: the row only ever reports the failure above
    return ConstraintRequest(GrammarSpec.json_object(), thinking=False), failed
