"""pytest-benchmark cases for the scheduler through its Python API, Rust and reference side by side.

By default (``--benchmark-disable`` is in pyproject's addopts) each case runs once, as a smoke test (a few
seconds in all). To measure::

    pytest benches --benchmark-enable                       # short workloads + decode steps
    pytest benches --benchmark-enable -m slow               # the full-size workloads a-e (minutes)
    pytest benches --benchmark-enable --benchmark-json=bench-results/pytest-bench.json

Each workload case replays a recorded run: the fake model's outputs are computed once, up front (the schedule
is deterministic), so the timed loop holds only ``add_request``/``schedule``/``update_from_output``. The
per-step numbers quoted in the README come from ``kvsched bench``, which times each call on its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import pytest
from kvsched.bench.harness import (
    ImplUnavailableError,
    RecordedRun,
    make_driver,
    make_scheduler,
    record_run,
    replay_run,
)
from kvsched.bench.workloads import generate, get_scenario, req_id
from kvsched.config import SchedulerConfig

IMPLS = ("rust", "reference")

# Smoke-sized scales: every workload keeps its shape (a/b: 256 decode steps after the prefill; c-e: Poisson
# arrivals, shared prefixes, preemption) with few requests.
SHORT_SCALES = {"a": 0.05, "b": 0.02, "c": 0.01, "d": 0.01, "e": 0.01}


def _require(impl: str) -> None:
    try:
        make_driver(impl, SchedulerConfig(num_blocks=1024))
    except ImplUnavailableError as exc:
        pytest.skip(str(exc))


@functools.cache
def _recorded(impl: str, name: str, scale: float) -> RecordedRun:
    return record_run(impl, generate(get_scenario(name).scaled(scale)))


def _bench_workload(benchmark: Any, impl: str, name: str, scale: float, rounds: int) -> None:
    _require(impl)
    recorded = _recorded(impl, name, scale)
    benchmark.group = f"workload {name} (scale {scale})"
    benchmark.extra_info["steps"] = recorded.num_steps

    def setup() -> tuple[tuple[Any, RecordedRun], dict[str, Any]]:
        return (make_driver(impl, recorded.config), recorded), {}

    steps = benchmark.pedantic(replay_run, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    assert steps == recorded.num_steps


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(SHORT_SCALES))
def test_workload_short(benchmark: Any, impl: str, name: str) -> None:
    _bench_workload(benchmark, impl, name, SHORT_SCALES[name], rounds=5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(SHORT_SCALES))
def test_workload_full(benchmark: Any, impl: str, name: str) -> None:
    _bench_workload(benchmark, impl, name, 1.0, rounds=3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_running", [64, 256, 1024])
def test_decode_step(benchmark: Any, impl: str, num_running: int) -> None:
    """One schedule() + update_from_output() with ``num_running`` requests all decoding."""
    _require(impl)
    prompt_len = 32
    config = SchedulerConfig(
        num_blocks=num_running * (8192 // 16) + 1,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(8192, num_running),
        prefix_hash_seed=0,
    )
    sched = make_scheduler(impl, config)
    rng = np.random.Generator(np.random.PCG64(0))
    for i in range(num_running):
        sched.add_request(req_id(i), rng.integers(3, 32000, size=prompt_len, dtype=np.int32))
    # Prefill everything (partial prefill chunks receive no token).
    values = np.full(num_running, 7, dtype=np.int32)
    indptr = np.arange(num_running + 1, dtype=np.int32)
    while True:
        out = sched.schedule()
        n = len(out.req_ids)
        done = (out.num_computed_tokens + out.num_scheduled_tokens) >= prompt_len
        ptr = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(done, out=ptr[1:])
        sched.update_from_output(out, (values[: int(ptr[-1])], ptr))
        if out.total_num_scheduled_tokens == num_running and n == num_running:
            break
    sampled = (values, indptr)

    def step() -> None:
        sched.update_from_output(sched.schedule(), sampled)

    benchmark.group = f"decode step, {num_running} running"
    # Each round appends a token to every request; max_model_len (8192) leaves room for ~8000 rounds. The
    # reference is ~100x slower, so it gets fewer rounds.
    rounds = 2000 if impl == "rust" else 100
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=rounds // 40)


def _decoding_scheduler(num_running: int, prompt_len: int, stagger: bool = False) -> Any:
    """A Rust scheduler of workload a's config with ``num_running`` requests past their prefill, all decoding.
    With ``stagger``, request ``i``'s prompt is ``prompt_len + i % 16`` tokens long (block boundaries spread
    over the steps)."""
    config = dataclasses.replace(get_scenario("a").scheduler_config(), max_num_seqs=num_running)
    sched = make_scheduler("rust", config)
    rng = np.random.Generator(np.random.PCG64(1))
    lengths = {req_id(i): prompt_len + (i % 16 if stagger else 0) for i in range(num_running)}
    for rid, length in lengths.items():
        sched.add_request(rid, rng.integers(3, 32000, size=length, dtype=np.int32))
    while True:  # a request gets its first token once its whole prompt is computed
        out = sched.schedule()
        total = np.array([lengths[r] for r in out.req_ids], dtype=np.int64)
        done = (out.num_computed_tokens + out.num_scheduled_tokens) >= total
        ptr = np.zeros(len(out.req_ids) + 1, dtype=np.int64)
        np.cumsum(done, out=ptr[1:])
        sched.update_from_output(out, (np.full(int(ptr[-1]), 7, dtype=np.int64), ptr))
        if out.num_reqs == num_running and out.total_num_scheduled_tokens == num_running:
            return sched


@pytest.mark.parametrize("form", ["numpy", "lists"])
def test_update_sampled_form(benchmark: Any, form: str) -> None:
    """``update_from_output`` alone (``schedule()`` runs untimed in the setup) at workload a's shape (256
    running requests decoding, prompts of 512), with the sampled tokens as the ``(values, indptr)`` numpy pair
    or as vLLM's ``list[list[int]]``. The inputs are built once; only their conversion and the update are timed."""
    num_running = 256
    sched = _decoding_scheduler(num_running, prompt_len=512)
    sampled: Any
    if form == "numpy":
        sampled = (np.full(num_running, 7, dtype=np.int64), np.arange(num_running + 1, dtype=np.int64))
    else:
        sampled = [[7] for _ in range(num_running)]

    def setup() -> tuple[tuple[Any, Any], dict[str, Any]]:
        return (sched.schedule(), sampled), {}

    benchmark.group = f"update_from_output, {num_running} running: sampled tokens as numpy vs lists"
    # Each round appends a token to every request: 1000 rounds stay well inside max_model_len (8192).
    benchmark.pedantic(sched.update_from_output, setup=setup, rounds=1000, iterations=1, warmup_rounds=50)
    assert sched.stats().num_running_reqs == num_running


@pytest.mark.parametrize("which", ["plain", "boundary"])
def test_block_boundary_steps(benchmark: Any, which: str) -> None:
    """Three consecutive steps (``schedule()`` + ``update_from_output()``) of 256 requests decoding in lock-step
    (64-token prompts, all prefilled in one step): the three at a block boundary (the update that fills a block
    and hashes it, the schedule that caches it, the schedule that allocates the next one), or three plain ones.
    Between rounds the scheduler is stepped, untimed, to the same phase of the next block (docs/benchmarks.md,
    "Block-boundary steps"; the criterion case ``boundary_step`` times the same in Rust)."""
    n, plen, rounds = 256, 64, 100
    config = dataclasses.replace(get_scenario("a").scheduler_config(), max_num_seqs=n, max_num_batched_tokens=n * plen)
    sched = make_scheduler("rust", config)
    bs = config.block_size
    rng = np.random.Generator(np.random.PCG64(1))
    for i in range(n):
        sched.add_request(req_id(i), rng.integers(3, 32000, size=plen, dtype=np.int32))
    sampled = (np.full(n, 7, dtype=np.int64), np.arange(n + 1, dtype=np.int64))
    first = req_id(0)
    # The step whose update fills a block starts with bs - 2 tokens computed past a block boundary.
    start = bs - 2 if which == "boundary" else bs // 4

    def step() -> None:
        sched.update_from_output(sched.schedule(), sampled)

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        while sched.get_num_computed_tokens(first) % bs != start:
            step()
        return (), {}

    def three() -> None:
        step()
        step()
        step()

    benchmark.group = f"block-boundary steps, {n} requests in lock-step (3 steps)"
    benchmark.pedantic(three, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)
    st = sched.stats()
    assert st.num_running_reqs == n and st.num_preemptions == 0


@pytest.mark.parametrize("cold_mb", [0, 8])
def test_decode_step_cold(benchmark: Any, cold_mb: int) -> None:
    """One ``schedule()`` + ``update_from_output()`` at workload a's shape (256 running requests decoding), in
    the tight loop (0) or with ``cold_mb`` MiB of other memory touched before each step, outside the timed region
    (``kvsched bench --cold``): in an engine the model runner evicts the scheduler's state between steps."""
    num_running = 256
    sched = _decoding_scheduler(num_running, prompt_len=512)
    sampled = (np.full(num_running, 7, dtype=np.int64), np.arange(num_running + 1, dtype=np.int64))
    cold_lines = np.zeros(cold_mb * 2**20, dtype=np.uint8)[::64]  # one element per cache line

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        np.add(cold_lines, 1, out=cold_lines)
        return (), {}

    def step() -> None:
        sched.update_from_output(sched.schedule(), sampled)

    benchmark.group = f"decode step, {num_running} running: tight vs cold caches"
    benchmark.extra_info["cold_mb"] = cold_mb
    benchmark.pedantic(step, setup=setup, rounds=1000, iterations=1, warmup_rounds=50)
    assert sched.stats().num_running_reqs == num_running


@pytest.mark.parametrize("batch", ["same", "one_replaced"])
def test_decode_step_batch_change(benchmark: Any, batch: str) -> None:
    """One ``schedule()`` + ``update_from_output()`` of 256 running requests whose batch is the same as the
    previous step's (``same``: 256 decodes), or changed (``one_replaced``: before the step, untimed, the oldest
    request is aborted and a new one of 8 prompt tokens added; the step decodes 255 and prefills the new one).
    Most steps of a serving mix change the batch (c: 1,512 of 2,550); the outputs name their requests through
    the id table shared with the scheduler, so a changed batch should cost about a steady one
    (docs/benchmarks.md, "Design choices and what they are worth")."""
    n, rounds = 256, 500
    sched = _decoding_scheduler(n, prompt_len=64, stagger=True)
    rng = np.random.Generator(np.random.PCG64(2))
    live = [req_id(i) for i in range(n)]
    serial = n

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        nonlocal serial
        if batch == "one_replaced":
            sched.abort_requests([live.pop(0)])
            live.append(req_id(serial))
            sched.add_request(live[-1], rng.integers(3, 32000, size=8, dtype=np.int32))
            serial += 1
        return (), {}

    # Both kinds of step schedule 256 requests, each of which samples a token (the new prompt fits in one step).
    sampled = (np.full(n, 7, dtype=np.int64), np.arange(n + 1, dtype=np.int64))

    def step() -> None:
        sched.update_from_output(sched.schedule(), sampled)

    benchmark.group = f"decode step, {n} running: same batch vs one request replaced"
    benchmark.pedantic(step, setup=setup, rounds=rounds, iterations=1, warmup_rounds=16)
    st = sched.stats()
    assert st.num_running_reqs == n and st.num_preemptions == 0


@pytest.mark.parametrize("layout", ["lockstep", "staggered"])
def test_decode_step_staggered(benchmark: Any, layout: str) -> None:
    """One ``schedule()`` + ``update_from_output()`` of 256 requests decoding, whose block boundaries fall in
    the same step (``lockstep``: 64-token prompts; one step in 16 allocates and one caches a block for every
    request) or spread over the steps (``staggered``: prompts of 64 + i % 16 tokens; every step an eighth of the
    requests do block work, as in a serving mix). Compare the means: the lock-step median leaves its block work
    out (docs/benchmarks.md, "Block-boundary steps"; ``scripts/dev/api_decode_loop.py 256 32 1500 0 1``)."""
    n, rounds = 256, 800
    sched = _decoding_scheduler(n, prompt_len=64, stagger=layout == "staggered")
    sampled = (np.full(n, 7, dtype=np.int64), np.arange(n + 1, dtype=np.int64))

    def step() -> None:
        sched.update_from_output(sched.schedule(), sampled)

    benchmark.group = f"decode step, {n} running: block boundaries in lock-step vs staggered"
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=16)
    st = sched.stats()
    assert st.num_running_reqs == n and st.num_preemptions == 0
