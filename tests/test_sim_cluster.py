"""The fleet simulator (kvsched.sim.cluster): one replica is simulate(), requests are conserved, and routers that
read the cache find more of it than routers that do not."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
from typing import Any

import kvsched
import numpy as np
import pytest
from kvsched.sim import PRESETS, WorkloadSpec, generate_workload, simulate
from kvsched.sim.cluster import (
    ROUTERS,
    SessionSpec,
    session_workload,
    simulate_cluster,
    summarize_cluster,
)
from kvsched.sim.workload import LengthDist

MODEL = PRESETS["llama-3.1-8b-h100"]


# 8 system prompts of 1024 tokens, every request in one of them.
_SHARED_PREFIX_SPEC = WorkloadSpec(
    rate=40,
    num_requests=160,
    prompt_len=LengthDist("fixed", 1100),
    output_len=LengthDist("uniform", 8, 32),
    num_prefix_groups=8,
    prefix_len=1024,
    prefix_fraction=1.0,
    seed=5,
)


def _shared_prefix_workload(n: int = 160) -> Any:
    return generate_workload(dataclasses.replace(_SHARED_PREFIX_SPEC, num_requests=n))


def _sink(into: dict[int, tuple[float, ...]]) -> Any:
    def sink(c: dict[str, Any]) -> None:
        for j, i in enumerate(c["idx"].tolist()):
            assert i not in into, f"request {i} reported twice"
            into[i] = tuple(
                float(c[k][j])
                for k in ("first_scheduled_time", "first_token_time", "finish_time", "num_output_tokens",
                          "num_cached_tokens", "num_recomputed_tokens", "num_preemptions")
            )  # fmt: skip

    return sink


@pytest.mark.parametrize(
    ("config", "router"),
    [
        ({"num_blocks": 2000, "max_num_seqs": 32}, "cache_aware"),
        # a small cache: preemptions and evictions; and a router that reads no cache
        ({"num_blocks": 160, "max_num_seqs": 16, "max_num_batched_tokens": 512}, "pow2"),
    ],
)
def test_one_replica_is_simulate(config: dict[str, Any], router: str) -> None:
    w = generate_workload(
        WorkloadSpec(
            rate=30,
            num_requests=150,
            prompt_len=LengthDist("uniform", 100, 900),
            output_len=LengthDist("uniform", 5, 80),
            num_prefix_groups=3,
            prefix_len=256,
            prefix_fraction=0.6,
            seed=3,
        )
    )
    single: dict[int, tuple[float, ...]] = {}
    fleet: dict[int, tuple[float, ...]] = {}
    ref = simulate(w, config, MODEL, request_sink=_sink(single))
    res = simulate_cluster(w, config, MODEL, replicas=1, router=router, request_sink=_sink(fleet))
    assert len(single) == len(w)
    assert fleet == single
    assert ref.final_stats["num_preemptions"] == res.replicas[0].final_stats["num_preemptions"]
    if "num_blocks" in config and config["num_blocks"] == 160:
        assert ref.final_stats["num_preemptions"] > 0  # the small cache does preempt
    s = summarize_cluster(res)
    assert s["fleet"]["overall"]["ttft"] == kvsched.sim.summarize(ref)["overall"]["ttft"]
    assert s["prefix_cache_hit_rate"] == pytest.approx(ref.final_stats["prefix_cache_hit_rate"])
    assert res.fleet.end_time == pytest.approx(ref.end_time)


def test_one_replica_is_simulate_with_step_time_noise() -> None:
    w = generate_workload(dataclasses.replace(_SHARED_PREFIX_SPEC, num_requests=80, seed=8))
    noisy = dataclasses.replace(MODEL, noise_sigma=0.4, noise_rho=0.6)
    single: dict[int, tuple[float, ...]] = {}
    fleet: dict[int, tuple[float, ...]] = {}
    simulate(w, {"num_blocks": 2000}, noisy, request_sink=_sink(single), noise_seed=3)
    simulate_cluster(w, {"num_blocks": 2000}, noisy, replicas=1, request_sink=_sink(fleet), noise_seed=3)
    assert len(single) == len(w) and fleet == single
    other: dict[int, tuple[float, ...]] = {}
    simulate_cluster(w, {"num_blocks": 2000}, noisy, replicas=1, request_sink=_sink(other), noise_seed=4)
    assert other != single


@pytest.mark.parametrize("router", ROUTERS)
def test_every_request_finishes_on_exactly_one_replica(router: str) -> None:
    w = _shared_prefix_workload(n=80)
    seen: dict[int, tuple[float, ...]] = {}
    replica_cols: list[np.ndarray] = []

    def sink(c: dict[str, Any]) -> None:
        _sink(seen)(c)
        replica_cols.append(np.stack([c["idx"], c["replica"]]))

    res = simulate_cluster(w, {"num_blocks": 300, "max_num_seqs": 16}, MODEL, replicas=3, router=router,
                           request_sink=sink)  # fmt: skip
    assert sorted(seen) == list(range(len(w)))
    assert all(np.isfinite(v[2]) for v in seen.values())  # every one finished
    pairs = np.concatenate(replica_cols, axis=1)
    assert (res.replica_of[pairs[0]] == pairs[1]).all()
    assert ((res.replica_of >= 0) & (res.replica_of < 3)).all()
    s = summarize_cluster(res)
    per = [r["overall"]["num_finished"] for r in s["replicas"]]
    assert per == s["requests_per_replica"]
    assert sum(per) == len(w) == s["fleet"]["overall"]["num_finished"]
    assert sum(s["reasons"].values()) == len(w)
    # each replica computed every token of its requests that its cache did not hold
    for k, r in enumerate(res.replicas):
        mine = res.replica_of == k
        prompt_and_out = int(w.prompt_len[mine].sum() + w.output_len[mine].sum())
        assert s["replicas"][k]["computed_tokens"] >= prompt_and_out - r.metrics.overall.num_cached_tokens - int(
            mine.sum()
        )


def test_cache_aware_routers_beat_blind_ones_on_hit_rate() -> None:
    # 8 system prompts, 4 replicas whose caches hold about 4 of them each: spreading every prompt everywhere
    # evicts; keeping each on a replica does not.
    w = _shared_prefix_workload()
    cfg = {"num_blocks": 300, "max_num_seqs": 16}
    hit = {
        r: summarize_cluster(simulate_cluster(w, cfg, MODEL, replicas=4, router=r))
        for r in ("random", "round_robin", "pow2", "cache_aware", "kv_overlap")
    }
    blind = max(hit[r]["prefix_cache_hit_rate"] for r in ("random", "round_robin", "pow2"))
    for r in ("cache_aware", "kv_overlap"):
        assert hit[r]["prefix_cache_hit_rate"] > blind + 0.2, (r, hit[r]["prefix_cache_hit_rate"], blind)
        assert hit[r]["fleet"]["overall"]["ttft"]["mean"] < hit["random"]["fleet"]["overall"]["ttft"]["mean"]


def test_session_turns_resend_the_conversation() -> None:
    sw = session_workload(SessionSpec(rate=2.0, num_sessions=6, think_time=1.0, num_groups=2, system_len=64,
                                      turns=LengthDist("fixed", 3), seed=2))  # fmt: skip
    w = sw.workload
    assert (np.diff(w.arrival_time) >= 0).all()
    by_session: dict[str, list[int]] = {}
    for i, s in enumerate(sw.session_ids):
        by_session.setdefault(s, []).append(i)
    assert len(by_session) == 6
    for s, idx in by_session.items():
        assert len(idx) == 3
        group = int(s[1:]) % 2
        for a, b in itertools.pairwise(idx):
            prev, cur = sw.prompts[a], sw.prompts[b]
            out = int(w.output_len[a])
            # the next turn is this turn's prompt, its answer, and a new user message
            assert (cur[: len(prev)] == prev).all()
            assert (cur[len(prev) : len(prev) + out] == 7).all()
            assert len(cur) > len(prev) + out
        assert all(int(w.prefix_group[i]) == group for i in idx)
    # two sessions of one group share its system prompt, those of two groups do not
    first = {s: sw.prompts[idx[0]] for s, idx in by_session.items()}
    assert (first["s0"][:64] == first["s2"][:64]).all()
    assert not (first["s0"][:64] == first["s1"][:64]).all()


def test_sessions_follow_their_cache() -> None:
    sw = session_workload(SessionSpec(rate=4.0, num_sessions=24, think_time=1.0, num_groups=2, system_len=256,
                                      turns=LengthDist("fixed", 4), output_len=LengthDist("fixed", 16),
                                      seed=1))  # fmt: skip
    cfg = {"num_blocks": 256, "max_model_len": 8192}
    rate = {
        r: summarize_cluster(simulate_cluster(sw, cfg, MODEL, replicas=4, router=r))["prefix_cache_hit_rate"]
        for r in ("round_robin", "cache_aware")
    }
    assert rate["cache_aware"] > rate["round_robin"] + 0.2, rate


def test_fleet_hit_rate_counts_every_replica_token() -> None:
    w = _shared_prefix_workload(n=60)
    res = simulate_cluster(w, {"num_blocks": 200, "max_num_seqs": 8}, MODEL, replicas=2, router="kv_overlap")
    hits = sum(r.final_stats["prefix_cache_hits"] for r in res.replicas)
    queries = sum(r.final_stats["prefix_cache_queries"] for r in res.replicas)
    assert res.fleet.final_stats["prefix_cache_hit_rate"] == pytest.approx(hits / queries)


def test_predictive_estimate_is_close_when_the_fleet_is_idle() -> None:
    # Requests far apart: no queue, no running requests; the estimate prices the lone prefill as the simulator.
    w = generate_workload(WorkloadSpec(rate=0.5, num_requests=20, prompt_len=LengthDist("uniform", 200, 2000),
                                       output_len=LengthDist("fixed", 4), seed=1))  # fmt: skip
    s = summarize_cluster(simulate_cluster(w, {"num_blocks": 4000}, MODEL, replicas=2, router="predictive"))
    assert s["ttft_estimate_error"]["p90_abs"] < 0.05, s["ttft_estimate_error"]


def test_predictive_estimate_under_moderate_load() -> None:
    # 20 requests/s over 4 replicas: most requests meet no queue (the estimate is then the simulated TTFT), some
    # arrive behind another prefill or beside decodes the estimate prices only as they stand.
    w = generate_workload(dataclasses.replace(_SHARED_PREFIX_SPEC, rate=20))
    s = summarize_cluster(simulate_cluster(w, {"num_blocks": 300, "max_num_seqs": 16}, MODEL, replicas=4,
                                           router="predictive"))  # fmt: skip
    err = s["ttft_estimate_error"]
    assert err["median_abs"] < 0.01, err
    assert err["p90_abs"] < 0.5, err


def test_bad_arguments_raise_typed_errors() -> None:
    w = _shared_prefix_workload(n=4)
    with pytest.raises(kvsched.InvalidConfigError, match="router must be one of"):
        simulate_cluster(w, {}, MODEL, replicas=2, router="nope")
    with pytest.raises(kvsched.InvalidConfigError, match="replicas"):
        simulate_cluster(w, {}, MODEL, replicas=0)
    with pytest.raises(kvsched.InvalidConfigError, match="router config"):
        simulate_cluster(w, {}, MODEL, replicas=2, router_config={"no_such_field": 1})
    with pytest.raises(ValueError, match="max_context_len"):
        SessionSpec(system_len=9000, max_context_len=8192)


def test_cli_sweeps_routers_and_replica_counts(tmp_path: Any, capsys: Any) -> None:
    from kvsched.cli import main

    out = tmp_path / "fleet"
    argv = ["simulate", "--replicas", "1,2", "--routers", "round_robin,cache_aware", "--num-requests", "30",
            "--rate", "20", "--prompt-len", "600", "--output-len", "8", "--prefix-groups", "3", "--prefix-len",
            "512", "--prefix-fraction", "1", "--set", "num_blocks=200", "--slo-ttft", "0.1", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.count("| 1 | `") == 2 and table.count("| 2 | `") == 2
    doc = json.loads((out / "cluster.json").read_text())
    assert [(r["num_replicas"], r["router"]) for r in doc["runs"]] == [
        (1, "round_robin"), (1, "cache_aware"), (2, "round_robin"), (2, "cache_aware")
    ]  # fmt: skip
    assert all(r["fleet"]["overall"]["num_finished"] == 30 for r in doc["runs"])
    with (out / "cluster_replicas.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 + 1 + 2 + 2
    # one replica: every router sends everything to it, so both runs are the same run
    one = [r for r in doc["runs"] if r["num_replicas"] == 1]
    assert one[0]["fleet"]["overall"]["ttft"] == one[1]["fleet"]["overall"]["ttft"]


def test_cli_sessions(tmp_path: Any) -> None:
    from kvsched.cli import main

    argv = ["simulate", "--replicas", "2", "--routers", "pow2", "--conversations", "--num-requests", "5",
            "--turns", "3", "--think-time", "1", "--prompt-len", "64", "--output-len", "16", "--prefix-groups", "2",
            "--prefix-len", "128", "--sticky-sessions", "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "cluster.json").read_text())
    assert doc["runs"][0]["fleet"]["overall"]["num_finished"] == 15


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--routers", "nope"], "unknown router"),
        (["--replicas", "0"], "--replicas"),
        (["--rates", "1,2"], "--rates does not apply"),
        (["--set", "num_blocks=100,200"], "one value per field"),
        (["--router-set", "no_such_field=1"], "no_such_field"),
        (["--conversations", "--tenants", "a:0.5,b:0.5"], "--conversations makes its own requests"),
    ],
)
def test_cli_rejects_bad_fleet_arguments(tmp_path: Any, capsys: Any, extra: list[str], message: str) -> None:
    from kvsched.cli import main

    argv = ["simulate", "--replicas", "2", "--num-requests", "5", "--out", str(tmp_path), "--no-progress", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_horizon_reports_unfinished_and_unarrived_requests() -> None:
    w = _shared_prefix_workload(n=120)  # arrivals over about 3 s
    res = simulate_cluster(w, {"num_blocks": 300, "max_num_seqs": 16}, MODEL, replicas=2, router="cache_aware",
                           horizon=1.0)  # fmt: skip
    s = summarize_cluster(res)
    o = s["fleet"]["overall"]
    arrived = int((w.arrival_time < 1.0).sum())
    assert o["num_requests"] == arrived
    assert 0 < o["num_finished"] < arrived
    assert (res.replica_of >= 0).sum() == arrived
    assert sum(r["overall"]["num_requests"] for r in s["replicas"]) == arrived


def test_cli_fleet_flags_need_replicas(tmp_path: Any, capsys: Any) -> None:
    from kvsched.cli import main

    fleet_flags = (
        ["--conversations"],
        ["--routers", "pow2"],
        ["--sticky-sessions"],
        ["--router-set", "cache_threshold=1"],
    )
    for extra in fleet_flags:
        argv = ["simulate", "--num-requests", "5", "--out", str(tmp_path), "--no-progress", *extra]
        assert main(argv) == 2
        assert "give --replicas N" in capsys.readouterr().err


def test_cli_router_set_reaches_the_router(tmp_path: Any) -> None:
    from kvsched.cli import main

    base = ["simulate", "--replicas", "2", "--routers", "cache_aware", "--num-requests", "40", "--rate", "20",
            "--prompt-len", "600", "--output-len", "8", "--prefix-groups", "2", "--prefix-len", "512",
            "--prefix-fraction", "1", "--no-progress"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    # a threshold no prompt can pass: cache_aware never follows a cached prefix
    assert main([*base, "--router-set", "cache_threshold=1.0", "--out", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "cluster.json").read_text())["runs"][0]["reasons"]
    b = json.loads((tmp_path / "b" / "cluster.json").read_text())["runs"][0]["reasons"]
    assert a.get("cache_hit", 0) > 0
    assert b.get("cache_hit", 0) == 0


def test_one_replica_is_simulate_with_the_new_size_term() -> None:
    # The fleet's replicas keep their own recent step sizes, as simulate() does: one replica is simulate().
    w = generate_workload(dataclasses.replace(_SHARED_PREFIX_SPEC, num_requests=80, seed=9))
    priced = dataclasses.replace(MODEL, new_size_step_s=3e-3, step_size_cache=8)
    single: dict[int, tuple[float, ...]] = {}
    fleet: dict[int, tuple[float, ...]] = {}
    plain: dict[int, tuple[float, ...]] = {}
    simulate(w, {"num_blocks": 2000}, priced, request_sink=_sink(single))
    simulate_cluster(w, {"num_blocks": 2000}, priced, replicas=1, request_sink=_sink(fleet))
    simulate_cluster(w, {"num_blocks": 2000}, MODEL, replicas=1, request_sink=_sink(plain))
    assert len(single) == len(w) and fleet == single
    assert plain != single
