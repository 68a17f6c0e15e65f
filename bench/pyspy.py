"""py-spy recordings of a running vLLM server, and where their samples went.

``recording(pid, out)`` runs ``py-spy record --subprocesses --threads --idle --nonblocking
-f raw`` on a server's root process (the API server: its engine core and worker are its
descendants) until the ``with`` block ends (SIGINT makes py-spy write the file).
``summarize(path)`` reads the raw (collapsed-stack) file. Every thread is sampled at every
tick; a sample is *busy* unless its stack shows a wait (``wait_kind``: blocked on a lock,
queue or socket, or vLLM's shared-memory queue spinning for the other process). Reported:
samples per process and thread (busy, spinning, in grammask's frames: any frame under
``grammask/``), grammask's samples by category and by function (the innermost grammask
frame of each busy sample: native code it calls, xgrammar's or llguidance's fills included,
counts for it; plus the model runner's wait for grammask's fill, a cost on its path), the
model runner's main thread and the engine core's main thread by phase (wall time), and
vLLM's own structured-output frames (``vllm/v1/structured_output``, ``xgrammar``,
``llguidance``). Standalone::

    python -m bench.pyspy out/pyspy-grammask.txt [more files]
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stats import render_table

_PROCESS = re.compile(r'^process (\d+):"(.*)"$')
_THREAD = re.compile(r"^thread \((\w+)\)(?:: (.*))?$")
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")

#: grammask's functions by what they do, on the innermost grammask frame's (file, name)
CATEGORIES = ("read token lists", "matcher advance", "grammar attach", "fill", "plan",
              "apply", "wait for the fill", "hand-off", "per-row Python loops",
              "batch membership", "metrics", "other")

#: leaf frames of a blocked thread (idle: waiting on a lock, a queue, a socket, a timer)
_IDLE_LEAVES = {"Condition.wait", "Event.wait", "_worker", "_PollLikeSelector.select",
                "EpollSelector.select", "BaseSelector.select", "Poller.poll", "poll",
                "Connection._recv", "_recv_bytes", "sleep", "Socket.recv",
                "Socket.recv_multipart", "_wait_for_tstate_lock", "select", "Queue.get",
                "SimpleQueue.get"}


@dataclass(frozen=True)
class Frame:
    func: str
    file: str

    @property
    def in_grammask(self) -> bool:
        return self.file.startswith("grammask/") or "/grammask/" in self.file


@dataclass(frozen=True)
class Stack:
    pid: int
    cmd: str
    thread: str
    frames: tuple[Frame, ...]  # outermost first
    count: int


def py_spy_path(explicit: str | None = None) -> str | None:
    """``explicit``, else ``py-spy`` next to the vLLM venv's Python, else on PATH."""
    if explicit:
        return explicit
    vllm_py = os.environ.get("GRAMMASK_VLLM_PYTHON")
    for cand in ([Path(vllm_py).parent / "py-spy"] if vllm_py else []) + [
            Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "py-spy"]:
        if cand.is_file():
            return str(cand)
    return shutil.which("py-spy")


@contextlib.contextmanager
def recording(pid: int, out: Path, *, rate: int = 20, py_spy: str | None = None,
              attach_s: float = 2.0) -> Iterator[None]:
    """Record ``pid`` and its descendants into ``out`` (raw) while the block runs.

    Every thread at every tick (``--idle``: wall time, waits included), without pausing
    the processes (``--nonblocking``); ``rate`` per second: py-spy at 100 Hz falls seconds
    behind on two busy cores and takes the CPU it measures."""
    exe = py_spy_path(py_spy)
    if exe is None:
        raise RuntimeError("py-spy not found: pip install py-spy into the vLLM venv")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--threads", "--idle",
           "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(out)]
    log = out.with_suffix(out.suffix + ".log")
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        time.sleep(attach_s)  # attach to every process before the work starts
        try:
            yield
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    if not out.is_file():
        raise RuntimeError(f"py-spy wrote no {out}: {log.read_text(errors='replace')[-600:]}")


def parse(path: str | Path) -> list[Stack]:
    stacks: list[Stack] = []
    for line in Path(path).read_text(errors="replace").splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        pid, cmd, thread = 0, "", "?"
        frames: list[Frame] = []
        for part in body.split(";"):
            if not frames and (m := _PROCESS.match(part)):
                pid, cmd = int(m.group(1)), m.group(2)
            elif not frames and (t := _THREAD.match(part)):
                thread = t.group(2) or t.group(1)
            elif f := _FRAME.match(part):
                frames.append(Frame(f.group(1), f.group(2)))
            else:
                frames.append(Frame(part, ""))
        stacks.append(Stack(pid, cmd, thread, tuple(frames), int(count)))
    return stacks


def role(stacks: list[Stack], pid: int) -> str:
    """What a process is, by its command line and the functions on its stacks."""
    cmds = {s.cmd for s in stacks if s.pid == pid}
    funcs = {f.func for s in stacks if s.pid == pid for f in s.frames}
    if any("api_server" in c for c in cmds):
        return "api server"
    if any("WorkerProc" in f or "worker_busy_loop" in f for f in funcs):
        return "worker"
    if any("EngineCore" in f for f in funcs):
        return "engine core"
    return next((c[:40] for c in cmds if c), f"pid {pid}")


def category(frame: Frame) -> str:
    """grammask's function ``frame`` by what it does (``CATEGORIES``)."""
    name = frame.func.rsplit(".", 1)[-1]
    base = frame.file.rsplit("/", 1)[-1]
    if frame.func == "Ticket.result":
        return "wait for the fill"
    if name == "_take":
        return "read token lists"
    if name in ("_advance", "_feed", "accept", "rollback", "_rewind", "feed"):
        return "matcher advance"
    if name in ("_attach_all", "_attach", "_pending_grammar", "_compile_error", "hedge"):
        return "grammar attach"
    if name in ("fill", "batch_fill", "is_terminated", "_fill_position", "_stop_only",
                "_check_fill") or frame.func.startswith("Filler."):
        return "fill"
    if name in ("plan_cpu_apply", "_bit_positions", "_job"):
        return "plan"
    if base == "apply.py" or name in ("apply", "_restore", "_plan_fits", "acquire"):
        return "apply"
    if name in ("_finish", "_work", "_settle", "_wait") or frame.func in (
            "FillWorker.run", "Ticket.__init__"):
        return "hand-off"
    if name in ("_run", "step", "<listcomp>", "<genexpr>", "<dictcomp>", "update_state",
                "has_rows", "proc_or_none", "processor", "core"):
        return "per-row Python loops"
    if name in ("add", "remove", "move", "swap", "_mutate", "request", "_gate", "take_over",
                "host_masks", "_check_row", "_status"):
        return "batch membership"
    if base == "metrics.py" or name in ("observe", "inc"):
        return "metrics"
    return "other"


def _funcs(frames: tuple[Frame, ...]) -> str:
    return ";".join(f.func for f in frames)


def wait_kind(frames: tuple[Frame, ...]) -> str | None:
    """Why a sampled thread was not working (None: it was): ``spin`` for vLLM's shared-
    memory queue waiting on the other process (it spins with ``sched_yield``, then polls:
    CPU burnt, no work done), ``idle`` for a blocked thread, ``grammask idle`` for
    grammask's worker threads waiting for a job, ``grammask wait`` for the model runner
    waiting for grammask's fill."""
    if not frames:
        return "idle"
    leaf = frames[-1]
    if leaf.in_grammask and leaf.func in ("_work", "Runner._work", "_Runner._work"):
        return "grammask idle"
    if leaf.in_grammask and leaf.func == "Ticket.result":
        return "grammask wait"  # the model runner blocked on the fill's lock
    funcs = _funcs(frames)
    if "acquire_read" in funcs or "acquire_write" in funcs:
        return "spin"
    if leaf.func in _IDLE_LEAVES or (leaf.func == "main" and "resource_tracker" in leaf.file):
        return "idle"
    if leaf.func in ("Runner.run", "run") and ("asyncio" in leaf.file or "uvloop" in leaf.file):
        return "idle"  # the event loop in native code: mostly its poll for I/O
    return None


def _vllm_so(frame: Frame) -> bool:
    return ("structured_output" in frame.file or frame.file.startswith(("xgrammar/",
            "llguidance/")) or "apply_grammar_bitmask" in frame.func)


def worker_phase(frames: tuple[Frame, ...]) -> str:
    """The model runner's main thread (worker process), one sample, by what it was doing."""
    inner = next((f for f in reversed(frames) if f.in_grammask), None)
    if inner is not None:
        return f"grammask: {category(inner)}"
    funcs = _funcs(frames)
    if "handle_output" in funcs or "enqueue_output" in funcs:
        return "send outputs to the engine core"
    if "acquire_read" in funcs:
        return "wait for the engine core (spin/poll)"
    if "sample_tokens" in funcs:
        if any(_vllm_so(f) for f in frames):
            return "vLLM: apply the grammar bitmask"
        return "sampler (and other logits processors)"
    if "execute_model" in funcs:
        return "forward and its inputs"
    return "other"


def engine_phase(frames: tuple[Frame, ...]) -> str:
    """The engine core's main thread (scheduler), one sample."""
    funcs = _funcs(frames)
    if any(_vllm_so(f) for f in frames) or any(f.in_grammask for f in frames):
        return "structured output (vLLM's engine: bitmask fill, accept)"
    if "acquire_read" in funcs or "FutureWrapper.result" in funcs:
        return "wait for the worker (spin/poll)"
    if "Scheduler.schedule" in funcs:
        return "schedule"
    if "update_from_output" in funcs:
        return "update from the output (stop checks, ...)"
    if "_process_input_queue" in funcs:
        return "idle: wait for requests" if wait_kind(frames) else "add requests"
    if "execute_model" in funcs or "sample_tokens" in funcs:
        return "send work to the worker"
    if "put_nowait" in funcs or "Queue.put" in funcs:
        return "hand outputs to the output thread"
    return "other"


def _pct(n: int, total: int) -> float:
    return round(100 * n / total, 1) if total else 0.0


def _phases(stacks: list[Stack], pids: list[int], thread: str,
            phase: Any) -> dict[str, Any]:
    c: Counter[str] = Counter()
    for s in stacks:
        if s.pid in pids and s.thread == thread:
            c[phase(s.frames)] += s.count
    n = sum(c.values())
    return {"samples": n, "phases": {k: {"samples": v, "pct": _pct(v, n)}
                                     for k, v in c.most_common()}}


def summarize(path: str | Path, top: int = 15) -> dict[str, Any]:
    """Where the samples of one raw recording went (see the module docstring).

    Recorded with ``--idle``, every thread is sampled at every tick (wall time); samples of
    a blocked or spinning thread (``wait_kind``) are told apart from working ("busy") ones.
    grammask's share is of busy samples (CPU time spent working)."""
    stacks = parse(path)
    total = sum(s.count for s in stacks)
    pids = sorted({s.pid for s in stacks})
    roles = {pid: role(stacks, pid) for pid in pids}
    waits = {id(s): wait_kind(s.frames) for s in stacks}
    busy = [s for s in stacks if waits[id(s)] is None]
    processes: list[dict[str, Any]] = []
    for pid in pids:
        mine = [s for s in stacks if s.pid == pid]
        work = [s for s in busy if s.pid == pid]
        n_busy = sum(s.count for s in work)
        g = sum(s.count for s in work if any(f.in_grammask for f in s.frames))
        so = sum(s.count for s in work if any(_vllm_so(f) for f in s.frames)
                 and not any(f.in_grammask for f in s.frames))
        processes.append({
            "pid": pid, "role": roles[pid], "samples": sum(s.count for s in mine),
            "busy": n_busy,
            "spin": sum(s.count for s in mine if waits[id(s)] == "spin"),
            "grammask_busy": g, "grammask_pct_of_busy": _pct(g, n_busy),
            "vllm_structured_output_busy": so, "vllm_structured_output_pct": _pct(so, n_busy)})
    threads: Counter[tuple[int, str]] = Counter()
    t_busy: Counter[tuple[int, str]] = Counter()
    t_spin: Counter[tuple[int, str]] = Counter()
    t_gram: Counter[tuple[int, str]] = Counter()
    for s in stacks:
        key = (s.pid, s.thread)
        threads[key] += s.count
        if waits[id(s)] is None:
            t_busy[key] += s.count
            if any(f.in_grammask for f in s.frames):
                t_gram[key] += s.count
        elif waits[id(s)] == "spin":
            t_spin[key] += s.count
    by_cat: Counter[str] = Counter()
    by_func: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    for s in stacks:
        inner = next((f for f in reversed(s.frames) if f.in_grammask), None)
        # busy samples, and the main thread's wait for the fill (a cost on its path)
        if inner is None or (waits[id(s)] is not None and inner.func != "Ticket.result"):
            continue
        by_cat[category(inner)] += s.count
        by_func[f"{inner.func} ({inner.file.removeprefix('grammask/')})"] += s.count
        by_thread[s.thread] += s.count
    g_total = sum(by_cat.values())
    worker = [pid for pid in pids if roles[pid] == "worker"]
    engine = [pid for pid in pids if roles[pid] == "engine core"]
    worker_busy = sum(p["busy"] for p in processes if p["pid"] in worker)
    return {
        "file": str(path), "samples": total, "busy": sum(s.count for s in busy),
        "processes": processes,
        "threads": [{"pid": pid, "role": roles[pid], "thread": name, "samples": n,
                     "busy": t_busy[(pid, name)], "spin": t_spin[(pid, name)],
                     "grammask_busy": t_gram[(pid, name)]}
                    for (pid, name), n in sorted(threads.items(),
                                                 key=lambda kv: -t_busy[kv[0]])[:10]],
        "grammask": {
            "samples": g_total,
            "pct_of_busy": _pct(g_total, sum(s.count for s in busy)),
            "pct_of_worker_busy": _pct(g_total, worker_busy),
            "by_thread": dict(by_thread.most_common()),
            "categories": {c: {"samples": by_cat[c], "pct_of_grammask": _pct(by_cat[c], g_total)}
                           for c in CATEGORIES if by_cat[c]},
            "top": [{"function": k, "samples": n, "pct_of_grammask": _pct(n, g_total)}
                    for k, n in by_func.most_common(top)],
        },
        "worker_main_thread": _phases(stacks, worker, "MainThread", worker_phase),
        "engine_core_main_thread": _phases(stacks, engine, "MainThread", engine_phase),
    }


def render(summary: dict[str, Any]) -> str:
    """Markdown tables of one summary."""
    out = [f"{summary['file']}: {summary['samples']} thread samples, {summary['busy']} busy"]
    out.append(render_table(
        ["process", "samples", "busy", "spin", "grammask (busy)", "% of busy",
         "vLLM structured output (busy)", "% of busy"],
        [[p["role"], p["samples"], p["busy"], p["spin"], p["grammask_busy"],
          p["grammask_pct_of_busy"], p["vllm_structured_output_busy"],
          p["vllm_structured_output_pct"]] for p in summary["processes"]]))
    out.append(render_table(["process", "thread", "samples", "busy", "spin", "grammask"],
                            [[t["role"], t["thread"], t["samples"], t["busy"], t["spin"],
                              t["grammask_busy"]] for t in summary["threads"]]))
    g = summary["grammask"]
    out.append(f"grammask: {g['samples']} samples (busy, plus the main thread's wait for the "
               f"fill), {g['pct_of_busy']}% of all busy samples, {g['pct_of_worker_busy']}% "
               f"of the worker's; by thread {g['by_thread']}")
    out.append(render_table(["grammask category", "samples", "% of grammask"],
                            [[c, v["samples"], v["pct_of_grammask"]]
                             for c, v in g["categories"].items()]))
    out.append(render_table(["innermost grammask function", "samples", "% of grammask"],
                            [[t["function"], t["samples"], t["pct_of_grammask"]]
                             for t in g["top"]]))
    for key, title in (("worker_main_thread", "worker main thread"),
                       ("engine_core_main_thread", "engine core main thread")):
        m = summary[key]
        out.append(render_table([f"{title} ({m['samples']} samples)", "samples", "%"],
                                [[k, v["samples"], v["pct"]]
                                 for k, v in m["phases"].items()]))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    for path in (sys.argv[1:] if argv is None else argv):
        print(render(summarize(path)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
