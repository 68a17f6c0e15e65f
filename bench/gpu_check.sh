#!/usr/bin/env bash
# The GPU checks in one run (about 6 minutes on one GPU), for whoever gets a CUDA machine:
#   1. tests/kernels/test_apply_devices.py on CUDA (apply kernel vs a bitwise reference for fp32/bf16/fp16
#      with model padding; BatchProcessor on CUDA logits under torch.inference_mode, which
#      exercises the pinned double buffers and their copy events);
#   2. tests/v2_gpu_check.py: the V2 adapter's token watch in vLLM 0.34's async order on a
#      real stream (post_update as device ops, no host sync; B = 1..512 slots from the top,
#      3/10/30 ms forwards): exact token reads, valid masks, the host's wait in apply, fill
#      overlap, bytes per step, the step against vLLM's way (issue 45, item 8; <= 90 s);
#      its contexts are padded as a FULL decode CUDA graph pads them, and an unconstrained
#      request beside the constrained rows asks for prompt logprobs: vLLM's prompt-logprob
#      token-id read (at total_len, between the processors and post_update) is replayed on
#      the device and every id it sees must be a valid token id (issue 50);
#   3. bench/gpu.py: apply kernel vs memcpy at B=1..1024 on 152k and 248k vocabularies, the
#      apply's host cost, and the decode step against vLLM's way on CUDA-graph and eager
#      forwards (bench/gpu_step.py; its cells get 150 s);
#   4. bench/wave.py: a wave of 256 and 512 first requests of one free-text schema, the engine
#      switch on, off, grammask forced to xgrammar and vLLM's way with xgrammar, with this
#      machine's own verdict (issue 52: which engine fills cheaper is the machine's call;
#      about a minute).
# Writes $OUT/gpu.json (benchmarks + what they proved), $OUT/v2.json, $OUT/wave.json and
# $OUT/gpu-tests.txt.
#
# The machine needs torch with CUDA; grammask's own dependencies that it lacks travel as
# wheels in .whl/ (no network there): `make gpu-wheels` here first (Python 3.12 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-deps --no-index --target .gpu-site .whl/*.whl
    export PYTHONPATH="$PWD/.gpu-site:$PWD/src"
else
    export PYTHONPATH="$PWD/src"
fi
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
status=0
"$PY" -m pytest -q -s -p no:cacheprovider tests/kernels/test_apply_devices.py tests/kernels/test_apply.py -rs 2>&1 | tee "$OUT/gpu-tests.txt" \
    || status=1
"$PY" -m tests.v2_gpu_check --device cuda --budget-s 75 --json "$OUT/v2.json" 2>&1 | tee "$OUT/v2.txt" \
    || status=1
"$PY" -m bench.gpu --json "$OUT/gpu.json" --step-budget-s 150 || status=1
"$PY" -m bench.wave --batch-sizes 256,512 --repeats 3 --steps 160 --json "$OUT/wave.json" \
    2>&1 | tee "$OUT/wave.txt" || status=1
echo "gpu_check: tests and benchmarks done (status $status); results in $OUT"
exit $status
