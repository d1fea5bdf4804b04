#!/usr/bin/env bash
# Exact instructions per scheduler step of bench workload h (256 running, about 1,000 waiting) under one policy
# configuration, counted by callgrind on schedule() + update_from_output() through the Python bindings (the
# workload generation and the fake model around them are not counted): deterministic, so the cost of one policy
# against another shows on a shared machine whose wall-clock medians move by 30% from run to run.
#
#   scripts/dev/policy_instructions.sh [PYTHONPATH] [STEPS] FIELD=VALUE ...
#   scripts/dev/policy_instructions.sh python 1000 policy=fair num_tenants=16
#
# FIELD=VALUE are `kvsched bench --set` items (scenario or SchedulerConfig fields). Prints steps, instructions,
# instructions per step.
set -euo pipefail
pypath=${1:-python}
steps=${2:-1000}
shift 2 || true
py=$(python3 -c "import sys; print(sys.executable)")  # the interpreter itself, not a shim script
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
PYTHONPATH=$pypath valgrind --tool=callgrind --callgrind-out-file="$out/cg" \
  "--toggle-collect=*__pymethod_schedule__" "--toggle-collect=*__pymethod_update_from_output__" \
  "$py" - "$steps" "$@" >"$out/log" 2>&1 <<'PY'
import sys
from dataclasses import replace

from kvsched.bench.harness import run_workload
from kvsched.bench.workloads import generate, get_scenario
from kvsched.cli import _bench_sets

steps, sets = int(sys.argv[1]), sys.argv[2:]
scenario = replace(get_scenario("h"), **_bench_sets(sets))
r = run_workload("rust", generate(scenario), warmup_steps=0, max_steps=steps)
print("STEPS", r.num_steps)
PY
n=$(grep -o "STEPS [0-9]*" "$out/log" | cut -d' ' -f2)
instr=$(grep -E "^(summary|totals):" "$out/cg" | head -1 | awk '{print $2}')
echo "$* steps=$n instructions=$instr per_step=$((instr / n))"
