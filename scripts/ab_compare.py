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

    python scripts/ab_compare.py [--steps GROUP] WORKLOAD ROUNDS DIR [DIR ...] [-- EXTRA BENCH ARGS]
    python scripts/ab_compare.py c 10 ../base .                # tight loop
    python scripts/ab_compare.py a 8 ../base . -- --cold 8     # 8 MiB touched between steps
    python scripts/ab_compare.py --steps finishing a 16 ../base .

``--steps`` compares the median of one group of steps instead of all (the run records every step's timings with
``--per-step``): ``finishing``, the steps after which fewer requests run (requests finished, or were preempted);
``prefill``, the steps that schedule more than 4x the tokens of the median step (prompt chunks). These are the
steps that make a workload's p99; their medians move with changes that the median of all steps cannot show.

Prints, per build, the median over rounds of the run medians and the median of the paired ratios to the first
build (below 1: faster), with a 95% confidence interval for that median (distribution-free, from the order of
the ratios; it needs 6 rounds or more) and the number of rounds in which the build was the faster. An interval
that contains 1 has not shown a difference: one build against a copy of itself on c read 1.021, interval
0.987-1.074, over 16 rounds on a 2-core VM (single rounds from 0.87 to 1.15).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEP_GROUPS = ("all", "finishing", "prefill")


def group_median(per_step: dict[str, list[int]], group: str) -> float:
    """The median step (schedule + update, µs) of `group` in a run's per-step record (see the module docstring);
    NaN when no step is in the group."""
    total = [s + u for s, u in zip(per_step["schedule_ns"], per_step["update_ns"], strict=True)]
    if group == "finishing":
        running = per_step["num_running_reqs"]
        chosen = [total[i] for i in range(len(total) - 1) if running[i + 1] < running[i]]
    elif group == "prefill":
        tokens = per_step["num_scheduled_tokens"]
        limit = 4 * statistics.median(tokens)
        chosen = [t for t, n in zip(total, tokens, strict=True) if n > limit]
    else:
        chosen = total
    return statistics.median(chosen) / 1000.0 if chosen else math.nan


def run_once(build: Path, workload: str, extra: list[str], json_path: Path, steps: str = "all") -> float:
    """One bench run of `workload` with the build in `build`; the median of its steps in `steps`, in µs."""
    cmd = [sys.executable, "-m", "kvsched.cli", "bench", "--impl", "rust", "-w", workload, "--repeat", "1"]
    cmd += ["--no-progress", "--json", str(json_path), *(["--per-step"] if steps != "all" else []), *extra]
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
    if steps != "all":
        return group_median(result["per_step"], steps)
    return float(result["total_us"]["median"])


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values`: the order statistics `x(k)` and
    `x(n + 1 - k)` with the largest `k` for which a Binomial(n, 1/2) falls below `k` with probability at most
    `(1 - level) / 2`. Its coverage is at least `level` whatever the distribution of the values. None when `n`
    is too small for any such interval (below 6 rounds at 95%)."""
    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - level) / 2.0
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2:
        p_next = below + math.comb(n, k) / 2.0**n
        if p_next > tail:
            break
        k, below = k + 1, p_next
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def run_order(builds: list[Path], round_index: int) -> list[Path]:
    """The order the builds run in round `round_index` (from 0): as given, reversed every other round."""
    return builds if round_index % 2 == 0 else builds[::-1]


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    steps = "all"
    if argv[:1] == ["--steps"]:
        if len(argv) < 2 or argv[1] not in STEP_GROUPS:
            print(f"--steps takes one of {', '.join(STEP_GROUPS)}", file=sys.stderr)
            return 2
        steps, argv = argv[1], argv[2:]
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
                medians[b].append(run_once(b, workload, extra, json_path, steps))
            row = "  ".join(f"{medians[b][-1]:.3f}" for b in builds)
            print(f"round {r + 1}/{rounds}: {row}", file=sys.stderr, flush=True)
    first = medians[builds[0]]
    for b in builds:
        ratios = [y / x for x, y in zip(first, medians[b], strict=True)]
        median, ratio = statistics.median(medians[b]), statistics.median(ratios)
        what = "median" if steps == "all" else f"median of the {steps} steps"
        line = f"{workload} {b}: {what} {median:.3f} µs, paired ratio {ratio:.3f}"
        if b != builds[0]:
            interval = median_interval(ratios)
            spread = (
                f"95% interval {interval[0]:.3f}-{interval[1]:.3f}" if interval else "too few rounds for an interval"
            )
            line += f" ({spread}; faster in {sum(r < 1.0 for r in ratios)} of {len(ratios)} rounds)"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
