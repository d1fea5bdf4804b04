"""Ring-buffer KV cache groups (``kv_cache_groups`` entry ``"ring"``, vLLM 0.33's ``CircularBufferSpec`` and
``CircularBufferManager``): a request holds exactly one block there, taken by its first allocation in group order,
never grown, never cached or looked up, never zeroed, and freed with its other tables. Block size 4 and small pools
keep every table traceable by hand."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched import InvalidConfigError, SchedulerConfig
from kvsched.config import RING
from test_hybrid_groups import make

IMPLS = [pytest.param("rust", marks=requires_rust), "reference"]


def tables(s: Any, rid: str, num_groups: int) -> list[list[int]]:
    return [[int(b) for b in s.get_block_ids(rid, g)] for g in range(num_groups)]


def group_new(out: Any, rid: str, g: int) -> list[int]:
    k = list(out.req_ids).index(rid)
    p = out.group_new_block_ids_indptr(g)
    return [int(b) for b in out.group_new_block_ids(g)[p[k] : p[k + 1]]]


def step(s: Any, token: int = 9) -> Any:
    """One schedule() and its update (every scheduled request samples ``token``; a chunk's sample is dropped)."""
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(out, [[token]] * len(out.req_ids))
    s.check_invariants()
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_a_ring_block_is_taken_once_in_group_order_and_never_grows(impl: str) -> None:
    # Full attention, a ring and a window of 8 tokens, prefix caching on: the ring pops its one block between the
    # full group's blocks and the window's; nothing more while the request decodes, and its id is reported once.
    s = make(impl, kv_cache_groups=(None, RING, 8))
    assert s.config.kv_cache_groups == (None, "ring", 8)
    s.add_request("a", list(range(22)), max_tokens=8)
    out = step(s)
    assert tables(s, "a", 3) == [[1, 2, 3, 4, 5, 6], [7], [8, 9, 10, 11, 12, 13]]
    assert [group_new(out, "a", g) for g in range(3)] == tables(s, "a", 3)
    assert out.new_block_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert out.zero_block_ids.tolist() == []  # no Mamba group: nothing is zeroed
    for _ in range(2):
        out = step(s)
        assert [group_new(out, "a", g) for g in range(3)] == [[], [], []]
        assert tables(s, "a", 3)[1] == [7]
    out = step(s)  # token 25 needs a seventh block in the attention groups, none in the ring
    assert [len(b) for b in (group_new(out, "a", g) for g in range(3))] == [1, 0, 1]
    assert tables(s, "a", 3)[1] == [7]


@pytest.mark.parametrize("impl", IMPLS)
def test_one_ring_block_per_request_whatever_its_length(impl: str) -> None:
    # A 60-token prompt in chunks of 16, then decodes: the ring table is one block from the first chunk on.
    s = make(impl, kv_cache_groups=(RING, None), max_num_batched_tokens=16, num_blocks=64)
    s.add_request("a", list(range(60)), max_tokens=12)
    s.add_request("b", list(range(100, 103)), max_tokens=12)
    ring: dict[str, list[int]] = {}
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        steps += 1
        for rid in out.req_ids:
            if rid in ring:
                assert group_new(out, rid, 0) == []
            else:
                ring[rid] = group_new(out, rid, 0)
                assert len(ring[rid]) == 1
            assert tables(s, rid, 2)[0] == ring[rid]
        s.update_from_output(out, [[9]] * len(out.req_ids))
        s.check_invariants()
    assert steps == 15 and sorted(ring) == ["a", "b"]  # 4 chunks of "a", then 11 more decodes
    assert s.num_free_blocks == 63


@pytest.mark.parametrize("impl", IMPLS)
def test_a_prefix_hit_leaves_the_ring_block_fresh(impl: str) -> None:
    # "b" repeats "a"'s prompt after "a" finished: the attention groups hit 20 tokens, the ring is never cached,
    # so "b" pops a fresh ring block (after the full group's new block, before the window's).
    s = make(impl, kv_cache_groups=(None, RING, 8))
    s.add_request("a", list(range(22)), max_tokens=3)
    for _ in range(3):
        step(s)
    assert not s.has_unfinished_requests()
    tokens = list(range(22))
    assert [s.get_cached_block_ids(tokens, group=g).tolist() for g in range(3)] == [
        [1, 2, 3, 4, 5],
        [0] * 5,
        [0, 0, 0, 11, 12],
    ]
    s.add_request("b", [*tokens, 99], max_tokens=2)
    out = step(s)
    assert int(out.num_computed_tokens[0]) == 20
    full, ring, window = tables(s, "b", 3)
    assert full[:5] == [1, 2, 3, 4, 5] and window[:5] == [0, 0, 0, 11, 12]
    # popped in group order: the full group's new block first, from the head of the free queue ("a"'s ring block
    # 7, which went there uncached), then the ring's and the window's
    assert (full[5], ring, window[5]) == (7, [14], 15)
    assert [group_new(out, "b", g) for g in range(3)] == [full, ring, window]
    # a lookup gives the ring null blocks as long as the hit: nothing to take
    assert s.get_cached_block_ids(tokens, group=1).tolist() == [0] * 5


@pytest.mark.parametrize("impl", IMPLS)
def test_preemption_frees_the_ring_block_and_readmission_takes_one(impl: str) -> None:
    # 8 usable blocks: "a" (7 tokens) holds 2 + 1, "b" (3 tokens) 1 + 1. "a" takes the last free blocks as it grows
    # and "b", the last admitted, is preempted: its ring block goes back with its table; readmitted, it takes one.
    s = make(impl, num_blocks=9, kv_cache_groups=(None, RING))
    s.add_request("a", list(range(7)), max_tokens=12)
    s.add_request("b", list(range(100, 103)), max_tokens=12)
    out = step(s)
    assert tables(s, "a", 2) == [[1, 2], [3]]
    assert tables(s, "b", 2) == [[4], [5]]
    preempted = False
    for _ in range(12):
        out = step(s)
        if "b" in list(out.preempted_req_ids):
            preempted = True
            assert tables(s, "b", 2) == [[], []]
            break
    assert preempted
    s.abort_requests(["a"])
    out = step(s)
    assert list(out.resumed_req_ids) == ["b"]
    assert len(group_new(out, "b", 1)) == 1
    assert len(tables(s, "b", 2)[1]) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_no_ring_block_is_zeroed_beside_a_mamba_group(impl: str) -> None:
    # With a Mamba group vLLM zeroes new attention blocks before use; the ring's and the Mamba state's are not.
    s = make(impl, kv_cache_groups=("mamba", None, RING), enable_prefix_caching=False)
    s.add_request("a", list(range(10)), max_tokens=8)
    out = step(s)
    assert tables(s, "a", 3) == [[1], [2, 3, 4], [5]]
    assert out.new_block_ids.tolist() == [2, 3, 4]
    assert out.zero_block_ids.tolist() == [2, 3, 4]
    for _ in range(3):
        out = step(s)
    assert tables(s, "a", 3) == [[1], [2, 3, 4, 6], [5]]
    assert out.zero_block_ids.tolist() == [6]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_leading_ring_group_is_not_the_primary_group(impl: str) -> None:
    s = make(impl, kv_cache_groups=(RING, "mamba", None, 8), enable_prefix_caching=False)
    assert s.config.primary_group == 2
    s.add_request("a", list(range(10)), max_tokens=2)
    out = step(s)
    assert tables(s, "a", 4) == [[1], [2], [3, 4, 5], [6, 7, 8]]
    assert out.new_block_ids.tolist() == out.group_new_block_ids(2).tolist() == [3, 4, 5]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_ring_block_counts_in_the_full_sequence_check(impl: str) -> None:
    # 9 usable blocks: "a" holds 4 + 1; "b" (16 tokens: 4 attention blocks) fits the 4 left only without its ring
    # block, so it waits (as vLLM counts 1 for a ring the request holds no block of).
    s = make(impl, num_blocks=10, kv_cache_groups=(None, RING), max_num_batched_tokens=24)
    s.add_request("a", list(range(13)), max_tokens=2)
    s.add_request("b", list(range(100, 116)), max_tokens=2)
    out = s.schedule()
    assert list(out.req_ids) == ["a"]
    assert s.num_free_blocks == 4
    s.check_invariants()


# --- configuration


def test_a_ring_group_is_accepted_with_prefix_caching() -> None:
    cfg = SchedulerConfig(kv_cache_groups=(None, "ring"))
    assert cfg.enable_prefix_caching and cfg.kv_cache_groups == (None, RING)
    assert SchedulerConfig(kv_cache_groups=["ring", None, "ring", 8]).primary_group == 1
    assert SchedulerConfig(kv_cache_groups=("mamba", "ring", None), enable_prefix_caching=False).primary_group == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_cache_groups": ("ring", "ring")}, "needs a group that is not Mamba or ring"),
        ({"kv_cache_groups": ("ring", "mamba"), "enable_prefix_caching": False}, "not Mamba or ring"),
        (
            {"kv_cache_groups": ("ring", "cross", None), "enable_prefix_caching": False},
            "cannot start with a cross-attention group",
        ),
        ({"kv_cache_groups": (None, "Ring")}, "'mamba' \\(Mamba\\) and 'ring' \\(ring buffer\\)"),
        (
            {"block_size": 16, "kv_cache_groups": ("ring", None), "kv_cache_group_block_sizes": (16, 32)},
            "must give block_size \\(16\\) to a group that is not Mamba, ring or replayed, got \\[16, 32\\]",
        ),
        ({"kv_cache_groups": (None, f"chunked:{2**31 - 3}")}, "must be None or a list"),
    ],
)
def test_bad_ring_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        SchedulerConfig(**fields)


def test_the_largest_chunk_size_stops_below_the_ring_encoding() -> None:
    assert SchedulerConfig(kv_cache_groups=(None, f"chunked:{2**31 - 4}")).kv_cache_groups[1] == "chunked:2147483644"


def test_a_ring_group_leaves_prefix_hits_inside_a_block_on() -> None:
    # vLLM disables hits inside a block only for groups that take part in prefix caching; a ring takes none.
    base = {"block_size": 16, "hash_block_size": 8, "mamba_align": True}
    assert SchedulerConfig(**base, kv_cache_groups=(None, "mamba", "ring")).partial_hit_unit() == 8
    with pytest.raises(InvalidConfigError, match="every other group full attention"):
        SchedulerConfig(**base, kv_cache_groups=(None, "mamba", 8))


# --- the Rust core against the reference, step by step (tests/test_differential.py's Twin)

# Ring groups beside full attention and windows with prefix caching (hits that leave the ring block fresh), first
# in group order, beside chunked-local attention, Mamba groups in both modes (zeroing on) and with sparse retention,
# cross attention, hits inside a block, the trailing-block drop with KV cache events, attention groups of different
# block sizes; sync and async, drafts,
# priority, the full-sequence check off; tight pools preempt.
RING_CONFIGS = [
    SchedulerConfig(block_size=4, num_blocks=34, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, "ring", 9), prefix_hash_seed=201),
    SchedulerConfig(block_size=2, num_blocks=50, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48,
                    kv_cache_groups=("ring", None, 3), async_scheduling=True, policy="priority",
                    num_speculative_tokens=2, prefix_hash_seed=202),
    SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=64,
                    kv_cache_groups=(None, "chunked:8", "ring", "ring"), scheduler_reserve_full_isl=False,
                    watermark=0.05, prefix_hash_seed=203),
    SchedulerConfig(block_size=4, num_blocks=30, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=("mamba", None, "ring"), enable_prefix_caching=False, async_scheduling=True,
                    num_speculative_tokens=2, mamba_speculative_blocks=2, prefix_hash_seed=204),
    SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=("ring", None, "mamba"), mamba_align=True, prefix_hash_seed=205),
    SchedulerConfig(block_size=4, num_blocks=36, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=48,
                    kv_cache_groups=(None, "ring", "cross"), enable_prefix_caching=False, prefix_hash_seed=206),
    SchedulerConfig(block_size=8, num_blocks=30, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, "mamba", "ring"), hash_block_size=4, mamba_align=True,
                    prefix_hash_seed=207),
    SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, "ring", 6), drop_trailing_hit_block=True, num_speculative_tokens=2,
                    enable_kv_cache_events=True, async_scheduling=True, prefix_hash_seed=208),
    SchedulerConfig(block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=16, max_model_len=64,
                    kv_cache_groups=("ring", None, "mamba"), mamba_align=True, prefix_cache_retention_interval=8,
                    policy="priority", prefix_hash_seed=209),
    # Beside attention groups of different block sizes (a ring's entry the primary group's size).
    SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=("ring", None, 9, None), kv_cache_group_block_sizes=(4, 4, 8, 4),
                    prefix_hash_seed=210),
    SchedulerConfig(block_size=2, num_blocks=60, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48,
                    kv_cache_groups=(None, "ring", 5), kv_cache_group_block_sizes=(2, 2, 6), async_scheduling=True,
                    num_speculative_tokens=2, prefix_hash_seed=211),
]  # fmt: skip


def _soak(cfg: SchedulerConfig, seed: int, steps: int, **twin: Any) -> Any:
    from test_differential import Rand, Twin

    t = Twin(cfg, Rand(rng=np.random.default_rng(seed)), **twin)
    rings = [g for g, w in enumerate(cfg.kv_cache_groups or ()) if w == RING]
    slots = [g if g < cfg.primary_group else g - 1 for g in rings]
    held = 0
    t.num_hits = 0  # the reference's lookups that found a hit

    def counted(lookup: Any) -> Any:
        def inner(*args: Any) -> Any:
            hits = lookup(*args)
            t.num_hits += bool(hits)
            return hits

        return inner

    t.ref._lookup = counted(t.ref._lookup)
    t.ref._partial_lookup = counted(t.ref._partial_lookup)
    for _ in range(steps):
        try:
            t.step()
        except AssertionError as e:
            raise AssertionError(f"{e}\nconfig {cfg}\nlast ops: {t.log[-15:]}") from e
        for r in t.ref._requests.values():
            assert all(len(r.group_block_ids[k]) == (1 if r.block_ids else 0) for k in slots), r.req_id
            held += sum(bool(r.group_block_ids[k]) for k in slots)
    t.drain()
    assert t.ref.stats().num_preemptions > 0, f"no preemption under {cfg}"
    assert held > 0
    return t


@requires_rust
def test_soak_ring_groups_match_reference_step_by_step() -> None:
    """Both implementations give every group, the rings included, the same tables and new blocks, find the same
    hits and zero the same blocks, step by step; requests are preempted and readmitted in each run, and the runs
    with prefix caching hit."""
    for i, cfg in enumerate(RING_CONFIGS):
        t = _soak(cfg, 7301 + i, 500, max_in_flight=1 + i % 3)
        assert not cfg.enable_prefix_caching or t.num_hits > 0, f"no prefix hit under {cfg}"


@requires_rust
def test_soak_ring_groups_with_streaming_input_match_reference_step_by_step() -> None:
    """With streaming-input sessions (resumable requests whose next part continues the request) both
    implementations agree at every step, and every request holds one ring block while it holds any block."""
    for i, cfg in enumerate(RING_CONFIGS[:2]):
        t = _soak(cfg, 7501 + i, 400, max_in_flight=2, streaming=True)
        assert t.session_ids, "no streaming-input session"
