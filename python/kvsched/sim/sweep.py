"""Sweeps: every combination of request rate, policy and config values, each run on the same workload.

For each rate one workload is generated (same seed: the same requests, only their arrival times scaled) or the
trace is replayed with its arrival times scaled to that rate; every policy and config combination then runs
on that same workload, so differences between runs come from the scheduler's decisions alone.

Lengths must fit ``max_model_len``, checked before anything runs: a generated workload is drawn with its prompt
lengths clipped to the smallest ``max_model_len`` of the sweep minus one (so every run sees the same requests),
and refused when the mean prompt length does not fit at all (:func:`~kvsched.sim.workload.check_prompt_lengths`);
a trace with a prompt that does not fit is refused. The simulator caps each output length at
``max_model_len - prompt_len``. Each run's summary counts both (``num_clipped_prompts``, ``num_capped_outputs``).

Every run is one :class:`SweepPoint`, a small picklable description (the workload recipe at its rate, or the
scaled trace; the config; the step model) that :func:`run_point` turns into a :class:`RunOutput` (the summary and
the series of the figures; no per-request data). Points are independent and deterministic, so they run the same
anywhere: one after another here (``jobs=1``), in ``jobs`` worker processes, or as Ray tasks on a local or
existing Ray cluster (``ray=True``; the ``ray`` extra). The results are the same, run for run, in the sweep's
order; one progress bar follows all of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import SchedulerConfig
from .point import RunOutput, SweepPoint, WorkloadInfo, run_point
from .progress import SimProgress
from .simulator import make_config
from .steptime import StepTimeModel, check_step_sizes
from .workload import TraceFormatError, Workload, WorkloadSpec, check_prompt_lengths

__all__ = [
    "RunOutput",
    "SweepPoint",
    "WorkloadInfo",
    "check_trace_fits",
    "parse_set",
    "run_point",
    "run_sweep",
    "scale_trace",
    "sweep_configs",
    "sweep_points",
]


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_set(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["num_blocks=2000,4000", "max_num_seqs=128"]`` -> ``{"num_blocks": [2000, 4000], "max_num_seqs": [128]}``."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--set takes field=v1[,v2...], got {item!r}")
        if key == "policy":
            raise ValueError("give policies with --policies, not --set policy=")
        axes[key] = [_parse_value(v.strip()) for v in values.split(",") if v.strip()]
    return axes


def scale_trace(workload: Workload, rate: float) -> Workload:
    """The trace with arrival times scaled so that its mean request rate is ``rate``."""
    n = len(workload)
    span = float(workload.arrival_time[-1] - workload.arrival_time[0]) if n else 0.0
    if n < 2 or span <= 0:
        return workload
    factor = (n - 1) / span / rate
    return dataclasses.replace(workload, arrival_time=workload.arrival_time * factor)


def _combos(axes: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(axes[k] for k in keys))]


def sweep_configs(
    policies: Sequence[str], axes: dict[str, list[Any]] | None = None, base_config: dict[str, Any] | None = None
) -> list[SchedulerConfig]:
    """The scheduler config of every (policy, axis values) combination of a sweep, in run order; a bad field or
    value raises the config's own error (``InvalidConfigError``)."""
    base = dict(base_config or {})
    return [make_config({**base, **combo, "policy": policy}) for policy in policies for combo in _combos(axes or {})]


def check_trace_fits(workload: Workload, max_model_len: int) -> None:
    """Raise :class:`TraceFormatError` if a request of ``workload`` has no room for an output token within
    ``max_model_len`` (its prompt has ``max_model_len`` tokens or more); the message says how to fix it."""
    too_long = workload.prompt_len >= max_model_len
    if too_long.any():
        longest = int(workload.prompt_len.max())
        raise TraceFormatError(
            f"{int(too_long.sum())} request(s) of {workload.source} have prompt_len >= max_model_len "
            f"({max_model_len}), the longest {longest} tokens; raise it (--set max_model_len={longest + 1} or "
            f"more) or leave those requests out"
        )


def sweep_points(
    workload: WorkloadSpec | Workload,
    *,
    rates: Sequence[float | None] = (None,),
    policies: Sequence[str] = ("fcfs",),
    axes: dict[str, list[Any]] | None = None,
    base_config: dict[str, Any] | None = None,
    step_model: StepTimeModel,
    scheduler: str | Callable[..., Any] = "rust",
    horizon: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    window: float | None = None,
    prompt_buckets: Sequence[int] | None = None,
    class_ttft_slo: dict[int, float] | None = None,
    per_request_dir: str | Path | None = None,
    warm_step_sizes: Sequence[int] | None = None,
) -> list[SweepPoint]:
    """Every (rate, policy, axis values) combination as a :class:`SweepPoint`, in run order. Config errors (an
    unknown field, an unknown policy such as one this build does not have) and lengths that cannot fit
    ``max_model_len`` (see the module docstring) are raised here, before anything runs."""
    axes = axes or {}
    base = dict(base_config or {})
    warm = check_step_sizes(() if warm_step_sizes is None else warm_step_sizes, "warm step sizes")
    combos = _combos(axes)
    # Validate every config up front: a bad policy or field fails fast, with the config's own message.
    configs = sweep_configs(policies, axes, base)
    max_model_len = min(cfg.max_model_len for cfg in configs)
    if isinstance(workload, WorkloadSpec):
        check_prompt_lengths(workload, max_model_len)
    else:
        check_trace_fits(workload, max_model_len)
    points = []
    for rate in rates:
        w: WorkloadSpec | Workload
        if isinstance(workload, WorkloadSpec):
            w = workload if rate is None else dataclasses.replace(workload, rate=rate)
            run_rate: float | None = w.rate
        else:
            w = workload if rate is None else scale_trace(workload, rate)
            run_rate = rate if rate is not None else _mean_rate(w)
        for policy in policies:
            for combo in combos:
                run_id = "_".join(
                    [f"rate{run_rate:g}" if run_rate is not None else "trace", policy]
                    + [f"{k}{v}" for k, v in combo.items()]
                )
                csv_path = None if per_request_dir is None else str(Path(per_request_dir) / f"requests_{run_id}.csv")
                points.append(
                    SweepPoint(
                        run_id=run_id,
                        rate=run_rate,
                        policy=policy,
                        overrides=combo,
                        config={**base, **combo, "policy": policy},
                        workload=w,
                        max_model_len=max_model_len,
                        step_model=step_model,
                        scheduler=scheduler,
                        horizon=horizon,
                        slo_ttft=slo_ttft,
                        slo_tpot=slo_tpot,
                        window=window,
                        prompt_buckets=tuple(prompt_buckets) if prompt_buckets is not None else None,
                        class_ttft_slo=class_ttft_slo,
                        per_request_csv=csv_path,
                        warm_step_sizes=warm,
                    )
                )
    return points


def run_sweep(
    workload: WorkloadSpec | Workload,
    *,
    rates: Sequence[float | None] = (None,),
    policies: Sequence[str] = ("fcfs",),
    axes: dict[str, list[Any]] | None = None,
    base_config: dict[str, Any] | None = None,
    step_model: StepTimeModel,
    scheduler: str | Callable[..., Any] = "rust",
    horizon: float | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    window: float | None = None,
    prompt_buckets: Sequence[int] | None = None,
    class_ttft_slo: dict[int, float] | None = None,
    progress: bool = False,
    on_run: Callable[[RunOutput], None] | None = None,
    per_request_dir: str | Path | None = None,
    jobs: int = 1,
    ray: bool = False,
    ray_address: str | None = None,
    warm_step_sizes: Sequence[int] | None = None,
) -> list[RunOutput]:
    """Run every (rate, policy, axis values) combination; see the module docstring.

    ``rates`` entries of None mean "the workload's own rate". Errors in the configs or lengths are raised before
    anything runs (:func:`sweep_points`). ``progress``: one bar (or, off a terminal, one line per run) on stderr
    over all the runs (:class:`~kvsched.sim.progress.SimProgress`). ``per_request_dir``: write each run's
    per-request rows to ``requests_<run_id>.csv`` there, as its requests finish. ``jobs``: worker processes
    (1: in this process). ``ray``: run the points as Ray tasks (``ray.init(address=ray_address)`` unless Ray is
    initialised already; None starts a local cluster or joins the one ``RAY_ADDRESS`` names). The outputs come
    back in the sweep's order either way; ``on_run`` is called with each as it completes. ``warm_step_sizes``:
    every run's :func:`~kvsched.sim.simulator.simulate` ``warm_step_sizes``.
    """
    points = sweep_points(
        workload,
        rates=rates,
        policies=policies,
        axes=axes,
        base_config=base_config,
        step_model=step_model,
        scheduler=scheduler,
        horizon=horizon,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        window=window,
        prompt_buckets=prompt_buckets,
        class_ttft_slo=class_ttft_slo,
        per_request_dir=per_request_dir,
        warm_step_sizes=warm_step_sizes,
    )
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if per_request_dir is not None:
        Path(per_request_dir).mkdir(parents=True, exist_ok=True)
    prog = SimProgress(len(points)) if progress else None
    try:
        if ray:
            from .parallel import run_points_ray

            return run_points_ray(points, progress=prog, on_run=on_run, address=ray_address)
        if jobs > 1 and len(points) > 1:
            from .parallel import run_points_processes

            return run_points_processes(points, jobs=jobs, progress=prog, on_run=on_run)
        outputs: list[RunOutput] = []
        for point in points:
            out = run_point(point, prog)
            outputs.append(out)
            if on_run is not None:
                on_run(out)
        return outputs
    finally:
        if prog is not None:
            prog.close()


def _mean_rate(w: Workload) -> float | None:
    n = len(w)
    span = float(w.arrival_time[-1] - w.arrival_time[0]) if n else 0.0
    return (n - 1) / span if n > 1 and span > 0 else None


def finite(x: float) -> float | None:
    """JSON-safe number (NaN and inf become None)."""
    return float(x) if isinstance(x, (int, float, np.floating)) and math.isfinite(x) else None
