"""Long add/schedule/update/abort loops on the Rust scheduler keep memory flat.

After a warm-up, the process RSS (``/proc/self/statm``, which sees Rust allocations), the number of Python
memory blocks (``sys.getallocatedblocks``) and the number of gc-tracked objects must stop growing. A leak of
one small object per step shows up as thousands of blocks or megabytes over the run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from conftest import requires_rust

pytestmark = requires_rust

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def churn(sched, steps: int, start: int, rng: np.random.Generator) -> int:
    """Keeps ~24 requests alive: add, schedule, prepare inputs, sample, update, sometimes abort."""
    i = start
    for _ in range(steps):
        while sched.num_unfinished_requests < 24:
            n = int(rng.integers(4, 40))
            max_tokens, priority = int(rng.integers(1, 12)), int(rng.integers(0, 3))
            sched.add_request(f"req-{i}", rng.integers(0, 50, n), max_tokens=max_tokens, eos_token_id=3,
                              priority=priority, arrival_time=float(i))  # fmt: skip
            i += 1
        out = sched.schedule()
        sched.prepare_model_inputs(out)
        n = len(out.req_ids)
        # The budget covers every prompt in one step, so each entry samples one token.
        res = sched.update_from_output(out, (rng.integers(0, 50, n).astype(np.int32), np.arange(n + 1)))
        done = set(res.finished_req_ids)  # (builds the lazy views too)
        if rng.random() < 0.05 and out.req_ids and out.req_ids[0] not in done:
            sched.abort_requests([out.req_ids[0]])
        sched.stats()
    return i


def new_scheduler():
    from kvsched import Scheduler

    return Scheduler(block_size=16, num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=4096,
                     max_model_len=128, policy="priority")  # fmt: skip


def run_flat_memory_check(steps: int, warmup: int, max_rss_growth: int, max_block_growth: int) -> None:
    rng = np.random.default_rng(0)
    sched = new_scheduler()
    i = churn(sched, warmup, 0, rng)
    gc.collect()
    rss0, blocks0, objs0 = rss_bytes(), sys.getallocatedblocks(), len(gc.get_objects())
    i = churn(sched, steps, i, rng)
    sched.check_invariants()
    gc.collect()
    rss1, blocks1, objs1 = rss_bytes(), sys.getallocatedblocks(), len(gc.get_objects())
    assert rss1 - rss0 <= max_rss_growth, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {steps} steps"
    assert blocks1 - blocks0 <= max_block_growth, f"Python blocks grew by {blocks1 - blocks0}"
    assert objs1 - objs0 <= max_block_growth, f"gc objects grew by {objs1 - objs0}"


def run_isolated(**kwargs: int) -> None:
    """`run_flat_memory_check` in a fresh interpreter: the process RSS of a full test run also moves with what
    earlier tests left behind (torch's threads, freed heap being reused), which once added 4.1 MiB here."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_memory import run_flat_memory_check
        run_flat_memory_check(**{kwargs!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_memory_is_flat_over_50k_steps() -> None:
    run_isolated(steps=50_000, warmup=5_000, max_rss_growth=4 * 2**20, max_block_growth=500)


def test_tracemalloc_sees_no_python_growth_per_step() -> None:
    rng = np.random.default_rng(1)
    sched = new_scheduler()
    i = churn(sched, 2_000, 0, rng)
    tracemalloc.start()
    try:
        churn(sched, 1_000, i, rng)
        gc.collect()
        base, _ = tracemalloc.get_traced_memory()
        churn(sched, 5_000, i + 10**6, rng)
        gc.collect()
        now, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert now - base < 64 * 1024, f"traced Python memory grew by {now - base} bytes over 5000 steps"


@pytest.mark.slow
def test_memory_is_flat_over_a_million_steps() -> None:
    run_isolated(steps=1_000_000, warmup=50_000, max_rss_growth=8 * 2**20, max_block_growth=500)
