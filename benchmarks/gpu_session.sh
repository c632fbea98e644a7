#!/usr/bin/env bash
# Everything a lent GPU is for, in one go and in order of what matters most, each part within
# its own time so that a slow part cannot starve the next: the float8 GEMM forms of one layer
# (fp8_gemm.py), the training steps at real sizes (gpu_step.py, rows by priority), then the
# test suite. Logs and JSON go to $1 (default: gpu-session/).
#
# Run on the GPU machine from the repository root, with autocast importable (PYTHONPATH=src)
# and the test extras installed:  bash benchmarks/gpu_session.sh OUTDIR [GEMM_S STEP_S SUITE_S]
set -uo pipefail
out=${1:-gpu-session}
gemm_s=${2:-80}
step_s=${3:-270}
suite_s=${4:-180}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $py -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  $py -c 'import torch; print("torch", torch.__version__)' 2>/dev/null
  date -u; } 2>&1 | tee "$out/device.txt"

echo "== fp8_gemm ($gemm_s s)"
timeout -k 5 "$gemm_s" $py benchmarks/fp8_gemm.py --triton on,off --json "$out/fp8_gemm.json" 2>&1 | tee "$out/fp8_gemm.txt"

# The rows that decide the targets first; the rest while time lasts.
rows=(
  "GPT-2 small/hand bf16/fused" "GPT-2 small/amp bf16/fused" "GPT-2 small/torch compile/fused"
  "GPT-2 medium/hand bf16/fused" "GPT-2 medium/amp bf16/fused" "GPT-2 medium/amp fp8/fused"
  "GPT-2 medium/amp fp8 delay/fused" "GPT-2 medium/amp fp8 dq/fused" "GPT-2 medium/amp fp8 delay dq/fused"
  "decoder 24x2048/amp bf16/fused" "decoder 24x2048/amp fp8/fused" "decoder 24x2048/amp fp8 delay/fused"
  "decoder 24x2048/amp fp8 dq/fused" "decoder 24x2048/amp fp8 delay dq/fused"
  "ResNet-18/flax bf16/-" "ResNet-18/amp bf16/-"
  "GPT-2 medium/torch compile/fused" "GPT-2 small/amp fp8/fused" "GPT-2 small/amp fp8 delay/fused"
  "GPT-2 small/amp bf16/naive" "GPT-2 small/hand bf16/naive" "decoder 24x2048/hand bf16/fused"
  "ResNet-18/amp fp8/-" "GPT-2 small/float32/fused" "GPT-2 small/torch compile/naive"
)
joined=$(IFS=';'; echo "${rows[*]}")
echo "== gpu_step ($step_s s)"
timeout -k 5 "$step_s" $py benchmarks/gpu_step.py --steps 10 --timeout 75 --rows "$joined" \
  --json "$out/gpu_step.json" 2>&1 | tee "$out/gpu_step.txt"

echo "== suite ($suite_s s)"
# SIGINT first: pytest then prints its summary line for what ran
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 15 "$suite_s" \
  $py -m pytest -n 12 -p no:cacheprovider -q -rfE > "$out/suite.txt" 2>&1
echo "suite exit $?"
tail -n 40 "$out/suite.txt"
