"""Victim selection (``preemption_victim``; docs/semantics.md, "Victim selection").

- Hand-worked cases, on both implementations: each rule's own victim in one pool, a victim scheduled earlier in
  its step taken back out (tokens, blocks), lcf counting the tokens before the step, shared blocks and the output
  budget in the cost score, the priority level and the fair tenant, swapping a chosen victim.
- Properties of random preemption-heavy runs (shared prefixes, every policy, every preemption mode), the two
  implementations in lock step: under ``default`` and ``lcf`` every victim of a step is the one the rule names
  from the state before the step; under ``cost`` every choice maximises the score computed from the block tables;
  under ``priority`` every victim is from the lowest level left; nothing leaks (blocks, CPU blocks) once drained.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from conftest import entry_sizes, requires_rust
from kvsched import RequestStatus, SchedulerConfig
from kvsched.reference import ReferenceScheduler
from test_differential import compare_outputs

IMPLS = ["reference", pytest.param("rust", marks=requires_rust)]
RULES = ["default", "lcf", "cost"]


def new_scheduler(impl: str, cfg: SchedulerConfig) -> Any:
    if impl == "reference":
        return ReferenceScheduler(cfg)
    from kvsched import Scheduler

    return Scheduler(cfg)


def tokens(k: int, n: int) -> list[int]:
    """``n`` tokens that share no prefix with another ``k``."""
    return [100 * k + j for j in range(n)]


class Sim:
    """A scheduler of either implementation fed by a fake model that samples token 7 (no EOS: requests end at
    ``max_tokens``)."""

    def __init__(self, impl: str, **fields: Any) -> None:
        base = dict(block_size=4, num_blocks=11, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    prefix_hash_seed=0)  # fmt: skip
        self.s = new_scheduler(impl, SchedulerConfig(**{**base, **fields}))
        self.lens: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> None:
        self.s.add_request(rid, prompt, max_tokens=max_tokens, arrival_time=float(len(self.lens)), **kw)
        self.lens[rid] = len(prompt)

    def feed(self, out: Any) -> None:
        sizes = entry_sizes(self.s, out, self.lens)
        self.s.update_from_output(out, [[] if z is None else [7] for z in sizes])
        self.s.check_invariants()

    def until_preemption(self, max_steps: int = 40) -> tuple[dict[str, int], Any]:
        """Steps until one preempts; returns the computed tokens of the running requests before that step, and
        its output (not applied)."""
        for _ in range(max_steps):
            before = {rid: self.s.get_num_computed_tokens(rid) for rid in self.s.running_req_ids()}
            out = self.s.schedule()
            self.s.check_invariants()
            if len(out.preempted_req_ids):
                return before, out
            self.feed(out)
        raise AssertionError("no preemption")

    def drain(self, pending: Any) -> None:
        """Applies ``pending`` (a step scheduled, not applied), then runs until every request finished."""
        self.feed(pending)
        for _ in range(500):
            if not self.s.has_unfinished_requests():
                return
            self.feed(self.s.schedule())
        raise AssertionError("the requests did not finish")


# ----------------------------------------------------------------------------------------------------------
# Hand-worked cases
# ----------------------------------------------------------------------------------------------------------


def three_requests(impl: str, rule: str) -> tuple[Sim, dict[str, int], Any]:
    """10 usable blocks of 4 tokens; a (13-token prompt), b (5), c (7) admitted together, 24 tokens each at most.
    In step 4 a takes the last free block (its 5th), then b needs its 3rd: b preempts. Before that step a, b, c
    have computed 16, 8 and 10 tokens and each has 4 output tokens."""
    m = Sim(impl, preemption_victim=rule)
    for k, (rid, n) in enumerate([("a", 13), ("b", 5), ("c", 7)]):
        m.add(rid, tokens(k, n), max_tokens=24)
    before, out = m.until_preemption()
    assert out.step_id == 4 and before == {"a": 16, "b": 8, "c": 10}
    return m, before, out


@pytest.mark.parametrize("impl", IMPLS)
def test_default_takes_the_tail(impl: str) -> None:
    m, _, out = three_requests(impl, "default")
    assert (list(out.preempted_req_ids), list(out.req_ids)) == (["c"], ["a", "b"])
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
def test_lcf_takes_the_fewest_computed_tokens_and_phase_a_goes_on_after_a_self_preemption(impl: str) -> None:
    m, _, out = three_requests(impl, "lcf")
    # b computed the fewest (8): the request that needs the block is the victim itself; c, after it, still runs.
    assert (list(out.preempted_req_ids), list(out.req_ids)) == (["b"], ["a", "c"])
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
def test_cost_takes_a_request_scheduled_earlier_in_the_step_back_out(impl: str) -> None:
    m, _, out = three_requests(impl, "cost")
    # Scores (output budget left 20/24 for all): a 5 blocks / 17 tokens (its 5th block taken in this step
    # counts: it is freed too), b 2/9, c 3/11. a was scheduled earlier in the step: it leaves the step with its
    # token and its new block, and b and c fit.
    assert (list(out.preempted_req_ids), list(out.req_ids)) == (["a"], ["b", "c"])
    assert out.total_num_scheduled_tokens == 2
    assert m.s.get_request_status("a") == RequestStatus.PREEMPTED
    assert m.s.get_num_computed_tokens("a") == 0 and len(m.s.get_block_ids("a")) == 0
    assert m.s.num_free_blocks == 10 - 3 - 3  # b and c hold 3 blocks each, the rest is free
    m.drain(out)
    assert m.s.num_free_blocks == 10


@pytest.mark.parametrize("impl", IMPLS)
def test_lcf_counts_the_tokens_before_the_step(impl: str) -> None:
    """a (8-token prompt) runs one token behind b (9); in step 4 b needs its 4th block and none is free. Before
    the step a has 11 tokens, b 12; a's token of this step (scheduled before b) does not count: a is the victim,
    taken back out of the step. Counting it would tie a and b at 12 and take b, the later one."""
    m = Sim(impl, num_blocks=7, preemption_victim="lcf")
    m.add("a", tokens(0, 8), max_tokens=10)
    m.add("b", tokens(1, 9), max_tokens=10)
    before, out = m.until_preemption()
    assert before == {"a": 11, "b": 12}
    assert (list(out.preempted_req_ids), list(out.req_ids)) == (["a"], ["b"])
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
def test_cost_counts_only_the_blocks_a_request_alone_holds(impl: str) -> None:
    """s1 and s2 share an 8-token prefix (2 blocks); p shares nothing. In step 1 s1 takes the last free block and
    s2 needs one. s1 holds 4 blocks but only 2 alone (2/13 tokens), p 3 of 3 (3/10), s2 1 of 3: p frees the most
    per token to compute again. Counting shared blocks would take s1 (4/13 > 3/10)."""
    m = Sim(impl, num_blocks=9, preemption_victim="cost")
    prefix = tokens(9, 8)
    m.add("s1", prefix + tokens(1, 4), max_tokens=12)
    m.add("p", tokens(2, 9), max_tokens=12)
    m.add("s2", prefix + tokens(3, 4), max_tokens=12)
    _, out = m.until_preemption()
    assert (list(out.preempted_req_ids), list(out.req_ids)) == (["p"], ["s1", "s2"])
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
def test_cost_spares_a_request_that_has_used_most_of_its_output_budget(impl: str) -> None:
    """Three equal requests but for max_tokens (near: 6, far and t: 16); in step 1 near and far take the last two
    blocks and t needs one. near and far hold 3 blocks for 9 tokens, t 2; near has 5/6 of its budget left, far
    15/16: far goes. (lcf and default take t, the later of equals.)"""
    for rule, victim in [("cost", "far"), ("lcf", "t"), ("default", "t")]:
        m = Sim(impl, num_blocks=9, preemption_victim=rule)
        for k, (rid, mt) in enumerate([("near", 6), ("far", 16), ("t", 16)]):
            m.add(rid, tokens(k, 8), max_tokens=mt)
        _, out = m.until_preemption()
        assert list(out.preempted_req_ids) == [victim], rule
        m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("rule", "victim"), [("default", "c"), ("lcf", "b"), ("cost", "b")])
def test_priority_first_then_the_rule_inside_the_lowest_level(impl: str, rule: str, victim: str) -> None:
    """a (priority 0) computed the fewest tokens but is above the lowest level {b, c} (priority 1): the rule
    chooses between b (10 tokens computed, 3 blocks for 11 tokens) and c (16, 4 for 17)."""
    m = Sim(impl, policy="priority", preemption_victim=rule)
    m.add("a", tokens(0, 5), max_tokens=24, priority=0)
    m.add("b", tokens(1, 7), max_tokens=24, priority=1)
    m.add("c", tokens(2, 13), max_tokens=24, priority=1)
    before, out = m.until_preemption()
    assert before == {"a": 8, "b": 10, "c": 16}
    assert list(out.preempted_req_ids) == [victim]
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("rule", "victim"), [("default", "x2"), ("lcf", "x1"), ("cost", "x1")])
def test_fair_the_rule_inside_the_tenant_with_the_largest_counter(impl: str, rule: str, victim: str) -> None:
    """Tenant x (counter 36) runs x1 and x2, tenant y (counter 13) runs y, which computed the fewest tokens: the
    rule chooses inside x."""
    m = Sim(impl, policy="fair", preemption_victim=rule)
    m.add("x1", tokens(0, 7), max_tokens=24, tenant="x")
    m.add("x2", tokens(1, 13), max_tokens=24, tenant="x")
    m.add("y", tokens(2, 5), max_tokens=24, tenant="y")
    before, out = m.until_preemption()
    assert before == {"x1": 10, "y": 8, "x2": 16}
    assert {t: s.counter for t, s in m.s.tenant_stats().items()} == {"x": 36.0, "y": 13.0}
    assert list(out.preempted_req_ids) == [victim]
    m.drain(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_a_victim_the_rule_chose_is_swapped_out_and_back(impl: str, mode: str) -> None:
    """The lcf case above under swap (and auto with copies cheap next to recompute): a is copied out (its 2
    blocks of 11 tokens before the step), resumed with the copies back, and every block comes back."""
    m = Sim(impl, num_blocks=7, preemption_victim="lcf", preemption_mode=mode, num_cpu_blocks=4,
            swap_cost_per_block=0.1)  # fmt: skip
    m.add("a", tokens(0, 8), max_tokens=10)
    m.add("b", tokens(1, 9), max_tokens=10)
    _, out = m.until_preemption()
    assert list(out.preempted_req_ids) == ["a"]
    assert len(out.swap_out) == 3 and list(m.s.get_cpu_block_ids("a")) == [0, 1, 2]  # ceil(11 / 4) blocks
    m.drain(out)
    st = m.s.stats()
    assert (st.num_swapped_out_reqs, st.num_swapped_in_reqs, st.num_recomputed_tokens) == (1, 1, 0)
    assert m.s.num_free_blocks == 6 and st.num_free_cpu_blocks == 4


# ----------------------------------------------------------------------------------------------------------
# Properties of random runs
# ----------------------------------------------------------------------------------------------------------

FAMILIES = [tokens(50 + k, 16) for k in range(3)]  # shared prefixes: running requests share blocks


class Snapshot:
    """What decides the victims of a step, read through the public API before the step."""

    def __init__(self, s: Any, meta: dict[str, dict[str, Any]]) -> None:
        self.running = list(s.running_req_ids())
        self.computed = {rid: s.get_num_computed_tokens(rid) for rid in self.running}
        self.counters = {t: st.counter for t, st in s.tenant_stats().items()}
        self.meta = meta


def level(snap: Snapshot, cfg: SchedulerConfig, cands: list[str]) -> list[str]:
    """The candidates of the policy's lowest level, in running order."""
    if cfg.policy == "priority":
        top = max(snap.meta[r]["key"] for r in cands)
        return [r for r in cands if snap.meta[r]["key"] == top]
    if cfg.policy == "fair":
        top_counter = max(snap.counters[snap.meta[r]["tenant"]] for r in cands)
        return [r for r in cands if snap.counters[snap.meta[r]["tenant"]] == top_counter]
    return cands


def expected_victim(snap: Snapshot, cfg: SchedulerConfig, cands: list[str]) -> str:
    """The victim of ``default`` or ``lcf`` among ``cands`` (in running order), from the state before the step
    (neither rule reads anything that changes within the step)."""
    lv = level(snap, cfg, cands)
    if cfg.preemption_victim == "lcf":
        fewest = min(snap.computed[r] for r in lv)
        return [r for r in lv if snap.computed[r] == fewest][-1]  # the later of equals
    if cfg.policy == "priority":
        keys = [(snap.meta[r]["key"], snap.meta[r]["arrival"]) for r in lv]
        return lv[keys.index(max(keys))]  # the first of equals
    return lv[-1]


def check_cost_choices(ref: ReferenceScheduler, choices: list[int]) -> None:
    """Wraps the reference's victim choice: each one must maximise the score computed from the block tables
    (a block counts when no other request's table holds it), the later of equals in running order."""
    pick = ref._pick_victim

    def checked(scheduled: list[list[Any]]) -> int:
        j = pick(scheduled)
        running = ref._running
        holders: dict[int, int] = {}
        for r in ref._requests.values():
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        cfg = ref.config
        cands = list(range(len(running)))
        if cfg.policy == "priority":
            top = max(r.effective_priority for r in running)
            cands = [k for k in cands if running[k].effective_priority == top]
        elif cfg.policy == "fair":
            top_counter = max(ref._tenants[r.tenant].counter for r in running)
            cands = [k for k in cands if ref._tenants[running[k].tenant].counter == top_counter]

        def score(r: Any) -> Fraction:
            own = sum(holders[b] == 1 for b in r.block_ids)
            left = Fraction(max(0, r.max_tokens - r.num_output_tokens), max(1, r.max_tokens))
            return Fraction(own, max(1, r.num_tokens)) * left

        best = max(score(running[k]) for k in cands)
        assert j == [k for k in cands if score(running[k]) == best][-1]
        choices.append(j)
        return j

    ref._pick_victim = checked  # type: ignore[method-assign]


def random_run(cfg: SchedulerConfig, seed: int, num_requests: int = 40) -> dict[str, int]:
    """Both implementations in lock step on a preemption-heavy random stream; checks the properties at every
    step. Returns what the run exercised."""
    from kvsched import Scheduler

    rng = np.random.default_rng(seed)
    ref, rs = ReferenceScheduler(cfg), Scheduler(cfg)
    cost_choices: list[int] = []
    if cfg.preemption_victim == "cost":
        check_cost_choices(ref, cost_choices)
    meta: dict[str, dict[str, Any]] = {}
    lens: dict[str, int] = {}
    seen = {"victims": 0, "multi": 0}
    for step in range(2000):
        for _ in range(min(int(rng.poisson(0.6)), num_requests - len(meta))):
            rid = f"r{len(meta)}"
            family = FAMILIES[int(rng.integers(3))]
            prompt = family[: int(rng.integers(0, 17))] + tokens(len(meta), int(rng.integers(1, 9)))
            kw = dict(max_tokens=int(rng.integers(1, 20)), arrival_time=float(step), priority=int(rng.integers(0, 3)),
                      tenant=f"t{int(rng.integers(0, 3))}")  # fmt: skip
            ref.add_request(rid, prompt, **kw)
            rs.add_request(rid, prompt, **kw)
            key = kw["priority"] * cfg.priority_aging_steps + step if cfg.priority_aging_steps else kw["priority"]
            meta[rid] = {"key": key, "arrival": float(step), "tenant": kw["tenant"]}
            lens[rid] = len(prompt)
        if len(meta) == num_requests and not ref.has_unfinished_requests():
            break
        snap = Snapshot(rs, meta)
        a, b = ref.schedule(), rs.schedule()
        compare_outputs(a, b)
        victims = list(a.preempted_req_ids)
        cands = list(snap.running)
        for v in victims:
            if cfg.preemption_victim != "cost":
                assert v == expected_victim(snap, cfg, cands), (step, victims, snap.computed)
            elif cfg.policy == "priority":
                assert v in level(snap, cfg, cands)
            cands.remove(v)
        seen["victims"] += len(victims)
        seen["multi"] += len(victims) > 1
        sizes = entry_sizes(ref, a, lens)
        sampled = [[] if z is None else [7] for z in sizes]
        ref.update_from_output(a, sampled)
        rs.update_from_output(b, sampled)
        for s in (ref, rs):
            s.check_invariants()
        assert list(ref.running_req_ids()) == list(rs.running_req_ids())
    else:
        raise AssertionError("the run did not finish")
    for s in (ref, rs):
        assert s.num_free_blocks == cfg.num_usable_blocks, "a block leaked"
        assert s.stats().num_free_cpu_blocks == cfg.num_cpu_blocks, "a CPU block leaked"
    assert len(cost_choices) == (seen["victims"] if cfg.preemption_victim == "cost" else 0)
    return seen


CASES = [(policy, rule, mode) for policy in ("fcfs", "priority", "fair") for rule in RULES
         for mode in ("recompute", "swap", "auto")]  # fmt: skip


@requires_rust
@pytest.mark.parametrize(("policy", "rule", "mode"), CASES, ids=["-".join(c) for c in CASES])
def test_random_runs_keep_the_victim_properties(policy: str, rule: str, mode: str) -> None:
    seen = {"victims": 0, "multi": 0}
    for seed in range(3):
        cfg = SchedulerConfig(
            block_size=4,
            num_blocks=14,
            max_num_seqs=8,
            max_num_batched_tokens=24,
            max_model_len=48,
            policy=policy,
            priority_aging_steps=2 if policy == "priority" and seed == 2 else 0,
            tenant_weights={"t1": 2.0},
            preemption_victim=rule,
            preemption_mode=mode,
            num_cpu_blocks=0 if mode == "recompute" else 8,
            swap_cost_per_block=0.5,
            scheduler_reserve_full_isl=seed != 1,
            long_prefill_token_threshold=6 if seed == 1 else 0,
            prefix_hash_seed=seed,
        )
        got = random_run(cfg, seed=1000 * seed + len(policy) + len(rule) + len(mode))
        seen = {k: seen[k] + got[k] for k in seen}
    assert seen["victims"] >= 10 and seen["multi"] > 0, seen
