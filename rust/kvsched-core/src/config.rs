//! Scheduler configuration and its validation. Field names and defaults follow vLLM's `SchedulerConfig` and
//! `CacheConfig`. A config that passes `validate()` can never make the scheduler divide by zero or overflow an
//! int32 slot id; requests that could never be scheduled under it are refused by `add_request`.
//!
//! The Python package declares the same fields once, in the table of `kvsched.config.SchedulerConfig`; its
//! tests hold this file to that table: the same defaults, the same bounds, the same rules applied in the same
//! order, and the same messages (numbers and names printed as Python prints them, see `py_float`/`py_str`).

use crate::error::{Result, SchedError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: waiting is a deque; the last running request is the preemption victim.
    Fcfs,
    /// Lower `priority` first, then earlier `arrival_time`, then request id.
    Priority,
    /// Weighted fair share across tenants (the Virtual Token Counter; see `fair.rs`).
    Fair,
    /// Shortest (uncached) prompt first: the fewest prompt blocks beyond the request's prefix-cache hit (see
    /// `order.rs`); preempted requests first, as under FCFS.
    Sjf,
    /// Earliest TTFT deadline first (`arrival_time + ttft_slo_s`); preempted requests first, as under FCFS.
    Slo,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            "fair" => Ok(Policy::Fair),
            "sjf" => Ok(Policy::Sjf),
            "slo" => Ok(Policy::Slo),
            other => Err(SchedError::InvalidConfig(format!(
                "policy must be one of ('fcfs', 'priority', 'fair', 'sjf', 'slo'), got {}",
                py_str(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
            Policy::Fair => "fair",
            Policy::Sjf => "sjf",
            Policy::Slo => "slo",
        }
    }

    /// The orders built on FCFS (`fcfs`, `sjf`, `slo`): what FCFS puts at the front of the queue (preempted
    /// requests, requests an admission pass skipped, requests made ready) goes there under them too; they
    /// order only the requests FCFS appends at the back.
    pub fn is_fcfs_family(self) -> bool {
        matches!(self, Policy::Fcfs | Policy::Sjf | Policy::Slo)
    }
}

/// What happens to a preempted request's KV (see `swap.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Drop it and recompute it on resume (vLLM v1; the default).
    Recompute,
    /// Copy it to the CPU pool and back on resume; recompute only when the CPU pool is full.
    Swap,
    /// Per victim, whichever of the two costs less by the configured cost constants.
    Auto,
}

impl PreemptionMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "recompute" => Ok(PreemptionMode::Recompute),
            "swap" => Ok(PreemptionMode::Swap),
            "auto" => Ok(PreemptionMode::Auto),
            other => Err(SchedError::InvalidConfig(format!(
                "preemption_mode must be one of ('recompute', 'swap', 'auto'), got {}",
                py_str(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PreemptionMode::Recompute => "recompute",
            PreemptionMode::Swap => "swap",
            PreemptionMode::Auto => "auto",
        }
    }
}

/// Which running request phase A preempts when a request's KV slots cannot be allocated (see `victim.rs`).
/// Every rule stays inside the policy's level: the lowest priority under `priority`, the tenants with the
/// largest counter under `fair`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionVictim {
    /// vLLM's rule: the last running request (`fcfs`), the largest `(priority, arrival_time)` (`priority`), the
    /// last request of the tenant with the largest counter (`fair`).
    Default,
    /// Least computed first: the fewest computed tokens, the least work to redo.
    Lcf,
    /// The largest `reclaimable blocks / tokens * share of the output budget left` (blocks freed per token
    /// to redo, far from done).
    Cost,
}

impl PreemptionVictim {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "default" => Ok(PreemptionVictim::Default),
            "lcf" => Ok(PreemptionVictim::Lcf),
            "cost" => Ok(PreemptionVictim::Cost),
            other => Err(SchedError::InvalidConfig(format!(
                "preemption_victim must be one of ('default', 'lcf', 'cost'), got {}",
                py_str(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PreemptionVictim::Default => "default",
            PreemptionVictim::Lcf => "lcf",
            PreemptionVictim::Cost => "cost",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlgo {
    Xxh3_128,
    Sha256,
    /// SHA-256; a block without extra keys is keyed with vLLM's default block hash (see `hashing.rs`).
    Sha256Pickle,
}

impl HashAlgo {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "xxh3_128" => Ok(HashAlgo::Xxh3_128),
            "sha256" => Ok(HashAlgo::Sha256),
            "sha256_pickle" => Ok(HashAlgo::Sha256Pickle),
            other => Err(SchedError::InvalidConfig(format!(
                "prefix_hash_algo must be one of ('xxh3_128', 'sha256', 'sha256_pickle'), got {}",
                py_str(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Xxh3_128 => "xxh3_128",
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Pickle => "sha256_pickle",
        }
    }
}

/// What happens to a request whose asynchronous KV load failed (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLoadFailurePolicy {
    /// The request computes the tokens that did not load itself (vLLM's default).
    Recompute,
    /// The request finishes with status `FinishedError`.
    Fail,
}

impl KvLoadFailurePolicy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "recompute" => Ok(KvLoadFailurePolicy::Recompute),
            "fail" => Ok(KvLoadFailurePolicy::Fail),
            other => Err(SchedError::InvalidConfig(format!(
                "kv_load_failure_policy must be one of ('recompute', 'fail'), got {}",
                py_str(other)
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvLoadFailurePolicy::Recompute => "recompute",
            KvLoadFailurePolicy::Fail => "fail",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
    pub enable_prefix_caching: bool,
    /// Record the blocks entering and leaving the prefix cache as vLLM's KV cache events
    /// (`Scheduler::take_kv_cache_events`).
    pub enable_kv_cache_events: bool,
    pub enable_chunked_prefill: bool,
    pub long_prefill_token_threshold: u32,
    pub policy: Policy,
    pub num_lookahead_tokens: u32,
    /// Draft tokens per request per step (vLLM's `num_speculative_tokens`): the padding of new decodes, the
    /// placeholder drafts of async scheduling and the most drafts a request may hold. `None`: the same as
    /// `num_lookahead_tokens` (a drafter that reserves one KV slot per draft, as EAGLE does; an n-gram drafter
    /// reserves none and sets this alone).
    pub num_speculative_tokens: Option<u32>,
    pub prefix_hash_algo: HashAlgo,
    /// Seeds the hash chain; `None` draws a random seed per scheduler.
    pub prefix_hash_seed: Option<Vec<u8>>,
    /// vLLM's full-prompt admission gate: a waiting request is admitted only if the KV cache can hold all of
    /// its tokens (minus prefix hits), not just its first chunk.
    pub scheduler_reserve_full_isl: bool,
    /// FCFS only: how many waiting requests phase B may reorder warm-before-cold (0 = strict order).
    pub cache_aware_admission_window: u32,
    /// KV usage at or above which the admission window applies, in [0, 1].
    pub cache_aware_admission_threshold: f64,
    /// Tenant weights (tenants not listed weigh 1.0); each finite and > 0.
    pub tenant_weights: Vec<(String, f64)>,
    /// Virtual-counter charge per prompt token computed (divided by the tenant's weight); finite, >= 0.
    pub fair_prefill_weight: f64,
    /// Virtual-counter charge per output token (divided by the tenant's weight); finite, >= 0.
    pub fair_decode_weight: f64,
    /// Tenant cache isolation: every request's blocks are keyed by its tenant (`hashing::tenant_cache_salt`
    /// salts block 0), so no request hits a block cached for another tenant.
    pub isolate_tenant_cache: bool,
    /// The most running requests of a tenant not named in `tenant_max_running` (`None`: no limit). At least 1.
    pub max_running_per_tenant: Option<u32>,
    /// Per-tenant running limits, overriding `max_running_per_tenant`; each in [1, i32::MAX].
    pub tenant_max_running: Vec<(String, u32)>,
    /// The most waiting (live, not running) requests of a tenant not named in `tenant_max_waiting` (`None`: no
    /// limit): `add_request` refuses a request of a tenant at its limit with `QueueFull`. At least 1.
    pub max_waiting_per_tenant: Option<u32>,
    /// Per-tenant waiting limits, overriding `max_waiting_per_tenant`; each in [1, i32::MAX].
    pub tenant_max_waiting: Vec<(String, u32)>,
    /// PRIORITY only: a waiting request gains one priority level per this many steps of age (0 = off).
    pub priority_aging_steps: u32,
    /// SLO: the TTFT target of a request added without `ttft_slo_s` (`None`: such a request has no deadline
    /// and sorts after every request that has one). Finite and > 0.
    pub default_ttft_slo_s: Option<f64>,
    /// Aging for every order: a request that has waited this many steps without being admitted goes ahead of
    /// the policy's order, oldest first (`None`: off). At least 1.
    pub max_wait_steps: Option<u32>,
    /// Session affinity (FCFS with an admission window): how many steps after its last request left
    /// `running` a `session_id` still counts as recently active. At least 1.
    pub session_ttl_steps: u32,
    /// vLLM's `AsyncScheduler`: every scheduled decode leaves output placeholders, so the next step (scheduled
    /// before this one's output is applied) already gives the request its next token.
    pub async_scheduling: bool,
    /// Most distinct LoRA adapters (`lora_name`) among running requests; an admission that would exceed it is
    /// skipped. 0 = no limit.
    pub max_loras: u32,
    /// Share of `num_blocks` kept free when admitting waiting requests (vLLM's `watermark`), in [0, 1).
    pub watermark: f64,
    /// Most requests admitted into `running` (vLLM's `max_num_active_seqs`); 0 = `max_num_seqs`. At most
    /// `max_num_seqs`.
    pub max_num_active_seqs: u32,
    /// vLLM's `long_prefill_token_threshold_adaptive`: the per-request cap is floored at a fair share of the
    /// budget, `max_num_batched_tokens / (running + waiting)`.
    pub long_prefill_token_threshold_adaptive: bool,
    /// vLLM's local prefill cadence (`prefill_schedule_interval`): while something decodes, prefill runs only
    /// once this many executed steps have passed since the last step that carried prefill. 1 = every step.
    pub prefill_schedule_interval: u32,
    /// What a preemption does with the victim's KV.
    pub preemption_mode: PreemptionMode,
    /// Blocks in the CPU swap pool (ids `0..num_cpu_blocks`, no null block); > 0 for swap and auto.
    pub num_cpu_blocks: u32,
    /// Auto: the cost of computing one token of a victim's context again (initial value; settable at run time).
    pub recompute_cost_per_token: f64,
    /// Auto: the cost of copying one block in one direction, in the same unit (initial value; settable).
    pub swap_cost_per_block: f64,
    /// Which running request a preemption takes (inside the policy's lowest level).
    pub preemption_victim: PreemptionVictim,
    /// KV connector: what a failed asynchronous load does to its request.
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Where a request waiting for its structured-output grammar waits. `true` (the newer vLLM rule): parked
    /// out of `waiting` until `set_ready`, then queued at the front of `waiting` in the order added. `false`
    /// (vLLM 0.33): it stays in `waiting` at its place; an admission pass that reaches it while blocked skips
    /// it and puts it back at the front, in order, at the end of the step.
    pub park_grammar_waits: bool,
    /// Decode context parallelism (vLLM's `decode_context_parallel_size`): the KV cache is sharded over this
    /// many ranks, so one block id names `block_size` slots on each of them and covers
    /// `block_size * dcp_world_size` tokens (`kv_block_size`). In [1, 1024].
    pub dcp_world_size: u32,
    /// Prefill context parallelism (vLLM's `prefill_context_parallel_size`): prefill tokens are split over this
    /// many ranks, which replicate the KV cache (or share it through DCP spanning them). It does not change the
    /// scheduler's block unit (vLLM 0.33 builds its KV cache manager with `pcp_world_size=1`). In [1, 1024];
    /// with both > 1, `dcp_world_size` must be a multiple of it (vLLM: DCP spans the PCP axis or TP x PCP).
    pub pcp_world_size: u32,
    /// vLLM's `cp_kv_cache_interleave_size`: consecutive tokens stored on one DCP rank before the next rank's
    /// turn; divides `block_size`. Used only by the rank-local slot mapping (`prepare_model_inputs`).
    pub cp_kv_cache_interleave_size: u32,
    /// Encoder tokens a step may compute (vLLM's encoder compute budget); requests with encoder inputs need it
    /// to be at least their largest input. 0: no encoder inputs accepted.
    pub max_num_encoder_input_tokens: u32,
    /// Encoder-cache capacity in encoder tokens (vLLM's `encoder_cache_size`); 0: no encoder inputs accepted.
    pub encoder_cache_size: u32,
    /// vLLM's `disable_chunked_mm_input`: a prefill chunk never covers only part of an encoder input; it stops
    /// before the input instead.
    pub disable_chunked_mm_input: bool,
    /// vLLM's encoder-decoder scheduling (`EncoderDecoderCacheManager`): an admission's `cross_attention_tokens`
    /// are its encoder inputs, charged to the step's encoder budget and to a slot count that starts at
    /// `encoder_cache_size` (`encoder_dec.rs`). Needs a cross-attention group.
    pub encoder_decoder: bool,
    /// Where a request whose asynchronous KV load is in progress waits. `true`: parked out of every queue until
    /// the load is reported over, then queued at the back of `kv_waiting` (in the order added, among those
    /// reported between two steps). `false` (vLLM 0.33): it goes to the front of `kv_waiting` with the other
    /// requests skipped in its step and keeps its place there; admission passes that reach it while it loads skip
    /// it, and the one that reaches it after its load is over promotes and admits it at that place.
    pub park_kv_loads: bool,
    /// vLLM 0.33's reservation for asynchronous loads: such a load is admitted only if its blocks fit beside
    /// the blocks every in-flight prefill (an earlier asynchronous load, or an admitted request with prompt left)
    /// still needs for its whole sequence, plus one decode step's blocks with speculative decoding.
    pub reserve_inflight_prefills: bool,
    /// vLLM 0.33 with a KV consumer connector and several batches in flight: the blocks of a request freed
    /// (finished, preempted, released after a transfer) while a step that scheduled it is still in flight go back
    /// to the pool only once every step scheduled before the free is applied (a load into a reused block could
    /// otherwise race the step still writing it); a preemption victim with a step in flight is not preempted
    /// (the allocation gives up instead).
    pub defer_block_free: bool,
    /// With `defer_block_free` (vLLM 0.33 with HiSparse, or set on a built scheduler as vLLM's tests do): an
    /// asynchronous load admitted while a non-empty step is in flight is registered with the connector
    /// (`update_state_after_alloc`) only once every step scheduled before its admission is applied (a released
    /// block may still be read by such a step, and the load is not ordered against it).
    pub defer_async_loads: bool,
    /// vLLM 0.33 with a KV connector that requires KV delivery (producer roles): a preempted request's output
    /// of steps still in flight is dropped, not delivered (delivering it could finish the request and hand off
    /// blocks the preemption already freed).
    pub drop_preempted_output: bool,
    /// vLLM's `SupportsHMA` connectors: the KV connector's hooks get every KV cache group's blocks (one table per
    /// group, group order; one table without `kv_cache_groups`), and at a finish a window's blocks that left the
    /// window of the processed tokens (and an align-mode Mamba group's states below the last processed token's)
    /// go back to the pool before the connector sees the tables (null blocks in their place). Allows a connector,
    /// and `defer_block_free`, with full-attention, sliding-window and Mamba groups.
    pub kv_connector_groups: bool,
    /// vLLM's KV connectors that complete divergent local hybrid hits (`supports_divergent_local_hybrid_hits`):
    /// with a connector, align-mode Mamba groups with prefix caching and a full-attention group, a new request's
    /// local hit is each lookup set's own, found alone, and its length the full-attention set's, unless a group's
    /// runs deeper (the usual hit then). When some group's hit is shorter (the hit diverged) and the connector
    /// finds no tokens, the usual hit replaces it. No effect otherwise.
    pub divergent_local_hits: bool,
    /// Which LoRA adapters count against `max_loras` when a waiting request is admitted. `true` (vLLM 0.33): those
    /// of every running request, scheduled in this step or not. `false` (vLLM 0.32): only those of the running
    /// requests scheduled in this step.
    pub max_loras_counts_unscheduled: bool,
    /// Under policy `priority`, when the running request being scheduled cannot get blocks and is itself the
    /// lowest-ranked victim: `true` (vLLM 0.33) preempts it and goes on with the next running request (they rank
    /// higher and may fit in the blocks it freed); `false` (vLLM 0.32) ends the pass over the running requests,
    /// as `fcfs` always does.
    pub continue_after_self_preemption: bool,
    /// A waiting request whose encoder input at the start of its chunk cannot be scheduled this step (the encoder
    /// budget or cache is short and no token before the input is left to compute; an encoder-decoder request whose
    /// encoder output does not fit the budget or the slots): `true` (vLLM 0.33) skips it, it keeps its place and
    /// the pass goes on; `false` (vLLM 0.32) ends the admission pass there.
    pub skip_encoder_blocked_admissions: bool,
    /// With a drafter's prefill lookahead (`prefill_lookahead_tokens` `N`) and encoder inputs: `true` (vLLM 0.33)
    /// cuts a chunk just before an input that does not fit and releases a consumed input at its end; `false`
    /// (vLLM 0.32) leaves the lookahead in both: the cut stops `N` tokens before the input (at nothing when the
    /// chunk starts fewer than `N + 1` tokens before it) and the release waits until `N` tokens past its end.
    pub exact_encoder_cut_and_release: bool,
    /// A waiting request whose chunk the prefill lookahead (`prefill_lookahead_tokens`) cuts to nothing: `true`
    /// (vLLM 0.33) skips it, it keeps its place and the pass goes on; `false` (vLLM 0.32) ends the admission pass
    /// there.
    pub skip_lookahead_cut_admissions: bool,
    /// When a step's output is applied, the blocks its tokens completed are cached then (instead of at the
    /// request's next allocation) for a running request with output placeholders (async scheduling) and, if
    /// `true` (vLLM 0.33), for every running request when speculative decoding is on; `false` (vLLM 0.32): only
    /// with output placeholders.
    pub cache_drafts_at_update: bool,
    /// A stop inside a step's tokens (a draft accepted past EOS or `max_tokens`): `true` (vLLM 0.33) cuts the
    /// request's computed count back to the tokens kept; `false` (vLLM 0.32) leaves it, so the blocks a KV
    /// connector is handed at the finish also cover the cut tokens. Blocks cached at that update never cover them.
    pub trim_computed_on_stop: bool,
    /// The blocks cached when a step's output is applied (see `cache_drafts_at_update`) reach the request's
    /// computed tokens less those of its steps still in flight: `true` (vLLM 0.33); `false` (vLLM 0.32's
    /// asynchronous scheduler): less its output placeholders left. The two differ only after invalid blocks of a
    /// synchronous KV load rolled back a request with a step in flight: the skipped output of the rolled-back
    /// step leaves a placeholder that no step in flight accounts for.
    pub cache_upto_in_flight: bool,
    /// Tokens after each full block that its prefix-cache hash also covers (vLLM 0.33's look-ahead block hashes
    /// for EAGLE-style drafters, `num_hash_lookahead_tokens`): block `i`'s hash exists, and the block can enter
    /// the prefix cache, only once the request has `(i + 1) * block_size + hash_lookahead_tokens` tokens, and a
    /// hit on it needs those following tokens to match too. 0: a block's hash covers its own tokens.
    pub hash_lookahead_tokens: u32,
    /// Prefill tokens past a chunk's end that the drafter reads (vLLM's `num_prefill_lookahead_tokens`: the number
    /// of draft tokens for a multi-module MTP drafter, 1 for other EAGLE-style drafters, 0 without one). `N > 1`:
    /// a prefill chunk never ends fewer than `N` tokens before the request's known tokens end (it is shortened to
    /// leave `N`, possibly to nothing), and the last `N - 1` computed tokens are not yet final: the blocks entering
    /// the prefix cache stop `N - 1` tokens short of the tokens being cached (with several groups only together
    /// with `drop_trailing_hit_block`, and then not in Mamba groups outside its rules, `mamba_eagle_group` off,
    /// as vLLM's hybrid coordinator). The encoder inputs a chunk reaches extend `N` tokens past its end
    /// (`encoder_sched.rs`). 0 changes nothing, nor does 1 without encoder inputs.
    pub prefill_lookahead_tokens: u32,
    /// Tokens below the window that every sliding-window group keeps (vLLM's `SlidingWindowSpec.
    /// extra_retained_tokens`, `num_prefill_lookahead_tokens - 1` with a multi-module MTP drafter): a window's
    /// blocks leave the request `extra_retained_tokens` tokens later, and its admission cap holds that many tokens
    /// more; prefix hits still need only the window's blocks. Needs a sliding window (`sliding_window` or a window
    /// group); not chunked-local groups.
    pub extra_retained_tokens: u32,
    /// Tokens per prefix-cache hash unit (vLLM's `hash_block_size`, set through `prefix_match_unit`): a block's
    /// hash chains over `block_size / hash_block_size` units, each hashed over its own tokens with its parent the
    /// unit before it, and is the hash of its last unit (`hashing.rs`); hits, caching and eviction stay whole
    /// blocks. `None`: `block_size` (one unit per block). Below `block_size` it must divide it and needs
    /// `kv_cache_groups` (vLLM hashes finer than the block only with several KV cache groups); with prefix
    /// caching on it cannot be combined with a Mamba group, `hash_lookahead_tokens`, `drop_trailing_hit_block` or
    /// `enable_kv_cache_events`.
    pub hash_block_size: Option<u32>,
    /// The longest prefix hit gives up its last block, which is computed again (vLLM's EAGLE trailing-block drop,
    /// `use_eagle` of its KV cache manager). With a sliding window, the hit's run of window blocks needs one
    /// block more before the drop; with several groups, every attention group drops as vLLM's hybrid
    /// coordinator does when no group is marked as the drafter's (see `hybrid_kv.rs`); align-mode Mamba groups
    /// (`mamba_align`) then also move their prefill chunk ends and checkpoints one block lower (`hybrid.rs`). Not
    /// with a chunked-local group (vLLM has no drop there).
    pub drop_trailing_hit_block: bool,
    /// Every layer attends to the last `sliding_window` tokens only (vLLM's `SlidingWindowSpec`, one KV cache
    /// group): blocks wholly outside the window go back to the pool as the request advances, and a prefix hit
    /// needs only the window's blocks (see `kv_cache_manager.rs`). `None`: full attention.
    pub sliding_window: Option<u32>,
    /// Several KV cache groups sharing one pool and one block size (vLLM's hybrid models: full attention plus
    /// sliding-window or chunked-local layers): one entry per group, `None` for full attention or `Some(w)` for a
    /// window of `w` tokens, `Some(CHUNKED_LOCAL | c)` for chunked-local attention in chunks of `c` tokens (with a
    /// full-attention group), `Some(CROSS_ATTENTION)` for a cross-attention group (encoder-decoder models) or
    /// `Some(MAMBA)` for a Mamba group (hybrid Mamba models with `mamba_cache_mode` "none"). The first group that
    /// is not Mamba (the *primary* group: `Request::blocks`) must be full attention, a window or chunked-local.
    /// Each request holds one block table per group; a prefix hit must be valid for every group (`hybrid.rs`).
    /// Empty: one group (full attention, or `sliding_window`).
    pub kv_cache_groups: Vec<Option<u32>>,
    /// Each KV cache group's block size in tokens, in group order (vLLM's hybrid models whose groups have
    /// different page sizes: its engine raises the smaller-page group's block size so the pages match): a block
    /// of group `g` holds `kv_cache_group_block_sizes[g]` tokens, one pool of equal pages serving every group.
    /// Each a multiple of `block_size`, the primary group's equal to it (`block_size` is the prefix-cache hash
    /// unit: vLLM's `hash_block_size`, the cached groups' sizes' greatest common divisor), but a replayed window's
    /// (`prefix_replay_groups`, never hashed), which may be any size; hits are aligned to the sizes' least
    /// common multiple (vLLM's scheduler block size; `hybrid.rs`). Only full-attention and sliding-window groups
    /// when the sizes differ. Empty: every group has `block_size`.
    pub kv_cache_group_block_sizes: Vec<u32>,
    /// The extra state blocks a request holds in each Mamba group for speculative decoding (vLLM's
    /// `MambaSpec.num_speculative_blocks`): a request holds `1 + mamba_speculative_blocks` blocks there. Needs a
    /// Mamba group when above 0.
    pub mamba_speculative_blocks: u32,
    /// Mamba groups in vLLM's `mamba_cache_mode` "align" (`hybrid.rs`): a Mamba group's blocks are `block_size`
    /// tokens long and its table grows with the request, holding real blocks only at its running state (the rest
    /// null blocks), and prefill chunks end at block boundaries (`step.rs`); with `enable_prefix_caching`, Mamba
    /// prefix hits and cached states at block boundaries (with KV cache events for them). Needs a Mamba group.
    /// `false`: mode "none".
    pub mamba_align: bool,
    /// With several KV cache groups, report every attention block an allocation pops in the step's
    /// `zero_block_ids` (vLLM's `needs_kv_cache_zeroing`: its workers zero them before use), as a Mamba group
    /// implies: vLLM also zeroes them for caches whose attention layers store more than one precision (a block
    /// reused by another group would be read in the other precision), a ring group's float32 keys among them.
    /// Needs `kv_cache_groups`. `false`: only with a Mamba group.
    pub zero_new_blocks: bool,
    /// Sparse prefix-cache retention (vLLM's `prefix_cache_retention_interval`; `hybrid.rs`) of align-mode Mamba
    /// states and sliding-window blocks: `None` caches every block (dense); `Some(0)` a Mamba group's states
    /// a later request can resume at only (the prompt's last block boundary that leaves a token, and the
    /// shared-prefix junction), and a window's blocks a hit at those positions needs (the window's blocks before
    /// each, one block further with the trailing-block drop); `Some(r)` (a multiple of `block_size`) those plus
    /// the state (the window's blocks) at the end of every `r` tokens. Full-attention, chunked-local and
    /// cross-attention groups cache every block; above 0 it needs a sliding window or a Mamba group.
    pub prefix_cache_retention_interval: Option<u32>,
    /// Prefill checkpoints of align-mode Mamba groups (vLLM's `MambaSpec.num_prefill_checkpoint_blocks` above 0
    /// with `prefill_checkpoint_alignment`; `hybrid_kv.rs`): `Some(a)`: a prefill chunk that starts at a block
    /// boundary can export the state at a block boundary inside it, a multiple of `a` tokens from its start, into
    /// an extra block, so it need not end there; `None`: none. Needs `mamba_align`.
    pub mamba_prefill_checkpoint_alignment: Option<u32>,
    /// The rows of the ring groups' rings (vLLM's `CircularBufferSpec.block_size`): `None`: the block size. Only a
    /// speculative decode step's blocks that an asynchronous KV load reserves count a ring's blocks by it (vLLM
    /// counts that step at every group's own block size); a ring holds one block whatever its rows. Needs a ring
    /// group.
    pub ring_block_size: Option<u32>,
    /// The sliding-window groups rebuilt by bounded prefix replay (vLLM's `SlidingWindowMLASpec` with
    /// `bounded_replay`, DeepSeek V4.1): never cached nor looked up; a prefix hit (local or loaded) recomputes its
    /// last window (the groups' common window) to rebuild them, without rewriting the hit's cached KV elsewhere
    /// (`hybrid.rs`, `step.rs`). A replayed window is never the primary group (it may come first, as DeepSeek
    /// V4.1's sliding-window cache does: the primary group is then the first attention group after it). Empty:
    /// none.
    pub prefix_replay_groups: Vec<u32>,
    /// Align-mode Mamba groups with prefix caching: which cached states defer a same-step hit on them
    /// (`hybrid.rs`). `true` (vLLM 0.33): the states an allocation caches in the current `schedule()` call.
    /// `false` (vLLM 0.32): also the state at the prompt's checkpoint (its last block boundary that leaves a
    /// token) whenever an allocation's cacheable tokens, floored to a block, end there and the request holds that
    /// state, even when it was cached before (by a hit or an earlier step).
    pub mamba_defer_new_states_only: bool,
    /// With `drop_trailing_hit_block`: whether align-mode Mamba groups take the drop's rules (vLLM's
    /// `is_eagle_group` marks them, or marks no group; `hybrid_kv.rs`). `false` (vLLM when it marks other groups
    /// only): a Mamba lookup is no verification of the drop (one that shortens the hit makes the drop's lookups
    /// check again), the tokens a Mamba group caches are floored to a block, and under sparse retention it keeps
    /// no state one block below a shared-prefix junction.
    pub mamba_eagle_group: bool,
    /// With `drop_trailing_hit_block`, sparse retention and several KV cache groups: whether a window's run (and
    /// the state of a Mamba group that takes the drop's rules) is also kept one block below a shared-prefix
    /// junction (vLLM 0.33); `false`: at the junction only (vLLM 0.32).
    pub drop_junction_below: bool,
    /// Tokens computed per step (vLLM's `max_num_scheduled_tokens`), a budget apart from the model inputs
    /// `max_num_batched_tokens` counts; 0 = `max_num_batched_tokens`. At most `max_num_batched_tokens`.
    pub max_num_scheduled_tokens: u32,
    /// Model inputs a drafter adds to every scheduled request, taken from `max_num_batched_tokens` (vLLM's
    /// `max_num_new_slots_for_drafting`). Below `max_num_batched_tokens`.
    pub draft_slots: u32,
    /// `schedule()` calls between two steps of one request that are not prefill chunks (vLLM's `decode_stagger`:
    /// `pipeline_parallel_size` on model runner V2 with async scheduling): after a step that leaves a request
    /// with nothing known to compute, phase A skips it until this many calls later. 1 = no wait.
    pub decode_stagger: u32,
    /// The most steps the caller keeps in flight (vLLM's `max_concurrent_batches`: the pipeline-parallel size,
    /// plus one with async scheduling on model runner V2); 0 = 2 with `async_scheduling`, else 1. Sizes the
    /// blocks a sliding-window request may hold at admission.
    pub max_concurrent_batches: u32,
}

/// What `schedule()` may do (vLLM's `PauseState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseState {
    Unpaused,
    /// No admissions from the waiting queue; running requests continue.
    PausedNew,
    /// Nothing is scheduled.
    PausedAll,
}

impl PauseState {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "unpaused" => Ok(PauseState::Unpaused),
            "paused_new" => Ok(PauseState::PausedNew),
            "paused_all" => Ok(PauseState::PausedAll),
            other => Err(SchedError::InvalidRequest(format!(
                "pause state must be one of ('unpaused', 'paused_new', 'paused_all'), got {other:?}"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PauseState::Unpaused => "unpaused",
            PauseState::PausedNew => "paused_new",
            PauseState::PausedAll => "paused_all",
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            block_size: 16,
            num_blocks: 4096,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 8192,
            enable_prefix_caching: true,
            enable_kv_cache_events: false,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            policy: Policy::Fcfs,
            num_lookahead_tokens: 0,
            num_speculative_tokens: None,
            prefix_hash_algo: HashAlgo::Xxh3_128,
            prefix_hash_seed: None,
            scheduler_reserve_full_isl: true,
            cache_aware_admission_window: 0,
            cache_aware_admission_threshold: 0.5,
            tenant_weights: Vec::new(),
            fair_prefill_weight: 1.0,
            fair_decode_weight: 2.0,
            isolate_tenant_cache: false,
            max_running_per_tenant: None,
            tenant_max_running: Vec::new(),
            max_waiting_per_tenant: None,
            tenant_max_waiting: Vec::new(),
            priority_aging_steps: 0,
            default_ttft_slo_s: None,
            max_wait_steps: None,
            session_ttl_steps: 1000,
            async_scheduling: false,
            max_loras: 0,
            watermark: 0.0,
            max_num_active_seqs: 0,
            long_prefill_token_threshold_adaptive: false,
            prefill_schedule_interval: 1,
            preemption_mode: PreemptionMode::Recompute,
            num_cpu_blocks: 0,
            recompute_cost_per_token: 1.0,
            swap_cost_per_block: 1.0,
            preemption_victim: PreemptionVictim::Default,
            kv_load_failure_policy: KvLoadFailurePolicy::Recompute,
            park_grammar_waits: true,
            dcp_world_size: 1,
            pcp_world_size: 1,
            cp_kv_cache_interleave_size: 1,
            max_num_encoder_input_tokens: 0,
            encoder_cache_size: 0,
            disable_chunked_mm_input: false,
            encoder_decoder: false,
            park_kv_loads: true,
            reserve_inflight_prefills: false,
            defer_block_free: false,
            defer_async_loads: false,
            drop_preempted_output: false,
            kv_connector_groups: false,
            divergent_local_hits: false,
            max_loras_counts_unscheduled: true,
            continue_after_self_preemption: true,
            skip_encoder_blocked_admissions: true,
            exact_encoder_cut_and_release: true,
            skip_lookahead_cut_admissions: true,
            cache_drafts_at_update: true,
            trim_computed_on_stop: true,
            cache_upto_in_flight: true,
            hash_lookahead_tokens: 0,
            prefill_lookahead_tokens: 0,
            extra_retained_tokens: 0,
            hash_block_size: None,
            drop_trailing_hit_block: false,
            sliding_window: None,
            kv_cache_groups: Vec::new(),
            kv_cache_group_block_sizes: Vec::new(),
            mamba_speculative_blocks: 0,
            mamba_align: false,
            zero_new_blocks: false,
            prefix_cache_retention_interval: None,
            mamba_prefill_checkpoint_alignment: None,
            ring_block_size: None,
            prefix_replay_groups: Vec::new(),
            mamba_defer_new_states_only: true,
            mamba_eagle_group: true,
            drop_junction_below: true,
            max_num_scheduled_tokens: 0,
            draft_slots: 0,
            decode_stagger: 1,
            max_concurrent_batches: 0,
        }
    }
}

const I32_MAX: u32 = i32::MAX as u32;
/// The pool keeps ~50 bytes of bookkeeping per block; 2^24 blocks (~800 MB) is far above any real GPU's pool.
pub const MAX_NUM_BLOCKS: u32 = 1 << 24;
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The most KV cache groups `kv_cache_groups` may list (a group's id tags its block hashes in one byte).
pub const MAX_KV_CACHE_GROUPS: usize = 64;
/// A `kv_cache_groups` entry (`Some(CROSS_ATTENTION)`) for a cross-attention group (vLLM's `CrossAttentionSpec`,
/// encoder-decoder models): a request holds `ceil(cross_attention_tokens / block_size)` blocks there, taken at its
/// first allocation and freed with it, never cached (`hybrid.rs`). Python spells it `"cross"`.
pub const CROSS_ATTENTION: u32 = u32::MAX;
/// A `kv_cache_groups` entry (`Some(MAMBA)`) for a Mamba (linear-attention) group with vLLM's `mamba_cache_mode`
/// "none" (`MambaSpec` with a block of `max_model_len` tokens): a request holds `1 + mamba_speculative_blocks`
/// state blocks there, taken at its first allocation and freed with it, never cached (`hybrid.rs`). Python spells
/// it `"mamba"`. It is `CHUNKED_LOCAL | (2^31 - 2)`, which is why chunk sizes stop at `2^31 - 3`.
pub const MAMBA: u32 = u32::MAX - 1;
/// A `kv_cache_groups` entry (`Some(RING)`) for a ring-buffer group (vLLM's `CircularBufferSpec`: a compressor's
/// per-request ring of the keys still being compressed, in DeepSeek V4.1, GLM-5 and Step 5 style models): a request
/// holds exactly one block there, taken at its first allocation and freed with it, never cached and never part of
/// a prefix-hit lookup, so it may sit beside prefix caching (`hybrid.rs`). Python spells it `"ring"`. It is
/// `CHUNKED_LOCAL | (2^31 - 3)`, which is why chunk sizes stop at `2^31 - 4`.
pub const RING: u32 = u32::MAX - 2;
/// The flag of a `kv_cache_groups` entry (`Some(CHUNKED_LOCAL | c)`) for a chunked-local attention group (vLLM's
/// `ChunkedLocalAttentionSpec`, Llama 4): the token at position `p` attends to the tokens of its own chunk of `c`
/// tokens (`p / c * c ..= p`) only, so the blocks wholly before the chunk of the next token go back to the pool
/// (`hybrid.rs`). `c` in `[1, MAX_CHUNK_SIZE]`. Python spells it `"chunked:c"`.
pub const CHUNKED_LOCAL: u32 = 1 << 31;
/// The largest chunk size of a chunked-local group (`2^31 - 4`: `CHUNKED_LOCAL | (2^31 - 2)` is `MAMBA`,
/// `CHUNKED_LOCAL | (2^31 - 3)` is `RING`).
pub const MAX_CHUNK_SIZE: u32 = I32_MAX - 3;

/// Whether a `kv_cache_groups` entry is a chunked-local group's (not cross attention, Mamba or a ring).
#[inline]
pub fn is_chunked_entry(w: u32) -> bool {
    w & CHUNKED_LOCAL != 0 && w != CROSS_ATTENTION && w != MAMBA && w != RING
}

/// Whether a `kv_cache_groups` entry holds no token-indexed blocks (a Mamba state or a ring): such a group is
/// never the primary group, which holds the decoder's tokens.
#[inline]
pub fn is_stateful_entry(w: u32) -> bool {
    w == MAMBA || w == RING
}

/// An integer field's fixed bounds (inclusive), and how to read it (`None`: unset, not checked).
struct IntField {
    name: &'static str,
    min: u32,
    max: u32,
    get: fn(&SchedulerConfig) -> Option<u32>,
}

/// The integer fields and their fixed bounds (the Python table's), checked first. Bounds set by another field (`max_num_active_seqs <= max_num_seqs`, `cp_kv_cache_interleave_size <= block_size`)
/// are rules, checked later.
const INT_FIELDS: &[IntField] = &[
    IntField { name: "block_size", min: 1, max: 4096, get: |c| Some(c.block_size) },
    IntField { name: "num_blocks", min: 2, max: MAX_NUM_BLOCKS, get: |c| Some(c.num_blocks) },
    IntField { name: "max_num_seqs", min: 1, max: I32_MAX, get: |c| Some(c.max_num_seqs) },
    IntField {
        name: "max_num_batched_tokens",
        min: 1,
        max: I32_MAX,
        get: |c| Some(c.max_num_batched_tokens),
    },
    IntField { name: "max_model_len", min: 2, max: I32_MAX, get: |c| Some(c.max_model_len) },
    IntField {
        name: "long_prefill_token_threshold",
        min: 0,
        max: I32_MAX,
        get: |c| Some(c.long_prefill_token_threshold),
    },
    IntField { name: "num_lookahead_tokens", min: 0, max: 1024, get: |c| Some(c.num_lookahead_tokens) },
    IntField { name: "num_speculative_tokens", min: 0, max: 1024, get: |c| c.num_speculative_tokens },
    IntField { name: "hash_lookahead_tokens", min: 0, max: 1024, get: |c| Some(c.hash_lookahead_tokens) },
    IntField {
        name: "prefill_lookahead_tokens",
        min: 0,
        max: 1024,
        get: |c| Some(c.prefill_lookahead_tokens),
    },
    IntField { name: "extra_retained_tokens", min: 0, max: 1024, get: |c| Some(c.extra_retained_tokens) },
    IntField { name: "hash_block_size", min: 1, max: 4096, get: |c| c.hash_block_size },
    IntField {
        name: "cache_aware_admission_window",
        min: 0,
        max: I32_MAX,
        get: |c| Some(c.cache_aware_admission_window),
    },
    IntField { name: "max_running_per_tenant", min: 1, max: I32_MAX, get: |c| c.max_running_per_tenant },
    IntField { name: "max_waiting_per_tenant", min: 1, max: I32_MAX, get: |c| c.max_waiting_per_tenant },
    IntField { name: "priority_aging_steps", min: 0, max: I32_MAX, get: |c| Some(c.priority_aging_steps) },
    IntField { name: "max_wait_steps", min: 1, max: I32_MAX, get: |c| c.max_wait_steps },
    IntField { name: "session_ttl_steps", min: 1, max: I32_MAX, get: |c| Some(c.session_ttl_steps) },
    IntField { name: "max_loras", min: 0, max: I32_MAX, get: |c| Some(c.max_loras) },
    IntField { name: "num_cpu_blocks", min: 0, max: MAX_NUM_BLOCKS, get: |c| Some(c.num_cpu_blocks) },
    // 0 stands for Python's None (as many as max_num_seqs).
    IntField {
        name: "max_num_active_seqs",
        min: 1,
        max: I32_MAX,
        get: |c| Some(c.max_num_active_seqs).filter(|&v| v != 0),
    },
    IntField {
        name: "prefill_schedule_interval",
        min: 1,
        max: I32_MAX,
        get: |c| Some(c.prefill_schedule_interval),
    },
    IntField { name: "dcp_world_size", min: 1, max: 1024, get: |c| Some(c.dcp_world_size) },
    IntField { name: "pcp_world_size", min: 1, max: 1024, get: |c| Some(c.pcp_world_size) },
    IntField {
        name: "cp_kv_cache_interleave_size",
        min: 1,
        max: 1024,
        get: |c| Some(c.cp_kv_cache_interleave_size),
    },
    IntField {
        name: "max_num_encoder_input_tokens",
        min: 0,
        max: I32_MAX,
        get: |c| Some(c.max_num_encoder_input_tokens),
    },
    IntField { name: "encoder_cache_size", min: 0, max: I32_MAX, get: |c| Some(c.encoder_cache_size) },
    IntField { name: "sliding_window", min: 1, max: I32_MAX, get: |c| c.sliding_window },
    IntField {
        name: "prefix_cache_retention_interval",
        min: 0,
        max: I32_MAX,
        get: |c| c.prefix_cache_retention_interval,
    },
    IntField {
        name: "mamba_prefill_checkpoint_alignment",
        min: 1,
        max: I32_MAX,
        get: |c| c.mamba_prefill_checkpoint_alignment,
    },
    IntField { name: "ring_block_size", min: 1, max: I32_MAX, get: |c| c.ring_block_size },
    // 0 stands for Python's None (max_num_batched_tokens).
    IntField {
        name: "max_num_scheduled_tokens",
        min: 1,
        max: I32_MAX,
        get: |c| Some(c.max_num_scheduled_tokens).filter(|&v| v != 0),
    },
    IntField { name: "draft_slots", min: 0, max: I32_MAX - 1, get: |c| Some(c.draft_slots) },
    IntField {
        name: "mamba_speculative_blocks",
        min: 0,
        max: 1024,
        get: |c| Some(c.mamba_speculative_blocks),
    },
    IntField { name: "decode_stagger", min: 1, max: 1024, get: |c| Some(c.decode_stagger) },
    // 0 stands for Python's None (2 with async scheduling, else 1).
    IntField {
        name: "max_concurrent_batches",
        min: 1,
        max: 1024,
        get: |c| Some(c.max_concurrent_batches).filter(|&v| v != 0),
    },
];

/// The fixed bounds of integer field `name`, if it has any (for messages about values outside `u32`).
pub fn int_field_bounds(name: &str) -> Option<(u32, u32)> {
    INT_FIELDS.iter().find(|f| f.name == name).map(|f| (f.min, f.max))
}

/// The error for integer field `name` holding `value`, outside its bounds `[min, max]`.
pub fn int_out_of_range(name: &str, value: impl std::fmt::Display, min: u32, max: u32) -> SchedError {
    SchedError::InvalidConfig(format!("{name} must be in [{min}, {max}], got {value}"))
}

fn check_range(name: &str, value: u32, min: u32, max: u32) -> Result<()> {
    if value < min || value > max {
        return Err(int_out_of_range(name, value, min, max));
    }
    Ok(())
}

/// A float field in `[min, max]` (or `[min, max)`), as the Python table states it.
fn check_unit_interval(name: &str, value: f64, open: bool) -> Result<()> {
    let inside = if open { (0.0..1.0).contains(&value) } else { (0.0..=1.0).contains(&value) };
    if !inside {
        let close = if open { ')' } else { ']' };
        return Err(SchedError::InvalidConfig(format!(
            "{name} must be in [0, 1{close}, got {}",
            py_float(value)
        )));
    }
    Ok(())
}

/// A float field that is finite and >= 0.
fn check_finite_non_negative(name: &str, value: f64) -> std::result::Result<(), String> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(format!("{name} must be finite and >= 0, got {}", py_float(value)));
    }
    Ok(())
}

impl SchedulerConfig {
    /// Draft tokens per request per step (`num_speculative_tokens`, else `num_lookahead_tokens`).
    pub fn num_spec_tokens(&self) -> u32 {
        self.num_speculative_tokens.unwrap_or(self.num_lookahead_tokens)
    }

    /// Each field on its own (bounds, finite floats), then the rules that tie fields together
    /// in the Python table's order: one bad value gets the same message on both sides.
    pub fn validate(&self) -> Result<()> {
        for f in INT_FIELDS {
            if let Some(value) = (f.get)(self) {
                check_range(f.name, value, f.min, f.max)?;
            }
        }
        check_unit_interval("cache_aware_admission_threshold", self.cache_aware_admission_threshold, false)?;
        check_unit_interval("watermark", self.watermark, true)?;
        for (name, w) in [
            ("fair_prefill_weight", self.fair_prefill_weight),
            ("fair_decode_weight", self.fair_decode_weight),
        ] {
            check_finite_non_negative(name, w).map_err(SchedError::InvalidConfig)?;
        }
        check_preemption_costs(self.recompute_cost_per_token, self.swap_cost_per_block)
            .map_err(SchedError::InvalidConfig)?;
        if let Some(slo) = self.default_ttft_slo_s {
            check_ttft_slo("default_ttft_slo_s", slo).map_err(SchedError::InvalidConfig)?;
        }
        for (tenant, w) in &self.tenant_weights {
            check_tenant_name(tenant).map_err(SchedError::InvalidConfig)?;
            check_tenant_weight(tenant, *w).map_err(SchedError::InvalidConfig)?;
        }
        for (field, limits) in [
            ("tenant_max_running", &self.tenant_max_running),
            ("tenant_max_waiting", &self.tenant_max_waiting),
        ] {
            for (tenant, limit) in limits {
                check_tenant_name(tenant).map_err(SchedError::InvalidConfig)?;
                check_tenant_limit(field, tenant, i64::from(*limit)).map_err(SchedError::InvalidConfig)?;
            }
        }
        self.validate_rules()
    }

    /// The rules between fields: int32 slot ids and positions, the context-parallel sizes, the bounds set by
    /// another field, and what the admission window, the preemption modes and aging need.
    fn validate_rules(&self) -> Result<()> {
        if u64::from(self.num_blocks) * u64::from(self.block_size) > u64::from(I32_MAX) {
            return Err(SchedError::InvalidConfig(format!(
                "num_blocks * block_size must fit in int32 slot ids, got {} * {}",
                self.num_blocks, self.block_size
            )));
        }
        // vLLM's ParallelConfig: DCP spans the PCP axis.
        if self.pcp_world_size > 1
            && self.dcp_world_size > 1
            && self.dcp_world_size % self.pcp_world_size != 0
        {
            return Err(SchedError::InvalidConfig(format!(
                "with pcp_world_size > 1, dcp_world_size must be 1 or a multiple of pcp_world_size (DCP spans the \
                 PCP axis), got dcp_world_size={} and pcp_world_size={}",
                self.dcp_world_size, self.pcp_world_size
            )));
        }
        let tokens = u64::from(self.num_blocks) * u64::from(self.block_size) * u64::from(self.dcp_world_size);
        if tokens > u64::from(I32_MAX) {
            return Err(SchedError::InvalidConfig(format!(
                "num_blocks * block_size * dcp_world_size must fit in int32 positions, got {} * {} * {}",
                self.num_blocks, self.block_size, self.dcp_world_size
            )));
        }
        if self.max_num_active_seqs != 0 {
            check_range("max_num_active_seqs", self.max_num_active_seqs, 1, self.max_num_seqs)?;
        }
        check_range("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size, 1, self.block_size)?;
        if self.max_num_scheduled_tokens != 0 {
            check_range(
                "max_num_scheduled_tokens",
                self.max_num_scheduled_tokens,
                1,
                self.max_num_batched_tokens,
            )?;
        }
        if self.draft_slots >= self.max_num_batched_tokens {
            return Err(SchedError::InvalidConfig(format!(
                "draft_slots must be below max_num_batched_tokens ({}): every scheduled request takes its tokens \
                 plus draft_slots of it, got {}",
                self.max_num_batched_tokens, self.draft_slots
            )));
        }
        if self.block_size % self.cp_kv_cache_interleave_size != 0 {
            return Err(SchedError::InvalidConfig(format!(
                "cp_kv_cache_interleave_size must divide block_size ({}), got {}",
                self.block_size, self.cp_kv_cache_interleave_size
            )));
        }
        if self.cache_aware_admission_window > 0 && self.policy != Policy::Fcfs {
            return Err(SchedError::InvalidConfig(format!(
                "cache_aware_admission_window > 0 needs policy 'fcfs' (the window reorders the FCFS queue; \
                 policy {} has its own order), got window {}",
                py_str(self.policy.name()),
                self.cache_aware_admission_window
            )));
        }
        if self.preemption_mode != PreemptionMode::Recompute && self.num_cpu_blocks == 0 {
            return Err(SchedError::InvalidConfig(format!(
                "preemption_mode {} needs a CPU pool: num_cpu_blocks must be > 0, got 0",
                py_str(self.preemption_mode.name())
            )));
        }
        if self.priority_aging_steps > 0 && self.policy != Policy::Priority {
            return Err(SchedError::InvalidConfig(format!(
                "priority_aging_steps > 0 needs policy 'priority', got {}",
                py_str(self.policy.name())
            )));
        }
        if let Some(window) = self.sliding_window {
            // vLLM: DCP and PCP do not support sliding-window attention; the CPU pool does not know its null
            // blocks yet.
            if self.dcp_world_size > 1 || self.pcp_world_size > 1 {
                return Err(SchedError::InvalidConfig(format!(
                    "sliding_window ({window}) needs dcp_world_size == 1 and pcp_world_size == 1, got {} and {}",
                    self.dcp_world_size, self.pcp_world_size
                )));
            }
            if self.preemption_mode != PreemptionMode::Recompute {
                return Err(SchedError::InvalidConfig(format!(
                    "sliding_window ({window}) needs preemption_mode 'recompute', got {}",
                    py_str(self.preemption_mode.name())
                )));
            }
        }
        if self.drop_trailing_hit_block {
            let chunked = self.kv_cache_groups.iter().flatten().any(|&w| is_chunked_entry(w));
            if chunked {
                return Err(SchedError::InvalidConfig(
                    "drop_trailing_hit_block cannot be combined with a chunked-local group (vLLM's chunked-local \
                     attention has no trailing-block drop)"
                        .into(),
                ));
            }
        }
        if self.mamba_prefill_checkpoint_alignment.is_some() && !self.mamba_align {
            return Err(SchedError::InvalidConfig(
                "mamba_prefill_checkpoint_alignment needs mamba_align (prefill checkpoints are vLLM's \
                 mamba_cache_mode 'align')"
                    .into(),
            ));
        }
        if self.ring_block_size.is_some() && !self.kv_cache_groups.contains(&Some(RING)) {
            return Err(SchedError::InvalidConfig(
                "ring_block_size needs a ring group ('ring') in kv_cache_groups".into(),
            ));
        }
        if self.zero_new_blocks && self.kv_cache_groups.is_empty() {
            return Err(SchedError::InvalidConfig(
                "zero_new_blocks needs kv_cache_groups (several KV cache groups)".into(),
            ));
        }
        self.validate_prefill_lookahead()?;
        self.validate_groups()?;
        self.validate_replay_groups()?;
        self.validate_group_block_sizes()?;
        self.validate_retention()?;
        self.validate_hash_block()?;
        if self.encoder_decoder && !self.kv_cache_groups.contains(&Some(CROSS_ATTENTION)) {
            return Err(SchedError::InvalidConfig(
                "encoder_decoder needs a cross-attention group ('cross') in kv_cache_groups (the encoder output's \
                 blocks)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// What `prefill_lookahead_tokens` above 1 and `extra_retained_tokens` need (see the fields).
    fn validate_prefill_lookahead(&self) -> Result<()> {
        if self.extra_retained_tokens > 0 {
            let window = self.sliding_window.is_some()
                || self
                    .kv_cache_groups
                    .iter()
                    .flatten()
                    .any(|&w| w != CROSS_ATTENTION && w != MAMBA && w & CHUNKED_LOCAL == 0);
            if !window {
                return Err(SchedError::InvalidConfig(format!(
                    "extra_retained_tokens ({}) needs a sliding window (sliding_window or a window group)",
                    self.extra_retained_tokens
                )));
            }
        }
        Ok(())
    }

    /// Tokens per prefix-match unit when a prefix hit can end inside a block (vLLM's partial hash hits): a
    /// `hash_block_size` below `block_size` with prefix caching on, align-mode Mamba groups (`mamba_align`), and
    /// every other group full attention. `None` otherwise (hits end on whole blocks).
    pub fn partial_hit_unit(&self) -> Option<u32> {
        let h = self.hash_block_size.filter(|&h| h < self.block_size && self.block_size % h == 0)?;
        let groups = &self.kv_cache_groups;
        let fine = groups.iter().all(|w| w.is_none() || *w == Some(MAMBA) || *w == Some(RING));
        (self.enable_prefix_caching && self.mamba_align && groups.contains(&Some(MAMBA)) && fine).then_some(h)
    }

    /// What a `hash_block_size` below `block_size` needs (vLLM's `resolve_kv_cache_block_sizes` and hybrid
    /// coordinator): a divisor of `block_size`, several KV cache groups, and with prefix caching on none of the
    /// features whose rules change with finer hashes (the prompt-tail entries vLLM's full-attention groups add at a
    /// sub-block boundary, which only the look-ahead hashes, the trailing-block drop and KV cache events make
    /// visible); with a Mamba group, prefix hits inside a block (`partial_hit_unit`) and none of the features not
    /// implemented beside them.
    fn validate_hash_block(&self) -> Result<()> {
        let Some(h) = self.hash_block_size.filter(|&h| h != self.block_size) else { return Ok(()) };
        let refuse = |what: &str| {
            Err(SchedError::InvalidConfig(format!(
                "hash_block_size ({h}) below block_size ({}) {what}",
                self.block_size
            )))
        };
        if self.block_size % h != 0 {
            return Err(SchedError::InvalidConfig(format!(
                "hash_block_size ({h}) must divide block_size ({})",
                self.block_size
            )));
        }
        if self.kv_cache_groups.is_empty() {
            return refuse(
                "needs kv_cache_groups (vLLM hashes finer than the block only with several KV cache groups)",
            );
        }
        if !self.enable_prefix_caching {
            return Ok(());
        }
        if self.kv_cache_groups.contains(&Some(MAMBA)) {
            if self.partial_hit_unit().is_none() {
                return refuse(
                    "with a Mamba group and prefix caching needs align-mode Mamba groups (mamba_align) and every \
                     other group full attention (prefix hits inside a block)",
                );
            }
            for (on, name) in [
                (self.num_cpu_blocks > 0, "num_cpu_blocks (swapping)"),
                (self.kv_connector_groups, "kv_connector_groups (a KV connector)"),
                (self.divergent_local_hits, "divergent_local_hits"),
                (self.dcp_world_size > 1 || self.pcp_world_size > 1, "context parallelism"),
                (self.prefill_lookahead_tokens > 1, "prefill_lookahead_tokens"),
            ] {
                if on {
                    return refuse(&format!(
                        "with a Mamba group and prefix caching (prefix hits inside a block) cannot be combined \
                         with {name} (not implemented)"
                    ));
                }
            }
        }
        for (on, name) in [
            (self.hash_lookahead_tokens > 0, "hash_lookahead_tokens"),
            (self.drop_trailing_hit_block, "drop_trailing_hit_block"),
            (self.enable_kv_cache_events, "enable_kv_cache_events"),
        ] {
            if on {
                return refuse(&format!(
                    "cannot be combined with {name} with prefix caching (the prompt-tail cache entries vLLM adds \
                     inside a block are not implemented)"
                ));
            }
        }
        Ok(())
    }

    /// What `kv_cache_group_block_sizes` needs: one size per group, each a multiple of `block_size` (the primary
    /// group's equal to it; a replayed window's any size), the pool's tokens at the largest within `i32::MAX`;
    /// when the sizes differ, only full-attention and sliding-window groups (and rings and replayed windows), and
    /// no `hash_block_size` other than `block_size`.
    fn validate_group_block_sizes(&self) -> Result<()> {
        let sizes = &self.kv_cache_group_block_sizes;
        if sizes.is_empty() {
            return Ok(());
        }
        let refuse =
            |what: String| Err(SchedError::InvalidConfig(format!("kv_cache_group_block_sizes {what}")));
        if sizes.len() != self.kv_cache_groups.len() {
            return refuse(format!(
                "must give one size per KV cache group ({} groups), got {}",
                self.kv_cache_groups.len(),
                sizes.len()
            ));
        }
        let bs = self.block_size;
        for (g, &s) in sizes.iter().enumerate() {
            // A replayed window is never hashed: its blocks may hold any number of tokens.
            let unit = if self.prefix_replay_groups.contains(&(g as u32)) { 1 } else { bs };
            if s == 0 || s % unit != 0 || u64::from(s) * u64::from(self.num_blocks) > u64::from(I32_MAX) {
                return refuse(format!(
                    "must be multiples of block_size ({bs}) (a replayed window's any size) with num_blocks * size \
                     <= {I32_MAX}, got {s} for group {g}"
                ));
            }
        }
        let primary = self.primary_group().unwrap_or(0);
        if sizes[primary] != bs {
            return refuse(format!(
                "must give block_size ({bs}) to a group that is not Mamba, ring or replayed, got {sizes:?}"
            ));
        }
        if sizes.iter().all(|&s| s == bs) {
            return Ok(());
        }
        let other = self
            .kv_cache_groups
            .iter()
            .flatten()
            .any(|&w| w == CROSS_ATTENTION || w == MAMBA || is_chunked_entry(w));
        for (on, name) in [
            (other, "chunked-local, cross-attention or Mamba groups"),
            (self.hash_block_size.is_some_and(|h| h != bs), "a hash_block_size other than block_size"),
        ] {
            if on {
                return refuse(format!(
                    "of different sizes cannot be combined with {name} (not implemented)"
                ));
            }
        }
        Ok(())
    }

    /// The primary KV cache group (`kv_cache_groups`): the first that is not Mamba, a ring or a replayed window
    /// (`prefix_replay_groups`) and, with `kv_cache_group_block_sizes`, whose block size is `block_size` (the
    /// first of the others when none is); its table is `Request::blocks`. `None` when every group is Mamba, a ring
    /// or replayed.
    pub fn primary_group(&self) -> Option<usize> {
        let mut candidates = self.kv_cache_groups.iter().enumerate().filter_map(|(g, &w)| {
            (!w.is_some_and(is_stateful_entry) && !self.prefix_replay_groups.contains(&(g as u32)))
                .then_some(g)
        });
        let first = candidates.next()?;
        let sizes = &self.kv_cache_group_block_sizes;
        // With block sizes per group: the first of them whose blocks hold `block_size` tokens (vLLM's engine may
        // list a group of larger blocks first: MiMo-V2's full-attention layers, whose pages are the smaller).
        Some(
            std::iter::once(first)
                .chain(candidates)
                .find(|&g| sizes.get(g).is_some_and(|&s| s == self.block_size))
                .unwrap_or(first),
        )
    }

    /// Each KV cache group's block size (`kv_cache_group_block_sizes`, or `kv_block_size` for every group).
    pub fn group_block_sizes(&self) -> Vec<u32> {
        if self.kv_cache_group_block_sizes.is_empty() {
            vec![self.kv_block_size(); self.kv_cache_groups.len()]
        } else {
            self.kv_cache_group_block_sizes.clone()
        }
    }

    /// What `prefix_cache_retention_interval` needs (vLLM's `_validate_prefix_cache_retention_interval`): a
    /// multiple of the block size, and above 0 a sliding window or a Mamba group (it has no effect on full
    /// attention, cross attention or chunked-local groups).
    fn validate_retention(&self) -> Result<()> {
        let Some(r) = self.prefix_cache_retention_interval else { return Ok(()) };
        let windows = self.sliding_window.is_some()
            || self
                .kv_cache_groups
                .iter()
                .flatten()
                .any(|&w| w != CROSS_ATTENTION && w != MAMBA && w & CHUNKED_LOCAL == 0);
        let has_mamba = self.kv_cache_groups.contains(&Some(MAMBA));
        if r > 0 && !has_mamba && !windows {
            return Err(SchedError::InvalidConfig(format!(
                "prefix_cache_retention_interval ({r}) needs a sliding window or a Mamba group (it has no effect \
                 on full attention; 0 or None)"
            )));
        }
        if r % self.block_size != 0 {
            return Err(SchedError::InvalidConfig(format!(
                "prefix_cache_retention_interval ({r}) must be a multiple of block_size ({})",
                self.block_size
            )));
        }
        let sizes = self.group_block_sizes();
        let lcm =
            sizes.iter().fold(u64::from(self.block_size), |a, &b| a / gcd(a, u64::from(b)) * u64::from(b));
        if u64::from(r) % lcm != 0 {
            return Err(SchedError::InvalidConfig(format!(
                "prefix_cache_retention_interval ({r}) must be a multiple of the KV cache groups' block sizes' least \
                 common multiple ({lcm})"
            )));
        }
        Ok(())
    }

    /// What `prefix_replay_groups` needs: sliding-window groups of one window, a full-attention or sliding-window
    /// group that is not replayed (the primary group), and none of the features whose counts the replay's rewind
    /// would change (align-mode Mamba splits, encoder-decoder, swap).
    fn validate_replay_groups(&self) -> Result<()> {
        let replay = &self.prefix_replay_groups;
        if replay.is_empty() {
            return Ok(());
        }
        let refuse = |what: String| Err(SchedError::InvalidConfig(what));
        let groups = &self.kv_cache_groups;
        if groups.is_empty() {
            return refuse("prefix_replay_groups needs kv_cache_groups (several KV cache groups)".into());
        }
        let mut window = None;
        for (i, &g) in replay.iter().enumerate() {
            let Some(&entry) = groups.get(g as usize) else {
                return refuse(format!(
                    "prefix_replay_groups entry {g} is not a group (kv_cache_groups has {})",
                    groups.len()
                ));
            };
            if replay[..i].contains(&g) {
                return refuse(format!("prefix_replay_groups lists group {g} more than once"));
            }
            let w = match entry {
                Some(w)
                    if w != 0 && !is_stateful_entry(w) && !is_chunked_entry(w) && w != CROSS_ATTENTION =>
                {
                    w
                }
                _ => return refuse(format!("prefix_replay_groups entry {g} is not a sliding-window group")),
            };
            match window {
                None => window = Some(w),
                Some(a) if a != w => {
                    return refuse(format!("prefix_replay_groups' windows must agree, got {a} and {w}"));
                }
                Some(_) => {}
            }
        }
        if self.primary_group().is_none() {
            return refuse(
                "prefix_replay_groups lists every attention group; a replayed window needs a full-attention or \
                 sliding-window group that is not replayed"
                    .into(),
            );
        }
        if self.mamba_align {
            return refuse("prefix_replay_groups cannot be combined with mamba_align".into());
        }
        if self.encoder_decoder {
            return refuse("prefix_replay_groups cannot be combined with encoder_decoder".into());
        }
        if self.num_cpu_blocks > 0 {
            return refuse("prefix_replay_groups cannot be combined with swap (num_cpu_blocks)".into());
        }
        Ok(())
    }

    /// The replay window (`prefix_replay_groups`' common window; 0 without replay groups).
    pub fn replay_window(&self) -> u32 {
        self.prefix_replay_groups
            .first()
            .and_then(|&g| self.kv_cache_groups.get(g as usize).copied().flatten())
            .unwrap_or(0)
    }

    /// What several KV cache groups (`kv_cache_groups`) need: two groups or more (one is the plain or
    /// `sliding_window` config), windows of at least one token, and none of the features that do not know
    /// per-group block tables yet.
    fn validate_groups(&self) -> Result<()> {
        let groups = &self.kv_cache_groups;
        if groups.is_empty() {
            if self.mamba_speculative_blocks > 0 {
                return Err(SchedError::InvalidConfig(format!(
                    "mamba_speculative_blocks ({}) needs a Mamba group in kv_cache_groups",
                    self.mamba_speculative_blocks
                )));
            }
            if self.mamba_align {
                return Err(SchedError::InvalidConfig(
                    "mamba_align needs a Mamba group in kv_cache_groups".into(),
                ));
            }
            return Ok(());
        }
        let refuse = |what: String| Err(SchedError::InvalidConfig(format!("kv_cache_groups {what}")));
        if groups.len() < 2 || groups.len() > MAX_KV_CACHE_GROUPS {
            return refuse(format!(
                "must list 2 to {MAX_KV_CACHE_GROUPS} groups (one group is the plain config or sliding_window), \
                 got {}",
                groups.len()
            ));
        }
        if groups.contains(&Some(0)) {
            return refuse(format!("windows must be in [1, {I32_MAX}], got 0"));
        }
        if groups.contains(&Some(CHUNKED_LOCAL)) {
            return refuse(format!("chunk sizes must be in [1, {MAX_CHUNK_SIZE}], got 0"));
        }
        let chunked = groups.iter().flatten().any(|&w| is_chunked_entry(w));
        if chunked && !groups.contains(&None) {
            return refuse(
                "with a chunked-local group needs a full-attention group (the core looks a chunked-local hit up \
                 within the full-attention hit)"
                    .into(),
            );
        }
        match groups.iter().find(|&&g| !g.is_some_and(is_stateful_entry)) {
            None => {
                return refuse(
                    "needs a group that is not Mamba or ring (it holds the decoder's tokens)".into(),
                )
            }
            Some(&Some(CROSS_ATTENTION)) => return refuse(
                "cannot start with a cross-attention group (the first group that is not Mamba or ring holds \
                     the decoder's tokens)"
                    .into(),
            ),
            Some(_) => {}
        }
        if self.enable_prefix_caching && groups.contains(&Some(CROSS_ATTENTION)) {
            return refuse(
                "with a cross-attention group needs enable_prefix_caching=False (cross-attention blocks are never \
                 cached, and vLLM cannot look up a prefix with them)"
                    .into(),
            );
        }
        let has_mamba = groups.contains(&Some(MAMBA));
        if self.enable_prefix_caching && has_mamba && !self.mamba_align {
            return refuse(
                "with a Mamba group needs enable_prefix_caching=False or mamba_align (vLLM's mamba_cache_mode \
                 'none' keeps one state per request, never cached)"
                    .into(),
            );
        }
        if self.mamba_speculative_blocks > 0 && !has_mamba {
            return Err(SchedError::InvalidConfig(format!(
                "mamba_speculative_blocks ({}) needs a Mamba group in kv_cache_groups",
                self.mamba_speculative_blocks
            )));
        }
        if self.mamba_align && !has_mamba {
            return Err(SchedError::InvalidConfig(
                "mamba_align needs a Mamba group in kv_cache_groups".into(),
            ));
        }
        if self.mamba_align && self.disable_chunked_mm_input {
            return Err(SchedError::InvalidConfig(
                "mamba_align cannot be combined with disable_chunked_mm_input (vLLM's mamba_cache_mode 'align' \
                 needs chunks that end at block boundaries inside an encoder input)"
                    .into(),
            ));
        }
        if let Some(w) = self.sliding_window {
            return refuse(format!(
                "cannot be combined with sliding_window ({w}): give the window per group"
            ));
        }
        if self.dcp_world_size > 1 || self.pcp_world_size > 1 {
            return refuse(format!(
                "needs dcp_world_size == 1 and pcp_world_size == 1, got {} and {}",
                self.dcp_world_size, self.pcp_world_size
            ));
        }
        if self.preemption_mode != PreemptionMode::Recompute {
            return refuse(format!(
                "needs preemption_mode 'recompute', got {}",
                py_str(self.preemption_mode.name())
            ));
        }
        if self.defer_block_free && !self.kv_connector_groups {
            return refuse(
                "is not supported with defer_block_free (only with kv_connector_groups)".to_string(),
            );
        }
        if self.preemption_victim != PreemptionVictim::Default {
            return refuse(format!(
                "needs the default preemption_victim, got {}",
                py_str(self.preemption_victim.name())
            ));
        }
        Ok(())
    }

    /// Tokens one block id covers: `block_size` on each of the `dcp_world_size` ranks (vLLM's scheduler block
    /// size). Allocation, hashing and prefix hits count in these units.
    pub fn kv_block_size(&self) -> u32 {
        self.block_size * self.dcp_world_size
    }

    /// Steps in flight at most (`max_concurrent_batches`, or its default: 2 with async scheduling, else 1).
    pub fn concurrent_batches(&self) -> u32 {
        match self.max_concurrent_batches {
            0 if self.async_scheduling => 2,
            0 => 1,
            n => n,
        }
    }

    /// Blocks that requests can hold: block 0 is the reserved null block.
    pub fn num_usable_blocks(&self) -> u32 {
        self.num_blocks - 1
    }

    /// Tokens the whole KV cache holds (`(num_blocks - 1) * kv_block_size`; fits in u32: `validate` bounds
    /// `num_blocks * kv_block_size` by i32::MAX). The cache may be smaller than one `max_model_len` request, as
    /// vLLM's scheduler allows: `add_request` then refuses each request that could never fit (see
    /// `Scheduler::add_request`).
    pub fn kv_capacity_tokens(&self) -> u32 {
        self.num_usable_blocks() * self.kv_block_size()
    }

    /// The most KV slots a request may ever hold: its positions stop at `max_model_len` and the cache holds
    /// `kv_capacity_tokens`.
    pub fn max_slots_per_request(&self) -> u32 {
        self.max_model_len.min(self.kv_capacity_tokens())
    }

    /// Tokens computed per step: `max_num_scheduled_tokens`, 0 meaning `max_num_batched_tokens`.
    pub fn token_budget(&self) -> u32 {
        if self.max_num_scheduled_tokens == 0 {
            self.max_num_batched_tokens
        } else {
            self.max_num_scheduled_tokens
        }
    }

    /// The most tokens one request can be given in a step: the token budget, and the model inputs less the
    /// request's `draft_slots`.
    pub fn max_chunk_tokens(&self) -> u32 {
        self.token_budget().min(self.max_num_batched_tokens - self.draft_slots)
    }

    /// How `add_request` names `max_chunk_tokens` in its messages.
    pub fn chunk_limit_text(&self) -> String {
        let chunk = self.max_chunk_tokens();
        if chunk == self.max_num_batched_tokens {
            format!("max_num_batched_tokens={chunk}")
        } else {
            format!("the {chunk} tokens a step gives one request (max_num_scheduled_tokens, max_num_batched_tokens less draft_slots)")
        }
    }

    /// Most requests admission lets into `running` (`max_num_active_seqs`, 0 meaning `max_num_seqs`).
    pub fn max_active_seqs(&self) -> usize {
        if self.max_num_active_seqs == 0 {
            self.max_num_seqs as usize
        } else {
            self.max_num_active_seqs as usize
        }
    }

    /// Free blocks an admission must leave (vLLM: `int(watermark * num_blocks)`, the null block included).
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * f64::from(self.num_blocks)) as usize
    }
}

/// A tenant name is a non-empty string.
pub fn check_tenant_name(tenant: &str) -> std::result::Result<(), String> {
    if tenant.is_empty() {
        return Err("a tenant name must be a non-empty string".into());
    }
    Ok(())
}

/// A tenant weight is finite and > 0.
pub fn check_tenant_weight(tenant: &str, w: f64) -> std::result::Result<(), String> {
    if !(w.is_finite() && w > 0.0) {
        return Err(format!(
            "the weight of tenant {} must be finite and > 0, got {}",
            py_str(tenant),
            py_float(w)
        ));
    }
    Ok(())
}

/// A per-tenant limit (`field` is `tenant_max_running` or `tenant_max_waiting`) is in [1, i32::MAX]; returns it.
pub fn check_tenant_limit(field: &str, tenant: &str, limit: i64) -> std::result::Result<u32, String> {
    match u32::try_from(limit) {
        Ok(v) if (1..=I32_MAX).contains(&v) => Ok(v),
        _ => Err(format!("the {field} of tenant {} must be in [1, {I32_MAX}], got {limit}", py_str(tenant))),
    }
}

/// A TTFT target (`default_ttft_slo_s`, a request's `ttft_slo_s`) is finite and > 0.
pub fn check_ttft_slo(name: &str, v: f64) -> std::result::Result<(), String> {
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{name} must be finite and > 0, got {}", py_float(v)));
    }
    Ok(())
}

/// The auto mode's cost constants are finite and >= 0.
pub fn check_preemption_costs(
    recompute_cost_per_token: f64,
    swap_cost_per_block: f64,
) -> std::result::Result<(), String> {
    check_finite_non_negative("recompute_cost_per_token", recompute_cost_per_token)?;
    check_finite_non_negative("swap_cost_per_block", swap_cost_per_block)
}

/// `v` as Python's `repr(float)` prints it (`1.0`, `nan`, `1e-05`, `1e+16`), so that a message reads the same
/// whichever side raised it.
pub fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = v.abs();
    if a == 0.0 || (1e-4..1e16).contains(&a) {
        // Display prints the shortest digits that round-trip, without an exponent; Python adds ".0".
        let s = format!("{v}");
        return if s.contains('.') { s } else { s + ".0" };
    }
    // Python's exponent has a sign and at least two digits.
    let s = format!("{v:e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// `s` as Python's `repr(str)` prints it for printable text: single quotes unless `s` holds one and no double
/// quote, backslashes and control characters escaped.
pub fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if u32::from(c) < 0x20 || (0x7f..=0xa0).contains(&u32::from(c)) || c == '\u{ad}' => {
                out.push_str(&format!("\\x{:02x}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
    }

    /// Prefix hits inside a block: a finer unit, prefix caching, align-mode Mamba groups and otherwise only full
    /// attention.
    #[test]
    fn partial_hit_unit_needs_align_mamba_and_full_attention() {
        let c = SchedulerConfig {
            block_size: 8,
            hash_block_size: Some(4),
            enable_prefix_caching: true,
            mamba_align: true,
            kv_cache_groups: vec![None, Some(MAMBA)],
            ..Default::default()
        };
        assert_eq!(c.partial_hit_unit(), Some(4));
        for off in [
            SchedulerConfig { hash_block_size: None, ..c.clone() },
            SchedulerConfig { hash_block_size: Some(8), ..c.clone() },
            SchedulerConfig { hash_block_size: Some(3), ..c.clone() },
            SchedulerConfig { enable_prefix_caching: false, ..c.clone() },
            SchedulerConfig { mamba_align: false, ..c.clone() },
            SchedulerConfig { kv_cache_groups: vec![None, Some(16)], ..c.clone() },
            SchedulerConfig { kv_cache_groups: vec![None, Some(MAMBA), Some(16)], ..c.clone() },
        ] {
            assert_eq!(off.partial_hit_unit(), None, "{off:?}");
        }
    }

    /// Any block size and DCP size in range (vLLM takes block sizes that are not powers of two: a hybrid Mamba
    /// model's attention block, sized to a state's page, is often 272 or 544 tokens).
    #[test]
    fn accepts_block_units_that_are_not_powers_of_two() {
        for (block_size, dcp_world_size) in
            [(3, 1), (12, 1), (272, 1), (544, 3), (1023, 1), (6, 6), (1024, 1024)]
        {
            let c = SchedulerConfig { block_size, dcp_world_size, num_blocks: 64, ..Default::default() };
            assert_eq!(c.validate(), Ok(()), "{block_size} x {dcp_world_size}");
        }
    }

    #[test]
    fn rejects_bad_values() {
        let bad = [
            SchedulerConfig { block_size: 0, ..Default::default() },
            SchedulerConfig { block_size: 4097, ..Default::default() },
            SchedulerConfig { num_blocks: 1, ..Default::default() },
            SchedulerConfig { max_num_seqs: 0, ..Default::default() },
            SchedulerConfig { max_model_len: 1, ..Default::default() },
            SchedulerConfig { watermark: 1.0, ..Default::default() },
            SchedulerConfig { max_num_seqs: 4, max_num_active_seqs: 5, ..Default::default() },
            SchedulerConfig { prefill_schedule_interval: 0, ..Default::default() },
            SchedulerConfig { watermark: f64::NAN, ..Default::default() },
            SchedulerConfig { num_blocks: u32::MAX / 2, block_size: 1024, ..Default::default() },
            SchedulerConfig { cache_aware_admission_threshold: 1.5, ..Default::default() },
            SchedulerConfig { cache_aware_admission_threshold: f64::NAN, ..Default::default() },
            SchedulerConfig { cache_aware_admission_window: 4, policy: Policy::Fair, ..Default::default() },
            SchedulerConfig {
                cache_aware_admission_window: 4,
                policy: Policy::Priority,
                ..Default::default()
            },
            SchedulerConfig { tenant_weights: vec![("a".into(), 0.0)], ..Default::default() },
            SchedulerConfig { tenant_weights: vec![("a".into(), f64::INFINITY)], ..Default::default() },
            SchedulerConfig { tenant_weights: vec![(String::new(), 1.0)], ..Default::default() },
            SchedulerConfig { max_running_per_tenant: Some(0), ..Default::default() },
            SchedulerConfig { max_waiting_per_tenant: Some(I32_MAX + 1), ..Default::default() },
            SchedulerConfig { tenant_max_running: vec![("a".into(), 0)], ..Default::default() },
            SchedulerConfig { tenant_max_waiting: vec![(String::new(), 3)], ..Default::default() },
            SchedulerConfig { tenant_max_waiting: vec![("a".into(), I32_MAX + 1)], ..Default::default() },
            SchedulerConfig { fair_decode_weight: -1.0, ..Default::default() },
            SchedulerConfig { fair_prefill_weight: f64::NAN, ..Default::default() },
            SchedulerConfig { priority_aging_steps: 3, ..Default::default() },
            SchedulerConfig { preemption_mode: PreemptionMode::Swap, ..Default::default() },
            SchedulerConfig { preemption_mode: PreemptionMode::Auto, ..Default::default() },
            SchedulerConfig { num_cpu_blocks: MAX_NUM_BLOCKS + 1, ..Default::default() },
            SchedulerConfig { recompute_cost_per_token: -1.0, ..Default::default() },
            SchedulerConfig { swap_cost_per_block: f64::NAN, ..Default::default() },
            SchedulerConfig { dcp_world_size: 0, ..Default::default() },
            SchedulerConfig { dcp_world_size: 2048, ..Default::default() },
            SchedulerConfig { pcp_world_size: 0, ..Default::default() },
            SchedulerConfig { pcp_world_size: 1025, ..Default::default() },
            SchedulerConfig { dcp_world_size: 2, pcp_world_size: 4, ..Default::default() },
            SchedulerConfig { dcp_world_size: 4, pcp_world_size: 3, ..Default::default() },
            SchedulerConfig { num_blocks: 1 << 22, block_size: 256, dcp_world_size: 4, ..Default::default() },
            SchedulerConfig { cp_kv_cache_interleave_size: 0, ..Default::default() },
            SchedulerConfig { cp_kv_cache_interleave_size: 32, ..Default::default() },
            SchedulerConfig { block_size: 16, cp_kv_cache_interleave_size: 3, ..Default::default() },
            SchedulerConfig { default_ttft_slo_s: Some(0.0), ..Default::default() },
            SchedulerConfig { default_ttft_slo_s: Some(f64::INFINITY), ..Default::default() },
            SchedulerConfig { max_wait_steps: Some(0), ..Default::default() },
            SchedulerConfig { session_ttl_steps: 0, ..Default::default() },
            SchedulerConfig { cache_aware_admission_window: 4, policy: Policy::Sjf, ..Default::default() },
            SchedulerConfig { cache_aware_admission_window: 4, policy: Policy::Slo, ..Default::default() },
        ];
        for cfg in bad {
            assert!(matches!(cfg.validate(), Err(SchedError::InvalidConfig(_))), "{cfg:?}");
        }
    }

    #[test]
    fn accepts_a_cache_or_budget_below_max_model_len() {
        // vLLM's scheduler accepts both; add_request refuses the requests that could never fit.
        for cfg in [
            SchedulerConfig { num_blocks: 100, block_size: 16, max_model_len: 1600, ..Default::default() },
            SchedulerConfig {
                enable_chunked_prefill: false,
                max_num_batched_tokens: 100,
                max_model_len: 200,
                ..Default::default()
            },
        ] {
            assert_eq!(cfg.validate(), Ok(()), "{cfg:?}");
        }
        let cfg =
            SchedulerConfig { num_blocks: 11, block_size: 16, max_model_len: 2048, ..Default::default() };
        assert_eq!((cfg.kv_capacity_tokens(), cfg.max_slots_per_request()), (160, 160));
    }

    #[test]
    fn context_parallel_block_unit() {
        // vLLM 0.33: DCP scales the scheduler's block size; PCP does not (KVCacheManager gets pcp_world_size=1).
        let cfg = SchedulerConfig { block_size: 16, num_blocks: 11, dcp_world_size: 4, ..Default::default() };
        assert_eq!(cfg.validate(), Ok(()));
        assert_eq!((cfg.kv_block_size(), cfg.kv_capacity_tokens()), (64, 640));
        let cfg = SchedulerConfig { dcp_world_size: 2, pcp_world_size: 2, ..Default::default() };
        assert_eq!(cfg.validate(), Ok(()));
        assert_eq!(cfg.kv_block_size(), 32);
        let cfg = SchedulerConfig { pcp_world_size: 3, ..Default::default() };
        assert_eq!((cfg.validate(), cfg.kv_block_size()), (Ok(()), 16));
        let cfg = SchedulerConfig {
            dcp_world_size: 8,
            pcp_world_size: 4,
            cp_kv_cache_interleave_size: 16,
            ..Default::default()
        };
        assert_eq!(cfg.validate(), Ok(()));
    }

    #[test]
    fn prints_numbers_and_names_as_python_does() {
        let floats = [
            (1.0, "1.0"),
            (-0.5, "-0.5"),
            (0.1, "0.1"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (-0.0, "-0.0"),
        ];
        for (v, text) in floats {
            assert_eq!(py_float(v), text);
        }
        assert_eq!(py_str("fair"), "'fair'");
        assert_eq!(py_str("it's"), "\"it's\"");
        assert_eq!(py_str("a'\"\\\n"), "'a\\'\"\\\\\\n'");
        let cfg = SchedulerConfig { priority_aging_steps: 2, policy: Policy::Fair, ..Default::default() };
        assert_eq!(
            cfg.validate(),
            Err(SchedError::InvalidConfig(
                "priority_aging_steps > 0 needs policy 'priority', got 'fair'".into()
            ))
        );
    }

    #[test]
    fn parses_names() {
        assert_eq!(Policy::parse("priority"), Ok(Policy::Priority));
        assert_eq!(Policy::parse("fair"), Ok(Policy::Fair));
        assert_eq!(Policy::parse("sjf"), Ok(Policy::Sjf));
        assert_eq!(Policy::parse("slo"), Ok(Policy::Slo));
        assert!(Policy::Sjf.is_fcfs_family() && !Policy::Priority.is_fcfs_family());
        assert!(Policy::parse("lifo").is_err());
        assert_eq!(HashAlgo::parse("sha256"), Ok(HashAlgo::Sha256));
        assert_eq!(HashAlgo::parse("sha256_pickle"), Ok(HashAlgo::Sha256Pickle));
        assert!(HashAlgo::parse("md5").is_err());
        assert_eq!(PreemptionMode::parse("auto"), Ok(PreemptionMode::Auto));
        assert!(PreemptionMode::parse("discard").is_err());
        assert_eq!(KvLoadFailurePolicy::parse("fail"), Ok(KvLoadFailurePolicy::Fail));
        assert!(KvLoadFailurePolicy::parse("retry").is_err());
        assert_eq!(PreemptionVictim::parse("lcf"), Ok(PreemptionVictim::Lcf));
        assert_eq!(PreemptionVictim::parse("cost").map(PreemptionVictim::name), Ok("cost"));
        assert!(PreemptionVictim::parse("lifo").is_err());
    }
}
