//! Read-only views of the scheduler's queues for hosts that mirror its state (the vLLM adapter) and for tests.
//! Each call builds a fresh list: none of this is on the per-step hot path.

use std::sync::Arc;

use crate::error::{Result, SchedError};
use crate::hashing::{BlockHash, ExtraKeys};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Ids of the running requests, in running order (admission order; preemption victims come from the end).
    pub fn running_req_ids(&self) -> Vec<Arc<str>> {
        self.running.iter().filter_map(|&s| self.slab.get(s).ok().map(|r| r.id.clone())).collect()
    }

    /// Ids of the requests that are not running, in the order admission would consider them: loaded requests
    /// (`kv_waiting`), then `waiting`, then the parked ones (blocked, or ready since the last step) in the
    /// order they were added.
    pub fn waiting_req_ids(&self) -> Vec<Arc<str>> {
        let mut ids: Vec<Arc<str>> = [&self.kv_waiting, &self.waiting]
            .iter()
            .flat_map(|q| q.handles_in_order(&self.tenants))
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

    /// The blocks a prefix lookup of these tokens would hit now, in order (vLLM's `get_computed_blocks`): at most
    /// `max_hit_tokens` tokens' worth of full blocks (default: all but the last token, which must be computed).
    /// Touches nothing; none without prefix caching.
    pub fn get_cached_block_ids(
        &self,
        token_ids: &[i64],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
        max_hit_tokens: Option<u32>,
    ) -> Result<Vec<u32>> {
        let mut tokens = Vec::with_capacity(token_ids.len());
        for &t in token_ids {
            tokens.push(Self::check_token_id("token id", t)?);
        }
        let limit = match max_hit_tokens {
            Some(m) => (m as usize).min(tokens.len()),
            None => tokens.len().saturating_sub(1),
        };
        let mut hits = Vec::new();
        if !self.config.enable_prefix_caching || limit == 0 {
            return Ok(hits);
        }
        let extra =
            ExtraKeys { cache_salt: cache_salt.map(Into::into), lora_name: lora_name.map(Into::into) };
        let bs = self.config.kv_block_size() as usize;
        let reach = (limit / bs) * bs; // hash only as far as a hit may reach
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.kv.hasher.extend_hashes(&mut hashes, &tokens[..reach], bs, &extra, &[], &mut Vec::new());
        // find_longest_cache_hit leaves the block of the last of `n` tokens out: n = limit + 1 allows limit / bs.
        self.kv.find_longest_cache_hit(&hashes, limit as u32 + 1, &mut hits);
        Ok(hits)
    }

    /// Block `block`'s reference count: how many requests hold it (0 when free, and always for the null block
    /// 0). `Err` for an id outside the pool.
    pub fn get_block_ref_cnt(&self, block: u32) -> Result<u32> {
        let num_blocks = self.kv.pool.num_blocks();
        if block >= num_blocks {
            return Err(SchedError::InvalidRequest(format!(
                "block id {block} is outside the KV cache pool (block ids 0..{num_blocks})"
            )));
        }
        Ok(self.kv.pool.ref_cnt(block))
    }
}
