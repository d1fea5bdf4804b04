"""One run of a sweep: :class:`SweepPoint` describes it (small and picklable: the workload's recipe at its rate, or
the scaled trace; the config; the step model), :func:`run_point` simulates and summarizes it into a
:class:`RunOutput`, wherever it runs (this process, a worker process, a Ray task). :class:`RequestCsvWriter` streams
a run's per-request rows to a CSV file while it runs.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import PROMPT_BUCKETS, REQUEST_COLUMNS
from .progress import SimProgress
from .simulator import SimResult, simulate
from .steptime import StepTimeModel
from .summary import summarize
from .workload import Workload, WorkloadSpec, WorkloadStream

__all__ = ["CDF_POINTS", "RequestCsvWriter", "RunOutput", "SweepPoint", "WorkloadInfo", "run_point"]


@dataclass
class RunOutput:
    """One run of a sweep: its coordinates, summary, and the series the plots and CSV files need. ``result`` is
    the run's :class:`SimResult` without its per-request data (its ``workload`` a :class:`WorkloadInfo`, its
    ``metrics`` None): the summary holds the figures, ``service`` the fairness windows, ``ttft_cdf`` the TTFT
    quantiles (``(quantiles, values)``)."""

    run_id: str
    rate: float | None
    policy: str
    overrides: dict[str, Any]
    summary: dict[str, Any]
    result: SimResult
    service: dict[str, Any] = field(default_factory=dict)
    ttft_cdf: tuple[list[float], list[float]] = ([], [])

    def label(self) -> str:
        parts = [self.policy] + [f"{k}={v}" for k, v in self.overrides.items()]
        return " ".join(parts)


@dataclass(frozen=True)
class WorkloadInfo:
    """What a sweep's reports need of a workload: its size, tenants and source (not its requests)."""

    num_requests: int
    tenant_names: tuple[str, ...]
    tenant_weights: tuple[float, ...]
    seed: int
    source: str
    num_clipped_prompts: int

    def __len__(self) -> int:
        return self.num_requests

    @property
    def num_tenants(self) -> int:
        return len(self.tenant_names)

    @classmethod
    def of(cls, w: Workload | WorkloadStream) -> WorkloadInfo:
        return cls(len(w), tuple(w.tenant_names), tuple(w.tenant_weights), w.seed, w.source, w.num_clipped_prompts)


@dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep, as a worker needs it (see the module docstring)."""

    run_id: str
    rate: float | None
    policy: str
    overrides: dict[str, Any]
    config: dict[str, Any]
    workload: WorkloadSpec | Workload  # the recipe at this rate, or the trace scaled to it
    max_model_len: int | None  # prompts of a recipe are clipped to fit it
    step_model: StepTimeModel
    scheduler: str | Callable[..., Any] = "rust"
    horizon: float | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    window: float | None = None
    prompt_buckets: tuple[int, ...] | None = None  # None: metrics.PROMPT_BUCKETS
    class_ttft_slo: dict[int, float] | None = None  # a TTFT target per priority class
    per_request_csv: str | None = None  # write the per-request rows here
    warm_step_sizes: tuple[int, ...] = ()  # step sizes the engine ran before (simulate's warm_step_sizes)


# Quantiles of the TTFT CDF in the reports (ttft_cdf.csv, ttft_cdf.png).
CDF_POINTS = 200


def run_point(point: SweepPoint, progress: SimProgress | None = None) -> RunOutput:
    """Simulate one point of a sweep and summarize it (in this process)."""
    w: Workload | WorkloadStream = (
        WorkloadStream(point.workload, max_model_len=point.max_model_len)
        if isinstance(point.workload, WorkloadSpec)
        else point.workload
    )
    sink = None
    if point.per_request_csv is not None:
        sink = RequestCsvWriter(point.per_request_csv, w.tenant_names)
    try:
        res = simulate(
            w,
            point.config,
            point.step_model,
            scheduler=point.scheduler,
            horizon=point.horizon,
            slo_ttft=point.slo_ttft,
            slo_tpot=point.slo_tpot,
            window=point.window,
            prompt_buckets=point.prompt_buckets if point.prompt_buckets is not None else PROMPT_BUCKETS,
            class_ttft_slo=point.class_ttft_slo,
            request_sink=sink,
            progress=progress or False,
            progress_desc=point.run_id,
            warm_step_sizes=point.warm_step_sizes,
        )
    finally:
        if sink is not None:
            sink.close()
    summary = summarize(res, slo_ttft=point.slo_ttft, slo_tpot=point.slo_tpot)
    summary["rate"] = point.rate
    summary["overrides"] = point.overrides
    summary["run_id"] = point.run_id
    metrics = res.metrics
    assert metrics is not None
    qs = np.linspace(0.0, 1.0, CDF_POINTS)
    ttft = metrics.overall.lat["ttft"]
    cdf = (qs.tolist(), ttft.quantiles(qs).tolist()) if ttft.count else ([], [])
    service = metrics.service or {}
    res.metrics = None
    res.workload = WorkloadInfo.of(w)
    return RunOutput(point.run_id, point.rate, point.policy, point.overrides, summary, res, service, cdf)


class RequestCsvWriter:
    """Writes the per-request rows of a run to ``path`` as the simulator hands them over (its ``request_sink``):
    the file grows with the run, the process's memory does not."""

    def __init__(self, path: str | Path, tenant_names: Sequence[str]) -> None:
        self.path = Path(path)
        self._names = list(tenant_names)
        self._file = self.path.open("w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        self._writer.writerow(["idx", *REQUEST_COLUMNS])

    def __call__(self, cols: dict[str, Any]) -> None:
        data = [np.asarray(cols["idx"]).tolist()] + [np.asarray(cols[c]).tolist() for c in REQUEST_COLUMNS]
        ti = 1 + REQUEST_COLUMNS.index("tenant")
        data[ti] = [self._names[t] for t in data[ti]]
        self._writer.writerows(
            ["" if (isinstance(v, float) and not math.isfinite(v)) else v for v in row]
            for row in zip(*data, strict=True)
        )

    def close(self) -> None:
        self._file.close()
