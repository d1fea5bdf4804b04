"""Per-step cost of pure decoding through the Python API, with nothing else between steps.

``n`` requests with distinct ``prompt_len``-token prompts are prefilled, then ``steps`` decode steps are timed:
``schedule()``, then ``update_from_output()`` with one sampled token per request as an int64 ``(values, indptr)``
pair. Prints the medians of both calls and of the step, and the step's p99, in µs.

    python scripts/dev/api_decode_loop.py [N] [PROMPT_LEN] [STEPS] [COLD_MB] [STAGGER]    # defaults: 256 32 1500 0 0

With ``COLD_MB`` > 0 a buffer of that many MB is written (one byte per cache line) before each step, outside the
timed region, as ``kvsched bench --cold`` does: the engine's other work between two steps. With ``STAGGER`` 1 the
prompts are ``PROMPT_LEN + i % 16`` tokens long, so the requests reach their block boundaries in different steps
(an eighth of them allocate or cache a block in every step, as in a serving mix) instead of all in the same step.

Pin it for a steadier reading (``taskset -c 1``) and alternate builds run by run when comparing two of them.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from kvsched import Scheduler, SchedulerConfig


def main() -> None:
    args = [int(a) for a in sys.argv[1:6]]
    n, prompt_len, steps, cold_mb, stagger = args + [256, 32, 1500, 0, 0][len(args) :]
    cold_lines = np.zeros(cold_mb << 20, dtype=np.uint8)[::64] if cold_mb > 0 else None
    # Requests prefilled first decode for the steps the others still prefill: room for those tokens too.
    extra = n * (prompt_len + 16) // 8192 + 8
    blocks_per_request = (prompt_len + steps + extra + 2) // 16 + 2
    sched = Scheduler(
        SchedulerConfig(
            block_size=16,
            num_blocks=n * blocks_per_request + 16,
            max_num_seqs=n,
            max_model_len=prompt_len + steps + extra + 16,
            max_num_batched_tokens=8192,
        )
    )
    prompt_lens = {}
    for i in range(n):
        base = 1 + i * (prompt_len + 16)
        prompt_lens[f"r{i}"] = length = prompt_len + (i % 16 if stagger else 0)
        sched.add_request(f"r{i}", list(range(base, base + length)), max_tokens=steps + extra, ignore_eos=True)
    values = np.full(n, 7, dtype=np.int64)
    indptr = np.arange(n + 1, dtype=np.int64)
    while True:  # prefill (chunked by the token budget) until every request decodes
        out = sched.schedule()
        lengths = np.array([prompt_lens[r] for r in out.req_ids], dtype=np.int64)
        done = (out.num_computed_tokens + out.num_scheduled_tokens) >= lengths
        sched.update_from_output(out, [[7] if d else [] for d in done])
        if len(out.req_ids) == n and bool((out.num_scheduled_tokens == 1).all()):
            break
    clock = time.perf_counter_ns
    sched_ns, update_ns = np.empty(steps), np.empty(steps)
    for k in range(steps):
        if cold_lines is not None:
            cold_lines += 1
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        sched.update_from_output(out, (values, indptr))
        t2 = clock()
        sched_ns[k], update_ns[k] = t1 - t0, t2 - t1
    step = (sched_ns + update_ns) / 1000
    print(
        f"n={n} prompt_len={prompt_len} steps={steps} cold_mb={cold_mb} stagger={stagger}: "
        f"schedule {np.median(sched_ns) / 1000:.2f} update {np.median(update_ns) / 1000:.2f} "
        f"step {np.median(step):.2f} p99 {np.percentile(step, 99):.2f} µs"
    )


if __name__ == "__main__":
    main()
