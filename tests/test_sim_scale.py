"""``kvsched.sim`` at scale: workloads drawn a chunk at a time are the same requests, deferred FCFS arrivals make
the same decisions, streamed metrics equal the figures rebuilt from the raw record (exactly below the exact limit,
within the sketch's stated error above it), per-request rows stream to a file, and sweeps give the same results
in worker processes and on Ray as in one process."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched.sim import (
    PRESETS,
    WorkloadSpec,
    generate_workload,
    parse_length,
    parse_priorities,
    parse_tenants,
    request_records,
    simulate,
    summarize,
    tenant_service,
)
from kvsched.sim.metrics import REQUEST_COLUMNS
from kvsched.sim.sketch import RELATIVE_ACCURACY, Quantiles
from kvsched.sim.sweep import parse_set, run_sweep
from kvsched.sim.workload import Workload, WorkloadStream, _gaps

MODEL = PRESETS["llama-3.1-8b-h100"]
TIGHT = {"num_blocks": 160, "block_size": 16, "max_num_batched_tokens": 256, "max_model_len": 2048}


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


def _one_draw_per_segment(spec: WorkloadSpec, max_model_len: int | None) -> Workload:
    """The workload drawn the plain way: each segment of the random stream in one call over all requests."""
    rng = np.random.default_rng(spec.seed)
    if spec.num_requests is not None:
        times = np.cumsum(_gaps(rng, spec.num_requests, spec.arrival, spec.cv)) / spec.rate
    else:
        expected = spec.duration * spec.rate
        blocks, total = [], 0.0
        while total < expected:
            gaps = _gaps(rng, int(expected + 6 * math.sqrt(expected) * max(1.0, spec.cv) + 16), spec.arrival, spec.cv)
            blocks.append(gaps)
            total += float(gaps.sum())
        times = np.cumsum(np.concatenate(blocks)) / spec.rate
        times = times[times < spec.duration]
    n = len(times)
    times = times - times[0] if n else times
    shares = np.array([t.share for t in spec.tenants])
    tenant = rng.choice(len(spec.tenants), size=n, p=shares / shares.sum()).astype(np.int64)
    values = np.array([v for v, _ in spec.priorities], dtype=np.int64)
    fracs = np.array([f for _, f in spec.priorities])
    priority = values[rng.choice(len(values), size=n, p=fracs / fracs.sum())]
    for i, t in enumerate(spec.tenants):
        if t.priority is not None:
            priority[tenant == i] = t.priority
    prompt_len = spec.prompt_len.sample(rng, n)
    if max_model_len is not None:
        prompt_len = np.minimum(prompt_len, max_model_len - 1)
    output_len = spec.output_len.sample(rng, n)
    group = np.full(n, -1, dtype=np.int64)
    plen = np.zeros(n, dtype=np.int64)
    if spec.num_prefix_groups > 0 and spec.prefix_len > 0 and spec.prefix_fraction > 0:
        shared = rng.random(n) < spec.prefix_fraction
        group[shared] = rng.integers(0, spec.num_prefix_groups, size=int(shared.sum()))
        plen[shared] = np.minimum(spec.prefix_len, prompt_len[shared] - 1)
    names = tuple(t.name for t in spec.tenants)
    return Workload(times, prompt_len, output_len, tenant, priority, group, plen, names, (1.0,) * len(names))


@pytest.mark.parametrize(
    "spec",
    [
        _spec(),
        _spec(rate=50.0, num_requests=3001, arrival="gamma", cv=3.0, prompt_len=parse_length("uniform:10:900")),
        _spec(tenants=parse_tenants("a:1"), priorities=parse_priorities("0:1"), num_prefix_groups=0),
        _spec(duration=0.001),
    ],
)
def test_a_workload_drawn_in_chunks_is_the_same_requests_as_one_draw_per_segment(spec: WorkloadSpec) -> None:
    for max_model_len in (None, 400):
        plain = _one_draw_per_segment(spec, max_model_len)
        stream = WorkloadStream(spec, max_model_len=max_model_len)
        chunks = list(stream.chunks(97))
        assert [start for start, _ in chunks] == list(range(0, len(plain), 97))
        whole = generate_workload(spec, max_model_len=max_model_len)
        for name in ("arrival_time", "prompt_len", "output_len", "tenant", "priority", "prefix_group", "prefix_len"):
            expected = getattr(plain, name)
            got = np.concatenate([getattr(w, name) for _, w in chunks]) if chunks else expected[:0]
            np.testing.assert_array_equal(got, expected, err_msg=name)
            np.testing.assert_array_equal(getattr(whole, name), expected, err_msg=name)
        assert len(stream) == len(plain)
        assert stream.last_arrival == (plain.arrival_time[-1] if len(plain) else 0.0)
        assert stream.max_prompt_len == (int(plain.prompt_len.max()) if len(plain) else 0)
        assert stream.num_clipped_prompts == whole.num_clipped_prompts


@requires_rust
@pytest.mark.parametrize("extra", [{}, {"cache_aware_admission_window": 8}, {"max_num_seqs": 4}])
def test_deferred_fcfs_arrivals_make_the_same_decisions(extra: dict[str, Any]) -> None:
    # Overloaded: the queue grows to hundreds of requests, far past what the scheduler is given at once.
    w = generate_workload(_spec(rate=60.0, duration=15.0, tenants=parse_tenants("a:1")))
    cfg = {**TIGHT, "max_num_seqs": 8, **extra}
    runs = [simulate(w, cfg, MODEL, record_batches=True, defer_arrivals=d) for d in (True, False)]
    deferred, plain = runs
    assert deferred.extra["deferred_arrivals"] and not plain.extra["deferred_arrivals"]
    assert (
        deferred.extra["max_in_scheduler"] <= 2 * cfg["max_num_seqs"] + cfg.get("cache_aware_admission_window", 0) + 1
    )
    assert plain.extra["max_in_scheduler"] > 4 * deferred.extra["max_in_scheduler"]
    assert deferred.batches == plain.batches
    np.testing.assert_array_equal(deferred.timeseries["num_waiting"], plain.timeseries["num_waiting"])
    a, b = (summarize(r, slo_ttft=5.0) for r in runs)
    for s in (a, b):
        s["overall"].pop("wall_s")
        s["overall"].pop("sim_speed")
    assert a == b
    # With a horizon the requests still waiting outside the scheduler are reported as waiting, unfinished.
    cut_runs = [simulate(w, cfg, MODEL, horizon=8.0, defer_arrivals=d) for d in (True, False)]
    assert cut_runs[0].final_stats == cut_runs[1].final_stats
    cut = [summarize(r) for r in cut_runs]
    for s in cut:
        s["overall"].pop("wall_s")
        s["overall"].pop("sim_speed")
    assert cut[0] == cut[1] and cut[0]["overall"]["num_unfinished"] > 100


def _within_sketch_error(value: float, exact: np.ndarray, q: float) -> bool:
    """``value`` is within the sketch's relative accuracy of an order statistic next to quantile ``q``."""
    v = np.sort(exact)
    rank = q * (len(v) - 1)
    lo, hi = v[math.floor(rank)], v[math.ceil(rank)]
    return bool(lo * (1 - RELATIVE_ACCURACY) - 1e-12 <= value <= hi * (1 + RELATIVE_ACCURACY) + 1e-12)


def test_quantiles_are_exact_below_the_limit_and_within_the_stated_error_above_it() -> None:
    rng = np.random.default_rng(1)
    values = rng.lognormal(-3, 1.5, size=5000)
    values[:50] = 0.0
    exact = Quantiles(exact_limit=10_000)
    sketched = Quantiles(exact_limit=1000)
    weighted = Quantiles(exact_limit=1000)
    for chunk in np.array_split(values, 7):
        exact.add(chunk)
        sketched.add(chunk)
    # Weighted values: each distinct value once, with its count.
    uniq, counts = np.unique(np.round(values, 3), return_counts=True)
    weighted.add(uniq, counts)
    assert exact.exact and not sketched.exact and not weighted.exact
    pcts = (50, 90, 99)
    s = exact.summary(pcts)
    for p in pcts:
        assert s[f"p{p}"] == np.percentile(values, p)
    for acc, ref in ((sketched, values), (weighted, np.repeat(uniq, counts))):
        assert acc.count == len(ref) and acc.sum == pytest.approx(ref.sum()) and acc.max == ref.max()
        for q in (0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0):
            assert _within_sketch_error(float(acc.quantiles([q])[0]), ref, q), q
    merged = Quantiles(exact_limit=1000)
    merged.merge(sketched)
    merged.merge(exact)
    assert merged.count == 2 * len(values)
    assert _within_sketch_error(float(merged.quantiles([0.9])[0]), np.concatenate([values, values]), 0.9)
    with pytest.raises(ValueError, match="no longer kept"):
        sketched.values()


@requires_rust
def test_streamed_metrics_equal_the_record_exactly_and_the_sketch_within_its_error() -> None:
    w = generate_workload(_spec(rate=20.0, duration=20.0))
    cfg = {**TIGHT, "policy": "priority"}
    res = simulate(w, cfg, MODEL, keep_records=True, slo_ttft=3.0, slo_tpot=0.05)
    rec = request_records(res)
    s = summarize(res, rec, slo_ttft=3.0, slo_tpot=0.05)
    small = simulate(w, cfg, MODEL, exact_limit=64, slo_ttft=3.0, slo_tpot=0.05)
    t = summarize(small, slo_ttft=3.0, slo_tpot=0.05)
    itl_groups = np.repeat(np.arange(len(w)), np.diff(rec.itl_indptr))
    groups = [("overall", s["overall"], t["overall"], rec.added)]
    groups += [(f"tenant {i}", s["tenants"][i], t["tenants"][i], rec.tenant == i) for i in range(w.num_tenants)]
    groups += [
        (f"priority {p['priority']}", p, q, rec.priority == p["priority"])
        for p, q in zip(s["priorities"], t["priorities"], strict=True)
    ]
    for name, exact, sketched, mask in groups:
        for key in ("num_requests", "num_finished", "num_good", "num_preemptions", "num_recomputed_tokens",
                    "num_output_tokens"):  # fmt: skip
            assert exact[key] == sketched[key], (name, key)
        for metric in ("ttft", "tpot", "e2e", "queue_delay", "itl"):
            v = rec.itl[mask[itl_groups]] if metric == "itl" else getattr(rec, metric)[mask]
            v = v[np.isfinite(v)]
            assert exact[metric]["p50"] == np.percentile(v, 50), (name, metric)
            assert exact[metric]["p99"] == np.percentile(v, 99), (name, metric)
            assert exact[metric]["mean"] == pytest.approx(v.mean()) == sketched[metric]["mean"]
            assert exact[metric]["max"] == v.max() == sketched[metric]["max"]
            for p in (50, 90, 99):
                assert _within_sketch_error(sketched[metric][f"p{p}"], v, p / 100), (name, metric, p)
    assert s["fairness"] == t["fairness"]
    # Goodput for other SLOs: from the kept (TTFT, TPOT) pairs below the limit; refused above it.
    other = summarize(res, slo_ttft=1.0)
    fin = rec.finished
    assert other["overall"]["num_good"] == int((fin & (rec.ttft <= 1.0)).sum())
    with pytest.raises(ValueError, match="counted goodput"):
        summarize(small, slo_ttft=1.0)


@requires_rust
def test_fairness_windows_stream_the_same_sums_and_coarsen_past_their_limit() -> None:
    w = generate_workload(_spec(rate=40.0, duration=6.0))
    res = simulate(w, TIGHT, MODEL, window=0.5, keep_records=True)
    rec = request_records(res)
    svc = tenant_service(res, 0.5, rec)
    streamed = res.metrics.service if res.metrics is not None else None
    assert streamed is not None
    np.testing.assert_allclose(streamed["service"], svc["service"])
    np.testing.assert_allclose(streamed["queue"], svc["queue"], atol=1e-9)
    # A window so small that the run would need more than MAX_WINDOWS: pairs merge, the sums stay.
    tiny = simulate(w, TIGHT, MODEL, window=1e-4, keep_records=True)
    assert tiny.metrics is not None and tiny.metrics.service is not None
    width = tiny.metrics.service["window"]
    assert width > 1e-4 and math.log2(width / 1e-4) == pytest.approx(round(math.log2(width / 1e-4)))
    ref = tenant_service(tiny, width, request_records(tiny))
    assert len(tiny.metrics.service["service"]) <= 4096
    np.testing.assert_allclose(tiny.metrics.service["service"].sum(axis=0), ref["service"].sum(axis=0))
    np.testing.assert_allclose(tiny.metrics.service["queue"].sum(axis=0), ref["queue"].sum(axis=0), rtol=1e-9)


@requires_rust
def test_per_request_rows_stream_to_a_file_and_equal_the_record(tmp_path: Path) -> None:
    from kvsched.sim.point import RequestCsvWriter

    w = generate_workload(_spec(rate=30.0, duration=10.0))
    path = tmp_path / "requests.csv"
    sink = RequestCsvWriter(path, w.tenant_names)
    res = simulate(w, TIGHT, MODEL, horizon=6.0, request_sink=sink, keep_records=True)
    sink.close()
    rec = request_records(res)
    with path.open() as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["idx"]))
    assert [int(r["idx"]) for r in rows] == list(range(len(w)))
    cols = rec.columns()
    for name in REQUEST_COLUMNS:
        expected = np.asarray(cols[name]).tolist()
        if name == "tenant":
            expected = [w.tenant_names[t] for t in expected]
        got = [r[name] for r in rows]
        for g, e in zip(got, expected, strict=True):
            if isinstance(e, float):
                assert (g == "" and not math.isfinite(e)) or float(g) == pytest.approx(e, rel=1e-12), name
            elif isinstance(e, bool):
                assert g == str(e), name
            else:
                assert g == str(e), name
    added = rec.added
    assert added.sum() < len(w) and (rec.added & ~rec.finished).sum() > 0  # some unfinished, some never arrived


def _comparable(runs: list[Any]) -> list[Any]:
    """The runs' summaries without their wall-clock figures, NaN as a string (NaN != NaN after pickling)."""

    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in ("wall_s", "sim_speed")}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return "nan" if isinstance(x, float) and math.isnan(x) else x

    return [clean(r.summary) for r in runs]


@requires_rust
def test_a_sweep_in_worker_processes_gives_the_serial_results() -> None:
    kw: dict[str, Any] = {
        "rates": [5.0, 15.0],
        "policies": ["fcfs", "priority"],
        "axes": parse_set(["num_blocks=160,400"]),
        "base_config": {k: v for k, v in TIGHT.items() if k != "num_blocks"},
        "step_model": MODEL,
        "slo_ttft": 1.0,
    }
    spec = _spec(duration=5.0)
    serial = run_sweep(spec, **kw)
    parallel = run_sweep(spec, jobs=2, **kw)
    assert [r.run_id for r in parallel] == [r.run_id for r in serial]
    assert _comparable(parallel) == _comparable(serial)
    for a, b in zip(serial, parallel, strict=True):
        assert a.ttft_cdf == b.ttft_cdf
        np.testing.assert_array_equal(a.service["service"], b.service["service"])


@pytest.mark.ray
@requires_rust
def test_a_sweep_on_a_local_ray_cluster_gives_the_serial_results() -> None:
    ray = pytest.importorskip("ray")
    kw: dict[str, Any] = {
        "rates": [5.0, 15.0],
        "policies": ["fcfs", "priority"],
        "base_config": TIGHT,
        "step_model": MODEL,
    }
    spec = _spec(duration=4.0)
    serial = run_sweep(spec, **kw)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_sweep(spec, ray=True, **kw)
    finally:
        ray.shutdown()
    assert [r.run_id for r in on_ray] == [r.run_id for r in serial]
    assert _comparable(on_ray) == _comparable(serial)


@requires_rust
def test_worker_processes_report_every_run_to_the_one_progress_display(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    import kvsched.sim.sweep as sweep
    from kvsched.sim.progress import SimProgress

    stream = io.StringIO()
    monkeypatch.setattr(sweep, "SimProgress", lambda n: SimProgress(n, stream=stream))
    runs = run_sweep(_spec(duration=4.0), rates=[5.0, 15.0], policies=["fcfs", "priority"], base_config=TIGHT,
                     step_model=MODEL, progress=True, jobs=2)  # fmt: skip
    lines = stream.getvalue().splitlines()
    assert lines[0] == "simulate: 4 runs"
    assert sorted(line.split(":")[0].split(" ", 2)[2] for line in lines[1:]) == sorted(r.run_id for r in runs)
    assert [line.split(" ")[1] for line in lines[1:]] == ["1/4", "2/4", "3/4", "4/4"]
    for r in runs:
        line = next(x for x in lines[1:] if f" {r.run_id}:" in x)
        assert f"{r.summary['overall']['num_requests']}/" in line
