//! What phase B takes next from `waiting`, beyond the queue's own order (`queue.rs`): aging, the `sjf`
//! re-keying, and the FCFS admission window's one-step reorderings (warm before cold, session affinity).
//!
//! **Aging** (`max_wait_steps = N`, any policy). A request *enters* `waiting` when it is added (unless parked),
//! preempted, queued after `set_ready`, or sent back from `kv_waiting` with nothing loaded; it is given the
//! first step it waits in (`wait_since`) and joins the aging FIFO. It is *aged* at step `s` when `s -
//! wait_since >= N`: `N` steps went by without admitting it. When phase B looks for its next candidate in
//! `waiting`, the policy's next request goes first if it was preempted; otherwise the oldest aged request (the
//! first of the FIFO that is still in `waiting` and not skipped in this pass) goes first, taken from its place
//! (a scan of its tier under FCFS and FAIR, O(1) in the heap). FIFO entries whose request left are dropped
//! lazily: O(1) amortised per step.
//!
//! **SJF re-keying.** A request is queued by its residual (prompt blocks beyond its prefix hit) as probed
//! when it was added. When it is the head of `waiting` in an admission pass and a cache entry was removed since
//! its last probe, it is probed again; if its residual grew (part of its prefix was evicted), it is re-queued
//! with the larger residual and the pass looks at the new head. At most `SJF_MAX_REKEYS_PER_PASS` re-keys per
//! pass (then the head is taken as it is): O(1) probes per pass. A residual is never lowered while the request
//! waits (a request that becomes warmer keeps its place: lowering it would need every waiting request probed).
//!
//! **Cache-aware window** (FCFS). When `cache_aware_admission_window` `W > 0` and, at the start of phase B, the
//! KV usage is at or above `cache_aware_admission_threshold`, phase B sees the first `W` requests of the first
//! tier reordered for this step: among the *peers* (plain new requests, status WAITING: never admitted, so
//! never computed and never preempted) those whose prompt has a cached prefix (the probe: at least one full
//! leading block hits) go first, then the cold peers, each group in queue order; the peers take exactly the
//! positions peers held, every other request keeps its position. Below the threshold nothing is probed. The
//! probe reads the cache map only (no ref counts, no LRU movement, no stats): O(1) per request, O(W) per step.
//!
//! **Session affinity** (FCFS, `W > 0`, at any KV usage). Among the same `W` requests, the first peer that
//! names a recently active session (`session.rs`) and whose prompt has a cached prefix is moved forward, after
//! the warm-before-cold reordering, to just behind the last PREEMPTED request ahead of it (to the front if there
//! is none): at most one per step, never past a preempted request, and not at all while the head of the queue
//! has waited `max_wait_steps` (if set).
//!
//! The reorderings last one step: `end_admission` puts the window's requests that phase B did not take back in
//! their original relative order, in the places they hold then. It relies on phase B taking requests only from
//! the front of the tier (aging takes one from anywhere, which only closes a gap) and putting the ones it skipped
//! back at the front: the window's requests still waiting are among its first `W + skipped` entries.
//!
//! `SchedulerConfig::validate` refuses a window > 0 with another policy: their queues are not in arrival order,
//! so "warm before cold within the first W" has no single meaning there.

use crate::config::Policy;
use crate::error::Result;
use crate::order::sjf_residual;
use crate::queue::WaitingQueue;
use crate::request::{ReqHandle, Request, RequestStatus, NO_SESSION};
use crate::scheduler::Scheduler;

/// `sjf`: most re-keys in one admission pass.
pub(crate) const SJF_MAX_REKEYS_PER_PASS: u32 = 8;

/// The front of the FCFS queue's first tier before the step's reordering, to restore after phase B.
pub(crate) struct AdmissionPlan {
    tier: i64,
    /// The first `W` entries in their original order.
    original: Vec<ReqHandle>,
}

impl Scheduler {
    /// The first step in which a request entering `waiting` now waits.
    fn wait_entry_step(&self) -> u64 {
        self.next_step_id + u64::from(self.in_schedule)
    }

    /// `slot`'s request entered `waiting` (see the module doc): with aging on, it joins the aging FIFO.
    pub(crate) fn enter_waiting(&mut self, slot: u32) -> Result<()> {
        if self.config.max_wait_steps.is_none() {
            return Ok(());
        }
        let since = self.wait_entry_step();
        self.next_wait_seq += 1;
        let seq = self.next_wait_seq;
        let req = self.slab.get_mut(slot)?;
        req.wait_seq = seq;
        req.wait_since = since;
        self.aging.push_back((since, seq, req.handle));
        if self.aging.len() > 2 * self.waiting.len() + 64 {
            let slab = &self.slab;
            self.aging.retain(|&(_, seq, h)| slab.resolve(h).is_some_and(|r| r.wait_seq == seq));
        }
        Ok(())
    }

    /// Whether the head of `waiting` has waited `max_wait_steps` (never without aging).
    fn head_has_aged(&mut self) -> bool {
        let Some(n) = self.config.max_wait_steps else { return false };
        let now = self.next_step_id;
        let Some(h) = self.waiting.peek(&self.tenants) else { return false };
        self.slab
            .resolve(h)
            .is_some_and(|r| r.wait_seq != 0 && now.saturating_sub(r.wait_since) >= u64::from(n))
    }

    /// The oldest request of `waiting` (not among `skipped`) if it has waited `n` steps.
    fn oldest_aged(&mut self, n: u32, skipped: &[ReqHandle]) -> Option<ReqHandle> {
        let now = self.next_step_id;
        let mut k = 0;
        while let Some(&(since, seq, h)) = self.aging.get(k) {
            if self.slab.resolve(h).is_none_or(|r| r.wait_seq != seq) {
                if k == 0 {
                    self.aging.pop_front();
                } else {
                    k += 1;
                }
                continue;
            }
            if skipped.contains(&h) {
                k += 1;
                continue;
            }
            return (now.saturating_sub(since) >= u64::from(n)).then_some(h);
        }
        None
    }

    /// The request phase B tries next from `waiting` (see the module doc), and whether aging took it out of
    /// its place (then `pop_candidate` removes it from there). `skipped`: the requests the pass took out of the
    /// queue; `rekeys`: the pass's `sjf` re-keys so far; `buf`: scratch.
    pub(crate) fn peek_waiting(
        &mut self,
        skipped: &[ReqHandle],
        rekeys: &mut u32,
        buf: &mut Vec<u32>,
    ) -> Result<Option<(ReqHandle, bool)>> {
        loop {
            let Some(h) = self.waiting.peek(&self.tenants) else { return Ok(None) };
            if let Some(n) = self.config.max_wait_steps {
                let preempted = self.slab.resolve(h).is_some_and(|r| r.status == RequestStatus::Preempted);
                if !preempted {
                    if let Some(a) = self.oldest_aged(n, skipped) {
                        return Ok(Some((a, a != h)));
                    }
                }
            }
            if self.config.policy == Policy::Sjf
                && *rekeys < SJF_MAX_REKEYS_PER_PASS
                && self.sjf_rekey(h, buf)?
            {
                *rekeys += 1;
                continue;
            }
            return Ok(Some((h, false)));
        }
    }

    /// `sjf`: probes the head `h` of `waiting` again if a cache entry was removed since its last probe, and
    /// re-queues it if its residual grew. Returns whether it did.
    fn sjf_rekey(&mut self, h: ReqHandle, buf: &mut Vec<u32>) -> Result<bool> {
        let WaitingQueue::Keyed(q) = &mut self.waiting else { return Ok(false) };
        if q.heap.peek().is_none_or(|(_, key)| key.is_front()) {
            return Ok(false); // what FCFS puts at the front keeps its place
        }
        let removed = self.kv.pool.num_removed();
        let req = self.slab.get_mut(h.slot)?;
        if req.sjf_probe_stamp == removed {
            return Ok(false); // nothing left the cache: its hit cannot have shrunk
        }
        req.sjf_probe_stamp = removed;
        let residual = sjf_residual(&self.kv, req, buf);
        if residual <= req.sjf_residual {
            return Ok(false);
        }
        req.sjf_residual = residual;
        q.heap.push(h, Self::order_key(Policy::Sjf, req));
        Ok(true)
    }

    /// Reorders the front of the FCFS queue's first tier for this step's phase B (the window's two rules);
    /// `None` when nothing moved.
    pub(crate) fn begin_admission(&mut self) -> Option<AdmissionPlan> {
        let window = self.config.cache_aware_admission_window as usize;
        if window == 0 {
            return None;
        }
        let reorder = self.kv.pool.usage() >= self.config.cache_aware_admission_threshold;
        let promote = !self.sessions.is_empty() && !self.head_has_aged();
        if !reorder && !promote {
            return None;
        }
        let (now, ttl) = (self.next_step_id, self.config.session_ttl_steps);
        let WaitingQueue::Fcfs(tiers) = &mut self.waiting else { return None };
        let tier = tiers.first_tier()?;
        let queue = tiers.tier_deque_mut(tier)?;
        let w = window.min(queue.len());
        let original: Vec<ReqHandle> = queue.iter().take(w).copied().collect();
        let (slab, kv) = (&self.slab, &self.kv);
        let warm = |r: &Request| {
            !r.skip_reading_prefix_cache && kv.has_cached_prefix(&r.block_hashes, r.num_tokens())
        };
        let mut order = original.clone();
        if reorder {
            // 0: not a peer (keeps its place), 1: warm peer, 2: cold peer.
            let mut class = Vec::with_capacity(w);
            for h in &original {
                let req = slab.resolve(*h)?;
                class.push(if req.status != RequestStatus::Waiting {
                    0u8
                } else if warm(req) {
                    1
                } else {
                    2
                });
            }
            let peers = (0..w).filter(|&i| class[i] != 0);
            let sorted =
                peers.clone().filter(|&i| class[i] == 1).chain(peers.clone().filter(|&i| class[i] == 2));
            for (slot, from) in peers.zip(sorted) {
                order[slot] = original[from];
            }
        }
        if promote {
            let mut behind = 0; // just behind the last preempted request seen
            for i in 0..w {
                let req = slab.resolve(order[i])?;
                if req.status == RequestStatus::Preempted {
                    behind = i + 1;
                } else if req.status == RequestStatus::Waiting
                    && req.session != NO_SESSION
                    && self.sessions.is_recent(req.session, now, ttl)
                    && warm(req)
                {
                    order[behind..=i].rotate_right(1);
                    break;
                }
            }
        }
        if order == original {
            return None;
        }
        for (k, h) in order.into_iter().enumerate() {
            queue[k] = h;
        }
        Some(AdmissionPlan { tier, original })
    }

    /// Restores the original relative order of the reordered requests that phase B did not admit, in the
    /// places they hold. `num_skipped`: requests phase B put back at the front of `waiting`; the window's
    /// requests still there are among the first `W + num_skipped` entries of their tier (see the module doc).
    pub(crate) fn end_admission(&mut self, plan: Option<AdmissionPlan>, num_skipped: usize) {
        let Some(plan) = plan else { return };
        let WaitingQueue::Fcfs(tiers) = &mut self.waiting else { return };
        let Some(queue) = tiers.tier_deque_mut(plan.tier) else { return };
        let key = |h: &ReqHandle| (h.slot, h.gen);
        let mut sorted = plan.original.clone();
        sorted.sort_unstable_by_key(key);
        let in_window = |h: &ReqHandle| sorted.binary_search_by_key(&key(h), key).is_ok();
        let limit = (plan.original.len() + num_skipped).min(queue.len());
        let places: Vec<usize> = (0..limit).filter(|&k| in_window(&queue[k])).collect();
        let mut here: Vec<ReqHandle> = places.iter().map(|&k| queue[k]).collect();
        here.sort_unstable_by_key(key);
        let left: Vec<ReqHandle> =
            plan.original.into_iter().filter(|h| here.binary_search_by_key(&key(h), key).is_ok()).collect();
        for (k, h) in places.into_iter().zip(left) {
            queue[k] = h;
        }
    }

    /// `check_invariants` helper: every request in `waiting` holds a live entry of the aging FIFO (with aging).
    pub(crate) fn check_aging(&self) -> std::result::Result<(), String> {
        if self.config.max_wait_steps.is_none() {
            return Ok(());
        }
        let mut seqs: Vec<u64> = self.aging.iter().map(|e| e.1).collect();
        seqs.sort_unstable();
        for h in self.waiting.handles() {
            let r = self.slab.resolve(h).ok_or("waiting holds a stale handle")?;
            if r.wait_seq == 0 || seqs.binary_search(&r.wait_seq).is_err() {
                return Err(format!("waiting request {:?} has no aging entry", r.id));
            }
        }
        Ok(())
    }

    /// Introspection: the order phase B would take `waiting` in at the next step, aging included (the `sjf`
    /// residuals as they stand, without the window's reorderings).
    pub(crate) fn waiting_in_order(&self) -> Vec<ReqHandle> {
        let Some(n) = self.config.max_wait_steps else { return self.waiting.handles_in_order(&self.tenants) };
        let now = self.next_step_id;
        let mut q = self.waiting.clone();
        let mut aged: std::collections::VecDeque<ReqHandle> = self
            .aging
            .iter()
            .filter(|&&(since, seq, h)| {
                now.saturating_sub(since) >= u64::from(n)
                    && self.slab.resolve(h).is_some_and(|r| r.wait_seq == seq)
            })
            .map(|e| e.2)
            .collect();
        let mut out = Vec::with_capacity(q.len());
        while let Some(h) = q.peek(&self.tenants) {
            let Some(r) = self.slab.resolve(h) else { break };
            match aged.front().copied() {
                Some(a) if r.status != RequestStatus::Preempted => {
                    aged.pop_front();
                    if let Some(ar) = self.slab.resolve(a) {
                        q.remove(a, ar.order_key, ar.tenant);
                    }
                    out.push(a);
                }
                _ => {
                    q.pop(&self.tenants);
                    if let Some(i) = aged.iter().position(|&x| x == h) {
                        aged.remove(i);
                    }
                    out.push(h);
                }
            }
        }
        out
    }
}
