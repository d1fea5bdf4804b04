"""Sweeps: every combination of request rate, policy and config values, each run on the same workload.

For each rate one workload is generated (same seed: the same requests, only their arrival times scaled) or the
trace is replayed with its arrival times scaled to that rate; every policy and config combination then runs
on that same workload, so differences between runs come from the scheduler's decisions alone.

Lengths must fit ``max_model_len``, checked before anything runs: a generated workload is drawn with its prompt
lengths clipped to the smallest ``max_model_len`` of the sweep minus one (so every run sees the same requests),
and refused when the mean prompt length does not fit at all (:func:`~kvsched.sim.workload.check_prompt_lengths`);
a trace with a prompt that does not fit is refused. The simulator caps each output length at
``max_model_len - prompt_len``. Each run's summary counts both (``num_clipped_prompts``, ``num_capped_outputs``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import SchedulerConfig
from .metrics import RequestRecords, request_records, summarize, tenant_service
from .progress import SimProgress
from .simulator import SimResult, make_config, simulate
from .steptime import StepTimeModel
from .workload import TraceFormatError, Workload, WorkloadSpec, check_prompt_lengths, generate_workload

__all__ = ["RunOutput", "check_trace_fits", "parse_set", "run_sweep", "scale_trace", "sweep_configs"]


@dataclass
class RunOutput:
    """One run of a sweep: its coordinates, summary, and the series the plots and CSV files need."""

    run_id: str
    rate: float | None
    policy: str
    overrides: dict[str, Any]
    summary: dict[str, Any]
    result: SimResult
    records: RequestRecords
    service: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        parts = [self.policy] + [f"{k}={v}" for k, v in self.overrides.items()]
        return " ".join(parts)


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
    progress: bool = False,
    on_run: Callable[[RunOutput], None] | None = None,
) -> list[RunOutput]:
    """Run every (rate, policy, axis values) combination; see the module docstring.

    ``rates`` entries of None mean "the workload's own rate". Config errors (an unknown field, an unknown
    policy such as one this build does not have) and lengths that cannot fit ``max_model_len`` (see the module
    docstring) are raised before anything runs. ``progress``: one bar (or, off a terminal, one line per run) on
    stderr over all the runs (:class:`~kvsched.sim.progress.SimProgress`).
    """
    axes = axes or {}
    base = dict(base_config or {})
    combos = _combos(axes)
    # Validate every config up front: a bad policy or field fails fast, with the config's own message.
    configs = sweep_configs(policies, axes, base)
    max_model_len = min(cfg.max_model_len for cfg in configs)
    if isinstance(workload, WorkloadSpec):
        check_prompt_lengths(workload, max_model_len)
    else:
        check_trace_fits(workload, max_model_len)
    outputs: list[RunOutput] = []
    prog = SimProgress(len(rates) * len(configs)) if progress else None
    try:
        for rate in rates:
            if isinstance(workload, WorkloadSpec):
                spec = workload if rate is None else dataclasses.replace(workload, rate=rate)
                w = generate_workload(spec, max_model_len=max_model_len)
                run_rate: float | None = spec.rate
            else:
                w = workload if rate is None else scale_trace(workload, rate)
                run_rate = rate if rate is not None else _mean_rate(w)
            for policy in policies:
                for combo in combos:
                    cfg = make_config({**base, **combo, "policy": policy})
                    run_id = "_".join(
                        [f"rate{run_rate:g}" if run_rate is not None else "trace", policy]
                        + [f"{k}{v}" for k, v in combo.items()]
                    )
                    res = simulate(
                        w,
                        cfg,
                        step_model,
                        scheduler=scheduler,
                        horizon=horizon,
                        progress=prog or False,
                        progress_desc=run_id,
                    )
                    rec = request_records(res)
                    summary = summarize(res, rec, slo_ttft=slo_ttft, slo_tpot=slo_tpot, window=window)
                    summary["rate"] = run_rate
                    summary["overrides"] = combo
                    summary["run_id"] = run_id
                    out = RunOutput(run_id, run_rate, policy, combo, summary, res, rec)
                    out.service = tenant_service(res, summary["fairness"]["window"], rec)
                    outputs.append(out)
                    if on_run is not None:
                        on_run(out)
    finally:
        if prog is not None:
            prog.close()
    return outputs


def _mean_rate(w: Workload) -> float | None:
    n = len(w)
    span = float(w.arrival_time[-1] - w.arrival_time[0]) if n else 0.0
    return (n - 1) / span if n > 1 and span > 0 else None


def finite(x: float) -> float | None:
    """JSON-safe number (NaN and inf become None)."""
    return float(x) if isinstance(x, (int, float, np.floating)) and math.isfinite(x) else None
