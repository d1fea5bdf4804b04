//! Waiting-queue keys, and the heap with lazy deletion that the keyed orders (`priority`, `sjf`, `slo`) use.
//!
//! A key compares `(tier, rank, deadline, arrival_time, id)`, smallest first. `tier` is the request's static
//! `order_key` (0 when not given) under every policy. `rank` is the policy's: the effective priority
//! (`priority`), the residual prompt blocks beyond the prefix hit (`sjf`), 0 (`slo`). `deadline` is the `slo`
//! deadline (`arrival_time + ttft_slo_s`, infinite without a target), 0 under the other policies. Live
//! requests have distinct ids, so keys order them totally. Under `sjf` and `slo` the requests FCFS puts at the
//! front of its queue (preempted, skipped by an admission pass, made ready) get a *front key*: the same tier,
//! a rank below every policy rank, most recently pushed first (`front_rank`), so within a tier they come
//! first, in FCFS's front order.
//!
//! `TierQueue` is FCFS within tiers (FCFS and each tenant of FAIR): one deque per tier, tiers ascending.
//!
//! `KeyedHeap` removes entries lazily: each push gets a sequence number, recorded per slot as the live one;
//! an entry whose number is not its slot's live number is stale and dropped when it reaches the top. Removing
//! any request (an aged one taken from the middle, a re-keyed one) is then O(1), and the heap is compacted
//! when stale entries outnumber live ones. Invariant: `len` counts exactly the live entries.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use crate::kv_cache_manager::KvCacheManager;
use crate::request::{ReqHandle, Request};

/// `sjf`'s key of `req` now: its prompt blocks beyond its prefix hit (`buf`: scratch for the hit blocks).
pub(crate) fn sjf_residual(kv: &KvCacheManager, req: &Request, buf: &mut Vec<u32>) -> u32 {
    let blocks = req.num_tokens().div_ceil(kv.block_size);
    if req.skip_reading_prefix_cache {
        return blocks;
    }
    buf.clear();
    kv.find_longest_cache_hit(&req.block_hashes, req.num_tokens(), buf);
    let hits = buf.len() as u32;
    buf.clear();
    blocks - hits
}

#[derive(Clone, Debug)]
pub struct OrderKey {
    /// The request's `order_key` (0 when not given): smaller first, under every policy.
    pub tier: i64,
    /// The policy's rank (see the module doc), or a front rank.
    pub rank: i128,
    /// `slo`: the deadline; 0 under the other policies.
    pub deadline: f64,
    pub arrival_time: f64,
    pub id: Arc<str>,
    /// Not compared: the `fair` queue files the request under it.
    pub tenant: u32,
}

/// The rank of the `seq`-th push to the front: below every policy rank (those are above `-2**96`), and the
/// later the push, the smaller.
pub fn front_rank(seq: u64) -> i128 {
    i128::MIN + i128::from(u64::MAX - seq)
}

impl OrderKey {
    pub fn cmp_key(&self, other: &Self) -> Ordering {
        self.tier
            .cmp(&other.tier)
            .then(self.rank.cmp(&other.rank))
            .then(self.deadline.total_cmp(&other.deadline))
            .then(self.arrival_time.total_cmp(&other.arrival_time))
            .then_with(|| self.id.cmp(&other.id))
    }

    /// Whether this is a front key (`front_rank`).
    pub fn is_front(&self) -> bool {
        self.rank < -(1i128 << 120)
    }
}

#[derive(Clone, Debug)]
struct HeapEntry {
    key: OrderKey,
    handle: ReqHandle,
    seq: u64,
}

impl PartialEq for HeapEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for HeapEntry {}
impl PartialOrd for HeapEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeapEntry {
    // BinaryHeap is a max-heap: reversed, so the smallest key is on top (a stale twin of a live entry may
    // share its key: the sequence number keeps the order total).
    fn cmp(&self, other: &Self) -> Ordering {
        other.key.cmp_key(&self.key).then(other.seq.cmp(&self.seq))
    }
}

/// A min-heap of requests by `OrderKey` with lazy removal (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct KeyedHeap {
    heap: BinaryHeap<HeapEntry>,
    /// By slot: the sequence number of the slot's live entry, 0 when it has none.
    live: Vec<u64>,
    next_seq: u64,
    len: usize,
}

impl KeyedHeap {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn is_live(&self, e: &HeapEntry) -> bool {
        self.live.get(e.handle.slot as usize) == Some(&e.seq)
    }

    /// Whether `h`'s slot has a live entry.
    pub fn contains(&self, h: ReqHandle) -> bool {
        self.live.get(h.slot as usize).is_some_and(|&s| s != 0)
    }

    /// Adds `h` under `key`; if `h` is already in the heap, its entry is replaced (a new key).
    pub fn push(&mut self, h: ReqHandle, key: OrderKey) {
        let slot = h.slot as usize;
        if self.live.len() <= slot {
            self.live.resize(slot + 1, 0);
        }
        if self.live[slot] == 0 {
            self.len += 1;
        }
        self.next_seq += 1;
        self.live[slot] = self.next_seq;
        self.heap.push(HeapEntry { key, handle: h, seq: self.next_seq });
        self.compact_if_stale();
    }

    fn drop_stale_top(&mut self) {
        while let Some(top) = self.heap.peek() {
            if self.is_live(top) {
                return;
            }
            self.heap.pop();
        }
    }

    /// The request with the smallest key, and its key.
    pub fn peek(&mut self) -> Option<(ReqHandle, &OrderKey)> {
        self.drop_stale_top();
        self.heap.peek().map(|e| (e.handle, &e.key))
    }

    pub fn pop(&mut self) -> Option<ReqHandle> {
        self.drop_stale_top();
        let e = self.heap.pop()?;
        self.live[e.handle.slot as usize] = 0;
        self.len -= 1;
        Some(e.handle)
    }

    /// Takes `h` out (O(1): its entry goes stale). Returns whether it was in.
    pub fn remove(&mut self, h: ReqHandle) -> bool {
        if !self.contains(h) {
            return false;
        }
        self.live[h.slot as usize] = 0;
        self.len -= 1;
        self.compact_if_stale();
        true
    }

    /// Drops stale entries once they outnumber the live ones (amortised O(1) per removal).
    fn compact_if_stale(&mut self) {
        if self.heap.len() > 2 * self.len + 64 {
            let live = std::mem::take(&mut self.live);
            self.heap.retain(|e| live.get(e.handle.slot as usize) == Some(&e.seq));
            self.live = live;
        }
    }

    /// Keeps the live entries for which `keep` is true (O(n)).
    pub fn retain(&mut self, mut keep: impl FnMut(ReqHandle) -> bool) {
        let mut live = std::mem::take(&mut self.live);
        self.heap.retain(|e| {
            let slot = e.handle.slot as usize;
            if live.get(slot) != Some(&e.seq) {
                return false;
            }
            if keep(e.handle) {
                return true;
            }
            live[slot] = 0;
            false
        });
        self.len = self.heap.len();
        self.live = live;
    }

    /// The live handles, in no particular order.
    pub fn handles(&self) -> impl Iterator<Item = ReqHandle> + '_ {
        self.heap.iter().filter(|e| self.is_live(e)).map(|e| e.handle)
    }
}

/// FCFS within tiers: one deque per tier, tiers ascending, no empty tier kept.
#[derive(Clone, Debug)]
pub struct TierQueue<T> {
    tiers: Vec<(i64, VecDeque<T>)>,
    len: usize,
    /// The deque of the last tier that emptied, kept for the next new tier (a queue that empties and refills
    /// every step allocates nothing).
    spare: Option<VecDeque<T>>,
}

impl<T> Default for TierQueue<T> {
    fn default() -> Self {
        TierQueue { tiers: Vec::new(), len: 0, spare: None }
    }
}

impl<T: Copy> TierQueue<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The deque of `tier`, created empty if missing.
    fn tier_mut(&mut self, tier: i64) -> &mut VecDeque<T> {
        // The common case, one tier (or pushing to the last), without a search.
        let k = match self.tiers.last() {
            Some(&(t, _)) if t == tier => self.tiers.len() - 1,
            _ => match self.tiers.binary_search_by_key(&tier, |(t, _)| *t) {
                Ok(k) => k,
                Err(k) => {
                    self.tiers.insert(k, (tier, self.spare.take().unwrap_or_default()));
                    k
                }
            },
        };
        &mut self.tiers[k].1
    }

    pub fn push_back(&mut self, tier: i64, x: T) {
        self.tier_mut(tier).push_back(x);
        self.len += 1;
    }

    pub fn push_front(&mut self, tier: i64, x: T) {
        self.tier_mut(tier).push_front(x);
        self.len += 1;
    }

    pub fn front(&self) -> Option<&T> {
        self.tiers.first().and_then(|(_, q)| q.front())
    }

    /// The tier of the first entry.
    pub fn first_tier(&self) -> Option<i64> {
        self.tiers.first().map(|(t, _)| *t)
    }

    pub fn pop_front(&mut self) -> Option<T> {
        let (_, q) = self.tiers.first_mut()?;
        let x = q.pop_front();
        if q.is_empty() {
            self.spare = Some(self.tiers.remove(0).1);
        }
        self.len -= usize::from(x.is_some());
        x
    }

    /// Removes the first entry of `tier` for which `is` holds (a scan of that tier). Returns whether it did.
    pub fn remove(&mut self, tier: i64, mut is: impl FnMut(&T) -> bool) -> bool {
        let Ok(k) = self.tiers.binary_search_by_key(&tier, |(t, _)| *t) else { return false };
        let q = &mut self.tiers[k].1;
        let Some(i) = q.iter().position(&mut is) else { return false };
        q.remove(i);
        if q.is_empty() {
            self.spare = Some(self.tiers.remove(k).1);
        }
        self.len -= 1;
        true
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for (_, q) in &mut self.tiers {
            q.retain(&mut keep);
        }
        self.tiers.retain(|(_, q)| !q.is_empty());
        self.len = self.tiers.iter().map(|(_, q)| q.len()).sum();
    }

    /// The entries in queue order.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.tiers.iter().flat_map(|(_, q)| q.iter())
    }

    /// The deque of `tier` (the admission window reorders the front of the first tier's).
    pub fn tier_deque_mut(&mut self, tier: i64) -> Option<&mut VecDeque<T>> {
        let k = self.tiers.binary_search_by_key(&tier, |(t, _)| *t).ok()?;
        Some(&mut self.tiers[k].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tier: i64, rank: i128, deadline: f64, t: f64, id: &str) -> OrderKey {
        OrderKey { tier, rank, deadline, arrival_time: t, id: id.into(), tenant: 0 }
    }

    fn h(slot: u32) -> ReqHandle {
        ReqHandle { slot, gen: 0 }
    }

    #[test]
    fn keys_compare_tier_rank_deadline_arrival_then_id() {
        let mut q = KeyedHeap::default();
        q.push(h(0), key(1, -5, 0.0, 0.0, "a")); // a later tier loses to everything in tier 0
        q.push(h(1), key(0, 2, 0.0, 0.0, "b"));
        q.push(h(2), key(0, 1, f64::INFINITY, 0.0, "c"));
        q.push(h(3), key(0, 1, 3.0, 9.0, "d"));
        q.push(h(4), key(0, 1, 3.0, 1.0, "f"));
        q.push(h(5), key(0, 1, 3.0, 1.0, "e"));
        q.push(h(6), key(0, front_rank(7), 0.0, 0.0, "g"));
        q.push(h(7), key(0, front_rank(8), 0.0, 0.0, "h")); // pushed to the front later: first
        let order: Vec<u32> = std::iter::from_fn(|| q.pop()).map(|x| x.slot).collect();
        assert_eq!(order, vec![7, 6, 5, 4, 3, 2, 1, 0]);
        assert!(key(0, front_rank(0), 0.0, 0.0, "x").is_front());
        assert!(!key(0, i128::from(i64::MIN) * i128::from(u32::MAX), 0.0, 0.0, "x").is_front());
    }

    #[test]
    fn removal_is_lazy_and_a_push_replaces_the_entry() {
        let mut q = KeyedHeap::default();
        for s in 0..5 {
            q.push(h(s), key(0, i128::from(s), 0.0, 0.0, &s.to_string()));
        }
        assert!(q.remove(h(0)));
        assert!(!q.remove(h(0)));
        q.push(h(1), key(0, 9, 0.0, 0.0, "1")); // re-keyed: now last
        assert_eq!(q.len(), 4);
        assert_eq!(q.peek().map(|(x, _)| x), Some(h(2)));
        q.retain(|x| x.slot != 3);
        let order: Vec<u32> = std::iter::from_fn(|| q.pop()).map(|x| x.slot).collect();
        assert_eq!(order, vec![2, 4, 1]);
        assert!(q.is_empty() && q.heap.is_empty());
    }

    #[test]
    fn stale_entries_are_compacted() {
        let mut q = KeyedHeap::default();
        for round in 0..1000u32 {
            q.push(h(round % 3), key(0, i128::from(round), 0.0, 0.0, "x"));
        }
        assert_eq!(q.len(), 3);
        assert!(q.heap.len() <= 2 * 3 + 65);
    }
}
