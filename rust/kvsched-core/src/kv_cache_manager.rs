//! Per-request KV block management on top of the pool: prefix-cache lookup, `allocate_slots` (all or nothing),
//! caching full blocks at allocation time, and freeing. Mirrors vLLM's `KVCacheManager` for a single
//! full-attention group. With KV cache events on, each call that enters blocks into the prefix cache records
//! them as one stored event (`events.rs`), after the evictions its allocation caused, as vLLM's block pool does.
//!
//! With a sliding window of `w` tokens (vLLM's `SlidingWindowManager`, one group), a request's table starts with
//! null blocks (`NULL_BLOCK`) where its blocks fell out of the window: the next token to compute attends to the
//! last `w` tokens only, so the blocks wholly before the first `processed + 1 - w` tokens go back to the pool,
//! deepest first, at each allocation (`processed`: the computed tokens less those of steps still in flight, which
//! may still read them). The nulls are always a prefix of the table; they are never touched, freed or cached. A
//! prefix hit needs only the blocks covering the window before its end: the lookup searches right to left for
//! the last run of `ceil((w - 1) / block_size)` cached blocks (or the run from block 0, if shorter) and pads the
//! blocks before it with nulls.

use crate::block_pool::{prefetch, BlockPool, NULL_BLOCK};
use crate::hashing::{BlockHash, BlockHasher};
use crate::hybrid::{group_key, window_reachable, window_retained};
use crate::request::Request;

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    pub hasher: BlockHasher,
    /// Tokens per block id (`SchedulerConfig::kv_block_size`): any size from 1 on.
    pub block_size: u32,
    /// The most slots one request holds: `min(max_model_len, the cache's capacity in tokens)`.
    pub max_slots: u32,
    pub enable_caching: bool,
    /// `(block, hash)` entered into the prefix cache since `schedule()` began: the step's record keeps them so
    /// that a failed step can take them out again (`Scheduler::fail_step`).
    pub newly_cached: Vec<(u32, BlockHash)>,
    /// Scratch bytes for block hashing, kept between calls (no allocation per hashed request).
    pub hash_buf: Vec<u8>,
    /// The attention window in tokens (`SchedulerConfig::sliding_window`); 0: full attention.
    pub sliding_window: u32,
    /// vLLM's admission cap of a sliding-window request, in blocks (`SlidingWindowSpec.
    /// max_admission_blocks_per_request`): the most blocks it holds at once, `ceil(min(w - 1 + tokens in flight,
    /// max_model_len) / block_size) + 1`, with one step's budget in flight per concurrent batch. Unused without
    /// a window.
    pub admission_cap_blocks: usize,
    /// Sparse retention of the one sliding window's blocks (`SchedulerConfig::prefix_cache_retention_interval`,
    /// `window_retained`; several groups keep theirs in `hybrid`); `None`: dense.
    pub retention: Option<u32>,
    /// Several KV cache groups (`hybrid.rs`); `None`: one group.
    pub hybrid: Option<Box<crate::hybrid::Hybrid>>,
    /// A sliding window or several groups: the single-group full-attention paths do not apply.
    pub special: bool,
    /// The longest prefix hit gives up its last block (`drop_trailing_hit_block`): with one full-attention
    /// group the hit's last block; with a sliding window or several groups, vLLM's EAGLE rules for them
    /// (`find_window_hit`, `find_hybrid_hit`).
    pub drop_trailing_hit: bool,
    /// The computed tokens not final yet (`prefill_lookahead_tokens - 1`, a multi-module MTP drafter may compute
    /// them again): the blocks entering the prefix cache stop this many tokens short of the tokens being cached.
    /// 0 with several groups without the trailing-block drop (vLLM's hybrid coordinator then caches the aligned
    /// tokens).
    pub reprefillable: u32,
    /// Tokens below the window a sliding window keeps (`SchedulerConfig::extra_retained_tokens`).
    pub extra_retained: u32,
    /// Tokens per prefix-match unit when prefix hits can end inside a block (`SchedulerConfig::partial_hit_unit`;
    /// requests then keep every unit's hash, `Request::unit_hashes`); 0: hits end on whole blocks.
    pub partial_unit: u32,
}

impl KvCacheManager {
    /// Longest run of cached blocks matching `block_hashes` from the start, capped so that at least the last of
    /// `num_tokens` tokens is computed. Appends the hit blocks to `out`. Side-effect free on the pool.
    pub fn find_longest_cache_hit(&self, block_hashes: &[BlockHash], num_tokens: u32, out: &mut Vec<u32>) {
        if self.special {
            if self.hybrid.is_some() {
                self.find_hybrid_hit(block_hashes, num_tokens, out);
            } else {
                self.find_window_hit(block_hashes, num_tokens, out);
            }
            return;
        }
        let start = out.len();
        for h in &block_hashes[..self.max_hit_blocks(block_hashes, num_tokens)] {
            match self.pool.get_cached_block(h) {
                Some(b) => out.push(b),
                None => break,
            }
        }
        if self.drop_trailing_hit && out.len() > start {
            out.pop();
        }
    }

    /// `find_longest_cache_hit` with a sliding window (vLLM's `SlidingWindowManager.find_longest_cache_hit`):
    /// from the right, the first run of cached blocks long enough to cover the window before its end; the
    /// blocks before the run are null blocks. Without such a run, the run of cached blocks from block 0.
    /// With the trailing-block drop (vLLM's `SlidingWindowManager` with EAGLE), the run needs one block more and
    /// the hit then gives up its last block (the blocks before the run stay null blocks).
    #[cold]
    fn find_window_hit(&self, block_hashes: &[BlockHash], num_tokens: u32, out: &mut Vec<u32>) {
        let max_blocks = self.max_hit_blocks(block_hashes, num_tokens);
        let drop = usize::from(self.drop_trailing_hit);
        let need = (self.sliding_window - 1).div_ceil(self.block_size) as usize + drop;
        let start = out.len();
        // `out[start..]` holds the current run, rightmost block first.
        let mut matched = false;
        for i in (0..max_blocks).rev() {
            match self.pool.get_cached_block(&block_hashes[i]) {
                Some(b) => {
                    out.push(b);
                    if out.len() - start >= need {
                        out[start..].reverse();
                        out.splice(start..start, std::iter::repeat_n(NULL_BLOCK, i));
                        matched = true;
                        break;
                    }
                }
                None => out.truncate(start),
            }
        }
        if !matched {
            out[start..].reverse();
        }
        if drop == 1 && out.len() > start {
            out.pop();
        }
    }

    /// Tokens wholly before the window of the next token after `num_computed_tokens` (vLLM's
    /// `get_num_skipped_tokens`).
    #[inline]
    fn skipped_tokens(&self, num_computed_tokens: u32) -> u32 {
        (num_computed_tokens + 1).saturating_sub(self.sliding_window + self.extra_retained)
    }

    /// The tokens whose full blocks enter the prefix cache when `num_tokens` are being cached (vLLM's
    /// `get_num_cacheable_tokens`): all of them less the `reprefillable` tail.
    #[inline(always)]
    pub(crate) fn cacheable(&self, num_tokens: u32) -> u32 {
        num_tokens.saturating_sub(self.reprefillable)
    }

    /// vLLM's `remove_skipped_blocks`: with `processed` tokens processed, the blocks wholly before the window go
    /// back to the pool (deepest first, from the last one before the window back to the first null) and become
    /// null blocks in the table.
    fn remove_skipped_blocks(&mut self, req: &mut Request, processed: u32) {
        let last = ((self.skipped_tokens(processed) / self.block_size) as usize).min(req.blocks.len());
        let mut first = last;
        while first > 0 && req.blocks[first - 1] != NULL_BLOCK {
            first -= 1;
        }
        if first < last {
            self.pool.free_blocks(&req.blocks[first..last]);
            req.blocks[first..last].fill(NULL_BLOCK);
        }
    }

    /// Blocks a lookup reads past its cap before dropping (vLLM's hybrid coordinator with the EAGLE drop looks one
    /// block further): the hashes a probe must compute beyond the hits it may keep.
    #[inline]
    pub(crate) fn lookup_margin_blocks(&self) -> usize {
        usize::from(self.drop_trailing_hit && self.hybrid.is_some())
    }

    /// The most blocks a prefix lookup of `num_tokens` tokens with these hashes may hit: none without caching,
    /// and never the block holding the last token (it must be computed).
    #[inline(always)]
    pub(crate) fn max_hit_blocks(&self, block_hashes: &[BlockHash], num_tokens: u32) -> usize {
        if !self.enable_caching || num_tokens == 0 {
            return 0;
        }
        (((num_tokens - 1) / self.block_size) as usize).min(block_hashes.len())
    }

    /// An upper bound on what `find_longest_cache_hit(block_hashes, num_tokens, ..)` would return, from `hint`
    /// (the hits of an earlier probe) with at most one lookup: the hits reach past `hint` blocks only if the
    /// hash right after them is cached, whatever was cached or evicted since. `None` when it is cached (look
    /// the hits up). Side-effect free.
    #[inline]
    pub fn cache_hit_upper_bound(
        &self,
        block_hashes: &[BlockHash],
        num_tokens: u32,
        hint: u32,
    ) -> Option<usize> {
        if self.special {
            // A window hit need not start at block 0: no bound from one lookup.
            return None;
        }
        let max_blocks = self.max_hit_blocks(block_hashes, num_tokens);
        // With the trailing block dropped, `hint` hits were `hint + 1` blocks found.
        let drop = usize::from(self.drop_trailing_hit);
        let k = (hint as usize + drop).min(max_blocks);
        if k < max_blocks && self.pool.get_cached_block(&block_hashes[k]).is_some() {
            return None;
        }
        Some(k.saturating_sub(drop))
    }

    /// The fewest blocks `allocate_slots` could pop for `req` (nothing computed, no blocks of a swap to restore)
    /// if its prefix hits are at most `max_hits` blocks and it computes at most `max_new` tokens after them
    /// (besides `lookahead` slots). The blocks needed only fall as the hits grow (a hit covers a block the
    /// chunk would otherwise need, and evictable hits count against the pool too), so `max_hits` gives the
    /// least.
    #[inline]
    pub fn min_blocks_to_admit(&self, req: &Request, max_hits: usize, max_new: u32, lookahead: u32) -> usize {
        let hit_tokens = max_hits as u32 * self.block_size;
        let n = req.num_tokens().saturating_sub(hit_tokens).min(max_new);
        self.blocks_to_add(req.blocks.len() + max_hits, hit_tokens + n + lookahead)
    }

    /// After a `find_longest_cache_hit` that found `num_hits` blocks: the tokens of the longest hit one lookup set
    /// found when it exceeds them (vLLM's `shared_prefix_boundary`), else 0; 0 with one group, and without
    /// prefix caching and either align-mode Mamba groups or sparse retention (the only ones that read it).
    pub(crate) fn shared_prefix_boundary(&self, num_hits: usize) -> u32 {
        match self.hybrid.as_deref() {
            Some(hy) if (hy.mamba_align || hy.retention.is_some()) && self.enable_caching => {
                let longest = hy.last_longest();
                if longest > num_hits {
                    longest as u32 * self.block_size
                } else {
                    0
                }
            }
            _ => 0,
        }
    }

    /// Blocks a request holding `held` blocks (its table plus its prefix hits) must add to have `num_slots`
    /// slots (capped at `max_slots`).
    #[inline(always)]
    pub(crate) fn blocks_to_add(&self, held: usize, num_slots: u32) -> usize {
        self.blocks_to_add_sized(held, num_slots, self.block_size)
    }

    /// `blocks_to_add` in blocks of `block_size` tokens (a KV cache group's own block size).
    #[inline(always)]
    pub(crate) fn blocks_to_add_sized(&self, held: usize, num_slots: u32, block_size: u32) -> usize {
        let num_slots = num_slots.min(self.max_slots);
        let required = num_slots.div_ceil(block_size) as usize;
        required.saturating_sub(held)
    }

    /// vLLM's `full_sequence_must_fit` admission gate (`scheduler_reserve_full_isl`): could the pool hold every
    /// known token of `req` (prompt, plus outputs for a resumed request; capped at `max_slots`) on top of
    /// the prefix hits `hits`? Hits at ref 0 leave the free queue when touched, so they count as needed blocks.
    /// Lookahead slots are not part of this check (the per-step allocation adds them). `reserved` blocks must
    /// stay free (the watermark). `computed`: its tokens computed before the hits (where an align-mode Mamba
    /// group's prefill checkpoint lies). `ext`: the tokens after the hits the KV connector loads; with a sliding
    /// window they move the window of the first computed token on, as computed tokens do.
    pub fn full_sequence_fits(
        &self,
        req: &Request,
        hits: &[u32],
        computed: u32,
        ext: u32,
        reserved: usize,
    ) -> bool {
        if self.special {
            let need = if self.hybrid.is_some() {
                self.hybrid_sequence_need(req, hits, computed, ext)
            } else {
                self.window_sequence_need(req, hits, ext)
            };
            return need + reserved <= self.pool.num_free_blocks();
        }
        let need = self.blocks_to_add(req.blocks.len() + hits.len(), req.num_tokens());
        let evictable_hits = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        need + evictable_hits + reserved <= self.pool.num_free_blocks()
    }

    /// `full_sequence_fits`' blocks with a sliding window (vLLM's `get_num_blocks_to_allocate` with the
    /// admission cap): the request's tokens need at most `admission_cap_blocks` blocks; a new request's blocks
    /// before the window of its first computed token (after its hits and its `ext` loaded tokens) become null
    /// blocks, its hits inside the window count when at ref 0.
    #[cold]
    fn window_sequence_need(&self, req: &Request, hits: &[u32], ext: u32) -> usize {
        let num_slots = req.num_tokens().min(self.max_slots);
        let required = (num_slots.div_ceil(self.block_size) as usize).min(self.admission_cap_blocks);
        if !req.blocks.is_empty() {
            return required.saturating_sub(req.blocks.len());
        }
        let computed = hits.len() as u32 * self.block_size + ext;
        let skipped = (self.skipped_tokens(computed) / self.block_size) as usize;
        let kept = &hits[skipped.min(hits.len())..];
        let evictable = kept.iter().filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0).count();
        required.saturating_sub(skipped.max(hits.len())) + evictable
    }

    /// Whether a new request with these hashes would hit at least one block (the admission probe: the same
    /// answer as `find_longest_cache_hit` being non-empty, in O(1)). Side-effect free.
    #[inline]
    pub fn has_cached_prefix(&self, block_hashes: &[BlockHash], num_tokens: u32) -> bool {
        if self.hybrid.is_some() {
            return self.hybrid_has_cached_prefix(block_hashes, num_tokens);
        }
        if self.sliding_window != 0 {
            let mut hits = Vec::new();
            self.find_window_hit(block_hashes, num_tokens, &mut hits);
            return !hits.is_empty();
        }
        // With the trailing block dropped, one hit needs two blocks found.
        let need = 1 + usize::from(self.drop_trailing_hit);
        self.max_hit_blocks(block_hashes, num_tokens) >= need
            && block_hashes[..need].iter().all(|h| self.pool.get_cached_block(h).is_some())
    }

    /// Reserves KV slots for `num_new_tokens` more tokens of `req`, which has `computed` tokens computed (plus
    /// `num_lookahead_tokens`), taking the prefix hits `hits` first, leaving `reserved` blocks free (the
    /// watermark). Returns the number of blocks newly popped from the free queue, or `None` when the pool cannot
    /// supply them, in which case no block was allocated or touched (with a sliding window, the blocks that left
    /// the window are freed either way, as in vLLM). `in_flight`: the request's tokens of steps in flight, which
    /// a sliding window keeps readable.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn allocate_slots(
        &mut self,
        req: &mut Request,
        computed: u32,
        num_new_tokens: u32,
        hits: &[u32],
        num_lookahead_tokens: u32,
        reserved: usize,
        in_flight: u32,
    ) -> Option<usize> {
        self.allocate_slots_inner(
            req,
            computed,
            num_new_tokens,
            hits,
            num_lookahead_tokens,
            reserved,
            true,
            in_flight,
        )
    }

    /// `allocate_slots` for a request with nothing computed yet whose first `num_external_tokens` tokens after
    /// the hits come from the KV connector: they take slots like computed tokens; with `cache` false (an
    /// asynchronous load) no block enters the prefix cache now (`cache_blocks` does it once the load is over).
    #[allow(clippy::too_many_arguments)]
    pub fn allocate_slots_ext(
        &mut self,
        req: &mut Request,
        computed: u32,
        num_new_tokens: u32,
        hits: &[u32],
        num_external_tokens: u32,
        num_lookahead_tokens: u32,
        reserved: usize,
        cache: bool,
        in_flight: u32,
    ) -> Option<usize> {
        let computed = computed + num_external_tokens;
        self.allocate_slots_inner(
            req,
            computed,
            num_new_tokens,
            hits,
            num_lookahead_tokens,
            reserved,
            cache,
            in_flight,
        )
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn allocate_slots_inner(
        &mut self,
        req: &mut Request,
        computed: u32,
        num_new_tokens: u32,
        hits: &[u32],
        num_lookahead_tokens: u32,
        reserved: usize,
        cache: bool,
        in_flight: u32,
    ) -> Option<usize> {
        if self.special {
            if self.hybrid.is_some() {
                return self.allocate_hybrid_slots(
                    req,
                    computed,
                    num_new_tokens,
                    hits,
                    num_lookahead_tokens,
                    reserved,
                    cache,
                    in_flight,
                );
            }
            return self.allocate_window_slots(
                req,
                computed,
                num_new_tokens,
                hits,
                num_lookahead_tokens,
                reserved,
                cache,
                in_flight,
            );
        }
        let bs = self.block_size;
        let total_computed = computed + hits.len() as u32 * bs;
        let need = self.blocks_to_add(
            req.blocks.len() + hits.len(),
            total_computed + num_new_tokens + num_lookahead_tokens,
        );
        if !hits.is_empty() {
            let evictable_hits = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
            if need + evictable_hits + reserved > self.pool.num_free_blocks() {
                return None;
            }
            self.pool.touch(hits);
            req.blocks.extend_from_slice(hits);
            // Hits are cached blocks by definition: count them as cached for this request.
            req.num_cached_blocks += hits.len() as u32;
        } else if need + reserved > self.pool.num_free_blocks() {
            return None;
        }
        if need > 0 {
            self.pool.allocate_into(need, &mut req.blocks);
        }
        let cache_tokens = self.cacheable((total_computed + num_new_tokens).min(req.num_tokens()));
        let num_full = (cache_tokens / self.block_size) as usize;
        if cache && self.enable_caching && num_full > req.num_cached_blocks as usize {
            self.cache_full_blocks(req, num_full);
        }
        Some(need)
    }

    /// `allocate_slots` with a sliding window (vLLM's `allocate_slots` over a `SlidingWindowManager`): first the
    /// blocks that left the window of the processed tokens go back to the pool; a new request's table then
    /// starts with null blocks for its computed tokens (hits and loads) before the window, followed by the hits
    /// inside it, and new blocks cover the rest.
    #[allow(clippy::too_many_arguments)]
    #[cold]
    fn allocate_window_slots(
        &mut self,
        req: &mut Request,
        computed: u32,
        num_new_tokens: u32,
        hits: &[u32],
        num_lookahead_tokens: u32,
        reserved: usize,
        cache: bool,
        in_flight: u32,
    ) -> Option<usize> {
        let total_computed = computed + hits.len() as u32 * self.block_size;
        self.remove_skipped_blocks(req, total_computed.saturating_sub(in_flight));
        let fresh = req.blocks.is_empty();
        let skipped =
            if fresh { (self.skipped_tokens(total_computed) / self.block_size) as usize } else { 0 };
        // A hit's null blocks lie before the window, unless it keeps extra tokens below it (`extra_retained`): the
        // nulls past the skipped blocks then enter the table as they are (never touched or counted).
        let kept = &hits[skipped.min(hits.len())..];
        let nulls = kept.iter().take_while(|&&b| b == NULL_BLOCK).count();
        let need = self.blocks_to_add(
            req.blocks.len() + skipped.max(hits.len()),
            total_computed + num_new_tokens + num_lookahead_tokens,
        );
        let evictable_hits = kept[nulls..].iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if need + evictable_hits + reserved > self.pool.num_free_blocks() {
            return None;
        }
        self.pool.touch(&kept[nulls..]);
        req.blocks.extend(std::iter::repeat_n(NULL_BLOCK, skipped));
        req.blocks.extend_from_slice(kept);
        // Hits and the null blocks before the window count as cached.
        req.num_cached_blocks += (skipped + kept.len()) as u32;
        if need > 0 {
            self.pool.allocate_into(need, &mut req.blocks);
        }
        let cache_tokens = self.cacheable((total_computed + num_new_tokens).min(req.num_tokens()));
        let num_full = (cache_tokens / self.block_size) as usize;
        if cache && self.enable_caching && num_full > req.num_cached_blocks as usize {
            self.cache_full_blocks(req, num_full);
        }
        Some(need)
    }

    /// vLLM's `KVCacheManager.cache_blocks`: enters the full blocks among the first `num_tokens` tokens (and
    /// the request's known hashes) into the prefix cache, if caching is on. With several KV cache groups each
    /// group goes from its own count of cached blocks (a window's null blocks count as cached, so the first
    /// group's count can run ahead of a full-attention group's after a load).
    pub fn cache_blocks(&mut self, req: &mut Request, num_tokens: u32) {
        if self.hybrid.is_some() {
            if self.enable_caching {
                self.cache_hybrid_blocks(req, num_tokens);
            }
            return;
        }
        let num_tokens = self.cacheable(num_tokens);
        let num_full = (num_tokens / self.block_size) as usize;
        if self.enable_caching && (num_full > req.num_cached_blocks as usize || self.hybrid.is_some()) {
            self.cache_full_blocks(req, num_full);
        }
    }

    /// Whether `cache_blocks(req, num_tokens)` would leave everything as it is, decided without a call: caching
    /// off, or no full block past the cached ones (with a single KV cache group).
    #[inline(always)]
    pub fn caches_nothing(&self, req: &Request, num_tokens: u32) -> bool {
        !self.enable_caching
            || (self.hybrid.is_none()
                && (num_tokens / self.block_size) as usize <= req.num_cached_blocks as usize)
    }

    /// Enters the request's blocks `num_cached_blocks..num_full` into the prefix cache (one group; caching is on:
    /// the caller checks).
    fn cache_full_blocks(&mut self, req: &mut Request, num_full: usize) {
        let num_full = num_full.min(req.block_hashes.len()).min(req.blocks.len());
        let first = req.num_cached_blocks as usize;
        if num_full <= first {
            return;
        }
        if self.special {
            self.cache_window_blocks(req, first, num_full);
            return;
        }
        if num_full == first + 1 {
            // One block (a decode completing it): no run to prefetch along.
            let (block, hash) = (req.blocks[first], req.block_hashes[first]);
            self.pool.cache_block(block, hash);
            self.newly_cached.push((block, hash));
        } else {
            let (blocks, hashes) = (&req.blocks[first..num_full], &req.block_hashes[first..num_full]);
            self.pool.cache_run(blocks, hashes);
            self.newly_cached.extend(blocks.iter().copied().zip(hashes.iter().copied()));
        }
        req.num_cached_blocks = num_full as u32;
        if self.pool.events_mut().is_some() {
            // Group 0's key is the plain hash, and this table has no null blocks.
            self.record_group_stored(req, &req.blocks, first, num_full, 0, &|_| true);
        }
    }

    /// `cache_full_blocks` with a sliding window: the null blocks are skipped, and a window of one token caches
    /// nothing (vLLM's `reachable_block_mask`: no block can start a hit) but with the trailing-block drop (whose
    /// hit needs the block past the boundary).
    #[cold]
    fn cache_window_blocks(&mut self, req: &mut Request, first: usize, num_full: usize) {
        let (w, bs, eagle) = (self.sliding_window, self.block_size, self.drop_trailing_hit);
        // Sparse retention: one group has no shared-prefix junction (vLLM's unitary coordinator reports none).
        let sparse = self.retention.map(|r| (r, window_reachable(req.num_prompt_tokens, 0, bs, eagle, true)));
        let kept = |i: usize| {
            (w > 1 || eagle)
                && match &sparse {
                    Some((r, reach)) => window_retained(i, bs, w, eagle, *r, reach),
                    None => true,
                }
        };
        for i in first..num_full {
            let (block, hash) = (req.blocks[i], req.block_hashes[i]);
            if block != NULL_BLOCK && kept(i) {
                self.pool.cache_block(block, hash);
                self.newly_cached.push((block, hash));
            }
        }
        req.num_cached_blocks = num_full as u32;
        if self.pool.events_mut().is_some() {
            self.record_group_stored(req, &req.blocks, first, num_full, 0, &kept);
        }
    }

    /// Group `g`'s block size in tokens (the manager's `block_size` but with KV cache groups of different sizes).
    #[inline]
    pub(crate) fn group_block_size(&self, g: usize) -> u32 {
        self.hybrid.as_deref().and_then(|hy| hy.block_sizes.get(g).copied()).unwrap_or(self.block_size)
    }

    /// Records the stored event of group `g`'s run `first..num_full` of `req`'s blocks (`blocks`: the group's
    /// table), just entered into the prefix cache: the hashes of its blocks that are not null and that `kept`
    /// entered (a window of one token caches nothing, sparse retention skips some), with the copies of the
    /// group's key of each and its index in the table, and the tokens and parent of the whole run (vLLM's event
    /// for a window group's run). A group whose blocks hold `k` hash blocks keys its block `i` by the request's
    /// hash `(i + 1) * k - 1`.
    #[cold]
    pub(crate) fn record_group_stored(
        &mut self,
        req: &Request,
        blocks: &[u32],
        first: usize,
        num_full: usize,
        g: usize,
        kept: &dyn Fn(usize) -> bool,
    ) {
        let gbs = self.group_block_size(g);
        let k = (gbs / self.block_size).max(1) as usize;
        let kept: Vec<(BlockHash, u32, u32)> = (first..num_full)
            .filter(|&i| blocks[i] != NULL_BLOCK && kept(i))
            .filter_map(|i| {
                let h = *req.block_hashes.get((i + 1) * k - 1)?;
                Some((h, self.pool.num_copies(&group_key(&h, g)), i as u32))
            })
            .collect();
        let bs = gbs as usize;
        let tokens = req.token_ids.get(first * bs..num_full * bs).unwrap_or_default();
        debug_assert_eq!(tokens.len(), (num_full - first) * bs);
        let parent = (first * k).checked_sub(1).and_then(|p| req.block_hashes.get(p).copied());
        if let Some(ev) = self.pool.events_mut() {
            ev.push_stored(
                kept.into_iter(),
                parent,
                tokens,
                &req.extra_keys,
                &req.id,
                first as u32,
                g as u32,
                gbs,
            );
        }
    }

    /// Records the stored event of one block of group `g` just entered under the key of `req`'s hash `i` apart
    /// from a run (an align-mode Mamba group's re-keyed prefill checkpoint, the prompt's checkpoint state that
    /// sparse retention keeps only as the prompt's tail, or a full-attention group's prompt tail entry with
    /// groups of different block sizes): that hash block's hash, tokens and parent, as vLLM's event for a single
    /// prefix-cache entry.
    #[cold]
    pub(crate) fn record_block_stored(&mut self, req: &Request, i: usize, g: usize) {
        let Some(&h) = req.block_hashes.get(i) else { return };
        let n = self.pool.num_copies(&group_key(&h, g));
        let bs = self.block_size as usize;
        let tokens = req.token_ids.get(i * bs..(i + 1) * bs).unwrap_or_default();
        let parent = i.checked_sub(1).map(|p| req.block_hashes[p]);
        if let Some(ev) = self.pool.events_mut() {
            ev.push_stored(
                std::iter::once((h, n, i as u32)),
                parent,
                tokens,
                &req.extra_keys,
                &req.id,
                i as u32,
                g as u32,
                bs as u32,
            );
        }
    }

    /// Releases every block of `req` (deepest first; the null blocks of a sliding window are no blocks) and
    /// clears its table.
    pub fn free(&mut self, req: &mut Request) {
        if !req.groups.is_empty() {
            return self.free_groups(req);
        }
        self.pool.free_blocks(&req.blocks);
        req.blocks.clear();
        req.num_cached_blocks = 0;
    }

    /// Whether a decode step of a request with `computed` tokens computed now enters a full block into the
    /// prefix cache or allocates a block (one token less than a multiple of the block size, or exactly a
    /// multiple).
    #[inline(always)]
    pub fn near_block_boundary(&self, computed: u32) -> bool {
        self.boundary_phase(computed) <= 1
    }

    /// Where a decode step of a request with `computed` tokens computed sits in its block: 0 when it completes
    /// one (one token less than a multiple of the block size computed), 1 when it starts the next.
    #[inline(always)]
    fn boundary_phase(&self, computed: u32) -> u32 {
        computed.wrapping_add(1) % self.block_size
    }

    /// A hint, no effect on results: if `req` is one token before or at a block boundary (a decode step that
    /// enters its last full block into the prefix cache, or one that allocates its next block), starts fetching
    /// the lines that step reads: its block table where caching resumes and where the next block goes, and its
    /// hash list at the same index. Called a few requests ahead of the schedule loop, so that in a lock-step
    /// batch (every request at a boundary in the same step) these per-request misses overlap instead of
    /// stalling one after another.
    #[inline(always)]
    pub fn prefetch_block_work(&self, req: &Request, computed: u32) {
        if !self.near_block_boundary(computed) {
            return;
        }
        let k = req.num_cached_blocks as usize;
        // `wrapping_add`: the addresses may lie past the lists (a prefetch never faults); nothing is read.
        prefetch(req.blocks.as_ptr().wrapping_add(k).cast());
        prefetch(req.blocks.as_ptr().wrapping_add(req.blocks.len()).cast());
        if self.enable_caching {
            prefetch(req.block_hashes.as_ptr().wrapping_add(k).cast());
        }
    }

    /// The second stage of `prefetch_block_work`, a few requests later (when its lines have arrived): starts
    /// fetching the cache-table slot where `req`'s next full block will be entered.
    #[inline(always)]
    pub fn prefetch_cache_slot(&self, req: &Request, computed: u32) {
        if self.boundary_phase(computed) != 0 || !self.enable_caching {
            return;
        }
        if let Some(h) = req.block_hashes.get(req.num_cached_blocks as usize) {
            self.pool.prefetch_cache_slot(h);
        }
    }

    /// A hint, no effect on results: after a decode's token filled a block (and it was hashed), the next step
    /// enters that block into the prefix cache. Starts fetching what that writes: the cache-table slot of its
    /// hash, and the block's hash slot and packed word. Issued from the update, a step ahead, so the lines have
    /// arrived when `schedule()` needs them (c: 0.930 and 0.944 of the step, two paired runs).
    #[inline(always)]
    pub fn prefetch_next_caching(&self, req: &Request) {
        if let (true, Some(h)) = (self.enable_caching, req.block_hashes.last()) {
            self.pool.prefetch_cache_slot(h);
            if let Some(&b) = req.blocks.get(req.num_cached_blocks as usize) {
                self.pool.prefetch_block(b);
            }
        }
    }

    /// Hashes the request's blocks that became full since the last call.
    #[inline]
    pub fn extend_hashes(&mut self, req: &mut Request) {
        if self.partial_unit != 0 {
            self.extend_unit_hashes(req);
            return;
        }
        if self.enable_caching
            && self.hasher.num_hashable(req.token_ids.len(), self.block_size as usize)
                > req.block_hashes.len()
        {
            self.hasher.extend_hashes(
                &mut req.block_hashes,
                &req.token_ids,
                self.block_size as usize,
                &req.extra_keys,
                &req.encoder_inputs,
                &mut self.hash_buf,
            );
        }
    }

    /// `extend_hashes` with prefix hits inside a block: the request's full units, then its blocks' hashes (each
    /// its last unit's).
    #[cold]
    fn extend_unit_hashes(&mut self, req: &mut Request) {
        let bs = self.block_size as usize;
        self.hasher.extend_unit_hashes(
            &mut req.unit_hashes,
            &req.token_ids,
            bs,
            &req.extra_keys,
            &req.encoder_inputs,
            &mut self.hash_buf,
        );
        let k = bs / self.partial_unit as usize;
        while req.block_hashes.len() < req.unit_hashes.len() / k {
            let i = req.block_hashes.len();
            req.block_hashes.push(req.unit_hashes[(i + 1) * k - 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HashAlgo;

    fn chain_hash(i: usize) -> BlockHash {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)).to_le_bytes());
        BlockHash(b)
    }

    /// A window hit is the rightmost run of `ceil((w - 1) / block_size)` cached blocks, null blocks before it;
    /// without such a run, the run of cached blocks from block 0.
    #[test]
    fn window_hits_take_the_rightmost_run_that_covers_the_window() {
        let mut kv = KvCacheManager {
            pool: BlockPool::new(16, true),
            hasher: BlockHasher::new(HashAlgo::Xxh3_128, Some(b"test")).unwrap(),
            block_size: 4,
            max_slots: 4 * 16,
            enable_caching: true,
            newly_cached: Vec::new(),
            hash_buf: Vec::new(),
            sliding_window: 0,
            admission_cap_blocks: usize::MAX,
            retention: None,
            hybrid: None,
            special: false,
            drop_trailing_hit: false,
            reprefillable: 0,
            extra_retained: 0,
            partial_unit: 0,
        };
        let hashes: Vec<BlockHash> = (0..8).map(chain_hash).collect();
        let mut blocks = Vec::new();
        kv.pool.allocate_into(8, &mut blocks);
        for i in [0, 1, 2, 5, 6] {
            kv.pool.cache_block(blocks[i], hashes[i]);
        }
        let hit = |kv: &KvCacheManager, window: u32| {
            let kv = KvCacheManager { sliding_window: window, special: window != 0, ..kv.clone() };
            let mut out = vec![99];
            kv.find_longest_cache_hit(&hashes, 8 * 4 + 1, &mut out);
            out
        };
        let (b, n) = (&blocks, NULL_BLOCK);
        // need 2: blocks 5 and 6.
        assert_eq!(hit(&kv, 8), vec![99, n, n, n, n, n, b[5], b[6]]);
        // need 3: blocks 5-6 are too short; blocks 0-2 are the run.
        assert_eq!(hit(&kv, 10), vec![99, b[0], b[1], b[2]]);
        // need 4: no run is long enough; the run from block 0.
        assert_eq!(hit(&kv, 14), vec![99, b[0], b[1], b[2]]);
        // Full attention: the run from block 0.
        assert_eq!(hit(&kv, 0), vec![99, b[0], b[1], b[2]]);
        // With the trailing-block drop (vLLM's SlidingWindowManager with EAGLE): one block more, then dropped.
        let drop = KvCacheManager { drop_trailing_hit: true, ..kv.clone() };
        // need 1 + 1: blocks 5-6, block 6 dropped.
        assert_eq!(hit(&drop, 4), vec![99, n, n, n, n, n, b[5]]);
        // need 2 + 1: blocks 5-6 are too short; blocks 0-2, block 2 dropped.
        assert_eq!(hit(&drop, 8), vec![99, b[0], b[1]]);
        // need 4 + 1: the run from block 0, its last block dropped.
        assert_eq!(hit(&drop, 14), vec![99, b[0], b[1]]);
        // A window of one token: the rightmost cached block, dropped: null blocks only.
        assert_eq!(hit(&drop, 1), vec![99, n, n, n, n, n, n]);
    }

    /// `cache_hit_upper_bound` never undercounts the hits `find_longest_cache_hit` finds, whatever the hint and
    /// whatever was cached or evicted since the hint was taken, and with the exact hits as hint it needs no
    /// further lookup. The chain's blocks are cached, freed, evicted (reallocated) and cached again at random.
    #[test]
    fn cache_hit_upper_bound_is_an_upper_bound() {
        for drop in [false, true] {
            upper_bound_holds(drop);
        }
    }

    /// `cache_hit_upper_bound` bounds the hits (exactly from their own count, except a dropped single block),
    /// and `has_cached_prefix` says whether there are any, with and without the trailing-block drop.
    fn upper_bound_holds(drop: bool) {
        const CHAIN: usize = 12;
        let mut kv = KvCacheManager {
            pool: BlockPool::new(24, true),
            hasher: BlockHasher::new(HashAlgo::Xxh3_128, Some(b"test")).unwrap(),
            block_size: 16,
            max_slots: 16 * 24,
            enable_caching: true,
            newly_cached: Vec::new(),
            hash_buf: Vec::new(),
            sliding_window: 0,
            admission_cap_blocks: usize::MAX,
            retention: None,
            hybrid: None,
            special: false,
            drop_trailing_hit: drop,
            reprefillable: 0,
            extra_retained: 0,
            partial_unit: 0,
        };
        let hashes: Vec<BlockHash> = (0..CHAIN).map(chain_hash).collect();
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let mut held: Vec<u32> = Vec::new();
        let mut hits = Vec::new();
        let mut exact_checked = 0;
        for round in 0..3000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 4 {
                // Cache a chain block in a fresh block (if it is not cached already) and keep it or free it.
                0 | 1 => {
                    let i = (x >> 8) as usize % CHAIN;
                    if kv.pool.get_cached_block(&hashes[i]).is_none() && kv.pool.num_free_blocks() > 0 {
                        let mut b = Vec::new();
                        kv.pool.allocate_into(1, &mut b);
                        kv.pool.cache_block(b[0], hashes[i]);
                        if (x >> 20) & 1 == 0 {
                            kv.pool.free_blocks(&b);
                        } else {
                            held.push(b[0]);
                        }
                    }
                }
                // Free what is held, or take free blocks (evicting the hashes they carry).
                2 => {
                    kv.pool.free_blocks(&held);
                    held.clear();
                }
                _ => {
                    let n = ((x >> 8) as usize % 6).min(kv.pool.num_free_blocks());
                    let mut b = Vec::new();
                    kv.pool.allocate_into(n, &mut b);
                    kv.pool.free_blocks(&b);
                }
            }
            for num_tokens in [1u32, 17, 100, (CHAIN as u32) * 16, (CHAIN as u32) * 16 + 1] {
                hits.clear();
                kv.find_longest_cache_hit(&hashes, num_tokens, &mut hits);
                for hint in 0..=CHAIN as u32 + 1 {
                    if let Some(bound) = kv.cache_hit_upper_bound(&hashes, num_tokens, hint) {
                        assert!(
                            bound >= hits.len(),
                            "round {round}: hint {hint} bound {bound} < {} hits",
                            hits.len()
                        );
                    }
                }
                let exact = kv.cache_hit_upper_bound(&hashes, num_tokens, hits.len() as u32);
                // With the drop and no hits, block 1 may be cached after a missing block 0: no bound then.
                if !(drop && hits.is_empty() && exact.is_none()) {
                    assert_eq!(exact, Some(hits.len()));
                }
                assert_eq!(kv.has_cached_prefix(&hashes, num_tokens), !hits.is_empty());
                exact_checked += usize::from(!hits.is_empty());
            }
        }
        assert!(exact_checked > 500, "the chain was rarely cached ({exact_checked} probes with hits)");
    }
}
