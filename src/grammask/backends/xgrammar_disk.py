"""xgrammar's disk codec: its compiled grammars as ``diskcache`` payloads, and back.

Why xgrammar and only it: its compile precomputes a per-token mask table over the whole
vocabulary (seconds for large JSON schemas, minutes for pathological ones), and xgrammar offers
a faithful serialization of it (``xgrammar.CompiledGrammar.serialize_json`` /
``deserialize_json``, which needs the vocabulary's ``TokenizerInfo`` and checks its metadata;
it is xgrammar's only format). Loading costs a fraction of the compile
(``bench/diskcache_heavy.py``, docs/benchmarks.md). llguidance compiles in milliseconds and
has no such format.

Where the time and the memory go (xgrammar 0.2): a load is xgrammar parsing its JSON, mostly
the adaptive token mask table: one entry per parser state, a dense one is a 4,750-word bitset
written as decimal numbers (``strtoll`` and picojson's per-number values dominate, with a
floor per number whatever its digits). That parse is the floor of a load. The entries repeat
(few distinct among thousands), which saves the file and the inflate, not the parse. The
serializer and the parser both build the whole picojson tree, many times the JSON, and the
JSON grows far faster than the grammar with nested ``oneOf``/``anyOf`` (deep nesting got a
vLLM worker OOM-killed). The figures: docs/benchmarks.md, Figures: disk cache.

Hence the writer: a grammar that is small and shallow (``inline_memory``, ``INLINE_DEPTH``) is
serialized on the writer thread; any other is compiled again and serialized by a child process
under a memory ceiling (``diskwriter``, the generic part: its protocol, limits and file
safety): the serving process never holds the serializer's peak. The child writes only if the
key it computes is byte for byte the parent's and its grammar has the parent's size.

Payload: xgrammar's JSON cut into pieces at its mask entries, each distinct piece stored once
(``pack_json``: piece count u32, sequence length u32, JSON length u64, piece byte lengths
u32[], the sequence of piece indices u32[], the pieces); joining them gives back xgrammar's text
exactly. The key material (``key_material``) is JSON: format, backend and its version,
grammask's version and ``RECIPE_VERSION`` (a constant, never a digest of source files),
vocabulary digest and size, options, and the spec's whole canonical form. A payload whose
piece table does not add up, or that xgrammar refuses, is discarded (and the file removed)
like a bad file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import struct
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from . import diskwriter
from .diskcache import FORMAT_VERSION, DiskCache, DiskCodec, warn_once
from .diskwriter import read_u32, u32
from .xgrammar_vocab import tokenizer_info

if TYPE_CHECKING:
    from ..specs.grammar_spec import GrammarSpec
    from ..vocab import Vocabulary

log = logging.getLogger("grammask")
#: compiles a spec for a vocabulary (lenient or not) into xgrammar's own compiled grammar
CompileFn = Callable[["GrammarSpec", "Vocabulary", bool], xgr.CompiledGrammar]

_PIECES = struct.Struct("<IIQ")  # distinct pieces, sequence length, characters of the JSON
INLINE_DEPTH = 4
#: A child costs seconds of (niced) CPU: start-up, a second compile. A grammar that compiled
#: faster than this is not worth one (a nested ``oneOf`` can compile fast into large JSON:
#: docs/benchmarks.md, Figures: disk cache).
CHILD_MIN_COMPILE_MS = 250.0
#: The child's deadline: this, plus four times the parent's compile time.
CHILD_TIMEOUT_S = 120.0
#: Loading (xgrammar's parse) handles its JSON at roughly this many bytes per millisecond
#: (docs/benchmarks.md, Figures: disk cache); a grammar whose load would not beat its compile
#: by ``WORTH`` is not written. The JSON is at least the grammar's memory size, so a compile
#: faster than that bound is skipped unseen.
LOAD_BYTES_PER_MS = 100_000
WORTH = 0.8
#: Parsing holds several times the JSON in the serving process: longer JSON is neither
#: written nor loaded (it would also load slowly; docs/benchmarks.md, Figures: disk cache).
MAX_JSON_BYTES = 128 * 1024 * 1024
#: One entry of xgrammar's adaptive token mask table: a flat object of integer lists. A quote
#: inside a JSON string is escaped, so this cannot match inside one; either way the pieces
#: join back to the exact text.
_MASK_ENTRY = re.compile(r'\{"store_type":[^{}]*\}')
#: the writer child's entry (``diskwriter.run_child``): it compiles as the adapter does
CHILD_CODE = "from grammask.backends.xgrammar import disk_child_main; disk_child_main()"

#: The recipe's version, part of the key. Bump whenever a change to how grammask shapes an
#: xgrammar compile (``backends/xgrammar.py``, ``normalize.py``, ``grammar_spec.py``, ``vocab.py``)
#: would make a stored grammar differ: entries under an older recipe are then never read. A
#: constant, not a digest of those sources, so an unrelated edit (or a parent and a writer
#: child reading files mid-edit) keeps the cache.
RECIPE_VERSION = 2

_recipe: str | None = None


def recipe_digest() -> str:
    """grammask's version, ``RECIPE_VERSION`` and xgrammar's version, as one key part."""
    global _recipe
    if _recipe is None:
        from importlib.metadata import PackageNotFoundError, version

        h = hashlib.sha256()
        for package in ("grammask", "xgrammar"):
            try:
                h.update(f"{package}={version(package)};".encode())
            except PackageNotFoundError:
                h.update(f"{package}=unknown;".encode())
        h.update(f"recipe={RECIPE_VERSION}".encode())
        _recipe = h.hexdigest()[:32]
    return _recipe


@functools.cache
def backend_version(name: str = "xgrammar") -> str:
    """The backend's installed version, part of the key (looked up once: it scans sys.path)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:  # pragma: no cover - the backend is imported already
        return "unknown"


def key_material(spec: GrammarSpec, vocab: Vocabulary, *, backend: str = "xgrammar",
                 lenient: bool = False) -> bytes:
    """Everything that determines a compiled grammar. The forced backend is left out (the
    backend is named here), so an auto-routed and a forced request share one file."""
    head = {"format": FORMAT_VERSION, "backend": backend,
            "backend_version": backend_version(backend),
            "recipe": recipe_digest(), "vocab": vocab.digest, "vocab_size": vocab.vocab_size,
            "stop_ids": list(vocab.stop_ids), "lenient": bool(lenient)}
    plain = spec if spec.backend is None else spec.with_backend(None)
    return (json.dumps(head, sort_keys=True) + "\n" + plain._key_material()).encode(
        "utf-8", "surrogatepass")


def alternation_depth(spec: GrammarSpec) -> int:
    """How deep ``oneOf``/``anyOf`` nest in a JSON schema spec (0 for other kinds)."""
    if spec.kind != "json_schema":
        return 0
    try:
        schema = json.loads(spec.source)
    except ValueError:
        return 0
    deepest = 0
    stack: list[tuple[object, int]] = [(schema, 0)]
    while stack:  # iterative: a schema may nest past Python's recursion limit
        node, depth = stack.pop()
        if isinstance(node, dict):
            here = depth + (1 if "oneOf" in node or "anyOf" in node else 0)
            deepest = max(deepest, here)
            stack.extend((v, here) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth) for v in node)
    return deepest


def pack_json(text: str) -> bytes:
    """xgrammar's JSON as pieces cut at its mask entries, each distinct piece once (the
    entries repeat, so the pieces are a fraction of the JSON); ``unpack_json`` joins them
    back exactly."""
    index: dict[str, int] = {}
    sequence = array("I")
    pos = 0
    for match in _MASK_ENTRY.finditer(text):
        for piece in (text[pos:match.start()], match.group()):
            sequence.append(index.setdefault(piece, len(index)))
        pos = match.end()
    sequence.append(index.setdefault(text[pos:], len(index)))
    pieces = [p.encode("utf-8", "surrogatepass") for p in index]
    return b"".join([_PIECES.pack(len(pieces), len(sequence), len(text)),
                     u32(array("I", map(len, pieces))), u32(sequence), *pieces])


def unpack_json(data: bytes, max_chars: int = MAX_JSON_BYTES) -> str:
    """The JSON ``pack_json`` stored; ValueError when the piece table does not add up or the
    text would be longer than ``max_chars`` (checked before it is built)."""
    if len(data) < _PIECES.size:
        raise ValueError(f"{len(data)} bytes, shorter than the piece header")
    count, length, chars = _PIECES.unpack_from(data)
    if chars > max_chars:
        raise ValueError(f"{chars} characters of JSON, past the bound of {max_chars}")
    view = memoryview(data)[_PIECES.size:]
    if len(view) < 4 * (count + length):
        raise ValueError("the piece table is truncated")
    sizes = read_u32(view, count)
    sequence = read_u32(view[4 * count:], length)
    offset = 4 * (count + length)
    if offset + sum(sizes) != len(view):
        raise ValueError("the piece sizes do not add up to the payload")
    if length and max(sequence) >= count:
        raise ValueError("a piece index is out of range")
    pieces = []
    for size in sizes:
        pieces.append(str(view[offset:offset + size], "utf-8", "surrogatepass"))
        offset += size
    if sum(len(pieces[i]) for i in sequence) != chars:
        raise ValueError("the pieces do not add up to the stated length")
    return "".join([pieces[i] for i in sequence])


def store_json(cache: DiskCache, what: str, material: bytes, text: str,
               compile_ms: float | None) -> tuple[bool, str]:
    """Write xgrammar's JSON under ``material`` unless it is too long or too slow to load."""
    load_ms = len(text) / LOAD_BYTES_PER_MS
    if len(text) > MAX_JSON_BYTES:
        return False, f"{len(text) / 1e6:.0f} MB of JSON is past the load bound"
    if compile_ms is not None and load_ms > WORTH * compile_ms:
        return False, (f"loading {len(text) / 1e6:.0f} MB of JSON would take about "
                       f"{load_ms:.0f} ms, compiling took {compile_ms:.0f} ms")
    if not cache.put(material, pack_json(text)):
        return False, "the file could not be written"
    log.info("grammask: %s written to the disk cache (%.1f MB of JSON)", what, len(text) / 1e6)
    return True, "written"


# ---------------------------------------------------------------------- writer child
def _child_write(job: dict[str, Any], spec: GrammarSpec, vocab: Vocabulary, material: bytes,
                 compile_fn: CompileFn) -> dict[str, Any]:
    """xgrammar's part of the writer child (``diskwriter.child_main``): check the key, compile,
    serialize, store."""
    if key_material(spec, vocab, lenient=job["lenient"]) != material:
        return {"written": False, "why": "the child's key differs (other sources or versions)"}
    tokenizer_info(vocab)  # built before the ceiling: it is start-up, not the write
    base = diskwriter.limit_memory(int(job["limit"]))
    started = time.perf_counter()
    inner = compile_fn(spec, vocab, job["lenient"])
    compile_ms = (time.perf_counter() - started) * 1000
    report: dict[str, Any] = {"compile_ms": compile_ms, "base_rss": base}
    if int(inner.memory_size_bytes) != job["memory"]:
        return {**report, "written": False, "why": "the child compiled another grammar"}
    text = inner.serialize_json()
    del inner
    cache = diskwriter.open_cache(job)
    given = job["compile_ms"]
    written, why = store_json(cache, spec.describe(), material, text,
                              compile_ms if given is None else float(given))
    return {**report, "written": written, "why": why, "json_bytes": len(text),
            "file_bytes": cache.path_for(material).stat().st_size if written else 0,
            "peak_rss": diskwriter.peak_rss()}


def child_main(compile_fn: CompileFn) -> None:
    """The writer child (``CHILD_CODE``): compile as the adapter does, serialize, store."""
    diskwriter.child_main(functools.partial(_child_write, compile_fn=compile_fn))


def load(cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False
         ) -> xgr.CompiledGrammar | None:
    """xgrammar's compiled grammar as an earlier compile (any process) left it, or None.
    Never raises."""
    if not cache.enabled:
        return None
    try:
        material = key_material(spec, vocab, lenient=lenient)
        payload = cache.get(material)
        if payload is None:
            return None
        try:
            text = unpack_json(payload)
            del payload
            compiled = xgr.CompiledGrammar.deserialize_json(text, tokenizer_info(vocab))
        except Exception as exc:  # a bad piece table, DeserializeFormatError, ...
            cache.discard(cache.path_for(material), None,
                          f"xgrammar refused it: {type(exc).__name__}: {exc}")
            return None
        return compiled
    except Exception as exc:  # never let the cache break a request
        warn_once(f"load:{cache.directory}", "grammask: disk cache read failed (%s: %s)",
                  type(exc).__name__, exc)
        return None


def store(cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, inner: xgr.CompiledGrammar,
          *, lenient: bool = False, compile_ms: float | None = None) -> bool:
    """Queue xgrammar's compiled grammar for writing; False when not queued. A small,
    shallow one is serialized on the writer thread, any other by a child process under
    ``writer_memory``. With ``compile_ms``, a grammar whose load would not be clearly
    faster than its compile is dropped (before serializing when its size tells)."""
    if not cache.enabled:
        return False
    size = int(inner.memory_size_bytes)
    inline = size <= cache.inline_memory and alternation_depth(spec) <= INLINE_DEPTH
    skip = None
    if compile_ms is not None and size / LOAD_BYTES_PER_MS > WORTH * compile_ms:
        skip = (f"loading {size / 1e6:.1f} MB or more would not beat a "
                f"{compile_ms:.0f} ms compile")
    elif not inline and compile_ms is not None and compile_ms < CHILD_MIN_COMPILE_MS:
        skip = f"a {compile_ms:.0f} ms compile is not worth a writer process"
    if skip is not None:
        log.info("grammask: %s not written to the disk cache: %s", spec.describe(), skip)
        return False
    material = key_material(spec, vocab, lenient=lenient)
    if inline:
        def write() -> None:
            written, why = store_json(cache, spec.describe(), material,
                                      inner.serialize_json(), compile_ms)
            cache.report({"where": "inline", "written": written, "why": why}, spec.describe())
        return cache.submit(write)
    job = {"lenient": lenient, "compile_ms": compile_ms, "memory": size,
           "timeout_s": CHILD_TIMEOUT_S + 4 * (compile_ms or 0.0) / 1000}
    return diskwriter.submit_child(cache, CHILD_CODE, spec, vocab, material, job)


class XGrammarCodec:
    """xgrammar's ``DiskCodec`` (the adapter's ``load_compiled``/``store_compiled`` wrap it)."""

    key_material = staticmethod(key_material)
    load = staticmethod(load)
    store = staticmethod(store)


CODEC: DiskCodec[xgr.CompiledGrammar] = XGrammarCodec()
