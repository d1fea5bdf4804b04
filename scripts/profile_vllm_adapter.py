"""Where the time of ``kvsched.vllm.Scheduler`` goes on a bench workload (needs vLLM importable).

Replays one ``kvsched bench`` workload through the adapter exactly as ``kvsched bench --impl vllm-adapter`` does
(``--async-scheduling``: ``--impl vllm-adapter-async``; same driver, same loop, warm-up, ``gc.freeze``), with
timers around the parts that are not the adapter's own Python: the Rust core's calls (``schedule()`` with the
``num_output_tokens`` column it hands out, ``update_from_output()``), the block hashes of a request whose new
token fills a block (vLLM's own scheduler hashes it too): with vLLM's default SHA-256 the core's
``_extend_block_hashes``, which reads the hash the core keyed the block with (the core computes it in its
``update_from_output()``), for a block without extra keys, the core's ``vllm_sha256_block_hashes`` for a salted
request's, vLLM's block hasher otherwise, and ``make_stats()`` (vLLM's
``SchedulerStats``, every step with stats on). Everything else in ``schedule()`` and ``update_from_output()`` is
the adapter's Python (mirroring vLLM's request fields, building vLLM's ``SchedulerOutput`` and one
``EngineCoreOutput`` per request). Prints per-step medians over the steps with the workload's most common number
of scheduled requests (the steady state), and over all steps.

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH=python python scripts/profile_vllm_adapter.py -w a

On a shared machine wall-clock time moves with the load; instruction counts do not. With ``--instructions``, run
under callgrind, the script replays the workload once and wraps steps ``--steps A:B`` (default the steady state of
workload a) so that callgrind collects only their ``schedule()`` (inside ``functools.reduce``) and
``update_from_output()`` (inside ``sorted``); it switches callgrind's instrumentation on itself after the imports
and the warm-up (which would otherwise take most of the run), with ``callgrind_control``:

    PYTHONHASHSEED=0 VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH=python valgrind --tool=callgrind \
        --instr-atstart=no --collect-atstart=no --toggle-collect=functools_reduce --toggle-collect=builtin_sorted \
        --callgrind-out-file=adapter.cg python scripts/profile_vllm_adapter.py -w a --instructions
    callgrind_annotate --inclusive=yes adapter.cg | grep -E "functools_reduce|builtin_sorted|Struct_vectorcall"

Divide the inclusive counts of ``functools_reduce`` (``schedule()``) and ``builtin_sorted``
(``update_from_output()``) by the number of wrapped steps the script prints. Keep ``PYTHONHASHSEED`` fixed when
comparing two versions: with Python's random string hashing, two runs of the same code differed by 2.5% (workload c)
(sets and dicts of request ids iterate and probe differently). Callgrind's CPU has no SHA extensions, so SHA-256
block hashing counts for more instructions there than it takes time on a CPU with them.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import kvsched.vllm.scheduler as adapter_module
from kvsched.bench import harness
from kvsched.bench.workloads import Workload, generate, get_scenario


class Timer:
    """Accumulates the nanoseconds spent in wrapped calls; ``take()`` returns and resets the sum."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        perf = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += perf() - t0
                self.calls += 1

        return timed

    def take(self) -> int:
        ns, self.ns = self.ns, 0
        return ns


core_hash = adapter_module.vllm_sha256_block_hashes


def run_once(config: Any, wl: Workload, impl: str) -> np.ndarray:
    """One timed run; rows of (scheduled requests, schedule ns, core schedule ns, update ns, core update ns,
    vLLM hasher ns, core block hash ns, make_stats ns), one per step."""
    driver: Any = harness.make_driver(impl, config)
    sched = driver._sched
    core = sched._core
    t_core_sched, t_core_upd, t_hash, t_sched, t_upd = Timer(), Timer(), Timer(), Timer(), Timer()
    t_core_hash, t_stats = Timer(), Timer()
    core.schedule = t_core_sched.wrap(core.schedule)
    core.step_num_output_tokens = t_core_sched.wrap(core.step_num_output_tokens)
    core.update_from_output = t_core_upd.wrap(core.update_from_output)
    sched.make_stats = t_stats.wrap(sched.make_stats)
    if driver._block_hasher is not None:
        # The timed wrapper is a new object: tell the adapter whether the core may hash for it, as it would have
        # decided for vLLM's hasher itself.
        hasher = driver._block_hasher
        driver._block_hasher = t_hash.wrap(hasher)
        sched._hasher_in_core[driver._block_hasher] = adapter_module._is_vllm_sha256_hasher(
            hasher, sched.hash_block_size
        )
    adapter_module.vllm_sha256_block_hashes = t_core_hash.wrap(core_hash)
    core._extend_block_hashes = t_core_hash.wrap(core._extend_block_hashes)
    rows: list[tuple[int, ...]] = []
    schedule, update = t_sched.wrap(sched.schedule), t_upd.wrap(sched.update_from_output)
    num_sched = [0]

    def timed_schedule() -> Any:
        t_hash.take()  # prompt hashing in add_request is not part of the step
        t_core_hash.take()
        out = schedule()
        num_sched[0] = len(out.num_scheduled_tokens)
        return out

    def timed_update(out: Any, mro: Any) -> Any:
        res = update(out, mro)
        rows.append(
            (
                num_sched[0],
                t_sched.take(),
                t_core_sched.take(),
                t_upd.take(),
                t_core_upd.take(),
                t_hash.take(),
                t_core_hash.take(),
                t_stats.take(),
            )
        )
        return res

    driver.schedule_fn = lambda: timed_schedule
    driver.update_fn = lambda: timed_update
    gc.collect()
    gc.freeze()
    try:
        harness._loop(driver, wl, max_steps=None, record=True)
    finally:
        gc.unfreeze()
        adapter_module.vllm_sha256_block_hashes = core_hash
    return np.array(rows, dtype=np.int64)


def count_instructions(config: Any, wl: Workload, impl: str, first: int, end: int) -> None:
    """One run with steps ``[first, end)`` wrapped for callgrind's ``--toggle-collect`` (see the module doc)."""
    import functools
    import subprocess

    driver: Any = harness.make_driver(impl, config)
    sched = driver._sched
    schedule, update = sched.schedule, sched.update_from_output
    step = [0]

    def wrapped_schedule() -> Any:
        step[0] += 1
        if first <= step[0] - 1 < end:
            return functools.reduce(lambda _acc, _x: schedule(), (0,), None)
        return schedule()

    def wrapped_update(out: Any, mro: Any) -> Any:
        if first <= step[0] - 1 < end:
            box: list[Any] = []

            def key(_x: int) -> int:
                box.append(update(out, mro))
                return 0

            sorted((0,), key=key)
            return box[0]
        return update(out, mro)

    driver.schedule_fn = lambda: wrapped_schedule
    driver.update_fn = lambda: wrapped_update
    # Instrumentation on from here (callgrind answers while this process runs, hence the busy wait).
    proc = subprocess.Popen(["callgrind_control", "-i", "on", str(os.getpid())], stdout=subprocess.DEVNULL)
    while proc.poll() is None:
        sum(range(10_000))
    if proc.returncode:
        raise SystemExit("callgrind_control failed: run this under valgrind --tool=callgrind (see the module doc)")
    gc.collect()
    gc.freeze()
    try:
        harness._loop(driver, wl, max_steps=end, record=False)
    finally:
        gc.unfreeze()
    mode = "async" if impl.endswith("-async") else "sync"
    print(
        f"workload {wl.scenario.name} ({mode}): steps {first} to {min(end, step[0]) - 1} wrapped "
        f"({max(0, min(end, step[0]) - first)} steps)"
    )


def interface_floor(n: int, steps: int, async_scheduling: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ns of the Python work vLLM's scheduler interface itself asks of any scheduler in steady decoding
    with ``n`` requests (one token each), with none of the adapter's own bookkeeping: ``schedule()``'s
    ``CachedRequestData`` and ``SchedulerOutput`` (computed and output counts as lists, the scheduled-tokens dict);
    ``update_from_output()``'s append of each sampled token to the request's output and token lists, one
    ``EngineCoreOutput`` per request and the ``EngineCoreOutputs``. Each with the cheapest Python that does it.
    The ``Request`` counters vLLM's ``_update_after_schedule`` and ``update_from_output`` move (computed,
    in-flight, with async scheduling the output placeholders) are not in it: a scheduler can keep them as one
    shared offset per step (the adapter's steady decoding cohorts). Real vLLM objects; the decisions, block
    hashing and stats are not in it (the profile times them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import Request

    reqs = [
        Request(
            f"req-{i}",
            prompt_token_ids=list(range(128)),
            sampling_params=SamplingParams(max_tokens=4096),
            pooling_params=None,
        )
        for i in range(n)
    ]
    ids = [r.request_id for r in reqs]
    outs, alls = [r._output_token_ids for r in reqs], [r._all_token_ids for r in reqs]
    computed = np.full(n, 128, dtype=np.int32)
    ones = np.ones(n, dtype=np.int32)
    template = dict.fromkeys(ids, 1)
    tokens = np.full(n, 7, dtype=np.int64)
    append = list.append
    sched_ns, upd_ns = np.empty(steps, dtype=np.int64), np.empty(steps, dtype=np.int64)
    perf = time.perf_counter_ns
    gc.collect()
    gc.freeze()
    try:
        for step in range(steps):
            t0 = perf()
            cached = CachedRequestData(
                req_ids=ids.copy(),
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=[None] * n,
                num_computed_tokens=computed.tolist(),
                num_output_tokens=(computed - 128).tolist(),
            )
            SchedulerOutput(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=cached,
                num_scheduled_tokens=template.copy(),
                total_num_scheduled_tokens=n,
                scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={},
                finished_req_ids=set(),
                free_encoder_mm_hashes=[],
                preempted_req_ids=set(),
            )
            t1 = perf()
            sampled = tokens.tolist()
            rows = [[t] for t in sampled]  # the runner's sampled_token_ids, built outside the timed region
            t2 = perf()
            deque(map(append, outs, sampled), 0)
            deque(map(append, alls, sampled), 0)
            EngineCoreOutputs(outputs=list(map(EngineCoreOutput, ids, rows)))
            t3 = perf()
            computed += ones
            sched_ns[step], upd_ns[step] = t1 - t0, t3 - t2
    finally:
        gc.unfreeze()
    return sched_ns, upd_ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-w", "--workload", default="a")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the one with the lowest median total is shown")
    ap.add_argument("--async-scheduling", action="store_true", help="asynchronous scheduling (vllm-adapter-async)")
    ap.add_argument(
        "--instructions", action="store_true", help="count instructions under callgrind instead (see the module doc)"
    )
    ap.add_argument("--steps", default="100:160", help="with --instructions: the steps to count, A:B (default 100:160)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the Python that vLLM's interface itself asks of any scheduler at the steady state's batch "
        "size (see interface_floor), and add the profile's core, hashing and stats parts to it",
    )
    args = ap.parse_args()

    impl = "vllm-adapter-async" if args.async_scheduling else "vllm-adapter"
    wl = generate(get_scenario(args.workload))
    config = wl.scenario.scheduler_config()
    harness._loop(harness.make_driver(impl, config), wl, max_steps=50, record=False)
    if args.instructions:
        first, end = (int(v) for v in args.steps.split(":"))
        count_instructions(config, wl, impl, first, end)
        return
    best: np.ndarray | None = None
    for _ in range(args.repeat):
        data = run_once(config, wl, impl)
        if best is None or np.median(data[:, 1] + data[:, 3]) < np.median(best[:, 1] + best[:, 3]):
            best = data
    assert best is not None
    data = best
    counts = np.bincount(data[:, 0])
    steady = data[data[:, 0] == counts.argmax()]
    for label, sel in ((f"steady state ({counts.argmax()} scheduled, {len(steady)} steps)", steady), ("all", data)):
        sched_ns, core_s, upd_ns, core_u, hash_ns, core_hash_ns, stats_ns = (sel[:, i] for i in range(1, 8))
        parts = [
            ("schedule(): total", sched_ns),
            ("  Rust core (schedule, num_output_tokens)", core_s),
            ("  adapter Python", sched_ns - core_s),
            ("update_from_output(): total", upd_ns),
            ("  Rust core update_from_output()", core_u),
            ("  vLLM block hasher (blocks that filled)", hash_ns),
            ("  core's block hashes (same)", core_hash_ns),
            ("  make_stats() (SchedulerStats)", stats_ns),
            ("  adapter Python", upd_ns - core_u - hash_ns - core_hash_ns - stats_ns),
            ("schedule + update", sched_ns + upd_ns),
        ]
        mode = "async" if args.async_scheduling else "sync"
        print(f"workload {args.workload} ({mode}), {label}: median µs per step")
        for name, ns in parts:
            print(f"  {name:<42} {np.median(ns) / 1e3:8.1f}")
    if args.floor:
        sched_ns, core_s, upd_ns, core_u, hash_ns, core_hash_ns, stats_ns = (steady[:, i] for i in range(1, 8))
        best_floor: tuple[np.ndarray, np.ndarray] | None = None
        for _ in range(args.repeat):
            f_s, f_u = interface_floor(int(counts.argmax()), 240, args.async_scheduling)
            if best_floor is None or np.median(f_s + f_u) < np.median(best_floor[0] + best_floor[1]):
                best_floor = (f_s, f_u)
        assert best_floor is not None
        f_sched, f_upd = (float(np.median(a)) / 1e3 for a in best_floor)
        others = float(np.median(core_s) + np.median(core_u) + np.median(hash_ns + core_hash_ns) + np.median(stats_ns))
        others /= 1e3
        print(f"vLLM's interface alone at {counts.argmax()} requests ({mode}): median µs per step")
        print(f"  {'schedule(): CachedRequestData, SchedulerOutput':<42} {f_sched:8.1f}")
        print(f"  {'update(): token appends, EngineCoreOutputs':<42} {f_upd:8.1f}")
        print(f"  {'+ core, block hashing, stats (profiled)':<42} {others:8.1f}")
        print(f"  {'floor for any scheduler behind vLLM':<42} {f_sched + f_upd + others:8.1f}")


if __name__ == "__main__":
    main()
