"""The compile service's memory: grammars, failures and plans by spec key.

Kept apart from the service (``compiler``) so the service stays a coordinator of threads
and deadlines; nothing here locks: the service holds its one lock around every call.

- grammars: an LRU bounded by (calibrated) bytes;
- failures: a bounded negative cache whose entries expire (insertion order = expiry order);
- plans: the router's plan per key. The router is a pure function of the spec, so a spec
  asked for at admission (``check``), at compile and by the first-mask hedge is planned
  once; a plan is dropped when the registered backends change.
"""

from __future__ import annotations

from collections import OrderedDict

from ..backends.registry import BackendInfo
from ..errors import GrammarError
from .grammar import Grammar, fresh_error
from .router import Plan
from .stats import Stats

#: Plans kept (a few hundred bytes each): far more than the grammars a cache usually holds.
MAX_PLANS = 4096
#: At most one heap trim per this many seconds: a trim walks the heap.
TRIM_INTERVAL_S = 1.0
#: Grammar bytes inserted since the last trim that make one due (evictions always do): a
#: trim hands free pages back that the next compiles fault in again, which costs a small
#: compile more than the scratch it frees; large compiles leave large scratch and get there
#: at once (docs/benchmarks.md, Figures: compile cache).
TRIM_AFTER_BYTES = 8 << 20
#: A compile at least this long makes a trim due at once (no ``TRIM_INTERVAL_S`` wait): its
#: scratch, freed when it ended, is large, and the trim costs a small share of such a
#: compile (docs/benchmarks.md, Figures: compile cache).
TRIM_AFTER_COMPILE_MS = 100.0


class CompileCache:
    """Grammars (LRU by bytes), failures (expiring) and plans (LRU by count), by spec key."""

    def __init__(self, stats: Stats, max_bytes: int, negative_ttl_s: float,
                 max_negative: int, max_plans: int = MAX_PLANS) -> None:
        self.stats = stats
        self.max_bytes = max_bytes
        self.negative_ttl_s = negative_ttl_s
        self.max_negative = max_negative
        self.max_plans = max_plans
        self.used = 0
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._failed: OrderedDict[str, tuple[float, GrammarError]] = OrderedDict()
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self._planned_with: tuple[BackendInfo, ...] = ()
        self.trim_wanted = False  # enough memory was freed since the last trim
        self._last_trim = 0.0
        self._inserted = 0  # grammar bytes inserted since the last trim
        self._urgent = False  # a long compile's scratch: trim without waiting the interval

    # ------------------------------------------------------------------------ grammars
    def get(self, key: str) -> Grammar | None:
        """A cached grammar, made the most recent (a hit)."""
        hit = self._grammars.get(key)
        if hit is not None:
            self._grammars.move_to_end(key)
        return hit

    def peek(self, key: str) -> Grammar | None:
        return self._grammars.get(key)

    def insert(self, key: str, grammar: Grammar) -> bool:
        """Keep a grammar, evicting the least recent ones past the byte budget; False when it
        does not fit."""
        if grammar.compile_ms >= TRIM_AFTER_COMPILE_MS and not grammar.from_disk:
            self.trim_wanted = self._urgent = True
        size = grammar.memory_bytes
        if size > self.max_bytes:
            return False
        self._inserted += size  # compile scratch, freed but not yet returned
        if self._inserted >= TRIM_AFTER_BYTES:
            self.trim_wanted = True
        old = self._grammars.pop(key, None)
        if old is not None:
            self.used -= old.memory_bytes
        self._grammars[key] = grammar
        self.used += size
        while self.used > self.max_bytes:
            _, evicted = self._grammars.popitem(last=False)
            self.used -= evicted.memory_bytes
            self.stats.evictions += 1
            self.trim_wanted = True
        return True

    def __len__(self) -> int:
        return len(self._grammars)

    def __contains__(self, key: str) -> bool:
        return key in self._grammars

    # ------------------------------------------------------------------------ failures
    def failure(self, key: str, now: float) -> GrammarError | None:
        """The remembered failure of a key while it has not expired (``now``: the service's
        ``time.monotonic``)."""
        failed = self._failed.get(key)
        if failed is None:
            return None
        if failed[0] > now:
            return failed[1]
        del self._failed[key]
        return None

    def remember_failure(self, key: str, error: GrammarError, now: float) -> None:
        """Errors kept without their traceback; expired entries purged; at most
        ``max_negative`` entries, oldest dropped first."""
        while self._failed:
            oldest = next(iter(self._failed.values()))
            if oldest[0] > now and len(self._failed) < self.max_negative:
                break
            self._failed.popitem(last=False)
        if self.max_negative:
            self._failed.pop(key, None)
            self._failed[key] = (now + self.negative_ttl_s, fresh_error(error))  # type: ignore[assignment]

    @property
    def failures(self) -> int:
        return len(self._failed)

    # --------------------------------------------------------------------------- plans
    def plan(self, key: str, backends: tuple[BackendInfo, ...]) -> Plan | None:
        """The plan made for this key, unless the registered backends (now ``backends``)
        changed since."""
        if not self._plans:
            return None
        if backends != self._planned_with:
            self._plans.clear()
            return None
        found = self._plans.get(key)
        if found is not None:
            self._plans.move_to_end(key)
        return found

    def keep_plan(self, key: str, plan: Plan, backends: tuple[BackendInfo, ...]) -> None:
        """Keep a plan made while ``backends`` were the registered ones."""
        if backends != self._planned_with:
            self._plans.clear()
            self._planned_with = backends
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.max_plans:
            self._plans.popitem(last=False)

    # --------------------------------------------------------------------------- trims
    def trim_due(self, now: float) -> bool:
        """Memory was freed or allocated, and the last heap trim is a while ago."""
        return self.trim_wanted and (self._urgent or now - self._last_trim >= TRIM_INTERVAL_S)

    def take_trim(self, now: float, force: bool = False) -> bool:
        """Whether to return freed memory to the OS now (at most once a ``TRIM_INTERVAL_S``
        unless forced); a yes counts as done."""
        if not force and not self.trim_due(now):
            return False
        self.trim_wanted = self._urgent = False
        self._inserted = 0
        self._last_trim = now
        self.stats.trims += 1
        return True

    # --------------------------------------------------------------------------- all
    def clear(self) -> None:
        """Forget everything: the next request of any spec is cold again (plans too)."""
        self._grammars.clear()
        self._failed.clear()
        self._plans.clear()
        self.used = 0
