"""The prefix-cache rules of EAGLE-style drafters (docs/semantics.md, "Look-ahead hashes and the trailing-block
drop"): ``hash_lookahead_tokens`` (a block's hash also covers the tokens after it and waits for them) and
``drop_trailing_hit_block`` (the longest hit gives up its last block), on the Rust core and on the reference.
Block size 4 keeps every hit countable by hand."""

from __future__ import annotations

from typing import Any

import pytest
from kvsched import InvalidConfigError, InvalidRequestError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **fields: Any) -> Any:
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 33,
        "max_model_len": 64,
        "max_num_batched_tokens": 64,
        "prefix_hash_seed": 0,
    }
    cfg.update(fields)
    config = SchedulerConfig(**cfg)
    return Scheduler(config) if impl == "rust" else ReferenceScheduler(config)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def run_all(s: Any, tok: int = 7) -> None:
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, [[tok]] * len(out.req_ids))
        s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_block_is_cached_only_once_the_token_after_it_exists(impl: str) -> None:
    # Without look-ahead the prefill of 8 tokens caches both of its blocks; with one look-ahead token block 1
    # has no hash until token 8 exists, and the request finishes (one output token) before it allocates again.
    plain = make(impl)
    plain.add_request("a", prompt(0, 8), max_tokens=1)
    run_all(plain)
    assert plain.get_num_cached_tokens([*prompt(0, 8), 7, 9]) == 8
    s = make(impl, hash_lookahead_tokens=1)
    s.add_request("a", prompt(0, 8), max_tokens=1)
    out = s.schedule()
    assert s.get_num_cached_blocks("a") == 1
    s.update_from_output(out, [[7]])
    s.check_invariants()
    assert s.get_num_cached_tokens([*prompt(0, 8), 7, 9]) == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_a_hit_on_a_block_needs_the_tokens_after_it_to_match(impl: str) -> None:
    s = make(impl, hash_lookahead_tokens=1)
    s.add_request("a", prompt(0, 8), max_tokens=3)
    out = s.schedule()
    s.update_from_output(out, [[7]])  # token 8 exists: block 1 has its hash, cached at the next allocation
    assert s.get_num_cached_blocks("a") == 1
    out = s.schedule()
    assert s.get_num_cached_blocks("a") == 2
    s.update_from_output(out, [[7]])
    run_all(s)
    assert s.get_num_cached_tokens([*prompt(0, 8), 7, 100]) == 8
    assert s.get_num_cached_tokens([*prompt(0, 8), 100, 7]) == 4  # block 1 was cached with token 7 after it
    assert [int(b) for b in s.get_cached_block_ids([*prompt(0, 8), 100, 7])] == [1]
    s.add_request("b", [*prompt(0, 8), 100, 7], max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [4]
    assert out.num_scheduled_tokens.tolist() == [6]


@pytest.mark.parametrize("impl", IMPLS)
def test_two_lookahead_tokens_need_two_tokens_after_the_block(impl: str) -> None:
    s = make(impl, hash_lookahead_tokens=2)
    s.add_request("a", prompt(0, 9), max_tokens=1)  # block 1 needs tokens 8 and 9: only block 0 is cached
    run_all(s)
    assert s.get_num_cached_tokens([*prompt(0, 10), 1]) == 4
    s.add_request("b", prompt(0, 10), max_tokens=2)  # block 1 is hashed and cached at the prefill
    run_all(s)
    assert s.get_num_cached_tokens([*prompt(0, 10), 1]) == 8
    assert s.get_num_cached_tokens([*prompt(0, 9), 1, 1]) == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_the_longest_hit_drops_its_last_block(impl: str) -> None:
    s = make(impl, drop_trailing_hit_block=True)
    s.add_request("a", prompt(0, 12), max_tokens=1)
    run_all(s)
    assert s.get_num_cached_tokens([*prompt(0, 12), 5]) == 8  # 3 blocks found, 2 kept
    assert s.get_num_cached_tokens([*prompt(0, 8), 900]) == 4
    assert s.get_num_cached_tokens([*prompt(0, 4), 900]) == 0  # one block found: none kept
    s.add_request("b", [*prompt(0, 8), 900, 901, 902], max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [4]
    assert out.num_scheduled_tokens.tolist() == [7]
    s.update_from_output(out, [[7]])
    s.check_invariants()
    assert s.stats().prefix_cache_hits == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_the_drop_holds_for_the_cache_aware_admission_probe(impl: str) -> None:
    # A waiting request whose only hit is one block counts as cold with the drop: the warm one goes first.
    s = make(
        impl,
        drop_trailing_hit_block=True,
        cache_aware_admission_window=4,
        cache_aware_admission_threshold=0.0,
        max_num_seqs=1,
    )
    s.add_request("seed", prompt(0, 12), max_tokens=1)
    run_all(s)
    s.add_request("one", [*prompt(0, 4), 500, 501], max_tokens=1)
    s.add_request("two", [*prompt(0, 8), 500, 501], max_tokens=1)
    out = s.schedule()
    assert list(out.req_ids) == ["two"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drop", [False, True])
def test_a_window_hit_needs_one_block_more_then_drops_it(impl: str, drop: bool) -> None:
    # A window of 5 tokens needs one block before the hit's end; with the drop two, and the hit then gives up
    # its last one (vLLM's SlidingWindowManager with EAGLE).
    s = make(impl, sliding_window=5, drop_trailing_hit_block=drop)
    s.add_request("a", prompt(0, 16), max_tokens=1)
    run_all(s)
    assert s.get_num_cached_tokens([*prompt(0, 16), 5]) == (12 if drop else 16)
    assert s.get_num_cached_tokens([*prompt(0, 8), 900]) == (4 if drop else 8)
    assert s.get_num_cached_tokens([*prompt(0, 4), 900]) == (0 if drop else 4)  # a run from block 0 drops too
    s.add_request("b", [*prompt(0, 16), 5], max_tokens=1)
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [12 if drop else 16]
    s.update_from_output(out, [[7]])
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drop", [False, True])
def test_groups_look_one_block_further_and_drop_it(impl: str, drop: bool) -> None:
    # With several groups every set looks one block past the candidate before dropping (vLLM's hybrid
    # coordinator): a resent block-aligned prompt of 16 tokens keeps 3 blocks, where one group keeps 2.
    s = make(impl, kv_cache_groups=(None, 5), drop_trailing_hit_block=drop)
    s.add_request("a", prompt(0, 16), max_tokens=1)
    run_all(s)
    assert s.get_num_cached_tokens(prompt(0, 16)) == 12
    assert s.get_num_cached_tokens([*prompt(0, 8), 900]) == (4 if drop else 8)
    one = make(impl, drop_trailing_hit_block=True)
    one.add_request("a", prompt(0, 16), max_tokens=1)
    run_all(one)
    assert one.get_num_cached_tokens(prompt(0, 16)) == 8


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drop", [False, True])
def test_the_window_group_with_the_drop_can_cut_the_hit_further(impl: str, drop: bool) -> None:
    # Group 0 (a window of 4 tokens) loses its cached blocks 3..5 to evictions, the full group keeps all six.
    # Without the drop the window's run is block 2 alone (12 tokens); with it the run is blocks 1 and 2, which
    # then gives up block 2: 8 tokens, though full attention still holds 5 blocks after its own drop.
    s = make(impl, kv_cache_groups=(4, None), num_blocks=24, drop_trailing_hit_block=drop)
    s.add_request("a", list(range(24)), max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, [[5]])
    s.add_request("x", list(range(1000, 1025)), max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, [[5]])
    s.add_request("b", list(range(24)), max_tokens=1)
    out = s.schedule()
    k = list(out.req_ids).index("b")
    assert int(out.num_computed_tokens[k]) == (8 if drop else 12)
    s.update_from_output(out, [[5]] * len(out.req_ids))
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("drop", [False, True])
def test_the_drop_moves_align_mamba_chunk_ends_one_block_lower(impl: str, drop: bool) -> None:
    # A 14-token prompt: its Mamba state is cached at the last block boundary a later hit can resume at, 12
    # without the drop; with it the attention hit gives up a block, so the chunk ends (and the state is cached)
    # at 8, where a longer prompt's hit then lands.
    s = make(impl, kv_cache_groups=["mamba", None], mamba_align=True, drop_trailing_hit_block=drop, num_blocks=64)
    s.add_request("a", prompt(0, 14), max_tokens=1)
    chunks = []
    while s.has_unfinished_requests():
        out = s.schedule()
        chunks.append(int(out.num_scheduled_tokens[0]))
        s.update_from_output(out, [[7] if sum(chunks) >= 14 else []])
        s.check_invariants()
    assert chunks == ([8, 6] if drop else [12, 2])
    s.add_request("b", prompt(0, 18), max_tokens=1)
    out = s.schedule()
    assert int(out.num_computed_tokens[0]) == (8 if drop else 12)
    s.update_from_output(out, [[7]])
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_settings_are_refused(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="drop_trailing_hit_block cannot be combined with a chunked-local"):
        make(impl, drop_trailing_hit_block=True, kv_cache_groups=[None, "chunked:8"])
    with pytest.raises(InvalidConfigError, match="hash_lookahead_tokens"):
        make(impl, hash_lookahead_tokens=-1)
    s = make(impl, hash_lookahead_tokens=1)
    with pytest.raises(InvalidRequestError, match="resumable request cannot have hash_lookahead_tokens > 0"):
        s.add_request("a", prompt(0, 8), max_tokens=1, resumable=True)
    assert not s.has_unfinished_requests()


# A multi-module MTP drafter's prefill lookahead (`prefill_lookahead_tokens`, docs/semantics.md "Prefill lookahead"):
# an admission whose chunk the lookahead cuts to nothing is skipped and keeps its place (vLLM 0.33), or ends the
# admission pass (`skip_lookahead_cut_admissions=False`, vLLM 0.32).
MTP = {"max_num_batched_tokens": 18, "num_lookahead_tokens": 3, "prefill_lookahead_tokens": 3}


def scheduled(out: Any) -> dict[str, int]:
    return dict(zip(out.req_ids, out.num_scheduled_tokens, strict=True))


def add_three(s: Any) -> None:
    # "a" takes 17 of the 18 tokens; "b" (3 tokens) would leave 2 of them, fewer than the lookahead: cut to 0;
    # "c" (1 token) reaches its end with the token left.
    s.add_request("a", list(range(10, 27)), max_tokens=4)
    s.add_request("b", [5, 6, 7], max_tokens=4)
    s.add_request("c", [8], max_tokens=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_admission_cut_to_nothing_is_skipped_and_keeps_its_place(impl: str) -> None:
    s = make(impl, **MTP)
    add_three(s)
    out = s.schedule()
    assert scheduled(out) == {"a": 17, "c": 1}
    assert s.stats().num_skipped_waiting_reqs == 1
    s.update_from_output(out, [[1], [2]])
    out = s.schedule()
    assert scheduled(out)["b"] == 3
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_skip_lookahead_cut_admissions_an_admission_cut_to_nothing_ends_the_pass(impl: str) -> None:
    s = make(impl, **MTP, skip_lookahead_cut_admissions=False)
    add_three(s)
    out = s.schedule()
    assert scheduled(out) == {"a": 17}
    assert s.stats().num_skipped_waiting_reqs == 0
    s.update_from_output(out, [[1]])
    out = s.schedule()
    assert scheduled(out)["b"] == 3 and "c" in scheduled(out)  # ("c" a decode padded with the drafts' slots)
    s.check_invariants()
