//! Encoder cache bookkeeping for multimodal inputs (`encoder_sched.rs` drives it from the step loop).
//!
//! The rules follow vLLM 0.33's `EncoderCacheManager` (learned from reading it, not copied): the cache holds
//! encoder outputs by content hash, sized in encoder tokens. An entry is referenced by the (request, input)
//! pairs that need it; when the last reference goes, the entry becomes *freeable* but stays cached (a later
//! input with the same hash reuses it without recomputation). Freeable entries are evicted oldest-freeable
//! first, only when an allocation needs their space; evicted hashes are reported once through
//! [`EncoderCache::take_freed`] so the workers can drop the tensors.

use std::collections::{BTreeMap, HashMap};

/// One encoder input of a request: it replaces prompt positions `start..start + num_tokens` with encoder
/// output identified by `hash` (equal hashes mean equal content, so the output is shared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncoderInput {
    pub start: u32,
    pub num_tokens: u32,
    pub hash: u64,
}

impl EncoderInput {
    pub fn end(&self) -> u32 {
        self.start + self.num_tokens
    }
}

/// One cached encoder output.
#[derive(Debug, Clone)]
struct Entry {
    num_tokens: u64,
    /// (request key, input index) pairs referencing this entry.
    refs: Vec<(u64, u32)>,
    /// Position in the freeable order while `refs` is empty.
    freeable_seq: Option<u64>,
}

/// Encoder cache accounting: free slots, freeable (unreferenced but still cached) slots, and references.
#[derive(Debug, Clone)]
pub struct EncoderCache {
    capacity: u64,
    num_free: u64,
    num_freeable: u64,
    entries: HashMap<u64, Entry>,
    freeable: BTreeMap<u64, u64>,
    next_seq: u64,
    freed: Vec<u64>,
}

impl EncoderCache {
    /// An empty cache of `capacity` encoder tokens.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            num_free: capacity,
            num_freeable: capacity,
            entries: HashMap::new(),
            freeable: BTreeMap::new(),
            next_seq: 0,
            freed: Vec::new(),
        }
    }

    /// Capacity in encoder tokens.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Sets the capacity of a cache that holds no entry (hashes evicted earlier stay queued for
    /// [`EncoderCache::take_freed`]). Returns false (changing nothing) if an entry is cached.
    pub fn resize_empty(&mut self, capacity: u64) -> bool {
        if !self.entries.is_empty() {
            return false;
        }
        self.capacity = capacity;
        self.num_free = capacity;
        self.num_freeable = capacity;
        true
    }

    /// Slots not occupied by any entry.
    pub fn num_free(&self) -> u64 {
        self.num_free
    }

    /// Slots free or reclaimable by evicting unreferenced entries.
    pub fn num_freeable(&self) -> u64 {
        self.num_freeable
    }

    /// Whether `hash` is cached (referenced or freeable).
    pub fn contains(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// If `hash` is cached, add the reference (`req`, `input`) and return true (no recomputation needed). A
    /// freeable entry becomes referenced again and leaves the freeable order.
    pub fn check_and_reference(&mut self, hash: u64, req: u64, input: u32) -> bool {
        let Some(entry) = self.entries.get_mut(&hash) else {
            return false;
        };
        if let Some(seq) = entry.freeable_seq.take() {
            self.freeable.remove(&seq);
            self.num_freeable -= entry.num_tokens;
        }
        if !entry.refs.contains(&(req, input)) {
            entry.refs.push((req, input));
        }
        true
    }

    /// Whether an input of `num_tokens` fits the remaining `compute_budget` and, together with
    /// `num_tokens_pending` (tokens already admitted this step but not yet allocated), the cache. When it fits
    /// only after evicting freeable entries, they are evicted now (oldest first) and their hashes queued for
    /// [`EncoderCache::take_freed`]. Returns false (changing nothing) when it does not fit.
    pub fn can_allocate(&mut self, num_tokens: u64, compute_budget: u64, num_tokens_pending: u64) -> bool {
        if num_tokens > compute_budget {
            return false;
        }
        let need = num_tokens.saturating_add(num_tokens_pending);
        if need <= self.num_free {
            return true;
        }
        if need > self.num_freeable {
            return false;
        }
        while need > self.num_free {
            let Some((_, hash)) = self.freeable.pop_first() else {
                return false;
            };
            if let Some(entry) = self.entries.remove(&hash) {
                self.num_free += entry.num_tokens;
            }
            self.freed.push(hash);
        }
        true
    }

    /// Allocate an entry for `hash` referenced by (`req`, `input`). Call after [`EncoderCache::can_allocate`]
    /// returned true. Returns false (changing nothing) if the space is missing or `hash` is cached with another
    /// size.
    pub fn allocate(&mut self, hash: u64, num_tokens: u64, req: u64, input: u32) -> bool {
        if self.entries.contains_key(&hash) {
            return self.entries.get(&hash).is_some_and(|e| e.num_tokens == num_tokens)
                && self.check_and_reference(hash, req, input);
        }
        if num_tokens > self.num_free || num_tokens > self.num_freeable {
            return false;
        }
        self.num_free -= num_tokens;
        self.num_freeable -= num_tokens;
        self.entries.insert(hash, Entry { num_tokens, refs: vec![(req, input)], freeable_seq: None });
        true
    }

    /// Drop the reference (`req`, `input`) to `hash`. When no reference remains, the entry becomes freeable
    /// (still cached, evictable). Unknown references are ignored.
    pub fn release(&mut self, hash: u64, req: u64, input: u32) {
        let Some(entry) = self.entries.get_mut(&hash) else {
            return;
        };
        let before = entry.refs.len();
        entry.refs.retain(|&r| r != (req, input));
        if entry.refs.len() == before || !entry.refs.is_empty() {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        entry.freeable_seq = Some(seq);
        self.freeable.insert(seq, hash);
        self.num_freeable += entry.num_tokens;
    }

    /// Drop every reference held by request `req` (finish, abort, preemption).
    pub fn release_request(&mut self, req: u64) {
        let mut held: Vec<(u64, u32)> = self
            .entries
            .iter()
            .flat_map(|(&h, e)| e.refs.iter().filter(|r| r.0 == req).map(move |r| (h, r.1)))
            .collect();
        held.sort_unstable();
        for (hash, input) in held {
            self.release(hash, req, input);
        }
    }

    /// Hashes evicted since the last call, in eviction order, less those cached again since (vLLM keeps the
    /// worker's tensor of an entry evicted and allocated again within one step).
    pub fn take_freed(&mut self) -> Vec<u64> {
        let mut freed = std::mem::take(&mut self.freed);
        freed.retain(|h| !self.entries.contains_key(h));
        freed
    }

    /// Whether any hash is queued for [`EncoderCache::take_freed`].
    pub fn has_freed(&self) -> bool {
        !self.freed.is_empty()
    }

    /// The size of the cached entry for `hash`.
    pub fn size_of(&self, hash: u64) -> Option<u64> {
        self.entries.get(&hash).map(|e| e.num_tokens)
    }

    /// The oldest reference to `hash` still held, if any.
    pub fn first_referrer(&self, hash: u64) -> Option<(u64, u32)> {
        self.entries.get(&hash).and_then(|e| e.refs.first().copied())
    }

    /// Removes the unreferenced entry `hash` at once (its encoder output was never computed, or the step that
    /// computed it failed): the space is free again and nobody can hit it. `report` queues the hash for
    /// [`EncoderCache::take_freed`]. Returns false (changing nothing) if the entry is absent or referenced.
    pub fn remove_unreferenced(&mut self, hash: u64, report: bool) -> bool {
        match self.entries.get(&hash) {
            Some(e) if e.refs.is_empty() => {}
            _ => return false,
        }
        let Some(entry) = self.entries.remove(&hash) else {
            return false;
        };
        if let Some(seq) = entry.freeable_seq {
            self.freeable.remove(&seq);
        }
        self.num_free += entry.num_tokens;
        if report {
            self.freed.push(hash);
        }
        true
    }

    /// Entries cached (referenced or freeable).
    pub fn num_entries(&self) -> usize {
        self.entries.len()
    }

    /// Fraction of the capacity held by entries (referenced or freeable); 0 for an empty cache.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            (self.capacity - self.num_free) as f64 / self.capacity as f64
        }
    }

    /// Every cached entry's hash, referenced or freeable (in no particular order).
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.keys().copied()
    }

    /// The (request, input) references held on every entry, for cross-checks.
    pub fn references(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.entries.iter().flat_map(|(&h, e)| e.refs.iter().map(move |&(r, i)| (h, r, i)))
    }

    /// Check the accounting: free + occupied = capacity, freeable = free + unreferenced, the freeable order holds
    /// exactly the unreferenced entries. Returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let occupied: u64 = self.entries.values().map(|e| e.num_tokens).sum();
        if occupied + self.num_free != self.capacity {
            return Err(format!(
                "occupied {occupied} + free {} != capacity {}",
                self.num_free, self.capacity
            ));
        }
        let unreferenced: u64 =
            self.entries.values().filter(|e| e.refs.is_empty()).map(|e| e.num_tokens).sum();
        if self.num_free + unreferenced != self.num_freeable {
            return Err(format!(
                "free {} + unreferenced {unreferenced} != freeable {}",
                self.num_free, self.num_freeable
            ));
        }
        for (&hash, e) in &self.entries {
            let listed = e.freeable_seq.is_some_and(|s| self.freeable.get(&s) == Some(&hash));
            if e.refs.is_empty() != listed {
                return Err(format!(
                    "entry {hash}: unreferenced {} but in freeable order {listed}",
                    e.refs.is_empty()
                ));
            }
        }
        if self.freeable.len() != self.entries.values().filter(|e| e.refs.is_empty()).count() {
            return Err("freeable order holds entries that are not cached".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::EncoderCache;

    /// vLLM: an input whose hash is cached is not recomputed; it only adds a reference (check_and_update_cache).
    #[test]
    fn shared_hash_is_reused_without_new_space() {
        let mut c = EncoderCache::new(100);
        assert!(!c.check_and_reference(7, 1, 0));
        assert!(c.can_allocate(40, 100, 0));
        assert!(c.allocate(7, 40, 1, 0));
        assert!(c.check_and_reference(7, 2, 0));
        assert_eq!(c.num_free(), 60);
        c.check_invariants().unwrap();
    }

    /// vLLM: an input larger than the remaining compute budget is not scheduled (can_allocate returns False).
    #[test]
    fn budget_refuses_before_cache() {
        let mut c = EncoderCache::new(100);
        assert!(!c.can_allocate(50, 49, 0));
        assert!(c.can_allocate(50, 50, 0));
        assert!(!c.can_allocate(50, 50, 51), "pending tokens of this step count against the cache");
    }

    /// vLLM: the last reference going makes an entry freeable, not freed; it is reused while still cached.
    #[test]
    fn released_entry_stays_cached_until_space_is_needed() {
        let mut c = EncoderCache::new(100);
        assert!(c.allocate(7, 60, 1, 0));
        c.release_request(1);
        assert_eq!((c.num_free(), c.num_freeable()), (40, 100));
        assert!(c.contains(7));
        assert!(c.take_freed().is_empty());
        assert!(c.check_and_reference(7, 2, 0));
        assert_eq!(c.num_freeable(), 40);
        c.check_invariants().unwrap();
    }

    /// vLLM: freeable entries are evicted oldest first, only as many as the allocation needs, and reported once.
    #[test]
    fn eviction_is_oldest_first_and_reported_once() {
        let mut c = EncoderCache::new(100);
        for (h, req) in [(1u64, 1u64), (2, 2), (3, 3)] {
            assert!(c.can_allocate(30, 100, 0));
            assert!(c.allocate(h, 30, req, 0));
        }
        c.release_request(2);
        c.release_request(1);
        assert!(c.can_allocate(40, 100, 0));
        assert_eq!(c.take_freed(), vec![2]);
        assert!(c.take_freed().is_empty());
        assert!(c.contains(1) && !c.contains(2));
        assert!(c.allocate(4, 40, 4, 0));
        c.check_invariants().unwrap();
        assert!(!c.can_allocate(31, 100, 0), "referenced entries are never evicted");
        assert!(c.take_freed().is_empty(), "a refused allocation evicts nothing");
        c.check_invariants().unwrap();
    }

    /// A reference held twice by the same request input counts once; a shared hash stays referenced until its
    /// last holder releases it.
    #[test]
    fn references_are_per_request_input() {
        let mut c = EncoderCache::new(10);
        assert!(c.allocate(5, 10, 1, 0));
        assert!(c.check_and_reference(5, 1, 0));
        assert!(c.check_and_reference(5, 2, 3));
        c.release(5, 1, 0);
        assert_eq!(c.num_freeable(), 0);
        c.release(5, 2, 3);
        assert_eq!(c.num_freeable(), 10);
        c.release(5, 2, 3);
        assert_eq!(c.num_freeable(), 10);
        assert!(!c.allocate(6, 11, 3, 0), "larger than the cache");
        assert!(!c.allocate(5, 9, 3, 0), "same hash, other size");
        c.check_invariants().unwrap();
    }
}
