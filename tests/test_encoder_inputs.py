"""Encoder inputs (multimodal): the encoder budget, the encoder cache and how they shape prefill chunks.

One test per vLLM 0.33 rule kvsched follows (``_try_schedule_encoder_inputs``, ``EncoderCacheManager``,
``_free_encoder_inputs``; named in each docstring) and per deliberate difference, each run on the Rust core and
on the pure-Python reference. docs/semantics.md, "Encoder inputs", is the contract.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import InvalidConfigError, InvalidRequestError, RequestStatus
from kvsched.reference import ReferenceScheduler

pytestmark = requires_rust

IMPLS = ["reference", "rust"]


def make(impl: str, **fields: Any) -> Any:
    from kvsched import Scheduler

    cls = ReferenceScheduler if impl == "reference" else Scheduler
    base: dict[str, Any] = {"block_size": 4, "num_blocks": 64, "max_model_len": 128}
    return cls(**{**base, **fields})


def chunks_done(s: Any, out: Any) -> list[list[int]]:
    """The sampled tokens for ``out``: none for a prefill chunk, one token otherwise."""
    res = []
    counts = zip(out.req_ids, out.num_computed_tokens.tolist(), out.num_scheduled_tokens.tolist(), strict=True)
    for rid, computed, n in counts:
        total = s._request_info(rid)[0] if hasattr(s, "_request_info") else s._requests[rid].num_prompt_tokens
        res.append([5] if computed + n >= total else [])
    return res


def step(s: Any) -> Any:
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(out, chunks_done(s, out))
    s.check_invariants()
    return out


def enc(out: Any) -> tuple[list[int], list[int]]:
    return out.scheduled_encoder_inputs.tolist(), out.scheduled_encoder_inputs_indptr.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_encoder_inputs_the_encoder_fields_are_empty(impl: str) -> None:
    """No encoder inputs: empty CSR values, an indptr of zeros, no freed hashes, encoder stats at 0."""
    s = make(impl)
    s.add_request("a", [1, 2, 3], arrival_time=0.0)
    s.add_request("b", [4, 5], arrival_time=1.0)
    out = step(s)
    assert enc(out) == ([], [0, 0, 0])
    assert out.free_encoder_hashes.tolist() == [] and str(out.free_encoder_hashes.dtype) == "uint64"
    st = s.stats()
    assert (st.encoder_cache_usage, st.num_encoder_inputs_computed, st.encoder_cache_hits) == (0.0, 0, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_is_cut_before_an_input_over_the_encoder_budget(impl: str) -> None:
    """vLLM _try_schedule_encoder_inputs: an input that does not fit the step's remaining encoder budget is not
    scheduled, and the prefill chunk stops just before it; the next step computes it."""
    s = make(impl, max_num_batched_tokens=16, max_num_encoder_input_tokens=8, encoder_cache_size=12)
    s.add_request("a", list(range(30)), max_tokens=2, encoder_inputs=[(2, 6, 11), (10, 6, 12)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10]  # 16 wanted; input 1 (10..16) needs 6 of the 2 left
    assert enc(out) == ([0], [0, 1])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [16]
    assert enc(out) == ([1], [0, 1])
    st = s.stats()
    assert (st.num_encoder_inputs_computed, st.num_encoder_tokens_computed) == (2, 12)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_starting_inside_an_unavailable_input_gets_nothing_and_admission_goes_on(impl: str) -> None:
    """vLLM 0.33: when the prefix cache puts the computed tokens inside an input whose encoder output is neither
    cached nor affordable, the request gets 0 tokens; in the waiting loop it is skipped (it keeps its place,
    counted as skipped) and later requests are still admitted (skip_request, not a stop of the pass)."""
    s = make(impl, max_num_batched_tokens=32, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    prompt = list(range(100, 116))
    s.add_request("p1", prompt, max_tokens=1, encoder_inputs=[(10, 6, 7)], arrival_time=0.0)
    step(s)  # p1 done: its 4 full blocks stay in the prefix cache, its encoder entry (7) is freeable
    s.add_request("hog", list(range(12)), max_tokens=3, encoder_inputs=[(0, 8, 99)], arrival_time=1.0)
    s.add_request("p2", prompt, max_tokens=1, encoder_inputs=[(10, 6, 7)], arrival_time=2.0)
    s.add_request("p3", [1, 2, 3], max_tokens=1, arrival_time=3.0)
    out = s.schedule()
    s.check_invariants()
    # hog computes its input, evicting 7 (budget and cache now full); p2 hits 12 prompt tokens (blocks hashed
    # with its encoder input, as p1's were), inside its input (10..16) whose output is gone: 0 tokens, skipped
    assert out.req_ids == ["hog", "p3"]
    assert enc(out) == ([0], [0, 1, 1])
    assert out.free_encoder_hashes.tolist() == [7]
    assert s.get_request_status("p2") == RequestStatus.WAITING
    assert s.stats().num_skipped_waiting_reqs == 1
    s.update_from_output(out, chunks_done(s, out))  # hog's input is consumed: its entry becomes freeable
    s.check_invariants()
    out = step(s)
    assert out.req_ids == ["hog", "p2"]
    assert enc(out) == ([0], [0, 0, 1])  # p2 computes its input again, evicting hog's freeable entry
    assert out.free_encoder_hashes.tolist() == [99]
    assert out.num_computed_tokens.tolist()[1] == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_block_hashes_include_the_encoder_inputs(impl: str) -> None:
    """vLLM's multimodal extra keys: a block overlapping an encoder input hashes its content hash and offset,
    so the same placeholder tokens with other encoder content never hit each other's KV; equal inputs do."""
    s = make(impl, max_num_batched_tokens=64, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    prompt = list(range(16))
    s.add_request("a", prompt, max_tokens=1, encoder_inputs=[(6, 4, 1)], arrival_time=0.0)
    s.add_request("b", prompt, max_tokens=1, encoder_inputs=[(6, 4, 2)], arrival_time=1.0)
    s.add_request("c", prompt, max_tokens=1, encoder_inputs=[(6, 4, 1)], arrival_time=2.0)
    s.add_request("d", prompt, max_tokens=1, arrival_time=3.0)
    ha, hb, hc, hd = (s.get_block_hashes(r) for r in "abcd")
    assert ha[0] == hb[0] == hd[0]  # block 0 (tokens 0..4) has no input
    assert ha[1] != hb[1] and ha[1] != hd[1] and ha[1:] == hc[1:]


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_hash_is_computed_once_and_referenced_by_both(impl: str) -> None:
    """vLLM EncoderCacheManager.check_and_update_cache: an input whose hash is cached (here: allocated by an
    earlier request of the same step) is not recomputed; the request only references the entry."""
    s = make(impl, max_num_batched_tokens=64, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    s.add_request("a", list(range(10)), max_tokens=2, encoder_inputs=[(0, 4, 42)], arrival_time=0.0)
    s.add_request("b", list(range(20, 30)), max_tokens=2, encoder_inputs=[(3, 4, 42)], arrival_time=1.0)
    out = step(s)
    assert out.req_ids == ["a", "b"]
    assert enc(out) == ([0], [0, 1, 1])
    st = s.stats()
    assert (st.num_encoder_inputs_computed, st.encoder_cache_hits, st.num_encoder_cache_entries) == (1, 1, 1)
    assert st.encoder_cache_usage == 0.5


@pytest.mark.parametrize("impl", IMPLS)
def test_freed_entries_stay_cached_until_space_is_needed_then_oldest_first(impl: str) -> None:
    """vLLM EncoderCacheManager: an entry no request needs is freeable, not freed: a later input with its hash
    still reuses it; it is evicted only when an allocation needs the space, oldest freeable first, and its hash
    is reported once in free_encoder_hashes."""
    s = make(impl, max_num_batched_tokens=64, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    s.add_request("a", list(range(6)), max_tokens=1, encoder_inputs=[(0, 4, 1)], arrival_time=0.0)
    s.add_request("b", list(range(6)), max_tokens=1, encoder_inputs=[(1, 4, 2)], arrival_time=1.0)
    out = step(s)  # both computed, both finish: entries 1 then 2 become freeable
    assert enc(out) == ([0, 0], [0, 1, 2])
    assert s.stats().encoder_cache_usage == 1.0
    s.add_request("c", list(range(6)), max_tokens=1, encoder_inputs=[(0, 4, 3)], arrival_time=2.0)
    out = step(s)
    assert enc(out) == ([0], [0, 1])
    assert out.free_encoder_hashes.tolist() == [1]  # the oldest freeable entry made room
    s.add_request("d", list(range(6)), max_tokens=1, encoder_inputs=[(0, 4, 2)], arrival_time=3.0)
    out = step(s)
    assert enc(out) == ([], [0, 0])  # 2 is still cached: reused, not recomputed
    assert out.free_encoder_hashes.tolist() == []
    assert s.stats().encoder_cache_hits == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_consumed_input_is_released_only_after_its_step_is_applied(impl: str) -> None:
    """vLLM _free_encoder_inputs (in update_from_output): a request keeps its reference until the step that
    consumed the input has run, so a step scheduled before that cannot evict it."""
    s = make(impl, max_num_batched_tokens=64, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    s.add_request("a", list(range(10)), max_tokens=4, encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    o1 = s.schedule()
    s.add_request("b", list(range(10)), max_tokens=4, encoder_inputs=[(0, 8, 2)], arrival_time=1.0)
    o2 = s.schedule()  # a's step is in flight: its entry is referenced, b's input does not fit
    s.check_invariants()
    assert o2.req_ids == [] and o2.free_encoder_hashes.tolist() == []
    s.update_from_output(o1, [[5]])
    s.update_from_output(o2, [])
    s.check_invariants()
    o3 = s.schedule()
    assert o3.req_ids == ["a", "b"] and enc(o3) == ([0], [0, 0, 1])
    assert o3.free_encoder_hashes.tolist() == [1]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("disable_chunked", [False, True])
def test_disable_chunked_mm_input_stops_before_a_partly_covered_input(impl: str, disable_chunked: bool) -> None:
    """vLLM disable_chunked_mm_input: a chunk that would cover only part of an input stops before it, even when
    the budget and the cache have room (without the flag the input is computed and the chunk ends inside it)."""
    s = make(
        impl,
        max_num_batched_tokens=10,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=8,
        disable_chunked_mm_input=disable_chunked,
    )
    s.add_request("a", list(range(20)), max_tokens=1, encoder_inputs=[(6, 8, 1)])
    out = step(s)
    if disable_chunked:
        assert out.num_scheduled_tokens.tolist() == [6] and enc(out) == ([], [0, 0])
        out = step(s)
        assert out.num_scheduled_tokens.tolist() == [10] and enc(out) == ([0], [0, 1])
    else:
        assert out.num_scheduled_tokens.tolist() == [10] and enc(out) == ([0], [0, 1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_drafter_lookahead_widens_the_encoder_window(impl: str, lookahead: int) -> None:
    """vLLM _try_schedule_encoder_inputs(shift_computed_tokens=num_prefill_lookahead): the drafter reads
    ``lookahead`` tokens past the chunk, so an input starting right after the chunk's end is computed with it."""
    s = make(
        impl,
        max_num_batched_tokens=10,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=16,
        prefill_lookahead_tokens=lookahead,
    )
    s.add_request("a", list(range(30)), max_tokens=1, encoder_inputs=[(10, 6, 1), (20, 4, 2)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10]
    assert enc(out) == (([0], [0, 1]) if lookahead else ([], [0, 0]))
    out = step(s)
    # [10, 20): input 0 is cached already with a lookahead; input 1 (at 20) is in the widened window
    assert enc(out) == (([1], [0, 1]) if lookahead else ([0], [0, 1]))
    assert s.stats().encoder_cache_hits == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("exact", [True, False])
def test_encoder_budget_cut_with_the_drafter_lookahead(impl: str, exact: bool) -> None:
    """vLLM 0.33 (exact_encoder_cut_and_release): an input in the widened window that does not fit the budget
    cuts the chunk just before the input itself: the chunk keeps its length here, the input waits. vLLM 0.32
    (False): the cut leaves the lookahead before the input too."""
    s = make(impl, max_num_batched_tokens=10, max_num_encoder_input_tokens=4, encoder_cache_size=16,
             prefill_lookahead_tokens=2, exact_encoder_cut_and_release=exact)  # fmt: skip
    s.add_request("a", list(range(30)), max_tokens=1, encoder_inputs=[(6, 4, 1), (11, 4, 2)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10 if exact else 9] and enc(out) == ([0], [0, 1])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10] and enc(out) == ([1], [0, 1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("exact", [True, False])
def test_consumed_input_release_with_the_drafter_lookahead(impl: str, exact: bool) -> None:
    """vLLM 0.33 (exact_encoder_cut_and_release): a request drops its reference to an input once its computed
    tokens reach the input's end; vLLM 0.32 (False) once they are the drafter's prefill lookahead past it."""
    s = make(impl, max_num_batched_tokens=10, max_num_encoder_input_tokens=8, encoder_cache_size=16,
             prefill_lookahead_tokens=3, exact_encoder_cut_and_release=exact)  # fmt: skip
    s.add_request("a", list(range(30)), max_tokens=1, encoder_inputs=[(0, 8, 1)])
    step(s)  # computes [0, 10): the input ends at 8
    assert s.encoder_cache_entries() == {1: [] if exact else ["a"]}
    step(s)
    assert s.encoder_cache_entries() == {1: []}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_disable_chunked_mm_input_stops_the_lookahead_before_the_input(impl: str, lookahead: int) -> None:
    """vLLM disable_chunked_mm_input with a drafter: a chunk that would cover only part of an input stops
    ``lookahead`` tokens before it (the drafter's read-ahead must not reach it); a request whose input a chunk
    could then never cover whole is refused at add_request."""
    fields = {"max_num_batched_tokens": 10, "max_num_encoder_input_tokens": 8, "encoder_cache_size": 8}
    s = make(impl, disable_chunked_mm_input=True, prefill_lookahead_tokens=lookahead, **fields)
    s.add_request("a", list(range(20)), max_tokens=1, encoder_inputs=[(6, 8, 1)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [6 - lookahead] and enc(out) == ([], [0, 0])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10] and enc(out) == ([0], [0, 1])
    # 8 tokens and the lookahead before them need more than a chunk of 10 when the lookahead is 3
    s = make(impl, disable_chunked_mm_input=True, prefill_lookahead_tokens=3, **fields)
    with pytest.raises(InvalidRequestError, match="encoder input 0"):
        s.add_request("b", list(range(20)), max_tokens=1, encoder_inputs=[(6, 8, 1)])
    s.add_request("c", list(range(20)), max_tokens=1, encoder_inputs=[(2, 8, 1)])  # 2 tokens before it: fits
    assert s.get_request_status("c") == RequestStatus.WAITING


@pytest.mark.parametrize("impl", IMPLS)
def test_multi_module_mtp_cuts_after_the_encoder_inputs(impl: str) -> None:
    """vLLM schedules the encoder inputs before _reserve_prefill_lookahead: with disable_chunked_mm_input, the
    chunk [0, 19) covers the input at 10..19 whole, so it is computed; only then the MTP lookahead of 3 shortens
    the chunk to 17 (cutting first would have stopped it before the input)."""
    s = make(impl, max_num_batched_tokens=19, max_num_encoder_input_tokens=9, encoder_cache_size=9,
             disable_chunked_mm_input=True, prefill_lookahead_tokens=3)  # fmt: skip
    s.add_request("a", list(range(20)), max_tokens=1, encoder_inputs=[(10, 9, 1)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [17] and enc(out) == ([0], [0, 1])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [3] and enc(out) == ([], [0, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_preemption_releases_the_victims_entries(impl: str) -> None:
    """vLLM _preempt_request: a preempted request drops its encoder-cache references (its entries become
    freeable, still cached), and computes its inputs again when resumed unless they are still cached."""
    s = make(
        impl,
        num_blocks=9,  # 8 usable blocks of 4
        max_num_batched_tokens=64,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=16,
        scheduler_reserve_full_isl=False,
    )
    s.add_request("a", list(range(12)), max_tokens=20, encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    s.add_request("b", list(range(40, 52)), max_tokens=20, encoder_inputs=[(0, 8, 2)], arrival_time=1.0)
    out = s.schedule()
    assert enc(out) == ([0], [0, 1])  # b's input does not fit the budget: b is cut to 0 and skipped
    s.update_from_output(out, chunks_done(s, out))
    for _ in range(30):
        out = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids  # KV ran out: the tail of running was preempted
    victim = out.preempted_req_ids[0]
    assert s.get_request_status(victim) == RequestStatus.PREEMPTED
    st = s.stats()
    assert st.num_encoder_cache_entries == 2  # both entries still cached (the victim's is freeable)
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_victim_preempted_in_its_own_step_hands_its_encoder_work_to_the_sharer(impl: str) -> None:
    """Deliberate difference from vLLM. PRIORITY: v (low priority, earlier in running) computes input hash 7 in
    this step and r hits that entry; r's KV allocation then preempts v. vLLM refunds v's encoder budget but
    leaves the entry cached with nobody computing it (r would find no encoder output at the runner). kvsched
    refunds the budget and hands the computation to r: r's entry in scheduled_encoder_inputs lists the input."""
    s = make(
        impl,
        num_blocks=24,  # 23 usable blocks of 4 tokens
        max_model_len=96,
        max_num_batched_tokens=40,
        long_prefill_token_threshold=20,
        policy="priority",
        scheduler_reserve_full_isl=False,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=8,
    )
    s.add_request("v", list(range(80)), max_tokens=1, priority=5, encoder_inputs=[(40, 8, 7)], arrival_time=0.0)
    # d is blocked (its grammar): it keeps the per-request cap active
    s.add_request("d", [1, 2, 3], max_tokens=1, ready=False, arrival_time=0.5)
    out = step(s)
    assert (out.req_ids, out.num_scheduled_tokens.tolist()) == (["v"], [20])
    s.add_request("r", list(range(200, 240)), max_tokens=1, priority=0, encoder_inputs=[(20, 8, 7)], arrival_time=1.0)
    out = step(s)
    assert (out.req_ids, out.num_scheduled_tokens.tolist()) == (["v", "r"], [20, 20])
    out = s.schedule()
    s.check_invariants()
    assert out.preempted_req_ids == ["v"]
    assert (out.req_ids, out.num_scheduled_tokens.tolist()) == (["r"], [20])
    assert enc(out) == ([0], [0, 1])  # r computes the input v was to compute
    s.update_from_output(out, chunks_done(s, out))
    s.check_invariants()
    assert s.stats().num_encoder_inputs_computed == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_failed_step_drops_the_entries_it_was_to_compute(impl: str) -> None:
    """fail_step: the encoder outputs of a step the runner could not execute may not exist, so their entries
    leave the cache (reported in the next free_encoder_hashes) and a later input with the hash is computed."""
    s = make(impl, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    s.add_request("a", list(range(10)), max_tokens=2, encoder_inputs=[(0, 4, 1)])
    out = s.schedule()
    assert s.fail_step(out) == ["a"]
    s.check_invariants()
    assert s.stats().num_encoder_cache_entries == 0
    empty = s.schedule()
    assert empty.free_encoder_hashes.tolist() == [1]
    s.update_from_output(empty, [])
    s.add_request("b", list(range(10)), max_tokens=2, encoder_inputs=[(0, 4, 1)])
    out = step(s)
    assert enc(out) == ([0], [0, 1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_look_ahead_hashes_key_the_inputs_of_the_look_ahead_tokens(impl: str, lookahead: int) -> None:
    """vLLM's look-ahead extra keys: with hash_lookahead_tokens L, a block's hash covers the encoder inputs that
    overlap the block or the L tokens after it, so an input starting right after block 0 changes block 0's hash
    (and one starting L tokens after it does not)."""
    s = make(impl, max_num_encoder_input_tokens=8, encoder_cache_size=16, hash_lookahead_tokens=lookahead)
    prompt = list(range(1, 14))
    s.add_request("plain", prompt, max_tokens=1)
    s.add_request("next", prompt, max_tokens=1, encoder_inputs=[(4, 2, 7)])  # starts right after block 0
    s.add_request("later", prompt, max_tokens=1, encoder_inputs=[(4 + lookahead, 2, 7)])
    plain, after, later = (list(s.get_block_hashes(r)) for r in ("plain", "next", "later"))
    assert (after[0] != plain[0]) == (lookahead > 0)
    assert later[0] == plain[0] and later[1] != plain[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_set_prefill_lookahead_widens_the_window_from_the_next_step_while_no_request_is_live(impl: str) -> None:
    """vLLM's tests set num_prefill_lookahead on a built scheduler: the chunk rules and the encoder window follow
    it; it can change only while the scheduler holds no request (else nothing changes)."""
    s = make(impl, max_num_batched_tokens=10, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    s.set_prefill_lookahead(1)
    assert s.config.prefill_lookahead_tokens == 1
    s.add_request("a", list(range(30)), max_tokens=1, encoder_inputs=[(10, 6, 1), (20, 4, 2)])
    out = step(s)
    assert out.num_scheduled_tokens.tolist() == [10] and enc(out) == ([0], [0, 1])  # as if built with it
    with pytest.raises(InvalidConfigError, match="no request is live"):
        s.set_prefill_lookahead(0)
    assert s.config.prefill_lookahead_tokens == 1
    s.check_invariants()
