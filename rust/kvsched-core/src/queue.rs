//! The waiting queue, in policy order.
//!
//! - FCFS: one deque per tier (`order_key`, 0 when not given), the tiers in ascending order; new requests at
//!   the back of their tier's deque, preempted ones (and those an admission pass skipped, or made ready) at its
//!   front. With every request in tier 0 (the default) this is exactly vLLM's FCFS deque. O(1) per operation
//!   with one tier, O(log tiers) to find a tier.
//! - PRIORITY, SJF and SLO: a heap with lazy removal on `OrderKey` (`order.rs`): `(tier, effective priority,
//!   arrival_time, id)`, `(tier, residual blocks, arrival_time, id)`, `(tier, deadline, arrival_time, id)`.
//!   Under PRIORITY a preempted request is pushed by its key (vLLM); under SJF and SLO it gets a front key (the
//!   front of its tier, as FCFS). O(log n) per operation.
//! - FAIR: one tiered deque per tenant (`fair.rs`), served by virtual counter (a scan of the tenants).
//!
//! Priority aging: with `priority_aging_steps = A > 0` the effective priority is `priority * A + arrival_step`
//! (`arrival_step`: the number of `schedule()` calls before the request was added). Comparing these is exactly
//! comparing `priority - age / A` at any common step, i.e. one level gained per `A` steps of age, so the key is
//! static and the heap stays a heap. Computed in `i128`: no overflow for any `i64` priority.

use crate::config::Policy;
use crate::fair::{FairQueue, Tenants};
use crate::order::{front_rank, KeyedHeap, OrderKey, TierQueue};
use crate::request::ReqHandle;

/// The effective priority of a request of `priority` added after `arrival_step` steps.
pub fn effective_priority(priority: i64, arrival_step: u64, aging_steps: u32) -> i128 {
    if aging_steps == 0 {
        i128::from(priority)
    } else {
        i128::from(priority) * i128::from(aging_steps) + i128::from(arrival_step)
    }
}

/// PRIORITY, SJF and SLO: the keyed heap; `fronts` (SJF, SLO) gives pushes to the front a front key.
#[derive(Clone, Debug)]
pub struct KeyedQueue {
    pub heap: KeyedHeap,
    fronts: bool,
    num_front_pushes: u64,
}

#[derive(Clone, Debug)]
pub enum WaitingQueue {
    Fcfs(TierQueue<ReqHandle>),
    Keyed(KeyedQueue),
    Fair(FairQueue),
}

impl WaitingQueue {
    pub fn new(policy: Policy) -> Self {
        let keyed = |fronts| {
            WaitingQueue::Keyed(KeyedQueue { heap: KeyedHeap::default(), fronts, num_front_pushes: 0 })
        };
        match policy {
            Policy::Fcfs => WaitingQueue::Fcfs(TierQueue::default()),
            Policy::Priority => keyed(false),
            Policy::Sjf | Policy::Slo => keyed(true),
            Policy::Fair => WaitingQueue::Fair(FairQueue::default()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WaitingQueue::Fcfs(q) => q.len(),
            WaitingQueue::Keyed(k) => k.heap.len(),
            WaitingQueue::Fair(f) => f.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new request: at the back of its tier (FCFS, of its tenant's tier under FAIR), by its key otherwise.
    pub fn push(&mut self, handle: ReqHandle, key: OrderKey) {
        match self {
            WaitingQueue::Fcfs(q) => q.push_back(key.tier, handle),
            WaitingQueue::Keyed(k) => k.heap.push(handle, key),
            WaitingQueue::Fair(f) => f.push_back(key.tenant, key.tier, handle, key.arrival_time),
        }
    }

    /// A preempted request (or one skipped by an admission pass, or made ready): to the front of its tier under
    /// FCFS, SJF and SLO (of its tenant's tier under FAIR), by its key under PRIORITY.
    pub fn push_preempted(&mut self, handle: ReqHandle, key: OrderKey) {
        match self {
            WaitingQueue::Fcfs(q) => q.push_front(key.tier, handle),
            WaitingQueue::Keyed(k) => {
                let key = if k.fronts {
                    k.num_front_pushes += 1;
                    OrderKey { rank: front_rank(k.num_front_pushes), deadline: 0.0, arrival_time: 0.0, ..key }
                } else {
                    key
                };
                k.heap.push(handle, key)
            }
            WaitingQueue::Fair(f) => f.push_front(key.tenant, key.tier, handle, key.arrival_time),
        }
    }

    /// The request phase B tries next (FAIR reads the tenants' counters).
    pub fn peek(&mut self, tenants: &Tenants) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.front().copied(),
            WaitingQueue::Keyed(k) => k.heap.peek().map(|(h, _)| h),
            WaitingQueue::Fair(f) => f.peek(tenants),
        }
    }

    /// Removes the request `peek` returned (with the same `tenants`).
    pub fn pop(&mut self, tenants: &Tenants) -> Option<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.pop_front(),
            WaitingQueue::Keyed(k) => k.heap.pop(),
            WaitingQueue::Fair(f) => f.pop(tenants),
        }
    }

    /// Takes `h` (of tier `tier` and tenant `tenant`) out from anywhere in the queue (aging): a scan of its tier
    /// (FCFS, FAIR), O(1) for the heap. Returns whether it was in.
    pub fn remove(&mut self, h: ReqHandle, tier: i64, tenant: u32) -> bool {
        match self {
            WaitingQueue::Fcfs(q) => q.remove(tier, |&x| x == h),
            WaitingQueue::Keyed(k) => k.heap.remove(h),
            WaitingQueue::Fair(f) => f.remove(tenant, tier, h),
        }
    }

    /// Keeps the entries for which `keep` is true (O(n); used only by aborts and in-flight finishes).
    pub fn retain(&mut self, mut keep: impl FnMut(ReqHandle) -> bool) {
        match self {
            WaitingQueue::Fcfs(q) => q.retain(|h| keep(*h)),
            WaitingQueue::Keyed(k) => k.heap.retain(keep),
            WaitingQueue::Fair(f) => f.retain(keep),
        }
    }

    pub fn handles(&self) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            WaitingQueue::Keyed(k) => k.heap.handles().collect(),
            WaitingQueue::Fair(f) => f.handles().collect(),
        }
    }

    /// The handles in pop order (O(n log n) for the heap; introspection only). FAIR: the order at the current
    /// counters (as if admitting charged nothing).
    pub fn handles_in_order(&self, tenants: &Tenants) -> Vec<ReqHandle> {
        match self {
            WaitingQueue::Fcfs(q) => q.iter().copied().collect(),
            _ => {
                let mut q = self.clone();
                std::iter::from_fn(|| q.pop(tenants)).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(p: i128, t: f64, id: &str) -> OrderKey {
        OrderKey { tier: 0, rank: p, deadline: 0.0, arrival_time: t, id: id.into(), tenant: 0 }
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

    #[test]
    fn fcfs_tiers_come_first_and_preempted_go_to_the_front_of_their_tier() {
        let t = Tenants::new(&Default::default());
        let mut q = WaitingQueue::new(Policy::Fcfs);
        let tiered = |tier: i64, id: &str| OrderKey { tier, ..key(0, 0.0, id) };
        q.push(h(0), tiered(0, "a"));
        q.push(h(1), tiered(1, "b"));
        q.push(h(2), tiered(-1, "c"));
        q.push(h(3), tiered(0, "d"));
        q.push_preempted(h(4), tiered(1, "e")); // the front of tier 1, not of the queue
        q.push_preempted(h(5), tiered(0, "f"));
        assert!(q.remove(h(3), 0, 0));
        assert!(!q.remove(h(3), 0, 0));
        let order: Vec<u32> = std::iter::from_fn(|| q.pop(&t)).map(|x| x.slot).collect();
        assert_eq!(order, vec![2, 5, 0, 4, 1]);
    }

    #[test]
    fn sjf_and_slo_put_what_fcfs_puts_at_the_front_there_priority_by_key() {
        let t = Tenants::new(&Default::default());
        for (policy, want) in [(Policy::Slo, vec![2, 1, 0]), (Policy::Priority, vec![1, 0, 2])] {
            let mut q = WaitingQueue::new(policy);
            q.push(h(0), key(5, 0.0, "a"));
            q.push_preempted(h(1), key(1, 0.0, "b"));
            q.push_preempted(h(2), key(9, 0.0, "c"));
            let order: Vec<u32> = q.handles_in_order(&t).iter().map(|x| x.slot).collect();
            assert_eq!(order, want);
            assert_eq!(q.len(), 3);
        }
    }
}
