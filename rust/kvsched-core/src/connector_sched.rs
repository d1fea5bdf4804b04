//! The bookkeeping of KV transfers through the connector (`connector.rs`): asynchronous loads (requests parked
//! in `WaitingForRemoteKvs` while their blocks fill) and delayed frees (blocks of a finished request kept while
//! the engine still receives into them or sends them).
//!
//! It also holds the free path of a request's blocks with `defer_block_free` (vLLM 0.33 with a KV consumer
//! connector and several batches in flight): blocks freed while a step in flight may still write them wait in
//! `deferred_frees` until every step scheduled before the free is applied, so a load never lands in a block a
//! running step still writes. With `defer_async_loads` as well, an asynchronous load admitted while a step is
//! in flight waits in `deferred_loads` and is registered with the connector once those steps are applied.
//!
//! Invariants (checked by `Scheduler::check_invariants`): a request in `WaitingForRemoteKvs` holds blocks
//! covering its computed tokens and sits in no queue until its load is reported finished (with `park_kv_loads`;
//! without it, it sits in `kv_waiting` from its admission step on); `held` maps the id of
//! every finished request whose blocks are not yet freed to those blocks and at least one pending transfer;
//! `deferred_frees` are in fence order, no fence past the steps scheduled; `deferred_loads` are in fence order,
//! each fence past the steps applied and not past those scheduled, each of a live request in
//! `WaitingForRemoteKvs`; every held or deferred block counts in its ref count like a block table's.

use std::sync::Arc;

use crate::config::{KvLoadFailurePolicy, CHUNKED_LOCAL, MAMBA, RING};
use crate::connector::{Connector, HeldBlocks, KvConnector, KvTransferReport};
use crate::error::{Result, SchedError};
use crate::request::RequestStatus;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Sets (or with `None` removes) the KV connector. Refused while a transfer is in progress.
    pub fn set_kv_connector(&mut self, connector: Option<Box<dyn KvConnector>>) -> Result<()> {
        if connector.is_some() && !self.config.kv_cache_groups.is_empty() {
            if !self.config.kv_connector_groups {
                return Err(SchedError::InvalidConfig(
                    "kv_cache_groups is not supported with a KV connector unless kv_connector_groups is set (its \
                     hooks then get one block table per group)"
                        .into(),
                ));
            }
            if self
                .config
                .kv_cache_groups
                .iter()
                .flatten()
                .any(|&w| w != MAMBA && w != RING && w & CHUNKED_LOCAL != 0)
            {
                return Err(SchedError::InvalidConfig(
                    "kv_cache_groups with a KV connector must be full-attention, sliding-window, Mamba and ring \
                     groups (no cross-attention or chunked-local group)"
                        .into(),
                ));
            }
        }
        if self.num_loading > 0 || !self.kv_waiting.is_empty() || !self.held.is_empty() {
            return Err(SchedError::InvalidRequest(
                "the KV connector cannot be changed while KV transfers are in progress".into(),
            ));
        }
        self.connector = connector.map(Connector);
        let record = self.connector.is_some() && self.kv.enable_caching;
        if let Some(hy) = self.kv.hybrid.as_deref_mut() {
            hy.boundary_offers = (record && hy.mamba_align && hy.windows.contains(&MAMBA)).then(Vec::new);
        }
        self.epoch += 1;
        Ok(())
    }

    /// The Mamba boundary states offered to the KV connector since the last call (vLLM's
    /// `take_boundary_state_offloads`), as `(request id, group, block, tokens)`: group by group, each group's in
    /// the order they were cached; a request's offers are withdrawn when its blocks go back to the pool. Empty
    /// unless a KV connector is set with align-mode Mamba groups and prefix caching.
    pub fn take_mamba_boundary_offers(&mut self) -> Vec<crate::hybrid::BoundaryOffer> {
        let Some(list) = self.kv.hybrid.as_deref_mut().and_then(|hy| hy.boundary_offers.as_mut()) else {
            return Vec::new();
        };
        let mut offers = std::mem::take(list);
        offers.sort_by_key(|o| o.1); // stable: each group's in caching order
        offers
    }

    pub fn has_kv_connector(&self) -> bool {
        self.connector.is_some()
    }

    /// The blocks a finished request holds for a transfer in KV cache group `group` (the table vLLM's KV cache
    /// manager still gives it: blocks that left a window at the finish are null blocks).
    pub fn get_held_block_ids(&self, req_id: &str, group: usize) -> Result<&[u32]> {
        let Some(h) = self.held.get(req_id) else {
            return Err(SchedError::UnknownRequest(format!("unknown held request id {req_id:?}")));
        };
        match h.tables.get(group) {
            Some(t) => Ok(t),
            None => Err(SchedError::InvalidRequest(format!(
                "group must be in [0, {}), got {group}",
                h.tables.len()
            ))),
        }
    }

    /// Finished requests whose blocks are still held for a transfer (vLLM keeps them in `requests`).
    pub fn num_held_kv_requests(&self) -> usize {
        self.held.len()
    }

    /// Applies what the engine reports about KV transfers, in vLLM 0.33's order: failed loads, invalid blocks,
    /// then finished loads and sends. Everything is validated first; on error nothing changes. Returns the
    /// requests finished because their load failed (policy `fail`).
    pub fn update_kv_transfers<S: AsRef<str>>(
        &mut self,
        report: KvTransferReport<'_, S>,
    ) -> Result<Vec<Arc<str>>> {
        let num_blocks = i64::from(self.config.num_blocks);
        for &b in report.invalid_block_ids {
            if !(1..num_blocks).contains(&b) {
                return Err(SchedError::InvalidRequest(format!(
                    "invalid_block_ids: block ids must be in [1, {num_blocks}), got {b}"
                )));
            }
        }
        if !report.invalid_block_ids.is_empty() && !self.config.kv_cache_groups.is_empty() {
            // vLLM refuses them too: a block id names a block of one group, not a request's tokens.
            return Err(SchedError::InvalidRequest(
                "invalid_block_ids are not supported with kv_cache_groups (report the requests in failed_recving)"
                    .into(),
            ));
        }
        let loading = |s: &Self, id: &str, what: &str, held_ok: fn(&HeldBlocks) -> bool| -> Result<()> {
            if let Some(&slot) = s.ids.get(id) {
                let r = s.slab.get(slot)?;
                let ok = r.status == RequestStatus::WaitingForRemoteKvs
                    && !(what == "finished_recving" && r.kv_load_done);
                return if ok {
                    Ok(())
                } else {
                    Err(SchedError::InvalidRequest(format!(
                        "{what}: request {id:?} has no KV load in progress (status {:?})",
                        r.status
                    )))
                };
            }
            match s.held.get(id) {
                Some(h) if held_ok(h) => Ok(()),
                Some(_) => Err(SchedError::InvalidRequest(format!(
                    "{what}: finished request {id:?} has no such transfer in progress"
                ))),
                None => Err(SchedError::UnknownRequest(format!("{what}: unknown request id {id:?}"))),
            }
        };
        for id in report.finished_recving {
            loading(self, id.as_ref(), "finished_recving", |h| h.awaiting_recv)?;
        }
        for id in report.failed_recving {
            loading(self, id.as_ref(), "failed_recving", |h| h.awaiting_recv)?;
        }
        for id in report.finished_sending {
            let id = id.as_ref();
            match self.held.get(id) {
                Some(h) if h.awaiting_send => {}
                Some(_) => {
                    return Err(SchedError::InvalidRequest(format!(
                        "finished_sending: request {id:?} is not being sent"
                    )))
                }
                None if self.ids.contains_key(id) => {
                    return Err(SchedError::InvalidRequest(format!(
                        "finished_sending: request {id:?} has not finished"
                    )))
                }
                None => {
                    return Err(SchedError::UnknownRequest(format!(
                        "finished_sending: unknown request id {id:?}"
                    )))
                }
            }
        }

        // Validated: apply.
        self.epoch += 1;
        let bs = self.config.kv_block_size();
        let fail = self.config.kv_load_failure_policy == KvLoadFailurePolicy::Fail;
        let mut failed: Vec<u32> = Vec::new();
        for id in report.failed_recving {
            let Some(&slot) = self.ids.get(id.as_ref()) else { continue };
            let (r, hot) = self.slab.get_mut_hot(slot)?;
            if fail {
                if !failed.contains(&slot) {
                    failed.push(slot);
                }
            } else {
                hot.computed[slot as usize] = 0;
                r.kv_load_failed = true;
            }
        }
        // Each request's tokens in the oldest step in flight (the step these blocks are reported with): vLLM
        // scans the blocks of the computed tokens less those, for loading and running requests alike.
        let mut in_step: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        if !report.invalid_block_ids.is_empty() {
            if let Some(rec) = self.in_flight.front() {
                for (h, &n) in rec.handles.iter().zip(&rec.num_scheduled_tokens) {
                    in_step.insert(h.slot, n as u32);
                }
            }
        }
        if !report.invalid_block_ids.is_empty() {
            let invalid: std::collections::HashSet<u32> =
                report.invalid_block_ids.iter().map(|&b| b as u32).collect();
            // In the order the requests were added (it decides the order of `fail` finishes).
            let mut loading: Vec<(u64, u32)> = self
                .slab
                .iter()
                .filter(|r| r.status == RequestStatus::WaitingForRemoteKvs)
                .map(|r| (r.add_seq, r.handle.slot))
                .collect();
            loading.sort_unstable();
            for (_, slot) in loading {
                let (r, hot) = self.slab.get_mut_hot(slot)?;
                let done =
                    hot.computed[slot as usize].saturating_sub(in_step.get(&slot).copied().unwrap_or(0));
                let n = (done.div_ceil(bs) as usize).min(r.blocks.len());
                if let Some(idx) = r.blocks[..n].iter().position(|b| invalid.contains(b)) {
                    if fail {
                        if !failed.contains(&slot) {
                            failed.push(slot);
                        }
                    } else {
                        hot.computed[slot as usize] = idx as u32 * bs;
                        r.kv_load_failed = true;
                    }
                }
            }
        }
        if !report.invalid_block_ids.is_empty() {
            self.roll_back_synchronous_loads(report.invalid_block_ids, &in_step, fail, &mut failed)?;
        }
        let mut errored = Vec::with_capacity(failed.len());
        for &slot in &failed {
            errored.push(self.finish(slot, RequestStatus::FinishedError)?);
        }
        if !failed.is_empty() {
            self.remove_finished_from_queues(true);
        }
        for id in report.finished_recving {
            let id = id.as_ref();
            if let Some(&slot) = self.ids.get(id) {
                let r = self.slab.get_mut(slot)?;
                if r.status == RequestStatus::WaitingForRemoteKvs && !r.kv_load_done {
                    r.kv_load_done = true;
                    // A request waiting in `kv_waiting` (`park_kv_loads` false) keeps its place there.
                    if r.parked {
                        self.newly_ready.push(r.handle);
                    }
                }
            } else {
                self.release_held(id, true);
            }
        }
        for id in report.finished_sending {
            self.release_held(id.as_ref(), false);
        }
        Ok(errored)
    }

    /// Invalid blocks among the computed blocks of running requests (vLLM's synchronous loads, which its
    /// `_handle_invalid_blocks` rolls back): `done` is a request's computed count less its tokens of the oldest
    /// step in flight (the step whose output the engine reports these blocks with); its first `ceil(done / bs)`
    /// blocks are scanned. A block named invalid is recomputed by the first running request (in `running`
    /// order) that holds it there: that request's computed count is cut to the start of its first such block
    /// not already claimed by an earlier request. A request whose invalid blocks were all claimed keeps `done`
    /// (only the tokens of that step are dropped). Every affected request's output of that step is dropped by
    /// the next `update_from_output`. Policy `fail`: the claimed block and every block after it in the
    /// request's table leave the prefix cache, and the affected requests are added to `failed`.
    fn roll_back_synchronous_loads(
        &mut self,
        invalid: &[i64],
        in_step: &std::collections::HashMap<u32, u32>,
        fail: bool,
        failed: &mut Vec<u32>,
    ) -> Result<()> {
        let invalid: std::collections::HashSet<u32> = invalid.iter().map(|&b| b as u32).collect();
        let bs = self.config.kv_block_size();
        let mut claimed: std::collections::HashSet<u32> = std::collections::HashSet::new();
        let mut evict: Vec<u32> = Vec::new();
        let mut skipped = Vec::new();
        for i in 0..self.running.len() {
            let slot = self.running[i];
            let (r, hot) = self.slab.get_mut_hot(slot)?;
            let s = slot as usize;
            let done = hot.computed[s].saturating_sub(in_step.get(&slot).copied().unwrap_or(0));
            let n = (done.div_ceil(bs) as usize).min(r.blocks.len());
            let mut affected = false;
            let mut cut = false;
            for (idx, &b) in r.blocks[..n].iter().enumerate() {
                if !invalid.contains(&b) {
                    continue;
                }
                affected = true;
                if !claimed.insert(b) || cut {
                    continue;
                }
                cut = true;
                hot.computed[s] = idx as u32 * bs;
                if fail {
                    evict.extend_from_slice(&r.blocks[idx..]);
                }
            }
            if !affected {
                continue;
            }
            if !cut {
                hot.computed[s] = done;
            }
            hot.sync(s, r);
            skipped.push(r.handle);
            if fail && !failed.contains(&slot) {
                failed.push(slot);
            }
        }
        for b in evict {
            self.kv.pool.evict_cached(b);
        }
        if let Some(rec) = self.in_flight.front_mut() {
            rec.kv_skipped.extend(skipped);
        }
        Ok(())
    }

    /// Takes each block that carries a hash out of the prefix cache, in the order given (vLLM's
    /// `KVCacheManager.evict_blocks`); the blocks stay with their holders. Block ids must be in
    /// `[1, num_blocks)`; on error nothing changes.
    pub fn evict_cached_blocks(&mut self, block_ids: &[i64]) -> Result<()> {
        let num_blocks = i64::from(self.config.num_blocks);
        if let Some(&b) = block_ids.iter().find(|&&b| !(1..num_blocks).contains(&b)) {
            return Err(SchedError::InvalidRequest(format!(
                "evict_cached_blocks: block ids must be in [1, {num_blocks}), got {b}"
            )));
        }
        if !block_ids.is_empty() && !self.config.kv_cache_groups.is_empty() {
            return Err(SchedError::InvalidRequest(
                "evict_cached_blocks is not supported with kv_cache_groups (a block id names a block of one group)"
                    .into(),
            ));
        }
        for &b in block_ids {
            self.kv.pool.evict_cached(b as u32);
        }
        self.epoch += 1;
        Ok(())
    }

    /// One transfer of a finished request is over; frees its blocks when none is left (deferred while the
    /// newest step that scheduled the request is in flight).
    fn release_held(&mut self, id: &str, recv: bool) {
        let Some(h) = self.held.get_mut(id) else { return };
        if recv {
            h.awaiting_recv = false;
        } else {
            h.awaiting_send = false;
        }
        if !h.awaiting_recv && !h.awaiting_send {
            if let Some(h) = self.held.remove(id) {
                self.kv.drop_boundary_offers(id);
                for w in &h.window {
                    self.kv.pool.free_blocks(w);
                }
                let in_flight = self.config.defer_block_free
                    && (h
                        .last_step
                        .is_some_and(|step| self.in_flight.front().is_some_and(|f| f.step_id <= step))
                        || h.load_fence.is_some_and(|fence| fence > self.processed_step_seq));
                if in_flight {
                    self.defer_free(h.tables.concat());
                } else {
                    for t in &h.tables {
                        self.kv.pool.free_blocks(t);
                    }
                }
            }
        }
    }

    /// With `kv_connector_groups`: frees now, group by group, the blocks that left a window at the finish of
    /// the held request `id` (vLLM frees them at the finish; a connector that answers `request_finished` only
    /// after the core call, as `kvsched.vllm` does, calls this for a request it keeps). Nothing to free: no-op.
    pub fn free_held_window_blocks(&mut self, id: &str) -> Result<()> {
        let Some(h) = self.held.get_mut(id) else {
            return Err(SchedError::UnknownRequest(format!("unknown held request id {id:?}")));
        };
        let window = std::mem::take(&mut h.window);
        for w in &window {
            self.kv.pool.free_blocks(w);
        }
        self.epoch += 1;
        Ok(())
    }

    /// Frees the blocks of the live request in `slot` (vLLM's `_free_request_blocks`): now, or with
    /// `defer_block_free` while a step in flight scheduled it, once every step scheduled so far is applied.
    /// `after_in_flight`: the request must also wait for every step now in flight (a deferred load, whose
    /// blocks a step in flight may still read, vLLM's `last_sched_seq` set at its admission).
    pub(crate) fn free_request_blocks(&mut self, slot: u32, after_in_flight: bool) -> Result<()> {
        // (A request can hold tokens in flight with no step in flight only while `fail_step` aborts it.)
        let defer = self.config.defer_block_free
            && (after_in_flight
                || (self.slab.hot.in_flight[slot as usize] > 0 && !self.in_flight.is_empty()));
        let req = self.slab.get_mut(slot)?;
        if defer {
            // Every group's table, in group order, as one list (vLLM's `pop_blocks_for_free`).
            let id = req.id.clone();
            let blocks = self.kv.take_tables(req).concat();
            self.kv.drop_boundary_offers(&id);
            self.defer_free(blocks);
        } else {
            self.kv.free(req);
        }
        Ok(())
    }

    /// Queues `blocks` (a table, freed deepest first when their turn comes) behind the steps scheduled so far.
    fn defer_free(&mut self, blocks: Vec<u32>) {
        if !blocks.is_empty() {
            self.deferred_frees.push_back((self.sched_step_seq, blocks));
        }
    }

    /// A step was applied (or failed): with tokens scheduled it counts, and the deferred frees whose fence it
    /// reaches go back to the pool, in the order they were deferred (vLLM's `_drain_deferred_frees`).
    pub(crate) fn on_step_applied(&mut self, num_entries: usize) {
        if num_entries == 0 {
            return;
        }
        self.processed_step_seq += 1;
        while self.deferred_frees.front().is_some_and(|(fence, _)| *fence <= self.processed_step_seq) {
            if let Some((_, blocks)) = self.deferred_frees.pop_front() {
                self.kv.pool.free_blocks(&blocks);
            }
        }
        self.register_deferred_loads();
    }

    /// Registers the deferred loads whose fence is reached with the connector, in admission order, and counts
    /// their connector prefix-cache stats then (vLLM's `_drain_deferred_loads`).
    fn register_deferred_loads(&mut self) {
        while self.deferred_loads.front().is_some_and(|d| d.fence <= self.processed_step_seq) {
            let Some(d) = self.deferred_loads.pop_front() else { break };
            let (Some(conn), Some(req)) = (self.connector.as_mut(), self.slab.resolve(d.handle)) else {
                continue;
            };
            let tables = self.config.kv_connector_groups.then(|| self.kv.group_tables(req));
            conn.after_alloc(req, tables.as_ref(), d.num_external_tokens);
            if let Some((queries, hits)) = d.queries {
                self.counters.connector_prefix_cache_queries += queries;
                self.counters.connector_prefix_cache_hits += hits;
            }
        }
    }

    /// Forgets the deferred load of the request in `slot` (it finished before its load was registered, so no
    /// transfer will report it over); returns whether it had one.
    pub(crate) fn take_deferred_load(&mut self, slot: u32) -> Option<u64> {
        let i = self.deferred_loads.iter().position(|d| d.handle.slot == slot)?;
        self.deferred_loads.remove(i).map(|d| d.fence)
    }

    /// vLLM's `_request_blocks_can_be_freed` for a preemption victim: with `defer_block_free`, not while a step
    /// in flight scheduled it (`in_step` of its in-flight tokens belong to the step being built, not in flight
    /// yet), since its blocks would come back only once that step is applied and the allocation would still
    /// fail. The allocation then gives up for this step instead of preempting.
    pub(crate) fn victim_blocks_can_be_freed(&self, victim: u32, in_step: u32) -> bool {
        !self.config.defer_block_free || self.slab.hot.in_flight[victim as usize] <= in_step
    }

    /// vLLM's `has_pending_block_frees` of the connector (false without one).
    pub(crate) fn connector_has_pending_block_frees(&mut self) -> bool {
        self.connector.as_mut().is_some_and(|c| c.0.has_pending_block_frees())
    }

    /// Turns `defer_block_free` on or off from now on (frees already deferred keep their fence).
    pub fn set_defer_block_free(&mut self, on: bool) -> Result<()> {
        if on && !self.config.kv_cache_groups.is_empty() && !self.config.kv_connector_groups {
            return Err(SchedError::InvalidConfig(
                "kv_cache_groups is not supported with defer_block_free".into(),
            ));
        }
        self.config.defer_block_free = on;
        self.epoch += 1;
        Ok(())
    }

    /// Turns `defer_async_loads` on or off from now on (loads already deferred keep their fence).
    pub fn set_defer_async_loads(&mut self, on: bool) {
        self.config.defer_async_loads = on;
        self.epoch += 1;
    }

    /// Requests whose asynchronous load waits for the steps in flight before it is registered with the
    /// connector (`defer_async_loads`), in the order they will be registered.
    pub fn deferred_load_ids(&self) -> Vec<Arc<str>> {
        self.deferred_loads.iter().filter_map(|d| self.slab.resolve(d.handle).map(|r| r.id.clone())).collect()
    }

    /// The deferred frees (vLLM's `deferred_frees`): each fence (the non-empty steps scheduled at the free) with
    /// its blocks in the order they go back, oldest first.
    pub fn deferred_frees(&self) -> Vec<(u64, Vec<u32>)> {
        self.deferred_frees
            .iter()
            .map(|(fence, blocks)| (*fence, blocks.iter().rev().copied().collect()))
            .collect()
    }

    /// Non-empty steps scheduled and applied so far (vLLM's `sched_step_seq`, `processed_step_seq`).
    pub fn step_seqs(&self) -> (u64, u64) {
        (self.sched_step_seq, self.processed_step_seq)
    }

    /// Blocks whose free waits for steps in flight (`defer_block_free`), in the order they go back.
    pub fn deferred_free_block_ids(&self) -> Vec<u32> {
        self.deferred_frees.iter().flat_map(|(_, blocks)| blocks.iter().rev().copied()).collect()
    }

    /// At finish: asks the connector whether to delay the free, and keeps the blocks if a transfer is still in
    /// progress. Returns whether the blocks were kept (the caller frees them otherwise).
    /// `load_fence`: its asynchronous load was never registered (the non-empty steps scheduled at its admission);
    /// its blocks wait until that many steps are applied.
    pub(crate) fn hold_for_transfer(
        &mut self,
        slot: u32,
        was_loading: bool,
        load_fence: Option<u64>,
    ) -> Result<bool> {
        let Some(conn) = self.connector.as_mut() else { return Ok(false) };
        let (req, hot) = self.slab.get_mut_hot(slot)?;
        let computed = hot.computed[slot as usize];
        let mut window = Vec::new();
        let awaiting_send = if self.config.kv_connector_groups {
            // vLLM's `_connector_finished`: the blocks that left a window of the processed tokens leave the
            // tables first (freed below unless the request's blocks are held).
            window = self.kv.take_all_skipped(req, computed.saturating_sub(hot.in_flight[slot as usize]));
            let tables = self.kv.computed_tables(req, computed);
            conn.0.request_finished_groups(req, &tables)
        } else {
            // The blocks of the computed tokens counted in the spec's block size, as vLLM clips them (under
            // decode context parallelism a block id covers `dcp_world_size` times that: more blocks stay).
            let n = (computed.div_ceil(self.config.block_size) as usize).min(req.blocks.len());
            conn.0.request_finished(req, &req.blocks[..n])
        };
        let awaiting_recv = was_loading;
        if !awaiting_send && !awaiting_recv {
            for w in &window {
                self.kv.pool.free_blocks(w);
            }
            return Ok(false);
        }
        let tables = self.kv.take_tables(req);
        let handle = req.handle;
        let last_step = if load_fence.is_some() {
            None
        } else if hot.in_flight[slot as usize] > 0 {
            self.in_flight.iter().rev().find(|r| r.handles.contains(&handle)).map(|r| r.step_id)
        } else {
            None
        };
        self.held.insert(
            req.id.clone(),
            HeldBlocks { tables, window, awaiting_recv, awaiting_send, last_step, load_fence },
        );
        self.slab.sync(slot);
        Ok(true)
    }

    /// Queues the blocked requests that became ready since the last step, in the order they were added:
    /// grammar-ready ones at the front of `waiting`, loaded ones at the back of `kv_waiting`.
    pub(crate) fn queue_newly_ready(&mut self) -> Result<()> {
        let mut ready = std::mem::take(&mut self.newly_ready);
        ready.retain(|h| self.slab.resolve(*h).is_some());
        ready.sort_by_key(|h| self.slab.resolve(*h).map_or(0, |r| r.add_seq));
        for &h in ready.iter().rev() {
            let req = self.slab.get_mut(h.slot)?;
            if req.status == RequestStatus::WaitingForGrammar && req.parked {
                req.parked = false;
                self.num_parked -= 1;
                let key = Self::order_key(self.config.policy, req);
                self.waiting.push_preempted(h, key);
                self.enter_waiting(h.slot)?;
            }
        }
        for &h in &ready {
            let req = self.slab.get_mut(h.slot)?;
            if req.status == RequestStatus::WaitingForRemoteKvs && req.parked {
                req.parked = false;
                self.num_parked -= 1;
                self.num_loading -= 1;
                let key = Self::order_key(self.config.policy, req);
                self.kv_waiting.push(h, key);
            }
        }
        Ok(())
    }
}

// The cache-hit cap (`hit_cap.rs`), set like the connectors.
impl Scheduler {
    /// Sets (or with `None` removes) the cache-hit cap. It applies from the next admission.
    pub fn set_cache_hit_cap(&mut self, cap: Option<Box<dyn crate::hit_cap::CacheHitCap>>) {
        self.hit_cap = cap.map(crate::hit_cap::HitCap);
        self.epoch += 1;
    }

    /// Whether a cache-hit cap is set.
    pub fn has_cache_hit_cap(&self) -> bool {
        self.hit_cap.is_some()
    }
}
