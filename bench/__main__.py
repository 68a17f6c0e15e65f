"""``python -m bench``: the benchmarks, one entry point.

    python -m bench                  # this list
    python -m bench NAME [ARGS ...]  # run one: the same as python -m bench.NAME [ARGS ...]
    python -m bench NAME --help      # its options

Results and their history: docs/benchmarks.md.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: name -> what it measures [where it runs]; in the order a reviewer would run them
BENCHMARKS: dict[str, str] = {
    "compile": "cold compile, first mask, cache hits: vs raw backends and vLLM's [CPU]",
    "step": "the decode step with masks against vLLM's way, three models of it [CPU]",
    "gpu": "apply kernel and host time, the step on CUDA (bench/gpu_check.sh) [CUDA]",
    "gpu_step": "the decode step vs vLLM's way, CUDA-graph and eager forwards [CUDA]",
    "vllm_server": "vs vLLM's engine on one server: valid rate, TTFT, tok/s [vLLM venv]",
    "vllm_throughput": "fixed-work TPOT: grammask, vLLM's engine, unconstrained [vLLM venv]",
    "stress": "compile service: deadlines, latency beside bad/slow specs, RSS bound [CPU]",
    "diskcache_heavy": "disk cache: heavy xgrammar grammars, cold vs load, memory [CPU]",
    "fillcost": "fill cost of the routed backend vs the cheaper eligible engine [CPU]",
    "wave": "a wave of one free-text schema: engine switch on, off, forced xgrammar, vLLM [CPU]",
    "v2_reads": "vLLM 0.34's V2 token watch: watched/ordered reads vs another tree [unit34]",
}


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [(__doc__ or "").strip(), "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(listing())
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
