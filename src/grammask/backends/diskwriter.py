"""The disk cache's writer process: a grammar too heavy to serialize in the serving process is
compiled again and written by a child, under a memory ceiling and a deadline.

Why a child: a backend's serializer can peak far above its grammar (xgrammar's: many times its
JSON, ``backends.xgrammar_disk``; docs/benchmarks.md, Figures: disk cache), and a serving
process that runs it can be OOM-killed.
The child is ``python -P -c <the codec's entry>``, niced, ``oom_score_adj`` 1000 (the first the
kernel kills), no core dump, ``SIGALRM`` at its deadline, and ``RLIMIT_DATA`` = its footprint
after start-up plus ``DiskCache.writer_memory`` (set by the codec once its start-up is done:
``limit_memory``). A grammar the ceiling cannot serialize is simply not written.

Protocol: the child's stdin is ``u64 job length, u64 key length``, the job (JSON: the cache's
directory, bound and compression, the ceiling, ``timeout_s``, the spec's fields, the codec's
own fields), the key material, then the vocabulary (``vocab_frame``); its stdout is one JSON
report line (``written``, ``why``, ``pid``, ``peak_rss``...). Nothing is unpickled. The codec's
write compares the key it computes from the spec and vocabulary with the parent's, byte for
byte, and writes only on a match (a child that imports other sources or versions writes
nothing). The child writes through ``DiskCache``, so its file gets the same checks: an owned
``0700`` directory, a ``0600`` temporary file, fsync and ``os.replace``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import subprocess
import sys
from array import array
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..specs.grammar_spec import GrammarSpec
from ..vocab import Vocabulary
from .diskcache import DiskCache, warn_once

#: The codec's part of a child's work: (job, spec, vocabulary, key material) -> its report.
ChildWrite = Callable[[dict[str, Any], GrammarSpec, Vocabulary, bytes], dict[str, Any]]
#: the vocabulary as the child reads it, per vocabulary digest (built once per process)
_FRAMES: dict[str, bytes] = {}


def u32(values: array[int]) -> bytes:
    """Little-endian u32s (the frames' and the codecs' integer arrays)."""
    if sys.byteorder == "big":  # pragma: no cover - the format is little-endian everywhere
        values.byteswap()
    return values.tobytes()


def read_u32(data: bytes | memoryview, count: int) -> array[int]:
    values = array("I")
    values.frombytes(data[:4 * count])
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    return values


# ------------------------------------------------------------------ the vocabulary
def vocab_frame(vocab: Vocabulary) -> bytes:
    """What the child needs to rebuild the vocabulary (its digest is part of the key the
    child checks); built once per vocabulary."""
    frame = _FRAMES.get(vocab.digest)
    if frame is None:
        frame = _FRAMES[vocab.digest] = _build_frame(vocab)
    return frame


def _build_frame(vocab: Vocabulary) -> bytes:
    head = json.dumps({"special_ids": sorted(vocab.special_ids), "stop_ids": list(vocab.stop_ids),
                       "vocab_size": vocab.vocab_size, "name": vocab.name,
                       "think_end": vocab.think_end}).encode()
    frame = bytearray(struct.pack("<QQ", len(head), len(vocab.tokens)) + head)
    frame += u32(array("I", map(len, vocab.tokens)))
    for token in vocab.tokens:  # not bytes.join: it holds an 80-byte buffer per token (12 MB)
        frame += token
    return bytes(frame)


def read_vocab(data: memoryview) -> Vocabulary:
    hlen, count = struct.unpack_from("<QQ", data)
    head = json.loads(bytes(data[16:16 + hlen]))
    sizes = read_u32(data[16 + hlen:], count)
    offset = 16 + hlen + 4 * count
    tokens = []
    for size in sizes:
        tokens.append(bytes(data[offset:offset + size]))
        offset += size
    return Vocabulary(tokens, special_ids=head["special_ids"], stop_ids=head["stop_ids"],
                      vocab_size=head["vocab_size"], name=head["name"],
                      think_end=head["think_end"])


# ------------------------------------------------------------------ the parent side
def child_request(cache: DiskCache, spec: GrammarSpec, frame: bytes, material: bytes,
                  job: dict[str, Any]) -> bytes:
    """The child's stdin: the job (the codec's fields plus the cache's and the spec's), the
    key material, the vocabulary frame. ``job`` needs ``timeout_s``."""
    job = {**job, "directory": str(cache.directory), "max_bytes": cache.max_bytes,
           "compress": cache.compress, "limit": cache.writer_memory,
           "spec": {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}}
    head = json.dumps(job).encode()
    return b"".join([struct.pack("<QQ", len(head), len(material)), head, material, frame])


def child_env() -> dict[str, str]:
    """The child imports this grammask (its key must match anyway), never touches a GPU and
    leaves no metrics files behind (vLLM's multiprocess Prometheus directory)."""
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def run_child(code: str, request: bytes, timeout: float) -> dict[str, Any]:
    """Run one writer child (``python -P -c code``, ``code`` a codec's constant that ends in
    ``child_main``); its report, or why there is none."""
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-c", code], stdin=subprocess.PIPE,
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


def submit_child(cache: DiskCache, code: str, spec: GrammarSpec, vocab: Vocabulary,
                 material: bytes, job: dict[str, Any]) -> bool:
    """Queue a child write on the cache's writer thread (the request, the vocabulary frame
    and the child's wait are all off the request path); False when not queued."""
    timeout = float(job["timeout_s"])

    def write() -> None:
        report = run_child(code, child_request(cache, spec, vocab_frame(vocab), material, job),
                           timeout)
        cache.forget_size()  # the child wrote (and evicted) on its own
        cache.report({"where": "child", **report}, spec.describe())
    return cache.submit(write)


# ------------------------------------------------------------------- the child side
def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def peak_rss() -> int:
    """This process's peak resident memory (since ``limit_memory`` reset it), in bytes."""
    return _status_bytes("VmHWM")


def limit_memory(extra: int) -> int:
    """Cap this process's data at its footprint now plus ``extra`` bytes (within any hard
    limit already set); returns the resident memory now, the write's baseline. Called by
    the codec after its start-up (the vocabulary's backend view), which is not the write's."""
    import resource

    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here is the write's own
    base = _status_bytes("VmRSS")
    limit = _status_bytes("VmData") + int(extra)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return base


def open_cache(job: dict[str, Any]) -> DiskCache:
    """The parent's cache, as the child opens it (the same directory checks apply)."""
    return DiskCache(job["directory"], job["max_bytes"], compress=job["compress"])


def _child_run(data: bytes, write: ChildWrite) -> dict[str, Any]:
    import resource
    import signal

    hlen, mlen = struct.unpack_from("<QQ", data)
    job = json.loads(data[16:16 + hlen])
    material = data[16 + hlen:16 + hlen + mlen]
    signal.alarm(int(job["timeout_s"]) + 1)  # default action: end the process
    with contextlib.suppress(OSError):
        os.nice(10)
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    vocab = read_vocab(memoryview(data)[16 + hlen + mlen:])
    del data
    return write(job, GrammarSpec(**job["spec"]), vocab, material)


def child_main(write: ChildWrite) -> None:
    """The writer child's body: read the request, run the codec's ``write``, print one JSON
    report line, exit without interpreter teardown."""
    report: dict[str, Any] = {"pid": os.getpid()}
    try:
        report.update(_child_run(sys.stdin.buffer.read(), write))
        code = 0
    except BaseException as exc:  # bad_alloc at the ceiling, a refused spec, ...
        report.update(written=False, why=f"{type(exc).__name__}: {exc}"[:500])
        with contextlib.suppress(Exception):
            report["peak_rss"] = peak_rss()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
    os._exit(code)  # no atexit, no interpreter teardown: the parent has its answer
