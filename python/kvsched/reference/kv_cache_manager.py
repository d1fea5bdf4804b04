"""Per-request KV block management on top of the pool: block hashes, prefix-cache lookup, ``_allocate_slots``
(all or nothing), caching full blocks at allocation time, and freeing. Mirrors
``rust/kvsched-core/src/kv_cache_manager.rs`` (vLLM's ``KVCacheManager`` for one full-attention group).
"""

from __future__ import annotations

import math

from .block_pool import _BlockPoolMixin
from .request import _Request


class _KVCacheManagerMixin(_BlockPoolMixin):
    """What a request asks of the block pool."""

    def _update_block_hashes(self, r: _Request) -> None:
        if self._config.enable_prefix_caching:
            r.block_hashes = self._hasher.block_hashes_of(
                r.token_ids, r.cache_salt, r.lora_name, len(r.block_hashes), r.block_hashes, r.encoder_inputs
            )

    def _lookup(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Longest prefix hit: the first cached block per hash, stopping at the first miss, capped so the last
        token is always computed."""
        hits: list[int] = []
        if not self._config.enable_prefix_caching:
            return hits
        for i in range((num_tokens - 1) // self._bs):
            blocks = self._cached.get(block_hashes[i])
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def _free_blocks(self, r: _Request) -> None:
        """Release ``r``'s blocks in reverse; cached ones go to the tail (LRU), uncached ones as one group to the
        head, deepest first (so the head is the deepest freed block)."""
        self._free_block_list(r.block_ids)
        r.block_ids = []
        r.num_cached_blocks = 0

    def _full_sequence_fits(self, r: _Request, hits: list[int], reserved: int) -> bool:
        """Could the free blocks hold all of ``r``'s tokens (capped at max_slots_per_request) beyond its hits, and still
        leave ``reserved`` (the watermark) free?"""
        full = min(r.num_tokens, self._config.max_slots_per_request)
        need = max(0, math.ceil(full / self._bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        return need + evictable_hits + reserved <= len(self._free)

    def _cache_blocks(self, r: _Request, num_tokens: int) -> None:
        """Enter ``r``'s full blocks among its first ``num_tokens`` tokens into the cache map (if caching)."""
        if not self._config.enable_prefix_caching:
            return
        num_full = min(num_tokens // self._bs, len(r.block_hashes), len(r.block_ids))
        first = r.num_cached_blocks
        for i in range(first, num_full):
            b, h = r.block_ids[i], r.block_hashes[i]
            self._block_hash[b] = h
            self._cached.setdefault(h, {})[b] = None
            self._newly_cached.append((b, h))
        r.num_cached_blocks = max(r.num_cached_blocks, num_full)
        if self._events is not None and num_full > first:  # one stored event for the run, after its evictions
            hashes = r.block_hashes[first:num_full]
            self._events.push_stored(
                [(h, len(self._cached[h])) for h in hashes],
                r.block_hashes[first - 1] if first else None,
                r.token_ids[first * self._bs : num_full * self._bs],
                r.lora_name,
                r.cache_salt,
            )

    def _allocate_slots(
        self, r: _Request, n: int, hits: list[int], lookahead: int, reserved: int = 0, ext: int = 0, cache: bool = True
    ) -> list[int] | None:
        """Reserve KV slots for ``n`` more tokens (+ lookahead), leaving ``reserved`` blocks free: the new
        blocks, or None (nothing changed). ``ext`` tokens after the hits come from the KV connector (they take
        slots like computed tokens); with ``cache`` False (an asynchronous load) no block enters the cache now."""
        c, bs = self._config, self._bs
        total_computed = r.num_computed_tokens + len(hits) * bs + ext
        num_slots = min(total_computed + n + lookahead, c.max_slots_per_request)
        need = max(0, math.ceil(num_slots / bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        if need + evictable_hits + reserved > len(self._free):
            return None
        for b in hits:  # touch
            if self._ref_cnt[b] == 0:
                self._free.remove(b)
            self._ref_cnt[b] += 1
        r.block_ids += hits
        r.num_cached_blocks += len(hits)
        new_blocks = [self._pop_free_block() for _ in range(need)]
        r.block_ids += new_blocks
        if cache:
            self._cache_blocks(r, min(total_computed + n, r.num_tokens))  # now, before the model writes them
        return new_blocks
