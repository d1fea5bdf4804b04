//! What hosts that mirror the scheduler's state read of it (the vLLM adapter, a router), and tests: views of
//! its queues and of the prefix cache, each a fresh list, and the KV cache events recorded since the last take.
//! None of this is on the per-step hot path.

use std::sync::Arc;

use crate::error::Result;
use crate::events::KvCacheEvents;
use crate::hashing::BlockHash;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Ids of the running requests, in running order (admission order; preemption victims come from the end).
    pub fn running_req_ids(&self) -> Vec<Arc<str>> {
        self.running.iter().filter_map(|&s| self.slab.get(s).ok().map(|r| r.id.clone())).collect()
    }

    /// Ids of the requests that are not running, in the order admission would consider them: loaded requests
    /// (`kv_waiting`), then `waiting` (aging included; `sjf` residuals as they stand; FCFS before the admission
    /// window's one-step reorderings), then the parked ones (blocked, or ready since the last step) in the
    /// order they were added.
    pub fn waiting_req_ids(&self) -> Vec<Arc<str>> {
        let mut ids: Vec<Arc<str>> = self
            .kv_waiting
            .handles_in_order(&self.tenants)
            .into_iter()
            .chain(self.waiting_in_order())
            .filter_map(|h| self.slab.resolve(h).map(|r| r.id.clone()))
            .collect();
        if self.num_parked > 0 {
            let mut parked: Vec<_> = self.slab.iter().filter(|r| r.parked).collect();
            parked.sort_by_key(|r| r.add_seq);
            ids.extend(parked.iter().map(|r| r.id.clone()));
        }
        ids
    }

    /// Blocks of the request whose hash is in the prefix cache map for it (its leading full, cached blocks).
    pub fn get_num_cached_blocks(&self, req_id: &str) -> Result<u32> {
        Ok(self.get_request(req_id)?.num_cached_blocks)
    }

    /// The KV cache events recorded since the last call, in the order they happened (none unless
    /// `enable_kv_cache_events`; see `events.rs`).
    pub fn take_kv_cache_events(&mut self) -> KvCacheEvents {
        self.kv.pool.take_events()
    }

    /// The hash of every block in the prefix cache, in block id order: a hash cached in several blocks appears
    /// once per block. Replaying the KV cache events from the start reproduces it (O(num_blocks)).
    pub fn cached_block_hashes(&self) -> Vec<BlockHash> {
        self.kv.pool.cached_blocks().map(|(_, h)| *h).collect()
    }
}
