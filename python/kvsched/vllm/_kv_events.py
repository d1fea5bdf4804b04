"""vLLM's KV cache events (``kv_events_config``) from kvsched's core.

The core records what enters and leaves its prefix cache (:mod:`kvsched.kv_events`) in the same places and order
as vLLM 0.33's block pool, keyed by its own block hashes. :class:`KVEventTranslator` turns each batch into vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with vLLM's own block hashes; the adapter publishes them
the way vLLM's scheduler does: one ``KVEventBatch`` per ``update_from_output`` that has events, the KV
connector's events after the cache's, through the publisher ``EventPublisherFactory`` builds from
``kv_events_config`` (:func:`make_publisher`).

A stored run names its request, its KV cache group, its block size, the index of its first block and that of each
block it stored, so its vLLM hashes are that request's ``block_hashes`` at those blocks' ends (vLLM's values, kept
on the ``Request`` by the adapter, one per hash block: a block of ``k`` hash blocks at index ``i`` ends at hash
``(i + 1) * k - 1``, as vLLM resolves a larger group's hashes), and so are its parent, tokens and extra keys. With
KV cache groups of different block sizes a prompt's tail entry (vLLM's partial prefix-cache entry, a second key
of a full-attention block) is a stored run of one hash block, and is removed right after its block. In a
sliding-window or chunked-local group the blocks of a run out of the window are null blocks (in an align-mode
Mamba group, the entries between its states), and under sparse retention (``prefix_cache_retention_interval``)
the blocks no later hit can use are not cached: vLLM leaves both out of the
event's hashes and extra keys, wherever they sit in the run, while its tokens and parent span the whole run. A
removed block carries no request: the core's hash of a block and vLLM's are both functions of the same content
(parent, tokens, LoRA, cache salt), so the hash a block was stored under is looked up in a map from the core's
(group, hash) to vLLM's, kept while some block of the group carries it. Events
must therefore be taken from the core (:meth:`KVEventTranslator.collect`) while the requests they name are still
known: after each ``schedule()`` and before ``update_from_output`` or ``finish_requests`` forgets a finished
request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

try:  # vLLM 0.33 (look-ahead block hashes); vLLM 0.32 has none
    from vllm.v1.core.kv_cache_utils import generate_lookahead_block_hash_extra_keys
except ImportError:  # pragma: no cover - vLLM 0.32
    generate_lookahead_block_hash_extra_keys = None
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvsched.kv_events import CLEARED, STORED

# vLLM 0.33's BlockStored has lookahead_token_ids (None without look-ahead hashes); vLLM 0.32's has no such field.
_HAS_LOOKAHEAD_FIELD = "lookahead_token_ids" in getattr(BlockStored, "__struct_fields__", ())

__all__ = ["KVEventTranslator", "kv_events_enabled", "make_publisher"]


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM's ``kv_events_config`` turns KV cache events on (vLLM's scheduler's own test)."""
    config = vllm_config.kv_events_config
    return config is not None and bool(config.enable_kv_cache_events)


def make_publisher(vllm_config: Any) -> Any:
    """vLLM's event publisher, built as vLLM's scheduler builds it (``NullEventPublisher`` when events are off)."""
    return EventPublisherFactory.create(vllm_config.kv_events_config, vllm_config.parallel_config.data_parallel_index)


class KVEventTranslator:
    """Translates the core's KV cache events into vLLM's (see the module docstring); ``get_request`` finds a live
    ``Request`` by id."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, get_request: Callable[[str], Any]) -> None:
        self.enabled = kv_events_enabled(vllm_config)
        # vLLM's KVCacheManager annotates every stored event with its group's spec.
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        self._spec_meta = [(get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs]
        self._get_request = get_request
        # Look-ahead block hashes (vLLM 0.33, EAGLE-style drafters): each block's event also carries the tokens
        # after it that its hash covers, and its extra keys cover them too.
        self._lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
        # (group, the core's hash) of a cached block -> the vLLM hash (as published) it was stored under.
        self._vllm_hash: dict[tuple[int, bytes], Any] = {}
        self._pending: list[KVCacheEvent] = []

    def collect(self, core: Any) -> None:
        """Takes the core's events since the last call and translates them (the requests they name are live)."""
        ev = core.take_kv_cache_events()
        if not len(ev):
            return
        kinds = ev.kinds.tolist()
        indptr = ev.block_hashes_indptr.tolist()
        copies = ev.num_copies.tolist()
        positions = ev.block_positions.tolist()
        firsts = ev.num_cached_blocks.tolist()
        groups = ev.groups.tolist()
        tokens_indptr = ev.token_ids_indptr.tolist()
        sizes = ev.block_sizes.tolist()
        rows = ev.block_hash_list()
        hash_block = ev.block_size
        vllm_hash = self._vllm_hash
        pending = self._pending
        for e, kind in enumerate(kinds):
            g = groups[e]
            if kind == STORED:
                req_id = ev.req_ids[e]
                assert req_id is not None
                request = self._get_request(req_id)
                # The run spans its tokens; its stored blocks sit at their indices in the request's table.
                block_size = sizes[e]
                k = block_size // hash_block
                first = firsts[e]
                end = first + (tokens_indptr[e + 1] - tokens_indptr[e]) // block_size
                stored = positions[indptr[e] : indptr[e + 1]]
                hashes = [maybe_convert_block_hash(request.block_hashes[(i + 1) * k - 1]) for i in stored]
                for core_hash, h in zip(rows[indptr[e] : indptr[e + 1]], hashes, strict=True):
                    vllm_hash[g, core_hash] = h
                pending.append(self._stored(request, hashes, first, stored, end, block_size, k, g))
            elif kind == CLEARED:
                vllm_hash.clear()
                pending.append(AllBlocksCleared())
            else:
                key = (g, rows[indptr[e]])
                h = vllm_hash[key] if copies[indptr[e]] else vllm_hash.pop(key)
                pending.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=g))

    def _stored(
        self,
        request: Any,
        hashes: list[Any],
        first: int,
        stored: list[int],
        end: int,
        block_size: int,
        k: int,
        group: int,
    ) -> BlockStored:
        """vLLM's ``BlockStored`` for group ``group``'s run of the request's blocks ``first .. end`` (of
        ``block_size`` tokens, ``k`` hash blocks each), of which those at ``stored`` (in order) were stored, as its
        block pool builds it."""
        bh = request.block_hashes
        extra_keys: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        la = self._lookahead
        for i in stored:
            lo, hi = i * block_size, (i + 1) * block_size
            if la:
                keys, mm_idx = generate_lookahead_block_hash_extra_keys(request, lo, hi, hi + la, mm_idx)
            else:
                keys, mm_idx = generate_block_hash_extra_keys(request, lo, hi, mm_idx)
            extra_keys.append(keys)
        lookahead: dict[str, Any] = {}
        if _HAS_LOOKAHEAD_FIELD:
            tokens = request.all_token_ids
            ids = [tokens[(i + 1) * block_size : (i + 1) * block_size + la] for i in stored]
            lookahead["lookahead_token_ids"] = ids if la else None
        lora = request.lora_request
        kind, window = self._spec_meta[group]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(bh[first * k - 1]) if first else None,
            token_ids=request.all_token_ids[first * block_size : end * block_size],
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            session_id=request.session_id,
            **lookahead,
        )

    def publish(self, publisher: Any, core: Any, connector: Any) -> None:
        """vLLM's end of ``update_from_output``: the cache's events, then the connector's (taken whether or not
        events are on, as vLLM does), in one ``KVEventBatch`` to ``publisher`` if there are any."""
        if self.enabled:
            self.collect(core)
        events, self._pending = self._pending, []
        if connector is not None:
            connector_events = connector.take_events()
            if connector_events:
                events.extend(connector_events)
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
