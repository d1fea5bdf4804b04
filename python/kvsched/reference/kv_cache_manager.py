"""Per-request KV block management on top of the pool: block hashes, prefix-cache lookup, ``_allocate_slots``
(all or nothing), caching full blocks at allocation time, and freeing. Mirrors
``rust/kvsched-core/src/kv_cache_manager.rs`` (vLLM's ``KVCacheManager`` for one full-attention group, or one
sliding-window group: ``sliding_window`` set, tables start with null blocks, block 0, where blocks left the window).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .._errors import InvalidRequestError, SchedulerTypeError
from ..config import CROSS_ATTENTION, MAMBA, RING, chunk_size_of
from .block_pool import _BlockPoolMixin
from .request import _Request

_I32_MAX = 2**31 - 1
_CROSS = -1  # a cross-attention group's entry in _group_windows
_MAMBA = -2  # a Mamba group's entry in _group_windows
_RING = -3  # a ring-buffer group's entry in _group_windows
_CHUNKED = 1 << 31  # the flag of a chunked-local group's entry in _group_windows (_CHUNKED | chunk size)


def _group_window(entry: int | str | None) -> int:
    """A ``kv_cache_groups`` entry as ``_group_windows`` gives it."""
    if entry is None:
        return 0
    if entry == CROSS_ATTENTION:
        return _CROSS
    if entry == MAMBA:
        return _MAMBA
    if entry == RING:
        return _RING
    chunk = chunk_size_of(entry)
    return int(entry) if chunk is None else _CHUNKED | chunk


def _mamba_checkpoint(num_tokens: int, bs: int, drop_eagle: bool, hash_lookahead: int) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position``: the last multiple of ``bs`` that leaves a token (or the
    look-ahead tokens) to compute; with EAGLE's trailing-block drop, the multiple at or below, one block lower."""
    limit = num_tokens if drop_eagle else num_tokens - max(1, hash_lookahead)
    pos = limit // bs * bs
    if drop_eagle:
        pos -= bs
    return max(pos, 0)


def _mamba_retained(i: int, bs: int, retention: int, reachable: tuple[int, ...]) -> bool:
    """vLLM's ``MambaManager.reachable_block_mask``: whether state block ``i`` (after ``(i + 1) * bs`` tokens)
    is cached under retention interval ``retention``: every one for an interval of one block, each at a multiple
    of the interval above that, and the ones at the ``reachable`` positions floored to a block boundary."""
    per_segment = retention // bs
    if retention > 0 and (per_segment <= 1 or (i + 1) % per_segment == 0):
        return True
    return any(b >= bs and b // bs == i + 1 for b in reachable)


def _checkpoint_valid(start: int, end: int, checkpoint: int, bs: int, align: int | None, unit: int = 0) -> bool:
    """vLLM's ``is_mamba_prefill_checkpoint_valid``: can a chunk computing tokens ``start..end`` export the state
    after ``checkpoint`` tokens (``align``: the prefill checkpoint alignment; ``unit``: the prefix-match unit when
    hits can end inside a block, else the block)?"""
    if not align:
        return False
    unit = unit or bs
    return (
        start % unit == 0
        and -(-end // bs) - 2 > (start - 1) // bs
        and start + unit <= checkpoint
        and start < checkpoint < end
        and (checkpoint - start) % align == 0
    )


def _window_reachable(
    num_prompt: int, junction: int, bs: int, eagle: bool, below: bool = True, align: int = 0
) -> tuple[int, ...]:
    """The positions a later request can resume a sliding window's hit at (vLLM's ``replay_boundaries`` and the
    shared-prefix ``junction``, 0: none): the prompt's last token; with EAGLE's drop the resend and longer-sibling
    positions floored to ``align`` (the scheduler block; default ``bs``) one ``align`` lower each, and with
    ``below`` (vLLM 0.33's groups that take the drop's rules) the junction one block (``bs``, the group's) lower
    too."""
    if eagle:
        a = align or bs
        out = [max((num_prompt - 1) // a * a - a, 0), max(num_prompt // a * a - a, 0)]
    else:
        out = [max(num_prompt - 1, 0)]
    if junction > 0:
        out.append(junction)
        if eagle and below and junction >= bs:
            out.append(junction - bs)
    return tuple(out)


def _window_retained(i: int, bs: int, window: int, eagle: bool, retention: int, reachable: tuple[int, ...]) -> bool:
    """vLLM's ``SlidingWindowManager.reachable_block_mask``: whether block ``i`` of a window of ``window`` tokens
    is cached under retention interval ``retention``: the ``need`` blocks a hit needs (``ceil((window - 1) / bs)``,
    one more with EAGLE, whose run ends one block past the boundary) before each ``reachable`` position floored to
    a block boundary, and with an interval above 0 the last ``need`` blocks of every segment of that interval
    (every block when ``need`` covers a segment)."""
    shift = int(eagle)
    need = -(-(window - 1) // bs) + shift
    if retention > 0:
        per_segment = retention // bs
        if need >= per_segment or (i >= shift and (i - shift) % per_segment >= per_segment - need):
            return True
    return any(b // bs + shift - need <= i < b // bs + shift for b in reachable)


def _window_kept(
    i: int, bs: int, align: int, window: int, eagle: bool, retention: int | None, reachable: tuple[int, ...]
) -> bool:
    """``_window_retained`` for a window group of blocks of ``bs`` tokens among groups of different block sizes, hits
    aligned to ``align`` tokens: the last ``need`` blocks of every segment of ``align`` tokens (dense, None) or of
    ``retention`` tokens (above 0), and with retention on the ``need`` blocks before each ``reachable`` position
    floored to ``align``. With the trailing-block drop (``eagle``) a hit needs one block more, past the aligned
    boundary: each run shifts one block up."""
    shift = int(eagle)
    need = -(-(window - 1) // bs) + shift
    segment = align if retention is None else retention or None
    if segment is not None:
        per_segment = segment // bs
        if need >= per_segment or (i >= shift and (i - shift) % per_segment >= per_segment - need):
            return True
    return retention is not None and any(
        b // align * align // bs + shift - need <= i < b // align * align // bs + shift for b in reachable
    )


class _KVCacheManagerMixin(_BlockPoolMixin):
    """What a request asks of the block pool."""

    def _check_cross_attention_tokens(self, req_id: str, tokens: object, resumable: object) -> int:
        """``add_request``'s check of ``cross_attention_tokens``: an int in [0, 2**31), only with a cross-attention
        group, not for a streaming-input session, its blocks within the whole cache. Returns it (0 for None)."""
        if tokens is None:
            return 0
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise SchedulerTypeError(f"cross_attention_tokens must be an int, got {type(tokens).__name__}")
        if not 0 <= tokens <= _I32_MAX:
            raise InvalidRequestError(f"cross_attention_tokens must be in [0, {_I32_MAX}], got {tokens}")
        if tokens == 0:
            return 0
        c = self._config
        if CROSS_ATTENTION not in (c.kv_cache_groups or ()):
            raise InvalidRequestError(
                f"request {req_id!r}: cross_attention_tokens ({tokens}) needs a cross-attention group in "
                "kv_cache_groups"
            )
        if resumable:
            raise InvalidRequestError(
                f"request {req_id!r}: a streaming-input session (resumable) cannot have cross_attention_tokens"
            )
        blocks = math.ceil(tokens / self._bs)
        if blocks > c.num_usable_blocks:
            raise InvalidRequestError(
                f"request {req_id!r}: cross_attention_tokens ({tokens}) need {blocks} blocks, more than the KV "
                f"cache's {c.num_usable_blocks} usable blocks"
            )
        return tokens

    def _update_block_hashes(self, r: _Request) -> None:
        unit = self._partial_unit
        if unit:  # every unit's hash, then the blocks' (each its last unit's)
            r.unit_hashes = self._hasher.unit_hashes_of(
                r.token_ids, r.cache_salt, r.lora_name, r.unit_hashes, r.encoder_inputs
            )
            k = self._bs // unit
            r.block_hashes.extend(
                r.unit_hashes[(i + 1) * k - 1] for i in range(len(r.block_hashes), len(r.unit_hashes) // k)
            )
            return
        if self._config.enable_prefix_caching:
            r.block_hashes = self._hasher.block_hashes_of(
                r.token_ids, r.cache_salt, r.lora_name, len(r.block_hashes), r.block_hashes, r.encoder_inputs
            )

    def _lookup(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        if self._config.kv_cache_groups is not None:
            return self._hybrid_lookup(block_hashes, num_tokens)
        return self._single_lookup(block_hashes, num_tokens)

    def _single_lookup(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """Longest prefix hit: the first cached block per hash, stopping at the first miss, capped so the last
        token is always computed (and, with ``drop_trailing_hit_block``, less its last block). With a sliding
        window: the rightmost run of cached blocks covering the window before its end, null blocks before it;
        without one, the run from block 0."""
        hits: list[int] = []
        if not self._config.enable_prefix_caching:
            return hits
        window = self._config.sliding_window
        drop = self._config.drop_trailing_hit_block
        if window is not None:
            # With the drop, the run needs one block more and the hit then gives up its last block.
            max_blocks = min((num_tokens - 1) // self._bs, len(block_hashes))
            need = math.ceil((window - 1) / self._bs) + int(drop)
            run: list[int] = []  # rightmost block first
            start = 0
            for i in range(max_blocks - 1, -1, -1):
                blocks = self._cached.get(block_hashes[i])
                if not blocks:
                    run = []
                    continue
                run.append(next(iter(blocks)))
                if len(run) >= need:
                    start = i
                    break
            hits = [0] * start + run[::-1]
            if drop and hits:
                hits.pop()
            return hits
        for i in range(min((num_tokens - 1) // self._bs, len(block_hashes))):
            blocks = self._cached.get(block_hashes[i])
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        if self._config.drop_trailing_hit_block and hits:
            hits.pop()  # the last hit block is computed again
        return hits

    def _skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens wholly before the window of the token after ``num_computed_tokens`` (0 without a window)."""
        window = self._config.sliding_window
        return 0 if window is None else max(0, num_computed_tokens - window - self._config.extra_retained_tokens + 1)

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

    def _take_all_skipped(self, r: _Request, processed: int) -> list[list[int]]:
        """vLLM's ``remove_skipped_blocks`` over every window group (the one ``sliding_window`` without groups) and
        align-mode Mamba group, in group order, without freeing: the blocks become null blocks and come back per
        group."""
        c = self._config
        if c.kv_cache_groups is None:
            if c.sliding_window is None:
                return []
            windows: tuple[int, ...] = (c.sliding_window,)
        else:
            windows = self._group_windows()
        out = []
        for g, w in enumerate(windows):
            removed: list[int] = []
            if w > 0:
                table = r.block_ids if c.kv_cache_groups is None else self._group_table(r, g)
                last = min(self._group_skipped(w, processed) // self._group_bs(g), len(table))
                first = last
                while first > 0 and table[first - 1] != 0:
                    first -= 1
                removed = table[first:last]
                table[first:last] = [0] * (last - first)
            elif w == _MAMBA and c.mamba_align and processed > 1:
                # An align-mode Mamba group: its states below the one of the last processed token.
                table = self._group_table(r, g)
                last = min((processed - 1) // self._bs, len(table))
                removed = [b for b in table[:last] if b != 0]
                table[:last] = [0] * last
            out.append(removed)
        return out

    def _computed_tables(self, r: _Request, computed: int) -> list[list[int]]:
        """Every group's table in group order, each attention group's cut to the blocks of the first ``computed``
        tokens (vLLM's ``get_block_ids_for_computed_tokens``; Mamba and cross-attention tables whole, a ring's block
        once a token is computed)."""
        n = math.ceil(computed / self._bs)
        if self._config.kv_cache_groups is None:
            return [r.block_ids[:n]]
        return [
            list(self._group_table(r, g))
            if w in (_MAMBA, _CROSS)
            else self._group_table(r, g)[: math.ceil(computed / self._group_bs(g))]
            for g, w in enumerate(self._group_windows())
        ]

    def _free_blocks(self, r: _Request) -> None:
        """Release ``r``'s blocks in reverse; cached ones go to the tail (LRU), uncached ones as one group to the
        head, deepest first (so the head is the deepest freed block). With several groups, group by group in group
        order."""
        if self._config.kv_cache_groups is not None:
            self._drop_boundary_offers(r.req_id)
            for g in range(len(self._config.kv_cache_groups)):
                self._free_block_list(self._group_table(r, g))
            r.group_block_ids = [[] for _ in r.group_block_ids]
            r.group_num_cached = [0] * len(r.group_num_cached)
            r.mamba_allocated.clear()
            r.mamba_appended.clear()
            r.mamba_checkpoint.clear()
            r.partial_hits.clear()
        else:
            self._free_block_list(r.block_ids)
        r.block_ids = []
        r.num_cached_blocks = 0

    def _full_sequence_fits(self, r: _Request, hits: list[int], ext: int, reserved: int) -> bool:
        """Could the free blocks hold all of ``r``'s tokens (capped at max_slots_per_request) beyond its hits, and still
        leave ``reserved`` (the watermark) free? ``ext``: the tokens after the hits the KV connector loads (with a
        sliding window they move the window of the first computed token on)."""
        full = min(r.num_tokens, self._config.max_slots_per_request)
        if self._config.kv_cache_groups is not None:
            return self._hybrid_sequence_need(r, hits, ext) + reserved <= len(self._free)
        if self._config.sliding_window is not None:
            return self._window_sequence_need(r, hits, ext) + reserved <= len(self._free)
        need = max(0, math.ceil(full / self._bs) - len(r.block_ids) - len(hits))
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        return need + evictable_hits + reserved <= len(self._free)

    def _window_sequence_need(self, r: _Request, hits: list[int], ext: int) -> int:
        """The full-sequence check's blocks with a sliding window: at most the admission cap; a new request's blocks
        before the window of its first computed token (after its hits and ``ext`` loaded tokens) become null blocks,
        its hits inside the window count when at ref 0."""
        c = self._config
        assert c.sliding_window is not None
        batches = c.concurrent_batches
        window = c.sliding_window + c.extra_retained_tokens  # (the extra tokens kept below it count too)
        cap = math.ceil(min(window - 1 + batches * c.max_num_batched_tokens, c.max_model_len) / self._bs) + 1
        required = min(math.ceil(min(r.num_tokens, c.max_slots_per_request) / self._bs), cap)
        if r.block_ids:
            return max(0, required - len(r.block_ids))
        skipped = self._skipped_tokens(len(hits) * self._bs + ext) // self._bs
        evictable = sum(1 for b in hits[skipped:] if b != 0 and self._ref_cnt[b] == 0)
        return max(0, required - max(skipped, len(hits))) + evictable

    def _cache_blocks(self, r: _Request, num_tokens: int) -> None:
        """Enter ``r``'s full blocks among its first ``num_tokens`` tokens into the cache map (if caching)."""
        if not self._config.enable_prefix_caching:
            return
        # The last prefill_lookahead_tokens - 1 computed tokens are not final (vLLM's unitary coordinator; its
        # hybrid one only with the trailing-block drop).
        c, groups = self._config, self._config.kv_cache_groups
        computed = num_tokens
        if c.drop_trailing_hit_block or groups is None or len(groups) == 1:
            num_tokens = max(0, num_tokens - self._reprefillable)
        if self._config.kv_cache_groups is not None:
            self._cache_hybrid_blocks(r, num_tokens, computed)
            return
        c, bs = self._config, self._bs
        num_full = min(num_tokens // bs, len(r.block_hashes), len(r.block_ids))
        first = r.num_cached_blocks
        window, retention, eagle = c.sliding_window, c.prefix_cache_retention_interval, c.drop_trailing_hit_block
        # sparse retention of the window's blocks (one group: no shared-prefix junction)
        reach = _window_reachable(r.num_prompt_tokens, 0, bs, eagle) if window and retention is not None else ()

        def kept(i: int) -> bool:
            # a window of one token caches nothing (no block can start a hit), but with the trailing-block drop
            # (whose hit needs the block past the boundary)
            if window is None or retention is None:
                return window != 1 or eagle
            return (window != 1 or eagle) and _window_retained(i, bs, window, eagle, retention, reach)

        for i in range(first, num_full):
            b, h = r.block_ids[i], r.block_hashes[i]
            if b == 0 or not kept(i):
                continue
            self._block_hash[b] = h
            self._cached.setdefault(h, {})[b] = None
            self._newly_cached.append((b, h))
        r.num_cached_blocks = max(r.num_cached_blocks, num_full)
        if self._events is not None and num_full > first:  # one stored event for the run, after its evictions
            self._record_stored(r, r.block_ids, first, num_full, 0, kept)

    def _record_stored(
        self,
        r: _Request,
        table: list[int],
        first: int,
        num_full: int,
        g: int,
        stored: Callable[[int], bool],
        offset: int = 0,
        single: bool = False,
    ) -> None:
        """The stored event of group ``g``'s run ``first:num_full`` of ``r``'s blocks (``table``: the group's
        blocks from index ``offset`` on): the hashes of its blocks that are not null and that ``stored`` entered,
        with the copies of the group's key of each and its index in the group's table, and the tokens and parent
        of the whole run. A group whose blocks hold ``k`` hash blocks keys its block ``i`` by hash ``(i + 1) * k -
        1``; ``single`` records one hash block of the request (``first``) at the hash block's size."""
        assert self._events is not None
        gbs = self._bs if single else self._group_bs(g)
        k = gbs // self._bs
        kept = [
            (r.block_hashes[(i + 1) * k - 1], i)
            for i in range(first, num_full)
            if table[i - offset] != 0 and stored(i) and (i + 1) * k <= len(r.block_hashes)
        ]
        self._events.push_stored(
            [(h, self._num_copies(self._group_key(h, g)), i) for h, i in kept],
            r.block_hashes[first * k - 1] if first else None,
            r.token_ids[first * gbs : num_full * gbs],
            r.lora_name,
            r.cache_salt,
            r.req_id,
            first,
            g,
            gbs,
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
        if c.kv_cache_groups is not None:
            return self._allocate_hybrid_slots(r, n, hits, lookahead, reserved, ext, cache)
        total_computed = r.num_computed_tokens + len(hits) * bs + ext
        num_slots = min(total_computed + n + lookahead, c.max_slots_per_request)
        skipped = 0
        if c.sliding_window is not None:
            self._remove_skipped_blocks(r, max(0, total_computed - r.num_in_flight_tokens))
            if not r.block_ids:
                skipped = self._skipped_tokens(total_computed) // bs
        kept = hits[skipped:]
        need = max(0, math.ceil(num_slots / bs) - len(r.block_ids) - max(skipped, len(hits)))
        # (with extra_retained_tokens a window hit's null blocks can reach past the skipped ones: never touched)
        evictable_hits = sum(1 for b in kept if b != 0 and self._ref_cnt[b] == 0)
        if need + evictable_hits + reserved > len(self._free):
            return None
        for b in (b for b in kept if b != 0):  # touch
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

    # --- several KV cache groups (``kv_cache_groups``; the core's ``hybrid.rs``)

    def _group_windows(self) -> tuple[int, ...]:
        """Each group's window, 0 for full attention, -1 for cross attention, -2 for Mamba, -3 for a ring buffer,
        ``_CHUNKED | c`` for chunked-local attention in chunks of ``c`` tokens."""
        groups = self._config.kv_cache_groups
        assert groups is not None
        return tuple(_group_window(w) for w in groups)

    def _fill_ring_hits(self, hits: list[list[int]], n: int) -> None:
        """A ring or replay group's hit (never looked up: vLLM's is empty) as ``n`` null blocks, the primary group's
        length, so that group 0's hits give the hit's length whatever group comes first; the allocation takes
        nothing from it."""
        replay = self._config.prefix_replay_groups
        for g, w in enumerate(self._group_windows()):
            if w == _RING or g in replay:
                hits[g] = [0] * n

    def _group_skipped(self, w: int, computed: int) -> int:
        """Tokens a window or chunked-local group ``w`` no longer reads once ``computed`` tokens are computed: those
        before the window of the next token (less the ``extra_retained_tokens`` a window keeps), or before its
        chunk."""
        if w & _CHUNKED:
            c = w & ~_CHUNKED
            return computed // c * c
        return max(0, computed - w - self._config.extra_retained_tokens + 1)

    def _group_bs(self, g: int) -> int:
        """Group ``g``'s block size (``kv_cache_group_block_sizes``; ``block_size`` without)."""
        sizes = self._config.kv_cache_group_block_sizes
        return self._bs if sizes is None else sizes[g]

    def _hit_align(self) -> int:
        """What a hit's length and each group's cached tokens are multiples of: the least common multiple of the
        groups' block sizes (vLLM's scheduler block size)."""
        sizes = self._config.kv_cache_group_block_sizes
        return self._bs if sizes is None else math.lcm(*sizes)

    def _group_cap(self, w: int, bs: int) -> int:
        """A window's (or chunked-local group's) admission cap in blocks of ``bs`` tokens."""
        c = self._config
        in_flight = c.concurrent_batches * c.max_num_batched_tokens
        if w & _CHUNKED:
            return math.ceil(min((w & ~_CHUNKED) + in_flight, c.max_model_len) / bs)
        return math.ceil(min(w - 1 + c.extra_retained_tokens + in_flight, c.max_model_len) / bs) + 1

    def _cross_blocks_to_add(self, r: _Request, held: int) -> int:
        """The blocks a cross-attention table of ``held`` blocks still needs for ``r``'s encoder output."""
        return max(0, math.ceil(r.cross_attention_tokens / self._bs) - held)

    def _group_slot(self, g: int) -> int | None:
        """Where group ``g``'s table sits in ``group_block_ids``; None for the primary group (``block_ids``)."""
        p = self._config.primary_group
        return None if g == p else g if g < p else g - 1

    def _group_table(self, r: _Request, g: int) -> list[int]:
        i = self._group_slot(g)
        return r.block_ids if i is None else r.group_block_ids[i]

    def _group_cached(self, r: _Request, g: int) -> int:
        i = self._group_slot(g)
        return r.num_cached_blocks if i is None else r.group_num_cached[i]

    def _set_group_cached(self, r: _Request, g: int, n: int) -> None:
        i = self._group_slot(g)
        if i is None:
            r.num_cached_blocks = n
        else:
            r.group_num_cached[i] = n

    def _hit_all(self, block_hashes: list[bytes], i: int, ids: list[int], k: int = 1) -> list[int] | None:
        """The first block cached for each group of ``ids`` under the hash of block ``i`` of ``k``-hash blocks (the
        hash of its last hash block, ``block_hashes[(i + 1) * k - 1]``), or None if one misses."""
        found = []
        for g in ids:
            blocks = self._cached.get(self._group_key(block_hashes[(i + 1) * k - 1], g))
            if not blocks:
                return None
            found.append(next(iter(blocks)))
        return found

    def _lookup_sets(self) -> list[tuple[int, list[int]]]:
        """The lookup sets: groups with the same window together (full attention as one), full attention first, then
        the others in order of first appearance; cross attention, rings, replay groups and Mamba (but align mode's
        with caching) have none."""
        sets: list[tuple[int, list[int]]] = []
        mamba_lookup = self._config.mamba_align and self._config.enable_prefix_caching
        replay = self._config.prefix_replay_groups
        for g, w in enumerate(self._group_windows()):
            if (w < 0 and not (w == _MAMBA and mamba_lookup)) or g in replay:
                continue  # never cached: no lookup
            for sw, ids in sets:
                if sw == w:
                    ids.append(g)
                    break
            else:
                sets.append((w, [g]))
        sets.sort(key=lambda s: s[0] != 0)
        return sets

    def _max_hit_len(self, block_hashes: list[bytes], num_tokens: int) -> int:
        if self._config.enable_prefix_caching and num_tokens > 0:
            return min((num_tokens - 1) // self._bs, len(block_hashes)) * self._bs
        return 0

    def _hybrid_lookup(self, block_hashes: list[bytes], num_tokens: int) -> list[int]:
        """The longest hit valid for every group: groups with the same window are looked up together, full
        attention first, each lookup capped at the hit so far, until a pass shortens nothing. Returns the primary
        group's hits (their length is the hit's); every group's are kept in ``_group_hits`` for the allocation that
        follows."""
        windows = self._group_windows()
        sets = self._lookup_sets()
        hits: list[list[int]] = [[] for _ in windows]
        done = [False] * len(windows)
        bs = self._bs
        # lengths in tokens; each set looks its blocks up at its own block size, and a hit is aligned to `align`
        longest = 0
        hit_len = self._max_hit_len(block_hashes, num_tokens)
        # The trailing-block drop: a set not yet verified at the current candidate looks one block further and gives
        # up its hit's last block (a window's run needs one block more); a Mamba set is verified as it is, or with
        # mamba_eagle_group off is none of the drop's (never verified).
        verified = [False] * len(sets)
        while True:
            curr = hit_len
            for idx, (w, ids) in enumerate(sets):
                gbs = self._group_bs(ids[0])
                if w == 0 and done[ids[0]]:
                    curr = min(curr, len(hits[ids[0]]) * gbs)
                    continue
                eagle = (
                    self._config.drop_trailing_hit_block
                    and not verified[idx]
                    and (w != _MAMBA or self._config.mamba_eagle_group)
                )
                before = curr
                curr = self._set_hit(block_hashes, w, ids, curr, eagle, hits)
                for g in ids:
                    done[g] = True
                if eagle:
                    verified[idx] = True
                elif curr < before:
                    verified = [False] * len(sets)
                longest = max(longest, curr)
            if curr >= hit_len:
                break
            hit_len = curr
            if len(sets) == 2 and sets[0][0] == 0:
                break  # one full-attention set and one window set: the window's lookup was capped at the full hit
        self._group_hits = [h[: hit_len // self._group_bs(g)] for g, h in enumerate(hits)]
        self._fill_ring_hits(self._group_hits, hit_len // bs)
        self._group_longest = longest // bs
        self._group_per_set = False
        return self._group_hits[self._config.primary_group]

    def _partial_hit_lookup(self, units: list[bytes], max_len: int) -> tuple[list[list[int]], int]:
        """The hybrid lookup when a prefix hit can end inside a block (``_partial_unit`` tokens per unit; full
        attention and align-mode Mamba groups, no trailing-block drop), over the request's unit hashes, capped at
        ``max_len`` tokens: full attention takes whole blocks, then the first missing block's unit boundaries high to
        low; Mamba the rightmost unit boundary it has cached, null blocks before its block. The sets run in order to a
        fixed point (one pass with a full-attention set and one other); full attention is cut to the blocks the hit
        touches. Returns every group's hits and the hit in tokens."""
        unit, bs = self._partial_unit, self._bs
        k = bs // unit
        windows = self._group_windows()
        sets = self._lookup_sets()
        hits: list[list[int]] = [[] for _ in windows]
        len_of: list[int | None] = [None] * len(windows)

        def found(f: int, ids: list[int]) -> list[int] | None:
            blocks = [next(iter(self._cached.get(self._group_key(units[f], g), {})), None) for g in ids]
            return None if None in blocks else blocks  # type: ignore[return-value]

        hit_len = max_len
        longest = 0
        while True:
            curr = hit_len
            for w, ids in sets:
                first_len = len_of[ids[0]]
                if w == 0 and first_len is not None:
                    curr = min(curr, first_len)
                    continue
                for g in ids:
                    hits[g] = []
                got = 0
                if w == _MAMBA:
                    for f in range(min(curr // unit, len(units)) - 1, -1, -1):
                        if (blocks := found(f, ids)) is not None:
                            for g, b in zip(ids, blocks, strict=True):
                                hits[g] = [0] * (f // k) + [b]
                            got = (f + 1) * unit
                            break
                else:
                    for i in range(min(curr // bs, len(units) // k)):
                        if (blocks := found((i + 1) * k - 1, ids)) is None:
                            break
                        for g, b in zip(ids, blocks, strict=True):
                            hits[g].append(b)
                    got = len(hits[ids[0]]) * bs
                    lo = len(hits[ids[0]]) * k
                    for f in range(min(lo + k - 1, curr // unit, len(units)) - 1, lo - 1, -1):
                        if (blocks := found(f, ids)) is not None:
                            for g, b in zip(ids, blocks, strict=True):
                                hits[g].append(b)
                            got = (f + 1) * unit
                            break
                for g in ids:
                    len_of[g] = got
                curr = got
                longest = max(longest, curr)
            if curr >= hit_len:
                break
            hit_len = curr
            if len(sets) == 2 and sets[0][0] == 0:
                break
        for w, ids in sets:
            if w == 0:
                for g in ids:
                    del hits[g][-(-hit_len // bs) :]
        self._fill_ring_hits(hits, len(hits[self._config.primary_group]))
        self._partial_longest = longest
        return hits, hit_len

    def _partial_lookup(self, r: _Request, num_tokens: int) -> list[int]:
        """An admission's lookup when prefix hits can end inside a block (``_partial_hit_lookup`` over the request's
        unit hashes, leaving out the last of ``num_tokens`` tokens): group 0's hits; every group's are kept in
        ``_group_hits``, the hit in tokens in ``_partial_hit_tokens``, and the request's shared-prefix junction is
        the longest set's hit when it is longer (in tokens, not rounded to a block)."""
        max_len = num_tokens - 1 if self._config.enable_prefix_caching and num_tokens > 0 else 0
        hits, hit_len = self._partial_hit_lookup(r.unit_hashes, max_len)
        self._group_hits = hits
        self._group_per_set = False
        self._partial_hit_tokens = hit_len
        r.shared_prefix_boundary = self._partial_longest if self._partial_longest > hit_len else 0
        return hits[0]

    def _hit_tokens(self, hits: list[int]) -> int:
        """The tokens group 0's ``hits`` (from the last lookup) cover: its blocks', or with prefix hits inside a
        block the lookup's hit."""
        if self._partial_unit and hits:
            return self._partial_hit_tokens
        return len(hits) * self._bs

    def _set_hit(
        self, block_hashes: list[bytes], w: int, ids: list[int], curr: int, eagle: bool, hits: list[list[int]]
    ) -> int:
        """The hit of the lookup set ``(w, ids)`` capped at ``curr`` tokens, into ``hits`` for each of its groups
        (``eagle``: it applies the trailing-block drop); returns its length in tokens."""
        bs, align = self._bs, self._hit_align()
        gbs = self._group_bs(ids[0])
        k = gbs // bs
        for g in ids:
            hits[g] = []
        drop = int(eagle and w != _MAMBA)
        n = (min(curr + gbs, len(block_hashes) * bs) if drop else curr) // gbs
        if w == _MAMBA:
            # Right to left: the first block every Mamba group has cached, null blocks before it.
            for i in range(n - 1, -1, -1):
                found = self._hit_all(block_hashes, i, ids, k)
                if found is not None:
                    for g, b in zip(ids, found, strict=True):
                        hits[g] = [0] * i + [b]
                    break
        elif w == 0:
            for i in range(n):
                found = self._hit_all(block_hashes, i, ids, k)
                if found is None:
                    break
                for g, b in zip(ids, found, strict=True):
                    hits[g].append(b)
        elif w & _CHUNKED:
            # Null blocks before the chunk that holds token n * gbs, then the cached blocks from there on, up to
            # the first miss.
            chunk = w & ~_CHUNKED
            start = n * gbs // chunk * chunk // gbs
            for g in ids:
                hits[g] = [0] * start
            for i in range(start, n):
                found = self._hit_all(block_hashes, i, ids, k)
                if found is None:
                    break
                for g, b in zip(ids, found, strict=True):
                    hits[g].append(b)
        else:
            need = math.ceil((w - 1) / gbs) + drop
            run: list[list[int]] = []  # rightmost block first
            start = None
            for i in range(n - 1, -1, -1):
                found = self._hit_all(block_hashes, i, ids, k)
                if found is None:
                    run = []
                    continue
                if not run and (i + 1 - drop) * gbs % align:
                    continue  # a run must end (after the drop) on the alignment
                run.append(found)
                if len(run) >= need:
                    start = i
                    break
            run.reverse()
            if start is None:  # the run from block 0, cut to the alignment
                while len(run) * gbs % align:
                    run.pop()
            for j, g in enumerate(ids):
                hits[g] = [0] * (start or 0) + [f[j] for f in run]
        for g in ids:
            if drop and hits[g]:
                hits[g].pop()
            while w > 0 and len(hits[g]) * gbs % align:
                hits[g].pop()  # a window's run after the drop: back to the alignment
        got = len(hits[ids[0]]) * gbs
        if w == 0:  # a full-attention hit rounded down to the alignment
            got -= got % align
            for g in ids:
                del hits[g][got // gbs :]
        return got

    def _hybrid_lookup_per_group(self, block_hashes: list[bytes], num_tokens: int) -> tuple[list[int], bool] | None:
        """The local hit with a KV connector that completes divergent local hits (``divergent_local_hits``): each
        lookup set alone, capped at the same length, each group keeping its own hit. None when a group's hit runs
        deeper than full attention's, or without Mamba groups or full attention (the usual lookup then). Else as
        many entries as the full-attention hit has blocks (group 0's hits, null blocks past them) and whether some
        group's hit (0 outside every lookup set) is shorter."""
        windows = self._group_windows()
        sets = self._lookup_sets()
        if _MAMBA not in windows or not sets or sets[0][0] != 0:
            return None
        hits: list[list[int]] = [[] for _ in windows]
        cap = self._max_hit_len(block_hashes, num_tokens)
        lens = [0] * len(windows)
        for w, ids in sets:
            got = self._set_hit(block_hashes, w, ids, cap, self._config.drop_trailing_hit_block, hits)
            for g in ids:
                lens[g] = got
        fa = lens[sets[0][1][0]]
        replay = self._config.prefix_replay_groups
        for g, w in enumerate(windows):
            if w == _RING or g in replay:  # a ring or a replay group takes no part in the hit
                lens[g] = fa
        self._fill_ring_hits(hits, fa // self._bs)
        if any(length > fa for length in lens):
            return None
        self._group_hits = hits
        self._group_longest = 0
        self._group_per_set = True
        num_hits = fa // self._bs
        out = hits[0][:num_hits]
        return out + [0] * (num_hits - len(out)), any(length < fa for length in lens)

    def _shared_prefix_boundary(self, num_hits: int) -> int:
        """After a lookup that found ``num_hits`` blocks: the tokens of the longest hit one lookup set found when it
        exceeds them (vLLM's ``shared_prefix_boundary``), else 0; 0 with one group, and without caching and either
        align-mode Mamba groups or sparse retention (the only ones that read it)."""
        c = self._config
        if not (c.kv_cache_groups and (c.mamba_align or c.prefix_cache_retention_interval is not None)):
            return 0
        if not c.enable_prefix_caching:
            return 0
        return self._group_longest * self._bs if self._group_longest > num_hits else 0

    def _hits_of_groups(self, hits: list[int]) -> list[list[int]]:
        """Every group's hits that go with group 0's ``hits`` (from the lookup that found them)."""
        if not hits:
            return [[] for _ in self._group_windows()]
        # (A lookup whose hits can end inside a block hands out group 0's hits, the others the primary group's.)
        given = (self._group_hits[0], self._group_hits[self._config.primary_group])
        assert self._group_per_set or hits in given, "the hits come from the last lookup"
        return self._group_hits

    def _hybrid_sequence_need(self, r: _Request, hits: list[int], ext: int) -> int:
        """The full-sequence check's blocks over every group (a window's capped at its admission cap)."""
        c, bs = self._config, self._bs
        all_hits = self._hits_of_groups(hits)
        num_slots = min(r.num_tokens, c.max_slots_per_request)
        hit_tokens = self._hit_tokens(hits)
        # (the tokens computed once the hit and the loaded tokens are in: a Mamba checkpoint chunk starts there)
        total_computed = min(r.num_computed_tokens + hit_tokens + ext, num_slots)
        partial = bool(hits) and hit_tokens % bs != 0  # one more block per group: the copy of the hit's last
        total = 0
        for g, w in enumerate(self._group_windows()):
            held, ghits, gbs = len(self._group_table(r, g)), all_hits[g], self._group_bs(g)
            required = math.ceil(num_slots / gbs)
            if w == _CROSS:
                total += self._cross_blocks_to_add(r, held) if not r.block_ids else 0
                continue
            if w == _MAMBA and c.mamba_align:
                if ghits:
                    if self._mamba_hit_key(r, g, ghits) in self._mamba_cached_step:
                        return c.num_blocks + 1  # a hit on a state this step writes: never fits in this step
                    total += int(self._ref_cnt[ghits[-1]] == 0)
                entries = required + c.mamba_speculative_blocks
                allocated = g in r.mamba_allocated
                checkpoint = self._align_checkpoint(r, g, allocated, total_computed, num_slots) is not None
                copy = partial or g in r.partial_hits
                total += max(0, self._align_need(entries, held + len(ghits), allocated, checkpoint, copy))
                continue
            if w == _MAMBA:
                total += max(0, 1 + c.mamba_speculative_blocks - held) if not r.block_ids else 0
                continue
            if w == _RING:
                total += int(held == 0)
                continue
            if w == 0:
                total += max(0, required - held - len(ghits)) + sum(1 for b in ghits if self._ref_cnt[b] == 0)
                total += int(partial)
                continue
            req_g = min(required, self._group_cap(w, gbs))
            if held:
                total += max(0, req_g - held)
                continue
            skipped = self._group_skipped(w, len(hits) * bs + ext) // gbs
            if g in c.prefix_replay_groups:  # its hit is rebuilt by the replay: nothing taken from it
                total += max(0, req_g - skipped)
                continue
            evictable = sum(1 for b in ghits[skipped:] if b != 0 and self._ref_cnt[b] == 0)
            total += max(0, req_g - max(skipped, len(ghits))) + evictable
        return total

    def _allocate_hybrid_slots(
        self, r: _Request, n: int, hits: list[int], lookahead: int, reserved: int, ext: int, cache: bool
    ) -> list[int] | None:
        """``_allocate_slots`` over every group: each window's out-of-window blocks go back first (group order);
        the blocks needed are summed over the groups; then each group touches its hits, then each pops its new
        blocks, then each caches its full blocks. Returns group 0's new blocks."""
        c, bs = self._config, self._bs
        all_hits = self._hits_of_groups(hits)
        windows = self._group_windows()
        hit_tokens = self._hit_tokens(hits)
        total_computed = r.num_computed_tokens + hit_tokens + ext
        processed = max(0, total_computed - r.num_in_flight_tokens)
        # a hit ending inside a block: each group copies that block into a block of its own before writing into it
        partial = bool(hits) and hit_tokens % bs != 0
        align = c.mamba_align
        for g, w in enumerate(windows):
            if w > 0:
                self._remove_group_skipped(r, g, w, processed)
            elif w == _MAMBA and align:
                self._remove_mamba_skipped(r, g, processed)
        fresh = not r.block_ids
        num_slots = min(total_computed + n + lookahead, c.max_slots_per_request)
        # Align-mode Mamba groups: the entries the state's tokens (no lookahead) want.
        mamba_entries = math.ceil((total_computed + n) / bs) + c.mamba_speculative_blocks
        plan = []
        # (group, null blocks before them, blocks of the external tokens), popped first
        ext_plan: list[tuple[int, int, int]] = []
        # the tokens computed before a new request's allocation: the external ones
        ext_tokens = r.num_computed_tokens + ext if fresh else 0
        total_need = evictable = 0
        uncounted = 0  # blocks align-mode Mamba groups pop beyond their counts (a load's state block)
        untouched = 0  # evictable hits counted but never touched (a local hit's state below a load's): stay free
        before = [len(self._group_table(r, g)) for g in range(len(windows))]
        for g, w in enumerate(windows):
            if w == _MAMBA and align:  # may be negative: vLLM sums it as it is
                ghits = all_hits[g]  # a new request's hit: the state block at its end, null blocks before it
                if ghits:
                    if self._mamba_hit_key(r, g, ghits) in self._mamba_cached_step:
                        return None  # its state is written by this step: not before the next step
                    evictable += int(self._ref_cnt[ghits[-1]] == 0)
                held = len(self._group_table(r, g)) + len(ghits)
                allocated = g in r.mamba_allocated
                # the prefill checkpoint, kept for the growth and the caching (even if the allocation fails)
                checkpoint = self._align_checkpoint(r, g, allocated, total_computed, total_computed + n)
                if checkpoint is None:
                    r.mamba_checkpoint.pop(g, None)
                else:
                    r.mamba_checkpoint[g] = checkpoint
                copy = partial or g in r.partial_hits
                counted = self._align_need(mamba_entries, held, allocated, checkpoint is not None, copy)
                total_need += counted
                if ext_tokens > 0 and not self._group_table(r, g):
                    # A load's state: null blocks before the block of the last loaded token, popped with the other
                    # groups' external blocks; the growth pops the rest (uncounted when the chunk reaches a later
                    # block, as vLLM counts it). A local hit's state lies below the loaded tokens: counted above,
                    # neither touched nor kept.
                    pad = (total_computed - 1) // bs
                    ext_plan.append((g, pad, 1))
                    popped = 1 + mamba_entries - max(pad + 1, mamba_entries - 1 - c.mamba_speculative_blocks)
                    uncounted += popped - counted
                    untouched += int(bool(ghits) and self._ref_cnt[ghits[-1]] == 0)
                plan.append((max(0, len(ghits) - 1), 0))
                continue
            if w < 0:  # the encoder output's, the state's or the ring's blocks, at the first allocation only
                held = len(self._group_table(r, g))
                need = 0
                if w == _RING:
                    need = int(held == 0)  # one block, never grown
                elif fresh:
                    need = (
                        self._cross_blocks_to_add(r, held)
                        if w == _CROSS
                        else max(0, 1 + c.mamba_speculative_blocks - held)
                    )
                if w in (_MAMBA, _RING) and ext_tokens > 0 and need > 0:
                    # a load's state or ring block, popped with the other groups' external blocks
                    ext_plan.append((g, 0, 1))
                total_need += need
                plan.append((0, need))
                continue
            gbs = self._group_bs(g)
            skipped_tokens = self._group_skipped(w, total_computed) if fresh and w else 0
            skipped = skipped_tokens // gbs
            # a replay group's hit counts as empty: null blocks for the skipped tokens, fresh blocks for the rest
            replayed = g in c.prefix_replay_groups
            held_after_hits = len(self._group_table(r, g)) + (skipped if replayed else max(skipped, len(all_hits[g])))
            need = max(0, math.ceil(num_slots / gbs) - held_after_hits) + int(partial)
            if not replayed:
                evictable += sum(1 for b in all_hits[g][skipped:] if b != 0 and self._ref_cnt[b] == 0)
            total_need += need
            # A new request's external tokens: vLLM pops their blocks for every group before the other new blocks
            # (allocate_external_computed_blocks), unless the window skips them all.
            # (the tokens computed before a new request's allocation: the external ones).
            g_ext = min(ext_tokens, total_computed - skipped_tokens) if skipped_tokens else ext_tokens
            if g_ext > 0:
                ext_plan.append((g, 0, min(need, max(0, math.ceil(total_computed / gbs) - held_after_hits))))
            plan.append((skipped, need))
        if total_need + evictable + reserved > len(self._free):
            return None
        if uncounted > 0 and total_need + evictable - untouched + uncounted > len(self._free):
            return None  # the blocks popped and touched exceed the free ones (vLLM's pool raises there)
        for g, (skipped, _) in enumerate(plan):
            loaded_state = windows[g] == _MAMBA and align and ext_tokens > 0  # a local hit's state stays in the cache
            ring = windows[g] == _RING  # its hit: null blocks, nothing to take
            if (windows[g] in (_CROSS, _MAMBA) and not all_hits[g]) or ring or loaded_state:
                continue
            if g in c.prefix_replay_groups:  # the skipped tokens' null blocks only: the replay rebuilds the hit
                self._group_table(r, g).extend([0] * skipped)
                self._set_group_cached(r, g, self._group_cached(r, g) + skipped)
                continue
            kept = all_hits[g][skipped:]
            # A chunked-local hit can hold null blocks past the skipped ones (never touched).
            for b in (b for b in kept if b != 0):  # touch
                if self._ref_cnt[b] == 0:
                    self._free.remove(b)
                self._ref_cnt[b] += 1
            self._group_table(r, g).extend([0] * skipped + kept)
            self._set_group_cached(r, g, self._group_cached(r, g) + skipped + len(kept))
            if partial:  # the block the hit ends inside, copied by the growth below; cached once the copy is full
                r.partial_hits[g] = (hit_tokens // bs, kept[-1])
                self._set_group_cached(r, g, hit_tokens // bs)
        new_blocks: list[int] = []
        for g, pad, ext_need in ext_plan:
            table = self._group_table(r, g)
            table.extend([0] * (pad - len(table)))
            ext_blocks = [self._pop_free_block() for _ in range(ext_need)]
            table.extend(ext_blocks)
            if self._zero_ids and windows[g] not in (_MAMBA, _RING) and g not in self._skip_zero:
                self._zero_ids[g].extend(ext_blocks)  # unless an asynchronous load writes them
            if g == c.primary_group:
                new_blocks = ext_blocks
            if not (windows[g] == _MAMBA and align):
                plan[g] = (plan[g][0], plan[g][1] - ext_need)
        for g, (_, need) in enumerate(plan):
            if windows[g] == _MAMBA and align:
                self._grow_mamba_align(r, g, mamba_entries)
                continue
            fresh_blocks = [self._pop_free_block() for _ in range(need)]
            if g in r.partial_hits:  # the first is the copy of the block the hit ends inside
                idx, source = r.partial_hits.pop(g)
                self._apply_copy(r, g, idx, source, fresh_blocks[0])
                self._group_table(r, g).extend(fresh_blocks[1:])
            else:
                self._group_table(r, g).extend(fresh_blocks)
            # with a Mamba group: new attention blocks are zeroed (not a ring's)
            if self._zero_ids and windows[g] not in (_MAMBA, _RING):
                self._zero_ids[g].extend(fresh_blocks)
            if g == c.primary_group:
                new_blocks = new_blocks + fresh_blocks
        for g, w in enumerate(windows):
            if w not in (_CROSS, _MAMBA, _RING) and self._group_bs(g) != bs:
                # another block size than the primary group's: its new block ids are the blocks it appended
                r.mamba_appended[g] = len(self._group_table(r, g)) - before[g]
        if cache:
            self._cache_blocks(r, min(total_computed + n, r.num_tokens))
        return new_blocks

    def _mamba_split(self, r: _Request, start: int, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``start`` cut where an align-mode Mamba state must be written
        (vLLM's ``_mamba_block_aligned_split`` without the shared-prefix checkpoint option, with the request's
        shared-prefix junction; the core's ``AlignedSplit``). With prefix hits inside a block (``_partial_unit``)
        the prefill's checkpoint is a unit boundary, and the prompt's last unit boundary past the last block
        boundary is a stop too."""
        c, bs, unit = self._config, self._bs, self._partial_unit
        prefill_end = max(r.num_prompt_tokens, r.num_tokens - 1)
        if start >= prefill_end:
            return n
        end = start + n
        drop, lookahead = c.drop_trailing_hit_block, c.hash_lookahead_tokens
        internal = end >= prefill_end and _checkpoint_valid(
            start,
            end,
            _mamba_checkpoint(prefill_end, unit or bs, drop, lookahead),
            bs,
            c.mamba_prefill_checkpoint_alignment,
            unit,
        )  # with prefill checkpoints: the last chunk exports the prefill's checkpoint from inside it
        last_cache = 0 if internal else _mamba_checkpoint(r.num_tokens, bs, drop, lookahead)
        if end < prefill_end:
            max_prefill = c.max_num_scheduled_tokens or c.max_num_batched_tokens
            if c.long_prefill_token_threshold > 0:
                max_prefill = min(max_prefill, c.long_prefill_token_threshold)
            aligned = end // bs * bs
            if aligned > start or bs <= max_prefill:
                end = aligned
        next_boundary = (start // bs + 1) * bs if start % bs and not internal else 0
        # the prompt's last unit boundary, where a later hit ending inside a block resumes
        tail = _mamba_checkpoint(r.num_prompt_tokens, unit, drop, lookahead) if unit and not internal else 0
        tail_stop = tail if last_cache < tail < r.num_prompt_tokens else 0
        # a shared-prefix junction inside the chunk: its block-floored position from the chunk's start
        junction = r.shared_prefix_boundary
        junction_stop = start + (junction - start) // bs * bs if start < junction < end else 0
        stops = (next_boundary, last_cache, tail_stop, junction_stop)
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def _align_need(self, entries: int, held: int, allocated: bool, checkpoint: bool, copy: bool = False) -> int:
        """An align-mode Mamba group's blocks to allocate for ``entries`` entries with ``held`` in the table: the
        missing ones, capped at 1 (1 plus the speculative blocks before its first allocation), one more with a
        prefill checkpoint; negative when the table is longer. With a block to copy (``copy``: a hit ending inside
        a block, or the request's own prompt tail cached there), one more, never below 1."""
        need = entries - held
        if copy:
            need = max(need, 0) + 1
        if need > 0:
            cap = (1 if allocated else 1 + self._config.mamba_speculative_blocks) + int(checkpoint) + int(copy)
            need = min(need, cap)
        return need

    def _align_checkpoint(self, r: _Request, g: int, allocated: bool, start: int, end: int) -> tuple[int, int] | None:
        """The prefill checkpoint an align-mode Mamba group's allocation computing tokens ``start..end`` reserves a
        block for, as (position, table index) (vLLM's ``_needs_internal_checkpoint``): the checkpoint of ``end`` when
        the chunk can export it and, under retention 0 only, reaches the prefill's end; its index must be past the
        table, a null block, or one of an allocated table's speculative blocks."""
        c, bs = self._config, self._bs
        if not c.mamba_prefill_checkpoint_alignment:
            return None
        prefill_end = max(r.num_prompt_tokens, r.num_tokens - 1) if c.prefix_cache_retention_interval == 0 else 0
        unit = self._partial_unit  # with prefix hits inside a block, the checkpoint is a unit boundary
        checkpoint = _mamba_checkpoint(end, unit or bs, c.drop_trailing_hit_block, c.hash_lookahead_tokens)
        align = c.mamba_prefill_checkpoint_alignment
        if end < prefill_end or not _checkpoint_valid(start, end, checkpoint, bs, align, unit):
            return None
        table, idx = self._group_table(r, g), -(-end // bs) - 2
        if idx >= len(table) or table[idx] == 0 or (allocated and idx >= len(table) - c.mamba_speculative_blocks):
            return checkpoint, idx
        return None

    def _cache_unit_checkpoint(self, r: _Request, g: int, b: int, position: int, prompt_checkpoint: int) -> None:
        """``_cache_mamba_checkpoint`` with prefix hits inside a block: the checkpoint at ``position``, a unit
        boundary, in block ``b``: keyed there (replacing its keys) unless already, or, when it is neither the
        prompt's checkpoint, nor a block-boundary state the retention keeps, nor the shared-prefix junction, out of
        the cache."""
        bs, unit = self._bs, self._partial_unit
        retention = self._config.prefix_cache_retention_interval
        retained = position % bs == 0 and (retention is None or _mamba_retained(position // bs - 1, bs, retention, ()))
        current = self._block_hash[b]
        if position != prompt_checkpoint and not retained and position != r.shared_prefix_boundary:
            if current is not None:
                self._uncache(b, current)
            return
        if position // unit > len(r.unit_hashes):
            return  # a position past the hashed tokens: nothing to key it by
        key = self._group_key(r.unit_hashes[position // unit - 1], g)
        if current == key:
            return
        self._cache_partial_block(b, key, position, replace=True)
        self._newly_cached.append((b, key))
        self._mamba_cached_step.add(key)

    def _remove_mamba_skipped(self, r: _Request, g: int, processed: int) -> None:
        """An align-mode Mamba group: the entries below ``(processed - 1) // bs`` go back to the pool (deepest
        first, null blocks skipped; vLLM's ``last_state_block_idx`` entry, when it frees it, is always one of
        them)."""
        table, bs = self._group_table(r, g), self._bs
        if processed > 1:
            last = min((processed - 1) // bs, len(table))
            freed = [b for b in table[:last] if b != 0]
            if freed:
                self._free_block_list(freed)
                table[:last] = [0] * last

    def _grow_mamba_align(self, r: _Request, g: int, entries: int) -> None:
        """An align-mode Mamba group's table grows to ``entries`` entries: null blocks pad it to
        ``entries - spec - 1``, the speculative blocks below that move to the end, new blocks fill the rest."""
        table, spec = self._group_table(r, g), self._config.mamba_speculative_blocks
        prev = len(table)
        r.mamba_appended[g] = 0
        allocated = g in r.mamba_allocated
        r.mamba_allocated.add(g)
        checkpoint = int(g in r.mamba_checkpoint)  # its entry, below the running state's, stays a real block
        copy = r.partial_hits.pop(g, None)
        if entries <= prev and not checkpoint and copy is None:
            return
        skipped = entries - spec - 1
        if prev < skipped - checkpoint:
            table.extend([0] * (skipped - checkpoint - prev))
        if allocated:
            for idx in range(prev - spec, prev):
                if idx >= skipped - checkpoint:
                    break
                table.append(table[idx])
                table[idx] = 0
        if copy is not None:
            cow = self._pop_free_block()
            if allocated:
                # the request's own cached prompt tail: it keeps writing into its block, so the cache entry moves to
                # the copy (filled by this step's copy, so a hit on it waits for the next step)
                idx, source = copy
                self._move_block_hashes(source, cow)
                self._cow_copies[g].append((source, cow))
                self._ref_cnt[source] += 1
                moved = self._block_hash[cow]
                if moved is not None:
                    self._mamba_cached_step.add(moved)
            else:
                self._apply_copy(r, g, copy[0], copy[1], cow)
        table.extend(self._pop_free_block() for _ in range(max(0, entries - len(table))))
        r.mamba_appended[g] = len(table) - prev

    def _apply_copy(self, r: _Request, g: int, idx: int, source: int, cow: int) -> None:
        """A hit ending inside block ``source`` (entry ``idx`` of group ``g``'s table): ``cow`` takes its place and a
        copy ``source -> cow`` is queued; both stay referenced until the copies are handed out (the source keeps the
        hit's reference, ``cow`` takes one more)."""
        table = self._group_table(r, g)
        table[idx] = cow
        self._cow_copies[g].append((source, cow))
        self._ref_cnt[cow] += 1

    def _mamba_hit_key(self, r: _Request, g: int, ghits: list[int]) -> bytes | None:
        """The key a Mamba group's hit ``ghits`` is checked under for a state this step writes: its block's key at
        its position, or with prefix hits inside a block the hit block's own hash."""
        if self._partial_unit:
            return self._block_hash[ghits[-1]]
        return self._group_key(r.block_hashes[len(ghits) - 1], g)

    def _take_block_copies(self) -> list[tuple[int, int]]:
        """The copies this schedule() call queued, group by group; their blocks' extra references go (source,
        destination, source, ...), as vLLM frees them after the step's admissions."""
        copies = [pair for per_group in self._cow_copies for pair in per_group]
        for per_group in self._cow_copies:
            per_group.clear()
        if copies:  # freed in that order: the list given reversed
            self._free_block_list([b for pair in reversed(copies) for b in reversed(pair)])
        return copies

    def _remove_group_skipped(self, r: _Request, g: int, w: int, processed: int) -> None:
        table = self._group_table(r, g)
        last = min(self._group_skipped(w, processed) // self._group_bs(g), len(table))
        first = last
        while first > 0 and table[first - 1] != 0:
            first -= 1
        if first < last:
            self._free_block_list(table[first:last])
            table[first:last] = [0] * (last - first)

    def _cache_hybrid_blocks(self, r: _Request, num_tokens: int, computed: int) -> None:
        """Each group's full blocks among the first ``num_tokens`` enter the cache map under the group's keys
        (null blocks skipped; a window of one token caches nothing; an align-mode Mamba group under sparse retention
        caches the states ``_mamba_retained`` keeps, and the prompt's checkpoint when ``num_tokens`` end there),
        group by group, each group's run recorded as one stored event with events on. Mamba groups outside the
        trailing-block drop's rules take all ``computed`` tokens (the reprefillable tail is cut in the drop's groups
        only)."""
        bs = self._bs

        def aligned(tokens: int) -> int:
            # every group caches the same tokens, rounded down to the hit alignment, of which each group caches the
            # full blocks whose hashes exist (look-ahead hashes can end before them: `hashed`)
            return min(tokens, len(r.block_ids) * bs) // self._hit_align() * self._hit_align()

        hashed = len(r.block_hashes) * bs
        mixed = any(self._group_bs(x) != bs for x in range(len(self._group_windows())))
        # (vLLM's get_num_cacheable_tokens for a group that takes the drop, once an aligned prefix is computed)
        eagle_extra = self._config.drop_trailing_hit_block and mixed and aligned(computed) > 0

        aligned_tokens = aligned(num_tokens)
        c = self._config
        align = c.mamba_align
        retention = c.prefix_cache_retention_interval if align else None
        # with the trailing-block drop the prompt's checkpoint lies one block lower, and Mamba states are kept where
        # a window's hit resumes (a resend's and a longer sibling's positions and the junction, one block lower each)
        eagle = c.drop_trailing_hit_block
        # Mamba groups that do not take the drop's rules cache their tokens floored to a block and keep no state one
        # block below the junction
        mamba_eagle = eagle and c.mamba_eagle_group
        prompt_checkpoint = _mamba_checkpoint(r.num_prompt_tokens, bs, eagle, c.hash_lookahead_tokens)
        # a prefill checkpoint is the prompt's when it lies at its last unit boundary with prefix hits inside a block
        unit = self._partial_unit
        checkpoint_of_prompt = (
            _mamba_checkpoint(r.num_prompt_tokens, unit, eagle, c.hash_lookahead_tokens) if unit else prompt_checkpoint
        )
        mamba_tokens = computed // bs * bs if eagle and not mamba_eagle else num_tokens
        mamba_aligned = aligned(computed) if eagle and not mamba_eagle else aligned_tokens
        # (with prefix hits inside a block the prompt's tail is keyed at its unit instead: _cache_partial_tail)
        at_tail = retention is not None and not self._partial_unit and 0 < mamba_tokens == prompt_checkpoint
        prompt_tail = prompt_checkpoint // bs - 1 if at_tail else -1
        # sparse retention of the window groups' blocks and the Mamba groups' states
        window_retention = c.prefix_cache_retention_interval
        junction, below = r.shared_prefix_boundary, c.drop_junction_below
        window_reach = _window_reachable(r.num_prompt_tokens, junction, bs, eagle, below)
        reachable = _window_reachable(r.num_prompt_tokens, junction, bs, eagle, below and c.mamba_eagle_group)
        for g, w in enumerate(self._group_windows()):
            if (w < 0 and not (w == _MAMBA and align)) or g in c.prefix_replay_groups:
                continue  # never cached
            table = self._group_table(r, g)
            first = self._group_cached(r, g)
            k = self._group_bs(g) // bs
            # with the trailing-block drop a group also caches the block of its own size past the aligned tokens
            # (vLLM's hit looks one block further, then gives it up)
            if w == _MAMBA:
                group_tokens = mamba_aligned
            elif eagle_extra:
                group_tokens = min(num_tokens, aligned_tokens + self._group_bs(g))
            else:
                group_tokens = aligned_tokens
            num_full = min(group_tokens, hashed) // self._group_bs(g)
            checkpoint = r.mamba_checkpoint.get(g) if w == _MAMBA else None
            tail = -1 if checkpoint is not None else prompt_tail  # a checkpoint is re-keyed instead
            if w == _MAMBA and checkpoint is None and not c.mamba_defer_new_states_only and not self._partial_unit:
                # with the drop a Mamba group's cacheable tokens are not floored: only tokens ending at the checkpoint
                exact = not mamba_eagle or num_tokens % bs == 0
                self._mark_prompt_checkpoint(r, g, mamba_tokens if exact else 0, prompt_checkpoint)
            # a full-attention group of blocks larger than the hash block files the prompt's tail
            tail_entry = w == 0 and self._group_bs(g) != bs
            if num_full <= first:
                if checkpoint is not None:
                    self._cache_mamba_checkpoint(r, g, checkpoint, checkpoint_of_prompt)
                if tail_entry:
                    self._cache_prompt_tail(r, g, group_tokens)
                if self._partial_unit:
                    self._cache_partial_tail(r, g, w, num_tokens)
                continue
            sparse = retention if w == _MAMBA else None
            window_sparse = window_retention if w > 0 and not w & _CHUNKED else None

            sized = (
                w > 0 and not w & _CHUNKED and any(self._group_bs(x) != bs for x in range(len(self._group_windows())))
            )
            gbs = self._group_bs(g)

            def kept(
                i: int,
                w: int = w,
                sparse: int | None = sparse,
                window_sparse: int | None = window_sparse,
                tail: int = tail,
                sized: bool = sized,
                gbs: int = gbs,
            ) -> bool:
                if w == 1 and not eagle:
                    return False
                if sized:  # groups of different block sizes: the blocks a hit aligned to them can use
                    # (the resend and sibling positions at the scheduler block, the junction's below at the group's)
                    reach = _window_reachable(r.num_prompt_tokens, junction, gbs, eagle, below, align=self._hit_align())
                    return _window_kept(i, gbs, self._hit_align(), w, eagle, c.prefix_cache_retention_interval, reach)
                if sparse is not None:
                    return i == tail or _mamba_retained(i, bs, sparse, reachable)
                if window_sparse is not None:
                    return _window_retained(i, bs, w, eagle, window_sparse, window_reach)
                return True

            for i in range(first, num_full):
                b = table[i]
                if b == 0 or not kept(i):
                    continue
                key = self._group_key(r.block_hashes[(i + 1) * k - 1], g)
                current = self._block_hash[b]
                if current is not None:  # a prefill checkpoint keyed one block lower (the drop) moves up to its entry
                    self._uncache(b, current)
                self._block_hash[b] = key
                self._cached.setdefault(key, {})[b] = None
                self._newly_cached.append((b, key))
                if w == _MAMBA:
                    self._mamba_cached_step.add(key)
            self._set_group_cached(r, g, num_full)
            if self._events is not None:
                self._record_stored(r, table, first, num_full, g, kept)
            if tail_entry:
                self._cache_prompt_tail(r, g, group_tokens)
            if checkpoint is not None:
                self._cache_mamba_checkpoint(r, g, checkpoint, checkpoint_of_prompt)
            if self._partial_unit:
                self._cache_partial_tail(r, g, w, num_tokens)
            if w == _MAMBA:
                self._offer_boundary_states(r, g, first, num_full)

    def _cache_partial_tail(self, r: _Request, g: int, w: int, num_tokens: int) -> None:
        """With prefix hits inside a block, after group ``g``'s full blocks among ``num_tokens`` were cached: the
        prompt's last unit boundary short of its last token, when it ends inside a block, files that block under the
        boundary's key (vLLM's ``_cache_partial_tail_block``). Full attention does so once the tokens reach the
        boundary; an align-mode Mamba group only when the tokens end exactly there (its state block then holds the
        state at the boundary): the key joins this step's cached states, and when it lies inside a block, the
        request's next allocation copies that block and moves the key to the copy (it keeps writing into its own)."""
        unit, bs = self._partial_unit, self._bs
        table = self._group_table(r, g)
        if w == 0:
            boundary = min((r.num_prompt_tokens - 1) // unit, len(r.unit_hashes)) * unit
            if boundary == 0 or boundary > num_tokens or boundary % bs == 0 or boundary // bs >= len(table):
                return
            key = self._group_key(r.unit_hashes[boundary // unit - 1], g)
            self._cache_partial_block(table[boundary // bs], key, boundary)
            return
        if num_tokens <= 0 or num_tokens % unit or num_tokens != _mamba_checkpoint(r.num_prompt_tokens, unit, False, 0):
            return
        idx = -(-num_tokens // bs) - 1
        if idx >= len(table) or table[idx] == 0 or num_tokens // unit > len(r.unit_hashes):
            return
        source = table[idx]
        if self._config.mamba_defer_new_states_only and self._hashed_tokens(r, g, source, idx) == num_tokens:
            return  # keyed there already (by a hit or an earlier step); vLLM 0.32 keys it again
        key = self._group_key(r.unit_hashes[num_tokens // unit - 1], g)
        self._cache_partial_block(source, key, num_tokens)
        self._mamba_cached_step.add(key)
        if num_tokens % bs:
            r.partial_hits[g] = (idx, source)
            self._set_group_cached(r, g, idx)

    def _hashed_tokens(self, r: _Request, g: int, b: int, idx: int) -> int | None:
        """The tokens block ``b`` (entry ``idx`` of group ``g``'s table)'s own hash covers: a partial entry's, or a
        full block's (keyed at its entry)."""
        if self._block_hash[b] is None:
            return None
        if b in self._partial_tokens:
            return self._partial_tokens[b]
        return (idx + 1) * self._bs

    def _cache_prompt_tail(self, r: _Request, g: int, num_tokens: int) -> None:
        """A full-attention group ``g`` of blocks larger than the hash block, after its full blocks among
        ``num_tokens`` (the cacheable tokens rounded down to the alignment) were cached: the prompt's last full hash
        block short of its last token, when it ends inside one of the group's blocks and within ``num_tokens``,
        becomes a key of that block (``_add_second_key``: its key when it has none, so that a block look-ahead
        hashes leave uncached is cached all the same; a second key otherwise, with events), recorded as a stored
        event of that hash block (vLLM's partial prefix-cache entry of a prompt's tail)."""
        bs, gbs = self._bs, self._group_bs(g)
        # (with the trailing-block drop the lookup reads the whole prompt before giving a block up)
        limit = r.num_prompt_tokens if self._config.drop_trailing_hit_block else max(0, r.num_prompt_tokens - 1)
        units = min(limit // bs, len(r.block_hashes))
        boundary = units * bs
        if boundary == 0 or boundary > num_tokens or boundary % gbs == 0:
            return
        table = self._group_table(r, g)
        if boundary // gbs >= len(table):
            return
        i = units - 1
        if self._add_second_key(table[boundary // gbs], self._group_key(r.block_hashes[i], g)) and self._events:
            self._record_stored(r, [table[boundary // gbs]], i, i + 1, g, lambda i: True, offset=i, single=True)

    def _offer_boundary_states(self, r: _Request, g: int, first: int, num_full: int) -> None:
        """With a KV connector: the Mamba group's blocks ``first:num_full`` that hold a cached state once the caching
        is done are offered to it in table order, each with the tokens its key covers (the block's own position, or
        wherever the request's hashes put a re-keyed checkpoint)."""
        if self._boundary_offers is None:
            return
        table = self._group_table(r, g)
        for i in range(first, min(num_full, len(table))):
            b = table[i]
            key = self._block_hash[b] if b else None
            if key is None:
                continue
            if i < len(r.block_hashes) and self._group_key(r.block_hashes[i], g) == key:
                j = i
            else:
                j = next((k for k, h in enumerate(r.block_hashes) if self._group_key(h, g) == key), -1)
                if j < 0:
                    continue
            self._boundary_offers.append((r.req_id, g, b, (j + 1) * self._bs))

    def take_mamba_boundary_offers(self) -> list[tuple[str, int, int, int]]:
        """The Mamba boundary states offered to the KV connector since the last call, as ``(req_id, group,
        block_id, num_tokens)``: group by group, each group's in the order they were cached. Empty unless a KV
        connector is set with align-mode Mamba groups and prefix caching."""
        if not self._boundary_offers:
            return []
        offers = sorted(self._boundary_offers, key=lambda o: o[1])
        self._boundary_offers.clear()
        return offers

    def _mark_prompt_checkpoint(self, r: _Request, g: int, num_tokens: int, prompt_checkpoint: int) -> None:
        """vLLM 0.32 (``mamba_defer_new_states_only`` off): when the tokens being cached, floored to a block, end at
        the prompt's checkpoint and the request holds a state there already cached under its key, the key counts as
        cached in this ``schedule()`` call (a same-step hit on it is deferred)."""
        bs = self._bs
        aligned = num_tokens // bs * bs
        if aligned == 0 or aligned != prompt_checkpoint:
            return
        i = aligned // bs - 1
        table = self._group_table(r, g)
        if i >= len(table) or i >= len(r.block_hashes) or table[i] == 0:
            return
        key = self._group_key(r.block_hashes[i], g)
        if self._block_hash[table[i]] == key:
            self._mamba_cached_step.add(key)

    def _cache_mamba_checkpoint(self, r: _Request, g: int, checkpoint: tuple[int, int], prompt_checkpoint: int) -> None:
        """An align-mode Mamba group's prefill checkpoint after its blocks were cached (vLLM's
        ``_cache_partial_tail_block`` with a checkpoint): the block at its index enters the cache under its position's
        key, unless the position is neither the prompt's checkpoint, nor a state the retention interval keeps, nor
        the shared-prefix junction: then the block leaves the cache. A block cached under that key stays."""
        bs, (position, idx) = self._bs, checkpoint
        table = self._group_table(r, g)
        if self._partial_unit:
            if idx < len(table) and table[idx] != 0 and position > 0:
                self._cache_unit_checkpoint(r, g, table[idx], position, prompt_checkpoint)
            return
        i = position // bs - 1
        if idx >= len(table) or table[idx] == 0 or i < 0:
            return
        b = table[idx]
        retention = self._config.prefix_cache_retention_interval
        retained = retention is None or _mamba_retained(i, bs, retention, ())
        current = self._block_hash[b]
        if position != prompt_checkpoint and not retained and position != r.shared_prefix_boundary:
            if current is not None:
                self._uncache(b, current)
            return
        if i >= len(r.block_hashes):
            return  # a position past the hashed tokens (drafts can reach it): nothing to key it by
        key = self._group_key(r.block_hashes[i], g)
        if current == key:
            return
        if current is not None:
            self._uncache(b, current)
        self._block_hash[b] = key
        self._cached.setdefault(key, {})[b] = None
        self._newly_cached.append((b, key))
        self._mamba_cached_step.add(key)
        if self._events is not None:  # the block's own stored event, apart from any run
            self._record_stored(r, [b], i, i + 1, g, lambda i: True, offset=i, single=True)
