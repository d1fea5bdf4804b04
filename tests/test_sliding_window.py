"""Sliding-window attention (``sliding_window``): the behaviour of docs/semantics.md's "Sliding-window attention",
on the Rust core and on the reference. Block size 4 and small pools keep every table traceable by hand."""

from __future__ import annotations

from typing import Any

import pytest
from kvsched import InvalidConfigError, Scheduler, SchedulerConfig
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


def table(s: Any, rid: str) -> list[int]:
    return [int(b) for b in s.get_block_ids(rid)]


def new_blocks(out: Any, rid: str) -> list[int]:
    k = list(out.req_ids).index(rid)
    p = out.new_block_ids_indptr
    return [int(b) for b in out.new_block_ids[p[k] : p[k + 1]]]


@pytest.mark.parametrize("impl", IMPLS)
def test_blocks_outside_the_window_become_null_blocks_at_the_next_allocation(impl: str) -> None:
    s = make(impl, sliding_window=4)
    s.add_request("a", list(range(10)), max_tokens=8)
    out = s.schedule()
    assert table(s, "a") == [1, 2, 3]
    free = s.num_free_blocks
    s.update_from_output(out, [[7]])
    # Decode after 10 computed tokens: the window of token 10 is 7..10; block 0 (tokens 0..3) is outside.
    out = s.schedule()
    assert table(s, "a") == [0, 2, 3]
    assert s.num_free_blocks == free + 1
    s.update_from_output(out, [[7]])
    s.check_invariants()
    out = s.schedule()  # 11 computed: the window is 8..11, block 1 (tokens 4..7) goes too
    assert table(s, "a") == [0, 0, 3]
    s.update_from_output(out, [[7]])
    out = s.schedule()  # 12 computed: token 12 needs a new block, appended after the nulls
    assert table(s, "a") == [0, 0, 3, 4]
    assert new_blocks(out, "a") == [4]
    s.update_from_output(out, [[7]])
    s.check_invariants()
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, [[7]] * len(out.req_ids))
        s.check_invariants()
    assert s.num_free_blocks == 32


@pytest.mark.parametrize("impl", IMPLS)
def test_async_scheduling_keeps_the_blocks_a_step_in_flight_still_reads(impl: str) -> None:
    s = make(impl, sliding_window=4, async_scheduling=True)
    s.add_request("a", list(range(10)), max_tokens=8)
    out0 = s.schedule()
    free = s.num_free_blocks
    out1 = s.schedule()  # the decode, scheduled before the prefill's output arrives
    assert table(s, "a") == [1, 2, 3]
    assert s.num_free_blocks == free
    s.update_from_output(out0, [[7]])
    s.schedule()  # the prefill is applied: 10 tokens processed, block 0 leaves the window
    assert table(s, "a") == [0, 2, 3]
    assert s.num_free_blocks == free + 1
    s.update_from_output(out1, [[7]])
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_prefix_hit_takes_only_the_blocks_that_cover_the_window(impl: str) -> None:
    s = make(impl, sliding_window=6)
    shared = list(range(100, 116))  # 4 full blocks
    s.add_request("a", [*shared, 1], max_tokens=1)
    out = s.schedule()
    a_blocks = table(s, "a")
    s.update_from_output(out, [[7]])  # a finishes; its 4 full blocks stay cached
    b_prompt = [*shared, 200, 201, 202, 203, 204]
    # The window of token 16 (tokens 11..16) needs blocks 2 and 3: the hit is 4 blocks, the first 2 of them null.
    assert s.get_num_cached_tokens(b_prompt) == 16
    s.add_request("b", b_prompt, max_tokens=1)
    out = s.schedule()
    assert table(s, "b")[:4] == [0, 0, a_blocks[2], a_blocks[3]]
    assert new_blocks(out, "b") == table(s, "b")  # a new request's whole table, null blocks included
    assert out.num_computed_tokens[list(out.req_ids).index("b")] == 16
    assert s.get_block_ref_cnt(a_blocks[0]) == 0 and s.get_block_ref_cnt(a_blocks[2]) == 1
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_window_of_one_token_caches_nothing(impl: str) -> None:
    s = make(impl, sliding_window=1)
    s.add_request("a", list(range(17)), max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, [[7]])
    assert s.get_num_cached_tokens(list(range(17))) == 0
    s.check_invariants()


# Sparse retention (prefix_cache_retention_interval, vLLM 0.33's engine default 0): a window's blocks enter the
# prefix cache only where a later request can hit. A window of 6 tokens needs the 2 blocks before a hit's end.
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("retention", "kept", "sibling_hit"),
    [(None, [0, 1, 2, 3, 4, 5], 16), (0, [4, 5], 0), (8, [0, 1, 2, 3, 4, 5], 16), (12, [1, 2, 4, 5], 12)],
)
def test_sparse_retention_caches_only_the_blocks_a_hit_can_use(
    impl: str, retention: int | None, kept: list[int], sibling_hit: int
) -> None:
    s = make(impl, sliding_window=6, prefix_cache_retention_interval=retention)
    prompt = list(range(100, 125))  # 6 full blocks and a token
    s.add_request("a", prompt, max_tokens=1)
    out = s.schedule()
    blocks = table(s, "a")
    s.update_from_output(out, [[7]])
    # 0: only the run before the resend's hit (24 tokens): blocks 4 and 5. 12 (segments of 3 blocks): also the
    # last 2 blocks of each segment. 8 (segments of 2 blocks, the run a hit needs): every block.
    assert [i for i in range(6) if s.get_block_hash(blocks[i]) is not None] == kept
    assert s.get_num_cached_tokens(prompt) == 24  # a resend of the same prompt still hits
    assert s.get_num_cached_tokens([*prompt[:16], 1, 2, 3, 4, 5]) == sibling_hit
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("retention", "kept"), [(None, [0, 1, 2, 3, 4, 5]), (0, [3, 4, 5]), (16, [2, 3, 4, 5])])
def test_sparse_retention_with_the_trailing_block_drop_keeps_one_block_more(
    impl: str, retention: int | None, kept: list[int]
) -> None:
    # EAGLE's drop: a hit's run is one block longer and ends one block past the hit. The 25-token prompt's resend
    # and longer siblings both hit 20 tokens: blocks 3 to 5. With segments of 4 blocks: also blocks 2 to 4.
    s = make(impl, sliding_window=6, drop_trailing_hit_block=True, prefix_cache_retention_interval=retention)
    prompt = list(range(100, 125))
    s.add_request("a", prompt, max_tokens=1)
    out = s.schedule()
    blocks = table(s, "a")
    s.update_from_output(out, [[7]])
    assert [i for i in range(6) if s.get_block_hash(blocks[i]) is not None] == kept
    assert s.get_num_cached_tokens(prompt) == 20
    s.check_invariants()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be"),
        ({"sliding_window": 8, "dcp_world_size": 2}, "needs dcp_world_size == 1"),
        ({"sliding_window": 8, "preemption_mode": "swap", "num_cpu_blocks": 4}, "needs preemption_mode"),
    ],
)
def test_combinations_a_window_does_not_support_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        SchedulerConfig(**fields)
