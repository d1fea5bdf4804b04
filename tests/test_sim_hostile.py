"""The hostile-tenant workload in the simulator (docs/security.md): two honest tenants at 3 requests/s each and a
hostile tenant at 54 requests/s (9x their combined rate, beyond the engine's capacity), with and without
per-tenant limits. The honest requests are the same in every run (the run without the hostile tenant drops its
requests from the same workload), so their TTFTs compare directly."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched.sim import (
    PRESETS,
    Workload,
    WorkloadSpec,
    generate_workload,
    parse_length,
    parse_tenants,
    request_records,
    simulate,
    summarize,
)

pytestmark = requires_rust

MODEL = PRESETS["llama-3.1-8b-h100"]
CFG = {"num_blocks": 400, "block_size": 16, "max_num_batched_tokens": 512, "max_model_len": 2048, "max_num_seqs": 32}
LIMITS = {"max_waiting_per_tenant": 16, "max_running_per_tenant": 8, "isolate_tenant_cache": True}


@pytest.fixture(scope="module")
def workloads() -> tuple[Workload, Workload]:
    """(honest only, honest + hostile): the hostile tenant's requests merged into the honest ones."""
    spec = WorkloadSpec(
        rate=60.0,
        duration=40.0,
        prompt_len=parse_length("lognormal:300:0.6", max_len=1500),
        output_len=parse_length("uniform:5:80"),
        tenants=parse_tenants("h1:0.05,h2:0.05,hostile:0.9"),
        seed=5,
    )
    mixed = generate_workload(spec)
    honest = mixed.tenant != 2
    fields = ("arrival_time", "prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len")
    alone = dataclasses.replace(mixed, **{f: getattr(mixed, f)[honest] for f in fields})
    return alone, mixed


def _honest_ttft_p99(res: Any) -> float:
    rec = request_records(res)
    mask = rec.tenant != 2
    assert rec.finished[mask].all()
    return float(np.percentile(rec.ttft[mask], 99))


def test_limits_refuse_the_flood_and_keep_the_honest_tenants_ttft(workloads: tuple[Workload, Workload]) -> None:
    alone, mixed = workloads
    base = _honest_ttft_p99(simulate(alone, CFG, MODEL, keep_records=True))
    flooded = _honest_ttft_p99(simulate(mixed, CFG, MODEL, keep_records=True))
    res = simulate(mixed, {**CFG, **LIMITS}, MODEL, keep_records=True)
    limited = _honest_ttft_p99(res)
    assert flooded > 100 * base  # without limits the flood queues the honest tenants behind it
    assert limited <= 1.5 * base  # with them the honest tenants' p99 TTFT stays within 1.5x
    refused = res.extra["num_refused"]
    assert refused["h1"] == refused["h2"] == 0 and refused["hostile"] > 0
    s = summarize(res)
    assert s["overall"]["num_refused"] == refused["hostile"]
    assert {t["tenant"]: t["num_refused"] for t in s["tenants"]} == refused
    # Refused requests are recorded as never added; every added request finished.
    rec = request_records(res)
    hostile = rec.tenant == 2
    assert int((~rec.added[hostile]).sum()) == refused["hostile"]
    assert rec.finished[rec.added].all()


def test_without_limits_nothing_is_refused_and_arrivals_may_be_deferred(workloads: tuple[Workload, Workload]) -> None:
    _alone, mixed = workloads
    res = simulate(mixed, CFG, MODEL)
    assert sum(res.extra["num_refused"].values()) == 0
    assert res.extra["deferred_arrivals"]
    assert not simulate(mixed, {**CFG, **LIMITS}, MODEL).extra["deferred_arrivals"]
