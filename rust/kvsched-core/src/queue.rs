//! The waiting queue, in policy order. FCFS is a deque (preempted requests go back to the front); PRIORITY is
//! a binary heap on `(effective priority, arrival_time, request id)`, lowest first; FAIR is one FIFO per tenant
//! (`fair.rs`), served by virtual counter. FCFS and PRIORITY never scan on the hot path; FAIR scans the tenants.
//!
//! Priority aging: with `priority_aging_steps = A > 0` the effective priority is `priority * A + arrival_step`
//! (`arrival_step`: the number of `schedule()` calls before the request was added). Comparing these is exactly
//! comparing `priority - age / A` at any common step, i.e. one level gained per `A` steps of age, so the key is
//! static and the heap stays a heap. Computed in `i128`: no overflow for any `i64` priority.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use crate::config::Policy;
use crate::fair::{FairQueue, Tenants};
use crate::request::ReqHandle;

#[derive(Clone, Debug)]
pub struct PriorityKey {
    /// The effective priority (see the module doc).
    pub priority: i128,
    pub arrival_time: f64,
    pub id: Arc<str>,
    pub tenant: u32,
}

/// The effective priority of a request of `priority` added after `arrival_step` steps.
pub fn effective_priority(priority: i64, arrival_step: u64, aging_steps: u32) -> i128 {
    if aging_steps == 0 {
        i128::from(priority)
    } else {
        i128::from(priority) * i128::from(aging_steps) + i128::from(arrival_step)
    }
}

impl PriorityKey {
    fn cmp_key(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then(self.arrival_time.total_cmp(&other.arrival_time))
            .then_with(|| self.id.cmp(&other.id))
    }
}

#[derive(Clone, Debug)]
pub struct HeapEntry {
    key: PriorityKey,
    handle: ReqHandle,
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
    // BinaryHeap is a max-heap: reverse so the smallest key is on top.
    fn cmp(&self, other: &Self) -> Ordering {
        other.key.cmp_key(&self.key)
    }
}

#[derive(Clone, Debug)]
pub enum WaitingQueue {
    Fcfs(VecDeque<ReqHandle>),
    Priority(BinaryHeap<HeapEntry>),
    Fair(FairQueue),
}

impl WaitingQueue {
    pub fn new(policy: Policy) -> Self {
        match policy {
            Policy::Fcfs => WaitingQueue::Fcfs(VecDeque::new()),
            Policy::Priority => WaitingQueue::Priority(BinaryHeap::new()),
            Policy::Fair => WaitingQueue::Fair(FairQueue::default()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WaitingQueue::Fcfs(q) => q.len(),
            WaitingQueue::Priority(h) => h.len(),
            WaitingQueue::Fair(f) => f.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new request.
    pub fn push(&mut self, handle: ReqHandle, key: PriorityKey) {
        match self {
            WaitingQueue::Fcfs(q) => q.push_back(handle),
            WaitingQueue::Priority(h) => h.push(HeapEntry { key, handle }),
            WaitingQueue::Fair(f) => f.push_back(key.tenant, handle, key.arrival_time),
        }
    }

    /// A preempted request: to the front under FCFS (of its tenant's FIFO under FAIR), by its key under
    /// PRIORITY.
    pub fn push_preempted(&mut self, handle: ReqHandle, key: PriorityKey) {
        match self {
            WaitingQueue::Fcfs(q) => q.push_front(handle),
            WaitingQueue::Priority(h) => h.push(HeapEntry { key, handle }),
            WaitingQueue::Fair(f) => f.push_front(key.tenant, handle, key.arrival_time),
        }
    }

    /// The request phase B tries next (FAIR reads the tenants' counters).
    pub fn peek(&self, tenants: &Tenants) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.front().copied(),
            WaitingQueue::Priority(h) => h.peek().map(|e| e.handle),
            WaitingQueue::Fair(f) => f.peek(tenants),
        }
    }

    /// Removes the request `peek` returned (with the same `tenants`).
    pub fn pop(&mut self, tenants: &Tenants) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.pop_front(),
            WaitingQueue::Priority(h) => h.pop().map(|e| e.handle),
            WaitingQueue::Fair(f) => f.pop(tenants),
        }
    }

    /// Keeps the entries for which `keep` is true (O(n); used only by aborts and in-flight finishes).
    pub fn retain(&mut self, mut keep: impl FnMut(ReqHandle) -> bool) {
        match self {
            WaitingQueue::Fcfs(q) => q.retain(|h| keep(*h)),
            WaitingQueue::Priority(h) => h.retain(|e| keep(e.handle)),
            WaitingQueue::Fair(f) => f.retain(keep),
        }
    }

    pub fn handles(&self) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            WaitingQueue::Priority(h) => h.iter().map(|e| e.handle).collect(),
            WaitingQueue::Fair(f) => f.handles().collect(),
        }
    }

    /// The handles in pop order (O(n log n) for the heap; introspection only). FAIR: the order at the current
    /// counters (as if admitting charged nothing).
    pub fn handles_in_order(&self, tenants: &Tenants) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            // Ascending by the reversed `Ord` is descending by key: the pop order reversed.
            WaitingQueue::Priority(h) => h.clone().into_sorted_vec().iter().rev().map(|e| e.handle).collect(),
            WaitingQueue::Fair(f) => {
                let mut f = f.clone();
                std::iter::from_fn(|| f.pop(tenants)).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(p: i128, t: f64, id: &str) -> PriorityKey {
        PriorityKey { priority: p, arrival_time: t, id: id.into(), tenant: 0 }
    }

    fn h(slot: u32) -> ReqHandle {
        ReqHandle { slot, gen: 0 }
    }

    #[test]
    fn priority_orders_by_priority_then_time_then_id() {
        let mut q = WaitingQueue::new(Policy::Priority);
        q.push(h(0), key(1, 0.0, "a"));
        q.push(h(1), key(0, 5.0, "b"));
        q.push(h(2), key(0, 1.0, "d"));
        q.push(h(3), key(0, 1.0, "c"));
        let t = Tenants::new(&Default::default());
        let order: Vec<u32> = std::iter::from_fn(|| q.pop(&t)).map(|x| x.slot).collect();
        assert_eq!(order, vec![3, 2, 1, 0]);
    }

    #[test]
    fn aging_gains_one_level_per_aging_steps() {
        // Priority 2 added at step 0 vs priority 0 added at step s, aging every 5 steps: equal at s = 10.
        assert!(effective_priority(2, 0, 5) > effective_priority(0, 9, 5));
        assert_eq!(effective_priority(2, 0, 5), effective_priority(0, 10, 5));
        assert!(effective_priority(2, 0, 5) < effective_priority(0, 11, 5));
        assert_eq!(effective_priority(-3, 99, 0), -3);
        assert!(effective_priority(i64::MAX, u64::MAX, u32::MAX) > effective_priority(i64::MIN, 0, u32::MAX));
    }

    #[test]
    fn fcfs_preempted_go_first() {
        let t = Tenants::new(&Default::default());
        let mut q = WaitingQueue::new(Policy::Fcfs);
        q.push(h(0), key(0, 0.0, "a"));
        q.push_preempted(h(1), key(0, 0.0, "b"));
        assert_eq!(q.peek(&t), Some(h(1)));
        q.retain(|x| x.slot != 1);
        assert_eq!(q.pop(&t), Some(h(0)));
        assert!(q.is_empty());
    }
}
