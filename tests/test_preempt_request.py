"""``preempt_request``: a running request preempted by hand (vLLM's ``_preempt_request`` as its tests call it), on
both implementations, and the two kept identical through random workloads that preempt by hand between steps."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from conftest import all_scheduler_classes, entry_sizes, requires_rust
from kvsched import InvalidRequestError, SchedulerTypeError, UnknownRequestError

IMPLS = all_scheduler_classes()
TOK = 7


def _sched(cls: Any, **cfg: Any) -> Any:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_blocks", 32)
    cfg.setdefault("max_model_len", 64)
    return cls(**cfg)


def _step(s: Any, prompt_lens: dict[str, int]) -> Any:
    out = s.schedule()
    sizes = entry_sizes(s, out, prompt_lens)
    s.update_from_output(out, [[] if n is None else [TOK] for n in sizes])
    s.check_invariants()
    return out


@pytest.mark.parametrize("cls", IMPLS, ids=lambda c: c.__name__)
def test_a_request_preempted_by_hand_resumes_first_and_is_reported_once(cls: Any) -> None:
    s = _sched(cls)
    lens = {}
    for i, rid in enumerate(("a", "b")):
        s.add_request(rid, list(range(100 * i, 100 * i + 10)), max_tokens=20)
        lens[rid] = 10
    _step(s, lens)
    s.add_request("c", list(range(300, 310)), max_tokens=20)
    lens["c"] = 10
    free = s.num_free_blocks
    s.preempt_request("a")
    s.check_invariants()
    assert s.num_free_blocks == free + 3  # 11 tokens in blocks of 4
    assert s.stats().num_preemptions == 1
    out = _step(s, lens)
    assert out.preempted_req_ids == ["a"]
    # First in waiting: it resumes before "c" is admitted; its two full blocks are a prefix hit.
    assert out.req_ids == ["b", "a", "c"] and out.resumed_req_ids == ["a"]
    assert out.num_scheduled_tokens.tolist() == [1, 3, 10]
    assert _step(s, lens).preempted_req_ids == []


@pytest.mark.parametrize("cls", IMPLS, ids=lambda c: c.__name__)
def test_in_flight_output_of_a_request_preempted_by_hand_is_stale_or_dropped(cls: Any) -> None:
    for drop in (False, True):
        s = _sched(cls, async_scheduling=True)
        s.add_request("a", list(range(10)), max_tokens=20)
        lens = {"a": 10}
        _step(s, lens)
        out = s.schedule()  # a decode in flight
        s.preempt_request("a", drop_stale_output=drop)
        s.check_invariants()
        res = s.update_from_output(out, [[TOK]])
        # Delivered (stale: it rolls nothing back) unless dropped.
        assert res.num_new_tokens.tolist() == [0 if drop else 1]
        assert s.get_output_token_ids("a") == [TOK] * (1 if drop else 2)


@pytest.mark.parametrize("cls", IMPLS, ids=lambda c: c.__name__)
def test_bad_preempt_requests_raise_and_change_nothing(cls: Any) -> None:
    s = _sched(cls)
    s.add_request("a", list(range(10)), max_tokens=20)
    _step(s, {"a": 10})
    s.add_request("w", list(range(50, 60)), max_tokens=20)
    before = (s.num_free_blocks, s.stats().num_preemptions, s.running_req_ids(), s.waiting_req_ids())
    with pytest.raises(UnknownRequestError):
        s.preempt_request("nope")
    with pytest.raises(InvalidRequestError, match="not running"):
        s.preempt_request("w")
    with pytest.raises(SchedulerTypeError):
        s.preempt_request(3)
    with pytest.raises(SchedulerTypeError):
        s.preempt_request("a", drop_stale_output=1)
    assert (s.num_free_blocks, s.stats().num_preemptions, s.running_req_ids(), s.waiting_req_ids()) == before
    s.check_invariants()


def _summary(out: Any) -> tuple[Any, ...]:
    return (
        out.req_ids,
        out.num_scheduled_tokens.tolist(),
        out.num_computed_tokens.tolist(),
        out.new_block_ids.tolist(),
        out.new_block_ids_indptr.tolist(),
        out.preempted_req_ids,
        out.resumed_req_ids,
    )


@requires_rust
@pytest.mark.parametrize("seed", range(12))
def test_preemptions_by_hand_keep_the_core_and_the_reference_identical(seed: int) -> None:
    """Random arrivals into a tight pool (the step preempts too), synchronous or asynchronous scheduling, with a
    running request preempted by hand before some steps: identical outputs, results and pools step by step."""
    rng = random.Random(seed)
    async_scheduling = seed % 2 == 1
    cfg = {"block_size": 4, "num_blocks": 24, "max_model_len": 64, "max_num_batched_tokens": 32}
    pair = [cls(async_scheduling=async_scheduling, **cfg) for cls in IMPLS]
    lens: dict[str, int] = {}
    in_flight: list[tuple[Any, ...]] = []
    by_hand = 0
    for step in range(120):
        if rng.random() < 0.4:
            rid = f"r{step}"
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            lens[rid], max_tokens = len(prompt), rng.randrange(1, 25)
            for s in pair:
                s.add_request(rid, prompt, max_tokens=max_tokens)
        running = pair[0].running_req_ids()
        assert pair[1].running_req_ids() == running
        if running and rng.random() < 0.2:
            victim, drop = rng.choice(running), rng.random() < 0.5
            for s in pair:
                s.preempt_request(victim, drop_stale_output=drop)
                s.check_invariants()
            by_hand += 1
        outs = [s.schedule() for s in pair]
        assert _summary(outs[0]) == _summary(outs[1])
        sizes = entry_sizes(pair[0], outs[0], lens)
        in_flight.append((outs, [[] if n is None else [rng.choice((TOK, TOK, 0))] for n in sizes]))
        if not async_scheduling or len(in_flight) > 1 or rng.random() < 0.3:
            (outs, rows) = in_flight.pop(0)
            res = [s.update_from_output(o, rows) for s, o in zip(pair, outs, strict=True)]
            assert res[0].finished_req_ids == res[1].finished_req_ids
            np.testing.assert_array_equal(res[0].num_new_tokens, res[1].num_new_tokens)
        for s in pair:
            s.check_invariants()
        assert pair[0].num_free_blocks == pair[1].num_free_blocks
        assert pair[0].stats().num_preemptions == pair[1].stats().num_preemptions
    assert by_hand > 5
