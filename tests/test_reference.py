"""Behaviour tests of the pure-Python ReferenceScheduler alone: each test pins one rule of docs/semantics.md.

Expected values are worked out by hand from the semantics (comments show the arithmetic), so a wrong reference
fails here before the differential tests compare it with the Rust core.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from conftest import entry_sizes, run_to_completion
from kvsched import (
    DuplicateRequestError,
    FinishReason,
    InternalError,
    InvalidOutputError,
    InvalidRequestError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    SchedulerTypeError,
    UnknownRequestError,
)
from kvsched.reference import ReferenceScheduler, SchedulerStats

TOK = 7  # a token that stops nothing


class Harness:
    """A ReferenceScheduler plus the prompt lengths the driver needs; checks invariants after every call."""

    def __init__(self, **cfg: object) -> None:
        # The config requires a pool that holds one request of max_model_len: default to the largest such.
        usable_tokens = (cfg.get("num_blocks", 4096) - 1) * cfg.get("block_size", 16)  # type: ignore[operator]
        cfg.setdefault("max_model_len", min(8192, usable_tokens))
        self.s = ReferenceScheduler(**cfg)
        self.prompt_lens: dict[str, int] = {}
        self.sizes: dict[int, list[int | None]] = {}  # step_id -> entry_sizes at scheduling

    def add(self, rid: str, prompt: list[int], **kw: object) -> None:
        kw.setdefault("arrival_time", float(len(self.prompt_lens)))
        self.s.add_request(rid, prompt, **kw)
        self.prompt_lens[rid] = len(prompt)
        self.s.check_invariants()

    def schedule(self):
        out = self.s.schedule()
        self.s.check_invariants()
        self.sizes[out.step_id] = entry_sizes(self.s, out, self.prompt_lens)
        return out

    def update(self, out, tokens: dict[str, list[int]] | None = None, drafts=None):
        """Default: an empty entry for prefill chunks, [TOK] otherwise; ``tokens`` overrides per id."""
        tokens = tokens or {}
        sizes = self.sizes[out.step_id]
        entries = []
        for rid, size in zip(out.req_ids, sizes, strict=True):
            entries.append(tokens.get(rid, [] if size is None else [TOK]))
        res = self.s.update_from_output(out, entries, drafts)
        self.s.check_invariants()
        return res

    def step(self, tokens: dict[str, list[int]] | None = None, drafts=None):
        out = self.schedule()
        return out, self.update(out, tokens, drafts)


def csr(values: np.ndarray, indptr: np.ndarray) -> list[list[int]]:
    return [values[indptr[i] : indptr[i + 1]].tolist() for i in range(len(indptr) - 1)]


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# --------------------------------------------------------------------------------------------------------
# Chunked prefill, threshold, limits
# --------------------------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    h = Harness(block_size=4, num_blocks=17, max_num_batched_tokens=8, max_model_len=64)
    h.add("a", prompt(20), max_tokens=1)
    outs = [h.step()[0] for _ in range(3)]
    assert [o.num_scheduled_tokens.tolist() for o in outs] == [[8], [8], [4]]
    assert [o.num_computed_tokens.tolist() for o in outs] == [[0], [8], [16]]
    assert [o.new_req_ids for o in outs] == [["a"], [], []]
    # 8 tokens -> blocks 1,2; 16 -> 3,4; 20 -> 5: running requests get only the blocks appended this step
    assert [csr(o.new_block_ids, o.new_block_ids_indptr) for o in outs] == [[[1, 2]], [[3, 4]], [[5]]]
    assert not h.s.has_unfinished_requests()  # the last chunk sampled TOK and max_tokens=1 capped it


def test_tokens_for_a_prefill_chunk_are_appended_and_a_bad_update_changes_nothing() -> None:
    h = Harness(block_size=4, num_blocks=17, max_num_batched_tokens=8, max_model_len=64, num_lookahead_tokens=1)
    h.add("a", prompt(20), max_tokens=5)
    out = h.schedule()
    before = h.s.stats()
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out, [[TOK]], [[1]])  # a prefill chunk gets no drafts
    assert h.s.stats() == before and h.s.get_output_token_ids("a") == []
    # vLLM's scheduler appends what the runner returns for a partial prefill (its runners return nothing there)
    res = h.s.update_from_output(out, [[TOK]])
    assert res.num_new_tokens.tolist() == [1] and h.s.get_output_token_ids("a") == [TOK]
    assert h.s.get_num_computed_tokens("a") == 8  # the chunk's 8: the prompt's rest and the token come next
    out = h.schedule()
    assert out.num_scheduled_tokens.tolist() == [8]
    h.s.check_invariants()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_enough_budget() -> None:
    cfg = {"block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 16, "max_model_len": 16}
    h = Harness(enable_chunked_prefill=False, **cfg)
    h.add("a", prompt(10))
    h.add("b", prompt(10, 200))
    out, _ = h.step()
    assert out.req_ids == ["a"]  # b needs 10 > 6 left: admission stops
    out, _ = h.step()
    assert out.req_ids == ["a", "b"] and out.num_scheduled_tokens.tolist() == [1, 10]

    h = Harness(**cfg)  # chunking on: b gets the 6 tokens that are left
    h.add("a", prompt(10))
    h.add("b", prompt(10, 200))
    out, _ = h.step()
    assert out.num_scheduled_tokens.tolist() == [10, 6]


def test_long_prefill_token_threshold_caps_tokens_per_request_per_step() -> None:
    h = Harness(block_size=4, num_blocks=32, long_prefill_token_threshold=3)
    h.add("a", prompt(7))
    h.add("b", prompt(5, 200))
    got = [h.step()[0].num_scheduled_tokens.tolist() for _ in range(3)]
    # a: 3, 3, 1 (prompt done in step 3); b: 3, 2, then a 1-token decode
    assert got == [[3, 3], [3, 2], [1, 1]]


def test_max_num_seqs_limits_the_running_set() -> None:
    h = Harness(block_size=4, num_blocks=32, max_num_seqs=2)
    for rid in "abc":
        h.add(rid, prompt(3))
    out, _ = h.step()
    assert out.req_ids == ["a", "b"] and h.s.stats().num_waiting_reqs == 1


def test_request_length_is_capped_by_max_model_len() -> None:
    h = Harness(block_size=4, num_blocks=32, max_model_len=8)
    h.add("a", prompt(5), max_tokens=100)  # effective max_tokens = 8 - 5 = 3
    outs = run_to_completion(h.s, h.prompt_lens)
    assert len(outs) == 3
    assert h.s.stats().num_finished_reqs == 1


# --------------------------------------------------------------------------------------------------------
# Full-prompt admission gate (vLLM 0.33 scheduler_reserve_full_isl)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", [True, False])
def test_full_prompt_gate_holds_a_prompt_back_until_all_of_it_fits(gate: bool) -> None:
    """vLLM 0.33 `allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl)`: a waiting request is
    admitted only if its whole prompt fits, and a gated request stops admission for the step."""
    h = Harness(
        block_size=4, num_blocks=8, max_num_batched_tokens=8, max_model_len=28, scheduler_reserve_full_isl=gate
    )  # 7 usable blocks
    h.add("a", prompt(5), max_tokens=3)
    h.step()  # a: 2 blocks
    h.add("b", prompt(24, 300), max_tokens=1)  # 6 blocks for the whole prompt; 5 are free
    h.add("c", prompt(3, 500), max_tokens=1)  # 1 block, but behind b
    out, _ = h.step()
    if gate:
        assert out.req_ids == ["a"]  # b waits; c is not admitted past it
        out, _ = h.step()  # a's last token: it finishes and frees its 2 blocks
        assert out.req_ids == ["a"]
        out, _ = h.step()
        assert out.req_ids == ["b"] and out.num_scheduled_tokens.tolist() == [8]  # all 7 blocks free now
    else:
        assert out.req_ids == ["a", "b"] and out.num_scheduled_tokens.tolist() == [1, 7]  # b's first chunk


def test_full_prompt_gate_counts_prefix_hits_as_held() -> None:
    """The gate needs ceil(num_tokens / bs) blocks minus the prefix hits (hits held by a running request cost
    nothing; vLLM's `get_num_blocks_to_allocate` with the new computed blocks)."""
    h = Harness(block_size=4, num_blocks=8, max_num_batched_tokens=64, max_model_len=28)
    h.add("a", prompt(16), max_tokens=5)
    h.step()  # a: 4 full, cached blocks; 3 free
    h.add("b", prompt(16) + prompt(8, 300), max_tokens=1)  # 6 blocks in all, 4 of them hits held by a
    out = h.schedule()  # a takes a 5th block (2 free); b needs 6 - 4 = 2
    assert out.req_ids == ["a", "b"] and out.num_computed_tokens.tolist() == [16, 16]
    assert h.s.num_free_blocks == 0
    h.update(out)


@pytest.mark.parametrize("gate", [True, False])
def test_full_prompt_gate_counts_the_outputs_of_a_resumed_request(gate: bool) -> None:
    """A preempted request is gated on prompt + outputs so far (vLLM: `min(request.num_tokens,
    max_model_len)`), the tokens it must recompute; without the gate it thrashes (resumed for a chunk,
    preempted again)."""
    h = Harness(block_size=4, num_blocks=6, max_num_batched_tokens=6, max_model_len=20,
                enable_prefix_caching=False, policy="priority", scheduler_reserve_full_isl=gate)  # fmt: skip
    h.add("lo", prompt(7), max_tokens=10, priority=1)  # 5 usable blocks
    h.step()
    h.step()  # lo: 9 tokens (2 computed blocks + the slot of its next token)
    h.add("hi", prompt(8, 300), max_tokens=10, priority=0)
    assert h.step()[0].num_scheduled_tokens_by_id() == {"lo": 1, "hi": 5}
    assert h.step()[0].num_scheduled_tokens_by_id() == {"lo": 1, "hi": 3}  # the pool is full
    out, _ = h.step()  # hi decodes into a 3rd block: lo is preempted with 10 tokens
    assert out.preempted_req_ids == ["lo"] and h.s.get_output_token_ids("lo") == [TOK] * 3
    # lo's 10 tokens need 3 blocks and 2 are free: gated, although a 5-token chunk (2 blocks) would fit.
    outs = [h.step()[0] for _ in range(3)]
    if gate:
        assert [o.req_ids for o in outs] == [["hi"]] * 3
        assert h.s.get_request_status("lo") == RequestStatus.PREEMPTED
    else:
        assert [o.req_ids for o in outs] == [["hi", "lo"], ["hi"], ["hi", "lo"]]
        assert outs[1].preempted_req_ids == ["lo"]


# --------------------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------------------


def test_fcfs_preempts_the_tail_and_requeues_it_at_the_front() -> None:
    # 3 usable blocks of 4 tokens; three 4-token prompts fill them, so every decode needs a fresh block.
    h = Harness(block_size=4, num_blocks=4)
    for rid in "abc":
        h.add(rid, prompt(4, 100 * (ord(rid) - 96)), max_tokens=3)
    h.step()
    out, _ = h.step()
    # a: needs a block -> victim c (tail) frees one -> a allocates. b: needs a block -> victim is b itself.
    assert out.req_ids == ["a"] and out.preempted_req_ids == ["c", "b"]
    assert h.s.get_request_status("b") == RequestStatus.PREEMPTED
    assert h.s.get_output_token_ids("b") == [TOK]  # outputs survive preemption
    assert h.s.get_num_computed_tokens("b") == 0 and h.s.get_block_ids("b").size == 0
    st = h.s.stats()
    assert (st.num_preemptions, st.num_running_reqs, st.num_waiting_reqs) == (2, 1, 2)
    outs = run_to_completion(h.s, h.prompt_lens)
    resumed = [rid for o in outs for rid in o.resumed_req_ids]
    assert resumed == ["b", "c"]  # the last preempted went to the front
    assert all(not o.new_req_ids for o in outs)


def test_resumed_request_gets_its_whole_block_table_and_preempted_prefix_stats() -> None:
    h = Harness(block_size=4, num_blocks=4)
    for rid in "abc":
        h.add(rid, prompt(4, 100 * (ord(rid) - 96)), max_tokens=3)
    h.step()
    h.step()
    outs = run_to_completion(h.s, h.prompt_lens)
    for o in outs:
        for k, rid in enumerate(o.req_ids):
            if rid in o.resumed_req_ids:
                table = csr(o.new_block_ids, o.new_block_ids_indptr)[k]
                assert table == h_blocks_at(o, k)
    st = h.s.stats()
    assert st.prefix_cache_queries == 12  # three first admissions of 4 tokens
    assert st.prefix_cache_preempted_queries == 2 * 5  # b and c come back with 5 tokens each


def h_blocks_at(out, k: int) -> list[int]:
    return csr(out.new_block_ids, out.new_block_ids_indptr)[k]


def test_priority_preemption_refunds_a_victim_scheduled_earlier_in_the_step() -> None:
    # A tight pool where a long prompt is admitted for its first chunk: the full-prompt gate is off.
    h = Harness(block_size=16, num_blocks=5, max_num_batched_tokens=20, policy="priority",
                scheduler_reserve_full_isl=False)  # fmt: skip
    h.add("v", prompt(16), priority=9)
    h.step()  # v: 16 tokens, 1 block; samples -> 17 tokens
    h.add("r", prompt(16, 300), priority=0)
    h.add("w", prompt(40, 500), priority=1)
    out, _ = h.step()
    # v: 1 (2nd block), r: 16 (1 block), w: 3 of 40 (1 block): 4 blocks, pool full
    assert out.req_ids == ["v", "r", "w"] and out.num_scheduled_tokens.tolist() == [1, 16, 3]
    out, _ = h.step()
    # v scheduled (budget 19); r needs a block -> victim v (lowest priority, already scheduled): refund ->
    # budget 20 -> r takes 1 (19 left) -> w takes 19 (its 2nd block is the one v freed). No refund: 18.
    assert out.preempted_req_ids == ["v"]
    assert out.req_ids == ["r", "w"] and out.num_scheduled_tokens.tolist() == [1, 19]
    assert out.total_num_scheduled_tokens == 20


def test_priority_victim_skipped_earlier_shifts_the_index_so_no_request_is_passed_over() -> None:
    # semantics.md note (1): the victim sat before r without being scheduled (its decode was in flight).
    h = Harness(
        block_size=4,
        num_blocks=5,
        max_num_batched_tokens=7,
        long_prefill_token_threshold=6,
        policy="priority",
        scheduler_reserve_full_isl=False,
    )  # chunk admission, no gate
    h.add("x", prompt(4), priority=9)
    out1 = h.schedule()  # x: 4 tokens, 1 block; its token is not applied yet
    h.add("r", prompt(15, 200))
    h.add("y", prompt(15, 400))
    out2 = h.schedule()  # x: n = 0 (skipped); r: 6 (2 blocks); y: 1 (1 block); pool full
    assert out2.req_ids == ["r", "y"] and out2.num_scheduled_tokens.tolist() == [6, 1]
    out3 = h.schedule()
    # r needs a 3rd block -> victim x (index 0 < 1) -> the index moves back -> y is still visited.
    assert out3.preempted_req_ids == ["x"]
    assert out3.req_ids == ["r", "y"] and out3.num_scheduled_tokens.tolist() == [6, 1]
    # A request preempted after its step was scheduled still receives that step's token.
    res = h.update(out1, {"x": [TOK]})
    assert res.num_new_tokens.tolist() == [1] and h.s.get_output_token_ids("x") == [TOK]
    assert h.s.get_request_status("x") == RequestStatus.PREEMPTED
    h.update(out2)
    h.update(out3)


def test_priority_policy_admits_by_priority_then_arrival_then_id() -> None:
    h = Harness(block_size=4, num_blocks=32, max_num_seqs=1, policy="priority")
    h.add("c", prompt(3), priority=1, arrival_time=0.0, max_tokens=1)
    h.add("b", prompt(3), priority=0, arrival_time=5.0, max_tokens=1)
    h.add("a", prompt(3), priority=0, arrival_time=5.0, max_tokens=1)
    order = [o.req_ids[0] for o in run_to_completion(h.s, h.prompt_lens)]
    assert order == ["a", "b", "c"]


def test_phase_b_does_not_run_in_a_step_that_preempted() -> None:
    h = Harness(block_size=4, num_blocks=4)  # 3 usable blocks
    for rid in "ab":
        h.add(rid, prompt(4, 100 * (ord(rid) - 96)))
    h.step()  # a, b: one block each
    h.add("c", prompt(1, 900))
    out, _ = h.step()
    # a takes the last free block; b needs one too and is its own victim. c would fit in the block b freed,
    # but no request is admitted in a step that preempted.
    assert out.req_ids == ["a"] and out.preempted_req_ids == ["b"]
    assert h.s.get_request_status("c") == RequestStatus.WAITING and h.s.num_free_blocks == 1
    out, _ = h.step()  # b (5 tokens) hits its freed block but needs 1 more + 1 evictable > 1 free
    assert out.req_ids == ["a"] and not out.preempted_req_ids


# --------------------------------------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------------------------------------


def test_identical_prompt_admitted_in_the_same_step_already_hits() -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(9))
    h.add("b", prompt(9))
    out, _ = h.step()
    # a caches blocks 0,1 on allocation; b hits both (lookup cap (9-1)//4 = 2) and computes 1 token
    assert out.num_computed_tokens.tolist() == [0, 8] and out.num_scheduled_tokens.tolist() == [9, 1]
    blocks = csr(out.new_block_ids, out.new_block_ids_indptr)
    assert blocks[1][:2] == blocks[0][:2]
    st = h.s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (18, 8)


def test_lookup_leaves_the_last_token_to_compute() -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(8))
    h.step()
    assert h.s.get_num_cached_tokens(prompt(8)) == 4  # exactly 2 blocks: at most 1 hit
    assert h.s.get_num_cached_tokens(prompt(9)) == 8
    assert h.s.get_num_cached_tokens(prompt(5)) == 4
    assert h.s.get_num_cached_tokens(prompt(4)) == 0
    assert h.s.get_num_cached_tokens([1, *prompt(8)[1:]]) == 0  # first block differs: the chain breaks


def test_cache_salt_and_lora_name_isolate_the_prefix_cache() -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(9), cache_salt="alice")
    h.add("b", prompt(9), cache_salt="bob")
    h.add("c", prompt(9), lora_name="L1")
    h.add("d", prompt(9), cache_salt="alice")
    out, _ = h.step()
    assert out.num_computed_tokens.tolist() == [0, 0, 0, 8]
    assert h.s.get_num_cached_tokens(prompt(9)) == 0
    assert h.s.get_num_cached_tokens(prompt(9), lora_name="L1") == 8
    assert h.s.get_block_hashes("a") != h.s.get_block_hashes("b")
    assert h.s.get_block_hashes("a")[1] != h.s.get_block_hashes("b")[1]  # the salt flows down the chain


def test_get_num_cached_tokens_changes_nothing() -> None:
    h = Harness(block_size=4, num_blocks=6)
    h.add("a", prompt(9), max_tokens=1)
    run_to_completion(h.s, h.prompt_lens)
    st = h.s.stats()
    for _ in range(3):
        assert h.s.get_num_cached_tokens(prompt(9)) == 8
    assert h.s.stats() == st
    # LRU order untouched: free queue [3 (unhashed, head), 4, 5, 2, 1]; 16 tokens take 3, 4, 5 and 2 (a's
    # deepest cached block), so only a's first block still hits.
    h.add("b", prompt(16, 500), max_tokens=1)
    h.step()
    assert h.s.get_num_cached_tokens(prompt(9)) == 4


def test_freed_blocks_go_deepest_first_to_the_tail_and_unhashed_blocks_to_the_head() -> None:
    h = Harness(block_size=4, num_blocks=5)  # 4 usable blocks: 1 2 3 4
    h.add("a", prompt(6), max_tokens=1)  # blocks [1, 2]; block 1 full (hashed), block 2 partial
    out, _ = h.step()
    assert h_blocks_at(out, 0) == [1, 2]
    # freed in reverse: 2 (no hash) -> head, 1 (hashed) -> tail: free queue is [2, 3, 4, 1]
    h.add("b", prompt(3, 500), max_tokens=1)
    out, _ = h.step()
    assert h_blocks_at(out, 0) == [2]
    # b's block is full after its token but was never cached (caching happens on allocation): to the head.
    h.add("c", prompt(13, 700), max_tokens=1)  # takes 2, 3, 4 and finally 1, evicting a's cached block
    assert h.s.get_num_cached_tokens(prompt(6)) == 4
    out, _ = h.step()
    assert h_blocks_at(out, 0) == [2, 3, 4, 1]
    assert h.s.get_num_cached_tokens(prompt(6)) == 0


def test_cached_free_blocks_are_evicted_in_lru_order() -> None:
    h = Harness(block_size=4, num_blocks=5)
    h.add("a", prompt(8), max_tokens=1)  # blocks 1, 2: both full, so both cached on allocation
    h.step()
    # freed in reverse (2 then 1) to the tail: queue [3, 4, 2, 1]; a's deepest block goes first
    h.add("b", prompt(12, 500), max_tokens=1)  # takes 3, 4, 2
    h.step()
    assert h.s.get_num_cached_tokens(prompt(9)) == 4  # block 1 survives, block 2 is gone


def test_prefix_hit_on_a_free_block_counts_against_the_free_pool() -> None:
    # 4 usable blocks. a (8 tokens) finishes: both blocks free but cached. b = a's prompt + 5 tokens: hits 2
    # blocks, both evictable, needs 2 more: 2 + 2 evictable <= 4 free -> admitted, and the pool is full.
    h = Harness(block_size=4, num_blocks=5)
    h.add("a", prompt(8), max_tokens=1)
    h.step()
    h.add("b", prompt(13), max_tokens=1)
    out = h.schedule()
    assert out.num_computed_tokens.tolist() == [8] and h.s.num_free_blocks == 0


def test_cache_map_keeps_duplicate_hashes_and_a_copy_survives_eviction() -> None:
    h = Harness(block_size=4, num_blocks=5)  # 4 usable blocks
    h.add("a", prompt(8), max_tokens=1)
    h.add("b", prompt(8), max_tokens=1)
    out, _ = h.step()
    # a: [1, 2]; b hits only block 1 (cap (8-1)//4 = 1) and computes its own copy of a's block 2: block 3
    assert csr(out.new_block_ids, out.new_block_ids_indptr) == [[1, 2], [1, 3]]
    # Both finished; free queue [4, 2, 3, 1]. c takes 4 and 2, evicting one copy of the duplicated hash.
    h.add("c", prompt(5, 500), max_tokens=5)
    out, _ = h.step()
    assert h_blocks_at(out, 0) == [4, 2]
    assert h.s.get_num_cached_tokens(prompt(9)) == 8  # b's block 3 carries the same hash: no dedup


def test_drafts_for_a_prefill_chunk_are_refused() -> None:
    h = Harness(block_size=4, num_blocks=32, num_lookahead_tokens=2, max_num_batched_tokens=4)
    h.add("a", prompt(10))
    out = h.schedule()
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out, [[]], [[1]])
    h.s.update_from_output(out, [[]], [[]])
    h.s.check_invariants()


def test_reset_prefix_cache_only_when_no_block_is_in_use() -> None:
    h = Harness(block_size=4, num_blocks=16)
    h.add("a", prompt(9), max_tokens=2)
    h.step()
    assert h.s.reset_prefix_cache() is False
    assert h.s.get_num_cached_tokens(prompt(9)) == 8
    run_to_completion(h.s, h.prompt_lens)
    assert h.s.get_num_cached_tokens(prompt(9)) == 8
    assert h.s.reset_prefix_cache() is True
    h.s.check_invariants()
    assert h.s.get_num_cached_tokens(prompt(9)) == 0


def test_prefix_caching_disabled_never_hits_and_keeps_no_hashes() -> None:
    h = Harness(block_size=4, num_blocks=32, enable_prefix_caching=False)
    h.add("a", prompt(9))
    h.add("b", prompt(9))
    out, _ = h.step()
    assert out.num_computed_tokens.tolist() == [0, 0]
    assert h.s.get_block_hashes("a") == [] and h.s.get_num_cached_tokens(prompt(9)) == 0


def test_output_tokens_extend_block_hashes_and_resumed_requests_hit_them() -> None:
    h = Harness(block_size=4, num_blocks=4)
    h.add("a", prompt(3))
    for _ in range(5):
        h.step()  # 3 + 5 = 8 tokens: two full blocks
    assert len(h.s.get_block_hashes("a")) == 2
    assert h.s.get_num_cached_tokens(prompt(3) + [TOK] * 6) == 4  # block 1 is cached on its next allocation
    h.step()
    assert h.s.get_num_cached_tokens(prompt(3) + [TOK] * 6) == 8


def test_hash_seed_fixes_the_chain_and_sha256_digests_are_32_bytes() -> None:
    def hashes(**cfg: object) -> list[bytes]:
        s = ReferenceScheduler(block_size=4, **cfg)
        s.add_request("a", prompt(8), arrival_time=0.0)
        return s.get_block_hashes("a")

    assert hashes() != hashes()  # random seed per scheduler
    assert hashes(prefix_hash_seed=3) == hashes(prefix_hash_seed=3) != hashes(prefix_hash_seed=4)
    assert [len(x) for x in hashes(prefix_hash_algo="sha256")] == [32, 32]
    assert [len(x) for x in hashes(prefix_hash_algo="xxh3_128")] == [16, 16]


# --------------------------------------------------------------------------------------------------------
# Stop conditions
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "tokens", "reason", "stop_reason", "num_outputs"),
    [
        ({"eos_token_id": 2}, [5, 2], FinishReason.STOP, -1, 2),
        ({"eos_token_id": 2, "ignore_eos": True, "max_tokens": 3}, [2, 2, 2], FinishReason.LENGTH, -1, 3),
        ({"stop_token_ids": [9, 11]}, [5, 11], FinishReason.STOP, 11, 2),
        # vLLM 0.33 check_stop: EOS and stop ids come before min_tokens (the sampler masks them until then)
        ({"eos_token_id": 2, "min_tokens": 3, "stop_token_ids": [9]}, [2], FinishReason.STOP, -1, 1),
        ({"eos_token_id": 2, "min_tokens": 3, "stop_token_ids": [9]}, [5, 9], FinishReason.STOP, 9, 2),
        ({"eos_token_id": 9, "stop_token_ids": [9]}, [9], FinishReason.STOP, -1, 1),  # EOS is checked first
        ({"max_tokens": 2}, [5, 5], FinishReason.LENGTH, -1, 2),
        ({"max_tokens": 2, "min_tokens": 2, "stop_token_ids": [5]}, [5], FinishReason.STOP, 5, 1),
        ({"max_tokens": 2, "min_tokens": 2, "stop_token_ids": [5]}, [4, 4], FinishReason.LENGTH, -1, 2),
    ],
)
def test_stop_checks_run_in_order_after_each_token(kw, tokens, reason, stop_reason, num_outputs) -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(3), **kw)
    for i, t in enumerate(tokens):
        _, res = h.step({"a": [t]})
        if i < len(tokens) - 1:
            assert res.finished_req_ids == []
    assert res.finished_req_ids == ["a"]
    assert res.finish_reasons.dtype == np.int8 and res.finish_reasons.tolist() == [reason]
    assert res.stop_reasons.dtype == np.int64 and res.stop_reasons.tolist() == [stop_reason]
    out = h.schedule()
    assert out.finished_req_ids == ["a"] and out.req_ids == []
    with pytest.raises(UnknownRequestError):
        h.s.get_request_status("a")  # finished requests are forgotten
    assert num_outputs == len(tokens)


def test_a_stop_discards_the_rest_of_the_entry() -> None:
    h = Harness(block_size=4, num_blocks=32, num_lookahead_tokens=2)
    h.add("a", prompt(3), eos_token_id=2)
    h.step(drafts=[[5, 6]])
    out = h.schedule()
    assert csr(out.spec_token_ids, out.spec_token_ids_indptr) == [[5, 6]]
    res = h.update(out, {"a": [5, 2, 6]})
    assert res.num_new_tokens.tolist() == [2] and res.finished_req_ids == ["a"]


# --------------------------------------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------------------------------------


def test_drafts_are_scheduled_with_lookahead_and_rejected_ones_roll_back() -> None:
    h = Harness(block_size=4, num_blocks=32, num_lookahead_tokens=3)
    h.add("a", prompt(3))
    out, _ = h.step(drafts=[[20, 21, 22]])
    # vLLM 0.33: admissions reserve lookahead slots too: 3 + 3 slots -> 2 blocks
    assert h_blocks_at(out, 0) == [1, 2]
    out = h.schedule()
    # 1 token + 3 drafts; slots 4 + 4 + 3 lookahead = 11 -> 3 blocks
    assert out.num_scheduled_tokens.tolist() == [4] and out.num_computed_tokens.tolist() == [3]
    assert csr(out.spec_token_ids, out.spec_token_ids_indptr) == [[20, 21, 22]]
    assert h.s.get_block_ids("a").tolist() == [1, 2, 3]
    inputs = h.s.prepare_model_inputs(out)
    assert inputs.input_token_ids.tolist() == [TOK, 20, 21, 22]
    assert inputs.input_positions.tolist() == [3, 4, 5, 6]
    assert h.s.get_num_computed_tokens("a") == 7
    h.update(out, {"a": [20, 30]})  # 1 draft accepted, 2 rejected
    assert h.s.get_output_token_ids("a") == [TOK, 20, 30]
    assert h.s.get_num_computed_tokens("a") == 5  # 7 - 2 rejected = num_tokens - 1


def test_drafts_are_validated() -> None:
    h = Harness(block_size=4, num_blocks=32, num_lookahead_tokens=1)
    h.add("a", prompt(3))
    out = h.schedule()
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out, [[TOK]], [[1, 2]])  # more drafts than num_lookahead_tokens
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out, [[TOK]], [[-1]])
    h.s.update_from_output(out, [[TOK]], [[4]])
    h.s.check_invariants()


@pytest.mark.parametrize("impl", ["reference", "core"])
def test_an_empty_decode_keeps_its_drafts_computed_and_extra_tokens_count_as_computed(impl: str) -> None:
    """vLLM's scheduler takes what the runner returns: nothing for a decode (nothing appended, nothing rolled
    back: the step's drafts stay computed), or more than 1 + drafts (appended, computed moves forward)."""
    cfg: dict[str, Any] = {"block_size": 4, "num_blocks": 32, "max_model_len": 64, "num_lookahead_tokens": 2}
    s = ReferenceScheduler(**cfg) if impl == "reference" else Scheduler(**cfg)
    s.add_request("a", prompt(3), max_tokens=20, arrival_time=0.0)
    s.add_request("b", prompt(3, 100), max_tokens=20, arrival_time=1.0)
    s.update_from_output(s.schedule(), [[TOK], [TOK]], [[1, 2], [1, 2]])
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [3, 3]
    res = s.update_from_output(out, [[], [TOK, 5, 6, 8, 9]])
    assert res.num_new_tokens.tolist() == [0, 5]
    assert list(s.get_output_token_ids("a")) == [TOK] and s.get_num_computed_tokens("a") == 6  # 3 + 1 + 2 drafts
    # b: 4 tokens + 5 = 9; computed 4 + 2 drafts - (2 - 4 accepted) = 8 = num_tokens - 1
    assert list(s.get_output_token_ids("b")) == [TOK, TOK, 5, 6, 8, 9] and s.get_num_computed_tokens("b") == 8
    s.check_invariants()
    out = s.schedule()
    assert out.req_ids == ["b"]  # a has nothing left to compute
    s.update_from_output(out, [[TOK, TOK]])  # no drafts scheduled, two tokens: both appended
    assert s.get_num_computed_tokens("b") == 9 and len(s.get_output_token_ids("b")) == 8
    s.check_invariants()


def test_drafts_are_capped_by_max_model_len() -> None:
    h = Harness(block_size=4, num_blocks=32, num_lookahead_tokens=4, max_model_len=6)
    h.add("a", prompt(3))
    h.step(drafts=[[1, 1, 1, 1]])
    out = h.schedule()
    # computed 3, num_tokens 4: n = min(1 + 4, 6 - 1 - 3) = 2 -> 1 draft
    assert out.num_scheduled_tokens.tolist() == [2]
    assert csr(out.spec_token_ids, out.spec_token_ids_indptr) == [[1]]


# --------------------------------------------------------------------------------------------------------
# Abort, in-flight steps, id reuse
# --------------------------------------------------------------------------------------------------------


def test_abort_in_every_state_frees_blocks_and_is_reported_once() -> None:
    h = Harness(block_size=4, num_blocks=4, max_num_batched_tokens=64)
    h.add("run", prompt(4, 100))
    h.add("pre", prompt(4, 200))
    h.add("fly", prompt(4, 300))
    h.step()
    out = h.schedule()  # run allocates by preempting fly then pre
    assert out.preempted_req_ids == ["fly", "pre"]
    h.update(out)
    h.add("new", prompt(3, 400))
    inflight = h.schedule()
    assert inflight.req_ids == ["run"]
    h.s.abort_requests(["pre", "new", "pre"])  # duplicates count once
    with pytest.raises(SchedulerTypeError):
        h.s.abort_requests("fly")  # a bare str is not an iterable of ids
    h.s.abort_requests(iter(["fly"]))
    h.s.abort_requests(["run"])  # in flight
    h.s.check_invariants()
    assert h.s.num_free_blocks == 3 and not h.s.has_unfinished_requests()
    res = h.s.update_from_output(inflight, [[-5, 99]])  # the entry of a gone request is ignored
    assert res.num_new_tokens.tolist() == [0] and res.finished_req_ids == []
    out = h.schedule()
    assert out.finished_req_ids == ["pre", "new", "fly", "run"]
    assert h.schedule().finished_req_ids == []
    assert h.s.stats().num_finished_reqs == 4
    for rid in ("pre", "new", "fly", "run"):
        with pytest.raises(UnknownRequestError):
            h.s.abort_requests([rid])


def test_abort_with_an_unknown_id_aborts_nothing() -> None:
    h = Harness()
    h.add("a", prompt(3))
    with pytest.raises(UnknownRequestError):
        h.s.abort_requests(["a", "zzz"])
    assert h.s.get_request_status("a") == RequestStatus.WAITING


def test_a_reused_id_never_receives_tokens_of_the_finished_request() -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(3))
    out1 = h.schedule()
    h.s.abort_requests(["a"])
    h.add("a", prompt(5, 500))
    out2 = h.schedule()
    assert out2.finished_req_ids == ["a"] and out2.new_req_ids == ["a"]
    res = h.s.update_from_output(out1, [[TOK]])
    assert res.num_new_tokens.tolist() == [0] and h.s.get_output_token_ids("a") == []
    h.s.update_from_output(out2, [[8]])
    assert h.s.get_output_token_ids("a") == [8]


def test_async_steps_apply_in_order_exactly_once() -> None:
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=4)
    h.add("a", prompt(10))
    out1 = h.schedule()
    out2 = h.schedule()  # prefill chunks continue while step 1 is in flight
    assert (out1.step_id, out2.step_id) == (0, 1) and out2.num_computed_tokens.tolist() == [4]
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out2, [[]])  # out of order
    h.s.update_from_output(out1, [[]])
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(out1, [[]])  # twice
    h.s.update_from_output(out2, [[]])
    out3 = h.schedule()  # the last 2 prompt tokens: not a chunk
    out4 = h.schedule()  # its decode waits for the token of step 3
    assert out3.num_scheduled_tokens.tolist() == [2] and out4.req_ids == []
    h.s.update_from_output(out3, [[TOK]])
    h.s.update_from_output(out4, [])
    assert h.s.stats().step_id == 4
    other = ReferenceScheduler()
    with pytest.raises(InvalidOutputError):
        other.update_from_output(h.schedule(), [])  # another scheduler's output


def test_prepare_model_inputs_lays_out_the_batch() -> None:
    h = Harness(block_size=4, num_blocks=32)
    h.add("a", prompt(6))
    h.add("b", prompt(2, 50))
    h.step()
    h.add("c", prompt(5))  # hits a's first block
    out = h.schedule()
    mi = h.s.prepare_model_inputs(out)
    # a: decode at position 6 (block 2), b: decode at 2 (block 3), c: positions 4..4 after a 4-token hit
    assert out.req_ids == ["a", "b", "c"]
    assert mi.input_positions.tolist() == [6, 2, 4]
    assert mi.input_token_ids.tolist() == [TOK, TOK, 104]
    assert mi.block_table.tolist() == [[1, 2], [3, 0], [1, 4]]
    assert mi.slot_mapping.tolist() == [2 * 4 + 2, 3 * 4 + 2, 4 * 4 + 0]
    assert mi.query_start_loc.tolist() == [0, 1, 2, 3] and mi.logits_indices.tolist() == [0, 1, 2]
    assert mi.seq_lens.tolist() == [7, 3, 5]
    assert (mi.num_reqs, mi.num_tokens, mi.max_seq_len, mi.max_query_len) == (3, 3, 7, 1)
    assert all(a.dtype == np.int32 for a in (mi.input_token_ids, mi.slot_mapping, mi.block_table))
    h.s.update_from_output(out, [[TOK]] * 3)
    with pytest.raises(InvalidOutputError):
        h.s.prepare_model_inputs(out)  # the scheduler changed since


# --------------------------------------------------------------------------------------------------------
# Stats, output types, invariants
# --------------------------------------------------------------------------------------------------------


def test_stats_fields_and_values() -> None:
    h = Harness(block_size=4, num_blocks=11)
    st = h.s.stats()
    assert isinstance(st, SchedulerStats)
    assert st == SchedulerStats(0, 0, 0, 0.0, 10, 0, 0, 0, 0, 0, 0, 0)
    h.add("a", prompt(9))
    h.add("b", prompt(9))
    h.step()
    st = h.s.stats()
    # a: 3 blocks; b: a's 2 cached blocks + 1 of its own
    assert (st.num_running_reqs, st.num_free_blocks, st.step_id) == (2, 6, 1)
    assert st.kv_cache_usage == 1 - 6 / 10
    with pytest.raises(AttributeError):
        st.step_id = 3  # type: ignore[misc]


def test_scheduler_output_field_types() -> None:
    h = Harness(block_size=4)
    h.add("a", prompt(3))
    out = h.schedule()
    for name in ("num_scheduled_tokens", "num_computed_tokens", "new_block_ids", "new_block_ids_indptr",
                 "spec_token_ids", "spec_token_ids_indptr"):  # fmt: skip
        assert getattr(out, name).dtype == np.int32, name
    for name in ("req_ids", "new_req_ids", "resumed_req_ids", "preempted_req_ids", "finished_req_ids"):
        assert isinstance(getattr(out, name), list), name
    assert out.num_scheduled_tokens_by_id() == {"a": 3}
    assert isinstance(out.total_num_scheduled_tokens, int) and isinstance(out.step_id, int)


def test_check_invariants_detects_corruption() -> None:
    h = Harness(block_size=4, num_blocks=8)
    h.add("a", prompt(9))
    h.step()
    h.s._ref_cnt[1] += 1
    with pytest.raises(InternalError):
        h.s.check_invariants()
    h.s._ref_cnt[1] -= 1
    h.s.check_invariants()
    h.s._block_hash[7] = b"x" * 16  # a free block with a hash that is not in the cache map
    with pytest.raises(InternalError):
        h.s.check_invariants()


def test_constructor_accepts_a_config_or_fields() -> None:
    assert ReferenceScheduler(SchedulerConfig(block_size=8)).config.block_size == 8
    assert ReferenceScheduler(block_size=8).config == SchedulerConfig(block_size=8)
    with pytest.raises(SchedulerError):
        ReferenceScheduler(SchedulerConfig(), block_size=8)
    with pytest.raises(SchedulerError):
        ReferenceScheduler(block_size=4097)


# --------------------------------------------------------------------------------------------------------
# Bad inputs: the right class, and nothing changes
# --------------------------------------------------------------------------------------------------------

BAD_ADDS = [
    (("", [1]), {}, InvalidRequestError),
    ((5, [1]), {}, SchedulerTypeError),
    (("dup", [1]), {}, DuplicateRequestError),
    (("x", []), {}, InvalidRequestError),
    (("x", [1, -1]), {}, InvalidRequestError),
    (("x", [2**31]), {}, InvalidRequestError),
    (("x", [1.5]), {}, SchedulerTypeError),
    (("x", np.zeros((2, 2), dtype=np.int32)), {}, SchedulerTypeError),
    (("x", np.zeros(3, dtype=np.float32)), {}, SchedulerTypeError),
    (("x", "abc"), {}, SchedulerTypeError),
    (("x", None), {}, SchedulerTypeError),
    (("x", list(range(64))), {}, InvalidRequestError),  # len(prompt) == max_model_len
    (("x", [1]), {"max_tokens": 0}, InvalidRequestError),
    (("x", [1]), {"min_tokens": -1}, InvalidRequestError),
    (("x", [1]), {"min_tokens": 64}, InvalidRequestError),  # > effective max_tokens 63
    (("x", [1]), {"max_tokens": 2, "min_tokens": 3}, InvalidRequestError),
    (("x", [1]), {"eos_token_id": -1}, InvalidRequestError),
    (("x", [1]), {"stop_token_ids": [2**31]}, InvalidRequestError),
    (("x", [1]), {"stop_token_ids": 5}, SchedulerTypeError),
    (("x", [1]), {"priority": 2**63}, InvalidRequestError),
    (("x", [1]), {"priority": 1.0}, SchedulerTypeError),
    (("x", [1]), {"arrival_time": math.nan}, InvalidRequestError),
    (("x", [1]), {"arrival_time": math.inf}, InvalidRequestError),
    (("x", [1]), {"arrival_time": "now"}, SchedulerTypeError),
    (("x", [1]), {"cache_salt": 3}, SchedulerTypeError),
    (("x", [1]), {"lora_name": b"l"}, SchedulerTypeError),
]


@pytest.mark.parametrize(("args", "kw", "error"), BAD_ADDS)
def test_bad_add_request_raises_the_documented_error_and_changes_nothing(args, kw, error) -> None:
    h = Harness(block_size=4, max_model_len=64)
    h.add("dup", prompt(3))
    before = h.s.stats()
    with pytest.raises(error):
        h.s.add_request(*args, **kw)
    assert h.s.stats() == before and h.s.num_unfinished_requests == 1
    h.s.check_invariants()


def test_bad_outputs_raise_and_change_nothing() -> None:
    h = Harness(block_size=4)
    h.add("a", prompt(3))
    h.add("b", prompt(3))
    out = h.schedule()
    i32 = np.int32
    bad = [
        ([[TOK]], InvalidOutputError),  # one entry for two requests
        ([[TOK], [TOK], [TOK]], InvalidOutputError),
        ((np.array([TOK, TOK], i32), np.array([0, 1], i32)), InvalidOutputError),  # indptr too short
        ((np.array([TOK, TOK], i32), np.array([0, 2, 1], i32)), InvalidOutputError),  # decreasing
        ((np.array([TOK, TOK], i32), np.array([1, 1, 2], i32)), InvalidOutputError),  # not from 0
        ((np.array([TOK, TOK], i32), np.array([0, 1, 3], i32)), InvalidOutputError),  # past the end
        ((np.array([TOK, TOK], np.float32), np.array([0, 1, 2], i32)), SchedulerTypeError),
        ((np.array([[TOK, TOK]], i32), np.array([0, 1, 2], i32)), SchedulerTypeError),
        ([[TOK], [-3]], InvalidOutputError),
        ([[TOK], [2**31]], InvalidOutputError),
        ([[TOK], [1.0]], SchedulerTypeError),
        (None, SchedulerTypeError),
    ]
    for sampled, error in bad:
        with pytest.raises(error):
            h.s.update_from_output(out, sampled)
        h.s.check_invariants()
        assert h.s.get_output_token_ids("a") == []
    with pytest.raises(SchedulerTypeError):
        h.s.update_from_output("not an output", [[TOK], [TOK]])
    res = h.s.update_from_output(out, (np.array([TOK, TOK], i32), np.array([0, 1, 2], i32)))
    assert res.num_new_tokens.tolist() == [1, 1]


@pytest.mark.parametrize("method", ["get_block_ids", "get_block_hashes", "get_request_status",
                                    "get_num_computed_tokens", "get_output_token_ids"])  # fmt: skip
def test_getters_raise_for_unknown_or_non_str_ids(method: str) -> None:
    s = ReferenceScheduler()
    with pytest.raises(UnknownRequestError):
        getattr(s, method)("nope")
    with pytest.raises(SchedulerTypeError):
        getattr(s, method)(3)


def test_invariants_hold_through_a_long_tight_random_run() -> None:
    """A quick seeded workout: tight KV, shared prefixes, aborts, drafts; invariants after every call."""
    rng = np.random.default_rng(0)
    for policy in ("fcfs", "priority"):
        h = Harness(block_size=4, num_blocks=12, max_num_batched_tokens=16, long_prefill_token_threshold=6,
                    num_lookahead_tokens=2, policy=policy, max_model_len=40)  # fmt: skip
        for i in range(300):
            if rng.random() < 0.5:
                rid = f"r{i}"
                h.add(rid, prompt(int(rng.integers(1, 24)), int(rng.integers(0, 3)) * 50),
                      max_tokens=int(rng.integers(1, 16)), priority=int(rng.integers(0, 3)),
                      eos_token_id=3)  # fmt: skip
            if rng.random() < 0.05 and h.s.num_unfinished_requests:
                victim = sorted(h.s._requests)[0]
                h.s.abort_requests([victim])
            out = h.schedule()
            sizes = entry_sizes(h.s, out, h.prompt_lens)
            sampled = [[] if sz is None else rng.integers(0, 6, int(rng.integers(1, sz + 1))).tolist()
                       for sz in sizes]  # fmt: skip
            drafts = [[] if sz is None else rng.integers(0, 6, 2).tolist() for sz in sizes]
            h.s.update_from_output(out, sampled, drafts)
            h.s.check_invariants()
        assert h.s.stats().num_preemptions > 0


# --------------------------------------------------------------------------------------------------------
# vLLM 0.33 parity: async scheduling, in-flight steps, pause states, grammar wait, LoRA limit, watermark,
# forced prefix-cache reset, spec-decode padding
# --------------------------------------------------------------------------------------------------------


def test_async_scheduling_gives_a_decode_its_next_token_before_the_previous_one_is_applied() -> None:
    """vLLM 0.33 AsyncScheduler._update_after_schedule: a non-chunk step leaves one output placeholder, so the
    next schedule() (before update) computes the placeholder's position."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64, async_scheduling=True)
    h.add("a", prompt(5), max_tokens=3)
    o1 = h.schedule()
    assert o1.num_scheduled_tokens.tolist() == [5] and h.s.get_num_output_placeholders("a") == 1
    o2 = h.schedule()  # o1 not applied yet: a still gets a token (position 5)
    assert o2.num_scheduled_tokens.tolist() == [1] and o2.num_computed_tokens.tolist() == [5]
    assert h.s.get_num_output_placeholders("a") == 2
    assert h.s.prepare_model_inputs(o2).input_token_ids.tolist() == [-1]  # still being sampled
    h.update(o1, {"a": [11]})  # two steps in flight at most, as vLLM's engine keeps them
    assert h.s.get_num_output_placeholders("a") == 1
    o3 = h.schedule()  # the steps in flight produce 2 of its 3 tokens: one more
    assert o3.num_scheduled_tokens.tolist() == [1]
    h.update(o2, {"a": [12]})
    assert h.s.get_output_token_ids("a") == [11, 12] and h.s.get_num_output_placeholders("a") == 1
    assert h.schedule().req_ids == []  # in flight: its last token (computed + 2 - ph >= prompt + max_tokens)
    res = h.update(o3, {"a": [13]})
    assert res.finished_req_ids == ["a"]


def test_async_scheduling_schedules_placeholder_drafts_and_refuses_draft_ids() -> None:
    """AsyncScheduler: spec_token_ids become num_spec_tokens placeholders (-1); drafts stay with the runner."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64, async_scheduling=True, num_lookahead_tokens=2)
    h.add("a", prompt(3), max_tokens=10)
    o1 = h.schedule()
    o2 = h.schedule()  # 1 token + 2 placeholder drafts
    assert o2.num_scheduled_tokens.tolist() == [3] and o2.spec_token_ids.tolist() == [-1, -1]
    assert h.s.get_num_output_placeholders("a") == 1 + 3
    with pytest.raises(InvalidOutputError):
        h.s.update_from_output(o1, [[TOK]], [[1, 2]])
    h.update(o1)
    h.update(o2, {"a": [TOK, 20]})  # 1 of 2 drafts accepted: computed and placeholders roll back by 1
    assert h.s.get_num_output_placeholders("a") == 0
    assert h.s.get_num_computed_tokens("a") == 3 + 3 - 1 and h.s.get_output_token_ids("a") == [TOK, TOK, 20]


def test_a_request_preempted_with_a_step_in_flight_is_not_resumed_before_that_output() -> None:
    """vLLM 0.33 _preempt_request: in-flight output becomes stale; the waiting loop skips the request (and
    counts it as deferred) while `num_stale_output_tokens` > 0; the stale tokens are still delivered."""
    h = Harness(block_size=4, num_blocks=5, max_num_batched_tokens=8, max_model_len=16, policy="priority",
                scheduler_reserve_full_isl=False)  # fmt: skip
    h.add("lo", prompt(3), max_tokens=8, priority=1)
    h.step()  # lo: 4 tokens, 1 block
    h.add("hi", prompt(13, 300), max_tokens=2, priority=0)
    o1 = h.schedule()  # lo decodes (in flight), hi: 7 of 13 (2 blocks)
    assert o1.num_scheduled_tokens_by_id() == {"lo": 1, "hi": 7}
    o2 = h.schedule()  # hi's last 6 need 4 blocks: lo (priority 1) is preempted with o1 in flight
    assert o2.preempted_req_ids == ["lo"] and o2.req_ids == ["hi"]
    h.update(o1)  # lo's stale token is delivered: it stays waiting (no rollback, no resume yet)
    assert h.s.get_output_token_ids("lo") == [TOK, TOK]
    assert h.s.get_request_status("lo") == RequestStatus.PREEMPTED
    h.update(o2)
    resumed = [h.step()[0].resumed_req_ids for _ in range(3)]  # once hi is done, lo comes back
    assert ["lo"] in resumed


def test_stale_entries_skip_admission_and_count_as_skipped_waiting() -> None:
    """vLLM 0.33 stats: num_skipped_waiting_reqs = len(deferred_waiting), num_waiting_reqs excludes them."""
    h = Harness(block_size=4, num_blocks=5, max_num_batched_tokens=8, max_model_len=16, policy="priority",
                scheduler_reserve_full_isl=False)  # fmt: skip
    h.add("lo", prompt(3), max_tokens=8, priority=1)
    h.step()
    h.add("hi", prompt(13, 300), max_tokens=2, priority=0)
    h.schedule()
    h.schedule()  # lo preempted with a step in flight
    out = h.schedule()  # lo is skipped: stale output pending
    assert "lo" not in out.req_ids
    st = h.s.stats()
    assert (st.num_waiting_reqs, st.num_skipped_waiting_reqs) == (0, 1)


def test_requests_waiting_for_a_grammar_are_skipped_and_keep_their_place() -> None:
    """vLLM 0.33 WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: skipped by the waiting loop (others pass it), deferred
    from the start, promoted to WAITING only when an admission pass reaches it after the grammar is ready."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=2)
    h.add("g", prompt(4), max_tokens=2, ready=False)
    h.add("b", prompt(4, 300), max_tokens=2)
    h.add("c", prompt(4, 400), max_tokens=2)
    assert h.s.get_request_status("g") == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert (h.s.stats().num_waiting_reqs, h.s.stats().num_skipped_waiting_reqs) == (2, 1)
    out, _ = h.step()
    assert out.req_ids == ["b", "c"]
    h.s.set_ready("g")
    assert h.s.get_request_status("g") == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR  # until reached
    h.s.set_ready("b")  # not waiting for a grammar: no effect
    h.step()  # b and c finish (max_tokens=2); max_num_seqs=2 kept g out of this admission pass
    out, _ = h.step()
    assert out.new_req_ids == ["g"] and h.s.stats().num_skipped_waiting_reqs == 0
    with pytest.raises(UnknownRequestError):
        h.s.set_ready("nope")


def test_paused_new_stops_admissions_and_paused_all_schedules_nothing() -> None:
    """vLLM 0.33 PauseState: PAUSED_NEW admits nothing (the unfinished count is the running requests);
    PAUSED_ALL schedules nothing (count 0) but the output still reports finished ids."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64)
    h.add("a", prompt(4), max_tokens=5)
    h.step()
    h.add("b", prompt(4, 300), max_tokens=5)
    h.s.set_pause_state("paused_new")
    assert h.s.pause_state == "paused_new" and h.s.num_unfinished_requests == 1
    out, _ = h.step()
    assert out.req_ids == ["a"]
    h.s.abort_requests(["a"])
    h.s.set_pause_state("paused_all")
    assert h.s.num_unfinished_requests == 0 and not h.s.has_unfinished_requests()
    out = h.schedule()
    assert out.req_ids == [] and out.finished_req_ids == ["a"] and out.step_id == 2
    h.update(out)
    h.s.set_pause_state("unpaused")
    assert h.step()[0].req_ids == ["b"]
    with pytest.raises(InvalidRequestError):
        h.s.set_pause_state("paused")
    with pytest.raises(SchedulerTypeError):
        h.s.set_pause_state(1)


def test_reset_prefix_cache_with_running_requests_preempts_them_from_the_tail() -> None:
    """vLLM 0.33 reset_prefix_cache(reset_running_requests=True): pop running from the tail into the front of
    waiting (they resume in order), drop their in-flight output, then the reset succeeds."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64)
    for rid in ("a", "b", "c"):
        h.add(rid, prompt(6, 100 * len(h.prompt_lens)), max_tokens=9)
    h.step()
    o = h.schedule()  # in flight while the cache is reset
    assert h.s.reset_prefix_cache() is False
    assert h.s.reset_prefix_cache(reset_running_requests=True) is True
    assert h.s.num_free_blocks == 31 and h.s.get_num_cached_tokens(prompt(6)) == 0
    assert h.s.stats().num_preemptions == 3
    res = h.update(o)  # the in-flight output is dropped
    assert res.num_new_tokens.tolist() == [0, 0, 0] and h.s.get_output_token_ids("a") == [TOK]
    out = h.schedule()
    assert out.preempted_req_ids == ["c", "b", "a"] and out.resumed_req_ids == ["a", "b", "c"]


def test_max_loras_skips_an_admission_that_would_add_an_adapter() -> None:
    """vLLM 0.33: with max_loras distinct adapters among running requests, a request needing another one is
    skipped (requests behind it, base model or a present adapter, may pass)."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64, max_loras=1)
    h.add("x", prompt(4), max_tokens=3, lora_name="L1")
    h.add("y", prompt(4, 300), max_tokens=3, lora_name="L2")
    h.add("z", prompt(4, 400), max_tokens=3)
    h.add("w", prompt(4, 500), max_tokens=3, lora_name="L1")
    out, _ = h.step()
    assert out.req_ids == ["x", "z", "w"] and h.s.stats().num_skipped_waiting_reqs == 1


def test_watermark_keeps_blocks_free_for_admissions_when_something_runs() -> None:
    """vLLM 0.33 watermark: admissions leave int(watermark * num_blocks) blocks free, once a request runs."""
    h = Harness(block_size=4, num_blocks=10, max_model_len=32, watermark=0.2)  # 2 blocks of headroom
    h.add("a", prompt(16), max_tokens=1)  # 4 blocks: admitted (nothing runs yet, no watermark)
    h.add("b", prompt(13, 300), max_tokens=1)  # 4 blocks: 5 free - 2 reserved = 3: waits
    out = h.schedule()
    assert out.req_ids == ["a"]


def test_spec_decode_pads_an_admission_with_one_token_left() -> None:
    """vLLM 0.33 pad_spec_decode: a request admitted with one token left to compute (its prefix all cached),
    into a batch of decodes, gets num_lookahead_tokens placeholder drafts (1 + k tokens)."""
    h = Harness(block_size=4, num_blocks=32, max_model_len=64, num_lookahead_tokens=2)
    h.add("a", prompt(8), max_tokens=20)
    h.step()  # a's 2 blocks are cached; a decodes from now on
    h.add("c", [*prompt(8), TOK], max_tokens=5)  # 9 tokens, 8 of them hit: one left
    out = h.schedule()
    assert out.num_scheduled_tokens_by_id() == {"a": 1, "c": 3}
    assert csr(out.spec_token_ids, out.spec_token_ids_indptr) == [[], [-1, -1]]
    h.update(out, {"c": [TOK, 5]})  # the first placeholder "accepted", the second rejected
    assert h.s.get_num_computed_tokens("c") == 8 + 3 - 1
    assert h.s.get_output_token_ids("c") == [TOK, 5]


# ----------------------------------------------------------------------------------------------------------
# Preemption modes: swap and auto (docs/semantics.md, "Preemption modes")
# ----------------------------------------------------------------------------------------------------------


def _swap_scenario(**cfg: Any) -> tuple[ReferenceScheduler, list[int], Any]:
    """8 usable blocks of 4. a (8 tokens, 2 blocks) and c (12 tokens, 3 blocks) run; b (13 tokens) shares a's
    first 2 blocks as prefix hits and adds 2. After one token each, step 2: a takes the last free block, c needs
    a 4th: the tail b (13 computed tokens, 4 blocks, 2 of them shared with a) is the victim. Returns the
    scheduler right after step 2 and b's block table before it."""
    s = ReferenceScheduler(block_size=4, num_blocks=9, max_model_len=32, prefix_hash_seed=0, **cfg)
    s.add_request("a", list(range(8)), max_tokens=2, arrival_time=0.0)
    s.add_request("c", list(range(100, 112)), arrival_time=1.0)
    s.add_request("b", [*range(8), 50, 51, 52, 53, 54], arrival_time=2.0)
    out = s.schedule()
    assert out.req_ids == ["a", "c", "b"] and s.num_free_blocks == 1
    s.update_from_output(out, [[TOK]] * 3)
    b_blocks = s.get_block_ids("b").tolist()
    out = s.schedule()
    assert out.req_ids == ["a", "c"] and out.preempted_req_ids == ["b"]
    s.check_invariants()
    s.update_from_output(out, [[TOK]] * 2)  # a reaches max_tokens: its 3 blocks are freed
    return s, b_blocks, out


def test_swap_mode_copies_the_victim_out_and_back_and_looks_up_the_prefix_cache_first() -> None:
    s, b_blocks, out2 = _swap_scenario(preemption_mode="swap", num_cpu_blocks=8)
    # step 2 copied all 4 of b's blocks out (the shared ones too: a may free them meanwhile)
    assert out2.swap_out.tolist() == [[b, k] for k, b in enumerate(b_blocks)]
    assert out2.swap_in.shape == (0, 2) and out2.swap_in.dtype == np.int32
    assert s.get_cpu_block_ids("b").tolist() == [0, 1, 2, 3]
    assert s.get_request_status("b") == RequestStatus.PREEMPTED and s.get_num_computed_tokens("b") == 0
    out = s.schedule()
    # b's first 3 blocks are still in the prefix cache (a's two, its own full third): only the 4th comes back
    # by copy; b resumes with its 13 tokens in KV and computes the 14th
    assert out.resumed_req_ids == ["b"] and out.swap_out.shape == (0, 2)
    blocks = s.get_block_ids("b").tolist()
    assert blocks[:3] == b_blocks[:3]
    assert out.swap_in.tolist() == [[3, blocks[3]]]
    k = out.req_ids.index("b")
    assert (out.num_computed_tokens[k], out.num_scheduled_tokens[k]) == (13, 1)
    assert s.get_cpu_block_ids("b").tolist() == []
    st = s.stats()
    assert (st.num_swapped_out_reqs, st.num_swapped_out_blocks, st.num_swapped_in_reqs) == (1, 4, 1)
    assert (st.num_swapped_in_blocks, st.num_recomputed_tokens, st.num_swap_fallbacks) == (1, 0, 0)
    assert (st.num_free_cpu_blocks, st.prefix_cache_preempted_hits) == (8, 12)
    s.check_invariants()
    s.update_from_output(out, [[TOK]] * len(out.req_ids))
    run_to_completion(s, {"a": 8, "b": 13, "c": 12})
    assert s.num_free_blocks == 8 and s.stats().num_free_cpu_blocks == 8


def test_recompute_mode_counts_the_tokens_it_computes_again() -> None:
    s, _, out2 = _swap_scenario()
    assert out2.swap_out.shape == (0, 2)
    out = s.schedule()
    assert out.resumed_req_ids == ["b"] and out.swap_in.shape == (0, 2)
    k = out.req_ids.index("b")
    assert (out.num_computed_tokens[k], out.num_scheduled_tokens[k]) == (12, 2)  # 3 blocks hit
    assert s.stats().num_recomputed_tokens == 1  # token 13 had been computed before the preemption


def test_a_cpu_pool_too_small_for_the_victim_falls_back_to_recompute() -> None:
    s, _, out2 = _swap_scenario(preemption_mode="swap", num_cpu_blocks=3)
    assert out2.swap_out.shape == (0, 2)
    st = s.stats()
    assert (st.num_swap_fallbacks, st.num_swapped_out_reqs, st.num_preemptions) == (1, 0, 1)
    s.check_invariants()


@pytest.mark.parametrize(("recompute_cost", "swapped"), [(1.0, False), (1.7, True)])
def test_auto_swaps_when_copying_out_and_back_costs_less_than_recomputing(recompute_cost: float, swapped: bool) -> None:
    """b: 13 computed tokens in 4 blocks, 2 shared with a (8 tokens stay resident): recomputing costs
    recompute_cost * (13 - 8), swapping 1.0 * 2 * 4 = 8. 5.0 < 8: recompute; 8.5 > 8: swap."""
    s = ReferenceScheduler(block_size=4, num_blocks=9, max_model_len=32, prefix_hash_seed=0,
                           preemption_mode="auto", num_cpu_blocks=8)  # fmt: skip
    s.set_preemption_costs(recompute_cost, 1.0)
    assert s.preemption_costs == (recompute_cost, 1.0)
    s.add_request("a", list(range(8)), max_tokens=2, arrival_time=0.0)
    s.add_request("c", list(range(100, 112)), arrival_time=1.0)
    s.add_request("b", [*range(8), 50, 51, 52, 53, 54], arrival_time=2.0)
    s.update_from_output(s.schedule(), [[TOK]] * 3)
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert len(out.swap_out) == (4 if swapped else 0)
    assert s.stats().num_swapped_out_reqs == int(swapped)
    s.check_invariants()


def test_aborting_a_swapped_out_request_frees_its_cpu_blocks() -> None:
    s, _, _ = _swap_scenario(preemption_mode="swap", num_cpu_blocks=8)
    assert s.stats().num_free_cpu_blocks == 4
    s.abort_requests(["b"])
    assert s.stats().num_free_cpu_blocks == 8
    s.check_invariants()
    assert s.schedule().finished_req_ids == ["a", "b"]


@pytest.mark.parametrize("apply_first", [False, True])
def test_a_victim_with_a_step_in_flight_is_recomputed_not_swapped(apply_first: bool) -> None:
    """Its KV is not final until that step's output is applied (drafts may be rejected, placeholders are
    unresolved). 4 usable blocks of 4: a (4 tokens) and b (12, in chunks of 4 by the long-prefill cap) run; step 2
    gives a its 2nd block and b its 2nd chunk; step 3 needs a 3rd block for b, and b (the tail) is the victim:
    with step 2 still in flight it is recomputed, with step 2 applied it is swapped out (8 tokens, 2 blocks)."""
    s = ReferenceScheduler(block_size=4, num_blocks=5, max_model_len=16, long_prefill_token_threshold=4,
                           prefix_hash_seed=0, preemption_mode="swap", num_cpu_blocks=8)  # fmt: skip
    s.add_request("a", [1, 2, 3, 4], arrival_time=0.0)
    s.add_request("b", list(range(100, 112)), arrival_time=1.0)
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [4, 4]
    s.update_from_output(out, [[TOK], []])
    out2 = s.schedule()
    assert out2.num_scheduled_tokens.tolist() == [1, 4] and s.num_free_blocks == 0
    if apply_first:
        s.update_from_output(out2, [[TOK], []])
    out3 = s.schedule()
    assert out3.preempted_req_ids == ["b"]
    assert out3.swap_out.tolist() == ([[int(b), k] for k, b in enumerate(out.new_block_ids[1:2].tolist()
                                       + out2.new_block_ids[1:].tolist())] if apply_first else [])  # fmt: skip
    st = s.stats()
    assert (st.num_swapped_out_reqs, st.num_swap_fallbacks) == (int(apply_first), 0)
    s.check_invariants()
