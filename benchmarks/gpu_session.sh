#!/usr/bin/env bash
# Everything a lent GPU is for, in order of what matters most, each part within its own time
# so that a slow part cannot starve the next: the float8 GEMM forms of one layer
# (fp8_gemm.py) and what recomputation costs (recompute_cost.py), the training steps at real
# sizes (gpu_step.py, rows by priority), then the test suite. A part given 0 seconds is left
# out, so the measurements and the suite can go in two calls (the second a rerun's room if the
# first fails). Logs and JSON go to OUTDIR (default: gpu-session/). On an H100 with 16 cores
# the suite ran 1068 of its tests in 210 s; the whole of it needs about 300.
#
# Run on the GPU machine from the repository root, with autocast importable (PYTHONPATH=src)
# and the test extras installed:
#   bash benchmarks/gpu_session.sh OUTDIR [GEMM_S STEP_S SUITE_S]
set -uo pipefail
out=${1:-gpu-session}
gemm_s=${2:-70}
step_s=${3:-260}
suite_s=${4:-300}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $py -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  $py -c 'import torch; print("torch", torch.__version__)' 2>/dev/null
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u; } 2>&1 | tee -a "$out/device.txt"

if [ "$gemm_s" != 0 ]; then
  echo "== fp8_gemm, recompute_cost ($gemm_s s)"
  # recompute_cost.py at the batch of make gpu-plan's "MLP timed" rows, 8192; both in the budget
  timeout -k 5 "$gemm_s" bash -c "$py benchmarks/fp8_gemm.py --triton on,off --json '$out/fp8_gemm.json'; \
    $py benchmarks/recompute_cost.py --batch 8192" 2>&1 | tee "$out/fp8_gemm.txt"
fi

# The rows no GPU has measured since recomputed chains first (an H100 measured GPT-2 medium
# amp bf16 and fp8 and the decoder's amp bf16 at batch 8 on 2026-11-28, docs/benchmarks.md),
# the targets' yardsticks among them; the float8 decoder at batch 8 last, as its run took
# over 130 s there; the rows already measured after it.
rows=(
  "GPT-2 medium/torch compile/fused" "GPT-2 small/amp bf16/fused" "GPT-2 small/torch compile/fused"
  "ResNet-18/flax bf16/-" "ResNet-18/amp bf16/-" "GPT-2 medium/amp bf16 merged/fused"
  "GPT-2 medium/amp bf16 state16/fused" "GPT-2 medium/hand bf16/fused" "GPT-2 small/hand bf16/fused"
  "GPT-2 small/amp fp8/fused" "decoder 24x2048/amp bf16/fused" "decoder 24x2048/hand bf16/fused"
  "decoder 24x2048/amp fp8/fused" "decoder 24x2048/amp bf16 state16/fused"
  "GPT-2 small/amp bf16 merged/fused" "GPT-2 medium/amp fp8 delay/fused" "ResNet-18/amp fp8/-"
  "GPT-2 small/amp bf16/naive" "decoder 24x2048 b8/amp fp8/fused"
  "GPT-2 medium/amp bf16/fused" "GPT-2 medium/amp fp8/fused" "decoder 24x2048 b8/amp bf16/fused"
)
if [ "$step_s" != 0 ]; then
  joined=$(IFS=';'; echo "${rows[*]}")
  echo "== gpu_step ($step_s s)"
  timeout -k 5 "$step_s" $py benchmarks/gpu_step.py --steps 10 --timeout 200 --rows "$joined" \
    --json "$out/gpu_step.json" 2>&1 | tee "$out/gpu_step.txt"
fi

if [ "$suite_s" != 0 ]; then
  echo "== suite ($suite_s s)"
  # SIGINT first: pytest then prints its summary line for what ran. test_install builds a
  # wheel with a build backend from the package registry, which the GPU machine cannot reach.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 15 "$suite_s" \
    $py -m pytest -n 15 -p no:cacheprovider -q -rfE --durations=15 \
    --ignore=tests/test_install.py > "$out/suite.txt" 2>&1
  echo "suite exit $?"
  tail -n 60 "$out/suite.txt"
fi
