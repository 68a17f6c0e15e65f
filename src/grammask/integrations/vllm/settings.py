"""Plugin settings: ``--additional-config '{"grammask": {...}}'`` first, then ``GRAMMASK_*``
environment variables, then defaults (``SETTINGS`` lists them; docs/vllm.md has the table,
generated from the same words by ``settings_table``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...backends import registry

log = logging.getLogger("grammask")



# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """Plugin settings; each field ``x`` is also env ``GRAMMASK_X`` and
    ``--additional-config '{"grammask": {"x": ...}}'`` (which wins over the env)."""

    enabled: bool = True
    structured_outputs: str = "grammask"
    json_whitespace: str = "compact"
    tool_arguments: str = "parameters"
    backend: str = "auto"
    prefer: str = "auto"
    cache_mb: int = 512
    compile_threads: int = 4
    compile_timeout_s: float = 10.0
    wait_s: float = 0.5
    hedge_s: float = 0.05
    fill_threads: int | None = None
    fill_cpus: str = "auto"
    parallel_min: int = 16
    on_error: str = "stop"
    think_end: str = "auto"
    metrics_port: int = 0
    warmup_dir: str = ""
    disk_cache: str = "auto"
    disk_cache_mb: int = 1024
    mask_digest_dir: str = ""
    debug_mask_fault_rank: int = -1
    token_marks: bool = True
    engine_switch: bool = True
    fill_verdict: str = "auto"

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


def _backend(value: object) -> str:
    """auto, or a registered backend's name or alias (as its name)."""
    text = str(value).strip().lower()
    name = "auto" if text == "auto" else registry.canonical(text)
    if name is None:
        raise ValueError(f"expected auto or a registered backend "
                         f"({', '.join(registry.names())}), got {value!r}")
    return name


def _word(*options: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = str(value).strip().lower()
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


def _cpus(value: object) -> str:
    """``auto``, ``none`` or a CPU list, kept as text (``decode.fill.fill_cpus`` reads
    it; checked here)."""
    from ...decode.fill import check_setting

    text = str(value).strip()
    check_setting(text)
    return text


def _port(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a port number, got {value!r}")
    number = int(value) if isinstance(value, int) else int(str(value))
    if not 0 <= number <= 65535:
        raise ValueError(f"expected a port 0..65535, got {value!r}")
    return number


def _rank(value: object) -> int:
    number = int(value) if isinstance(value, int) else int(str(value).strip())
    if number < -1:
        raise ValueError(f"expected a rank >= 0, or -1 for off, got {value!r}")
    return number


def _think_end(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected 'auto', 'none' or the marker text, got {value!r}")
    return value.strip() if value.strip().lower() not in ("auto", "none") else (
        value.strip().lower())


#: field -> (parser, one-line meaning); the docs table is generated from the same words.
SETTINGS: dict[str, tuple[Callable[[object], Any], str]] = {
    "enabled": (_bool, "0 makes the plugin inert; requests with grammask keys get a 400"),
    "structured_outputs": (_word("grammask", "vllm"), "who serves vLLM's own structured "
                           "outputs (response_format, structured_outputs, tools, text.format): "
                           "grammask (the drop-in) or vllm (its engine, as without grammask)"),
    "json_whitespace": (_word("compact", "any"), "JSON whitespace of those requests when "
                        "they set no whitespace option: compact (no whitespace between "
                        "tokens, so a weak model cannot run to max_tokens on it) or any"),
    "tool_arguments": (_word("parameters", "vllm"), "arguments of forced tool calls "
                       "(tool_choice required or named): parameters (each tool's parameters "
                       "schema, strict or not, and at most 16 calls) or vllm (vLLM's tag: "
                       "any JSON unless the tool is strict)"),
    "backend": (_backend, "backend for requests that do not name one (auto: per-request "
                "routing; else a registered backend: `grammask backends`)"),
    "prefer": (_backend, "tie-break when several backends enforce a schema"),
    "cache_mb": (_positive(int), "compiled-grammar LRU cache size, MiB"),
    "compile_threads": (_positive(int), "concurrent grammar compiles"),
    "compile_timeout_s": (_positive(float), "compile budget per backend (the compile goes on "
                          "failing only its own requests past it)"),
    "wait_s": (_positive(float), "longest the batch waits for a row's grammar at its first "
               "mask; past it that row alone fails (stop-only) and the compile finishes for "
               "the cache"),
    "hedge_s": (_positive(float), "after this, a JSON schema whose routed backend is still "
                "compiling is compiled by the other backend too; the first ready serves"),
    "fill_threads": (_optional_int, "threads of the batch-parallel mask fill (auto)"),
    "fill_cpus": (_cpus, "CPUs the fill thread runs on: auto (on vLLM's CPU platform, which "
                  "pins each worker and its threads to its OpenMP cores: onto CPUs no rank is "
                  "pinned to, when there are any), none (where vLLM started it), or a list "
                  "such as 1 or 2-3"),
    "parallel_min": (_positive(int), "fewest rows of one backend that use the batch fill"),
    "on_error": (_word("stop", "free"),
                 "a failed row gets a stop-only mask (stop) or none (free)"),
    "think_end": (_think_end, "thinking end marker: auto (from the tokenizer, e.g. "
                  "</think>), none, or the marker text"),
    "warmup_dir": (lambda v: str(v).strip(), "a directory of specs compiled at start-up, "
                   "before the server reports healthy (grammask.compile.warmup; empty: none)"),
    "disk_cache": (lambda v: str(v).strip() or "auto", "compiled xgrammar grammars on disk "
                   "across restarts and processes: auto (the user's cache directory), off, "
                   "or a directory"),
    "disk_cache_mb": (_positive(int), "size bound of the disk cache, MiB"),
    "mask_digest_dir": (lambda v: str(v).strip(), "debug: each tensor-parallel rank appends "
                        "a digest of every mask it applies (per request and step) to a file "
                        "here, to compare ranks (grammask.decode.step_apply.compare; empty: off)"),
    "debug_mask_fault_rank": (_rank, "debug, tests only: this tensor-parallel rank's masks "
                              "refuse one token they allow, to show the digests catch it "
                              "(-1: off)"),
    "token_marks": (_bool, "V2 runner: mark where a step's tokens will land (a valid token "
                    "id no constrained row samples) so their fill overlaps the next forward; "
                    "false: grammask writes nothing into vLLM's token history and reads "
                    "each step's tokens after the runner's stream passed them (no overlap)"),
    "engine_switch": (_bool, "running rows of a JSON schema move to the engine the fill "
                      "tuner measured cheaper to fill here (outputs then depend on when its "
                      "verdict lands: seeded runs reproduce only with false)"),
    "fill_verdict": (_word("auto", "rival", "routed"), "debug, tests only: the fill tuner's "
                     "verdict measured (auto) or forced (rival: the other engine wins; "
                     "routed: the routed one keeps the spec)"),
    "metrics_port": (_port, "grammask's own Prometheus exporter in vLLM's engine core (0: off; "
                     "or set PROMETHEUS_MULTIPROC_DIR to see them on vLLM's /metrics)"),
}


def load_settings(additional_config: object = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``--additional-config`` (key ``grammask``), then env, then defaults."""
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
    return load_settings(getattr(vllm_config, "additional_config", None))


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


def describe_settings(settings: Settings) -> str:
    """One log line: every setting and its value."""
    return "settings: " + ", ".join(f"{f.name}={getattr(settings, f.name)}"
                                    for f in fields(Settings))
