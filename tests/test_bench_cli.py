"""`kvsched bench` and its parts: workloads, traces, the harness, the JSON report and the plot.

These tests check that the benchmark machinery works and is deterministic; they never assert timings.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import types
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvsched import InvalidConfigError
from kvsched.bench.harness import ImplUnavailableError, make_driver, run_scaling, run_workload
from kvsched.bench.report import build_document, scaling_summary
from kvsched.bench.trace import TraceFormatError, dump_trace, load_trace
from kvsched.bench.workloads import (
    SCENARIOS,
    Scenario,
    Workload,
    generate,
    get_scenario,
    req_id,
    sampled_token,
    sampled_tokens,
)
from kvsched.cli import main
from kvsched.config import SchedulerConfig

SMALL = 0.02


def _available(impl: str) -> bool:
    try:
        make_driver(impl, SchedulerConfig(num_blocks=1024))
    except ImplUnavailableError:
        return False
    return True


IMPLS = [
    pytest.param(name, marks=pytest.mark.skipif(not _available(name), reason=f"{name} scheduler not available"))
    for name in ("rust", "reference")
]


def _any_impl() -> str:
    for name in ("rust", "reference"):
        if _available(name):
            return name
    pytest.skip("no scheduler implementation is available")


def _same_workload(x: Workload, y: Workload) -> bool:
    if x.scenario != y.scenario or len(x.requests) != len(y.requests):
        return False
    for a, b in zip(x.requests, y.requests, strict=True):
        if (a.idx, a.arrival_step, a.priority, a.max_tokens) != (
            b.idx,
            b.arrival_step,
            b.priority,
            b.max_tokens,
        ):
            return False
        if a.prompt_token_ids.dtype != b.prompt_token_ids.dtype:
            return False
        if not np.array_equal(a.prompt_token_ids, b.prompt_token_ids):
            return False
    return True


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_workload_generation_is_deterministic(name: str) -> None:
    scenario = get_scenario(name).scaled(SMALL)
    assert _same_workload(generate(scenario), generate(scenario))


def test_workloads_follow_their_recipe() -> None:
    a = generate(get_scenario("a"))
    assert len(a.requests) == 256
    assert {len(r.prompt_token_ids) for r in a.requests} == {512}
    assert {r.max_tokens for r in a.requests} == {256}
    assert {r.arrival_step for r in a.requests} == {0}

    c = generate(get_scenario("c").scaled(0.1))
    arrivals = [r.arrival_step for r in c.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    # Poisson arrivals at one request per step: about as many steps as requests.
    assert 0.7 * len(arrivals) < arrivals[-1] < 1.3 * len(arrivals)
    lens = [len(r.prompt_token_ids) for r in c.requests]
    assert min(lens) >= 200 and max(lens) <= 4000 + 2048
    assert all(32 <= r.max_tokens <= 512 for r in c.requests)
    # Half the prompts start with one of 8 shared prefixes (>= 256 tokens): count distinct 256-token heads.
    heads = {r.prompt_token_ids[:256].tobytes() for r in c.requests}
    assert len(heads) < 0.75 * len(c.requests)
    assert all(r.max_tokens >= 1 for r in c.requests)


def test_d_and_e_replay_the_prompts_of_c() -> None:
    c, d, e = (generate(get_scenario(n).scaled(SMALL)) for n in "cde")
    for x in (d, e):
        assert [r.prompt_token_ids.tobytes() for r in x.requests] == [r.prompt_token_ids.tobytes() for r in c.requests]
    assert d.scenario.config.num_blocks < c.scenario.config.num_blocks
    assert {r.priority for r in e.requests} == {0, 1, 2, 3}
    assert e.scenario.config.policy == "priority"


def test_scaling_shrinks_counts_but_keeps_progress_possible() -> None:
    d = get_scenario("d")
    small = d.scaled(0.01)
    assert small.num_requests == 20
    assert small.config.num_blocks >= small.min_num_blocks()
    assert small.scale == 0.01 and d.scaled(1.0) == d


def test_a_scenario_holds_a_scheduler_config() -> None:
    e = get_scenario("e")
    assert e.scheduler_config() is e.config
    assert (e.config.policy, e.config.num_blocks, e.config.prefix_hash_seed) == ("priority", 6000, 0)
    # Config-field keywords override the held config, as `kvsched bench --policy` applies them; the config's
    # fields read through the scenario too.
    fcfs = replace(e, name="e2", policy="fcfs")
    assert fcfs == replace(e.with_config(policy="fcfs"), name="e2") and fcfs.policy == "fcfs"
    assert fcfs.num_priorities == 4 and fcfs.config.num_blocks == 6000
    with pytest.raises(TypeError, match="no_such_field"):
        replace(e, no_such_field=1)
    with pytest.raises(InvalidConfigError, match="fcfs"):
        replace(e, cache_aware_admission_window=4)
    with pytest.raises(AttributeError, match="no_such_field"):
        _ = e.no_such_field


def test_a_scenario_dict_round_trips_with_its_whole_config() -> None:
    sc = get_scenario("g").with_config(async_scheduling=True, tenant_weights={"t0": 2.0}).scaled(0.1)
    data = json.loads(json.dumps(sc.to_dict()))
    assert Scenario.from_dict(data) == sc
    assert {f.name for f in fields(SchedulerConfig)} <= set(data)
    # A flat dict of only some config fields (a trace header with fewer fields) takes the rest from BENCH_CONFIG.
    short = {k: v for k, v in get_scenario("f").to_dict().items() if k not in ("async_scheduling", "watermark")}
    assert Scenario.from_dict(short) == get_scenario("f")


def test_sampled_tokens_match_the_scalar_formula() -> None:
    idx = np.array([0, 1, 7, 1999], dtype=np.int64)
    pos = np.array([0, 5, 255, 511], dtype=np.int64)
    got = sampled_tokens(idx, pos)
    assert got.dtype == np.int64
    assert got.tolist() == [sampled_token(int(i), int(p)) for i, p in zip(idx, pos, strict=True)]
    assert sampled_token(0, 0) == 3 + 12345 % (32000 - 3)


def test_request_ids_sort_like_their_index() -> None:
    assert sorted([req_id(10), req_id(9), req_id(100)]) == [req_id(9), req_id(10), req_id(100)]


@pytest.mark.parametrize("name", ["a", "e"])
def test_trace_dump_then_load_round_trips(tmp_path: Path, name: str) -> None:
    workload = generate(get_scenario(name).scaled(SMALL))
    path = dump_trace(workload, tmp_path / "sub" / f"{name}.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["vocab"] == 32000 and header["scenario"]["name"] == name
    assert set(json.loads(lines[1])) == {"idx", "arrival_step", "priority", "max_tokens", "prompt_token_ids"}
    assert _same_workload(load_trace(path), workload)


def test_malformed_trace_is_rejected_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    header = json.dumps({"scenario": get_scenario("a").to_dict(), "vocab": 32000})
    path.write_text(header + '\n{"idx": 0, "arrival_step": 0}\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2"):
        load_trace(path)
    path.write_text("not json\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1"):
        load_trace(path)
    path.write_text(header + "\n[1, 2]\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: each line must be a JSON object"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_bench_and_simulator_traces_share_one_error_type() -> None:
    from kvsched.sim import TraceFormatError as SimTraceFormatError

    assert SimTraceFormatError is TraceFormatError and issubclass(TraceFormatError, ValueError)


@pytest.mark.parametrize("impl", IMPLS)
def test_harness_runs_a_workload_to_completion(impl: str) -> None:
    workload = generate(get_scenario("d").scaled(SMALL))
    result = run_workload(impl, workload, warmup_steps=5)
    assert result.num_steps == len(result.schedule_ns) == len(result.update_ns) == len(result.num_running_reqs)
    # Every request got every token it asked for.
    assert result.num_output_tokens == workload.total_output_tokens()
    assert result.num_scheduled_tokens.sum() >= workload.total_prompt_tokens() - result.counters.prefix_cache_hits
    assert (result.schedule_ns > 0).all() and (result.update_ns > 0).all()
    assert len(result.add_request_ns) == len(workload.requests)


def test_rust_and_reference_schedule_the_same_trace_identically() -> None:
    if not (_available("rust") and _available("reference")):
        pytest.skip("needs both the Rust scheduler and the reference")
    workload = generate(get_scenario("e").scaled(SMALL))
    rust = run_workload("rust", workload, warmup_steps=0)
    ref = run_workload("reference", workload, warmup_steps=0)
    assert (rust.num_steps, rust.digest) == (ref.num_steps, ref.digest)
    assert rust.counters == ref.counters


@pytest.mark.parametrize("impl", IMPLS)
def test_scaling_harness_runs(impl: str) -> None:
    points = run_scaling(impl, sizes=[4, 16], num_steps=5)
    assert [p.num_running for p in points] == [4, 16]
    assert all(p.num_steps == 5 or p.num_steps >= 5 for p in points)
    summary = scaling_summary(points)[impl]
    assert len(summary["points"]) == 2 and "loglog_slope" in summary


def test_bench_quick_writes_json_with_every_figure(tmp_path: Path) -> None:
    impl = _any_impl()
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    argv = ["bench", "--quick", "--workloads", "a", "--impl", impl, "--json", str(out), "--markdown", str(md)]
    assert main([*argv, "--no-progress"]) == 0
    assert "| a | " + impl in md.read_text()
    doc = json.loads(out.read_text())
    assert {"schema_version", "machine", "results", "ratios", "scaling"} <= set(doc)
    assert doc["machine"]["cpu_model"]
    (res,) = doc["results"]
    assert res["workload"] == "a" and res["impl"] == impl
    for key in ("schedule_us", "update_us", "total_us"):
        assert set(res[key]) >= {"median", "p99", "max"}
        assert 0 < res[key]["median"] <= res[key]["p99"] <= res[key]["max"]
    for key in (
        "steps_per_s",
        "num_preemptions",
        "prefix_cache_hit_rate",
        "peak_rss_mib",
        "num_steps",
        "schedule_digest",
    ):
        assert key in res
    assert res["num_steps"] == 256  # prompt in one step (13 x 512 tokens fit the budget), then 255 decodes


def test_bench_cold_reports_its_memory_and_schedules_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    impl = _any_impl()
    docs = {}
    for cold in ("0", "2.5"):
        out = tmp_path / f"cold{cold}.json"
        md = tmp_path / f"cold{cold}.md"
        argv = ["bench", "--quick", "-w", "a", "--impl", impl, "--cold", cold, "--json", str(out)]
        assert main([*argv, "--markdown", str(md), "--no-progress"]) == 0
        docs[cold] = (json.loads(out.read_text())["results"][0], capsys.readouterr().out, md.read_text())
    (tight, tight_table, tight_md), (cold_res, cold_table, cold_md) = docs["0"], docs["2.5"]
    assert (tight["cold_mb"], cold_res["cold_mb"]) == (0.0, 2.5)
    assert tight["schedule_digest"] == cold_res["schedule_digest"]  # only the caches differ
    assert "cold MB" not in tight_table and "cold MB" not in tight_md
    assert "cold MB" in cold_table and "| a | " + impl + " | 2.5 |" in cold_md
    for bad in ("-1", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            main(["bench", "--cold", bad, "--no-progress", "--no-json"])


def test_harness_cold_touches_the_memory_between_steps() -> None:
    from kvsched.bench.harness import _reset_peak_rss

    if not _reset_peak_rss():
        pytest.skip("no peak-RSS reset here (Linux /proc/self/clear_refs)")
    impl = _any_impl()
    workload = generate(get_scenario("a").scaled(SMALL))
    tight = run_workload(impl, workload, warmup_steps=0)
    cold = run_workload(impl, workload, warmup_steps=0, cold_mb=48)
    # Every page of the 48 MiB buffer was written during the timed run (the tight run grew far less).
    assert cold.peak_rss_bytes - cold.rss_before_bytes >= 47 * 2**20
    assert tight.peak_rss_bytes - tight.rss_before_bytes < 47 * 2**20
    with pytest.raises(ValueError):
        run_workload(impl, workload, cold_mb=-1)


def test_bench_replays_a_dumped_trace(tmp_path: Path) -> None:
    impl = _any_impl()
    traces = tmp_path / "traces"
    assert main(["bench", "--quick", "-w", "a,c", "--dump-trace", str(traces), "--dump-only", "--no-progress"]) == 0
    assert sorted(p.name for p in traces.iterdir()) == ["a.jsonl", "c.jsonl"]
    out = tmp_path / "replay.json"
    argv = ["bench", "--trace", str(traces / "c.jsonl"), "--impl", impl, "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["workload"] == "c" and res["num_requests"] == len(generate(get_scenario("c").scaled(0.05)).requests)


def test_bench_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    impl = _any_impl()
    png = tmp_path / "bench.png"
    argv = ["bench", "--quick", "-w", "a", "--impl", impl, "--no-json", "--plot", str(png), "--no-progress"]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "-w", "z", "--no-progress", "--no-json"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_kvsched_command_line_entry_point_shows_bench() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert "--workloads" in proc.stdout and "--scaling" in proc.stdout


def test_document_has_no_ratios_for_a_single_implementation() -> None:
    impl = _any_impl()
    result = run_workload(impl, generate(get_scenario("a").scaled(SMALL)), warmup_steps=0)
    doc = build_document([result])
    assert doc["ratios"] == [] and doc["scaling"] is None


def test_bench_scaling_alone_writes_a_scaling_summary(tmp_path: Path) -> None:
    impl = _any_impl()
    out = tmp_path / "scaling.json"
    argv = ["bench", "--scaling", "--scaling-sizes", "4,8", "--scaling-steps", "5", "--impl", impl]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["results"] == []  # --scaling alone skips the workloads
    points = doc["scaling"][impl]["points"]
    assert [p["num_running"] for p in points] == [4, 8]
    assert doc["scaling"][impl]["loglog_slope"] is not None


@pytest.mark.skipif(not _available("rust"), reason="rust scheduler not available")
def test_admission_window_on_workload_f_raises_the_hit_rate_and_cuts_recomputation() -> None:
    results = {}
    for window in (0, 16):
        scenario = get_scenario("f").with_config(cache_aware_admission_window=window).scaled(0.1)
        results[window] = run_workload("rust", generate(scenario), warmup_steps=0)
    for r in results.values():
        assert r.completed and r.num_prompt_tokens_computed >= r.num_min_prompt_tokens > 0
    hit = {w: r.counters.prefix_cache_hits / r.counters.prefix_cache_queries for w, r in results.items()}
    recomputed = {w: r.num_prompt_tokens_computed - r.num_min_prompt_tokens for w, r in results.items()}
    assert hit[16] > hit[0]
    assert recomputed[16] < recomputed[0]


def test_bench_policy_and_window_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    impl = _any_impl()
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "-w", "f", "--impl", impl, "--json", str(out), "--no-progress"]
    assert main([*argv, "--admission-window", "0", "--admission-threshold", "0.25"]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert (res["scenario"]["cache_aware_admission_window"], res["scenario"]["cache_aware_admission_threshold"]) == (
        0,
        0.25,
    )
    assert res["num_recomputed_prompt_tokens"] >= 0
    assert main([*argv, "--policy", "fair"]) == 0  # f's window is dropped: fair has its own order
    (res,) = json.loads(out.read_text())["results"]
    assert (res["scenario"]["policy"], res["scenario"]["cache_aware_admission_window"]) == ("fair", 0)
    assert main([*argv, "--policy", "fair", "--admission-window", "4"]) == 2
    assert "needs policy 'fcfs'" in capsys.readouterr().err


def test_policy_experiments_run(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kvsched._core")
    from kvsched.bench import policies

    assert policies.main(["--steps", "200", "--window", "50", "--arrival-steps", "100", "--aging-steps", "5"]) == 0
    text = capsys.readouterr().out
    assert "Jain" in text and "throughput fair / fcfs" in text and "priority_aging_steps=5" in text


@pytest.mark.skipif(not _available("rust"), reason="rust scheduler not available")
def test_preemption_modes_on_workload_g_swap_instead_of_recomputing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workload g (long contexts, tight pool) under the three modes: one row per mode, swaps counted, and the
    tokens recomputed after preemptions drop to what the CPU pool could not hold."""
    out = tmp_path / "bench.json"
    argv = ["bench", "-w", "g", "--scale", "0.2", "--repeat", "1", "--warmup-steps", "0", "--impl", "rust"]
    assert main([*argv, "--json", str(out), "--no-progress", "--preemption-mode", "recompute,swap,auto"]) == 0
    rows = {r["workload"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"g-recompute", "g-swap", "g-auto"}
    rec, swap = rows["g-recompute"], rows["g-swap"]
    assert rec["num_preemptions"] > 0 and rec["num_recomputed_tokens"] > 0 and rec["num_swapped_out_blocks"] == 0
    assert swap["preemption_mode"] == "swap" and swap["num_swapped_out_blocks"] > 0
    assert swap["num_recomputed_tokens"] < rec["num_recomputed_tokens"]
    assert swap["num_scheduled_tokens_total"] < rec["num_scheduled_tokens_total"]
    assert "swap out blk" in capsys.readouterr().out


@pytest.mark.skipif(not _available("rust"), reason="rust scheduler not available")
def test_bench_preemption_victim_sets_the_rule(tmp_path: Path) -> None:
    """--preemption-victim reaches the scheduler config: the run records it, and on workload d (memory pressure)
    lcf preempts other requests than the default rule does."""
    argv = [
        "bench",
        "-w",
        "d",
        "--scale",
        "0.05",
        "--repeat",
        "1",
        "--warmup-steps",
        "0",
        "--impl",
        "rust",
        "--no-progress",
    ]
    rows = {}
    for rule in ("default", "lcf"):
        out = tmp_path / f"{rule}.json"
        assert main([*argv, "--json", str(out), "--preemption-victim", rule]) == 0
        (rows[rule],) = json.loads(out.read_text())["results"]
    assert [rows[r]["scenario"]["preemption_victim"] for r in ("default", "lcf")] == ["default", "lcf"]
    assert rows["default"]["num_preemptions"] > 0
    assert rows["lcf"]["num_recomputed_tokens"] != rows["default"]["num_recomputed_tokens"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--no-json", "--preemption-victim", "lifo"])
    assert exc.value.code == 2


def test_bench_preemption_mode_gives_swap_a_cpu_pool() -> None:
    from kvsched.cli import _with_mode

    d = get_scenario("d")
    swap = _with_mode(d, "swap", None)
    assert (swap.name, swap.num_cpu_blocks, swap.scheduler_config().preemption_mode) == ("d-swap", d.num_blocks, "swap")
    assert _with_mode(d, "auto", 7).num_cpu_blocks == 7
    assert _with_mode(d, "recompute", None).num_cpu_blocks == 0


# ---------------------------------------------------------------------------------------------------------
# The measuring scripts (scripts/ and scripts/dev/): they run and print their figures (timings are not asserted)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run_script(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / args[0]), *args[1:]], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _load_script(name: str) -> types.ModuleType:
    """A script of scripts/ (a path below it) imported as a module (to call its functions directly)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, SCRIPTS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_decode_loop_script_prints_its_medians() -> None:
    out = _run_script("dev/api_decode_loop.py", "8", "16", "40", "1", "1")
    assert out.startswith("n=8 prompt_len=16 steps=40 cold_mb=1 stagger=1:") and "p99" in out


@pytest.mark.parametrize("mode", ["alone", "abab"])
def test_abab_script_times_every_step_of_workload_a(mode: str) -> None:
    out = _run_script("dev/abab.py", mode, "1")
    assert out.startswith(f"mode={mode} steps=272:")
    assert "decode-only steps (255)" in out


def test_abab_script_rejects_an_unknown_mode() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "dev" / "abab.py"), "sometimes"], capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0 and "MODE must be abab or alone" in proc.stderr


@pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None, reason="needs valgrind"
)
def test_step_cache_misses_script_counts_both_methods_per_step() -> None:
    import kvsched

    package_root = Path(kvsched.__file__).resolve().parent.parent
    # The script runs `python3`: this interpreter, whatever PATH holds.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "dev" / "step_cache_misses.sh"), str(package_root), "8", "5", "0", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("n=8 steps=5 cold_mb=0 stagger=1 ")
    assert lines[1].split() == ["Ir", "I1mr", "D1mr", "D1mw", "DLmr", "DLmw"]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {"schedule", "update_from_output"}
    # Each method runs instructions every step. (A miss count is a difference of two runs and may dip below
    # zero by a line or two over so few steps.)
    assert all(len(v) == 6 and v[0] > 0 for v in rows.values())


def test_ab_compare_script_pairs_alternating_runs(tmp_path: Path) -> None:
    # The same build twice: both get a median and the first one's paired ratio to itself is exactly 1.
    build = Path(__file__).resolve().parent.parent
    out = _run_script("ab_compare.py", "a", "2", str(build), str(build), "--", "--scale", "0.05")
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"a {build}: median ") for line in lines)
    assert lines[0].endswith("paired ratio 1.000")


def test_ab_compare_script_reverses_the_build_order_every_other_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # With a fixed order, any penalty (or gain) of running second in a round would land on one build throughout.
    ab_compare = _load_script("ab_compare.py")
    builds = []
    for name in ("old", "new"):
        (tmp_path / name / "python" / "kvsched").mkdir(parents=True)
        builds.append(tmp_path / name)
    calls: list[str] = []

    def fake_run_once(build: Path, workload: str, extra: list[str], json_path: Path, steps: str) -> float:
        calls.append(build.name)
        # The second run of each round pays 10%, whichever build it is.
        second = len(calls) % 2 == 0
        return (10.0 if build.name == "old" else 12.0) * (1.1 if second else 1.0)

    monkeypatch.setattr(ab_compare, "run_once", fake_run_once)
    assert ab_compare.main(["c", "4", str(builds[0]), str(builds[1])]) == 0
    assert calls == ["old", "new", "new", "old", "old", "new", "new", "old"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("paired ratio 1.000")
    # Per round the ratio is 1.32 or 1.09 (12 * 1.1 / 10, 12 / (10 * 1.1)): their median lies between.
    ratio = float(lines[1].split("paired ratio ")[1].split(" ")[0])
    assert 1.09 < ratio < 1.32
    assert lines[1].endswith("(too few rounds for an interval; faster in 0 of 4 rounds)")


def test_ab_compare_step_groups() -> None:
    ab_compare = _load_script("ab_compare.py")
    # Five steps: a prefill (1000 tokens), three decodes of 4 requests, then one after which 2 requests finished.
    per_step = {
        "schedule_ns": [9000, 1000, 1200, 1100, 1300],
        "update_ns": [1000, 1000, 3000, 1000, 500],
        "num_running_reqs": [4, 4, 4, 2, 2],
        "num_scheduled_tokens": [1000, 4, 4, 4, 2],
    }
    assert ab_compare.group_median(per_step, "all") == pytest.approx(2.1)
    assert ab_compare.group_median(per_step, "prefill") == pytest.approx(10.0)
    assert ab_compare.group_median(per_step, "finishing") == pytest.approx(4.2)
    per_step["num_running_reqs"] = [4, 4, 4, 4, 4]
    assert math.isnan(ab_compare.group_median(per_step, "finishing"))


def test_ab_compare_script_compares_a_group_of_steps(tmp_path: Path) -> None:
    build = Path(__file__).resolve().parent.parent
    out = _run_script("ab_compare.py", "--steps", "prefill", "a", "1", str(build), "--", "--scale", "0.05")
    assert out.startswith(f"a {build}: median of the prefill steps ")
    assert out.strip().endswith("paired ratio 1.000")


def test_ab_compare_interval_for_the_median_ratio() -> None:
    # Distribution-free: order statistics chosen by the binomial(n, 1/2) tails, at least 95% coverage.
    ab_compare = _load_script("ab_compare.py")
    # n = 16: P(B <= 3) = 0.0106 <= 0.025 < P(B <= 4) = 0.0384, so the 4th and 13th smallest values.
    assert ab_compare.median_interval([float(x) for x in range(16, 0, -1)]) == (4.0, 13.0)
    # n = 6: only the extremes (P(B = 0) = 1/64); n = 5: P(B = 0) = 1/32 > 0.025, no interval.
    assert ab_compare.median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert ab_compare.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    # Its coverage over many samples of a skewed distribution is at least 95%.
    rng = np.random.default_rng(0)
    samples = rng.lognormal(0.0, 0.5, size=(2000, 16))
    true_median = 1.0  # exp(0)
    covered = 0
    for row in samples:
        interval = ab_compare.median_interval(list(row))
        assert interval is not None
        covered += interval[0] <= true_median <= interval[1]
    assert covered / len(samples) >= 0.95


def test_ab_compare_script_rejects_a_directory_without_a_build(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "ab_compare.py"), "a", "1", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "has no python/kvsched tree" in proc.stderr


# ---------------------------------------------------------------------------------------------------------
# Runs with vLLM's scheduler: vLLM is imported before anything is timed

_RECORD_VLLM_IMPORTED = """
import sys
import kvsched.bench.harness as harness
from kvsched.cli import main

seen = []
original = harness.run_workload


def recording(impl, *args, **kwargs):
    seen.append((impl, "vllm" in sys.modules))
    return original(impl, *args, **kwargs)


harness.run_workload = recording
code = main(["bench", "--impl", "rust,vllm", "-w", "a", "--scale", "0.05", "--repeat", "1", "--no-json",
             "--no-progress"])
print("CODE", code)
print("SEEN", seen)
"""


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
def test_bench_with_vllm_imports_it_before_the_first_timed_run() -> None:
    if not _vllm_importable():
        pytest.skip("vLLM is optional: pip install 'kvsched[vllm]'")
    # A fresh interpreter: in this one another test may have imported vLLM already.
    proc = subprocess.run(
        [sys.executable, "-c", _RECORD_VLLM_IMPORTED], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "CODE 0" in proc.stdout
    assert "SEEN [('rust', True), ('vllm', True)]" in proc.stdout


def test_bench_without_vllm_stops_before_timing_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if _vllm_importable():
        pytest.skip("vLLM is importable here")
    import kvsched.bench.harness as harness

    calls: list[str] = []
    monkeypatch.setattr(harness, "run_workload", lambda impl, *a, **k: calls.append(impl))
    code = main(["bench", "--impl", "rust,vllm", "-w", "a", "--scale", "0.05", "--no-json", "--no-progress"])
    assert code == 2 and calls == []
    assert "vllm is not importable" in capsys.readouterr().err


@pytest.mark.skipif(not _available("rust"), reason="rust scheduler not available")
def test_bench_runs_several_implementations_in_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With several implementations they take turns run by run (a drift of the machine's speed reaches all of
    them), and each keeps the best of its own runs."""
    import kvsched.bench.harness as harness

    calls: list[str] = []
    real = harness.run_workload

    def spy(impl: str, *args: object, **kwargs: object) -> object:
        calls.append(impl)
        return real(impl, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(harness, "run_workload", spy)
    out = tmp_path / "bench.json"
    argv = ["bench", "--impl", "rust,reference", "-w", "a", "--scale", "0.05", "--repeat", "2", "--warmup-steps", "0"]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    assert calls == ["rust", "reference", "rust", "reference"]
    results = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in results] == ["rust", "reference"]
    for r in results:
        assert len(r["repeats"]) == 2
        assert r["total_us"]["median"] == pytest.approx(min(x["total_median_us"] for x in r["repeats"]))


# ---- What the printed report explains -------------------------------------------------------------------------


def _doc(workload: str, impl: str = "rust", *, median: float, p99: float, scale: float = 1.0) -> dict[str, Any]:
    """A results entry as result_to_dict builds it, for a run with these total µs."""
    from kvsched.bench.report import _target_check

    result = types.SimpleNamespace(workload=workload, impl=impl, scenario={"scale": scale}, cold_mb=0.0)
    total = {"median": median, "p99": p99, "max": p99}
    return {"workload": workload, "impl": impl, "total_us": total, "target": _target_check(result, total)}  # type: ignore[arg-type]


def test_target_legend_says_what_the_column_checks_and_by_how_much_a_run_missed() -> None:
    from kvsched.bench.report import TARGETS, _target_cell, format_target_legend

    docs = [
        _doc("a", median=2.0, p99=30.0),  # no p99 target: ok
        _doc("d", median=2.0, p99=17.4),  # p99 8.7x the median
        _doc("b", median=55.0, p99=60.0),  # median over 40
        _doc("g", median=1.0, p99=9.0),  # no target at all
        _doc("c", "reference", median=90.0, p99=900.0),
    ]
    assert [_target_cell(d["target"]) for d in docs] == ["ok", "MISS p99", "MISS median", "-", "n/a"]
    legend = format_target_legend(docs)
    assert legend[0].startswith("target: median schedule+update per step <= a 10, b 40, c 50, d 50 µs")
    assert "p99 <= 5x the median for c, d" in legend[0]
    assert set(TARGETS) == {"a", "b", "c", "d"}
    assert "target n/a: the targets are for rust at scale 1 without --cold; these runs have impl reference" in legend
    assert "target MISS d (rust): p99 17.4 µs is 8.7x the median 2.0 µs (at most 5x)" in legend
    assert "target MISS b (rust): median 55.0 µs > 40 µs" in legend
    assert not any("MISS a" in line for line in legend)


def test_bench_quick_prints_every_workload_and_explains_the_empty_targets(capsys: pytest.CaptureFixture[str]) -> None:
    if not _available("rust"):
        pytest.skip("rust scheduler not available")
    assert main(["bench", "--quick", "--max-steps", "40", "--no-json", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[3:] if line and line.split()[0] in SCENARIOS}
    assert sorted(rows) == sorted(SCENARIOS) == list("abcdefg")  # f and g are in the table too
    assert {rows[w][-1] for w in "abcd"} == {"n/a"} and {rows[w][-1] for w in "efg"} == {"-"}
    assert "target n/a: the targets are for rust at scale 1 without --cold; these runs have scale 0.05" in out


def test_bench_help_names_every_workload() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(proc.stdout.split())
    assert "a,b,c,d,e,f,g" in text and "a-f" not in text
    for name in SCENARIOS:
        assert f" {name} " in text or f" {name}=" in text, name


@pytest.mark.parametrize(
    ("slope", "words"),
    [
        (0.45, "step time grows as n^0.45 (less than linear: the cost per request falls as n grows)"),
        (1.02, "step time grows as n^1.02 (about linear: a constant cost per request)"),
        (1.12, "step time grows as n^1.12 (slightly faster than linear: the cost per request grows with n)"),
        (1.6, "step time grows as n^1.60 (faster than linear: the cost per request grows with n)"),
    ],
)
def test_scaling_slope_is_named_plainly(slope: float, words: str) -> None:
    from kvsched.bench.report import format_markdown, format_scaling, scaling_verdict

    assert scaling_verdict(slope) == words
    point = {"num_running": 64, "num_steps": 5, "us_per_request": 0.1, "growth_vs_previous": None}
    point |= {k: {"median": 1.0, "p99": 2.0} for k in ("schedule_us", "update_us", "total_us")}
    summary = {"rust": {"points": [point], "loglog_slope": slope, "at_most_linear": slope <= 1.1}}
    text = format_scaling(summary)
    assert words in text and "FASTER" not in text and "log-log" not in text
    md = format_markdown({"machine": {"cpu_model": "x", "num_cpus": 2, "python": "3", "numpy": "2"},
                          "results": [], "ratios": [], "scaling": summary})  # fmt: skip
    assert f"Scaling (rust): {words}" in md
