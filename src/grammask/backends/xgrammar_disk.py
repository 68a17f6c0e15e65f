"""xgrammar's disk codec: its compiled grammars as ``diskcache`` payloads, and back.

Why xgrammar and only it: its compile precomputes a per-token mask table over the whole
vocabulary (seconds for large JSON schemas, minutes for pathological ones), and xgrammar offers
a faithful serialization of it (``xgrammar.CompiledGrammar.serialize_json`` /
``deserialize_json``, which needs the vocabulary's ``TokenizerInfo`` and checks its metadata;
it is xgrammar's only format). Loading costs a fraction of the compile (bench/diskcache.py,
bench/diskcache_heavy.py). llguidance compiles in milliseconds and has no such format.

Where the time and the memory go (xgrammar 0.2): a load is xgrammar parsing its JSON, mostly
the adaptive token mask table: one entry per parser state, a dense one is a 4,750-word bitset
written as decimal numbers (``strtoll`` and picojson's per-number values dominate; about
100 kB/ms, and at least ~55 ns per number whatever its digits). That parse is the floor of a
load: 40 patterned properties are 9.3 million numbers, 0.8 s. The entries repeat (3,061 entries,
47 distinct: 71 MB of JSON, 11 MB with each entry stored once, 2.9 MB compressed), which saves
the file and the inflate, not the parse. The serializer and the parser both build the whole
picojson tree: 8 to 13 times the JSON (the serializer's peak, 71 MB: +0.58 GB; the parser's,
+0.5 GB), and the JSON grows far faster than the grammar with nested ``oneOf``/``anyOf``
(depth 8: a 5 MB grammar, 151 MB of JSON, +2.5 GB; a vLLM worker was OOM-killed at depth 10).

Hence the writer: a grammar that is small and shallow (``inline_memory``, ``INLINE_DEPTH``) is
serialized on the writer thread; any other is compiled again and serialized by a child process
(``python -c``, niced, ``oom_score_adj`` 1000, ``RLIMIT_DATA`` = its footprint after start-up
plus ``writer_memory``, an alarm): the serving process never holds the serializer's peak, and a
grammar the ceiling cannot serialize is simply not written. The child gets the spec, the key
material and the vocabulary's tokens on stdin, and writes only if the key it computes from them
is byte for byte the parent's (same sources, versions, vocabulary) and its grammar has the
parent's size.

Payload: xgrammar's JSON cut into pieces at its mask entries, each distinct piece stored once
(``pack_json``: piece count u32, sequence length u32, JSON length u64, piece byte lengths
u32[], the sequence of piece indices u32[], the pieces); joining them gives back xgrammar's text
exactly. The key material (``key_material``) is JSON: format, backend and its version,
grammask's version and a digest of the sources that shape a compile, vocabulary digest and
size, options, and the spec's whole canonical form. A payload whose piece table does not add
up, or that xgrammar refuses, is discarded (and the file removed) like a bad file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from ..diskcache import FORMAT_VERSION, DiskCache, warn_once

if TYPE_CHECKING:
    from ..spec import GrammarSpec
    from ..vocab import Vocabulary

log = logging.getLogger("grammask")
#: the vocabulary as the writer child reads it, per vocabulary digest (built once)
_FRAMES: dict[str, bytes] = {}
#: compiles a spec for a vocabulary (lenient or not) into xgrammar's own compiled grammar
CompileFn = Callable[["GrammarSpec", "Vocabulary", bool], xgr.CompiledGrammar]

_PIECES = struct.Struct("<IIQ")  # distinct pieces, sequence length, characters of the JSON
INLINE_DEPTH = 4
#: A child costs seconds of (niced) CPU: start-up, a second compile. A grammar that compiled
#: faster than this is not worth one (nested ``oneOf`` compiles in 0.1 s into 38 MB of JSON).
CHILD_MIN_COMPILE_MS = 250.0
#: The child's deadline: this, plus four times the parent's compile time.
CHILD_TIMEOUT_S = 120.0
#: Loading (xgrammar's parse) handles its JSON at roughly this many bytes per millisecond; a
#: grammar whose load would not beat its compile by ``WORTH`` is not written. The JSON is at
#: least the grammar's memory size, so a compile faster than that bound is skipped unseen.
LOAD_BYTES_PER_MS = 100_000
WORTH = 0.8
#: Parsing holds about 7 times the JSON in the serving process (71 MB: +0.5 GB): longer JSON is
#: neither written nor loaded (it would also load slowly: 1.2 GB took 44 s).
MAX_JSON_BYTES = 128 * 1024 * 1024
#: One entry of xgrammar's adaptive token mask table: a flat object of integer lists. A quote
#: inside a JSON string is escaped, so this cannot match inside one; either way the pieces
#: join back to the exact text.
_MASK_ENTRY = re.compile(r'\{"store_type":[^{}]*\}')
_CHILD_CODE = "from grammask.backends.xgrammar import disk_child_main; disk_child_main()"

#: Sources whose changes can change a compiled grammar: part of the key.
#: Bump whenever a change to how grammask shapes an xgrammar compile (``backends/xgrammar.py``,
#: ``normalize.py``, ``spec.py``, ``vocab.py``) would make a stored grammar differ: entries
#: under an older recipe are then never read. A constant, not a digest of those sources, so
#: an unrelated edit (or a parent and a writer child reading files mid-edit) keeps the cache.
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


def _u32(values: array[int]) -> bytes:
    if sys.byteorder == "big":  # pragma: no cover - the format is little-endian everywhere
        values.byteswap()
    return values.tobytes()


def _read_u32(data: bytes | memoryview, count: int) -> array[int]:
    values = array("I")
    values.frombytes(data[:4 * count])
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    return values


def pack_json(text: str) -> bytes:
    """xgrammar's JSON as pieces cut at its mask entries, each distinct piece once (the
    entries repeat: 71 MB of JSON become 11 MB); ``unpack_json`` joins them back exactly."""
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
                     _u32(array("I", map(len, pieces))), _u32(sequence), *pieces])


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
    sizes = _read_u32(view, count)
    sequence = _read_u32(view[4 * count:], length)
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
def _vocab_frame(vocab: Vocabulary) -> bytes:
    """What the child needs to rebuild the vocabulary (its digest is checked there)."""
    head = json.dumps({"special_ids": sorted(vocab.special_ids), "stop_ids": list(vocab.stop_ids),
                       "vocab_size": vocab.vocab_size, "name": vocab.name,
                       "think_end": vocab.think_end}).encode()
    frame = bytearray(struct.pack("<QQ", len(head), len(vocab.tokens)) + head)
    frame += _u32(array("I", map(len, vocab.tokens)))
    for token in vocab.tokens:  # not bytes.join: it holds an 80-byte buffer per token (12 MB)
        frame += token
    return bytes(frame)


def _read_vocab(data: memoryview) -> Vocabulary:
    from ..vocab import Vocabulary

    hlen, count = struct.unpack_from("<QQ", data)
    head = json.loads(bytes(data[16:16 + hlen]))
    sizes = _read_u32(data[16 + hlen:], count)
    offset = 16 + hlen + 4 * count
    tokens = []
    for size in sizes:
        tokens.append(bytes(data[offset:offset + size]))
        offset += size
    return Vocabulary(tokens, special_ids=head["special_ids"], stop_ids=head["stop_ids"],
                      vocab_size=head["vocab_size"], name=head["name"],
                      think_end=head["think_end"])


def child_request(cache: DiskCache, spec: GrammarSpec, vocab_frame: bytes, material: bytes,
                  job: dict[str, Any]) -> bytes:
    """The child's stdin: the job (spec fields, options, bounds), the key, the vocabulary."""
    job = {**job, "directory": str(cache.directory), "max_bytes": cache.max_bytes,
           "compress": cache.compress, "limit": cache.writer_memory,
           "spec": {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}}
    head = json.dumps(job).encode()
    return b"".join([struct.pack("<QQ", len(head), len(material)), head, material,
                     vocab_frame])


def child_env() -> dict[str, str]:
    """The child imports this grammask (its key must match anyway), never touches a GPU and
    leaves no metrics files behind (vLLM's multiprocess Prometheus directory)."""
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def _child_write(data: bytes, compile_fn: CompileFn) -> dict[str, Any]:
    import resource
    import signal

    hlen, mlen = struct.unpack_from("<QQ", data)
    job = json.loads(data[16:16 + hlen])
    material = data[16 + hlen:16 + hlen + mlen]
    signal.alarm(int(job["timeout_s"]) + 1)  # default action: end the process
    with contextlib.suppress(OSError):
        os.nice(10)
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")  # the first the kernel kills
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from ..spec import GrammarSpec

    vocab = _read_vocab(memoryview(data)[16 + hlen + mlen:])
    del data
    spec = GrammarSpec(**job["spec"])
    if key_material(spec, vocab, lenient=job["lenient"]) != material:
        return {"written": False, "why": "the child's key differs (other sources or versions)"}
    vocab.xgrammar_info  # noqa: B018 - built before the ceiling: it is start-up, not the write
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # the peak below is the write's own
    base = _status_kib("VmRSS")
    limit = _status_kib("VmData") + int(job["limit"])
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    started = time.perf_counter()
    inner = compile_fn(spec, vocab, job["lenient"])
    compile_ms = (time.perf_counter() - started) * 1000
    report: dict[str, Any] = {"compile_ms": compile_ms, "base_rss": base}
    if int(inner.memory_size_bytes) != job["memory"]:
        return {**report, "written": False, "why": "the child compiled another grammar"}
    text = inner.serialize_json()
    del inner
    cache = DiskCache(job["directory"], job["max_bytes"], compress=job["compress"])
    given = job["compile_ms"]
    written, why = store_json(cache, spec.describe(), material, text,
                              compile_ms if given is None else float(given))
    return {**report, "written": written, "why": why, "json_bytes": len(text),
            "file_bytes": cache.path_for(material).stat().st_size if written else 0,
            "peak_rss": _status_kib("VmHWM")}


def child_main(compile_fn: CompileFn) -> None:
    """The writer child (``python -c``): compile, serialize, store, one JSON report line."""
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        report.update(_child_write(sys.stdin.buffer.read(), compile_fn))
        code = 0
    except BaseException as exc:  # bad_alloc at the ceiling, a refused spec, ...
        report.update(written=False, why=f"{type(exc).__name__}: {exc}"[:500])
        with contextlib.suppress(Exception):
            report["peak_rss"] = _status_kib("VmHWM")
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    os._exit(code)  # no atexit, no interpreter teardown: the parent has its answer


def run_child(request: bytes, timeout: float) -> dict[str, Any]:
    """Run one writer child; its report, or why there is none."""
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-c", _CHILD_CODE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=child_env(), close_fds=True)
    except (OSError, ValueError) as exc:
        warn_once("child", "grammask: cannot start the disk cache's writer process (%s): "
                   "large grammars are not written", exc)
        return {"written": False, "why": f"cannot start the writer child ({exc})"}
    try:
        out, err = proc.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"written": False, "pid": proc.pid, "why": f"timed out after {timeout:.0f} s"}
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        report: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):  # it died (a signal, the kernel) or never started
        tail = err.decode(errors="replace").strip().splitlines()[-1:]
        report = {"written": False, "pid": proc.pid,
                  "why": f"the child ended with status {proc.returncode} {tail}"}
        warn_once("child-report", "grammask: the disk cache's writer process gave no "
                   "report (%s)", report["why"])
    report["returncode"] = proc.returncode
    return report


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
            compiled = xgr.CompiledGrammar.deserialize_json(text, vocab.xgrammar_info)
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
    else:
        timeout = CHILD_TIMEOUT_S + 4 * (compile_ms or 0.0) / 1000
        job = {"lenient": lenient, "compile_ms": compile_ms, "memory": size,
               "timeout_s": timeout}

        def write() -> None:  # the request is built here, off the request path
            frame = _FRAMES.get(vocab.digest)
            if frame is None:
                frame = _FRAMES[vocab.digest] = _vocab_frame(vocab)
            report = run_child(child_request(cache, spec, frame, material, job), timeout)
            cache.forget_size()  # the child wrote (and evicted) on its own
            cache.report({"where": "child", **report}, spec.describe())
    return cache.submit(write)
