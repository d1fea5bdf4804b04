//! What hosts that mirror the scheduler's state read of it (the vLLM adapter, a router), and tests: views of
//! its queues and of the prefix cache, each a fresh list, and the KV cache events recorded since the last take.
//! None of this is on the per-step hot path.

use std::sync::Arc;

use crate::error::{Result, SchedError};
use crate::events::KvCacheEvents;
use crate::hashing::{BlockHash, ExtraKeys};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// The encoder cache's entries, by hash ascending, each with the ids of the requests referencing it (sorted,
    /// once each; empty for a freeable entry): vLLM's `EncoderCacheManager.cached`.
    pub fn encoder_cache_entries(&self) -> Vec<(u64, Vec<Arc<str>>)> {
        let mut entries: Vec<(u64, Vec<Arc<str>>)> = self.encoder.hashes().map(|h| (h, Vec::new())).collect();
        entries.sort_unstable_by_key(|e| e.0);
        for (hash, req, _) in self.encoder.references() {
            if let (Ok(k), Ok(r)) = (entries.binary_search_by_key(&hash, |e| e.0), self.slab.get(req as u32))
            {
                entries[k].1.push(r.id.clone());
            }
        }
        for e in &mut entries {
            e.1.sort_unstable();
            e.1.dedup();
        }
        entries
    }

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

    /// The block table of KV cache group `group` of a request (the primary group's is `Request::blocks`).
    pub fn get_group_block_ids(&self, req_id: &str, group: usize) -> Result<&[u32]> {
        let req = self.get_request(req_id)?;
        let num_groups = req.groups.len() + 1;
        if group >= num_groups {
            return Err(SchedError::InvalidRequest(format!(
                "group must be in [0, {num_groups}), got {group}"
            )));
        }
        let primary = self.kv.hybrid.as_deref().map_or(0, |hy| hy.primary);
        Ok(match crate::hybrid::group_slot(primary, group) {
            None => &req.blocks,
            Some(i) => &req.groups[i].blocks,
        })
    }

    /// For each block of KV cache group `group`'s table of a request, the tokens the hash it is cached under
    /// covers (vLLM's `block_hash_num_tokens`; 0 for a null block or one not cached): the end of the request's
    /// block of that hash. That is the block's own end, except for an align-mode Mamba group's prefill
    /// checkpoint under the trailing-block drop, keyed by the hash of the block below its entry until the
    /// request caches that entry, and a block of a group of larger blocks than `block_size` whose key is the
    /// prompt's tail entry inside it (the end of that hash block).
    pub fn get_block_hash_num_tokens(&self, req_id: &str, group: usize) -> Result<Vec<u32>> {
        let table = self.get_group_block_ids(req_id, group)?;
        Ok(self.kv.key_tokens(self.get_request(req_id)?, group, table))
    }

    /// Leading blocks of the request that are entered in the prefix cache.
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
        self.get_group_cached_block_ids(token_ids, cache_salt, lora_name, max_hit_tokens, 0)
    }

    /// For each full block of these tokens (hashed as a request's with these extra keys), whether the prefix
    /// cache holds a block with its hash now: block by block, not only a run from block 0 (the cache-hit cap's
    /// `cached`). Touches nothing; all false without prefix caching.
    pub fn get_cached_block_mask(
        &self,
        token_ids: &[i64],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Result<Vec<bool>> {
        let mut tokens = Vec::with_capacity(token_ids.len());
        for &t in token_ids {
            tokens.push(Self::check_token_id("token id", t)?);
        }
        let bs = self.config.kv_block_size() as usize;
        if !self.config.enable_prefix_caching {
            return Ok(vec![false; tokens.len() / bs]);
        }
        let extra =
            ExtraKeys { cache_salt: cache_salt.map(Into::into), lora_name: lora_name.map(Into::into) };
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.kv.hasher.extend_hashes(&mut hashes, &tokens, bs, &extra, &[], &mut Vec::new());
        Ok(hashes.iter().map(|h| self.kv.pool.get_cached_block(h).is_some()).collect())
    }

    /// `get_cached_block_ids` for KV cache group `group` (with `kv_cache_groups`; group 0 is the plain call): the
    /// hit every group takes together, as the same length in each group (a window's dropped blocks are null
    /// blocks). `Err` for a group the config does not have.
    pub fn get_group_cached_block_ids(
        &self,
        token_ids: &[i64],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
        max_hit_tokens: Option<u32>,
        group: usize,
    ) -> Result<Vec<u32>> {
        let num_groups = self.config.kv_cache_groups.len().max(1);
        if group >= num_groups {
            return Err(SchedError::InvalidRequest(format!(
                "group must be in [0, {num_groups}), got {group}"
            )));
        }
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
        // Hash only as far as a lookup may read (and the tokens a look-ahead hash covers after it).
        let blocks = limit / bs + self.kv.lookup_margin_blocks();
        let reach = (blocks * bs + self.kv.hasher.lookahead()).min(tokens.len());
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.kv.hasher.extend_hashes(&mut hashes, &tokens[..reach], bs, &extra, &[], &mut Vec::new());
        // find_longest_cache_hit leaves the block of the last of `n` tokens out: n = limit + 1 allows limit / bs.
        self.kv.find_longest_cache_hit(&hashes, limit as u32 + 1, &mut hits);
        if group > 0 {
            return Ok(self.kv.hybrid_hits(&hits).get(group).cloned().unwrap_or_default());
        }
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

    /// vLLM's `num_output_tokens` column (`CachedRequestData`) for each entry of the most recent step: the
    /// request's output tokens plus its output placeholders, as they were before the step added its own. Only
    /// right after `schedule()`, before any other call changes the scheduler (as `prepare_model_inputs`).
    pub fn step_num_output_tokens(&self, scheduler_id: u64, step_id: u64) -> Result<Vec<i32>> {
        let stale = || {
            SchedError::InvalidOutput(format!(
                "step_num_output_tokens needs the most recent step, right after schedule() and before any other \
                 call changes the scheduler; step {step_id} is not that step"
            ))
        };
        if scheduler_id != self.scheduler_id {
            return Err(SchedError::InvalidOutput("this output was produced by another scheduler".into()));
        }
        let rec = self.in_flight.back().ok_or_else(stale)?;
        if rec.step_id != step_id || rec.epoch != self.epoch {
            return Err(stale());
        }
        let async_scheduling = self.config.async_scheduling;
        let mut counts = Vec::with_capacity(rec.handles.len());
        for (k, &h) in rec.handles.iter().enumerate() {
            let req = self.slab.resolve(h).ok_or_else(stale)?;
            let mut placeholders = req.num_output_placeholders;
            // The step's own placeholders (asynchronous scheduling): one per sampled token and scheduled draft.
            if async_scheduling && !rec.is_prefill_chunk.get(k).copied().unwrap_or(false) {
                let added = 1 + rec.num_spec_tokens.get(k).copied().unwrap_or(0);
                placeholders = placeholders.checked_sub(added).ok_or_else(|| {
                    SchedError::Internal(format!("entry {k}: fewer output placeholders than the step added"))
                })?;
            }
            counts.push((req.num_output_tokens() + placeholders) as i32);
        }
        Ok(counts)
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
