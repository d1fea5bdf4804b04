"""Sweeps: every combination of request rate, policy and config values, each run on the same workload.

For each rate one workload is generated (same seed: the same requests, only their arrival times scaled) or the
trace is replayed with its arrival times scaled to that rate; every policy and config combination then runs
on that same workload, so differences between runs come from the scheduler's decisions alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .metrics import RequestRecords, request_records, summarize, tenant_service
from .simulator import SimResult, make_config, simulate
from .steptime import StepTimeModel
from .workload import Workload, WorkloadSpec, generate_workload

__all__ = ["RunOutput", "parse_set", "run_sweep", "scale_trace"]


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
    policy such as one this build does not have) are raised before anything runs.
    """
    axes = axes or {}
    base = dict(base_config or {})
    keys = list(axes)
    combos = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(axes[k] for k in keys))]
    # Validate every config up front: a bad policy or field fails fast, with the config's own message.
    for policy in policies:
        for combo in combos:
            make_config({**base, **combo, "policy": policy})
    outputs: list[RunOutput] = []
    for rate in rates:
        if isinstance(workload, WorkloadSpec):
            spec = workload if rate is None else dataclasses.replace(workload, rate=rate)
            w = generate_workload(spec)
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
                    progress=progress,
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
    return outputs


def _mean_rate(w: Workload) -> float | None:
    n = len(w)
    span = float(w.arrival_time[-1] - w.arrival_time[0]) if n else 0.0
    return (n - 1) / span if n > 1 and span > 0 else None


def finite(x: float) -> float | None:
    """JSON-safe number (NaN and inf become None)."""
    return float(x) if isinstance(x, (int, float, np.floating)) and math.isfinite(x) else None
