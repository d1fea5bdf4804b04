"""Admission policies as behaviour and properties (docs/semantics.md, "Admission policies").

- cache-aware admission: the canonical case (warm request first and reusing its prefix with a window; evicted
  without one), the threshold, the one-step lifetime of the reordering, non-peers keeping their place;
- fair share: the VTC bound for tenants that stay backlogged (hypothesis), fair vs fcfs on a stream where one
  tenant sends 10x the others' rate (Jain's index and throughput), weights, run-time weight changes;
- priority aging: a request that starves without aging is admitted within the bound with it.

Scenario tests run on both implementations; the long-stream properties run on the Rust core only (the
differential tests hold the reference to it step by step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import entry_sizes, requires_rust
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched import SchedulerConfig
from kvsched.bench.policies import PriorityStream, TenantStream, jain_index, run_priority_stream, run_tenant_stream
from kvsched.reference import ReferenceScheduler

IMPLS = ["reference", pytest.param("rust", marks=requires_rust)]


class Sim:
    """A scheduler of either implementation plus the prompt lengths its fake model needs."""

    def __init__(self, impl: str, **fields: Any) -> None:
        if impl == "reference":
            self.s: Any = ReferenceScheduler(**fields)
        else:
            from kvsched import Scheduler

            self.s = Scheduler(**fields)
        self.lens: dict[str, int] = {}

    def add(self, rid: str, prompt: Any, **kw: Any) -> None:
        self.s.add_request(rid, prompt, **kw)
        self.lens[rid] = len(prompt)

    def feed(self, out: Any) -> Any:
        """One token (7) for every entry of ``out`` whose prompt is complete (call right after schedule())."""
        sizes = entry_sizes(self.s, out, self.lens)
        res = self.s.update_from_output(out, [[] if z is None else [7] for z in sizes])
        self.s.check_invariants()
        return res

    def step(self) -> Any:
        out = self.s.schedule()
        self.feed(out)
        return out


# ----------------------------------------------------------------------------------------------------------
# Cache-aware admission
# ----------------------------------------------------------------------------------------------------------

WARM = list(range(100, 148))  # 48 tokens: 3 blocks of 16


def canonical(impl: str, window: int, threshold: float = 0.5) -> tuple[list[str], int, int]:
    """Block size 16; 8 usable blocks, 4 held by a running request (KV usage 0.5, the default threshold), so
    the free pool holds only the warm 3-block prefix plus one block. A cold 48-token request arrives before a
    warm one whose prompt is cached. Returns (admitted in that step, cached tokens of the warm prompt right
    after it, prefix-hit tokens of cold + warm)."""
    m = Sim(impl, block_size=16, num_blocks=9, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=128,
            cache_aware_admission_window=window, cache_aware_admission_threshold=threshold,
            prefix_hash_seed=0)  # fmt: skip
    m.add("seed", WARM, max_tokens=1, arrival_time=0.0)  # computes and caches the warm prompt, then ends
    m.add("busy", list(range(500, 560)), max_tokens=4, arrival_time=1.0)  # holds 4 blocks throughout
    m.step()
    assert m.s.get_num_cached_tokens(WARM) == 32  # a hit never covers the last token
    m.add("cold", list(range(900, 948)), max_tokens=1, arrival_time=2.0)
    m.add("warm", WARM, max_tokens=1, arrival_time=3.0)
    hits_before = m.s.stats().prefix_cache_hits
    out = m.s.schedule()
    admitted, cached_after = out.req_ids[1:], m.s.get_num_cached_tokens(WARM)
    m.feed(out)
    for _ in range(10):
        m.step()
    assert not m.s.has_unfinished_requests() and m.s.num_free_blocks == 8
    return admitted, cached_after, m.s.stats().prefix_cache_hits - hits_before


@pytest.mark.parametrize("impl", IMPLS)
def test_canonical_case_window_admits_the_warm_request_first_and_it_reuses_its_prefix(impl: str) -> None:
    admitted, cached_after, hits = canonical(impl, window=4)
    assert admitted == ["warm"]
    assert cached_after == 32  # the warm prefix survived
    assert hits == 32  # the warm request reused 2 blocks (the most a 48-token prompt can); cold hits nothing


@pytest.mark.parametrize("impl", IMPLS)
def test_canonical_case_without_window_the_cold_request_evicts_the_warm_prefix(impl: str) -> None:
    admitted, cached_after, hits = canonical(impl, window=0)
    assert admitted == ["cold"]
    assert cached_after == 16  # the cold request took the free block and 2 of the prefix's 3 blocks
    assert hits == 16


@pytest.mark.parametrize("impl", IMPLS)
def test_below_the_threshold_nothing_is_reordered(impl: str) -> None:
    assert canonical(impl, window=4, threshold=0.6)[0] == ["cold"]  # usage is 0.5


@pytest.mark.parametrize("impl", IMPLS)
def test_the_reordering_lasts_one_step(impl: str) -> None:
    """Step 1 (usage >= threshold) admits one warm request out of order; step 2 (usage below) must see the
    original FCFS order of the rest, not the reordered one."""
    m = Sim(impl, block_size=4, num_blocks=17, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
            cache_aware_admission_window=8, prefix_hash_seed=0)  # fmt: skip
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    m.add("seed", [*prefix, 9], max_tokens=1, arrival_time=0.0)
    m.add("busy", list(range(200, 232)), max_tokens=2, arrival_time=0.0)  # 8 of 16 blocks: usage 0.5
    m.step()
    for k, (rid, prompt) in enumerate([("c1", [50, 51, 52, 53, 54]), ("w1", [*prefix, 10]),
                                       ("c2", [60, 61, 62, 63, 64]), ("w2", [*prefix, 11])]):  # fmt: skip
        m.add(rid, prompt, max_tokens=5, arrival_time=1.0 + k)
    assert m.step().req_ids == ["busy", "w1"]  # busy then finishes: usage drops to 3/16
    assert m.step().req_ids == ["w1", "c1"]  # strict FCFS again: c1 is the head, not w2


@pytest.mark.parametrize("impl", IMPLS)
def test_warm_requests_go_first_in_arrival_order_within_the_window_only(impl: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64,
            cache_aware_admission_window=3, cache_aware_admission_threshold=0.0, prefix_hash_seed=0)  # fmt: skip
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    m.add("seed", [*prefix, 9], max_tokens=1, arrival_time=0.0)
    m.step()
    for k, rid in enumerate(["c1", "w1", "c2", "w2", "c3"]):
        prompt = [*prefix, 20 + k] if rid[0] == "w" else [40 + k, 41, 42, 43, 44]
        m.add(rid, prompt, max_tokens=2, arrival_time=1.0 + k)
    # Window 3: [c1, w1, c2] -> [w1, c1, c2]; w2 and c3 are outside it.
    assert m.step().req_ids == ["w1", "c1", "c2", "w2", "c3"]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_preempted_request_keeps_its_place_at_the_head(impl: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
            cache_aware_admission_window=4, cache_aware_admission_threshold=0.0, prefix_hash_seed=0)  # fmt: skip
    for k in range(3):
        m.add(f"r{k}", [10 * k + j for j in range(1, 8)], max_tokens=20, arrival_time=float(k))
    victim = None
    for _ in range(20):
        out = m.step()
        if out.preempted_req_ids:
            victim = out.preempted_req_ids[0]
            break
    assert victim is not None, "the pool is too small for three growing requests"
    m.add("w", [1, 2, 3, 4, 5, 6, 8], max_tokens=1, arrival_time=9.0)  # warm: r0's first block is cached
    # The victim is not a peer: the warm newcomer does not pass it.
    for _ in range(60):
        out = m.step()
        if victim in out.req_ids or "w" in out.req_ids:
            assert victim in out.resumed_req_ids, out.req_ids
            break
    else:
        raise AssertionError("neither was admitted")


# ----------------------------------------------------------------------------------------------------------
# Fair share
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_fair_serves_the_tenant_with_the_smallest_counter_not_the_earliest_request(impl: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=128, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
            policy="fair", prefix_hash_seed=0)  # fmt: skip
    for k in range(6):
        m.add(f"a{k}", [10 * k + 1, 2, 3, 4, 5, 6, 7, 8], max_tokens=4, arrival_time=float(k), tenant="a")
    m.add("b0", [99, 2, 3, 4, 5, 6, 7, 8], max_tokens=4, arrival_time=10.0, tenant="b")
    assert m.step().req_ids == ["a0", "b0", "a1"]  # after a0, a's counter (8) exceeds b's (0)


@pytest.mark.parametrize("impl", IMPLS)
def test_fcfs_ignores_tenants_but_still_reports_their_service(impl: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=128, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
            prefix_hash_seed=0)  # fmt: skip
    for k in range(6):
        m.add(f"a{k}", [10 * k + 1, 2, 3, 4, 5], max_tokens=4, arrival_time=float(k), tenant="a")
    m.add("b0", [99, 2, 3, 4, 5], max_tokens=4, arrival_time=10.0, tenant="b")
    assert m.step().req_ids == ["a0", "a1", "a2"]
    st_ = m.s.tenant_stats()
    assert (st_["a"].num_prefill_tokens, st_["a"].num_decode_tokens, st_["a"].num_waiting_reqs) == (15, 3, 3)
    assert (st_["b"].num_prefill_tokens, st_["b"].num_waiting_reqs) == (0, 1)
    assert st_["a"].counter == 15 + 2 * 3


@requires_rust
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=st.tuples(st.sampled_from([1.0, 0.5, 2.0, 3.0]), st.sampled_from([1.0, 0.5, 2.0, 3.0])),
    max_num_seqs=st.integers(1, 6),
    prompt_max=st.integers(4, 40),
    output_max=st.integers(1, 24),
    budget=st.sampled_from([8, 32, 256]),
    num_blocks=st.sampled_from([26, 64, 400]),
    counts=st.tuples(st.integers(30, 80), st.integers(30, 80)),
    seed=st.integers(0, 2**16),
)
def test_vtc_bound_holds_for_two_backlogged_tenants(
    weights: tuple[float, float], max_num_seqs: int, prompt_max: int, output_max: int, budget: int,
    num_blocks: int, counts: tuple[int, int], seed: int,
) -> None:  # fmt: skip
    """The bound of docs/semantics.md: while f and g both have waiting requests (from step 0, counters equal),
    c_f - c_g <= U_f and c_g - c_f <= U_g, with U_x = max_num_seqs * (w_p * max prompt + w_d * max output) /
    weight_x. Service is measured from the outputs (not read from the counters), and must equal the counters."""
    m = Sim("rust", block_size=4, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=96, policy="fair", tenant_weights={"f": weights[0], "g": weights[1]},
            prefix_hash_seed=0)  # fmt: skip
    rng = np.random.default_rng(seed)
    for name, count in zip("fg", counts, strict=True):
        for k in range(count):
            prompt = rng.integers(3, 10**6, size=int(rng.integers(1, prompt_max + 1)))
            m.add(f"{name}{k}", prompt, max_tokens=int(rng.integers(1, output_max + 1)), arrival_time=float(k),
                  tenant=name)  # fmt: skip
    w = dict(zip("fg", weights, strict=True))
    bound = {x: max_num_seqs * (1.0 * prompt_max + 2.0 * output_max) / w[x] for x in "fg"}
    service = {"f": 0.0, "g": 0.0}
    charged: dict[str, int] = {}
    steps = 0
    while steps < 3000:
        st_ = m.s.tenant_stats()
        if not (st_["f"].num_waiting_reqs and st_["g"].num_waiting_reqs):
            break  # no longer both backlogged
        out = m.s.schedule()
        for rid, n, c in zip(out.req_ids, out.num_scheduled_tokens.tolist(), out.num_computed_tokens.tolist(),
                             strict=True):  # fmt: skip
            end = min(c + n, m.lens[rid])
            service[rid[0]] += 1.0 * max(0, end - max(c, charged.get(rid, 0))) / w[rid[0]]
            charged[rid] = max(charged.get(rid, 0), end)
        res = m.feed(out)
        for rid, k in zip(out.req_ids, res.num_new_tokens.tolist(), strict=True):
            service[rid[0]] += 2.0 * k / w[rid[0]]
        st_ = m.s.tenant_stats()
        assert (st_["f"].counter, st_["g"].counter) == pytest.approx((service["f"], service["g"]))
        assert service["f"] - service["g"] <= bound["f"] + 1e-9
        assert service["g"] - service["f"] <= bound["g"] + 1e-9
        steps += 1
    assert steps > 0


@requires_rust
def test_the_vtc_bound_fails_under_fcfs_on_the_same_kind_of_input() -> None:
    """The property above is not vacuous: fcfs serves g's earlier flood first and the difference runs away."""
    bound = 4 * (1.0 * 16 + 2.0 * 8)
    worst = {}
    for policy in ("fcfs", "fair"):
        m = Sim("rust", block_size=4, num_blocks=400, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=96,
                policy=policy, prefix_hash_seed=0)  # fmt: skip
        for k in range(60):
            m.add(f"g{k}", [k + 1000] * 16, max_tokens=8, arrival_time=float(k), tenant="g")
        for k in range(60):
            m.add(f"f{k}", [k + 5000] * 16, max_tokens=8, arrival_time=100.0 + k, tenant="f")
        worst[policy] = 0.0
        for _ in range(60):
            m.step()
            st_ = m.s.tenant_stats()
            worst[policy] = max(worst[policy], abs(st_["f"].counter - st_["g"].counter))
    assert worst["fair"] <= bound < 5 * bound < worst["fcfs"]


def test_jain_index_limits() -> None:
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([0, 0]) == 1.0


@requires_rust
def test_one_tenant_at_ten_times_the_rate_fair_is_fair_fcfs_is_not_and_throughput_is_kept() -> None:
    stream = TenantStream()  # t0 sends 10x the rate of t1..t3; all four stay backlogged
    steps, window = 2000, 100  # tokens per step depend on the request mix: shorter runs vary by a few %
    runs = {p: run_tenant_stream(p, stream, steps, seed=1) for p in ("fcfs", "fair")}
    for run in runs.values():
        assert run.backlogged[window:].all(), "every tenant must stay backlogged for the comparison to mean much"
    jain = {p: run.window_jain(window, skip=window) for p, run in runs.items()}
    assert jain["fair"].min() >= 0.95
    assert jain["fcfs"].mean() <= 0.6  # t0 gets ~10/13 of the service
    ratio = runs["fair"].throughput(window) / runs["fcfs"].throughput(window)
    assert abs(ratio - 1.0) <= 0.02


@requires_rust
def test_weighted_tenants_get_service_in_proportion_to_their_weights() -> None:
    stream = TenantStream(rates=(1.0, 1.0), weights=(1.0, 3.0))
    run = run_tenant_stream("fair", stream, 600, seed=2)
    assert run.backlogged[100:].all()
    raw = run.service[100:].sum(axis=0) * np.array(stream.weights)  # undo the division by the weight
    assert raw[1] / raw[0] == pytest.approx(3.0, rel=0.05)


@requires_rust
def test_a_weight_change_at_run_time_changes_the_shares_from_then_on() -> None:
    m = Sim("rust", block_size=4, num_blocks=512, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
            policy="fair", prefix_hash_seed=0)  # fmt: skip
    for k in range(300):
        for t in ("a", "b"):
            m.add(f"{t}{k}", [k + (0 if t == "a" else 10**5)] * 8, max_tokens=4, arrival_time=float(k), tenant=t)

    def raw_service(steps: int) -> tuple[int, int]:
        before = m.s.tenant_stats()
        for _ in range(steps):
            m.step()
        after = m.s.tenant_stats()
        a, b = (after[t].num_prefill_tokens + after[t].num_decode_tokens
                - before[t].num_prefill_tokens - before[t].num_decode_tokens for t in ("a", "b"))  # fmt: skip
        return a, b

    a, b = raw_service(100)
    assert a / b == pytest.approx(1.0, rel=0.1)
    m.s.set_tenant_weight("b", 4.0)
    a, b = raw_service(200)
    assert b / a == pytest.approx(4.0, rel=0.15)


# ----------------------------------------------------------------------------------------------------------
# Priority aging
# ----------------------------------------------------------------------------------------------------------


def low_priority_wait(impl: str, aging_steps: int, steps: int = 150) -> int | None:
    """One slot; a priority-5 request waits while a priority-0 request arrives every step."""
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy="priority", priority_aging_steps=aging_steps, prefix_hash_seed=0)  # fmt: skip
    m.add("low", [1, 2, 3], max_tokens=1, priority=5, arrival_time=0.0)
    for step in range(steps):
        m.add(f"hi{step}", [4, 5, 6], max_tokens=1, priority=0, arrival_time=1.0 + step)
        if "low" in m.step().req_ids:
            return step
    return None


@pytest.mark.parametrize("impl", IMPLS)
def test_without_aging_a_low_priority_request_starves(impl: str) -> None:
    assert low_priority_wait(impl, 0) is None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("aging_steps", [1, 4, 10])
def test_with_aging_it_waits_exactly_until_its_age_makes_up_the_priority_gap(impl: str, aging_steps: int) -> None:
    # Keys: low 5 * A + 0; the high request added before step k has 0 * A + k. Equal at k = 5A, where the
    # earlier arrival_time (low's) wins.
    assert low_priority_wait(impl, aging_steps) == 5 * aging_steps


@requires_rust
def test_aging_bounds_the_longest_low_priority_wait_on_a_saturating_stream() -> None:
    stream = PriorityStream()
    without = run_priority_stream(0, stream, arrival_steps=1000, seed=3)
    with_aging = run_priority_stream(50, stream, arrival_steps=1000, seed=3)
    assert without.num_not_admitted == with_aging.num_not_admitted == {0: 0, 1: 0}
    assert max(with_aging.waits[1]) < max(without.waits[1]) / 2


def test_a_config_with_tenant_weights_is_still_hashable_and_immune_to_the_callers_dict() -> None:
    weights = {"a": 2.0}
    cfg = SchedulerConfig(policy="fair", tenant_weights=weights)
    weights["a"] = 5.0  # the config keeps its own copy
    assert cfg.tenant_weights == {"a": 2.0}
    same = SchedulerConfig(policy="fair", tenant_weights={"a": 2})
    assert cfg == same and hash(cfg) == hash(same)
    assert hash(SchedulerConfig()) == hash(SchedulerConfig())
    assert {cfg: 1}[same] == 1
