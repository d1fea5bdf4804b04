"""Translate a vLLM engine configuration into a kvsched :class:`~kvsched.config.SchedulerConfig`.

Everything kvsched's core does not implement yet is refused here, at construction, with an
:class:`UnsupportedFeatureError` that names the feature and the vLLM setting that turned it on. A refused
deployment never starts; it is never scheduled wrongly. kvsched's own knobs come from
``--additional-config '{"kvsched": {...}}'`` (read and checked in ``_policy.py``) on top of what vLLM decides.
"""

from __future__ import annotations

import math
from typing import Any

from kvsched.config import CROSS_ATTENTION, MAMBA, RING, SchedulerConfig, chunk_size_of, chunked_local

from ._compat import RULES
from ._errors import UnsupportedFeatureError
from ._kv_events import kv_events_enabled
from ._policy import build_config, effective_policy, read_additional_config

__all__ = [
    "UnsupportedFeatureError",
    "check_kv_connector",
    "check_multimodal",
    "encoder_budget",
    "kvsched_config_from_vllm",
]


def _refuse(feature: str, setting: str) -> None:
    raise UnsupportedFeatureError(
        f"kvsched.vllm.Scheduler does not support {feature} yet ({setting}); run this deployment with vLLM's own "
        "scheduler (drop --scheduler-cls), or turn the feature off. See docs/vllm.md for what is supported."
    )


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def _checkpoint_blocks(spec: Any) -> int:
    """A ``MambaSpec``'s prefill checkpoint blocks (vLLM 0.33; none before)."""
    return int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0)


def _extra_retained_tokens(kv_cache_config: Any) -> int:
    """The tokens below the window the sliding-window groups keep (``SlidingWindowSpec.extra_retained_tokens``,
    which vLLM's engine sets to ``num_prefill_lookahead_tokens - 1`` on every window); refused when they differ."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    extra = {
        int(getattr(g.kv_cache_spec, "extra_retained_tokens", 0) or 0)
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, SlidingWindowSpec)
    }
    if len(extra) > 1:
        _refuse("sliding-window KV cache groups that retain different extra tokens", f"extra_retained_tokens {extra}")
    return next(iter(extra), 0)


def _checkpoint_alignment(kv_cache_config: Any) -> int | None:
    """The Mamba groups' prefill checkpoint alignment when every one declares checkpoint blocks (vLLM's scheduler
    takes the first group's alignment; the adapter refuses Mamba groups of different specs with prefix caching),
    else None (no checkpoints; an alignment of None also exports none)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    if not specs or any(_checkpoint_blocks(s) <= 0 for s in specs):
        return None
    align = getattr(specs[0], "prefill_checkpoint_alignment", None)
    return None if align is None else int(align)


def _check_kv_cache_config(
    kv_cache_config: Any, block_size: int, dcp: int = 1, prefix_caching: bool = True
) -> tuple[list[int | str | None], int, int]:
    """Refuses the KV cache layouts the core does not implement; returns each KV cache group's sliding window, in
    vLLM's group order (None: full attention, ``"cross"``: cross attention, ``"chunked:<c>"``: chunked-local
    attention, ``"mamba"``: Mamba), the attention groups' block size (in scheduler blocks: times ``dcp``) and the
    Mamba groups' speculative state blocks.

    Several groups (hybrid models: full-attention and sliding-window, chunked-local or Mamba layers;
    encoder-decoder models: plus cross-attention layers) map to the core's ``kv_cache_groups``, one entry per vLLM
    group, the attention groups of one block size. A Mamba group (``MambaSpec`` with ``mamba_cache_mode`` "none",
    vLLM's mode without prefix caching) holds one state block of ``max_model_len`` tokens per request; the
    scheduler block size is then the least common multiple of the two (vLLM's engine).

    ``dcp``: vLLM's decode-context-parallel size; ``block_size`` is then vLLM's scheduler block size, the spec's
    block size times ``dcp`` (a block id covers that many tokens, sharded over the DCP ranks). A Mamba group in
    mode "align" (block-sized states) runs with ``prefix_caching`` (the cache config's ``enable_prefix_caching``)
    on or off; on, with vLLM's retention of its states (``prefix_cache_retention_interval``: None dense, 0 the
    states a later request can resume at, above 0 those and one every that many tokens); sliding windows follow
    the same retention of their blocks."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    try:
        from vllm.v1.kv_cache_interface import CircularBufferSpec
    except ImportError:  # a release without compressor rings
        CircularBufferSpec = None

    # Multi-head latent attention (DeepSeek, Kimi) schedules as full attention and sliding windows do: vLLM's KV
    # cache managers for its specs are the full-attention and sliding-window ones.
    full_types: tuple[type, ...] = (FullAttentionSpec, MLAAttentionSpec)
    window_types: tuple[type, ...] = (SlidingWindowSpec, SlidingWindowMLASpec)
    groups = list(kv_cache_config.kv_cache_groups)
    hybrid = len(groups) > 1
    windows: list[int | str | None] = []
    # vLLM looks up the prefix hit of groups with equal specs together; the core does so for equal windows (and
    # equal chunk sizes).
    window_specs: dict[int | str, Any] = {}
    attention_sizes: dict[int, int] = {}
    mamba_sizes: set[int] = set()
    mamba_specs: list[Any] = []
    spec_blocks: set[int] = set()
    ring_sizes: set[int] = set()
    replay_sizes: set[int] = set()
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        where = f"KV cache group {g}: " if hybrid else ""
        if CircularBufferSpec is not None and type(spec) is CircularBufferSpec:
            # A compressor's ring of the keys still being compressed (DeepSeek V4.1, GLM-5, Qwen4, Step 5): one
            # block per request, never cached (vLLM's CircularBufferManager).
            if dcp > 1:
                _refuse(
                    "compressor ring groups (CircularBufferSpec) with decode context parallelism",
                    f"{where}decode_context_parallel_size={dcp}",
                )
            ring_sizes.add(int(spec.block_size))
            windows.append(RING)
            continue
        # Plain or MLA full attention and sliding windows, chunked-local or cross attention, or Mamba: the other
        # specs subclass or differ from them.
        window: int | str | None = None
        if type(spec) is MambaSpec:
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode not in ("none", "align") or (mode == "none" and prefix_caching):
                # Prefix caching runs with mode "align" only (vLLM's default with prefix caching).
                _refuse(
                    f"Mamba prefix caching (mamba_cache_mode {mode!r})",
                    f"{where}MambaSpec: use mamba_cache_mode 'align' or turn prefix caching off "
                    "(--no-enable-prefix-caching)",
                )
            if not prefix_caching and mode == "align" and _checkpoint_blocks(spec) > 0:
                # Mamba2 and Gated DeltaNet layers export a block-boundary state from inside a chunk (the core's
                # mamba_prefill_checkpoint_alignment); vLLM then reserves its block by the KV cache config's
                # retention, which the adapter passes only with prefix caching.
                _refuse(
                    "Mamba prefill checkpoints without prefix caching (mamba_cache_mode 'align' with "
                    "num_prefill_checkpoint_blocks and enable_prefix_caching=False)",
                    f"{where}MambaSpec: num_prefill_checkpoint_blocks={spec.num_prefill_checkpoint_blocks}",
                )
            window = MAMBA
            if prefix_caching and mode == "align" and mamba_specs and spec not in mamba_specs:
                # vLLM looks up the prefix hits of Mamba groups with different specs apart (the shared-prefix
                # junction can then differ), the core looks all Mamba groups up together.
                _refuse("Mamba prefix caching with Mamba KV cache groups of different specs", f"{where}MambaSpec")
            mamba_specs.append(spec)
            mamba_sizes.add(int(spec.block_size))
            spec_blocks.add(int(spec.num_speculative_blocks))
            windows.append(window)
            continue
        replayed_window = type(spec) in window_types and getattr(spec, "bounded_replay", False)
        if replayed_window:
            # A window rebuilt by bounded prefix replay: never looked up, so beside any other window; never hashed,
            # so its blocks may hold any number of tokens (DeepSeek V4.1's hold 32, fewer than the hashed groups').
            window = int(spec.sliding_window)
        elif type(spec) in window_types:
            window = int(spec.sliding_window)
            if window in window_specs and window_specs[window] != spec:
                _refuse(
                    "two sliding-window KV cache groups with the same window but different specs (vLLM looks up "
                    "their prefix hits apart, the core together)",
                    f"{where}sliding_window={window}",
                )
            window_specs[window] = spec
        elif type(spec) is ChunkedLocalAttentionSpec:
            # Llama 4's local-attention layers (vLLM's ChunkedLocalAttentionManager).
            window = chunked_local(int(spec.attention_chunk_size))
            if chunk_size_of(window) is None:
                _refuse("chunked-local attention with this chunk size", f"{where}attention_chunk_size={window}")
            if window in window_specs and window_specs[window] != spec:
                _refuse(
                    "two chunked-local KV cache groups with the same chunk size but different specs (vLLM looks up "
                    "their prefix hits apart, the core together)",
                    f"{where}attention_chunk_size={spec.attention_chunk_size}",
                )
            window_specs[window] = spec
        elif type(spec) is CrossAttentionSpec:
            # The encoder output's blocks of an encoder-decoder model (vLLM's CrossAttentionManager).
            window = CROSS_ATTENTION
            if all(w == MAMBA for w in windows):
                _refuse(
                    "a cross-attention KV cache group first (the core's first group that is not Mamba holds the "
                    "decoder's tokens)",
                    where,
                )
        elif type(spec) not in full_types:
            _refuse(
                f"the KV cache spec {type(spec).__name__}",
                f"{where}only FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec, "
                "ChunkedLocalAttentionSpec, CrossAttentionSpec and MambaSpec are supported",
            )
        elif getattr(spec, "sliding_window", None):
            _refuse("full-attention specs with a sliding window", f"{where}sliding_window={spec.sliding_window}")
        if dcp > 1 and not getattr(spec, "dcp_sharded", False):
            _refuse("KV cache specs that decode context parallelism does not shard", f"{where}dcp_sharded=False")
        if replayed_window:
            replay_sizes.add(int(spec.block_size) * dcp)
        else:
            attention_sizes.setdefault(int(spec.block_size) * dcp, g)
        windows.append(window)
    if not attention_sizes and replay_sizes:
        # (vLLM needs a group that takes part in prefix caching.)
        _refuse(
            "bounded-replay windows without an attention KV cache group that is not replayed",
            f"KV cache groups {replay_groups(kv_cache_config)} with bounded_replay",
        )
    if not attention_sizes:
        _refuse("models with Mamba layers only (no attention KV cache group)", "MambaSpec")
    _check_replay_groups(groups, windows)

    def per_rank(size: int) -> str:
        return f"{size // dcp} * {dcp}" if dcp > 1 else str(size)

    if len(attention_sizes) > 1 or replay_sizes - set(attention_sizes):
        # Groups whose pages differ (vLLM's engine raised the smaller page's block size): full-attention and
        # sliding-window groups whose block sizes are multiples of the smallest (the core's primary group is the
        # first of those, which hashes: vLLM's hash_block_size, their greatest common divisor), in any order, and
        # replayed windows of any size.
        sizes = [int(group.kv_cache_spec.block_size) for group in groups]
        setting = f"KV cache group block sizes {sizes}"
        if dcp > 1:
            _refuse("KV cache groups of different block sizes with decode context parallelism", setting)
        other = [w for w in windows if w is not None and w != RING and not isinstance(w, int)]
        if other:
            _refuse(
                "KV cache groups of different block sizes with chunked-local, cross-attention or Mamba groups",
                f"{setting}, {sorted({str(w).split(':')[0] for w in other})}",
            )
        # (A ring's block size is its rows, checked below against the attention block; a replayed window's is
        # never hashed.)
        replayed = set(replay_groups(kv_cache_config))
        hashed = [s for g, (s, w) in enumerate(zip(sizes, windows, strict=True)) if w != RING and g not in replayed]
        if any(s % min(hashed) for s in hashed):
            # (vLLM's engine raises a smaller page's block size by the ratio of the pages, so the largest page's
            # group keeps the smallest block, which divides the others.)
            _refuse(
                "KV cache groups of different block sizes whose smallest block size does not divide every other "
                "cached group's (the core hashes at the smallest block)",
                setting,
            )
        attention_sizes = {min(hashed): 0}
        mixed = math.lcm(*hashed, *replay_sizes, *ring_sizes)
    else:
        mixed = 0
    attention_size = next(iter(attention_sizes))
    if any(attention_size % r for r in ring_sizes):
        # vLLM's scheduler block size (the least common multiple of every group's) would exceed the attention
        # groups' block, and its prefix hits would align to it.
        _refuse(
            "compressor ring groups whose block size does not divide the attention groups' block size",
            f"ring block sizes {sorted(ring_sizes)}, attention block size {attention_size}",
        )
    if len(mamba_sizes) > 1:
        _refuse("Mamba KV cache groups of different block sizes", f"{sorted(mamba_sizes)}")
    if len(spec_blocks) > 1:
        _refuse("Mamba KV cache groups with different num_speculative_blocks", f"{sorted(spec_blocks)}")
    # vLLM's engine gives the scheduler the least common multiple of the groups' block sizes.
    want = mixed or math.lcm(attention_size, *mamba_sizes)
    if want != block_size:
        feature = (
            "a scheduler block size other than the least common multiple of the KV cache groups' block sizes"
            if mamba_sizes
            else "KV cache groups of different block sizes"
            if hybrid
            else "a KV cache block size that differs from the scheduler block size"
        )
        _refuse(feature, f"{want if mamba_sizes else per_rank(want)} != {block_size}")
    if any(chunk_size_of(w) is not None for w in windows) and None not in windows:
        _refuse(
            "chunked-local KV cache groups without a full-attention group (vLLM's lookup then counts the blocks "
            "before the last prompt token's chunk as a hit with nothing cached; the core looks a chunked-local hit "
            "up within a full-attention hit)",
            f"{len(windows)} KV cache groups",
        )
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        _refuse("HiSparse host blocks", "kv_cache_config.hisparse_host_num_blocks")
    _check_retention(getattr(kv_cache_config, "prefix_cache_retention_interval", None), block_size, windows)
    return windows, attention_size, next(iter(spec_blocks), 0)


def replay_groups(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups vLLM rebuilds by bounded prefix replay (DeepSeek V4.1's ``SlidingWindowMLASpec`` with
    ``bounded_replay``, vLLM's ``prefix_replay_group_ids``): the core's ``prefix_replay_groups``."""
    groups = kv_cache_config.kv_cache_groups
    return tuple(g for g, group in enumerate(groups) if getattr(group.kv_cache_spec, "bounded_replay", False))


def _check_replay_groups(groups: list[Any], windows: list[int | str | None]) -> None:
    """Refuses the bounded-replay layouts the core does not implement (``prefix_replay_groups``)."""
    replay = [g for g, group in enumerate(groups) if getattr(group.kv_cache_spec, "bounded_replay", False)]
    if not replay:
        return
    setting = f"KV cache groups {replay} with bounded_replay"
    sizes = sorted({int(groups[g].kv_cache_spec.sliding_window) for g in replay})
    if len(sizes) > 1:
        # (vLLM asserts one window.)
        _refuse("bounded-replay windows of different sizes", f"{setting}: windows {sizes}")
    if MAMBA in windows or CROSS_ATTENTION in windows:
        _refuse("bounded-replay windows beside Mamba or cross-attention groups", setting)


def _check_retention(retention: int | None, block_size: int, windows: list[int | str | None]) -> None:
    """vLLM's scheduler checks the KV cache config's ``prefix_cache_retention_interval`` when it builds its KV
    cache coordinator, which kvsched replaces: the same ValueError for the values vLLM's rejects (above 0 without a
    sliding-window or Mamba group; negative, or not a multiple of the scheduler block size ``block_size``)."""
    if retention is None:
        return
    if not any(w == MAMBA or (isinstance(w, int) and not isinstance(w, bool)) for w in windows):
        if retention == 0:
            return
        raise ValueError(
            f"prefix_cache_retention_interval ({retention}) is set but this model has no sliding-window or Mamba KV "
            "cache group, where it would act (0 or None there)"
        )
    if retention < 0 or retention % block_size:
        raise ValueError(
            f"prefix_cache_retention_interval ({retention}) must be non-negative and a multiple of the scheduler "
            f"block size ({block_size})"
        )


def check_kv_connector(vllm_config: Any, connector: Any) -> bool:
    """Refuses a vLLM scheduler-role KV connector that relies on parts of vLLM's scheduler kvsched replaces;
    returns whether it binds the block pool (then the adapter gives it block pins, ``_pins.py``).

    A connector that overrides ``bind_kv_cache_manager`` or ``bind_gpu_block_pool`` changes vLLM's block pool
    (references, frees, cached lookups by vLLM's block hashes). vLLM's ``SimpleCPUOffloadConnector`` (eager and
    lazy offload), ``MooncakeStoreConnector`` and ``UMBPStoreConnector`` use only what the adapter's pinning pool
    provides: they are accepted, with their own ``bind_gpu_block_pool`` (and UMBP's own ``bind_kv_cache_manager``).
    Every other such connector is refused, by name. vLLM's ``MultiConnector`` overrides both only to pass them on
    to its children: it is refused when one of its children (at any depth) is. Every other connector gets
    ``bind_kv_cache_manager`` with the ``kv_cache_manager`` view, as vLLM binds its own manager.

    With a window or several groups (full attention, sliding windows, align-mode Mamba groups) the three bind the
    pool alike: each group's blocks from the block state, Mamba states through its boundary hand-offs,
    ``SimpleCPUOffloadConnector``'s recovered window blocks through the pool view's group lookups, UMBP's
    local-cache lookup of a request's local hit from inside its prefix lookup (``BlockPins.looking_up``). vLLM
    hands the store connectors a Mamba group's finished partial tail (``register_finished_partial_tail``) only
    after a partial-block hit, from a hash block smaller than the block, which the adapter refuses with
    connectors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    binds = False

    def check(conn: Any, path: str) -> None:
        nonlocal binds
        cls = type(conn)
        name = f"{path}{cls.__name__}"
        forwards = isinstance(conn, MultiConnector) and all(
            getattr(cls, m) is getattr(MultiConnector, m) for m in ("bind_kv_cache_manager", "bind_gpu_block_pool")
        )
        if forwards:
            for child in conn.sub_connectors:
                check(child, f"{name} > ")
            return
        if _is_simple_cpu_offload(cls):
            binds = True
            return
        if _is_mooncake_store(cls) or _is_umbp_store(cls):
            binds = True
            return
        # A subclass of vLLM's MultiConnector or of one of its pool connectors is named by the binding it changes
        # from that connector's (vLLM's connector itself, or a subclass changing neither, by the bindings vLLM's
        # base class lacks).
        methods = ("bind_kv_cache_manager", "bind_gpu_block_pool")
        parent = MultiConnector if issubclass(cls, MultiConnector) else _pool_connector_parent(cls)
        overridden = [m for m in methods if parent not in (None, cls) and getattr(cls, m) is not getattr(parent, m)]
        overridden = overridden or [m for m in methods if getattr(cls, m, None) is not getattr(KVConnectorBase_V1, m)]
        if overridden:
            missing = _pool_connector_missing(cls)
            feature = (
                f"KV connectors that use vLLM's own block pool ({name} overrides {' and '.join(overridden)}{missing})"
            )
            _refuse(feature, "kv_transfer_config")

    check(connector, "")
    return binds


# vLLM's other connectors that bind its block pool, by class name: what kvsched.vllm lacks to host them.
_POOL_CONNECTORS_MISSING = {
    "MooncakeStoreConnector": (
        "a subclass that binds the pool or the KV cache manager otherwise than vLLM's MooncakeStoreConnector is "
        "not verified against vLLM's scheduler"
    ),
    "HiSparseConnector": (
        "it needs a HiSparse host block pool (kv_cache_config.hisparse_host_num_blocks) and binds vLLM's "
        "HiSparse coordinator into vLLM's own KV cache managers, which allocate and reclaim host blocks beside "
        "the GPU pool; kvsched's core has no host pool"
    ),
    "UMBPStoreConnector": (
        "a subclass that binds the pool or the KV cache manager otherwise than vLLM's UMBPStoreConnector is not "
        "verified against vLLM's scheduler"
    ),
}


def _pool_connector_parent(cls: type) -> type | None:
    """The nearest of vLLM's own connectors that bind the block pool in ``cls``'s bases (``cls`` itself
    included), or None."""
    for klass in cls.__mro__:
        if klass.__name__ in _POOL_CONNECTORS_MISSING and klass.__module__.startswith("vllm."):
            return klass
    return None


def _pool_connector_missing(cls: type) -> str:
    """``": what is missing"`` for vLLM's own connectors that bind the block pool (or a subclass), else ``""``."""
    parent = _pool_connector_parent(cls)
    return f": {_POOL_CONNECTORS_MISSING[parent.__name__]}" if parent is not None else ""


def _is_mooncake_store(cls: type) -> bool:
    """vLLM's ``MooncakeStoreConnector`` or a subclass binding the pool as it does.

    Its scheduler half pins the blocks of each store job with ``touch`` and gives them back with ``free_blocks``
    once every worker rank has reported the job (``blocks[bid]`` reads), and reads the current block tables
    through ``kv_connector_block_state``: block pins and the adapter's block state serve all of it, in every KV
    cache group, with the Mamba align groups' boundary states (``boundary_state_offloads``)."""
    if not any(klass.__name__ == "MooncakeStoreConnector" for klass in cls.__mro__):
        return False  # (without importing the store's modules for every other connector)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector
    except ImportError:
        return False
    return _binds_the_pool_as(cls, MooncakeStoreConnector)


def _is_umbp_store(cls: type) -> bool:
    """vLLM 0.33's ``UMBPStoreConnector`` or a subclass binding the pool and the KV cache manager as it does.

    Its scheduler half pins the blocks of each store event with ``touch`` and gives them back with
    ``free_blocks`` once every worker rank has reported the event (``blocks[bid]`` reads), and reads the current
    block tables through ``kv_connector_block_state``: block pins and the adapter's block state serve all of it.
    Its ``bind_kv_cache_manager`` keeps a local prefix-cache lookup (``coordinator.single_type_managers[g]
    .block_pool.get_cached_block``, the pinning pool's) that it asks, with several KV cache groups or a sliding
    window, for the blocks of a request's local hit from inside its prefix lookup, inside the core's call: the
    pinning pool answers those (``BlockPins.looking_up``). Its prefix lookups go to the UMBP runtime the
    deployment registers with vLLM (``UMBPRuntimeFactory``)."""
    if not any(klass.__name__ == "UMBPStoreConnector" for klass in cls.__mro__):
        return False  # (without importing the store's modules for every other connector)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector import UMBPStoreConnector
    except ImportError:
        return False
    return _binds_the_pool_as(cls, UMBPStoreConnector, UMBPStoreConnector.bind_kv_cache_manager)


def _is_simple_cpu_offload(cls: type) -> bool:
    """vLLM's ``SimpleCPUOffloadConnector`` or a subclass binding the pool as it does."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
            SimpleCPUOffloadConnector,
        )
    except ImportError:
        return False
    return _binds_the_pool_as(cls, SimpleCPUOffloadConnector)


def _binds_the_pool_as(cls: type, connector: type, bind_manager: Any = None) -> bool:
    """``cls`` is ``connector`` or a subclass that binds vLLM's block pool with ``connector``'s own
    ``bind_gpu_block_pool`` and binds the KV cache manager with ``bind_manager`` (default: vLLM's base class's
    ``bind_kv_cache_manager``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return (
        issubclass(cls, connector)
        and getattr(cls, "bind_gpu_block_pool", None) is getattr(connector, "bind_gpu_block_pool", None)
        and getattr(cls, "bind_kv_cache_manager", None) is (bind_manager or KVConnectorBase_V1.bind_kv_cache_manager)
    )


def check_hash_block(
    vllm_config: Any, windows: list[int | str | None] | None, block_size: int, hash_block_size: int
) -> None:
    """Refuses what a hash block smaller than the block (vLLM's ``hash_block_size``, set through
    ``prefix_match_unit``) is not supported with: one KV cache group, a size that does not divide the block, Mamba
    groups with prefix caching beside other groups than full attention (vLLM then keys Mamba states inside a
    block without hits inside a block), KV connectors, the auxiliary
    output connector and KV cache events (vLLM's full-attention groups also key a prompt's tail inside a block,
    which these see)."""
    setting = f"hash_block_size={hash_block_size}, block_size={block_size}"
    if len(windows or [None]) < 2:
        _refuse("a hash block size different from the block size with one KV cache group", setting)
    if block_size % hash_block_size:
        _refuse("a hash block size that does not divide the block size", setting)
    cache = vllm_config.cache_config
    # (A compressor ring takes no part in prefix hits: vLLM's fine-grained lookups leave it out.)
    attention_kinds = {w for w in windows or () if w not in (MAMBA, RING)}
    if MAMBA in (windows or ()) and cache.enable_prefix_caching and attention_kinds - {None}:
        _refuse(
            "Mamba prefix caching with a hash block smaller than the block beside sliding-window or other "
            "attention groups than full attention",
            setting,
        )
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV connectors with a hash block smaller than the block", f"kv_transfer_config, {setting}")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enabled", False):
        _refuse(
            "the auxiliary output connector with a hash block smaller than the block", f"aux_output_config, {setting}"
        )
    if cache.enable_prefix_caching and kv_events_enabled(vllm_config):
        _refuse("KV cache events with a hash block smaller than the block", f"kv_events_config, {setting}")


def _check_group_block_sizes(
    vllm_config: Any, sizes: list[int], hash_block_size: int | None, hashed: list[int]
) -> None:
    """Refuses what KV cache groups of different block sizes are not supported with: a hash block other than the
    smallest block (``prefix_match_unit``), the auxiliary output connector (vLLM keys a prompt's tail inside a
    larger full-attention block, which it sees). ``hashed``: the
    sizes of the groups that take part in prefix caching (every one but the replayed windows)."""
    setting = f"KV cache group block sizes {sizes}"
    cache = vllm_config.cache_config
    caching = bool(cache.enable_prefix_caching)
    if caching and hash_block_size not in (None, math.gcd(*hashed)):
        _refuse(
            "a prefix match unit other than the smallest block with KV cache groups of different block sizes",
            f"hash_block_size={hash_block_size}, {setting}",
        )
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enabled", False):
        _refuse(
            "the auxiliary output connector with KV cache groups of different block sizes",
            f"aux_output_config, {setting}",
        )


def kvsched_config_from_vllm(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: int | None,
    windows: list[int | str | None] | None = None,
    attention_block_size: int | None = None,
    mamba_speculative_blocks: int = 0,
) -> tuple[SchedulerConfig, int]:
    """The kvsched config for ``vllm_config`` and the number of speculative tokens; raises for unsupported ones.

    The fields vLLM decides come from its config; the kvsched settings of ``additional_config`` are added on top
    (a setting vLLM decides is refused there, see ``_policy.py``). ``windows``: each KV cache group's sliding
    window, None for full attention (``_check_kv_cache_config``; default: one full-attention group);
    ``attention_block_size``: the attention groups' block size (default: ``block_size``, vLLM's scheduler block
    size, which a Mamba group makes larger); ``mamba_speculative_blocks``: a Mamba group's extra state blocks."""
    knobs, _ = read_additional_config(vllm_config)
    sched = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config

    kv_transfer = vllm_config.kv_transfer_config
    # A connector that loads KV (a decode engine: kv_consumer, kv_both).
    loads_kv = kv_transfer is not None and bool(kv_transfer.is_kv_consumer)
    if _attr(model, "runner_type") == "pooling":
        _refuse("pooling models", "runner_type='pooling'")
    aux = getattr(vllm_config, "aux_output_config", None)
    if RULES.version == "0.32" and aux is not None and getattr(aux, "enabled", False):
        # vLLM 0.32's connector has another interface (no cache-hit questions); kvsched follows 0.33's.
        _refuse("the auxiliary output connector on vLLM 0.32", "aux_output_config.enabled")
    if _attr(model, "is_diffusion", False):
        _refuse("diffusion models", "model_config.is_diffusion")
    enc_dec = bool(_attr(model, "is_encoder_decoder", False))
    if enc_dec:
        check_encoder_decoder(vllm_config, windows)
    elif _attr(model, "supports_multimodal_inputs", False):
        check_multimodal(vllm_config)
    # Context parallelism: vLLM's scheduler block size (block_size here) is the spec's block size times the DCP
    # size, its KV cache manager shards each block over the DCP ranks and leaves PCP out of the unit
    # (pcp_world_size=1); the core's dcp_world_size / pcp_world_size do the same.
    dcp = int(_attr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(_attr(parallel, "prefill_context_parallel_size", 1) or 1)
    cp = f"decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}"
    if (dcp > 1 or pcp > 1) and (len(windows or [None]) > 1 or any(w is not None for w in windows or [None])):
        # vLLM shards only full attention (and Mamba) with DCP, and runs PCP with full attention only.
        _refuse("context parallelism with sliding-window attention or several KV cache groups", cp)
    if _attr(vllm_config.observability_config, "kv_cache_metrics", False):
        _refuse("KV cache eviction metrics", "observability_config.kv_cache_metrics")
    windows = windows or [None]
    sliding_window = windows[0] if len(windows) == 1 else None
    kv_cache_groups = tuple(windows) if len(windows) > 1 else None
    windowed = sliding_window is not None or kv_cache_groups is not None
    if kv_cache_groups is not None:
        # The core keeps one block table per group; its victim rules know one.
        num = f"{len(windows)} KV cache groups"
        if kv_transfer is not None and any(
            w is not None and not isinstance(w, int) and w not in (MAMBA, RING) for w in windows
        ):
            # The core hands a connector full-attention, sliding-window and Mamba groups only (vLLM's SupportsHMA
            # connectors with chunked-local or cross-attention groups are not compared with vLLM yet).
            kinds = sorted(
                {str(w).split(":")[0] for w in windows if w is not None and not isinstance(w, int) and w != MAMBA}
            )
            _refuse(
                "KV connectors with chunked-local or cross-attention KV cache groups",
                f"kv_transfer_config, {num} ({', '.join(kinds)})",
            )
        mamba_modes = {
            str(getattr(group.kv_cache_spec, "mamba_cache_mode", "none"))
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            if windows[g] == MAMBA
        }
        align = mamba_modes == {"align"}
        if MAMBA in windows and cache.enable_prefix_caching and not align:
            # Prefix caching runs with mode "align" only (vLLM's default with prefix caching).
            _refuse("Mamba prefix caching (mamba_cache_mode 'none')", "enable_prefix_caching=True")
        if MAMBA in windows and (len(mamba_modes) > 1 or getattr(cache, "mamba_cache_mode", "none") not in mamba_modes):
            # vLLM's scheduler splits chunks by the cache config's mode, its Mamba managers allocate by the specs'.
            _refuse(
                "Mamba KV cache groups whose mamba_cache_mode differs from the cache config's",
                f"cache_config.mamba_cache_mode={getattr(cache, 'mamba_cache_mode', 'none')!r}, MambaSpec modes "
                f"{sorted(mamba_modes)}",
            )
        if align and any(
            windows[g] == MAMBA and int(group.kv_cache_spec.block_size) != int(attention_block_size or block_size)
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
        ):
            # The core's align-mode Mamba blocks are its attention blocks (vLLM's default mamba_block_size).
            _refuse("Mamba blocks of another size than the attention blocks (mamba_block_size)", "MambaSpec block_size")
        if MAMBA in windows and not align:
            # vLLM's mamba_cache_mode "none": one state block of max_model_len tokens per request.
            for g, group in enumerate(kv_cache_config.kv_cache_groups):
                size = int(group.kv_cache_spec.block_size)
                if windows[g] == MAMBA and size < int(model.max_model_len):
                    # Every allocation's slots (at most max_model_len) then fit one state block, as vLLM's mode
                    # "none" makes them (mamba_block_size = max_model_len).
                    _refuse("Mamba blocks shorter than max_model_len", f"KV cache group {g}: block_size={size}")
                if windows[g] == MAMBA and size > int(model.max_model_len) and loads_kv:
                    # The core counts an asynchronous load's reservation for the in-flight prefills with state
                    # blocks of max_model_len tokens (vLLM's engine sets mamba_block_size = max_model_len).
                    _refuse(
                        "KV connectors that load KV with Mamba blocks longer than max_model_len",
                        f"kv_transfer_config.kv_role={kv_transfer.kv_role!r}, KV cache group {g}: block_size={size}",
                    )
        if CROSS_ATTENTION in windows and cache.enable_prefix_caching:
            # vLLM's CrossAttentionManager cannot look up a prefix (vLLM turns prefix caching off for
            # encoder-decoder models).
            _refuse("prefix caching with a cross-attention KV cache group", "enable_prefix_caching=True")
        victim = knobs.get("preemption_victim", "default")
        if victim != "default":
            _refuse(
                "a preemption victim rule other than the default with several KV cache groups",
                f"preemption_victim={victim!r}, {num}",
            )

    if sched.policy not in ("fcfs", "priority"):
        _refuse(f"the scheduling policy {sched.policy!r}", "policy")
    # The effective policy (vLLM's, or the kvsched setting's where vLLM's allows it) stays a knob: a bad value
    # is then reported as the kvsched settings'.
    policy = effective_policy(str(sched.policy), knobs.get("policy"))
    finer_hashes = hash_block_size is not None and hash_block_size != block_size
    # (Attention groups of different block sizes: _check_kv_cache_config refuses them beside Mamba groups, whose
    # blocks hold max_model_len tokens in mode "none".)
    # (A compressor ring's block holds its ring's rows, not tokens: the core gets the first attention group's
    # block size for it, which its one block per request never reads.)
    group_sizes: list[int] = []
    replayed = replay_groups(kv_cache_config)
    if kv_cache_groups and MAMBA not in kv_cache_groups:
        pairs = list(zip(kv_cache_config.kv_cache_groups, kv_cache_groups, strict=True))
        # (The core's primary group: the first of the smallest blocks among the attention groups not replayed.)
        first = min(
            int(p[0].kv_cache_spec.block_size) for g, p in enumerate(pairs) if p[1] != RING and g not in replayed
        )
        group_sizes = [int(g.kv_cache_spec.block_size) if w != RING else first for g, w in pairs]
    if len(set(group_sizes)) > 1:
        # (vLLM's hash block: the greatest common divisor of the groups that take part in prefix caching.)
        hashed = [size for g, size in enumerate(group_sizes) if g not in replayed]
        _check_group_block_sizes(vllm_config, group_sizes, hash_block_size, hashed)
        # The core hashes at the smallest blocks (vLLM's hash_block_size, their greatest common divisor).
        finer_hashes = False
    if hash_block_size is not None and finer_hashes:
        check_hash_block(vllm_config, windows, block_size, hash_block_size)
    block_size = attention_block_size or block_size
    # Any block size runs (a hybrid Mamba model's attention block is sized to its state's page: 272, 544, 1072,
    # ...); the core keeps a block of one rank within 4096 tokens.
    if block_size // dcp > 4096:
        _refuse("block sizes above 4096 tokens per rank", f"block_size={block_size}")

    num_spec_tokens = int(_attr(vllm_config, "num_speculative_tokens", 0) or 0)
    spec = vllm_config.speculative_config
    # EAGLE/EAGLE3/MTP drafters' prefix-cache rules. vLLM 0.33 keys blocks by look-ahead hashes with prefix caching
    # and no KV connector (num_hash_lookahead_tokens), else drops the trailing block of every hit; vLLM 0.32 always
    # drops it (it has no look-ahead hashes). disable_eagle_block_drop turns both off.
    hash_lookahead = int(_attr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    drop_trailing = spec is not None and bool(spec.use_eagle_block_drop()) and not hash_lookahead
    # Whether the Mamba groups take the drop's rules (vLLM's is_eagle_group marks them, or marks no group).
    mamba_eagle_group = True
    lookahead = int(_attr(vllm_config, "num_lookahead_tokens", 0) or 0)
    if spec is not None:
        method = f"method={spec.method!r}"
        if spec.num_speculative_tokens_per_batch_size:
            _refuse("dynamic speculation lengths", "num_speculative_tokens_per_batch_size")
        if kv_cache_groups and MAMBA in kv_cache_groups and cache.mamba_cache_mode != "align":
            # Prefix caching is off with a Mamba group (mode "none"): vLLM's trailing-block drop has no hit to act
            # on and it keys no look-ahead hashes, so vLLM's default rules (MTP on Qwen3-Next, ...) run as they are.
            # (In mode "align" the core moves the chunk ends and Mamba checkpoints with the drop, and leaves the
            # look-ahead tokens to compute before them.)
            drop_trailing = False
        if kv_cache_groups and not cache.enable_prefix_caching:
            # The drop acts on prefix hits only (vLLM looks none up).
            drop_trailing = False
        if drop_trailing and kv_cache_groups:
            if any(chunk_size_of(w) is not None for w in kv_cache_groups):
                # vLLM's ChunkedLocalAttentionManager asserts that no drop reaches it (its engine stops there).
                _refuse(
                    "the EAGLE/MTP trailing-block drop with chunked-local attention (vLLM's chunked-local manager "
                    "has none)",
                    f"{method}: set disable_eagle_block_drop=True",
                )
            flagged = [bool(getattr(g, "is_eagle_group", False)) for g in kv_cache_config.kv_cache_groups]
            if any(flagged):
                # vLLM drops in the lookup sets (groups of one spec) that hold a drafter's group only; the core
                # drops in all of them, as vLLM does when no group is marked.
                sets = {w for w in kv_cache_groups if w not in (MAMBA, CROSS_ATTENTION)}
                marked = {w for w, f in zip(kv_cache_groups, flagged, strict=True) if f}
                if not sets <= marked:
                    _refuse(
                        "the EAGLE/MTP trailing-block drop in the drafter's KV cache groups only (groups of another "
                        "kind that hold no drafter layer)",
                        f"{method}: is_eagle_group marks {sorted(g for g, f in enumerate(flagged) if f)}; set "
                        "disable_eagle_block_drop=True",
                    )
                # vLLM's Mamba groups that is_eagle_group does not mark (it marks the drafter's attention groups:
                # MTP on Qwen3-Next) take none of the drop's rules but the checkpoint position and the chunk ends.
                mamba_eagle_group = MAMBA not in kv_cache_groups or MAMBA in marked
        prefill_lookahead = int(_attr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
        window_lookup_first = None not in (windows or [None]) and any(
            isinstance(w, int) and not isinstance(w, bool) for w in windows or ()
        )
        if hash_lookahead > 1 and cache.enable_prefix_caching and window_lookup_first:
            # vLLM's window lookup runs first without a full-attention group and reads block hashes up to the
            # request's last token, past those look-ahead hashes of more than one token leave it (its scheduler
            # fails there).
            _refuse(
                "look-ahead block hashes of more than one token (multi-module MTP) with sliding-window layers and no "
                "full-attention KV cache group (vLLM's window lookup reads past the request's block hashes)",
                f"{method}: num_hash_lookahead_tokens={hash_lookahead}; set disable_lookahead_block_hashes=True",
            )
        flagged_groups = any(bool(getattr(g, "is_eagle_group", False)) for g in kv_cache_config.kv_cache_groups)
        if cache.enable_prefix_caching and block_size < prefill_lookahead and (drop_trailing or flagged_groups):
            # vLLM's KV cache coordinator rejects it at construction (its dropped tail must hold the lookahead).
            raise ValueError(
                f"Multi-module MTP with prefix caching requires scheduler_block_size (={block_size}) >= "
                f"num_speculative_tokens (={prefill_lookahead})."
            )
        # EAGLE/MTP and draft models reserve a KV slot per draft; DFlash (and DSpark's fill-in layout) one more,
        # for the bonus query of its draft pass. The core takes both counts apart, as vLLM's scheduler does.
        if lookahead not in (0, num_spec_tokens, num_spec_tokens + 1):
            _refuse(
                "drafters whose lookahead slots differ from 0, num_speculative_tokens and num_speculative_tokens + 1",
                method,
            )
        victim = knobs.get("preemption_victim", "default")
        if (
            RULES.skip_drafts
            and lookahead
            and (policy != "fcfs" or victim != "default")
            and bool(vllm_config.use_v2_model_runner)
        ):
            # vLLM's skip_drafts counts a request scheduled and then preempted in the same step; only the FCFS
            # victim (the tail of `running`) is never one, and the core does not report the others. (vLLM 0.32 has
            # no skip_drafts.)
            _refuse(
                "EAGLE-style drafters on model runner V2 (skip_drafts) with a victim rule that can preempt a request "
                "already scheduled in the step (a policy other than fcfs, or preemption_victim other than default)",
                f"{method}, policy={policy!r}, preemption_victim={victim!r}",
            )

    algo = str(_attr(cache, "prefix_caching_hash_algo", "sha256"))
    fields: dict[str, Any] = {
        "block_size": block_size // dcp,
        "dcp_world_size": dcp,
        "pcp_world_size": pcp,
        "num_blocks": int(kv_cache_config.num_blocks),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "max_model_len": int(model.max_model_len),
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "long_prefill_token_threshold": int(sched.long_prefill_token_threshold or 0),
        "policy": str(sched.policy),
        "num_lookahead_tokens": lookahead,
        "num_speculative_tokens": num_spec_tokens,
        "prefix_hash_algo": "sha256" if algo.startswith("sha256") else "xxh3_128",
    }
    if algo == "sha256":
        # vLLM's default hash: the core keys its blocks without extra keys with vLLM's own hashes, chained from
        # vLLM's NONE_HASH, so the adapter reads a filled block's hash from the core instead of hashing it again.
        fields["prefix_hash_algo"] = "sha256_pickle"
        fields["prefix_hash_seed"] = vllm_none_hash()
    # vLLM's KV cache events (kv_events_config): the core records them, the adapter publishes them in vLLM's form.
    fields["enable_kv_cache_events"] = kv_events_enabled(vllm_config)
    fields["scheduler_reserve_full_isl"] = bool(sched.scheduler_reserve_full_isl)
    fields["sliding_window"] = sliding_window
    # A multi-module MTP drafter's prefill lookahead (vLLM's num_prefill_lookahead_tokens; 1 for other EAGLE-style
    # drafters changes nothing) and the tokens its windows keep below them.
    fields["prefill_lookahead_tokens"] = int(_attr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    fields["extra_retained_tokens"] = _extra_retained_tokens(kv_cache_config) if windowed else 0
    fields["kv_cache_groups"] = kv_cache_groups
    # A KV connector with a window or several groups, in any role: the core hands it every group's blocks (null
    # blocks before a window, for loaded tokens too) and frees a window's out-of-window blocks before
    # request_finished, as vLLM's _connector_finished does (the adapter calls request_finished_all_groups of
    # SupportsHMA connectors, request_finished of the one group otherwise).
    fields["kv_connector_groups"] = kv_transfer is not None and windowed
    fields["mamba_speculative_blocks"] = mamba_speculative_blocks if kv_cache_groups and MAMBA in kv_cache_groups else 0
    # vLLM's mamba_cache_mode "align" (block-sized state blocks, block-aligned prefill chunks).
    fields["mamba_align"] = bool(kv_cache_groups and MAMBA in kv_cache_groups and cache.mamba_cache_mode == "align")
    # vLLM's workers zero new attention blocks before use with Mamba layers and with attention layers of several
    # precisions (needs_kv_cache_zeroing; a compressor ring keeps float32 keys beside the attention cache's).
    # (One group holds one spec, of one precision: vLLM's groups of several specs, UniformTypeKVCacheSpecs, are
    # refused above.)
    zeroing = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
    fields["zero_new_blocks"] = zeroing and kv_cache_groups is not None and MAMBA not in kv_cache_groups
    # vLLM's sparse retention of cached Mamba states and sliding-window blocks (the KV cache config's
    # prefix_cache_retention_interval, the engine's default 0); it changes nothing without prefix caching of
    # align-mode Mamba states or of a sliding window.
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", None)
    has_window = any(isinstance(w, int) and not isinstance(w, bool) for w in windows or ())
    sparse = fields["enable_prefix_caching"] and (fields["mamba_align"] or has_window)
    fields["prefix_cache_retention_interval"] = None if retention is None or not sparse else int(retention)
    # vLLM 0.32 keeps a window's run (a Mamba state) at a shared-prefix junction only, 0.33 also one block lower
    # for the groups that take the drop's rules.
    fields["drop_junction_below"] = RULES.drop_junction_below
    cached_mamba = fields["mamba_align"] and fields["enable_prefix_caching"]
    # Mamba2 and Gated DeltaNet layers' prefill checkpoints (MambaSpec's num_prefill_checkpoint_blocks and
    # prefill_checkpoint_alignment): the last prefill chunk exports a block-boundary state into an extra block.
    fields["mamba_prefill_checkpoint_alignment"] = _checkpoint_alignment(kv_cache_config) if cached_mamba else None
    fields["hash_lookahead_tokens"] = hash_lookahead
    fields["drop_trailing_hit_block"] = drop_trailing
    fields["mamba_eagle_group"] = mamba_eagle_group
    # vLLM's hash_block_size (prefix_match_unit): the core chains a block's hash over the hash blocks, so a block's
    # key is vLLM's hash of its last hash block.
    fields["hash_block_size"] = hash_block_size if finer_hashes else None
    if len(set(group_sizes)) > 1:
        fields["kv_cache_group_block_sizes"] = tuple(group_sizes)
    if finer_hashes and fields["enable_prefix_caching"] and (hash_lookahead or drop_trailing):
        # vLLM's full-attention groups then key a prompt's tail inside its last block as the block's own hash
        # (its free order and promotion follow); the core does not keep these entries.
        _refuse(
            "EAGLE/MTP prefix-cache rules (look-ahead hashes, trailing-block drop) with a hash block smaller than "
            "the block",
            f"hash_block_size={hash_block_size}, block_size={block_size}: set disable_eagle_block_drop=True",
        )
    fields["async_scheduling"] = bool(sched.async_scheduling)
    fields["watermark"] = float(sched.watermark)
    # A token budget apart from the input budget (vLLM's max_num_scheduled_tokens; above the input budget it
    # changes nothing), and the query slots a drafter adds to every scheduled request (P-EAGLE, draft models,
    # PARD). DFlash/DSpark cap the drafting requests through max_num_active_seqs, which vLLM's config sets.
    scheduled = sched.max_num_scheduled_tokens
    if scheduled is not None and scheduled < sched.max_num_batched_tokens:
        fields["max_num_scheduled_tokens"] = int(scheduled)
    fields["draft_slots"] = int(spec.max_num_new_slots_for_drafting) if spec is not None else 0
    if sched.max_num_active_seqs is not None:
        fields["max_num_active_seqs"] = int(sched.max_num_active_seqs)
    fields["long_prefill_token_threshold_adaptive"] = bool(sched.long_prefill_token_threshold_adaptive)
    # vLLM 0.33 applies the prefill cadence in the scheduler only without data parallelism (vLLM 0.32 never); a DP
    # engine core drives it across ranks through schedule(throttle_prefills=...), which the adapter passes on.
    fields["prefill_schedule_interval"] = (
        int(sched.prefill_schedule_interval) if RULES.local_prefill_cadence and parallel.data_parallel_size == 1 else 1
    )
    # Where the supported vLLM releases' scheduling rules differ (kvsched.vllm._compat).
    fields["max_loras_counts_unscheduled"] = RULES.max_loras_counts_unscheduled
    fields["continue_after_self_preemption"] = RULES.continue_after_self_preemption
    fields["skip_encoder_blocked_admissions"] = RULES.skip_encoder_blocked_admissions
    fields["exact_encoder_cut_and_release"] = RULES.exact_encoder_cut_and_release
    fields["skip_lookahead_cut_admissions"] = RULES.skip_lookahead_cut_admissions
    fields["cache_drafts_at_update"] = RULES.cache_drafts_at_update
    fields["trim_computed_on_stop"] = RULES.trim_computed_on_stop
    fields["cache_upto_in_flight"] = RULES.cache_upto_in_flight
    fields["mamba_defer_new_states_only"] = RULES.mamba_defer_new_states_only
    # vLLM keeps a request waiting for its grammar in `waiting` (skipped where the admission pass reaches it).
    fields["park_grammar_waits"] = False
    # vLLM keeps a request whose asynchronous KV load is in progress in `kv_holding_waiting` at its place.
    fields["park_kv_loads"] = False
    # ... and admits an asynchronous load only beside what its in-flight prefills still need.
    fields["reserve_inflight_prefills"] = True
    # vLLM 0.33 with a consumer connector and several batches in flight frees the blocks of a request a step in
    # flight still writes only once that step is processed (a load could land in them meanwhile).
    fields["defer_block_free"] = bool(
        kv_transfer is not None and kv_transfer.is_kv_consumer and vllm_config.max_concurrent_batches > 1
    )
    # Pipeline parallelism: vLLM's engine keeps max_concurrent_batches steps in flight (its batch queue), which
    # also sizes a sliding window's admission cap; AsyncScheduler on model runner V2 lets pipeline_parallel_size
    # calls pass between two decode steps of a request (XPU without PP microbatching: 1).
    fields["max_concurrent_batches"] = int(vllm_config.max_concurrent_batches)
    fields["decode_stagger"] = decode_stagger(vllm_config)
    # vLLM's engine has no swap path (its runner never copies KV to a CPU pool): preemption recomputes.
    fields["preemption_mode"] = "recompute"
    # A failed asynchronous load: the core cuts the request's computed tokens back to the valid prefix (policy
    # "recompute"); with vLLM's policy "fail" kvsched.vllm.Scheduler then finishes the request itself, after the
    # step's outputs, as vLLM's scheduler does.
    if vllm_config.lora_config is not None:
        fields["max_loras"] = int(vllm_config.lora_config.max_loras)
    # (Without encoder inputs it changes nothing; a text model's scheduler can get an encoder cache later.)
    fields["disable_chunked_mm_input"] = bool(sched.disable_chunked_mm_input)
    # Encoder-decoder models: vLLM's EncoderDecoderCacheManager (the budget and cache size come with the
    # scheduler's construction, from vLLM's MultiModalBudget).
    fields["encoder_decoder"] = enc_dec
    # vLLM reserves a speculative decode step's blocks in every group for an asynchronous load's admission, counted
    # at each group's block size, a ring's rows included: the core counts a ring's by ring_block_size.
    rings = sorted(
        {
            int(g.kv_cache_spec.block_size)
            for g, w in zip(kv_cache_config.kv_cache_groups, kv_cache_groups, strict=True)
            if w == RING
        }
        if kv_cache_groups is not None
        else ()
    )
    if len(rings) > 1 and kv_transfer is not None and num_spec_tokens:
        _refuse(
            "KV connectors with speculative decoding beside compressor rings of different sizes",
            f"kv_transfer_config, ring block sizes {rings}",
        )
    fields["ring_block_size"] = rings[0] if rings else None
    # DeepSeek V4.1's sliding windows rebuilt by bounded prefix replay.
    fields["prefix_replay_groups"] = replay_groups(kv_cache_config)
    if fields["prefix_replay_groups"]:
        aux = getattr(vllm_config, "aux_output_config", None)
        if aux is not None and getattr(aux, "enabled", False):
            _refuse("the auxiliary output connector beside bounded-replay windows", "aux_output_config")
    return build_config(fields, knobs), num_spec_tokens


def vllm_none_hash() -> bytes:
    """The ``NONE_HASH`` (block 0's parent hash) that vLLM's engine sets for its default SHA-256 block hash once it
    has built its scheduler: the hash of ``PYTHONHASHSEED``, or of vLLM's fixed seed where that is not set."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    return bytes(sha256(resolve_none_hash_seed(sha256)))


def decode_stagger(vllm_config: Any) -> int:
    """vLLM's ``AsyncScheduler.decode_stagger`` where it applies (async scheduling on model runner V2): the
    pipeline-parallel size, 1 on XPU without ``VLLM_XPU_PP_MICROBATCH``; 1 elsewhere."""
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp <= 1 or not vllm_config.scheduler_config.async_scheduling or not vllm_config.use_v2_model_runner:
        return 1
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if current_platform.is_xpu() and not envs.VLLM_XPU_PP_MICROBATCH:
        return 1
    return pp


def check_encoder_decoder(vllm_config: Any, windows: list[int | str | None] | None) -> None:
    """Refuses the encoder-decoder deployments vLLM 0.33's scheduler refuses, or kvsched does not schedule yet."""
    model = vllm_config.model_config
    if not _attr(model, "supports_multimodal_inputs", False):
        # vLLM's scheduler asserts that an encoder-decoder model implements the multimodal interface.
        _refuse("encoder-decoder models without the multimodal interface", "model_config.is_encoder_decoder")
    if CROSS_ATTENTION not in (windows or []):
        _refuse(
            "encoder-decoder models without a cross-attention KV cache group (CrossAttentionSpec)",
            "model_config.is_encoder_decoder",
        )
    if bool(_attr(vllm_config, "use_v2_model_runner", False)):
        _refuse("encoder-decoder models on model runner V2 (encoder_input_updates)", "use_v2_model_runner")
    if vllm_config.ec_transfer_config is not None:
        _refuse("encoder-decoder models with an encoder-cache connector", "ec_transfer_config")
    if _attr(vllm_config.ec_manager_config, "encoder_cache_manager_cls", None) is not None:
        _refuse("custom encoder cache managers", "ec_manager_config.encoder_cache_manager_cls")


def check_multimodal(vllm_config: Any) -> None:
    """Refuses the multimodal settings the core does not implement (for a multimodal model at construction, and
    for any model once its encoder budget and cache are sized after construction)."""
    if _attr(vllm_config, "is_mm_encoder_only", False):
        _refuse("encoder-only multimodal deployments", "multimodal_config.mm_encoder_only")
    if _attr(vllm_config.ec_manager_config, "encoder_cache_manager_cls", None) is not None:
        _refuse("custom encoder cache managers", "ec_manager_config.encoder_cache_manager_cls")
    if bool(vllm_config.scheduler_config.disable_chunked_mm_input) and RULES.version == "0.32":
        # vLLM 0.32 lets a chunk that starts exactly at an input end inside it; the core follows 0.33.
        _refuse("disable_chunked_mm_input on vLLM 0.32", "--disable-chunked-mm-input")


def encoder_budget(vllm_config: Any, mm_registry: Any) -> tuple[int, int]:
    """vLLM's encoder compute budget and encoder cache size (in encoder tokens) for the model, computed as vLLM's
    scheduler computes them (``MultiModalBudget``); ``(0, 0)`` for a model without multimodal inputs."""
    if not _attr(vllm_config.model_config, "supports_multimodal_inputs", False):
        return 0, 0
    from vllm.multimodal.encoder_budget import MultiModalBudget

    budget = MultiModalBudget(vllm_config, mm_registry)
    return int(budget.encoder_compute_budget), int(budget.encoder_cache_size)
