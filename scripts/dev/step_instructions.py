"""Workload d (scaled) through the Rust scheduler under one preemption mode, for counting the instructions of
``schedule()`` + ``update_from_output()`` with callgrind (docs/benchmarks.md, "Preemption modes"):

    valgrind --tool=callgrind "--toggle-collect=*__pymethod_schedule__" \\
        "--toggle-collect=*__pymethod_update_from_output__" \\
        $(pyenv which python3) scripts/dev/step_instructions.py recompute 0.1

Run the real interpreter, not a pyenv shim (valgrind does not follow the shim's exec). With PYTHONPATH pointing at
the build to measure; swap and auto get a CPU pool as large as the GPU pool.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from kvsched.bench.harness import run_workload
from kvsched.bench.workloads import generate, get_scenario


def main() -> None:
    mode, scale = sys.argv[1], float(sys.argv[2])
    sc = get_scenario("d")
    if mode != "recompute":
        sc = replace(sc, preemption_mode=mode, num_cpu_blocks=sc.num_blocks)
    r = run_workload("rust", generate(sc.scaled(scale)), warmup_steps=0)
    c = r.counters
    print(mode, "steps", r.num_steps, "preemptions", c.num_preemptions, "tokens", int(r.num_scheduled_tokens.sum()))


if __name__ == "__main__":
    main()
