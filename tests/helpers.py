"""Small test helpers: feed text through a matcher, read mask bits."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from grammask import Grammar, GrammarSpec, Vocabulary, allocate_bitmask
from grammask.backends import Matcher
from grammask.specs.grammar_spec import BackendName


def feed(matcher: Matcher, vocab: Vocabulary, text: str) -> bool:
    """Accept the tokenization of ``text``; True when every token was accepted."""
    return all(matcher.accept(t) for t in vocab.encode(text))


def accepts_complete(matcher: Matcher, vocab: Vocabulary, text: str) -> bool:
    """``text`` is accepted to the end and a stop token is allowed after it."""
    return feed(matcher, vocab, text) and matcher.accept(vocab.stop_ids[0])


def mask_of(matcher: Matcher, vocab: Vocabulary) -> torch.Tensor:
    bm = allocate_bitmask(1, vocab.vocab_size)
    matcher.fill(bm, 0)
    return bm[0]


def bit(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)

#: First-mask budgets out of reach, for tests about masks rather than latency: on two loaded
#: CI cores a compile may take longer than the production ``wait_s`` / ``hedge_s``, and a
#: hedge would serve another backend's (equally valid, differently styled) grammar.
PATIENT: dict[str, float] = {"wait_s": 120.0, "hedge_s": 60.0}


# ------------------------------------------------------------------ raw-backend references
#: token id -> (word, bit) as torch stores an int32 word (bit 31 is the sign)
_BIT_VALUES = torch.tensor([(1 << i) - (1 << 32) if i == 31 else 1 << i for i in range(32)],
                           dtype=torch.int32)


def words_to_bool(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask row as one bool per token id."""
    return (words.unsqueeze(-1) & _BIT_VALUES).ne(0).flatten()[:vocab_size]


def bool_to_words(allowed: torch.Tensor) -> torch.Tensor:
    """One bool per token id as an int32 bitmask row (the inverse of ``words_to_bool``)."""
    n = allowed.numel()
    padded = torch.zeros(((n + 31) // 32) * 32, dtype=torch.bool)
    padded[:n] = allowed
    bits = padded.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    total = bits.sum(-1)
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)


def _closed(node: Any) -> Any:
    """``extra_properties=False`` as GrammarSpec documents it: every object schema that does
    not declare ``additionalProperties`` gets ``false`` (written here, not by grammask)."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if ("properties" in node or node.get("type") == "object") \
            and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


class _RawVocab:
    """The raw backends' tokenizer objects for one Vocabulary, built here from its plain token
    bytes: special tokens keep their text (nothing blanked or flagged), only the stop ids are
    told to the backends, as their end-of-sequence tokens."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self.n_tokens = len(vocab.tokens)
        self.stop_ids = tuple(vocab.stop_ids)
        # the documented rules: never a special token inside text, never an id past the
        # tokenizer (model padding); stop ids are decided separately
        keep = torch.zeros(vocab.vocab_size, dtype=torch.bool)
        keep[:self.n_tokens] = True
        keep[[i for i in vocab.special_ids if i < self.n_tokens]] = False
        keep[list(self.stop_ids)] = False
        self.keep_words = bool_to_words(keep)
        stops = torch.zeros(vocab.vocab_size, dtype=torch.bool)
        stops[list(self.stop_ids)] = True
        self.stop_words = bool_to_words(stops)
        self._xgr: Any = None
        self._llg: Any = None
        self._lock = threading.Lock()
        self._compiled: dict[tuple[str, str], Any] = {}

    def compiled(self, spec: GrammarSpec, backend: BackendName) -> Any:
        """The raw backend's compiled grammar (xgrammar ``CompiledGrammar``, or a pristine
        llguidance ``LLMatcher`` to copy), built once per spec and backend."""
        key = (spec.key, backend)
        found = self._compiled.get(key)
        if found is None:
            if backend == "xgrammar":
                found = _raw_xgrammar(spec, self)
            else:
                import llguidance as llg

                found = llg.LLMatcher(self.llguidance_tokenizer(),
                                      _raw_llguidance_grammar(spec), log_level=0)
                if found.is_error():
                    raise ValueError(f"llguidance refused the reference grammar: "
                                     f"{found.get_error()}")
            self._compiled[key] = found
        return found

    def xgrammar_compiler(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._xgr is None:
                info = xgr.TokenizerInfo(list(self.vocab.tokens), xgr.VocabType.RAW,
                                         vocab_size=self.vocab.vocab_size,
                                         stop_token_ids=list(self.stop_ids),
                                         add_prefix_space=False)
                self._xgr = xgr.GrammarCompiler(info)
            return self._xgr

    def llguidance_tokenizer(self) -> Any:
        import llguidance as llg

        with self._lock:
            if self._llg is None:
                self._llg = llg.LLTokenizer(llg.TokenizerWrapper(_PlainTokens(self.vocab)),
                                            eos_token=list(self.stop_ids))
            return self._llg


class _PlainTokens:
    """What llguidance's ``TokenizerWrapper`` reads: the plain token bytes; only the stop ids
    are flagged (they are the backend's end-of-sequence tokens, never text)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.stop_ids[0]
        self.bos_token_id = None
        self.tokens = list(vocab.tokens)
        self.special_token_ids = list(vocab.stop_ids)
        self._vocab = vocab

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._vocab.encode(text)


_RAW_VOCABS: dict[int, _RawVocab] = {}
_RAW_LOCK = threading.Lock()


def _raw_vocab(vocab: Vocabulary) -> _RawVocab:
    with _RAW_LOCK:
        raw = _RAW_VOCABS.get(id(vocab))
        if raw is None or raw.vocab is not vocab:
            raw = _RAW_VOCABS[id(vocab)] = _RawVocab(vocab)
        return raw


def _choice_text(choices: Sequence[str]) -> str:
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _raw_xgrammar(spec: GrammarSpec, raw: _RawVocab) -> Any:
    comp = raw.xgrammar_compiler()
    if spec.kind == "json_schema":
        schema = spec.schema
        return comp.compile_json_schema(
            json.dumps(schema), any_whitespace=spec.any_whitespace,
            separators=None if spec.any_whitespace else (",", ":"),
            strict_mode=not spec.extra_properties)
    if spec.kind == "regex":
        return comp.compile_regex(spec.source)
    if spec.kind == "choice":
        return comp.compile_grammar("root ::= " + _choice_text(spec.choices))
    if spec.kind == "grammar" and spec.syntax == "lark":
        return comp.compile_lark(spec.source)
    if spec.kind == "grammar":
        return comp.compile_grammar(spec.source)
    raise NotImplementedError(f"no raw xgrammar reference for {spec.kind}")


def _raw_llguidance_grammar(spec: GrammarSpec) -> str:
    import llguidance as llg

    if spec.kind == "json_schema":
        schema = spec.schema if spec.extra_properties else _closed(spec.schema)
        options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
        if not spec.any_whitespace:
            options.update(item_separator=",", key_separator=":")
        return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=options))  # type: ignore[arg-type]
    if spec.kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(spec.source))
    if spec.kind == "choice":
        return str(llg.LLMatcher.grammar_from_lark("start: " + _choice_text(spec.choices)))
    if spec.kind == "grammar" and spec.syntax == "lark":
        return str(llg.LLMatcher.grammar_from_lark(spec.source))
    raise NotImplementedError(f"no raw llguidance reference for {spec.kind}")


class RawReference:
    """What a grammask matcher must allow next, stated from the RAW backend objects.

    The backend (xgrammar ``GrammarMatcher`` / llguidance ``LLMatcher``, compiled here from the
    spec over the tokenizer's plain token bytes, not through grammask's adapters) gives the
    grammar's mask; the rules grammask documents (``backends/base.py``, ``vocab.py``) are then
    applied on top, here and nowhere else:

    - ids past the tokenizer (model padding) and special tokens are never allowed;
    - the stop ids are allowed exactly where the grammar may end (the raw backend's own
      end-of-sequence answer), and accepting one ends the output: from then on only stop
      ids are allowed and accepted.

    ``rollback`` and ``fork`` replay the accepted tokens on a fresh raw matcher, so they do
    not lean on the backends' rollback either."""

    def __init__(self, spec: GrammarSpec, vocab: Vocabulary, backend: BackendName) -> None:
        self.spec, self.vocab, self.backend = spec, vocab, backend
        self._raw = _raw_vocab(vocab)
        self._compiled = self._raw.compiled(spec, backend)
        self.history: list[int] = []
        self._restart()

    @classmethod
    def of(cls, grammar: Grammar, vocab: Vocabulary) -> RawReference:
        """The reference for a compiled grammask grammar: the same spec on the backend that
        serves it (the two backends may style a language differently)."""
        return cls(grammar.spec, vocab, grammar.backend)

    def _restart(self) -> None:
        self._m: Any  # xgrammar GrammarMatcher or llguidance LLMatcher (raw, no adapter)
        if self.backend == "xgrammar":
            import xgrammar as xgr

            self._m = xgr.GrammarMatcher(self._compiled)
        else:
            self._m = self._compiled.deep_copy()
        self._stops = 0  # stop ids accepted (the first one ends the output)
        self._cache: torch.Tensor | None = None

    # -------------------------------------------------------------- raw backend views
    def _text_words(self) -> torch.Tensor:
        """The raw backend's mask over the model vocab (stop bits as the backend sets them)."""
        raw = self._raw
        words = torch.zeros((1, (self.vocab.vocab_size + 31) // 32), dtype=torch.int32)
        if self.backend == "xgrammar":
            self._m.fill_next_token_bitmask(words, 0)
            return words[0]
        if self._m.is_stopped():  # llguidance: nothing can follow (complete, or lost)
            return words[0]
        import llguidance.torch as llt

        own = torch.zeros((1, (raw.n_tokens + 31) // 32), dtype=torch.int32)
        llt.fill_next_token_bitmask(self._m, own, 0)
        assert not self._m.is_error(), self._m.get_error()
        words[0, :own.shape[1]] = own[0]
        return words[0]

    def _may_end(self) -> bool:
        if self.backend == "xgrammar":
            return bool(self._m.is_completed())
        return bool(self._m.is_accepting() or (self._m.is_stopped()
                                                and not self._m.is_error()))

    # ------------------------------------------------------------------ the contract
    def can_terminate(self) -> bool:
        return self._stops > 0 or self._may_end()

    def is_terminated(self) -> bool:
        return self._stops > 0

    def words(self) -> torch.Tensor:
        """The expected int32 bitmask row (a copy)."""
        if self._cache is None:
            if self._stops:
                self._cache = self._raw.stop_words.clone()
            else:
                words = self._text_words() & self._raw.keep_words
                if self._may_end():
                    words |= self._raw.stop_words
                self._cache = words
        return self._cache.clone()

    def allowed(self) -> torch.Tensor:
        """The expected mask: one bool per token id of the model vocab."""
        return words_to_bool(self.words(), self.vocab.vocab_size)

    def accept(self, token: int) -> bool:
        if not 0 <= token < self.vocab.vocab_size:
            return False
        if token in self._raw.stop_ids:
            if not self.can_terminate():
                return False
            self._stops += 1
        elif self._stops or not bool(self._raw.keep_words[token >> 5] >> (token & 31) & 1):
            return False  # after the end, a special token, or model padding
        elif self.backend == "xgrammar":
            if not self._m.accept_token(token):
                return False
        elif self._m.is_stopped() or self._m.validate_tokens([token]) != 1 \
                or not self._m.consume_token(token):
            return False
        self.history.append(token)
        self._cache = None
        return True

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.history):
            raise ValueError(f"rollback {n} of {len(self.history)}")
        kept = self.history[:len(self.history) - n]
        self.history = []
        self._restart()
        for token in kept:
            assert self.accept(token), token

    def fork(self) -> RawReference:
        twin = RawReference(self.spec, self.vocab, self.backend)
        for token in self.history:
            assert twin.accept(token), token
        return twin


def raw_reference(grammar: Grammar, vocab: Vocabulary, tokens: Sequence[int] = ()
                  ) -> torch.Tensor:
    """The mask (bool over the model vocab) grammask must serve after ``tokens`` were
    committed under ``grammar``, from the raw backend (``RawReference``)."""
    ref = RawReference.of(grammar, vocab)
    for token in tokens:
        assert ref.accept(token), (token, ref.history)
    return ref.allowed()


def declare_unbounded(monkeypatch: Any, name: str) -> None:
    """Declare a backend's compiles unbounded for one test: a test that makes a real
    backend's compile stall (a stand-in for a runaway) must also let it be abandoned, which
    only an unbounded backend's compiles are (a bounded one compiles on the caller)."""
    import dataclasses

    from grammask.backends import registry

    info = registry.info(name)
    monkeypatch.setitem(registry._registered, info.name,
                        dataclasses.replace(info, bounded_compile=False))


class ThreadClock:
    """A stand-in for ``time.perf_counter`` as one module reads it (``module.time``; the
    rest of ``time`` is real), one clock a thread: each stands still until its own thread
    ``advance``s it, however long the real work takes. For ``grammask.decode.stepjob``: the
    host's ``advance`` between ``step`` and ``apply`` is the forward the fill job overlaps
    (the window it measures), a stand-in's ``advance`` on the fill worker is that job's work
    (a plan's time); the job's real work takes none, so which fits is the test's choice."""

    def __init__(self, monkeypatch: Any, module: Any) -> None:
        real, clock = module.time, self
        self._now: dict[int, float] = {}

        class _Time:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def perf_counter(self) -> float:
                return clock.now()

        monkeypatch.setattr(module, "time", _Time())

    def now(self) -> float:
        """The calling thread's clock (each starts at 1000 s)."""
        return self._now.get(threading.get_ident(), 1000.0)

    def advance(self, seconds: float) -> None:
        """Move the calling thread's clock on (no other thread writes its entry)."""
        self._now[threading.get_ident()] = self.now() + seconds
