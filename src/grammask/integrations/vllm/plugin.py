"""The vLLM plugin: ``GrammaskLogitsProcessor``, the class the ``vllm.logits_processors`` entry
point names. Importing this module never raises, on any vLLM.

- **A supported vLLM** (``compat.SUPPORTED_VLLM``): the class subclasses every
  logits-processor interface that vLLM has (0.32/0.33: V1 and V2; 0.34: V2 only, the V1
  runner is gone) and dispatches on the constructor's argument types
  (``compat.runner_of``): ``(vllm_config, device, is_pin_memory)`` is the V1 runner
  (``v1_batch.V1Batch``), ``(vllm_config, req_states)`` the V2 runner
  (``v2.V2Batch``). It holds no logic of its own.
- **Any other vLLM** (a newer line, a moved module, a broken import of grammask's own): the
  class is ``StandAside``, built on whichever interfaces vLLM has so that its loader accepts
  it. It masks nothing, leaves vLLM's structured outputs to vLLM's engine, refuses requests
  that carry grammask's own keys with a 400 (they would otherwise run unconstrained without
  a word), and logs one line at start-up saying why.
"""

from __future__ import annotations

import logging
import types
from typing import Any

from .compat import FQCN, interfaces, unsupported, vllm_version

__all__ = ["FQCN", "STAND_ASIDE_REASON", "GrammaskLogitsProcessor", "StandAside"]

log = logging.getLogger("grammask")


_V1, _V2 = interfaces()


def _bases() -> tuple[type, ...]:
    """vLLM's interfaces this vLLM has: its loader checks ``issubclass`` against them."""
    found = tuple(b for b in (_V1, _V2) if isinstance(b, type))
    return found or (object,)


class _StandAsideMixin:
    """Masks nothing; grammask's own keys get a 400; vLLM's structured outputs stay vLLM's."""

    reason = ""

    def __init__(self, vllm_config: Any = None, *args: Any) -> None:
        pass

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        # the keys spelled out, not imported: this class must work when grammask's own
        # modules do not import (``request.EXTRA_ARGS_KEY``; the opt-out leaves vLLM serving)
        if any(isinstance(k, str) and k.startswith("grammask")
               and k != "grammask_structured_outputs" for k in extra):
            raise ValueError(f"grammask is installed but stands aside on this server: "
                             f"{cls.reason}. Send the constraint as vLLM's structured "
                             "outputs (response_format, structured_outputs) instead")

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return False

    def apply_staged_writes(self) -> None:
        pass

    def apply(self, logits: Any, ctx: Any = None) -> Any:
        return logits

    def close(self) -> None:
        pass


StandAside: type = types.new_class(
    "StandAside", (_StandAsideMixin, *_bases()),
    exec_body=lambda ns: ns.update(__doc__=_StandAsideMixin.__doc__, __module__=__name__))


def _real_class() -> type:
    """The serving class (imports grammask's engine; may raise on a broken install)."""
    from .served import served_class

    return served_class(_V1, _V2)


STAND_ASIDE_REASON = ""
try:
    STAND_ASIDE_REASON = unsupported()
    GrammaskLogitsProcessor: Any = None if STAND_ASIDE_REASON else _real_class()
except Exception as exc:  # a broken import must not stop vLLM's server from starting
    STAND_ASIDE_REASON = f"loading grammask's plugin failed ({type(exc).__name__}: {exc})"
    GrammaskLogitsProcessor = None
if GrammaskLogitsProcessor is None:
    StandAside.reason = STAND_ASIDE_REASON  # type: ignore[attr-defined]
    GrammaskLogitsProcessor = StandAside
    log.warning("grammask stands aside on vLLM %s: %s. vLLM's own engine serves structured "
                "outputs; requests with grammask's own keys are refused (400).",
                vllm_version() or "(none)", STAND_ASIDE_REASON)
