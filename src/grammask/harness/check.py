"""Checking one item on one backend: compile, feed its instances, sample and audit, judge.

Runs inside a worker process (see ``runner``): one ``Checker`` holds the vocabulary, a fresh
``Compiler`` and the token table for the worker's lifetime, so the vocabulary and
backend-tokenizer setup (seconds: docs/benchmarks.md, Figures: start-up) is paid once per
worker, not per item.

Semantics (the report's columns):
- a valid instance is *accepted* when some serialization of it (``compact``:
  ``json.dumps(x, separators=(",", ":"), ensure_ascii=False)``; ``default``: ``json.dumps(x)``,
  ASCII escapes and ``", "``/``": "``) is accepted token by token (canonical tokenization)
  and a stop token is then allowed; which forms pass is counted per form;
- an invalid instance is *rejected* when every form is refused before it completes (a token
  or the final stop token refused); one accepted form is an under-constraint;
- a sampled output is a finished random walk under the mask; it must pass the item's oracle.
JSON schemas run the way grammask serves them by default: objects closed
(``extra_properties=False``, OpenAI strict mode). The labels come from a JSON Schema validator
(undeclared keys allowed), so a refused valid instance carrying a key that no ``properties``
anywhere in the schema declares is counted as ``over_closed`` (by design), not as ``over``;
one accepted once its keys are put in the schema's declared order is ``over_order`` (both
backends fix the property order; JSON Schema does not).
``--open-objects`` checks plain JSON Schema semantics instead (xgrammar compiles open objects
far more slowly: docs/benchmarks.md, Figures: compile routing).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..backends import get_backend, registry
from ..compile.compiler import Compiler, Grammar
from ..errors import CompileFailure, CompileTimeoutError, GrammarError
from ..specs.grammar_spec import BackendName, GrammarSpec
from ..vocab import Vocabulary, load_vocabulary
from .corpus import Instance, Item
from .diff import DiffReport, Judge, differential
from .oracles import (
    ChoiceOracle,
    JsonOracle,
    LarkOracle,
    RegexOracle,
    Verdict,
    local_registry,
)
from .walk import (
    AuditReport,
    MaskReader,
    PrefixOracle,
    ProbeReport,
    TokenTable,
    feed,
    probe_walk,
    random_walk,
    token_table,
)

MAX_ROW_EXAMPLES = 5
Emit = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class CheckConfig:
    """How hard to look (picklable: it travels to the workers). ``walks`` sampled outputs
    per spec and backend, each at most ``max_tokens`` long and ``walk_budget_s`` seconds;
    ``audit_steps`` audited steps per walk offering ``audit_tokens`` allowed and as many
    forbidden tokens; the differential resolves ``resolve`` differing tokens per compared
    step within ``diff_budget_s`` seconds per item."""

    tokenizer: str = "qwen2.5"
    timeout_s: float = 10.0
    walks: int = 2
    max_tokens: int = 256
    audit_steps: int = 3
    audit_tokens: int = 2000
    forms: tuple[str, ...] = ("compact", "default")
    any_whitespace: bool = True
    extra_properties: bool = False
    mask_instances: bool = True
    diff: bool = True
    resolve: int = 2
    walk_budget_s: float = 15.0
    diff_budget_s: float = 20.0
    seed: int = 0
    remotes: str | None = None
    reuse_auto: bool = True
    #: the dead-end probe (``walk.probe_walk``): states per walk, allowed tokens per state
    #: (one per distinct first byte), tokens per finishing walk; 0 states: off
    probe_states: int = 2
    probe_tokens: int = 8
    probe_depth: int = 160


@dataclass
class ItemOracle:
    """What an item can be judged by: a complete-output judge, maybe a prefix oracle."""

    name: str
    judge: Judge | None = None
    prefix: PrefixOracle | None = None
    json: JsonOracle | None = None
    error: str = ""


@dataclass
class Row:
    """One spec on one backend: what the report's table and JSON rows are made of."""

    subset: str
    id: str
    kind: str
    backend: str
    status: str = "ok"  # ok | compile_error | invalid_spec | timeout | crash | harness_error
    error: str = ""
    served_by: str = ""
    reason: str = ""
    unenforced: list[str] = field(default_factory=list)
    compile_ms: float = 0.0
    oracle: str = ""
    valid_total: int = 0
    valid_accepted: int = 0
    valid_forms_total: dict[str, int] = field(default_factory=dict)
    valid_forms_accepted: dict[str, int] = field(default_factory=dict)
    over: int = 0  # valid (label and oracle) instances refused in every form
    over_label: int = 0  # refused valid-labelled instances our validator calls invalid
    over_closed: int = 0  # refused because of an undeclared key while objects are closed
    over_order: int = 0  # accepted once its keys are in declared order (backends' choice)
    invalid_total: int = 0
    invalid_rejected: int = 0
    under: int = 0  # invalid instances accepted in some form
    under_known: int = 0  # ... where a declared unenforced keyword explains it
    under_label: int = 0  # ... where our validator calls the instance valid
    label_disagree: int = 0
    instances_skipped: int = 0
    samples_total: int = 0
    samples_valid: int = 0
    samples_invalid: int = 0
    samples_known_gap: int = 0
    samples_unfinished: int = 0
    samples_unchecked: int = 0
    samples_truncated: int = 0  # ended by stepping back to where the grammar could end
    probe_states: int = 0  # states the dead-end probe looked at
    probe_tokens: int = 0  # allowed tokens it took there
    dead_ends: int = 0  # ... after which no finishing walk ended
    invalid_ends: int = 0  # ... after which the ending failed the oracle outside the gaps
    probe_unfinished: int = 0  # ... after which no try ended within its tokens (no finding)
    instances_ms: float = 0.0
    samples_ms: float = 0.0
    audit: dict[str, Any] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    recycle: bool = False
    reused_from: str = ""  # auto's row copied from the forced row of the very same grammar

    @property
    def compiled(self) -> bool:
        return self.status == "ok"

    def example(self, **fields: Any) -> None:
        if len(self.examples) < MAX_ROW_EXAMPLES:
            self.examples.append(fields)


def seed_for(cfg: CheckConfig, *parts: object) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, *(zlib.crc32(str(p).encode()) for p in parts)])


def spec_for(item: Item, backend: str, cfg: CheckConfig) -> GrammarSpec:
    forced: BackendName | None = None if backend == "auto" else backend
    if item.kind == "json_schema":
        return GrammarSpec.json_schema(item.source, any_whitespace=cfg.any_whitespace,
                                       extra_properties=cfg.extra_properties, backend=forced)
    if item.kind == "regex":
        return GrammarSpec.regex(item.source, backend=forced)
    if item.kind == "choice":
        return GrammarSpec.choice(item.source, backend=forced)
    return GrammarSpec.grammar(item.source, item.syntax, backend=forced)  # type: ignore[arg-type]


def forms_of(inst: Instance, kind: str, cfg: CheckConfig) -> list[tuple[str, str]]:
    """The texts an instance is fed as (see the module docstring)."""
    if inst.text is not None:
        return [("text", inst.text)]
    if kind != "json_schema":
        return []
    out: list[tuple[str, str]] = []
    for form in cfg.forms if cfg.any_whitespace else ("compact",):
        try:
            if form == "compact":
                text = json.dumps(inst.data, separators=(",", ":"), ensure_ascii=False,
                                  allow_nan=False)
            else:
                text = json.dumps(inst.data, allow_nan=False)
        except ValueError:
            continue
        out.append((form, text))
    return out


class Checker:
    """A worker's state: one vocabulary, one Compiler, one token table."""

    def __init__(self, cfg: CheckConfig, vocab: Vocabulary | None = None) -> None:
        self.cfg = cfg
        self.vocab = vocab if vocab is not None else load_vocabulary(cfg.tokenizer)
        for name in registry.names():
            get_backend(name).prepare(self.vocab)
        self.compiler = Compiler(self.vocab, timeout_s=cfg.timeout_s, max_workers=1,
                             negative_ttl_s=0.0)
        self.table: TokenTable = token_table(self.vocab)
        self.reader = MaskReader(self.vocab.vocab_size)
        self.registry = local_registry(Path(cfg.remotes) if cfg.remotes else None)

    def close(self) -> None:
        self.compiler.close()

    # ------------------------------------------------------------------------ oracles
    def oracle_for(self, item: Item) -> ItemOracle:
        try:
            if item.kind == "json_schema":
                js = JsonOracle(item.source, registry=self.registry)
                return ItemOracle("jsonschema", judge=js.check, json=js)
            if item.kind == "regex":
                rx = RegexOracle(item.source)
                return ItemOracle("regex", judge=complete_judge(rx), prefix=rx)
            if item.kind == "choice":
                ch = ChoiceOracle(item.source)
                return ItemOracle("choice", judge=complete_judge(ch), prefix=ch)
            lk = LarkOracle(item.source, item.syntax or "lark")
            return ItemOracle("lark" if item.syntax == "lark" else "lark (own GBNF translation)",
                              judge=lambda data, _gaps: lk.parses(data))
        except Exception as exc:  # the oracle cannot read this spec: say so, check the rest
            return ItemOracle("none", error=f"{type(exc).__name__}: {exc}"[:300])

    # ------------------------------------------------------------------------- items
    def check(self, item: Item, backends: tuple[str, ...], emit: Emit, *,
              diff: bool = True) -> None:
        """Check ``item`` on each backend, emitting ``start``/``row`` messages as it goes
        (so a hang or crash later loses only what was still running), then ``diff``."""
        oracle = self.oracle_for(item)
        disagree = label_disagreements(item, oracle)
        compiled: dict[str, Grammar] = {}
        rows: dict[str, Row] = {}
        try:
            for label in backends:
                emit("start", {"backend": label})
                reused = self.reused_auto_row(item, rows) if label == "auto" else None
                row, grammar = (reused, None) if reused else self.check_backend(
                    item, label, oracle)
                rows[label] = row
                row.label_disagree = disagree
                if grammar is not None and label != "auto":
                    compiled[label] = grammar
                emit("row", asdict(row))
            pair = [compiled[b] for b in registry.names() if b in compiled][:2]
            if diff and self.cfg.diff and len(pair) == 2:  # the first two registered
                emit("start", {"backend": "diff"})
                emit("diff", self.differential(item, pair[0], pair[1], oracle))
        finally:
            self.compiler.clear()

    def reused_auto_row(self, item: Item, rows: dict[str, Row]) -> Row | None:
        """Auto's row when auto routes to a backend whose forced row was already checked with
        the very same compiled grammar (same backend, same lenient flag, same gaps: the
        backend compile depends on nothing else). Checking it again would repeat the same
        walks; a fallback, a failed forced row or a different mode is checked for real."""
        if not self.cfg.reuse_auto:
            return None
        try:
            spec = spec_for(item, "auto", self.cfg)
            decision = self.compiler.route(spec)
            forced = self.compiler.route(spec.with_backend(decision.backend))
        except GrammarError:
            return None
        base = rows.get(decision.backend)
        if (base is None or not base.compiled or forced.lenient != decision.lenient
                or set(forced.unenforced) != set(decision.unenforced)):
            return None
        return replace(base, backend="auto", reason=decision.reason,
                       reused_from=decision.backend, examples=list(base.examples))

    def check_backend(self, item: Item, label: str, oracle: ItemOracle
                      ) -> tuple[Row, Grammar | None]:
        row = Row(item.subset, item.id, item.kind, label, oracle=oracle.name)
        if oracle.error:
            row.oracle = f"none ({oracle.error})"
        count_instances(row, item, self.cfg)
        try:
            spec = spec_for(item, label, self.cfg)
        except GrammarError as exc:
            row.status, row.error = "invalid_spec", exc.message[:300]
            return row, None
        started = time.perf_counter()
        try:
            grammar = self.compiler.compile(spec)
        except CompileTimeoutError as exc:
            row.status, row.error, row.recycle = "timeout", exc.message[:300], True
            return row, None
        except CompileFailure as exc:
            row.status, row.error = "compile_error", exc.message[:300]
            return row, None
        row.compile_ms = round((time.perf_counter() - started) * 1000, 3)
        row.served_by, row.reason = grammar.backend, grammar.reason
        row.unenforced = list(grammar.unenforced)
        if label != "auto" and grammar.backend != label:
            row.status, row.error = "compile_error", f"served by {grammar.backend}"
            return row, None
        self.check_grammar(row, item, grammar, oracle)
        return row, grammar

    def check_grammar(self, row: Row, item: Item, grammar: Grammar, oracle: ItemOracle
                      ) -> None:
        """Instances, sampled outputs and audits of one compiled grammar, into ``row``
        (public so a test can hand in a deliberately broken grammar)."""
        audit = AuditReport()
        t0 = time.perf_counter()
        self._instances(row, item, grammar, oracle, audit)
        t1 = time.perf_counter()
        self._samples(row, item, grammar, oracle, audit)
        row.instances_ms = round((t1 - t0) * 1000, 1)
        row.samples_ms = round((time.perf_counter() - t1) * 1000, 1)
        row.audit = audit.as_dict()

    def _instances(self, row: Row, item: Item, grammar: Grammar, oracle: ItemOracle,
                   audit: AuditReport) -> None:
        reader = self.reader if self.cfg.mask_instances else None
        for idx, inst in enumerate(item.instances):
            forms = forms_of(inst, item.kind, self.cfg)
            accepted: dict[str, bool] = {}
            where = ""
            for form, text in forms:
                try:
                    ids = self.vocab.encode(text)
                except Exception:  # lone surrogates cannot be tokenized as raw text
                    continue
                result = feed(grammar.matcher(), self.table, ids,
                              reader if inst.valid else None, audit)
                accepted[form] = result.accepted
                where = where or result.context
            if not accepted:
                continue
            if inst.valid:
                for form, ok in accepted.items():
                    row.valid_forms_accepted[form] = row.valid_forms_accepted.get(form, 0) + ok
                if any(accepted.values()):
                    row.valid_accepted += 1
                    continue
                label_ok = _oracle_valid(oracle, inst)
                if label_ok is False:
                    row.over_label += 1
                elif self._accepts_reordered(item, inst, grammar, audit):
                    row.over_order += 1
                    continue
                elif (not self.cfg.extra_properties and item.kind == "json_schema"
                      and inst.text is None and undeclared_keys(item.source, inst.data)):
                    row.over_closed += 1
                    continue
                else:
                    row.over += 1
                row.example(what="valid instance refused", instance=idx,
                            forms=sorted(accepted), oracle_agrees=label_ok, at=where[-80:])
            elif any(accepted.values()):
                verdict = _oracle_verdict(oracle, inst, tuple(grammar.unenforced))
                row.under += 1
                if verdict is not None and verdict.valid:
                    row.under_label += 1
                elif verdict is not None and verdict.known_gap:
                    row.under_known += 1
                row.example(what="invalid instance accepted", instance=idx,
                            forms=[f for f, ok in accepted.items() if ok],
                            why=verdict.detail if verdict else "", known_gap=bool(
                                verdict and verdict.known_gap))
            else:
                row.invalid_rejected += 1

    def _accepts_reordered(self, item: Item, inst: Instance, grammar: Grammar,
                           audit: AuditReport) -> bool:
        """Both backends emit (and accept) properties only in the schema's declared order,
        which JSON Schema does not require: a valid instance accepted once its keys are put
        in that order is refused by design (``over_order``), not over-constrained."""
        if item.kind != "json_schema" or inst.text is not None:
            return False
        ordered = reorder_keys(inst.data, declared_order(item.source))
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        if text == json.dumps(inst.data, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False):
            return False
        try:
            ids = self.vocab.encode(text)
        except Exception:
            return False
        return feed(grammar.matcher(), self.table, ids, None, audit).accepted

    def _samples(self, row: Row, item: Item, grammar: Grammar, oracle: ItemOracle,
                 audit: AuditReport) -> None:
        cfg = self.cfg
        probe = ProbeReport()
        try:
            for w in range(cfg.walks):
                self._sample(row, grammar, oracle, audit, probe, w)
        finally:
            row.probe_states, row.probe_tokens = probe.states, probe.tokens
            row.dead_ends, row.invalid_ends = probe.dead_ends, probe.invalid_ends
            row.probe_unfinished = probe.unfinished
            for ex in probe.examples:
                row.example(what=f"dead-end probe: {ex.pop('kind')}", **ex)

    def _sample(self, row: Row, grammar: Grammar, oracle: ItemOracle, audit: AuditReport,
                probe: ProbeReport, w: int) -> None:
        """One sampled walk, judged, and the dead-end probe along it."""
        cfg = self.cfg
        rng = seed_for(cfg, row.id, row.backend, w)
        free, steps = _walk_plan(rng, cfg)
        walk = random_walk(grammar.matcher(), self.table, self.reader, rng,
                           max_tokens=cfg.max_tokens, free_steps=free, audit_steps=steps,
                           audit_tokens=cfg.audit_tokens, oracle=oracle.prefix,
                           report=audit, budget_s=cfg.walk_budget_s)
        if cfg.probe_states > 0:
            probe_walk(grammar.matcher, self.table, self.reader, walk,
                       seed_for(cfg, row.id, row.backend, w, "probe"), oracle.judge,
                       tuple(grammar.unenforced), probe, states=cfg.probe_states,
                       tokens=cfg.probe_tokens, depth=cfg.probe_depth)
        row.samples_truncated += walk.truncated
        if not walk.finished:
            row.samples_unfinished += 1
            return
        row.samples_total += 1
        if oracle.judge is None:
            row.samples_unchecked += 1
            return
        verdict = oracle.judge(walk.data, tuple(grammar.unenforced))
        if verdict is None or verdict.reason == "oracle-error":
            row.samples_unchecked += 1
        elif verdict.valid:
            row.samples_valid += 1
        elif verdict.known_gap:
            row.samples_known_gap += 1
        else:
            row.samples_invalid += 1
            row.example(what="sampled output invalid", reason=verdict.reason,
                        detail=verdict.detail,
                        output=walk.data[:300].decode("utf-8", "backslashreplace"))

    def differential(self, item: Item, one: Grammar, other: Grammar, oracle: ItemOracle
                     ) -> dict[str, Any]:
        """Two backends' masks along walks led by each in turn."""
        cfg = self.cfg
        report = DiffReport()
        pairs = ((other, one, (other.backend, one.backend)),
                 (one, other, (one.backend, other.backend)))
        for n, (lead, follow, names) in enumerate(pairs):
            rng = seed_for(cfg, item.id, "diff", n)
            free, _ = _walk_plan(rng, cfg)
            span = free + 32  # compare at most 24 steps, spread over the free part and beyond
            steps = set(range(0, span, max(1, span // 24)))
            differential(lead.matcher(), follow.matcher(), names,
                         (tuple(lead.unenforced), tuple(follow.unenforced)), self.table, rng,
                         oracle.judge, report, max_tokens=cfg.max_tokens, free_steps=free,
                         audit_steps=steps, resolve=cfg.resolve,
                         budget_s=cfg.diff_budget_s / 2,
                         is_json=item.kind == "json_schema")
        return {"subset": item.subset, "id": item.id, "kind": item.kind, **report.as_dict()}


def _walk_plan(rng: np.random.Generator, cfg: CheckConfig) -> tuple[int, set[int]]:
    """Free (uniform) steps before finishing, and which steps to audit (always step 0)."""
    free = int(rng.integers(0, max(1, cfg.max_tokens // 4)))
    span = max(2, free + 24)
    extra = rng.choice(np.arange(1, span), min(cfg.audit_steps - 1, span - 1), replace=False)
    return free, {0, *(int(s) for s in extra)} if cfg.audit_steps > 0 else set()


def complete_judge(oracle: RegexOracle | ChoiceOracle) -> Judge:
    """Full match of a complete output; a miss that another regex dialect (ASCII classes,
    ``.`` matching newline) explains is reported as a declared gap, not a bug."""
    def judge(data: bytes, _gaps: tuple[str, ...]) -> Verdict | None:
        verdict = oracle.complete(data)
        if verdict is None:
            return None
        if verdict:
            return Verdict(True)
        dialects = [n for n, v in oracle.dialects(data, complete=True).items() if v]
        if dialects:
            return Verdict(False, "regex dialect", tuple(dialects), True)
        return Verdict(False, "no full match")
    return judge


def count_instances(row: Row, item: Item, cfg: CheckConfig) -> None:
    for inst in item.instances:
        forms = forms_of(inst, item.kind, cfg)
        if not forms:
            row.instances_skipped += 1
            continue
        if inst.valid:
            row.valid_total += 1
            for form, _ in forms:
                row.valid_forms_total[form] = row.valid_forms_total.get(form, 0) + 1
        else:
            row.invalid_total += 1


def _oracle_valid(oracle: ItemOracle, inst: Instance) -> bool | None:
    verdict = _oracle_verdict(oracle, inst, ())
    return None if verdict is None else verdict.valid


def _oracle_verdict(oracle: ItemOracle, inst: Instance, unenforced: tuple[str, ...]
                    ) -> Verdict | None:
    if oracle.json is not None and inst.text is None:
        verdict = oracle.json.check_value(inst.data, unenforced)
        return None if verdict.reason == "oracle-error" else verdict
    if oracle.judge is not None and inst.text is not None:
        return oracle.judge(inst.text.encode("utf-8", "surrogatepass"), unenforced)
    return None


def declared_keys(schema: Any) -> set[str]:
    """Every property name any ``properties`` in the schema declares."""
    out: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                out.update(props)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def declared_order(schema: Any) -> dict[str, int]:
    """Property names in the order the schema first declares them (document order)."""
    order: dict[str, int] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name in props:
                    order.setdefault(name, len(order))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return order


def reorder_keys(value: Any, order: dict[str, int]) -> Any:
    """``value`` with every object's keys in declared order (undeclared keys last)."""
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: order.get(k, len(order)))
        return {k: reorder_keys(value[k], order) for k in keys}
    if isinstance(value, list):
        return [reorder_keys(v, order) for v in value]
    return value


def undeclared_keys(schema: Any, data: Any) -> bool:
    """Whether ``data`` has an object key no ``properties`` of the schema declares."""
    declared = declared_keys(schema)
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k not in declared for k in node):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def label_disagreements(item: Item, oracle: ItemOracle) -> int:
    """Instances whose label our own validator disputes (reported, labels still rule)."""
    return sum(1 for inst in item.instances
               if (v := _oracle_valid(oracle, inst)) is not None and v != inst.valid)
