//! What one step hands out (`SchedulerOutput`), what applying a step's sampled tokens reports
//! (`UpdateResult`), and the flat batch layout a paged-attention runner consumes (`ModelInputs`).
//! Everything is struct-of-arrays: per-request data is aligned with `handles`, ragged data is CSR
//! (`values` + `_indptr`).

use std::sync::Arc;

use crate::request::{FinishReason, ReqHandle};

#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    /// Unique per scheduler instance; outputs carry it so one scheduler never applies another's step.
    pub scheduler_id: u64,
    pub step_id: u64,
    /// Scheduled requests: running ones first (phase A), then admitted ones (phase B).
    pub handles: Vec<ReqHandle>,
    pub num_scheduled_tokens: Vec<i32>,
    /// Tokens already in the KV cache before this step (prefix hits included).
    pub num_computed_tokens: Vec<i32>,
    /// Indices into `handles` of requests scheduled for the first time.
    pub new_reqs: Vec<u32>,
    /// Indices into `handles` of requests resumed after preemption.
    pub resumed_reqs: Vec<u32>,
    /// CSR aligned with `handles`: the whole block table for new/resumed requests, appended blocks otherwise.
    pub new_block_ids: Vec<i32>,
    pub new_block_ids_indptr: Vec<i32>,
    /// With several KV cache groups: every group but the primary one (`primary_group`, whose ids are
    /// `new_block_ids`), in group order, each laid out as `new_block_ids`, with its CSR offsets in
    /// `group_new_block_ids_indptr` (equal to `new_block_ids_indptr` for every group but a cross-attention or
    /// Mamba one). Empty with one group.
    pub group_new_block_ids: Vec<Vec<i32>>,
    pub group_new_block_ids_indptr: Vec<Vec<i32>>,
    /// With several KV cache groups: the primary group (the first that is not Mamba, a ring or a replayed
    /// window), whose ids are `new_block_ids`. 0 with one group.
    pub primary_group: usize,
    /// With a Mamba group: every attention-group block this `schedule()` allocated, group by group in group
    /// order, each group's in allocation order (vLLM's `new_block_ids_to_zero`; blocks of a request preempted
    /// later in the step included). Empty otherwise.
    pub zero_block_ids: Vec<i32>,
    /// With prefix hits inside a block (`SchedulerConfig::partial_hit_unit`): block copies the runner makes
    /// before the forward pass, as (source, destination) pairs, group by group (vLLM's `kv_cache_block_copies`).
    /// Empty otherwise.
    pub kv_cache_block_copies: Vec<(u32, u32)>,
    /// CSR aligned with `handles`: draft tokens scheduled for verification.
    pub spec_token_ids: Vec<i32>,
    pub spec_token_ids_indptr: Vec<i32>,
    pub total_num_scheduled_tokens: u64,
    /// Requests preempted in this step (they are waiting again).
    pub preempted: Vec<ReqHandle>,
    /// Ids of requests preempted outside `schedule()` since the previous step (`reset_prefix_cache` with
    /// `reset_running_requests`), reported before `preempted`, even if they finished since.
    pub preempted_before_step: Vec<Arc<str>>,
    /// Ids of requests finished (any reason) since the previous step.
    pub finished_req_ids: Vec<Arc<str>>,
    /// Copies the runner makes before this step's forward pass, first all of `swap_out` (GPU block, CPU
    /// block), then all of `swap_in` (CPU block, GPU block): flattened pairs.
    pub swap_out: Vec<i32>,
    pub swap_in: Vec<i32>,
    /// CSR aligned with `handles`: indices (into the request's encoder inputs) of the inputs whose encoder the
    /// runner computes in this step, ascending per request. Both vectors are empty when the step computes no
    /// encoder input (the Python binding then shows `num_reqs + 1` zeros).
    pub scheduled_encoder_inputs: Vec<i32>,
    pub scheduled_encoder_inputs_indptr: Vec<i32>,
    /// CSR aligned with `handles`, like `scheduled_encoder_inputs`: the inputs whose encoder output the EC
    /// connector loads in this step (allocated in the encoder cache, not computed). Empty without loads.
    pub scheduled_encoder_loads: Vec<i32>,
    pub scheduled_encoder_loads_indptr: Vec<i32>,
    /// Encoder-cache entries evicted since the previous step: the runner drops their outputs.
    pub free_encoder_hashes: Vec<u64>,
    /// No entry is a prefill chunk or carries drafts: each samples exactly one token (a host mirroring the
    /// requests' state can then skip the per-entry chunk and draft checks).
    pub one_token_each: bool,
}

impl SchedulerOutput {
    pub fn num_reqs(&self) -> usize {
        self.handles.len()
    }

    /// Empties the output as `default()` builds it, keeping its vectors' capacity (`Scheduler::recycle_output`).
    pub(crate) fn reset(&mut self) {
        // Every field by name: a new field does not compile until it is reset here too.
        let SchedulerOutput {
            scheduler_id,
            step_id,
            handles,
            num_scheduled_tokens,
            num_computed_tokens,
            new_reqs,
            resumed_reqs,
            new_block_ids,
            new_block_ids_indptr,
            group_new_block_ids,
            group_new_block_ids_indptr,
            primary_group,
            zero_block_ids,
            kv_cache_block_copies,
            spec_token_ids,
            spec_token_ids_indptr,
            total_num_scheduled_tokens,
            preempted,
            preempted_before_step,
            finished_req_ids,
            swap_out,
            swap_in,
            scheduled_encoder_inputs,
            scheduled_encoder_inputs_indptr,
            scheduled_encoder_loads,
            scheduled_encoder_loads_indptr,
            free_encoder_hashes,
            one_token_each,
        } = self;
        (*scheduler_id, *step_id, *total_num_scheduled_tokens) = (0, 0, 0);
        *one_token_each = false;
        *primary_group = 0;
        zero_block_ids.clear();
        kv_cache_block_copies.clear();
        handles.clear();
        preempted.clear();
        preempted_before_step.clear();
        finished_req_ids.clear();
        free_encoder_hashes.clear();
        group_new_block_ids.clear();
        group_new_block_ids_indptr.clear();
        for v in [
            num_scheduled_tokens,
            num_computed_tokens,
            new_block_ids,
            new_block_ids_indptr,
            spec_token_ids,
            spec_token_ids_indptr,
            swap_out,
            swap_in,
            scheduled_encoder_inputs,
            scheduled_encoder_inputs_indptr,
            scheduled_encoder_loads,
            scheduled_encoder_loads_indptr,
        ] {
            v.clear();
        }
        new_reqs.clear();
        resumed_reqs.clear();
    }
}

/// The scheduler's own record of an in-flight step, used to validate and apply its output.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepRecord {
    pub step_id: u64,
    /// `Scheduler::epoch` right after this step was scheduled (`prepare_model_inputs` requires it unchanged).
    pub epoch: u64,
    pub handles: Vec<ReqHandle>,
    /// `num_finished_reqs` when the step was scheduled: unchanged means every handle is still live.
    pub num_finished_at_schedule: u64,
    pub is_prefill_chunk: Vec<bool>,
    pub num_spec_tokens: Vec<u32>,
    /// No entry is a prefill chunk or carries drafts: each must receive exactly one sampled token.
    pub one_token_each: bool,
    pub num_computed_tokens: Vec<i32>,
    pub num_scheduled_tokens: Vec<i32>,
    pub spec_token_ids: Vec<i32>,
    pub spec_token_ids_indptr: Vec<i32>,
    /// `(block, hash)` this step entered into the prefix cache (taken out again if the step fails).
    pub cached_blocks: Vec<(u32, crate::hashing::BlockHash)>,
    /// Victims this step swapped out (their `swap_out` copies run with the step; if it fails they recompute).
    pub swapped_out: Vec<ReqHandle>,
    /// Hashes of the encoder inputs this step computes (they leave the cache if the step fails).
    pub encoder_hashes: Vec<u64>,
    /// Entries whose output is dropped when the step is applied: running requests rolled back by invalid
    /// blocks the engine reported with this step (`update_kv_transfers`).
    pub kv_skipped: Vec<ReqHandle>,
}

#[derive(Clone, Debug, Default)]
pub struct UpdateResult {
    pub finished_req_ids: Vec<Arc<str>>,
    pub finish_reasons: Vec<FinishReason>,
    /// The stop token that ended each finished request, or -1.
    pub stop_reasons: Vec<i64>,
    /// Tokens appended per entry of the output (after truncation at a stop).
    pub num_new_tokens: Vec<i32>,
    /// Streaming-input sessions whose current input part stopped (they continue: `stream.rs`), with the part's
    /// finish reason and stop token (or -1), aligned.
    pub part_finished_req_ids: Vec<Arc<str>>,
    pub part_finish_reasons: Vec<FinishReason>,
    pub part_stop_reasons: Vec<i64>,
}

#[derive(Clone, Debug, Default)]
pub struct ModelInputs {
    pub input_token_ids: Vec<i32>,
    pub input_positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    /// Row-major `[num_reqs, max_num_blocks]`, padded with the null block 0.
    pub block_table: Vec<i32>,
    pub max_num_blocks: usize,
    pub logits_indices: Vec<i32>,
    pub max_seq_len: i32,
    pub max_query_len: i32,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running_reqs: usize,
    /// Waiting requests not deferred (vLLM: `num_waiting_reqs`).
    pub num_waiting_reqs: usize,
    /// Waiting requests skipped by an admission pass, or added blocked, and not admitted since.
    pub num_skipped_waiting_reqs: usize,
    pub kv_cache_usage: f64,
    pub num_free_blocks: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_preempted_queries: u64,
    pub prefix_cache_preempted_hits: u64,
    pub num_preemptions: u64,
    pub num_finished_reqs: u64,
    /// KV connector: tokens asked of it at admissions (beyond the local hit), and tokens it supplied.
    pub connector_prefix_cache_queries: u64,
    pub connector_prefix_cache_hits: u64,
    pub step_id: u64,
    pub num_swapped_out_reqs: u64,
    pub num_swapped_out_blocks: u64,
    pub num_swapped_in_reqs: u64,
    pub num_swapped_in_blocks: u64,
    pub num_swap_fallbacks: u64,
    pub num_recomputed_tokens: u64,
    pub num_free_cpu_blocks: usize,
    pub cpu_kv_cache_usage: f64,
    /// Fraction of `encoder_cache_size` held by entries (referenced or freeable); 0 without an encoder cache.
    pub encoder_cache_usage: f64,
    /// Entries in the encoder cache (referenced or freeable).
    pub num_encoder_cache_entries: usize,
    /// Encoder inputs (and their tokens) scheduled for computation so far.
    pub num_encoder_inputs_computed: u64,
    pub num_encoder_tokens_computed: u64,
    /// Encoder inputs a scheduled request found already cached (counted when it started referencing them).
    pub encoder_cache_hits: u64,
}
