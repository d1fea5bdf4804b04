"""Memory and time of ``kvsched simulate`` against the length of the simulated traffic.

Runs the same command for each duration, each in its own process (so that its peak resident set is its own):

    kvsched simulate --rate 20 --duration <D> --prompt-len uniform:768:1280 --output-len uniform:100:300 \
        --set num_blocks=28000 --step-model llama-3.1-8b-h100 --no-progress --jobs 1 --out <tmp>

and prints, per duration, the peak RSS (``wait4``'s ``ru_maxrss``), the wall-clock and CPU time (user + system),
the number of requests and steps; then checks the targets of docs/simulator.md ("Memory and time at scale"):
an hour in at most 300 MB, a day in under 10 minutes and 1 GB on one core, and the peak of 1 h and 4 h within
10% of each other. ``--json FILE`` writes the measurements. Usage::

    python scripts/sim_scale_bench.py                   # 1 h, 4 h and 24 h (the day takes minutes)
    python scripts/sim_scale_bench.py --hours 1,4       # only the duration check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COMMAND = [
    "simulate", "--rate", "20", "--prompt-len", "uniform:768:1280", "--output-len", "uniform:100:300",
    "--set", "num_blocks=28000", "--step-model", "llama-3.1-8b-h100", "--no-progress", "--jobs", "1",
]  # fmt: skip


def measure(hours: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "kvsched.cli", *COMMAND, "--duration", f"{hours * 3600:g}", "--out", out]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        stdout = proc.stdout.read() if proc.stdout else ""
        stderr = proc.stderr.read() if proc.stderr else ""
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{stderr}")
        run = json.loads((Path(out) / "sim.json").read_text())["runs"][0]["overall"]
    return {
        "hours": hours,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "num_requests": run["num_requests"],
        "num_steps": run["num_steps"],
        "table": stdout.strip(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hours", default="1,4,24", help="comma-separated durations in hours (%(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = p.parse_args()
    hours = [float(h) for h in args.hours.split(",") if h.strip()]
    rows = []
    print(f"{'hours':>5} {'requests':>10} {'steps':>10} {'peak RSS':>10} {'wall':>9} {'CPU':>9}")
    for h in hours:
        r = measure(h)
        rows.append(r)
        print(
            f"{h:>5g} {r['num_requests']:>10,} {r['num_steps']:>10,} {r['peak_rss_mb']:>8.0f}MB "
            f"{r['wall_s']:>8.1f}s {r['cpu_s']:>8.1f}s",
            flush=True,
        )
    by = {r["hours"]: r for r in rows}
    checks = []
    if 1.0 in by:
        checks.append(("1 h peak RSS <= 300 MB", by[1.0]["peak_rss_mb"] <= 300))
    if 24.0 in by:
        checks.append(("24 h in < 10 min (CPU time)", by[24.0]["cpu_s"] < 600))
        checks.append(("24 h peak RSS < 1 GB", by[24.0]["peak_rss_mb"] < 1024))
    if 1.0 in by and 4.0 in by:
        ratio = by[4.0]["peak_rss_mb"] / by[1.0]["peak_rss_mb"]
        checks.append((f"4 h / 1 h peak RSS within 10% ({ratio:.3f})", abs(ratio - 1) <= 0.10))
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": COMMAND, "runs": rows, "checks": dict(checks)}, indent=1) + "\n")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
