"""Warm-up: compile a directory of specs into the cache before traffic arrives.

A first request whose grammar is not compiled waits for it (bounded by ``wait_s``; past it the
request fails alone). Operators who know their schemas ahead compile them at start-up:
``grammask warmup DIR`` on the command line, or the plugin setting ``warmup_dir``.

What a directory may hold (one spec a file; subdirectories are not read):

| file | spec |
|---|---|
| ``*.json`` | a JSON schema |
| ``*.choice.json`` | a JSON list of strings (a choice) |
| ``*.gbnf``, ``*.ebnf`` | a GBNF / EBNF grammar |
| ``*.lark`` | a Lark grammar |
| ``*.regex`` | a regular expression (one trailing newline is dropped) |

Other files are listed as skipped. A bad file is reported with its error and skipped; the
others still compile. Schemas are compiled as requests send them by default
(``any_whitespace`` and closed objects as the library defaults), so the cache keys match.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..errors import GrammarError, ServerFault
from ..specs.grammar_spec import GrammarSpec
from .compiler import Compiler, Grammar

#: files larger than this are refused (the spec limit is 4 MB; a file is read whole)
MAX_FILE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class WarmResult:
    """One file's outcome."""

    file: str
    kind: str | None
    backend: str | None
    compile_ms: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.kind is not None


def spec_of_file(path: Path, *, any_whitespace: bool = True) -> GrammarSpec | None:
    """The spec a file holds (by its name), None for files warm-up does not read."""
    name = path.name.lower()
    if path.stat().st_size > MAX_FILE_BYTES:
        raise GrammarError(f"{path.name}: {path.stat().st_size} bytes is over the "
                           f"{MAX_FILE_BYTES} byte limit", where=path.name)
    if name.endswith(".choice.json"):
        choices = json.loads(path.read_text(encoding="utf-8"))
        return GrammarSpec.choice(choices)
    if name.endswith(".json"):
        return GrammarSpec.json_schema(path.read_text(encoding="utf-8"),
                                       any_whitespace=any_whitespace)
    if name.endswith((".gbnf", ".ebnf")):
        return GrammarSpec.grammar(path.read_text(encoding="utf-8"), syntax="ebnf")
    if name.endswith(".lark"):
        return GrammarSpec.grammar(path.read_text(encoding="utf-8"), syntax="lark")
    if name.endswith(".regex"):
        text = path.read_text(encoding="utf-8")
        return GrammarSpec.regex(text[:-1] if text.endswith("\n") else text)
    return None


def warm(compiler: Compiler, directory: str | Path, *, any_whitespace: bool = True,
         progress: Callable[[WarmResult], None] | None = None) -> list[WarmResult]:
    """Compile every spec file of ``directory`` (concurrently, on the compiler's pool)."""
    root = Path(directory)
    if not root.is_dir():
        raise GrammarError(f"warm-up directory {str(root)!r} does not exist or is not a "
                           "directory", where=str(root))
    started: list[tuple[Path, GrammarSpec | None, Future[Grammar] | None, str | None]] = []
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        try:
            spec = spec_of_file(path, any_whitespace=any_whitespace)
            future = compiler.compile_async(spec) if spec is not None else None
            started.append((path, spec, future, None))
        except (GrammarError, ServerFault, ValueError, UnicodeDecodeError, OSError) as exc:
            started.append((path, None, None, _message(exc)))
    results = []
    for path, spec, future, error in started:
        result = _outcome(path, spec, future, error)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def _outcome(path: Path, spec: GrammarSpec | None, future: Future[Grammar] | None,
             error: str | None) -> WarmResult:
    if error is not None:
        return WarmResult(path.name, None, None, None, error)
    if spec is None or future is None:
        return WarmResult(path.name, None, None, None, "skipped: not a spec file")
    started = time.perf_counter()
    try:
        grammar = future.result()
    except Exception as exc:
        return WarmResult(path.name, spec.kind, None,
                          round((time.perf_counter() - started) * 1000, 2), _message(exc))
    return WarmResult(path.name, spec.kind, grammar.backend, round(grammar.compile_ms, 2))


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, GrammarError) else f"{type(exc).__name__}: {text}"


def summary_table(results: Iterable[WarmResult]) -> str:
    """A Markdown table: file, kind, backend, compile ms, error; then the counts."""
    rows = list(results)
    lines = ["| file | kind | backend | compile ms | error |", "|---|---|---|---|---|"]
    for r in rows:
        ms = "" if r.compile_ms is None else f"{r.compile_ms:.1f}"
        lines.append(f"| {r.file} | {r.kind or ''} | {r.backend or ''} | {ms} | "
                     f"{(r.error or '').replace('|', '/')[:160]} |")
    ok = sum(r.ok for r in rows)
    skipped = sum(r.kind is None and (r.error or "").startswith("skipped") for r in rows)
    lines.append(f"\n{ok} compiled, {len(rows) - ok - skipped} failed, {skipped} skipped")
    return "\n".join(lines)
