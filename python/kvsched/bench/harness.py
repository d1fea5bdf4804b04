"""The benchmark loop: replay a workload through one scheduler implementation and time every step.

Each step: add the requests that arrive at this step (timed separately, per call), then

    t0  out = schedule()                      -- timed ("schedule")
    t1  read req_ids / the two count arrays   -- timed separately ("access"), not part of "total"
        fake model: sampled tokens (numpy)    -- not timed
    t2  update_from_output(out, sampled)      -- timed ("update")
    t3

"total" = schedule + update. Timing uses ``time.perf_counter_ns`` in this one process, after a warm-up run of
the same workload on a throw-away scheduler. The fake model gives one token to every scheduled request whose
prompt is complete (``num_computed + num_scheduled >= prompt + outputs so far``), found with vectorised numpy
on arrays indexed by the request's own index; requests finish by ``max_tokens`` only.

With ``cold_mb`` (``kvsched bench --cold MB``), a buffer of that many MiB is touched (one write per 64-byte
cache line) at the start of every step, before its arrivals and ``schedule()``, outside the timed region: in an
engine the model runner and Python run between two steps and evict the scheduler's state from the CPU caches,
which a tight loop never does.

An implementation is reached through a small :class:`Driver`; for kvsched's two schedulers (same API) the
timed calls are the schedulers' own bound methods, with nothing in between.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.config import DEFAULT_BLOCK_SIZE, SchedulerConfig

from .driver import Counters, Driver, ImplUnavailableError, IntArray
from .progress import Progress
from .workloads import VOCAB_SIZE, Scenario, TraceRequest, Workload, req_id, sampled_tokens

__all__ = [
    "IMPLS",
    "Counters",
    "Driver",
    "ImplUnavailableError",
    "RecordedRun",
    "RunResult",
    "ScalingPoint",
    "StalledError",
    "available_impls",
    "best_of",
    "make_driver",
    "make_scheduler",
    "record_run",
    "replay_run",
    "run_scaling",
    "run_workload",
]


class NativeDriver:
    """kvsched's own API (the Rust :class:`kvsched.Scheduler` or the Python reference)."""

    def __init__(self, impl: str, sched: Any) -> None:
        self.impl = impl
        self._sched = sched

    def add(self, req: TraceRequest, rid: str) -> None:
        self._sched.add_request(
            rid,
            req.prompt_token_ids,
            max_tokens=req.max_tokens,
            priority=req.priority,
            arrival_time=float(req.arrival_step),
            tenant=f"t{req.tenant}",
        )

    def schedule_fn(self) -> Callable[[], Any]:
        fn: Callable[[], Any] = self._sched.schedule
        return fn

    def update_fn(self) -> Callable[[Any, Any], Any]:
        fn: Callable[[Any, Any], Any] = self._sched.update_from_output
        return fn

    def view(self, out: Any) -> tuple[Sequence[str], npt.NDArray[Any], npt.NDArray[Any]]:
        return out.req_ids, out.num_scheduled_tokens, out.num_computed_tokens

    def model_output(self, out: Any, req_ids: Sequence[str], values: IntArray, indptr: IntArray) -> Any:
        return (values, indptr)

    def after_update(self, result: Any) -> None:
        pass

    def has_unfinished(self) -> bool:
        return bool(self._sched.has_unfinished_requests())

    def num_unfinished(self) -> int:
        return int(self._sched.num_unfinished_requests)

    def num_running(self) -> int:
        return int(self._sched.stats().num_running_reqs)

    def counters(self) -> Counters:
        s = self._sched.stats()
        return Counters(
            num_preemptions=int(s.num_preemptions),
            prefix_cache_queries=int(s.prefix_cache_queries),
            prefix_cache_hits=int(s.prefix_cache_hits),
            prefix_cache_preempted_queries=int(s.prefix_cache_preempted_queries),
            prefix_cache_preempted_hits=int(s.prefix_cache_preempted_hits),
            num_recomputed_tokens=int(s.num_recomputed_tokens),
            num_swapped_out_blocks=int(s.num_swapped_out_blocks),
            num_swapped_in_blocks=int(s.num_swapped_in_blocks),
            num_swap_fallbacks=int(s.num_swap_fallbacks),
        )


def make_scheduler(impl: str, config: SchedulerConfig) -> Any:
    """A bare scheduler with kvsched's API: ``"rust"`` (:class:`kvsched.Scheduler`) or ``"reference"``."""
    if impl == "rust":
        try:
            from kvsched import Scheduler
        except ImportError as exc:
            raise ImplUnavailableError(
                f"the Rust scheduler is not built/installed ({exc}); build it with `maturin develop --release` "
                "(pip install maturin)"
            ) from exc
        return Scheduler(config)
    if impl == "reference":
        try:
            from kvsched.reference import ReferenceScheduler
        except ImportError as exc:
            raise ImplUnavailableError(f"kvsched.reference is not available ({exc})") from exc
        return ReferenceScheduler(config)
    raise ValueError(f"{impl!r} has no kvsched-API scheduler; choose rust or reference")


def _rust_driver(config: SchedulerConfig) -> Driver:
    return NativeDriver("rust", make_scheduler("rust", config))


def _reference_driver(config: SchedulerConfig) -> Driver:
    return NativeDriver("reference", make_scheduler("reference", config))


def _vllm_driver(config: SchedulerConfig) -> Driver:
    from .vllm_impl import VllmDriver

    driver: Driver = VllmDriver(config, "vllm")
    return driver


def _vllm_adapter_driver(config: SchedulerConfig) -> Driver:
    from .vllm_impl import VllmDriver

    driver: Driver = VllmDriver(config, "vllm-adapter")
    return driver


IMPLS: dict[str, Callable[[SchedulerConfig], Driver]] = {
    "rust": _rust_driver,
    "reference": _reference_driver,
    "vllm": _vllm_driver,
    "vllm-adapter": _vllm_adapter_driver,
}


def make_driver(impl: str, config: SchedulerConfig) -> Driver:
    try:
        factory = IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}") from None
    return factory(config)


def available_impls() -> list[str]:
    """The implementations that load here (cheap probe with a tiny config)."""
    found = []
    for name in IMPLS:
        try:
            make_driver(name, SchedulerConfig(num_blocks=1024))
        except ImplUnavailableError:
            continue
        found.append(name)
    return found


# ----------------------------------------------------------------------------------------------------
# Memory


def _read_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to clear_refs). False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes(reset_ok: bool) -> int:
    hwm = _read_status_kib("VmHWM") if reset_ok else None
    if hwm is not None:
        return hwm * 1024
    # Fallback: the process's lifetime peak (ru_maxrss is KiB on Linux, bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# ----------------------------------------------------------------------------------------------------
# The loop


@dataclass
class RunResult:
    workload: str
    impl: str
    scenario: dict[str, Any]
    num_requests: int
    num_steps: int
    schedule_ns: IntArray
    update_ns: IntArray
    access_ns: IntArray
    num_scheduled_reqs: IntArray
    num_running_reqs: IntArray
    num_scheduled_tokens: IntArray
    add_request_ns: IntArray
    wall_s: float
    counters: Counters
    num_output_tokens: int
    peak_rss_bytes: int
    rss_before_bytes: int
    digest: str
    warmup_steps: int
    cold_mb: float = 0.0  # memory touched between steps (0: the tight loop)
    num_prompt_tokens_computed: int = 0
    completed: bool = False  # every request arrived and finished (not cut by max_steps)
    num_min_prompt_tokens: int = 0  # what an infinite prefix cache would compute (0 if not completed)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_ns(self) -> IntArray:
        return self.schedule_ns + self.update_ns


class StalledError(RuntimeError):
    """The scheduler stopped making progress (a bug in the implementation, or an impossible workload)."""


def _loop(
    driver: Driver,
    workload: Workload,
    *,
    max_steps: int | None,
    record: bool,
    progress: Progress | None = None,
    recorder: list[tuple[list[TraceRequest], Any]] | None = None,
    cold_bytes: int = 0,
) -> dict[str, Any]:
    requests = workload.requests
    # One element per cache line of a buffer of cold_bytes, written (outside the timed region) before each step.
    cold_lines = np.zeros(cold_bytes, dtype=np.uint8)[::64] if cold_bytes > 0 else None
    num_reqs = len(requests)
    size = workload.max_idx() + 1
    known_len = workload.prompt_lens()  # prompt + outputs so far, by request index
    prompt_len = workload.prompt_lens()
    num_out = np.zeros(size, dtype=np.int64)  # outputs so far, by request index
    ids = [req_id(r.idx) for r in requests]
    idx_of = {rid: r.idx for rid, r in zip(ids, requests, strict=True)}
    get_idx = idx_of.__getitem__
    arrivals = [r.arrival_step for r in requests]
    vocab = workload.vocab if workload.vocab else VOCAB_SIZE

    schedule = driver.schedule_fn()
    update = driver.update_fn()
    view = driver.view
    model_output = driver.model_output
    after_update = driver.after_update
    perf = time.perf_counter_ns
    cumsum = np.cumsum

    sched_ns: list[int] = []
    upd_ns: list[int] = []
    acc_ns: list[int] = []
    n_sched: list[int] = []
    n_run: list[int] = []
    n_tok: list[int] = []
    add_ns: list[int] = []
    digest = 0
    out_tokens = 0
    prompt_tokens = 0  # prompt positions computed, recomputation included
    idle_steps = 0

    step = 0
    nxt = 0
    num_steps = 0
    unfinished = False
    while True:
        if max_steps is not None and num_steps >= max_steps:
            break
        if not unfinished:
            if nxt >= num_reqs:
                break
            step = max(step, arrivals[nxt])  # nothing to do until the next arrival: skip idle steps
        if cold_lines is not None:
            cold_lines += 1
        first_new = nxt
        while nxt < num_reqs and arrivals[nxt] <= step:
            a0 = perf()
            driver.add(requests[nxt], ids[nxt])
            add_ns.append(perf() - a0)
            nxt += 1

        t0 = perf()
        out = schedule()
        t1 = perf()
        rids, nst, nct = view(out)
        t2 = perf()
        m = len(rids)
        if m:
            idx = np.fromiter(map(get_idx, rids), dtype=np.int64, count=m)
            complete = (nct + nst) >= known_len[idx]
            sel = idx[complete]
            pos = num_out[sel]
            values = sampled_tokens(sel, pos, vocab)
            indptr = np.zeros(m + 1, dtype=np.int64)
            cumsum(complete, out=indptr[1:])
            num_out[sel] = pos + 1
            known_len[sel] += 1
            out_tokens += len(sel)
            sampled = model_output(out, rids, values, indptr)
            tok = int(nst.sum())
            if record:
                pl = prompt_len[idx]
                prompt_tokens += int((np.minimum(nct + nst, pl) - np.minimum(nct, pl)).sum())
                # Order-independent within a step: implementations may list the same batch differently.
                order = np.argsort(idx, kind="stable")
                digest = zlib.crc32(nst[order].astype(np.int32).tobytes(), zlib.crc32(idx[order].tobytes(), digest))
        else:
            sampled = model_output(out, rids, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
            tok = 0
        if record:
            n_run.append(driver.num_running())
        if recorder is not None:
            recorder.append((requests[first_new:nxt], sampled))
        t3 = perf()
        res = update(out, sampled)
        t4 = perf()
        after_update(res)
        if record:
            sched_ns.append(t1 - t0)
            acc_ns.append(t2 - t1)
            upd_ns.append(t4 - t3)
            n_sched.append(m)
            n_tok.append(tok)
        num_steps += 1
        step += 1
        unfinished = driver.has_unfinished()

        if tok == 0 and nxt >= num_reqs:
            idle_steps += 1
            if idle_steps > 1000:
                raise StalledError(
                    f"{driver.impl} on workload {workload.name}: no token scheduled for 1000 steps "
                    f"with {driver.num_unfinished()} requests unfinished"
                )
        else:
            idle_steps = 0
        if progress is not None and (num_steps & 31) == 0:
            done = nxt - driver.num_unfinished()
            progress.update(done / max(num_reqs, 1), f"step {num_steps} running {n_run[-1] if n_run else 0}")

    return {
        "num_steps": num_steps,
        "schedule_ns": np.asarray(sched_ns, dtype=np.int64),
        "update_ns": np.asarray(upd_ns, dtype=np.int64),
        "access_ns": np.asarray(acc_ns, dtype=np.int64),
        "num_scheduled_reqs": np.asarray(n_sched, dtype=np.int64),
        "num_running_reqs": np.asarray(n_run, dtype=np.int64),
        "num_scheduled_tokens": np.asarray(n_tok, dtype=np.int64),
        "add_request_ns": np.asarray(add_ns, dtype=np.int64),
        "digest": f"{digest:08x}",
        "num_output_tokens": out_tokens,
        "num_prompt_tokens_computed": prompt_tokens,
        "completed": nxt >= num_reqs and not unfinished,
    }


def run_workload(
    impl: str,
    workload: Workload,
    *,
    warmup_steps: int = 50,
    max_steps: int | None = None,
    progress: Progress | None = None,
    cold_mb: float = 0.0,
) -> RunResult:
    """Replay ``workload`` through ``impl`` and time every step (see the module docstring); ``cold_mb`` MiB of
    other memory are touched between steps (0: the tight loop)."""
    if not cold_mb >= 0:
        raise ValueError(f"cold_mb must be >= 0, got {cold_mb}")
    cold_bytes = int(cold_mb * 2**20)
    config = workload.scenario.config
    if warmup_steps > 0:
        _loop(make_driver(impl, config), workload, max_steps=warmup_steps, record=False, cold_bytes=cold_bytes)
    driver = make_driver(impl, config)

    gc.collect()
    # Objects alive now (workload, warm-up leftovers) will never be garbage: keep the cyclic GC off them, as a
    # serving engine does after start-up. The GC stays enabled for whatever the scheduler allocates.
    gc.freeze()
    rss_before = (_read_status_kib("VmRSS") or 0) * 1024
    reset_ok = _reset_peak_rss()
    if progress is not None:
        progress.start(f"{workload.name} | {impl}")
    t0 = time.perf_counter()
    try:
        data = _loop(driver, workload, max_steps=max_steps, record=True, progress=progress, cold_bytes=cold_bytes)
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - t0
    peak = _peak_rss_bytes(reset_ok)
    counters = driver.counters()
    if progress is not None:
        progress.finish(f"({data['num_steps']} steps)")
    return RunResult(
        workload=workload.name,
        impl=impl,
        scenario=workload.scenario.to_dict(),
        num_requests=len(workload.requests),
        wall_s=wall,
        counters=counters,
        peak_rss_bytes=peak,
        rss_before_bytes=rss_before,
        warmup_steps=warmup_steps,
        cold_mb=cold_mb,
        num_min_prompt_tokens=workload.min_prompt_tokens_computed() if data["completed"] else 0,
        **data,
    )


def best_of(runs: Sequence[RunResult]) -> RunResult:
    """The run with the lowest median schedule+update (as timeit/pyperf take the best of several runs on a
    noisy machine); every run's medians are kept in ``extra["repeats"]``."""
    if not runs:
        raise ValueError("best_of needs at least one run")
    best = min(runs, key=lambda r: float(np.median(r.total_ns)))
    best.extra["repeats"] = [
        {
            "total_median_us": float(np.median(r.total_ns)) / 1000.0,
            "schedule_median_us": float(np.median(r.schedule_ns)) / 1000.0,
            "update_median_us": float(np.median(r.update_ns)) / 1000.0,
            "total_p99_us": float(np.percentile(r.total_ns, 99)) / 1000.0,
        }
        for r in runs
    ]
    return best


# ----------------------------------------------------------------------------------------------------
# Record once, replay many times (pytest-benchmark): the schedule is deterministic, so the fake model's
# outputs can be computed in a first run and fed back unchanged, leaving only scheduler calls in the loop.


@dataclass
class RecordedRun:
    impl: str
    config: SchedulerConfig
    steps: list[tuple[list[TraceRequest], Any]]  # per step: requests added before schedule(), model output

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def record_run(impl: str, workload: Workload) -> RecordedRun:
    """Run ``workload`` once through ``impl`` and keep, per step, the arrivals and the fake model's output."""
    config = workload.scenario.config
    steps: list[tuple[list[TraceRequest], Any]] = []
    _loop(make_driver(impl, config), workload, max_steps=None, record=False, recorder=steps)
    return RecordedRun(impl=impl, config=config, steps=steps)


def replay_run(driver: Driver, recorded: RecordedRun) -> int:
    """Feed a recorded run to a fresh scheduler of the same implementation; returns the number of steps.

    Only ``add_request``, ``schedule`` and ``update_from_output`` run in this loop.
    """
    add = driver.add
    schedule = driver.schedule_fn()
    update = driver.update_fn()
    after_update = driver.after_update
    for new, sampled in recorded.steps:
        for r in new:
            add(r, req_id(r.idx))
        after_update(update(schedule(), sampled))
    if driver.has_unfinished():
        raise StalledError(f"{driver.impl}: replay ended with unfinished requests (schedule diverged?)")
    return len(recorded.steps)


# ----------------------------------------------------------------------------------------------------
# Scaling: step cost against the number of running decode requests


@dataclass
class ScalingPoint:
    impl: str
    num_running: int
    num_steps: int
    schedule_ns: IntArray
    update_ns: IntArray

    @property
    def total_ns(self) -> IntArray:
        return self.schedule_ns + self.update_ns


def run_scaling(
    impl: str,
    sizes: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    *,
    num_steps: int = 200,
    prompt_len: int = 64,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Progress | None = None,
) -> list[ScalingPoint]:
    """Time ``num_steps`` pure-decode steps with exactly ``n`` running requests, for each ``n`` in ``sizes``.

    Requests get short random prompts and enough ``max_tokens`` to stay alive; timing starts once every
    request has finished its prefill, so each timed step schedules exactly ``n`` decode tokens.
    """
    points = []
    rng = np.random.Generator(np.random.PCG64(7))
    for n in sizes:
        warm = 8 + (n * prompt_len) // 8192  # steps to get every prompt through prefill, plus a margin
        total_len = prompt_len + 2 * (warm + num_steps) + 2
        blocks_per_req = -(-total_len // block_size)
        max_model_len = max(8192, total_len + 1)
        config = SchedulerConfig(
            block_size=block_size,
            # Room for every request, and for one request of max_model_len (the config requires it).
            num_blocks=max(n * blocks_per_req, -(-max_model_len // block_size)) + 2,
            max_num_seqs=n,
            max_num_batched_tokens=max(8192, n),
            max_model_len=max_model_len,
            prefix_hash_seed=0,
        )
        reqs = [
            TraceRequest(
                idx=i,
                arrival_step=0,
                priority=0,
                max_tokens=2 * (warm + num_steps),
                prompt_token_ids=rng.integers(3, VOCAB_SIZE, size=prompt_len, dtype=np.int32),
            )
            for i in range(n)
        ]
        scenario = Scenario(
            name=f"scaling-{n}",
            description="pure decode",
            num_requests=n,
            prompt_len=(prompt_len, prompt_len),
            output_len=(num_steps, num_steps),
            config=config,
        )
        workload = Workload(scenario=scenario, requests=reqs)
        if progress is not None:
            progress.start(f"scaling {impl} n={n}")
        driver = make_driver(impl, config)
        data = _loop(driver, workload, max_steps=warm + num_steps, record=True)
        decode = data["num_scheduled_tokens"] == n
        decode &= data["num_scheduled_reqs"] == n
        first = int(np.argmax(decode)) if decode.any() else len(decode)
        sel = slice(first, None)
        if not decode[sel].all():
            raise StalledError(f"scaling n={n}: steps after warm-up were not all pure decode")
        points.append(
            ScalingPoint(
                impl=impl,
                num_running=n,
                num_steps=int(decode[sel].sum()),
                schedule_ns=data["schedule_ns"][sel],
                update_ns=data["update_ns"][sel],
            )
        )
        if progress is not None:
            progress.finish()
    return points


def cpu_model_name() -> str:
    """``lscpu``'s model name (from /proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
