//! The scheduler: owns the requests, the queues and the KV cache manager. This file holds construction,
//! request intake, aborts, queries, stats and the invariant check; `step.rs` holds `schedule()`, `update.rs`
//! holds `update_from_output()`, `model_inputs.rs` the runner-facing batch layout.
//!
//! Invariants (see `check_invariants`): every live request is in exactly one of `running` (status RUNNING) or
//! `waiting` (WAITING/PREEMPTED, no blocks, nothing computed); the id map and the slab agree; each block's
//! ref count equals the number of block tables holding it; `running` never exceeds `max_num_seqs`; the mirror
//! columns of the slab's hot state (`slab::Hot`) agree with the records of the running requests.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::block_pool::BlockPool;
use crate::config::{check_ttft_slo, py_str, PauseState, Policy, SchedulerConfig};
use crate::connector::{Connector, DeferredLoad, Held};
use crate::encoder::EncoderCache;
use crate::error::{Result, SchedError};
use crate::fair::{Tenant, Tenants, DEFAULT_TENANT};
use crate::hashing::{tenant_cache_salt, BlockHash, BlockHasher, ExtraKeys};
use crate::hybrid::Hybrid;
use crate::kv_cache_manager::KvCacheManager;
use crate::order::OrderKey;
use crate::output::{SchedulerOutput, SchedulerStats, StepRecord};
use crate::queue::{effective_priority, WaitingQueue};
use crate::request::{
    FinishReason, GroupTable, ReqHandle, Request, RequestParams, RequestStatus, NO_EOS, NO_SESSION,
};
use crate::session::Sessions;
use crate::slab::{DecodeLimits, Slab};
use crate::swap::CpuBlockPool;

static NEXT_SCHEDULER_ID: AtomicU64 = AtomicU64::new(1);

/// The largest token id accepted (token ids travel as int32).
pub const MAX_TOKEN_ID: i64 = i32::MAX as i64;
/// Token, block and hash lists of a new request are reserved for at most this many tokens past its prompt
/// (`reserve_lists`).
const RESERVE_MAX_TOKENS: u64 = 2048;

#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_preempted_queries: u64,
    pub prefix_cache_preempted_hits: u64,
    pub num_preemptions: u64,
    pub num_finished_reqs: u64,
    /// Preemption by swapping (`swap_sched.rs`).
    pub num_swapped_out_reqs: u64,
    pub num_swapped_out_blocks: u64,
    pub num_swapped_in_reqs: u64,
    pub num_swapped_in_blocks: u64,
    /// Victims that were to be swapped but were recomputed: the CPU pool could not hold them.
    pub num_swap_fallbacks: u64,
    /// Tokens computed before a preemption and lost to it (not restored by prefix hits or a swap-in), counted
    /// when the request resumes.
    pub num_recomputed_tokens: u64,
    /// KV connector: tokens asked of the connector at admission (beyond the local hit) and tokens it had.
    pub connector_prefix_cache_queries: u64,
    pub connector_prefix_cache_hits: u64,
    /// Encoder inputs: computed (inputs, tokens) and found cached.
    pub num_encoder_inputs_computed: u64,
    pub num_encoder_tokens_computed: u64,
    pub encoder_cache_hits: u64,
    /// Scheduled requests and tokens of the most recent step (for the invariant check).
    pub last_num_scheduled_reqs: usize,
    pub last_num_scheduled_tokens: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) kv: KvCacheManager,
    /// Align-mode Mamba groups (`mamba_align`): how prefill chunks are cut at block boundaries.
    pub(crate) mamba_split: Option<crate::hybrid::AlignedSplit>,
    pub(crate) slab: Slab,
    pub(crate) ids: HashMap<Arc<str>, u32>,
    /// Slots of running requests, in admission order.
    pub(crate) running: Vec<u32>,
    pub(crate) waiting: WaitingQueue,
    /// Tenant registry, weights and virtual counters (`fair.rs`).
    pub(crate) tenants: Tenants,
    pub(crate) scheduler_id: u64,
    pub(crate) next_step_id: u64,
    pub(crate) in_flight: VecDeque<Box<StepRecord>>,
    /// The record of the last applied step, kept so that the next step's record reuses its buffers.
    pub(crate) spare_record: Option<Box<StepRecord>>,
    /// An output the caller handed back once done with it (`recycle_output`): the next step is built in it,
    /// reusing its vectors' capacity.
    pub(crate) spare_output: Option<Box<SchedulerOutput>>,
    /// `admit_waiting`'s prefix-hit buffer, kept between steps (empty between them).
    pub(crate) hits_buf: Vec<u32>,
    pub(crate) finished_since_step: Vec<Arc<str>>,
    /// Slots of running requests `finish` took out of the slab that are still in `running`, until
    /// `remove_finished_from_queues` removes them (by slot, without reading every running request's record).
    finished_running: Vec<u32>,
    /// Bumped by every call that changes state; `prepare_model_inputs` requires it unchanged since `schedule()`.
    pub(crate) epoch: u64,
    pub(crate) counters: Counters,
    pub(crate) pause_state: PauseState,
    /// Waiting requests with `deferred` set (vLLM's `len(deferred_waiting)`).
    pub(crate) num_deferred: usize,
    /// Requests preempted outside `schedule()` (`reset_prefix_cache(reset_running_requests=True)`), reported in
    /// the next output's preempted ids.
    pub(crate) preempted_since_step: Vec<Arc<str>>,
    /// Steps that scheduled tokens (vLLM's `num_executed_steps`; empty steps do not count).
    pub(crate) num_executed_steps: u64,
    /// The executed step that last carried prefill (vLLM's `last_prefill_step`; starts a full interval back).
    pub(crate) last_prefill_step: i64,
    /// Whether the last released (not deferred) admission pass left requests waiting that were not skipped.
    pub(crate) prefill_capacity_bound: bool,
    /// The CPU swap pool (`swap.rs`; empty under `recompute`).
    pub(crate) cpu: CpuBlockPool,
    /// Auto's cost constants now in force (initially from the config; `set_preemption_costs`).
    pub(crate) recompute_cost_per_token: f64,
    pub(crate) swap_cost_per_block: f64,
    /// The KV connector, if any (`connector.rs`).
    pub(crate) connector: Option<Connector>,
    /// The encoder-cache connector, if any (`ec_connector.rs`).
    pub(crate) ec_connector: Option<crate::ec_connector::EcConn>,
    /// The cache-hit cap, if any (`hit_cap.rs`).
    pub(crate) hit_cap: Option<crate::hit_cap::HitCap>,
    /// Requests whose asynchronous KV load is over, holding their blocks (vLLM's `kv_holding_waiting`): phase
    /// B takes them before `waiting`, and under `paused_new` only them.
    pub(crate) kv_waiting: WaitingQueue,
    /// Parked requests that became ready since the last step, queued at the start of the next `schedule()`.
    pub(crate) newly_ready: Vec<ReqHandle>,
    /// Requests with `parked` set (in no queue, not running).
    pub(crate) num_parked: usize,
    /// Parked requests in `WaitingForRemoteKvs`.
    pub(crate) num_loading: usize,
    /// Streaming-input sessions in `WaitingForInput` (vLLM's `num_waiting_for_streaming_input`).
    pub(crate) num_waiting_for_input: usize,
    /// Sessions whose input part stopped in the update being applied, queued again at its end (`stream.rs`).
    pub(crate) continuing: Vec<u32>,
    /// Blocks of finished requests kept for a KV transfer.
    pub(crate) held: Held,
    /// Non-empty steps scheduled and applied (vLLM's `sched_step_seq` and `processed_step_seq`).
    pub(crate) sched_step_seq: u64,
    pub(crate) processed_step_seq: u64,
    /// `defer_block_free`: blocks freed while a step in flight may still write them, each with its fence (the
    /// non-empty steps scheduled at the free), oldest first. They go back to the pool once `processed_step_seq`
    /// reaches the fence (`connector_sched.rs`).
    pub(crate) deferred_frees: VecDeque<(u64, Vec<u32>)>,
    /// `defer_async_loads`: asynchronous loads admitted while a step was in flight, not yet registered with the
    /// connector, in admission order (vLLM's `deferred_loads`).
    pub(crate) deferred_loads: VecDeque<DeferredLoad>,
    /// References taken by `pin_blocks` and not yet given back by `unpin_blocks`, per block id (`pins.rs`).
    pub(crate) pins: HashMap<u32, u32>,
    pub(crate) next_add_seq: u64,
    /// The encoder cache (`encoder.rs`, driven by `encoder_sched.rs`).
    pub(crate) encoder: EncoderCache,
    /// Live requests' encoder-input hashes: (encoder tokens, number of live inputs with the hash).
    pub(crate) encoder_sizes: HashMap<u64, (u32, u32)>,
    /// Encoder-decoder scheduling: vLLM's `EncoderDecoderCacheManager` slot count (`encoder_dec.rs`).
    pub(crate) enc_dec_free_slots: i64,
    /// Session affinity: which sessions ran recently (`session.rs`).
    pub(crate) sessions: Sessions,
    /// Aging (`max_wait_steps`): the requests of `waiting` in the order they entered it, as `(first step
    /// waited in, wait_seq, handle)`; entries whose request left are dropped lazily (`admission.rs`).
    pub(crate) aging: VecDeque<(u64, u64, ReqHandle)>,
    pub(crate) next_wait_seq: u64,
    /// Inside `schedule()` past its start: a request entering `waiting` now first waits in the next step.
    pub(crate) in_schedule: bool,
}

/// vLLM's `SlidingWindowSpec.max_admission_blocks_per_request`: the blocks a request with a window holds at
/// most, its window before the first token in flight and one step's budget per concurrent batch
/// (`max_concurrent_batches`), plus one for a window that starts inside a block. `usize::MAX` without a window.
fn window_admission_cap_blocks(config: &SchedulerConfig) -> usize {
    config.sliding_window.map_or(usize::MAX, |w| window_cap_blocks(config, w, config.kv_block_size()))
}

/// `window_admission_cap_blocks` for a window of `window` tokens; for a chunked-local group of chunks of `c`
/// tokens (vLLM's `ChunkedLocalAttentionSpec.max_admission_blocks_per_request`), `ceil(min(c + in-flight tokens,
/// max_model_len) / bs)`; in blocks of `bs` tokens (the group's block size).
fn window_cap_blocks(config: &SchedulerConfig, window: u32, bs: u32) -> usize {
    let batches = u64::from(config.concurrent_batches());
    let in_flight = batches * u64::from(config.max_num_batched_tokens);
    let bs = u64::from(bs);
    if let Some(c) = crate::hybrid::chunk_size(window) {
        return (u64::from(c) + in_flight).min(u64::from(config.max_model_len)).div_ceil(bs) as usize;
    }
    let tokens = (u64::from(window) - 1 + u64::from(config.extra_retained_tokens) + in_flight)
        .min(u64::from(config.max_model_len));
    tokens.div_ceil(bs) as usize + 1
}

fn bad_request(msg: String) -> SchedError {
    SchedError::InvalidRequest(msg)
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        // A full interval back, so the first step is never gated.
        let last_prefill_step = -i64::from(config.prefill_schedule_interval);
        let hasher = BlockHasher::new(config.prefix_hash_algo, config.prefix_hash_seed.as_deref())?
            .with_lookahead(config.hash_lookahead_tokens as usize)
            .with_unit(config.hash_block_size);
        let kv = KvCacheManager {
            pool: BlockPool::new(config.num_blocks, config.enable_prefix_caching)
                .with_kv_cache_events(config.enable_kv_cache_events)
                .with_block_groups(config.kv_cache_groups.len() > 1),
            hasher,
            block_size: config.kv_block_size(),
            max_slots: config.max_slots_per_request(),
            enable_caching: config.enable_prefix_caching,
            newly_cached: Vec::new(),
            hash_buf: Vec::new(),
            sliding_window: config.sliding_window.unwrap_or(0),
            admission_cap_blocks: window_admission_cap_blocks(&config),
            retention: config
                .prefix_cache_retention_interval
                .filter(|_| config.sliding_window.is_some() && config.kv_cache_groups.is_empty()),
            hybrid: (!config.kv_cache_groups.is_empty()).then(|| {
                let sizes = config.group_block_sizes();
                let primary = config.primary_group().unwrap_or(0);
                let mut hy = Hybrid::new(
                    &config.kv_cache_groups,
                    &sizes,
                    primary,
                    config.mamba_speculative_blocks,
                    |w, bs| window_cap_blocks(&config, w, bs),
                );
                hy.mamba_align = config.mamba_align;
                if config.zero_new_blocks && hy.zero_ids.is_empty() {
                    hy.zero_ids = vec![Vec::new(); hy.windows.len()];
                }
                hy.defer_new_states_only = config.mamba_defer_new_states_only;
                hy.mamba_eagle = config.mamba_eagle_group;
                hy.junction_below = config.drop_junction_below;
                hy.retention = config.prefix_cache_retention_interval;
                hy.hash_lookahead = config.hash_lookahead_tokens;
                hy.checkpoint_align = config.mamba_prefill_checkpoint_alignment.unwrap_or(0);
                hy = hy.with_replay(&config.prefix_replay_groups);
                if config.mamba_align && config.enable_prefix_caching {
                    hy = hy.with_mamba_lookup();
                }
                Box::new(hy)
            }),
            special: config.sliding_window.is_some() || !config.kv_cache_groups.is_empty(),
            drop_trailing_hit: config.drop_trailing_hit_block,
            // vLLM's unitary coordinator always leaves the reprefillable tail out of the cache, its hybrid one only
            // in the groups that drop the trailing block.
            reprefillable: if config.kv_cache_groups.len() > 1 && !config.drop_trailing_hit_block {
                0
            } else {
                config.prefill_lookahead_tokens.saturating_sub(1)
            },
            extra_retained: config.extra_retained_tokens,
            partial_unit: config.partial_hit_unit().unwrap_or(0),
        };
        let limits = DecodeLimits {
            max_model_len: i64::from(config.max_model_len),
            max_slots: kv.max_slots,
            lookahead: config.num_lookahead_tokens,
            // A sliding window frees blocks as decodes advance: every step allocates through `allocate_slots`
            // (a block size of 0 makes the plain-decode span empty).
            // So does a reprefillable tail (the blocks a decode caches are not those it completes).
            block_size: if kv.special || kv.reprefillable > 0 { 0 } else { kv.block_size },
            caching: kv.enable_caching,
        };
        let mamba_split = config.mamba_align.then(|| {
            let mut max_prefill_tokens = if config.max_num_scheduled_tokens > 0 {
                config.max_num_scheduled_tokens
            } else {
                config.max_num_batched_tokens
            };
            if config.long_prefill_token_threshold > 0 {
                max_prefill_tokens = max_prefill_tokens.min(config.long_prefill_token_threshold);
            }
            crate::hybrid::AlignedSplit {
                bs: config.block_size,
                max_prefill_tokens,
                drop_eagle: config.drop_trailing_hit_block,
                hash_lookahead: config.hash_lookahead_tokens,
                checkpoint_align: config.mamba_prefill_checkpoint_alignment.unwrap_or(0),
                unit: config.partial_hit_unit().unwrap_or(0),
            }
        });
        Ok(Scheduler {
            mamba_split,
            cpu: CpuBlockPool::new(config.num_cpu_blocks),
            encoder: EncoderCache::new(u64::from(config.encoder_cache_size)),
            encoder_sizes: HashMap::new(),
            enc_dec_free_slots: i64::from(config.encoder_cache_size),
            recompute_cost_per_token: config.recompute_cost_per_token,
            swap_cost_per_block: config.swap_cost_per_block,
            waiting: WaitingQueue::new(config.policy),
            kv_waiting: WaitingQueue::new(config.policy),
            tenants: Tenants::new(&config),
            config,
            kv,
            slab: Slab::new(limits),
            ids: HashMap::new(),
            running: Vec::new(),
            scheduler_id: NEXT_SCHEDULER_ID.fetch_add(1, Ordering::Relaxed),
            next_step_id: 0,
            in_flight: VecDeque::new(),
            spare_record: None,
            spare_output: None,
            hits_buf: Vec::new(),
            finished_since_step: Vec::new(),
            finished_running: Vec::new(),
            epoch: 0,
            counters: Counters::default(),
            pause_state: PauseState::Unpaused,
            num_deferred: 0,
            preempted_since_step: Vec::new(),
            connector: None,
            ec_connector: None,
            hit_cap: None,
            newly_ready: Vec::new(),
            num_parked: 0,
            num_loading: 0,
            num_waiting_for_input: 0,
            continuing: Vec::new(),
            held: Held::default(),
            sched_step_seq: 0,
            processed_step_seq: 0,
            deferred_frees: VecDeque::new(),
            deferred_loads: VecDeque::new(),
            pins: HashMap::new(),
            next_add_seq: 0,
            num_executed_steps: 0,
            last_prefill_step,
            prefill_capacity_bound: false,
            sessions: Sessions::default(),
            aging: VecDeque::new(),
            next_wait_seq: 0,
            in_schedule: false,
        })
    }

    /// The slot the next added request will occupy (bindings index their per-request data by it).
    pub fn next_slot(&self) -> u32 {
        self.slab.next_handle().slot
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The prefill cadence's state: executed steps (steps that scheduled tokens), the executed step that last
    /// carried prefill, and whether the last released admission pass left requests waiting (see `schedule_with`).
    pub fn prefill_cadence(&self) -> (u64, i64, bool) {
        (self.num_executed_steps, self.last_prefill_step, self.prefill_capacity_bound)
    }

    pub fn scheduler_id(&self) -> u64 {
        self.scheduler_id
    }

    /// `add_request`'s check of `cross_attention_tokens`: only with a cross-attention group, not for a
    /// streaming-input session, and its blocks must fit the whole cache.
    fn check_cross_attention_tokens(&self, req_id: &str, params: &RequestParams) -> Result<()> {
        let n = params.cross_attention_tokens;
        if n == 0 {
            return Ok(());
        }
        if !self.config.kv_cache_groups.contains(&Some(crate::config::CROSS_ATTENTION)) {
            return Err(bad_request(format!(
                "request {req_id:?}: cross_attention_tokens ({n}) needs a cross-attention group in kv_cache_groups"
            )));
        }
        if params.resumable {
            return Err(bad_request(format!(
                "request {req_id:?}: a streaming-input session (resumable) cannot have cross_attention_tokens"
            )));
        }
        let blocks = n.div_ceil(self.config.kv_block_size());
        if blocks > self.config.num_usable_blocks() {
            return Err(bad_request(format!(
                "request {req_id:?}: cross_attention_tokens ({n}) need {blocks} blocks, more than the KV cache's {} \
                 usable blocks",
                self.config.num_usable_blocks()
            )));
        }
        Ok(())
    }

    /// Adds a request to the waiting queue. On error nothing changes.
    pub fn add_request(
        &mut self,
        req_id: &str,
        prompt_token_ids: &[i64],
        params: RequestParams,
    ) -> Result<()> {
        if req_id.is_empty() {
            return Err(bad_request("request id must be a non-empty string".into()));
        }
        if self.ids.contains_key(req_id) || self.held.contains_key(req_id) {
            return Err(SchedError::DuplicateRequest(format!("request id {req_id:?} is already known")));
        }
        let prompt_len = prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(bad_request(format!("request {req_id:?}: the prompt is empty")));
        }
        let max_model_len = self.config.max_model_len as usize;
        if prompt_len >= max_model_len {
            return Err(bad_request(format!(
                "request {req_id:?}: prompt of {prompt_len} tokens does not fit max_model_len={max_model_len} \
                 (at least one output token must fit)"
            )));
        }
        let mut token_ids = Vec::with_capacity(prompt_len + 16);
        for (i, &t) in prompt_token_ids.iter().enumerate() {
            if !(0..=MAX_TOKEN_ID).contains(&t) {
                return Err(bad_request(format!(
                    "request {req_id:?}: prompt token {i} must be in [0, {MAX_TOKEN_ID}], got {t}"
                )));
            }
            token_ids.push(t as u32);
        }
        let room = (max_model_len - prompt_len) as u32;
        let max_tokens = match params.max_tokens {
            Some(0) => {
                return Err(bad_request(format!("request {req_id:?}: max_tokens must be >= 1, got 0")))
            }
            Some(m) => m.min(room),
            None => room,
        };
        // The most KV slots the request ever holds: all its tokens but the last sampled one. It must fit in the
        // whole cache (alone, it can then always run: nothing livelocks preempting itself) and, without chunked
        // prefill, in one step's budget (a preempted request recomputes all its tokens in one step). vLLM's
        // scheduler accepts such requests and never finishes them; kvsched refuses them here.
        let longest = prompt_len as u64 + u64::from(max_tokens) - 1;
        let capacity = self.config.kv_capacity_tokens();
        if longest > u64::from(capacity) {
            return Err(bad_request(format!(
                "request {req_id:?}: prompt ({prompt_len}) + max_tokens ({max_tokens}) - 1 = {longest} tokens do \
                 not fit the KV cache ({} usable blocks of {} tokens = {capacity}); lower max_tokens",
                self.config.num_usable_blocks(),
                self.config.kv_block_size()
            )));
        }
        if !self.config.enable_chunked_prefill && longest > u64::from(self.config.max_chunk_tokens()) {
            return Err(bad_request(format!(
                "request {req_id:?}: prompt ({prompt_len}) + max_tokens ({max_tokens}) - 1 = {longest} tokens \
                 exceed {}; without chunked prefill they could not be (re)computed in one step. Lower max_tokens \
                 or enable chunked prefill",
                self.config.chunk_limit_text()
            )));
        }
        if params.min_tokens > max_tokens {
            return Err(bad_request(format!(
                "request {req_id:?}: min_tokens={} exceeds the effective max_tokens={max_tokens}",
                params.min_tokens
            )));
        }
        if !params.arrival_time.is_finite() {
            return Err(bad_request(format!(
                "request {req_id:?}: arrival_time must be finite, got {}",
                params.arrival_time
            )));
        }
        if let Some(slo) = params.ttft_slo_s {
            check_ttft_slo("ttft_slo_s", slo).map_err(|m| bad_request(format!("request {req_id:?}: {m}")))?;
        }
        if params.session_id.as_deref() == Some("") {
            return Err(bad_request(format!("request {req_id:?}: session_id must be a non-empty string")));
        }
        self.check_encoder_inputs(req_id, prompt_len, &params.encoder_inputs).map_err(bad_request)?;
        self.check_cross_attention_tokens(req_id, &params)?;
        self.check_encoder_decoder_request(
            req_id,
            params.encoder_inputs.len(),
            params.cross_attention_tokens,
        )
        .map_err(bad_request)?;
        if params.resumable {
            self.check_resumable(req_id, &params)?;
        }
        let tenant_name = params.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        crate::config::check_tenant_name(tenant_name)
            .map_err(|m| bad_request(format!("request {req_id:?}: {m}")))?;
        // Last of the checks: a valid request of a tenant at its waiting limit is refused, changing nothing.
        self.tenants
            .check_waiting_room(tenant_name)
            .map_err(|m| SchedError::QueueFull(format!("request {}: {m}", py_str(req_id))))?;
        let cache_salt = if self.config.isolate_tenant_cache {
            Some(tenant_cache_salt(tenant_name, params.cache_salt.as_deref()))
        } else {
            params.cache_salt
        };
        let tenant = self.tenants.intern(tenant_name);
        let handle = self.slab.next_handle();
        let id: Arc<str> = Arc::from(req_id);
        let mut req = Request {
            id: id.clone(),
            handle,
            token_ids,
            num_prompt_tokens: prompt_len as u32,
            status: if params.waiting_for_grammar {
                RequestStatus::WaitingForGrammar
            } else {
                RequestStatus::Waiting
            },
            priority: params.priority,
            // `+ 0.0` turns -0.0 into 0.0: arrival times compare by value (total_cmp would order them).
            arrival_time: params.arrival_time + 0.0,
            num_preemptions: 0,
            num_cached_tokens: -1,
            replay_start: 0,
            load_restores_window: false,
            max_tokens,
            requested_max_tokens: params.max_tokens.unwrap_or(max_tokens),
            min_tokens: params.min_tokens,
            eos_token_id: params.eos_token_id.unwrap_or(NO_EOS),
            ignore_eos: params.ignore_eos,
            stop_token_ids: if params.stop_token_ids.is_empty() {
                None
            } else {
                Some(Box::new(params.stop_token_ids))
            },
            stop_reason: -1,
            extra_keys: ExtraKeys { cache_salt, lora_name: params.lora_name },
            block_hashes: Vec::new(),
            unit_hashes: Vec::new(),
            partial_hits: Vec::new(),
            blocks: Vec::new(),
            num_cached_blocks: 0,
            groups: vec![GroupTable::default(); self.config.kv_cache_groups.len().saturating_sub(1)],
            spec_token_ids: Vec::new(),
            is_prefill_chunk: false,
            effective_priority: effective_priority(
                params.priority,
                self.next_step_id,
                self.config.priority_aging_steps,
            ),
            tenant,
            num_charged_prompt_tokens: 0,
            order_key: params.order_key.unwrap_or(0),
            deadline: match params.ttft_slo_s.or(self.config.default_ttft_slo_s) {
                // `+ 0.0` as above; a sum past the f64 range is infinite: no deadline, in effect.
                Some(slo) => params.arrival_time + 0.0 + slo,
                None => f64::INFINITY,
            },
            sjf_residual: 0,
            sjf_probe_stamp: self.kv.pool.num_removed(),
            wait_seq: 0,
            wait_since: 0,
            session: NO_SESSION,
            num_output_placeholders: 0,
            drop_stale_output: false,
            // vLLM enqueues a request in a blocked status straight into `deferred_waiting`.
            deferred: params.waiting_for_grammar,
            grammar_ready: false,
            skip_reading_prefix_cache: params.skip_reading_prefix_cache,
            cpu_blocks: Vec::new(),
            num_swapped_tokens: 0,
            num_lost_tokens: 0,
            probe_hits: 0,
            shared_prefix_boundary: 0,
            add_seq: self.next_add_seq,
            kv_load_done: false,
            kv_load_failed: false,
            inflight_prefill: false,
            decode_ready_step: 0,
            chunk_step: (u64::MAX, 0),
            // A request waiting for its grammar is parked (in no queue) until `set_ready`, unless the config
            // keeps it in `waiting` (vLLM 0.33's rule: skipped by each admission pass that reaches it).
            parked: params.waiting_for_grammar && self.config.park_grammar_waits,
            encoder_held: vec![false; params.encoder_inputs.len()].into_boxed_slice(),
            encoder_inputs: params.encoder_inputs.into_boxed_slice(),
            num_encoder_held: 0,
            cross_attention_tokens: params.cross_attention_tokens,
            resumable: params.resumable,
            input_queue: std::collections::VecDeque::new(),
            input_closed: false,
            max_len_bound: (prompt_len as u32).saturating_add(max_tokens),
        };
        self.register_encoder_inputs(&req.encoder_inputs);
        self.next_add_seq += 1;
        self.num_deferred += usize::from(params.waiting_for_grammar);
        self.num_parked += usize::from(req.parked);
        Self::reserve_lists(&mut req, longest, self.kv.block_size, self.kv.enable_caching);
        self.kv.extend_hashes(&mut req);
        if self.config.policy == Policy::Sjf {
            let mut buf = std::mem::take(&mut self.hits_buf);
            req.sjf_residual = crate::order::sjf_residual(&self.kv, &req, &mut buf);
            self.hits_buf = buf;
        }
        if let Some(name) = params.session_id.as_deref() {
            req.session = self.sessions.add_request(name, self.next_step_id, self.config.session_ttl_steps);
        }
        let key = Self::order_key(self.config.policy, &req);
        let parked = req.parked;
        self.slab.insert(req);
        self.ids.insert(id, handle.slot);
        if !parked {
            self.waiting.push(handle, key);
            self.enter_waiting(handle.slot)?;
        }
        self.tenants.on_arrival(tenant);
        self.epoch += 1;
        Ok(())
    }

    /// Validates one token id given as a signed integer (for bindings).
    pub fn check_token_id(what: &str, t: i64) -> Result<u32> {
        if (0..=MAX_TOKEN_ID).contains(&t) {
            Ok(t as u32)
        } else {
            Err(bad_request(format!("{what} must be in [0, {MAX_TOKEN_ID}], got {t}")))
        }
    }

    /// The key `req` is queued by under `policy` (`order.rs`): its tier, then the policy's rank (the effective
    /// priority, the `sjf` residual), the `slo` deadline, arrival time and id.
    pub(crate) fn order_key(policy: Policy, req: &Request) -> OrderKey {
        OrderKey {
            tier: req.order_key,
            rank: match policy {
                Policy::Priority => req.effective_priority,
                Policy::Sjf => i128::from(req.sjf_residual),
                _ => 0,
            },
            deadline: if policy == Policy::Slo { req.deadline } else { 0.0 },
            arrival_time: req.arrival_time,
            id: req.id.clone(),
            tenant: req.tenant,
        }
    }

    pub(crate) fn slot_of(&self, req_id: &str) -> Result<u32> {
        self.ids
            .get(req_id)
            .copied()
            .ok_or_else(|| SchedError::UnknownRequest(format!("unknown request id {req_id:?}")))
    }

    pub fn get_request(&self, req_id: &str) -> Result<&Request> {
        let slot = self.slot_of(req_id)?;
        self.slab.get(slot)
    }

    /// Aborts every listed request (each must be known; on error nothing changes).
    pub fn abort_requests<S: AsRef<str>>(&mut self, req_ids: &[S]) -> Result<()> {
        // In the given order (it decides the free order of their blocks), each id once.
        let mut slots = Vec::with_capacity(req_ids.len());
        let mut seen = HashSet::with_capacity(req_ids.len());
        for id in req_ids {
            let slot = self.slot_of(id.as_ref())?;
            if seen.insert(slot) {
                slots.push(slot);
            }
        }
        let mut from_waiting = false;
        for &slot in &slots {
            from_waiting |= self.slab.get(slot)?.status != RequestStatus::Running;
            self.finish(slot, RequestStatus::FinishedAborted)?;
        }
        self.remove_finished_from_queues(from_waiting);
        self.epoch += 1;
        Ok(())
    }

    /// The runner could not execute step `step_id`, which must be the only step in flight (a step scheduled
    /// after it was built on its results). The blocks the step entered into the prefix cache leave it (their KV
    /// was never computed, so no later request may hit them; only requests of this step can hold them), then
    /// every request of the step that is still live is aborted, in step order (the freed uncached blocks go to
    /// the head of the free queue, as any unhashed block), then the victims the step swapped out give their CPU
    /// blocks back (the copy may never have run: they recompute when resumed), and the step counts as applied.
    /// Returns the aborted ids. On error nothing changes.
    pub fn fail_step(&mut self, scheduler_id: u64, step_id: u64) -> Result<Vec<Arc<str>>> {
        if scheduler_id != self.scheduler_id {
            return Err(SchedError::InvalidOutput("this output was produced by another scheduler".into()));
        }
        let Some(rec) = self.in_flight.front() else {
            return Err(SchedError::InvalidOutput(format!(
                "step {step_id} was already applied (no step is in flight)"
            )));
        };
        if step_id != rec.step_id {
            let msg = if step_id < rec.step_id {
                format!("step {step_id} was already applied")
            } else {
                format!("step {} is in flight before step {step_id}: apply or fail it first", rec.step_id)
            };
            return Err(SchedError::InvalidOutput(msg));
        }
        if self.in_flight.len() > 1 {
            return Err(SchedError::InvalidOutput(format!(
                "step {step_id} can only fail while it is the only step in flight ({} are): the later steps \
                 were scheduled on its results",
                self.in_flight.len()
            )));
        }
        let Some(rec) = self.in_flight.pop_front() else {
            return Err(SchedError::Internal("in-flight step vanished".into()));
        };
        // A live request outside the step holds blocks the step's schedule() cached only when it promoted the
        // request's finished KV load without scheduling it: their KV arrived from the connector, they stay.
        let mut kept: HashSet<u32> = HashSet::new();
        if !rec.cached_blocks.is_empty() {
            for r in self.slab.iter().filter(|r| !rec.handles.contains(&r.handle)) {
                kept.extend(r.blocks.iter().copied());
                for t in &r.groups {
                    kept.extend(t.blocks.iter().copied());
                }
            }
        }
        for (block, hash) in &rec.cached_blocks {
            if !kept.contains(block) {
                self.kv.pool.uncache(*block, hash);
            }
        }
        // Nothing runs any more: frees deferred behind the step go back (after the uncaching above, as blocks
        // with no KV), and the aborts below free at once.
        self.on_step_applied(rec.handles.len());
        let failed_encoder = rec.encoder_hashes;
        // The step's requests are aborted with its tokens still counted in flight: they were never processed (a
        // KV connector's finish leaves them out of the tokens whose window has passed); nothing runs any more, so
        // their blocks go back at once (`free_request_blocks`).
        let mut ids = Vec::new();
        let mut from_waiting = false;
        for &h in &rec.handles {
            let Some(req) = self.slab.resolve(h) else { continue };
            from_waiting |= req.status != RequestStatus::Running;
            ids.push(req.id.clone());
            self.finish(h.slot, RequestStatus::FinishedAborted)?;
        }
        self.remove_finished_from_queues(from_waiting);
        for &h in &rec.swapped_out {
            if self.slab.resolve(h).is_some() {
                self.release_cpu_blocks(h.slot)?;
            }
        }
        // The encoder outputs this step was to compute may not exist: their entries leave the cache (only the
        // step's requests, now aborted, referenced them) and are reported freed.
        for hash in failed_encoder {
            self.encoder.remove_unreferenced(hash, true);
        }
        self.epoch += 1;
        Ok(ids)
    }

    /// Ends a request: frees its blocks, forgets it, reports it in the next step; returns its id. The caller
    /// removes it from `running`/`waiting` (in one pass for many requests) with `remove_finished_from_queues`.
    pub(crate) fn finish(&mut self, slot: u32, status: RequestStatus) -> Result<Arc<str>> {
        let req = self.slab.get_mut(slot)?;
        let prev = req.status;
        if prev != RequestStatus::Running {
            self.tenants.on_leave_waiting(req.tenant);
        } else {
            self.tenants.on_leave_running(req.tenant);
        }
        req.wait_seq = 0;
        if req.session != NO_SESSION {
            if prev == RequestStatus::Running {
                self.sessions.on_leave_running(req.session, self.next_step_id);
            }
            self.sessions.remove_request(req.session);
        }
        let load_fence =
            if prev == RequestStatus::WaitingForRemoteKvs { self.take_deferred_load(slot) } else { None };
        let load_deferred = load_fence.is_some();
        let req = self.slab.get_mut(slot)?;
        let was_loading = prev == RequestStatus::WaitingForRemoteKvs && !req.kv_load_done && !load_deferred;
        if req.parked {
            req.parked = false;
            self.num_parked -= 1;
            if prev == RequestStatus::WaitingForRemoteKvs {
                self.num_loading -= 1;
            }
        }
        if prev == RequestStatus::WaitingForInput {
            self.num_waiting_for_input -= 1;
        }
        req.status = status;
        if req.deferred {
            req.deferred = false;
            self.num_deferred -= 1;
        }
        if !self.hold_for_transfer(slot, was_loading, load_fence)? {
            self.free_request_blocks(slot, load_deferred)?;
        }
        self.release_cpu_blocks(slot)?;
        self.forget_encoder_inputs(slot)?;
        if self.config.encoder_decoder {
            // vLLM's EncoderDecoderCacheManager frees every finished request's inputs (`encoder_dec.rs`).
            self.enc_dec_free_slots += i64::from(self.slab.get(slot)?.cross_attention_tokens);
        }
        let id = self
            .slab
            .remove(slot)
            .ok_or_else(|| SchedError::Internal(format!("slot {slot} vanished while finishing")))?;
        self.ids.remove(&id);
        if prev == RequestStatus::Running {
            self.finished_running.push(slot);
        }
        self.finished_since_step.push(id.clone());
        self.counters.num_finished_reqs += 1;
        Ok(id)
    }

    /// Takes the requests `finish` ended out of the queues: the running ones (which `finish` recorded) always,
    /// the waiting queues when `waiting` (some request that finished was not running).
    pub(crate) fn remove_finished_from_queues(&mut self, waiting: bool) {
        /// Up to this many finished running requests are found by slot; more take one pass over the records.
        const BY_SLOT: usize = 8;
        let slab = &self.slab;
        let gone = &mut self.finished_running;
        // `finish` recorded them since the previous call; a slot a new request took since (possible only after an
        // error cut a call short) is live again and stays.
        let dead = |s: u32| slab.peek(s).is_none();
        match gone.len() {
            0 => {}
            1 => {
                if let Some(p) = self.running.iter().position(|&s| s == gone[0] && dead(s)) {
                    self.running.remove(p);
                }
            }
            k if k <= BY_SLOT => self.running.retain(|&s| !(gone.contains(&s) && dead(s))),
            _ => self.running.retain(|&s| !dead(s)),
        }
        gone.clear();
        if waiting {
            self.waiting.retain(|h| slab.resolve(h).is_some());
            if !self.kv_waiting.is_empty() {
                self.kv_waiting.retain(|h| slab.resolve(h).is_some());
            }
            if !self.newly_ready.is_empty() {
                self.newly_ready.retain(|&h| slab.resolve(h).is_some());
            }
        }
    }

    pub fn has_unfinished_requests(&self) -> bool {
        self.num_unfinished_requests() > 0
    }

    /// vLLM's `get_num_unfinished_requests`: 0 while paused for all, only the running requests while paused for
    /// new ones (waiting requests stay queued but do not count).
    pub fn num_unfinished_requests(&self) -> usize {
        // Sessions waiting for their next input part do not count (vLLM 0.33 subtracts them in both states).
        match self.pause_state {
            PauseState::PausedAll => 0,
            // Requests holding KV blocks (loading, or loaded and not yet admitted) still drain (vLLM 0.33).
            PauseState::PausedNew => (self.running.len() + self.kv_waiting.len() + self.num_loading)
                .saturating_sub(self.num_waiting_for_input),
            PauseState::Unpaused => self.num_live_requests() - self.num_waiting_for_input,
        }
    }

    /// Running, waiting, loaded-waiting and parked requests.
    pub(crate) fn num_live_requests(&self) -> usize {
        self.running.len() + self.waiting.len() + self.kv_waiting.len() + self.num_parked
    }

    pub fn pause_state(&self) -> PauseState {
        self.pause_state
    }

    /// vLLM's `set_pause_state`: takes effect at the next `schedule()`.
    pub fn set_pause_state(&mut self, state: PauseState) {
        if state != self.pause_state {
            self.pause_state = state;
            self.epoch += 1;
        }
    }

    /// The structured-output grammar of `req_id` is ready. The request is still reported as waiting for it
    /// until an admission pass reaches it (vLLM promotes it there). A request that does not wait for a grammar
    /// is left alone.
    pub fn set_ready(&mut self, req_id: &str) -> Result<()> {
        let slot = self.slot_of(req_id)?;
        let req = self.slab.get_mut(slot)?;
        if req.status == RequestStatus::WaitingForGrammar && !req.grammar_ready {
            req.grammar_ready = true;
            if req.parked {
                self.newly_ready.push(req.handle);
            }
            self.epoch += 1;
        }
        Ok(())
    }

    /// Tokens of a live request whose KV is computed (vLLM's `Request.num_computed_tokens`).
    pub fn get_num_computed_tokens(&self, req_id: &str) -> Result<u32> {
        Ok(self.slab.computed(self.slot_of(req_id)?))
    }

    /// Tokens of a live request scheduled in steps whose output is not yet applied.
    pub fn get_num_in_flight_tokens(&self, req_id: &str) -> Result<u32> {
        Ok(self.slab.hot.in_flight[self.slot_of(req_id)? as usize])
    }

    /// Where a live request's last bounded prefix replay starts (`SchedulerConfig::prefix_replay_groups`; vLLM's
    /// `Request.replay_start`, sent in `NewRequestData`): 0 until it replays, or when nothing replays.
    pub fn get_replay_start(&self, req_id: &str) -> Result<u32> {
        Ok(self.get_request(req_id)?.replay_start)
    }

    /// Output placeholders of a live request (async scheduling; vLLM's `Request.num_output_placeholders`).
    pub fn get_num_output_placeholders(&self, req_id: &str) -> Result<u32> {
        Ok(self.get_request(req_id)?.num_output_placeholders)
    }

    pub fn num_running_reqs(&self) -> usize {
        self.running.len()
    }

    /// Requests not running: waiting, loaded-waiting and parked (blocked) ones.
    pub fn num_waiting_reqs(&self) -> usize {
        self.waiting.len() + self.kv_waiting.len() + self.num_parked
    }

    pub fn num_free_blocks(&self) -> usize {
        self.kv.pool.num_free_blocks()
    }

    pub fn request_id(&self, h: ReqHandle) -> Option<&Arc<str>> {
        self.slab.resolve(h).map(|r| &r.id)
    }

    /// Reserves the token, block and hash lists of a new request for the length it can reach (`longest` slots
    /// plus the last sampled token), up to `RESERVE_MAX_TOKENS` past its prompt: the requests of a batch tend to
    /// reach the same lengths in the same step, and growing all their lists there (reallocate and copy) was most
    /// of a block-boundary step; a prompt's own list would otherwise be exactly full, so its first sampled token
    /// copied the whole prompt. Longer requests grow by doubling past the cap, rarely.
    fn reserve_lists(req: &mut Request, longest: u64, block_size: u32, enable_caching: bool) {
        let cap = req.token_ids.len() as u64 + RESERVE_MAX_TOKENS;
        let max_tokens = (longest + 1).min(cap) as usize;
        req.token_ids.reserve(max_tokens.saturating_sub(req.token_ids.len()));
        let max_blocks = max_tokens.div_ceil(block_size as usize);
        req.blocks.reserve(max_blocks);
        if enable_caching {
            req.block_hashes.reserve(max_blocks);
        }
    }

    /// Tokens a new request of the tenant `"default"` with this prompt would take from the prefix cache now.
    /// Touches nothing.
    pub fn get_num_cached_tokens(
        &self,
        prompt_token_ids: &[i64],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Result<u32> {
        self.get_num_cached_tokens_of(prompt_token_ids, cache_salt, lora_name, None)
    }

    /// `get_num_cached_tokens` for a request of `tenant` (`None`: `"default"`), which keys the lookup under
    /// `isolate_tenant_cache` and changes nothing otherwise.
    pub fn get_num_cached_tokens_of(
        &self,
        prompt_token_ids: &[i64],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
        tenant: Option<&str>,
    ) -> Result<u32> {
        let mut tokens = Vec::with_capacity(prompt_token_ids.len());
        for &t in prompt_token_ids {
            tokens.push(Self::check_token_id("prompt token id", t)?);
        }
        if !self.config.enable_prefix_caching || tokens.is_empty() {
            return Ok(0);
        }
        let cache_salt = if self.config.isolate_tenant_cache {
            Some(tenant_cache_salt(tenant.unwrap_or(DEFAULT_TENANT), cache_salt))
        } else {
            cache_salt.map(Into::into)
        };
        let extra = ExtraKeys { cache_salt, lora_name: lora_name.map(Into::into) };
        let bs = self.config.kv_block_size() as usize;
        // Hash only as far as a lookup can read.
        let blocks = (tokens.len() - 1) / bs + self.kv.lookup_margin_blocks();
        let reach = (blocks * bs + self.kv.hasher.lookahead()).min(tokens.len());
        let mut hashes: Vec<BlockHash> = Vec::new();
        self.kv.hasher.extend_hashes(&mut hashes, &tokens[..reach], bs, &extra, &[], &mut Vec::new());
        let mut hits = Vec::new();
        self.kv.find_longest_cache_hit(&hashes, tokens.len() as u32, &mut hits);
        Ok(hits.len() as u32 * self.config.kv_block_size())
    }

    /// vLLM's `reset_prefix_cache(reset_running_requests)`: with `reset_running_requests`, first preempts every
    /// running request from the tail (so they resume in their running order) and drops their in-flight output;
    /// the reset then cannot fail. Otherwise it succeeds only when no usable block is in use.
    pub fn reset_prefix_cache(&mut self, reset_running_requests: bool) -> Result<bool> {
        if reset_running_requests && !self.running.is_empty() {
            while let Some(slot) = self.running.pop() {
                self.preempt(slot, true)?;
                let id = self.slab.get(slot)?.id.clone();
                self.preempted_since_step.push(id);
            }
            self.epoch += 1;
        }
        let ok = self.kv.pool.reset_prefix_cache();
        if ok {
            self.epoch += 1;
        } else if reset_running_requests {
            if !self.held.is_empty()
                || !self.deferred_frees.is_empty()
                || !self.pins.is_empty()
                || self.slab.iter().any(|r| !r.blocks.is_empty())
            {
                // KV transfers hold blocks (vLLM raises: not supported yet), frees wait for steps in flight, or
                // blocks are pinned.
                return Ok(false);
            }
            return Err(SchedError::Internal("the prefix cache is in use with no request running".into()));
        }
        Ok(ok)
    }

    /// vLLM's `_preempt_request` called by hand (its tests take a request out of `running` and preempt it): the
    /// running request `req_id` is preempted now, as a step preempts a victim in recompute mode. Its blocks are
    /// freed (or wait for the steps in flight, with `defer_block_free`), the output of its steps in flight becomes
    /// stale (dropped with `drop_stale_output`), it goes back to the front of the waiting queue, and the next
    /// step lists it in `preempted_req_ids`. An unknown id, or a request that is not running, is an error that
    /// changes nothing.
    pub fn preempt_request(&mut self, req_id: &str, drop_stale_output: bool) -> Result<()> {
        let slot = self.slot_of(req_id)?;
        let pos = self.running.iter().position(|&s| s == slot).ok_or_else(|| {
            SchedError::InvalidRequest(format!(
                "request {req_id:?} is not running: only a running request can be preempted"
            ))
        })?;
        self.running.remove(pos);
        self.preempt(slot, drop_stale_output)?;
        self.preempted_since_step.push(self.slab.get(slot)?.id.clone());
        self.epoch += 1;
        Ok(())
    }

    /// The number of preemptions so far (`stats().num_preemptions`, without building the whole snapshot).
    pub fn num_preemptions(&self) -> u64 {
        self.counters.num_preemptions
    }

    pub fn stats(&self) -> SchedulerStats {
        let c = &self.counters;
        SchedulerStats {
            num_running_reqs: self.running.len(),
            num_waiting_reqs: self.num_waiting_reqs() - self.num_deferred,
            num_skipped_waiting_reqs: self.num_deferred,
            kv_cache_usage: self.kv.pool.usage(),
            num_free_blocks: self.kv.pool.num_free_blocks(),
            prefix_cache_queries: c.prefix_cache_queries,
            prefix_cache_hits: c.prefix_cache_hits,
            prefix_cache_preempted_queries: c.prefix_cache_preempted_queries,
            prefix_cache_preempted_hits: c.prefix_cache_preempted_hits,
            num_preemptions: c.num_preemptions,
            num_finished_reqs: c.num_finished_reqs,
            connector_prefix_cache_queries: c.connector_prefix_cache_queries,
            connector_prefix_cache_hits: c.connector_prefix_cache_hits,
            step_id: self.next_step_id,
            num_swapped_out_reqs: c.num_swapped_out_reqs,
            num_swapped_out_blocks: c.num_swapped_out_blocks,
            num_swapped_in_reqs: c.num_swapped_in_reqs,
            num_swapped_in_blocks: c.num_swapped_in_blocks,
            num_swap_fallbacks: c.num_swap_fallbacks,
            num_recomputed_tokens: c.num_recomputed_tokens,
            num_free_cpu_blocks: self.cpu.num_free_blocks(),
            cpu_kv_cache_usage: self.cpu.usage(),
            encoder_cache_usage: self.encoder.usage(),
            num_encoder_cache_entries: self.encoder.num_entries(),
            num_encoder_inputs_computed: c.num_encoder_inputs_computed,
            num_encoder_tokens_computed: c.num_encoder_tokens_computed,
            encoder_cache_hits: c.encoder_cache_hits,
        }
    }

    /// Every tenant seen so far (named in `tenant_weights`, in a request, or given a weight), in registration
    /// order, with its weight, virtual counter and service.
    pub fn tenant_stats(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.iter()
    }

    /// Changes a tenant's weight from now on (registering the tenant if it is new). On error nothing changes.
    pub fn set_tenant_weight(&mut self, tenant: &str, weight: f64) -> Result<()> {
        self.tenants.set_weight(tenant, weight)
    }

    pub fn block_hash_of(&self, block: u32) -> Option<&BlockHash> {
        self.kv.pool.block_hash(block)
    }

    /// Checks every internal invariant; `Err` describes the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let cfg = &self.config;
        let mut held = vec![0u32; cfg.num_blocks as usize];
        let mut where_: HashMap<u32, &str> = HashMap::new();
        for &s in &self.running {
            if where_.insert(s, "running").is_some() {
                return Err(format!("slot {s} appears twice in running"));
            }
            if self.slab.peek(s).is_none() {
                return Err(format!("running holds slot {s}, which has no live request"));
            }
        }
        if !self.finished_running.is_empty() {
            return Err(format!("finished slots {:?} are still to leave running", self.finished_running));
        }
        for (queue, name) in [(&self.waiting, "waiting"), (&self.kv_waiting, "kv_waiting")] {
            for h in queue.handles() {
                if self.slab.resolve(h).is_none() {
                    return Err(format!("{name} holds a stale handle {h:?}"));
                }
                if let Some(prev) = where_.insert(h.slot, name) {
                    return Err(format!("slot {} is in {name} and in {prev}", h.slot));
                }
            }
        }
        for h in &self.newly_ready {
            match self.slab.resolve(*h) {
                Some(r) if r.parked => {}
                _ => return Err(format!("newly_ready holds {h:?}, not a parked request")),
            }
        }
        if self.running.len() > cfg.max_num_seqs as usize {
            return Err(format!("{} running requests exceed max_num_seqs", self.running.len()));
        }
        let num_wfi = self.slab.iter().filter(|r| r.status == RequestStatus::WaitingForInput).count();
        if num_wfi != self.num_waiting_for_input {
            return Err(format!(
                "{num_wfi} sessions wait for input, the count says {}",
                self.num_waiting_for_input
            ));
        }
        if self.ids.len() != self.slab.len() {
            return Err(format!("id map has {} entries, slab {}", self.ids.len(), self.slab.len()));
        }
        let bs = cfg.kv_block_size();
        self.slab.check_hot(&self.running)?;
        // A request's in-flight count is what the steps awaiting their output scheduled for it.
        let mut scheduled: HashMap<ReqHandle, u32> = HashMap::new();
        for rec in &self.in_flight {
            for (&h, &n) in rec.handles.iter().zip(&rec.num_scheduled_tokens) {
                *scheduled.entry(h).or_default() += n as u32;
            }
        }
        for r in self.slab.iter() {
            let computed = self.slab.computed(r.handle.slot);
            let in_flight = self.slab.hot.in_flight[r.handle.slot as usize];
            let want = scheduled.get(&r.handle).copied().unwrap_or(0);
            if in_flight != want {
                return Err(format!(
                    "request {:?}: {in_flight} tokens in flight, but the steps in flight hold {want}",
                    r.id
                ));
            }
            match self.ids.get(&r.id) {
                Some(&s) if s == r.handle.slot => {}
                _ => return Err(format!("request {:?} is not mapped to its slot", r.id)),
            }
            let place = where_.get(&r.handle.slot).copied();
            match (r.status, place) {
                (RequestStatus::Running, Some("running")) => {}
                (st, Some("waiting")) if st.is_waiting() && st != RequestStatus::WaitingForRemoteKvs => {
                    if !r.blocks.is_empty() || computed != 0 || r.num_output_placeholders != 0 {
                        return Err(format!("waiting request {:?} holds blocks or computed tokens", r.id));
                    }
                }
                (st, Some("kv_waiting")) if st.is_waiting() && st != RequestStatus::WaitingForGrammar => {
                    if st == RequestStatus::WaitingForRemoteKvs && !r.kv_load_done && cfg.park_kv_loads {
                        return Err(format!("request {:?} is queued while its KV load is in progress", r.id));
                    }
                }
                (RequestStatus::WaitingForGrammar | RequestStatus::WaitingForRemoteKvs, None) if r.parked => {
                }
                (st, p) => return Err(format!("request {:?} has status {st:?} but sits in {p:?}", r.id)),
            }
            if r.parked != place.is_none() {
                return Err(format!("request {:?}: parked flag disagrees with its place", r.id));
            }
            if r.deferred && !r.status.is_waiting() {
                return Err(format!("request {:?} is deferred but not waiting", r.id));
            }
            if self.slab.hot.stale[r.handle.slot as usize] > in_flight {
                return Err(format!("request {:?} has more stale than in-flight tokens", r.id));
            }
            if computed
                > r.num_tokens_with_spec()
                    + r.num_output_placeholders
                    + cfg.num_lookahead_tokens
                    + cfg.num_spec_tokens()
                    + bs
            {
                return Err(format!("request {:?} computed more tokens than it has", r.id));
            }
            if (r.blocks.len() as u64) * u64::from(bs) < u64::from(computed) {
                return Err(format!("request {:?}: blocks do not cover its computed tokens", r.id));
            }
            if r.num_tokens() > cfg.max_model_len || r.num_output_tokens() > r.max_tokens {
                return Err(format!("request {:?} is longer than its limits", r.id));
            }
            if r.groups.len() + 1 != cfg.kv_cache_groups.len().max(1) {
                return Err(format!("request {:?} holds {} block tables", r.id, r.groups.len() + 1));
            }
            let num_hashes = if cfg.enable_prefix_caching {
                self.kv.hasher.num_hashable(r.token_ids.len(), bs as usize)
            } else {
                0
            };
            if r.block_hashes.len() != num_hashes {
                return Err(format!("request {:?}: not one hash per full block with its look-ahead", r.id));
            }
            let primary = self.kv.hybrid.as_deref().map_or(0, |hy| hy.primary);
            for g in 0..=r.groups.len() {
                // This group's block size: its table covers the slots the primary group's covers, at its size
                // (a table of as many entries as some slot count in the primary's last block needs).
                let gbs = self.kv.hybrid.as_deref().map_or(bs, |hy| hy.block_sizes[g]) as usize;
                // Hash blocks per block of this group (a cached group's size is a multiple of the primary's).
                let k = (gbs / bs as usize).max(1);
                let covers = |n: usize, p: usize| {
                    let bs = bs as usize;
                    let lo = if p == 0 { 0 } else { ((p - 1) * bs + 1).div_ceil(gbs) };
                    (lo..=(p * bs).div_ceil(gbs)).contains(&n)
                };
                let (blocks, num_cached) = match crate::hybrid::group_slot(primary, g) {
                    None => (&r.blocks, r.num_cached_blocks),
                    Some(i) => (&r.groups[i].blocks, r.groups[i].num_cached_blocks),
                };
                let window =
                    if cfg.kv_cache_groups.is_empty() { cfg.sliding_window } else { cfg.kv_cache_groups[g] };
                let align_mamba = window == Some(crate::config::MAMBA) && cfg.mamba_align;
                if align_mamba {
                    // An align-mode Mamba table: at least the state's and the speculative blocks' entries from
                    // the first allocation on (null blocks between the states), none cached without prefix
                    // caching, at most the table's entries with it.
                    let least =
                        if r.blocks.is_empty() { 0 } else { 1 + cfg.mamba_speculative_blocks as usize };
                    let most_cached = if cfg.enable_prefix_caching { blocks.len() } else { 0 };
                    if (r.blocks.is_empty() && !blocks.is_empty())
                        || blocks.len() < least
                        || num_cached as usize > most_cached
                    {
                        return Err(format!(
                            "request {:?}: align-mode Mamba group {g} holds {} entries ({num_cached} cached), \
                             expected at least {least} (at most {most_cached} cached)",
                            r.id,
                            blocks.len()
                        ));
                    }
                } else if let Some((kind, whole)) = match window {
                    // Tables taken whole at the first allocation, never cached: a ring's one block, a Mamba
                    // group's state blocks, a cross-attention group's encoder output blocks.
                    Some(crate::config::RING) => Some(("ring", 1)),
                    Some(crate::config::MAMBA) => Some(("Mamba", 1 + cfg.mamba_speculative_blocks as usize)),
                    Some(crate::config::CROSS_ATTENTION) => {
                        Some(("cross-attention", r.cross_attention_tokens.div_ceil(bs) as usize))
                    }
                    _ => None,
                } {
                    let want = if r.blocks.is_empty() { 0 } else { whole };
                    if blocks.len() != want || num_cached != 0 {
                        return Err(format!(
                            "request {:?}: {kind} group {g} holds {} blocks ({num_cached} cached), expected {want} \
                             (none cached)",
                            r.id,
                            blocks.len()
                        ));
                    }
                } else if !covers(blocks.len(), r.blocks.len()) {
                    return Err(format!(
                        "request {:?}: group {g}'s table does not cover the primary group's",
                        r.id
                    ));
                }
                // A sliding window's table starts with the null blocks of the blocks that left the window.
                let num_null = blocks.iter().take_while(|&&b| b == 0).count();
                if num_null > 0 && window.is_none() {
                    return Err(format!("request {:?} holds the null block without a sliding window", r.id));
                }
                let live: Vec<u32> = if align_mamba {
                    blocks.iter().copied().filter(|&b| b != 0).collect()
                } else {
                    blocks[num_null..].to_vec()
                };
                let uniq: HashSet<u32> = live.iter().copied().collect();
                if uniq.len() != live.len() || uniq.contains(&0) {
                    return Err(format!(
                        "request {:?} holds a block twice or a null block after a block",
                        r.id
                    ));
                }
                for &b in &live {
                    held[b as usize] += 1;
                }
                // A replayed window is never cached: its table's cached count stops at its null blocks.
                if cfg.prefix_replay_groups.contains(&(g as u32))
                    && (num_cached as usize > num_null
                        || live.iter().any(|&b| self.kv.pool.block_hash(b).is_some()))
                {
                    return Err(format!(
                        "request {:?}: replayed window group {g} holds a cached block",
                        r.id
                    ));
                }
                if num_cached as usize > blocks.len() {
                    return Err(format!("request {:?}: more cached blocks than blocks", r.id));
                }
                // A window of one token caches nothing (its table's blocks count as cached all the same).
                if cfg.enable_prefix_caching && window != Some(1) {
                    let first = num_null.min(num_cached as usize);
                    for (i, &b) in blocks.iter().enumerate().take(num_cached as usize).skip(first) {
                        if align_mamba && b == 0 {
                            continue; // the null entries between an align-mode Mamba table's states
                        }
                        let sparse_window = window.is_some_and(|w| {
                            crate::hybrid::is_window(w) && crate::hybrid::chunk_size(w).is_none()
                        });
                        // (A window among groups of different block sizes keeps the blocks an aligned hit can use,
                        // retention or not.)
                        let sized = self
                            .kv
                            .hybrid
                            .as_deref()
                            .is_some_and(|hy| hy.block_sizes.iter().any(|&s| s != bs));
                        if (align_mamba || sparse_window)
                            && (cfg.prefix_cache_retention_interval.is_some() || sized)
                            && self.kv.pool.block_hash(b).is_none()
                        {
                            continue; // a state or window block sparse retention did not cache
                        }
                        // With prefix hits inside a block, a Mamba prefill checkpoint keyed at its unit boundary (or
                        // taken out of the cache as a transient state).
                        if align_mamba
                            && self.kv.partial_unit != 0
                            && (self.kv.pool.block_hash(b).is_none()
                                || self.kv.pool.partial_tokens(b).is_some())
                        {
                            continue;
                        }
                        // A block is keyed by the hash of its last hash block.
                        let key = r.block_hashes.get((i + 1) * k - 1).map(|h| crate::hybrid::group_key(h, g));
                        // With the drop, or look-ahead hashes of several tokens (multi-module MTP), a prefill
                        // checkpoint one block below its entry is keyed there.
                        let below = (i > 0
                            && align_mamba
                            && (cfg.drop_trailing_hit_block || cfg.hash_lookahead_tokens > 1)
                            && cfg.mamba_prefill_checkpoint_alignment.is_some())
                        .then(|| r.block_hashes.get(i - 1).map(|h| crate::hybrid::group_key(h, g)))
                        .flatten();
                        let got = self.kv.pool.block_hash(b);
                        if got != key.as_ref() && (below.is_none() || got != below.as_ref()) {
                            return Err(format!(
                                "request {:?}: block {i} hash disagrees with the cache",
                                r.id
                            ));
                        }
                    }
                }
            }
        }
        for (id, h) in &self.held {
            if !h.awaiting_recv && !h.awaiting_send {
                return Err(format!("finished request {id:?} holds blocks for no transfer"));
            }
            if self.ids.contains_key(id) {
                return Err(format!("request {id:?} is live and holds blocks for a finished transfer"));
            }
            for &b in h.tables.iter().chain(&h.window).flatten() {
                held[b as usize] += 1;
            }
        }
        let mut last_fence = 0;
        for (fence, blocks) in &self.deferred_frees {
            if *fence > self.sched_step_seq || *fence < last_fence {
                return Err(format!("deferred free fenced at step {fence} out of order"));
            }
            last_fence = *fence;
            for &b in blocks {
                held[b as usize] += 1;
            }
        }
        if self.processed_step_seq > self.sched_step_seq {
            return Err("more non-empty steps applied than scheduled".into());
        }
        let mut last_fence = 0;
        for d in &self.deferred_loads {
            if d.fence <= self.processed_step_seq || d.fence > self.sched_step_seq || d.fence < last_fence {
                return Err(format!("deferred load fenced at step {} out of order", d.fence));
            }
            last_fence = d.fence;
            match self.slab.resolve(d.handle) {
                Some(r) if r.status == RequestStatus::WaitingForRemoteKvs => {}
                _ => return Err("a deferred load's request is not waiting for its load".into()),
            }
        }
        for (&b, &n) in &self.pins {
            if n == 0 || b == 0 || b as usize >= held.len() {
                return Err(format!("block {b} is pinned {n} times"));
            }
            held[b as usize] += n;
        }
        self.kv.pool.check(&held)?;
        self.check_swap_invariants()?;
        self.check_encoder_invariants()?;
        let parked = self.slab.iter().filter(|r| r.parked).count();
        let loading =
            self.slab.iter().filter(|r| r.parked && r.status == RequestStatus::WaitingForRemoteKvs).count();
        if parked != self.num_parked || loading != self.num_loading {
            return Err(format!(
                "{parked} parked ({loading} loading) requests, counted {} ({})",
                self.num_parked, self.num_loading
            ));
        }
        let mut per_tenant = vec![(0u32, 0u32); self.tenants.len()];
        for r in self.slab.iter() {
            let t = r.tenant as usize;
            match per_tenant.get_mut(t) {
                Some((_, n)) if r.status == RequestStatus::Running => *n += 1,
                Some((n, _)) => *n += 1,
                None => return Err(format!("request {:?} has an unknown tenant {t}", r.id)),
            }
        }
        self.tenants.check_counts(&per_tenant)?;
        let mut per_session: HashMap<u32, (u32, u32)> = HashMap::new();
        for r in self.slab.iter().filter(|r| r.session != NO_SESSION) {
            let e = per_session.entry(r.session).or_default();
            e.0 += 1;
            e.1 += u32::from(r.status == RequestStatus::Running);
        }
        self.sessions.check(&per_session)?;
        self.check_aging()?;
        let deferred = self.slab.iter().filter(|r| r.deferred).count();
        if deferred != self.num_deferred {
            return Err(format!("{deferred} deferred requests, counted {}", self.num_deferred));
        }
        if self.counters.last_num_scheduled_reqs > cfg.max_num_seqs as usize {
            return Err("the last step scheduled more than max_num_seqs requests".into());
        }
        let inputs = self.counters.last_num_scheduled_tokens
            + self.counters.last_num_scheduled_reqs as u64 * u64::from(cfg.draft_slots);
        if self.counters.last_num_scheduled_tokens > u64::from(cfg.token_budget())
            || inputs > u64::from(cfg.max_num_batched_tokens)
        {
            return Err("the last step exceeded the token budget".into());
        }
        if cfg.policy == Policy::Fcfs && !matches!(self.waiting, WaitingQueue::Fcfs(_)) {
            return Err("queue type does not match the policy".into());
        }
        Ok(())
    }

    /// The finish reason reported for a final status.
    pub(crate) fn finish_reason(status: RequestStatus) -> FinishReason {
        match status {
            RequestStatus::FinishedLengthCapped => FinishReason::Length,
            RequestStatus::FinishedAborted => FinishReason::Abort,
            RequestStatus::FinishedError => FinishReason::Error,
            _ => FinishReason::Stop,
        }
    }
}
