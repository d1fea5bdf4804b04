#!/usr/bin/env bash
# Simulated cache misses per decode step, schedule() and update_from_output() apart: where `perf stat` has no
# hardware counters (as in many VMs, which report "not supported"), callgrind's cache simulation counts the misses
# of the two binding methods instead. It runs scripts/dev/api_decode_loop.py (N decoding requests, COLD_MB of other
# memory written before each step, STAGGER 1 for requests that reach their block boundaries in different steps)
# for STEPS and for 2 * STEPS decode steps and prints the difference divided by STEPS, so the prefill and the
# set-up cancel out: exactly for instructions; the miss counts of the two runs also differ by how their heaps
# happen to lie, a few lines in all, so give it enough steps (the default 200) for per-step figures.
#
#   scripts/dev/step_cache_misses.sh [PYTHONPATH] [N] [STEPS] [COLD_MB] [STAGGER]     # defaults: python 51 200 1 1
#
# The simulated caches default to those of a 2-core AMD EPYC VM: L1i 32 KiB 8-way, L1d 48 KiB 12-way, and a
# last level of 1 MiB 16-way standing for the per-core L2 (callgrind models two levels; L2 misses are the ones
# that go to the shared L3 or memory). Set I1=... D1=... LL=... (callgrind's size,associativity,line) to model
# another CPU. Compare two builds by running it with each build's python/ directory. Columns: instructions (Ir),
# L1i misses (I1mr: the step's code does not stay in the L1 instruction cache between two steps), L1d read and
# write misses (D1mr, D1mw), L2 read and write misses (DLmr, DLmw).
set -euo pipefail
pypath=${1:-python}
n=${2:-51}
steps=${3:-200}
cold=${4:-1}
stagger=${5:-1}
i1=${I1:-32768,8,64}
d1=${D1:-49152,12,64}
ll=${LL:-1048576,16,64}
here=$(cd "$(dirname "$0")" && pwd)
py=$(python3 -c "import sys; print(sys.executable)")  # the interpreter itself, not a shim script
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for s in "$steps" $((2 * steps)); do
  PYTHONPATH=$pypath valgrind --tool=callgrind --cache-sim=yes "--I1=$i1" "--D1=$d1" "--LL=$ll" \
    --callgrind-out-file="$out/cg.$s" \
    "--toggle-collect=*__pymethod_schedule__" "--toggle-collect=*__pymethod_update_from_output__" \
    "$py" "$here/api_decode_loop.py" "$n" 32 "$s" "$cold" "$stagger" >"$out/log.$s" 2>&1
  callgrind_annotate --inclusive=yes --threshold=100 --show=Ir,I1mr,D1mr,D1mw,DLmr,DLmw "$out/cg.$s" \
    >"$out/ann.$s" 2>/dev/null
done
echo "n=$n steps=$steps cold_mb=$cold stagger=$stagger I1=$i1 D1=$d1 LL=$ll, per step:"
python3 - "$out/ann.$steps" "$out/ann.$((2 * steps))" "$steps" <<'PY'
import re
import sys

events = ["Ir", "I1mr", "D1mr", "D1mw", "DLmr", "DLmw"]


def counts(path: str) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for line in open(path):
        for method in ("schedule", "update_from_output"):
            # The first line naming the method (inclusive counts, sorted largest first) is its whole cost.
            if f"PyScheduler::__pymethod_{method}__" in line and method not in found:
                numbers = re.findall(r"([\d,]+) \(\s*[\d.]+%\)|\s(\.)\s", line)
                found[method] = [int(a.replace(",", "")) if a else 0 for a, _ in numbers][: len(events)]
    return found


one, two, steps = counts(sys.argv[1]), counts(sys.argv[2]), int(sys.argv[3])
print(f"{'':20}" + "".join(f"{e:>9}" for e in events))
for method in ("schedule", "update_from_output"):
    per_step = [(b - a) / steps for a, b in zip(one[method], two[method], strict=True)]
    print(f"{method:20}" + "".join(f"{v:9.1f}" for v in per_step))
PY
