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
def test_bad_settings_are_refused(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="drop_trailing_hit_block needs full attention"):
        make(impl, drop_trailing_hit_block=True, sliding_window=8)
    with pytest.raises(InvalidConfigError, match="drop_trailing_hit_block needs full attention"):
        make(impl, drop_trailing_hit_block=True, kv_cache_groups=[None, 8])
    with pytest.raises(InvalidConfigError, match="hash_lookahead_tokens"):
        make(impl, hash_lookahead_tokens=-1)
    s = make(impl, hash_lookahead_tokens=1)
    with pytest.raises(InvalidRequestError, match="resumable request cannot have hash_lookahead_tokens > 0"):
        s.add_request("a", prompt(0, 8), max_tokens=1, resumable=True)
    assert not s.has_unfinished_requests()
