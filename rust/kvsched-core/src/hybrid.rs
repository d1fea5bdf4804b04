//! Several KV cache groups in one pool (`SchedulerConfig::kv_cache_groups`, vLLM's `HybridKVCacheCoordinator`
//! over one `FullAttentionManager`, `SlidingWindowManager`, `ChunkedLocalAttentionManager` or
//! `CrossAttentionManager` per group, all with the same block size).
//!
//! A request holds one block table per group (group 0's is `Request::blocks`, the others `Request::groups`),
//! all of the same length: every group covers every slot. Group by group, in group order:
//!
//! - **Allocation**: the blocks that left each window go back to the pool first (deepest first, one call per
//!   group); the blocks needed are summed over the groups and checked against the pool at once; then each
//!   group touches its prefix hits, then each group pops its new blocks, then each group caches its full
//!   blocks.
//! - **Freeing**: group 0's table deepest first, then group 1's, and so on (vLLM frees manager by manager).
//! - **Prefix cache**: a group's block enters the cache under its hash tagged with the group id (group 0's
//!   key is the hash itself), so a hit in one group never hands out another group's block.
//! - **Prefix hit**: groups with the same window (full attention counting as one) are looked up together (a
//!   block is a hit only if every group of the set has it cached); full attention first, then the windows in
//!   order of first appearance, each lookup capped at the hit so far, until a pass shortens nothing. Every
//!   group's hit then has the same number of blocks (full attention trimmed to it, windows with null blocks
//!   before their run).
//! - **Chunked-local groups** (`CHUNKED_LOCAL | c`, vLLM's `ChunkedLocalAttentionManager`): a window group whose
//!   skipped tokens are those before the chunk of the next token (`computed / c * c`), with its own admission
//!   cap (`ceil(min(c + in-flight tokens, max_model_len) / bs)`). Its lookup, capped at `n` blocks: the blocks
//!   before the chunk that holds token `n * bs` are null blocks, then the cached blocks from there on, stopping
//!   at the first miss (`chunk_hit`). Its full blocks are all cached.
//! - **Cross-attention groups** (`CROSS_ATTENTION`, vLLM's `CrossAttentionManager`): a request's table there
//!   holds `ceil(cross_attention_tokens / bs)` blocks, taken by its first allocation (a fresh table: an
//!   admission, or a readmission after preemption) and never grown after; freed with the others; never cached,
//!   never part of a lookup (the config refuses prefix caching with them). Its table is the only one not as
//!   long as group 0's.
//!
//! This module holds the groups' description; `hybrid_kv.rs` holds what `KvCacheManager` does with them, off the
//! single-group paths: `KvCacheManager` branches there only when `hybrid` is set.

use std::sync::{Mutex, MutexGuard};

use crate::config::{CHUNKED_LOCAL, CROSS_ATTENTION};
use crate::hashing::BlockHash;

/// The groups of a hybrid KV cache.
#[derive(Debug)]
pub struct Hybrid {
    /// Each group's window in tokens; 0: full attention; `CROSS_ATTENTION`: cross attention; `CHUNKED_LOCAL | c`:
    /// chunked-local attention in chunks of `c` tokens.
    pub windows: Vec<u32>,
    /// Each group's admission cap in blocks (`usize::MAX` for full attention); see
    /// `KvCacheManager::admission_cap_blocks`.
    pub caps: Vec<usize>,
    /// The lookup sets: a window (0: full attention) and the groups that have it, full attention first, then
    /// the windows in order of first appearance.
    pub lookups: Vec<(u32, Vec<usize>)>,
    /// Each group's hits found by the last `find_longest_cache_hit` (group 0's are also the caller's list):
    /// `allocate_slots` and `full_sequence_fits` take the other groups' hits from here when handed group 0's.
    last_hits: Mutex<Vec<Vec<u32>>>,
}

impl Clone for Hybrid {
    fn clone(&self) -> Self {
        Hybrid {
            windows: self.windows.clone(),
            caps: self.caps.clone(),
            lookups: self.lookups.clone(),
            last_hits: Mutex::new(self.hits().clone()),
        }
    }
}

impl Hybrid {
    /// `windows`: per group, `None` for full attention. `cap` gives a window's (or chunked-local group's)
    /// admission cap in blocks.
    pub fn new(windows: &[Option<u32>], cap: impl Fn(u32) -> usize) -> Self {
        let windows: Vec<u32> = windows.iter().map(|w| w.unwrap_or(0)).collect();
        let caps = windows
            .iter()
            .map(|&w| if w == 0 || w == CROSS_ATTENTION { usize::MAX } else { cap(w) })
            .collect();
        let mut lookups: Vec<(u32, Vec<usize>)> = Vec::new();
        for (g, &w) in windows.iter().enumerate() {
            if w == CROSS_ATTENTION {
                continue;
            }
            match lookups.iter_mut().find(|(lw, _)| *lw == w) {
                Some((_, ids)) => ids.push(g),
                None => lookups.push((w, vec![g])),
            }
        }
        // Full attention first (a stable sort keeps the windows' order).
        lookups.sort_by_key(|(w, _)| *w != 0);
        let n = windows.len();
        Hybrid { windows, caps, lookups, last_hits: Mutex::new(vec![Vec::new(); n]) }
    }

    /// `last_hits` (a lock never held across a call: it cannot be poisoned by a panic elsewhere).
    pub(crate) fn hits(&self) -> MutexGuard<'_, Vec<Vec<u32>>> {
        self.last_hits.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Group `g`'s prefix-cache key of a block with hash `h`: the hash itself for group 0, else the hash with
/// its last byte tagged by the group id.
#[inline]
pub fn group_key(h: &BlockHash, g: usize) -> BlockHash {
    let mut k = *h;
    if g > 0 {
        k.0[31] ^= g as u8;
        k.0[30] ^= 0x5a;
    }
    k
}

/// Tokens wholly before a window of `w` tokens of the token after `computed` (vLLM's `get_num_skipped_tokens`).
#[inline]
pub(crate) fn window_skipped(w: u32, computed: u32) -> u32 {
    (computed + 1).saturating_sub(w)
}

/// The chunk size of a chunked-local group's entry `w`, or `None` for another group.
#[inline]
pub(crate) fn chunk_size(w: u32) -> Option<u32> {
    (w != CROSS_ATTENTION && w & CHUNKED_LOCAL != 0).then_some(w & !CHUNKED_LOCAL)
}

/// Tokens a window or chunked-local group `w` no longer reads once `computed` tokens are computed (vLLM's
/// `get_num_skipped_tokens`): those before the window of the next token, or before its chunk.
#[inline]
pub(crate) fn group_skipped(w: u32, computed: u32) -> u32 {
    match chunk_size(w) {
        Some(c) => computed / c * c,
        None => window_skipped(w, computed),
    }
}
