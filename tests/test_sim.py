"""``kvsched.sim``: the simulator finishes or reports every request, conserves tokens, its summaries equal the
figures recomputed from the per-request records, it is deterministic, and sweeps, traces and the CLI work."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import requires_rust
from kvsched import InvalidConfigError, SchedulerConfig
from kvsched.config import POLICIES
from kvsched.sim import (
    PRESETS,
    StepTimeModel,
    TraceFormatError,
    Workload,
    WorkloadSpec,
    dump_trace,
    generate_workload,
    jain_index,
    load_step_time_model,
    load_trace,
    make_config,
    parse_length,
    parse_priorities,
    parse_tenants,
    request_records,
    simulate,
    summarize,
    tenant_service,
)
from kvsched.sim.steptime import (
    StepSizeCache,
    new_size_flags,
    parse_warm_step_sizes,
    recent_step_sizes,
)
from kvsched.sim.sweep import parse_set, run_sweep

pytestmark = requires_rust

MODEL = PRESETS["llama-3.1-8b-h100"]


def _spec(**kw: Any) -> WorkloadSpec:
    base: dict[str, Any] = {
        "rate": 10.0,
        "duration": 20.0,
        "prompt_len": parse_length("lognormal:300:0.6", max_len=1500),
        "output_len": parse_length("uniform:5:80"),
        "tenants": parse_tenants("a:0.6,b:0.3:2,c:0.1:1:0"),
        "priorities": parse_priorities("0:0.3,1:0.7"),
        "num_prefix_groups": 3,
        "prefix_len": 64,
        "prefix_fraction": 0.5,
        "seed": 3,
    }
    base.update(kw)
    return WorkloadSpec(**base)


# A small pool with a small budget: chunked prefills, prefix hits and preemptions all happen.
TIGHT = {"num_blocks": 160, "block_size": 16, "max_num_batched_tokens": 256, "max_model_len": 2048}


@pytest.fixture(scope="module")
def tight_run() -> Any:
    w = generate_workload(_spec())
    res = simulate(w, {**TIGHT, "policy": "priority"}, MODEL, keep_records=True)
    return w, res, request_records(res)


def test_every_request_finishes_and_tokens_are_conserved(tight_run: Any) -> None:
    w, res, rec = tight_run
    assert len(w) > 50
    assert rec.finished.all() and rec.added.all()
    np.testing.assert_array_equal(rec.num_output_tokens, res.target_output_len)
    np.testing.assert_array_equal(res.target_output_len, np.minimum(w.output_len, 2048 - w.prompt_len))
    # Every computed token belongs to one request: what the steps scheduled is what the requests received.
    assert res.step_num_tokens.sum() == rec.num_scheduled_tokens.sum() == res.sched_num_tokens.sum()
    assert res.step_num_sampled.sum() == rec.num_output_tokens.sum() == len(res.token_idx)
    # Per request: prompt + outputs - 1 tokens enter the KV cache once, minus prefix hits, plus recomputation.
    expected = w.prompt_len + rec.num_output_tokens - 1 - rec.num_cached_tokens + rec.num_recomputed_tokens
    np.testing.assert_array_equal(rec.num_scheduled_tokens, expected)
    assert rec.num_preemptions.sum() == res.final_stats["num_preemptions"] > 0
    assert rec.num_recomputed_tokens.sum() > 0
    assert rec.num_cached_tokens.sum() > 0  # shared prefixes hit
    assert res.final_stats["num_running_reqs"] == res.final_stats["num_waiting_reqs"] == 0
    # Time only moves forward and every token comes after its request's arrival.
    assert np.all(np.diff(res.step_start) >= 0)
    assert np.all(rec.first_scheduled_time >= rec.arrival_time)
    assert np.all(rec.ttft > 0) and np.all(rec.e2e >= rec.ttft)
    assert np.all(rec.queue_delay >= 0)


def test_fast_path_gives_the_same_run_as_full_recording() -> None:
    w = generate_workload(_spec(duration=10.0))
    for extra in ({}, TIGHT):
        fast = simulate(w, extra, MODEL, record_batches=True, keep_records=True)
        full = simulate(w, extra, MODEL, record_batches=True, keep_records=True, fast_path=False)
        assert fast.extra["num_fast_steps"] > 0 and full.extra["num_fast_steps"] == 0
        assert fast.batches == full.batches
        for f in dataclasses.fields(fast):
            a, b = getattr(fast, f.name), getattr(full, f.name)
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, b, err_msg=f.name)
        assert fast.end_time == full.end_time


def test_summary_equals_figures_recomputed_from_records(tight_run: Any) -> None:
    w, res, rec = tight_run
    s = summarize(res, rec, slo_ttft=2.0, slo_tpot=0.02)
    o = s["overall"]
    duration = res.end_time - w.arrival_time[0]
    assert o["duration"] == pytest.approx(duration)
    assert o["num_finished"] == int(rec.finished.sum())
    assert o["request_throughput"] == pytest.approx(rec.finished.sum() / duration)
    assert o["output_token_throughput"] == pytest.approx(rec.num_output_tokens.sum() / duration)
    for key in ("ttft", "e2e", "queue_delay", "tpot"):
        v = getattr(rec, key)
        v = v[np.isfinite(v)]
        assert o[key]["p50"] == pytest.approx(np.percentile(v, 50))
        assert o[key]["p99"] == pytest.approx(np.percentile(v, 99))
        assert o[key]["mean"] == pytest.approx(v.mean())
    # ITLs from the per-request token times: e2e - ttft = sum of that request's ITLs.
    per_req_itl = np.add.reduceat(rec.itl, rec.itl_indptr[:-1][np.diff(rec.itl_indptr) > 0])
    multi = np.diff(rec.itl_indptr) > 0
    np.testing.assert_allclose(per_req_itl, (rec.e2e - rec.ttft)[multi], rtol=1e-9, atol=1e-12)
    good = [
        f and t <= 2.0 and not (p > 0.02)
        for f, t, p in zip(rec.finished.tolist(), rec.ttft.tolist(), rec.tpot.tolist(), strict=True)
    ]
    assert o["num_good"] == sum(good)
    assert o["goodput"] == pytest.approx(sum(good) / duration)
    assert o["num_preemptions"] == int(rec.num_preemptions.sum())
    # Per tenant and per priority class: the groups partition the requests.
    assert sum(t["num_requests"] for t in s["tenants"]) == len(w)
    assert sum(p["num_requests"] for p in s["priorities"]) == len(w)
    for i, t in enumerate(s["tenants"]):
        mask = rec.tenant == i
        assert t["num_requests"] == int(mask.sum())
        assert t["ttft"]["p90"] == pytest.approx(np.percentile(rec.ttft[mask], 90))
        assert t["service_tokens"] == pytest.approx(rec.num_scheduled_tokens[mask].sum())
    assert sum(t["service_share"] for t in s["tenants"]) == pytest.approx(1.0)
    for p in s["priorities"]:
        mask = rec.priority == p["priority"]
        assert p["e2e"]["p50"] == pytest.approx(np.percentile(rec.e2e[mask], 50))
    # Fairness: per-window service sums to each tenant's tokens; queue-seconds sum to the requests' waits.
    svc = tenant_service(res, s["fairness"]["window"], rec)
    for i in range(w.num_tenants):
        mask = rec.tenant == i
        assert svc["service"][:, i].sum() == pytest.approx(rec.num_scheduled_tokens[mask].sum())
        assert svc["queue"][:, i].sum() * svc["window"] == pytest.approx(rec.queue_delay[mask].sum())
    weights = np.asarray(w.tenant_weights)
    for k in range(len(svc["jain"])):
        b = svc["backlogged"][k]
        if b.sum() >= 2:
            assert svc["jain"][k] == pytest.approx(jain_index(svc["service"][k, b] / weights[b]))
        else:
            assert math.isnan(svc["jain"][k])
    finite = svc["jain"][np.isfinite(svc["jain"])]
    if finite.size:
        assert s["fairness"]["jain_mean"] == pytest.approx(finite.mean())
    else:
        assert math.isnan(s["fairness"]["jain_mean"])


def test_horizon_reports_unfinished_requests() -> None:
    w = generate_workload(_spec(rate=20.0, duration=20.0))
    res = simulate(w, TIGHT, MODEL, horizon=5.0, keep_records=True)
    rec = request_records(res)
    assert res.end_time >= 5.0
    assert not rec.added[w.arrival_time > res.end_time].any()
    unfinished = rec.added & ~rec.finished
    assert unfinished.sum() > 0 and rec.finished.sum() > 0
    assert np.isnan(rec.e2e[unfinished]).all() and np.isfinite(rec.e2e[rec.finished]).all()
    assert (rec.num_output_tokens[unfinished] < res.target_output_len[unfinished]).all()
    s = summarize(res, rec)
    assert s["overall"]["num_unfinished"] == int(unfinished.sum())
    assert s["overall"]["num_requests"] == int(rec.added.sum())


def test_deterministic_for_a_seed() -> None:
    spec = _spec(duration=8.0)
    runs = [simulate(generate_workload(spec), TIGHT, MODEL, keep_records=True) for _ in range(2)]
    a, b = (summarize(r) for r in runs)
    for s in (a, b):
        s["overall"].pop("wall_s")
        s["overall"].pop("sim_speed")
    assert a == b
    np.testing.assert_array_equal(runs[0].token_idx, runs[1].token_idx)
    other = generate_workload(dataclasses.replace(spec, seed=4))
    assert not np.array_equal(other.arrival_time[:10], runs[0].workload.arrival_time[:10])


def test_same_seed_gives_the_same_requests_at_every_rate() -> None:
    slow = generate_workload(_spec(num_requests=50, rate=2.0))
    fast = generate_workload(_spec(num_requests=50, rate=8.0))
    np.testing.assert_allclose(slow.arrival_time, 4 * fast.arrival_time)
    np.testing.assert_array_equal(slow.prompt_len, fast.prompt_len)
    np.testing.assert_array_equal(slow.tenant, fast.tenant)


def test_workload_distributions_and_tenant_priority() -> None:
    w = generate_workload(_spec(rate=50.0, duration=40.0))
    assert abs(len(w) / 40.0 - 50.0) < 5
    shares = np.bincount(w.tenant, minlength=3) / len(w)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.04)
    assert (w.priority[w.tenant == 2] == 0).all()  # tenant c has a fixed priority
    assert abs(w.prompt_len.mean() - 300) < 30
    assert w.output_len.min() >= 5 and w.output_len.max() <= 80
    shared = w.prefix_group >= 0
    assert 0.4 < shared.mean() < 0.6 and (w.prefix_len[shared] <= w.prompt_len[shared] - 1).all()
    bursty = generate_workload(_spec(arrival="gamma", cv=3.0, num_requests=4000))
    gaps = np.diff(bursty.arrival_time)
    assert gaps.std() / gaps.mean() > 2.0


def test_reference_scheduler_makes_the_same_decisions() -> None:
    w = generate_workload(_spec(duration=4.0))
    rust = simulate(w, TIGHT, MODEL, record_batches=True, keep_records=True)
    ref = simulate(w, TIGHT, MODEL, scheduler="reference", record_batches=True, keep_records=True)
    assert rust.batches == ref.batches
    assert rust.end_time == ref.end_time
    np.testing.assert_array_equal(rust.preempt_idx, ref.preempt_idx)


def test_sweep_runs_every_combination_on_the_same_workload() -> None:
    spec = _spec(duration=5.0)
    runs = run_sweep(
        spec,
        rates=[2.0, 4.0],
        policies=["fcfs", "priority"],
        axes=parse_set(["num_blocks=160,400"]),
        base_config={k: v for k, v in TIGHT.items() if k != "num_blocks"},
        step_model=MODEL,
        slo_ttft=1.0,
    )
    assert len(runs) == 8
    assert {(r.rate, r.policy, r.overrides["num_blocks"]) for r in runs} == {
        (rate, p, nb) for rate in (2.0, 4.0) for p in ("fcfs", "priority") for nb in (160, 400)
    }
    for r in runs:
        assert r.result.config.policy == r.policy and r.result.config.num_blocks == r.overrides["num_blocks"]
        assert r.summary["overall"]["num_finished"] == r.summary["overall"]["num_requests"] > 0
    at2 = [r for r in runs if r.rate == 2.0]
    expected = generate_workload(dataclasses.replace(spec, rate=2.0))
    for r in at2:
        o = r.summary["overall"]
        assert o["num_requests"] == len(expected) and o["num_output_tokens"] == int(expected.output_len.sum())
    assert len({r.run_id for r in runs}) == 8


def test_config_errors_are_clear() -> None:
    with pytest.raises(InvalidConfigError, match="unknown scheduler config field"):
        make_config({"num_blokcs": 10})
    with pytest.raises(ValueError, match="--set takes"):
        parse_set(["num_blocks"])
    missing = next(p for p in ("fair", "no-such-policy") if p not in POLICIES)
    with pytest.raises(InvalidConfigError, match="policy"):
        run_sweep(_spec(duration=1.0), policies=["fcfs", missing], step_model=MODEL)
    with pytest.raises(ValueError, match="max_model_len"):
        simulate(generate_workload(_spec(duration=2.0, prompt_len=parse_length("9000"))), {}, MODEL)


def test_tenant_reaches_a_scheduler_that_accepts_it() -> None:
    from kvsched.reference import ReferenceScheduler

    seen: list[str] = []

    class TenantScheduler(ReferenceScheduler):
        def add_request(self, req_id: str, prompt_token_ids: Any, *, tenant: str = "", **kw: Any) -> None:
            seen.append(tenant)
            super().add_request(req_id, prompt_token_ids, **kw)

    w = generate_workload(_spec(duration=2.0))
    res = simulate(w, {}, MODEL, scheduler=TenantScheduler)
    assert res.extra["tenant_passed"]
    assert seen == [w.tenant_names[t] for t in w.tenant.tolist()]


def test_trace_roundtrip_and_bad_traces(tmp_path: Path) -> None:
    w = generate_workload(_spec(duration=3.0))
    path = dump_trace(w, tmp_path / "t.jsonl")
    back = load_trace(path)
    for name in ("prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len"):
        np.testing.assert_array_equal(getattr(back, name), getattr(w, name), err_msg=name)
    np.testing.assert_allclose(back.arrival_time, w.arrival_time, atol=1e-6)
    assert back.tenant_names == w.tenant_names and back.tenant_weights == w.tenant_weights
    minimal = tmp_path / "m.jsonl"
    minimal.write_text(
        '{"arrival_time": 1.5, "prompt_len": 10, "output_len": 3}\n'
        '{"arrival_time": 0, "prompt_len": 4, "output_len": 1}\n'
    )
    m = load_trace(minimal)
    assert m.arrival_time.tolist() == [0.0, 1.5] and m.tenant_names == ("default",)
    res = simulate(m, {}, MODEL)
    assert summarize(res)["overall"]["num_finished"] == 2
    for bad, msg in (
        ('{"arrival_time": -1, "prompt_len": 4, "output_len": 1}', "arrival_time"),
        ('{"arrival_time": 0, "prompt_len": 0, "output_len": 1}', ">= 1"),
        ('{"arrival_time": 0, "output_len": 1}', "prompt_len"),
        ("[1, 2]", "JSON object"),
        ("{nope", "not JSON"),
        ("", "no request"),
    ):
        p = tmp_path / "bad.jsonl"
        p.write_text(bad + "\n")
        with pytest.raises(TraceFormatError, match=msg):
            load_trace(p)


def test_step_time_model_presets_and_files(tmp_path: Path) -> None:
    for name, preset in PRESETS.items():
        assert preset.name == name and "estimate" in preset.source
        # A 256-request decode step at 1k context is slower than a single decode, and both are positive.
        assert 0 < preset.step_time(0, 1, 1024) < preset.step_time(0, 256, 256 * 1024)
    assert PRESETS["llama-3.1-8b-h100"].step_s > PRESETS["llama-3.2-1b-h100"].step_s
    path = MODEL.save(tmp_path / "m.json", extra={"note": 1})
    assert load_step_time_model(path) == MODEL
    # A model saved before the lone-prefill term existed loads with it 0; one with it keeps it.
    assert all(p.lone_prefill_token_s == 0 for p in PRESETS.values())
    old = MODEL.to_dict()
    del old["lone_prefill_token_s"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_step_time_model(tmp_path / "old.json") == MODEL
    lone = dataclasses.replace(MODEL, lone_prefill_token_s=2e-6)
    assert load_step_time_model(lone.save(tmp_path / "lone.json")) == lone
    assert lone.step_time(100, prefill_reqs=1, lone_prefill_tokens=100) == pytest.approx(
        MODEL.step_time(100, prefill_reqs=1) + 2e-4
    )
    assert load_step_time_model("llama-3.2-1b-h100") is PRESETS["llama-3.2-1b-h100"]
    with pytest.raises(ValueError, match="unknown step-time preset"):
        load_step_time_model("nope")
    with pytest.raises(ValueError, match=">= 0"):
        StepTimeModel(step_s=-1.0)
    with pytest.raises(ValueError, match="needs"):
        StepTimeModel()


def test_step_time_noise_has_mean_one_and_the_stated_spread_and_memory() -> None:
    from kvsched.sim.steptime import StepNoise, fit_step_noise

    first, second = StepNoise(0.3, 0.7, seed=1), StepNoise(0.3, 0.7, seed=1)
    assert [first.next() for _ in range(5)] == [second.next() for _ in range(5)]
    noise = StepNoise(0.3, 0.7, seed=1)
    x = np.array([noise.next() for _ in range(100_000)])
    assert x.mean() == pytest.approx(1.0, abs=0.02)
    sigma, rho = fit_step_noise(np.log(x))
    assert sigma == pytest.approx(0.3, rel=0.05) and rho == pytest.approx(0.7, abs=0.03)
    # Pairs across two runs of steps do not count for the correlation.
    # Runs of two steps, each run starting where the previous ended: the pairs across runs are equal, the pairs
    # within a run independent.
    v = np.random.default_rng(0).standard_normal(2001)
    runs = np.column_stack([v[:-1], v[1:]]).ravel()
    assert fit_step_noise(runs)[1] > 0.4
    assert fit_step_noise(runs, np.repeat(np.arange(2000), 2))[1] < 0.1
    assert fit_step_noise(np.zeros(10)) == (0.0, 0.0)
    for bad in ({"noise_sigma": -0.1}, {"noise_rho": 1.0}, {"noise_rho": -0.5}, {"noise_sigma": float("nan")}):
        with pytest.raises(ValueError, match="noise"):
            dataclasses.replace(MODEL, **bad)


def test_step_time_noise_in_the_simulator(tmp_path: Path) -> None:
    w = generate_workload(_spec(duration=10.0))
    noisy = dataclasses.replace(MODEL, noise_sigma=0.5, noise_rho=0.8)
    assert load_step_time_model(noisy.save(tmp_path / "noisy.json")) == noisy
    plain = simulate(w, {"num_blocks": 4000}, MODEL, keep_records=True)
    a = simulate(w, {"num_blocks": 4000}, noisy, keep_records=True, noise_seed=1)
    b = simulate(w, {"num_blocks": 4000}, noisy, keep_records=True, noise_seed=1)
    c = simulate(w, {"num_blocks": 4000}, noisy, keep_records=True, noise_seed=2)
    # Seeded: the same seed gives the same run, another seed another.
    assert np.array_equal(a.step_time, b.step_time)
    assert not np.array_equal(a.step_time, c.step_time)
    # Without noise the seed is unused.
    again = simulate(w, {"num_blocks": 4000}, MODEL, keep_records=True, noise_seed=9)
    assert np.array_equal(plain.step_time, again.step_time)
    # The factors have mean 1 (the mean step time stays close to the model's) but spread the steps' times.
    ratio = a.step_time.mean() / plain.step_time.mean()
    assert 0.8 < ratio < 1.25
    assert np.std(a.step_time) > 1.5 * np.std(plain.step_time)
    # The fast path draws one factor per step as the full path does.
    slow = simulate(w, {"num_blocks": 4000}, noisy, keep_records=True, noise_seed=1, fast_path=False)
    assert np.array_equal(slow.step_time, a.step_time)


def test_jain_index() -> None:
    assert jain_index(np.array([1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert jain_index(np.array([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert math.isnan(jain_index(np.zeros(3)))


def test_parsers_reject_bad_input() -> None:
    for bad in ("uniform:5", "lognormal:a:1", "zipf:3:4", "0", "uniform:9:3"):
        with pytest.raises(TraceFormatError):
            parse_length(bad)
    for bad in ("a:x", "a:1,a:2", "a:-1", ":1"):
        with pytest.raises(TraceFormatError):
            parse_tenants(bad)
    for bad in ("0", "0:0", "x:1"):
        with pytest.raises(TraceFormatError):
            parse_priorities(bad)
    for prios in ((), ((0, 0.0),), ((0, float("nan")),), ((0, -1.0), (1, 2.0))):
        with pytest.raises(TraceFormatError, match="priorities"):
            WorkloadSpec(priorities=prios)


def test_cli_end_to_end(tmp_path: Path) -> None:
    from kvsched.cli import main

    out = tmp_path / "out"
    trace = tmp_path / "trace.jsonl"
    argv = ["simulate", "--rates", "2,6", "--policies", "fcfs,priority", "--duration", "4",
            "--prompt-len", "uniform:50:400", "--output-len", "lognormal:40:0.5", "--tenants", "a:0.7,b:0.3:2",
            "--priorities", "0:0.5,1:0.5", "--prefix-groups", "2", "--prefix-len", "32", "--prefix-fraction", "0.5",
            "--set", "num_blocks=160", "--set", "max_model_len=2048", "--set", "max_num_batched_tokens=512",
            "--slo-ttft", "0.5",
            "--slo-tpot", "0.05", "--out", str(out), "--per-request", "--dump-trace", str(trace),
            "--no-progress"]  # fmt: skip
    try:
        import matplotlib  # noqa: F401

        argv.append("--plot")
        pngs = ["latency.png", "goodput.png", "ttft_cdf.png", "tenant_service.png", "timeseries.png"]
    except ImportError:
        pngs = []
    assert main(argv) == 0
    for name in ["sim.json", "summary.csv", "tenants.csv", "priorities.csv", "timeseries.csv",
                 "tenant_service.csv", "ttft_cdf.csv", *pngs]:  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "sim.json").read_text())
    assert doc["kind"] == "kvsched-simulate" and len(doc["runs"]) == 4
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["rate"], r["policy"]) for r in rows] == [
        ("2.0", "fcfs"),
        ("2.0", "priority"),
        ("6.0", "fcfs"),
        ("6.0", "priority"),
    ]
    assert all(r["num_finished"] == r["num_requests"] for r in rows)
    reqs = list(out.glob("requests_*.csv"))
    assert len(reqs) == 4
    # The dumped trace replays to the same run.
    dumped = tmp_path / "trace_rate6.jsonl"
    out2 = tmp_path / "out2"
    argv2 = ["simulate", "--trace", str(dumped), "--policies", "priority", "--set", "num_blocks=160",
             "--set", "max_model_len=2048",
             "--set", "max_num_batched_tokens=512", "--slo-ttft", "0.5", "--slo-tpot", "0.05", "--out", str(out2),
             "--no-progress"]  # fmt: skip
    assert main(argv2) == 0
    doc2 = json.loads((out2 / "sim.json").read_text())
    a = doc["runs"][3]["overall"]
    b = doc2["runs"][0]["overall"]
    assert a["num_requests"] == b["num_requests"] and a["num_output_tokens"] == b["num_output_tokens"]
    assert a["ttft"]["p50"] == pytest.approx(b["ttft"]["p50"], rel=1e-3)


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvsched.cli import main

    missing = next(p for p in ("fair", "no-such-policy") if p not in POLICIES)
    assert main(["simulate", "--policies", missing, "--duration", "1", "--no-progress"]) == 2
    assert "policy" in capsys.readouterr().err
    assert main(["simulate", "--set", "bogus=1", "--duration", "1", "--no-progress"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["simulate", "--step-model", "nope", "--no-progress"]) == 2
    assert main(["simulate", "--prompt-len", "zipf:1", "--no-progress"]) == 2
    assert main(["simulate", "--calibrate", "--no-progress"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["simulate", "--list-presets"]) == 0
    assert "llama-3.1-8b-h100" in capsys.readouterr().out


def test_import_kvsched_sim_imports_no_matplotlib_tqdm_or_torch() -> None:
    code = (
        "import sys, kvsched, kvsched.sim, kvsched.cli\n"
        "kvsched.cli.build_parser()\n"
        "bad = [m for m in ('matplotlib', 'torch', 'tqdm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_config_passes_through_unchanged() -> None:
    cfg = make_config(SchedulerConfig(num_blocks=1000, policy="priority"), max_num_seqs=7)
    assert (cfg.num_blocks, cfg.policy, cfg.max_num_seqs, cfg.prefix_hash_seed) == (1000, "priority", 7, 0)


def test_jain_index_covers_backlogged_tenants_under_overload() -> None:
    w = generate_workload(_spec(rate=40.0, duration=6.0))
    res = simulate(w, TIGHT, MODEL, window=1.0, keep_records=True)
    rec = request_records(res)
    s = summarize(res, rec)
    svc = tenant_service(res, 1.0, rec)
    finite = np.isfinite(svc["jain"])
    assert finite.sum() >= 3  # the backlog builds up: several windows with competing tenants
    weights = np.asarray(w.tenant_weights)
    for k in np.flatnonzero(finite):
        b = svc["backlogged"][k]
        assert b.sum() >= 2 and (svc["queue"][k, b] >= 1).all()
        assert svc["jain"][k] == pytest.approx(jain_index(svc["service"][k, b] / weights[b]))
    assert s["fairness"]["jain_mean"] == pytest.approx(svc["jain"][finite].mean())
    assert 0 < s["fairness"]["jain_min"] <= s["fairness"]["jain_mean"] <= 1


@pytest.mark.skipif("fair" not in POLICIES, reason="this build has no fair-share policy")
def test_fair_policy_gets_tenants_and_their_weights() -> None:
    w = generate_workload(_spec(rate=40.0, duration=4.0))
    res = simulate(w, {**TIGHT, "policy": "fair"}, MODEL, keep_records=True)
    assert res.extra["tenant_passed"]
    assert dict(res.config.tenant_weights) == {"a": 1.0, "b": 2.0, "c": 1.0}
    rec = request_records(res)
    assert rec.finished.all()
    # The heavy tenant a waits longest under fair share; under FCFS every tenant waits alike.
    fcfs = request_records(simulate(w, TIGHT, MODEL, keep_records=True))
    fair_a, fair_c = (np.median(rec.queue_delay[rec.tenant == i]) for i in (0, 2))
    assert fair_a > fair_c
    assert np.median(fcfs.queue_delay[fcfs.tenant == 2]) > fair_c


def test_swapped_blocks_are_charged_and_auto_mode_prices_victims_with_the_step_model() -> None:
    # Everything arrives within the first step, so the schedule does not depend on step times: runs that differ
    # only in the swap coefficient make the same decisions, and their clocks differ by that coefficient times the
    # number of blocks copied (an integer).
    w = generate_workload(_spec(rate=100_000.0, duration=0.0006, tenants=parse_tenants("a:1")))
    assert len(w) > 30
    cfg = {**TIGHT, "num_cpu_blocks": 4000}

    def run(mode: str, swap_block_s: float) -> Any:
        model = dataclasses.replace(MODEL, swap_block_s=swap_block_s)
        return simulate(
            w, {**cfg, "preemption_mode": mode}, model, record_batches=True, fast_path=False, keep_records=True
        )

    free, paid = run("swap", 0.0), run("swap", 1e-3)
    assert free.batches == paid.batches
    extra = (paid.step_time.sum() - free.step_time.sum()) / 1e-3
    assert extra > 10 and abs(extra - round(extra)) < 1e-6
    # Recompute mode never swaps: the coefficient is not charged.
    rec0, rec1 = run("recompute", 0.0), run("recompute", 1e-3)
    assert rec0.batches == rec1.batches and rec0.step_time.sum() == pytest.approx(rec1.step_time.sum())
    # Auto mode: swapping priced far above recomputing recomputes every victim (the recompute mode's schedule);
    # priced at almost nothing, it swaps them (the swap mode's schedule).
    assert run("auto", 10.0).batches == rec0.batches
    assert run("auto", 1e-12).batches == free.batches
    assert free.batches != rec0.batches


def _plain_workload(arrival: Any, prompt_len: Any, output_len: Any, seed: int) -> Workload:
    """One tenant, no priorities, no shared prefixes."""
    n = len(arrival)
    return Workload(
        arrival_time=np.asarray(arrival, dtype=np.float64),
        prompt_len=np.asarray(prompt_len),
        output_len=np.asarray(output_len),
        tenant=np.zeros(n, dtype=np.int64),
        priority=np.zeros(n, dtype=np.int64),
        prefix_group=np.full(n, -1, dtype=np.int64),
        prefix_len=np.zeros(n, dtype=np.int64),
        seed=seed,
    )


def test_lone_prefill_term_prices_lone_prefill_steps_exactly() -> None:
    # Requests arriving far apart (each runs alone: lone prefill chunks, then lone decodes), then a burst (prefills
    # sharing steps with each other and with decodes). The arrivals are far enough apart that step times cannot
    # change the schedule, so the step times differ by exactly the term on the lone prefill steps.
    n_alone, n_burst = 6, 8
    rng = np.random.default_rng(4)
    n = n_alone + n_burst
    w = _plain_workload(
        np.concatenate([100.0 * np.arange(n_alone), np.full(n_burst, 100.0 * n_alone)]),
        rng.integers(20, 600, size=n),
        rng.integers(2, 30, size=n),
        seed=4,
    )
    c = 3e-5
    base = simulate(w, TIGHT, MODEL, record_batches=True, keep_records=True)
    paid = simulate(
        w, TIGHT, dataclasses.replace(MODEL, lone_prefill_token_s=c), record_batches=True, keep_records=True
    )
    assert paid.batches == base.batches
    lone = (base.step_num_reqs == 1) & (base.step_prefill_tokens > 0)
    assert lone.sum() >= n_alone and (~lone & (base.step_prefill_tokens > 0)).any()
    np.testing.assert_allclose(
        paid.step_time - base.step_time, np.where(lone, c * base.step_prefill_tokens, 0.0), rtol=0, atol=1e-15
    )
    assert paid.step_time.sum() == pytest.approx(base.step_time.sum() + c * base.step_prefill_tokens[lone].sum())


def test_step_size_cache_is_a_least_recently_used_set_of_sizes() -> None:
    cache = StepSizeCache(2)
    # 5 and 7 new; 5 again (now the most recent); 9 new, evicting 7 (least recent), not 5; then 7 is new again.
    assert [cache.new(s) for s in (5, 7, 5, 9, 5, 7, 9, 5)] == [True, True, False, True, False, True, True, True]
    assert len(cache) == 2
    assert new_size_flags([5, 7, 5, 9, 5, 7, 9, 5], 2).tolist() == [True, True, False, True, False, True, True, True]
    assert new_size_flags([5, 7, 5, 9], 0).tolist() == [False] * 4  # capacity 0: the term is off
    assert new_size_flags([1, 2, 3, 1, 2, 3], 3).tolist() == [True] * 3 + [False] * 3
    assert new_size_flags([1, 2, 3, 1, 2, 3], 2).tolist() == [True] * 6  # a cycle longer than the cache
    with pytest.raises(ValueError, match="capacity"):
        StepSizeCache(0)
    for bad in ({"step_size_cache": -1}, {"step_size_cache": 2.5}, {"step_size_cache": True}, {"new_size_step_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dataclasses.replace(MODEL, **bad)
    on = dataclasses.replace(MODEL, new_size_step_s=1e-3, step_size_cache=32)
    assert on.charges_new_sizes and not MODEL.charges_new_sizes
    assert not dataclasses.replace(MODEL, new_size_step_s=1e-3).charges_new_sizes  # no cache: off
    priced = on.step_time(100, prefill_reqs=1, new_size_steps=1)
    assert priced == pytest.approx(MODEL.step_time(100, prefill_reqs=1) + 1e-3)


def _expected_new_size_charges(res: Any, capacity: int) -> npt.NDArray[np.float64]:
    """Per step of a recorded run, 1 where its size (scheduled tokens) was not among the last ``capacity``
    distinct sizes: a plain list-based LRU, independent of StepSizeCache."""
    recent: list[int] = []
    out = []
    for size in res.step_num_tokens.tolist():
        out.append(0.0 if size in recent else 1.0)
        if size in recent:
            recent.remove(size)
        recent.append(size)
        del recent[:-capacity]
    return np.array(out)


@pytest.mark.parametrize("capacity", [1, 4, 32])
def test_new_size_term_prices_steps_of_a_size_not_run_recently(capacity: int) -> None:
    # Requests far apart (each alone: the schedule cannot depend on step times), so the only difference in step
    # times is the term, on exactly the steps whose size is not among the last `capacity` distinct sizes.
    w = _far_apart_workload()
    c = 4e-3
    base = simulate(w, TIGHT, MODEL, record_batches=True, keep_records=True)
    paid = simulate(
        w,
        TIGHT,
        dataclasses.replace(MODEL, new_size_step_s=c, step_size_cache=capacity),
        record_batches=True,
        keep_records=True,
    )
    assert paid.batches == base.batches
    new = _expected_new_size_charges(base, capacity)
    assert 0 < new.sum() < len(new)  # some sizes repeat within the cache, some do not
    np.testing.assert_allclose(paid.step_time - base.step_time, c * new, rtol=0, atol=1e-15)


def test_new_size_term_under_load_is_the_same_with_and_without_the_fast_path() -> None:
    # A fast step (the previous all-decode batch again) repeats the previous step's size, the most recent one, so
    # the fast path looks nothing up: with it on and off the runs are the same, step for step.
    w = generate_workload(_spec(duration=5.0))
    model = dataclasses.replace(MODEL, new_size_step_s=2e-3, step_size_cache=16)
    fast = simulate(w, TIGHT, model, keep_records=True, record_batches=True)
    slow = simulate(w, TIGHT, model, keep_records=True, record_batches=True, fast_path=False)
    assert fast.batches == slow.batches
    np.testing.assert_array_equal(fast.step_time, slow.step_time)
    new = _expected_new_size_charges(fast, 16)
    assert 0 < new.sum() < len(new)
    assert fast.step_time.sum() > simulate(w, TIGHT, MODEL, keep_records=True).step_time.sum()


def test_new_size_term_off_leaves_results_bit_identical() -> None:
    # The term needs both a price and a cache: with either 0 every step time, and so every figure, is the same.
    w = generate_workload(_spec(duration=5.0))
    base = simulate(w, TIGHT, MODEL, keep_records=True)
    for off in (
        dataclasses.replace(MODEL, new_size_step_s=5e-3),
        dataclasses.replace(MODEL, step_size_cache=32),
    ):
        res = simulate(w, TIGHT, off, keep_records=True)
        np.testing.assert_array_equal(res.step_time, base.step_time)
        got, want = summarize(res), summarize(base)
        for d in (got, want):
            del d["overall"]["wall_s"], d["overall"]["sim_speed"]  # the run's own speed
        np.testing.assert_equal(got, want)
    on = simulate(w, TIGHT, dataclasses.replace(MODEL, new_size_step_s=5e-3, step_size_cache=32), keep_records=True)
    assert on.step_time.sum() > base.step_time.sum()


def test_warm_step_size_cache_starts_with_the_sizes_run_before() -> None:
    # 5, 7, 5, 9 run before: a cache of 2 holds 5 and 9 (7 left it), so 9 and 5 are not new, 7 is.
    cache = StepSizeCache(2, warm=[5, 7, 5, 9])
    assert cache.sizes() == [5, 9] and cache.num_new == 0  # the warm sizes are not counted
    assert [cache.new(s) for s in (9, 5, 7, 9)] == [False, False, True, True]
    assert cache.num_new == 2
    assert StepSizeCache(2).sizes() == [] and len(StepSizeCache(3, (4, 4, 4))) == 1
    history = [3, 8, 3, 1, 8, 8, 2, 6, 1, 3]
    assert recent_step_sizes(history) == [8, 2, 6, 1, 3]
    for capacity in range(1, 7):  # the distinct recent sizes rebuild the cache of any capacity
        assert StepSizeCache(capacity, recent_step_sizes(history)).sizes() == StepSizeCache(capacity, history).sizes()
    later = [1, 2, 9, 8, 3]
    assert new_size_flags(later, 3, history).tolist() == [False, True, True, True, True]
    assert new_size_flags(later, 5, history).tolist() == [False, False, True, True, False]  # 9 evicts 8
    assert new_size_flags(later, 3).tolist() == [True] * 5  # no history: every size new, as before
    assert new_size_flags(later, 0, history).tolist() == [False] * 5


@pytest.mark.parametrize("bad", [[0], [4, -1], [2.0], ["3"], [True], [None], "12", 5, {1: 2}])
def test_warm_step_sizes_bad_input_is_a_value_error(bad: Any) -> None:
    w = generate_workload(_spec(duration=1.0))
    on = dataclasses.replace(MODEL, new_size_step_s=1e-3, step_size_cache=8)
    with pytest.raises(ValueError, match="warm step sizes"):
        StepSizeCache(8, bad)
    for model in (on, MODEL):  # checked with the term off too
        with pytest.raises(ValueError, match="warm step sizes"):
            simulate(w, TIGHT, model, warm_step_sizes=bad)
    with pytest.raises(ValueError, match="warm step sizes"):
        run_sweep(_spec(duration=1.0), step_model=on, axes=parse_set(["num_blocks=160"]), warm_step_sizes=bad)
    assert simulate(w, TIGHT, on, warm_step_sizes=np.array([3, 4], dtype=np.int32)).num_steps > 0  # numpy ints


def _far_apart_workload(n: int = 30) -> Workload:
    rng = np.random.default_rng(7)
    return _plain_workload(
        100.0 * np.arange(n), rng.choice([40, 90, 300, 700], size=n), rng.integers(2, 12, size=n), seed=7
    )


@pytest.mark.parametrize("capacity", [4, 32])
def test_warm_step_sizes_make_a_size_run_before_not_new(capacity: int) -> None:
    # Each request alone, so the schedule does not depend on step times: the only difference between a cold and a
    # warm run is which steps the new-size term charges, by the sizes run before and then the run's own.
    w = _far_apart_workload()
    c = 4e-3
    priced = dataclasses.replace(MODEL, new_size_step_s=c, step_size_cache=capacity)
    base = simulate(w, TIGHT, MODEL, record_batches=True, keep_records=True)
    sizes = base.step_num_tokens.tolist()
    cold = simulate(w, TIGHT, priced, record_batches=True, keep_records=True)
    assert cold.extra["num_new_size_steps"] > 0 and "num_new_size_steps" not in base.extra
    # Warm with exactly the run's first prefill size (most recent): that step is no longer new, the rest as before.
    first = sizes[0]
    one = simulate(w, TIGHT, priced, record_batches=True, keep_records=True, warm_step_sizes=[first])
    assert one.batches == base.batches
    want = new_size_flags(sizes, capacity, [first]).astype(np.float64)
    assert want[0] == 0 and new_size_flags(sizes, capacity)[0]
    np.testing.assert_allclose(one.step_time - base.step_time, c * want, rtol=0, atol=1e-15)
    assert one.extra["num_new_size_steps"] == int(want.sum()) == cold.extra["num_new_size_steps"] - 1
    # Warm with a history ending in every size the run meets: none is new while they all fit the cache.
    distinct = sorted(set(sizes))
    warm = simulate(w, TIGHT, priced, keep_records=True, warm_step_sizes=[1, 2, 3, *distinct])
    expect = new_size_flags(sizes, capacity, [1, 2, 3, *distinct]).astype(np.float64)
    np.testing.assert_allclose(warm.step_time - base.step_time, c * expect, rtol=0, atol=1e-15)
    assert (expect.sum() == 0) == (len(distinct) <= capacity)
    assert warm.step_time.sum() < cold.step_time.sum()


def test_warm_step_sizes_unset_or_empty_leaves_results_bit_identical() -> None:
    w = generate_workload(_spec(duration=5.0))
    priced = dataclasses.replace(MODEL, new_size_step_s=2e-3, step_size_cache=16)
    base = simulate(w, TIGHT, priced, keep_records=True, record_batches=True)
    for warm in (None, [], ()):
        res = simulate(w, TIGHT, priced, keep_records=True, record_batches=True, warm_step_sizes=warm)
        assert res.batches == base.batches and res.extra == base.extra
        for name in ("step_start", "step_time", "step_num_tokens", "sched_idx", "sched_num_tokens", "token_idx"):
            np.testing.assert_array_equal(getattr(res, name), getattr(base, name), err_msg=name)
    # The term off: warm sizes change nothing.
    off = simulate(w, TIGHT, MODEL, keep_records=True)
    np.testing.assert_array_equal(simulate(w, TIGHT, MODEL, keep_records=True, warm_step_sizes=[5, 6]).step_time,
                                  off.step_time)  # fmt: skip
    # Under load, warm sizes change the prices and the fast path still matches the slow one.
    sizes = base.step_num_tokens[:50].tolist()
    fast = simulate(w, TIGHT, priced, keep_records=True, record_batches=True, warm_step_sizes=sizes)
    slow = simulate(w, TIGHT, priced, keep_records=True, record_batches=True, warm_step_sizes=sizes, fast_path=False)
    np.testing.assert_array_equal(fast.step_time, slow.step_time)
    assert fast.extra["num_new_size_steps"] < base.extra["num_new_size_steps"]


def test_parse_warm_step_sizes(tmp_path: Path) -> None:
    assert parse_warm_step_sizes("1:3,7, 5") == (1, 2, 3, 7, 5)
    assert parse_warm_step_sizes("64") == (64,)
    for bad in ("3:1", "0", "x", "1:", "", "1,,2", "-2", "1:2000000"):
        with pytest.raises(ValueError):
            parse_warm_step_sizes(bad)
    listed = tmp_path / "sizes.json"
    listed.write_text("[4, 9, 4]")
    assert parse_warm_step_sizes(str(listed)) == (4, 9, 4)
    model = dataclasses.replace(MODEL, new_size_step_s=1e-3, step_size_cache=8)
    cal = model.save(tmp_path / "cal.json", extra={"recent_step_sizes": [12, 30, 7]})
    assert parse_warm_step_sizes("calibration", cal) == (12, 30, 7)
    assert parse_warm_step_sizes(str(cal)) == (12, 30, 7)
    plain = model.save(tmp_path / "plain.json")
    for spec, step_model in (("calibration", plain), ("calibration", "llama-3.1-8b-h100"), ("calibration", None),
                             (str(tmp_path / "none.json"), None), (str(listed), None)):  # fmt: skip
        if step_model is None and spec.endswith("sizes.json"):
            listed.write_text('[4, "9"]')
        with pytest.raises(ValueError):
            parse_warm_step_sizes(spec, step_model)


def test_cli_warm_step_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsched.cli import main

    model = dataclasses.replace(MODEL, new_size_step_s=5e-3, step_size_cache=256, name="sized")
    cal = model.save(tmp_path / "cal.json", extra={"recent_step_sizes": list(range(1, 257))})
    base = ["simulate", "--rate", "4", "--duration", "5", "--prompt-len", "uniform:20:200", "--output-len", "4",
            "--set", "num_blocks=400", "--step-model", str(cal), "--no-progress", "--jobs", "1"]  # fmt: skip

    def ttft(out: str, *extra: str) -> float:
        assert main([*base, "--out", str(tmp_path / out), *extra]) == 0
        return float(json.loads((tmp_path / out / "sim.json").read_text())["runs"][0]["overall"]["ttft"]["mean"])

    cold = ttft("cold")
    # Every size up to 256 run before: no prefill of up to 200 tokens pays for a new size.
    assert ttft("cal", "--warm-step-sizes", "calibration") < cold
    assert ttft("range", "--warm-step-sizes", "1:256") == ttft("cal2", "--warm-step-sizes", "calibration")
    for out, extra in (("fleet_cold", []), ("fleet_warm", ["--warm-step-sizes", "1:256"])):
        assert main([*base, "--out", str(tmp_path / out), "--replicas", "1", *extra]) == 0
    fleet = [json.loads((tmp_path / out / "cluster.json").read_text())["runs"][0]["fleet"]["overall"]["ttft"]["mean"]
             for out in ("fleet_cold", "fleet_warm")]  # fmt: skip
    assert fleet[1] < fleet[0]
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "x"), "--warm-step-sizes", "0:3"]) == 2
    assert "--warm-step-sizes" in capsys.readouterr().err
    preset = ["simulate", "--duration", "1", "--no-progress", "--out", str(tmp_path / "y")]
    assert main([*preset, "--warm-step-sizes", "1:8"]) == 2
    assert "no new-size term" in capsys.readouterr().err
    assert main([*preset, "--validate", "--model", str(tmp_path), "--warm-step-sizes", "1:8"]) == 2


def test_attention_hinge_prices_each_chunk_past_its_threshold() -> None:
    w = generate_workload(_spec(duration=5.0))
    a = MODEL.prefill_attn_s
    base = simulate(w, TIGHT, MODEL, keep_records=True)
    # A hinge at 0 pairs charges every pair twice: the same as doubling prefill_attn_s.
    hinge0 = simulate(
        w, TIGHT, dataclasses.replace(MODEL, prefill_attn_spill_s=a, attn_spill_pairs=0.0), keep_records=True
    )
    doubled = simulate(w, TIGHT, dataclasses.replace(MODEL, prefill_attn_s=2 * a), keep_records=True)
    np.testing.assert_allclose(hinge0.step_time, doubled.step_time, rtol=1e-12)
    assert hinge0.step_time.sum() > base.step_time.sum()
    # A threshold above every chunk charges nothing.
    never = simulate(
        w, TIGHT, dataclasses.replace(MODEL, prefill_attn_spill_s=1.0, attn_spill_pairs=1e12), keep_records=True
    )
    np.testing.assert_array_equal(never.step_time, base.step_time)
