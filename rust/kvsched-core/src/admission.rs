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

/// The front of the FCFS queue before the step's reordering, to restore after phase B.
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
            } else if !req.skip_reading_prefix_cache
                && self.kv.has_cached_prefix(&req.block_hashes, req.num_tokens())
            {
                1
            } else {
                2
            });
        }
        let peers = (0..w).filter(|&i| class[i] != 0);
        let order: Vec<usize> = peers
            .clone()
            .filter(|&i| class[i] == 1)
            .chain(peers.clone().filter(|&i| class[i] == 2))
            .collect();
        let mut moved = false;
        for (slot, from) in peers.zip(order) {
            queue[slot] = original[from];
            moved |= slot != from;
        }
        moved.then_some(AdmissionPlan { original })
    }

    /// Restores the original order of the reordered requests that phase B did not admit. Phase B takes requests
    /// from the front and puts the ones it skips back at the front, so those left are the first entries of the
    /// queue, in some order. (Checked: if that ever failed, the queue is left as it is rather than corrupted.)
    pub(crate) fn end_admission(&mut self, plan: Option<AdmissionPlan>) {
        let Some(plan) = plan else { return };
        let WaitingQueue::Fcfs(queue) = &mut self.waiting else { return };
        // The window's requests still in the queue are at its front (phase B puts the ones it skipped back
        // there); those it admitted left it, and so did those admitted with an asynchronous KV load (to the
        // KV-waiting queue under park_kv_loads = false). So look for them among the first `window` entries.
        let key = |h: &ReqHandle| (h.slot, h.gen);
        let mut head: Vec<ReqHandle> = queue.iter().take(plan.original.len()).copied().collect();
        head.sort_unstable_by_key(key);
        let left: Vec<ReqHandle> =
            plan.original.into_iter().filter(|h| head.binary_search_by_key(&key(h), key).is_ok()).collect();
        let mut front: Vec<ReqHandle> = queue.iter().take(left.len()).copied().collect();
        let mut expect = left.clone();
        front.sort_unstable_by_key(key);
        expect.sort_unstable_by_key(key);
        if front != expect {
            debug_assert!(false, "the admission window's requests are not at the front of the queue");
            return;
        }
        for (k, h) in left.into_iter().enumerate() {
            queue[k] = h;
        }
    }
}
