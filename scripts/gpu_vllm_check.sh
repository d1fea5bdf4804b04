#!/usr/bin/env bash
# kvsched.vllm in a real vLLM engine on a CUDA GPU: identical greedy tokens and tokens/s, vLLM's scheduler vs ours.
# Usage (on the CUDA machine, from the repository root, with a built wheel in dist/ unless kvsched.vllm imports):
#   bash scripts/gpu_vllm_check.sh            # installs dist/kvsched-*.whl with the vllm extra, then runs
# Output: one JSON line per scheduler and {"identical_greedy_tokens": true|false}; exit 1 if tokens differ.
# Results also go to $OUT/gpu.txt and $OUT/result.jsonl (default OUT=./gpu-check-out/vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out/vllm}
mkdir -p "$OUT"
if ! python3 -c "import kvsched.vllm" 2>/dev/null; then
    wheel=$(ls dist/kvsched-*.whl | head -n 1)
    timeout 900 python3 -m pip install -q "${wheel}[vllm]"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 1200 python3 scripts/gpu_vllm_check.py "$@" | tee "$OUT/result.jsonl"
