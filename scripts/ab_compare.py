"""Compare builds of kvsched on one workload by alternating runs: the paired figure a noisy machine still resolves.

Each build is a directory holding a ``python/`` tree with its own ``_core.abi3.so`` (e.g. a ``git archive`` of a
commit plus its built extension, or this checkout after ``maturin develop --release``). Every round runs
``kvsched bench --impl rust -w WORKLOAD --repeat 1`` once per build, in turn, pinned to one core when
``taskset`` exists, and reads the step median (schedule + update, µs) from the bench's JSON. Since the builds
alternate within each round, a drift of the machine's speed over minutes affects all of them alike; the paired
ratio (this build's median over the first build's, in the same round) cancels it. The order of the builds is
reversed every other round (A B, B A, A B, ...), so neither build always runs second.

Each run imports its build from a fresh copy of the build's ``python/`` tree. Where the extension's pages land in
physical memory (they stay in the page cache between runs) moves a step by a few per cent: one build against a
byte-identical copy of itself read a paired ratio of 1.040 on e, the copy slower in all 12 rounds, and 0.998 once
the page cache was dropped. A copy per run draws a new placement every run, so it spreads over the rounds
instead of favouring one build throughout.

    python scripts/ab_compare.py WORKLOAD ROUNDS DIR [DIR ...] [-- EXTRA BENCH ARGS]
    python scripts/ab_compare.py c 10 /tmp/base /tmp/new            # tight loop
    python scripts/ab_compare.py a 8 /tmp/base /tmp/new -- --cold 8  # 8 MiB touched between steps

Prints, per build, the median over rounds of the run medians and the median of the paired ratios to the first
build (below 1: faster).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(build: Path, workload: str, extra: list[str], json_path: Path) -> float:
    """One bench run of `workload` with the build in `build`; its median step in µs."""
    cmd = [sys.executable, "-m", "kvsched.cli", "bench", "--impl", "rust", "-w", workload, "--repeat", "1"]
    cmd += ["--no-progress", "--json", str(json_path), *extra]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "1" if (os.cpu_count() or 1) > 1 else "0", *cmd]
    with tempfile.TemporaryDirectory() as tmp:
        # A fresh copy: the extension's pages get a new place in the page cache (see the module docstring).
        tree = shutil.copytree(build / "python", Path(tmp) / "python")
        env = dict(os.environ, PYTHONPATH=str(tree))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed for {build}:\n{proc.stderr}")
    result = json.loads(json_path.read_text())["results"][0]
    return float(result["total_us"]["median"])


def run_order(builds: list[Path], round_index: int) -> list[Path]:
    """The order the builds run in round `round_index` (from 0): as given, reversed every other round."""
    return builds if round_index % 2 == 0 else builds[::-1]


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    workload, rounds = argv[0], int(argv[1])
    builds = [Path(d) for d in argv[2:]]
    for b in builds:
        if not (b / "python" / "kvsched").is_dir():
            print(f"{b} has no python/kvsched tree", file=sys.stderr)
            return 2
    medians: dict[Path, list[float]] = {b: [] for b in builds}
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / "bench.json"
        for r in range(rounds):
            for b in run_order(builds, r):
                medians[b].append(run_once(b, workload, extra, json_path))
            row = "  ".join(f"{medians[b][-1]:.3f}" for b in builds)
            print(f"round {r + 1}/{rounds}: {row}", file=sys.stderr, flush=True)
    first = medians[builds[0]]
    for b in builds:
        ratio = statistics.median(y / x for x, y in zip(first, medians[b], strict=True))
        print(f"{workload} {b}: median {statistics.median(medians[b]):.3f} µs, paired ratio {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
