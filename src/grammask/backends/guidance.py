"""llguidance adapter: millisecond compiles, Earley parser, errors reported as sticky state.

llguidance never raises on a bad grammar; the matcher enters an error state that it never
leaves. The adapter turns that into a ``GrammarError`` at compile time and keeps a pristine
template matcher per grammar, so a new request costs a ``deep_copy``, not a recompile (the
first request takes the copy the compile computed the start state's mask with).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance as llg
import torch

from ..errors import (
    GrammarError,
    InvalidGrammarError,
    InvalidRegexError,
    InvalidSchemaError,
    UnsupportedError,
)
from ..schema import jsontext
from ..schema.features import FORMATS, Feature
from ..schema.normalize import locate, normalize_schema
from ..specs.grammar_spec import BackendName, GrammarSpec
from ..vocab import Vocabulary
from .base import (
    RELEASED,
    BackendMatcher,
    FirstMask,
    check_batch,
    new_first_mask,
    refuse_empty_language,
)
from .registry import BackendInfo, Cost, register

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a stub-only TypedDict

log = logging.getLogger("grammask")


class GuidanceMatcher(BackendMatcher):
    def __init__(self, inner: llg.LLMatcher, stop_ids: tuple[int, ...], vocab_size: int,
                 first_mask: FirstMask | None = None,
                 owner: GuidanceCompiled | None = None, lane: int = 0) -> None:
        super().__init__(stop_ids, vocab_size)
        self._m = inner
        self._owner = owner  # told when this matcher breaks (its lexer is shared: see there)
        #: the owner's template this matcher was copied from (its lexer's lock): a batch fill
        #: fills the rows of one lane on one thread, so copies never wait on each other
        self.lane = lane
        #: the tokens llguidance consumed, so a batch fill can move the row to another lane
        #: (a copy of that lane's template, the tokens replayed)
        self._history: list[int] = []
        self._first_mask = first_mask  # the start state's mask, computed once per grammar
        # the depth at which llguidance consumed a stop token: llguidance reports a complete
        # grammar (``abc`` after ``abc``) as stopped before any stop token, xgrammar does not
        self._stop_at: int | None = None
        #: llguidance's error once it lost the parse (a dead end: a mask allowed a token
        #: after which nothing can follow); the row reading it fails with cause dead_end
        self.failure: str | None = None

    def accept(self, token_id: int) -> bool:
        tid = self._token(token_id)  # llguidance kills the matcher on ids past the vocabulary
        if tid is None:
            return False
        if self._m.is_stopped():
            # also true in llguidance's error state (it lost the parse): that ends the output
            # like a stop, its mask allows only the stop tokens, and accepting one agrees
            self._check_error()
            if tid in self._stop_ids:
                self._extra_stops += 1
                return True
            return False
        # validated first: a refused consume_token would poison the matcher for good
        if self._m.try_consume_tokens([tid]) != 1:
            return False
        self._history.append(tid)
        self._depth += 1
        if tid in self._stop_ids:
            self._stop_at = self._depth
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        index = self._check_fill(bitmask, row)  # a uint8 tensor here corrupts the heap
        if self._m.is_stopped():  # stopped or in error: stop tokens only
            self._stop_only(bitmask, index)
            return
        first = self._first_mask
        if self._depth == 0 and first is not None:
            self._copy_first(bitmask, index, first)
            return
        self._m.unsafe_compute_mask_ptr(self._row_ptr(bitmask, index), self._words * 4)
        self._check_error()

    @classmethod
    def batch_accept(cls, matchers: Sequence[GuidanceMatcher], tokens: Sequence[int]
                     ) -> list[bool]:
        """``accept`` for each row: llguidance's batch consume poisons a matcher that is
        refused (and a stop after the end must be counted, not consumed), and each call
        releases the GIL only to take it back at once."""
        return [m.accept(t) for m, t in zip(matchers, tokens, strict=True)]

    def _check_error(self) -> None:
        if self.failure is not None or not self._m.is_error():
            return
        error = str(self._m.get_error())
        self.failure = error.strip().splitlines()[0][:200] if error.strip() else "error"
        owner = self._owner
        if owner is not None:
            self._owner = None  # once
            owner.matcher_failed(error)

    def _native_rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        depth = self._depth - num_tokens
        del self._history[depth:]
        if self._stop_at is not None and self._stop_at > depth:
            self._stop_at = None

    def is_terminated(self) -> bool:
        # a stop was accepted, or llguidance lost the parse (it then allows only stops)
        return self._extra_stops > 0 or self._stop_at is not None or bool(self._m.is_error())

    def can_terminate(self) -> bool:
        return bool(self._m.is_stopped() or self._m.is_accepting())

    def _native_fork(self) -> GuidanceMatcher:
        twin = GuidanceMatcher(self._m.deep_copy(), self._stop_ids, self._vocab_size,
                               self._first_mask, self._owner, self.lane)
        twin._history = self._history.copy()
        twin._stop_at = self._stop_at
        twin.failure = self.failure
        return twin

    def release(self) -> None:
        """Nothing is recycled (a copy of the template is cheap: docs/benchmarks.md, Figures:
        decode host path); any later use raises, as ``Matcher.release`` promises."""
        self._m = RELEASED
        self._extra_stops = 0  # every path now reaches the native matcher, which raises
        self._stop_at = None

    def _native_reset(self) -> None:
        self._m.reset()
        self._history.clear()
        self.failure = None
        self._stop_at = None

    @property
    def error(self) -> str:
        return str(self._m.get_error())

    @property
    def native(self) -> llg.LLMatcher:
        """The raw llguidance matcher, for batch fills only (advancing it would leave this
        adapter's counters stale)."""
        return self._m

    def _move(self, lane: int) -> bool:
        """Become a copy of the owner's template ``lane`` in the same state (the consumed
        tokens replayed); False, unchanged, when that cannot be done exactly."""
        owner = self._owner
        if owner is None or self.failure is not None:
            return False
        template = owner.lane_template(lane)
        if lane and template is owner.lane_template(0):  # no template of its own
            return False
        twin = template.deep_copy()
        if self._history and not twin.consume_tokens(self._history):
            return False
        if twin.is_error() or twin.is_stopped() != self._m.is_stopped():
            return False
        self._m = twin
        self.lane = lane
        return True

    @classmethod
    def batch_fill(cls, rows: Sequence[tuple[GuidanceMatcher, int]], bitmask: torch.Tensor,
                   threads: int | None, state: dict[str, Any]) -> None:
        """Fill many rows on the calling thread, in one native call (the GIL released
        throughout). ``threads`` is not read: several threads take the rows placed by lock
        first (``fill_lanes`` and ``fill_shares``: ``capabilities.FillLanes``), which is the
        caller's to do (``decode.fill.place_fills``).

        One thread: one LLExecutor call, not a fill per row. Alone on the machine the
        per-row fills are faster (the executor's thread runs on cold caches), but each lets
        the GIL go and takes it back: beside a host thread that runs Python, every re-take
        waits for it (``stepjob``: one re-take a step). Measurements: docs/benchmarks.md."""
        check_batch(rows, bitmask)
        if len(rows) < 2:
            for m, r in rows:
                m.fill(bitmask, r)
            return
        _fill_rows(state, 0, rows, bitmask)

    @classmethod
    def fill_lanes(cls, rows: Sequence[tuple[GuidanceMatcher, int]], bitmask: torch.Tensor,
                   threads: int | None
                   ) -> tuple[int, Sequence[tuple[GuidanceCompiled | None, int,
                                                  tuple[GuidanceMatcher, int]]]] | None:
        """The rows' lock groups and lanes (``capabilities.FillLanes``) on ``threads`` fill
        threads (None: 80% of the cores, at most 8).

        Copies of one llguidance template share its lexer behind one lock, held through
        each mask: two threads filling copies of one template take turns (two threads were
        slower than one). So a row's lock group is its grammar (its ``GuidanceCompiled``;
        None for a row that lost it, on an error: it never moves) and its lane the template
        it was copied from (``lane_template``); a row placed on another lane is moved there
        by ``fill_shares``. None (one thread) also where a grammar's tokenizer is a Python
        callback (forced text): it takes the GIL inside fills, so threads would take turns
        on it, slower than one."""
        n = threads if threads is not None else _default_threads()
        if len(rows) < 2 or n <= 1:
            return None
        placed: list[tuple[GuidanceCompiled | None, int, tuple[GuidanceMatcher, int]]] = []
        for row in rows:
            m = row[0]
            owner = m._owner
            if owner is not None and not owner.parallel:
                return None
            placed.append((owner, m.lane, row))
        check_batch(rows, bitmask)
        return n, placed

    @classmethod
    def fill_shares(cls, shares: Sequence[Sequence[tuple[tuple[GuidanceMatcher, int], int]]],
                    bitmask: torch.Tensor, state: dict[str, Any]) -> None:
        """Fill ``shares[k]`` on fill thread ``k`` (``capabilities.FillLanes``): the calling
        thread takes the first share, a pool per thread count (kept in ``state``) the others;
        each thread moves its rows placed on a new lane (their tokens replayed on a copy of
        that lane's template: same state, same masks), then fills them in one native call."""
        n = len(shares)
        if n <= 1:
            for share in shares:
                _fill_share(state, 0, share, bitmask)
            return
        pool = state.get(f"guidance_pool{n}")
        if pool is None:
            pool = state[f"guidance_pool{n}"] = ThreadPoolExecutor(
                n - 1, thread_name_prefix="grammask-fill")
        futures: list[Future[None]] = [pool.submit(_fill_share, state, k, share, bitmask)
                                       for k, share in enumerate(shares) if k and share]
        try:
            _fill_share(state, 0, shares[0], bitmask)
        finally:
            for f in futures:
                f.result()


def _default_threads() -> int:
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores * 4 // 5))


def _fill_share(state: dict[str, Any], thread: int,
                share: Sequence[tuple[tuple[GuidanceMatcher, int], int]],
                bitmask: torch.Tensor) -> None:
    """One fill thread's rows: move the rows placed on a new lane, then one native fill."""
    rows: list[tuple[GuidanceMatcher, int]] = []
    for row, lane in share:
        m = row[0]
        if m.lane != lane and not m._move(lane):
            m.fill(bitmask, row[1])  # it stays where it was: filled alone, never wrongly
            continue
        rows.append(row)
    _fill_rows(state, thread, rows, bitmask)


def _fill_rows(state: dict[str, Any], thread: int, rows: Sequence[tuple[GuidanceMatcher, int]],
               bitmask: torch.Tensor) -> None:
    """``rows`` in one call of this thread's one-thread ``LLExecutor`` (GIL released)."""
    if not rows:
        return
    key = f"guidance_exec{thread}"
    executor = state.get(key)
    if executor is None:
        executor = state[key] = llg.LLExecutor(1)
    executor.unsafe_compute_mask_ptr([(m._m, r) for m, r in rows], bitmask.data_ptr(),
                                     bitmask.shape[1] * 4, bitmask.shape[0])


class GuidanceCompiled:
    """A compiled llguidance grammar: a pristine template matcher that requests deep-copy.

    The copies share the template's lexer (its lazily built regex states). When a lexer
    limit is hit ("lexer error: too many expressions constructed": a ``{162}`` repeat fed
    many tokens at once), that shared lexer is broken for every later copy: each one would
    refuse its first token. So a matcher that breaks reports it, and the next request gets
    a template rebuilt from the grammar text (copies already running stay broken).

    ``spare``: a copy of the template the compile already made (to compute the first mask
    with), handed to the first request instead of a fresh copy: computing a mask leaves a
    matcher's parse state as it was (a raw llguidance request computes its first mask on
    the very matcher it then advances)."""

    backend: BackendName = "guidance"

    def __init__(self, template: llg.LLMatcher, grammar: str, stop_ids: tuple[int, ...],
                 first_mask: FirstMask, vocab_size: int,
                 tokenizer: llg.LLTokenizer | None = None,
                 spare: llg.LLMatcher | None = None, parallel: bool = True) -> None:
        self._template = template
        #: fills may run on several threads (the tokenizer is native: no GIL in a fill)
        self.parallel = parallel
        #: one template per fill lane beyond the first (``lane_template``), made on demand
        self._lanes: dict[int, llg.LLMatcher] = {}
        self._next_lane = itertools.count()
        #: lanes new matchers are spread over (a batch fill raises it for a busy grammar)
        self.lanes_wanted = 1
        # taken at most once: list.pop is atomic, so two threads never share the spare
        self._spare = [] if spare is None else [spare]
        self._grammar = grammar
        self._tokenizer = tokenizer
        self._broken = False
        self.rebuilds = 0
        self._lock = threading.Lock()
        self._stop_ids = stop_ids
        self._first_mask = first_mask
        self._vocab_size = vocab_size
        # an estimate: llguidance exposes none
        self.memory_bytes = len(grammar) * 4 + 64 * 1024 + first_mask.nbytes

    def warnings(self) -> list[str]:
        """What llguidance ignored in the grammar (``capabilities.Warnings``), read when
        asked (a lenient compile's report): not on every compile's path."""
        return list(self._template.get_grammar_warnings())

    def matcher(self) -> GuidanceMatcher:
        if self._broken:
            self._rebuild()
        lane = next(self._next_lane) % self.lanes_wanted if self.lanes_wanted > 1 else 0
        if lane and lane not in self._lanes:
            lane = 0  # made by the batch fill that wants it, not on this (host's) path
        if lane:
            inner = self._lanes[lane].deep_copy()
        else:
            try:
                inner = self._spare.pop()
            except IndexError:
                inner = self._template.deep_copy()
        return GuidanceMatcher(inner, self._stop_ids, self._vocab_size, self._first_mask, self,
                               lane)

    def lane_template(self, lane: int) -> llg.LLMatcher:
        """The template of fill lane ``lane`` (0: the compile's); a lane's own is built from
        the grammar text on first use (a compile: it has its own lexer and lock)."""
        if lane == 0 or self._tokenizer is None:
            return self._template
        template = self._lanes.get(lane)
        if template is None:
            template = llg.LLMatcher(self._tokenizer, self._grammar, log_level=0)
            if template.is_error():
                return self._template
            with self._lock:
                template = self._lanes.setdefault(lane, template)
                self.lanes_wanted = max(self.lanes_wanted, lane + 1)
        return template

    def matcher_failed(self, error: str) -> None:
        """A matcher made here entered llguidance's error state: the shared lexer may be
        broken, so the next ``matcher()`` starts from a fresh template."""
        if self._tokenizer is not None:
            log.warning("grammask: an llguidance matcher failed (%s); the grammar's template "
                        "is rebuilt for the next request", error.strip().splitlines()[0][:200])
            self._broken = True

    def _rebuild(self) -> None:
        with self._lock:
            if not self._broken or self._tokenizer is None:
                return
            fresh = llg.LLMatcher(self._tokenizer, self._grammar, log_level=0)
            if not fresh.is_error():
                self._spare.clear()  # a copy of the broken template shares its lexer
                self._lanes = {}
                self._template = fresh
                self.rebuilds += 1
            self._broken = False


# ------------------------------------------------------------------ the tokenizer view
@dataclass(frozen=True)
class TokenizerView:
    """llguidance's view of a vocabulary, kept on it (``Vocabulary.view``)."""

    tokenizer: llg.LLTokenizer
    #: tokenizes natively (Rust): its fills never take the GIL, so they can run on several
    #: threads at once
    native: bool


_VIEW = "guidance.tokenizer"


def tokenizer_view(vocab: Vocabulary) -> TokenizerView:
    """llguidance's tokenizer for ``vocab``, built once per vocabulary (seconds): native
    when the vocabulary has a tokenizer JSON that tokenizes as ``encode`` does, else a
    Python callback. The difference matters: llguidance tokenizes forced text inside a
    mask fill (on JSON, about one fill in five), and a callback takes the GIL there, so the
    fill waits on the host's Python thread and two fill threads take turns."""
    return vocab.view(_VIEW, _make_view)


def tokenizer(vocab: Vocabulary) -> llg.LLTokenizer:
    """``tokenizer_view(vocab).tokenizer``."""
    return tokenizer_view(vocab).tokenizer


def _make_view(vocab: Vocabulary) -> TokenizerView:
    native = native_tokenizer(vocab)
    if native is not None:
        return TokenizerView(native, native=True)
    wrapper = _TokenizerSource(vocab)
    return TokenizerView(llg.LLTokenizer(llg.TokenizerWrapper(wrapper),
                                         n_vocab=vocab.vocab_size,
                                         eos_token=list(vocab.stop_ids)), native=False)


#: texts a native tokenizer must split exactly as the vocabulary's ``encode``
_PROBES = ('{"name": "Zoë Ünïcode", "n": -12345.5e3, "tags": ["a b", "\\n\\t"]}\n\n',
           "It's   3.14 — don't\r\n  <|endoftext|> 中文 😀 \t x" * 2)


def native_tokenizer(vocab: Vocabulary) -> llg.LLTokenizer | None:
    """The native tokenizer, or None (no JSON, or it tokenizes a probe unlike ``encode``:
    then the callback, which is exact by construction)."""
    try:
        text = vocab.tokenizer_json()
        if text is None:
            return None
        tok = llg.LLTokenizer(text, n_vocab=vocab.vocab_size, eos_token=list(vocab.stop_ids))
        for probe in _PROBES:
            if tok.tokenize_str(probe) != vocab.encode(probe):
                log.warning("grammask: llguidance's native tokenizer differs from the "
                            "vocabulary's on %r; using a Python callback", probe)
                return None
    except Exception as exc:  # never fatal: the callback serves
        log.warning("grammask: no native llguidance tokenizer (%s: %s)",
                    type(exc).__name__, exc)
        return None
    return tok


class _TokenizerSource:
    """The duck-typed tokenizer llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.stop_ids[0]
        self.bos_token_id = None
        # llguidance sizes its masks by len(tokens): pad to the model vocab with specials
        # that can never match text.
        pad = [b"<|grammask_pad_%d|>" % i for i in range(len(vocab.tokens), vocab.vocab_size)]
        self.tokens = [*vocab.tokens, *pad]
        self.special_token_ids = sorted(vocab.special_ids | set(range(len(vocab.tokens),
                                                                       vocab.vocab_size)))
        self._vocab = vocab

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._vocab.encode(text)


class GuidanceBackend:
    name: BackendName = "guidance"

    def prepare(self, vocab: Vocabulary) -> None:
        tokenizer_view(vocab)

    def compile(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False
                ) -> GuidanceCompiled:
        grammar = grammar_text(spec, lenient=lenient)
        view = tokenizer_view(vocab)
        template = llg.LLMatcher(view.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _translate(spec, template.get_error())
        first_mask, probe = _first_mask(spec, template, vocab)
        return GuidanceCompiled(template, grammar, vocab.stop_ids, first_mask,
                                vocab.vocab_size, view.tokenizer, spare=probe,
                                parallel=view.native)

    def check(self, spec: GrammarSpec, *, lenient: bool = False) -> None:
        grammar = grammar_text(spec, lenient=lenient)
        message = llg.LLMatcher.validate_grammar(grammar)
        if message:
            raise _translate(spec, message)


def _first_mask(spec: GrammarSpec, template: llg.LLMatcher, vocab: Vocabulary
                ) -> tuple[FirstMask, llg.LLMatcher]:
    """The start state's mask, computed once per grammar: every request's first fill is then
    a copy. It also catches grammars llguidance accepts but can produce no token for (e.g. an
    ``allOf`` of ``multipleOf`` and a bound): that error only shows in the first mask, and a
    request would get a stop-only mask. Found at compile time, routing can fall back.
    Computed on a copy of the template (returned: the first request's matcher)."""
    probe = template.deep_copy()
    first = new_first_mask(vocab.vocab_size)
    probe.unsafe_compute_mask_ptr(first.ptr, first.nbytes)
    where = "/" if spec.kind == "json_schema" else None
    if probe.is_error():
        reason = str(probe.get_error()).strip().splitlines()[0][:200]
        raise UnsupportedError(f"llguidance: the compiled grammar can produce no output: "
                               f"nothing can be generated (first mask failed: {reason})",
                               where=where)
    refuse_empty_language(first, "llguidance", where)
    return first, probe


def json_options(spec: GrammarSpec, *, lenient: bool) -> JsonCompileOptions:
    opts: JsonCompileOptions = {"whitespace_flexible": spec.any_whitespace}
    if not spec.any_whitespace:
        opts["item_separator"] = ","
        opts["key_separator"] = ":"
    if spec.whitespace_pattern is not None:
        opts["whitespace_pattern"] = spec.whitespace_pattern
    if lenient:
        opts["lenient"] = True
        opts["coerce_one_of"] = True
    return opts


def grammar_text(spec: GrammarSpec, *, lenient: bool) -> str:
    """The llguidance grammar (JSON text) for a spec; raises GrammarError when unexpressible."""
    try:
        if spec.kind == "json_schema":
            # llguidance reads patterns as JSON Schema searches itself: leave them as written
            schema = normalize_schema(spec.schema, close_objects=not spec.extra_properties,
                                      search_patterns=False)
            if schema is False:
                raise InvalidSchemaError("the schema `false` accepts no value", where="/")
            if schema is True:
                schema = {}
            # as text: llguidance converts a dict slower than the C encoder writes it
            # (docs/benchmarks.md, Figures: cold path)
            return str(llg.LLMatcher.grammar_from_json_schema(
                jsontext.for_parser(schema), defaults=json_options(spec, lenient=lenient)))
        if spec.kind == "json_object":
            return str(llg.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=json_options(spec, lenient=False)))
        if spec.kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(spec.source))
        if spec.kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                          for c in spec.choices)
            return str(llg.LLMatcher.grammar_from_lark(lark))
        if spec.kind == "grammar":
            source = spec.source
            if spec.syntax == "ebnf":
                from llguidance.gbnf_to_lark import any_to_lark

                source = any_to_lark(source)
            return str(llg.LLMatcher.grammar_from_lark(source))
        return str(llg.LLMatcher.grammar_from_lark(_struct_tag_lark(spec.source)))
    except GrammarError:
        raise
    except Exception as exc:
        raise _translate(spec, str(exc)) from exc


def _struct_tag_lark(source: str) -> str:
    """vLLM's legacy structural tag (structures + triggers) as an llguidance Lark grammar."""
    tag = json.loads(source)
    if "structures" not in tag or "triggers" not in tag:
        raise UnsupportedError("llguidance serves only the legacy structural-tag form "
                               "(structures + triggers); this one needs xgrammar",
                               where="structural_tag")
    tags = []
    for i, item in enumerate(tag["structures"]):
        begin = item.get("begin", "")
        trigger = next((t for t in tag["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidGrammarError(f"begin {begin!r} starts with no trigger",
                                      where=f"structural_tag/structures/{i}")
        tags.append(llg.StructTag(trigger=trigger, begin=begin, grammar=item.get("schema", {}),
                                  end=item.get("end", "")))
    return str(llg.StructTag.to_grammar(tags))


_LARK_POS = re.compile(r"(\d+)\((\d+)\): ")
_LINE = re.compile(r"(line \d+(?:,? ?(?:col(?:umn)?)? ?\d+)?)", re.IGNORECASE)


def _translate(spec: GrammarSpec, message: str) -> GrammarError:
    message = " ".join(str(message).strip().split())
    if len(message) > 500:
        message = message[:497] + "..."
    where_match = _LINE.search(message)
    where = where_match.group(1) if where_match else None
    lark_pos = _LARK_POS.match(message)
    if lark_pos:  # llguidance's Lark errors start "LINE(COLUMN): ..."
        where = f"line {lark_pos.group(1)} column {lark_pos.group(2)}"
    text = f"llguidance: {message}"
    if spec.kind == "json_schema" and where is None:
        where = locate(spec.schema, message)
    if spec.kind in ("json_schema", "json_object"):
        if "Unimplemented" in message or "not supported" in message.lower():
            return UnsupportedError(text, where=where)
        return InvalidSchemaError(text, where=where)
    if spec.kind == "regex":
        return InvalidRegexError(text, where=where)
    return InvalidGrammarError(text, where=where)


#: The formats llguidance 1.7 checks; it refuses the others as unknown (lenient mode
#: ignores them): they are its unchecked formats.
KNOWN_FORMATS = ("date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                 "uri", "uuid")
UNCHECKED_FORMATS = frozenset(f for name, f in FORMATS.items() if name not in KNOWN_FORMATS)
#: What llguidance 1.7 refuses by default ("Unimplemented keys"); lenient mode ignores them.
GAPS: dict[Feature, str] = {
    Feature.FORMAT_DATE: "day-of-month not checked (2023-02-29 passes)",
    Feature.UNIQUE_ITEMS: "refused",
    Feature.CONTAINS: "refused",
    Feature.PROPERTY_NAMES: "refused",
    Feature.DEPENDENT_REQUIRED: "refused",
    Feature.DEPENDENT_SCHEMAS: "refused",
    Feature.DEPENDENCIES: "refused",
    Feature.IF_THEN_ELSE: "refused",
    Feature.NOT: "refused",
    Feature.UNEVALUATED_PROPERTIES: "refused",
    Feature.UNEVALUATED_ITEMS: "refused",
    Feature.REMOTE_REF: "refused",
    Feature.ANCHOR_REF: "refused ($dynamicRef)",
    Feature.PROPERTY_COUNT: "refused unless every property is required",
    Feature.PATTERN_LOOKAROUND: "refused, even in lenient mode",
    Feature.ONE_OF_OVERLAPPING: "refused; lenient mode treats it as anyOf (an instance "
                                "matching several branches passes)",
}

#: llguidance gaps lenient mode cannot serve: when both backends have gaps, xgrammar then
#: serves (with its gaps listed) instead of a doomed llguidance attempt.
LENIENT_CANNOT = frozenset({Feature.PATTERN_LOOKAROUND})

#: Refused by llguidance's default mode only as a formality where no other backend checks
#: them: lenient mode serves them exactly (unknown formats are annotations in JSON Schema
#: 2020-12). Where another backend checks one, it is a gap of llguidance's own, and that
#: gap asks for lenient mode already.
LENIENT_EXACT = frozenset({Feature.FORMAT_UNKNOWN, *UNCHECKED_FORMATS})


#: What lenient mode leaves unenforced beyond ``GAPS``: llguidance's default mode refuses a
#: oneOf it cannot prove exclusive, lenient mode (``coerce_one_of``) serves it as anyOf,
#: silently where llguidance thinks the branches disjoint (multipleOf 3 / multipleOf 5).
LENIENT_GAPS: dict[Feature, str] = {
    Feature.ONE_OF_MAY_OVERLAP: "served as anyOf in lenient mode"}


register(BackendInfo(
    name="guidance", package="llguidance", priority=1, label="llguidance", aliases=("llguidance",),
    adapter=GuidanceBackend, matcher=GuidanceMatcher, compiled=GuidanceCompiled, gaps=GAPS,
    unchecked_formats=UNCHECKED_FORMATS,
    lenient=True, lenient_exact=LENIENT_EXACT, lenient_cannot=LENIENT_CANNOT,
    lenient_gaps=LENIENT_GAPS,
    # LLParserLimits' defaults bound a compile: initial lexer fuel 1,000,000, 500,000 grammar
    # symbols; the first mask: 200,000 step fuel (what each costs: docs/benchmarks.md,
    # Figures: compile routing)
    bounded_compile=True,
    footprint=(2.3, 0),  # llguidance reports no size: grammask's own estimate
    costs={
        "json_closed": Cost(2, "computes each step's mask lazily, at fill time"),
        "json_free_text": Cost(1, "computes masks lazily"),
        "json_open_objects": Cost(1, "compiles open objects lazily"),
        "json_object": Cost(1, "computes masks lazily"),
        "regex": Cost(1, "compiles regexes lazily"),
        "lark": Cost(1, "parses Lark natively"),
        "gbnf": Cost(3, "converts GBNF to Lark, which folds trailing whitespace into "
                        "terminals and refuses some valid texts"),
        "choice": Cost(2, "compiles a finite set lazily"),
        "structural_tag_legacy": Cost(2, "converts the legacy form to its own structural "
                                         "tags"),
    }))
