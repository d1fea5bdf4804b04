"""Build vLLM schedulers without a GPU, a model or the network: for tests, benchmarks and experiments.

``make_vllm_config`` writes a tiny Llama ``config.json`` (no weights, no tokenizer) to a temporary directory,
points vLLM's ``ModelConfig`` at it and sets the scheduler and cache fields; ``make_scheduler`` builds vLLM's own
``Scheduler``/``AsyncScheduler`` or ``kvsched.vllm.Scheduler`` on a hand-built ``KVCacheConfig`` with one
full-attention group, the way vLLM's engine core constructs its scheduler. Set ``VLLM_TARGET_DEVICE=cpu``
before vLLM is first imported on a machine without a GPU (importing ``kvsched.vllm`` imports vLLM).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, TypeGuard

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from kvsched.config import DEFAULT_BLOCK_SIZE

__all__ = [
    "TINY_LLAMA",
    "TINY_VOCAB_SIZE",
    "DeterministicExecutor",
    "RandomECConnector",
    "RandomKVConnector",
    "deterministic_token",
    "is_replay_group",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "request_block_hasher",
    "save_tiny_deepseek",
    "save_tiny_llama",
    "save_tiny_mimo_v2",
    "save_tiny_qwen3_next",
]

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# A tiny LLaVA (the tiny Llama with a CLIP vision tower of 56 px patches of 14: 16 tokens per image), with the
# image processor config vLLM's multimodal processor loads to size the encoder budget and cache.
TINY_LLAVA: dict[str, Any] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 31999,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "torch_dtype": "float32",
    "vocab_size": 32000,
    "text_config": {k: v for k, v in TINY_LLAMA.items() if k != "architectures"},
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 32,
    },
}
TINY_LLAVA_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "crop_size": {"height": 56, "width": 56},
    "size": {"shortest_edge": 56},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 1 / 255,
}

# vLLM's LLaVA processor needs a tokenizer that knows the image token: a word-level one with only the special
# tokens (schedulers never tokenize text).
_TINY_LLAVA_SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 31999}
TINY_LLAVA_TOKENIZER: dict[str, Any] = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in _TINY_LLAVA_SPECIAL.items()
    ],
    "normalizer": None,
    "pre_tokenizer": {"type": "WhitespaceSplit"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": _TINY_LLAVA_SPECIAL, "unk_token": "<unk>"},
}
TINY_LLAVA_TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}

_MODEL_DIRS: dict[tuple[int, bool], str] = {}


def _model_dir(max_model_len: int, multimodal: bool = False) -> str:
    path = _MODEL_DIRS.get((max_model_len, multimodal))
    if path is None:
        path = tempfile.mkdtemp(prefix="kvsched-vllm-model-")
        positions = max(max_model_len, 8192)
        config = dict(TINY_LLAMA, max_position_embeddings=positions)
        if multimodal:
            config = dict(TINY_LLAVA, text_config=dict(TINY_LLAVA["text_config"], max_position_embeddings=positions))
            for name, content in (
                ("preprocessor_config.json", TINY_LLAVA_PREPROCESSOR),
                ("tokenizer.json", TINY_LLAVA_TOKENIZER),
                ("tokenizer_config.json", TINY_LLAVA_TOKENIZER_CONFIG),
            ):
                with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                    json.dump(content, f)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        _MODEL_DIRS[(max_model_len, multimodal)] = path
    return path


def make_vllm_config(
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_blocks: int = 1024,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    scheduler_reserve_full_isl: bool = True,
    watermark: float = 0.0,
    max_loras: int = 0,
    max_num_active_seqs: int | None = None,
    long_prefill_token_threshold_adaptive: bool = False,
    prefill_schedule_interval: int = 1,
    num_speculative_tokens: int = 0,
    speculative_method: str = "ngram",
    per_request_spec_decode_metrics: str = "none",
    kv_connector_seed: int | None = None,
    kv_connector_sync_invalid: bool = False,
    kv_load_failure_policy: str = "recompute",
    kv_role: str = "kv_both",
    kv_connector_multi: bool = False,
    kv_connector_divergent_hits: bool = False,
    cpu_offload_blocks: int | None = None,
    cpu_offload_lazy: bool = False,
    kv_events: bool = False,
    multimodal: bool = False,
    disable_chunked_mm_input: bool = False,
    parallel_drafting: bool = False,
    eagle_block_drop: bool = False,
    lookahead_block_hashes: bool = True,
    multi_module_mtp: bool = False,
    max_num_scheduled_tokens: int | None = None,
    ec_connector_seed: int | None = None,
    ec_role: str = "ec_consumer",
    pipeline_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    mamba_cache_mode: str = "none",
    kv_transfer: dict[str, Any] | None = None,
) -> Any:
    """A ``VllmConfig`` for a model-less scheduler (CPU target, tiny Llama config; ``multimodal``: a tiny LLaVA,
    whose requests may carry images, with vLLM's ``disable_chunked_mm_input``). ``decode_context_parallel_size`` /
    ``prefill_context_parallel_size``: vLLM's DCP / PCP sizes, set on the built config (``block_size`` is then the
    per-rank block size: ``make_scheduler`` gives the scheduler ``block_size * dcp``,
    as vLLM's engine does, and requests hash blocks of that many tokens). ``num_speculative_tokens``
    > 0 adds a speculative config of ``speculative_method``: ``ngram``/``ngram_gpu``, or ``eagle`` (the tiny config
    as its draft model; ``eagle_block_drop``: vLLM's default prefix-cache rules for it, look-ahead block hashes
    or, with a KV connector (and on vLLM 0.32), the trailing-block drop; else ``disable_eagle_block_drop``;
    ``lookahead_block_hashes`` False: vLLM 0.33's ``disable_lookahead_block_hashes``, the drop then without a
    connector), or ``dflash`` (the same drafter taken for a DFlash one: ``k + 1`` lookahead slots, the drafting
    requests capped as vLLM's config caps them). ``multi_module_mtp`` (with ``eagle`` and
    ``num_speculative_tokens`` > 1): the drafter is a multi-module MTP one instead (method ``mtp``, one module per
    draft token: vLLM's ``num_prefill_lookahead_tokens`` is then ``num_speculative_tokens``).
    ``cpu_offload_blocks`` adds a ``kv_transfer_config`` for vLLM's ``SimpleCPUOffloadConnector`` (eager offload,
    lazy with ``cpu_offload_lazy``) with a CPU pool of that many blocks (``make_scheduler`` then gives the KV
    cache config its tensors); else ``kv_connector_seed`` adds a ``kv_transfer_config`` for
    :class:`RandomKVConnector` with that seed and role ``kv_role`` (``kv_producer``, ``kv_consumer``,
    ``kv_both``); with ``kv_connector_multi`` it is the second child of vLLM's ``MultiConnector``, whose first is
    a passive one (a :class:`RandomKVConnector` that finds no tokens and delays no free); with
    ``kv_connector_divergent_hits`` it (and the passive one) claims ``supports_divergent_local_hybrid_hits``.
    ``kv_events`` turns KV
    cache events on with vLLM's ``null`` publisher (replace the scheduler's ``kv_event_publisher`` to see the
    batches). ``parallel_drafting`` makes the drafter draft in parallel (vLLM's P-EAGLE layout: ``k - 1`` extra
    query slots per scheduled request, taken from ``max_num_batched_tokens``); ``max_num_scheduled_tokens`` sets
    vLLM's token budget apart from that input budget. ``ec_connector_seed`` adds an ``ec_transfer_config`` for
    :class:`RandomECConnector` with that seed and role ``ec_role``. ``kv_transfer``: the fields of a
    ``KVTransferConfig`` for any connector vLLM's factory knows, instead of the connectors above.
    ``pipeline_parallel_size`` > 1: vLLM's pipeline parallelism (its engine then keeps ``max_concurrent_batches``
    steps in flight; async scheduling is switched on after the config is built, as vLLM validates it against the
    model runner of the environment)."""
    from vllm.config import CacheConfig, ModelConfig, ObservabilityConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.config import SchedulerConfig as VllmSchedulerConfig

    model_dir = _model_dir(max_model_len, multimodal)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=not multimodal,  # vLLM's multimodal processors need the tokenizer
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = VllmSchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
        is_encoder_decoder=False,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl,
        async_scheduling=async_scheduling and pipeline_parallel_size == 1,
        watermark=watermark,
        max_num_active_seqs=max_num_active_seqs,
        long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
        prefill_schedule_interval=prefill_schedule_interval,
        disable_chunked_mm_input=disable_chunked_mm_input,
        max_num_scheduled_tokens=max_num_scheduled_tokens,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo="sha256",
        cache_dtype="auto",
    )
    cache_config.num_gpu_blocks = num_blocks
    # vLLM's Mamba cache mode ("align": block-sized Mamba state blocks, block-aligned prefill chunks), as
    # --mamba-cache-mode sets it.
    cache_config.mamba_cache_mode = mamba_cache_mode
    lora_config = None
    if max_loras:
        from vllm.config import LoRAConfig

        lora_config = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
    speculative_config = None
    if num_speculative_tokens and speculative_method in ("eagle", "dflash"):
        # An EAGLE drafter (k lookahead slots) on the same tiny config, with vLLM's default prefix-cache rules for
        # it or without them. "dflash": the same drafter taken for a DFlash one (set below).
        from vllm.config import ParallelConfig

        speculative_config = SpeculativeConfig(
            method="eagle",
            # (A multimodal target drafts with the tiny text model: vLLM sizes a drafter from its text config.)
            model=_model_dir(max_model_len) if multimodal else model_dir,
            num_speculative_tokens=num_speculative_tokens,
            disable_eagle_block_drop=not eagle_block_drop,
            parallel_drafting=parallel_drafting,
            # (vLLM 0.32 has no look-ahead hashes, nor this field.)
            **({} if lookahead_block_hashes else {"disable_lookahead_block_hashes": True}),
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
        if multi_module_mtp:
            # The same tiny draft model with one MTP module per draft token (vLLM reads the count from its config).
            speculative_config.method = "mtp"
            speculative_config.draft_model_config.hf_config.num_nextn_predict_layers = num_speculative_tokens
    elif num_speculative_tokens:
        speculative_config = SpeculativeConfig(
            method=speculative_method,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=num_speculative_tokens,
            prompt_lookup_min=1,
            parallel_drafting=parallel_drafting,
        )
    kv_transfer_config = None
    if kv_transfer is not None:
        from vllm.config import KVTransferConfig

        kv_transfer_config = KVTransferConfig(**kv_transfer)
    elif cpu_offload_blocks is not None:
        from vllm.config import KVTransferConfig

        # vLLM's SimpleCPUOffloadConnector (eager offload) with a CPU pool of that many blocks (the kv_cache_tensors
        # make_scheduler builds with it size one block of the tiny spec at 8 bytes per token).
        kv_transfer_config = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": cpu_offload_blocks * 8 * block_size,
                "lazy_offload": cpu_offload_lazy,
            },
        )
    elif kv_connector_seed is not None:
        from vllm.config import KVTransferConfig

        child = {
            "kv_connector": "RandomKVConnector",
            "kv_connector_module_path": __name__,
            "kv_role": kv_role,
            "kv_connector_extra_config": {
                "seed": kv_connector_seed,
                "sync_invalid": kv_connector_sync_invalid,
                "divergent_hits": kv_connector_divergent_hits,
            },
        }
        if kv_connector_multi:
            passive_extra = {"seed": kv_connector_seed, "passive": True, "divergent_hits": kv_connector_divergent_hits}
            passive = {**child, "kv_connector_extra_config": passive_extra}
            kv_transfer_config = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role=kv_role,
                kv_load_failure_policy=kv_load_failure_policy,
                kv_connector_extra_config={"connectors": [passive, child]},
            )
        else:
            kv_transfer_config = KVTransferConfig(**child, kv_load_failure_policy=kv_load_failure_policy)
    kv_events_config = None
    if kv_events:
        from vllm.config import KVEventsConfig

        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    ec_transfer_config = None
    if ec_connector_seed is not None:
        from vllm.config import ECTransferConfig

        ec_transfer_config = ECTransferConfig(
            ec_connector="RandomECConnector",
            ec_connector_module_path=__name__,
            ec_role=ec_role,
            ec_connector_extra_config={"seed": ec_connector_seed},
        )
    vllm_config = VllmConfig(
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        ec_transfer_config=ec_transfer_config,
        kv_events_config=kv_events_config,
        kv_transfer_config=kv_transfer_config,
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        lora_config=lora_config,
        speculative_config=speculative_config,
        observability_config=ObservabilityConfig(per_request_spec_decode_metrics=per_request_spec_decode_metrics),
    )
    # The CPU platform turns async scheduling off: switch it back on to exercise the async path.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # Context parallelism, set on the built config as vLLM's KV cache manager tests set it (the tiny model's KV
    # heads would need more tensor-parallel ranks than DCP for vLLM's config checks; the scheduler reads only
    # the two sizes).
    vllm_config.parallel_config.decode_context_parallel_size = decode_context_parallel_size
    vllm_config.parallel_config.prefill_context_parallel_size = prefill_context_parallel_size
    if speculative_config is not None and speculative_method == "dflash":
        # A DFlash drafter needs its own draft model; the EAGLE one stands in, taken for DFlash once the config is
        # built: k + 1 lookahead slots (a bonus query and one per draft), and, as vLLM 0.33's config does for
        # DFlash (0.32's does not), no more drafting requests than the token budget holds draft passes of k + 1
        # queries.
        from ._compat import RULES

        speculative_config.method = "dflash"
        sched = vllm_config.scheduler_config
        most = sched.max_num_batched_tokens // vllm_config.num_lookahead_tokens
        if RULES.version != "0.32" and most < (sched.max_num_active_seqs or sched.max_num_seqs):
            sched.max_num_active_seqs = most
    return vllm_config


def _kv_cache_config(
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
    kv_cache_groups: Sequence[int | str | None] | None = None,
    max_model_len: int = 0,
    num_speculative_tokens: int = 0,
    mamba_align: bool = False,
    with_tensors: bool = False,
    prefix_cache_retention_interval: int | None = None,
    mamba_prefill_checkpoint_alignment: int | None = None,
    group_block_sizes: Sequence[int] | None = None,
    eagle_groups: Sequence[int] = (),
    extra_retained_tokens: int = 0,
    mla: bool = False,
    ring_block_size: int = 8,
    tokens_per_state: int = 1,
    mixed_precision: bool = False,
) -> Any:
    """One KV cache group (full attention, or ``sliding_window``), or one group per entry of ``kv_cache_groups``
    (None: full attention, an int: a sliding window of that many tokens, ``"replay:<w>"``: a sliding window
    of ``w`` tokens rebuilt by bounded prefix replay (DeepSeek V4.1's ``SlidingWindowMLASpec`` with
    ``bounded_replay``), ``"chunked:<c>"``: chunked-local attention in chunks of ``c`` tokens, ``"cross"``: cross
    attention, ``"ring"``: a compressor's ring buffer
    (``CircularBufferSpec``, a ring of ``ring_block_size`` rows), ``"mamba"``: a Mamba group as vLLM builds it
    without prefix caching: ``mamba_cache_mode`` "none", a block of ``max_model_len`` tokens, a speculative state
    block per draft token; with ``mamba_align``, ``mamba_cache_mode`` "align" and blocks of ``block_size``
    tokens); groups of one kind share one spec. ``prefix_cache_retention_interval``: the config's (vLLM's engine
    copies the cache config's there; None: dense). ``mamba_prefill_checkpoint_alignment``: the Mamba groups declare
    a prefill checkpoint block with this alignment (Mamba2 and Gated DeltaNet layers in mode "align"; None: none).
    ``group_block_sizes``: each attention group's block size (a model whose groups' pages differ, after vLLM's
    engine raised the smaller page's block size; None: ``block_size`` for every group).
    ``eagle_groups``: the groups marked as holding an EAGLE/MTP drafter's layers (``is_eagle_group``).
    ``extra_retained_tokens``: the windows keep that many tokens below them (vLLM's engine sets
    ``num_prefill_lookahead_tokens - 1`` on every window). ``mla``: the full-attention and sliding-window groups are
    multi-head latent attention's (``MLAAttentionSpec``, ``SlidingWindowMLASpec``: DeepSeek and Kimi models).
    ``tokens_per_state``: the full-attention groups store one state per that many tokens (compressed attention:
    DeepSeek V4.1, Step 5); it must divide the prefix-hit alignment. ``mixed_precision``: the attention groups
    store bfloat16, the rings float32 (vLLM then zeroes new attention blocks)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    full_spec, window_spec = (MLAAttentionSpec, SlidingWindowMLASpec) if mla else (FullAttentionSpec, SlidingWindowSpec)
    dtype = torch.bfloat16 if mixed_precision else torch.float32

    def spec(window: int | str | None, block_size: int = block_size) -> Any:
        if window == "ring":
            return CircularBufferSpec(
                block_size=ring_block_size, num_kv_heads=1, head_size=1, head_size_v=0, dtype=torch.float32
            )
        if window == "cross":
            return CrossAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        if window == "mamba":
            checkpoints: dict[str, Any] = {}
            if mamba_prefill_checkpoint_alignment is not None:
                checkpoints = {
                    "num_prefill_checkpoint_blocks": 1,
                    "prefill_checkpoint_alignment": mamba_prefill_checkpoint_alignment,
                }
            return MambaSpec(
                block_size=block_size if mamba_align else max_model_len,
                shapes=((1,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align" if mamba_align else "none",
                num_speculative_blocks=num_speculative_tokens,
                **checkpoints,
            )
        if window is None:
            compressed = {"tokens_per_state": tokens_per_state} if tokens_per_state > 1 else {}
            return full_spec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=dtype, **compressed)
        if is_replay_group(window):
            # DeepSeek V4.1's sliding window rebuilt by bounded prefix replay (never prefix cached).
            return SlidingWindowMLASpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=dtype,
                sliding_window=int(window.removeprefix("replay:")),
                extra_retained_tokens=extra_retained_tokens,
                bounded_replay=True,
            )
        if isinstance(window, str) and window.startswith("chunked:"):
            return ChunkedLocalAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=1,
                dtype=dtype,
                attention_chunk_size=int(window.removeprefix("chunked:")),
            )
        return window_spec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=dtype,
            sliding_window=window,
            extra_retained_tokens=extra_retained_tokens,
        )

    windows = [sliding_window] if kv_cache_groups is None else list(kv_cache_groups)
    sizes = list(group_block_sizes) if group_block_sizes is not None else [block_size] * len(windows)
    groups = [KVCacheGroupSpec([f"layer{g}"], spec(w, sizes[g])) for g, w in enumerate(windows)]
    for g in eagle_groups:
        groups[g].is_eagle_group = True
    tensors = []
    if with_tensors:
        # One backing allocation per layer, as a worker would build it (a connector that sizes a CPU pool from the
        # GPU one reads it): the tiny specs' page is 8 bytes per token (K and V, one float32 each).
        from vllm.v1.kv_cache_interface import KVCacheTensor

        page = 8 * block_size
        tensors = [
            KVCacheTensor(
                size=num_blocks * page, layers=[f"layer{g}"], layer_stride=num_blocks * page, block_stride=page
            )
            for g in range(len(groups))
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
    )


def is_replay_group(window: object) -> TypeGuard[str]:
    """Whether a ``kv_cache_groups`` entry of ``make_scheduler`` is a window rebuilt by bounded prefix replay
    (``"replay:<w>"``)."""
    return isinstance(window, str) and window.startswith("replay:")


def make_scheduler(
    impl: str,
    vllm_config: Any,
    *,
    use_v2_model_runner: bool = False,
    log_stats: bool = True,
    include_finished_set: bool = False,
    sliding_window: int | None = None,
    kv_cache_groups: Sequence[int | str | None] | None = None,
    prefix_cache_retention_interval: int | None = None,
    mamba_prefill_checkpoint_alignment: int | None = None,
    hash_block_size: int | None = None,
    group_block_sizes: Sequence[int] | None = None,
    eagle_groups: Sequence[int] = (),
    mla: bool = False,
    ring_block_size: int = 8,
    tokens_per_state: int = 1,
    mixed_precision: bool = False,
) -> Any:
    """``impl``: ``"vllm"`` (vLLM's own class for the config's async setting) or ``"kvsched"``.
    ``sliding_window``: the model's one KV cache group is a ``SlidingWindowSpec`` of that many tokens (default:
    full attention). ``kv_cache_groups``: a hybrid model instead, one KV cache group per entry (None: full
    attention, an int: a sliding window of that many tokens, ``"chunked:<c>"``: chunked-local attention in chunks
    of ``c`` tokens, ``"cross"``: cross attention, ``"mamba"``: a Mamba group in mode "none", which needs prefix
    caching off), in that order. ``prefix_cache_retention_interval``: the KV cache config's (vLLM's sparse
    retention of cached Mamba and sliding-window states; None: dense). ``mamba_prefill_checkpoint_alignment``: the
    Mamba groups (mode "align") declare prefill checkpoints of this alignment (vLLM 0.33's Mamba2 and Gated DeltaNet
    layers; None: none). ``hash_block_size``: the granularity of the requests' block hashes (vLLM's
    ``prefix_match_unit``; a divisor of the block size, with several groups; None: the scheduler block size).
    ``group_block_sizes``: each KV cache group's block size (groups whose pages differ); the scheduler block size is
    then their least common multiple and the requests' hash block their greatest common divisor with prefix caching
    or a KV connector, the scheduler block size otherwise (vLLM's ``resolve_kv_cache_block_sizes``).
    ``eagle_groups``: the KV cache groups marked as an EAGLE/MTP drafter's (``is_eagle_group``, which vLLM's
    planner sets on the groups holding draft layers; none marked: vLLM treats every group as the drafter's).
    ``mla``: the attention groups are multi-head latent attention's (DeepSeek, Kimi: ``MLAAttentionSpec``, and
    ``SlidingWindowMLASpec`` for windows). ``"ring"`` groups are compressor rings (``CircularBufferSpec``) of
    ``ring_block_size`` rows, which enter the scheduler block size's least common multiple as vLLM's engine counts
    them; ``tokens_per_state`` compresses the full-attention groups; ``mixed_precision`` stores the attention groups
    in bfloat16 beside the rings' float32 (see ``_kv_cache_config``).

    ``use_v2_model_runner`` picks the output format of the model runner the scheduler serves (vLLM reads it
    from ``VLLM_USE_V2_MODEL_RUNNER`` when the scheduler is built; it is set for the construction only).
    """
    from vllm.v1.structured_output import StructuredOutputManager

    if impl == "vllm":
        if vllm_config.scheduler_config.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as cls
    elif impl == "kvsched":
        from kvsched.vllm import Scheduler as cls
    else:
        raise ValueError(f"impl must be 'vllm' or 'kvsched', got {impl!r}")
    block_size = vllm_config.cache_config.block_size
    max_model_len = int(vllm_config.model_config.max_model_len)
    # vLLM's engine gives the scheduler its block size times the DCP size (one block id covers a block on every
    # DCP rank; resolve_kv_cache_block_sizes), the KV cache specs keep the per-rank size; with a Mamba group, the
    # least common multiple of the groups' block sizes (a Mamba group's block holds max_model_len tokens).
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    scheduler_block_size = block_size * dcp
    # (vLLM's mamba_cache_mode "align": the Mamba block is the attention block.)
    mamba_align = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align"
    if "mamba" in (kv_cache_groups or ()) and not mamba_align:
        scheduler_block_size = math.lcm(scheduler_block_size, max_model_len)
    if "ring" in (kv_cache_groups or ()):
        scheduler_block_size = math.lcm(scheduler_block_size, ring_block_size)
    if group_block_sizes is not None:
        scheduler_block_size = math.lcm(*group_block_sizes)
        if hash_block_size is None:
            hashing = vllm_config.cache_config.enable_prefix_caching or vllm_config.kv_transfer_config is not None
            # (vLLM's hash block: the greatest common divisor of the groups that take part in prefix caching, not
            # a window rebuilt by bounded replay.)
            hashed = [
                z for z, w in zip(group_block_sizes, kv_cache_groups or (), strict=True) if not is_replay_group(w)
            ]
            hash_block_size = math.gcd(*hashed) if hashing else scheduler_block_size
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if use_v2_model_runner else "0"
    try:
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=_kv_cache_config(
                vllm_config.cache_config.num_gpu_blocks,
                block_size,
                sliding_window,
                kv_cache_groups,
                max_model_len,
                int(getattr(vllm_config, "num_speculative_tokens", 0) or 0),
                mamba_align,
                with_tensors=_offloads_to_cpu(vllm_config),
                prefix_cache_retention_interval=prefix_cache_retention_interval,
                mamba_prefill_checkpoint_alignment=mamba_prefill_checkpoint_alignment,
                group_block_sizes=group_block_sizes,
                eagle_groups=eagle_groups,
                # As vLLM's engine tags the windows for a multi-module MTP drafter.
                extra_retained_tokens=max(0, int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) - 1),
                mla=mla,
                ring_block_size=ring_block_size,
                tokens_per_state=tokens_per_state,
                mixed_precision=mixed_precision,
            ),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=scheduler_block_size,
            hash_block_size=scheduler_block_size if hash_block_size is None else hash_block_size,
            include_finished_set=include_finished_set,
            log_stats=log_stats,
        )
    finally:
        if saved is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved


def _offloads_to_cpu(vllm_config: Any) -> bool:
    """Whether the config's KV connector is SimpleCPUOffloadConnector, or a MultiConnector with it as a child."""
    kv = vllm_config.kv_transfer_config
    if kv is None:
        return False
    children = (kv.kv_connector_extra_config or {}).get("connectors", ())
    names = {kv.kv_connector, *(c.get("kv_connector") for c in children)}
    return "SimpleCPUOffloadConnector" in names


_HASHERS: dict[tuple[int, int], Callable[[Any], Any]] = {}


def request_block_hasher(block_size: int, hash_lookahead_tokens: int = 0) -> Callable[[Any], Any]:
    """The request block hasher vLLM's engine core gives each ``Request`` (SHA-256; with vLLM 0.33's look-ahead
    block hashes when ``hash_lookahead_tokens``, the engine's ``num_hash_lookahead_tokens``, is not 0)."""
    hasher = _HASHERS.get((block_size, hash_lookahead_tokens))
    if hasher is None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        args = (hash_lookahead_tokens,) if hash_lookahead_tokens else ()
        hasher = get_request_block_hasher(block_size, hash_fn, *args)
        _HASHERS[block_size, hash_lookahead_tokens] = hasher
    return hasher


def make_request(
    req_id: str,
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int = 16,
    min_tokens: int = 0,
    eos_token_id: int | None = None,
    stop_token_ids: Sequence[int] = (),
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    prompt_logprobs: int | None = None,
    client_index: int = 0,
    images: Sequence[tuple[int, int, str]] = (),
    resumable: bool = False,
    hash_lookahead_tokens: int = 0,
) -> Any:
    """A vLLM ``Request`` as the engine core builds it (block hasher attached, EOS set as the frontend does);
    ``client_index`` is the front-end process the request came from (its outputs are grouped by it); ``images``:
    its multimodal inputs as ``(offset, length, identifier)``, sorted by offset (the data is a dummy: no
    scheduler reads it); ``resumable``: a streaming-input session, or for the id of a live one its next part (a
    request of that id that is not resumable ends its input); ``hash_lookahead_tokens``: the engine's
    ``num_hash_lookahead_tokens`` (look-ahead block hashes, vLLM 0.33)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    mm_features = None
    if images:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

        mm_features = [
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                mm_position=PlaceholderRange(offset=offset, length=length),
                identifier=identifier,
                modality="image",
            )
            for offset, length, identifier in images
        ]

    # Prompt logprobs make vLLM skip reading the prefix cache for the request (SamplingParams sets the flag).
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_token_ids),
        prompt_logprobs=prompt_logprobs,
    )
    if eos_token_id is not None:
        params.update_from_generation_config({}, eos_token_id)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        lora_request=_lora_request(lora_name),
        block_hasher=request_block_hasher(block_size, hash_lookahead_tokens),
        client_index=client_index,
        mm_features=mm_features,
        resumable=resumable,
    )


def _lora_request(name: str | None) -> Any:
    """A LoRA request for ``name`` (ids are stable per name; the path is never read by a scheduler)."""
    if name is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1 + sum(map(ord, name)), f"/nonexistent/{name}")


class RandomECConnector(ECConnectorBase):  # type: ignore[misc]  # vLLM is untyped here
    """A scheduler-role encoder-cache connector whose answers are a seeded function of what it is asked: it holds
    the encoder outputs of about half the identifiers (``has_cache_item``), and says a request's outputs are still
    in transit (``ensure_cache_available``) for about one ask in five. It transfers nothing. Two instances with the
    same seed, asked the same things in the same order, answer the same; ``calls`` logs every scheduler-side call
    with its arguments, and its metadata is the identifiers allocated since the last step (each with whether it
    holds it), so the differential tests can compare vLLM's scheduler and kvsched's call for call."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config, role)
        self.seed = int(vllm_config.ec_transfer_config.ec_connector_extra_config.get("seed", 0))
        self.calls: list[tuple[Any, ...]] = []
        self._asked: dict[str, int] = {}
        self._allocated: list[tuple[str, bool]] = []

    def _draw(self, *key: Any) -> float:
        import random

        return random.Random(f"{self.seed}:{key!r}").random()

    def has_cache_item(self, identifier: str) -> bool:
        held = self._draw("item", identifier) < 0.5
        self.calls.append(("has_cache_item", identifier, held))
        return held

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        req_id = request.request_id
        k = self._asked[req_id] = self._asked.get(req_id, 0) + 1
        available = self._draw("ensure", req_id, num_computed_tokens, k) >= 0.2
        self.calls.append(("ensure_cache_available", req_id, num_computed_tokens, available))
        return available

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        identifier = request.mm_features[index].identifier
        self.calls.append(("update_state_after_alloc", request.request_id, index))
        self._allocated.append((identifier, self._draw("item", identifier) < 0.5))

    def update_state_after_free(self, request: Any, index: int) -> None:
        self.calls.append(("update_state_after_free", request.request_id, index))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = RandomECConnectorMetadata(self._allocated)
        self._allocated = []
        self.calls.append(("build_connector_meta", tuple(sorted(scheduler_output.num_scheduled_tokens.items()))))
        return meta

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, request.status.name))
        return False, {"ec": request.request_id}

    def start_load_caches(self, encoder_cache: Any, **kwargs: Any) -> None:
        return None

    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        return None


class RandomECConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """:class:`RandomECConnector`'s metadata: (identifier, loaded) per encoder input allocated in the step."""

    def __init__(self, allocated: list[tuple[str, bool]]) -> None:
        self.allocated = allocated

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RandomECConnectorMetadata) and self.allocated == other.allocated

    def __repr__(self) -> str:
        return f"RandomECConnectorMetadata({self.allocated!r})"


class RandomKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM is untyped here
    """A scheduler-role KV connector whose answers are a seeded function of what it is asked, in the role of its
    ``kv_transfer_config``: a consumer (``kv_consumer``, a decode engine) finds external tokens for some requests
    (loaded synchronously or asynchronously) and "ask again later" for a few; a producer (``kv_producer``, a
    prefill engine) finds none and delays the free of some finished requests (their blocks are "being sent");
    ``kv_both`` does both. It transfers nothing. :meth:`report` plays the workers: it draws what a step's
    ``ModelRunnerOutput.kv_connector_output`` says (loads over, some failed whole or with an invalid block among
    the loaded ones, an invalid block among the loaded ones of some synchronous loads of the step, sends over),
    among the transfers the steps applied so far started; the connector forgets a
    transfer once its scheduler hands it the report (``update_connector_output``).

    vLLM derives from the role whether a preempted request's in-flight output is dropped
    (``requires_kv_delivery``: producer roles) and, with several batches in flight, whether block frees wait for
    the steps in flight (consumer roles). Two instances with the same seed, asked the same things in the same
    order, answer the same: the differential driver (``tests/vllm_driver.py``) gives one to vLLM's scheduler and
    one to kvsched's and compares ``calls``, a log of every hook call with the request state and blocks it was
    called with.

    ``"passive": true`` in its ``kv_connector_extra_config`` makes it find no external tokens and delay no free in
    any role (it still logs its calls): a second child of vLLM's ``MultiConnector`` that only watches.
    ``"sync_invalid": true`` makes :meth:`report` draw invalid blocks of synchronous loads too (off by default: the
    draws of every other report stay as they are). ``"divergent_hits": true`` makes it claim
    ``supports_divergent_local_hybrid_hits`` (as vLLM's NIXL and MoRI-IO connectors do): with Mamba prefix caching
    both schedulers then look a new request's local hit up group by group.
    """

    # Invalid blocks of synchronous loads reported by any instance (:meth:`report`), for tests to check coverage.
    num_sync_invalid_reported: ClassVar[int] = 0

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.seed = int(extra.get("seed", 0))
        self.passive = bool(extra.get("passive", False))
        self.sync_invalid = bool(extra.get("sync_invalid", False))
        self.divergent_hits = bool(extra.get("divergent_hits", False))
        self.loads_external = bool(self._kv_transfer_config.is_kv_consumer) and not self.passive
        self.sends = bool(self._kv_transfer_config.is_kv_producer) and not self.passive
        self.calls: list[tuple[Any, ...]] = []
        self._num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        self.loads: dict[str, tuple[list[int], int, int]] = {}  # req_id -> (blocks, first token, tokens)
        self.sending: set[str] = set()
        self._asked: dict[str, int] = {}
        self._pending: dict[str, tuple[int, int, bool]] = {}  # req_id -> (local tokens, external tokens, async)
        # The Request objects it was asked about, as real connectors keep them (their state is read live in
        # build_connector_meta); forgotten at request_finished.
        self._requests: dict[str, Any] = {}
        # Loads a step's metadata started (the workers begin them when they run that step).
        self._started: set[str] = set()
        # Synchronous loads admitted since the last metadata (with one KV cache group: their blocks may be
        # reported invalid).
        self._sync_loads: dict[str, tuple[list[int], int, int]] = {}

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.divergent_hits

    def _rng(self, *key: Any) -> Any:
        import random

        return random.Random("/".join(map(str, (self.seed, *key))))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        n = self._asked[req_id] = self._asked.get(req_id, 0) + 1
        self._requests[req_id] = request
        self.calls.append(("matched", req_id, num_computed_tokens, request.num_tokens, request.num_preemptions))
        if not self.loads_external:
            return 0, False
        rng = self._rng(req_id, n, num_computed_tokens)
        room = request.num_tokens - num_computed_tokens
        r = rng.random()
        if r < 0.08:
            return None, False
        if r < 0.5 or room <= 1:
            self._pending[req_id] = (num_computed_tokens, 0, False)
            return 0, False
        is_async = rng.random() < 0.6
        ext = rng.randrange(1, room + 1) if is_async else rng.randrange(1, room)
        self._pending[req_id] = (num_computed_tokens, ext, is_async)
        return ext, is_async

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # The groups an asynchronous load writes (their loaded tokens' blocks are not zeroed): every group about
        # half the time (vLLM's P/D connectors), else a seeded subset (what it answers depends on nothing else).
        groups = tuple(range(self._num_groups))
        rng = self._rng(request.request_id, "loaded", request.num_preemptions)
        if self.passive or rng.random() < 0.5:
            return groups
        return tuple(g for g in groups if rng.random() < 0.5)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        groups = blocks.get_block_ids()
        if len(groups) == 1:
            self.calls.append(
                ("alloc", req_id, list(groups[0]), num_external_tokens, list(blocks.get_unhashed_block_ids()))
            )
        else:  # several KV cache groups: every group's blocks (null blocks before a window included)
            unhashed = [list(u) for u in blocks.get_unhashed_block_ids_all_groups()]
            # and the hashes the cached ones carry (a group of larger blocks: the hash at each block's end)
            hashes = [[bytes(b.block_hash).hex() for b in g if b.block_hash is not None] for g in blocks.blocks]
            self.calls.append(("alloc", req_id, [list(g) for g in groups], num_external_tokens, unhashed, hashes))
        block_ids = groups[0]
        local, _ext, is_async = self._pending.pop(req_id, (0, 0, False))
        if is_async and num_external_tokens > 0:
            self.loads[req_id] = (list(block_ids), local, num_external_tokens)
        elif num_external_tokens > 0 and self._num_groups == 1:
            # A synchronous load: the workers load it in the step about to be built (its metadata lists it).
            self._sync_loads[req_id] = (list(block_ids), local, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # What a real connector may read here: the scheduled requests' state as vLLM has it at this point (before
        # its _update_after_schedule advances them).
        state = []
        for req_id in scheduler_output.num_scheduled_tokens:
            r = self._requests.get(req_id)
            if r is not None:
                state.append(
                    (req_id, r.status.name, r.num_computed_tokens, r.is_prefill_chunk, r.num_output_placeholders)
                )
        self.calls.append(("meta", state))
        block_state = scheduler_output.kv_connector_block_state
        if block_state is not None and block_state.boundary_state_offloads:
            # The cached Mamba boundary states handed over (vLLM's align mode with prefix caching): in the order
            # given, with the tables a connector resolves for them.
            offloads = block_state.boundary_state_offloads
            self.calls.append(
                (
                    "boundary_states",
                    [(req_id, list(offloads[req_id])) for req_id in offloads],
                    sorted(block_state.req_ids),
                    [(r, [list(t) for t in block_state.get_block_ids(r) or ()]) for r in sorted(offloads)],
                )
            )
        meta = KVConnectorMetadata()
        meta.new_req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        meta.loads = sorted(self.loads)
        meta.sync_loads = sorted(self._sync_loads.items())
        self._sync_loads = {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, list(block_ids), block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's SupportsHMA: every KV cache group's blocks of the computed tokens (logged as one list with one
        # group, as request_finished logs them).
        if len(block_ids) == 1:
            return self.request_finished(request, block_ids[0])
        return self._finished(request, [list(g) for g in block_ids], block_ids[0])

    def _finished(self, request: Any, logged: list[Any], block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self.calls.append(("finished", req_id, request.status.name, logged))
        rng = self._rng(req_id, "finished")
        delay = self.sends and bool(block_ids) and req_id not in self.loads and rng.random() < 0.3
        if delay:
            self.sending.add(req_id)
        params = {"req": req_id, "blocks": len(block_ids)} if rng.random() < 0.5 and not self.passive else None
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        recv = sorted(connector_output.finished_recving or ())
        send = sorted(connector_output.finished_sending or ())
        self.calls.append(("output", recv, send))
        for req_id in recv:
            self.loads.pop(req_id, None)
            self._started.discard(req_id)
        self.sending.difference_update(send)

    def report(self, rng: Any, metadata: Any, block_size: int) -> Any:
        """What the workers report with the output of the step whose connector metadata is ``metadata``: each
        load started by then (listed in the metadata of this step or an earlier one) ends with probability 0.35
        (of those, one in ten failed whole and one in ten with one invalid block among its loaded ones), with
        ``sync_invalid`` one in ten synchronous loads of the step has one invalid block among its loaded ones, each
        send with probability 0.35; None about half the time nothing ended. ``rng`` (a ``random.Random``) makes the
        draws, so a driver that gives both schedulers the same report keeps them in step."""
        from vllm.v1.outputs import KVConnectorOutput

        if metadata is not None:
            self._started.update(getattr(metadata, "loads", ()))
        recv: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        send: set[str] = set()
        for rid in sorted(self._started & set(self.loads)):
            if rng.random() < 0.35:
                blocks, first, n = self.loads[rid]
                recv.add(rid)
                r = rng.random()
                if r < 0.1:
                    failed.add(rid)
                elif r < 0.2:
                    idx = rng.randrange(first // block_size, -(-(first + n) // block_size))
                    # (the first group's table: a Mamba group's can be shorter)
                    bad = blocks[idx] if idx < len(blocks) else 0
                    # vLLM refuses invalid blocks with several KV cache groups (a block id names a block within
                    # one group), and a window's null block holds nothing: the load failed whole instead.
                    if bad == 0 or self._num_groups > 1:
                        failed.add(rid)
                    else:
                        invalid.add(bad)
        # The synchronous loads of this step: one in ten with an invalid block among its loaded ones (vLLM
        # rolls its request back, or fails it, with kv_load_failure_policy "fail").
        for _rid, (blocks, first, n) in getattr(metadata, "sync_loads", ()) if self.sync_invalid else ():
            if rng.random() < 0.1:
                bad = blocks[rng.randrange(first // block_size, -(-(first + n) // block_size))]
                if bad:  # (a window's null block holds nothing)
                    invalid.add(bad)
                    RandomKVConnector.num_sync_invalid_reported += 1
        for rid in sorted(self.sending):
            if rng.random() < 0.35:
                send.add(rid)
        if not (recv or send or invalid) and rng.random() < 0.5:
            return None
        return KVConnectorOutput(
            finished_recving=recv or None,
            finished_sending=send or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
        )

    # Worker-side hooks: never called on a scheduler-role connector.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


# ---- end-to-end helpers: a tiny real model, and an executor that needs no model ---------------------------------

TINY_VOCAB_SIZE = 512


def save_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
) -> str:
    """Write a tiny random Llama (2 layers, hidden 128, float32 safetensors) and a word-level tokenizer to
    ``path``, for a vLLM engine that must load real weights without the network. Token ``i`` (``i >= 4``) is the
    word ``w{i}``; 0-3 are ``<pad> <s> </s> <unk>`` (EOS is ``</s>``, id 2). The tokenizer has a plain chat
    template (the messages' contents, one per line), so chat completions work too. Returns ``path``.

    ``layer_types`` (one of ``"full_attention"`` / ``"sliding_attention"`` per layer, as in Hugging Face configs)
    with ``sliding_window`` (tokens) makes those layers attend over a sliding window: vLLM's Llama reads them and
    builds one KV cache group per kind of layer (all sliding: one window group; mixed: a window group and a
    full-attention group, as for gpt-oss or Gemma 3)."""
    from kvsched.runner.testing import save_tiny_hf_model

    path = os.fspath(path)
    window: dict[str, Any] = {}
    if layer_types is not None:
        kinds = set(layer_types)
        if not layer_types or not kinds <= {"full_attention", "sliding_attention"}:
            raise ValueError(
                f"layer_types must name full_attention or sliding_attention per layer, got {layer_types!r}"
            )
        if "sliding_attention" in kinds and (sliding_window is None or sliding_window < 1):
            raise ValueError(f"sliding layers need a positive sliding_window, got {sliding_window!r}")
        window = {"layer_types": list(layer_types), "sliding_window": sliding_window}
    elif sliding_window is not None:
        raise ValueError("sliding_window needs layer_types (which layers slide)")
    save_tiny_hf_model(
        path,
        "llama",
        seed=seed,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(layer_types) if layer_types is not None else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=4096,
        **window,
    )
    _save_tiny_tokenizer(path)
    return path


def save_tiny_qwen3_next(path: str | os.PathLike[str], *, seed: int = 0, linear_value_heads: int = 1) -> str:
    """Write a tiny random Qwen3-Next (a hybrid of Gated DeltaNet linear attention and full attention, with MoE
    layers: one linear-attention layer, one full-attention layer, hidden 128, bfloat16 safetensors) and the word-level
    tokenizer of :func:`save_tiny_llama` to ``path``. vLLM runs its linear-attention layer with a Mamba-style state
    (one ``MambaSpec`` KV cache group beside the full-attention group; vLLM's CPU build needs bfloat16 and
    128-dimensional linear-attention heads for it). vLLM sizes the attention block so a page holds one state:
    384 tokens with one linear-attention value head, 1,152 with four (``linear_value_heads``). Needs a
    ``transformers`` with Qwen3-Next. Returns ``path``."""
    if linear_value_heads not in (1, 2, 4, 8):
        raise ValueError(f"linear_value_heads must be 1, 2, 4 or 8, got {linear_value_heads!r}")
    import torch
    import transformers

    path = os.fspath(path)
    config = transformers.Qwen3NextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=max(1, linear_value_heads // 2),
        linear_num_value_heads=linear_value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    model = _random_model(transformers.Qwen3NextForCausalLM, config, seed)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    _save_tiny_tokenizer(path)
    return path


def save_tiny_deepseek(path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a tiny random DeepSeek-V3 (multi-head latent attention: every layer caches one compressed latent per
    token instead of keys and values; a dense first layer, then a mixture-of-experts layer; hidden 128) and the
    word-level tokenizer of :func:`save_tiny_llama` to ``path`` (float32 safetensors). vLLM builds one
    ``MLAAttentionSpec`` KV cache group for it. The latent is 512 + 64 wide (``kv_lora_rank`` +
    ``qk_rope_head_dim``), DeepSeek's own sizes, because vLLM's CPU MLA decode kernel is built for that width only.
    Returns ``path``."""
    import transformers

    path = os.fspath(path)
    # As DeepSeek-V3's own config (which vLLM reads): sigmoid router scores with a bias per expert, no MTP layer.
    extra: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0}
    config = transformers.DeepseekV3Config(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        **extra,
    )
    model = _random_model(transformers.DeepseekV3ForCausalLM, config, seed)
    model.save_pretrained(path, safe_serialization=True)
    _save_tiny_tokenizer(path)
    return path


def save_tiny_mimo_v2(path: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Write a tiny random Xiaomi MiMo-V2-Flash (hidden 64, float32 safetensors) and the word-level tokenizer of
    :func:`save_tiny_llama` to ``path``. Layer 0 attends over the whole context, layers 1 and 2 over a 256-token
    sliding window with an attention sink per head, as in the served model; layer 0's MLP is dense, the others are
    mixtures of four experts (two per token, sigmoid router scores with a bias per expert).

    The window layers cache two KV heads per token and the full-attention layer one (32-dimensional heads both),
    so a full-attention page per token is half a window one: vLLM doubles the full-attention layer's block to give
    every layer the same page, and the first KV cache group (layer 0's) has 256-token blocks, the window groups
    128-token ones. That is the layout of the served model, whose full-attention layers have fewer KV heads.

    The checkpoint is written by hand (config and tensor names as in the published checkpoint, which vLLM's
    ``MiMoV2FlashForCausalLM`` reads): the ``transformers`` port of this model gives every layer the same number of
    KV heads. Returns ``path``."""
    import torch
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hidden, head_dim, window = 64, 32, 256
    full_kv_heads, swa_kv_heads, q_heads = 1, 2, 2
    experts, expert_width, dense_width = 4, 32, 128
    kinds = [0, 1, 1]  # 0: full attention, 1: sliding window
    moe = [0, 1, 1]
    config = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": dense_width,
        "moe_intermediate_size": expert_width,
        "num_hidden_layers": len(kinds),
        "hybrid_layer_pattern": kinds,
        "layer_types": ["sliding_attention" if k else "full_attention" for k in kinds],
        "moe_layer_freq": moe,
        "mlp_layer_types": ["sparse" if m else "dense" for m in moe],
        "num_attention_heads": q_heads,
        "num_key_value_heads": full_kv_heads,
        "head_dim": head_dim,
        "v_head_dim": head_dim,
        "swa_num_attention_heads": q_heads,
        "swa_num_key_value_heads": swa_kv_heads,
        "swa_head_dim": head_dim,
        "swa_v_head_dim": head_dim,
        "sliding_window": window,
        "sliding_window_size": window,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_bias": False,
        "attention_value_scale": 0.707,
        "partial_rotary_factor": 0.5,
        "rope_theta": 5_000_000.0,
        "swa_rope_theta": 10_000.0,
        "n_routed_experts": experts,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-5,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> Any:
        # The spread of _random_model, so that greedy argmaxes are not near-ties.
        return torch.randn(rows, cols, generator=gen) * 0.15

    tensors: dict[str, Any] = {
        "model.embed_tokens.weight": matrix(TINY_VOCAB_SIZE, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": matrix(TINY_VOCAB_SIZE, hidden),
    }
    for i, (kind, sparse) in enumerate(zip(kinds, moe, strict=True)):
        layer = f"model.layers.{i}"
        kv_heads = swa_kv_heads if kind else full_kv_heads
        tensors[f"{layer}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{layer}.post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{layer}.self_attn.q_proj.weight"] = matrix(q_heads * head_dim, hidden)
        tensors[f"{layer}.self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        tensors[f"{layer}.self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        tensors[f"{layer}.self_attn.o_proj.weight"] = matrix(hidden, q_heads * head_dim)
        if kind:
            tensors[f"{layer}.self_attn.attention_sink_bias"] = torch.randn(q_heads, generator=gen)
        if sparse:
            tensors[f"{layer}.mlp.gate.weight"] = matrix(experts, hidden)
            tensors[f"{layer}.mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=gen) * 0.1
            for e in range(experts):
                expert = f"{layer}.mlp.experts.{e}"
                tensors[f"{expert}.gate_proj.weight"] = matrix(expert_width, hidden)
                tensors[f"{expert}.up_proj.weight"] = matrix(expert_width, hidden)
                tensors[f"{expert}.down_proj.weight"] = matrix(hidden, expert_width)
        else:
            tensors[f"{layer}.mlp.gate_proj.weight"] = matrix(dense_width, hidden)
            tensors[f"{layer}.mlp.up_proj.weight"] = matrix(dense_width, hidden)
            tensors[f"{layer}.mlp.down_proj.weight"] = matrix(hidden, dense_width)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _save_tiny_tokenizer(path)
    return path


def _random_model(cls: Any, config: Any, seed: int) -> Any:
    """A Hugging Face model of class ``cls`` built from ``config`` with seeded random weights, its matrices drawn
    with a wider spread than the default so that greedy argmaxes are not near-ties."""
    import torch

    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    return model


def _save_tiny_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {word: i for i, word in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), TINY_VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(path)


def deterministic_token(context: Sequence[int], vocab_size: int = TINY_VOCAB_SIZE, eos_token_id: int = 2) -> int:
    """The token :class:`DeterministicExecutor` samples after ``context``: a hash of all of it (EOS about one
    time in 40; never a special token otherwise)."""
    import hashlib
    from array import array

    h = int.from_bytes(hashlib.blake2b(array("q", context).tobytes(), digest_size=8).digest(), "little")
    return eos_token_id if h % 40 == 0 else 4 + h % (vocab_size - 4)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class DeterministicExecutor(Executor):  # type: ignore[misc]  # vLLM is untyped here
    """A vLLM executor with no model: it keeps each request's tokens and block table as vLLM's model runner V1
    or V2 does from each ``SchedulerOutput``, writes every scheduled position's token into a paged "KV cache"
    (one token id per slot) at the block ids the scheduler assigned, and samples
    :func:`deterministic_token` of the context it reads back from those blocks. A scheduler that hands out a
    wrong prefix hit, block id or computed count makes it read a different context (listed in ``errors``)
    and sample different tokens. ``distributed_executor_backend=DeterministicExecutor`` in an engine that runs
    in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

    instances: ClassVar[list[Any]] = []

    def _init_executor(self) -> None:
        self.block_size = self.cache_config.block_size
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.pending: list[ModelRunnerOutput] = []
        self.errors: list[str] = []
        # One entry per step that scheduled tokens: what the scheduler decided (batch, computed counts,
        # block ids, resumed, preempted and finished requests), for comparing two schedulers step by step.
        self.trace: list[tuple[Any, ...]] = []
        self.num_steps = 0
        DeterministicExecutor.instances.append(self)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        return [{"model.layers.0.self_attn.attn": spec}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBNHC"]]

    def set_kv_cache_layout(self, layout_name: str, *args: Any) -> None:
        pass  # one token id per slot: any layout

    def determine_available_memory(self) -> list[int]:
        return [1 << 30]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.num_blocks = kv_cache_configs[0].num_blocks

    def compile_or_warm_up_model(self) -> None:
        pass

    def collective_rpc(
        self, method: Any, timeout: Any = None, args: tuple[Any, ...] = (), kwargs: Any = None, non_block: bool = False
    ) -> Any:
        # Control messages to workers (cache resets, device syncs): there are none to send them to.
        return _done([None]) if non_block else [None]

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def take_draft_token_ids(self) -> None:
        return None

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self._run(scheduler_output)
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            return _done(output) if non_block else output
        self.pending.append(output)
        return _done(None) if non_block else None

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self.pending.pop(0)
        return _done(output) if non_block else output

    def _run(self, so: Any) -> Any:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.block_tables.pop(req_id, None)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.num_steps += 1
        cached = so.scheduled_cached_reqs
        self.trace.append(
            (
                list(so.num_scheduled_tokens.items()),
                [(r.req_id, r.num_computed_tokens, list(r.block_ids[0])) for r in so.scheduled_new_reqs],
                list(cached.req_ids),
                list(cached.num_computed_tokens),
                [None if b is None else list(b[0]) for b in cached.new_block_ids],
                sorted(cached.resumed_req_ids),
                sorted(so.preempted_req_ids or ()),
                sorted(so.finished_req_ids),
            )
        )
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            prefill = getattr(new, "prefill_token_ids", None)  # model runner V2: a resumed request's tokens
            self.tokens[new.req_id] = list(prefill if prefill is not None else new.prompt_token_ids)
            self.block_tables[new.req_id] = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.all_token_ids:  # model runner V1: not scheduled in the previous step
                self.tokens[req_id] = list(cached.all_token_ids[req_id])
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.block_tables[req_id] = list(new_blocks[0])
            elif new_blocks is not None:
                self.block_tables[req_id] += new_blocks[0]
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, table, start = self.tokens[req_id], self.block_tables[req_id], computed[req_id]
            end = start + n
            for pos in range(start, min(end, len(tokens))):
                block = self.kv.setdefault(table[pos // self.block_size], [None] * self.block_size)
                block[pos % self.block_size] = tokens[pos]
            if end < len(tokens):
                sampled.append([])  # a partial prefill samples nothing
                continue
            context = [self.kv[table[pos // self.block_size]][pos % self.block_size] for pos in range(end)]
            if context != tokens[:end]:
                self.errors.append(f"step {self.num_steps}: {req_id} read a context that is not its own")
            token = deterministic_token([-1 if t is None else t for t in context])
            tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
