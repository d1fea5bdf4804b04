//! Cache-aware admission (FCFS only): warm requests before cold ones inside a bounded window.
//!
//! A cold request admitted first allocates blocks, and the blocks it pops from the free queue may be exactly
//! the cached prefix that a warm request behind it was about to reuse. When `cache_aware_admission_window`
//! `W > 0` and, at the start of phase B, the KV usage is at or above `cache_aware_admission_threshold`, phase B
//! sees the first `W` waiting requests reordered for this step: among the *peers* (plain new requests, status
//! WAITING: never admitted, so never computed and never preempted) those whose prompt has a cached prefix (the
//! probe: at least one full leading block hits) go first, then the cold peers, each group in queue order; the
//! peers take exactly the positions peers held, every other request keeps its position. Below the threshold
//! nothing is probed. The probe reads the cache map only (no ref counts, no LRU movement, no stats): O(1) per
//! request, O(W) per step.
//!
//! The reordering lasts one step: `end_admission` puts the requests phase B did not take back in their
//! original relative order, so the queue order is never changed by a step that admitted nothing. It relies on
//! phase B taking requests only from the front of the queue and putting the ones it skipped back at the front:
//! the window's requests that are still waiting then fill the front of the queue.
//!
//! `SchedulerConfig::validate` refuses a window > 0 with the `priority` or `fair` policy: their queues are not
//! in arrival order, so "warm before cold within the first W" has no single meaning there.

use crate::queue::WaitingQueue;
use crate::request::{ReqHandle, RequestStatus};
use crate::scheduler::Scheduler;

/// The step's reordering of the front of the FCFS queue, to undo after phase B.
pub(crate) struct AdmissionPlan {
    /// The first `W` entries in their original order.
    original: Vec<ReqHandle>,
}

impl Scheduler {
    /// Reorders the front of the FCFS queue for this step's phase B; `None` when nothing moved.
    pub(crate) fn begin_admission(&mut self) -> Option<AdmissionPlan> {
        let window = self.config.cache_aware_admission_window as usize;
        if window == 0 || self.kv.pool.usage() < self.config.cache_aware_admission_threshold {
            return None;
        }
        let WaitingQueue::Fcfs(queue) = &mut self.waiting else { return None };
        let w = window.min(queue.len());
        let original: Vec<ReqHandle> = queue.iter().take(w).copied().collect();
        // 0: not a peer (keeps its place), 1: warm peer, 2: cold peer.
        let mut class = Vec::with_capacity(w);
        for h in &original {
            let req = self.slab.resolve(*h)?;
            class.push(if req.status != RequestStatus::Waiting {
                0u8
            } else if self.kv.has_cached_prefix(&req.block_hashes, req.num_tokens()) {
                1
            } else {
                2
            });
        }
        let peers = (0..w as u32).filter(|&i| class[i as usize] != 0);
        let order: Vec<u32> = peers
            .clone()
            .filter(|&i| class[i as usize] == 1)
            .chain(peers.clone().filter(|&i| class[i as usize] == 2))
            .collect();
        let mut source: Vec<u32> = (0..w as u32).collect();
        for (slot, from) in peers.zip(order) {
            source[slot as usize] = from;
        }
        if source.iter().enumerate().all(|(i, &s)| i as u32 == s) {
            return None;
        }
        let reordered: Vec<ReqHandle> = source.iter().map(|&s| original[s as usize]).collect();
        for (k, h) in reordered.iter().enumerate() {
            queue[k] = *h;
        }
        Some(AdmissionPlan { original })
    }

    /// Restores the original order of the reordered requests phase B left in the queue.
    pub(crate) fn end_admission(&mut self, plan: Option<AdmissionPlan>) {
        let Some(plan) = plan else { return };
        // The window's requests phase B did not admit are still waiting, at the front of the queue.
        let left: Vec<ReqHandle> = plan
            .original
            .iter()
            .copied()
            .filter(|&h| self.slab.resolve(h).is_some_and(|r| r.status.is_waiting()))
            .collect();
        let WaitingQueue::Fcfs(queue) = &mut self.waiting else { return };
        for (k, h) in left.into_iter().enumerate() {
            queue[k] = h;
        }
    }
}
