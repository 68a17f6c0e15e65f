"""A persistent compiled-grammar cache shared by the processes of one host.

What is cached, and why only that:

- **xgrammar** grammars are cached: their compile precomputes a per-token mask table over the
  whole vocabulary (seconds for large JSON schemas, minutes for pathological ones), and xgrammar
  offers a faithful serialization of it (``xgrammar.CompiledGrammar.serialize_json`` /
  ``deserialize_json``, which needs the vocabulary's ``TokenizerInfo`` and checks its metadata).
  Loading a file costs a fraction of the compile (see bench/diskcache.py).
- **llguidance** grammars are not: llguidance compiles in milliseconds (it builds its lexer and
  parser lazily and computes masks on the fly, there is no per-token table to save) and it has no
  serialization format for a compiled grammar. Reading and checking a file would cost about what
  the compile does, for a second copy of the spec on disk.

File format (one file per key, ``<sha256 of the key material>.xgc``): the header ``magic``
(8 bytes), ``format version`` (u16), ``flags`` (u16; bit 0: payload is zlib-compressed),
``key length`` (u32), ``payload length`` (u64), ``sha256(payload)`` (32 bytes), then the full key
material (JSON: format, backend and its version, grammask's version and a digest of the sources
that shape a compile, vocabulary digest and size, options, and the spec's whole canonical form),
then the payload: xgrammar's own JSON, zlib level 1 (the JSON of a large schema is tens of MB and
compresses about 4x). Nothing is ever unpickled. A file is served only when every header field,
the stored key (compared byte for byte with the expected one: a hash collision or a renamed
file never serves a wrong grammar), the exact length and the checksum agree, and xgrammar
accepts the payload. Anything else (truncated, flipped bytes, another version, a directory in
place of the file) is a miss: the file is removed, a warning is logged once per file, and the
caller compiles.

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
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.xgrammar import XGrammarCompiled
    from .spec import GrammarSpec
    from .vocab import Vocabulary

log = logging.getLogger("grammask")

MAGIC = b"GRAMMASK"
#: Bump when the header or the key material changes (it is part of the key, so files of
#: another version live under other names and are never read by this one).
FORMAT_VERSION = 1
SUFFIX = ".xgc"
FLAG_ZLIB = 1
_HEADER = struct.Struct("<8sHHIQ32s")  # magic, version, flags, key length, payload length, sha
MAX_KEY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
#: Temporary files older than this are a crashed writer's: removed by the eviction scan.
STALE_TMP_S = 3600.0
#: Writes waiting for the writer thread beyond this are dropped (the cache is a bonus).
MAX_PENDING = 64
#: xgrammar's serializer builds a JSON document in memory: its peak is about 35 times the
#: grammar's ``memory_size_bytes`` (5 MB grammar: +170 MB; a 25 s Snowplow compile took a
#: 23 GiB machine out of memory). Larger grammars are not written (nor ever read back).
MAX_ENTRY_MEMORY = 32 * 1024 * 1024
#: ... but nested alternatives break that factor: the JSON grows about 3.6x per level of
#: ``oneOf``/``anyOf`` nesting while the grammar only doubles (nested objects in a oneOf:
#: depth 6, 1.3 MB grammar, 10 MB of JSON; depth 9, 2.6 MB, 275 MB of JSON and +4 GB; depth
#: 10, ``bad_alloc`` under a 12 GB limit, and a real server's worker was OOM-killed). The
#: serializer runs in the serving process, so schemas nested deeper are never written.
MAX_ALTERNATION_DEPTH = 6
#: Loading (read, checksum, inflate, parse) handles xgrammar's JSON at roughly this many
#: bytes per millisecond for files of tens of MB; a grammar whose load would not beat its
#: compile by ``WORTH`` is not written (small schemas: a 4 MB payload loads in ~30 ms for a
#: 115 ms compile; trivial ones are tiny). Past ``MAX_PAYLOAD`` loading slows down far more:
#: WashingtonPost wp_53 compiles in 18 s, serializes to 1.2 GB of JSON (324 MB compressed)
#: and took 44 s to load.
LOAD_BYTES_PER_MS = 100_000
WORTH = 0.8
MAX_PAYLOAD = 256 * 1024 * 1024
#: The eviction scan runs after a write when this process's estimate exceeds the bound, or
#: when the last scan is older than this (other processes write too).
RESCAN_S = 30.0

#: Sources whose changes can change a compiled grammar: part of the key.
_RECIPE_FILES = ("backends/xgrammar.py", "normalize.py", "spec.py", "vocab.py")

_warned: set[str] = set()
_warned_lock = threading.Lock()
_live: weakref.WeakSet[DiskCache] = weakref.WeakSet()
#: At interpreter exit, queued writes get this long to land (the writer is a daemon thread;
#: one killed mid-write leaves only a temporary file, swept later).
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


def backend_version(name: str = "xgrammar") -> str:
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


class DiskCache:
    """One cache directory: byte-level ``get``/``put`` keyed by key material, an xgrammar codec
    on top, a background writer and a size bound. ``enabled`` is False when the directory was
    refused (every call is then a no-op miss)."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 *, compress: bool = True, max_entry_memory: int = MAX_ENTRY_MEMORY) -> None:
        self.directory = Path(directory).expanduser()
        self.max_entry_memory = max_entry_memory
        self.max_bytes = int(max_bytes)
        self.compress = compress
        self.enabled = False
        self._cond = threading.Condition()
        self._pending: list[Callable[[], None]] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self._approx: int | None = None
        self._last_scan = 0.0
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
            why, payload = self._parse(data, material)
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

    @staticmethod
    def _parse(data: bytes, material: bytes) -> tuple[str | None, bytes]:
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
        if _HEADER.size + len(material) + len(payload) > self.max_bytes:
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
        size = _HEADER.size + len(material) + len(payload)
        self._approx = None if self._approx is None else self._approx + size
        if (self._approx is None or self._approx > self.max_bytes
                or time.monotonic() - self._last_scan > RESCAN_S):
            self.evict()
        return True

    def evict(self) -> int:
        """Remove least recently used files until the directory holds at most ``max_bytes``
        (and stale temporary files); returns how many files were removed."""
        now = time.time()
        files: list[tuple[float, int, str]] = []
        removed = 0
        try:
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.name.startswith(".tmp-"):
                        if now - st.st_mtime > STALE_TMP_S:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
                        continue
                    if entry.name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
                        files.append((st.st_mtime, st.st_size, entry.path))
        except OSError:
            return 0
        total = sum(size for _, size, _ in files)
        files.sort()
        for _, size, path in files:
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
        n = used = 0
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        used += entry.stat(follow_symlinks=False).st_size
                        n += 1
        return n, used

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
                compiled = xgr.CompiledGrammar.deserialize_json(payload.decode("utf-8"),
                                                                vocab.xgrammar_info)
            except Exception as exc:  # DeserializeFormatError/VersionError, bad UTF-8, ...
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
        """Queue a compiled xgrammar grammar for writing; False when not queued. With
        ``compile_ms``, a grammar whose load would not be clearly faster than its compile
        (or whose file would take over a quarter of the bound) is dropped by the writer."""
        inner = getattr(compiled, "_compiled", None)
        if not self.enabled or inner is None or not hasattr(inner, "serialize_json"):
            return False
        size = int(getattr(inner, "memory_size_bytes", 0))
        depth = alternation_depth(spec)
        if depth > MAX_ALTERNATION_DEPTH:
            log.info("grammask: %s not written to the disk cache: oneOf/anyOf nested %d deep "
                     "(xgrammar's serializer grows exponentially with it)", spec.describe(),
                     depth)
            return False
        if size > self.max_entry_memory:
            log.info("grammask: %s not written to the disk cache: %.0f MB in memory, the "
                     "serializer would need about %.1f GB", spec.describe(), size / 1e6,
                     35 * size / 1e9)
            return False
        material = key_material(spec, vocab, lenient=lenient)

        def write() -> None:
            payload = inner.serialize_json().encode("utf-8")
            load_ms = len(payload) / LOAD_BYTES_PER_MS
            if compile_ms is not None and load_ms > WORTH * compile_ms:
                log.info("grammask: %s not written to the disk cache: loading %.0f MB would "
                         "take about %.0f ms, compiling took %.0f ms", spec.describe(),
                         len(payload) / 1e6, load_ms, compile_ms)
                return
            if len(payload) > MAX_PAYLOAD:
                log.info("grammask: %s not written to the disk cache: %.0f MB of JSON is "
                         "too slow to load", spec.describe(), len(payload) / 1e6)
                return
            self.put(material, payload)

        return self.submit(write)


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
