//! The KV connector, scheduler side: the hooks of vLLM's `KVConnectorBase_V1` (scheduler role) the core calls,
//! what the engine reports about KV transfers, and the blocks kept for a transfer still in progress.
//! `connector_sched.rs` holds the scheduler's bookkeeping of the transfers.
//!
//! The core knows a connector only as a `KvConnector` trait object, so it stays free of Python: the binding
//! wraps a Python object behind it. With no connector set, the step loop never calls a hook.

use std::collections::HashMap;
use std::sync::Arc;

use crate::request::Request;

/// The hooks the scheduler calls (vLLM's `KVConnectorBase_V1`, scheduler role). Called only when a connector
/// is set. A hook cannot fail from the core's point of view: an implementation that hits an error answers
/// conservatively (no external tokens, no delayed free) and reports the error its own way.
pub trait KvConnector: Send + Sync {
    /// At admission of a request with nothing computed yet, after the local prefix hit (`num_computed_tokens`,
    /// a multiple of the block size): how many more tokens the connector can supply, and whether they load
    /// asynchronously. `None`: the connector cannot tell yet; the request is skipped this step.
    fn get_num_new_matched_tokens(&mut self, req: &Request, num_computed_tokens: u32) -> Option<(u32, bool)>;

    /// After a successful allocation at admission: `req.blocks` is the whole block table; the first
    /// `num_computed_tokens - num_external_tokens` tokens are local hits, the next `num_external_tokens` are to
    /// be loaded by the connector.
    fn update_state_after_alloc(&mut self, req: &Request, num_external_tokens: u32);

    /// With `defer_async_loads`, instead of `update_state_after_alloc` at the admission of an asynchronous load
    /// while a step is in flight: the request holds its blocks and waits for its load, which is registered
    /// (`update_state_after_alloc`, same arguments) once the steps in flight at its admission are applied.
    fn load_deferred(&mut self, _req: &Request, _num_external_tokens: u32) {}

    /// At the allocation of an asynchronous load (`get_num_new_matched_tokens` answered external tokens to load
    /// asynchronously) when new attention blocks are zeroed (a Mamba group, `SchedulerOutput::zero_block_ids`):
    /// the KV cache groups the load writes (vLLM's `get_loaded_kv_cache_group_ids`); the blocks of the loaded
    /// tokens there stay out of the blocks to zero. `None` (the default): every group.
    fn loaded_groups(&mut self, _req: &Request) -> Option<Vec<usize>> {
        None
    }

    /// With `SchedulerConfig::divergent_local_hits`, at an admission whose local hit diverged across the groups and
    /// to which the connector added no tokens: the hit every group agrees on, `num_local_tokens`, replaces the
    /// hit it was asked with (`get_num_new_matched_tokens` is not asked again).
    fn local_hit_replaced(&mut self, _req: &Request, _num_local_tokens: u32) {}

    /// When a request finishes (any reason), before its blocks are freed: `block_ids` are the blocks holding its
    /// computed tokens. `true`: the engine is sending them, free them only when it reports the send finished.
    fn request_finished(&mut self, req: &Request, block_ids: &[u32]) -> bool;

    /// With `kv_connector_groups` (vLLM's `SupportsHMA`), instead of `update_state_after_alloc`: `tables` are
    /// every KV cache group's blocks, in group order, `key_tokens` per group, for each of its table's blocks, the
    /// tokens of the request's hash it is cached under (`Scheduler::get_block_hash_num_tokens`), 0 for a block not
    /// in the prefix cache (null blocks, blocks not computed or not entered, the blocks sparse retention or a
    /// window among groups of different block sizes leave out, which need not lead the table). By default the
    /// first table's hook.
    fn update_state_after_alloc_groups(
        &mut self,
        req: &Request,
        _tables: &[&[u32]],
        _key_tokens: &[Vec<u32>],
        num_external_tokens: u32,
    ) {
        self.update_state_after_alloc(req, num_external_tokens);
    }

    /// With `kv_connector_groups`, instead of `load_deferred`: `tables` as in `update_state_after_alloc_groups`.
    fn load_deferred_groups(&mut self, req: &Request, _tables: &[&[u32]], num_external_tokens: u32) {
        self.load_deferred(req, num_external_tokens);
    }

    /// With `kv_connector_groups` (vLLM's `request_finished_all_groups`), instead of `request_finished`: each
    /// group's blocks holding the computed tokens, in group order (a window's blocks that left the window of the
    /// processed tokens already freed, null blocks in their place). By default `request_finished` of the first.
    fn request_finished_groups(&mut self, req: &Request, tables: &[Vec<u32>]) -> bool {
        self.request_finished(req, tables.first().map_or(&[][..], |t| &t[..]))
    }

    /// When a running request's allocation fails and a victim would be preempted: `true` when transfers in
    /// progress will release blocks, so the scheduler gives up on the allocation for this step instead of
    /// preempting (vLLM's `has_pending_block_frees`).
    fn has_pending_block_frees(&mut self) -> bool {
        false
    }
}

/// Every KV cache group's block table in group order, with the tokens of each block's cache key, 0 for a block not
/// in the prefix cache (`update_state_after_alloc_groups`).
pub(crate) type GroupTables<'a> = (Vec<&'a [u32]>, Vec<Vec<u32>>);

/// A connector in the scheduler (a newtype so the scheduler can stay `Debug`).
pub(crate) struct Connector(pub Box<dyn KvConnector>);

impl Connector {
    /// `update_state_after_alloc` (with `tables`, `kv_connector_groups`: its per-group form).
    pub(crate) fn after_alloc(
        &mut self,
        req: &Request,
        tables: Option<&GroupTables<'_>>,
        num_external_tokens: u32,
    ) {
        match tables {
            Some((t, c)) => self.0.update_state_after_alloc_groups(req, t, c, num_external_tokens),
            None => self.0.update_state_after_alloc(req, num_external_tokens),
        }
    }

    /// `load_deferred` (with `tables`: its per-group form).
    pub(crate) fn deferred(
        &mut self,
        req: &Request,
        tables: Option<&GroupTables<'_>>,
        num_external_tokens: u32,
    ) {
        match tables {
            Some((t, _)) => self.0.load_deferred_groups(req, t, num_external_tokens),
            None => self.0.load_deferred(req, num_external_tokens),
        }
    }
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvConnector")
    }
}

/// The blocks of a finished request kept for a transfer still in progress.
#[derive(Clone, Debug)]
pub(crate) struct HeldBlocks {
    /// One table per KV cache group, in group order (one without groups).
    pub tables: Vec<Vec<u32>>,
    /// With `kv_connector_groups`: per group, the blocks that left a window at the finish (null blocks in
    /// `tables`), freed before the tables at the release, or earlier by `free_held_window_blocks`.
    pub window: Vec<Vec<u32>>,
    /// It finished (aborted, or failed with policy `fail`) while its load was in progress.
    pub awaiting_recv: bool,
    /// The connector asked to delay the free (`request_finished` returned `true`).
    pub awaiting_send: bool,
    /// The newest step in flight that scheduled the request when it finished (with `defer_block_free` at the
    /// release, its blocks wait in the deferred frees until that step is applied); `None` when none was.
    pub last_step: Option<u64>,
    /// It finished while its asynchronous load was deferred (never registered): the non-empty steps scheduled at
    /// its admission (vLLM sets `last_sched_seq` there). With `defer_block_free` the release waits until that many
    /// steps are applied, not for the steps in flight at the finish.
    pub load_fence: Option<u64>,
}

/// An asynchronous load admitted while a step was in flight, registered with the connector once `fence` (the
/// non-empty steps scheduled at its admission) steps are applied (`defer_async_loads`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeferredLoad {
    pub fence: u64,
    pub handle: crate::request::ReqHandle,
    pub num_external_tokens: u32,
    /// The connector prefix-cache query and hit tokens it records once registered (`None` for a request that
    /// had tokens computed before its admission: no lookup).
    pub queries: Option<(u64, u64)>,
}

/// What the engine reports about KV transfers (vLLM's `KVConnectorOutput`).
#[derive(Clone, Copy, Debug, Default)]
pub struct KvTransferReport<'a, S: AsRef<str>> {
    /// Requests whose asynchronous load finished (successfully or not).
    pub finished_recving: &'a [S],
    /// Finished requests whose blocks were being sent: free them now.
    pub finished_sending: &'a [S],
    /// Requests whose whole load failed.
    pub failed_recving: &'a [S],
    /// Blocks whose load failed.
    pub invalid_block_ids: &'a [i64],
}

pub(crate) type Held = HashMap<Arc<str>, HeldBlocks>;
