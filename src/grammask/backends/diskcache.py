"""A persistent compiled-grammar store shared by the processes of one host.

The store keeps opaque payloads under key material; what goes in is a backend's business: a
backend that declares ``disk`` (``backends.registry``) has a ``DiskCodec``, which turns its
compiled grammars into payloads and back (xgrammar's is ``backends.xgrammar_disk``: why only
xgrammar, and where its time and memory go); its adapter's ``store_compiled`` /
``load_compiled`` wrap it. A write too heavy for the serving process goes to a child
(``diskwriter``).

File format (one file per key, ``<sha256 of the key material>.xgc``): the header ``magic``
(8 bytes), ``format version`` (u16), ``flags`` (u16; bit 0: payload is zlib-compressed),
``key length`` (u32), ``payload length`` (u64), ``sha256(payload)`` (32 bytes), then the full key
material, then the payload (zlib level 1). Nothing is ever unpickled. A file is served only when
every header field, the stored key (compared byte for byte with the expected one: a hash
collision or a renamed file never serves a wrong grammar), the exact length and the checksum
agree. Anything else (truncated, flipped bytes, another version, a directory in place of the
file) is a miss: the file is removed, a warning is logged once per file, and the caller
compiles.

Sharing: writes go to a temporary file in the same directory (``0600``), are fsynced and
``os.replace``-d into place, so readers (other tensor-parallel ranks, replicas) never see a
partial file and concurrent writers of one key leave one of their (equal, valid) files. The
directory is created ``0700`` and refused (cache disabled, with a warning) when it is not a
directory owned by the current user or is group/world-writable. The size bound evicts the least
recently used files (by mtime; a read touches its file) after writes. Writes run on one
background thread per cache (``submit``), off the request path.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ..specs.grammar_spec import GrammarSpec
    from ..vocab import Vocabulary

log = logging.getLogger("grammask")

MAGIC = b"GRAMMASK"
#: Bump when the header, the payload or the key material changes (it is part of the key, so
#: files of another version live under other names and are never read by this one).
FORMAT_VERSION = 2
SUFFIX = ".xgc"
FLAG_ZLIB = 1
_HEADER = struct.Struct("<8sHHIQ32s")  # magic, version, flags, key length, payload length, sha
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
#: Temporary files older than this are a crashed writer's: removed by the eviction scan.
STALE_TMP_S = 3600.0
#: Writes waiting for the writer thread beyond this are dropped (the cache is a bonus).
MAX_QUEUED_WRITES = 64
#: Serialized on the writer thread only when the grammar is this small and its
#: ``oneOf``/``anyOf`` nest at most ``INLINE_DEPTH`` deep; anything else goes to a child. The
#: serializer's peak is many times its JSON, itself a multiple of the grammar, and more with
#: nested alternatives: a small, shallow grammar's peak is one a serving process can hold
#: (docs/benchmarks.md, Figures: disk cache).
INLINE_MEMORY = 4 * 1024 * 1024
#: What the writer child may allocate past its start-up footprint, with room above the
#: heaviest benchmarked grammar's need (docs/benchmarks.md, Figures: disk cache). A grammar
#: that needs more is not written.
WRITER_MEMORY = 2 * 1024 * 1024 * 1024
#: The eviction scan runs after a write when this process's estimate exceeds the bound, or
#: when the last scan is older than this (other processes write too).
RESCAN_S = 30.0
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


def warn_once(name: str, message: str, *args: object) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    log.warning(message, *args)


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


# ------------------------------------------------------------------------- the codec
Compiled = TypeVar("Compiled")


class DiskCodec(Protocol[Compiled]):
    """A backend's disk format: its own compiled grammar (``Compiled``) as a payload under
    key material, and back. The key material must name everything that shapes the grammar
    (format, backend version, a recipe version constant, vocabulary, options, the spec), so
    that a file is never served for another one. ``load`` and ``store`` never raise: the
    cache is a bonus."""

    def key_material(self, spec: GrammarSpec, vocab: Vocabulary, *,
                     lenient: bool = False) -> bytes:
        """The bytes a file is stored under (compared whole on every read)."""

    def load(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary, *,
             lenient: bool = False) -> Compiled | None:
        """The grammar an earlier compile (any process) stored, or None (absent or bad:
        the bad file is removed)."""

    def store(self, cache: DiskCache, spec: GrammarSpec, vocab: Vocabulary,
              compiled: Compiled, *, lenient: bool = False,
              compile_ms: float | None = None) -> bool:
        """Queue ``compiled`` for writing, off the request path; False when not queued."""


# ------------------------------------------------------------------------- the cache
class DiskCache:
    """One cache directory: byte-level ``get``/``put`` keyed by key material, a background
    writer and a size bound; a backend's codec (``store_compiled``/``load_compiled`` of a
    backend whose adapter is a ``capabilities.DiskBackend``) turns its grammars into
    payloads. ``enabled`` is False when the directory was refused (every call is then a
    no-op miss)."""

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
        self._writes: list[Callable[[], None]] = []
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
            self.discard(path, None, f"cannot open it ({exc})")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.discard(path, st, "not a regular file")
                return None
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read()
            why, payload = parse_file(data, material)
            if why is not None:
                self.discard(path, st, why)
                return None
            with contextlib.suppress(OSError):
                os.utime(fd)  # the LRU clock
            return payload
        except OSError as exc:
            self.discard(path, None, f"cannot read it ({exc})")
            return None
        finally:
            os.close(fd)

    def discard(self, path: Path, st: os.stat_result | None, why: str) -> None:
        """Warn (once per file) and remove the file, unless another writer replaced it since."""
        warn_once(str(path), "grammask: disk cache file %s is unusable (%s): removed, "
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
            warn_once(f"write:{self.directory}", "grammask: cannot write the disk cache in "
                       "%s (%s)", self.directory, exc)
            return False
        with contextlib.suppress(OSError):
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._approx = None if self._approx is None else self._approx + size
        self._evict_if_due()
        return True

    def forget_size(self) -> None:
        """Another process wrote here (a writer child): rescan before trusting the estimate."""
        self._approx = None

    def _evict_if_due(self) -> None:
        if (self._approx is None or self._approx > self.max_bytes
                or time.monotonic() - self._last_scan > RESCAN_S):
            self.evict()

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
            if len(self._writes) >= MAX_QUEUED_WRITES:
                return False
            self._writes.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop,
                                                name="grammask-disk-cache", daemon=True)
                self._thread.start()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._writes:
                    self._busy = False
                    self._thread = None
                    self._cond.notify_all()
                    return
                work = self._writes.pop(0)
                self._busy = True
            try:
                work()
            except Exception:  # a cache write must never take anything down
                log.exception("grammask: writing the disk cache failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write is on disk; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._writes and not self._busy
                                       and self._thread is None, timeout)

    def report(self, report: dict[str, Any], what: str) -> None:
        """Record what a write did (``last_write``), and log a write that did not happen."""
        self.last_write = report
        if not report.get("written"):
            log.info("grammask: %s not written to the disk cache: %s", what, report.get("why"))


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
