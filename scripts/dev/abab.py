"""kvsched's step cost when other Python work runs between its steps: the pure-Python reference scheduler.

Workload a's requests (256 prompts of 512 tokens, 256 tokens each; ``kvsched bench -w a``) go to the Rust
scheduler and to the reference. The Rust scheduler's steps are timed (``schedule()`` + ``update_from_output()``
with one int64 ``(values, indptr)`` pair); in ``abab`` mode the reference runs one step of the same trace
between two Rust steps, outside the timed region, as a model runner's Python would; in ``alone`` mode it does
not run. Prints the Rust step's median and p99 in µs, over all steps (prefill included) and over decode-only
steps.

    python scripts/dev/abab.py [MODE] [RUNS]     # MODE: abab (default) or alone; best median of RUNS (default 3)

Pin it (``taskset -c 1``) and alternate the modes run by run when comparing them.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from kvsched.bench.harness import make_scheduler
from kvsched.bench.workloads import generate, get_scenario, req_id


def sampled_for(out: Any, known: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """One token for each entry whose prompt and outputs so far are all computed after the step."""
    ids = out.req_ids
    total = np.fromiter((known[r] for r in ids), dtype=np.int64, count=len(ids))
    done = (np.asarray(out.num_computed_tokens) + np.asarray(out.num_scheduled_tokens)) >= total
    indptr = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(done, out=indptr[1:])
    for r, d in zip(ids, done.tolist(), strict=True):
        if d:
            known[r] += 1
    return np.full(int(indptr[-1]), 7, dtype=np.int64), indptr


def run(mode: str) -> tuple[np.ndarray, np.ndarray]:
    workload = generate(get_scenario("a"))
    config = get_scenario("a").scheduler_config()
    rust, ref = make_scheduler("rust", config), make_scheduler("reference", config)
    known_rust: dict[str, int] = {}
    known_ref: dict[str, int] = {}
    for r in workload.requests:
        rid = req_id(r.idx)
        for sched, known in ((rust, known_rust), (ref, known_ref)):
            sched.add_request(rid, r.prompt_token_ids, max_tokens=r.max_tokens, ignore_eos=True)
            known[rid] = len(r.prompt_token_ids)
    clock = time.perf_counter_ns
    step_ns: list[int] = []
    decode_only: list[bool] = []
    while rust.has_unfinished_requests():
        if mode == "abab" and ref.has_unfinished_requests():
            out_ref = ref.schedule()
            ref.update_from_output(out_ref, sampled_for(out_ref, known_ref))
        t0 = clock()
        out = rust.schedule()
        t1 = clock()
        sampled = sampled_for(out, known_rust)  # outside the timed region
        t2 = clock()
        rust.update_from_output(out, sampled)
        t3 = clock()
        step_ns.append((t1 - t0) + (t3 - t2))
        decode_only.append(out.total_num_scheduled_tokens == out.num_reqs)
    return np.asarray(step_ns) / 1000, np.asarray(decode_only)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "abab"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if mode not in ("abab", "alone"):
        raise SystemExit(f"MODE must be abab or alone, got {mode!r}")
    best: tuple[np.ndarray, np.ndarray] | None = None
    for _ in range(runs):
        t, dec = run(mode)
        if best is None or np.median(t) < np.median(best[0]):
            best = (t, dec)
    assert best is not None
    t, dec = best
    print(
        f"mode={mode} steps={len(t)}: median {np.median(t):.2f} p99 {np.percentile(t, 99):.2f} µs; "
        f"decode-only steps ({int(dec.sum())}): median {np.median(t[dec]):.2f} p99 {np.percentile(t[dec], 99):.2f} µs"
    )


if __name__ == "__main__":
    main()
