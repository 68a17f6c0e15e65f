"""Fill tuning (``Compiler(tune_fill=True)``): when another backend also enforces every keyword
of a JSON schema, it is compiled in the background, both fill the same walk (``fillcost``),
and the cheaper to fill on this machine serves the spec's later requests. The walk is a
running row's real tokens where the decode side handed one over by then (``note_walk``:
rows start as the routed compile ends, and a rival worth switching to, xgrammar on free
text, compiles for far longer than a few steps), else a probe walk of the grammar.
A verdict for the rival is also kept as a ``Verdict`` (``offer``): rows of that spec already
running on the routed grammar switch to the rival (``decode/engine_switch``).

Kept apart from the service (``compiler``): this is a policy started once a spec's routed
compile is done (before its first fill: the rival's compile starts within milliseconds of
the first request), never on a request's path, and never beside the routed compile (it
would take that compile's CPU). Its only effect on the service is one cache insert, under
the service's lock, and only while the grammar it measured is still the one cached.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import metrics
from ..backends import registry
from ..specs.grammar_spec import BackendName, GrammarSpec
from . import fillcost
from .grammar import Grammar
from .router import Plan
from .state import ServiceState

_FILL_TUNED = metrics.FILL_TUNED
#: comparisons waiting for their rival backend's one compile at a time (the oldest dropped)
QUEUED_MAX = 64
#: the fewest tokens of a running row's history a comparison takes instead of a probe walk
REAL_WALK_MIN = 16
log = logging.getLogger("grammask")

#: ``Compiler(fill_verdict=...)``: measure (auto), or force the verdict (tests: no timing)
VerdictMode = Literal["auto", "rival", "routed"]


@dataclass
class Verdict:
    """The rival fills a spec cheaper here: rows on ``routed`` may switch to ``grammar``.
    ``switched`` / ``stayed`` count the rows that did and, by reason, those that could not
    (``decode/engine_switch`` updates them; one log line once the spec's rows are done)."""

    key: str
    routed: str
    grammar: Grammar
    routed_us: float
    rival_us: float
    switched: int = 0
    stayed: dict[str, int] = field(default_factory=dict)
    reported: bool = False

    def describe(self) -> str:
        stayed = ", ".join(f"{n} {why}" for why, n in sorted(self.stayed.items())) or "none"
        return (f"{self.grammar.spec.describe()}: {self.routed} {self.routed_us:.1f} µs a "
                f"token, {self.grammar.backend} {self.rival_us:.1f}: {self.switched} running "
                f"rows switched to {self.grammar.backend} (stayed: {stayed})")


class FillTuner:
    """Compares the fill of a spec's routed grammar with its fallback's, off the request path.

    ``compile`` and ``plan`` are the service's own (the rival compile takes the normal path:
    its own key, deadline and cache); ``submit`` runs work on the service's pool (it raises
    ``RuntimeError`` once that pool shut down)."""

    def __init__(self, state: ServiceState, *, compile: Callable[[GrammarSpec], Grammar],
                 plan: Callable[[GrammarSpec], Plan], submit: Callable[..., Any],
                 verdict: VerdictMode = "auto") -> None:
        self._state = state
        self._compile = compile
        self._plan = plan
        self._submit = submit
        self._verdict = verdict
        self._structure: dict[str, int] | None = None  # probe walks' structural tokens
        self._offers: dict[tuple[str, str], Verdict] = {}
        self._offers_lock = threading.Lock()
        #: bumped by each new offer: a fill job looks for rows to switch only when it moved
        self.epoch = 0
        #: the specs with an offer (a new set per offer: read without the lock)
        self.offered: frozenset[str] = frozenset()
        # one rival compile at a time per backend (a wave of new schemas must not fill the
        # rival's compile slots that first masks routed there wait for); the rest queue
        self._busy: set[str] = set()
        self._queued: dict[str, deque[tuple[GrammarSpec, Grammar]]] = {}
        #: the specs whose comparison would take a running row's tokens (a new set per
        #: change: read without the lock), and the walks handed over for them
        self.wanting: frozenset[str] = frozenset()
        self._walks: dict[str, list[int]] = {}

    def note_walk(self, key: str, tokens: list[int]) -> None:
        """A running row of spec ``key`` took ``tokens`` on the routed grammar (its
        constrained history): the comparison fills along them, the longest handed over (at
        most ``fillcost.PROBE_TOKENS``: then no more are asked for). Ignored once the
        comparison ran."""
        with self._offers_lock:
            if key in self.wanting and len(tokens) > len(self._walks.get(key, ())):
                self._walks[key] = list(tokens[:fillcost.PROBE_TOKENS])
                if len(tokens) >= fillcost.PROBE_TOKENS:
                    self.wanting = self.wanting - {key}

    def offer(self, key: str, backend: str) -> Verdict | None:
        """The verdict for rows of spec ``key`` running on ``backend`` (None: none)."""
        return self._offers.get((key, backend))

    def after_compile(self, spec: GrammarSpec, grammar: Grammar) -> None:
        """Start a comparison when another backend enforces every keyword of this JSON
        schema (the route's fallback: set only then) and nothing forced the choice."""
        if (spec.backend is not None or spec.kind != "json_schema"
                or grammar.fallback_from is not None or grammar.from_disk):
            return
        route = self._plan(spec).route
        other = route.fallback
        if other is None or route.backend != grammar.backend or route.lenient:
            return
        with self._offers_lock:
            self.wanting = self.wanting | {spec.key}
            if other in self._busy:
                queue = self._queued.setdefault(other, deque(maxlen=QUEUED_MAX))
                queue.append((spec, grammar))
                return
            self._busy.add(other)
        self._start(spec, grammar, other)

    def _start(self, spec: GrammarSpec, grammar: Grammar, other: BackendName) -> None:
        try:
            self._submit(self._tune_then_next, spec, grammar, other)
        except RuntimeError:  # closed meanwhile: nothing to tune
            with self._offers_lock:
                self._busy.discard(other)
                self._walks.clear()
                self.wanting = frozenset()

    def _tune_then_next(self, spec: GrammarSpec, grammar: Grammar, other: BackendName) -> None:
        """``_tune``, then the next comparison queued for the same rival backend."""
        try:
            self._tune(spec, grammar, other)
        finally:
            with self._offers_lock:
                self._walks.pop(spec.key, None)
                self.wanting = self.wanting - {spec.key}
                queue = self._queued.get(other)
                following = queue.popleft() if queue else None
                if following is None:
                    self._busy.discard(other)
            if following is not None:
                self._start(*following, other)

    def _tune(self, spec: GrammarSpec, grammar: Grammar, other: BackendName) -> None:
        """Compile ``other``, compare the fills on a probe walk, and serve the cheaper for
        ``spec`` from now on."""
        try:
            rival = self._compile(spec.with_backend(other))
            if rival.unenforced != grammar.unenforced:
                return
            result, walked = self._compare(spec, grammar, rival)
        except Exception as exc:  # never the request's concern: it is served already
            log.debug("grammask: fill tuning of %s skipped: %s", spec.describe(), exc)
            return
        moved = (result.b_cheaper() if self._verdict == "auto"
                 else self._verdict == "rival")
        metrics.FILL_SECONDS_PER_TOKEN.labels(backend=grammar.backend).observe(
            result.a_us / 1e6)
        metrics.FILL_SECONDS_PER_TOKEN.labels(backend=other).observe(result.b_us / 1e6)
        _FILL_TUNED.labels(routed=grammar.backend,
                           served=other if moved else grammar.backend).inc()
        with self._state.lock:
            self._state.stats.fill_tuned += 1
            if not moved or self._state.closed or self._state.memory.peek(spec.key) is not grammar:
                return
            self._state.stats.fill_moved += 1
            title = registry.info(other).title
            served = dataclasses.replace(
                rival, spec=grammar.spec, fallback_from=None,
                reason=f"{grammar.reason}; {title} then measured cheaper to fill here: "
                       f"{result.b_us:.1f} µs a token against {result.a_us:.1f} "
                       f"({walked} of {result.tokens} tokens)")
            self._state.memory.insert(spec.key, served)
        with self._offers_lock:
            self._offers[(spec.key, grammar.backend)] = Verdict(
                spec.key, grammar.backend, served, result.a_us, result.b_us)
            self.offered = self.offered | {spec.key}
            self.epoch += 1
        log.info("grammask: fill tuning: %s fills cheaper than %s here (%.1f against %.1f µs "
                 "a token, %s of %d tokens): it serves %s from now on, running rows switch",
                 other, grammar.backend, result.b_us, result.a_us, walked, result.tokens,
                 spec.describe())

    def _compare(self, spec: GrammarSpec, grammar: Grammar, rival: Grammar
                 ) -> tuple[fillcost.Comparison, str]:
        """Both fills along a running row's tokens when one was handed over (and both
        engines take enough of it), else along a probe walk; and which walk it was."""
        vocab_size = self._state.vocab.vocab_size
        with self._offers_lock:
            real = self._walks.pop(spec.key, None)
        if real is not None and len(real) >= REAL_WALK_MIN:
            result = fillcost.compare(grammar, rival, real, vocab_size)
            if result.tokens >= REAL_WALK_MIN:
                return result, "a running row's walk"
        walk = fillcost.probe(grammar, self._structure_tokens(), vocab_size,
                              seed=int(spec.key[:8], 16))
        return fillcost.compare(grammar, rival, walk, vocab_size), "a probe walk"

    def _structure_tokens(self) -> dict[str, int]:
        """The probe walks' structural tokens of this vocabulary (texts that are one token)."""
        if self._structure is None:
            found = {}
            for text in fillcost.STRUCTURE:
                ids = self._state.vocab.encode(text)
                if len(ids) == 1:
                    found[text] = ids[0]
            self._structure = found
        return self._structure
