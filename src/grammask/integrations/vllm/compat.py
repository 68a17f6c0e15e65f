"""The vLLM internals grammask relies on, in one place, for the lines it supports (0.32-0.34).

What is not public API is checked here, not scattered:

- **Arrival**: vLLM calls a logits processor's ``validate_params`` from
  ``InputProcessor._validate_params``. It passes the request's own params, before the copy
  for the engine, and no config. ``admission_config`` reads the config off that one caller
  frame, identified by its code object rather than a walk over any frame with a
  ``vllm_config``. Why a frame at all (0.32 to 0.34 alike): the hook's only argument is the
  ``SamplingParams``; the V1 validator (``validate_logits_processors_parameters``) and the V2
  one (``build_custom_logits_processors_params_validator``) are built from the processor
  classes alone; and the API server never enters ``set_current_vllm_config`` (only engine
  and worker code does), so ``get_current_vllm_config_or_none``, tried first, is None there.
  The ``InputProcessor`` holding the config is reachable only as the caller.
- **Runner interfaces**: the V1 runner builds a processor as ``(vllm_config, device,
  is_pin_memory)``, the V2 runner as ``(vllm_config, LogitsProcRequestState)``.
  ``runner_of`` tells them apart by type, not by argument count. vLLM 0.34 removed the V1
  runner and its interface; ``interfaces`` imports whichever exist, and ``unsupported`` says
  why the plugin must stand aside (a line it was not built for, or an interface missing).
- **The V2 runner's token history as host memory** (``host_view``): ``RequestState`` keeps
  ``all_token_ids`` in pinned host memory mapped into the device (``StagedWriteTensor`` with
  ``uva_instead_of_gpu``; its ``_uva_buf``) unless a drafter prefers it dense. The token
  watch reads that memory in numpy, with no CUDA call, instead of copying it back.
- **The drop-in's assumptions**: the version line, exactly the ``StructuredOutputsParams``
  fields it translates, and ``AsyncLLM.add_request``'s two arguments that carry vLLM's
  reasoning decision (``mismatch``).
- **vLLM's reasoning decision** (``engine_call``): the chat and Responses servers pass
  ``reasoning_ended`` and ``reasoning_parser_kwargs`` to ``AsyncLLM.add_request``, which
  writes them onto the engine request only after ``process_inputs`` (where
  ``validate_params`` runs); ``SamplingParams`` carries neither. They are read off that
  caller frame, identified by its code object. ``LLMEngine.add_request`` (offline) takes
  neither (the engine decides from the prompt); a raw prompt is processed on a thread pool
  (``process_inputs_async``), where the frame is out of reach: vLLM's own front ends pass
  rendered prompts, so there only a direct ``AsyncLLM`` caller, who passes neither as a rule,
  is met, and the engine's rule applies.
- **No tokenizer** (``--skip-tokenizer-init``, ``unserved``) and **no Python front end**
  (0.34's ``VLLM_USE_RUST_FRONTEND``, ``rust_frontend``: ``validate_params`` never runs).
- **Where processors are never called** (``unsupported``, ``unserved``): a runner that never
  calls custom logits processors (0.34's standalone CPU runner: ``platforms/cpu.py``
  ``uses_standalone_cpu_model_runner``, its sampler ``v1/worker/cpu/sampler.py`` builds
  none), and the V1 runner's configurations that drop or starve them (speculative decoding;
  async scheduling without ``--logits-processors``). Both processes decide from the same
  inputs: the platform, and the config (``use_v2_model_runner`` is the very property vLLM's
  ``InputProcessor`` reads to pick the processors' validator).
- **V1 chunked prefill** (``v1_discarded``): which rows' samples the V1 runner drops (a
  prompt chunk before the last) is its ``discard_request_mask``, read off the calling
  ``GPUModelRunner._sample`` frame, identified by its code object: the V1 interface hands a
  processor no such thing.

A vLLM outside these lines leaves vLLM's structured outputs to vLLM (``mismatch`` says why)
and still loads grammask's own keys, where the public hooks are enough.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from functools import cache
from types import CodeType
from typing import Any, Literal

#: vLLM lines whose admission flow the drop-in was written against and tested on.
SUPPORTED_VLLM = ("0.32.", "0.33.", "0.34.")
#: The first line without the V1 model runner (and its logits-processor interface).
V2_ONLY_FROM = (0, 34)
#: ``StructuredOutputsParams`` fields the drop-in translates; any other field could be a
#: constraint option grammask would ignore.
KNOWN_FIELDS = frozenset({"json", "regex", "choice", "grammar", "json_object",
                          "disable_any_whitespace", "disable_additional_properties",
                          "whitespace_pattern", "structural_tag", "_backend",
                          "_backend_was_auto"})
#: frames between ``InputProcessor._validate_params`` and ``validate_params`` (V1: the
#: module function; V2: the validator closure), with room to spare
_MAX_DEPTH = 6


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:  # pragma: no cover - the plugin needs vLLM to load at all
        return ""
    return str(getattr(vllm, "__version__", "?"))


def version_tuple(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a vLLM version string; (0, 0) when it cannot be read."""
    found = vllm_version() if version is None else version
    parts = found.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def interfaces() -> tuple[Any, Any]:
    """vLLM's (V1, V2) logits-processor base classes; None for one this vLLM lacks.

    Never raises: any failure to import one (a module moved, a broken install) is None."""
    v1: Any = None
    v2: Any = None
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor as v1
    except Exception:
        v1 = None
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as v2
    except Exception:
        v2 = None
    return v1, v2


#: The class vLLM loads (entry point and ``--logits-processors``): one spelling, here, which
#: the plugin module and the adapters import without importing each other.
FQCN = "grammask.integrations.vllm.plugin:GrammaskLogitsProcessor"


def unsupported() -> str:
    """Empty when the plugin can serve on the installed vLLM; else why it stands aside."""
    found = vllm_version()
    if not found.startswith(SUPPORTED_VLLM):
        return (f"vLLM {found or '(none)'} is not a line grammask supports "
                f"({', '.join(v + 'x' for v in SUPPORTED_VLLM)})")
    v1, v2 = interfaces()
    if v2 is None:
        return f"vLLM {found} has no V2 logits-processor interface where grammask expects it"
    if v1 is None and version_tuple(found) < V2_ONLY_FROM:
        return f"vLLM {found} has no V1 logits-processor interface where grammask expects it"
    return runner_without_processors()


def runner_without_processors() -> str:
    """Why this machine's vLLM runs a model runner that never calls custom logits processors
    (empty: it calls them). A platform-wide fact, so the API server (where the drop-in and
    ``validate_params`` run) and the engine read the same answer. vLLM 0.34 on a CPU
    without Triton that is not x86 runs its standalone CPU runner, whose sampler builds only
    vLLM's own processors. A failed check counts as no such runner: vLLM's own start-up
    would fail on the same platform query."""
    try:
        from vllm.platforms import current_platform

        # looked up on the class: the platform's ``__getattr__`` logs a warning for a
        # name it lacks (every vLLM before 0.34)
        if getattr(type(current_platform), "uses_standalone_cpu_model_runner", None) is None:
            return ""
        if bool(current_platform.uses_standalone_cpu_model_runner()):
            return ("vLLM's standalone CPU model runner (a CPU without Triton that is not "
                    "x86) never calls custom logits processors")
    except Exception:
        return ""
    return ""


def unserved(config: Any, runner: Literal["v1", "v2"] | None = None) -> str:
    """Why vLLM would not call grammask's processor with the samples it must mask on this
    server's configuration (empty: it would). ``runner``: the runner that built the processor
    (the engine knows it); None: the one vLLM picks, ``config.use_v2_model_runner`` (the
    property vLLM's ``InputProcessor`` reads to pick the processors' validator, so the API
    server decides as the engine does; one that cannot be read counts as V1, where standing
    aside is the safe side: vLLM's engine then serves structured outputs)."""
    if config is None:
        return ""
    if getattr(getattr(config, "model_config", None), "skip_tokenizer_init", False):
        return ("--skip-tokenizer-init: grammask builds its masks from the model's tokenizer, "
                "which vLLM does not load")
    if why := _unread_tokenizer(getattr(config, "model_config", None)):
        return why
    if why := _drops_masked_samples(config):
        return why
    if not _on_v1(config, runner):
        return ""
    if getattr(config, "speculative_config", None):
        return ("speculative decoding on vLLM's V1 model runner skips custom logits "
                "processors; run the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) or start "
                "without --speculative-config")
    scheduler = getattr(config, "scheduler_config", None)
    listed = getattr(getattr(config, "model_config", None), "logits_processors", None)
    if getattr(scheduler, "async_scheduling", False) and not listed:
        return ("vLLM's V1 model runner with async scheduling resolves the -1 placeholders "
                "of its output tokens only when --logits-processors is non-empty; start with "
                "`--logits-processors grammask.integrations.vllm.plugin:"
                "GrammaskLogitsProcessor`, or --no-async-scheduling, or the V2 model runner")
    return ""


def _unread_tokenizer(model_config: Any) -> str:
    """Why grammask cannot read this model's token bytes (empty: it can): a Mistral
    SentencePiece tokenizer (``--tokenizer-mode mistral`` on an older Mistral model), whose
    bytes ``compiler.mistral_vocabulary`` does not read; masks over wrong bytes would be
    silent violations, so vLLM's engine serves it. The tokenizer is vLLM's cached one (a
    config whose tokenizer cannot be loaded counts as readable: vLLM's own start-up fails
    on it)."""
    if getattr(model_config, "tokenizer_mode", None) not in ("mistral", "auto"):
        return ""
    try:
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(model_config)
    except Exception:
        return ""
    if getattr(type(tokenizer), "IS_MISTRAL_TOKENIZER", False) and not getattr(
            tokenizer, "is_tekken", False):
        return ("a Mistral SentencePiece tokenizer (tokenizer_mode=mistral): grammask reads "
                "Hugging Face and Mistral Tekken tokenizers; --tokenizer-mode hf serves it")
    return ""


def _drops_masked_samples(config: Any) -> str:
    """Why a configuration of either runner would commit tokens the processor never masked
    (empty: none). vLLM 0.34:

    - batch-sharded sampling (``parallel_config.enable_batch_sharded_sampling``): each
      tensor-parallel rank's processor sees only the requests it samples, reassigned every
      step (``sample/batch_shard.py``), while ``post_update`` commits every slot on every
      rank: a rank's matcher misses the tokens other ranks sampled, and ranks no longer
      share the rows their first-mask agreement gathers over;
    - synthetic acceptance (``speculative_config.rejection_sample_method='synthetic'``)
      accepts drafts without reading the masked logits
      (``spec_decode/rejection_sampler_utils.py``)."""
    parallel = getattr(config, "parallel_config", None)
    if (getattr(parallel, "enable_batch_sharded_sampling", False)
            and int(getattr(parallel, "tensor_parallel_size", 1) or 1) > 1):
        return ("batch-sharded sampling (--enable-batch-sharded-sampling) shows each "
                "tensor-parallel rank's processor only its own share of the batch; start "
                "without it")
    spec = getattr(config, "speculative_config", None)
    if getattr(spec, "rejection_sample_method", "standard") == "synthetic":
        return ("synthetic rejection sampling accepts draft tokens without the masked "
                "logits; use rejection_sample_method 'standard'")
    return ""


def _on_v1(config: Any, runner: Literal["v1", "v2"] | None) -> bool:
    if runner is not None:
        return runner == "v1"
    if version_tuple() >= V2_ONLY_FROM:
        return False
    try:
        return not bool(getattr(config, "use_v2_model_runner", False))
    except Exception:  # vLLM's own property refused the config: the safe side
        return True


def mismatch() -> str:
    """Empty when the installed vLLM is one the drop-in's mechanism holds for; else why."""
    found = vllm_version()
    if not found.startswith(SUPPORTED_VLLM):
        return (f"vLLM {found or '(none)'} is not a line the drop-in was built for "
                f"({', '.join(v + 'x' for v in SUPPORTED_VLLM)}); vLLM's engine serves "
                "structured outputs")
    from vllm.sampling_params import StructuredOutputsParams

    fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    if fields != KNOWN_FIELDS:
        return (f"vLLM {found}'s StructuredOutputsParams has fields grammask does not "
                f"translate ({sorted(fields ^ KNOWN_FIELDS)}); vLLM's engine serves them")
    if _validate_params_code() is None:
        return (f"vLLM {found} has no InputProcessor._validate_params; vLLM's engine "
                "serves structured outputs")
    if len(_entry_codes()) != len(_ENTRIES):
        return (f"vLLM {found}'s AsyncLLM.add_request, LLMEngine.add_request or "
                "InputProcessor.process_inputs is not where the drop-in reads the reasoning "
                "decision; vLLM's engine serves structured outputs")
    return ""


def rust_frontend() -> str:
    """Why no Python front end validates requests (empty: one does). vLLM 0.34's
    ``VLLM_USE_RUST_FRONTEND`` serves HTTP from a Rust binary: ``validate_params`` never
    runs, so nothing is taken over and grammask's own keys get no 400 up front."""
    value = os.environ.get("VLLM_USE_RUST_FRONTEND", "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return ""
    return ("vLLM's Rust front end (VLLM_USE_RUST_FRONTEND) never calls grammask's "
            "validate_params")


#: The frames ``engine_call`` looks for: (module, class, method, the name it reports)
_ENTRIES = (("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", "AsyncLLM.add_request"),
            ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request", "LLMEngine.add_request"),
            ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs",
             "process_inputs"))
#: frames between ``AsyncLLM.add_request`` and the caller of ``engine_call`` (process_inputs,
#: _validate_params, the processors' validator, the plugin's validate_params and
#: validate_sampling_params), with room
_MAX_CALL_DEPTH = 16


@cache
def _entry_codes() -> dict[CodeType, str]:
    """Code objects of ``_ENTRIES`` (those that have both decision arguments, for
    ``AsyncLLM.add_request``); a missing one is left out."""
    import importlib
    import inspect

    codes: dict[CodeType, str] = {}
    for module, cls, method, name in _ENTRIES:
        try:
            fn = inspect.unwrap(getattr(getattr(importlib.import_module(module), cls), method))
            params = inspect.signature(fn).parameters
        except Exception:
            continue
        if name == "AsyncLLM.add_request" and not {
                "reasoning_ended", "reasoning_parser_kwargs"} <= set(params):
            continue
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            codes[code] = name
    return codes


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """How the request being validated reaches vLLM's engine: ``reasoning_ended`` and
    ``reasoning_parser_kwargs`` as vLLM's engine will get them, and from where (``via``)."""

    reasoning_ended: bool | None
    parser_kwargs: Any
    via: str


def engine_call() -> EngineCall | None:
    """Where the current ``validate_params`` call came from (``AsyncLLM.add_request``:
    its two locals; ``LLMEngine.add_request``: neither; a raw prompt on vLLM's thread pool:
    neither); None from anywhere else (a caller that processed its request apart)."""
    codes = _entry_codes()
    if not codes:
        return None
    work_item = _work_item_code()
    frame = sys._getframe(1)
    for _ in range(_MAX_CALL_DEPTH):
        name = codes.get(frame.f_code)
        if name == "AsyncLLM.add_request":
            found = frame.f_locals
            ended = found.get("reasoning_ended")
            return EngineCall(None if ended is None else bool(ended),
                              found.get("reasoning_parser_kwargs"), name)
        if name == "LLMEngine.add_request":
            return EngineCall(None, None, name)
        back = frame.f_back
        if name == "process_inputs" and back is not None and back.f_code is work_item:
            return EngineCall(None, None, "process_inputs_async")
        if back is None:
            return None
        frame = back
    return None


@cache
def _work_item_code() -> CodeType | None:
    from concurrent.futures.thread import _WorkItem

    return getattr(_WorkItem.run, "__code__", None)


@cache
def _validate_params_code() -> CodeType | None:
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return None
    method = getattr(InputProcessor, "_validate_params", None)
    return getattr(method, "__code__", None)


def admission_config() -> Any:
    """The ``VllmConfig`` of the ``InputProcessor`` validating the current request, or None
    (another caller, e.g. a test calling ``validate_params`` directly)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        current = None
    else:
        current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    code = _validate_params_code()
    if code is None:
        return None
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame.f_code is code:
            return getattr(frame.f_locals.get("self"), "vllm_config", None)
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def _speculative_on_v1(config: Any) -> bool:
    """vLLM's V1 runner drops entry-point logits processors when speculative decoding is
    on (without a word), so a grammask request there would be served unconstrained. From
    0.34 there is only the V2 runner, whose processors stay active under drafts."""
    if config is None or not getattr(config, "speculative_config", None):
        return False
    if version_tuple() >= V2_ONLY_FROM:
        return False
    return not bool(getattr(config, "use_v2_model_runner", False))


@cache
def _v1_sample_code() -> CodeType | None:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:
        return None
    return getattr(getattr(GPUModelRunner, "_sample", None), "__code__", None)


#: frames between ``GPUModelRunner._sample`` and the caller of ``v1_discarded`` (the
#: sampler's module call and forward, ``apply_logits_processors``, the plugin), with room
_MAX_SAMPLE_DEPTH = 14


def v1_discarded(num_rows: int) -> Any:
    """The V1 runner's ``discard_request_mask`` for the batch it samples now (a bool numpy
    array of ``num_rows``: True where the row's sample is dropped, a prompt chunk before
    the last), read off the calling ``GPUModelRunner._sample`` frame; None when not called
    from there (another runner, a test driving the sampler itself) or the mask is not
    there. ``gpu_model_runner.py`` (0.33): ``_prepare_inputs`` sets it (optimistic sequence
    length below the request's token count), ``_bookkeeping_sync`` drops those samples."""
    code = _v1_sample_code()
    if code is None:
        return None
    try:
        frame = sys._getframe(1)
        for _ in range(_MAX_SAMPLE_DEPTH):
            if frame.f_code is code:
                mask = getattr(frame.f_locals.get("self"), "discard_request_mask", None)
                found = getattr(mask, "np", None)
                if found is None or len(found) < num_rows:
                    return None
                return found[:num_rows].astype(bool)
            if frame.f_back is None:
                return None
            frame = frame.f_back
    except Exception:
        return None
    return None


def runner_of(args: tuple[Any, ...]) -> Literal["v1", "v2"]:
    """Which runner built the processor, from the arguments after ``vllm_config``."""
    if len(args) == 1:
        from vllm.v1.worker.gpu.sample.logits_processor.interface import (
            LogitsProcRequestState,
        )

        if isinstance(args[0], LogitsProcRequestState):
            return "v2"
    if len(args) == 2 and isinstance(args[1], bool):
        return "v1"  # (device, is_pin_memory)
    raise TypeError("GrammaskLogitsProcessor(vllm_config, device, is_pin_memory) (V1 runner) "
                    "or (vllm_config, LogitsProcRequestState) (V2 runner), got "
                    f"{[type(a).__name__ for a in args]}")


def host_view(staged: Any) -> Any:
    """A V2 ``StagedWriteTensor`` (or ``UvaBackedTensor``) as a numpy array of host memory the
    device writes into: the UVA buffer (0.34: ``_uva_buf.np``) or a CPU tensor itself; None
    for device memory."""
    uva = getattr(staged, "_uva_buf", None)
    if uva is not None and getattr(uva, "np", None) is not None:
        return uva.np
    tensor = getattr(staged, "gpu", None)
    if tensor is not None and getattr(getattr(tensor, "device", None), "type", None) == "cpu":
        return tensor.numpy()
    return None
