"""The waiting orders beyond fcfs/priority/fair, as behaviour and properties (docs/semantics.md, "Admission
policies"): ``sjf`` (residual, cache-aware, with its lazy re-keying), ``slo`` (deadlines), ``order_key`` tiers,
``max_wait_steps`` aging under every policy, and session affinity inside the fcfs admission window.

Scenario tests run on both implementations; the properties run on both too (hypothesis), since each of them is
a statement about one implementation's admissions (the differential tests hold the two to each other).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from conftest import entry_sizes, requires_rust
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched.reference import ReferenceScheduler

IMPLS = ["reference", pytest.param("rust", marks=requires_rust)]
BOTH = ["reference", "rust"]  # for hypothesis: the rust examples skip without the extension


class Sim:
    """A scheduler of either implementation plus the prompt lengths its fake model needs."""

    def __init__(self, impl: str, **fields: Any) -> None:
        fields.setdefault("prefix_hash_seed", 0)
        if impl == "reference":
            self.s: Any = ReferenceScheduler(**fields)
        else:
            from kvsched import Scheduler

            self.s = Scheduler(**fields)
        self.lens: dict[str, int] = {}
        self.steps = 0

    def add(self, rid: str, prompt: Any, **kw: Any) -> None:
        self.s.add_request(rid, list(prompt), **kw)
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
        self.steps += 1
        return out

    def admitted(self, out: Any) -> list[str]:
        """The requests ``out`` admitted (new or resumed), in admission order."""
        fresh = set(out.new_req_ids) | set(out.resumed_req_ids)
        return [r for r in out.req_ids if r in fresh]

    def run_until_empty(self, max_steps: int = 500) -> list[str]:
        """Steps until nothing is left; the admissions in order."""
        order: list[str] = []
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return order
            order += self.admitted(self.step())
        raise AssertionError("requests left after max_steps")


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------------------------------------------
# sjf
# ----------------------------------------------------------------------------------------------------------

LONG = toks(100, 40)  # 10 blocks of 4


def warm_long_vs_cold_short(impl: str, policy: str) -> list[str]:
    """One slot. The 40-token prompt LONG is cached (a finished request computed it); a cold 12-token request
    and a 44-token continuation of LONG (its first 10 blocks cached: 1 block left) wait behind a running one."""
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy=policy)  # fmt: skip
    m.add("seed", LONG, max_tokens=1, arrival_time=0.0)
    m.step()
    m.add("busy", toks(300, 8), max_tokens=3, arrival_time=1.0)
    m.step()
    m.add("cold", toks(500, 12), max_tokens=1, arrival_time=2.0)
    m.add("warm", [*LONG, 1, 2, 3, 4], max_tokens=1, arrival_time=3.0)
    return m.run_until_empty()


@pytest.mark.parametrize("impl", IMPLS)
def test_sjf_prefers_a_warm_long_prompt_over_a_cold_shorter_one(impl: str) -> None:
    assert warm_long_vs_cold_short(impl, "sjf")[-2:] == ["warm", "cold"]
    assert warm_long_vs_cold_short(impl, "fcfs")[-2:] == ["cold", "warm"]


@pytest.mark.parametrize("impl", IMPLS)
def test_sjf_orders_cold_prompts_by_blocks_then_arrival_then_id(impl: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy="sjf", enable_prefix_caching=False)  # fmt: skip
    m.add("busy", toks(1, 4), max_tokens=2, arrival_time=0.0)
    m.step()
    m.add("c9", toks(10, 9), max_tokens=1, arrival_time=1.0)  # 3 blocks
    m.add("b12", toks(30, 12), max_tokens=1, arrival_time=2.0)  # 3 blocks, later
    m.add("a5", toks(50, 5), max_tokens=1, arrival_time=3.0)  # 2 blocks
    m.add("z8", toks(70, 8), max_tokens=1, arrival_time=0.5)  # 2 blocks, earliest
    m.add("y8", toks(90, 8), max_tokens=1, arrival_time=0.5)  # 2 blocks, same time: id order
    assert m.run_until_empty() == ["y8", "z8", "a5", "c9", "b12"]


@pytest.mark.parametrize("impl", IMPLS)
def test_sjf_re_keys_a_waiting_request_whose_prefix_was_evicted(impl: str) -> None:
    """The warm request was queued with a residual of 1 block; the cache is cleared while it waits, so when it
    reaches the head it is probed again (11 blocks) and the cold 3-block request goes first."""
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy="sjf")  # fmt: skip
    m.add("seed", LONG, max_tokens=1, arrival_time=0.0)
    m.step()
    m.s.set_pause_state("paused_new")
    m.add("warm", [*LONG, 1, 2, 3, 4], max_tokens=1, arrival_time=1.0)
    m.add("cold", toks(500, 12), max_tokens=1, arrival_time=2.0)
    assert m.s.waiting_req_ids() == ["warm", "cold"]  # by the residuals probed when they were added
    assert m.s.reset_prefix_cache()
    assert m.s.waiting_req_ids() == ["warm", "cold"]  # not re-probed until it is the head of an admission pass
    m.s.set_pause_state("unpaused")
    assert m.run_until_empty() == ["cold", "warm"]


# ----------------------------------------------------------------------------------------------------------
# slo and order_key
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("default", [None, 2.5])
def test_slo_admits_by_deadline_and_requests_without_one_last(impl: str, default: float | None) -> None:
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy="slo", default_ttft_slo_s=default)  # fmt: skip
    m.add("busy", toks(1, 4), max_tokens=2, arrival_time=0.0)
    m.step()
    m.add("a", toks(10, 4), max_tokens=1, arrival_time=0.0, ttft_slo_s=10.0)  # deadline 10
    m.add("none", toks(20, 4), max_tokens=1, arrival_time=0.2)  # no target: the default's, or no deadline
    m.add("b", toks(30, 4), max_tokens=1, arrival_time=1.0, ttft_slo_s=2.0)  # deadline 3
    m.add("d", toks(40, 4), max_tokens=1, arrival_time=2.0, ttft_slo_s=1.0)  # deadline 3, later arrival
    m.add("e", toks(50, 4), max_tokens=1, arrival_time=9.5, ttft_slo_s=0.25)  # deadline 9.75
    expected = ["b", "d", "e", "a", "none"] if default is None else ["none", "b", "d", "e", "a"]  # none: 2.7
    assert m.s.waiting_req_ids() == expected
    assert m.run_until_empty() == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair", "sjf", "slo"])
def test_order_key_is_a_tier_before_the_policys_order(impl: str, policy: str) -> None:
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy=policy)  # fmt: skip
    m.add("busy", toks(1, 4), max_tokens=2, arrival_time=0.0)
    m.step()
    # Within a tier every policy here keeps these in arrival order (equal priority, length, deadline, tenant).
    for k, tier in enumerate([1, None, -1, 0, 1, -1]):
        m.add(f"r{k}", toks(10 * k + 10, 4), max_tokens=1, arrival_time=float(k), order_key=tier)
    assert m.run_until_empty() == ["r2", "r5", "r1", "r3", "r0", "r4"]


# ----------------------------------------------------------------------------------------------------------
# Aging
# ----------------------------------------------------------------------------------------------------------


def starved_wait(impl: str, policy: str, max_wait_steps: int | None, steps: int = 60) -> int | None:
    """One slot, one-token requests. A request the policy ranks last (a long prompt under sjf, a late
    deadline under slo, a higher tier under fcfs, priority 5 under priority) is added first; then a request it
    ranks first arrives before every step. Returns the step that admits the first one, or None."""
    m = Sim(impl, block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
            policy=policy, max_wait_steps=max_wait_steps)  # fmt: skip
    low: dict[str, Any] = {
        "sjf": {},
        "slo": {"ttft_slo_s": 100.0},
        "fcfs": {"order_key": 1},
        "priority": {"priority": 5},
    }[policy]
    m.add("low", toks(100, 40 if policy == "sjf" else 4), max_tokens=1, arrival_time=0.0, **low)
    for step in range(steps):
        m.add(f"hi{step}", toks(step * 8 % 60, 4), max_tokens=1, arrival_time=1.0 + step, ttft_slo_s=1.0)
        if "low" in m.step().req_ids:
            return step
    return None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", ["sjf", "slo", "fcfs", "priority"])
def test_without_aging_the_last_ranked_request_starves(impl: str, policy: str) -> None:
    assert starved_wait(impl, policy, None) is None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", ["sjf", "slo", "fcfs", "priority"])
@pytest.mark.parametrize("n", [1, 3, 10])
def test_with_max_wait_steps_it_is_admitted_once_it_has_waited_that_many_steps(impl: str, policy: str, n: int) -> None:
    # Added before step 0, it waits in steps 0 .. n-1 and is aged at step n.
    assert starved_wait(impl, policy, n) == n


@pytest.mark.parametrize("impl", IMPLS)
def test_aging_never_passes_a_preempted_request_at_the_head(impl: str) -> None:
    """A priority-0 request preempted for blocks is the policy's next request when the slot frees; an aged
    priority-9 request waits behind it, then goes before the younger priority-0 requests."""
    m = Sim(impl, block_size=4, num_blocks=9, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32,
            policy="priority", max_wait_steps=2)  # fmt: skip
    m.add("a", toks(0, 12), max_tokens=12, priority=0, arrival_time=0.0)  # grows to 6 blocks
    m.add("b", toks(20, 12), max_tokens=12, priority=0, arrival_time=0.5)
    m.add("old", toks(40, 4), max_tokens=1, priority=9, arrival_time=1.0)
    m.add("young", toks(60, 4), max_tokens=1, priority=0, arrival_time=2.0)
    order: list[tuple[str, str]] = []
    while m.s.has_unfinished_requests():
        out = m.step()
        order += [(r, "resumed" if r in out.resumed_req_ids else "new") for r in m.admitted(out)]
    preempted_b = ("b", "resumed") in order
    assert preempted_b, order
    assert order.index(("b", "resumed")) < order.index(("old", "new")) < order.index(("young", "new"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(BOTH),
    policy=st.sampled_from(["fcfs", "priority", "fair", "sjf", "slo"]),
    n=st.integers(1, 6),
    slots=st.integers(1, 3),
    arrivals=st.lists(st.integers(0, 3), min_size=20, max_size=60),
    data=st.data(),
)
def test_aging_bounds_the_wait(impl: str, policy: str, n: int, slots: int, arrivals: list[int], data: Any) -> None:
    """Plenty of KV blocks and budget, one-token requests (each finishes in the step that admits it): every
    step admits ``slots`` requests while enough wait. Then a request that entered waiting at step e is admitted
    by step e + N + floor(k / slots), where k counts the requests ahead of it in the aging FIFO (entered
    before it) still waiting at step e + N; and once aged, no request that entered after it is admitted before
    it. The policy's own keys are random (priorities, lengths, deadlines, tiers, tenants)."""
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    m = Sim(impl, block_size=4, num_blocks=512, max_num_seqs=slots, max_num_batched_tokens=512, max_model_len=64,
            policy=policy, max_wait_steps=n, default_ttft_slo_s=3.0)  # fmt: skip
    since: dict[str, int] = {}
    admitted_at: dict[str, int] = {}
    fifo: list[str] = []  # the aging FIFO: requests in the order they entered waiting
    k = 0
    for step, num_new in enumerate([*arrivals, *[0] * 200]):
        for _ in range(num_new):
            rid = f"r{k}"
            k += 1
            kw = {
                "priority": data.draw(st.integers(0, 3)),
                "order_key": data.draw(st.sampled_from([None, 0, 1])),
                "tenant": data.draw(st.sampled_from(["a", "b"])),
                "ttft_slo_s": data.draw(st.sampled_from([None, 0.5, 5.0])),
            }
            m.add(rid, toks(10 * k, data.draw(st.integers(1, 30))), max_tokens=1, arrival_time=float(step), **kw)
            since[rid] = step
            fifo.append(rid)
        waiting = [r for r in fifo if r not in admitted_at]
        if not waiting and not m.s.has_unfinished_requests():
            break
        aged = [r for r in waiting if step - since[r] >= n]
        out = m.step()
        got = m.admitted(out)
        assert not out.preempted_req_ids and not out.resumed_req_ids
        for r in got:
            admitted_at[r] = step
        # Aged requests go first, oldest first; only once none is left do the others come.
        assert got[: len(aged)] == aged[: len(got)], (step, aged, got)
    for r, e in since.items():
        ahead = [q for q in fifo[: fifo.index(r)] if admitted_at[q] >= e + n]
        assert admitted_at[r] <= e + n + len(ahead) // slots, (r, e, admitted_at[r], len(ahead))


# ----------------------------------------------------------------------------------------------------------
# slo admits in deadline order (property)
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(BOTH),
    reqs=st.lists(
        st.tuples(
            st.floats(0.0, 20.0, allow_nan=False),  # arrival time
            st.sampled_from([None, 0.1, 1.0, 2.5, 10.0]),  # ttft_slo_s
            st.sampled_from([None, None, -1, 1]),  # order_key
            st.integers(1, 40),  # prompt length
        ),
        min_size=1,
        max_size=40,
    ),
    default=st.sampled_from([None, 3.0]),
    slots=st.integers(1, 4),
)
def test_slo_admits_in_deadline_order(
    impl: str, reqs: list[tuple[float, float | None, int | None, int]], default: float | None, slots: int
) -> None:
    """Requests arrive over a few steps; every step's admissions are the first requests of the waiting queue
    in ``(order_key, deadline, arrival_time, id)`` order, the deadline ``arrival_time + ttft_slo_s`` (or the
    default's; infinite without one)."""
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    m = Sim(impl, block_size=4, num_blocks=512, max_num_seqs=slots, max_num_batched_tokens=64, max_model_len=64,
            policy="slo", default_ttft_slo_s=default)  # fmt: skip
    keys: dict[str, tuple[int, float, float, str]] = {}
    pending = list(enumerate(reqs))
    while pending or m.s.has_unfinished_requests():
        for i, (t, slo, tier, n) in pending[:3]:
            rid = f"q{i:02d}"
            m.add(rid, toks(100 * i, n), max_tokens=2, arrival_time=t, ttft_slo_s=slo, order_key=tier)
            target = default if slo is None else slo
            keys[rid] = (tier or 0, math.inf if target is None else t + target, t, rid)
        pending = pending[3:]
        waiting = m.s.waiting_req_ids()
        assert waiting == sorted(waiting, key=keys.__getitem__)
        out = m.step()
        got = [r for r in out.new_req_ids]
        assert got == waiting[: len(got)]


# ----------------------------------------------------------------------------------------------------------
# Session affinity
# ----------------------------------------------------------------------------------------------------------

TURN1 = toks(200, 16)  # 4 blocks


def session_scenario(impl: str, **over: Any) -> list[str]:
    """One slot, fcfs with a window of 4 (threshold 1.0: no warm-before-cold). Turn 1 of session "s" runs and
    finishes; while another request runs, two cold requests queue, then turn 2 of "s" (turn 1's prompt and
    more: its prefix is cached). Returns the admissions after turn 1."""
    fields = dict(block_size=4, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                  cache_aware_admission_window=4, cache_aware_admission_threshold=1.0,
                  session_ttl_steps=20)  # fmt: skip
    turn2_kw = {"session_id": over.pop("turn2_session", "s")}
    busy_tokens = over.pop("busy_tokens", 3)
    fields.update(over)
    m = Sim(impl, **fields)
    m.add("turn1", TURN1, max_tokens=2, arrival_time=0.0, session_id="s")
    m.add("busy", toks(400, 8), max_tokens=busy_tokens, arrival_time=0.5)
    order: list[str] = []
    for _ in range(3):  # turn1 runs (steps 0, 1) and finishes; busy is admitted in step 2
        order += m.admitted(m.step())
    m.add("c1", toks(500, 8), max_tokens=1, arrival_time=1.0)
    m.add("c2", toks(600, 8), max_tokens=1, arrival_time=2.0)
    m.add("turn2", [*TURN1, 7, 7, 9, 9], max_tokens=1, arrival_time=3.0, **turn2_kw)
    return [r for r in order + m.run_until_empty() if r not in ("turn1",)]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_warm_continuation_of_a_recent_session_is_promoted(impl: str) -> None:
    assert session_scenario(impl) == ["busy", "turn2", "c1", "c2"]


@pytest.mark.parametrize("impl", IMPLS)
def test_no_promotion_without_a_session_after_its_ttl_or_without_a_window(impl: str) -> None:
    assert session_scenario(impl, turn2_session=None) == ["busy", "c1", "c2", "turn2"]
    assert session_scenario(impl, turn2_session="other") == ["busy", "c1", "c2", "turn2"]
    assert session_scenario(impl, session_ttl_steps=1, busy_tokens=6) == ["busy", "c1", "c2", "turn2"]
    assert session_scenario(impl, cache_aware_admission_window=0) == ["busy", "c1", "c2", "turn2"]


@pytest.mark.parametrize("impl", IMPLS)
def test_no_promotion_once_the_head_has_waited_max_wait_steps(impl: str) -> None:
    assert session_scenario(impl, max_wait_steps=50) == ["busy", "turn2", "c1", "c2"]
    assert session_scenario(impl, max_wait_steps=2) == ["busy", "c1", "c2", "turn2"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(BOTH),
    num_blocks=st.integers(14, 30),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 8)), min_size=10, max_size=80),
)
def test_a_session_promotion_never_passes_a_preempted_request(impl: str, num_blocks: int, ops: Any) -> None:
    """fcfs with a window and sessions whose turns extend each other (warm), under memory pressure (requests
    are preempted and resumed). The window's warm-before-cold rule is off (threshold 1.0), so the only
    reordering is the promotion of session affinity: in every step, each resumed request is admitted before
    every new one."""
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    m = Sim(impl, block_size=4, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
            cache_aware_admission_window=6, cache_aware_admission_threshold=1.0, session_ttl_steps=10)  # fmt: skip
    history: dict[int, list[int]] = {}
    k = 0
    for kind, session, length in ops:
        if kind <= 2:  # a new turn of `session_id` s<session>: its last prompt plus more
            base = history.get(session, toks(1000 * (session + 1), 8))
            prompt = (base + toks(50 * k, length))[:40]
            history[session] = prompt
            m.add(f"t{k}", prompt, max_tokens=kind + 2, arrival_time=float(k), session_id=f"s{session}")
            k += 1
        elif kind == 3:
            m.add(f"c{k}", toks(5000 + 50 * k, 4 * length), max_tokens=3, arrival_time=float(k))
            k += 1
        else:
            out = m.step()
            got = m.admitted(out)
            kinds = ["r" if r in out.resumed_req_ids else "n" for r in got]
            assert "".join(kinds) == "r" * kinds.count("r") + "n" * kinds.count("n"), (got, kinds)
    m.run_until_empty()
