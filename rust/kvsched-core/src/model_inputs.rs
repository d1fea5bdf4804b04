//! The flat batch layout a paged-attention runner needs for the most recent step, built in one pass without
//! per-request allocations: token ids, positions, KV slot of every scheduled token, CSR query offsets,
//! sequence lengths, a padded block table and the index of each request's last token (the one sampled).
//!
//! Under decode context parallelism a block id covers `block_size * dcp_world_size` tokens and names
//! `block_size` slots on every DCP rank; the slot mapping is then per rank, as vLLM's workers compute it
//! (`BlockTable.compute_slot_mapping`): the tokens of a block are dealt to the ranks round-robin in runs of
//! `cp_kv_cache_interleave_size`, and a token stored on another rank maps to the padding slot -1.

use crate::error::{Result, SchedError};
use crate::output::ModelInputs;
use crate::scheduler::Scheduler;

/// vLLM's padding slot id: the token's K/V is not written on this rank.
pub const PAD_SLOT_ID: i32 = -1;

impl Scheduler {
    /// The batch layout of the most recent step for DCP rank 0 (the only rank without DCP).
    pub fn prepare_model_inputs(&self, scheduler_id: u64, step_id: u64) -> Result<ModelInputs> {
        self.prepare_model_inputs_for_rank(scheduler_id, step_id, 0)
    }

    /// The batch layout of the most recent step as DCP rank `dcp_rank` sees it: everything but `slot_mapping`
    /// is the same on every rank.
    pub fn prepare_model_inputs_for_rank(
        &self,
        scheduler_id: u64,
        step_id: u64,
        dcp_rank: u32,
    ) -> Result<ModelInputs> {
        if !self.config.kv_cache_groups.is_empty() {
            return Err(SchedError::InvalidRequest(
                "prepare_model_inputs does not support kv_cache_groups (it lays out one block table)".into(),
            ));
        }
        if dcp_rank >= self.config.dcp_world_size {
            return Err(SchedError::InvalidRequest(format!(
                "dcp_rank must be in [0, dcp_world_size={}), got {dcp_rank}",
                self.config.dcp_world_size
            )));
        }
        let stale = || {
            SchedError::InvalidOutput(format!(
                "prepare_model_inputs needs the most recent step, right after schedule() and before any other \
                 call changes the scheduler; step {step_id} is not that step"
            ))
        };
        if scheduler_id != self.scheduler_id {
            return Err(SchedError::InvalidOutput("this output was produced by another scheduler".into()));
        }
        let last = self.in_flight.back().ok_or_else(stale)?;
        if last.step_id != step_id || last.epoch != self.epoch {
            return Err(stale());
        }
        // Slots per block on one rank, tokens per block id, and the rank layout inside a block.
        let bs = self.config.block_size as usize;
        let kv_bs = self.config.kv_block_size() as usize;
        let dcp = self.config.dcp_world_size as usize;
        let interleave = self.config.cp_kv_cache_interleave_size as usize;
        let rank = dcp_rank as usize;
        let n = last.handles.len();
        let total: usize = last.num_scheduled_tokens.iter().map(|&x| x as usize).sum();
        let mut mi = ModelInputs {
            input_token_ids: Vec::with_capacity(total),
            input_positions: Vec::with_capacity(total),
            slot_mapping: Vec::with_capacity(total),
            query_start_loc: Vec::with_capacity(n + 1),
            seq_lens: Vec::with_capacity(n),
            logits_indices: Vec::with_capacity(n),
            ..Default::default()
        };
        let async_scheduling = self.config.async_scheduling;
        let mut max_blocks = 0usize;
        for &h in &last.handles {
            let req = self.slab.resolve(h).ok_or_else(stale)?;
            max_blocks = max_blocks.max(req.blocks.len());
        }
        mi.max_num_blocks = max_blocks;
        mi.block_table = vec![0; n * max_blocks];
        mi.query_start_loc.push(0);
        for (i, &h) in last.handles.iter().enumerate() {
            let req = self.slab.resolve(h).ok_or_else(stale)?;
            let start = last.num_computed_tokens[i] as usize;
            let num = last.num_scheduled_tokens[i] as usize;
            let num_tokens = req.token_ids.len();
            let spec = &last.spec_token_ids
                [last.spec_token_ids_indptr[i] as usize..last.spec_token_ids_indptr[i + 1] as usize];
            for pos in start..start + num {
                let token = if pos < num_tokens {
                    req.token_ids[pos] as i32
                } else if async_scheduling {
                    // Sampled by a step still in flight (or a draft placeholder): the runner fills it in.
                    -1
                } else {
                    *spec.get(pos - num_tokens).ok_or_else(|| {
                        SchedError::InvalidOutput(format!(
                            "request {:?}: token at position {pos} is not known yet (apply the previous step's \
                             output before preparing this one)",
                            req.id
                        ))
                    })?
                };
                let block = *req.blocks.get(pos / kv_bs).ok_or_else(|| {
                    SchedError::Internal(format!("request {:?} has no block for position {pos}", req.id))
                })? as usize;
                let offset = pos % kv_bs;
                let slot = if dcp == 1 {
                    (block * bs + offset) as i32
                } else if (offset / interleave) % dcp == rank {
                    (block * bs + offset / (dcp * interleave) * interleave + offset % interleave) as i32
                } else {
                    PAD_SLOT_ID
                };
                mi.input_token_ids.push(token);
                mi.input_positions.push(pos as i32);
                mi.slot_mapping.push(slot);
            }
            let end = mi.input_token_ids.len() as i32;
            mi.query_start_loc.push(end);
            mi.logits_indices.push(end - 1);
            let seq_len = (start + num) as i32;
            mi.seq_lens.push(seq_len);
            mi.max_seq_len = mi.max_seq_len.max(seq_len);
            mi.max_query_len = mi.max_query_len.max(num as i32);
            for (k, &b) in req.blocks.iter().enumerate() {
                mi.block_table[i * max_blocks + k] = b as i32;
            }
        }
        Ok(mi)
    }
}
