"""``kvsched.sim``: a serving simulator driven by the real scheduler (``kvsched simulate``).

Requests arrive in simulated time, the real :class:`kvsched.Scheduler` (or the pure-Python reference) decides
every step, and a linear step-time model says how long each step takes. See ``docs/simulator.md``.

    >>> from kvsched.sim import WorkloadSpec, generate_workload, simulate, summarize, PRESETS
    >>> w = generate_workload(WorkloadSpec(rate=2.0, duration=10.0, seed=1))
    >>> res = simulate(w, {"num_blocks": 4096}, PRESETS["llama-3.1-8b-h100"])
    >>> summary = summarize(res, slo_ttft=0.5, slo_tpot=0.05)

Nothing here imports torch or matplotlib; calibration (:mod:`kvsched.sim.calibrate`) and plots
(:mod:`kvsched.sim.plot`) import them when called.
"""

from __future__ import annotations

from .metrics import RequestRecords, jain_index
from .simulator import SimResult, StalledError, make_config, simulate
from .steptime import DEFAULT_PRESET, FEATURES, PRESETS, StepTimeModel, load_step_time_model
from .summary import request_records, summarize, tenant_service
from .workload import (
    LengthDist,
    TenantSpec,
    TraceFormatError,
    Workload,
    WorkloadSpec,
    dump_trace,
    generate_workload,
    load_trace,
    parse_length,
    parse_priorities,
    parse_tenants,
    prompt_tokens,
)

__all__ = [
    "DEFAULT_PRESET",
    "FEATURES",
    "PRESETS",
    "LengthDist",
    "RequestRecords",
    "SimResult",
    "StalledError",
    "StepTimeModel",
    "TenantSpec",
    "TraceFormatError",
    "Workload",
    "WorkloadSpec",
    "dump_trace",
    "generate_workload",
    "jain_index",
    "load_step_time_model",
    "load_trace",
    "make_config",
    "parse_length",
    "parse_priorities",
    "parse_tenants",
    "prompt_tokens",
    "request_records",
    "simulate",
    "summarize",
    "tenant_service",
]
