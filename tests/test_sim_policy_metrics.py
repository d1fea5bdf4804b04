"""The simulator's recompute tax and TTFT by prompt-length bucket, checked against the raw record of the run."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched.sim import PRESETS, WorkloadSpec, generate_workload, parse_length, request_records, simulate, summarize
from kvsched.sim.metrics import PROMPT_BUCKETS, RunMetrics, prompt_bucket

pytestmark = requires_rust

MODEL = PRESETS["llama-3.1-8b-h100"]
# A pool small enough that requests are preempted and recomputed.
TIGHT = {"num_blocks": 120, "block_size": 16, "max_num_batched_tokens": 256, "max_model_len": 2048}


def _workload(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "rate": 12.0,
        "duration": 15.0,
        "prompt_len": parse_length("uniform:20:1500"),
        "output_len": parse_length("uniform:5:120"),
        "seed": 5,
    }
    return generate_workload(WorkloadSpec(**{**base, **kw}))


@pytest.fixture(scope="module")
def tight() -> Any:
    w = _workload()
    res = simulate(w, TIGHT, MODEL, keep_records=True, exact_limit=40)  # past 40 values: the sketch
    return w, res, request_records(res)


def test_recompute_tax_is_recomputed_over_all_computed_tokens(tight: Any) -> None:
    _, res, rec = tight
    o = summarize(res, rec)["overall"]
    recomputed = int(rec.num_recomputed_tokens.sum())
    computed = int(rec.num_scheduled_tokens.sum())
    assert recomputed > 0 and rec.num_preemptions.sum() > 0  # the pool is tight enough to matter
    assert computed == int(res.step_num_tokens.sum())
    assert o["num_scheduled_tokens"] == computed
    assert o["recompute_tax"] == pytest.approx(recomputed / computed)
    assert 0 < o["recompute_tax"] < 1
    assert o["recomputed_tokens_per_preemption"] == pytest.approx(recomputed / rec.num_preemptions.sum())


def test_recompute_tax_is_zero_without_preemption() -> None:
    w = _workload(duration=5.0)
    o = summarize(simulate(w, {"num_blocks": 20000, "max_model_len": 2048}, MODEL))["overall"]
    assert o["num_preemptions"] == 0 and o["recompute_tax"] == 0.0
    assert math.isnan(o["recomputed_tokens_per_preemption"])


def test_ttft_by_prompt_length_bucket_matches_the_records(tight: Any) -> None:
    w, res, rec = tight
    buckets = summarize(res, rec)["overall"]["ttft_by_prompt_len"]
    assert [(b["lo"], b["hi"]) for b in buckets] == [
        (1, 128), (129, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 4096), (4097, 8192), (8193, None),
    ]  # fmt: skip
    assert sum(b["num_requests"] for b in buckets) == len(w)
    used = 0
    for b in buckets:
        hi = b["hi"] if b["hi"] is not None else 1 << 30
        mask = (w.prompt_len >= b["lo"]) & (w.prompt_len <= hi)
        assert b["num_requests"] == int(mask.sum())
        v = rec.ttft[mask]
        assert b["num_first_token"] == int(np.isfinite(v).sum())
        if not mask.any():
            assert math.isnan(b["ttft"]["p50"])
            continue
        used += 1
        assert b["ttft"]["mean"] == pytest.approx(v.mean())
        assert b["ttft"]["max"] == pytest.approx(v.max())
        for p in (50, 90, 99):
            exact = np.percentile(v, p)
            if mask.sum() <= 40:
                assert b["ttft"][f"p{p}"] == pytest.approx(exact)
            else:  # the sketch: within 0.5% of an order statistic next to it
                lo, hi_ = np.sort(v)[[int(np.floor(p / 100 * (len(v) - 1))), int(np.ceil(p / 100 * (len(v) - 1)))]]
                assert lo * 0.995 <= b["ttft"][f"p{p}"] <= hi_ * 1.005
    assert used >= 4


def test_prompt_buckets_are_configurable_and_checked() -> None:
    w = _workload(duration=5.0)
    res = simulate(w, TIGHT, MODEL, keep_records=True, prompt_buckets=(500,))
    rec = request_records(res)
    buckets = summarize(res, rec)["overall"]["ttft_by_prompt_len"]
    assert [(b["lo"], b["hi"]) for b in buckets] == [(1, 500), (501, None)]
    short = w.prompt_len <= 500
    assert buckets[0]["ttft"]["p50"] == pytest.approx(np.percentile(rec.ttft[short], 50))
    assert buckets[1]["ttft"]["p99"] == pytest.approx(np.percentile(rec.ttft[~short], 99))
    np.testing.assert_array_equal(prompt_bucket(np.array([1, 128, 129, 8192, 8193]), PROMPT_BUCKETS), [0, 0, 1, 6, 7])
    for bad in ((0, 10), (10, 10), (20, 10)):
        with pytest.raises(ValueError, match="prompt_buckets"):
            RunMetrics(tenant_names=["a"], tenant_weights=[1.0], priorities=[0], window=1.0, prompt_buckets=bad)


def test_cli_reports_both_in_the_table_csv_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsched.cli import main

    out = tmp_path / "out"
    argv = ["simulate", "--rate", "12", "--duration", "8", "--prompt-len", "uniform:20:1500", "--output-len",
            "uniform:5:120", "--set", "num_blocks=120", "--set", "max_num_batched_tokens=256",
            "--set", "max_model_len=2048", "--prompt-buckets", "256,1024", "--out", str(out), "--no-progress",
            "--jobs", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "recomp %" in printed
    assert "TTFT p50/p99 by prompt length" in printed and "257-1024" in printed and "1025+" in printed
    run = json.loads((out / "sim.json").read_text())["runs"][0]["overall"]
    assert run["recompute_tax"] == pytest.approx(run["num_recomputed_tokens"] / run["num_scheduled_tokens"])
    assert run["recompute_tax"] > 0
    assert [b["hi"] for b in run["ttft_by_prompt_len"]] == [256, 1024, None]
    with (out / "summary.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["recompute_tax"]) == pytest.approx(run["recompute_tax"])
    with (out / "prompt_buckets.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["bucket"] for r in rows] == ["1-256", "257-1024", "1025+"]
    assert sum(int(r["num_requests"]) for r in rows) == run["num_requests"]
    assert float(rows[1]["ttft_p50"]) == pytest.approx(run["ttft_by_prompt_len"][1]["ttft"]["p50"])
    assert main([*argv[:-7], "--prompt-buckets", "512,256", "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "--prompt-buckets" in capsys.readouterr().err
