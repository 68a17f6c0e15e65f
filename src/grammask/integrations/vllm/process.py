"""The process's grammask compiler inside vLLM: one per tokenizer and settings, built from the
model's own tokenizer (``cached_tokenizer_from_config``) and sized by the model's vocabulary,
warmed up before the server reports healthy; grammask's logs through vLLM's handlers."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from ...backends import get_backend, registry
from ...compile.compiler import Compiler
from ...errors import GrammarError
from ...vocab import Vocabulary
from .dropin import status as dropin_status
from .settings import Settings, _tp_size

log = logging.getLogger("grammask")


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


# -------------------------------------------------------------------------- compiler
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
    if getattr(type(tokenizer), "IS_MISTRAL_TOKENIZER", False):  # vllm.utils.mistral's test
        return mistral_vocabulary(tokenizer, vocab_size=vocab_size, stop_ids=stops,
                                  name=str(model_config.tokenizer))
    return Vocabulary.from_huggingface(tokenizer, vocab_size=vocab_size,
                                       stop_ids=stops or None,
                                       name=str(model_config.tokenizer))


def mistral_vocabulary(tokenizer: Any, *, vocab_size: int, stop_ids: list[int],
                       name: str) -> Vocabulary:
    """The vocabulary of vLLM's ``MistralTokenizer`` (``--tokenizer-mode mistral``), read
    from its Tekken tokenizer (``mistral_common``'s ``Tekkenizer``), not from ``get_vocab``.

    Why not the Hugging Face path (which also cannot tell how such a tokenizer spells its
    bytes, and refuses it): a ``MistralTokenizer`` spells each token by its decoded text, so
    the byte tokens ``0x80``..``0xFF`` and every other token holding part of a character
    read ``"\ufffd"`` (1,435 of the 131,072 ids of ``mistral_common``'s Tekken file), and
    ``get_vocab`` keeps one id per spelling (1,028 ids missing).

    Contract: token ``i`` is the Tekkenizer's own bytes for it (``id_to_byte_piece``); the
    special tokens (ids below ``num_special_tokens``: ``<s>``, ``</s>``, ``[TOOL_CALLS]``,
    ``[ARGS]``, ...) are special, spelled as Mistral spells them; ``encode`` is Tekken's
    (special-token text is plain text); the thinking end is ``[/THINK]`` where it is a
    special token (v13+). Grammars name Mistral's special tokens by id (``<[9]>``, as
    ``mistral_common``'s ``GrammarFactory`` writes them) or by this text.

    A SentencePiece Mistral tokenizer (older models, ``is_spm``) raises ``RuntimeError``:
    its byte tokens and ``▁`` spaces are not checked here, and grammask stands aside rather
    than serve masks over wrong token bytes."""
    if not getattr(tokenizer, "is_tekken", False):
        raise RuntimeError(
            f"grammask supports Hugging Face tokenizers and Mistral's Tekken tokenizers, got "
            f"a SentencePiece {type(tokenizer).__name__} (tokenizer_mode=mistral): use "
            "--tokenizer-mode hf, or disable grammask (GRAMMASK_ENABLED=0)")
    tekken = tokenizer.tokenizer
    n_special = int(tekken.num_special_tokens)
    tokens = [str(tekken.id_to_piece(i)).encode() if i < n_special
              else bytes(tekken.id_to_byte_piece(i)) for i in range(int(tekken.n_words))]
    special = range(n_special)
    stops = stop_ids or [int(tekken.eos_id)]

    def encode(text: str) -> list[int]:
        return list(tekken.encode(text, bos=False, eos=False))

    think = "[/THINK]" if tekken.is_special("[/THINK]") else None
    return Vocabulary(tokens, special_ids=special, stop_ids=stops,
                      vocab_size=max(vocab_size, len(tokens)), name=name, encode=encode,
                      think_end=think)


_COMPILERS: dict[tuple[Any, ...], Compiler] = {}
_COMPILERS_LOCK = threading.Lock()


def shared_compiler(vllm_config: Any, settings: Settings) -> Compiler:
    """The process's compiler for this tokenizer and these settings (built once: seconds;
    docs/benchmarks.md, Figures: start-up)."""
    mc = vllm_config.model_config
    key = (mc.tokenizer, getattr(mc, "tokenizer_revision", None),
           getattr(mc, "tokenizer_mode", None), mc.get_vocab_size(), settings.backend,
           settings.prefer, settings.cache_mb, settings.compile_threads,
           settings.compile_timeout_s, settings.disk_cache, settings.disk_cache_mb,
           _tp_size(vllm_config) > 1, settings.fill_verdict)
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            vocab = vocabulary_from_vllm(mc)
            compiler = Compiler(vocab, backend=settings.backend, prefer=settings.prefer,
                            max_workers=settings.compile_threads,
                            cache_bytes=settings.cache_mb * 1024 * 1024,
                            timeout_s=settings.compile_timeout_s,
                            disk_cache_dir=disk_cache_dir(settings),
                            disk_cache_bytes=settings.disk_cache_mb * 1024 * 1024,
                            # ranks must end with one grammar per spec: no timing fallbacks
                            rank_invariant=_tp_size(vllm_config) > 1,
                            fill_verdict=settings.fill_verdict)  # type: ignore[arg-type]
            # every backend's tokenizer view (slow to build for Qwen's 152k tokens), even one
            # the settings do not choose: built before the server reports healthy, so no
            # first request waits on them past its budget
            for backend in registry.backends():
                get_backend(backend.name).prepare(vocab)
            if settings.warmup_dir:
                # JSON specs warmed as the drop-in will ask for them (compact by default),
                # else a standard request for a warmed schema would miss the cache
                drop = dropin_status(vllm_config, settings)
                _warm_up(compiler, settings.warmup_dir,
                         any_whitespace=not (drop.on and drop.compact_json))
            _COMPILERS[key] = compiler
    return compiler


def disk_cache_dir(settings: Settings) -> Path | None:
    """The compiled-grammar directory: on by default in the plugin (a restart or another
    replica on the host loads what was compiled), under the user's cache directory."""
    value = settings.disk_cache.strip()
    if value.lower() in ("off", "none", "0", "false"):
        return None
    if value.lower() in ("", "auto", "on"):
        from ...backends.diskcache import default_cache_dir

        return default_cache_dir()
    return Path(value).expanduser()


def _warm_up(compiler: Compiler, directory: str, *, any_whitespace: bool) -> None:
    from ...compile.warmup import summary_table, warm

    started = time.perf_counter()
    try:
        results = warm(compiler, directory, any_whitespace=any_whitespace)
    except GrammarError as exc:
        log.error("grammask: warm-up skipped: %s", exc)
        return
    log.info("grammask: warm-up of %s in %.1f s\n%s", directory,
             time.perf_counter() - started, summary_table(results))
