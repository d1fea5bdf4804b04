"""The simulator's recompute tax, TTFT by prompt-length bucket, conversations and per-class TTFT targets, checked
against the raw record of the run; the figures of docs/policies.md."""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
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


# ---- Multi-turn sessions and per-class TTFT targets -------------------------------------------------------


def _session_spec(**kw: Any) -> WorkloadSpec:
    base: dict[str, Any] = {
        "rate": 8.0,
        "duration": 20.0,
        "prompt_len": parse_length("uniform:40:200"),
        "output_len": parse_length("uniform:10:120"),
        "priorities": ((0, 0.3), (1, 0.7)),
        "num_prefix_groups": 2,
        "prefix_len": 32,
        "prefix_fraction": 0.5,
        "session_slots": 5,
        "session_turns": 3,
        "seed": 2,
    }
    return WorkloadSpec(**{**base, **kw})


def test_session_contexts_grow_turn_by_turn() -> None:
    from kvsched.sim.workload import WorkloadStream

    w = generate_workload(_session_spec(), max_model_len=1024)
    plain = generate_workload(_session_spec(session_slots=0), max_model_len=1024)
    assert w.sessions and not plain.sessions
    # The same arrivals, tenants and classes; new prompt material is drawn as without sessions.
    np.testing.assert_array_equal(w.arrival_time, plain.arrival_time)
    np.testing.assert_array_equal(w.priority, plain.priority)
    assert (w.prefix_group >= 2).all()  # conversations are groups of their own, after the shared ones
    np.testing.assert_array_equal(w.prefix_len, w.prompt_len - 1)
    turns = 0
    for g in np.unique(w.prefix_group):
        idx = np.flatnonzero(w.prefix_group == g)
        assert 1 <= len(idx) <= 3
        assert 40 <= w.prompt_len[idx[0]] <= 200
        for a, b in itertools.pairwise(idx.tolist()):
            new = w.prompt_len[b] - w.prompt_len[a] - w.output_len[a]
            assert 40 <= new <= 200  # the previous prompt and answer, plus the next message
            turns += 1
    assert turns > len(w) // 2
    assert w.max_prompt_len < 1024
    # Drawn a chunk at a time: the same requests.
    stream = WorkloadStream(_session_spec(), max_model_len=1024)
    parts = [c for _, c in stream.chunks(size=17)]
    assert all(c.sessions for c in parts)
    np.testing.assert_array_equal(np.concatenate([c.prompt_len for c in parts]), w.prompt_len)
    np.testing.assert_array_equal(np.concatenate([c.prefix_group for c in parts]), w.prefix_group)
    with pytest.raises(ValueError, match="session"):
        _session_spec(session_turns=0)


def test_session_flag_survives_a_trace(tmp_path: Path) -> None:
    from kvsched.sim import dump_trace, load_trace

    w = generate_workload(_session_spec(duration=5.0), max_model_len=1024)
    back = load_trace(dump_trace(w, tmp_path / "t.jsonl"))
    assert back.sessions
    np.testing.assert_array_equal(back.prompt_len, w.prompt_len)
    np.testing.assert_array_equal(back.prefix_len, w.prefix_len)
    assert not load_trace(dump_trace(generate_workload(_session_spec(session_slots=0)), tmp_path / "u.jsonl")).sessions


class _Recording:
    """A Rust scheduler that notes the keywords of every add_request."""

    def __init__(self, config: Any) -> None:
        from kvsched import Scheduler

        self.inner = Scheduler(config)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def add_request(self, req_id: str, *args: Any, **kw: Any) -> Any:
        self.calls.append((req_id, kw))
        return self.inner.add_request(req_id, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_simulator_passes_session_ids_and_class_targets_and_counts_goodput_by_them() -> None:
    w = generate_workload(_session_spec(rate=30.0, duration=10.0), max_model_len=1024)
    made: list[_Recording] = []

    def factory(config: Any) -> _Recording:
        made.append(_Recording(config))
        return made[-1]

    targets = {0: 0.3}
    res = simulate(
        w, {"num_blocks": 300, "max_model_len": 1024, "max_num_batched_tokens": 512, "policy": "slo"}, MODEL,
        scheduler=factory, keep_records=True, class_ttft_slo=targets, slo_ttft=2.0,
    )  # fmt: skip
    (sched,) = made
    assert len(sched.calls) == len(w)
    for req_id, kw in sched.calls:
        i = int(req_id[1:])
        assert kw["session_id"] == f"s{w.prefix_group[i]}"
        assert kw.get("ttft_slo_s") == targets.get(int(w.priority[i]))
    rec = request_records(res)
    limit = np.where(rec.priority == 0, 0.3, 2.0)
    good = rec.finished & (rec.ttft <= limit)
    assert 0 < good.sum() < len(w)
    s = summarize(res, rec, slo_ttft=2.0)
    assert s["overall"]["num_good"] == int(good.sum())
    assert s["class_ttft_slo"] == {"0": 0.3}
    by_class = {p["priority"]: p["num_good"] for p in s["priorities"]}
    assert by_class == {0: int(good[rec.priority == 0].sum()), 1: int(good[rec.priority == 1].sum())}
    # Other SLOs, counted afterwards from the kept (TTFT, TPOT) pairs, keep the class target.
    assert summarize(res, rec, slo_ttft=None)["overall"]["num_good"] == int(
        (rec.finished & ~(rec.ttft > np.where(rec.priority == 0, 0.3, np.inf))).sum()
    )
    # Without sessions or targets nothing extra reaches the scheduler.
    made.clear()
    simulate(generate_workload(_session_spec(session_slots=0, duration=3.0)), {"max_model_len": 1024}, MODEL,
             scheduler=factory)  # fmt: skip
    assert all("session_id" not in kw and "ttft_slo_s" not in kw for _, kw in made[0].calls)


@pytest.mark.parametrize("study", ["victim", "sjf", "slo", "fair", "session"])
def test_the_policy_study_figures_are_drawn_from_the_committed_tables(study: str, tmp_path: Path) -> None:
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs matplotlib")
    root = Path(__file__).resolve().parent.parent
    png = tmp_path / f"{study}.png"
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "policy_plots.py"), study, str(root / "docs/sim/policies" / study),
         str(png)],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "MPLBACKEND": "Agg"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "docs/img" / f"policies_{study}.png").exists()
