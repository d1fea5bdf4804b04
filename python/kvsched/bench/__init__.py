"""Benchmarks of per-step scheduling latency (``kvsched bench``): workloads, traces, the timing harness,
reports and plots. numpy is the only dependency; matplotlib only for plots."""

from __future__ import annotations

from .harness import RunResult, ScalingPoint, run_scaling, run_workload
from .trace import dump_trace, load_trace
from .workloads import SCENARIOS, Scenario, TraceRequest, Workload, generate, get_scenario

__all__ = [
    "SCENARIOS",
    "RunResult",
    "ScalingPoint",
    "Scenario",
    "TraceRequest",
    "Workload",
    "dump_trace",
    "generate",
    "get_scenario",
    "load_trace",
    "run_scaling",
    "run_workload",
]
