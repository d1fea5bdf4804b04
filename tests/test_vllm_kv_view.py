"""``kvsched.vllm.Scheduler.kv_cache_manager``, the read-only view of the core's KV cache under vLLM's names.

Needs vLLM (``pip install 'kvsched[vllm]'``); skipped otherwise. The differential driver (``tests/vllm_driver.py``)
runs vLLM's scheduler and kvsched's on identical calls; here every state check also reads both schedulers'
``kv_cache_manager`` the way vLLM's tests and tools do (request block tables, the pool's free count, usage and
reference counts, ``req_to_blocks``/``num_cached_block``, prefix lookups for probe requests, the prefix-cache
counters) and requires the same answers.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm_driver import Pair, compare, random_config

pytestmark = pytest.mark.vllm


def _probe(request: Any, extra: list[int]) -> Request:
    """A request that has not been added anywhere: ``request``'s tokens (and salt, adapter, hasher), then ``extra``."""
    return Request(
        request_id="probe",
        prompt_token_ids=[*request.all_token_ids, *extra],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=request.cache_salt,
        lora_request=request.lora_request,
        block_hasher=request._block_hasher,
    )


def compare_kv_views(when: str, a: Any, b: Any) -> None:
    """vLLM's scheduler ``a`` and kvsched's ``b`` answer the same through ``kv_cache_manager``."""
    ma, mb = a.kv_cache_manager, b.kv_cache_manager
    pa, pb = ma.block_pool, mb.block_pool
    compare(f"{when}: free blocks", pa.get_num_free_blocks(), pb.get_num_free_blocks())
    compare(f"{when}: free queue", pa.free_block_queue.num_free_blocks, pb.free_block_queue.num_free_blocks)
    compare(f"{when}: num_gpu_blocks", pa.num_gpu_blocks, pb.num_gpu_blocks)
    compare(f"{when}: usage", ma.usage, mb.usage)
    # The null block 0 is left out: vLLM 0.32 counts a window's references to it down below zero (0.33 does not
    # touch it); kvsched's is always 0.
    compare(f"{when}: ref counts", [blk.ref_cnt for blk in pa.blocks[1:]], [blk.ref_cnt for blk in pb.blocks[1:]])
    compare(f"{when}: null block ref count", pb.blocks[0].ref_cnt, 0)
    compare(f"{when}: num_kv_cache_groups", ma.num_kv_cache_groups, mb.num_kv_cache_groups)
    managers = zip(ma.coordinator.single_type_managers, mb.coordinator.single_type_managers, strict=True)
    for g, (sa, sb) in enumerate(managers):
        compare(f"{when}: group {g} block size", sa.block_size, sb.block_size)
        compare(f"{when}: group {g} id", sa.kv_cache_group_id, sb.kv_cache_group_id)
        # vLLM's req_to_blocks is a defaultdict: a read can leave an empty entry behind.
        holding_a = {rid: [blk.block_id for blk in blocks] for rid, blocks in sa.req_to_blocks.items() if blocks}
        holding_b = {rid: [blk.block_id for blk in blocks] for rid, blocks in sb.req_to_blocks.items()}
        compare(f"{when}: group {g} req_to_blocks", sorted(holding_a.items()), sorted(holding_b.items()))
        if ma.enable_caching:
            compare(
                f"{when}: group {g} num_cached_block",
                # vLLM adds a holder's entry once it hits or caches a block, and reads it with .get(req_id, 0).
                sorted((rid, sa.num_cached_block.get(rid, 0)) for rid in holding_a),
                sorted(sb.num_cached_block.items()),
            )
    for rid in a.requests:
        compare(f"{when}: {rid} block ids", ma.get_block_ids(rid), mb.get_block_ids(rid))
        compare(f"{when}: {rid} blocks", ma.get_blocks(rid).get_block_ids(), mb.get_blocks(rid).get_block_ids())
        n = a.requests[rid].num_computed_tokens
        compare(
            f"{when}: {rid} block ids for computed tokens",
            ma.get_block_ids_for_computed_tokens(rid, n),
            mb.get_block_ids_for_computed_tokens(rid, n),
        )
    stats_a, stats_b = ma.prefix_cache_stats, mb.prefix_cache_stats
    if stats_a is None or stats_b is None:
        compare(f"{when}: prefix_cache_stats", stats_a, stats_b)
    else:
        fields = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
        compare(
            f"{when}: prefix_cache_stats",
            [getattr(stats_a, f) for f in fields],
            [getattr(stats_b, f) for f in fields],
        )
    # Prefix lookups for requests that extend live ones (a whole block more, or one token).
    for rid in sorted(a.requests)[:3]:
        for extra in ([7] * sa.block_size, [11]):
            blocks_a, hit_a, _ = ma.get_computed_blocks(_probe(a.requests[rid], extra))
            blocks_b, hit_b, boundary_b = mb.get_computed_blocks(_probe(b.requests[rid], extra))
            compare(f"{when}: {rid} probe hit", hit_a, hit_b)
            compare(f"{when}: {rid} probe blocks", blocks_a.get_block_ids(), blocks_b.get_block_ids())
            assert boundary_b == 0


class _ViewPair(Pair):
    def check_state(self, when: str) -> None:
        super().check_state(when)
        compare_kv_views(when, self.a, self.b)


MODES = [(False, False), (True, False), (False, True)]


@pytest.mark.parametrize(("async_scheduling", "v2"), MODES, ids=["sync-v1", "async-v1", "sync-v2"])
@pytest.mark.parametrize("seed", range(4))
def test_the_view_answers_as_vllms_kv_cache_manager(async_scheduling: bool, v2: bool, seed: int) -> None:
    import random

    rng = random.Random(seed * 7919 + 17)
    cfg = random_config(rng, async_scheduling=async_scheduling, v2=v2)
    cfg.num_speculative_tokens = 0
    cfg.per_request_spec_decode_metrics = "none"
    _ViewPair(cfg, seed).run(60)


@pytest.mark.parametrize(("async_scheduling", "v2"), MODES, ids=["sync-v1", "async-v1", "sync-v2"])
@pytest.mark.parametrize("seed", range(2))
def test_the_view_answers_as_vllms_kv_cache_manager_with_several_groups(
    async_scheduling: bool, v2: bool, seed: int
) -> None:
    """A hybrid model (a full-attention group and sliding-window groups): every group's manager, block tables
    and blocks read the same as vLLM's."""
    import random

    from vllm_driver import random_groups

    rng = random.Random(seed * 7919 + 17)
    cfg = random_config(rng, async_scheduling=async_scheduling, v2=v2)
    cfg.num_speculative_tokens = 0
    cfg.per_request_spec_decode_metrics = "none"
    cfg.kv_cache_groups = random_groups(random.Random(f"groups/{seed}"), cfg.block_size)
    cfg.num_blocks = 1 + (cfg.num_blocks - 1) * len(cfg.kv_cache_groups)
    _ViewPair(cfg, seed).run(60)


def test_the_view_has_one_manager_per_group() -> None:
    cfg = make_vllm_config(block_size=4, num_blocks=64, max_model_len=64)
    pair = [make_scheduler(impl, cfg, kv_cache_groups=(None, 8, None)) for impl in ("vllm", "kvsched")]
    views = [s.kv_cache_manager for s in pair]
    view = views[1]
    assert view.num_kv_cache_groups == 3
    assert [m.kv_cache_group_id for m in view.coordinator.single_type_managers] == [0, 1, 2]
    assert view.coordinator.num_single_type_manager == 3
    assert view.get_block_ids("nobody") == ([], [], [])
    assert view.get_num_common_prefix_blocks("nobody") == [0, 0, 0]
    for s in pair:
        s.add_request(make_request("r0", list(range(3, 23)), max_tokens=4, block_size=4))
        _steps(s, 2)
    ids = view.get_block_ids("r0")
    assert ids == views[0].get_block_ids("r0")
    assert len(ids) == 3 and all(len(t) == 6 for t in ids)  # 21 slots: 6 blocks in each group
    assert ids[1][0] == 0 and ids[0][0] != 0  # the window of 8 tokens: its first block left it
    assert view.get_blocks("r0").get_block_ids() == ids
    assert view.get_block_ids_for_computed_tokens("r0", 9) == tuple(t[:3] for t in ids)
    # A lookup for a request that extends r0 by a block hits r0's cached blocks in every group.
    probe = [_probe(s.requests["r0"], [7] * 4) for s in pair]
    hits = [v.get_computed_blocks(p) for v, p in zip(views, probe, strict=True)]
    assert hits[1][0].get_block_ids() == hits[0][0].get_block_ids()
    assert hits[1][1] == hits[0][1] == 20  # five full blocks of 21 computed tokens
    assert hits[1][0].get_block_ids()[1][0] == 0


def _steps(sched: Any, n: int) -> None:
    for _ in range(n):
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[5]] * len(ids)
            ),
        )


def test_the_view_is_read_only_and_names_what_it_leaves_out() -> None:
    sched = make_scheduler("kvsched", make_vllm_config(block_size=16, num_blocks=64))
    view = sched.kv_cache_manager
    assert sched.kv_cache_manager is view  # one view per scheduler, live
    with pytest.raises(AttributeError, match=r"read-only view.*'allocate_slots'"):
        _ = view.allocate_slots
    with pytest.raises(AttributeError, match=r"read-only view.*'free_blocks'"):
        _ = view.block_pool.free_blocks
    with pytest.raises(AttributeError, match=r"read-only view.*'reset_prefix_cache' cannot be set"):
        view.reset_prefix_cache = None
    with pytest.raises(AttributeError, match="cannot be set"):
        view.block_pool.num_gpu_blocks = 1
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        _ = view.no_such_thing
    with pytest.raises(IndexError):
        _ = view.block_pool.blocks[64]
    assert view.block_pool.blocks[-1].block_id == 63
    assert [b.block_id for b in view.block_pool.blocks[2:5]] == [2, 3, 4]
    assert view.block_pool.null_block.is_null and view.block_pool.null_block.ref_cnt == 0
    assert view.get_block_ids("unknown") == ([],)
    assert "unknown" not in view.coordinator.single_type_managers[0].req_to_blocks


def test_the_view_follows_a_request_through_its_life() -> None:
    sched = make_scheduler("kvsched", make_vllm_config(block_size=16, num_blocks=64))
    view = sched.kv_cache_manager
    pool, manager = view.block_pool, view.coordinator.single_type_managers[0]
    free = pool.get_num_free_blocks()
    assert free == 63 and view.usage == 0.0
    sched.add_request(make_request("a", list(range(40)), max_tokens=4))
    assert "a" not in manager.req_to_blocks  # waiting: no blocks
    out = sched.schedule()
    stats = view.prefix_cache_stats  # the counters since the last make_stats: this admission's lookup
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 40, 0)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]]))
    assert view.prefix_cache_stats is not stats  # drained into the step's SchedulerStats, as vLLM's
    (ids,) = view.get_block_ids("a")
    assert len(ids) == 3 and pool.get_num_free_blocks() == free - 3
    assert [blk.block_id for blk in manager.req_to_blocks["a"]] == ids
    assert all(pool.blocks[b].ref_cnt == 1 for b in ids)
    assert manager.num_cached_block["a"] == 2  # the two full blocks of the prompt
    assert view.usage == pytest.approx(3 / 63)
    assert view.get_block_ids_for_computed_tokens("a", 20) == (ids[:2],)
    # A request with the same first 32 tokens would hit the two cached blocks.
    probe = make_request("p", [*range(32), 99])
    blocks, hit, _ = view.get_computed_blocks(probe)
    assert (hit, blocks.get_block_ids()) == (32, (ids[:2],))
    assert view.get_computed_blocks(probe, max_cache_hit_length=20)[1] == 16
    _steps(sched, 3)  # max_tokens reached: finished, blocks freed (and still cached)
    assert not sched.requests
    assert pool.get_num_free_blocks() == free and len(manager.req_to_blocks) == 0
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert view.get_computed_blocks(probe)[1] == 32
    sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)


def test_engine_core_reads_the_view_as_vllms() -> None:
    """EngineCore derives the attention block size and the KV cache group metadata from ``kv_cache_manager``
    and ``kv_cache_config``: with kvsched's scheduler it gets what it gets with vLLM's."""
    from vllm.v1.engine.core import EngineCore

    cfg = make_vllm_config(block_size=16, num_blocks=64)
    results = []
    for impl in ("vllm", "kvsched"):
        core = object.__new__(EngineCore)
        core.scheduler = make_scheduler(impl, cfg)
        core.vllm_config = cfg
        EngineCore._initialize_effective_attention_block_size(core)
        results.append((cfg.cache_config.effective_attention_block_size, EngineCore.get_kv_cache_group_metadata(core)))
    assert results[0] == results[1]
    assert results[1][0] == 16
