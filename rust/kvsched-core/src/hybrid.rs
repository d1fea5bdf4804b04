//! Several KV cache groups in one pool (`SchedulerConfig::kv_cache_groups`, vLLM's `HybridKVCacheCoordinator`
//! over one `FullAttentionManager`, `SlidingWindowManager`, `ChunkedLocalAttentionManager`,
//! `CrossAttentionManager` or `MambaManager` per group, the attention groups with the same block size, or, full
//! attention and windows only, each its own: `Hybrid::block_sizes`).
//!
//! A request holds one block table per group (the *primary* group's, the first that is not Mamba, a ring or a
//! replayed window, is `Request::blocks`; the others are `Request::groups`, in group order), all of the same
//! length but cross attention's and Mamba's (and a replayed window's of another block size): every attention group
//! covers every slot. Group by group, in group order:
//!
//! - **Block sizes**: with `SchedulerConfig::kv_cache_group_block_sizes`, group `g`'s blocks hold `b_g` tokens, a
//!   multiple of the primary group's (the manager's `block_size`, which the request's hashes are taken at): its
//!   table has `ceil(slots / b_g)` entries, its block `i` is keyed by `block_hashes[(i + 1) * b_g / bs - 1]`, and
//!   every count of it goes by `b_g`. Hits are aligned to `Hybrid::align` (the least common multiple), every group
//!   caches the same aligned prefix, and a window of blocks smaller than it keeps only what an aligned hit can use
//!   (`window_kept`).
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
//! - **Mamba groups** (`MAMBA`, vLLM's `MambaManager` with `mamba_cache_mode` "none", whose block holds the state
//!   of `max_model_len` tokens): a request's table there holds `1 + mamba_speculative_blocks` blocks, taken by its
//!   first allocation and never grown after (every allocation's slots fit one such block); freed with the
//!   others; never cached, never part of a lookup (the config refuses prefix caching with them). vLLM lists
//!   them in layer order, so they may come before the primary group. With one, every attention block a
//!   `schedule()` allocates is reported in its output's `zero_block_ids` (vLLM zeroes them before use), group by
//!   group, each group's in allocation order.
//! - **Ring groups** (`RING`, vLLM's `CircularBufferManager` over a `CircularBufferSpec`: a compressor's ring of the
//!   keys still being compressed): a request's table there holds exactly one block, taken by its first allocation
//!   and never grown after (popped, like a Mamba group's state, with the other groups' external blocks when the
//!   allocation loads tokens); freed with the others; never cached, never part of a lookup (its hit is empty, the
//!   other groups' hit is found without it), never reported in `zero_block_ids`. Unlike cross attention and Mamba
//!   groups it sits beside prefix caching.
//! - **Mamba groups in align mode** (`mamba_align`, vLLM's `MambaManager` with `mamba_cache_mode` "align"): the
//!   state blocks are `bs` tokens long and the table grows with the request, as vLLM's does, but holds real blocks
//!   only at its running state. An allocation for `t` tokens (computed plus new, no lookahead) wants
//!   `ceil(t / bs) + s` entries (`s` = `mamba_speculative_blocks`); when the table is shorter it pads with null
//!   blocks up to `ceil(t / bs) - 1`, moves the speculative blocks that would sit below that to the end, and
//!   pops the rest (at most `1`, `1 + s` at the first allocation). Its count in the all-or-nothing check is
//!   `ceil(t / bs) + s - len` capped at that (negative when the table is longer: vLLM sums it as it is). Before
//!   each allocation, with `p` tokens processed, the entries below `(p - 1) / bs` go back to the pool (deepest
//!   first, null blocks skipped): the state two allocations old among them. A running request's new ids in the
//!   group are the entries its allocation appended. With prefix caching the Mamba groups are one lookup set
//!   (right to left: the first block all of them have cached, null blocks before it), their non-null entries at
//!   full-block boundaries are cached after each allocation, a hit on a state cached in the current `schedule()`
//!   call fails its allocation (`mamba_cached_step`; without `defer_new_states_only`, as vLLM 0.32, the state
//!   at the prompt's checkpoint counts as cached in the call whenever an allocation's cacheable tokens, floored
//!   to a block, end there, even when it was cached before), and the longest single-set hit, when longer than
//!   the combined one, is the request's shared-prefix junction (a chunk stop, `AlignedSplit::split`).
//!
//! - **Sparse retention** (`retention`, `SchedulerConfig::prefix_cache_retention_interval`): a window group caches
//!   only the blocks a later hit can use (`window_retained`, at the positions `window_reachable` gives, the
//!   shared-prefix junction among them), an align-mode Mamba group only the states `mamba_retained` keeps; the
//!   junction is then set at every lookup with prefix caching.
//!
//! This module holds the groups' description; `hybrid_kv.rs` holds what `KvCacheManager` does with them, off the
//! single-group paths: `KvCacheManager` branches there only when `hybrid` is set.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::config::{CHUNKED_LOCAL, CROSS_ATTENTION, MAMBA, RING};
use crate::hashing::BlockHash;

/// The groups of a hybrid KV cache.
#[derive(Debug)]
pub struct Hybrid {
    /// Each group's window in tokens; 0: full attention; `CROSS_ATTENTION`: cross attention; `MAMBA`: Mamba; `RING`: a ring;
    /// `CHUNKED_LOCAL | c`: chunked-local attention in chunks of `c` tokens.
    pub windows: Vec<u32>,
    /// Each group's block size in tokens (`SchedulerConfig::kv_cache_group_block_sizes`): the primary group's is
    /// the manager's `block_size`, the others multiples of it (a replayed window's any size).
    pub block_sizes: Vec<u32>,
    /// The least common multiple of `block_sizes` (vLLM's scheduler block size): a hit's length in tokens and the
    /// tokens each group caches are multiples of it.
    pub align: u32,
    /// The primary group: the first that is not Mamba, a ring or a replayed window (its table is
    /// `Request::blocks`).
    pub primary: usize,
    /// The blocks a request holds in a Mamba group (`1 + mamba_speculative_blocks`).
    pub mamba_blocks: usize,
    /// Mamba groups in vLLM's `mamba_cache_mode` "align" (`SchedulerConfig::mamba_align`; see `hybrid_kv.rs`).
    pub mamba_align: bool,
    /// With a Mamba group (vLLM then zeroes new attention blocks before use): each group's attention blocks
    /// allocated since the last `schedule()` returned, in allocation order (`SchedulerOutput::zero_block_ids`).
    /// Empty without one.
    pub zero_ids: Vec<Vec<u32>>,
    /// The groups an asynchronous KV load being allocated writes (vLLM's `get_loaded_kv_cache_group_ids`): the
    /// blocks of its external tokens there stay out of `zero_ids` (the load would race the zeroing). Set by the
    /// scheduler around that one allocation; empty otherwise.
    pub skip_zero: Vec<usize>,
    /// Each group's admission cap in blocks (`usize::MAX` for full attention); see
    /// `KvCacheManager::admission_cap_blocks`.
    pub caps: Vec<usize>,
    /// The lookup sets: a window (0: full attention) and the groups that have it, full attention first, then
    /// the windows in order of first appearance.
    pub lookups: Vec<(u32, Vec<usize>)>,
    /// Each group's hits found by the last `find_longest_cache_hit` (group 0's are also the caller's list):
    /// `allocate_slots` and `full_sequence_fits` take the other groups' hits from here when handed group 0's.
    last_hits: Mutex<Vec<Vec<u32>>>,
    /// See `last_longest`.
    last_longest: AtomicUsize,
    /// See `last_per_group`.
    last_per_group: AtomicBool,
    /// Align-mode Mamba groups with prefix caching: the keys Mamba blocks entered the cache under since the
    /// current `schedule()` call began (vLLM's `cached_blocks_this_step`): a Mamba hit on one of them fails its
    /// allocation in this step (its state is written by this step).
    pub mamba_cached_step: HashSet<BlockHash>,
    /// `SchedulerConfig::mamba_defer_new_states_only`: `false` (vLLM 0.32) also puts the state at the prompt's
    /// checkpoint in `mamba_cached_step` whenever an allocation's cacheable tokens end there, cached before or
    /// not (see `hybrid_kv.rs`).
    pub defer_new_states_only: bool,
    /// `SchedulerConfig::mamba_eagle_group`: with the trailing-block drop, the Mamba groups take its rules.
    pub mamba_eagle: bool,
    /// `SchedulerConfig::drop_junction_below`: with the drop and sparse retention, the groups that take its rules
    /// also keep what a hit one block below a shared-prefix junction needs (`window_reachable`).
    pub junction_below: bool,
    /// With prefix caching: the sparse retention of align-mode Mamba states and of sliding-window blocks
    /// (`SchedulerConfig::prefix_cache_retention_interval`; `None`: dense, see `mamba_retained` and
    /// `window_retained`).
    pub retention: Option<u32>,
    /// The hash lookahead tokens (`SchedulerConfig::hash_lookahead_tokens`): where the prompt's checkpoint lies
    /// under sparse retention (`mamba_checkpoint`).
    pub hash_lookahead: u32,
    /// Align-mode Mamba groups' prefill checkpoints (`SchedulerConfig::mamba_prefill_checkpoint_alignment`; 0:
    /// none): see `checkpoint_valid` and `hybrid_kv.rs`.
    pub checkpoint_align: u32,
    /// Align-mode Mamba groups with prefix caching and a KV connector: the boundary states the caching offered
    /// since the last `Scheduler::take_mamba_boundary_offers` (vLLM's `boundary_state_offloads`), each as
    /// `(request id, group, block, tokens)` in the order the groups cached them; `None`: not recorded.
    pub boundary_offers: Option<Vec<BoundaryOffer>>,
    /// With prefix hits inside a block (`KvCacheManager::partial_unit`): the last admission lookup's hit and its
    /// longest single set's hit, in tokens (`find_partial_admission_hit`).
    pub partial_hit_tokens: u32,
    pub partial_longest: u32,
    /// With prefix hits inside a block: the block copies queued since the current `schedule()` call began, per
    /// group, as `(source, destination)` (vLLM's `kv_cache_block_copies`; `SchedulerOutput::kv_cache_block_copies`).
    pub cow_copies: Vec<Vec<(u32, u32)>>,
    /// Each group: whether bounded prefix replay rebuilds it (`SchedulerConfig::prefix_replay_groups`; empty:
    /// none). Such a sliding-window group is in no lookup set, its hit is null blocks like a ring's (taken as
    /// empty by the allocation: the hit's window gets fresh blocks), and it is never cached.
    pub replay: Vec<bool>,
}

/// A Mamba boundary state offered to a KV connector: `(request id, group, block, tokens it holds the state of)`.
pub type BoundaryOffer = (std::sync::Arc<str>, u32, u32, u32);

impl Clone for Hybrid {
    fn clone(&self) -> Self {
        Hybrid {
            windows: self.windows.clone(),
            block_sizes: self.block_sizes.clone(),
            align: self.align,
            primary: self.primary,
            mamba_blocks: self.mamba_blocks,
            mamba_align: self.mamba_align,
            zero_ids: self.zero_ids.clone(),
            skip_zero: self.skip_zero.clone(),
            caps: self.caps.clone(),
            lookups: self.lookups.clone(),
            last_hits: Mutex::new(self.hits().clone()),
            last_longest: AtomicUsize::new(self.last_longest()),
            last_per_group: AtomicBool::new(self.last_per_group()),
            mamba_cached_step: self.mamba_cached_step.clone(),
            defer_new_states_only: self.defer_new_states_only,
            mamba_eagle: self.mamba_eagle,
            junction_below: self.junction_below,
            retention: self.retention,
            hash_lookahead: self.hash_lookahead,
            checkpoint_align: self.checkpoint_align,
            boundary_offers: self.boundary_offers.clone(),
            partial_hit_tokens: self.partial_hit_tokens,
            partial_longest: self.partial_longest,
            cow_copies: self.cow_copies.clone(),
            replay: self.replay.clone(),
        }
    }
}

impl Hybrid {
    /// `windows`: per group, `None` for full attention; `block_sizes` each group's block size; `primary` the
    /// primary group (`SchedulerConfig::primary_group`). `cap` gives a window's (or chunked-local group's)
    /// admission cap in blocks of the given size; `mamba_speculative_blocks` the extra state blocks of a Mamba
    /// group.
    pub fn new(
        windows: &[Option<u32>],
        block_sizes: &[u32],
        primary: usize,
        mamba_speculative_blocks: u32,
        cap: impl Fn(u32, u32) -> usize,
    ) -> Self {
        let windows: Vec<u32> = windows.iter().map(|w| w.unwrap_or(0)).collect();
        let caps = windows
            .iter()
            .zip(block_sizes)
            .map(|(&w, &bs)| if is_window(w) { cap(w, bs) } else { usize::MAX })
            .collect();
        let align = block_sizes.iter().fold(1u64, |a, &b| lcm(a, u64::from(b.max(1))));
        let lookups = build_lookups(&windows, false, &[]);
        let n = windows.len();
        let zero_ids = if windows.contains(&MAMBA) { vec![Vec::new(); n] } else { Vec::new() };
        Hybrid {
            windows,
            block_sizes: block_sizes.to_vec(),
            align: u32::try_from(align).unwrap_or(u32::MAX),
            primary,
            mamba_blocks: 1 + mamba_speculative_blocks as usize,
            mamba_align: false,
            zero_ids,
            skip_zero: Vec::new(),
            caps,
            lookups,
            last_hits: Mutex::new(vec![Vec::new(); n]),
            last_longest: AtomicUsize::new(0),
            last_per_group: AtomicBool::new(false),
            mamba_cached_step: HashSet::new(),
            defer_new_states_only: true,
            mamba_eagle: true,
            junction_below: true,
            retention: None,
            hash_lookahead: 0,
            checkpoint_align: 0,
            boundary_offers: None,
            partial_hit_tokens: 0,
            partial_longest: 0,
            cow_copies: vec![Vec::new(); n],
            replay: Vec::new(),
        }
    }

    /// Bounded prefix replay rebuilds `groups` (`SchedulerConfig::prefix_replay_groups`): they leave the lookup
    /// sets. Call before `with_mamba_lookup`.
    pub fn with_replay(mut self, groups: &[u32]) -> Self {
        if groups.is_empty() {
            return self;
        }
        self.replay = (0..self.windows.len()).map(|g| groups.contains(&(g as u32))).collect();
        self.lookups = build_lookups(&self.windows, false, &self.replay);
        self
    }

    /// Whether group `g` is rebuilt by bounded prefix replay (see `replay`).
    #[inline]
    pub fn is_replay(&self, g: usize) -> bool {
        self.replay.get(g).copied().unwrap_or(false)
    }

    /// Align-mode Mamba groups with prefix caching: the Mamba groups join the lookup as one set (vLLM groups
    /// them by their one spec), in the order of first appearance among the sets that are not full attention.
    pub fn with_mamba_lookup(mut self) -> Self {
        self.lookups = build_lookups(&self.windows, true, &self.replay);
        self
    }

    /// The longest hit (in blocks) one lookup set found in the last `find_longest_cache_hit`, which may exceed
    /// the combined hit (vLLM's `longest_hit_length`).
    pub(crate) fn last_longest(&self) -> usize {
        self.last_longest.load(Ordering::Relaxed)
    }

    pub(crate) fn set_last_longest(&self, n: usize) {
        self.last_longest.store(n, Ordering::Relaxed);
    }

    /// Whether the last lookup was the per-group one (`find_hybrid_hit_per_group`): each group's hits are then
    /// its own, of its own length, and the caller's list only carries the full-attention hit's length.
    pub(crate) fn last_per_group(&self) -> bool {
        self.last_per_group.load(Ordering::Relaxed)
    }

    pub(crate) fn set_last_per_group(&self, per_group: bool) {
        self.last_per_group.store(per_group, Ordering::Relaxed);
    }

    /// Where group `g`'s table sits in `Request::groups`; `None` for the primary group (`Request::blocks`).
    #[inline]
    pub fn slot(&self, g: usize) -> Option<usize> {
        group_slot(self.primary, g)
    }

    /// `last_hits` (a lock never held across a call: it cannot be poisoned by a panic elsewhere).
    pub(crate) fn hits(&self) -> MutexGuard<'_, Vec<Vec<u32>>> {
        self.last_hits.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// The lookup sets of groups `windows`: full attention as one set first, then each window (and, with `mamba`, the
/// Mamba groups as one set) in order of first appearance.
fn build_lookups(windows: &[u32], mamba: bool, replay: &[bool]) -> Vec<(u32, Vec<usize>)> {
    let mut lookups: Vec<(u32, Vec<usize>)> = Vec::new();
    for (g, &w) in windows.iter().enumerate() {
        if (w != 0 && !is_window(w) && !(mamba && w == MAMBA)) || replay.get(g).copied().unwrap_or(false) {
            continue;
        }
        match lookups.iter_mut().find(|(lw, _)| *lw == w) {
            Some((_, ids)) => ids.push(g),
            None => lookups.push((w, vec![g])),
        }
    }
    // Full attention first (a stable sort keeps the others' order).
    lookups.sort_by_key(|(w, _)| *w != 0);
    lookups
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

/// Where group `g`'s table sits in `Request::groups` when `primary` is the primary group (`None`: it is).
#[inline]
pub fn group_slot(primary: usize, g: usize) -> Option<usize> {
    match g.cmp(&primary) {
        std::cmp::Ordering::Less => Some(g),
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => Some(g - 1),
    }
}

/// Whether a group's `windows` entry is a sliding window (not full attention, cross attention, Mamba or a ring).
#[inline]
pub fn is_window(w: u32) -> bool {
    w != 0 && w != CROSS_ATTENTION && w != MAMBA && w != RING
}

/// Tokens wholly before a window of `w` tokens of the token after `computed`, less the `extra` tokens kept below
/// it (vLLM's `get_num_skipped_tokens` with `extra_retained_tokens`).
#[inline]
pub(crate) fn window_skipped(w: u32, computed: u32, extra: u32) -> u32 {
    (computed + 1).saturating_sub(w + extra)
}

/// The chunk size of a chunked-local group's entry `w`, or `None` for another group.
#[inline]
pub(crate) fn chunk_size(w: u32) -> Option<u32> {
    crate::config::is_chunked_entry(w).then_some(w & !CHUNKED_LOCAL)
}

/// Tokens a window or chunked-local group `w` no longer reads once `computed` tokens are computed (vLLM's
/// `get_num_skipped_tokens`): those before the window of the next token (less the `extra` tokens a window keeps
/// below it), or before its chunk.
#[inline]
pub(crate) fn group_skipped(w: u32, computed: u32, extra: u32) -> u32 {
    match chunk_size(w) {
        Some(c) => computed / c * c,
        None => window_skipped(w, computed, extra),
    }
}

/// The Mamba checkpoint boundary of a prefill of `num_tokens` tokens (vLLM's
/// `get_mamba_prefill_checkpoint_position`): the last multiple of `bs` that leaves at least one token (or
/// `hash_lookahead` tokens) to compute; with EAGLE's trailing-block drop, the multiple at or below `num_tokens`, one
/// block lower.
pub(crate) fn mamba_checkpoint(num_tokens: u32, bs: u32, drop_eagle: bool, hash_lookahead: u32) -> u32 {
    let limit = if drop_eagle { num_tokens } else { num_tokens.saturating_sub(hash_lookahead.max(1)) };
    let pos = limit / bs * bs;
    if drop_eagle {
        pos.saturating_sub(bs)
    } else {
        pos
    }
}

/// Whether a chunk computing tokens `start..end` exports the state after `checkpoint` tokens into an extra block
/// (vLLM's `is_mamba_prefill_checkpoint_valid` with whole-block hashes; `align`: the Mamba layers' prefill
/// checkpoint alignment, 0: no checkpoints): the chunk starts at a block boundary, `checkpoint` lies strictly
/// inside it at least a block past its start, a multiple of `align` tokens from its start, and the checkpoint's
/// block (`ceil(end / bs) - 2`) lies past the block holding the chunk's initial state.
#[cfg(test)]
pub(crate) fn checkpoint_valid(start: u32, end: u32, checkpoint: u32, bs: u32, align: u32) -> bool {
    checkpoint_valid_in_units(start, end, checkpoint, bs, bs, align)
}

/// `checkpoint_valid` when prefix hits can end inside a block (`unit` tokens per prefix-match unit): the chunk
/// starts at a unit boundary and `checkpoint` lies at least a unit past its start; the columns stay the blocks'.
pub(crate) fn checkpoint_valid_in_units(
    start: u32,
    end: u32,
    checkpoint: u32,
    unit: u32,
    bs: u32,
    align: u32,
) -> bool {
    if align == 0 {
        return false;
    }
    let initial_col = if start == 0 { -1 } else { i64::from((start - 1) / bs) };
    let checkpoint_col = i64::from(end.div_ceil(bs)) - 2;
    start % unit == 0
        && checkpoint_col > initial_col
        && start + unit <= checkpoint
        && start < checkpoint
        && checkpoint < end
        && (checkpoint - start) % align == 0
}

/// Sparse retention of align-mode Mamba states (vLLM's `MambaManager.reachable_block_mask`): whether state block
/// `i` (the state after `(i + 1) * bs` tokens) enters the prefix cache with retention interval `retention` (a
/// multiple of `bs`) and the positions a later request can resume at, `reachable` (the prompt's last token,
/// the shared-prefix junction; 0: none), each floored to a block boundary. An interval of one block or less
/// but 0 keeps every state; 0 keeps the reachable ones only; above that, also each state at a multiple of it.
pub(crate) fn mamba_retained(i: usize, bs: u32, retention: u32, reachable: &[u32]) -> bool {
    let per_segment = (retention / bs) as usize;
    if retention > 0 && per_segment <= 1 {
        return true;
    }
    if retention > 0 && (i + 1) % per_segment == 0 {
        return true;
    }
    reachable.iter().any(|&b| b >= bs && (b / bs) as usize == i + 1)
}

/// The token positions a later request can resume a sliding window's hit at, for `window_retained` (vLLM's
/// `replay_boundaries` plus the shared-prefix junction): the prompt's last token (a resend of the same prompt is
/// capped there), or with EAGLE's trailing-block drop (`eagle`) the block-floored positions of a resend and of a
/// longer sibling, one block lower each; and the request's `junction` (0: none), with `below` (vLLM 0.33's
/// groups that take the drop's rules) also one block lower.
pub(crate) fn window_reachable(
    num_prompt: u32,
    junction: u32,
    bs: u32,
    eagle: bool,
    below: bool,
) -> Vec<u32> {
    window_reachable_at(num_prompt, junction, bs, bs, eagle, below)
}

/// `window_reachable` among groups of different block sizes: the resend and longer-sibling positions at `align`
/// tokens (the scheduler block, vLLM's `replay_boundaries`), the junction's one block lower at the group's `bs`.
pub(crate) fn window_reachable_at(
    num_prompt: u32,
    junction: u32,
    align: u32,
    bs: u32,
    eagle: bool,
    below: bool,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(4);
    if eagle {
        let resend = num_prompt.saturating_sub(1) / align * align;
        let extension = num_prompt / align * align;
        out.push(resend.saturating_sub(align));
        out.push(extension.saturating_sub(align));
    } else {
        out.push(num_prompt.saturating_sub(1));
    }
    if junction > 0 {
        out.push(junction);
        if eagle && below && junction >= bs {
            out.push(junction - bs);
        }
    }
    out
}

/// Sparse retention of a sliding window's blocks (vLLM's `SlidingWindowManager.reachable_block_mask`): whether
/// block `i` of a window of `window` tokens enters the prefix cache under retention interval `retention` (a
/// multiple of `bs`). A hit at a block boundary needs the `need = ceil((window - 1) / bs)` blocks before it
/// (one more with EAGLE's drop, `eagle`, whose run ends one block past the boundary). Kept: the `need` blocks
/// ending at each of the `reachable` positions (`window_reachable`) floored to a block boundary; with an
/// interval above 0 also the last `need` blocks of every segment of `retention / bs` blocks (every block when
/// `need` covers a whole segment).
pub(crate) fn window_retained(
    i: usize,
    bs: u32,
    window: u32,
    eagle: bool,
    retention: u32,
    reachable: &[u32],
) -> bool {
    let shift = usize::from(eagle);
    let need = (window.saturating_sub(1)).div_ceil(bs) as usize + shift;
    if retention > 0 {
        let per_segment = (retention / bs) as usize;
        if need >= per_segment || (i >= shift && (i - shift) % per_segment >= per_segment - need) {
            return true;
        }
    }
    reachable.iter().any(|&b| {
        let end = (b / bs) as usize + shift;
        i < end && i + need >= end
    })
}

/// `window_retained` for a window group of blocks of `gbs` tokens among groups of different block sizes, whose
/// hits are aligned to `align` tokens (vLLM's `SlidingWindowManager.reachable_block_mask` with the scheduler
/// block size as its alignment): with `need = ceil((window - 1) / gbs)` blocks for a hit, the last `need` blocks
/// of every segment of `align` tokens (dense retention, `None`), or of `r` tokens (`Some(r)`, `r > 0`), every
/// block when `need` covers a segment; with retention on (`Some`), also the `need` blocks ending at each of the
/// `reachable` positions floored to `align`. With the trailing-block drop (`eagle`) a hit needs one block more,
/// which lies past the aligned boundary: each run shifts one block up.
pub(crate) fn window_kept(
    i: usize,
    gbs: u32,
    align: u32,
    window: u32,
    eagle: bool,
    retention: Option<u32>,
    reachable: &[u32],
) -> bool {
    let shift = usize::from(eagle);
    let need = (window.saturating_sub(1)).div_ceil(gbs) as usize + shift;
    let segment = match retention {
        None => Some(align),
        Some(0) => None,
        Some(r) => Some(r),
    };
    if let Some(seg) = segment {
        let per_segment = (seg / gbs) as usize;
        if need >= per_segment || (i >= shift && (i - shift) % per_segment >= per_segment - need) {
            return true;
        }
    }
    retention.is_some()
        && reachable.iter().any(|&b| {
            let end = (b / align * align / gbs) as usize + shift;
            i < end && i + need >= end
        })
}

/// The settings of `mamba_aligned_split`, fixed for a scheduler's lifetime.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AlignedSplit {
    pub bs: u32,
    /// The longest prefill chunk a step may schedule (`max_num_scheduled_tokens`, capped at
    /// `long_prefill_token_threshold` when set).
    pub max_prefill_tokens: u32,
    pub drop_eagle: bool,
    pub hash_lookahead: u32,
    /// The Mamba layers' prefill checkpoint alignment (0: no prefill checkpoints; `checkpoint_valid`).
    pub checkpoint_align: u32,
    /// Tokens per prefix-match unit when prefix hits can end inside a block (`SchedulerConfig::partial_hit_unit`);
    /// 0: hits end on whole blocks.
    pub unit: u32,
}

impl AlignedSplit {
    /// A prefill chunk of `n` tokens from `start`, cut where an align-mode Mamba state must be written (vLLM's
    /// `_mamba_block_aligned_split` without the shared-prefix checkpoint option), `junction` being the request's
    /// `shared_prefix_boundary` (0: none):
    /// the prefill ends at `max(num_prompt, num_tokens - 1)`; a chunk that ends before it is floored to a block
    /// boundary (unless that leaves nothing and a block is wider than `max_prefill_tokens`); it then stops at the
    /// next block boundary when it starts inside a block, and at the last block boundary that leaves a token to
    /// compute (`mamba_checkpoint`), and at `start + (junction - start) / bs * bs` when `junction` lies strictly
    /// inside it, whichever comes first strictly inside it. A chunk past the prefill is kept. With prefill
    /// checkpoints, a chunk that reaches the prefill's end and can export the prefill's checkpoint
    /// (`mamba_checkpoint` of the prefill's end, `checkpoint_valid`) stops only at the junction.
    ///
    /// When prefix hits can end inside a block (`unit`), the prefill's checkpoint is taken at a unit boundary, and
    /// a chunk without it also stops at the prompt's last unit boundary that leaves a token to compute when that
    /// lies past the last block boundary (the state a later request's hit ending inside a block resumes from).
    pub fn split(&self, num_prompt: u32, num_tokens: u32, start: u32, n: u32, junction: u32) -> u32 {
        let prefill_end = num_prompt.max(num_tokens.saturating_sub(1));
        if start >= prefill_end {
            return n;
        }
        let bs = self.bs;
        let unit = if self.unit == 0 { bs } else { self.unit };
        let mut end = start + n;
        let internal = end >= prefill_end && {
            let checkpoint = mamba_checkpoint(prefill_end, unit, self.drop_eagle, self.hash_lookahead);
            checkpoint_valid_in_units(start, end, checkpoint, unit, bs, self.checkpoint_align)
        };
        let last_cache =
            if internal { 0 } else { mamba_checkpoint(num_tokens, bs, self.drop_eagle, self.hash_lookahead) };
        if end < prefill_end {
            let aligned = end / bs * bs;
            if aligned > start || bs <= self.max_prefill_tokens {
                end = aligned;
            }
        }
        let next_boundary = if start % bs != 0 && !internal { (start / bs + 1) * bs } else { 0 };
        let tail = if self.unit != 0 && !internal {
            mamba_checkpoint(num_prompt, unit, self.drop_eagle, self.hash_lookahead)
        } else {
            0
        };
        let tail_stop = if last_cache < tail && tail < num_prompt { tail } else { 0 };
        // A shared-prefix junction inside the chunk: its block-floored position (from `start`).
        let junction_stop =
            if start < junction && junction < end { start + (junction - start) / bs * bs } else { 0 };
        for stop in [next_boundary, last_cache, tail_stop, junction_stop] {
            if start < stop && stop < end {
                end = stop;
            }
        }
        end.saturating_sub(start)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        checkpoint_valid, mamba_checkpoint, mamba_retained, window_kept, window_reachable,
        window_reachable_at, window_retained, AlignedSplit,
    };

    #[test]
    fn sparse_retention_keeps_segment_ends_and_reachable_states() {
        let kept =
            |r: u32, reach: &[u32]| (0..8).filter(|&i| mamba_retained(i, 4, r, reach)).collect::<Vec<_>>();
        // An interval of one block keeps every state; 0 only the reachable ones, floored to a block boundary.
        assert_eq!(kept(4, &[]), (0..8).collect::<Vec<_>>());
        assert_eq!(kept(0, &[]), Vec::<usize>::new());
        assert_eq!(kept(0, &[13]), vec![2]); // a 14-token prompt: the state after 12 tokens
        assert_eq!(kept(0, &[3, 0]), Vec::<usize>::new()); // below one block: nothing
                                                           // Every third block's end (12, 24 tokens) plus the reachable states.
        assert_eq!(kept(12, &[]), vec![2, 5]);
        assert_eq!(kept(12, &[19, 8]), vec![1, 2, 3, 5]);
    }

    #[test]
    fn a_window_of_smaller_blocks_keeps_the_blocks_before_each_aligned_boundary() {
        // Blocks of 4 tokens, hits aligned to 12: a window of 6 tokens needs 2 blocks before a boundary.
        let kept = |retention, reach: &[u32]| {
            (0..9).filter(|&i| window_kept(i, 4, 12, 6, false, retention, reach)).collect::<Vec<_>>()
        };
        assert_eq!(kept(None, &[]), vec![1, 2, 4, 5, 7, 8]);
        assert_eq!(kept(Some(0), &[]), Vec::<usize>::new());
        // The prompt's last token at 29 floors to 24: blocks 4 and 5.
        assert_eq!(kept(Some(0), &[29]), vec![4, 5]);
        // An interval of 24 tokens: the 2 blocks before 24 (and 48), and those before 17 floored to 12.
        assert_eq!(kept(Some(24), &[17]), vec![1, 2, 4, 5]);
        // A window that covers a segment keeps every block.
        assert_eq!((0..9).filter(|&i| window_kept(i, 4, 12, 13, false, None, &[])).count(), 9);
        // With the trailing-block drop a hit needs 3 blocks, the last one past the boundary: a segment's 3 blocks
        // are all kept densely; under retention the runs end one block past 24 and past 12.
        let eagle = |retention, reach: &[u32]| {
            (0..9).filter(|&i| window_kept(i, 4, 12, 6, true, retention, reach)).collect::<Vec<_>>()
        };
        assert_eq!(eagle(None, &[]), (0..9).collect::<Vec<_>>());
        assert_eq!(eagle(Some(0), &[29]), vec![4, 5, 6]);
        // Under the drop the resend and the longer sibling of a 30-token prompt resume at 12 (24 less one
        // scheduler block of 12), a junction at 20 also one block of the group's (4) lower.
        assert_eq!(window_reachable_at(30, 20, 12, 4, true, true), vec![12, 12, 20, 16]);
        assert_eq!(window_reachable_at(30, 20, 12, 4, false, true), vec![29, 20]);
        assert_eq!(eagle(Some(24), &[17]), vec![1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn sparse_window_retention_keeps_the_runs_a_hit_needs() {
        // Blocks of 4 tokens, a window of 9 tokens: a hit at a boundary needs the 2 blocks before it (3 and a
        // run one block further with EAGLE's drop).
        let kept = |r: u32, eagle: bool, reach: &[u32]| {
            (0..10).filter(|&i| window_retained(i, 4, 9, eagle, r, reach)).collect::<Vec<_>>()
        };
        // A 14-token prompt: a resend resumes at 13 tokens, floored to 12: blocks 1 and 2.
        assert_eq!(window_reachable(14, 0, 4, false, true), vec![13]);
        assert_eq!(kept(0, false, &[13]), vec![1, 2]);
        assert_eq!(kept(0, false, &[]), Vec::<usize>::new());
        // Segments of 3 blocks: the last 2 of each, plus the reachable run.
        assert_eq!(kept(12, false, &[]), vec![1, 2, 4, 5, 7, 8]);
        assert_eq!(kept(12, false, &[13, 28]), vec![1, 2, 4, 5, 6, 7, 8]);
        // A segment no longer than the run a hit needs keeps every block.
        assert_eq!(kept(8, false, &[]), (0..10).collect::<Vec<_>>());
        // EAGLE: a resend and a longer sibling of a 14-token prompt both hit at 8 tokens, their run of 3 blocks
        // ending one block past it; the junction too, and one block below it.
        assert_eq!(window_reachable(14, 0, 4, true, true), vec![8, 8]);
        assert_eq!(window_reachable(16, 24, 4, true, true), vec![8, 12, 24, 20]);
        // vLLM 0.32, and a Mamba group that does not take the drop's rules: at the junction only.
        assert_eq!(window_reachable(16, 24, 4, true, false), vec![8, 12, 24]);
        assert_eq!(kept(0, true, &[8, 8]), vec![0, 1, 2]);
        assert_eq!(kept(16, true, &[]), vec![2, 3, 4, 6, 7, 8]);
        // A window of one token needs no block: only EAGLE's extra one.
        assert!((0..10).all(|i| !window_retained(i, 4, 1, false, 0, &[13])));
        assert_eq!(
            (0..10).filter(|&i| window_retained(i, 4, 1, true, 0, &[13])).collect::<Vec<_>>(),
            vec![3]
        );
    }

    #[test]
    fn checkpoint_is_the_last_boundary_that_leaves_tokens_to_compute() {
        assert_eq!(mamba_checkpoint(10, 4, false, 0), 8);
        assert_eq!(mamba_checkpoint(8, 4, false, 0), 4); // one token left to compute
        assert_eq!(mamba_checkpoint(11, 4, false, 3), 8);
        assert_eq!(mamba_checkpoint(11, 4, false, 4), 4);
        assert_eq!(mamba_checkpoint(12, 4, true, 0), 8); // EAGLE's drop: one block lower
        assert_eq!(mamba_checkpoint(3, 4, true, 0), 0);
        assert_eq!(mamba_checkpoint(0, 4, false, 0), 0);
    }

    #[test]
    fn chunks_end_at_block_boundaries_and_the_last_checkpoint() {
        let s = AlignedSplit {
            bs: 4,
            max_prefill_tokens: 64,
            drop_eagle: false,
            hash_lookahead: 0,
            checkpoint_align: 0,
            unit: 0,
        };
        assert_eq!(s.split(10, 10, 0, 10, 0), 8); // the last boundary that leaves a token
        assert_eq!(s.split(10, 10, 8, 2, 0), 2);
        assert_eq!(s.split(17, 17, 0, 10, 0), 8); // floored
        assert_eq!(s.split(17, 17, 0, 3, 0), 0); // floored to nothing
        assert_eq!(s.split(6, 8, 0, 8, 0), 4); // resumed: the prefill ends at 7 (outputs replayed)
        assert_eq!(s.split(6, 8, 7, 1, 0), 1); // a decode is kept
                                               // A block wider than the longest chunk keeps an unaligned end, then stops at its block's end.
        let wide = AlignedSplit {
            bs: 8,
            max_prefill_tokens: 6,
            drop_eagle: false,
            hash_lookahead: 0,
            checkpoint_align: 0,
            unit: 0,
        };
        assert_eq!(wide.split(20, 20, 0, 6, 0), 6);
        assert_eq!(wide.split(20, 20, 6, 14, 0), 2);
        assert_eq!(wide.split(20, 20, 6, 5, 0), 2);
        // A shared-prefix junction stops the chunk at its block-floored position.
        assert_eq!(s.split(40, 40, 8, 24, 20), 12); // floored from the chunk's start: 8 + 12
        assert_eq!(s.split(40, 40, 8, 24, 24), 16);
        assert_eq!(s.split(40, 40, 8, 24, 10), 24); // floored to the start: no stop
        assert_eq!(s.split(40, 40, 8, 16, 24), 16); // at the chunk's end: not inside it
        assert_eq!(s.split(40, 40, 8, 24, 40), 24);
    }

    #[test]
    fn prefill_checkpoints_let_the_last_chunk_run_to_the_prefill_end() {
        let with = |align| AlignedSplit {
            bs: 4,
            max_prefill_tokens: 64,
            drop_eagle: false,
            hash_lookahead: 0,
            checkpoint_align: align,
            unit: 0,
        };
        // Without checkpoints the chunk stops at the last boundary that leaves a token (8); with them the state
        // there is exported from inside the chunk when it lies a multiple of the alignment from the start.
        assert_eq!(with(0).split(10, 10, 0, 10, 0), 8);
        assert_eq!(with(4).split(10, 10, 0, 10, 0), 10);
        assert_eq!(with(8).split(10, 10, 0, 10, 0), 10);
        assert_eq!(with(3).split(10, 10, 0, 10, 0), 8);
        assert_eq!(with(4).split(10, 10, 4, 6, 0), 6);
        assert_eq!(with(8).split(10, 10, 4, 6, 0), 4);
        // A chunk that does not reach the prefill's end is floored as before.
        assert_eq!(with(4).split(20, 20, 0, 10, 0), 8);
        // A chunk starting inside a block, or whose checkpoint is less than a block past its start: no export.
        assert_eq!(with(4).split(10, 10, 2, 8, 0), 2);
        assert_eq!(with(4).split(6, 6, 4, 2, 0), 2);
        assert_eq!(with(4).split(9, 9, 4, 5, 0), 5); // a block past its start: exported
                                                     // The shared-prefix junction still stops it.
        assert_eq!(with(4).split(40, 40, 8, 32, 20), 12);
    }

    /// With prefix hits inside a block (values from vLLM's `_mamba_block_aligned_split`, as the reference's
    /// split test against it draws them): the prompt's last unit boundary past the last block boundary is a stop,
    /// and the prefill's checkpoint is a unit boundary.
    #[test]
    fn chunks_stop_at_the_prompts_last_unit_boundary() {
        let with = |bs, unit, drop_eagle, hash_lookahead, checkpoint_align| AlignedSplit {
            bs,
            max_prefill_tokens: 64,
            drop_eagle,
            hash_lookahead,
            checkpoint_align,
            unit,
        };
        let s = with(8, 2, false, 0, 0);
        assert_eq!(s.split(21, 21, 0, 21, 0), 16); // the last block boundary first
        assert_eq!(s.split(21, 21, 16, 5, 0), 4); // then the prompt's last unit boundary (20)
        assert_eq!(with(8, 0, false, 0, 0).split(21, 21, 16, 5, 0), 5); // hits on whole blocks: none
        assert_eq!(s.split(21, 21, 20, 1, 0), 1);
        assert_eq!(s.split(21, 21, 0, 12, 0), 8);
        assert_eq!(s.split(22, 25, 16, 8, 0), 8); // the unit boundary (20) below the last block boundary (24)
        assert_eq!(with(8, 4, false, 0, 0).split(16, 16, 8, 8, 0), 4);
        // EAGLE's drop: one unit lower (18); look-ahead hashes leave their tokens.
        assert_eq!(with(8, 2, true, 0, 0).split(21, 21, 8, 13, 0), 10);
        assert_eq!(with(8, 2, false, 3, 0).split(21, 21, 16, 5, 0), 2);
        // Prefill checkpoints: a chunk starting on a unit boundary inside a block exports the checkpoint at 8.
        assert_eq!(with(4, 2, false, 0, 2).split(10, 10, 2, 8, 0), 8);
        assert_eq!(with(4, 0, false, 0, 2).split(10, 10, 2, 8, 0), 2);
    }

    #[test]
    fn a_checkpoint_is_valid_inside_a_block_aligned_chunk() {
        assert!(checkpoint_valid(0, 10, 8, 4, 4));
        assert!(!checkpoint_valid(0, 10, 8, 4, 0)); // no checkpoints
        assert!(!checkpoint_valid(0, 8, 8, 4, 4)); // at the chunk's end: not inside it
        assert!(!checkpoint_valid(4, 10, 4, 4, 4)); // at its start
        assert!(!checkpoint_valid(2, 10, 8, 4, 2)); // a chunk starting inside a block
        assert!(checkpoint_valid(4, 13, 8, 4, 4));
        assert!(!checkpoint_valid(4, 13, 8, 4, 8)); // 4 tokens from the start: not a multiple of 8
    }
}
