//! The waiting queue, in policy order. FCFS is a deque (preempted requests go back to the front); PRIORITY is
//! a binary heap on `(priority, arrival_time, request id)`, lowest first. Neither scans on the hot path.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use crate::config::Policy;
use crate::request::ReqHandle;

#[derive(Clone, Debug)]
pub struct PriorityKey {
    pub priority: i64,
    pub arrival_time: f64,
    pub id: Arc<str>,
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
}

impl WaitingQueue {
    pub fn new(policy: Policy) -> Self {
        match policy {
            Policy::Fcfs => WaitingQueue::Fcfs(VecDeque::new()),
            Policy::Priority => WaitingQueue::Priority(BinaryHeap::new()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WaitingQueue::Fcfs(q) => q.len(),
            WaitingQueue::Priority(h) => h.len(),
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
        }
    }

    /// A preempted request: to the front under FCFS, by its key under PRIORITY.
    pub fn push_preempted(&mut self, handle: ReqHandle, key: PriorityKey) {
        match self {
            WaitingQueue::Fcfs(q) => q.push_front(handle),
            WaitingQueue::Priority(h) => h.push(HeapEntry { key, handle }),
        }
    }

    pub fn peek(&self) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.front().copied(),
            WaitingQueue::Priority(h) => h.peek().map(|e| e.handle),
        }
    }

    pub fn pop(&mut self) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.pop_front(),
            WaitingQueue::Priority(h) => h.pop().map(|e| e.handle),
        }
    }

    /// Keeps the entries for which `keep` is true (O(n); used only by aborts and in-flight finishes).
    pub fn retain(&mut self, mut keep: impl FnMut(ReqHandle) -> bool) {
        match self {
            WaitingQueue::Fcfs(q) => q.retain(|h| keep(*h)),
            WaitingQueue::Priority(h) => h.retain(|e| keep(e.handle)),
        }
    }

    pub fn handles(&self) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            WaitingQueue::Priority(h) => h.iter().map(|e| e.handle).collect(),
        }
    }

    /// The handles in pop order (O(n log n) for the heap; introspection only).
    pub fn handles_in_order(&self) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            // Ascending by the reversed `Ord` is descending by key: the pop order reversed.
            WaitingQueue::Priority(h) => h.clone().into_sorted_vec().iter().rev().map(|e| e.handle).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(p: i64, t: f64, id: &str) -> PriorityKey {
        PriorityKey { priority: p, arrival_time: t, id: id.into() }
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
        let order: Vec<u32> = std::iter::from_fn(|| q.pop()).map(|x| x.slot).collect();
        assert_eq!(order, vec![3, 2, 1, 0]);
    }

    #[test]
    fn fcfs_preempted_go_first() {
        let mut q = WaitingQueue::new(Policy::Fcfs);
        q.push(h(0), key(0, 0.0, "a"));
        q.push_preempted(h(1), key(0, 0.0, "b"));
        assert_eq!(q.peek(), Some(h(1)));
        q.retain(|x| x.slot != 1);
        assert_eq!(q.pop(), Some(h(0)));
        assert!(q.is_empty());
    }
}
