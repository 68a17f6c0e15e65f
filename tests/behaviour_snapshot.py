"""Behaviour snapshot for the package reorganisation (issue 46): run before and after the move.

    .venv/bin/python -m tests.behaviour_snapshot --out FILE.json [--limit N]

The two outputs must be byte-identical. The script uses only ``import grammask`` and the names
``grammask/__init__.py`` exports (``Compiler``, ``GrammarSpec``, ``BatchProcessor``, ``route``,
the errors, ``load_vocabulary``, ``allocate_bitmask``), so the same file runs on both layouts.

What it records, for a deterministic sample of the corpus (``../shared/corpus``, or
``$GRAMMASK_CORPUS``) and deterministic mutants of every sampled input:

- the route (``grammask.route``: backend, reason, unenforced, lenient, fallback, features
  with their JSON pointers) and the compiler's plan (attempts, hedge), or the error raised;
- the admission check (``Compiler.check``) and the compile outcome, on auto routing and on
  each backend forced through the spec's ``backend`` option: the serving backend, its reason
  and gaps, or the error class, message and ``where`` (JSON pointer, offset, line);
- for each compiled grammar, the masks along sampled walks through a matcher (at each step:
  the number of allowed tokens, the token taken and the sha256 of the bitmask row), the
  first taking the lowest allowed id, the others a seeded choice among the sorted ids;
- one ``BatchProcessor`` run (precompiled grammars, seeded logits, argmax sampling): per
  step and row, the token taken and the sha256 of which logits were masked.

No timings, addresses or paths; keys sorted. The tokenizer is the real Qwen2.5 one.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import grammask

SEED = 46
ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("GRAMMASK_CORPUS", ROOT.parent / "shared" / "corpus"))
BACKENDS = ("xgrammar", "llguidance")
#: maskbench schemas per subset (21 subsets), JSON-Schema-Test-Suite groups per file
PER_SUBSET = 4
PER_JSTS_FILE = 4
MAX_SCHEMA_CHARS = 12_000
MUTANTS_PER_SCHEMA = 4
#: open objects only on small schemas: xgrammar's non-strict mode takes up to a minute on
#: large ones (a snapshot of minutes, not of behaviour)
OPEN_MAX_CHARS = 3_000
#: walks per compiled base spec and their length; mutants get one short walk
WALKS, WALK_LEN = 3, 20
MUTANT_WALK_LEN = 8
BATCH_ROWS, BATCH_STEPS = 12, 16
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_TMP = re.compile(r"/tmp/[^\s'\"]*")


# ------------------------------------------------------------------------- inputs
class Case:
    """One input: how to build its spec (per backend option), and what it is."""

    def __init__(self, name: str, kind: str, make: Callable[[str | None], Any],
                 base: bool) -> None:
        self.name = name
        self.kind = kind
        self.make = make
        self.base = base


def _json_case(name: str, schema: Any, base: bool, **options: Any) -> Case:
    def make(backend: str | None) -> Any:
        return grammask.GrammarSpec.json_schema(schema, backend=backend, **options)
    return Case(name, "json_schema", make, base)


def _grammar_case(name: str, source: str, syntax: Any, base: bool) -> Case:
    def make(backend: str | None) -> Any:
        return grammask.GrammarSpec.grammar(source, syntax=syntax, backend=backend)
    return Case(name, f"grammar:{syntax}", make, base)


def _regex_case(name: str, pattern: str, base: bool) -> Case:
    def make(backend: str | None) -> Any:
        return grammask.GrammarSpec.regex(pattern, backend=backend)
    return Case(name, "regex", make, base)


def _choice_case(name: str, choices: list[str], base: bool) -> Case:
    def make(backend: str | None) -> Any:
        return grammask.GrammarSpec.choice(choices, backend=backend)
    return Case(name, "choice", make, base)


def maskbench_schemas(rng: random.Random) -> Iterator[tuple[str, Any]]:
    for path in sorted((CORPUS / "maskbench").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            items = [json.loads(line) for line in fh if line.strip()]
        fits = [i for i in items if len(json.dumps(i["schema"])) <= MAX_SCHEMA_CHARS]
        subset = path.name.removesuffix(".jsonl.gz")
        for n in sorted(rng.sample(range(len(fits)), min(PER_SUBSET, len(fits)))):
            yield f"maskbench/{subset}/{fits[n]['id']}", fits[n]["schema"]


def jsts_schemas(rng: random.Random) -> Iterator[tuple[str, Any]]:
    for path in sorted((CORPUS / "jsts").glob("*/*.jsonl")):
        with path.open(encoding="utf-8") as fh:
            groups = [json.loads(line) for line in fh if line.strip()]
        for n in sorted(rng.sample(range(len(groups)), min(PER_JSTS_FILE, len(groups)))):
            g = groups[n]
            yield f"jsts/{g['file']}#{n}", g["schema"]


REGEXES = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "email": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4}",
    "words": r"(foo|bar|baz)( (foo|bar|baz)){0,5}",
    "hex": r"0x[0-9a-fA-F]{1,8}",
}
REGEX_MUTANTS = {
    "unbalanced": "(",
    "bad_class": "]",
    "bad_repeat": "{2,1}",
    "dangling": "\\",
}
CHOICES = {
    "colours": ["red", "green", "blue", "ultraviolet"],
    "answers": ["yes", "no", "maybe so", "I don't know"],
}


def build_cases(limit: int | None) -> list[Case]:
    rng = random.Random(SEED)
    schemas = list(maskbench_schemas(rng)) + list(jsts_schemas(rng))
    blog = CORPUS / "lark" / "blog.schema.json"
    schemas.append(("lark/blog.schema.json", json.loads(blog.read_text(encoding="utf-8"))))
    grammars = [(f"gbnf/{p.name}", p.read_text(encoding="utf-8"), "ebnf")
                for p in sorted((CORPUS / "gbnf").glob("*.gbnf"))]
    grammars += [("lark/vllm-sql.gbnf",
                  (CORPUS / "lark" / "vllm-sql.gbnf").read_text(encoding="utf-8"), "ebnf")]
    grammars += [(f"lark/{p.name}", p.read_text(encoding="utf-8"), "lark")
                 for p in sorted((CORPUS / "lark").glob("*.lark"))]
    if limit is not None:
        schemas = schemas[:limit]
        grammars = grammars[:max(1, limit // 10)]
    cases: list[Case] = []
    for name, schema in schemas:
        cases.append(_json_case(name, schema, True))
        for label, mutant, options in schema_mutants(schema, rng):
            cases.append(_json_case(f"{name}~{label}", mutant, False, **options))
    for name, source, syntax in grammars:
        cases.append(_grammar_case(name, source, syntax, True))
        for label, mutant in grammar_mutants(source, syntax, rng):
            cases.append(_grammar_case(f"{name}~{label}", mutant, syntax, False))
    regexes = sorted(REGEXES.items())
    if limit is not None:
        regexes = regexes[:2]
    for name, pattern in regexes:
        cases.append(_regex_case(f"regex/{name}", pattern, True))
        label, broken = sorted(REGEX_MUTANTS.items())[rng.randrange(len(REGEX_MUTANTS))]
        cases.append(_regex_case(f"regex/{name}~{label}", pattern + broken, False))
    for name, choices in sorted(CHOICES.items()):
        cases.append(_choice_case(f"choice/{name}", choices, True))
    cases.append(_choice_case("choice/empty~empty", [], False))
    return cases


# ------------------------------------------------------------------------- mutants
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
        "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _nodes(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema (object form), in document order, with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key, value in schema.items():
        here = f"{pointer}/{_escape(key)}"
        if key in _MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _nodes(sub, f"{here}/{_escape(name)}")
        elif key in _LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _nodes(sub, f"{here}/{i}")
        elif key in _ONE:
            yield from _nodes(value, here)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _at(schema: Any, pointer: str) -> Any:
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


_OTHER_TYPE = {"string": "integer", "integer": "string", "number": "boolean",
               "boolean": "number", "object": "array", "array": "object", "null": "string"}


def _pick(rng: random.Random, nodes: list[tuple[str, dict[str, Any]]],
          test: Callable[[dict[str, Any]], bool]) -> str | None:
    fits = [p for p, n in nodes if test(n)]
    return fits[rng.randrange(len(fits))] if fits else None


def _mutate(kind: str, schema: Any, rng: random.Random) -> tuple[Any, dict[str, Any]] | None:
    """One mutant of ``kind`` (a deep copy), or None where the kind does not apply."""
    out = copy.deepcopy(schema)
    if not isinstance(out, dict):
        return None
    nodes = list(_nodes(out))
    options: dict[str, Any] = {}
    if kind == "drop_required":
        p = _pick(rng, nodes, lambda n: isinstance(n.get("required"), list) and n["required"])
        if p is None:
            return None
        node = _at(out, p)
        node["required"] = node["required"][1:]
    elif kind == "require_undeclared":
        p = _pick(rng, nodes, lambda n: isinstance(n.get("properties"), dict))
        if p is None:
            return None
        node = _at(out, p)
        node["required"] = [*node.get("required", []), "zz_not_declared"]
    elif kind == "change_type":
        p = _pick(rng, nodes, lambda n: isinstance(n.get("type"), str)
                  and n["type"] in _OTHER_TYPE)
        if p is None:
            return None
        node = _at(out, p)
        node["type"] = _OTHER_TYPE[node["type"]]
    elif kind == "invalid_type":
        p = _pick(rng, nodes, lambda n: "type" in n)
        if p is None:
            return None
        _at(out, p)["type"] = "strnig"
    elif kind == "unknown_keyword":
        p = _pick(rng, nodes, lambda n: True)
        _at(out, p or "")["x-snapshot-unknown"] = {"nested": True}
    elif kind == "unsupported_keyword":
        p = _pick(rng, nodes, lambda n: n.get("type") in ("object", "array"))
        if p is None:
            return None
        node = _at(out, p)
        if node["type"] == "array":
            node["uniqueItems"] = True
        else:
            node["unevaluatedProperties"] = False
    elif kind == "broken_ref":
        p = _pick(rng, nodes, lambda n: "type" in n)
        if p is None:
            return None
        _at(out, p)["$ref"] = "#/$defs/zz_missing"
    elif kind == "remote_ref":
        p = _pick(rng, nodes, lambda n: "type" in n)
        if p is None:
            return None
        _at(out, p)["$ref"] = "http://example.com/schemas/zz.json"
    elif kind == "bad_pattern":
        p = _pick(rng, nodes, lambda n: n.get("type") == "string")
        if p is None:
            return None
        _at(out, p)["pattern"] = "^([a-z]+$"
    elif kind == "bad_value":
        p = _pick(rng, nodes, lambda n: n.get("type") in ("string", "array", "integer"))
        if p is None:
            return None
        node = _at(out, p)
        key = {"string": "minLength", "array": "minItems", "integer": "minimum"}[node["type"]]
        node[key] = -1 if key != "minimum" else "zero"
    elif kind == "empty_enum":
        p = _pick(rng, nodes, lambda n: n.get("type") in ("string", "integer"))
        if p is None:
            return None
        _at(out, p)["enum"] = []
    elif kind == "strict":
        options = {"strict": True}
    elif kind == "open_objects":
        if len(json.dumps(schema)) > OPEN_MAX_CHARS:
            return None
        options = {"extra_properties": True}
    elif kind == "compact":
        options = {"any_whitespace": False}
    else:  # pragma: no cover
        raise ValueError(kind)
    return out, options


MUTATIONS = ("drop_required", "require_undeclared", "change_type", "invalid_type",
             "unknown_keyword", "unsupported_keyword", "broken_ref", "remote_ref",
             "bad_pattern", "bad_value", "empty_enum", "strict", "open_objects", "compact")


def schema_mutants(schema: Any, rng: random.Random
                   ) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    kinds = list(MUTATIONS)
    rng.shuffle(kinds)
    made = 0
    for kind in kinds:
        if made == MUTANTS_PER_SCHEMA:
            return
        found = _mutate(kind, schema, rng)
        if found is not None:
            made += 1
            yield kind, found[0], found[1]


def grammar_mutants(source: str, syntax: str, rng: random.Random) -> Iterator[tuple[str, str]]:
    lines = source.splitlines()
    rule = next((i for i, line in enumerate(lines)
                 if ("::=" in line or (syntax == "lark" and ":" in line))
                 and not line.lstrip().startswith(("#", "//"))), 0)
    broken = list(lines)
    broken[rule] = broken[rule] + " zz_undefined_rule"
    yield "undefined_rule", "\n".join(broken)
    cut = rng.randrange(len(source) // 4, max(len(source) // 4 + 1, len(source) * 3 // 4))
    yield "truncated_paren", source[:cut] + " ( \n"


# ------------------------------------------------------------------------- recording
def _clean(text: str) -> str:
    return _TMP.sub("/tmp/?", _ADDRESS.sub("0x?", text))


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__,
            "message": _clean(str(getattr(exc, "message", exc))),
            "where": getattr(exc, "where", None)}


def _name(value: Any) -> Any:
    return getattr(value, "value", value) if value is not None else None


def _route(route: Any) -> dict[str, Any]:
    features = getattr(route, "features", None) or {}
    return {
        "backend": route.backend,
        "reason": _clean(route.reason),
        "unenforced": list(getattr(route, "unenforced", ())),
        "lenient": getattr(route, "lenient", None),
        "fallback": getattr(route, "fallback", None),
        "features": {str(_name(k)): v for k, v in sorted(features.items(),
                                                         key=lambda kv: str(_name(kv[0])))},
    }


def _attempt(a: Any) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"backend": a.backend, "lenient": getattr(a, "lenient", None),
            "unenforced": list(getattr(a, "unenforced", ())),
            "budget": getattr(a, "budget", None), "slot_budget": getattr(a, "slot_budget", None),
            "skip_busy": getattr(a, "skip_busy", None),
            "after": sorted(getattr(a, "after", ()))}


def _plan(p: Any) -> dict[str, Any]:
    return {"route": _route(p.route), "attempts": [_attempt(a) for a in p.attempts],
            "hedge": _attempt(getattr(p, "hedge", None))}


def _safely(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except grammask.CompileFailure as exc:
        return _error(exc)


class Walker:
    """Masks along sampled walks through a matcher."""

    def __init__(self, vocab: grammask.Vocabulary) -> None:
        self.vocab = vocab
        self.size = vocab.vocab_size
        self.stops = frozenset(vocab.stop_ids)
        self.bitmask = grammask.allocate_bitmask(1, self.size)

    def mask(self, matcher: Any) -> tuple[list[int], str]:
        self.bitmask.fill_(0)
        matcher.fill(self.bitmask, 0)
        digest = hashlib.sha256(self.bitmask[0].numpy().tobytes()).hexdigest()
        bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:self.size]).tolist(), digest

    def walk(self, grammar: Any, steps: int, rng: random.Random | None) -> dict[str, Any]:
        matcher = grammar.matcher()
        out: list[list[Any]] = []
        end = "length"
        try:
            for _ in range(steps):
                allowed, digest = self.mask(matcher)
                text = [t for t in sorted(allowed) if t not in self.stops]
                if not text:
                    token = min(allowed) if allowed else -1
                else:
                    token = text[0] if rng is None else text[rng.randrange(len(text))]
                ok = token >= 0 and matcher.accept(token)
                out.append([len(allowed), token, digest, ok])
                if not ok:
                    end = "rejected" if token >= 0 else "empty"
                    break
                if matcher.is_terminated():
                    end = "terminated"
                    break
            final = {"can_terminate": matcher.can_terminate(),
                     "terminated": matcher.is_terminated()}
        finally:
            matcher.release()
        return {"steps": out, "end": end, **final}

    def walks(self, grammar: Any, count: int, steps: int, seed: str) -> list[dict[str, Any]]:
        found = [self.walk(grammar, steps, None)]
        for i in range(1, count):
            found.append(self.walk(grammar, steps, random.Random(f"{seed}/{i}")))
        return found


def _compiled(grammar: Any) -> dict[str, Any]:
    return {"backend": grammar.backend, "reason": _clean(grammar.reason),
            "unenforced": list(grammar.unenforced), "fallback_from": grammar.fallback_from}


def record_case(case: Case, compiler: Any, walker: Walker,
                batch: list[tuple[str, Any]]) -> dict[str, Any]:
    rec: dict[str, Any] = {"kind": case.kind, "base": case.base, "modes": {}}
    for mode in ("auto", *BACKENDS):
        try:
            spec = case.make(None if mode == "auto" else mode)
        except grammask.CompileFailure as exc:
            rec["modes"][mode] = {"spec": _error(exc)}
            continue
        entry: dict[str, Any] = {"spec": {"key": spec.key}}
        entry["route"] = _safely(lambda: _route(grammask.route(spec)))  # noqa: B023
        entry["plan"] = _safely(lambda: _plan(compiler.plan(spec)))  # noqa: B023
        entry["check"] = _safely(lambda: _attempt(compiler.check(spec)))  # noqa: B023
        try:
            grammar = compiler.compile(spec)
        except grammask.CompileFailure as exc:
            entry["compile"] = _error(exc)
        else:
            entry["compile"] = _compiled(grammar)
            if case.base:
                entry["walks"] = walker.walks(grammar, WALKS, WALK_LEN, f"{case.name}/{mode}")
                if mode != "auto":
                    batch.append((f"{case.name}/{mode}", grammar))
            else:
                entry["walks"] = walker.walks(grammar, 1, MUTANT_WALK_LEN, case.name)
        rec["modes"][mode] = entry
    return rec


def record_batch(compiler: Any, grammars: list[tuple[str, Any]]) -> dict[str, Any]:
    """One BatchProcessor over precompiled grammars: seeded logits, argmax sampling."""
    vocab = compiler.vocab
    rng = random.Random(SEED)
    chosen = sorted(rng.sample(range(len(grammars)), min(BATCH_ROWS, len(grammars))))
    rows = [grammars[i] for i in chosen]
    proc = grammask.BatchProcessor(compiler, max_batch=len(rows), wait_s=120.0,
                                   hedge_s=60.0, think_end=None)
    gen = torch.Generator().manual_seed(SEED)
    steps: list[dict[str, Any]] = []
    try:
        for row, (_, grammar) in enumerate(rows):
            proc.add(row, grammar.spec, grammar=grammar)
        for _ in range(BATCH_STEPS):
            proc.step()
            logits = torch.randn(len(rows), vocab.vocab_size, generator=gen)
            proc.apply(logits)
            masked = torch.isinf(logits)
            tokens = logits.argmax(dim=-1).tolist()
            steps.append({
                "masked": [hashlib.sha256(masked[r].numpy().tobytes()).hexdigest()
                           for r in range(len(rows))],
                "allowed": [int((~masked[r]).sum()) for r in range(len(rows))],
                "tokens": tokens,
                "errors": {str(k): _clean(v) for k, v in sorted(proc.errors.items())},
            })
            for row, token in enumerate(tokens):
                proc.advance(row, [token])
    finally:
        proc.close()
    return {"rows": [name for name, _ in rows], "steps": steps}


def snapshot(limit: int | None, progress: bool = False) -> dict[str, Any]:
    t0 = time.monotonic()  # progress lines only, never in the snapshot
    torch.manual_seed(SEED)
    vocab = grammask.load_vocabulary("qwen2.5")
    compiler = grammask.Compiler(vocab, timeout_s=300, tune_fill=False, max_workers=2)
    walker = Walker(vocab)
    cases = build_cases(limit)
    batch: list[tuple[str, Any]] = []
    specs: dict[str, Any] = {}
    try:
        for n, case in enumerate(cases):
            if case.name in specs:
                raise SystemExit(f"duplicate case name {case.name}")
            specs[case.name] = record_case(case, compiler, walker, batch)
            if progress:
                print(f"[{n + 1}/{len(cases)}] {time.monotonic() - t0:.1f}s {case.name}",
                      file=sys.stderr, flush=True)
        batch_record = record_batch(compiler, batch)
        if progress:
            print(f"batch done {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    finally:
        compiler.close()
    return {"version": 1, "vocab_size": vocab.vocab_size, "specs": specs,
            "batch": batch_record, "summary": summarize(specs)}


def summarize(specs: dict[str, Any]) -> dict[str, Any]:
    errors: dict[str, int] = {}
    walks = compiled = 0
    for rec in specs.values():
        for entry in rec["modes"].values():
            for stage in ("spec", "route", "compile"):
                found = entry.get(stage) or {}
                if "error" in found:
                    label = f"{stage}:{found['error']}"
                    errors[label] = errors.get(label, 0) + 1
            if "walks" in entry:
                compiled += 1
                walks += len(entry["walks"])
    return {"cases": len(specs), "base": sum(r["base"] for r in specs.values()),
            "mutants": sum(not r["base"] for r in specs.values()),
            "compiled": compiled, "walks": walks, "errors": dict(sorted(errors.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the snapshot (JSON)")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N schemas (and a few grammars): a quick run")
    parser.add_argument("--progress", action="store_true", help="name each case on stderr")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # the compiler's warnings (fallbacks, gaps) are in the snapshot already
    logging.getLogger("grammask").setLevel(logging.ERROR)
    result = snapshot(args.limit, args.progress)
    text = json.dumps(result, sort_keys=True, indent=1, ensure_ascii=True) + "\n"
    Path(args.out).write_text(text, encoding="utf-8")
    print(json.dumps(result["summary"], sort_keys=True), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
