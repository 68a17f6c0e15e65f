"""Command line: ``grammask compile | warmup | grammars | demo | check | bench``.

``check`` needs the ``check`` extra (``pip install 'grammask[check]'``). ``bench`` runs the
repository's benchmarks (``bench/``, not part of the installed package) from a source
checkout: it is the same as ``python -m bench.compile|step|stress ...`` there."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .backends import get_backend, registry
from .compile.compiler import Compiler, running_compiles
from .errors import CompileFailure, GrammarError
from .specs.grammar_spec import GrammarSpec
from .specs.text import spec_from_text
from .vocab import load_vocabulary

#: the benchmarks ``grammask bench`` runs (``bench/<name>.py`` of a source checkout)
BENCHMARKS = ("compile", "step", "stress")



def _backend_arg(value: str) -> str:
    """A ``--backend`` value with its alias resolved (``llguidance`` -> ``guidance``)."""
    text = value.strip().lower()
    return registry.canonical(text) or text

def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    if argv is None and running_compiles():
        # run as a program with an abandoned native compile still going (a timeout): the
        # interpreter would wait for it at exit (minutes); nothing is left to do, so leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        return _bench(args[1:])
    if args and args[0] == "check":
        # imports without the check extra: it says itself what is missing (exit 2)
        from .harness import cli as check_cli

        return int(check_cli.main(args[1:]))
    parser = argparse.ArgumentParser(prog="grammask", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile one spec; print backend, reason, time")
    comp.add_argument("spec", help="inline spec text, or a path to a file holding it")
    comp.add_argument("--kind", choices=["json", "regex", "choice", "grammar", "named"],
                      help="named: SPEC is a library grammar's name (grammask grammars)")
    comp.add_argument("--backend", default="auto", type=_backend_arg,
                      choices=["auto", *registry.names()],
                      help="auto (per-spec routing) or a registered backend (an alias works "
                      "too; `grammask backends` lists them)")
    comp.add_argument("--tokenizer", default="qwen2.5")
    comp.add_argument("--timeout", type=float, default=30.0)
    comp.add_argument("--json", action="store_true", help="print one JSON object")
    warm = sub.add_parser("warmup", help="compile a directory of specs into the cache "
                          "(json, *.choice.json, gbnf, lark, regex); print a table")
    warm.add_argument("directory")
    warm.add_argument("--tokenizer", default="qwen2.5")
    warm.add_argument("--timeout", type=float, default=30.0)
    warm.add_argument("--compact", action="store_true",
                      help="schemas without free whitespace (disable_any_whitespace)")
    warm.add_argument("--disk-cache", metavar="DIR",
                      help="also write the compiled grammars to this disk cache (the plugin's "
                           "default is ~/.cache/grammask): servers started later load them")
    sub.add_parser("grammars", help="list the shipped grammar library")
    sub.add_parser("backends", help="list the registered backends: names, aliases, "
                   "capabilities, the workloads each serves")
    demo = sub.add_parser("demo", help="compile a schema on each backend and auto")
    demo.add_argument("--tokenizer", default="qwen2.5")
    sub.add_parser("bench", help="benchmarks, from a source checkout: bench compile|step|stress "
                   "... (python -m bench.NAME there)")
    sub.add_parser("check", help="mask-correctness harness (see grammask check --help; needs "
                   "grammask[check])")
    ns = parser.parse_args(args)
    if ns.command == "demo":
        return _demo(ns.tokenizer)
    if ns.command == "warmup":
        return _warmup(ns)
    if ns.command == "grammars":
        from .specs import library

        for name in library.names():
            print(f"{name:12} {library.load(name).syntax:5} {library.load(name).description}")
        return 0
    if ns.command == "backends":
        print(backends_table())
        return 0
    return _compile(ns)


def backends_table() -> str:
    """One line per registered backend: what it is called, can do and serves, cheapest
    first (the router's cost model, ``backends.registry``)."""
    lines = [f"{'backend':<10} {'aliases':<11} {'capabilities':<28} serves (cost rank)"]
    for b in registry.backends():
        caps = [c for c, on in (("lenient", b.lenient), ("batch-fill", b.batch_fill),
                                ("disk-cache", b.disk), ("warnings", b.warnings)) if on]
        serves = ", ".join(f"{w} {c.rank:g}" for w, c in b.costs.items())
        lines.append(f"{b.name:<10} {','.join(b.aliases) or '-':<11} "
                     f"{','.join(caps) or '-':<28} {serves}")
    return "\n".join(lines)


def _warmup(ns: argparse.Namespace) -> int:
    from .compile.warmup import summary_table, warm

    compiler = Compiler(load_vocabulary(ns.tokenizer), timeout_s=ns.timeout,
                    disk_cache_dir=ns.disk_cache)
    try:
        results = warm(compiler, ns.directory, any_whitespace=not ns.compact,
                       progress=lambda r: print(
                           f"{r.file}: {r.backend or '-'} "
                           f"{'' if r.compile_ms is None else f'{r.compile_ms:.1f} ms'}"
                           f"{' ' + r.error if r.error else ''}", file=sys.stderr))
    except GrammarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        compiler.flush_disk_cache(60.0)  # the writes land before the process exits
        compiler.close()
    print(summary_table(results))
    return 0 if all(r.ok or (r.error or "").startswith("skipped") for r in results) else 1


def _read_spec(value: str) -> tuple[str, str]:
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8"), path.name
    except OSError:
        pass
    return value, ""


def _compile(ns: argparse.Namespace) -> int:
    try:
        text, name = _read_spec(ns.spec)
        spec = spec_from_text(text, ns.kind, backend=ns.backend, name=name)
        compiler = Compiler(load_vocabulary(ns.tokenizer), timeout_s=ns.timeout)
        grammar = compiler.compile(spec)
    except CompileFailure as exc:
        if ns.json:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                              "where": exc.where}))
        else:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    result = {"kind": spec.kind, "backend": grammar.backend, "reason": grammar.reason,
              "unenforced": list(grammar.unenforced), "compile_ms": round(grammar.compile_ms, 3),
              "fallback_from": grammar.fallback_from, "key": spec.key}
    if ns.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>13}: {v}")
    return 0


DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age"],
}


NUMERIC_SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                   "unit": {"enum": ["m", "km"]}},
    "required": ["x", "y"],
}


def _demo(tokenizer: str) -> int:
    t0 = time.perf_counter()
    vocab = load_vocabulary(tokenizer)
    print(f"vocabulary: {vocab.name}: {len(vocab.tokens)} tokens, model vocab {vocab.vocab_size},"
          f" stop ids {list(vocab.stop_ids)} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
    t0 = time.perf_counter()
    for backend in registry.backends():
        get_backend(backend.name).prepare(vocab)
    print(f"backend tokenizers ready ({(time.perf_counter() - t0) * 1000:.0f} ms, once per model)")
    print(f"schema: {json.dumps(DEMO_SCHEMA)}\n")
    specs = {
        "auto": GrammarSpec.json_schema(DEMO_SCHEMA),
        **{name: GrammarSpec.json_schema(DEMO_SCHEMA, backend=name)
           for name in registry.names()},
        "auto (no text)": GrammarSpec.json_schema(NUMERIC_SCHEMA),
        "auto+uniqueItems": GrammarSpec.json_schema(
            {**DEMO_SCHEMA, "properties": {**DEMO_SCHEMA["properties"],  # type: ignore[dict-item]
                                           "tags": {"type": "array", "uniqueItems": True}}}),
        "auto+propNames": GrammarSpec.json_schema(
            {"type": "object", "additionalProperties": {"type": "integer"},
             "propertyNames": {"pattern": "^[a-z]+$"}}),
    }
    compiler = Compiler(vocab)
    print(f"{'request':<17} {'backend':<9} {'cold ms':>8} {'cached ms':>9}  reason")
    for label, spec in specs.items():
        t0 = time.perf_counter()
        grammar = compiler.compile(spec)
        cold = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        compiler.compile(spec)
        warm = (time.perf_counter() - t0) * 1000
        print(f"{label:<17} {grammar.backend:<9} {cold:8.2f} {warm:9.4f}  {grammar.reason}")
        if grammar.unenforced:
            print(f"{'':<17} unenforced: {', '.join(grammar.unenforced)}")
    grammar = compiler.compile(GrammarSpec.json_schema(DEMO_SCHEMA, any_whitespace=False))
    out = _greedy_sample(grammar, vocab)
    print(f"\nrandom-logit sample under the mask (compact whitespace): {out}")
    try:
        json.loads(out)
    except ValueError:
        print("(sample hit the demo's token cap before the JSON closed)")
    return 0


def _greedy_sample(grammar: Any, vocab: Any, steps: int = 200) -> str:
    import torch

    from .kernels.bitmask import allocate_bitmask

    gen = torch.Generator().manual_seed(0)
    # random logits would ramble inside strings forever; nudge towards closing tokens
    bias = torch.zeros(vocab.vocab_size)
    for i, tok in enumerate(vocab.tokens):
        if any(c in tok for c in b'"}],') and len(tok) <= 3:
            bias[i] = 4.0
    bias[list(vocab.stop_ids)] = 8.0
    matcher = grammar.matcher()
    mask = allocate_bitmask(1, vocab.vocab_size)
    ids: list[int] = []
    for _ in range(steps):
        matcher.fill(mask, 0)
        bits = ((mask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()
        logits = torch.randn(vocab.vocab_size, generator=gen) + bias
        logits[bits[: vocab.vocab_size] == 0] = float("-inf")
        token = int(torch.argmax(logits))
        if token in vocab.stop_ids:
            break
        matcher.accept(token)
        ids.append(token)
    return str(vocab.decode(ids).decode("utf-8", "replace"))


def _bench(args: list[str]) -> int:
    """The benchmarks are a repository tool (``bench/``), not part of the installed package:
    run in-process when ``bench`` is importable (a checkout on ``sys.path``), else as
    ``python -m bench.NAME`` when the working directory is a checkout, else say where they
    live. Nothing is added to ``sys.path``."""
    if not args or args[0] not in BENCHMARKS:
        print(f"usage: grammask bench {'|'.join(BENCHMARKS)} [options]", file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    try:
        found = importlib.util.find_spec(f"bench.{name}") is not None
    except ImportError:  # no ``bench`` package on sys.path
        found = False
    if found:
        module = importlib.import_module(f"bench.{name}")
        return int(module.main(rest) or 0)
    cwd = Path.cwd()
    if (cwd / "bench" / f"{name}.py").is_file() and (cwd / "src" / "grammask").is_dir():
        # the console script does not put the working directory on sys.path; ``-m`` does
        return subprocess.call([sys.executable, "-m", f"bench.{name}", *rest], cwd=cwd)
    print(f"grammask bench runs from a source checkout: cd into it and run "
          f"python -m bench.{name} ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
