//! The flat batch layout a paged-attention runner needs for the most recent step, built in one pass without
//! per-request allocations: token ids, positions, KV slot of every scheduled token, CSR query offsets,
//! sequence lengths, a padded block table and the index of each request's last token (the one sampled).

use crate::error::{Result, SchedError};
use crate::output::ModelInputs;
use crate::scheduler::Scheduler;

impl Scheduler {
    pub fn prepare_model_inputs(&self, scheduler_id: u64, step_id: u64) -> Result<ModelInputs> {
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
        let bs = self.config.block_size as usize;
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
                let block = *req.blocks.get(pos / bs).ok_or_else(|| {
                    SchedError::Internal(format!("request {:?} has no block for position {pos}", req.id))
                })? as usize;
                mi.input_token_ids.push(token);
                mi.input_positions.push(pos as i32);
                mi.slot_mapping.push((block * bs + pos % bs) as i32);
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
