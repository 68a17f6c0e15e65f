"""What the harness checks: items (one spec and its labelled instances) read from the corpus.

Subsets: every ``maskbench/<name>.jsonl.gz`` (``maskbench`` selects them all), ``jsts``
(JSON-Schema-Test-Suite draft 2020-12, core and optional), ``gbnf`` (llama.cpp grammars),
``lark`` (llguidance's Lark grammars and samples), and two derived from maskbench so the
regex and choice oracles run on real-world specs: ``patterns`` (every distinct string
``pattern``, as a regex spec) and ``choices`` (every string ``enum`` of two or more values).
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ItemKind = Literal["json_schema", "regex", "choice", "grammar"]

DERIVED = ("patterns", "choices")
GROUPS = ("maskbench", "jsts", "gbnf", "lark", *DERIVED)


@dataclass(frozen=True)
class Instance:
    """A labelled input. ``data`` is a JSON value (serialized in several forms); ``text`` is
    an exact text fed as is (grammars, regexes, or JSON in one precise spelling)."""

    valid: bool
    data: Any = None
    text: str | None = None
    description: str = ""


@dataclass(frozen=True)
class Item:
    id: str
    subset: str
    kind: ItemKind
    source: Any  # schema (dict/bool) | pattern | list of choices | grammar text
    syntax: str | None = None
    instances: tuple[Instance, ...] = ()


def maskbench_subsets(corpus: Path) -> list[str]:
    return sorted(p.name[: -len(".jsonl.gz")] for p in (corpus / "maskbench").glob("*.jsonl.gz"))


def available_subsets(corpus: Path) -> list[str]:
    return [*maskbench_subsets(corpus), "jsts", "gbnf", "lark", *DERIVED]


def expand_subsets(corpus: Path, names: Iterable[str] | None) -> list[str]:
    """Subset names with ``maskbench`` expanded; ``None`` means every subset."""
    known = available_subsets(corpus)
    if not names:
        return known
    out: list[str] = []
    for name in names:
        picked = maskbench_subsets(corpus) if name == "maskbench" else [name]
        for sub in picked:
            if sub not in known:
                raise ValueError(f"unknown subset {sub!r}; known: {', '.join(known)}")
            if sub not in out:
                out.append(sub)
    return out


def _maskbench(corpus: Path, subset: str) -> Iterator[Item]:
    with gzip.open(corpus / "maskbench" / f"{subset}.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            tests = tuple(Instance(bool(t["valid"]), data=t["data"],
                                   description=str(t.get("description", "")))
                          for t in rec.get("tests", []))
            yield Item(str(rec["id"]), subset, "json_schema", rec["schema"], instances=tests)


def _jsts(corpus: Path) -> Iterator[Item]:
    for part in ("core", "optional"):
        path = corpus / "jsts" / "draft2020-12" / f"{part}.jsonl"
        with path.open(encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                rec = json.loads(line)
                tests = tuple(Instance(bool(t["valid"]), data=t["data"],
                                       description=str(t.get("description", "")))
                              for t in rec["tests"])
                name = rec["file"].removeprefix("draft2020-12/")
                yield Item(f"{name}#{i}: {rec['description']}", "jsts", "json_schema",
                           rec["schema"], instances=tests)


def _gbnf(corpus: Path) -> Iterator[Item]:
    for path in sorted((corpus / "gbnf").glob("*.gbnf")):
        yield Item(path.name, "gbnf", "grammar", path.read_text(encoding="utf-8"), "ebnf")


def _lark(corpus: Path) -> Iterator[Item]:
    d = corpus / "lark"
    for path in sorted(d.glob("*.lark")):
        text = path.read_text(encoding="utf-8")
        instances: list[Instance] = []
        sample = path.with_suffix(".xml")
        if sample.is_file():
            instances.append(Instance(True, text=sample.read_text(encoding="utf-8"),
                                      description=sample.name))
        if path.name == "lark.lark":  # a Lark grammar of Lark: its own text is an instance
            instances.append(Instance(True, text=text, description="its own text"))
        yield Item(path.name, "lark", "grammar", text, "lark", tuple(instances))
    for path in sorted(d.glob("*.gbnf")):
        yield Item(path.name, "lark", "grammar", path.read_text(encoding="utf-8"), "ebnf")
    for path in sorted(d.glob("*.schema.json")):
        sample = d / path.name.replace(".schema.json", ".sample.json")
        instances = []
        if sample.is_file():
            instances.append(Instance(True, data=json.loads(sample.read_text(encoding="utf-8")),
                                      description=sample.name))
        yield Item(path.name, "lark", "json_schema", json.loads(path.read_text(encoding="utf-8")),
                   instances=tuple(instances))


def _walk_schema(node: Any) -> Iterator[dict[str, Any]]:
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            yield cur
            stack.extend(cur.values())
        elif isinstance(cur, list):
            stack.extend(cur)


def _derived(corpus: Path, what: str) -> Iterator[Item]:
    seen: set[str] = set()
    for subset in maskbench_subsets(corpus):
        for item in _maskbench(corpus, subset):
            for node in _walk_schema(item.source):
                if what == "patterns":
                    pat = node.get("pattern")
                    if isinstance(pat, str) and pat not in seen:
                        seen.add(pat)
                        yield Item(f"{item.id}:pattern#{len(seen)}", "patterns", "regex", pat)
                else:
                    enum = node.get("enum")
                    if (isinstance(enum, list) and len(enum) >= 2
                            and all(isinstance(e, str) for e in enum)):
                        key = json.dumps(enum)
                        if key not in seen:
                            seen.add(key)
                            yield Item(f"{item.id}:enum#{len(seen)}", "choices", "choice",
                                       list(enum))


def load_subset(corpus: Path, subset: str) -> list[Item]:
    if subset == "jsts":
        return list(_jsts(corpus))
    if subset == "gbnf":
        return list(_gbnf(corpus))
    if subset == "lark":
        return list(_lark(corpus))
    if subset in DERIVED:
        return list(_derived(corpus, subset))
    return list(_maskbench(corpus, subset))


def load_items(corpus: Path, subsets: Iterable[str] | None, *, sample: int | None,
               seed: int, whole: Iterable[str] = ()) -> list[Item]:
    """Items of the chosen subsets; with ``sample``, a seeded random ``sample`` per subset
    (stratified: every subset keeps its share, small ones are taken whole), except the
    subsets in ``whole``, which are always taken whole."""
    per_subset: list[list[Item]] = []
    keep = set(expand_subsets(corpus, whole)) if whole else set()
    for subset in expand_subsets(corpus, subsets):
        chosen = load_subset(corpus, subset)
        if sample is not None and len(chosen) > sample and subset not in keep:
            chosen = random.Random(f"{seed}:{subset}").sample(chosen, sample)
        per_subset.append(chosen)
    # round-robin across subsets: a run cut short still covers every subset evenly
    items: list[Item] = []
    for rank in range(max((len(c) for c in per_subset), default=0)):
        items.extend(c[rank] for c in per_subset if rank < len(c))
    return items


def read_instances(path: Path, kind: ItemKind) -> tuple[Instance, ...]:
    """``{"valid": bool, "data": ...}`` or ``{"valid": bool, "text": "..."}`` per line.
    For non-JSON specs a string ``data`` is taken as the text."""
    out: list[Instance] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("valid"), bool):
                raise ValueError(f"{path}:{lineno}: expected an object with a boolean 'valid'")
            text = rec.get("text")
            if text is None and kind != "json_schema":
                if not isinstance(rec.get("data"), str):
                    raise ValueError(f"{path}:{lineno}: a {kind} instance needs a string "
                                     "'text' (or 'data')")
                text = rec["data"]
            out.append(Instance(rec["valid"], data=rec.get("data"), text=text,
                                description=str(rec.get("description", f"line {lineno}"))))
    return tuple(out)
