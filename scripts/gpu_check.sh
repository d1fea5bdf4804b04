#!/usr/bin/env bash
# GPU check of the torch runner on a CUDA machine, which needs no network access:
#
#   1. installs a kvsched wheel built elsewhere (dist/kvsched-*.whl, maturin abi3 x86-64; copy `dist/` along)
#      without dependencies or an index; falls back to the in-tree sources plus the wheel's (or an already
#      built) native module if pip cannot install it;
#   2. runs the gpu-marked tests: the Triton paged-attention kernel vs the torch reference backend
#      (fp32/bf16/fp16), the engine vs transformers (fp32 exact greedy; bf16 near-argmax);
#   3. runs the throughput benchmark on a random-weight model with Llama-3.2-1B shapes (nothing downloaded):
#      output tokens/s at batch 1, 64 and 256, and the share of step time spent in the scheduler and input
#      preparation vs the model; again with CUDA graphs for decode steps; and at batch 256 with the
#      pure-Python reference scheduler for contrast.
#
# Needs python with torch (CUDA), triton, numpy, pytest, safetensors; transformers for the engine-vs-HF tests.
# Usage (repo root):  OUT=/path/for/results scripts/gpu_check.sh        (default OUT=./gpu-check-out)
# Results: $OUT/env.txt, $OUT/pytest_gpu.txt, $OUT/throughput{,_graphs,_reference}.{txt,json}
# DRY_RUN=1 checks the script itself on a CPU machine (gpu tests skip, throughput runs with --tiny).
# Each phase has its own timeout (240 + 120 + 120 + 90 s), so the whole check ends within 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "environment"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| cuda", torch.version.cuda, "| available", torch.cuda.is_available())' 2>&1
  "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
  "$PY" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
  "$PY" -c 'import flash_attn; print("flash_attn", flash_attn.__version__)' 2>&1 | tail -1
} | tee "$OUT/env.txt"
TP_ARGS=(--batch-sizes 1,64,256 --input-len 128 --output-len 128)
TP_REF_ARGS=(--batch-sizes 256 --input-len 128 --output-len 128)
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "DRY_RUN: no CUDA needed; tiny throughput runs"
  TP_ARGS=(--tiny)
  TP_REF_ARGS=(--tiny --batch-sizes 8)
elif ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch with CUDA is required (and cannot be installed here: no network)" | tee -a "$OUT/env.txt"
  exit 2
fi

step "install kvsched"
WHEEL="$(ls -t dist/kvsched-*.whl 2>/dev/null | head -1 || true)"
CHECK='import kvsched, kvsched.runner.triton_attention, kvsched.bench.engine_throughput; from kvsched import Scheduler
print("kvsched", kvsched.__version__, "from", kvsched.__file__)'
USE_SOURCE=1
if [ -n "$WHEEL" ] && "$PY" -m pip install --no-deps --no-index --force-reinstall "$WHEEL" >"$OUT/pip.txt" 2>&1 \
   && (cd /tmp && PYTHONPATH= "$PY" -c "$CHECK"); then
  echo "installed $WHEEL"
  # Tests and benchmarks use the installed package (it has the native module; python/ may not).
  export PYTHONPATH=
  USE_SOURCE=0
else
  echo "the wheel '${WHEEL:-<none in dist/>}' did not install or lacks the runner: using python/ + the native module"
  tail -5 "$OUT/pip.txt" 2>/dev/null
  if [ -n "$WHEEL" ] && ! ls python/kvsched/_core*.so >/dev/null 2>&1; then
    "$PY" - "$WHEEL" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("kvsched/_core") and name.endswith(".so"):
            open("python/" + name, "wb").write(z.read(name)); print("extracted", name)
PYEOF
  fi
  export PYTHONPATH="$PWD/python"
  "$PY" -c "$CHECK" || { echo "gpu_check: kvsched does not import"; exit 2; }
fi

step "gpu tests"
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/test_runner_attention.py tests/test_engine_hf.py 2>&1 | tee "$OUT/pytest_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "throughput, Llama-3.2-1B shapes, random weights, bf16"
timeout 120 "$PY" -m kvsched.bench.engine_throughput "${TP_ARGS[@]}" --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "throughput, as above, with CUDA graphs for decode-only steps"
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "DRY_RUN: skipped (needs CUDA)"
else
  timeout 120 "$PY" -m kvsched.bench.engine_throughput "${TP_ARGS[@]}" --cuda-graphs --json "$OUT/throughput_graphs.json" \
    2>&1 | tee "$OUT/throughput_graphs.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

step "throughput at batch 256 with the pure-Python reference scheduler (for contrast)"
timeout 90 "$PY" -m kvsched.bench.engine_throughput "${TP_REF_ARGS[@]}" --scheduler reference --json "$OUT/throughput_reference.json" 2>&1 | tee "$OUT/throughput_reference.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done (status $status, source mode $USE_SOURCE); results in $OUT"
exit $status
