"""The persistent compiled-grammar cache: a hit across processes serves the same masks as a
fresh compile; every kind of bad file is a warning, a removal and a recompile, never a wrong
grammar; private permissions; the size bound; concurrent writers (threads and processes);
heavy and deeply nested grammars are serialized by a child under a memory ceiling, never by
the serving process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from grammask import Compiler, GrammarSpec, Vocabulary, metrics
from grammask.backends import get_backend
from grammask.backends.diskcache import (
    _HEADER,
    FORMAT_VERSION,
    INLINE_MEMORY,
    MAGIC,
    SUFFIX,
    DiskCache,
    default_cache_dir,
)
from grammask.backends.xgrammar_disk import (
    INLINE_DEPTH,
    alternation_depth,
    key_material,
    pack_json,
    unpack_json,
)

from ..helpers import mask_of

#: the xgrammar adapter, whose disk codec these tests exercise
XG: Any = get_backend("xgrammar")

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}},
          "required": ["name", "age", "tags"]}
INSTANCE = '{"name": "Ada Lovelace", "age": 36, "tags": ["bb", "a", "ccc"]}'
OTHER = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


def _spec(schema: object = SCHEMA) -> GrammarSpec:
    return GrammarSpec.json_schema(schema, backend="xgrammar")  # type: ignore[arg-type]


def _compiler(vocab: Vocabulary, directory: Path, **kw: object) -> Compiler:
    return Compiler(vocab, backend="xgrammar", timeout_s=120, disk_cache_dir=directory,
                  **kw)  # type: ignore[arg-type]


def _walk_masks_equal(vocab: Vocabulary, a: object, b: object, text: str) -> int:
    """Fill both grammars' masks along the tokens of ``text`` (and the stop): equal at every
    step; returns the number of steps."""
    ma, mb = a.matcher(), b.matcher()  # type: ignore[attr-defined]
    steps = 0
    for tok in [*vocab.encode(text), vocab.stop_ids[0]]:
        assert bool((mask_of(ma, vocab) == mask_of(mb, vocab)).all()), f"step {steps}"
        assert ma.accept(tok) and mb.accept(tok), f"token {tok} refused at step {steps}"
        steps += 1
    assert ma.is_terminated() and mb.is_terminated()
    return steps


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))


def _metric(result: str) -> float:
    return metrics.snapshot().get(
        f'grammask_cache_requests_total{{result="{result}",tier="disk"}}', 0.0)


@pytest.fixture(scope="module")
def seeded(qwen25: Vocabulary, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Path, Path, Path]]:
    """A cache directory holding valid files for SCHEMA and OTHER: (dir, file, other_file)."""
    directory = tmp_path_factory.mktemp("seed") / "cache"
    compiler = _compiler(qwen25, directory)
    compiler.compile(_spec())
    assert compiler.flush_disk_cache(60)
    (first,) = _files(directory)
    compiler.compile(_spec(OTHER))
    assert compiler.flush_disk_cache(60)
    (other,) = [p for p in _files(directory) if p != first]
    compiler.close()
    yield directory, first, other


def _copy_seed(seeded: tuple[Path, Path, Path], tmp_path: Path) -> tuple[Path, Path, bytes]:
    _, first, other = seeded
    target = tmp_path / "cache"
    target.mkdir(mode=0o700)
    (target / first.name).write_bytes(first.read_bytes())
    return target, target / first.name, other.read_bytes()


# ----------------------------------------------------------------------- hits
def test_hit_across_processes_serves_the_same_masks(qwen25: Vocabulary, tmp_path: Path
                                                     ) -> None:
    directory = tmp_path / "cache"
    script = f"""
import json, sys
from grammask import Compiler, GrammarSpec, load_vocabulary
eng = Compiler(load_vocabulary("qwen2.5"), backend="xgrammar", timeout_s=120,
             disk_cache_dir={str(directory)!r})
g = eng.compile(GrammarSpec.json_schema({json.dumps(SCHEMA)!r}))
assert eng.flush_disk_cache(60)
print(json.dumps({{"from_disk": g.from_disk, "writes": eng.stats.disk_writes,
                  "compiles": eng.stats.compiles["xgrammar"]}}))
"""
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child == {"from_disk": False, "writes": 1, "compiles": 1}
    assert len(_files(directory)) == 1

    hits_before = _metric("hit")
    compiler = _compiler(qwen25, directory)
    grammar = compiler.compile(_spec())
    assert grammar.from_disk and grammar.backend == "xgrammar"
    assert compiler.stats.disk_hits == 1 and compiler.stats.compiles["xgrammar"] == 0
    if metrics.available():
        assert _metric("hit") == hits_before + 1
    fresh = get_backend("xgrammar").compile(_spec(), qwen25, lenient=False)
    assert _walk_masks_equal(qwen25, grammar.backend_grammar, fresh, INSTANCE) > 10
    compiler.flush_disk_cache(10)
    assert compiler.stats.disk_writes == 0  # a hit is not written again
    compiler.close()


def test_miss_compiles_writes_and_counts(qwen25: Vocabulary, tmp_path: Path) -> None:
    misses_before = _metric("miss")
    compiler = _compiler(qwen25, tmp_path / "c")
    grammar = compiler.compile(_spec())
    assert not grammar.from_disk and compiler.stats.disk_misses == 1
    if metrics.available():
        assert _metric("miss") == misses_before + 1
    assert compiler.flush_disk_cache(60) and len(_files(tmp_path / "c")) == 1
    # the memory cache answers first: no second disk lookup
    assert compiler.compile(_spec()) is grammar and compiler.stats.disk_misses == 1
    compiler.close()


def test_single_flight_loads_once(qwen25: Vocabulary, seeded: tuple[Path, Path, Path],
                                  tmp_path: Path) -> None:
    directory, _, _ = _copy_seed(seeded, tmp_path)
    compiler = _compiler(qwen25, directory)
    futures = [compiler.compile_async(_spec()) for _ in range(8)]
    grammars = {id(f.result(60)) for f in futures}
    assert len(grammars) == 1
    assert compiler.stats.disk_hits == 1 and compiler.stats.joined == 7
    assert compiler.stats.compiles["xgrammar"] == 0
    compiler.close()


def test_auto_routed_and_forced_requests_share_a_file(qwen25: Vocabulary) -> None:
    plain = GrammarSpec.json_schema(SCHEMA)
    assert key_material(plain, qwen25) == key_material(_spec(), qwen25)
    assert key_material(plain, qwen25) != key_material(plain, qwen25, lenient=True)
    assert key_material(plain, qwen25) != key_material(_spec(OTHER), qwen25)
    assert key_material(GrammarSpec.json_schema(SCHEMA, any_whitespace=False), qwen25) \
        != key_material(plain, qwen25)
    small = Vocabulary([b"a", b"b", b"<eos>"], special_ids=[2], stop_ids=[2])
    assert key_material(plain, small) != key_material(plain, qwen25)
    assert b'"backend": "xgrammar"' in key_material(plain, small)


def test_llguidance_grammars_stay_off_disk(qwen25: Vocabulary, tmp_path: Path) -> None:
    compiler = Compiler(qwen25, backend="guidance", disk_cache_dir=tmp_path / "c")
    compiler.compile(GrammarSpec.json_schema(SCHEMA))
    assert compiler.flush_disk_cache(10)
    assert _files(tmp_path / "c") == [] and compiler.stats.disk_writes == 0
    assert compiler.stats.disk_misses == 0  # not even looked up
    compiler.close()


def test_off_by_default(qwen25: Vocabulary) -> None:
    compiler = Compiler(qwen25, backend="xgrammar")
    assert compiler.disk_cache is None and compiler.flush_disk_cache(0)
    compiler.close()


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "grammask"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the spec says: ignore it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "grammask"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "grammask"


# -------------------------------------------------------------------- bad files
def _truncate(data: bytes, other: bytes) -> bytes:
    return data[:-100]


def _flip(data: bytes, other: bytes) -> bytes:
    out = bytearray(data)
    out[-50] ^= 0x01
    return bytes(out)


def _magic(data: bytes, other: bytes) -> bytes:
    return b"NOTMASK!" + data[8:]


def _version(data: bytes, other: bytes) -> bytes:
    return data[:8] + struct.pack("<H", 99) + data[10:]


def _other_key(data: bytes, other: bytes) -> bytes:
    return other  # a valid file, for another spec, under this file's name


def _empty(data: bytes, other: bytes) -> bytes:
    return b""


def _header_only(data: bytes, other: bytes) -> bytes:
    return data[:_HEADER.size]


def _trailing(data: bytes, other: bytes) -> bytes:
    return data + b"\0"


CORRUPTIONS = {"truncated": _truncate, "flipped-byte": _flip, "wrong-magic": _magic,
               "wrong-version": _version, "key-mismatch": _other_key, "empty": _empty,
               "header-only": _header_only, "trailing-bytes": _trailing}


def _pieces(good: bytes) -> bytes:  # a piece index past the table
    count = struct.unpack_from("<I", good)[0]
    at = 16 + 4 * count  # the first index of the sequence
    return good[:at] + struct.pack("<I", count) + good[at + 4:]


#: Payloads with a right header, key and checksum (written through ``put``) that are wrong
#: inside: the piece table, or the JSON xgrammar reads.
PAYLOADS: dict[str, Callable[[bytes], bytes]] = {
    "backend-refuses-payload": lambda good: pack_json('{"not": "a grammar"}'),
    "pieces-truncated": lambda good: good[:-7],
    "piece-index-out-of-range": _pieces,
    "not-a-piece-table": lambda good: b"{}"}


@pytest.mark.parametrize("case", [*CORRUPTIONS, "directory", *PAYLOADS])
def test_bad_file_is_removed_warned_and_recompiled(
        case: str, qwen25: Vocabulary, seeded: tuple[Path, Path, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    directory, path, other = _copy_seed(seeded, tmp_path)
    good = path.read_bytes()
    material = key_material(_spec(), qwen25)
    payload = DiskCache(directory).get(material)
    assert payload is not None

    def spoil() -> None:
        if case == "directory":
            path.unlink(missing_ok=True)
            path.mkdir()
            (path / "inside").write_text("x")
        elif case in PAYLOADS:  # header, key and checksum right; payload not
            assert DiskCache(directory).put(material, PAYLOADS[case](payload))
        else:
            path.write_bytes(CORRUPTIONS[case](good, other))

    spoil()
    cache = DiskCache(directory)
    with caplog.at_level(logging.WARNING, logger="grammask"):
        assert XG.load_compiled(cache, _spec(), qwen25) is None
    assert not path.exists(), "the bad file is removed"
    assert any("unusable" in r.getMessage() and path.name in r.getMessage()
               for r in caplog.records)

    # through the compiler: a bad file is a miss and a recompile, and a good file comes back
    spoil()
    compiler = _compiler(qwen25, directory)
    grammar = compiler.compile(_spec())
    assert not grammar.from_disk
    assert compiler.stats.disk_misses == 1 and compiler.stats.compiles["xgrammar"] == 1
    assert compiler.flush_disk_cache(60)
    compiler.close()
    assert path.is_file()
    fresh = _compiler(qwen25, directory)
    again = fresh.compile(_spec())
    assert again.from_disk
    assert _walk_masks_equal(qwen25, again.backend_grammar, grammar.backend_grammar, INSTANCE) > 10
    fresh.close()


def test_warns_once_per_file(qwen25: Vocabulary, seeded: tuple[Path, Path, Path],
                             tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory, path, _ = _copy_seed(seeded, tmp_path)
    cache = DiskCache(directory)
    with caplog.at_level(logging.WARNING, logger="grammask"):
        for _ in range(3):
            path.write_bytes(b"garbage")
            assert XG.load_compiled(cache, _spec(), qwen25) is None
    assert sum(path.name in r.getMessage() for r in caplog.records) == 1


def test_key_is_compared_not_only_hashed(tmp_path: Path) -> None:
    """A renamed file (or a colliding hash) is refused by its stored key."""
    cache = DiskCache(tmp_path / "c")
    assert cache.put(b"key-a", b"payload-a")
    os.replace(cache.path_for(b"key-a"), cache.path_for(b"key-b"))
    assert cache.get(b"key-b") is None
    assert not cache.path_for(b"key-b").exists()
    assert cache.put(b"key-a", b"payload-a") and cache.get(b"key-a") == b"payload-a"


def test_raw_file_layout(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", compress=False)
    cache.put(b"material", b"payload")
    data = cache.path_for(b"material").read_bytes()
    magic, version, flags, klen, plen, _ = _HEADER.unpack_from(data)
    assert (magic, version, flags, klen, plen) == (MAGIC, FORMAT_VERSION, 0, 8, 7)
    assert data[_HEADER.size:] == b"materialpayload"


# -------------------------------------------------------------------- permissions
def test_private_files_and_directory(qwen25: Vocabulary, tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b" / "cache"
    compiler = _compiler(qwen25, directory)
    assert compiler.disk_cache is not None
    compiler.compile(_spec(OTHER))
    assert compiler.flush_disk_cache(60)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (path,) = _files(directory)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in directory.iterdir() if p.name.startswith(".tmp")] == []
    compiler.close()


def test_files_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        cache = DiskCache(tmp_path / "c")
        cache.put(b"k", b"v")
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.path_for(b"k").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_refuses_a_shared_writable_directory(mode: int, qwen25: Vocabulary, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="grammask"):
        compiler = Compiler(qwen25, backend="xgrammar", disk_cache_dir=directory)
    assert compiler.disk_cache is None
    assert any("disk cache disabled" in r.getMessage() for r in caplog.records)
    compiler.compile(_spec(OTHER))  # still works, without the disk
    assert compiler.flush_disk_cache(1) and list(directory.iterdir()) == []
    compiler.close()


def test_refuses_a_directory_of_another_user(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory away")
    os.chown(directory, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="grammask"):
        cache = DiskCache(directory)
    assert not cache.enabled and not cache.put(b"k", b"v") and cache.get(b"k") is None
    assert any("owned by uid 65534" in r.getMessage() for r in caplog.records)


def test_refuses_a_file_and_an_unusable_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert not DiskCache(tmp_path / "file").enabled
    assert not DiskCache(tmp_path / "file" / "below").enabled


# ----------------------------------------------------------------------- eviction
def test_evicts_least_recently_used_under_the_bound(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=10_000, compress=False)
    payload = b"x" * 3000
    keys = [f"key-{i}".encode() for i in range(3)]
    now = time.time()
    for i, key in enumerate(keys):
        assert cache.put(key, payload)
        os.utime(cache.path_for(key), (now - 100 + i, now - 100 + i))
    assert cache.get(keys[0]) == payload  # touched: now the most recent
    assert cache.put(b"key-3", payload)  # 4 files x ~3.1 kB > 10 kB: one must go
    assert not cache.path_for(keys[1]).exists(), "the least recently used is evicted"
    for key in (keys[0], keys[2], b"key-3"):
        assert cache.path_for(key).exists()
    assert cache.usage()[1] <= 10_000


def test_compiler_keeps_the_directory_under_its_bound(qwen25: Vocabulary, tmp_path: Path
                                                    ) -> None:
    directory = tmp_path / "c"
    probe = _compiler(qwen25, directory)
    probe.compile(_spec(OTHER))
    probe.flush_disk_cache(60)
    one = _files(directory)[0].stat().st_size
    probe.close()
    shutil.rmtree(directory)
    compiler = _compiler(qwen25, directory, disk_cache_bytes=int(one * 2.5))
    for n in range(4):
        compiler.compile(_spec({"type": "object", "properties": {f"f{n}": {"type": "integer"}},
                           "required": [f"f{n}"]}))
        compiler.flush_disk_cache(60)
    files, used = compiler.disk_cache.usage()  # type: ignore[union-attr]
    assert used <= one * 2.5 and 1 <= files <= 2
    compiler.close()


def test_stale_temporary_files_are_swept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c")
    stale = tmp_path / "c" / ".tmp-dead-1-2"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / "c" / ".tmp-live-1-3"
    fresh.write_bytes(b"being written")
    cache.evict()
    assert not stale.exists() and fresh.exists()


# ---------------------------------------------------------------------- concurrency
def _payload(qwen25: Vocabulary, seeded: tuple[Path, Path, Path]) -> tuple[bytes, bytes]:
    directory, _, _ = seeded
    cache = DiskCache(directory)
    material = key_material(_spec(), qwen25)
    payload = cache.get(material)
    assert payload is not None
    return material, payload


def test_concurrent_thread_writers_leave_a_valid_file(
        qwen25: Vocabulary, seeded: tuple[Path, Path, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    material, payload = _payload(qwen25, seeded)
    cache = DiskCache(tmp_path / "c")
    stop = threading.Event()
    seen: list[bytes | None] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(cache.get(material))

    reader = threading.Thread(target=read)
    with caplog.at_level(logging.WARNING, logger="grammask"):
        reader.start()
        with ThreadPoolExecutor(6) as pool:
            assert all(pool.map(lambda _: cache.put(material, payload), range(24)))
        stop.set()
        reader.join()
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]
    assert all(s is None or s == payload for s in seen) and any(s == payload for s in seen)
    assert len(_files(tmp_path / "c")) == 1
    assert [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp")] == []
    loaded = XG.load_compiled(cache, _spec(), qwen25)
    assert loaded is not None
    fresh = get_backend("xgrammar").compile(_spec(), qwen25, lenient=False)
    _walk_masks_equal(qwen25, loaded, fresh, INSTANCE)


def test_concurrent_process_writers_leave_a_valid_file(
        qwen25: Vocabulary, seeded: tuple[Path, Path, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    material, payload = _payload(qwen25, seeded)
    (tmp_path / "material").write_bytes(material)
    (tmp_path / "payload").write_bytes(payload)
    directory = tmp_path / "c"
    script = f"""
from pathlib import Path
from grammask.backends.diskcache import DiskCache
cache = DiskCache({str(directory)!r})
m = Path({str(tmp_path / "material")!r}).read_bytes()
p = Path({str(tmp_path / "payload")!r}).read_bytes()
for _ in range(15):
    assert cache.put(m, p)
    got = cache.get(m)
    assert got is None or got == p, "a reader saw a wrong payload"
print("ok")
"""
    procs = [subprocess.Popen([PYTHON, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    cache = DiskCache(directory)
    seen: list[bytes | None] = []
    with caplog.at_level(logging.WARNING, logger="grammask"):
        while any(p.poll() is None for p in procs):
            seen.append(cache.get(material))
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "ok", err
        assert "unusable" not in err
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]
    assert all(s is None or s == payload for s in seen)
    assert len(_files(directory)) == 1
    assert [p for p in directory.iterdir() if p.name.startswith(".tmp")] == []
    compiler = _compiler(qwen25, directory)
    grammar = compiler.compile(_spec())
    assert grammar.from_disk
    fresh = get_backend("xgrammar").compile(_spec(), qwen25, lenient=False)
    _walk_masks_equal(qwen25, grammar.backend_grammar, fresh, INSTANCE)
    compiler.close()


# ------------------------------------------------------------- the payload's pieces
def test_pieces_join_back_to_the_exact_text(qwen25: Vocabulary) -> None:
    compiled = get_backend("xgrammar").compile(_spec(), qwen25, lenient=False)
    text = compiled._compiled.serialize_json()  # type: ignore[attr-defined]
    packed = pack_json(text)
    assert unpack_json(packed) == text
    assert len(packed) < len(text) * 1.05  # distinct entries cost a few bytes of table
    odd = 'é{"store_type":1,"a":[1]}\udc80{"store_type":1,"a":[1]}{"store_type":2}'
    assert unpack_json(pack_json(odd)) == odd  # any text, lone surrogates included
    assert unpack_json(pack_json("")) == ""
    with pytest.raises(ValueError, match="bound"):
        unpack_json(packed, max_chars=len(text) - 1)
    for bad in (b"", packed[:10], packed[:-1], packed + b"x", _pieces(packed)):
        with pytest.raises(ValueError):
            unpack_json(bad)


# ------------------------------------------------------------------- heavy grammars
def _heavy(props: int) -> GrammarSpec:
    from bench.diskcache_heavy import patterned_schema

    return _spec(patterned_schema(props))


def _heavy_instance(props: int) -> str:
    return json.dumps({f"field_{i}": f"Abc{'d' * i}-{'7' * (3 + i)}" for i in range(props)})


@pytest.fixture(scope="module")
def heavy(qwen25: Vocabulary) -> object:
    """6 patterned properties: 5.4 MB, past the inline bound (a child writes it)."""
    compiled = get_backend("xgrammar").compile(_heavy(6), qwen25, lenient=False)
    assert compiled.memory_bytes > INLINE_MEMORY
    return compiled


def test_small_grammars_are_serialized_inline(qwen25: Vocabulary, tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c")
    compiled = get_backend("xgrammar").compile(_spec(OTHER), qwen25, lenient=False)
    assert XG.store_compiled(cache, _spec(OTHER), qwen25, compiled) and cache.flush(60)
    assert cache.last_write == {"where": "inline", "written": True, "why": "written"}


def test_a_heavy_grammar_is_written_by_a_child_and_loads_the_same_masks(
        qwen25: Vocabulary, heavy: object, tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c")
    assert XG.store_compiled(cache, _heavy(6), qwen25, heavy) and cache.flush(300)
    report = cache.last_write
    assert report is not None and report["where"] == "child" and report["written"], report
    assert report["pid"] != os.getpid() and report["returncode"] == 0
    (path,) = _files(tmp_path / "c")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # repeated mask entries are stored once (and compressed)
    assert report["file_bytes"] == path.stat().st_size < report["json_bytes"] / 5
    loaded = XG.load_compiled(DiskCache(tmp_path / "c"), _heavy(6), qwen25)
    assert loaded is not None
    assert _walk_masks_equal(qwen25, loaded, heavy, _heavy_instance(6)) > 20


def test_the_serving_process_never_runs_the_heavy_serializer(tmp_path: Path) -> None:
    """12 patterned properties: xgrammar's serializer takes the process's peak RSS up by
    ~130 MB. Writing it through the cache must leave the serving process's peak where the
    compile put it; the child that did the work reports its own peak."""
    directory = tmp_path / "c"
    script = f"""
import json, re
from pathlib import Path
from grammask import load_vocabulary
from grammask.backends import get_backend
from grammask.backends.diskcache import DiskCache
from tests.backends.test_diskcache import _heavy
def growth(work):  # the peak RSS above the RSS before ``work`` (Linux: VmHWM reset)
    def kib(field):
        text = Path("/proc/self/status").read_text()
        return int(re.search(field + r":\\s+(\\d+)", text).group(1)) * 1024
    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS")
    work()
    return kib("VmHWM") - before
vocab = load_vocabulary("qwen2.5")
spec = _heavy(12)
compiled = get_backend("xgrammar").compile(spec, vocab, lenient=False)
cache = DiskCache({str(directory)!r})
write = growth(lambda: get_backend("xgrammar").store_compiled(cache, spec, vocab, compiled)
               and cache.flush(600))
inline = growth(compiled._compiled.serialize_json)  # what writing it here would cost
print(json.dumps({{"write": write, "inline": inline, "report": cache.last_write}}))
"""
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    report = got["report"]
    assert report["where"] == "child" and report["written"], report
    assert got["inline"] > 80e6, got
    assert got["write"] < 40e6, got
    assert report["peak_rss"] - report["base_rss"] > 80e6  # the child held it instead
    assert len(_files(directory)) == 1


def test_a_grammar_past_the_writer_ceiling_is_not_written(
        qwen25: Vocabulary, heavy: object, tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", writer_memory=16 * 1024 * 1024)
    assert XG.store_compiled(cache, _heavy(6), qwen25, heavy) and cache.flush(300)
    report = cache.last_write
    assert report is not None and report["where"] == "child", report
    assert not report["written"] and "alloc" in report["why"], report
    assert _files(tmp_path / "c") == []
    assert [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp")] == []


def test_the_child_writes_only_under_the_parents_key(qwen25: Vocabulary, heavy: object,
                                                     tmp_path: Path) -> None:
    """Another key (other sources, versions, vocabulary) in the child: nothing is written."""
    from grammask.backends.diskwriter import child_request, run_child, vocab_frame
    from grammask.backends.xgrammar_disk import CHILD_CODE

    cache = DiskCache(tmp_path / "c")
    job = {"lenient": False, "compile_ms": None, "memory": 1, "timeout_s": 120}
    material = key_material(_heavy(6), qwen25)
    report = run_child(CHILD_CODE, child_request(cache, _heavy(6), vocab_frame(qwen25),
                                                 material + b" ", job), 120)
    assert not report["written"] and "key differs" in report["why"], report
    report = run_child(CHILD_CODE, child_request(cache, _heavy(6), vocab_frame(qwen25),
                                                 material, job),
                       120)  # the right key, but a grammar of another size
    assert not report["written"] and "another grammar" in report["why"], report
    assert _files(tmp_path / "c") == []


def test_deeply_nested_alternatives_are_serialized_only_in_a_child(qwen25: Vocabulary,
                                                                   tmp_path: Path) -> None:
    """xgrammar's serializer grows ~3.6x per level of oneOf nesting (depth 8: +2.5 GB for a
    5 MB grammar; depth 10 ran a server's worker out of memory). Such specs are no longer
    refused: a child serializes them under its ceiling, and what does not fit is not written;
    a fast compile is not worth a child at all."""
    from tests.e2e.test_isolation import nested_one_of

    assert alternation_depth(GrammarSpec.json_schema(nested_one_of(9))) == 9
    assert alternation_depth(GrammarSpec.json_schema(SCHEMA)) == 0
    assert alternation_depth(GrammarSpec.regex("a|b")) == 0
    deep = GrammarSpec.json_schema(nested_one_of(8), backend="xgrammar")
    compiled = get_backend("xgrammar").compile(deep, qwen25, lenient=False)
    cache = DiskCache(tmp_path / "c", writer_memory=256 * 1024 * 1024)
    assert not XG.store_compiled(cache, deep, qwen25, compiled, compile_ms=200.0)
    assert XG.store_compiled(cache, deep, qwen25, compiled) and cache.flush(300)
    report = cache.last_write
    assert report is not None and report["where"] == "child" and not report["written"], report
    assert _files(tmp_path / "c") == []
    # a tiny grammar nested past INLINE_DEPTH still goes to the child
    shallow_size = GrammarSpec.json_schema(nested_one_of(INLINE_DEPTH + 1), backend="xgrammar")
    small = get_backend("xgrammar").compile(shallow_size, qwen25, lenient=False)
    assert small.memory_bytes < cache.inline_memory
    assert XG.store_compiled(cache, shallow_size, qwen25, small) and cache.flush(300)
    assert cache.last_write is not None and cache.last_write["where"] == "child"


def test_the_child_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child imports this grammask, sees no GPU and writes no Prometheus files."""
    from grammask.backends.diskwriter import child_env

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/prom")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = child_env()
    assert "PROMETHEUS_MULTIPROC_DIR" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "src")


def test_the_key_is_versions_and_a_recipe_constant(qwen25: Vocabulary) -> None:
    """The recipe part of the key is the packages' versions and ``RECIPE_VERSION``, nothing
    read from source files (an unrelated edit keeps the cache); the codec is the module's."""
    import hashlib
    from importlib.metadata import version

    from grammask.backends import xgrammar_disk

    h = hashlib.sha256()
    for package in ("grammask", "xgrammar"):
        h.update(f"{package}={version(package)};".encode())
    h.update(f"recipe={xgrammar_disk.RECIPE_VERSION}".encode())
    assert xgrammar_disk.recipe_digest() == h.hexdigest()[:32]
    head = json.loads(key_material(_spec(), qwen25).split(b"\n", 1)[0])
    assert head["recipe"] == h.hexdigest()[:32] and head["format"] == FORMAT_VERSION
    assert xgrammar_disk.CODEC.key_material(_spec(), qwen25) == key_material(_spec(), qwen25)
