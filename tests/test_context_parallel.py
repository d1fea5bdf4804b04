"""Decode/prefill context parallelism (docs/semantics.md, "Context parallelism"): each test pins one rule of
vLLM 0.33 (named in its docstring) or one deliberate difference, on both the Rust core and the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvsched import InvalidConfigError, InvalidRequestError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = [pytest.param(Scheduler, id="rust"), pytest.param(ReferenceScheduler, id="reference")]


def make(impl: Any, **cfg: Any) -> Any:
    fields = {"block_size": 4, "num_blocks": 17, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    fields.update({"max_model_len": 64, "prefix_hash_seed": 1}, **cfg)
    return impl(**fields)


def prompt(n: int) -> list[int]:
    return list(range(100, 100 + n))


def step(s: Any) -> Any:
    """Schedules once and gives every scheduled request one token (the prompts here fit in one step)."""
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(out, [[7] for _ in out.req_ids])
    s.check_invariants()
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dcp", "num_blocks"), [(1, 5), (2, 3), (3, 2), (4, 2), (5, 1)])
def test_dcp_allocates_blocks_of_block_size_times_dcp_tokens(impl: Any, dcp: int, num_blocks: int) -> None:
    """vLLM 0.33 ``SingleTypeKVCacheManager.__init__``: ``block_size = kv_cache_spec.block_size *
    dcp_world_size``, so a 17-token prompt takes ceil(17 / (4 * dcp)) blocks."""
    s = make(impl, dcp_world_size=dcp)
    s.add_request("a", prompt(17), max_tokens=4)
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [17]
    assert len(out.new_block_ids) == num_blocks
    assert s.num_free_blocks == 16 - num_blocks
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("dcp", "pcp", "num_blocks"), [(1, 2, 5), (1, 4, 5), (2, 2, 3), (4, 2, 2), (3, 3, 2), (6, 3, 1)]
)
def test_pcp_does_not_change_the_block_unit(impl: Any, dcp: int, pcp: int, num_blocks: int) -> None:
    """vLLM 0.33 ``Scheduler.__init__`` builds its ``KVCacheManager`` with ``pcp_world_size=1`` (PCP ranks
    replicate the KV cache, or DCP spans them): only DCP scales the block unit."""
    s = make(impl, dcp_world_size=dcp, pcp_world_size=pcp)
    assert s.config.kv_block_size == 4 * dcp
    s.add_request("a", prompt(17), max_tokens=4)
    assert len(s.schedule().new_block_ids) == num_blocks


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dcp", [1, 2, 3, 4])
def test_prefix_hits_come_in_kv_block_units(impl: Any, dcp: int) -> None:
    """vLLM 0.33 ``FullAttentionManager.find_longest_cache_hit``: with DCP the block hashes are viewed at the
    sharded block size (``block_size * dcp``) and the hit is a whole number of those blocks that leaves the
    last token to compute."""
    s = make(impl, dcp_world_size=dcp)
    s.add_request("a", prompt(24), max_tokens=4)
    step(s)
    unit = 4 * dcp
    # 24 tokens: the hit stops below the last token, at a multiple of the unit.
    assert s.get_num_cached_tokens(prompt(24)) == (23 // unit) * unit
    # A prompt that diverges inside the second unit keeps only the first unit.
    diverged = prompt(24)
    diverged[unit + 1] = 5
    assert s.get_num_cached_tokens(diverged) == unit
    s.add_request("b", prompt(24), max_tokens=4)
    out = s.schedule()
    k = out.req_ids.index("b")
    assert out.num_computed_tokens[k] == (23 // unit) * unit
    assert len(s.get_block_hashes("b")) == 24 // unit  # one hash per full unit of its tokens
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_scales_the_kv_capacity(impl: Any) -> None:
    """The pool holds ``(num_blocks - 1) * block_size * dcp`` tokens (every block id spans all DCP ranks); a
    request that could never fit is refused as without DCP."""
    s = make(impl, dcp_world_size=4, max_model_len=512)
    assert s.config.kv_capacity_tokens == 16 * 16
    s.add_request("fits", prompt(256), max_tokens=1)
    with pytest.raises(InvalidRequestError, match="16 usable blocks of 16 tokens"):
        s.add_request("too-long", prompt(257), max_tokens=1)


def expected_slot(pos: int, blocks: list[int], bs: int, dcp: int, inter: int, rank: int) -> int:
    """vLLM 0.33 ``BlockTable.compute_slot_mapping`` (its Triton kernel), written out for one token."""
    virtual = bs * dcp
    off = pos % virtual
    if (off // inter) % dcp != rank:
        return -1
    return blocks[pos // virtual] * bs + off // (dcp * inter) * inter + off % inter


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("dcp", "inter"), [(1, 1), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2), (6, 4)])
def test_slot_mapping_per_dcp_rank(impl: Any, dcp: int, inter: int) -> None:
    """vLLM 0.33's workers compute the slot mapping per DCP rank (``BlockTable.compute_slot_mapping``): the
    tokens of a block are dealt to the ranks in runs of ``cp_kv_cache_interleave_size``; a token stored on
    another rank gets the padding slot -1. Every token is written on exactly one rank, into its own block."""
    s = make(impl, dcp_world_size=dcp, cp_kv_cache_interleave_size=inter)
    s.add_request("a", prompt(37), max_tokens=4)
    out = s.schedule()
    blocks = out.new_block_ids.tolist()
    owners = np.zeros(37, dtype=int)
    for rank in range(dcp):
        mi = s.prepare_model_inputs(out, dcp_rank=rank)
        assert mi.input_positions.tolist() == list(range(37))
        assert mi.block_table.tolist() == [blocks]  # the block table is the same on every rank
        want = [expected_slot(p, blocks, 4, dcp, inter, rank) for p in range(37)]
        assert mi.slot_mapping.tolist() == want
        owners += mi.slot_mapping >= 0
        local = mi.slot_mapping[mi.slot_mapping >= 0]
        assert len(set(local.tolist())) == len(local)
    assert owners.tolist() == [1] * 37


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_tokens_rotate_over_the_ranks(impl: Any) -> None:
    """With interleave 1 (vLLM's default), token ``p`` is stored on rank ``p % dcp`` at local offset
    ``(p % (bs * dcp)) // dcp`` of its block."""
    s = make(impl, dcp_world_size=2)
    s.add_request("a", prompt(5), max_tokens=8)
    step(s)
    b = s.get_block_ids("a").tolist()
    seen = []
    for pos in range(5, 10):
        out = s.schedule()
        mis = [s.prepare_model_inputs(out, dcp_rank=r) for r in range(2)]
        assert [int(m.input_positions[0]) for m in mis] == [pos, pos]
        seen.append([int(m.slot_mapping[0]) for m in mis])
        s.update_from_output(out, [[7]])
        b = s.get_block_ids("a").tolist()
    # positions 5..9 on ranks 1, 0, 1, 0, 1; block 0 holds positions 0..7, block 1 from 8 on.
    assert seen == [[-1, b[0] * 4 + 2], [b[0] * 4 + 3, -1], [-1, b[0] * 4 + 3], [b[1] * 4, -1], [-1, b[1] * 4]]


def test_config_rules() -> None:
    """vLLM's ``ParallelConfig``: with PCP, DCP is 1 or spans the PCP axis (kvsched: a multiple of it);
    ``cp_kv_cache_interleave_size`` divides the block size."""
    assert SchedulerConfig(dcp_world_size=4, pcp_world_size=2).kv_block_size == 64
    assert SchedulerConfig(pcp_world_size=3).kv_block_size == 16
    with pytest.raises(InvalidConfigError, match="multiple of pcp_world_size"):
        SchedulerConfig(dcp_world_size=2, pcp_world_size=4)
    with pytest.raises(InvalidConfigError, match="cp_kv_cache_interleave_size"):
        SchedulerConfig(block_size=16, cp_kv_cache_interleave_size=32)
    SchedulerConfig(block_size=16, dcp_world_size=2, cp_kv_cache_interleave_size=16)  # block-level interleave


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("block_size", "dcp"), [(3, 1), (3, 2), (4, 3), (6, 3), (12, 5)])
def test_block_units_that_are_not_powers_of_two(impl: Any, block_size: int, dcp: int) -> None:
    """vLLM 0.33 takes any block size and any DCP size that divides the TP size (``ParallelConfig``): the block
    unit is ``block_size * dcp`` whatever its factors. A prompt takes ceil(prompt / unit) blocks, decode
    allocates the next block when the unit is full, and a prefix hit is a whole number of units."""
    unit = block_size * dcp
    s = make(
        impl, block_size=block_size, dcp_world_size=dcp, num_blocks=64, max_model_len=512, max_num_batched_tokens=512
    )
    assert s.config.kv_block_size == unit
    n = 2 * unit + 1
    s.add_request("a", prompt(n), max_tokens=2 * unit)
    out = step(s)
    assert len(out.new_block_ids) == 3
    for k in range(1, 2 * unit - 1):
        step(s)
        assert len(s.get_block_ids("a")) == -(-(n + k) // unit), k
    assert s.get_num_cached_tokens(prompt(n)) == 2 * unit
    s.add_request("b", prompt(n) + [9] * unit, max_tokens=1)
    out = step(s)
    assert out.num_computed_tokens[out.req_ids.index("b")] == 2 * unit
