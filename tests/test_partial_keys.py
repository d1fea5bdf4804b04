"""The reference block pool's keys finer than the block (a prefix match unit below the block): partial entries,
extra keys beside a block's hash, promotion, replacement and moves. The same script as the core's block pool
tests (``partial_entries_extra_keys_and_promotion`` and its neighbours in ``block_pool.rs``)."""

from __future__ import annotations

from kvsched.reference import ReferenceScheduler


def h(x: int) -> bytes:
    return bytes([x]) * 32


def pool(num_blocks: int = 6) -> ReferenceScheduler:
    return ReferenceScheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)


def keys(s: ReferenceScheduler, b: int) -> tuple[bytes | None, list[bytes]]:
    return s._block_hash[b], list(s._extra_keys.get(b, ()))


def first(s: ReferenceScheduler, key: bytes) -> int | None:
    return next(iter(s._cached.get(key, {})), None)


def test_partial_entries_extra_keys_and_promotion() -> None:
    s = pool()
    assert s._cache_partial_block(1, h(20), 20)
    assert not s._cache_partial_block(0, h(20), 20)
    assert keys(s, 1) == (h(20), []) and first(s, h(20)) == 1
    s.check_invariants()
    # Filling the block promotes it: the partial entry goes, the full hash comes.
    s._uncache(1, h(20))
    s._insert_key(1, h(24), None)
    assert keys(s, 1) == (h(24), []) and first(s, h(20)) is None
    # The tail keyed again is an extra key beside the longer full hash; twice is once.
    assert s._cache_partial_block(1, h(20), 20)
    s._cache_partial_block(1, h(20), 20)
    assert keys(s, 1) == (h(24), [h(20)])
    assert s._has_key(1, h(20)) and s._has_key(1, h(24)) and not s._has_key(2, h(20))
    s.check_invariants()
    # Block 2's hash after block 1's extra key under the same key: the first filed is found.
    s._cache_partial_block(2, h(20), 20)
    assert first(s, h(20)) == 1
    s._cache_partial_block(3, h(12), 12)
    s._insert_key(4, h(16), None)
    s._cache_partial_block(4, h(12), 12)
    assert first(s, h(12)) == 3
    s._uncache(3, h(12))
    s._insert_key(3, h(30), None)
    assert first(s, h(12)) == 4
    s.check_invariants()
    # Reusing block 1 evicts every key it carries.
    assert s._pop_free_block() == 1
    assert keys(s, 1) == (None, []) and first(s, h(24)) is None and first(s, h(20)) == 2
    s._free_block_list([1])
    s.check_invariants()


def test_a_longer_partial_entry_or_a_rewrite_replaces_the_keys() -> None:
    s = pool(4)
    s._cache_partial_block(1, h(4), 4)
    s._cache_partial_block(1, h(6), 6)
    assert keys(s, 1) == (h(6), []) and first(s, h(4)) is None
    s._cache_partial_block(1, h(5), 5)
    assert keys(s, 1) == (h(6), [h(5)])
    s._cache_partial_block(1, h(5), 5, replace=True)
    assert keys(s, 1) == (h(5), []) and first(s, h(6)) is None
    s._insert_key(2, h(8), None)
    s._cache_partial_block(2, h(8), 8)
    assert keys(s, 2) == (h(8), [])
    s.check_invariants()


def test_moving_keys_keeps_them_live_on_the_copy() -> None:
    s = pool()
    s._insert_key(1, h(16), None)
    s._cache_partial_block(1, h(12), 12)
    s._cache_partial_block(2, h(12), 12)
    s._move_block_hashes(1, 3)
    assert keys(s, 1) == (None, []) and keys(s, 3) == (h(16), [h(12)])
    assert first(s, h(16)) == 3 and first(s, h(12)) == 2
    s.check_invariants()
    s._cache_partial_block(2, h(14), 14)
    assert keys(s, 2) == (h(14), [])
    s._move_block_hashes(2, 4)
    s._cache_partial_block(4, h(15), 15)
    assert keys(s, 4) == (h(15), [])
    s.check_invariants()
    assert s.reset_prefix_cache()
    assert first(s, h(15)) is None and not s._extra_keys and not s._partial_tokens
    s.check_invariants()


def test_unit_hashes_cover_every_full_unit_and_end_each_block() -> None:
    from kvsched.reference.hashing import _BlockHasher

    tokens = [t * 7 + 1 for t in range(22)]
    for unit, lookahead in [(1, 0), (2, 0), (4, 0), (8, 0), (2, 2)]:
        h = _BlockHasher("sha256", b"s", 8, lookahead, unit)
        part = h.unit_hashes_of(tokens[:13], "salt", None, [])
        units = h.unit_hashes_of(tokens, "salt", None, part)
        assert len(part) == (13 - lookahead) // unit and units[: len(part)] == part
        assert len(units) == (22 - lookahead) // unit
        blocks = h.block_hashes_of(tokens, "salt", None)
        k = 8 // unit
        assert blocks == [units[(i + 1) * k - 1] for i in range(len(blocks))]
        assert blocks and len(set(units)) == len(units)


def test_partial_hit_unit() -> None:
    from kvsched import SchedulerConfig
    from kvsched.config import MAMBA

    on = dict(block_size=8, hash_block_size=4, enable_prefix_caching=True, mamba_align=True)
    assert SchedulerConfig.partial_hit_unit(_Fields(**on, kv_cache_groups=(None, MAMBA))) == 4  # type: ignore[arg-type]
    for off in [
        dict(on, hash_block_size=None),
        dict(on, hash_block_size=8),
        dict(on, hash_block_size=3),
        dict(on, enable_prefix_caching=False),
        dict(on, mamba_align=False),
    ]:
        assert SchedulerConfig.partial_hit_unit(_Fields(**off, kv_cache_groups=(None, MAMBA))) is None  # type: ignore[arg-type]
    for groups in [(None, 16), (None, MAMBA, 16), None]:
        assert SchedulerConfig.partial_hit_unit(_Fields(**on, kv_cache_groups=groups)) is None  # type: ignore[arg-type]


class _Fields:
    """The fields ``partial_hit_unit`` reads (the config itself refuses a finer unit with Mamba prefix caching)."""

    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def test_partial_hits_end_on_unit_boundaries() -> None:
    """The core's ``partial_hits_end_on_unit_boundaries`` (``hybrid_kv.rs``), on the reference's lookup."""
    from kvsched.config import MAMBA

    s = ReferenceScheduler(
        num_blocks=16,
        block_size=8,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_cache_groups=(None, MAMBA),
        mamba_align=True,
    )
    s._partial_unit = 4  # the configuration itself is refused until partial hits are admitted
    units = [bytes([i + 1]) * 32 for i in range(7)]
    b = [s._pop_free_block() for _ in range(6)]
    key = s._group_key
    s._insert_key(b[0], units[1], None)
    s._insert_key(b[1], units[3], None)
    s._cache_partial_block(b[2], units[4], 20)
    s._cache_partial_block(b[3], key(units[4], 1), 20)
    s._cache_partial_block(b[4], key(units[2], 1), 12)
    assert s._partial_hit_lookup(units, 27) == ([[b[0], b[1], b[2]], [0, 0, b[3]]], 20)
    assert s._partial_hit_lookup(units, 19) == ([[b[0], b[1]], [0, b[4]]], 12)
    s._uncache(b[3], key(units[4], 1))
    assert s._partial_hit_lookup(units, 27)[1] == 12
    s._uncache(b[4], key(units[2], 1))
    assert s._partial_hit_lookup(units, 27) == ([[], []], 0)
    s._uncache(b[2], units[4])
    s._insert_key(b[2], units[5], None)
    s._cache_partial_block(b[5], key(units[5], 1), 24)
    assert s._partial_hit_lookup(units, 27) == ([[b[0], b[1], b[2]], [0, 0, b[5]]], 24)
