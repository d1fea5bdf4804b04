"""Does importing vLLM slow the Rust scheduler down? Workload a through the Rust scheduler, five times in this
process, after importing nothing, torch, vLLM, or vLLM followed by ``gc.freeze()`` (docs/benchmarks.md, "kvsched
inside vLLM's process"). Prints the median step (schedule + update) of each run.

    PYTHONPATH=python python3 scripts/dev/vllm_import_probe.py plain
    PYTHONPATH=python python3 scripts/dev/vllm_import_probe.py torch
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=python /path/to/vllm-env/python scripts/dev/vllm_import_probe.py vllm
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=python /path/to/vllm-env/python scripts/dev/vllm_import_probe.py vllm-freeze

Alternate the modes (several rounds) on a shared machine: the spread between runs is larger than the effect.
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    if mode not in ("plain", "torch", "vllm", "vllm-freeze"):
        raise SystemExit(f"mode must be plain, torch, vllm or vllm-freeze, got {mode!r}")
    if mode.startswith("vllm"):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import vllm.v1.core.sched.scheduler  # noqa: F401

        if mode == "vllm-freeze":
            gc.freeze()
    elif mode == "torch":
        import torch  # noqa: F401

    from kvsched.bench.harness import run_workload
    from kvsched.bench.workloads import generate, get_scenario

    w = generate(get_scenario("a"))
    medians = []
    for _ in range(5):
        r = run_workload("rust", w, warmup_steps=20)
        medians.append(float(np.median(np.asarray(r.schedule_ns) + np.asarray(r.update_ns))) / 1e3)
    runs = " ".join(f"{m:.1f}" for m in medians)
    tracked = len(gc.get_objects())
    print(f"{mode}: median step per run (µs) {runs}; best {min(medians):.1f}; gc-tracked objects {tracked}")


if __name__ == "__main__":
    main()
