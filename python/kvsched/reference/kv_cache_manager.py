"""Per-request KV block management on top of the pool: block hashes, prefix-cache lookup, ``_allocate_slots``
(all or nothing), caching full blocks at allocation time, and freeing. Mirrors
``rust/kvsched-core/src/kv_cache_manager.rs`` (vLLM's ``KVCacheManager`` for one full-attention group, or one
sliding-window group: ``sliding_window`` set, tables start with null blocks, block 0, where blocks left the window).
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
        token is always computed. With a sliding window: the rightmost run of cached blocks covering the window
        before its end, null blocks before it; without one, the run from block 0."""
        hits: list[int] = []
        if not self._config.enable_prefix_caching:
            return hits
        window = self._config.sliding_window
        if window is not None:
            max_blocks = min((num_tokens - 1) // self._bs, len(block_hashes))
            need = math.ceil((window - 1) / self._bs)
            run: list[int] = []  # rightmost block first
            for i in range(max_blocks - 1, -1, -1):
                blocks = self._cached.get(block_hashes[i])
                if not blocks:
                    run = []
                    continue
                run.append(next(iter(blocks)))
                if len(run) >= need:
                    return [0] * i + run[::-1]
            return run[::-1]
        for i in range((num_tokens - 1) // self._bs):
            blocks = self._cached.get(block_hashes[i])
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def _skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens wholly before the window of the token after ``num_computed_tokens`` (0 without a window)."""
        window = self._config.sliding_window
        return 0 if window is None else max(0, num_computed_tokens - window + 1)

    def _remove_skipped_blocks(self, r: _Request, processed: int) -> None:
        """The blocks wholly before the window of the ``processed`` tokens go back to the pool, deepest first
        (from the last one before the window back to the first null block), and become null blocks."""
        last = min(self._skipped_tokens(processed) // self._bs, len(r.block_ids))
        first = last
        while first > 0 and r.block_ids[first - 1] != 0:
            first -= 1
        if first < last:
            self._free_block_list(r.block_ids[first:last])
            r.block_ids[first:last] = [0] * (last - first)

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
        if self._config.sliding_window is not None:
            return self._window_sequence_need(r, hits) + reserved <= len(self._free)
        need = max(0, math.ceil(full / self._bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        return need + evictable_hits + reserved <= len(self._free)

    def _window_sequence_need(self, r: _Request, hits: list[int]) -> int:
        """The full-sequence check's blocks with a sliding window: at most the admission cap; a new request's hits
        before the window of its first computed token become null blocks, the others count when at ref 0."""
        c = self._config
        assert c.sliding_window is not None
        batches = 2 if c.async_scheduling else 1
        cap = math.ceil(min(c.sliding_window - 1 + batches * c.max_num_batched_tokens, c.max_model_len) / self._bs) + 1
        required = min(math.ceil(min(r.num_tokens, c.max_slots_per_request) / self._bs), cap)
        if r.block_ids:
            return max(0, required - len(r.block_ids))
        skipped = self._skipped_tokens(len(hits) * self._bs) // self._bs
        evictable = sum(1 for b in hits[skipped:] if b != 0 and self._ref_cnt[b] == 0)
        return max(0, required - max(skipped, len(hits))) + evictable

    def _cache_blocks(self, r: _Request, num_tokens: int) -> None:
        """Enter ``r``'s full blocks among its first ``num_tokens`` tokens into the cache map (if caching)."""
        if not self._config.enable_prefix_caching:
            return
        num_full = min(num_tokens // self._bs, len(r.block_hashes), len(r.block_ids))
        first = r.num_cached_blocks
        for i in range(first, num_full):
            b, h = r.block_ids[i], r.block_hashes[i]
            if b == 0 or self._config.sliding_window == 1:
                continue  # a null block; a window of one token caches nothing (no block can start a hit)
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
                r.req_id,
                first,
            )

    def _allocate_slots(
        self, r: _Request, n: int, hits: list[int], lookahead: int, reserved: int = 0, ext: int = 0, cache: bool = True
    ) -> list[int] | None:
        """Reserve KV slots for ``n`` more tokens (+ lookahead), leaving ``reserved`` blocks free: the new
        blocks, or None (no block allocated or touched). ``ext`` tokens after the hits come from the KV connector
        (they take slots like computed tokens); with ``cache`` False (an asynchronous load) no block enters the
        cache now. With a sliding window, the blocks that left the window of the processed tokens (computed less
        in flight) go back to the pool first, whatever the outcome; a new request's table starts with null blocks
        for its computed tokens before the window."""
        c, bs = self._config, self._bs
        total_computed = r.num_computed_tokens + len(hits) * bs + ext
        num_slots = min(total_computed + n + lookahead, c.max_slots_per_request)
        skipped = 0
        if c.sliding_window is not None:
            self._remove_skipped_blocks(r, max(0, total_computed - r.num_in_flight_tokens))
            if not r.block_ids:
                skipped = self._skipped_tokens(total_computed) // bs
        kept = hits[skipped:]
        need = max(0, math.ceil(num_slots / bs) - len(r.block_ids) - max(skipped, len(hits)))
        evictable_hits = sum(1 for b in kept if self._ref_cnt[b] == 0)
        if need + evictable_hits + reserved > len(self._free):
            return None
        for b in kept:  # touch
            if self._ref_cnt[b] == 0:
                self._free.remove(b)
            self._ref_cnt[b] += 1
        r.block_ids += [0] * skipped + kept
        r.num_cached_blocks += skipped + len(kept)  # hits, and the null blocks before the window, count as cached
        new_blocks = [self._pop_free_block() for _ in range(need)]
        r.block_ids += new_blocks
        if cache:
            self._cache_blocks(r, min(total_computed + n, r.num_tokens))  # now, before the model writes them
        return new_blocks
