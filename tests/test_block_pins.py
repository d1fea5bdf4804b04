"""Block pins (``pin_blocks`` / ``unpin_blocks``) and the block-hash reads (``get_block_hash``,
``get_cached_block_id``), the same in both implementations: vLLM's ``BlockPool.touch`` / ``free_blocks`` by block
id, with the free order vLLM's leaves, and bad calls refused with the scheduler unchanged. The random
interleaving with steps is in test_differential.py (``test_soak_block_pins_match_reference_step_by_step``)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import InvalidRequestError, SchedulerConfig, SchedulerTypeError
from kvsched.reference import ReferenceScheduler


def _impls() -> list[Any]:
    return [pytest.param(ReferenceScheduler, id="reference"), pytest.param("rust", id="rust", marks=requires_rust)]


def _make(impl: Any, **fields: Any) -> Any:
    config = SchedulerConfig(**{"block_size": 4, "num_blocks": 16, "max_model_len": 200, **fields})
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(config)
    return impl(config)


def _run(s: Any, req_id: str, prompt: list[int], max_tokens: int = 1) -> list[int]:
    """Adds a request and runs it to its end; returns its blocks."""
    s.add_request(req_id, prompt, max_tokens=max_tokens)
    blocks: list[int] = []
    while s.has_request(req_id):
        out = s.schedule()
        if s.has_request(req_id):
            blocks = s.get_block_ids(req_id).tolist()
        s.update_from_output(out, [[7]] * out.num_reqs)
    return blocks


def _free_order(s: Any) -> list[int]:
    """The free queue, head first (``free_block_ids``), checked against the blocks the next allocation takes
    (runs one request over every free block, which evicts what they cached)."""
    order: list[int] = s.free_block_ids().tolist()
    n = s.num_free_blocks
    assert len(order) == n
    s.add_request("probe", list(range(1000, 1000 + 4 * n - 1)), max_tokens=1)
    out = s.schedule()
    assert s.get_block_ids("probe").tolist() == order
    s.update_from_output(out, [[7]] * out.num_reqs)
    return order


def _pool_state(s: Any) -> tuple[int, list[int], list[int]]:
    blocks = range(s.config.num_blocks)
    return s.num_free_blocks, [s.get_block_ref_cnt(b) for b in blocks], [s.get_block_pin_cnt(b) for b in blocks]


@pytest.mark.parametrize("impl", _impls())
def test_pins_keep_blocks_out_of_the_free_queue_and_unpins_put_them_where_free_blocks_does(impl: Any) -> None:
    s = _make(impl, enable_prefix_caching=True)
    a = _run(s, "a", list(range(9)))  # 3 blocks: 2 cached, 1 partial (not cached)
    hashed, tail = a[:2], a[2]
    assert [s.get_block_hash(b) is not None for b in a] == [True, True, False]
    assert s.get_cached_block_id(s.get_block_hash(a[0])) == a[0]
    free = s.num_free_blocks
    s.pin_blocks([hashed[0], hashed[0], tail])
    assert (s.get_block_ref_cnt(hashed[0]), s.get_block_pin_cnt(hashed[0]), s.get_block_pin_cnt(tail)) == (2, 2, 1)
    assert s.num_free_blocks == free - 2
    assert s.get_cached_block_id(s.get_block_hash(a[0])) == a[0]  # a pinned block stays cached
    s.check_invariants()
    s.unpin_blocks([hashed[0]])
    assert s.num_free_blocks == free - 2
    # vLLM's free_blocks: the unhashed block to the head, the hashed one to the tail.
    s.unpin_blocks([tail, hashed[0]])
    assert s.num_free_blocks == free
    s.check_invariants()
    order = _free_order(s)
    assert order[0] == tail
    assert order[-1] == hashed[0]


@pytest.mark.parametrize("impl", _impls())
def test_a_pin_outlives_its_request_and_blocks_eviction(impl: Any) -> None:
    s = _make(impl)
    s.add_request("a", list(range(13)), max_tokens=2)
    s.update_from_output(out := s.schedule(), [[7]] * out.num_reqs)
    a = s.get_block_ids("a").tolist()
    s.pin_blocks(a[:3])
    s.update_from_output(out := s.schedule(), [[7]] * out.num_reqs)
    assert not s.has_request("a")
    assert [s.get_block_ref_cnt(b) for b in a[:3]] == [1, 1, 1]
    # Pinned cached blocks survive an allocation of every free block.
    s.pin_blocks([a[0]])
    _run(s, "big", list(range(500, 500 + 4 * s.num_free_blocks - 1)))
    assert all(s.get_block_hash(b) is not None for b in a[:3])
    assert not s.reset_prefix_cache()  # a pin keeps a block in use
    s.unpin_blocks([a[0]])
    # Given back in the order given: hashed blocks to the tail in that order.
    s.unpin_blocks([a[2], a[0], a[1]])
    assert _free_order(s)[-3:] == [a[2], a[0], a[1]]
    assert s.reset_prefix_cache()
    assert s.get_block_hash(a[0]) is None
    s.check_invariants()


@pytest.mark.parametrize("impl", _impls())
def test_bad_pins_and_unpins_are_refused_and_change_nothing(impl: Any) -> None:
    s = _make(impl)
    a = _run(s, "a", list(range(9)), max_tokens=1)
    s.pin_blocks([a[0]])
    before = _pool_state(s)
    refused: list[tuple[str, Any, type[Exception], str]] = [
        ("pin", [a[1], 0], InvalidRequestError, "block 0 is the null block: it cannot be pinned"),
        ("pin", [a[1], 16], InvalidRequestError, "block id 16 is outside the KV cache pool (block ids 0..16)"),
        ("pin", [-1], InvalidRequestError, "block id -1 is outside the KV cache pool"),
        ("pin", [True], SchedulerTypeError, "block_ids must hold ints, got bool"),
        ("pin", 3, SchedulerTypeError, "block_ids must be an iterable of int, got int"),
        ("unpin", [a[0], a[1]], InvalidRequestError, f"block {a[1]} is not pinned"),
        ("unpin", [a[0], a[0]], InvalidRequestError, f"block {a[0]} is unpinned 2 times but pinned only 1 times"),
        ("unpin", [0], InvalidRequestError, "block 0 is the null block: it cannot be unpinned"),
    ]
    for op, arg, cls, msg in refused:
        fn = s.pin_blocks if op == "pin" else s.unpin_blocks
        with pytest.raises(cls) as info:
            fn(arg)
        assert str(info.value) == msg
    assert _pool_state(s) == before
    with pytest.raises(InvalidRequestError, match="outside the KV cache pool"):
        s.get_block_hash(16)
    with pytest.raises(InvalidRequestError, match="outside the KV cache pool"):
        s.get_block_pin_cnt(16)
    assert s.get_block_hash(0) is None and s.get_block_pin_cnt(0) == 0
    with pytest.raises(SchedulerTypeError, match="block_hash must be bytes"):
        s.get_cached_block_id("x")
    with pytest.raises(InvalidRequestError, match="must be 16 bytes"):
        s.get_cached_block_id(b"x")
    assert s.get_cached_block_id(bytes(16)) is None
    s.check_invariants()


@pytest.mark.parametrize("impl", _impls())
def test_without_prefix_caching_nothing_is_cached_and_unpins_go_to_the_head(impl: Any) -> None:
    s = _make(impl, enable_prefix_caching=False)
    a = _run(s, "a", list(range(9)), max_tokens=1)
    assert all(s.get_block_hash(b) is None for b in a)
    s.pin_blocks(a)
    s.unpin_blocks([a[1], a[0], a[2]])
    assert _free_order(s)[:3] == [a[1], a[0], a[2]]


@pytest.mark.parametrize("impl", _impls())
def test_with_several_groups_a_cached_block_names_its_group_and_request_hash(impl: Any) -> None:
    """With several KV cache groups a block is cached under its group's key of a request block hash:
    ``get_block_hash_group`` names the hash and the group, ``get_cached_block_id(hash, group)`` finds the block
    again, and a group the config lacks is refused."""
    s = _make(impl, num_blocks=32, kv_cache_groups=(None, 3))
    s.add_request("a", list(range(13)), max_tokens=3)
    out = s.schedule()
    s.update_from_output(out, [[7]])
    groups = [s.get_block_ids("a", g).tolist() for g in range(2)]
    first = s.get_block_hash_group(groups[0][0])
    assert first is not None and first[1] == 0 and first[0] == s.get_block_hash(groups[0][0])
    assert s.get_cached_block_id(first[0]) == s.get_cached_block_id(first[0], 0) == groups[0][0]
    windowed = [b for b in groups[1][:3] if b]
    assert windowed  # the window keeps its last block
    for b in windowed:
        found = s.get_block_hash_group(b)
        assert found is not None and found[1] == 1
        assert s.get_cached_block_id(found[0], 1) == b
        assert s.get_cached_block_id(found[0], 0) == groups[0][groups[1].index(b)]
    assert s.get_block_hash_group(0) is None
    with pytest.raises(InvalidRequestError, match=r"group must be in \[0, 2\), got 2"):
        s.get_cached_block_id(first[0], 2)
    with pytest.raises(InvalidRequestError, match=r"group must be in \[0, 2\), got -1"):
        s.get_cached_block_id(first[0], -1)
    with pytest.raises(SchedulerTypeError, match="group must be an int"):
        s.get_cached_block_id(first[0], "1")
