//! The bookkeeping of KV transfers through the connector (`connector.rs`): asynchronous loads (requests parked
//! in `WaitingForRemoteKvs` while their blocks fill) and delayed frees (blocks of a finished request kept while
//! the engine still receives into them or sends them).
//!
//! Invariants (checked by `Scheduler::check_invariants`): a request in `WaitingForRemoteKvs` holds blocks
//! covering its computed tokens and sits in no queue until its load is reported finished (with `park_kv_loads`;
//! without it, it sits in `kv_waiting` from its admission step on); `held` maps the id of
//! every finished request whose blocks are not yet freed to those blocks and at least one pending transfer;
//! every held block counts in its ref count like a block table's.

use std::sync::Arc;

use crate::config::KvLoadFailurePolicy;
use crate::connector::{Connector, HeldBlocks, KvConnector, KvTransferReport};
use crate::error::{Result, SchedError};
use crate::request::RequestStatus;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Sets (or with `None` removes) the KV connector. Refused while a transfer is in progress.
    pub fn set_kv_connector(&mut self, connector: Option<Box<dyn KvConnector>>) -> Result<()> {
        if self.num_loading > 0 || !self.kv_waiting.is_empty() || !self.held.is_empty() {
            return Err(SchedError::InvalidRequest(
                "the KV connector cannot be changed while KV transfers are in progress".into(),
            ));
        }
        self.connector = connector.map(Connector);
        self.epoch += 1;
        Ok(())
    }

    pub fn has_kv_connector(&self) -> bool {
        self.connector.is_some()
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
                let n = (hot.computed[slot as usize].div_ceil(bs) as usize).min(r.blocks.len());
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

    /// One transfer of a finished request is over; frees its blocks when none is left.
    fn release_held(&mut self, id: &str, recv: bool) {
        let Some(h) = self.held.get_mut(id) else { return };
        if recv {
            h.awaiting_recv = false;
        } else {
            h.awaiting_send = false;
        }
        if !h.awaiting_recv && !h.awaiting_send {
            if let Some(h) = self.held.remove(id) {
                self.kv.pool.free_blocks(&h.blocks);
            }
        }
    }

    /// At finish: asks the connector whether to delay the free, and keeps the blocks if a transfer is still in
    /// progress. Returns whether the blocks were kept (the caller frees them otherwise).
    pub(crate) fn hold_for_transfer(&mut self, slot: u32, was_loading: bool) -> Result<bool> {
        let Some(conn) = self.connector.as_mut() else { return Ok(false) };
        let (req, hot) = self.slab.get_mut_hot(slot)?;
        let n = (hot.computed[slot as usize].div_ceil(self.config.kv_block_size()) as usize)
            .min(req.blocks.len());
        let awaiting_send = conn.0.request_finished(req, &req.blocks[..n]);
        let awaiting_recv = was_loading;
        if !awaiting_send && !awaiting_recv {
            return Ok(false);
        }
        let blocks = std::mem::take(&mut req.blocks);
        req.num_cached_blocks = 0;
        self.held.insert(req.id.clone(), HeldBlocks { blocks, awaiting_recv, awaiting_send });
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
