"""Behaviour tests of the Rust scheduler (``kvsched.Scheduler``) through its Python API.

One test (or a small group) per numbered point of ``docs/semantics.md``; each is named after what it proves.
Small block sizes and pools keep every scenario traceable by hand (block ids included).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kvsched
import numpy as np
import pytest
from kvsched import FinishReason, RequestStatus, Scheduler, SchedulerConfig
from kvsched import scheduler as scheduler_module

# ---------------------------------------------------------------------------------------------------------
# Helpers


def make(**fields: Any) -> Scheduler:
    """A small scheduler (block_size 4) with a fixed hash seed; ``fields`` override the defaults."""
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 64,
        "max_model_len": 64,
        "max_num_batched_tokens": 256,
        "prefix_hash_seed": 0,
    }
    cfg.update(fields)
    return Scheduler(**cfg)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def num_tokens(s: Scheduler, rid: str) -> int:
    return s._request_info(rid)[0] + len(s.get_output_token_ids(rid))


def is_chunk(s: Scheduler, rid: str) -> bool:
    """Right after ``schedule()``: True if this step was a partial prefill for ``rid``."""
    return s.get_num_computed_tokens(rid) < num_tokens(s, rid)


def answer(s: Scheduler, out: Any, tok: int = 7) -> list[list[int]]:
    """One token for each entry that is not a prefill chunk (call right after ``schedule()``)."""
    return [[] if is_chunk(s, rid) else [tok] for rid in out.req_ids]


def step(s: Scheduler, tok: int = 7) -> tuple[Any, Any]:
    out = s.schedule()
    s.check_invariants()
    res = s.update_from_output(out, answer(s, out, tok))
    s.check_invariants()
    return out, res


def run_all(s: Scheduler, tok: int = 7, max_steps: int = 1000) -> list[str]:
    finished: list[str] = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return finished
        _, res = step(s, tok)
        finished += res.finished_req_ids
    raise AssertionError("did not finish")


def blocks_of(out: Any, rid: str) -> list[int]:
    k = out.req_ids.index(rid)
    p = out.new_block_ids_indptr
    return out.new_block_ids[p[k] : p[k + 1]].tolist()


def by_id(out: Any) -> dict[str, int]:
    return out.num_scheduled_tokens_by_id()


# ---------------------------------------------------------------------------------------------------------
# Block pool


def test_null_block_is_never_handed_out_and_every_usable_block_is():
    s = make(num_blocks=9, max_model_len=32)  # 8 usable blocks of 4 tokens
    for i in range(4):
        s.add_request(f"r{i}", prompt(100 * i, 8), max_tokens=1)  # 2 blocks each
    out = s.schedule()
    held = [b for rid in out.req_ids for b in s.get_block_ids(rid).tolist()]
    assert 0 not in held
    assert sorted(held) == list(range(1, 9))
    assert s.num_free_blocks == 0
    assert s.stats().kv_cache_usage == 1.0


def test_fresh_pool_allocates_in_id_order_and_counts_usable_blocks():
    s = make(num_blocks=17, max_model_len=32)
    assert s.num_free_blocks == 16 == s.config.num_usable_blocks
    assert s.stats().kv_cache_usage == 0.0
    s.add_request("a", prompt(0, 9), max_tokens=4)  # 3 blocks
    out = s.schedule()
    assert blocks_of(out, "a") == [1, 2, 3]
    assert s.num_free_blocks == 13
    assert s.stats().num_free_blocks == 13
    assert s.stats().kv_cache_usage == pytest.approx(1 - 13 / 16)


def test_finishing_returns_every_block_to_the_free_count():
    s = make(num_blocks=17, max_model_len=32)
    s.add_request("a", prompt(0, 9), max_tokens=4)
    s.add_request("b", prompt(50, 5), max_tokens=2)
    run_all(s)
    assert s.num_free_blocks == 16
    assert s.stats().kv_cache_usage == 0.0


# ---------------------------------------------------------------------------------------------------------
# Prefix cache


def test_shared_prefix_hits_through_the_hash_chain():
    s = make()
    s.add_request("a", prompt(0, 12), max_tokens=1)
    run_all(s)
    shared = [*prompt(0, 8), 900, 901, 902]
    assert s.get_num_cached_tokens(shared) == 8
    s.add_request("b", shared, max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [8]
    assert out.num_scheduled_tokens.tolist() == [3]
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (12 + 11, 8)
    assert s._request_info("b")[2] == 8  # num_cached_tokens


def test_a_changed_earlier_block_breaks_the_chain():
    s = make()
    s.add_request("a", prompt(0, 12), max_tokens=1)
    run_all(s)
    changed_first = [999, *prompt(1, 11), 5]  # block 1 and 2 identical, block 0 not
    assert s.get_num_cached_tokens(changed_first) == 0
    changed_second = [*prompt(0, 4), 999, *prompt(5, 7), 5]
    assert s.get_num_cached_tokens(changed_second) == 4


def test_lookup_is_capped_so_the_last_token_is_computed():
    s = make()
    s.add_request("a", prompt(0, 16), max_tokens=1)  # 16 prompt tokens + 1 output: 4 full blocks cached
    run_all(s)
    assert s.get_num_cached_tokens(prompt(0, 16)) == 12  # exactly 4*bs: at most 3 blocks
    assert s.get_num_cached_tokens(prompt(0, 17)) == 16
    assert s.get_num_cached_tokens(prompt(0, 13)) == 12
    assert s.get_num_cached_tokens(prompt(0, 12)) == 8
    s.add_request("b", prompt(0, 16), max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [12]
    assert out.num_scheduled_tokens.tolist() == [4]


def test_identical_prompts_admitted_in_the_same_step_already_hit():
    s = make()
    s.add_request("a", prompt(0, 16), max_tokens=3)
    s.add_request("b", prompt(0, 16), max_tokens=3)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [0, 12]
    assert out.num_scheduled_tokens.tolist() == [16, 4]
    a, b = blocks_of(out, "a"), blocks_of(out, "b")
    assert a[:3] == b[:3]
    assert a[3] != b[3]
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (32, 12)
    s.check_invariants()


def test_cache_salt_and_lora_name_isolate_the_cache():
    s = make()
    s.add_request("plain", prompt(0, 9), max_tokens=1)
    s.add_request("salted", prompt(100, 9), max_tokens=1, cache_salt="tenant-a")
    s.add_request("lora", prompt(200, 9), max_tokens=1, lora_name="adapter")
    run_all(s)
    assert s.get_num_cached_tokens(prompt(0, 9)) == 8
    assert s.get_num_cached_tokens(prompt(0, 9), cache_salt="x") == 0
    assert s.get_num_cached_tokens(prompt(0, 9), lora_name="x") == 0
    assert s.get_num_cached_tokens(prompt(100, 9)) == 0
    assert s.get_num_cached_tokens(prompt(100, 9), cache_salt="tenant-b") == 0
    assert s.get_num_cached_tokens(prompt(100, 9), cache_salt="tenant-a") == 8
    assert s.get_num_cached_tokens(prompt(200, 9)) == 0
    assert s.get_num_cached_tokens(prompt(200, 9), lora_name="other") == 0
    assert s.get_num_cached_tokens(prompt(200, 9), lora_name="adapter") == 8
    # Both keys must match: the lora_name keys every block, the salt block 0 (and the chain carries it).
    assert s.get_num_cached_tokens(prompt(100, 9), cache_salt="tenant-a", lora_name="adapter") == 0


def test_output_tokens_fill_cached_blocks_too():
    s = make()
    s.add_request("a", prompt(0, 6), max_tokens=4)
    run_all(s, tok=7)  # 10 tokens: blocks [0..3] and [4, 5, 7, 7] are full and cached
    assert s.get_num_cached_tokens([*prompt(0, 6), 7, 7, 7]) == 8
    assert s.get_num_cached_tokens([*prompt(0, 6), 7, 8, 7]) == 4


def test_draft_tokens_are_never_cached():
    s = make(num_lookahead_tokens=2)
    s.add_request("r", prompt(0, 5))
    out = s.schedule()
    s.update_from_output(out, [[7]], draft_token_ids=[[50, 51]])
    out = s.schedule()  # computes token 5 (the 7) and the drafts at 6 and 7: block 1 is not known to be full
    assert s.get_num_cached_tokens([*prompt(0, 5), 7, 50, 51, 1]) == 4
    assert len(s.get_block_hashes("r")) == 1
    s.update_from_output(out, [[50, 51, 9]])  # both accepted: now the block holds known tokens
    assert len(s.get_block_hashes("r")) == 2


def test_prefix_caching_off_never_hits():
    s = make(enable_prefix_caching=False)
    s.add_request("a", prompt(0, 16), max_tokens=3)
    s.add_request("b", prompt(0, 16), max_tokens=3)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [0, 0]
    assert s.get_block_hashes("a") == []
    assert s.get_num_cached_tokens(prompt(0, 16)) == 0
    assert s.stats().prefix_cache_hits == 0
    s.update_from_output(out, [[7], [7]])
    run_all(s)
    assert s.get_num_cached_tokens(prompt(0, 17)) == 0
    assert s.num_free_blocks == 63


def test_same_seed_gives_equal_hashes_and_different_seeds_do_not():
    a, b, c = make(prefix_hash_seed=1), make(prefix_hash_seed=1), make(prefix_hash_seed=2)
    for s in (a, b, c):
        s.add_request("r", prompt(0, 9))
    assert a.get_block_hashes("r") == b.get_block_hashes("r")
    assert a.get_block_hashes("r") != c.get_block_hashes("r")
    assert len(a.get_block_hashes("r")) == 2
    assert all(len(h) == 16 for h in a.get_block_hashes("r"))
    sha = make(prefix_hash_algo="sha256")
    sha.add_request("r", prompt(0, 9))
    assert all(len(h) == 32 for h in sha.get_block_hashes("r"))


def test_get_num_cached_tokens_is_side_effect_free():
    def scenario(probe: bool) -> tuple[list[int], Any]:
        s = make(num_blocks=9, max_model_len=32)  # 8 usable
        s.add_request("a", prompt(0, 9), max_tokens=1)
        run_all(s)
        before = (s.stats(), s.num_free_blocks)
        if probe:
            for _ in range(3):
                assert s.get_num_cached_tokens(prompt(0, 9)) == 8
                assert s.get_num_cached_tokens(prompt(0, 5)) == 4
            assert (s.stats(), s.num_free_blocks) == before
        # Take 7 of the 8 free blocks: if the probe had touched the LRU order, other blocks would survive.
        s.add_request("b", prompt(500, 28), max_tokens=1)
        out = s.schedule()
        return blocks_of(out, "b"), s.get_num_cached_tokens(prompt(0, 9))

    assert scenario(probe=True) == scenario(probe=False)


def test_free_evicts_deepest_block_first_and_unhashed_blocks_are_reused_first():
    s = make(num_blocks=9, max_model_len=32)  # 8 usable: free queue 1..8
    s.add_request("a", prompt(0, 9), max_tokens=1)  # blocks [1, 2, 3]; 1 and 2 full (hashed)
    out = s.schedule()
    assert blocks_of(out, "a") == [1, 2, 3]
    s.update_from_output(out, [[7]])  # a finishes: 3 -> head, then 2, 1 -> tail
    # Free queue now: 3, 4, 5, 6, 7, 8, 2, 1
    s.add_request("b", prompt(100, 5), max_tokens=1)  # 2 blocks from the head
    out = s.schedule()
    assert blocks_of(out, "b") == [3, 4]
    s.update_from_output(out, [[7]])  # b finishes: 4 (unhashed) -> head, 3 -> tail
    # Free queue now: 4, 5, 6, 7, 8, 2, 1, 3
    assert s.get_num_cached_tokens(prompt(0, 9)) == 8
    s.add_request("c", prompt(200, 23), max_tokens=1)  # 6 blocks: 4..8, then evicts 2 (a's deepest)
    out = s.schedule()
    assert blocks_of(out, "c") == [4, 5, 6, 7, 8, 2]
    assert s.get_num_cached_tokens(prompt(0, 9)) == 4  # a's block 0 (block 1) still cached
    s.update_from_output(out, [[7]])  # c finishes: its last block (not cached) -> head, 5 others -> tail
    s.add_request("d", prompt(300, 2), max_tokens=5)
    out = s.schedule()
    assert blocks_of(out, "d") == [2]  # c's unhashed last block comes back first
    s.add_request("e", prompt(400, 2), max_tokens=5)
    out = s.schedule()
    assert blocks_of(out, "e") == [1]  # then the least recently freed hashed block: a's block 0
    assert s.get_num_cached_tokens(prompt(0, 9)) == 0  # a probe after eviction misses
    s.check_invariants()


def test_cached_blocks_are_evicted_lru_across_requests():
    s = make(num_blocks=9, max_model_len=32)  # 8 usable
    s.add_request("a", prompt(0, 8), max_tokens=1)  # blocks 1, 2, both cached
    run_all(s)
    s.add_request("b", prompt(100, 8), max_tokens=1)  # blocks 3, 4, both cached
    run_all(s)
    # Free queue: 5, 6, 7, 8 (never hashed), then a's blocks deepest first (2, 1), then b's (4, 3).
    assert s.get_num_cached_tokens(prompt(0, 9)) == 8
    assert s.get_num_cached_tokens(prompt(100, 9)) == 8
    s.add_request("c", prompt(200, 17), max_tokens=5)  # 5 blocks: 5..8, then a's deepest block
    out = s.schedule()
    assert blocks_of(out, "c") == [5, 6, 7, 8, 2]
    assert s.get_num_cached_tokens(prompt(0, 9)) == 4
    assert s.get_num_cached_tokens(prompt(100, 9)) == 8
    s.add_request("d", prompt(300, 2), max_tokens=5)
    out = s.schedule()
    assert blocks_of(out, "d") == [1]  # a's first block: a was freed before b
    assert s.get_num_cached_tokens(prompt(0, 9)) == 0
    assert s.get_num_cached_tokens(prompt(100, 9)) == 8
    s.add_request("e", prompt(400, 2), max_tokens=5)
    out = s.schedule()
    assert blocks_of(out, "e") == [4]  # then b's deepest
    assert s.get_num_cached_tokens(prompt(100, 9)) == 4
    s.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# Requests


def test_an_output_names_its_requests_after_they_finish_and_new_requests_take_their_slots():
    # Ids are kept by slot and an output looks them up when asked: it must see the ids as they were when it was
    # scheduled, whatever was added since (more than one 64-slot chunk of the id table, slots reused included).
    s = make(num_blocks=512, max_num_seqs=128)
    first = [f"first-{i}" for i in range(70)]
    for i, rid in enumerate(first):
        s.add_request(rid, prompt(1000 * i, 3), max_tokens=1)
    old = s.schedule()
    res = s.update_from_output(old, [[7]] * len(first))
    assert sorted(res.finished_req_ids) == sorted(first)
    second = [f"second-{i}" for i in range(80)]
    for i, rid in enumerate(second):
        s.add_request(rid, prompt(500_000 + 1000 * i, 3), max_tokens=2)
    new = s.schedule()
    # First access of the old output's lists only now, after every one of its slots was taken again.
    assert old.req_ids == first
    assert old.new_req_ids == first
    assert old.num_scheduled_tokens_by_id() == {rid: 3 for rid in first}
    assert len(old) == old.num_reqs == len(first)
    assert new.req_ids == second
    assert new.new_req_ids == second
    s.update_from_output(new, [[7]] * len(second))
    out = s.schedule()
    assert out.req_ids == second
    assert out.new_req_ids == []
    assert old.req_ids == first and new.req_ids == second
    s.check_invariants()


def test_status_transitions_and_preemption_count():
    s = make(num_blocks=5, max_model_len=16)  # 4 usable blocks
    s.add_request("a", prompt(0, 7), max_tokens=3)
    s.add_request("b", prompt(100, 7), max_tokens=5)
    assert s.get_request_status("a") is RequestStatus.WAITING
    assert s.get_request_status("a") == RequestStatus.WAITING
    step(s)
    step(s)
    assert s.get_request_status("a") is RequestStatus.RUNNING
    assert s._request_info("b")[1] == 0
    out, res = step(s)  # a needs a third block: b (last running) is preempted
    assert out.preempted_req_ids == ["b"]
    assert s.get_request_status("b") is RequestStatus.PREEMPTED
    assert s._request_info("b")[1] == 1
    assert res.finished_req_ids == ["a"]  # a reached max_tokens=3
    with pytest.raises(kvsched.UnknownRequestError):
        s.get_request_status("a")
    out, _ = step(s)
    assert out.resumed_req_ids == ["b"]
    assert s.get_request_status("b") is RequestStatus.RUNNING
    assert s._request_info("b")[1] == 1
    # The resume hit b's own first block, but num_cached_tokens keeps the value of the first admission.
    assert out.num_computed_tokens.tolist() == [4]
    assert s._request_info("b")[2] == 0
    run_all(s)
    assert not s.has_unfinished_requests()


def test_request_info_reports_prompt_priority_and_arrival():
    s = make(policy="priority")
    s.add_request("a", prompt(0, 5), priority=-3, arrival_time=12.5)
    assert s._request_info("a") == (5, 0, -1, -3, 12.5)
    s.schedule()
    assert s._request_info("a")[2] == 0  # num_cached_tokens set at first admission


def test_arrival_time_defaults_to_the_monotonic_clock():
    s = make(policy="priority")
    t0 = time.monotonic()
    s.add_request("first", prompt(0, 3))
    s.add_request("second", prompt(10, 3))
    t1 = time.monotonic()
    a1, a2 = s._request_info("first")[4], s._request_info("second")[4]
    assert t0 <= a1 <= a2 <= t1
    s.add_request("int-time", prompt(20, 3), arrival_time=5)
    assert s._request_info("int-time")[4] == 5.0
    assert s.schedule().req_ids == ["int-time", "first", "second"]


@pytest.mark.parametrize(
    "max_tokens",
    [
        2**31,
        2**40,
        2**63 - 1,
        2**63,
        2**70,
    ],
)
def test_a_huge_max_tokens_is_capped_by_max_model_len(max_tokens):
    s = make(max_model_len=8)
    s.add_request("r", prompt(0, 5), max_tokens=max_tokens)
    step(s)
    step(s)
    _, res = step(s)
    assert res.finished_req_ids == ["r"]
    assert res.finish_reasons.tolist() == [FinishReason.LENGTH]


# ---------------------------------------------------------------------------------------------------------
# schedule()


def test_token_budget_is_respected_and_the_last_admission_is_chunked():
    s = make(max_num_batched_tokens=10)
    for rid in "abc":
        s.add_request(rid, prompt(ord(rid) * 100, 6), max_tokens=3)
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    assert out.num_scheduled_tokens.tolist() == [6, 4]
    assert out.total_num_scheduled_tokens == 10
    assert s.get_request_status("c") is RequestStatus.WAITING


def test_running_requests_are_scheduled_before_waiting_ones():
    s = make()
    s.add_request("a", prompt(0, 5), max_tokens=5)
    step(s)
    s.add_request("b", prompt(100, 5), max_tokens=5)
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    assert out.new_req_ids == ["b"]
    assert by_id(out) == {"a": 1, "b": 5}


def test_chunked_prefill_splits_a_prompt_across_steps():
    s = make(max_num_batched_tokens=8)
    s.add_request("a", prompt(0, 20), max_tokens=2)
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(out.num_scheduled_tokens.tolist())
        chunk = is_chunk(s, "a")
        res = s.update_from_output(out, [[]] if chunk else [[7]])
        assert res.num_new_tokens.tolist() == [0 if chunk else 1]
        if chunk:
            assert s.get_output_token_ids("a") == []
    assert sizes == [[8], [8], [4]]
    assert s.get_output_token_ids("a") == [7]
    assert s.get_num_computed_tokens("a") == 20


def test_long_prefill_token_threshold_caps_each_request_per_step():
    s = make(long_prefill_token_threshold=4)
    s.add_request("a", prompt(0, 10), max_tokens=2)
    s.add_request("b", prompt(100, 6), max_tokens=2)
    out = s.schedule()
    assert by_id(out) == {"a": 4, "b": 4}
    s.update_from_output(out, [[], []])
    out = s.schedule()
    assert by_id(out) == {"a": 4, "b": 2}
    s.update_from_output(out, [[], [7]])
    out = s.schedule()
    assert by_id(out) == {"a": 2, "b": 1}


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_long_prefill_threshold_is_off_for_a_lone_request(impl: str):
    """vLLM 0.33 schedule(): the cap only protects other requests from a long prefill, so with one request in the
    scheduler (running + waiting) it is not applied; it comes back as soon as a second request arrives."""
    cfg = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=64, long_prefill_token_threshold=4)
    if impl == "rust":
        s: Any = Scheduler(cfg)
    else:
        from kvsched.reference import ReferenceScheduler

        s = ReferenceScheduler(cfg)
    s.add_request("a", prompt(0, 20), max_tokens=2)
    out = s.schedule()
    assert by_id(out) == {"a": 20}
    s.update_from_output(out, [[7]])
    s.add_request("b", prompt(100, 10), max_tokens=2)
    out = s.schedule()
    assert by_id(out) == {"a": 1, "b": 4}


def test_chunking_off_stops_admission_at_a_prompt_over_the_budget():
    s = make(enable_chunked_prefill=False, max_model_len=16, max_num_batched_tokens=16)
    s.add_request("a", prompt(0, 10), max_tokens=2)
    s.add_request("b", prompt(100, 10), max_tokens=2)
    s.add_request("c", prompt(200, 2), max_tokens=2)  # would fit, but admission stops at b
    out = s.schedule()
    assert out.req_ids == ["a"]
    assert out.num_scheduled_tokens.tolist() == [10]
    s.update_from_output(out, [[7]])
    out = s.schedule()
    assert by_id(out) == {"a": 1, "b": 10, "c": 2}


def test_max_num_seqs_caps_the_running_requests():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add_request(rid, prompt(ord(rid) * 100, 3), max_tokens=2)
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    assert s.stats().num_running_reqs == 2
    assert s.stats().num_waiting_reqs == 1
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    s.update_from_output(out, [[7], [7]])  # both finish
    out = s.schedule()
    assert out.req_ids == ["c"]


def _two_decoders_filling_the_pool(policy: str = "fcfs") -> Scheduler:
    """4 usable blocks of 4 tokens; a and b (7-token prompts) hold 2 blocks each and have 9 tokens after 2
    steps, so the third step needs a third block for a."""
    s = make(num_blocks=5, max_model_len=16, policy=policy)
    s.add_request("a", prompt(0, 7), max_tokens=3, arrival_time=1.0)
    s.add_request("b", prompt(100, 7), max_tokens=5, arrival_time=2.0)
    step(s)
    step(s)
    assert s.num_free_blocks == 0
    return s


def test_phase_b_does_not_run_in_a_step_that_preempted():
    s = _two_decoders_filling_the_pool()
    s.add_request("c", prompt(200, 2), max_tokens=1)  # one block would be free after the preemption
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert out.req_ids == ["a"]
    assert s.num_free_blocks == 1
    assert s.get_request_status("c") is RequestStatus.WAITING


def test_admission_never_preempts():
    s = _two_decoders_filling_the_pool()
    s.abort_requests(["a"])  # frees 2 blocks; b keeps 2, and will need a third at its next decode
    s.add_request("c", prompt(200, 9), max_tokens=1)  # needs 3 blocks: does not fit in the 2 free ones
    out = s.schedule()
    assert out.req_ids == ["b"]
    assert out.preempted_req_ids == []
    assert s.get_request_status("c") is RequestStatus.WAITING
    assert s.get_request_status("b") is RequestStatus.RUNNING
    assert s.stats().num_preemptions == 0


# ---------------------------------------------------------------------------------------------------------
# Preemption


def test_fcfs_preempts_the_last_running_request_and_resumes_it_first_with_its_outputs():
    s = _two_decoders_filling_the_pool()
    outputs_b = s.get_output_token_ids("b")
    assert outputs_b == [7, 7]
    s.add_request("c", prompt(200, 2), max_tokens=1)
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert s.get_block_ids("b").tolist() == []
    assert s.get_num_computed_tokens("b") == 0
    assert s.get_output_token_ids("b") == outputs_b  # outputs are kept
    res = s.update_from_output(out, [[7]])
    assert res.finished_req_ids == ["a"]
    out = s.schedule()  # b went to the front of waiting: it is resumed before c
    assert out.req_ids == ["b", "c"]
    assert out.resumed_req_ids == ["b"]
    assert out.new_req_ids == ["c"]
    # The whole block table of b, which recomputes prompt + outputs (9 tokens) minus its prefix hits.
    assert blocks_of(out, "b") == s.get_block_ids("b").tolist()
    assert len(blocks_of(out, "b")) == 3
    k = out.req_ids.index("b")
    assert out.num_computed_tokens[k] + out.num_scheduled_tokens[k] == 9
    st = s.stats()
    assert st.num_preemptions == 1
    assert st.prefix_cache_preempted_queries == 9
    assert st.prefix_cache_preempted_hits == out.num_computed_tokens[k]
    s.update_from_output(out, answer(s, out))
    run_all(s)
    assert s.num_free_blocks == 4


def test_fcfs_preempts_from_the_back_until_it_fits_and_keeps_the_victims_order():
    s = make(num_blocks=5, max_model_len=16, max_num_batched_tokens=12, long_prefill_token_threshold=8)
    s.add_request("x", prompt(0, 15))
    s.add_request("y", prompt(100, 2), max_tokens=5)
    s.add_request("z", prompt(200, 2), max_tokens=5)
    out, _ = step(s)
    assert by_id(out) == {"x": 8, "y": 2, "z": 2}
    assert s.num_free_blocks == 0
    out = s.schedule()  # x's last 7 prompt tokens need 2 more blocks: z, then y are preempted
    assert out.preempted_req_ids == ["z", "y"]
    assert out.req_ids == ["x"]
    res = s.update_from_output(out, [[7]])
    assert res.finished_req_ids == ["x"]  # 16 tokens = max_model_len
    out = s.schedule()  # each victim went to the front: y (preempted last) is first, then z
    assert out.resumed_req_ids == ["y", "z"]
    assert by_id(out) == {"y": 3, "z": 3}  # prompt + the output each kept
    mi = s.prepare_model_inputs(out)  # a resumed request recomputes its prompt and its outputs
    assert mi.input_token_ids.tolist() == [100, 101, 7, 200, 201, 7]
    assert mi.input_positions.tolist() == [0, 1, 2, 0, 1, 2]
    assert mi.block_table.tolist() == [s.get_block_ids("y").tolist(), s.get_block_ids("z").tolist()]


def test_a_request_preempted_in_flight_still_receives_its_tokens():
    # 3 usable blocks. b (low priority) decodes; c (high priority) prefills in chunks and, in the next step,
    # scheduled before b's step is applied, needs b's block.
    # c is admitted for its first chunk although its prompt does not fit: the full-prompt gate is off.
    s = make(
        num_blocks=4, max_model_len=12, max_num_batched_tokens=8, policy="priority", scheduler_reserve_full_isl=False
    )
    s.add_request("b", prompt(0, 3), max_tokens=5, priority=9)
    step(s)  # b: 1 block, 4 tokens
    s.add_request("c", prompt(100, 11), max_tokens=1, priority=0)
    out1 = s.schedule()  # b decodes 1, c prefills 7 (2 blocks): the pool is full
    assert by_id(out1) == {"b": 1, "c": 7}
    out2 = s.schedule()  # async: b has nothing new; c's last 4 prompt tokens need a third block
    assert out2.preempted_req_ids == ["b"]
    assert out2.req_ids == ["c"]
    assert s.get_request_status("b") is RequestStatus.PREEMPTED
    res1 = s.update_from_output(out1, [[8], []])
    assert res1.num_new_tokens.tolist() == [1, 0]
    assert s.get_output_token_ids("b") == [7, 8]
    assert s.get_num_computed_tokens("b") == 0
    assert s.get_request_status("b") is RequestStatus.PREEMPTED
    res2 = s.update_from_output(out2, [[9]])
    assert res2.finished_req_ids == ["c"]
    s.check_invariants()
    out3 = s.schedule()
    assert out3.resumed_req_ids == ["b"]
    assert out3.num_computed_tokens[0] + out3.num_scheduled_tokens[0] == 5


def test_priority_preempts_the_largest_priority_and_refunds_it():
    s = make(num_blocks=5, max_model_len=16, policy="priority")  # 4 usable blocks
    s.add_request("low", prompt(0, 5), max_tokens=9, priority=5, arrival_time=1.0)
    step(s)  # low: 6 tokens, 2 blocks
    s.add_request("high", prompt(100, 7), max_tokens=9, priority=0, arrival_time=2.0)
    out = s.schedule()
    assert out.req_ids == ["low", "high"]  # running order: low first
    s.update_from_output(out, [[7], [7]])
    step(s)  # low: 8 tokens (7 computed), high: 9 tokens (8 computed); the pool is full
    assert s.num_free_blocks == 0
    out = s.schedule()
    # low is scheduled first (its 8th slot fits), then high needs a third block: the victim is low, the
    # largest priority value though it sits first in running; its tokens are refunded.
    assert out.preempted_req_ids == ["low"]
    assert out.req_ids == ["high"]
    assert by_id(out) == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    assert s.get_request_status("low") is RequestStatus.PREEMPTED
    assert s.get_num_computed_tokens("low") == 0
    assert s._request_info("low")[1] == 1
    s.update_from_output(out, [[7]])
    s.check_invariants()


def test_priority_refund_frees_budget_for_later_running_requests():
    # 6 usable blocks, budget 6. Running order: low (priority 5), high (0), chunky (1, a 20-token prefill).
    # chunky is admitted for its first chunk although its prompt does not fit: the full-prompt gate is off.
    s = make(
        num_blocks=7, max_model_len=24, max_num_batched_tokens=6, policy="priority", scheduler_reserve_full_isl=False
    )
    s.add_request("low", prompt(0, 3), max_tokens=20, priority=5)
    step(s)
    s.add_request("high", prompt(100, 7), max_tokens=17, priority=0)
    step(s)
    s.add_request("chunky", prompt(200, 20), max_tokens=4, priority=1)
    out, _ = step(s)
    assert by_id(out) == {"low": 1, "high": 2, "chunky": 3}
    out, _ = step(s)
    assert by_id(out) == {"low": 1, "high": 1, "chunky": 4}
    assert s.num_free_blocks == 0
    # low's 7th slot fits its 2 blocks: it is scheduled (budget 6 -> 5). high's 9th slot needs a block: the
    # victim is low; its token is refunded, so chunky gets 5 tokens, not 4.
    out = s.schedule()
    assert out.preempted_req_ids == ["low"]
    assert by_id(out) == {"high": 1, "chunky": 5}
    assert out.total_num_scheduled_tokens == 6
    s.check_invariants()


def test_a_victim_skipped_earlier_in_the_step_does_not_make_the_next_request_skipped():
    # Differs from vLLM (note 1): the victim sat before r without being scheduled (n = 0, its step in flight);
    # the index still moves back, so the request after r is scheduled in this step.
    s = make(
        num_blocks=7,
        max_model_len=24,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=4,
        policy="priority",
        scheduler_reserve_full_isl=False,  # high is admitted for its first chunk before the pool can hold it
    )  # 6 usable blocks
    s.add_request("low", prompt(0, 3), max_tokens=10, priority=9)
    step(s)
    s.add_request("high", prompt(100, 20), max_tokens=2, priority=0)
    s.add_request("third", prompt(200, 20), max_tokens=2, priority=1)
    out, _ = step(s)
    assert by_id(out) == {"low": 1, "high": 4, "third": 4}
    out_n = s.schedule()  # low 1 (a second block), high 4, third 4: the pool is full
    assert by_id(out_n) == {"low": 1, "high": 4, "third": 4}
    ans_n = answer(s, out_n)
    assert s.num_free_blocks == 0
    out = s.schedule()  # async: low has nothing new (n = 0); high needs a block and evicts low
    assert out.preempted_req_ids == ["low"]
    assert by_id(out) == {"high": 4, "third": 4}
    ans = answer(s, out)
    s.update_from_output(out_n, ans_n)
    s.update_from_output(out, ans)
    s.check_invariants()


def test_priority_preempted_request_waits_by_its_key_not_at_the_front():
    s = _two_decoders_filling_the_pool("priority")  # a: (0, 1.0), b: (0, 2.0)
    s.add_request("c", prompt(200, 2), max_tokens=1, priority=-1, arrival_time=3.0)
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]  # the largest (priority, arrival_time)
    res = s.update_from_output(out, [[7]])
    assert res.finished_req_ids == ["a"]
    out = s.schedule()
    assert out.req_ids == ["c", "b"]  # c's priority beats the preempted b
    assert out.new_req_ids == ["c"]
    assert out.resumed_req_ids == ["b"]


def test_priority_victim_ties_break_by_arrival_time_then_running_order():
    s = make(num_blocks=7, max_model_len=16, policy="priority")  # 6 usable blocks
    s.add_request("x", prompt(0, 7), max_tokens=9, priority=1, arrival_time=1.0)
    s.add_request("y", prompt(100, 7), max_tokens=9, priority=1, arrival_time=3.0)
    s.add_request("z", prompt(200, 7), max_tokens=9, priority=1, arrival_time=2.0)
    out = s.schedule()
    assert out.req_ids == ["x", "z", "y"]
    s.update_from_output(out, [[7]] * 3)
    out = s.schedule()
    s.update_from_output(out, [[7]] * 3)
    out = s.schedule()  # each needs a third block: y (latest arrival) goes first
    assert out.preempted_req_ids == ["y"]
    assert out.req_ids == ["x", "z"]


def test_priority_victim_on_a_full_tie_is_the_first_in_running_order():
    s = make(num_blocks=5, max_model_len=16, policy="priority")
    s.add_request("p", prompt(0, 7), max_tokens=9, priority=0, arrival_time=1.0)
    s.add_request("q", prompt(100, 7), max_tokens=9, priority=0, arrival_time=1.0)
    out = s.schedule()
    assert out.req_ids == ["p", "q"]
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()  # p needs a block: the victim is p itself (first on the tie)
    assert out.preempted_req_ids == ["p"]
    # vLLM 0.33: under PRIORITY the pass goes on after a request preempted itself (the rest rank higher and
    # may fit in the blocks it freed); phase B does not run in a step that preempted
    assert out.req_ids == ["q"]
    assert s.get_request_status("p") == RequestStatus.PREEMPTED


# ---------------------------------------------------------------------------------------------------------
# Policies


def test_fcfs_admits_in_arrival_order_ignoring_priority():
    s = make(policy="fcfs")
    s.add_request("a", prompt(0, 3), priority=9, arrival_time=5.0)
    s.add_request("b", prompt(10, 3), priority=0, arrival_time=1.0)
    s.add_request("c", prompt(20, 3), priority=-5, arrival_time=0.0)
    assert s.schedule().req_ids == ["a", "b", "c"]


def test_priority_admits_by_priority_then_arrival_then_id():
    s = make(policy="priority")
    s.add_request("a", prompt(0, 3), priority=1, arrival_time=0.0)
    s.add_request("b", prompt(10, 3), priority=0, arrival_time=5.0)
    s.add_request("d", prompt(20, 3), priority=0, arrival_time=1.0)
    s.add_request("c", prompt(30, 3), priority=0, arrival_time=1.0)
    s.add_request("e", prompt(40, 3), priority=-1, arrival_time=9.0)
    assert s.schedule().req_ids == ["e", "c", "d", "b", "a"]


def test_priority_admission_order_holds_one_at_a_time():
    s = make(policy="priority", max_num_seqs=1)
    s.add_request("late", prompt(0, 3), max_tokens=1, priority=2)
    s.add_request("early", prompt(10, 3), max_tokens=1, priority=1)
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += out.new_req_ids
    assert order == ["early", "late"]


# ---------------------------------------------------------------------------------------------------------
# update_from_output


def test_eos_and_stop_tokens_stop_even_before_min_tokens():
    """vLLM 0.33 check_stop: EOS, then stop ids, then the length limits, and only then min_tokens (which defers
    repetition detection alone): the sampler keeps EOS and stop ids out until min_tokens (kvsched's runner
    masks them too)."""
    s = make()
    s.add_request("e", prompt(0, 3), max_tokens=10, min_tokens=2, eos_token_id=2)
    s.add_request("s", prompt(10, 3), max_tokens=10, min_tokens=2, stop_token_ids=[3])
    out = s.schedule()
    res = s.update_from_output(out, [[2], [3]])
    assert res.finished_req_ids == ["e", "s"]
    assert res.finish_reasons.tolist() == [FinishReason.STOP, FinishReason.STOP]
    assert res.stop_reasons.tolist() == [-1, 3]


def test_eos_stops_unless_ignore_eos():
    s = make()
    s.add_request("eos", prompt(0, 3), max_tokens=3, eos_token_id=2)
    s.add_request("ign", prompt(10, 3), max_tokens=3, eos_token_id=2, ignore_eos=True)
    _, res = step(s, tok=2)
    assert res.finished_req_ids == ["eos"]
    assert res.finish_reasons.tolist() == [FinishReason.STOP]
    assert res.stop_reasons.tolist() == [-1]
    step(s, tok=2)
    _, res = step(s, tok=2)
    assert res.finished_req_ids == ["ign"]
    assert res.finish_reasons.tolist() == [FinishReason.LENGTH]


def test_eos_is_checked_before_stop_tokens_and_stops_before_length():
    s = make()
    s.add_request("both", prompt(0, 3), max_tokens=5, eos_token_id=2, stop_token_ids=[2])
    s.add_request("last", prompt(10, 3), max_tokens=1, stop_token_ids=[2, 4])
    _, res = step(s, tok=2)
    assert res.finished_req_ids == ["both", "last"]
    assert res.finish_reasons.tolist() == [FinishReason.STOP, FinishReason.STOP]
    assert res.stop_reasons.tolist() == [-1, 2]
    assert res.finish_reasons.dtype == np.int8
    assert res.stop_reasons.dtype == np.int64


def test_max_tokens_caps_with_length():
    s = make()
    s.add_request("r", prompt(0, 3), max_tokens=3, eos_token_id=2)
    finished = run_all(s, tok=5)
    assert finished == ["r"]


def test_max_model_len_caps_generation():
    s = make(max_model_len=8)
    s.add_request("r", prompt(0, 5))  # effective max_tokens = 3
    s.add_request("m", prompt(10, 5), max_tokens=100)
    outputs = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        for rid in out.req_ids:
            outputs[rid] = s.get_output_token_ids(rid)
        res = s.update_from_output(out, answer(s, out))
        for rid in res.finished_req_ids:
            outputs[rid] = len(outputs[rid]) + 1
        assert set(res.finish_reasons.tolist()) <= {FinishReason.LENGTH}
    assert outputs == {"r": 3, "m": 3}


def _spec(lookahead: int = 2, **req: Any) -> tuple[Scheduler, Any]:
    """A decoding request ``r`` with ``lookahead`` drafts scheduled in the returned (unapplied) step."""
    s = make(num_lookahead_tokens=lookahead)
    s.add_request("r", prompt(0, 5), **req)
    out = s.schedule()
    s.update_from_output(out, [[7]], draft_token_ids=[[50 + i for i in range(lookahead)]])
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [1 + lookahead]
    assert out.spec_token_ids.tolist() == [50 + i for i in range(lookahead)]
    assert out.spec_token_ids_indptr.tolist() == [0, lookahead]
    return s, out


def test_accepted_drafts_append_every_token():
    s, out = _spec()
    assert s.get_num_computed_tokens("r") == 8  # 6 tokens + 2 drafts
    res = s.update_from_output(out, [[50, 51, 9]])
    assert res.num_new_tokens.tolist() == [3]
    assert s.get_output_token_ids("r") == [7, 50, 51, 9]
    assert s.get_num_computed_tokens("r") == 8


def test_rejected_drafts_roll_back_computed_tokens():
    s, out = _spec()
    res = s.update_from_output(out, [[9]])  # both drafts rejected
    assert res.num_new_tokens.tolist() == [1]
    assert s.get_num_computed_tokens("r") == 6
    assert s.get_output_token_ids("r") == [7, 9]
    s.check_invariants()
    out = s.schedule()  # no drafts given this time: a plain decode of the one new token
    assert out.num_scheduled_tokens.tolist() == [1]
    assert out.spec_token_ids.tolist() == []


def test_a_stop_inside_a_speculative_entry_truncates_the_rest():
    s, out = _spec(eos_token_id=2, max_tokens=10)
    res = s.update_from_output(out, [[50, 2, 9]])
    assert res.finished_req_ids == ["r"]
    assert res.num_new_tokens.tolist() == [2]
    assert res.finish_reasons.tolist() == [FinishReason.STOP]
    assert s.num_free_blocks == 63


def test_max_tokens_inside_a_speculative_entry_truncates_the_rest():
    s, out = _spec(max_tokens=2)
    res = s.update_from_output(out, [[50, 51, 52]])
    assert res.num_new_tokens.tolist() == [1]
    assert res.finish_reasons.tolist() == [FinishReason.LENGTH]


def test_running_requests_reserve_lookahead_slots():
    s = make(num_lookahead_tokens=4, max_model_len=16, num_blocks=8)
    s.add_request("r", prompt(0, 4), max_tokens=11)
    out = s.schedule()  # vLLM 0.33: admission reserves lookahead too: 4 + 4 slots, 2 blocks
    assert blocks_of(out, "r") == [1, 2]
    s.update_from_output(out, [[7]])
    out = s.schedule()  # computed 4 + 1 new + 4 lookahead = 9 slots: 3 blocks
    assert blocks_of(out, "r") == [3]
    assert s.get_block_ids("r").tolist() == [1, 2, 3]
    for _ in range(8):
        s.update_from_output(out, [[7]])
        out = s.schedule()
        s.check_invariants()
    # 13 tokens computed + lookahead would be 18 slots, but never more than max_model_len = 16: 4 blocks
    assert len(s.get_block_ids("r")) == 4


def test_drafts_are_capped_by_the_remaining_room():
    s = make(num_lookahead_tokens=3, max_model_len=8)
    s.add_request("r", prompt(0, 5))
    out = s.schedule()
    s.update_from_output(out, [[7]], draft_token_ids=[[1, 2, 3]])
    out = s.schedule()  # computed 5, 6 tokens + 3 drafts, but only max_model_len-1-5 = 2 may be computed
    assert out.num_scheduled_tokens.tolist() == [2]
    assert out.spec_token_ids.tolist() == [1]
    s.check_invariants()


def test_async_scheduling_applies_two_steps_in_order():
    s = make()
    s.add_request("a", prompt(0, 5), max_tokens=4)
    out0 = s.schedule()
    s.update_from_output(out0, [[7]])
    out1 = s.schedule()  # a decodes
    s.add_request("b", prompt(100, 5), max_tokens=4)
    out2 = s.schedule()  # before out1 is applied: a has nothing new; b is admitted
    assert out1.req_ids == ["a"]
    assert out2.req_ids == ["b"]
    assert out2.step_id == out1.step_id + 1
    res1 = s.update_from_output(out1, [[8]])
    res2 = s.update_from_output(out2, [[9]])
    assert res1.num_new_tokens.tolist() == [1]
    assert res2.num_new_tokens.tolist() == [1]
    assert s.get_output_token_ids("a") == [7, 8]
    assert s.get_output_token_ids("b") == [9]
    s.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# abort


def test_abort_a_waiting_request():
    s = make(max_num_seqs=1)
    s.add_request("a", prompt(0, 5))
    s.add_request("w", prompt(10, 5))
    s.schedule()
    s.abort_requests(["w"])
    assert s.stats().num_waiting_reqs == 0
    with pytest.raises(kvsched.UnknownRequestError):
        s.get_request_status("w")
    assert s.stats().num_finished_reqs == 1


def test_abort_a_running_request_frees_its_blocks_and_is_reported_next_step():
    s = make()
    s.add_request("a", prompt(0, 9), max_tokens=5)
    s.add_request("b", prompt(100, 3), max_tokens=5)
    step(s)
    free = s.num_free_blocks
    s.abort_requests(["a", "a"])  # duplicates count once
    assert s.num_free_blocks == free + 3
    assert s.num_unfinished_requests == 1
    out = s.schedule()
    assert out.finished_req_ids == ["a"]
    assert out.req_ids == ["b"]
    s.update_from_output(out, [[7]])
    assert s.schedule().finished_req_ids == []


def test_abort_in_flight_ignores_its_tokens():
    s = make()
    s.add_request("a", prompt(0, 5), max_tokens=5)
    s.add_request("b", prompt(10, 5), max_tokens=5)
    out = s.schedule()
    s.abort_requests(["a"])
    # Whatever the entry of an aborted request holds is ignored, even a count that would be invalid.
    res = s.update_from_output(out, [[1, 2, 3, 4], [7]])
    assert res.num_new_tokens.tolist() == [0, 1]
    assert res.finished_req_ids == []
    assert s.schedule().finished_req_ids == ["a"]
    s.check_invariants()


def test_abort_in_flight_ignores_even_out_of_range_tokens():
    # semantics.md: "r is gone (finished or aborted since it was scheduled): the entry is ignored, whatever it
    # holds"; the token range check applies to the other entries only.
    s = make()
    s.add_request("a", prompt(0, 5), max_tokens=5)
    s.add_request("b", prompt(10, 5), max_tokens=5)
    out = s.schedule()
    s.abort_requests(["a"])
    res = s.update_from_output(out, [[-1, 2**31], [7]])
    assert res.num_new_tokens.tolist() == [0, 1]
    assert s.get_output_token_ids("b") == [7]


def test_abort_a_preempted_request():
    s = _two_decoders_filling_the_pool()
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    s.abort_requests(["b"])
    s.update_from_output(out, [[7]])
    assert s.schedule().finished_req_ids == ["b", "a"]
    s.check_invariants()


def test_finished_req_ids_of_a_step_list_stops_and_aborts_since_the_previous_step():
    s = make()
    s.add_request("a", prompt(0, 3), max_tokens=1)
    s.add_request("b", prompt(10, 3), max_tokens=5)
    s.add_request("c", prompt(20, 3), max_tokens=5)
    out = s.schedule()
    res = s.update_from_output(out, [[7], [7], [7]])
    assert res.finished_req_ids == ["a"]
    s.abort_requests(["c"])
    out = s.schedule()
    assert sorted(out.finished_req_ids) == ["a", "c"]
    assert s.stats().num_finished_reqs == 2


# ---------------------------------------------------------------------------------------------------------
# Other calls


def test_has_unfinished_requests_tracks_waiting_and_running():
    s = make()
    assert not s.has_unfinished_requests()
    assert s.num_unfinished_requests == 0
    s.add_request("a", prompt(0, 3), max_tokens=2)
    assert s.has_unfinished_requests()
    assert s.num_unfinished_requests == 1
    step(s)
    assert s.has_unfinished_requests()
    step(s)
    assert not s.has_unfinished_requests()
    assert s.num_unfinished_requests == 0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    s = make()
    s.add_request("a", prompt(0, 9), max_tokens=1)
    run_all(s)
    s.add_request("b", prompt(100, 3), max_tokens=5)
    step(s)
    free = s.num_free_blocks
    assert s.reset_prefix_cache() is False
    assert s.get_num_cached_tokens(prompt(0, 9)) == 8
    assert s.num_free_blocks == free
    s.abort_requests(["b"])
    assert s.reset_prefix_cache() is True
    assert s.get_num_cached_tokens(prompt(0, 9)) == 0
    assert s.num_free_blocks == 63
    s.check_invariants()
    s.add_request("c", prompt(0, 9), max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [0]


def test_stats_report_every_counter():
    s = make(num_blocks=5, max_model_len=16)
    st = s.stats()
    assert isinstance(st, kvsched.SchedulerStats)
    assert st == kvsched.SchedulerStats(
        num_running_reqs=0,
        num_waiting_reqs=0,
        num_skipped_waiting_reqs=0,
        kv_cache_usage=0.0,
        num_free_blocks=4,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prefix_cache_preempted_queries=0,
        prefix_cache_preempted_hits=0,
        num_preemptions=0,
        num_finished_reqs=0,
        step_id=0,
    )
    assert st.prefix_cache_hit_rate == 0.0
    s.add_request("a", prompt(0, 7), max_tokens=3)
    s.add_request("b", prompt(100, 7), max_tokens=5)
    s.add_request("c", prompt(0, 5), max_tokens=1)
    step(s)  # a, b admitted (4 blocks); c waits
    st = s.stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_free_blocks) == (2, 1, 0)
    assert st.kv_cache_usage == 1.0
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (14, 0)
    assert st.step_id == 1
    step(s)
    step(s)  # b preempted, a finishes
    st = s.stats()
    assert st.num_preemptions == 1
    assert st.num_finished_reqs == 1
    assert st.step_id == 3
    assert st.num_running_reqs == 0
    assert st.num_waiting_reqs == 2
    assert st.kv_cache_usage == 0.0
    out, _ = step(s)  # b resumed: preempted counters; it hits its first block (the second was evicted)
    st = s.stats()
    assert out.resumed_req_ids == ["b"]
    assert (st.prefix_cache_preempted_queries, st.prefix_cache_preempted_hits) == (9, 4)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (14, 0)
    run_all(s)  # c is admitted once b is done and hits a's first block
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (19, 4)
    assert st.prefix_cache_hit_rate == pytest.approx(4 / 19)
    assert st.num_finished_reqs == 3
    assert st.num_free_blocks == 4
    s.check_invariants()


def test_preemption_logs_a_rate_limited_warning(caplog, monkeypatch):
    monkeypatch.setattr(scheduler_module, "_last_warning", [float("-inf"), 0])
    monkeypatch.setattr(logging.getLogger("kvsched"), "propagate", True)  # whatever other tests configured
    caplog.set_level(logging.WARNING, logger="kvsched")
    s = _two_decoders_filling_the_pool()
    assert [r for r in caplog.records if r.name == "kvsched"] == []
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    records = [r for r in caplog.records if r.name == "kvsched"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "1 request(s) preempted" in records[0].getMessage()
    assert "1 in total" in records[0].getMessage()
    # A second preemption within the interval is counted, not logged.
    s2 = _two_decoders_filling_the_pool()
    s2.schedule()
    assert len([r for r in caplog.records if r.name == "kvsched"]) == 1
    assert scheduler_module._last_warning[1] == 1


# ---------------------------------------------------------------------------------------------------------
# prepare_model_inputs


def test_prepare_model_inputs_lays_out_a_mixed_batch():
    s = make(max_num_batched_tokens=12)
    s.add_request("a", prompt(0, 6), max_tokens=5)
    step(s)  # a: 6 prompt tokens + output 7
    s.add_request("b", prompt(100, 13), max_tokens=5)
    out = s.schedule()  # a decodes 1; b prefills 11 (chunk)
    mi = s.prepare_model_inputs(out)
    for name in (
        "input_token_ids",
        "input_positions",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_table",
        "logits_indices",
    ):
        assert getattr(mi, name).dtype == np.int32, name
    assert (mi.num_reqs, mi.num_tokens) == (2, 12)
    assert mi.input_token_ids.tolist() == [7, *prompt(100, 11)]
    assert mi.input_positions.tolist() == [6, *range(11)]
    assert mi.query_start_loc.tolist() == [0, 1, 12]
    assert mi.seq_lens.tolist() == [7, 11]
    assert mi.logits_indices.tolist() == [0, 11]
    assert (mi.max_seq_len, mi.max_query_len) == (11, 11)
    a_blocks = s.get_block_ids("a").tolist()
    b_blocks = s.get_block_ids("b").tolist()
    assert mi.block_table.shape == (2, 3)
    assert mi.block_table.tolist() == [a_blocks + [0] * (3 - len(a_blocks)), b_blocks]
    expected_slots = [a_blocks[6 // 4] * 4 + 6 % 4] + [b_blocks[p // 4] * 4 + p % 4 for p in range(11)]
    assert mi.slot_mapping.tolist() == expected_slots
    assert "ModelInputs(" in repr(mi)


def test_prepare_model_inputs_includes_scheduled_drafts():
    s, out = _spec()
    mi = s.prepare_model_inputs(out)
    assert mi.input_token_ids.tolist() == [7, 50, 51]
    assert mi.input_positions.tolist() == [5, 6, 7]
    assert mi.logits_indices.tolist() == [2]


def test_prepare_model_inputs_raises_when_stale():
    s = make()
    s.add_request("a", prompt(0, 5), max_tokens=5)
    out = s.schedule()
    s.prepare_model_inputs(out)  # fresh: fine, and may be called twice
    s.prepare_model_inputs(out)
    s.add_request("b", prompt(100, 5))  # any change makes it stale
    with pytest.raises(kvsched.InvalidOutputError):
        s.prepare_model_inputs(out)
    s.update_from_output(out, [[7]])
    out2 = s.schedule()
    with pytest.raises(kvsched.InvalidOutputError):
        s.prepare_model_inputs(out)
    s.prepare_model_inputs(out2)
    s.update_from_output(out2, answer(s, out2))
    with pytest.raises(kvsched.InvalidOutputError):  # applied: stale too
        s.prepare_model_inputs(out2)


# ---------------------------------------------------------------------------------------------------------
# SchedulerOutput, UpdateResult, token forms


def test_scheduler_output_fields_and_conveniences():
    s = make()
    s.add_request("a", prompt(0, 9), max_tokens=5)
    s.add_request("b", prompt(100, 3), max_tokens=5)
    out = s.schedule()
    assert out.step_id == 0
    assert len(out) == 2
    assert out.num_reqs == 2
    assert out.num_scheduled_tokens_by_id() == {"a": 9, "b": 3}
    for name in (
        "num_scheduled_tokens",
        "num_computed_tokens",
        "new_block_ids",
        "new_block_ids_indptr",
        "spec_token_ids",
        "spec_token_ids_indptr",
    ):
        assert getattr(out, name).dtype == np.int32, name
    assert out.new_block_ids_indptr.shape == (3,)
    assert out.spec_token_ids_indptr.shape == (3,)
    assert out.new_block_ids_indptr.tolist() == [0, 3, 4]
    assert out.new_block_ids.tolist() == [1, 2, 3, 4]
    assert out.spec_token_ids.tolist() == []
    assert out.new_req_ids == ["a", "b"]
    assert out.resumed_req_ids == out.preempted_req_ids == out.finished_req_ids == []
    assert out.total_num_scheduled_tokens == 12
    assert isinstance(out, kvsched.SchedulerOutput)
    r = repr(out)
    assert r.startswith("SchedulerOutput(step_id=0, num_reqs=2, total_num_scheduled_tokens=12")
    res = s.update_from_output(out, [[7], [7]])
    assert isinstance(res, kvsched.UpdateResult)
    assert res.num_new_tokens.dtype == np.int32
    assert repr(res) == "UpdateResult(num_finished=0)"
    out = s.schedule()
    assert out.step_id == 1
    assert out.new_req_ids == []
    assert out.new_block_ids_indptr.tolist() == [0, 0, 0]  # no new blocks for decodes within a block


def test_an_empty_step_has_empty_csr_arrays():
    s = make()
    out = s.schedule()
    assert out.req_ids == []
    assert out.new_block_ids_indptr.tolist() == [0]
    assert out.spec_token_ids_indptr.tolist() == [0]
    assert out.num_scheduled_tokens.shape == (0,)
    assert out.total_num_scheduled_tokens == 0
    res = s.update_from_output(out, [])
    assert res.finished_req_ids == []
    res = s.update_from_output(s.schedule(), (np.zeros(0, np.int64), np.zeros(1, np.int64)))
    assert res.num_new_tokens.tolist() == []


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sampled_tokens_as_a_numpy_pair(dtype):
    s = make(max_num_batched_tokens=10)
    s.add_request("a", prompt(0, 3), max_tokens=5)
    s.add_request("b", prompt(100, 9), max_tokens=5)
    out = s.schedule()  # a: 3 (complete), b: 7 (chunk)
    res = s.update_from_output(out, (np.array([11], dtype=dtype), np.array([0, 1, 1], dtype=dtype)))
    assert res.num_new_tokens.tolist() == [1, 0]
    out = s.schedule()
    res = s.update_from_output(out, (np.array([12, 13], dtype=dtype), np.array([0, 1, 2], dtype=dtype)))
    assert s.get_output_token_ids("a") == [11, 12]
    assert s.get_output_token_ids("b") == [13]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sampled_tokens_as_lists_of_arrays_or_lists(dtype):
    s = make()
    s.add_request("a", prompt(0, 3), max_tokens=5)
    s.add_request("b", prompt(100, 3), max_tokens=5)
    out = s.schedule()
    s.update_from_output(out, [np.array([11], dtype=dtype), [12]])
    assert s.get_output_token_ids("a") == [11]
    assert s.get_output_token_ids("b") == [12]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_prompts_and_stop_ids_as_numpy_arrays(dtype):
    s = make()
    s.add_request("a", np.arange(5, dtype=dtype), stop_token_ids=np.array([9], dtype=dtype), max_tokens=5)
    s.add_request("b", prompt(0, 5), max_tokens=5)
    assert s.get_block_hashes("a") == s.get_block_hashes("b")
    assert s.get_num_cached_tokens(np.arange(5, dtype=dtype)) == 0
    _, res = step(s, tok=9)
    assert res.finished_req_ids == ["a"]
    assert res.stop_reasons.tolist() == [9]


def test_drafts_as_a_numpy_pair():
    s = make(num_lookahead_tokens=2)
    s.add_request("r", prompt(0, 5))
    out = s.schedule()
    s.update_from_output(
        out, (np.array([7], np.int32), np.array([0, 1], np.int32)), (np.array([50, 51]), np.array([0, 2]))
    )
    out = s.schedule()
    assert out.spec_token_ids.tolist() == [50, 51]


def test_scheduler_accepts_a_config_object_and_exposes_it():
    cfg = SchedulerConfig(block_size=8, num_blocks=32, max_model_len=128)
    s = Scheduler(cfg)
    assert s.config is cfg
    assert s.num_free_blocks == 31
    assert "Scheduler(policy='fcfs'" in repr(s)
