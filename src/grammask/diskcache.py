"""A persistent compiled-grammar cache shared by the processes of one host.

What is cached, and why only that:

- **xgrammar** grammars are cached: their compile precomputes a per-token mask table over the
  whole vocabulary (seconds for large JSON schemas, minutes for pathological ones), and xgrammar
  offers a faithful serialization of it (``xgrammar.CompiledGrammar.serialize_json`` /
  ``deserialize_json``, which needs the vocabulary's ``TokenizerInfo`` and checks its metadata;
  it is xgrammar's only format). Loading costs a fraction of the compile (bench/diskcache.py,
  bench/diskcache_heavy.py).
- **llguidance** grammars are not: llguidance compiles in milliseconds (it builds its lexer and
  parser lazily and computes masks on the fly, there is no per-token table to save) and it has no
  serialization format for a compiled grammar.

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

File format (one file per key, ``<sha256 of the key material>.xgc``): the header ``magic``
(8 bytes), ``format version`` (u16), ``flags`` (u16; bit 0: payload is zlib-compressed),
``key length`` (u32), ``payload length`` (u64), ``sha256(payload)`` (32 bytes), then the full key
material (JSON: format, backend and its version, grammask's version and a digest of the sources
that shape a compile, vocabulary digest and size, options, and the spec's whole canonical form),
then the payload (zlib level 1): xgrammar's JSON cut into pieces at its mask entries, each
distinct piece stored once (``pack_json``: piece count u32, sequence length u32, JSON length
u64, piece byte lengths u32[], the sequence of piece indices u32[], the pieces); joining them
gives back xgrammar's text exactly. Nothing is ever unpickled. A file is served only when every
header field, the stored key (compared byte for byte with the expected one: a hash collision or
a renamed file never serves a wrong grammar), the exact length, the checksum and the piece table
agree, and xgrammar accepts the text. Anything else (truncated, flipped bytes, another version,
a directory in place of the file) is a miss: the file is removed, a warning is logged once per
file, and the caller compiles.

Sharing: writes go to a temporary file in the same directory (``0600``), are fsynced and
``os.replace``-d into place, so readers (other tensor-parallel ranks, replicas) never see a
partial file and concurrent writers of one key leave one of their (equal, valid) files. The
directory is created ``0700`` and refused (cache disabled, with a warning) when it is not a
directory owned by the current user or is group/world-writable. The size bound evicts the least
recently used files (by mtime; a read touches its file) after writes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import time
import weakref
import zlib
from array import array
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends.xgrammar import XGrammarCompiled
    from .spec import GrammarSpec
    from .vocab import Vocabulary

log = logging.getLogger("grammask")

MAGIC = b"GRAMMASK"
#: Bump when the header, the payload or the key material changes (it is part of the key, so
#: files of another version live under other names and are never read by this one).
FORMAT_VERSION = 2
SUFFIX = ".xgc"
FLAG_ZLIB = 1
_HEADER = struct.Struct("<8sHHIQ32s")  # magic, version, flags, key length, payload length, sha
_PIECES = struct.Struct("<IIQ")  # distinct pieces, sequence length, characters of the JSON
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
#: Temporary files older than this are a crashed writer's: removed by the eviction scan.
STALE_TMP_S = 3600.0
#: Writes waiting for the writer thread beyond this are dropped (the cache is a bonus).
MAX_PENDING = 64
#: Serialized on the writer thread only when the grammar is this small and its
#: ``oneOf``/``anyOf`` nest at most ``INLINE_DEPTH`` deep; anything else goes to a child. The
#: serializer's peak is 8 to 13 times its JSON, which is 1.5 to 8 times the grammar (maskbench:
#: most grammars are under 1 MB and add 0-12 MB; 3.2 MB added 51 MB; the worst factor seen,
#: 110x, would make 4 MB cost 0.45 GB) but up to 28 times with nested alternatives (depth 5:
#: 0.65 MB, +35 MB; depth 6: 1.3 MB, +164 MB).
INLINE_MEMORY = 4 * 1024 * 1024
INLINE_DEPTH = 4
#: What the writer child may allocate past its start-up footprint (40 patterned properties:
#: about 0.8 GB). A grammar that needs more is not written.
WRITER_MEMORY = 2 * 1024 * 1024 * 1024
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
#: The eviction scan runs after a write when this process's estimate exceeds the bound, or
#: when the last scan is older than this (other processes write too).
RESCAN_S = 30.0
#: One entry of xgrammar's adaptive token mask table: a flat object of integer lists. A quote
#: inside a JSON string is escaped, so this cannot match inside one; either way the pieces
#: join back to the exact text.
_MASK_ENTRY = re.compile(r'\{"store_type":[^{}]*\}')
_CHILD_CODE = "from grammask.diskcache import child_main; child_main()"

#: Sources whose changes can change a compiled grammar: part of the key.
_RECIPE_FILES = ("backends/xgrammar.py", "normalize.py", "spec.py", "vocab.py")

_warned: set[str] = set()
_warned_lock = threading.Lock()
_live: weakref.WeakSet[DiskCache] = weakref.WeakSet()
#: At interpreter exit, queued writes get this long to land (the writer is a daemon thread;
#: one killed mid-write leaves only a temporary file, swept later; a child finishes alone).
EXIT_FLUSH_S = 10.0


@atexit.register
def _flush_at_exit() -> None:
    deadline = time.monotonic() + EXIT_FLUSH_S
    for cache in list(_live):
        cache.flush(max(0.0, deadline - time.monotonic()))


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/grammask``, else ``~/.cache/grammask``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "grammask"


def _warn_once(name: str, message: str, *args: object) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    log.warning(message, *args)


_recipe: str | None = None


def recipe_digest() -> str:
    """grammask's version and a digest of the sources that shape an xgrammar compile."""
    global _recipe
    if _recipe is None:
        from importlib.metadata import PackageNotFoundError, version

        h = hashlib.sha256()
        try:
            h.update(version("grammask").encode())
        except PackageNotFoundError:
            h.update(b"unknown")
        root = Path(__file__).resolve().parent
        for rel in _RECIPE_FILES:
            h.update(rel.encode())
            try:
                h.update((root / rel).read_bytes())
            except OSError:
                h.update(b"missing")
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


def check_directory(path: Path) -> str | None:
    """Why ``path`` must not hold a cache (None: fine). It must be a real directory of the
    current user, writable by nobody else (others could plant grammars)."""
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat it ({exc})"
    uid = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        return "it is a symlink owned by another user"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by the current user ({uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


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


# ------------------------------------------------------------------------ file format
def parse_file(data: bytes, material: bytes) -> tuple[str | None, bytes]:
    """(why the file is bad or None, its payload): every header field, the key, the length
    and the checksum must agree."""
    if len(data) < _HEADER.size:
        return f"truncated ({len(data)} bytes, shorter than the header)", b""
    magic, version, flags, klen, plen, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a grammask cache file (bad magic)", b""
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}", b""
    if flags & ~FLAG_ZLIB:
        return f"unknown flags {flags:#x}", b""
    if len(data) != _HEADER.size + klen + plen:
        return (f"length {len(data)} does not match its header "
                f"({_HEADER.size + klen + plen})"), b""
    if data[_HEADER.size:_HEADER.size + klen] != material:
        return "stored key differs from the expected key", b""
    payload = data[_HEADER.size + klen:]
    if hashlib.sha256(payload).digest() != digest:
        return "payload checksum mismatch", b""
    if flags & FLAG_ZLIB:
        try:
            payload = zlib.decompress(payload)
        except zlib.error as exc:
            return f"payload does not decompress ({exc})", b""
    return None, payload


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
    from .vocab import Vocabulary

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
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def _child_write(data: bytes) -> dict[str, Any]:
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
    from .backends import get_backend
    from .spec import GrammarSpec

    vocab = _read_vocab(memoryview(data)[16 + hlen + mlen:])
    del data
    spec = GrammarSpec(**job["spec"])
    if key_material(spec, vocab, lenient=job["lenient"]) != material:
        return {"written": False, "why": "the child's key differs (other sources or versions)"}
    backend = get_backend("xgrammar")
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
    inner = backend.compile(spec, vocab, lenient=job["lenient"])._compiled  # type: ignore[attr-defined]
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


def child_main() -> None:
    """The writer child (``python -c``): compile, serialize, store, one JSON report line."""
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        report.update(_child_write(sys.stdin.buffer.read()))
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
        _warn_once("child", "grammask: cannot start the disk cache's writer process (%s): "
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
        _warn_once("child-report", "grammask: the disk cache's writer process gave no "
                   "report (%s)", report["why"])
    report["returncode"] = proc.returncode
    return report


# ------------------------------------------------------------------------- the cache
class DiskCache:
    """One cache directory: byte-level ``get``/``put`` keyed by key material, an xgrammar codec
    on top, a background writer (and its child processes) and a size bound. ``enabled`` is
    False when the directory was refused (every call is then a no-op miss)."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 *, compress: bool = True, inline_memory: int = INLINE_MEMORY,
                 writer_memory: int = WRITER_MEMORY) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self.compress = compress
        self.inline_memory = inline_memory
        self.writer_memory = writer_memory
        #: What the last write did: ``where`` (inline/child), ``written``, ``why``, and from a
        #: child its ``pid``, ``peak_rss``, ``base_rss``, ``json_bytes``...
        self.last_write: dict[str, Any] | None = None
        self.enabled = False
        self._cond = threading.Condition()
        self._pending: list[Callable[[], None]] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self._approx: int | None = None
        self._last_scan = 0.0
        self._frames: dict[str, bytes] = {}
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("grammask: disk cache disabled: cannot create %s (%s)",
                        self.directory, exc)
            return
        why = check_directory(self.directory)
        if why is not None:
            log.warning("grammask: disk cache disabled: refusing %s: %s", self.directory, why)
            return
        self.enabled = True
        _live.add(self)
        recipe_digest()  # read its sources now, not in the first request's load

    # ------------------------------------------------------------------ files
    def path_for(self, material: bytes) -> Path:
        return self.directory / (hashlib.sha256(material).hexdigest() + SUFFIX)

    def get(self, material: bytes) -> bytes | None:
        """The payload stored under ``material``, or None (absent, or bad: removed)."""
        if not self.enabled:
            return None
        path = self.path_for(material)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a symlink, no permission, ...
            self._bad(path, None, f"cannot open it ({exc})")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._bad(path, st, "not a regular file")
                return None
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read()
            why, payload = parse_file(data, material)
            if why is not None:
                self._bad(path, st, why)
                return None
            with contextlib.suppress(OSError):
                os.utime(fd)  # the LRU clock
            return payload
        except OSError as exc:
            self._bad(path, None, f"cannot read it ({exc})")
            return None
        finally:
            os.close(fd)

    def _bad(self, path: Path, st: os.stat_result | None, why: str) -> None:
        """Warn (once per file) and remove the file, unless another writer replaced it since."""
        _warn_once(str(path), "grammask: disk cache file %s is unusable (%s): removed, "
                   "compiling instead", path, why)
        self.remove(path, st)

    @staticmethod
    def remove(path: Path, st: os.stat_result | None = None) -> None:
        with contextlib.suppress(OSError):
            now = os.lstat(path)
            if st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                return  # a fresh file replaced the bad one meanwhile
            if stat.S_ISDIR(now.st_mode):
                import shutil

                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)

    def put(self, material: bytes, payload: bytes) -> bool:
        """Store atomically (temp file, fsync, rename); False when it could not be written."""
        if not self.enabled:
            return False
        flags = 0
        if self.compress:
            payload = zlib.compress(payload, 1)
            flags |= FLAG_ZLIB
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, len(material), len(payload),
                              hashlib.sha256(payload).digest())
        size = _HEADER.size + len(material) + len(payload)
        if size > self.max_bytes:
            return False  # would be evicted at once
        path = self.path_for(material)
        tmp = self.directory / f".tmp-{path.name}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                for chunk in (header, material, payload):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if os.path.isdir(path):  # something planted a directory under the name
                self.remove(path)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            _warn_once(f"write:{self.directory}", "grammask: cannot write the disk cache in "
                       "%s (%s)", self.directory, exc)
            return False
        with contextlib.suppress(OSError):
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._approx = None if self._approx is None else self._approx + size
        if (self._approx is None or self._approx > self.max_bytes
                or time.monotonic() - self._last_scan > RESCAN_S):
            self.evict()
        return True

    def evict(self) -> int:
        """Remove least recently used files until the directory holds at most ``max_bytes``
        (and stale temporary files); returns how many files were removed."""
        files = _scan(self.directory)
        if files is None:
            return 0
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
            total -= size
        self._approx = total
        self._last_scan = time.monotonic()
        return removed

    def usage(self) -> tuple[int, int]:
        """(files, bytes) of cache files in the directory now."""
        files = _scan(self.directory, sweep=False) or []
        return len(files), sum(size for _, size, _ in files)

    # ------------------------------------------------------------ background writer
    def submit(self, work: Callable[[], None]) -> bool:
        """Run ``work`` on the writer thread (off the request path); False when dropped."""
        if not self.enabled:
            return False
        with self._cond:
            if len(self._pending) >= MAX_PENDING:
                return False
            self._pending.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop,
                                                name="grammask-disk-cache", daemon=True)
                self._thread.start()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._busy = False
                    self._thread = None
                    self._cond.notify_all()
                    return
                work = self._pending.pop(0)
                self._busy = True
            try:
                work()
            except Exception:  # a cache write must never take anything down
                log.exception("grammask: writing the disk cache failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write is on disk; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy
                                       and self._thread is None, timeout)

    # ---------------------------------------------------------------- xgrammar codec
    def load_xgrammar(self, spec: GrammarSpec, vocab: Vocabulary, *, lenient: bool = False
                      ) -> XGrammarCompiled | None:
        """A grammar compiled earlier (any process), or None. Never raises."""
        if not self.enabled:
            return None
        try:
            material = key_material(spec, vocab, lenient=lenient)
            payload = self.get(material)
            if payload is None:
                return None
            import xgrammar as xgr

            from .backends.xgrammar import XGrammarCompiled

            try:
                text = unpack_json(payload)
                del payload
                compiled = xgr.CompiledGrammar.deserialize_json(text, vocab.xgrammar_info)
            except Exception as exc:  # a bad piece table, DeserializeFormatError, ...
                self._bad(self.path_for(material), None,
                          f"xgrammar refused it: {type(exc).__name__}: {exc}")
                return None
            return XGrammarCompiled(compiled, vocab.stop_ids, vocab.vocab_size)
        except Exception as exc:  # never let the cache break a request
            _warn_once(f"load:{self.directory}", "grammask: disk cache read failed (%s: %s)",
                       type(exc).__name__, exc)
            return None

    def store_xgrammar(self, spec: GrammarSpec, vocab: Vocabulary, compiled: object, *,
                       lenient: bool = False, compile_ms: float | None = None) -> bool:
        """Queue a compiled xgrammar grammar for writing; False when not queued. A small,
        shallow one is serialized on the writer thread, any other by a child process under
        ``writer_memory``. With ``compile_ms``, a grammar whose load would not be clearly
        faster than its compile is dropped (before serializing when its size tells)."""
        inner = getattr(compiled, "_compiled", None)
        if not self.enabled or inner is None or not hasattr(inner, "serialize_json"):
            return False
        size = int(getattr(inner, "memory_size_bytes", 0))
        inline = size <= self.inline_memory and alternation_depth(spec) <= INLINE_DEPTH
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
                written, why = store_json(self, spec.describe(), material,
                                          inner.serialize_json(), compile_ms)
                self._report({"where": "inline", "written": written, "why": why}, spec)
        else:
            timeout = CHILD_TIMEOUT_S + 4 * (compile_ms or 0.0) / 1000
            job = {"lenient": lenient, "compile_ms": compile_ms, "memory": size,
                   "timeout_s": timeout}

            def write() -> None:  # the request is built here, off the request path
                frame = self._frames.get(vocab.digest)
                if frame is None:
                    frame = self._frames[vocab.digest] = _vocab_frame(vocab)
                report = run_child(child_request(self, spec, frame, material, job), timeout)
                self._approx = None  # the child wrote (and evicted) on its own
                self._report({"where": "child", **report}, spec)
        return self.submit(write)

    def _report(self, report: dict[str, Any], spec: GrammarSpec) -> None:
        self.last_write = report
        if not report.get("written"):
            log.info("grammask: %s not written to the disk cache: %s", spec.describe(),
                     report.get("why"))


def _scan(directory: Path, *, sweep: bool = True) -> list[tuple[float, int, str]] | None:
    """(mtime, size, path) of the cache files; removes stale temporary files on the way."""
    now = time.time()
    files: list[tuple[float, int, str]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith("."):
                    if sweep and entry.name.startswith(".tmp-") and now - st.st_mtime > STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                if entry.name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
                    files.append((st.st_mtime, st.st_size, entry.path))
    except OSError:
        return None
    return files
