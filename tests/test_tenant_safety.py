"""Tenant cache isolation and per-tenant limits as properties (docs/semantics.md, "Tenant isolation and limits";
docs/security.md).

- isolation: no request ever shares a block with a request of another tenant, and a probe of another tenant's
  prompt sees no cached token, while a tenant's own hits are those it gets without isolation;
- ``tenant_max_running`` / ``max_running_per_tenant``: a tenant never runs more requests than its limit, and the
  other tenants go past its waiting requests;
- ``tenant_max_waiting`` / ``max_waiting_per_tenant``: ``add_request`` refuses with ``QueueFullError`` and leaves
  no state behind (the same id can be added once there is room).

Scenario tests run on both implementations; hypothesis drives random streams on both (the differential tests hold
the two to each other step by step).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import entry_sizes, requires_rust
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched import QueueFullError, SchedulerError
from kvsched.config import tenant_cache_salt
from kvsched.reference import ReferenceScheduler

IMPLS = ["reference", pytest.param("rust", marks=requires_rust)]
TENANTS = ["default", "a", "b"]
PREFIX = [(5 * i + 1) % 50 for i in range(64)]


def make(impl: str, **fields: Any) -> Any:
    if impl == "reference":
        return ReferenceScheduler(**fields)
    from kvsched import Scheduler

    return Scheduler(**fields)


class Run:
    """A scheduler fed by a fake model that samples token 7 for every entry whose prompt is complete."""

    def __init__(self, impl: str, **fields: Any) -> None:
        fields = {
            "block_size": 4,
            "num_blocks": 64,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "max_model_len": 48,
            **fields,
        }
        self.s = make(impl, **fields)
        self.lens: dict[str, int] = {}
        self.tenant: dict[str, str] = {}

    def add(self, rid: str, prompt: list[int], tenant: str = "default", **kw: Any) -> None:
        self.s.add_request(rid, np.array(prompt, np.int64), tenant=tenant, **kw)
        self.lens[rid] = len(prompt)
        self.tenant[rid] = tenant

    def step(self) -> Any:
        out = self.s.schedule()
        sizes = entry_sizes(self.s, out, self.lens)
        self.s.update_from_output(out, [[] if z is None else [7] for z in sizes])
        self.s.check_invariants()
        return out

    def running_per_tenant(self) -> Counter[str]:
        return Counter(self.tenant[r] for r in self.s.running_req_ids())

    def snapshot(self) -> tuple[Any, ...]:
        s = self.s
        return (
            s.stats(),
            s.tenant_stats(),
            list(s.waiting_req_ids()),
            list(s.running_req_ids()),
            s.num_free_blocks,
            s.num_unfinished_requests,
        )


# ----------------------------------------------------------------------------------------------------------
# Cache isolation
# ----------------------------------------------------------------------------------------------------------


def test_the_tenant_salt_is_distinct_for_distinct_pairs_and_matches_the_core() -> None:
    pairs = [("a", None), ("a", ""), ("a", "b"), ("a:b", None), ("a:1:b", None), ("b", "a"), ("é", None)]
    assert len({tenant_cache_salt(t, s) for t, s in pairs}) == len(pairs)
    assert tenant_cache_salt("é", "x") == "kvsched-tenant:2:é:x"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("isolate", [False, True])
def test_a_probe_of_another_tenants_prompt_hits_only_without_isolation(impl: str, isolate: bool) -> None:
    run = Run(impl, isolate_tenant_cache=isolate)
    run.add("a0", PREFIX[:33], tenant="a", max_tokens=1)
    while run.s.has_unfinished_requests():
        run.step()
    own = run.s.get_num_cached_tokens(PREFIX[:33], tenant="a")
    other = run.s.get_num_cached_tokens(PREFIX[:33], tenant="b")
    assert own == 32
    assert other == (0 if isolate else 32)
    # A request of the other tenant: its first step computes the whole prompt under isolation.
    hits = run.s.stats().prefix_cache_hits
    run.add("b0", PREFIX[:33], tenant="b", max_tokens=1)
    run.step()
    assert run.s.stats().prefix_cache_hits - hits == (0 if isolate else 32)
    if isolate:  # a cache salt chosen by a client does not reach another tenant's blocks either
        forged = tenant_cache_salt("a", None)
        assert run.s.get_num_cached_tokens(PREFIX[:33], cache_salt=forged, tenant="c") == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(["reference", "rust"]),
    ops=st.lists(
        st.tuples(st.sampled_from(TENANTS), st.integers(1, 40), st.sampled_from([None, "s"]), st.integers(0, 3)),
        min_size=1,
        max_size=30,
    ),
)
def test_with_isolation_no_request_ever_shares_a_block_with_another_tenant(impl: str, ops: list[Any]) -> None:
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    run = Run(impl, isolate_tenant_cache=True, num_blocks=48)
    for i, (tenant, n, salt, steps) in enumerate(ops):
        run.add(f"r{i}", PREFIX[:n], tenant=tenant, max_tokens=3, cache_salt=salt)
        for _ in range(steps):
            run.step()
            owner: dict[int, str] = {}
            for rid in run.s.running_req_ids():
                for b in run.s.get_block_ids(rid).tolist():
                    assert owner.setdefault(b, run.tenant[rid]) == run.tenant[rid], f"block {b} shared"
        # Whatever is cached now, a probe hits only blocks its own tenant computed: another tenant never hits.
        seen = {run.tenant[r] for r in run.lens}
        for t in TENANTS:
            if t not in seen:
                assert run.s.get_num_cached_tokens(PREFIX[:40], tenant=t) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_isolation_keeps_a_tenants_own_hits(impl: str) -> None:
    hits = []
    for isolate in (False, True):
        run = Run(impl, isolate_tenant_cache=isolate)
        for i in range(6):
            run.add(f"r{i}", PREFIX[: 20 + i], tenant="a", max_tokens=2)
            run.step()
        while run.s.has_unfinished_requests():
            run.step()
        hits.append(run.s.stats().prefix_cache_hits)
    assert hits[0] == hits[1] > 0


# ----------------------------------------------------------------------------------------------------------
# Running limit
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_a_tenant_at_its_running_limit_waits_and_the_others_go_past(impl: str) -> None:
    run = Run(impl, tenant_max_running={"a": 2})
    for i in range(4):
        run.add(f"a{i}", [1, 2, 3], tenant="a", max_tokens=5)
    run.add("b0", [4, 5, 6], tenant="b", max_tokens=5)
    run.step()
    assert run.running_per_tenant() == {"a": 2, "b": 1}
    assert list(run.s.waiting_req_ids()) == ["a2", "a3"]
    assert run.s.tenant_stats()["a"].num_running_reqs == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(["reference", "rust"]),
    default_limit=st.sampled_from([None, 1, 2, 3]),
    limits=st.dictionaries(st.sampled_from(TENANTS), st.integers(1, 3), max_size=2),
    policy=st.sampled_from(["fcfs", "fair", "priority"]),
    ops=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 30), st.integers(0, 2)), min_size=1, max_size=40),
)
def test_a_tenant_never_runs_more_than_its_limit(
    impl: str, default_limit: int | None, limits: dict[str, int], policy: str, ops: list[Any]
) -> None:
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    run = Run(impl, max_running_per_tenant=default_limit, tenant_max_running=limits, policy=policy, num_blocks=24)

    def check() -> None:
        for t, n in run.running_per_tenant().items():
            limit = limits.get(t, default_limit)
            assert limit is None or n <= limit, f"tenant {t} runs {n} > {limit}"

    for i, (tenant, n, steps) in enumerate(ops):
        run.add(f"r{i}", PREFIX[:n], tenant=tenant, max_tokens=4)
        for _ in range(steps):
            run.step()
            check()
    for _ in range(400):
        if not run.s.has_unfinished_requests():
            break
        run.step()
        check()
    assert not run.s.has_unfinished_requests(), "a limit must not stall the tenant for good"


# ----------------------------------------------------------------------------------------------------------
# Waiting limit
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_a_full_waiting_queue_refuses_with_queue_full_and_changes_nothing(impl: str) -> None:
    run = Run(impl, max_waiting_per_tenant=2, tenant_max_waiting={"b": 1})
    run.add("a0", [1, 2, 3], tenant="a")
    run.add("a1", [1, 2, 3], tenant="a")
    before = run.snapshot()
    with pytest.raises(QueueFullError, match="'a'") as e:
        run.add("a2", [1, 2, 3], tenant="a")
    assert isinstance(e.value, SchedulerError)
    assert run.snapshot() == before
    run.add("b0", [4], tenant="b")  # another tenant has its own room
    with pytest.raises(QueueFullError):
        run.add("b1", [4], tenant="b")
    run.step()  # admitted: running requests leave the waiting count
    run.add("a2", [1, 2, 3], tenant="a")  # the refused id is unknown, so it can come back
    run.add("b1", [4], tenant="b")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(["reference", "rust"]),
    limit=st.integers(1, 3),
    ops=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 30), st.booleans()), min_size=1, max_size=40),
)
def test_a_refused_request_leaves_no_state_behind(impl: str, limit: int, ops: list[Any]) -> None:
    if impl == "rust":
        pytest.importorskip("kvsched._core")
    run = Run(impl, max_waiting_per_tenant=limit, max_num_seqs=2, num_blocks=16)
    for i, (tenant, n, step) in enumerate(ops):
        before = run.snapshot()
        waiting = run.s.tenant_stats().get(tenant)
        try:
            run.add(f"r{i}", PREFIX[:n], tenant=tenant, max_tokens=3)
        except QueueFullError:
            assert waiting is not None and waiting.num_waiting_reqs >= limit
            assert run.snapshot() == before
            with pytest.raises(SchedulerError):
                run.s.get_request_status(f"r{i}")
        else:
            assert waiting is None or waiting.num_waiting_reqs < limit
        if step:
            run.step()
