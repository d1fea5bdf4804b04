//! The KV block pool: ref counts, the free queue, and the prefix-cache map.
//!
//! Invariants (checked by `check`):
//! - block 0 is the null block: never free, never allocated, never hashed;
//! - a usable block is in the free queue iff its reference count is 0;
//! - `cached` maps a hash to the blocks carrying exactly that hash, in insertion order, and every block with a
//!   hash is in the map once. A free block keeps its hash (it can still be hit) until it is popped for reuse.
//!
//! The map's primary table (`CacheTable`) stores block ids with a 32-bit tag (8 bytes a slot; the key of an
//! entry `b` is `hash[b]`), not (hash, block) pairs (36 bytes), so it stays small, and the slot of a key has a
//! known address: the hundreds of inserts and evictions of a block-boundary step (every request of a decode
//! batch fills a block in the same step) prefetch it a few requests ahead instead of each missing in turn.
//! Hashes are stored 32-byte aligned (one cache line each); whether a block has one is a bit of its word in
//! `meta`, beside its reference count.
//!
//! With KV cache events on (`events`), every block leaving the map (evicted for reuse, or `uncache`d) and every
//! reset is recorded; the caller records the blocks it enters (`KvCacheManager`, which knows their request).
//! With several KV cache groups the caller also files each block it enters under its group (`set_event_group`):
//! a removed event names the group and the block's own hash, not the group's cache key, and a block pin's host
//! reads both (`block_group`). Off, the only cost is one branch per eviction.
//!
//! Second keys (`add_second_key`, events on only): with KV cache groups of different block sizes a cached block of
//! a full-attention group may also carry the key of a prompt's tail that ends inside it (vLLM's partial prefix-cache
//! entry). No lookup can find it (a group looks up the keys of its own block ends only), so it is kept apart from
//! the map, for its events only: it leaves the cache with its block, its removed event right after the block's.
//! With a prefix-match unit finer than the block, a block can also be found under keys other than its hash:
//! a prefix ending inside it (`cache_partial_block`, vLLM's partial entries). Those extra keys live apart
//! (`PartialKeys`, created by the first partial entry): a lookup of a key returns, of the blocks filed under
//! it as their hash or as an extra key, the one filed first; evicting or re-keying a block drops all its keys.
//! Until a partial entry is made, the cost is one branch per lookup, insertion and eviction.

use std::collections::HashMap;

use crate::cache_table::CacheTable;
use crate::events::KvCacheEvents;
use crate::free_queue::FreeBlockQueue;
use crate::hashing::{BlockHash, PrehashedBuild};
use crate::hybrid::group_key;

pub const NULL_BLOCK: u32 = 0;

/// A block's hash slot, 32-byte aligned so that reading or writing it touches one cache line (an
/// `Option<BlockHash>` is 33 bytes: half of them straddled two lines). Whether the slot holds a hash is kept
/// apart, in the block's word in `BlockPool::meta` (`HASHED`).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct HashSlot(BlockHash);

const EMPTY_SLOT: HashSlot = HashSlot(BlockHash([0; 32]));

/// A hint that `p`'s cache line will be read soon (no effect on results; a no-op off x86_64).
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults, whatever the address, and changes no program state.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Where a block hash lands in the cache table: its first 8 bytes (block hashes are uniform already).
#[inline]
fn table_hash(hash: &BlockHash) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&hash.0[..8]);
    u64::from_le_bytes(b)
}

/// The keys blocks carry besides their hash (a prefix match unit finer than the block): see the module notes.
#[derive(Debug, Clone, Default)]
struct PartialKeys {
    /// Per key, the blocks filed under it as an extra key, in insertion order, each with its insertion number.
    extra: HashMap<BlockHash, Vec<(u64, u32)>, PrehashedBuild>,
    /// Per block, its extra keys.
    of_block: HashMap<u32, Vec<BlockHash>>,
    /// The tokens a block's hash stands for when the hash is a partial entry (absent: a full block's hash,
    /// which no partial entry of the same block outgrows).
    tokens: HashMap<u32, u32>,
    /// Per block, the insertion number of its hash (0: entered before the first partial entry).
    seq: Vec<u64>,
    /// The next insertion number (from 1).
    next: u64,
}

impl PartialKeys {
    fn new(num_blocks: usize) -> Self {
        PartialKeys { seq: vec![0; num_blocks], next: 1, ..Default::default() }
    }

    /// Takes block `b`'s extra keys and partial-entry length out.
    fn drop_block(&mut self, b: u32) {
        self.tokens.remove(&b);
        let Some(keys) = self.of_block.remove(&b) else { return };
        for k in keys {
            if let Some(v) = self.extra.get_mut(&k) {
                v.retain(|e| e.1 != b);
                if v.is_empty() {
                    self.extra.remove(&k);
                }
            }
        }
    }
}

/// `BlockPool::meta`'s flag bit: the block carries a hash. The other 31 bits are its reference count.
const HASHED: u32 = 1 << 31;

#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Per block: its reference count, with the `HASHED` bit set while it carries a hash. One array, so that
    /// freeing or allocating a block (both read the two) touches one line of it, not one in each of two.
    meta: Vec<u32>,
    /// `hash[b]` is block `b`'s hash while `meta[b]` has `HASHED` (stale bytes otherwise).
    hash: Vec<HashSlot>,
    free: FreeBlockQueue,
    /// The first block cached under each hash (what a lookup returns), as block ids keyed by `hash[b]`.
    cached: CacheTable,
    /// Later blocks with the same hash, in insertion order (rare: no allocation on the common path).
    duplicates: HashMap<BlockHash, Vec<u32>, PrehashedBuild>,
    /// `free_blocks`' list of the unhashed blocks it frees, kept across calls (empty between them).
    unhashed_buf: Vec<u32>,
    /// Cache entries taken out so far (evictions, `uncache`, resets): while it stays the same, no prefix hit
    /// can have shrunk (the `sjf` order re-probes a request only when it moved).
    num_removed: u64,
    /// The KV cache events not yet taken; `None` when they are off.
    events: Option<Box<KvCacheEvents>>,
    /// With events on or several KV cache groups (`with_block_groups`): per block, the group whose key it was
    /// last cached under (empty otherwise: group 0).
    event_groups: Vec<u8>,
    /// Whether `set_event_group` files blocks without events too (several KV cache groups).
    track_groups: bool,
    /// With events on: the second keys each block carries (with their group), in the order they were added.
    second_keys: HashMap<u32, Vec<(BlockHash, u8)>>,
    /// How many blocks carry each second key.
    second_copies: HashMap<BlockHash, u32, PrehashedBuild>,
    /// Keys finer than the block; `None` until the first partial entry (and after a reset).
    partial: Option<Box<PartialKeys>>,
    /// Whether an eviction takes the general path: some hash is carried by several blocks (`duplicates`) or
    /// blocks carry extra keys (`partial`). Kept up to date by the few places that change either, so that the
    /// common eviction reads one flag.
    slow_evict: bool,
}

impl BlockPool {
    pub fn new(num_blocks: u32, enable_caching: bool) -> Self {
        let n = num_blocks as usize;
        BlockPool {
            meta: vec![0; n],
            hash: vec![EMPTY_SLOT; n],
            free: FreeBlockQueue::new(n, 1..num_blocks),
            // Sized up front (every block can be cached at once): no rehash spike in the middle of a step.
            cached: CacheTable::with_capacity(if enable_caching { n.min(1 << 20) } else { 0 }),
            duplicates: HashMap::default(),
            unhashed_buf: Vec::new(),
            num_removed: 0,
            events: None,
            event_groups: Vec::new(),
            track_groups: false,
            second_keys: HashMap::new(),
            second_copies: HashMap::default(),
            partial: None,
            slow_evict: false,
        }
    }

    /// The pool filing each block it caches under its KV cache group whether events are on or not (`on`: several
    /// groups), so that `block_group` answers for every cached block.
    pub fn with_block_groups(mut self, on: bool) -> Self {
        self.track_groups = on;
        self
    }

    /// The pool with KV cache events recorded (`enable_kv_cache_events`) or not.
    pub fn with_kv_cache_events(mut self, on: bool) -> Self {
        self.events = on.then(Box::default);
        self
    }

    /// Files `block`, just cached under group `g`'s key, under that group (for its removed event with events on,
    /// and for `block_group` with several groups).
    #[cold]
    pub fn set_event_group(&mut self, block: u32, g: usize) {
        if self.events.is_none() && !self.track_groups {
            return;
        }
        if self.event_groups.is_empty() {
            self.event_groups = vec![0; self.meta.len()];
        }
        self.event_groups[block as usize] = g as u8;
    }

    /// The KV cache group whose key `block` was last cached under (0 unless groups are filed: one group, or
    /// neither events nor `with_block_groups`). Meaningful while the block carries a hash.
    pub fn block_group(&self, block: u32) -> usize {
        self.event_groups.get(block as usize).map_or(0, |&g| g as usize)
    }

    /// The events recorded and not taken yet, if events are on (for the caller's stored events).
    #[inline(always)]
    pub fn events_mut(&mut self) -> Option<&mut KvCacheEvents> {
        self.events.as_deref_mut()
    }

    /// Takes the events recorded so far (none when events are off).
    pub fn take_events(&mut self) -> KvCacheEvents {
        self.events.as_deref_mut().map(KvCacheEvents::take).unwrap_or_default()
    }

    /// How many blocks carry `hash` in the prefix cache (as their key or as a second key).
    pub fn num_copies(&self, hash: &BlockHash) -> u32 {
        let first = u32::from(self.get_cached_block(hash).is_some());
        let second = if self.second_copies.is_empty() {
            0
        } else {
            self.second_copies.get(hash).copied().unwrap_or(0)
        };
        first + self.duplicates.get(hash).map_or(0, |v| v.len() as u32) + second
    }

    /// Files `key` (group `g`'s) as a key of `block`: a block that carries no key takes it as its key (it is then
    /// cached: it goes back to the pool's tail when freed); with events on, a block that carries another key takes
    /// it as a second key (see the module docs). Returns whether the block did not carry it already (false:
    /// nothing changed; also for the null block, and for a block with a key with events off).
    #[cold]
    pub fn add_second_key(&mut self, block: u32, key: BlockHash, g: usize) -> bool {
        let b = block as usize;
        if block == NULL_BLOCK || b >= self.meta.len() {
            return false;
        }
        match self.hash_of(b) {
            None => {
                self.cache_block(block, key);
                self.set_event_group(block, g);
                return true;
            }
            Some(h) if *h == key => return false,
            Some(_) if self.events.is_none() => return false,
            Some(_) => {}
        }
        let keys = self.second_keys.entry(block).or_default();
        if keys.iter().any(|(k, _)| *k == key) {
            return false;
        }
        keys.push((key, g as u8));
        *self.second_copies.entry(key).or_insert(0) += 1;
        true
    }

    /// Takes the second keys of `block` out (it left the cache), recording each one's removed event.
    #[cold]
    fn remove_second_keys(&mut self, block: u32) {
        let Some(keys) = self.second_keys.remove(&block) else { return };
        for (key, g) in keys {
            match self.second_copies.get_mut(&key) {
                Some(c) if *c > 1 => *c -= 1,
                _ => {
                    self.second_copies.remove(&key);
                }
            }
            let n = self.num_copies(&key);
            if let Some(ev) = self.events.as_deref_mut() {
                ev.push_removed(group_key(&key, g as usize), n, u32::from(g));
            }
        }
    }

    /// Every block carrying a hash, with it, in block id order (O(num_blocks): tests and diagnostics).
    pub fn cached_blocks(&self) -> impl Iterator<Item = (u32, &BlockHash)> + '_ {
        (1..self.meta.len()).filter_map(|b| self.hash_of(b).map(|h| (b as u32, h)))
    }

    pub fn num_blocks(&self) -> u32 {
        self.meta.len() as u32
    }

    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn num_usable_blocks(&self) -> usize {
        self.meta.len() - 1
    }

    /// Share of usable blocks held by requests, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.num_usable_blocks() as f64
    }

    /// Cache entries taken out so far (see the field): unchanged means no prefix hit has shrunk.
    pub fn num_removed(&self) -> u64 {
        self.num_removed
    }

    pub fn ref_cnt(&self, block: u32) -> u32 {
        self.meta[block as usize] & !HASHED
    }

    /// Whether block `b` (in range) carries a hash.
    #[inline(always)]
    fn is_hashed(&self, b: usize) -> bool {
        self.meta[b] & HASHED != 0
    }

    pub fn block_hash(&self, block: u32) -> Option<&BlockHash> {
        self.hash_of(block as usize)
    }

    /// `block`'s hash if it has one (`b` in range).
    #[inline(always)]
    fn hash_of(&self, b: usize) -> Option<&BlockHash> {
        if self.is_hashed(b) {
            Some(&self.hash[b].0)
        } else {
            None
        }
    }

    /// Free blocks in eviction order, head first (O(n): tests and diagnostics).
    pub fn free_order(&self) -> Vec<u32> {
        self.free.iter().collect()
    }

    pub fn is_free(&self, block: u32) -> bool {
        self.free.contains(block)
    }

    /// The first block carrying `hash` as its hash, if any: the whole-block lookup. Extra keys (a prefix match
    /// unit finer than the block, see the module notes) are not looked at; `get_cached_key` does.
    pub fn get_cached_block(&self, hash: &BlockHash) -> Option<u32> {
        // Every block in the table is hashed: compare the slot directly.
        let hashes = &self.hash;
        self.cached.find(table_hash(hash), |b| hashes[b as usize].0 == *hash)
    }

    /// The first block filed under `key`, as its hash or as an extra key (vLLM's lookup with partial entries).
    pub fn get_cached_key(&self, key: &BlockHash) -> Option<u32> {
        let first = self.get_cached_block(key);
        match self.partial.as_deref() {
            None => first,
            Some(p) => Self::first_with_extra(p, key, first),
        }
    }

    /// Of `first` (the first block whose hash is `hash`) and the first block carrying `hash` as an extra key,
    /// the one filed first.
    #[cold]
    fn first_with_extra(p: &PartialKeys, hash: &BlockHash, first: Option<u32>) -> Option<u32> {
        let Some(&(s, b)) = p.extra.get(hash).and_then(|v| v.first()) else { return first };
        match first {
            Some(a) if p.seq[a as usize] < s => Some(a),
            _ => Some(b),
        }
    }

    /// Whether `block` is filed under `key` (as its hash or as an extra key).
    pub fn has_key(&self, block: u32, key: &BlockHash) -> bool {
        if self.hash_of(block as usize) == Some(key) {
            return true;
        }
        self.partial.as_deref().and_then(|p| p.of_block.get(&block)).is_some_and(|keys| keys.contains(key))
    }

    /// The tokens block `block`'s hash stands for when it is a partial entry (`cache_partial_block`); `None` for a
    /// full block's hash or none.
    pub fn partial_tokens(&self, block: u32) -> Option<u32> {
        self.partial.as_deref().and_then(|p| p.tokens.get(&block).copied())
    }

    /// Block `block`'s extra keys (none without partial entries), in insertion order.
    pub fn extra_keys(&self, block: u32) -> &[BlockHash] {
        self.partial.as_deref().and_then(|p| p.of_block.get(&block)).map_or(&[], Vec::as_slice)
    }

    /// Files block `block` under `key`, a prefix of `num_tokens` tokens ending inside it or at its end (vLLM's
    /// `cache_partial_block`): as its hash if it has none, else as an extra key. A block whose hash is a shorter
    /// partial entry, or every block with `replace` (its contents were rewritten), loses all its keys first.
    /// The null block is never filed (returns false).
    pub fn cache_partial_block(
        &mut self,
        block: u32,
        key: BlockHash,
        num_tokens: u32,
        replace: bool,
    ) -> bool {
        if block == NULL_BLOCK {
            return false;
        }
        let b = block as usize;
        let already = self.has_key(block, &key);
        if self.is_hashed(b) {
            let shorter = !already
                && self
                    .partial
                    .as_deref()
                    .and_then(|p| p.tokens.get(&block))
                    .is_some_and(|&t| t < num_tokens);
            if replace || shorter {
                self.evict_hashed(block);
            }
        }
        self.insert_key(block, key, Some(num_tokens));
        true
    }

    /// Files `block` under `key` unless it is already: as its hash (a partial entry of `tokens` tokens, or a full
    /// block's hash with `None`) if it has none, else as an extra key.
    fn insert_key(&mut self, block: u32, key: BlockHash, tokens: Option<u32>) {
        if self.has_key(block, &key) {
            return;
        }
        let n = self.meta.len();
        let hashed = self.is_hashed(block as usize);
        self.slow_evict = true;
        let p = self.partial.get_or_insert_with(|| Box::new(PartialKeys::new(n)));
        if hashed {
            let s = p.next;
            p.next += 1;
            p.extra.entry(key).or_default().push((s, block));
            p.of_block.entry(block).or_default().push(key);
            return;
        }
        if let Some(t) = tokens {
            p.tokens.insert(block, t);
        }
        self.cache_block_rekey(block, key);
    }

    /// Re-files every key of `src` under `dst` (a block with none), quietly (vLLM's `move_block_hashes`): the
    /// request holding `src` keeps writing into it while the prefix cache keeps `dst`, a copy.
    pub fn move_block_hashes(&mut self, src: u32, dst: u32) {
        debug_assert!(!self.is_hashed(dst as usize) && self.extra_keys(dst).is_empty());
        let Some(&primary) = self.hash_of(src as usize) else { return };
        let tokens = self.partial.as_deref().and_then(|p| p.tokens.get(&src).copied());
        let extras = self.extra_keys(src).to_vec();
        let g = self.block_group(src);
        self.evict_hashed_quietly(src);
        if self.events.is_some() || self.track_groups {
            self.set_event_group(dst, g);
        }
        self.insert_key(dst, primary, tokens);
        for k in extras {
            self.insert_key(dst, k, None);
        }
    }

    /// A hint, no effect on results: starts fetching the cache-table slot where `hash` is looked up, inserted
    /// or evicted.
    #[inline(always)]
    pub fn prefetch_cache_slot(&self, hash: &BlockHash) {
        prefetch(self.cached.slot_addr(table_hash(hash)));
    }

    /// Starts fetching the hash slot and packed word of `block` (both written when it is cached).
    #[inline(always)]
    pub fn prefetch_block(&self, block: u32) {
        prefetch(self.hash.as_ptr().wrapping_add(block as usize).cast());
        prefetch(self.meta.as_ptr().wrapping_add(block as usize).cast());
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cached hashes. The caller has checked
    /// that `n <= num_free_blocks()`.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<u32>) {
        if n > 1 {
            self.allocate_run_into(n, out);
            return;
        }
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                debug_assert!(false, "allocate_into called without enough free blocks");
                return;
            };
            // The next allocations (often the next requests', in a step where every request takes a block) pop
            // the new head and the block after it, evicting their hashes: start fetching their lines while this
            // block is handed out (the head's hash and link were prefetched by the previous pop).
            if let Some(h) = self.free.front() {
                if self.is_hashed(h as usize) {
                    self.prefetch_cache_slot(&self.hash[h as usize].0);
                }
                if let Some(n) = self.free.next_of(h) {
                    if self.is_hashed(n as usize) {
                        prefetch((&self.hash[n as usize] as *const HashSlot).cast());
                    }
                    if let Some(p) = self.free.next_of(n).and_then(|nn| self.free.link_addr(nn)) {
                        prefetch(p);
                    }
                }
            }
            self.evict(b);
            self.meta[b as usize] = 1;
            out.push(b);
        }
    }

    /// `allocate_into` for several blocks (a prefill chunk): the queue hands out its first `n` blocks in one walk,
    /// the cache-table slots of those that carry a hash are fetched while the rest are marked in use, and then
    /// their hashes are evicted in allocation order (the same blocks, order and evictions as `n` single pops).
    fn allocate_run_into(&mut self, n: usize, out: &mut Vec<u32>) {
        let start = out.len();
        let got = self.free.pop_front_n(n, out);
        debug_assert_eq!(got, n, "allocate_into called without enough free blocks");
        let run = &out[start..];
        let mut any_hashed = false;
        for &b in run {
            // A count of 1, the hash flag kept until `evict` takes the hash out below.
            let m = &mut self.meta[b as usize];
            *m = (*m & HASHED) | 1;
            if *m & HASHED != 0 {
                any_hashed = true;
                self.prefetch_cache_slot(&self.hash[b as usize].0);
            }
        }
        if any_hashed {
            for &b in run {
                self.evict(b);
            }
        }
    }

    /// Takes `block`'s hash (if any) out of the prefix cache; the common case, a block that carries none, is
    /// one inlined check.
    #[inline(always)]
    fn evict(&mut self, block: u32) {
        if self.is_hashed(block as usize) {
            self.evict_hashed(block);
        }
    }

    fn evict_hashed(&mut self, block: u32) {
        self.evict_hashed_quietly(block);
        if self.events.is_some() {
            let key = self.hash[block as usize].0;
            let n = self.num_copies(&key);
            let g = self.event_groups.get(block as usize).map_or(0, |&g| g as usize);
            // A group's key of a hash is the hash with bytes flipped: the same flip gives the hash back.
            let h = group_key(&key, g);
            if let Some(ev) = self.events.as_deref_mut() {
                ev.push_removed(h, n, g as u32);
            }
            if !self.second_keys.is_empty() {
                self.remove_second_keys(block);
            }
        }
    }

    #[inline(always)]
    fn evict_hashed_quietly(&mut self, block: u32) {
        self.num_removed += 1;
        let i = block as usize;
        self.meta[i] &= !HASHED;
        let h = self.hash[i].0;
        // Found by block id, not by comparing hashes: one probe, and only the table is read.
        let key = table_hash(&h);
        // Without duplicate hashes or extra keys (the common case) the block is filed in the table: one probe
        // removes it.
        if !self.slow_evict {
            let removed = self.cached.remove(key, block);
            debug_assert!(removed, "hashed block {block} is not in the prefix-cache table");
            return;
        }
        self.evict_general(block, key, h);
    }

    /// `evict_hashed_quietly` with duplicate hashes or extra keys about.
    #[cold]
    #[inline(never)]
    fn evict_general(&mut self, block: u32, key: u64, h: BlockHash) {
        if let Some(p) = self.partial.as_deref_mut() {
            p.drop_block(block);
        }
        if self.cached.contains_block(key, block) {
            // `block` is what lookups return: promote the oldest duplicate, if any, so they keep returning
            // the earliest cached block.
            match self.duplicates.get_mut(&h) {
                Some(dups) if !dups.is_empty() => {
                    let next = dups.remove(0);
                    if dups.is_empty() {
                        self.duplicates.remove(&h);
                    }
                    self.cached.replace(key, block, next);
                }
                _ => {
                    self.cached.remove(key, block);
                }
            }
        } else if let Some(dups) = self.duplicates.get_mut(&h) {
            dups.retain(|&x| x != block);
            if dups.is_empty() {
                self.duplicates.remove(&h);
            }
        }
        self.refresh_slow_evict();
    }

    /// Recomputes `slow_evict` after a change to `duplicates` or `partial`.
    fn refresh_slow_evict(&mut self) {
        self.slow_evict = !self.duplicates.is_empty() || self.partial.is_some();
    }

    /// Takes `block` out of the prefix cache if it still carries `hash` (its KV was never computed:
    /// `Scheduler::fail_step`); a free block stays where it is in the free queue. Returns whether it did.
    pub fn uncache(&mut self, block: u32, hash: &BlockHash) -> bool {
        let b = block as usize;
        if b >= self.hash.len() || self.hash_of(b) != Some(hash) {
            return false;
        }
        self.evict(block);
        true
    }

    /// Takes `block` out of the prefix cache if it carries a hash (vLLM's `BlockPool.evict_blocks`); a free
    /// block stays where it is in the free queue. Returns whether it did.
    pub fn evict_cached(&mut self, block: u32) -> bool {
        let b = block as usize;
        if b >= self.hash.len() || !self.is_hashed(b) {
            return false;
        }
        self.evict_hashed(block);
        true
    }

    /// A prefix hit takes a reference; a block at ref 0 leaves the free queue (O(1)).
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let m = &mut self.meta[b as usize];
            if *m & !HASHED == 0 {
                self.free.remove(b);
            }
            *m += 1;
        }
    }

    /// Releases one request's blocks in reverse order: its deepest blocks become the first eviction candidates.
    /// Blocks reaching ref 0 go to the tail when hashed (LRU, deepest first), and as one group to the head when
    /// not (reused first, deepest first): vLLM 0.33's `free_blocks` + `prepend_n`. Null blocks (a sliding
    /// window's table) are skipped: their count stays 0.
    pub fn free_blocks(&mut self, blocks: &[u32]) {
        // The unhashed blocks that reach ref 0, deepest first (usually one: a request's last, partial block).
        let mut unhashed = std::mem::take(&mut self.unhashed_buf);
        for &b in blocks.iter().rev() {
            let m = &mut self.meta[b as usize];
            debug_assert!(b == NULL_BLOCK || *m & !HASHED > 0, "freeing block {b} with ref_cnt 0");
            if *m & !HASHED == 0 {
                continue; // freed more often than held: left as it is (`check` reports it)
            }
            *m -= 1;
            if *m == HASHED {
                self.free.push_back(b);
            } else if *m == 0 {
                unhashed.push(b);
            }
        }
        // Pushing them to the front in table order leaves the group at the head deepest block first.
        for &b in unhashed.iter().rev() {
            self.free.push_front(b);
        }
        unhashed.clear();
        self.unhashed_buf = unhashed;
    }

    /// Enters a full, allocated block carrying no hash into the prefix cache (only called with caching on).
    /// With blocks keyed finer than the block about, `cache_block_rekey` instead.
    #[inline]
    pub fn cache_block(&mut self, block: u32, hash: BlockHash) {
        if block == NULL_BLOCK {
            return;
        }
        debug_assert!(!self.is_hashed(block as usize) && self.partial.is_none());
        self.enter(block, hash);
    }

    /// `cache_block` where blocks may be keyed finer than the block (a prefix match unit below the block): a
    /// block already filed under a partial entry (its prompt tail) loses its keys first (vLLM's promotion of a
    /// partial entry to the full block's hash).
    pub fn cache_block_rekey(&mut self, block: u32, hash: BlockHash) {
        if block == NULL_BLOCK {
            return;
        }
        if self.is_hashed(block as usize) {
            self.evict_hashed(block);
        }
        if let Some(p) = self.partial.as_deref_mut() {
            p.seq[block as usize] = p.next;
            p.next += 1;
        }
        self.enter(block, hash);
    }

    /// Files `block` (carrying no hash) under `hash` in the table.
    #[inline(always)]
    fn enter(&mut self, block: u32, hash: BlockHash) {
        self.hash[block as usize] = HashSlot(hash);
        self.meta[block as usize] |= HASHED;
        let hashes = &self.hash;
        let key = table_hash(&hash);
        // `block` itself is not in the table yet, so a match is another block with the same hash (every block
        // in the table is hashed). `key_of` (for growth only: the table is sized for the pool) re-derives an
        // entry's key from its block.
        let found = self.cached.find_or_insert(
            key,
            block,
            |b| hashes[b as usize].0 == hash,
            |b| table_hash(&hashes[b as usize].0),
        );
        if found.is_some() {
            self.duplicates.entry(hash).or_default().push(block);
            self.slow_evict = true;
        }
    }

    /// `cache_block` for each of `blocks` with its hash in `hashes` (same length), in order. The table slot a
    /// few blocks ahead is fetched while this one is entered: a prefill chunk caches dozens of blocks whose
    /// slots are scattered over the table.
    pub fn cache_run(&mut self, blocks: &[u32], hashes: &[BlockHash]) {
        const AHEAD: usize = 4;
        debug_assert_eq!(blocks.len(), hashes.len());
        for h in hashes.iter().take(AHEAD) {
            self.prefetch_cache_slot(h);
        }
        for (i, (&b, h)) in blocks.iter().zip(hashes).enumerate() {
            if let Some(next) = hashes.get(i + AHEAD) {
                self.prefetch_cache_slot(next);
            }
            self.cache_block(b, *h);
        }
    }

    /// Drops every cached hash; only allowed when no usable block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() != self.num_usable_blocks() {
            return false;
        }
        self.cached.clear();
        self.duplicates.clear();
        self.second_keys.clear();
        self.second_copies.clear();
        self.partial = None;
        self.slow_evict = false;
        self.num_removed += 1;
        for m in &mut self.meta {
            *m &= !HASHED;
        }
        if let Some(ev) = self.events.as_deref_mut() {
            ev.push_cleared();
        }
        true
    }

    /// Checks the pool against `held`: the number of request block tables holding each block.
    #[allow(clippy::needless_range_loop)]
    pub fn check(&self, held: &[u32]) -> Result<(), String> {
        self.free.check()?;
        if self.meta[0] != 0 || self.free.contains(NULL_BLOCK) {
            return Err("the null block is in use, free or hashed".into());
        }
        for b in 1..self.meta.len() {
            let rc = self.meta[b] & !HASHED;
            if rc != held[b] {
                return Err(format!("block {b}: ref_cnt {rc} but {} request(s) hold it", held[b]));
            }
            if (rc == 0) != self.free.contains(b as u32) {
                return Err(format!("block {b}: ref_cnt {rc} but free={}", self.free.contains(b as u32)));
            }
            if let Some(h) = self.hash_of(b) {
                let primary = usize::from(self.cached.contains_block(table_hash(h), b as u32));
                let dups = self.duplicates.get(h).map_or(0, |v| v.iter().filter(|&&x| x == b as u32).count());
                if primary + dups != 1 {
                    return Err(format!(
                        "block {b} has a hash but is in the cache map {} times",
                        primary + dups
                    ));
                }
            }
        }
        let mapped = self.cached.len() + self.duplicates.values().map(Vec::len).sum::<usize>();
        let hashed = self.meta.iter().filter(|&&m| m & HASHED != 0).count();
        if mapped != hashed {
            return Err(format!("cache map holds {mapped} blocks but {hashed} blocks have a hash"));
        }
        self.cached.check()?;
        let mut seconds: HashMap<BlockHash, u32> = HashMap::new();
        for (&b, keys) in &self.second_keys {
            if keys.is_empty() || !self.is_hashed(b as usize) {
                return Err(format!("block {b} carries second keys but no key"));
            }
            for (k, _) in keys {
                *seconds.entry(*k).or_insert(0) += 1;
            }
        }
        if seconds.len() != self.second_copies.len()
            || seconds.iter().any(|(k, n)| self.second_copies.get(k) != Some(n))
        {
            return Err("second-key counts disagree with the blocks' second keys".into());
        }
        if let Some(ev) = &self.events {
            ev.check()?;
        }
        for b in self.cached.iter() {
            // Every entry carries a hash, and a lookup of that hash finds this entry (one entry per hash).
            let found = if (b as usize) < self.hash.len() {
                self.hash_of(b as usize).and_then(|h| self.get_cached_block(h))
            } else {
                None
            };
            if found != Some(b) {
                return Err(format!("cache map entry {b} disagrees with block hashes"));
            }
        }
        if self.slow_evict != (!self.duplicates.is_empty() || self.partial.is_some()) {
            return Err("slow_evict disagrees with the duplicates and extra keys".into());
        }
        if let Some(p) = self.partial.as_deref() {
            let mut filed = 0;
            for (k, v) in &p.extra {
                if v.is_empty() {
                    return Err("an extra key filed under no block".into());
                }
                for &(_, b) in v {
                    let ok = self.is_hashed(b as usize)
                        && self.hash_of(b as usize) != Some(k)
                        && p.of_block
                            .get(&b)
                            .is_some_and(|keys| keys.iter().filter(|&x| x == k).count() == 1);
                    if !ok {
                        return Err(format!("block {b}: extra key entry disagrees with the block's keys"));
                    }
                }
                filed += v.len();
            }
            if filed != p.of_block.values().map(Vec::len).sum::<usize>() {
                return Err("extra keys filed by key and by block disagree".into());
            }
            if p.tokens.keys().any(|&b| !self.is_hashed(b as usize)) {
                return Err("a partial entry's length kept for a block without a hash".into());
            }
        }
        for (h, v) in &self.duplicates {
            let bad = v.is_empty()
                || self.get_cached_block(h).is_none()
                || v.iter().any(|&b| self.hash_of(b as usize) != Some(h));
            if bad {
                return Err("duplicate cache entry disagrees with block hashes".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u8) -> BlockHash {
        let mut b = [0u8; 32];
        b[0] = x;
        b[9] = x;
        BlockHash(b)
    }

    #[test]
    fn unhashed_blocks_go_to_the_head_as_a_group_deepest_first() {
        let mut p = BlockPool::new(8, false);
        let mut a = Vec::new();
        p.allocate_into(3, &mut a);
        assert_eq!(a, vec![1, 2, 3]);
        p.free_blocks(&a);
        // vLLM 0.33 prepends the group in eviction order: the deepest block (3) is reused first.
        assert_eq!(p.free.iter().collect::<Vec<_>>(), vec![3, 2, 1, 4, 5, 6, 7]);
    }

    #[test]
    fn allocate_free_and_lru_order() {
        let mut p = BlockPool::new(6, true);
        let mut a = Vec::new();
        p.allocate_into(3, &mut a);
        assert_eq!(a, vec![1, 2, 3]);
        p.cache_block(1, h(1));
        p.cache_block(2, h(2));
        p.free_blocks(&a);
        // Reverse order: 3 (no hash) to the head, then 2, 1 (hashed) to the tail.
        assert_eq!(p.free.iter().collect::<Vec<_>>(), vec![3, 4, 5, 2, 1]);
        assert_eq!(p.get_cached_key(&h(2)), Some(2));
        let mut held = vec![0u32; 6];
        p.check(&held).unwrap();
        // A hit revives a free cached block.
        p.touch(&[2]);
        held[2] = 1;
        p.check(&held).unwrap();
        assert_eq!(p.num_free_blocks(), 4);
        // Popping a hashed block evicts it.
        let mut b = Vec::new();
        p.allocate_into(4, &mut b);
        assert_eq!(b, vec![3, 4, 5, 1]);
        assert_eq!(p.get_cached_key(&h(1)), None);
        for x in &b {
            held[*x as usize] = 1;
        }
        p.check(&held).unwrap();
        assert!(!p.reset_prefix_cache());
        p.free_blocks(&b);
        p.free_blocks(&[2]);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.get_cached_key(&h(2)), None);
        p.check(&[0; 6]).unwrap();
    }

    #[test]
    fn second_keys_leave_with_their_block_and_count_their_copies() {
        use crate::events::{REMOVED, STORED};
        let mut p = BlockPool::new(6, true).with_kv_cache_events(true);
        let mut a = Vec::new();
        p.allocate_into(3, &mut a);
        p.cache_block(1, h(1));
        p.cache_block(2, h(2));
        // Block 1 and 2 both take h(9) as a second key; block 3 (no key) takes it as its key.
        assert!(p.add_second_key(1, h(9), 0));
        assert!(!p.add_second_key(1, h(9), 0), "a block carries a second key once");
        assert!(!p.add_second_key(2, h(2), 0), "nor its own key");
        assert!(p.add_second_key(2, h(9), 0));
        assert!(p.add_second_key(3, h(9), 0));
        assert_eq!(p.num_copies(&h(9)), 3);
        assert_eq!(p.block_hash(3), Some(&h(9)));
        p.check(&[0, 1, 1, 1, 0, 0]).unwrap();
        p.free_blocks(&a);
        // Reusing the cached blocks: each one's key leaves, then its second key.
        p.take_events();
        let mut b = Vec::new();
        p.allocate_into(5, &mut b);
        let ev = p.take_events();
        assert_eq!(ev.kinds, vec![REMOVED; 5]);
        assert_eq!(ev.block_hashes, vec![h(9), h(2), h(9), h(1), h(9)]);
        assert_eq!(ev.num_copies, vec![2, 0, 1, 0, 0]);
        assert!(!ev.kinds.contains(&STORED));
        p.check(&[0, 1, 1, 1, 1, 1]).unwrap();
        // Off with events off.
        let mut q = BlockPool::new(4, true);
        q.allocate_into(1, &mut Vec::new());
        q.cache_block(1, h(1));
        assert!(!q.add_second_key(1, h(9), 0));
        assert_eq!(q.num_copies(&h(9)), 0);
    }

    #[test]
    fn duplicate_hashes_are_kept_in_order() {
        let mut p = BlockPool::new(4, true);
        let mut a = Vec::new();
        p.allocate_into(2, &mut a);
        p.cache_block(1, h(7));
        p.cache_block(2, h(7));
        assert_eq!(p.get_cached_key(&h(7)), Some(1));
        p.check(&[0, 1, 1, 0]).unwrap();
    }

    fn keys(p: &BlockPool, b: u32) -> (Option<BlockHash>, Vec<BlockHash>) {
        (p.block_hash(b).copied(), p.extra_keys(b).to_vec())
    }

    #[test]
    fn partial_entries_extra_keys_and_promotion() {
        let mut p = BlockPool::new(6, true);
        let mut a = Vec::new();
        p.allocate_into(4, &mut a);
        let held = [0, 1, 1, 1, 1, 0];
        // Block 1 is keyed at its prompt tail (a partial entry): the key becomes its hash.
        assert!(p.cache_partial_block(1, h(20), 20, false));
        assert!(!p.cache_partial_block(NULL_BLOCK, h(20), 20, false));
        assert_eq!(keys(&p, 1), (Some(h(20)), vec![]));
        assert_eq!(p.get_cached_key(&h(20)), Some(1));
        p.check(&held).unwrap();
        // Filling the block promotes it: the partial entry goes, the full hash comes.
        p.cache_block_rekey(1, h(24));
        assert_eq!(keys(&p, 1), (Some(h(24)), vec![]));
        assert_eq!(p.get_cached_key(&h(20)), None);
        // Keying the tail again files it as an extra key beside the full hash (the full one is longer).
        assert!(p.cache_partial_block(1, h(20), 20, false));
        assert_eq!(keys(&p, 1), (Some(h(24)), vec![h(20)]));
        assert!(p.has_key(1, &h(20)) && p.has_key(1, &h(24)) && !p.has_key(2, &h(20)));
        // Twice is once.
        p.cache_partial_block(1, h(20), 20, false);
        assert_eq!(keys(&p, 1), (Some(h(24)), vec![h(20)]));
        p.check(&held).unwrap();
        // Block 2 takes the same key as its hash after block 1's extra key: lookups keep the first filed.
        p.cache_partial_block(2, h(20), 20, false);
        assert_eq!(p.get_cached_key(&h(20)), Some(1));
        p.check(&held).unwrap();
        // Block 3's hash first, then block 4's extra key: block 3 is found; once it goes, block 4.
        p.cache_partial_block(3, h(12), 12, false);
        p.cache_block_rekey(4, h(16));
        p.cache_partial_block(4, h(12), 12, false);
        assert_eq!(p.get_cached_key(&h(12)), Some(3));
        p.cache_block_rekey(3, h(30));
        assert_eq!(p.get_cached_key(&h(12)), Some(4));
        p.check(&held).unwrap();
        // Freeing and reusing block 1 evicts every key it carries: block 2 is found under the tail key.
        p.free_blocks(&[1]);
        let mut b = Vec::new();
        p.allocate_into(2, &mut b);
        assert_eq!(b, vec![5, 1]);
        assert_eq!(keys(&p, 1), (None, vec![]));
        assert_eq!(p.get_cached_key(&h(24)), None);
        assert_eq!(p.get_cached_key(&h(20)), Some(2));
        p.check(&[0, 1, 1, 1, 1, 1]).unwrap();
    }

    #[test]
    fn a_longer_partial_entry_or_a_rewrite_replaces_the_keys() {
        let mut p = BlockPool::new(4, true);
        let mut a = Vec::new();
        p.allocate_into(2, &mut a);
        p.cache_partial_block(1, h(4), 4, false);
        // A longer prefix in the same block: the shorter entry goes.
        p.cache_partial_block(1, h(6), 6, false);
        assert_eq!(keys(&p, 1), (Some(h(6)), vec![]));
        assert_eq!(p.get_cached_key(&h(4)), None);
        // A shorter one beside a longer hash is an extra key.
        p.cache_partial_block(1, h(5), 5, false);
        assert_eq!(keys(&p, 1), (Some(h(6)), vec![h(5)]));
        // Rewritten contents: every key goes, even one already there.
        p.cache_partial_block(1, h(5), 5, true);
        assert_eq!(keys(&p, 1), (Some(h(5)), vec![]));
        assert_eq!(p.get_cached_key(&h(6)), None);
        p.check(&[0, 1, 1, 0]).unwrap();
        // The full hash of the block, entered as a partial entry of the block's length, is its hash.
        p.cache_block_rekey(2, h(8));
        p.cache_partial_block(2, h(8), 8, false);
        assert_eq!(keys(&p, 2), (Some(h(8)), vec![]));
        assert!(p.reset_prefix_cache() || p.num_free_blocks() < 3);
    }

    #[test]
    fn moving_keys_keeps_them_live_on_the_copy() {
        let mut p = BlockPool::new(6, true);
        let mut a = Vec::new();
        p.allocate_into(4, &mut a);
        p.cache_block_rekey(1, h(16));
        p.cache_partial_block(1, h(12), 12, false);
        p.cache_partial_block(2, h(12), 12, false);
        let removed = p.num_removed();
        p.move_block_hashes(1, 3);
        assert_eq!(keys(&p, 1), (None, vec![]));
        assert_eq!(keys(&p, 3), (Some(h(16)), vec![h(12)]));
        assert_eq!(p.get_cached_key(&h(16)), Some(3));
        // Moved keys are filed anew: block 2's entry is now the first under the tail key.
        assert_eq!(p.get_cached_key(&h(12)), Some(2));
        assert!(p.num_removed() > removed);
        p.check(&[0, 1, 1, 1, 1, 0]).unwrap();
        // A partial hash moves with its length: a longer entry on the copy still replaces it.
        p.cache_partial_block(2, h(14), 14, false);
        assert_eq!(keys(&p, 2), (Some(h(14)), vec![]));
        p.move_block_hashes(2, 4);
        p.cache_partial_block(4, h(15), 15, false);
        assert_eq!(keys(&p, 4), (Some(h(15)), vec![]));
        p.check(&[0, 1, 1, 1, 1, 0]).unwrap();
        p.free_blocks(&[1, 2, 3, 4]);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.get_cached_key(&h(15)), None);
        assert_eq!(p.extra_keys(3), &[] as &[BlockHash]);
        p.check(&[0; 6]).unwrap();
    }

    /// vLLM's pool, written plainly: per key, its blocks in insertion order (whether the key is a block's hash
    /// or an extra key); per block, its hash (with the tokens of a partial entry) and its extra keys.
    #[derive(Default)]
    struct Model {
        keys: Vec<(BlockHash, Vec<u32>)>,
        primary: HashMap<u32, (BlockHash, Option<u32>)>,
        extras: HashMap<u32, Vec<BlockHash>>,
    }

    impl Model {
        fn first(&self, k: &BlockHash) -> Option<u32> {
            self.keys.iter().find(|(x, _)| x == k).and_then(|(_, v)| v.first().copied())
        }
        fn file(&mut self, k: BlockHash, b: u32) {
            match self.keys.iter_mut().find(|(x, _)| *x == k) {
                Some((_, v)) => v.push(b),
                None => self.keys.push((k, vec![b])),
            }
        }
        fn drop_all(&mut self, b: u32) {
            let mut ks: Vec<BlockHash> = self.primary.remove(&b).map(|p| p.0).into_iter().collect();
            ks.extend(self.extras.remove(&b).unwrap_or_default());
            for k in ks {
                if let Some(i) = self.keys.iter().position(|(x, _)| *x == k) {
                    self.keys[i].1.retain(|&x| x != b);
                    if self.keys[i].1.is_empty() {
                        self.keys.remove(i);
                    }
                }
            }
        }
        fn has(&self, b: u32, k: &BlockHash) -> bool {
            self.primary.get(&b).is_some_and(|p| p.0 == *k)
                || self.extras.get(&b).is_some_and(|v| v.contains(k))
        }
        fn insert(&mut self, b: u32, k: BlockHash, tokens: Option<u32>) {
            if self.has(b, &k) {
                return;
            }
            match self.primary.entry(b) {
                std::collections::hash_map::Entry::Occupied(_) => self.extras.entry(b).or_default().push(k),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert((k, tokens));
                }
            }
            self.file(k, b);
        }
        fn cache_full(&mut self, b: u32, k: BlockHash) {
            self.drop_all(b);
            self.insert(b, k, None);
        }
        fn cache_partial(&mut self, b: u32, k: BlockHash, t: u32, replace: bool) {
            let already = self.has(b, &k);
            let shorter = !already && self.primary.get(&b).and_then(|p| p.1).is_some_and(|x| x < t);
            if replace || shorter {
                self.drop_all(b);
            }
            self.insert(b, k, Some(t));
        }
        fn move_keys(&mut self, src: u32, dst: u32) {
            let Some((k, t)) = self.primary.get(&src).copied() else { return };
            let extras = self.extras.get(&src).cloned().unwrap_or_default();
            self.drop_all(src);
            self.insert(dst, k, t);
            for e in extras {
                self.insert(dst, e, None);
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        Free(usize),
        Full(usize, u8),
        Partial(usize, u8, bool),
        Move(usize, usize),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
            3 => (any::<usize>(), 0u8..4).prop_map(|(i, k)| Op::Full(i, k)),
            4 => (any::<usize>(), 1u8..8, proptest::bool::weighted(0.15)).prop_map(|(i, k, r)| Op::Partial(i, k, r)),
            2 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Op::Move(a, b)),
            1 => Just(Op::Reset),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Random partial entries, full hashes, moves, evictions and resets: every lookup and every block's keys
        /// agree with the plain model after each operation, and the pool's own check holds.
        #[test]
        fn partial_keys_match_a_plain_model(ops in proptest::collection::vec(op(), 1..60)) {
            let n = 7u32;
            let mut p = BlockPool::new(n, true);
            let mut m = Model::default();
            let mut held: Vec<u32> = Vec::new();
            // Full keys are h(100 + k), partial keys h(k) standing for k tokens.
            let all: Vec<BlockHash> = (1u8..8).chain(100..104).map(h).collect();
            for o in ops {
                match o {
                    Op::Alloc if p.num_free_blocks() > 0 => {
                        let mut out = Vec::new();
                        p.allocate_into(1, &mut out);
                        m.drop_all(out[0]);
                        held.push(out[0]);
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let b = held.swap_remove(i % held.len());
                        p.free_blocks(&[b]);
                    }
                    Op::Full(i, k) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        p.cache_block_rekey(b, h(100 + k));
                        m.cache_full(b, h(100 + k));
                    }
                    Op::Partial(i, k, r) if !held.is_empty() => {
                        let b = held[i % held.len()];
                        p.cache_partial_block(b, h(k), u32::from(k), r);
                        m.cache_partial(b, h(k), u32::from(k), r);
                    }
                    Op::Move(i, j)
                        if held.len() > 1
                            && held[i % held.len()] != held[j % held.len()]
                            && p.block_hash(held[j % held.len()]).is_none() =>
                    {
                        let (src, dst) = (held[i % held.len()], held[j % held.len()]);
                        p.move_block_hashes(src, dst);
                        m.move_keys(src, dst);
                    }
                    Op::Reset if p.reset_prefix_cache() => m = Model::default(),
                    _ => {}
                }
                let mut count = vec![0u32; n as usize];
                for &b in &held {
                    count[b as usize] += 1;
                }
                p.check(&count).unwrap();
                for k in &all {
                    prop_assert_eq!(p.get_cached_key(k), m.first(k), "key {:?}", k.0[0]);
                }
                for b in 1..n {
                    let want = m.primary.get(&b).map(|x| x.0);
                    prop_assert_eq!(p.block_hash(b).copied(), want);
                    let want: Vec<BlockHash> = m.extras.get(&b).cloned().unwrap_or_default();
                    prop_assert_eq!(p.extra_keys(b).to_vec(), want);
                }
            }
        }
    }
}
