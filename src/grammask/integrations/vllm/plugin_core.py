"""What the vLLM V1 and V2 adapters share: ``PluginCore`` (settings, compiler, processor, the
TP agreement, inertness). The parts live in their own modules, imported from there:
``settings`` (settings), ``admission`` (request parsing and the 400s), ``process`` (the
shared compiler and vocabulary).

- Settings come from ``--additional-config '{"grammask": {...}}'`` first, then ``GRAMMASK_*``
  environment variables, then defaults (``SETTINGS`` lists them; docs/vllm.md has the table).
- One ``Compiler`` per process and tokenizer (``shared_compiler``): the vocabulary is built from
  the model's own tokenizer (``cached_tokenizer_from_config``), sized by the model's vocab.
- ``validate_sampling_params`` runs in the API server before a request reaches vLLM's engine:
  it parses the request and runs ``Compiler.check`` (routing plus the backend's syntax check),
  never a tokenizer compile, and raises ``VLLMValidationError`` (an HTTP 400).
- ``claim`` makes sure only one plugin instance acts per runner: vLLM instantiates a class
  that is both an installed entry point and listed in ``--logits-processors`` twice.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Literal

from ... import __version__, metrics
from ...compile.compiler import Compiler, Grammar
from ...decode.fill import Filler, fill_cpus
from ...decode.firstmask import Agreement, Solo, tp_group_for_vllm
from ...decode.processor import Arrival, BatchProcessor
from ...decode.step_apply import MaskDigests
from ...errors import CompileFailure, GrammarError, InvalidSpecError, ServerFault
from ...specs.request import STAND_IN, ConstraintRequest
from .admission import carries_request, request_of
from .compat import rust_frontend, unserved
from .dropin import OPT_OUT_KEY, log_status
from .dropin import status as dropin_status
from .process import shared_compiler, use_vllm_logging
from .reasoner import rule_for
from .settings import _tp_rank, _tp_size, describe_settings, settings_for

log = logging.getLogger("grammask")


def _cpu_platform() -> bool:
    """vLLM's CPU platform, whose workers pin every thread they start to their OpenMP cores
    (``fill_cpus=auto`` moves the fill thread off them)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


RunnerKind = Literal["v1", "v2"]

__all__ = ["PluginCore", "RunnerKind", "host_masks"]


# ------------------------------------------------------------------------- the core
_ACTIVE: dict[tuple[int, RunnerKind], weakref.ref[PluginCore]] = {}
_ACTIVE_LOCK = threading.Lock()


class PluginCore:
    """Per-instance state both adapters share: settings, compiler, processor, inertness.

    Only the newest instance per (``vllm_config``, runner) is active: vLLM builds a class
    listed both as entry point and in ``--logits-processors`` twice, in one go, and a
    rebuild replaces the old instances. Inert instances return at once from every hook.
    """

    def __init__(self, vllm_config: Any, kind: RunnerKind, max_batch: int) -> None:
        self.vllm_config = vllm_config  # held so id(vllm_config) stays unique while we live
        self.kind: RunnerKind = kind
        self.max_batch = max_batch
        self.settings = settings_for(vllm_config)
        #: why vLLM would not call this runner's processors with what they must mask
        #: (``compat.unserved``; empty: it would): grammask then stands aside, inert
        self.aside = unserved(vllm_config, kind) if self.settings.enabled else ""
        self.active = self.settings.enabled and not self.aside
        self.compiler: Compiler | None = None
        self.agreement: Agreement = Solo()
        self._proc: BatchProcessor | None = None
        use_vllm_logging()
        log.info("grammask %s loaded on vLLM's %s model runner (%s); %s", __version__,
                 kind.upper(), "active" if self.active else "STANDS ASIDE" if self.aside
                 else "DISABLED", describe_settings(self.settings))
        self.dropin = dropin_status(vllm_config, self.settings)
        log_status(self.dropin, f"{kind.upper()} model runner")
        self._foreign_warned = False
        if rust := rust_frontend():
            log.warning("grammask: %s: vLLM's engine serves vLLM's structured outputs; requests "
                        "with grammask's own keys are checked here, in the engine, and a bad "
                        "one fails its row (grammask_row_errors, a log line naming it) "
                        "instead of getting a 400", rust)
        if self.aside:
            log.warning("grammask stands aside on vLLM's %s model runner: %s. vLLM's own engine "
                        "serves structured outputs; requests with grammask's own keys are "
                        "refused (400).", kind.upper(), self.aside)
        if not self.active:
            return
        self.compiler = shared_compiler(vllm_config, self.settings)
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
        return self._proc is not None and self._proc.has_rows

    @property
    def proc_or_none(self) -> BatchProcessor | None:
        return self._proc

    def processor(self) -> BatchProcessor:
        """The batch processor (made at the first constrained request: a fill thread)."""
        if self._proc is None:
            assert self.compiler is not None
            kwargs: dict[str, Any] = {}
            if self.settings.think_end != "auto":
                kwargs["think_end"] = self.settings.think_end_arg
            if self.settings.mask_digest_dir:
                rank = _tp_rank()
                fault = self.settings.debug_mask_fault_rank == rank
                kwargs["digests"] = MaskDigests(self.settings.mask_digest_dir, rank,
                                                fault=fault)
                log.warning("grammask: recording mask digests in %s (rank %d%s)",
                            self.settings.mask_digest_dir, rank,
                            ", FAULT INJECTED" if fault else "")
            self._proc = BatchProcessor(
                self.compiler, max_batch=self.max_batch, wait_s=self.settings.wait_s,
                hedge_s=self.settings.hedge_s, agreement=self.agreement,
                on_error=self.settings.on_error,  # type: ignore[arg-type]
                engine_switch=self.settings.engine_switch, reader=self,
                filler=Filler(parallel_min=self.settings.parallel_min,
                              threads=self.settings.fill_threads,
                              cpus=fill_cpus(self.settings.fill_cpus,
                                             pinning_host=_cpu_platform())), **kwargs)
        return self._proc

    @property
    def default_marker(self) -> bool:
        """Whether requests without their own ``grammask_think_end`` get a thinking gate."""
        if self.settings.think_end == "none":
            return False
        if self.settings.think_end != "auto":
            return True
        return self.compiler is not None and self.compiler.vocab.think_end is not None

    def request(self, sampling_params: Any, *, resumed: bool = False
                ) -> tuple[ConstraintRequest | None, Future[Grammar] | None]:
        """The request's constraint and its compile (started now), or (None, None).

        ``resumed``: a preempted request added again (counted once: ``Row.count``).

        A malformed constraint that got past validation becomes a failed compile, so that
        row alone errors (stop-only mask) and the batch goes on."""
        if not self.active:
            return None, None
        self._check_foreign(sampling_params)
        extra = getattr(sampling_params, "extra_args", None)
        try:
            request = request_of(extra)
            if request is not None and getattr(sampling_params, "structured_outputs", None):
                raise InvalidSpecError("a request carries either vLLM structured_outputs or a "
                                       "grammask constraint, not both", where="grammask")
        except GrammarError as exc:
            # validation refuses these with a 400; a front end without it (the Rust one)
            # lets them through: this row alone fails, and the log names the constraint
            log.warning("grammask: a request's constraint is refused in the engine (%s): %s",
                        _constraint_text(extra), exc)
            return _invalid(exc)
        if request is None:
            return None, None
        try:
            request = self._with_rule(request, resumed)
        except Exception as exc:  # the server's parser cannot be built here: this row fails
            return _invalid(ServerFault(f"reasoning parser {request.reasoning!r}: "
                                        f"{type(exc).__name__}: {exc}"))
        assert self.compiler is not None
        try:
            return request, self.compiler.compile_async(request.spec)
        except CompileFailure as exc:  # a closed compiler: this row alone fails
            return _invalid(exc)

    def _with_rule(self, request: ConstraintRequest, resumed: bool) -> ConstraintRequest:
        """The request with vLLM's reasoning rule for it (a request the drop-in took over)
        and its ``resumed`` mark; parses are cached and shared, so this is a copy."""
        changes: dict[str, Any] = {"resumed": True} if resumed else {}
        reasoning = request.reasoning
        if reasoning is not None and request.thinking:
            changes["rule"] = rule_for(self.vllm_config.model_config, reasoning.parser,
                                       reasoning.kwargs)
        return dataclasses.replace(request, **changes) if changes else request

    def claims(self, sampling_params: Any) -> bool:
        """Whether grammask serves this request, from its keys alone (``request`` parses
        them): the model runner's thread asks this per new request, before the forward."""
        if not self.active:
            return False
        self._check_foreign(sampling_params)
        return carries_request(getattr(sampling_params, "extra_args", None))

    def arrival(self, sampling_params: Any, resumed: bool) -> Arrival:
        """``request`` and ``host_masks`` as one ``Arrival``: what a fill job makes the
        row from (``BatchProcessor.add_later``), off the runner's thread."""
        request, grammar = self.request(sampling_params, resumed=resumed)
        return Arrival(request, grammar, host_masks(sampling_params))

    def _check_foreign(self, sampling_params: Any) -> None:
        """Warn once when vLLM's own structured outputs reach the engine with the drop-in
        on (``validate_params`` did not run on the request: another path)."""
        if (self.dropin.on and not self._foreign_warned
                and getattr(sampling_params, "structured_outputs", None) is not None
                and OPT_OUT_KEY not in (getattr(sampling_params, "extra_args", None) or {})):
            self._foreign_warned = True
            log.warning("grammask: a request reached the engine with vLLM structured_outputs "
                        "still set; vLLM's engine serves it, not grammask")

    def deactivate(self) -> None:
        self.active = False
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None


def host_masks(sampling_params: Any) -> bool:
    """Whether vLLM's own processors forbid tokens of this request before grammask masks
    (they run first on both runners): ``min_tokens`` (the stop tokens), ``allowed_token_ids``,
    ``bad_words``, ``logit_bias``. Its rows then get the grammar-wins check."""
    return any(bool(getattr(sampling_params, name, None)) for name in
               ("min_tokens", "allowed_token_ids", "bad_words", "logit_bias"))


def _constraint_text(extra_args: Any, limit: int = 200) -> str:
    """The request's grammask keys as text, cut at ``limit`` characters (for a log line)."""
    keys = {k: v for k, v in (extra_args or {}).items()
            if isinstance(k, str) and k.startswith("grammask")}
    text = repr(keys)
    return text if len(text) <= limit else text[:limit] + "..."


def _invalid(exc: GrammarError | ServerFault) -> tuple[ConstraintRequest, Future[Grammar]]:
    failed: Future[Grammar] = Future()
    failed.set_exception(exc)
    return STAND_IN, failed  # the row only ever reports the failure above
