"""xgrammar adapter: fastest per-token fill, slow and sometimes pathological JSON compiles."""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

from ..errors import GrammarError, InvalidGrammarError, InvalidRegexError, InvalidSchemaError
from ..kernels.lent import lend
from ..schema import jsontext
from ..schema.features import Feature
from ..schema.normalize import locate, normalize_schema
from ..specs.grammar_spec import BackendName, GrammarSpec
from ..vocab import Vocabulary
from . import xgrammar_disk
from .base import (
    RELEASED,
    SPARES,
    BackendMatcher,
    FirstMask,
    check_batch,
    new_first_mask,
    refuse_empty_language,
)
from .diskcache import DiskCache
from .registry import BackendInfo, Cost, register
from .xgrammar_vocab import tokenizer_info as tokenizer_info  # the adapter's tokenizer view

try:  # the batch accept without the wrapper's per-element conversion (``_accept_all``)
    from xgrammar.base import _core as _xgr_core  # type: ignore[attr-defined]

    _CORE_BATCH: Any = _xgr_core.BatchGrammarMatcher
except (ImportError, AttributeError):  # another xgrammar: its public wrapper
    _CORE_BATCH = None

_COMPACT = (",", ":")
_THREADS = min(8, os.cpu_count() or 1)  # vLLM uses 8; more only helps large grammars
# "[11:27:52] /project/cpp/grammar_compiler.cc:1207: Check failed: (...) is false: " prefixes
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


class XGrammarMatcher(BackendMatcher):
    def __init__(self, inner: xgr.GrammarMatcher, stop_ids: tuple[int, ...],
                 vocab_size: int, first_mask: FirstMask | None = None,
                 owner: XGrammarCompiled | None = None, ended: bool | None = None) -> None:
        """``ended``: whether ``inner`` is terminated, when the caller knows (None: asked)."""
        super().__init__(stop_ids, vocab_size)
        self._m = inner
        self._first_mask = first_mask  # the start state's mask, computed once per grammar
        self._owner = owner  # takes the native matcher back on ``release``
        #: xgrammar's ``is_terminated`` (a stop token accepted), kept here: asked for every
        #: row of every step, a native call each (the batch fill must not see ended rows)
        self._ended = bool(inner.is_terminated()) if ended is None else ended

    def accept(self, token_id: int) -> bool:
        tid = self._token(token_id)  # xgrammar would wrap 2**32 + i to token i
        if tid is None:
            return False
        if self._ended:
            if tid in self._stop_ids:
                self._extra_stops += 1
                return True
            return False
        if not self._m.accept_token(tid):
            return False
        self._depth += 1
        self._ended = tid in self._stop_ids  # xgrammar ends on the stop token it accepts
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        index = self._check_fill(bitmask, row)
        first = self._first_mask
        if self._depth == 0 and first is not None:  # the start state (a stop makes depth 1)
            self._copy_first(bitmask, index, first)
        elif self._ended:
            self._stop_only(bitmask, index)
        else:
            self._m.fill_next_token_bitmask(bitmask, index)

    def _native_rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        self._ended = bool(self._m.is_terminated())

    def is_terminated(self) -> bool:
        if self._m is RELEASED:
            self._m.is_terminated()  # raises
        return self._ended

    def can_terminate(self) -> bool:
        return self._ended or bool(self._m.is_completed())

    def _native_fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork(), self._stop_ids, self._vocab_size,
                               self._first_mask, self._owner)

    def release(self) -> None:
        """Give the native matcher back to its grammar (``XGrammarCompiled.matcher`` resets
        it for the next request: a fraction of a new one's cost, which a batch whose short
        requests end often pays on the fill thread for every new row; docs/benchmarks.md,
        Figures: decode host path)."""
        owner, inner = self._owner, self._m
        self._owner = None
        self._m = RELEASED
        self._ended = False  # every path now reaches the native matcher, which raises
        self._first_mask = None
        if owner is not None and inner is not RELEASED:
            owner.recycle(inner)

    def _native_reset(self) -> None:
        self._m.reset()
        self._ended = bool(self._m.is_terminated())

    @property
    def native(self) -> xgr.GrammarMatcher:
        """The raw xgrammar matcher, for batch fills only (advancing it would leave this
        adapter's counters stale)."""
        return self._m

    @classmethod
    def batch_fill(cls, rows: Sequence[tuple[XGrammarMatcher, int]], bitmask: torch.Tensor,
                   threads: int | None, state: dict[str, Any]) -> None:
        """Fill many rows in one call of xgrammar's ``BatchGrammarMatcher`` (its own threads;
        one thread still beats the per-row loop: no Python per row, the GIL released)."""
        check_batch(rows, bitmask)
        key = f"xgrammar{threads}"
        batch = state.get(key)
        if batch is None:
            batch = state[key] = xgr.BatchGrammarMatcher("auto" if threads is None else threads)
        batch.batch_fill_next_token_bitmask([m._m for m, _ in rows], bitmask,
                                            [r for _, r in rows])

    @classmethod
    def batch_accept(cls, matchers: Sequence[XGrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool]:
        """One native call for every row; a refusal leaves xgrammar's state as it was, so
        those rows (a stop after the end, a token not allowed) go through ``accept``."""
        if not matchers:
            return []
        if min(tokens) < 0 or max(tokens) >= min(m._vocab_size for m in matchers):
            return [m.accept(t) for m, t in zip(matchers, tokens, strict=True)]
        done = _accept_all([m._m for m in matchers], list(tokens))
        if done is None:
            for m, t in zip(matchers, tokens, strict=True):
                m._depth += 1
                m._ended = t in m._stop_ids
            return [True] * len(matchers)
        out = []
        for m, t, ok in zip(matchers, tokens, done, strict=True):
            if ok:
                m._depth += 1
                m._ended = t in m._stop_ids
            else:
                ok = m.accept(t)
            out.append(ok)
        return out


def _accept_all(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool] | None:
    """Each matcher takes its token in one native call: None when all did, else who did.

    xgrammar's own wrapper turns the answer into a list element by element through the FFI
    (at a large batch, more than the accepts cost: docs/benchmarks.md, Figures: decode host
    path); asking the array whether it holds a refusal is one call, and all are accepted
    in nearly every step."""
    if _CORE_BATCH is None:
        done = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return None if all(done) else done
    accept = _CORE_BATCH.batch_accept_token
    handles = [m._handle for m in matchers]
    # the GIL kept through the call (tvm-ffi lets it go by default): a short call, and a
    # busy host thread would hold the GIL it must take back (``stepjob``: one re-take a
    # step, the fill's). Set and restored with the GIL held: no other thread sees the flag.
    releases = accept.release_gil
    accept.release_gil = False
    try:
        answer = accept(handles, tokens, False)
    finally:
        accept.release_gil = releases
    if len(answer) == len(matchers):
        refused: object = False if isinstance(answer[0], bool) else 0
        if refused not in answer:
            return None
    return [bool(ok) for ok in answer]


class XGrammarCompiled:
    """A compiled xgrammar grammar. After a compile's empty-language check it also holds the
    start state's mask (every request's first fill is a copy) and the matcher that check
    filled it with, handed to the first request (a fill leaves the parse state as it was)."""

    backend: BackendName = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: tuple[int, ...],
                 vocab_size: int) -> None:
        self._compiled = compiled
        self._stop_ids = stop_ids
        self._vocab_size = vocab_size
        self.memory_bytes = int(compiled.memory_size_bytes)
        self._first_mask: FirstMask | None = None
        #: native matchers to hand out again: the one the empty-language check made, and
        #: those released by ended requests (``recycle``), counted in ``SPARES`` until
        #: taken or dropped with this grammar. list.pop and append are atomic, so two
        #: threads never share one.
        self._spare: list[xgr.GrammarMatcher] = []
        weakref.finalize(self, _drop_spares, self._spare)

    def _native(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._compiled, override_stop_tokens=list(self._stop_ids))

    def matcher(self) -> XGrammarMatcher:
        try:
            inner = self._spare.pop()
        except IndexError:
            inner = self._native()
        else:
            SPARES.free()
            inner.reset()
        # a start state with a first mask is not terminated (``_refuse_empty``): no native
        # call to ask (each one gives up the GIL, which a busy host thread then holds)
        return XGrammarMatcher(inner, self._stop_ids, self._vocab_size, self._first_mask, self,
                               False if self._first_mask is not None else None)

    def recycle(self, inner: xgr.GrammarMatcher) -> None:
        """Keep a released (or unused) native matcher for a later request, within
        ``SPARES``: per grammar and for the process."""
        if len(self._spare) < SPARES.per_grammar and SPARES.reserve():
            self._spare.append(inner)


def _drop_spares(spare: list[xgr.GrammarMatcher]) -> None:
    """A grammar left memory: its kept matchers leave the budget with it."""
    SPARES.free(len(spare))
    spare.clear()


class XGrammarBackend:
    name: BackendName = "xgrammar"

    def __init__(self) -> None:
        self._compilers: dict[str, xgr.GrammarCompiler] = {}
        self._lock = threading.Lock()

    def prepare(self, vocab: Vocabulary) -> None:
        tokenizer_info(vocab)
        xgrammar_disk.recipe_digest()  # reads package metadata: now, not in a first load

    # the disk capability (``capabilities.DiskBackend``): ``xgrammar_disk`` is the codec
    def load_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, *,
                      lenient: bool = False) -> XGrammarCompiled | None:
        compiled = xgrammar_disk.load(cache, spec, vocab, lenient=lenient)
        return None if compiled is None else XGrammarCompiled(compiled, vocab.stop_ids,
                                                               vocab.vocab_size)

    def store_compiled(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary,
                       grammar: object, *, lenient: bool = False,
                       compile_ms: float | None = None) -> bool:
        if not isinstance(grammar, XGrammarCompiled):
            return False
        return xgrammar_disk.store(cache, spec, vocab, grammar._compiled, lenient=lenient,
                                   compile_ms=compile_ms)

    def _compiler(self, vocab: Vocabulary) -> xgr.GrammarCompiler:
        with self._lock:
            comp = self._compilers.get(vocab.digest)
            if comp is None:
                # grammask caches compiled grammars itself; xgrammar's cache would double memory.
                comp = xgr.GrammarCompiler(tokenizer_info(vocab), max_threads=_THREADS,
                                           cache_enabled=False)
                self._compilers[vocab.digest] = comp
            return comp

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = True
                ) -> XGrammarCompiled:
        comp = self._compiler(vocab)
        try:
            compiled = _compile(comp, spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with a message
            raise _translate(spec, exc) from exc
        result = XGrammarCompiled(compiled, vocab.stop_ids, vocab.vocab_size)
        _refuse_empty(result, spec, vocab)
        return result

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        try:
            _grammar_only(spec)
        except GrammarError:
            raise
        except Exception as exc:
            raise _translate(spec, exc) from exc


def _refuse_empty(compiled: XGrammarCompiled, spec: GrammarSpec, vocab: Vocabulary) -> None:
    """xgrammar compiles an empty language (``root ::= root``) and masks every token: find it
    from the start state's mask, once per compile. The mask and the matcher that filled it
    are kept for the first request."""
    first = new_first_mask(vocab.vocab_size)
    native = compiled._native()
    where = "/" if spec.kind == "json_schema" else None
    if native.is_terminated():  # not at a start state: the adapter's own fill says what then
        compiled.matcher().fill(first.tensor(), 0)
        refuse_empty_language(first, "xgrammar", where)
        return
    native.fill_next_token_bitmask(first.tensor(), 0)
    refuse_empty_language(first, "xgrammar", where)
    compiled._first_mask = first
    compiled.recycle(native)


def json_options(spec: GrammarSpec) -> dict[str, Any]:
    """How a spec's whitespace and extra-key options map onto xgrammar's JSON compiler."""
    if spec.any_whitespace:
        return {"any_whitespace": True, "strict_mode": not spec.extra_properties}
    return {"any_whitespace": False, "separators": _COMPACT,
            "strict_mode": not spec.extra_properties}


def _schema_text(spec: GrammarSpec) -> str:
    return jsontext.for_parser(normalize_schema(spec.schema, close_objects=False,
                                                explicit_free=True, escape_nul=True,
                                                merge_combinators=True))


def _compile(comp: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    if spec.kind == "json_schema":
        return comp.compile_json_schema(_schema_text(spec), **json_options(spec))
    if spec.kind == "json_object":
        separators = None if spec.any_whitespace else _COMPACT
        return comp.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace,
                                        separators=separators, strict_mode=False)
    if spec.kind == "regex":
        return comp.compile_regex(spec.source)
    if spec.kind == "choice":
        return comp.compile_grammar(_choice_ebnf(spec.choices))
    if spec.kind == "grammar":
        if spec.syntax == "lark":
            return comp.compile_lark(spec.source)
        return comp.compile_grammar(spec.source)
    tag = json.loads(spec.source)
    if "structures" in tag:
        return comp.compile_structural_tag(*_legacy_tag(tag))
    return comp.compile_structural_tag(spec.source)


def _legacy_tag(tag: dict[str, Any]) -> tuple[list[xgr.StructuralTagItem], list[str]]:
    """vLLM's legacy form: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``."""
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})),
                                   end=s.get("end", "")) for s in tag["structures"]]
    return items, list(tag["triggers"])


def _grammar_only(spec: GrammarSpec) -> None:
    """Parse without a tokenizer: what request validation can afford."""
    if spec.kind == "json_schema":
        xgr.Grammar.from_json_schema(_schema_text(spec), **json_options(spec))
    elif spec.kind == "regex":
        xgr.Grammar.from_regex(spec.source)
    elif spec.kind == "choice":
        xgr.Grammar.from_ebnf(_choice_ebnf(spec.choices))
    elif spec.kind == "grammar":
        if spec.syntax == "lark":
            xgr.Grammar.from_lark(spec.source)
        else:
            xgr.Grammar.from_ebnf(spec.source)
    elif spec.kind == "structural_tag":
        tag = json.loads(spec.source)
        if "structures" in tag:
            xgr.Grammar.from_structural_tag(*_legacy_tag(tag))
        else:
            xgr.Grammar.from_structural_tag(spec.source)


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _translate(spec: GrammarSpec, exc: Exception) -> GrammarError:
    text = _NOISE.sub("", str(exc).strip()).splitlines()
    message = " ".join(line.strip() for line in text[:3])
    where = _LINE.search(message)
    location = where.group(1) if where else None
    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_schema":
            location = locate(spec.schema, message) or location
        if not message:  # a failed check with no text (e.g. a bound past a double)
            message = (f"the JSON schema compiler failed without a message "
                       f"({type(exc).__name__}); no keyword could be blamed")
        return InvalidSchemaError(f"xgrammar: {message}", where=location)
    message = message or f"failed without a message ({type(exc).__name__})"
    if spec.kind == "structural_tag" and location is None:
        location = "structural_tag/format" if "format" in message.lower() else "structural_tag"
    if spec.kind == "regex":
        return InvalidRegexError(f"xgrammar: {message}", where=location)
    return InvalidGrammarError(f"xgrammar: {message}", where=location)


_LINE = re.compile(r"(line \d+(?:,? ?(?:col(?:umn)?)? ?\d+)?)", re.IGNORECASE)


#: Formats xgrammar 0.2.8 ignores (each a gap: ``BackendInfo.unchecked_formats``).
UNCHECKED_FORMATS = frozenset({Feature.FORMAT_IDN_EMAIL, Feature.FORMAT_IDN_HOSTNAME,
                               Feature.FORMAT_IRI, Feature.FORMAT_IRI_REFERENCE,
                               Feature.FORMAT_REGEX})
#: What xgrammar 0.2.8 ignores, gets wrong or refuses, keyword by keyword (measured with
#: the retired keyword probe, its table in docs/keyword-probe.md; held by `grammask check`).
GAPS: dict[Feature, str] = {
    Feature.UNIQUE_ITEMS: "ignored",
    Feature.CONTAINS: "wrong: accepts only []",
    Feature.DEPENDENT_REQUIRED: "ignored",
    Feature.DEPENDENT_SCHEMAS: "ignored",
    Feature.DEPENDENCIES: "ignored",
    Feature.IF_THEN_ELSE: "ignored",
    Feature.NOT: "ignored",
    Feature.MULTIPLE_OF_FRACTION: "ignored",
    Feature.ALL_OF: "the node matches any value (an allOf normalize cannot merge into its "
                    "node)",
    Feature.COMBINATOR_SIBLINGS: "the node's other keywords are ignored (where normalize "
                                 "cannot merge them into the branches)",
    Feature.ONE_OF: "treated as anyOf",
    Feature.REMOTE_REF: "matches anything",
    Feature.REF_SIBLINGS: "siblings ignored",
    Feature.ANCHOR_REF: "matches anything",
    Feature.PATTERN_LENGTH: "length ignored",
    Feature.PATTERN_PROPERTIES: "refuses keys that match when additionalProperties is absent",
    Feature.WHITESPACE_PATTERN: "not supported",
    Feature.REQUIRED_UNDECLARED: "ignored for names not in properties",
    Feature.STRING_LENGTH: "admits raw control characters (invalid JSON)",
    Feature.FORMAT_UNTYPED: "ignored without type: string",
    Feature.FORMAT_DATE: "day-of-month not checked (2023-02-29 passes)",
    Feature.PATTERN_INNER_ANCHORS: "^ and $ inside the pattern are ignored",
    Feature.PATTERN_LOOKAROUND: "look-around and \\b are ignored",
    Feature.ROOT_REF: "mask forbids tokens accept takes (`}}` after `{\"x\":{`)",
}


def disk_child_main() -> None:
    """The disk cache's writer process (``diskwriter.run_child``): it compiles as this
    adapter does, so the key and the grammar match the parent's."""
    backend = XGrammarBackend()
    xgrammar_disk.child_main(
        lambda spec, vocab, lenient: backend.compile(spec, vocab, lenient=lenient)._compiled)


register(BackendInfo(
    name="xgrammar", package="xgrammar", priority=0, adapter=XGrammarBackend,
    matcher=XGrammarMatcher, compiled=XGrammarCompiled, gaps=GAPS,
    unchecked_formats=UNCHECKED_FORMATS,
    # measured RSS per cached grammar: memory_size_bytes misses allocator overhead and the
    # matcher-side structures (bench/stress.py --calibrate; corpus schemas, Qwen2.5, glibc)
    footprint=(0.57, 180 * 1024),
    costs={
        "json_closed": Cost(1, "compiles a schema without free-form text fast and fills "
                               "fastest"),
        "json_free_text": Cost(3, "precomputes string masks at compile time"),
        "json_open_objects": Cost(4, "compiles open objects in its non-strict mode, which is "
                                     "slow"),
        "json_object": Cost(3, "precomputes the masks of free-form strings at compile time"),
        "regex": Cost(3, "compiles regexes eagerly: the compile grows with the pattern"),
        "lark": Cost(3, "compiles Lark eagerly"),
        "gbnf": Cost(1, "parses GBNF natively"),
        "choice": Cost(1, "compiles a finite set eagerly and fills fastest"),
        "structural_tag": Cost(1, "has structural tags natively"),
        "structural_tag_legacy": Cost(1, "has structural tags natively"),
    }))


def _cpu_kernel(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                rows: list[int]) -> None:
    """xgrammar's CPU apply (fast for rows that allow most tokens), lent to ``kernels``."""
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
        apply_token_bitmask_inplace_cpu,
    )

    apply_token_bitmask_inplace_cpu(logits, bitmask, vocab_size, rows)


def _device_kernel() -> Any:
    """xgrammar's Triton apply kernel, or None without Triton."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import (
            apply_token_bitmask_inplace_triton,
        )
    except ImportError:
        return None
    return apply_token_bitmask_inplace_triton


lend(cpu=_cpu_kernel, device=_device_kernel)
