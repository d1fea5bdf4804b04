//! The router: its replicas, the blocks each caches (the index), their load, the requests in flight, and the
//! decisions.
//!
//! A decision ranks the healthy candidates with the configured policy (`crate::policy`); with sticky sessions
//! the replica of the previous request with the same `session_id` goes first while the balance rule does not call it overloaded. Routing a request
//! (`route`, or `assign` when the caller chose the replica) keeps it in flight on its replica until the caller
//! reports it finished, and counts it in that replica's load (`crate::load`). Losing a replica (`remove_replica`)
//! purges its blocks and sessions and hands back the requests it had in flight. Every call that fails leaves the
//! router unchanged: arguments are checked before anything is written. Invariants (`check_invariants`): the
//! index's own; every in-flight request is on a live replica; each replica's pending load adds up from its
//! in-flight requests; those of `Sessions`.

use std::collections::HashMap;

use crate::config::RouterConfig;
use crate::error::{Result, RouterError};
use crate::event::KvEvent;
use crate::index::{slots, PrefixIndex, ReplicaSet, MAX_REPLICAS};
use crate::load::{LoadReport, Pending, ReplicaLoad};
use crate::policy::{imbalanced, rank, ttft, Candidate, PromptShape, Reason};
use crate::prompt::{Prompt, PromptHasher, PromptKeys};
use crate::session::Sessions;

/// Where a request goes, and what the router knew when it chose.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub slot: usize,
    pub reason: Reason,
    /// Leading blocks of the prompt the replica caches.
    pub num_overlap_blocks: usize,
    pub num_prompt_blocks: usize,
    pub num_prompt_tokens: usize,
    /// The predictive estimate for this replica (`crate::predict`), whatever the policy.
    pub estimated_ttft_s: f64,
}

/// Every candidate, most preferred first, and the decision for the first.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    pub slots: Vec<usize>,
    pub decision: Decision,
}

#[derive(Clone, Debug)]
struct Replica {
    name: String,
    healthy: bool,
    load: ReplicaLoad,
}

#[derive(Clone, Debug)]
struct InFlight {
    slot: usize,
    seq: u64,
    pending: Pending,
}

#[derive(Clone, Debug)]
pub struct Router {
    config: RouterConfig,
    hasher: PromptHasher,
    replicas: Vec<Option<Replica>>,
    names: HashMap<String, usize>,
    index: PrefixIndex,
    requests: HashMap<String, InFlight>,
    sessions: Sessions,
    round_robin_counter: u64,
    next_seq: u64,
}

impl Router {
    pub fn new(config: RouterConfig) -> Result<Self> {
        config.validate()?;
        let hasher = PromptHasher::new(
            config.prefix_hash_algo,
            config.prefix_hash_seed.as_deref(),
            config.block_size,
        )?;
        Ok(Router {
            sessions: Sessions::new(config.max_sessions),
            config,
            hasher,
            replicas: Vec::new(),
            names: HashMap::new(),
            index: PrefixIndex::default(),
            requests: HashMap::new(),
            round_robin_counter: 0,
            next_seq: 0,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    // -- replicas ------------------------------------------------------------------------------------------

    /// Adds a healthy replica with an empty cache, in the lowest free slot.
    pub fn add_replica(&mut self, name: &str) -> Result<usize> {
        if self.names.contains_key(name) {
            return Err(RouterError::DuplicateReplica(format!("replica {name:?} is already registered")));
        }
        let slot = match self.replicas.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.replicas.len() < MAX_REPLICAS => {
                self.replicas.push(None);
                self.replicas.len() - 1
            }
            None => {
                return Err(RouterError::InvalidArgument(format!(
                    "a router indexes at most {MAX_REPLICAS} replicas"
                )))
            }
        };
        self.replicas[slot] =
            Some(Replica { name: name.to_owned(), healthy: true, load: ReplicaLoad::default() });
        self.names.insert(name.to_owned(), slot);
        Ok(slot)
    }

    /// The replica is gone: forgets its blocks, load and sessions, and returns the ids of the requests it had in
    /// flight, in the order they were routed, so the caller can send them elsewhere (they are no longer in flight).
    pub fn remove_replica(&mut self, name: &str) -> Result<Vec<String>> {
        let slot = self.slot(name)?;
        let mut moved: Vec<(u64, String)> =
            self.requests.iter().filter(|(_, r)| r.slot == slot).map(|(id, r)| (r.seq, id.clone())).collect();
        moved.sort_unstable();
        for (_, id) in &moved {
            self.requests.remove(id);
        }
        self.index.clear(slot);
        self.sessions.forget_slot(slot);
        self.names.remove(name);
        self.replicas[slot] = None;
        while self.replicas.last().is_some_and(Option::is_none) {
            self.replicas.pop();
        }
        Ok(moved.into_iter().map(|(_, id)| id).collect())
    }

    /// An unhealthy replica keeps its index and requests but takes no new ones until it is healthy again.
    pub fn set_healthy(&mut self, name: &str, healthy: bool) -> Result<()> {
        let slot = self.slot(name)?;
        self.replica_mut(slot).healthy = healthy;
        Ok(())
    }

    /// Registered replicas in slot order, with their health.
    pub fn replicas(&self) -> impl Iterator<Item = (usize, &str, bool)> {
        self.replicas
            .iter()
            .enumerate()
            .filter_map(|(s, r)| r.as_ref().map(|r| (s, r.name.as_str(), r.healthy)))
    }

    pub fn replica_name(&self, slot: usize) -> &str {
        self.replicas.get(slot).and_then(Option::as_ref).map_or("", |r| r.name.as_str())
    }

    pub fn slot(&self, name: &str) -> Result<usize> {
        self.names.get(name).copied().ok_or_else(|| RouterError::UnknownReplica(name.to_owned()))
    }

    fn replica(&self, slot: usize) -> &Replica {
        match self.replicas.get(slot) {
            Some(Some(r)) => r,
            // Slots come from `names` or from the live set only.
            _ => unreachable_slot(),
        }
    }

    fn replica_mut(&mut self, slot: usize) -> &mut Replica {
        match self.replicas.get_mut(slot) {
            Some(Some(r)) => r,
            _ => unreachable_slot(),
        }
    }

    // -- what the replicas report --------------------------------------------------------------------------

    /// Applies a replica's block events in order. They are all checked first; a bad one applies none.
    pub fn apply_events(&mut self, name: &str, events: &[KvEvent<'_>]) -> Result<()> {
        let slot = self.slot(name)?;
        for e in events {
            e.validate(self.config.block_size)?;
        }
        for e in events {
            match e {
                KvEvent::Stored { block_hashes, .. } => self.index.insert(slot, block_hashes),
                KvEvent::Removed { block_hashes } => self.index.remove(slot, block_hashes),
                KvEvent::AllCleared => self.index.clear(slot),
            }
        }
        Ok(())
    }

    /// A load snapshot of a replica; it supersedes the requests the router counted since the previous one.
    pub fn update_load(&mut self, name: &str, report: LoadReport) -> Result<()> {
        let slot = self.slot(name)?;
        report.validate()?;
        self.replica_mut(slot).load.report(report);
        Ok(())
    }

    // -- decisions -----------------------------------------------------------------------------------------

    pub fn prompt_keys(&self, prompt: &Prompt<'_>) -> Result<PromptKeys> {
        self.hasher.keys(prompt)
    }

    /// The healthy replicas among `candidates` (all healthy replicas when `None`).
    fn candidate_set(&self, candidates: Option<&[&str]>) -> Result<ReplicaSet> {
        let mut set: ReplicaSet = 0;
        match candidates {
            None => {
                for (s, _, healthy) in self.replicas() {
                    if healthy {
                        set |= 1 << s;
                    }
                }
            }
            Some(names) => {
                for n in names {
                    let s = self.slot(n)?;
                    if self.replica(s).healthy {
                        set |= 1 << s;
                    }
                }
            }
        }
        if set == 0 {
            let what = if self.names.is_empty() {
                "no replica is registered"
            } else if candidates.is_some() {
                "no healthy replica among the candidates"
            } else {
                "no replica is healthy"
            };
            return Err(RouterError::NoReplica(format!("cannot route: {what}")));
        }
        Ok(set)
    }

    fn shape(&self, keys: &PromptKeys) -> PromptShape {
        PromptShape {
            num_blocks: keys.keys.len(),
            num_tokens: keys.num_tokens,
            block_size: self.config.block_size,
        }
    }

    fn candidate(&self, slot: usize, overlap_blocks: usize) -> Candidate {
        Candidate {
            slot,
            overlap_blocks,
            num_cached_blocks: self.index.num_blocks(slot),
            load: self.replica(slot).load.effective(),
        }
    }

    fn decision(&self, c: &Candidate, reason: Reason, shape: &PromptShape) -> Decision {
        Decision {
            slot: c.slot,
            reason,
            num_overlap_blocks: c.overlap_blocks,
            num_prompt_blocks: shape.num_blocks,
            num_prompt_tokens: shape.num_tokens,
            estimated_ttft_s: ttft(c, shape, &self.config.params),
        }
    }

    fn rank_keys(&self, keys: &PromptKeys, set: ReplicaSet, session: Option<&str>) -> Ranking {
        let mut overlaps = [0u32; MAX_REPLICAS];
        self.index.overlaps(&keys.keys, set, &mut overlaps);
        let mut cands: Vec<Candidate> = slots(set).map(|s| self.candidate(s, overlaps[s] as usize)).collect();
        let shape = self.shape(keys);
        let p = &self.config.params;
        let mut reason = rank(self.config.policy, &mut cands, &shape, p, self.round_robin_counter);
        if let Some(sticky) = self.sticky_slot(session, set) {
            let idle = cands.iter().map(|c| c.load.num_requests()).min().unwrap_or(0);
            if let Some(i) = cands.iter().position(|c| c.slot == sticky) {
                if !imbalanced(cands[i].load.num_requests(), idle, p) {
                    cands[..=i].rotate_right(1);
                    reason = Reason::Sticky;
                }
            }
        }
        let decision = self.decision(&cands[0], reason, &shape);
        Ranking { slots: cands.iter().map(|c| c.slot).collect(), decision }
    }

    fn sticky_slot(&self, session: Option<&str>, set: ReplicaSet) -> Option<usize> {
        if !self.config.sticky_sessions {
            return None;
        }
        self.sessions.get(session?).filter(|&s| set & (1 << s) != 0)
    }

    /// Ranks the healthy candidates for a prompt without routing anything.
    pub fn rank(
        &self,
        prompt: &Prompt<'_>,
        session: Option<&str>,
        candidates: Option<&[&str]>,
    ) -> Result<Ranking> {
        let keys = self.hasher.keys(prompt)?;
        let set = self.candidate_set(candidates)?;
        Ok(self.rank_keys(&keys, set, session))
    }

    /// Chooses a replica for a request and keeps the request in flight there.
    pub fn route(
        &mut self,
        req_id: &str,
        prompt: &Prompt<'_>,
        session: Option<&str>,
        candidates: Option<&[&str]>,
    ) -> Result<Decision> {
        self.check_new_request(req_id)?;
        let keys = self.hasher.keys(prompt)?;
        let set = self.candidate_set(candidates)?;
        let decision = self.rank_keys(&keys, set, session).decision;
        self.commit(req_id, &keys, &decision, session);
        Ok(decision)
    }

    /// Records that the caller sent a request to `replica` (chosen from `rank`, or by its own rule): as `route`,
    /// without choosing. The replica may be unhealthy; the caller decided.
    pub fn assign(
        &mut self,
        req_id: &str,
        replica: &str,
        prompt: &Prompt<'_>,
        session: Option<&str>,
    ) -> Result<Decision> {
        let slot = self.slot(replica)?;
        self.check_new_request(req_id)?;
        let keys = self.hasher.keys(prompt)?;
        let mut overlaps = [0u32; MAX_REPLICAS];
        self.index.overlaps(&keys.keys, 1 << slot, &mut overlaps);
        let c = self.candidate(slot, overlaps[slot] as usize);
        let decision = self.decision(&c, Reason::Assigned, &self.shape(&keys));
        self.commit(req_id, &keys, &decision, session);
        Ok(decision)
    }

    fn check_new_request(&self, req_id: &str) -> Result<()> {
        if self.requests.contains_key(req_id) {
            return Err(RouterError::DuplicateRequest(req_id.to_owned()));
        }
        Ok(())
    }

    fn commit(&mut self, req_id: &str, keys: &PromptKeys, d: &Decision, session: Option<&str>) {
        let shape = self.shape(keys);
        let uncached = (shape.num_tokens as u64 - shape.cached_tokens(d.num_overlap_blocks)).max(1);
        let pending = self.replica_mut(d.slot).load.routed(uncached, shape.num_tokens as u64);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.requests.insert(req_id.to_owned(), InFlight { slot: d.slot, seq, pending });
        if self.config.record_routed_prefixes {
            self.index.insert(d.slot, &keys.keys);
        }
        if let (true, Some(s)) = (self.config.sticky_sessions, session) {
            self.sessions.touch(s, d.slot);
        }
        self.round_robin_counter += 1;
    }

    /// The request computed its prompt (its first token came back): it counts as running, not waiting.
    pub fn prefill_done(&mut self, req_id: &str) -> Result<()> {
        let r =
            self.requests.get_mut(req_id).ok_or_else(|| RouterError::UnknownRequest(req_id.to_owned()))?;
        let slot = r.slot;
        let mut pending = r.pending;
        match self.replicas.get_mut(slot) {
            Some(Some(rep)) => rep.load.prefill_done(&mut pending),
            _ => unreachable_slot(),
        }
        if let Some(r) = self.requests.get_mut(req_id) {
            r.pending = pending;
        }
        Ok(())
    }

    /// The request is over (finished, aborted or failed): it leaves its replica's load.
    pub fn finish(&mut self, req_id: &str) -> Result<()> {
        let r = self.requests.remove(req_id).ok_or_else(|| RouterError::UnknownRequest(req_id.to_owned()))?;
        self.replica_mut(r.slot).load.finished(&r.pending);
        Ok(())
    }

    // -- introspection -------------------------------------------------------------------------------------

    /// The load the policies see for a replica: its last snapshot plus the requests routed since.
    pub fn load(&self, name: &str) -> Result<LoadReport> {
        Ok(self.replica(self.slot(name)?).load.effective())
    }

    pub fn num_cached_blocks(&self, name: &str) -> Result<usize> {
        Ok(self.index.num_blocks(self.slot(name)?))
    }

    /// Whether the index holds block `key` for a replica.
    pub fn is_cached(&self, name: &str, key: u64) -> Result<bool> {
        let slot = self.slot(name)?;
        Ok(self.index.holders(key) & (1 << slot) != 0)
    }

    /// The longest cached prefix of a prompt, in blocks, on every registered replica (healthy or not), in slot
    /// order.
    pub fn overlaps(&self, prompt: &Prompt<'_>) -> Result<Vec<(usize, usize)>> {
        let keys = self.hasher.keys(prompt)?;
        let set: ReplicaSet = self.replicas().fold(0, |acc, (s, _, _)| acc | (1 << s));
        let mut out = [0u32; MAX_REPLICAS];
        self.index.overlaps(&keys.keys, set, &mut out);
        Ok(slots(set).map(|s| (s, out[s] as usize)).collect())
    }

    /// The requests in flight on a replica, in the order they were routed.
    pub fn in_flight(&self, name: &str) -> Result<Vec<String>> {
        let slot = self.slot(name)?;
        let mut ids: Vec<(u64, &String)> =
            self.requests.iter().filter(|(_, r)| r.slot == slot).map(|(id, r)| (r.seq, id)).collect();
        ids.sort_unstable();
        Ok(ids.into_iter().map(|(_, id)| id.clone()).collect())
    }

    pub fn num_in_flight(&self) -> usize {
        self.requests.len()
    }

    pub fn num_sessions(&self) -> usize {
        self.sessions.len()
    }

    pub fn check_invariants(&self) -> Result<()> {
        self.index.check_invariants()?;
        for (s, _, _) in self.replicas() {
            let mine: Vec<Pending> =
                self.requests.values().filter(|r| r.slot == s).map(|r| r.pending).collect();
            self.replica(s).load.check(&mine)?;
        }
        for (id, r) in &self.requests {
            if !matches!(self.replicas.get(r.slot), Some(Some(_))) {
                return Err(RouterError::Internal(format!("request {id:?} is in flight on a free slot")));
            }
        }
        for (s, rep) in self.replicas.iter().enumerate() {
            if rep.is_none() && self.index.num_blocks(s) != 0 {
                return Err(RouterError::Internal(format!("free slot {s} still has indexed blocks")));
            }
        }
        if self.names.len() != self.replicas().count() {
            return Err(RouterError::Internal("replica names and slots disagree".into()));
        }
        if !self.sessions.check_invariants() {
            return Err(RouterError::Internal("the sticky-session table is inconsistent".into()));
        }
        Ok(())
    }
}

/// A slot that names no replica reached a lookup: a bug in the router, never the caller's doing.
#[cold]
#[allow(clippy::panic)]
fn unreachable_slot() -> ! {
    panic!("kvsched-router: a slot without a replica was looked up")
}
