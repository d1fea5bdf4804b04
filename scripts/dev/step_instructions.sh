#!/usr/bin/env bash
# Exact instructions per scheduler step (schedule() + update_from_output() through the Python bindings), counted
# by callgrind: deterministic, so a small difference between two builds shows on a noisy, shared machine where
# wall-clock medians cannot resolve it. Only the two binding methods are counted (--toggle-collect), not the
# workload generation or the fake model around them.
#
#   scripts/dev/step_instructions.sh [PYTHONPATH] [WORKLOADS] [SCALE]
#   scripts/dev/step_instructions.sh python a,b,c,d,e 0.1          # this tree (after maturin develop --release)
#
# Prints one line per workload: steps, instructions, instructions per step. Compare two builds by running it with
# each build's python/ directory (e.g. a `git archive` of the older commit with its own _core.abi3.so).
set -euo pipefail
pypath=${1:-python}
workloads=${2:-a,b,c,d,e}
scale=${3:-0.1}
py=$(python3 -c "import sys; print(sys.executable)")  # the interpreter itself, not a shim script
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for w in ${workloads//,/ }; do
  PYTHONPATH=$pypath valgrind --tool=callgrind --callgrind-out-file="$out/cg.$w" \
    "--toggle-collect=*__pymethod_schedule__" "--toggle-collect=*__pymethod_update_from_output__" \
    "$py" - "$w" "$scale" >"$out/log.$w" 2>&1 <<'PY'
import sys
from kvsched.bench.harness import run_workload
from kvsched.bench.workloads import generate, get_scenario

name, scale = sys.argv[1], float(sys.argv[2])
r = run_workload("rust", generate(get_scenario(name).scaled(scale)), warmup_steps=0)
print("STEPS", r.num_steps)
PY
  steps=$(grep -o "STEPS [0-9]*" "$out/log.$w" | cut -d' ' -f2)
  instr=$(grep -E "^(summary|totals):" "$out/cg.$w" | head -1 | awk '{print $2}')
  echo "$w scale=$scale steps=$steps instructions=$instr per_step=$((instr / steps))"
done
