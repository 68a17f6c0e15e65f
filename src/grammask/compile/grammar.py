"""A compiled spec as grammask hands it out (``Grammar``).

Kept apart from the service (``compiler``) so that what carries out a plan (``plan_runner``)
and what serves rows can name a grammar without depending on the service.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..backends import BackendGrammar, Matcher, registry
from ..errors import GrammarError, ServerFault
from ..specs.grammar_spec import BackendName, GrammarSpec


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled spec: makes matchers, and says which backend serves it and why.

    Made by ``Compiler.compile`` (never by hand); immutable, shared by every request of its
    spec and across threads (each thread drives its own matcher).

    Attributes
    ----------
    spec : GrammarSpec
        The spec it was compiled for (with the compiler's forced backend, if any).
    backend : str
        The registered backend that serves it.
    reason : str
        Why that backend (the router's reason, a fallback's cause, a fill measurement).
    unenforced : tuple of str
        What of the spec that backend does not enforce (its ``gaps`` the spec uses, a
        lenient compile's warnings); empty when everything is enforced.
    compile_ms : float
        How long the compile took (the load time when ``from_disk``).
    backend_grammar : BackendGrammar
        The backend's own compiled form.
    fallback_from : str or None
        The backend that failed first, when a fallback serves it.
    from_disk : bool
        Loaded from the disk cache.
    """

    spec: GrammarSpec
    backend: BackendName
    reason: str
    unenforced: tuple[str, ...]
    compile_ms: float
    backend_grammar: BackendGrammar = field(repr=False)
    fallback_from: BackendName | None = None
    from_disk: bool = False

    def matcher(self) -> Matcher:
        """A fresh ``Matcher`` at the grammar's start (cheap); raises nothing. Its contract
        (``accept``, ``fill``, ``rollback``...) is ``backends.base``'s."""
        return self.backend_grammar.matcher()

    @property
    def memory_bytes(self) -> int:
        """Estimated process memory this grammar holds, in bytes: the backend's own size
        scaled by its calibrated footprint (``BackendInfo.footprint``, against measured RSS)."""
        scale, base = registry.footprint(self.backend)
        return int(scale * int(self.backend_grammar.memory_bytes) + base)


def fresh_error(error: BaseException) -> BaseException:
    """A copy without traceback, cause or context: raising a stored error object again and
    again grows its traceback (and keeps every frame alive) on each raise."""
    try:
        twin = copy.copy(error)
    except Exception:  # an exception class that does not copy: a plain one says the same
        twin = (ServerFault if isinstance(error, ServerFault) else GrammarError)(str(error))
    twin.__traceback__ = None
    twin.__cause__ = None
    twin.__context__ = None
    twin.__suppress_context__ = True
    return twin

