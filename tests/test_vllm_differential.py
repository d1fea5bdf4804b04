"""kvsched.vllm.Scheduler against vLLM 0.33's own Scheduler / AsyncScheduler, field by field, after every call.

Needs vLLM (``pip install '.[vllm]'``); skipped otherwise. The driver (``tests/vllm_driver.py``) gives
both schedulers identical requests and model outputs (seeded random: shared prefixes, tight pools that preempt,
EOS and stop ids, min tokens, cache salts, priorities, aborts, speculative decoding (n-gram and EAGLE drafters,
drafts, random acceptance), the async batch-queue pattern, V1 and V2 runner output formats, a KV connector) and
compares every field of every ``SchedulerOutput`` and ``EngineCoreOutputs``, every live request's state and block
table, and
the request counts and KV usage. The full sweep (200 seeds x 300 steps per mode) is ``-m slow`` or
``python tests/vllm_driver.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

from vllm_driver import run_seed

pytestmark = pytest.mark.vllm

MODES = [("sync", "v1"), ("sync", "v2"), ("async", "v1"), ("async", "v2")]


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(12))
def test_identical_to_vllm(sync: str, runner: str, seed: int) -> None:
    run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2")


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "k"), [(100, 1), (101, 2), (102, 4)])
def test_identical_to_vllm_with_speculative_decoding(sync: str, runner: str, seed: int, k: int) -> None:
    """n-gram drafting with k drafts per step in every run: drafts through update_draft_token_ids (sync),
    placeholders (async), random acceptance, padded new decodes, spec-decoding stats."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", num_speculative_tokens=k)
    assert cfg.num_speculative_tokens == k


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(400, 403))
def test_identical_to_vllm_with_streaming_input(
    sync: str, runner: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming-input sessions: parts appended while a streaming session runs, waits to run or waits for input, and
    inputs ended, compared after every call."""
    taken = _count_parts(monkeypatch)
    run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", streaming=True)
    assert taken  # some part was taken (the draws exercised sessions)


PP_MODES = [("sync", "v1"), ("sync", "v2"), ("async", "v2")]  # vLLM refuses async-v1 with pipeline parallelism


@pytest.mark.parametrize(("sync", "runner"), PP_MODES, ids=[f"{s}-{r}" for s, r in PP_MODES])
@pytest.mark.parametrize("seed", range(500, 503))
def test_identical_to_vllm_with_pipeline_parallelism(sync: str, runner: str, seed: int) -> None:
    """A pipeline-parallel size of 2-4, steps kept in flight as vLLM's engine keeps them (its batch queue):
    decodes staggered on model runner V2 with async scheduling, the sampled tokens sent back without it."""
    cfg = run_seed(seed, 100, async_scheduling=sync == "async", v2=runner == "v2", pp=True)
    assert cfg.pipeline_parallel_size > 1


def test_identical_to_vllm_with_pipeline_parallelism_and_tokens_for_a_prefill_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Synchronous pipeline parallelism where the runner returns tokens for a partial prefill while the request's
    next step is already in flight (vLLM's scheduler appends them): the request then holds more tokens than its
    steps in flight computed, and the blocks their sampled tokens fill (their hashes) no longer follow from the
    computed counts. Seed 89 draws this (V1 runner) and fills a block there by step 80. The driver draws such
    runner outputs on vLLM 0.33 only."""
    from kvsched.vllm import RULES
    from kvsched.vllm.scheduler import Scheduler

    if RULES.version == "0.32":
        pytest.skip("the driver draws tokens for a partial prefill on vLLM 0.33 only")

    marked: list[str] = []
    mark = Scheduler._mark_tokens_ahead

    def counted(self: Scheduler, req_id: str) -> None:
        marked.append(req_id)
        mark(self, req_id)

    monkeypatch.setattr(Scheduler, "_mark_tokens_ahead", counted)
    cfg = run_seed(89, 90, async_scheduling=False, v2=False, pp=True)
    assert cfg.pipeline_parallel_size > 1
    assert marked  # the draws exercised a request ahead of its steps in flight


# Sparse retention of cached sliding-window blocks (the KV cache config's prefix_cache_retention_interval, in
# blocks): dense (None), and vLLM's engine default 0.
RETENTIONS = [None, 0]


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(300, 303))
@pytest.mark.parametrize("retention", RETENTIONS)
def test_identical_to_vllm_with_a_sliding_window(sync: str, runner: str, seed: int, retention: int | None) -> None:
    """A model whose one KV cache group is a SlidingWindowSpec (a window drawn per seed, from one token to several
    blocks): out-of-window blocks freed at the same moments (after the steps in flight that read them), window
    prefix hits with null blocks, the same block tables and prefill stats; with the window's blocks retained
    densely and as vLLM's engine default retains them (only the runs a resend's hit needs)."""
    cfg = run_seed(
        seed, 120, async_scheduling=sync == "async", v2=runner == "v2", sliding_window=True, retention=retention
    )
    assert cfg.sliding_window is not None and cfg.prefix_cache_retention_interval == retention


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(400, 403))
def test_identical_to_vllm_with_draft_slots_and_a_token_budget(sync: str, runner: str, seed: int) -> None:
    """Parallel drafting (k - 1 query slots per scheduled request from max_num_batched_tokens) and, in some runs,
    max_num_scheduled_tokens below the input budget: the same tokens per request, step by step."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", budgets=True)
    assert cfg.num_speculative_tokens > 0


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(400, 403))
@pytest.mark.parametrize("retention", RETENTIONS)
def test_identical_to_vllm_with_several_kv_cache_groups(
    sync: str, runner: str, seed: int, retention: int | None
) -> None:
    """A hybrid model: full-attention and sliding-window KV cache groups (drawn per seed) in one pool, vLLM's
    HybridKVCacheCoordinator: one block list per group in every output, prefix hits valid for every group, the
    same block tables of every group and prefill stats; the windows' blocks retained densely and sparsely (vLLM's
    engine default: the runs a resend's hit and the shared-prefix junctions need)."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", hybrid=True, retention=retention)
    assert cfg.kv_cache_groups is not None and len(cfg.kv_cache_groups) >= 2
    assert cfg.prefix_cache_retention_interval == retention


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(600, 603))
def test_identical_to_vllm_with_mamba_groups(sync: str, runner: str, seed: int) -> None:
    """A hybrid Mamba model (Mamba groups first, around full attention, after it, beside a window; drawn per seed)
    with prefix caching off, vLLM's mamba_cache_mode "none": each request's state blocks (and speculative ones
    with drafts) at admission, the attention blocks each step allocates listed for zeroing, the same block tables
    of every group and preemptions."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", mamba=True)
    assert cfg.kv_cache_groups is not None and "mamba" in cfg.kv_cache_groups


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(650, 652))
def test_identical_to_vllm_with_align_mode_mamba_groups(sync: str, runner: str, seed: int) -> None:
    """The hybrid Mamba layouts in vLLM's mamba_cache_mode "align" with prefix caching off: block-sized state
    tables (null blocks between the states, speculative blocks moved forward) and block-aligned prefill chunks,
    the same outputs and block tables of every group."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", mamba=True, mamba_align=True)
    assert cfg.kv_cache_groups is not None and cfg.mamba_cache_mode == "align"


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", [1, 3])
@pytest.mark.parametrize("retention", [None, 0])
@pytest.mark.parametrize("checkpoints", [False, True], ids=["", "checkpoints"])
def test_identical_to_vllm_with_mamba_prefix_hits_inside_a_block(
    sync: str, runner: str, seed: int, retention: int | None, checkpoints: bool
) -> None:
    """Mamba prefix caching with a prefix-match unit below the block (vLLM's partial hash hits): hits ending on
    a unit boundary inside a block in the full-attention and Mamba groups, the blocks they end inside copied into
    private blocks (kv_cache_block_copies), each prompt's tail keyed inside a block (a Mamba state there moved to a
    copy before the request's next step), chunks stopped at that tail; the same outputs, block tables and copies.
    The cached Mamba states retained densely (None) and as vLLM's engine default (0), without and with prefill
    checkpoints (at a unit boundary). Both seeds draw a unit below the block and copy blocks."""
    import vllm_driver

    vllm_driver.PREFIX_HITS = vllm_driver.PARTIAL_BLOCK_HITS = vllm_driver.BLOCK_COPIES = 0
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        mamba=True,
        mamba_align=True,
        mamba_prefix_caching=True,
        mamba_retention=retention,
        mamba_checkpoints=checkpoints,
        hash_block_size=-1,
    )
    assert cfg.hash_block_size is not None and cfg.hash_block_size < cfg.block_size
    assert cfg.prefix_cache_retention_interval == retention
    assert vllm_driver.BLOCK_COPIES > 0, vllm_driver.BLOCK_COPIES


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("retention", [None, 0])
# 661 stalls in vLLM's own scheduler (identically) before any hit; 660's prefill threshold of one block leaves no
# room for a checkpoint inside a chunk.
@pytest.mark.parametrize(("checkpoints", "seed"), [(False, 660), (True, 663)], ids=["", "checkpoints"])
def test_identical_to_vllm_with_mamba_prefix_caching(
    sync: str, runner: str, seed: int, retention: int | None, checkpoints: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same layouts with prefix caching on (vLLM's default for hybrid Mamba models): Mamba prefix hits aligned
    with the attention groups', hits on states cached in the same step deferred, cached states and shared-prefix
    junction stops, the same outputs and block tables of every group; some admissions hit. The cached Mamba states
    retained densely (None) and as vLLM's engine default retains them (0: only the states a later request can
    resume at, the prompt's last boundary before its last token and the junctions): the same states cached, hits
    and prefill stats. With prefill checkpoints (Mamba2 and Gated DeltaNet layers: the last chunk exports a
    block-boundary state into an extra block), the same chunk splits, extra blocks and re-keyed states; vLLM's
    Mamba managers reserve some."""
    import vllm_driver
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    # vLLM's Mamba managers' prefill checkpoint reservations (a block allocated for one).
    reserved = [0]
    allocate = MambaManager.allocate_new_blocks

    def counting(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        reserved[0] += request_id in getattr(self, "_checkpoints", {})
        return allocate(self, request_id, *args, **kwargs)

    monkeypatch.setattr(MambaManager, "allocate_new_blocks", counting)

    vllm_driver.PREFIX_HITS = 0
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        mamba=True,
        mamba_align=True,
        mamba_prefix_caching=True,
        mamba_retention=retention,
        mamba_checkpoints=checkpoints,
    )
    assert cfg.kv_cache_groups is not None and cfg.enable_prefix_caching
    assert cfg.prefix_cache_retention_interval == retention
    assert vllm_driver.PREFIX_HITS > 0
    assert (cfg.mamba_checkpoint_alignment is not None) == checkpoints
    assert (reserved[0] > 0) == checkpoints, reserved


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", range(600, 603))
def test_identical_to_vllm_with_chunked_local_attention(sync: str, runner: str, seed: int) -> None:
    """A Llama 4-like model: full-attention and chunked-local KV cache groups (chunk sizes drawn per seed, some
    not a multiple of the block size, sometimes beside a sliding window), vLLM's ChunkedLocalAttentionManager:
    the blocks before a request's chunk freed at the same moments, chunked-local prefix hits with null blocks,
    the same block tables of every group and prefill stats."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", chunked_local=True)
    assert cfg.kv_cache_groups is not None and any(isinstance(g, str) for g in cfg.kv_cache_groups)


def test_a_chunked_local_hit_is_cut_to_its_chunks_start_as_vllm_cuts_it() -> None:
    """Side by side with vLLM's Scheduler: the chunked group's block 4 of a finished request left its chunk early
    (freed while it decoded) and another request evicted it; a request sharing 22 prompt tokens then hits 4 blocks
    (the chunk of token 20 starts at 16), not the 5 full-attention blocks, with null blocks in the chunked group."""
    from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
    from vllm_driver import step_pair

    cfg = make_vllm_config(block_size=4, num_blocks=21, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
    pair = [make_scheduler(impl, cfg, kv_cache_groups=(None, "chunked:8")) for impl in ("vllm", "kvsched")]
    prompt = list(range(100, 124))

    def add(req_id: str, tokens: list[int], max_tokens: int) -> None:
        for s in pair:
            s.add_request(make_request(req_id, tokens, max_tokens=max_tokens, block_size=4))

    add("a", prompt, 10)
    for _ in range(10):
        step_pair(pair)
    add("c", list(range(300, 316)), 1)
    for _ in range(2):
        step_pair(pair)
    add("b", [*prompt[:22], 99], 2)
    outs, _ = step_pair(pair)
    for out in outs:
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 16
        assert new.block_ids == ([1, 2, 3, 4, 8, 7], [0, 0, 0, 0, 16, 14])


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "dcp"), [(700, 2), (701, 4)])
def test_identical_to_vllm_with_decode_context_parallelism(sync: str, runner: str, seed: int, dcp: int) -> None:
    """Decode context parallelism: the scheduler's block (and the requests' hash block) is block_size * DCP tokens,
    so allocation counts, prefix hits and preemptions go by it, as vLLM's KV cache manager with
    dcp_world_size."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", dcp=dcp)
    assert cfg.decode_context_parallel_size == dcp


@pytest.mark.parametrize(("sync", "runner"), [("sync", "v1"), ("async", "v1")], ids=["sync-v1", "async-v1"])
def test_identical_to_vllm_with_a_kv_connector_under_decode_context_parallelism(sync: str, runner: str) -> None:
    """DCP 2 with the seeded RandomKVConnector (kv_both): loads, saves and delayed frees go by the block of
    block_size * DCP tokens, and a finished request hands the connector the blocks of its computed tokens counted
    in the spec's block size, as vLLM clips them (sync-v1 differs there at a request aborted after an empty
    output when counted in the scheduler's block)."""
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, dcp=2)
    assert cfg.decode_context_parallel_size == 2 and cfg.kv_connector_seed == 0


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "layout"), [(720, "one"), (721, "hybrid"), (722, "dcp")])
def test_identical_to_vllm_with_multi_head_latent_attention(sync: str, runner: str, seed: int, layout: str) -> None:
    """MLA models (DeepSeek, Kimi): MLAAttentionSpec groups (one, or beside SlidingWindowMLASpec windows in the
    hybrid layouts, or under DCP 2) schedule as vLLM's full-attention and sliding-window managers run them."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", mla=True,
                   hybrid=layout == "hybrid", dcp=2 if layout == "dcp" else 1)  # fmt: skip
    assert cfg.mla


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "layout"), [(5, "one"), (1, "hybrid"), (2, "mla"), (3, "mamba"), (1, "sized")])
def test_identical_to_vllm_with_compressor_rings(sync: str, runner: str, seed: int, layout: str) -> None:
    """Compressor rings (CircularBufferSpec, DeepSeek V4.1 / GLM-5 / Qwen4 / Step 5 style): one block per request,
    never cached or looked up, beside full attention (seed 5: the ring first, attention in bfloat16, so vLLM zeroes
    new attention blocks for the mixed precisions), a hybrid layout, MLA groups, and align-mode Mamba groups with
    prefix caching, and beside attention groups of different block sizes."""
    mamba = layout == "mamba"
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", ring=True,
                   hybrid=layout in ("hybrid", "sized"), mla=layout == "mla", mamba=mamba, mamba_align=mamba,
                   mamba_prefix_caching=mamba, group_block_factors=(-1,) if layout == "sized" else ())  # fmt: skip
    assert "ring" in (cfg.kv_cache_groups or ())
    if layout == "sized":
        assert len(set(cfg.group_block_sizes or ())) > 1
    if seed == 5:
        assert cfg.kv_cache_groups[0] == "ring" and cfg.mixed_precision  # type: ignore[index]


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(
    ("seed", "layout"),
    [(1, "hybrid"), (0, "connector"), (3, "ring"), (7, "sized"), (1, "first"), (3, "first"), (3, "first-eagle")],
)
def test_identical_to_vllm_with_bounded_prefix_replay(sync: str, runner: str, seed: int, layout: str) -> None:
    """DeepSeek V4.1's bounded prefix replay (SlidingWindowMLASpec with bounded_replay): the replayed windows are
    never cached or looked up, and a prefix hit recomputes its last window; beside full attention and other
    windows, with a KV connector whose loads restore the windows or not, beside compressor rings, and in DeepSeek
    V4.1's own order (a replayed window first, its blocks smaller than the hashed groups' or not dividing them;
    with an EAGLE drafter's prefix-cache rules). Each run replays at some admissions."""
    import vllm_driver

    before = vllm_driver.REPLAY_COUNTS["admissions replaying"]
    cfg = run_seed(seed, 150, async_scheduling=sync == "async", v2=runner == "v2", replay=True, hybrid=True,
                   connector=layout == "connector", ring=layout == "ring", replay_first=layout.startswith("first"),
                   eagle=layout == "first-eagle",
                   group_block_factors=(-1,) if layout == "sized" else ())  # fmt: skip
    assert any(str(g).startswith("replay:") for g in cfg.kv_cache_groups or ())
    if layout == "sized":
        assert len(set(cfg.group_block_sizes or ())) > 1
    if layout.startswith("first"):
        assert str(cfg.kv_cache_groups[0]).startswith("replay:")  # type: ignore[index]
        assert cfg.group_block_sizes is not None and cfg.group_block_sizes[0] != cfg.block_size
    assert vllm_driver.REPLAY_COUNTS["admissions replaying"] > before


V2_MODES = [("sync", "v2"), ("async", "v2")]  # vLLM runs prefill context parallelism on model runner V2 only


@pytest.mark.parametrize(("sync", "runner"), V2_MODES, ids=[f"{s}-{r}" for s, r in V2_MODES])
@pytest.mark.parametrize(("seed", "dcp"), [(710, 1), (711, 2)])
def test_identical_to_vllm_with_prefill_context_parallelism(sync: str, runner: str, seed: int, dcp: int) -> None:
    """Prefill context parallelism (PCP 2, alone or with DCP across it): vLLM's KV cache manager leaves PCP out of
    the block unit, and so does kvsched."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", dcp=dcp, pcp=2)
    assert cfg.prefill_context_parallel_size == 2


SYNC_MODES = [("sync", "v1"), ("sync", "v2")]


ENC_DEC_MODES = [("sync", "v1"), ("async", "v1")]  # kvsched.vllm refuses encoder-decoder models on model runner V2


@pytest.mark.parametrize(("sync", "runner"), ENC_DEC_MODES, ids=[f"{s}-{r}" for s, r in ENC_DEC_MODES])
@pytest.mark.parametrize("seed", [601, 604])  # seeds whose draws put the budget or the slots under pressure
def test_identical_to_vllm_with_an_encoder_decoder_model(
    sync: str, runner: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cross-attention KV cache group and encoder-decoder scheduling with a small encoder budget and
    EncoderDecoderCacheManager: admissions wait for the budget or the slots (vLLM's can_allocate says no), the
    slot counts are compared after every call."""
    from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager

    refused = []
    can_allocate = EncoderDecoderCacheManager.can_allocate

    def counting(self: Any, *args: Any) -> bool:
        ok = can_allocate(self, *args)
        refused.append(not ok)
        return ok

    monkeypatch.setattr(EncoderDecoderCacheManager, "can_allocate", counting)
    cfg = run_seed(seed, 150, async_scheduling=sync == "async", v2=runner == "v2", encoder_decoder=True)
    assert cfg.kv_cache_groups == (None, "cross")
    assert any(refused) and not all(refused)  # the budget or the slots held some admission back


@pytest.mark.parametrize(("sync", "runner"), SYNC_MODES, ids=[f"{s}-{r}" for s, r in SYNC_MODES])
@pytest.mark.parametrize("seed", range(200, 204))
def test_identical_to_vllm_with_a_kv_connector(sync: str, runner: str, seed: int) -> None:
    """A seeded RandomKVConnector on both sides (each scheduler builds its own through vLLM's KVConnectorFactory):
    sync and async loads, "ask later", loads finished late, failed whole or cut by invalid blocks (policy recompute
    or fail), aborts mid-load, delayed frees for sends. Every hook call (request state, blocks, unhashed blocks) is
    compared too."""
    cfg = run_seed(seed, 120, async_scheduling=False, v2=runner == "v2", connector=True)
    assert cfg.kv_connector_seed == seed


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", [0, 3])
def test_identical_to_vllm_with_simple_cpu_offload(sync: str, runner: str, seed: int) -> None:
    """vLLM's SimpleCPUOffloadConnector (eager offload) on both sides, its loads and stores reported over by a
    simulated worker: the connector's state and every GPU block's reference count, block hash and hashed token
    count are compared after every call too (the connector pins the blocks it copies through the block pool)."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", cpu_offload=True)
    assert cfg.cpu_offload_blocks


@pytest.mark.parametrize(("sync", "lazy"), [("sync", False), ("async", True)], ids=["sync-eager", "async-lazy"])
def test_identical_to_vllm_with_simple_cpu_offload_over_windows_and_groups(sync: str, lazy: bool) -> None:
    """SimpleCPUOffloadConnector over full attention and sliding windows in several KV cache groups (gpt-oss,
    Gemma 3 layouts drawn per seed): its per-group stores (a window's blocks that left it, from the GPU prefix
    cache), loads into every group, and every GPU block's reference count and block hash with its group, compared
    after every call."""
    import vllm_driver

    vllm_driver.OFFLOAD_COUNTS.clear()
    cfg = run_seed(1, 120, async_scheduling=sync == "async", v2=False, cpu_offload=True, lazy_offload=lazy,
                   hybrid=True)  # fmt: skip
    assert cfg.cpu_offload_blocks and cfg.kv_cache_groups and None in cfg.kv_cache_groups
    counts = vllm_driver.OFFLOAD_COUNTS
    assert counts["stored blocks (window)"] and counts["stored blocks (full attention)"], counts


@pytest.mark.parametrize("sync", ["sync", "async"])
def test_identical_to_vllm_with_simple_cpu_offload_over_mamba_groups(sync: str) -> None:
    """SimpleCPUOffloadConnector over align-mode Mamba groups with prefix caching (hybrid Mamba layouts drawn per
    seed): the Mamba states the scheduler hands it through the block state stored besides the attention blocks,
    loads into every group, compared after every call."""
    import vllm_driver

    vllm_driver.OFFLOAD_COUNTS.clear()
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=False, cpu_offload=True, mamba=True,
                   mamba_align=True, mamba_prefix_caching=True)  # fmt: skip
    assert cfg.cpu_offload_blocks and cfg.kv_cache_groups and "mamba" in cfg.kv_cache_groups
    counts = vllm_driver.OFFLOAD_COUNTS
    assert counts["boundary states stored"] and counts["stored blocks (Mamba)"] and counts["load events"], counts


@pytest.mark.parametrize(("sync", "runner"), [("sync", "v1"), ("async", "v2")], ids=["sync-v1", "async-v2"])
def test_identical_to_vllm_with_lazy_cpu_offload_and_kv_events(sync: str, runner: str) -> None:
    """SimpleCPUOffloadConnector's lazy mode (it walks the GPU free queue from a cursor) with KV cache events on:
    the connector's own events (blocks stored to and removed from its CPU pool) are published with the
    scheduler's and compared batch by batch, besides the pool and the connector's state."""
    cfg = run_seed(5, 120, async_scheduling=sync == "async", v2=runner == "v2", cpu_offload=True,
                   lazy_offload=True, kv_events=True)  # fmt: skip
    assert cfg.cpu_offload_lazy and cfg.kv_events


ASYNC_MODES = [("async", "v1"), ("async", "v2")]
ROLES = ["kv_producer", "kv_consumer", "kv_both"]


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "kv_role"), [(0, "kv_both"), (1, "kv_consumer")])
def test_identical_to_vllm_with_the_mooncake_store_connector(sync: str, runner: str, seed: int, kv_role: str) -> None:
    """vLLM's MooncakeStoreConnector on both sides, a stand-in store in place of the Mooncake store, its lookup
    server and workers (``MooncakeStandIn``): prefix lookups answered from the blocks its store jobs saved (some
    asynchronous), loads (some asynchronous, some with an invalid block), store jobs pinning their blocks through
    the block pool until reported. The connector's metadata, its state and its calls on the pool, and every GPU
    block's reference count and block hash are compared after every call too."""
    import vllm_driver

    vllm_driver.MOONCAKE_COUNTS.clear()
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", mooncake_store=True,
                   kv_role=kv_role)  # fmt: skip
    assert cfg.mooncake_store is not None and cfg.kv_role == kv_role
    counts = vllm_driver.MOONCAKE_COUNTS
    assert counts["lookups"] and counts["store jobs"]  # the draws reached the store both ways


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize(("seed", "kv_role"), [(9, "kv_both"), (6, "kv_consumer")])
def test_identical_to_vllm_with_the_umbp_store_connector(sync: str, runner: str, seed: int, kv_role: str) -> None:
    """vLLM 0.33's UMBPStoreConnector on both sides, a stand-in UMBP runtime registered with vLLM's
    UMBPRuntimeFactory and stand-in workers (``UMBPStandIn``): lookups answered from the objects its store events
    saved or another engine published (some failing, some asynchronous), asynchronous loads (some with invalid
    blocks), store events pinning their blocks through the block pool until reported (some jobs failing). The
    connector's metadata, its state and its calls on the pool, and every GPU block's reference count and block
    hash are compared after every call too."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp", reason="UMBP is vLLM 0.33's")
    import vllm_driver

    vllm_driver.UMBP_COUNTS.clear()
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", umbp_store=True, kv_role=kv_role)
    assert cfg.umbp_store is not None and cfg.kv_role == kv_role
    counts = vllm_driver.UMBP_COUNTS
    # The draws reached the store both ways: hits and loads, and (but for a consumer) store events.
    assert counts["lookups with a hit"] and counts["async loads"]
    assert bool(counts["store events"]) == (kv_role != "kv_consumer")


@pytest.mark.parametrize(("sync", "runner"), [("sync", "v1"), ("async", "v1")], ids=["sync-v1", "async-v1"])
@pytest.mark.parametrize("store", ["mooncake", "umbp"])
@pytest.mark.parametrize("layout", ["hybrid", "mamba"])
def test_identical_to_vllm_with_store_connectors_over_windows_and_groups(
    sync: str, runner: str, store: str, layout: str
) -> None:
    """MooncakeStoreConnector and UMBPStoreConnector with a hybrid model (full attention and sliding windows in
    several KV cache groups, drawn per seed) or a hybrid Mamba model with prefix caching (align-mode Mamba
    groups, their states stored through the boundary hand-offs): the stand-ins store and look up each group's
    blocks (a window's within its window, a Mamba group's states), loads fill every group, a failed load reports
    its request (``failed_recving``: block ids are not unique across groups); UMBP asks its local prefix-cache
    lookup for the local hit from inside the core's lookup. Metadata, connector state, pool calls and every GPU
    block are compared after every call."""
    import vllm_driver
    from kvsched.vllm import RULES

    if store == "umbp":
        pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp", reason="UMBP is vLLM 0.33's")
    counts = vllm_driver.MOONCAKE_COUNTS if store == "mooncake" else vllm_driver.UMBP_COUNTS
    counts.clear()
    seed = STORE_HYBRID_SEEDS[store, layout]
    mamba = {"mamba": True, "mamba_align": True, "mamba_prefix_caching": True} if layout == "mamba" else {}
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", hybrid=layout == "hybrid",
                   mooncake_store=store == "mooncake", umbp_store=store == "umbp", **mamba)  # fmt: skip
    assert cfg.kv_cache_groups and len(cfg.kv_cache_groups) > 1
    assert ("mamba" in cfg.kv_cache_groups) == (layout == "mamba")
    # The draws reached the store both ways, and (on vLLM 0.33; not in these steps on 0.32) a load failed.
    assert counts["lookups"] and (counts["loads"] or counts["async loads"]), counts
    assert counts["failed loads"] or RULES.version == "0.32", counts
    if store == "mooncake" and layout == "mamba":
        assert counts["boundary puts"], counts  # Mamba states stored through the boundary hand-offs


# Seeds whose first 120 steps load from the store, with a failed load on vLLM 0.33.
STORE_HYBRID_SEEDS = {("mooncake", "hybrid"): 2, ("umbp", "hybrid"): 2, ("mooncake", "mamba"): 3, ("umbp", "mamba"): 3}


@pytest.mark.parametrize(("sync", "runner"), [("sync", "v1"), ("async", "v2")], ids=["sync-v1", "async-v2"])
def test_identical_to_vllm_with_the_umbp_store_connector_and_kv_cache_events(sync: str, runner: str) -> None:
    """UMBPStoreConnector with KV cache events on: its events (objects stored once the runtime confirms them,
    removed when a recheck misses them or its worker reports them evicted) are published with the scheduler's and
    compared batch by batch."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp", reason="UMBP is vLLM 0.33's")
    import vllm_driver

    vllm_driver.UMBP_COUNTS.clear()
    run_seed(9, 120, async_scheduling=sync == "async", v2=runner == "v2", umbp_store=True, kv_events=True)
    assert vllm_driver.UMBP_COUNTS["evictions reported"]


@pytest.mark.parametrize(("sync", "kv_role"), [("sync", "kv_producer"), ("async", "kv_consumer"), ("async", "kv_both")])
def test_identical_to_vllm_with_streaming_input_and_a_kv_connector(
    sync: str, kv_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming-input sessions with the seeded RandomKVConnector: sessions asked about external tokens at their
    first admission and after a preemption, loads, and ``request_finished`` with the blocks of the tokens computed
    when the input ends."""
    taken = _count_parts(monkeypatch)
    run_seed(409, 150, async_scheduling=sync == "async", v2=False, connector=True, kv_role=kv_role, streaming=True)
    assert taken  # some part was taken (the draws exercised sessions)


@pytest.mark.parametrize(("sync", "runner"), ASYNC_MODES, ids=[f"{s}-{r}" for s, r in ASYNC_MODES])
@pytest.mark.parametrize("kv_role", ROLES)
@pytest.mark.parametrize("seed", range(210, 212))
def test_identical_to_vllm_with_a_kv_connector_and_batches_in_flight(
    sync: str, runner: str, kv_role: str, seed: int
) -> None:
    """The seeded RandomKVConnector in each role with async scheduling: block frees deferred behind the steps in
    flight (consumer roles), a preempted request's in-flight output dropped (producer roles), loads reported with
    the output of the step whose metadata started them or a later one."""
    cfg = run_seed(seed, 120, async_scheduling=True, v2=runner == "v2", connector=True, kv_role=kv_role)
    assert cfg.kv_role == kv_role


V1_MODES = [("sync", "v1"), ("async", "v1")]
# Seeds whose kv_consumer runs report invalid blocks of synchronous loads, with the policy each draws.
SYNC_INVALID_SEEDS = {2: "recompute", 7: "fail"}


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize("seed", SYNC_INVALID_SEEDS)
def test_identical_to_vllm_with_invalid_blocks_of_synchronous_loads(sync: str, runner: str, seed: int) -> None:
    """The seeded RandomKVConnector as a decode engine reports an invalid block among the loaded ones of some
    synchronous loads, with the output of the step that loaded them: vLLM rolls the running requests holding the
    block back (their output of that step dropped; policy fail: their blocks leave the prefix cache and they fail),
    and so does kvsched.vllm. The seeds draw both policies and report such blocks."""
    from kvsched.vllm import RULES
    from kvsched.vllm.testing import RandomKVConnector

    before = RandomKVConnector.num_sync_invalid_reported
    cfg = run_seed(
        seed, 150, async_scheduling=sync == "async", v2=False, connector=True, kv_role="kv_consumer", sync_invalid=True
    )
    if sync == "sync" or RULES.version != "0.32":  # (on vLLM 0.32 the asynchronous runs of these seeds draw none)
        assert RandomKVConnector.num_sync_invalid_reported > before
    assert cfg.kv_load_failure_policy == SYNC_INVALID_SEEDS[seed]


def test_identical_to_vllm_caching_at_updates_after_a_rollback_with_a_step_in_flight() -> None:
    """Async scheduling, seed 1: a request rolled back by an invalid block of its synchronous load while its next
    step was in flight keeps an output placeholder no step in flight accounts for; when its last token completes
    a block, vLLM 0.32 leaves that block uncached at the update (up to the computed tokens less the placeholders
    left) and vLLM 0.33 caches it (less the tokens in flight), which later admissions see (0.32: step 260). The
    run ends where vLLM's own scheduler stalls in the drain (kvsched stalls identically)."""
    from vllm_driver import VllmStopped

    try:
        run_seed(1, 300, async_scheduling=True, v2=False, connector=True, kv_role="kv_consumer", sync_invalid=True)
    except VllmStopped as exc:
        assert "stalls identically" in str(exc)


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize(("layout", "seed"), [("sliding_window", 7), ("hybrid", 3)])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_identical_to_vllm_with_a_kv_connector_loading_into_windows(
    sync: str, runner: str, layout: str, seed: int, kv_role: str
) -> None:
    """The seeded RandomKVConnector in the roles that load KV, on a sliding-window model and on a hybrid model
    (full attention and windows): loaded tokens before a window become null blocks, the full-sequence admission
    gate counts them as computed, and once an asynchronous load is over every group's loaded blocks enter the
    prefix cache from that group's own count; the connector gets every group's blocks, hashed as vLLM's are."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role=kv_role,
                   **{layout: True})  # fmt: skip
    assert cfg.kv_role == kv_role and (cfg.sliding_window is not None or cfg.kv_cache_groups is not None)


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize("align", [False, True], ids=["none", "align"])
def test_identical_to_vllm_with_a_kv_producer_on_mamba_groups(sync: str, runner: str, align: bool) -> None:
    """The seeded RandomKVConnector as a KV producer on a hybrid Mamba model, vLLM's mamba_cache_mode "none" and
    "align" (prefix caching off): the connector gets every group's blocks, the Mamba state blocks too, at each
    allocation and at the finish (in mode "align" after the states below the last processed token went back), and
    the blocks of a request held for a send come back as vLLM's do."""
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role="kv_producer",
                   mamba=True, mamba_align=align)  # fmt: skip
    assert cfg.kv_role == "kv_producer" and cfg.kv_cache_groups is not None and "mamba" in cfg.kv_cache_groups
    assert cfg.mamba_cache_mode == ("align" if align else "none")


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize("align", [False, True], ids=["none", "align"])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_identical_to_vllm_with_kv_loads_on_mamba_groups(
    sync: str, runner: str, align: bool, kv_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seeded RandomKVConnector in the roles that load KV on a hybrid Mamba model, vLLM's mamba_cache_mode
    "none" and "align" (prefix caching off): a load's Mamba state block is popped with the other groups' external
    blocks (mode "align": null blocks before it), the blocks an asynchronous load writes (every group, or the
    subset get_loaded_kv_cache_group_ids draws) stay out of new_block_ids_to_zero, an asynchronous load is admitted
    beside the Mamba blocks the in-flight prefills still need, and a failed load frees every group's blocks."""
    from kvsched.vllm.testing import RandomKVConnector

    answers: list[tuple[int, int]] = []  # (groups loaded, groups in all) of each asynchronous load's allocation
    loaded_groups = RandomKVConnector.get_loaded_kv_cache_group_ids

    def counted(self: Any, request: Any) -> tuple[int, ...]:
        groups = loaded_groups(self, request)
        answers.append((len(groups), self._num_groups))
        return groups

    monkeypatch.setattr(RandomKVConnector, "get_loaded_kv_cache_group_ids", counted)
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role=kv_role,
                   mamba=True, mamba_align=align)  # fmt: skip
    assert cfg.kv_role == kv_role and cfg.kv_cache_groups is not None and "mamba" in cfg.kv_cache_groups
    assert cfg.mamba_cache_mode == ("align" if align else "none")
    # Asynchronous loads were allocated on both sides (asked as often), some loading every group, some fewer.
    assert answers and len(answers) % 2 == 0
    assert any(n == total for n, total in answers) and any(n < total for n, total in answers)


@pytest.mark.parametrize(("sync", "kv_role"), [("sync", "kv_both"), ("async", "kv_consumer"), ("async", "kv_both")])
def test_identical_to_vllm_with_a_multi_connector(sync: str, kv_role: str) -> None:
    """The seeded RandomKVConnector as the second child of vLLM's MultiConnector, after a passive one, on both
    sides: the MultiConnector binds each child to the scheduler's KV cache manager (vLLM's, or kvsched's read-only
    view), asks every child for matches, gives the loading child the request's blocks and the other one none,
    and merges their finishes. Both children's calls are compared."""
    cfg = run_seed(230, 120, async_scheduling=sync == "async", v2=False, connector=True, kv_role=kv_role,
                   multi_connector=True)  # fmt: skip
    assert cfg.kv_connector_multi


@pytest.mark.parametrize(("sync", "runner"), ASYNC_MODES, ids=[f"{s}-{r}" for s, r in ASYNC_MODES])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_identical_to_vllm_with_deferred_async_loads(
    sync: str, runner: str, kv_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33's defer_async_loads set on both schedulers (consumer roles, async scheduling): asynchronous loads
    admitted while a step is in flight are registered with the connector once that step is processed, their
    connector stats recorded then, and an abort before that frees their blocks behind the steps in flight. On
    vLLM 0.32, which has no such gate, neither scheduler defers."""
    from kvsched.vllm import RULES
    from kvsched.vllm._connector import ConnectorBridge

    deferred: list[str] = []
    load_deferred = ConnectorBridge.load_deferred

    def counting(self: ConnectorBridge, req_id: str, *args: object) -> None:
        deferred.append(req_id)
        load_deferred(self, req_id, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ConnectorBridge, "load_deferred", counting)
    for seed in range(220, 222):
        run_seed(seed, 150, async_scheduling=True, v2=runner == "v2", connector=True, kv_role=kv_role,
                 defer_async_loads=True)  # fmt: skip
    assert bool(deferred) is RULES.defer_async_loads


def test_failed_loads_finish_in_vllms_set_order() -> None:
    """Requests failed by a KV load (policy "fail") are finished, and their outputs listed, in the iteration order
    of the set vLLM builds them in; with colliding string hashes that order depends on the order of insertion,
    so the adapter builds its sets the same way. Seed 28 has two failing in one step, and under hash seed 4 their
    hashes collide (found by the 100-seed connector sweep): run in a child process with that hash seed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONHASHSEED": "4", "PYTHONPATH": os.pathsep.join([str(here.parent / "python"), str(here)])}
    argv = ["--first-seed", "28", "--seeds", "1", "--steps", "300", "--modes", "sync-v1", "--connector"]
    proc = subprocess.run(
        [sys.executable, str(here / "vllm_driver.py"), *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1/1 seeds x 300 steps without a difference" in proc.stdout


def test_loads_cut_by_invalid_blocks_fail_in_vllms_queue_order() -> None:
    """Asynchronous loads that invalid blocks cut (policy "fail") go into vLLM's set in the order of its
    kv_holding_waiting queue (the order the loads began), not in the order of the adapter's own sets: seed 48 of
    the asynchronous sweep with synchronous invalid blocks has two in one step whose hashes collide under hash
    seed 0 (the outputs came in the other order); run in a child process with that hash seed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join([str(here.parent / "python"), str(here)])}
    argv = ["--first-seed", "48", "--seeds", "1", "--steps", "300", "--modes", "async-v1", "--connector"]
    argv += ["--sync-invalid", "--kv-roles", "kv_consumer"]
    proc = subprocess.run(
        [sys.executable, str(here / "vllm_driver.py"), *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1/1 seeds x 300 steps without a difference" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
def test_identical_to_vllm_full_sweep(sync: str, runner: str) -> None:
    for seed in range(200):
        run_seed(seed, 300, async_scheduling=sync == "async", v2=runner == "v2")


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("connector", [False, True], ids=["lookahead-hashes", "drop-with-connector"])
@pytest.mark.parametrize("seed", [500, 501])
def test_identical_to_vllm_with_eagle_prefix_cache_rules(sync: str, runner: str, connector: bool, seed: int) -> None:
    """An EAGLE drafter with vLLM's default prefix-cache rules: look-ahead block hashes on vLLM 0.33 without a KV
    connector, the trailing-block drop with one (and always on vLLM 0.32)."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=connector, eagle=True)
    assert cfg.eagle_block_drop


@pytest.mark.parametrize(("sync", "runner"), MODES, ids=[f"{s}-{r}" for s, r in MODES])
@pytest.mark.parametrize("seed", [0, 1])
def test_identical_to_vllm_with_a_dflash_drafter(sync: str, runner: str, seed: int) -> None:
    """A DFlash drafter: k + 1 lookahead slots for k drafts (a bonus query in its draft pass), vLLM's cap on the
    drafting requests; on vLLM 0.33 without EAGLE's prefix-cache rules, on 0.32 with them."""
    from kvsched.vllm import RULES
    from kvsched.vllm.testing import make_scheduler, make_vllm_config

    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", eagle=True, dflash=True)
    assert cfg.speculative_method == "dflash"
    vcfg = make_vllm_config(num_speculative_tokens=3, speculative_method="dflash", max_num_batched_tokens=64)
    assert vcfg.num_lookahead_tokens == 4
    assert vcfg.scheduler_config.max_num_active_seqs == (None if RULES.version == "0.32" else 16)
    assert make_scheduler("kvsched", vcfg).num_lookahead_tokens == 4


MTP_MODES = [("sync", "v1"), ("async", "v1")]


@pytest.mark.parametrize(("sync", "runner"), MTP_MODES, ids=[f"{s}-{r}" for s, r in MTP_MODES])
@pytest.mark.parametrize("layout", ["full", "window", "hybrid", "mamba"])
def test_identical_to_vllm_with_multi_module_mtp(sync: str, runner: str, layout: str) -> None:
    """A multi-module MTP drafter (2-4 modules): vLLM's prefill lookahead ends chunks before the prompt's end, keeps
    the reprefillable tail out of the prefix cache, and its windows keep the extra retained tokens; beside
    align-mode Mamba groups with prefix caching (Qwen3.5-style) too. On vLLM 0.32 a waiting request whose chunk the
    lookahead cuts to nothing ends the admission pass."""
    mamba = layout == "mamba"
    cfg = run_seed(
        600,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        mtp=True,
        sliding_window=layout == "window",
        hybrid=layout == "hybrid",
        mamba=mamba,
        mamba_align=mamba,
        mamba_prefix_caching=mamba,
    )
    assert cfg.multi_module_mtp and cfg.num_speculative_tokens > 1


def _count_parts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The streaming sessions kvsched.vllm hands a part to, in order (to check that the draws exercised them)."""
    from kvsched.vllm.scheduler import Scheduler

    taken: list[object] = []
    take_part = Scheduler._take_part

    def counted(self: Scheduler, session: object, part: object) -> None:
        taken.append(session)
        take_part(self, session, part)

    monkeypatch.setattr(Scheduler, "_take_part", counted)
    return taken


HASH_MODES = [("sync", "v1"), ("async", "v1")]


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize("seed", [800, 801])
def test_identical_to_vllm_with_hash_blocks_smaller_than_the_block(sync: str, runner: str, seed: int) -> None:
    """Several KV cache groups whose requests hash at a unit finer than the block (vLLM's hash_block_size, set
    through prefix_match_unit): both schedulers hash at that unit and every lookup and cached block goes by the
    hash of a block's last unit; prefix hits, evictions and preemptions are compared after every call."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", hybrid=True, hash_block_size=-1)
    assert cfg.hash_block_size is not None and cfg.block_size % cfg.hash_block_size == 0
    assert cfg.hash_block_size < cfg.block_size


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize(("seed", "factors"), [(900, (2,)), (901, (3,)), (902, (4,))])
def test_identical_to_vllm_with_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, seed: int, factors: tuple[int, ...]
) -> None:
    """Full-attention and sliding-window groups of different block sizes (vLLM's engine raises the block size of
    the groups with smaller pages): vLLM's scheduler runs at their least common multiple, both hash at the first
    group's block; every group's table, new blocks, aligned prefix hits and cached blocks are compared after every
    call."""
    cfg = run_seed(
        seed, 120, async_scheduling=sync == "async", v2=runner == "v2", hybrid=True, group_block_factors=factors
    )
    assert cfg.group_block_sizes is not None and len(set(cfg.group_block_sizes)) > 1


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize("seed", [3, 5])
def test_identical_to_vllm_with_the_larger_blocks_first(sync: str, runner: str, seed: int) -> None:
    """MiMo-V2's layout: the first group's blocks larger than another's (vLLM raised its block size, its pages
    being the smaller), so the group that hashes and holds the decoder's blocks in the core is a later one; prefix
    hits stay aligned to every group's blocks. Compared after every call."""
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        hybrid=True,
        group_block_factors=(-1,),
        first_group_factor=-1,
    )
    assert cfg.group_block_sizes is not None and cfg.group_block_sizes[0] > min(cfg.group_block_sizes)


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_identical_to_vllm_with_kv_connectors_the_drop_and_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, kv_role: str
) -> None:
    """The seeded RandomKVConnector beside an EAGLE drafter's trailing-block drop (vLLM's rule with a KV connector)
    over two windows of 3 tokens in blocks of 4 and full attention in blocks of 12: the blocks handed to the
    allocation hook carry the hashes vLLM's do, among them a full-attention block the request does not fill yet,
    cached by its prompt's tail entry; compared after every call."""
    cfg = run_seed(3, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role=kv_role,
                   hybrid=True, group_block_factors=(-1,), eagle=True, eagle_drop=True)  # fmt: skip
    assert cfg.kv_cache_groups == (3, 3, None) and cfg.group_block_sizes == (4, 4, 12) and cfg.eagle_block_drop


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize(("seed", "layout"), [(23, "hybrid"), (32, "hybrid"), (12, "window")])
def test_identical_to_vllm_with_the_trailing_block_drop_over_a_window_of_one_token(
    sync: str, runner: str, seed: int, layout: str
) -> None:
    """A window of one token caches no block, none being able to start a hit, but with an EAGLE drafter's
    trailing-block drop: its hit reads the block past the boundary, so vLLM caches the window's blocks (they go back
    to the pool's tail, and a later hit finds them). Seeds 23 and 32 lay a window of one token beside full
    attention and other windows, seed 12 has it as the model's one group."""
    cfg = run_seed(seed, 120, async_scheduling=sync == "async", v2=runner == "v2", eagle=True, eagle_drop=True,
                   hybrid=layout == "hybrid", sliding_window=layout == "window")  # fmt: skip
    assert (
        1 in (cfg.kv_cache_groups or (cfg.sliding_window,)) and cfg.eagle_block_drop and not cfg.lookahead_block_hashes
    )


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize(("rules", "seed"), [("lookahead", 3), ("lookahead", 6), ("drop", 3), ("drop", 5)])
def test_identical_to_vllm_with_eagle_rules_and_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, rules: str, seed: int
) -> None:
    """An EAGLE drafter's prefix-cache rules over groups of different block sizes (MiMo-V2 with its MTP layers):
    look-ahead hashes (each group caches the blocks of its own size whose hashes exist, and the prompt's tail entry
    in a larger full-attention block caches that block, which then goes back to the pool's tail) or the
    trailing-block drop (each group caches the block of its own size past the aligned prefix, a window's runs one
    block up); every call compared, the prefill stats' cached tokens among them."""
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        hybrid=True,
        group_block_factors=(-1,),
        eagle=True,
        eagle_drop=rules == "drop",
        eagle_lookahead=rules == "lookahead",
    )
    assert cfg.group_block_sizes is not None and len(set(cfg.group_block_sizes)) > 1
    assert cfg.eagle_block_drop and cfg.lookahead_block_hashes == (rules == "lookahead")


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize(("rules", "seed"), [("drop", 3), ("lookahead", 5)])
def test_identical_to_vllm_with_a_multi_module_mtp_drafter_and_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, rules: str, seed: int
) -> None:
    """A multi-module MTP drafter (vLLM's prefill lookahead of one token per module) over groups of different block
    sizes: with the trailing-block drop each group caches up to its block past the aligned finalised tokens (its
    reprefillable tail left out), with look-ahead hashes the aligned computed tokens (vLLM's hybrid coordinator);
    chunks never end within the lookahead; every call compared, the prefill stats' cached tokens among them."""
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        hybrid=True,
        group_block_factors=(-1,),
        mtp=True,
        eagle_drop=rules == "drop",
        eagle_lookahead=rules == "lookahead",
    )
    assert cfg.group_block_sizes is not None and len(set(cfg.group_block_sizes)) > 1 and cfg.multi_module_mtp
    assert cfg.lookahead_block_hashes == (rules == "lookahead")


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize(("seed", "factors"), [(908, (2,)), (912, (2,))])
def test_identical_to_vllm_with_kv_events_and_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, seed: int, factors: tuple[int, ...]
) -> None:
    """KV cache events with a window group first and full-attention groups of larger blocks: each group's stored
    runs at its own block size (hashes at its blocks' ends), the prompt-tail entries vLLM files inside a larger
    full-attention block and their removals, published batch by batch and compared event by event."""
    import vllm_driver

    vllm_driver.MAMBA_EVENT_COUNTS.clear()
    cfg = run_seed(
        seed,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        hybrid=True,
        group_block_factors=factors,
        kv_events=True,
    )
    counts = dict(vllm_driver.MAMBA_EVENT_COUNTS)
    vllm_driver.MAMBA_EVENT_COUNTS.clear()
    assert cfg.group_block_sizes is not None and len(set(cfg.group_block_sizes)) > 1 and cfg.kv_events
    assert counts.get("stored runs of larger blocks", 0) > 0 and counts.get("tail entries", 0) > 0, counts


@pytest.mark.parametrize(("sync", "runner"), HASH_MODES, ids=[f"{s}-{r}" for s, r in HASH_MODES])
@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_both"])
def test_identical_to_vllm_with_kv_connectors_and_kv_cache_groups_of_different_block_sizes(
    sync: str, runner: str, kv_role: str
) -> None:
    """The seeded RandomKVConnector over two windows of 3 tokens in blocks of 4 and full attention in blocks of 12
    (hits aligned to 12 tokens): each hook call gets every group's blocks, the windows' cached blocks only those
    an aligned hit can use (not a leading run of the table), each cached block's hash at its own block's end;
    loads, failed loads and delayed frees at each group's block size, compared after every call."""
    cfg = run_seed(
        3,
        120,
        async_scheduling=sync == "async",
        v2=runner == "v2",
        connector=True,
        kv_role=kv_role,
        hybrid=True,
        group_block_factors=(3,),
    )
    assert cfg.kv_cache_groups == (3, 3, None) and cfg.group_block_sizes == (4, 4, 12)


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_identical_to_vllm_with_kv_connectors_and_mamba_prefix_caching(
    sync: str, runner: str, kv_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seeded RandomKVConnector on a hybrid Mamba model with Mamba prefix caching (mamba_cache_mode "align",
    prefix caching on): each step's build_connector_meta gets the Mamba states cached since the last step
    (kv_connector_block_state's boundary_state_offloads, with the tables of the requests that have some, held
    ones too), and a load beside a local Mamba hit takes the state of the last loaded token, leaving the hit's
    state to the cache."""
    from kvsched.vllm.testing import RandomKVConnector

    seen = {"offered": 0, "hit_and_load": 0}
    build, matched = RandomKVConnector.build_connector_meta, RandomKVConnector.get_num_new_matched_tokens

    def counted_build(self: Any, scheduler_output: Any) -> Any:
        state = scheduler_output.kv_connector_block_state
        seen["offered"] += bool(state is not None and state.boundary_state_offloads)
        return build(self, scheduler_output)

    def counted_matched(self: Any, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        ext, is_async = matched(self, request, num_computed_tokens)
        seen["hit_and_load"] += bool(num_computed_tokens and ext)
        return ext, is_async

    monkeypatch.setattr(RandomKVConnector, "build_connector_meta", counted_build)
    monkeypatch.setattr(RandomKVConnector, "get_num_new_matched_tokens", counted_matched)
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role=kv_role,
                   mamba=True, mamba_align=True, mamba_prefix_caching=True)  # fmt: skip
    assert cfg.kv_role == kv_role and cfg.mamba_cache_mode == "align" and cfg.enable_prefix_caching
    assert seen["offered"] > 0, seen
    if kv_role == "kv_consumer":
        assert seen["hit_and_load"] > 0, seen


@pytest.mark.parametrize(("sync", "seed", "steps"), [("sync", 3, 40), ("async", 4, 140)])
def test_identical_to_vllm_with_kv_loads_and_mamba_prefill_checkpoints(sync: str, seed: int, steps: int) -> None:
    """The seeded RandomKVConnector (kv_both) on a hybrid Mamba model with Mamba prefix caching and prefill
    checkpoints (Qwen3-Next's and Nemotron-H's layers declare them): the full-sequence check of an admission with
    loaded tokens that end inside a block reserves no checkpoint block (the chunk after the load cannot export
    one; seed 3 admits such a load at step 15), and the blocks an asynchronous load leaves free for the in-flight
    prefills count their checkpoints from the tokens computed before the step (seed 4 admits one at step 135)."""
    cfg = run_seed(seed, steps, async_scheduling=sync == "async", v2=False, connector=True, kv_role="kv_both",
                   mamba=True, mamba_align=True, mamba_prefix_caching=True, mamba_checkpoints=True)  # fmt: skip
    assert cfg.mamba_checkpoint_alignment is not None and cfg.kv_connector_seed is not None


@pytest.mark.parametrize(("sync", "runner"), V1_MODES, ids=[f"{s}-{r}" for s, r in V1_MODES])
@pytest.mark.parametrize("kv_role", ["kv_consumer", "kv_both"])
def test_identical_to_vllm_with_a_connector_that_completes_divergent_local_hits(
    sync: str, runner: str, kv_role: str
) -> None:
    """The seeded RandomKVConnector claiming supports_divergent_local_hybrid_hits (as vLLM's NIXL and MoRI-IO do) on
    a hybrid Mamba model with Mamba prefix caching: a new request's local hit is looked up group by group; a
    full-attention hit deeper than the Mamba group's stands when the connector finds tokens past it and gives way
    to the hit both agree on when it finds none, in both schedulers alike."""
    from vllm_driver import DIVERGED_HITS

    DIVERGED_HITS.clear()
    cfg = run_seed(0, 120, async_scheduling=sync == "async", v2=runner == "v2", connector=True, kv_role=kv_role,
                   mamba=True, mamba_align=True, mamba_prefix_caching=True, divergent_hits=True)  # fmt: skip
    assert cfg.kv_connector_divergent_hits and cfg.enable_prefix_caching
    # vLLM's own scheduler had diverged hits, some kept (the connector found tokens), some replaced.
    assert 0 < DIVERGED_HITS["replaced"] < DIVERGED_HITS["diverged"], DIVERGED_HITS


def test_a_loaded_mamba_state_leaves_the_local_hit_below_it_free_as_vllm() -> None:
    """A preempted request resumes with a one-block local hit and one token loaded past it (align-mode Mamba, a
    window and full attention; kv_consumer, seed 44, step 25): its Mamba group pops a block its count leaves out
    (the load's state), and counts the local hit's state, which it never touches and which stays free. vLLM's pool
    holds exactly the blocks popped and touched, and vLLM admits the request: so must kvsched (it failed the
    allocation when it took the counted hit for a popped block)."""
    cfg = run_seed(44, 30, async_scheduling=False, v2=False, connector=True, kv_role="kv_consumer",
                   mamba=True, mamba_align=True, mamba_prefix_caching=True, divergent_hits=True)  # fmt: skip
    assert cfg.kv_cache_groups == ("mamba", 8, None) and cfg.mamba_cache_mode == "align"
