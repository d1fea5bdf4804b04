"""The reference's keys finer than the block and its lookup with hits inside a block, against vLLM's own
``BlockPool`` (partial entries, extra keys, promotion, ``move_block_hashes``, eviction, free order) and its
fine-grained full-attention and Mamba finders, on random operations (vLLM-marked: imports vLLM)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest
from kvsched.config import MAMBA
from kvsched.reference import ReferenceScheduler

pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

pytestmark = pytest.mark.vllm

BS, UNIT = 8, 2
K = BS // UNIT


class _Req:
    """What vLLM's pool reads of a request with events off: its hashes at the prefix-match unit."""

    def __init__(self, units: list[bytes]) -> None:
        self.block_hashes = units


def _prompts(rng: random.Random, n: int, num_units: int) -> list[list[bytes]]:
    """Unit hashes of ``n`` prompts drawn from two tokens per unit (so that they share prefixes)."""
    out = []
    for _ in range(n):
        parent, units = b"", []
        for _ in range(num_units):
            parent = hashlib.sha256(parent + bytes([rng.randrange(2)])).digest()
            units.append(parent)
        out.append(units)
    return out


def _specs() -> tuple[Any, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=BS, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    return full, mamba


def _reference(num_blocks: int) -> ReferenceScheduler:
    s = ReferenceScheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_cache_groups=(None, MAMBA),
        mamba_align=True,
    )
    s._partial_unit = UNIT  # the configuration itself stays refused until hits inside a block are admitted
    return s


def _vllm_hit(pool: Any, units: list[bytes], max_len: int) -> tuple[list[list[int]], int]:
    """vLLM's simple-hybrid lookup (full attention, then Mamba capped at its hit; full attention cut to the
    blocks the hit touches), through its own finders."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager

    full, mamba = _specs()
    kw = {"block_pool": pool, "drop_eagle_block": False, "alignment_tokens": UNIT}
    (fa,), fa_len = FullAttentionManager.find_longest_cache_hit(units, max_len, [0], kv_cache_spec=full, **kw)
    (mb,), hit = MambaManager.find_longest_cache_hit(units, fa_len, [1], kv_cache_spec=mamba, **kw)
    fa = fa[: -(-hit // BS)]
    return [[b.block_id for b in fa], [b.block_id for b in mb]], hit


@pytest.mark.parametrize("seed", range(40))
def test_partial_keys_and_lookups_match_vllms_block_pool(seed: int) -> None:
    from vllm.v1.core.block_pool import BlockPool

    rng = random.Random(seed)
    n = 16
    pool = BlockPool(n, enable_caching=True, hash_block_size=UNIT)
    s = _reference(n)
    prompts = _prompts(rng, 2, 3 * K)
    reqs = [_Req(u) for u in prompts]
    held: dict[int, tuple[int, int, int]] = {}  # block -> (prompt, block position, group)
    keys = [s._group_key(u, g) for units in prompts for u in units for g in (0, 1)]
    for _ in range(150):
        op = rng.choice(["alloc", "alloc", "free", "full", "partial", "partial", "move", "reset", "lookup"])
        if op == "alloc" and pool.get_num_free_blocks() > 0:
            (blk,) = pool.get_new_blocks(1)
            assert s._pop_free_block() == blk.block_id
            held[blk.block_id] = (rng.randrange(len(prompts)), rng.randrange(3), rng.randrange(2))
        elif op == "free" and held:
            b = rng.choice(sorted(held))
            del held[b]
            pool.free_blocks([pool.blocks[b]])
            s._free_block_list([b])
        elif op == "full" and held:
            b = rng.choice(sorted(held))
            p, i, g = held[b]
            blk = pool.blocks[b]
            # vLLM keys a block full once, or promotes a partial entry of its own position.
            tokens = blk.block_hash_num_tokens
            if blk.block_hash is None or (tokens is not None and i * BS < tokens < (i + 1) * BS):
                pool.cache_full_blocks(reqs[p], [blk] * (i + 1), i, i + 1, BS, g)
                h = s._group_key(prompts[p][(i + 1) * K - 1], g)
                if s._block_hash[b] is not None:
                    s._uncache(b, s._block_hash[b])
                s._insert_key(b, h, None)
        elif op == "partial" and held:
            b = rng.choice(sorted(held))
            p, i, g = held[b]
            f = i * K + rng.randrange(K)
            replace = rng.random() < 0.1
            tokens = (f + 1) * UNIT
            pool.cache_partial_block(reqs[p], pool.blocks[b], tokens, g, BS, replace_existing_hashes=replace)
            s._cache_partial_block(b, s._group_key(prompts[p][f], g), tokens, replace)
        elif op == "move" and len(held) > 1:
            src, dst = rng.sample(sorted(held), 2)
            if pool.blocks[src].block_hash is not None and s._block_hash[dst] is None:
                pool.move_block_hashes(pool.blocks[src], pool.blocks[dst])
                s._move_block_hashes(src, dst)
                held[dst] = held[src]
        elif op == "reset" and not held:
            assert pool.reset_prefix_cache() and s.reset_prefix_cache()
        elif op == "lookup":
            units = rng.choice(prompts)
            max_len = rng.randrange(len(units) * UNIT + 1)
            assert s._partial_hit_lookup(units, max_len) == _vllm_hit(pool, units, max_len), max_len
        for key in keys:
            want = pool.cached_block_hash_to_block.get_one_block(_vllm_key(key))
            got = next(iter(s._cached.get(key, {})), None)
            assert got == (None if want is None else want.block_id)
        assert [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()] == list(s._free)
    if not held:
        s.check_invariants()


def _vllm_key(key: bytes) -> Any:
    """vLLM's key of a reference key (the hash, with the group id appended to a group's above 0)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    group = key[-1] if len(key) % 2 else 0
    return make_block_hash_with_group_id(key[:-1] if group else key, group)  # type: ignore[arg-type]


def _vllm_split(req: Any, n: int, bs: int, unit: int, drop: bool, lookahead: int, align: int, max_tokens: int) -> int:
    """vLLM's ``Scheduler._mamba_block_aligned_split`` over the scheduler fields it reads (prefix hits inside a
    block on: align-mode Mamba groups, a unit below the block)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    fields = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=bs),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        block_size=bs,
        hash_block_size=unit,
        mamba_partial_cache_hit=unit < bs,
        mamba_shared_prefix_checkpoint=False,
        use_eagle_block_drop=drop,
        num_hash_lookahead_tokens=lookahead,
        mamba_has_prefill_checkpoint_blocks=align > 0,
        mamba_prefill_checkpoint_alignment=align or None,
        max_num_scheduled_tokens=max_tokens,
    )
    return int(Scheduler._mamba_block_aligned_split(fields, req, n))  # type: ignore[arg-type]


def test_mamba_chunks_stop_at_the_prompts_last_unit_boundary_as_vllms() -> None:
    """The reference's align-mode Mamba chunk split with prefix hits inside a block (the prompt's last unit
    boundary as a stop, the prefill checkpoint at a unit) equals vLLM's on random requests, chunks, junctions,
    trailing-block drops, look-ahead hashes (vLLM 0.33) and prefill checkpoint alignments; the unit at the block
    size (hits on whole blocks) too."""
    from types import SimpleNamespace

    from kvsched.vllm import RULES

    rng = random.Random(0)
    num_stops = 0
    for _ in range(4000):
        bs = rng.choice((8, 16))
        unit = rng.choice([u for u in (2, 4, 8, 16) if bs % u == 0])
        drop = rng.random() < 0.2
        # (vLLM 0.32's split has no look-ahead hashes)
        lookahead = 0 if drop or rng.random() < 0.7 or RULES.version == "0.32" else rng.randrange(1, 4)
        align = rng.choice((0, 0, unit, 2 * unit))
        max_tokens = rng.choice((bs // 2, 64))
        num_prompt = rng.randrange(2, 80)
        num_tokens = num_prompt + rng.choice((0, 0, rng.randrange(1, 10)))
        start = rng.randrange(0, num_tokens)
        n = rng.randrange(1, num_tokens - start + 1)
        junction = rng.choice((0, rng.randrange(0, num_prompt + 1)))
        req = SimpleNamespace(
            num_computed_tokens=start,
            num_prompt_tokens=num_prompt,
            num_tokens=num_tokens,
            shared_prefix_boundary=junction,
        )
        config = SimpleNamespace(
            drop_trailing_hit_block=drop,
            hash_lookahead_tokens=lookahead,
            mamba_prefill_checkpoint_alignment=align or None,
            max_num_scheduled_tokens=max_tokens,
            max_num_batched_tokens=max_tokens,
            long_prefill_token_threshold=0,
        )
        ours = SimpleNamespace(_config=config, _bs=bs, _partial_unit=unit if unit < bs else 0)
        got = ReferenceScheduler._mamba_split(ours, req, start, n)  # type: ignore[arg-type]
        want = _vllm_split(req, n, bs, unit, drop, lookahead, align, max_tokens)
        assert got == want, (bs, unit, drop, lookahead, align, max_tokens, num_prompt, num_tokens, start, n, junction)
        whole = _vllm_split(req, n, bs, bs, drop, lookahead, align, max_tokens)
        num_stops += got < whole
    # Some chunks stop earlier than with whole-block hits (at the prompt's last unit boundary).
    assert num_stops > 100, num_stops


def _pair(num_blocks: int, unit: int, retention: int | None, checkpoints: int | None) -> tuple[Any, ReferenceScheduler]:
    """vLLM's scheduler and the reference, a Mamba group (mode "align") then full attention, blocks of ``BS``
    tokens, prefix caching, requests hashed at ``unit`` tokens (vLLM's partial hash hits on), the cached Mamba states
    retained as ``retention`` says (None: dense), prefill checkpoints of ``checkpoints`` tokens' alignment (None:
    none)."""
    from kvsched.vllm import RULES
    from kvsched.vllm.testing import make_scheduler, make_vllm_config

    cfg = make_vllm_config(block_size=BS, num_blocks=num_blocks, max_model_len=96, max_num_batched_tokens=32,
                           max_num_seqs=4, enable_prefix_caching=True, mamba_cache_mode="align")  # fmt: skip
    vllm_sched = make_scheduler(
        "vllm",
        cfg,
        kv_cache_groups=("mamba", None),
        hash_block_size=unit,
        prefix_cache_retention_interval=retention,
        mamba_prefill_checkpoint_alignment=checkpoints,
    )
    assert vllm_sched.kv_cache_manager.coordinator.enable_partial_hash_hits
    ref = ReferenceScheduler(
        num_blocks=num_blocks,
        block_size=BS,
        hash_block_size=unit,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=96,
        enable_prefix_caching=True,
        kv_cache_groups=(MAMBA, None),
        mamba_align=True,
        mamba_defer_new_states_only=RULES.mamba_defer_new_states_only,  # (vLLM 0.32 keys a prompt's tail again)
        prefix_cache_retention_interval=retention,
        mamba_prefill_checkpoint_alignment=checkpoints,
    )
    assert ref._partial_unit == unit
    return vllm_sched, ref


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("retention", [None, 0], ids=["dense", "sparse"])
@pytest.mark.parametrize("checkpoints", [False, True], ids=["", "checkpoints"])
def test_hits_inside_a_block_schedule_as_vllms(seed: int, retention: int | None, checkpoints: bool) -> None:
    """The reference scheduling requests that share prefixes of any length, with hits ending inside a block, against
    vLLM's own scheduler step by step, the cached Mamba states retained densely and as vLLM's engine default (0),
    without and with prefill checkpoints (of a unit's or a block's alignment):
    the tokens scheduled and computed, every request's block table in each group, the block copies and the blocks
    to zero, the free blocks."""
    from kvsched.vllm.testing import make_request
    from vllm_driver import runner_output

    rng = random.Random(seed)
    unit = rng.choice((2, 4))
    alignment = rng.choice((unit, BS)) if checkpoints else None
    vllm_sched, ref = _pair(rng.choice((24, 40)), unit, retention, alignment)
    bases = [[rng.randrange(3, 50) for _ in range(40)] for _ in range(2)]
    num_partial = num_copies = 0
    next_id = 0
    for step in range(40):
        if rng.random() < 0.35 and next_id < 10:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(3, 40)] + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 6))]
            max_tokens = rng.randrange(1, 4)
            rid = f"r{next_id}"
            next_id += 1
            vllm_sched.add_request(make_request(rid, prompt, max_tokens=max_tokens, block_size=unit))
            ref.add_request(rid, prompt, max_tokens=max_tokens, ignore_eos=True)
        so = vllm_sched.schedule()
        out = ref.schedule()
        want = {r: int(n) for r, n in so.num_scheduled_tokens.items()}
        got = dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True))
        assert got == want, (step, got, want)
        hits = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        num_partial += sum(1 for n in hits.values() if n % BS)
        assert {r: c for r, c in zip(out.req_ids, out.num_computed_tokens.tolist(), strict=True) if r in hits} == hits
        copies = [(c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies or ()]
        num_copies += len(copies)
        assert out.kv_cache_block_copies.tolist() == [list(c) for c in copies], step
        assert out.zero_block_ids.tolist() == list(so.new_block_ids_to_zero or ()), step
        for rid in want:
            tables = [list(t) for t in vllm_sched.kv_cache_manager.get_block_ids(rid)]
            r = ref._requests[rid]
            assert [list(ref._group_table(r, g)) for g in range(2)] == tables, (step, rid)
        ids = list(want)
        sampled = [[] if vllm_sched.requests[r].is_prefill_chunk else [9] for r in ids]
        vllm_sched.update_from_output(so, runner_output(ids, sampled))
        ref.update_from_output(out, sampled)
        ref.check_invariants()
        assert ref._free.__len__() == vllm_sched.kv_cache_manager.block_pool.get_num_free_blocks(), step
    print(f"seed {seed}: {num_partial} hits inside a block, {num_copies} copies")
