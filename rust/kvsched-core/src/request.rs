//! A request's scheduling state. Requests live in a slab (`slots`) indexed by dense integers; a slot's
//! generation changes whenever it is reused, so a `ReqHandle` taken in an old step can never reach a new
//! request that happens to occupy the same slot.

use std::sync::Arc;

use crate::encoder::EncoderInput;
use crate::hashing::{BlockHash, ExtraKeys};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum RequestStatus {
    Waiting = 0,
    Running = 1,
    Preempted = 2,
    FinishedStopped = 3,
    FinishedLengthCapped = 4,
    FinishedAborted = 5,
    /// Waiting, but not schedulable until its structured-output grammar is ready (vLLM's
    /// `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`). Numbered after the others so existing codes keep their values.
    WaitingForGrammar = 6,
    /// Admitted with an asynchronous KV load from the connector: holds its blocks, not schedulable until the
    /// engine reports the load finished (vLLM's `WAITING_FOR_REMOTE_KVS`).
    WaitingForRemoteKvs = 7,
    /// Finished because its KV load failed and `kv_load_failure_policy` is `"fail"` (vLLM's `FINISHED_ERROR`).
    FinishedError = 8,
    /// A streaming-input session (`resumable`) whose last input part stopped, waiting for its next part: holds
    /// its blocks and computed tokens, never admitted until `append_input` (vLLM's `WAITING_FOR_STREAMING_REQ`).
    WaitingForInput = 9,
}

impl RequestStatus {
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RequestStatus::FinishedStopped
                | RequestStatus::FinishedLengthCapped
                | RequestStatus::FinishedAborted
                | RequestStatus::FinishedError
        )
    }

    /// Any of the statuses of a request in the waiting queue.
    pub fn is_waiting(self) -> bool {
        matches!(
            self,
            RequestStatus::Waiting
                | RequestStatus::Preempted
                | RequestStatus::WaitingForGrammar
                | RequestStatus::WaitingForRemoteKvs
                | RequestStatus::WaitingForInput
        )
    }
}

/// Stands for a draft token the runner fills in (async scheduling, padded spec decodes); `-1` as int32.
pub const SPEC_PLACEHOLDER: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FinishReason {
    Stop = 1,
    Length = 2,
    Abort = 3,
    /// The KV load failed (`kv_load_failure_policy = "fail"`).
    Error = 4,
}

/// `Request::eos_token_id` of a request without an EOS token.
pub const NO_EOS: u32 = u32::MAX;

/// A stable reference to a request: slot index plus the slot's generation when it was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReqHandle {
    pub slot: u32,
    pub gen: u32,
}

/// What `add_request` takes besides the id and the prompt.
#[derive(Clone, Debug, Default)]
pub struct RequestParams {
    pub max_tokens: Option<u32>,
    pub min_tokens: u32,
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    pub priority: i64,
    pub arrival_time: f64,
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
    /// The tenant the request is served for (`None`: the tenant `"default"`).
    pub tenant: Option<String>,
    /// The request waits for its structured-output grammar (`set_ready` releases it).
    pub waiting_for_grammar: bool,
    /// Never reads the prefix cache (vLLM's `skip_reading_prefix_cache`, set for prompt logprobs): admission
    /// finds no hits and the prefix-cache stats leave it out. Its full blocks are still cached for others.
    pub skip_reading_prefix_cache: bool,
    /// Encoder inputs (multimodal): sorted by `start`, non-overlapping, inside the prompt.
    pub encoder_inputs: Vec<EncoderInput>,
    /// Its `session_id`: the conversation it continues (session affinity, see `admission.rs`); `None`: none.
    pub session_id: Option<String>,
    /// Its TTFT target in seconds (policy `slo`: deadline `arrival_time + ttft_slo_s`); finite and > 0.
    pub ttft_slo_s: Option<f64>,
    /// A static tier: smaller first, under every policy (`None`: tier 0).
    pub order_key: Option<i64>,
    /// A streaming-input session: a stop ends only the current input part (`stream.rs`).
    pub resumable: bool,
    /// The encoder output tokens its cross-attention layers attend to (encoder-decoder models): a
    /// cross-attention KV cache group (`kv_cache_groups`) gives it `ceil(cross_attention_tokens / block_size)`
    /// blocks at its first allocation. 0: none.
    pub cross_attention_tokens: u32,
}

/// The next input part of a streaming-input session (`Scheduler::append_input`).
#[derive(Clone, Debug, Default)]
pub struct InputPart {
    pub token_ids: Vec<u32>,
    pub max_tokens: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    pub arrival_time: f64,
}

/// `Request::session` of a request without a `session_id`.
pub const NO_SESSION: u32 = u32::MAX;

/// One KV cache group's block table of a request (the groups but the primary one: `Request::groups`).
#[derive(Debug, Clone, Default)]
pub struct GroupTable {
    pub blocks: Vec<u32>,
    /// Leading blocks of `blocks` already entered into the prefix cache (null blocks included).
    pub num_cached_blocks: u32,
    /// A Mamba group in align mode (`mamba_align`): whether an allocation took the table's blocks since the request's last free
    /// (vLLM's `_allocated_block_reqs`).
    pub mamba_allocated: bool,
    /// A Mamba group in align mode: the entries the request's last allocation appended to `blocks` (null
    /// blocks and moved speculative blocks included): a running request's new block ids in that group.
    pub mamba_appended: u32,
    /// A Mamba group in align mode with prefill checkpoints: the checkpoint its last allocation reserved a block
    /// for, as (position in tokens, table index) (vLLM's `MambaManager._checkpoints`); `None`: none.
    pub mamba_checkpoint: Option<(u32, usize)>,
}

/// Field order is deliberate (`repr(C)`): what `update_from_output()` reads for a decode sits in the first
/// cache line (the stop ids' header in the second), what the slower paths of `schedule()` read in the first
/// two; identity, priority and hashing inputs follow. The computed, in-flight and stale token counts are not
/// here: they live in the slab's hot columns (`slab::Hot`), from which `schedule()` serves a plain decode
/// without reading the record at all.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Request {
    // --- first cache line: read by update_from_output for every request
    pub handle: ReqHandle,
    pub num_prompt_tokens: u32,
    /// Effective limit: `min(max_tokens, max_model_len - prompt_len)`.
    pub max_tokens: u32,
    pub status: RequestStatus,
    pub ignore_eos: bool,
    pub is_prefill_chunk: bool,
    /// `NO_EOS` when none (token ids never exceed `i32::MAX`): 4 bytes instead of 8 leave room for `tenant`.
    pub eos_token_id: u32,
    /// Index of the request's tenant in `Tenants` (read for every appended token's charge).
    pub tenant: u32,
    /// Async scheduling: tokens the runner will sample in steps scheduled but not yet applied.
    pub num_output_placeholders: u32,
    /// Stop token ids (`None`: none), behind one thin pointer so that the stop check of every appended token
    /// reads only this line (a `Box<[u32]>` would take 16 bytes and not fit).
    #[allow(clippy::box_collection)]
    pub stop_token_ids: Option<Box<Vec<u32>>>,
    /// Prompt then output tokens.
    pub token_ids: Vec<u32>,
    // --- second cache line: read by the general path of schedule()
    /// The block table.
    pub blocks: Vec<u32>,
    /// Draft tokens proposed for the next step (speculative decoding).
    pub spec_token_ids: Vec<u32>,
    /// Leading blocks of `blocks` already entered into the prefix cache.
    pub num_cached_blocks: u32,
    pub min_tokens: u32,
    // --- cold: touched on admission, preemption, block boundaries and finish
    pub block_hashes: Vec<BlockHash>,
    /// With prefix hits inside a block (`SchedulerConfig::partial_hit_unit`): the hash of every full prefix-match
    /// unit, the units of a block not full yet too (a block's hash is its last unit's). Empty otherwise.
    pub unit_hashes: Vec<BlockHash>,
    /// With prefix hits inside a block: per group, the block a hit (or, in an align-mode Mamba group, the
    /// request's own cached prompt tail) ends inside, as `(group, table index, block)`, until the next allocation
    /// copies it (vLLM's `_partial_hit_reqs`). Empty otherwise.
    pub partial_hits: Vec<(usize, usize, u32)>,
    /// With several KV cache groups (`kv_cache_groups`): the tables of every group but the primary one (the
    /// first group that is not Mamba, whose table is `blocks`), in group order; each as long as `blocks` but a
    /// cross-attention or Mamba one. Empty with one group.
    pub groups: Vec<GroupTable>,
    pub id: Arc<str>,
    pub priority: i64,
    pub arrival_time: f64,
    pub num_preemptions: u32,
    /// Prefix-cache hit at first admission, in tokens; -1 until admitted.
    pub num_cached_tokens: i64,
    /// With bounded prefix replay (`SchedulerConfig::prefix_replay_groups`): where its last replay starts, the
    /// first token its replayed windows are recomputed from (vLLM's `Request.replay_start`); 0 when nothing replays.
    pub replay_start: u32,
    /// With bounded prefix replay: whether the asynchronous KV load it waits for restores the replayed windows
    /// (the connector's loaded groups hold them all), asked at the load's admission.
    pub load_restores_window: bool,
    pub stop_reason: i64,
    pub extra_keys: ExtraKeys,
    // --- policy keys and tenant accounting (`fair.rs`)
    /// The priority the waiting heap and the victim choice compare: `priority`, or with aging
    /// `priority * priority_aging_steps + arrival_step` (see `queue.rs`).
    pub effective_priority: i128,
    /// Prompt tokens already charged to the tenant: recomputation after a preemption is not charged again.
    pub num_charged_prompt_tokens: u32,
    /// The tier (`order_key`, 0 when not given) and the `slo` deadline (`arrival_time + ttft_slo_s`, infinite
    /// without a target) the waiting queue orders by (`order.rs`).
    pub order_key: i64,
    pub deadline: f64,
    /// `sjf`: the residual (prompt blocks beyond the prefix hit) the waiting queue holds it by, and the pool's
    /// count of removed cache entries when it was last probed (`admission.rs`).
    pub sjf_residual: u32,
    pub sjf_probe_stamp: u64,
    /// Aging: nonzero while the request is in `waiting` (its entry in the aging FIFO), and the first step it
    /// waits in there (`admission.rs`).
    pub wait_seq: u64,
    pub wait_since: u64,
    /// Index of its streaming-input session in `Sessions` (`NO_SESSION`: none).
    pub session: u32,
    // --- in-flight bookkeeping (vLLM's `Request` fields of the same names; the in-flight and stale token
    // counts are hot columns, `slab::Hot`)
    /// Output of steps scheduled before the preemption is dropped, not applied (see `slab::Hot::stale`).
    pub drop_stale_output: bool,
    /// `max_tokens` as given (the effective limit when none was given). Async scheduling's test of a request
    /// whose last token is already in flight reads it, as vLLM does, so a limit past `max_model_len` is tested
    /// as given.
    pub requested_max_tokens: u32,
    /// Skipped by an admission pass (or added blocked) and not admitted since: vLLM's `deferred_waiting`.
    pub deferred: bool,
    /// `set_ready` was called while the request waited for its grammar.
    pub grammar_ready: bool,
    /// See `RequestParams::skip_reading_prefix_cache`.
    pub skip_reading_prefix_cache: bool,
    // --- preemption by swapping (`swap_sched.rs`)
    /// CPU blocks holding the KV of a swapped-out request (empty unless swapped).
    pub cpu_blocks: Vec<u32>,
    /// Tokens whose KV the CPU blocks hold (0 unless swapped).
    pub num_swapped_tokens: u32,
    /// Tokens computed when the request was last preempted and not yet recovered: what resuming it must
    /// compute again unless prefix hits or a swap-in restore them (the recomputed-tokens stat).
    pub num_lost_tokens: u32,
    /// Prefix hits the last admission probe of this request found (`find_longest_cache_hit`). Only a hint, for
    /// `KvCacheManager::cache_hit_upper_bound`: whatever the cache did since, the hits can reach past it only if
    /// the hash right after them is cached now.
    pub probe_hits: u32,
    /// Align-mode Mamba groups with prefix caching: the tokens of the longest hit one lookup set found at the
    /// request's last lookup when the combined hit is shorter (vLLM's `shared_prefix_boundary`), else 0. A prefill
    /// chunk stops at its block-floored position (`AlignedSplit::split`).
    pub shared_prefix_boundary: u32,
    /// Order of `add_request` calls: blocked requests that become ready are queued in this order.
    pub add_seq: u64,
    /// KV connector: the asynchronous load of this request was reported finished (or failed).
    pub kv_load_done: bool,
    /// KV connector: the load failed; `num_computed_tokens` was cut back to the valid prefix.
    pub kv_load_failed: bool,
    /// vLLM 0.33's in-flight prefill set: an asynchronous load, or an admission with prompt left to compute,
    /// until a step leaves it with nothing left (or it is preempted). Tracked with `reserve_inflight_prefills`.
    pub inflight_prefill: bool,
    /// The step (`schedule()` call id) that last scheduled tokens of this request through a prefill chunk's path,
    /// and its computed tokens before them: the in-flight prefill reservation reads the count before the step
    /// (vLLM's `num_computed_tokens` while it schedules). `u64::MAX`: none.
    pub chunk_step: (u64, u32),
    /// `decode_stagger`: the first `schedule()` call (its step id) in which phase A may schedule this request
    /// again after a step that was not a prefill chunk (vLLM's `next_decode_eligible_step`). Kept across
    /// preemption, as vLLM keeps it.
    pub decode_ready_step: u64,
    /// In no queue and not running: blocked (grammar not ready, KV load in progress), or ready and queued at the
    /// start of the next `schedule()`.
    pub parked: bool,
    // --- encoder inputs (`encoder_sched.rs`)
    pub encoder_inputs: Box<[EncoderInput]>,
    /// Per encoder input: this request holds a reference to its encoder-cache entry.
    pub encoder_held: Box<[bool]>,
    /// Inputs with `encoder_held` set.
    pub num_encoder_held: u32,
    /// `RequestParams::cross_attention_tokens`.
    pub cross_attention_tokens: u32,
    // --- streaming input (`stream.rs`)
    /// A streaming-input session (`RequestParams::resumable`).
    pub resumable: bool,
    /// Input parts given while the streaming-input session was not waiting for one, in order; `None`: the input is over.
    pub input_queue: std::collections::VecDeque<Option<InputPart>>,
    /// `finish_input` was called: no more parts are accepted.
    pub input_closed: bool,
    /// The most tokens the streaming-input session can reach with the parts given so far (validation of the next part).
    pub max_len_bound: u32,
}

impl Request {
    pub fn num_tokens(&self) -> u32 {
        self.token_ids.len() as u32
    }

    pub fn num_output_tokens(&self) -> u32 {
        self.num_tokens() - self.num_prompt_tokens
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens as usize..]
    }

    pub fn num_tokens_with_spec(&self) -> u32 {
        self.num_tokens() + self.spec_token_ids.len() as u32
    }
}
