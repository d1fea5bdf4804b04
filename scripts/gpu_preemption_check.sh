#!/usr/bin/env bash
# The preemption modes end to end on a CUDA GPU:
# python -m kvsched.bench.preemption_e2e on a random-weight model with Llama-3.2-1B shapes (nothing downloaded),
# 64 requests of 2000-8000 prompt tokens and 256 outputs, 8000 GPU blocks and 8000 CPU blocks of 16 tokens, under
# recompute, swap and auto: output tokens/s, preemptions, blocks swapped, tokens recomputed, auto's measured
# cost constants.
#
# Uses the in-tree sources (python/) with the native module already built into python/kvsched (copy
# python/kvsched/_core.abi3.so along if it was built on another machine); the run ends within 9 minutes.
#   OUT=/path/for/results scripts/gpu_preemption_check.sh          (default OUT=./gpu-check-out)
# Results: $OUT/env.txt, $OUT/preemption_e2e.{txt,json}. DRY_RUN=1 checks the script on a CPU machine (--tiny).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/python"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| cuda", torch.version.cuda, "| available", torch.cuda.is_available())' 2>&1
} | tee "$OUT/env.txt"
ARGS=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "DRY_RUN: tiny model on the CPU"
  ARGS=(--tiny)
elif ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_preemption_check: torch with CUDA is required" | tee -a "$OUT/env.txt"
  exit 2
fi
timeout 540 "$PY" -m kvsched.bench.preemption_e2e "${ARGS[@]}" --json "$OUT/preemption_e2e.json" 2>&1 \
  | grep -v "preempted for lack of KV cache blocks" | tee "$OUT/preemption_e2e.txt"
exit "${PIPESTATUS[0]}"
