"""Workload h of `kvsched bench` (the cost of each policy's step): its backlog, and that it runs every policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import requires_rust
from kvsched.bench.workloads import EXTRA_SCENARIOS, SCENARIOS, generate, get_scenario


def test_initial_requests_arrive_at_step_zero_and_the_rest_keep_their_process() -> None:
    h = get_scenario("h")
    assert "h" not in SCENARIOS and EXTRA_SCENARIOS["h"] is h  # run only when named
    w = generate(h.scaled(0.2))
    k = w.scenario.initial_requests
    assert k == 230 and len(w.requests) == 1030
    steps = [r.arrival_step for r in w.requests]
    assert steps == sorted(steps)
    assert sum(s == 0 for s in steps) >= k
    # After the backlog, Poisson arrivals at 4 per step.
    tail = steps[k:]
    assert 0.8 * len(tail) / 4 < tail[-1] < 1.2 * len(tail) / 4
    # Without a backlog the same seed gives the same arrival process from step 0.
    plain = generate(replace(h.scaled(0.2), initial_requests=0))
    assert [r.arrival_step for r in plain.requests][: len(tail)] == tail
    assert [len(r.prompt_token_ids) for r in plain.requests] == [len(r.prompt_token_ids) for r in w.requests]
    with pytest.raises(ValueError, match=r"unknown workload 'z'.*, h$"):
        get_scenario("z")


@requires_rust
@pytest.mark.parametrize(
    "sets",
    [
        ["policy=fcfs"],
        ["policy=priority", "num_priorities=4"],
        ["policy=fair", "num_tenants=16"],
        ["policy=sjf", "max_wait_steps=50"],
        ["policy=slo", "default_ttft_slo_s=5"],
    ],
)
def test_workload_h_runs_under_every_policy(sets: list[str], tmp_path: Path) -> None:
    import json

    from kvsched.cli import main

    argv = ["bench", "-w", "h", "--quick", "--max-steps", "60", "--no-progress", "--json", str(tmp_path / "b.json")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    (result,) = json.loads((tmp_path / "b.json").read_text())["results"]
    assert result["workload"] == "h" and result["num_steps"] == 60
    assert result["scenario"]["policy"] == sets[0].split("=")[1]
    # The backlog (58 requests at --quick's scale) is admitted within the budget of the first steps.
    assert result["max_running_reqs"] >= 58
