//! `schedule()`: vLLM 0.33's token-budget loop.
//!
//! Phase A walks `running` in order and gives each request `min(remaining, threshold, budget, model-length
//! cap)` tokens (remaining counts drafts and, with async scheduling, output placeholders); when its KV slots
//! cannot be allocated, a victim is preempted (`victim.rs`; vLLM's FCFS: the last running request; PRIORITY:
//! the largest `(priority, arrival_time)`; refunded if it was already scheduled this step) until the allocation
//! succeeds or the request itself is the victim. Phase B, only when nothing was preempted in the step and admissions are
//! not paused, admits waiting requests in policy order with their prefix-cache hits while `max_num_seqs`, the
//! budget and the free blocks allow (with `scheduler_reserve_full_isl`, the free blocks must hold the whole
//! prompt, not just its first chunk); it never preempts. Requests with nothing to do are skipped, not
//! blocking; waiting requests that cannot run yet are skipped and keep their place.
//! The admission order is not decided here: `WaitingQueue::peek` gives the policy's next candidate, and
//! `admission.rs` may reorder the front of the FCFS queue for the step. Prompt tokens computed are charged to
//! the tenants (`fair.rs`): phase A's once phase A is final, phase B's at each admission (so the next fair
//! pick sees them).

use crate::config::{PauseState, Policy, CROSS_ATTENTION, MAMBA};
use crate::connector::DeferredLoad;
use crate::encoder_sched::{release_encoder_refs, EncoderStep};
use crate::error::{Result, SchedError};
use crate::output::{SchedulerOutput, StepRecord};
use crate::request::{ReqHandle, RequestStatus, NO_SESSION, SPEC_PLACEHOLDER};
use crate::scheduler::Scheduler;
use crate::swap_sched::{complete_resume, restored_tokens};

/// How many requests ahead of the one being scheduled the table slots of block-boundary work are prefetched
/// (their block-table and hash-list lines twice as far ahead).
const PREFETCH_AHEAD: usize = 4;

/// From this many running requests `schedule()` decides whether to prefetch ahead from a sample of
/// `PREFETCH_SAMPLES` of them, not from the first alone (see `schedule_running`).
const PREFETCH_MIN_RUNNING: usize = 128;
const PREFETCH_SAMPLES: usize = 16;

/// The step's output under construction plus the per-entry flags the scheduler records about it. The flags'
/// vectors come from the record of an applied step handed back for reuse, and the output from an output the
/// caller handed back (`Scheduler::recycle_output`), or new ones: both keep their capacity, so a warm scheduler
/// whose caller recycles its outputs allocates little per step. `schedule_with` lends it to each phase and to
/// `finish_step` by reference: it holds many vectors, and each move of it would be a copy.
struct Builder {
    /// Boxed: it goes to the caller as built, and each move of the (large) output would be a copy.
    out: Box<SchedulerOutput>,
    is_chunk: Vec<bool>,
    num_spec: Vec<u32>,
    /// Plain decodes appended last whose constant entries (one token, no new blocks) are not written yet:
    /// `fill` writes them in bulk before any other change or read of those vectors.
    unfilled: usize,
    /// Some entry was pushed as a prefill chunk or with drafts (it stays set if that entry is removed).
    mixed: bool,
    /// `is_chunk`, `num_spec` and `out.spec_token_ids_indptr` are written. They are not until an entry is
    /// pushed as a prefill chunk or with drafts (every entry before it is `false`, `0`, no drafts): that entry
    /// writes them for the entries before it, or `write_everything` does for the whole step.
    flags_written: bool,
    /// `out.num_scheduled_tokens` is written. It is not until an entry is pushed with more than one token
    /// (every entry before it has one): that entry writes it for the entries before it, or `write_everything` does.
    counts_written: bool,
    /// Some entry was pushed by `push` (the general path or an admission), so it may not be a plain decode:
    /// `finish_step` must look at the entries (it stays set if that entry is removed).
    general: bool,
}

impl Builder {
    /// `spare`: an output handed back (`Scheduler::recycle_output`), built in again with its vectors' capacity.
    #[inline(always)]
    fn with_capacity(n: usize, rec: &mut StepRecord, spare: Option<Box<SchedulerOutput>>) -> Self {
        let mut is_chunk = std::mem::take(&mut rec.is_prefill_chunk);
        let mut num_spec = std::mem::take(&mut rec.num_spec_tokens);
        is_chunk.clear();
        num_spec.clear();
        is_chunk.reserve(n);
        num_spec.reserve(n);
        // Filled in place (`Box::new` of a built value would copy it from the stack).
        let mut out = match spare {
            Some(mut out) => {
                out.reset();
                out
            }
            None => Box::<SchedulerOutput>::default(),
        };
        out.handles.reserve(n);
        out.num_scheduled_tokens.reserve(n);
        out.num_computed_tokens.reserve(n);
        out.new_block_ids.reserve(n + 16);
        out.new_block_ids_indptr.reserve(n + 1);
        out.spec_token_ids_indptr.reserve(n + 1);
        out.new_block_ids_indptr.push(0);
        out.spec_token_ids_indptr.push(0);
        Builder {
            out,
            is_chunk,
            num_spec,
            unfilled: 0,
            mixed: false,
            flags_written: false,
            counts_written: false,
            general: false,
        }
    }

    /// Writes the constant entries of the plain decodes appended since the last call (only the block offsets
    /// while every entry so far is a one-token decode without drafts: see `flags_written`, `counts_written`).
    #[inline]
    fn fill(&mut self) {
        let k = std::mem::take(&mut self.unfilled);
        if k == 0 {
            return;
        }
        let o = &mut self.out;
        o.new_block_ids_indptr.resize(o.handles.len() + 1, o.new_block_ids.len() as i32);
        self.extend_written();
    }

    /// Brings the vectors written so far (`flags_written`, `counts_written`) up to the current entries: one
    /// token, no drafts, not a chunk for each entry they do not cover yet.
    #[inline]
    fn extend_written(&mut self) {
        let o = &mut self.out;
        let n = o.handles.len();
        if self.counts_written {
            o.num_scheduled_tokens.resize(n, 1);
        }
        if self.flags_written {
            o.spec_token_ids_indptr.resize(n + 1, o.spec_token_ids.len() as i32);
            self.is_chunk.resize(n, false);
            self.num_spec.resize(n, 0);
        }
    }

    /// Writes the vectors not written yet (`flags`: `is_chunk`, `num_spec`, the draft offsets; `counts`: the
    /// token counts) for the current entries (all of them: `fill` has run), as every entry so far reads.
    fn write_all(&mut self, flags: bool, counts: bool) {
        self.flags_written |= flags;
        self.counts_written |= counts;
        self.extend_written();
    }

    /// Appends one scheduled request; `computed` is its count before this step.
    #[allow(clippy::too_many_arguments)]
    fn push(&mut self, h: ReqHandle, n: u32, computed: u32, blocks: &[u32], spec: &[u32], is_chunk: bool) {
        self.fill();
        let mixed = is_chunk || !spec.is_empty();
        self.write_all(mixed, n != 1);
        self.mixed |= mixed;
        let o = &mut self.out;
        o.handles.push(h);
        if self.counts_written {
            o.num_scheduled_tokens.push(n as i32);
        }
        o.num_computed_tokens.push(computed as i32);
        if !blocks.is_empty() {
            o.new_block_ids.extend(blocks.iter().map(|&b| b as i32));
        }
        o.new_block_ids_indptr.push(o.new_block_ids.len() as i32);
        o.total_num_scheduled_tokens += u64::from(n);
        self.general = true;
        if self.flags_written {
            if !spec.is_empty() {
                o.spec_token_ids.extend(spec.iter().map(|&t| t as i32));
            }
            o.spec_token_ids_indptr.push(o.spec_token_ids.len() as i32);
            self.is_chunk.push(is_chunk);
            self.num_spec.push(spec.len() as u32);
        }
    }

    /// Counts `k` plain decodes whose handle and computed count the caller appended (`Slab::plain_decode_run`);
    /// `fill` writes their constant entries.
    #[inline(always)]
    fn add_decodes(&mut self, k: usize) {
        self.out.total_num_scheduled_tokens += k as u64;
        self.unfilled += k;
    }

    /// Appends one plain decode: one token, no new block, no drafts, not a prefill chunk (only its handle and
    /// computed count now; `fill` writes the constant entries).
    #[inline(always)]
    fn push_decode(&mut self, h: ReqHandle, computed: u32) {
        let o = &mut self.out;
        o.handles.push(h);
        o.num_computed_tokens.push(computed as i32);
        o.total_num_scheduled_tokens += 1;
        self.unfilled += 1;
    }

    /// Appends one decode that takes one new block: one token, no drafts, not a prefill chunk.
    #[inline(always)]
    fn push_decode_with_block(&mut self, h: ReqHandle, computed: u32, block: u32) {
        self.fill();
        let o = &mut self.out;
        o.handles.push(h);
        if self.counts_written {
            o.num_scheduled_tokens.push(1);
        }
        o.num_computed_tokens.push(computed as i32);
        o.new_block_ids.push(block as i32);
        o.new_block_ids_indptr.push(o.new_block_ids.len() as i32);
        o.total_num_scheduled_tokens += 1;
        if self.flags_written {
            o.spec_token_ids_indptr.push(o.spec_token_ids.len() as i32);
            self.is_chunk.push(false);
            self.num_spec.push(0);
        }
    }

    /// Removes entry `pos` (a preempted victim refunded from this step; rare, O(n)). Returns its tokens.
    fn remove(&mut self, pos: usize) -> u32 {
        self.write_everything();
        let o = &mut self.out;
        let n = o.num_scheduled_tokens.remove(pos) as u32;
        o.handles.remove(pos);
        o.num_computed_tokens.remove(pos);
        for (ids, indptr) in [
            (&mut o.new_block_ids, &mut o.new_block_ids_indptr),
            (&mut o.spec_token_ids, &mut o.spec_token_ids_indptr),
        ] {
            let (a, b) = (indptr[pos] as usize, indptr[pos + 1] as usize);
            ids.drain(a..b);
            indptr.remove(pos + 1);
            for x in indptr.iter_mut().skip(pos + 1) {
                *x -= (b - a) as i32;
            }
        }
        o.total_num_scheduled_tokens -= u64::from(n);
        self.is_chunk.remove(pos);
        self.num_spec.remove(pos);
        // The removed entry may have been the only prefill chunk or entry with drafts.
        self.mixed = self.is_chunk.iter().zip(&self.num_spec).any(|(&c, &d)| c || d > 0);
        n
    }

    /// Writes everything not written yet: every vector covers every entry (before a removal, or when the step
    /// is finished).
    fn write_everything(&mut self) {
        self.fill();
        self.write_all(true, true);
    }
}

/// A step's two budgets (vLLM 0.33): `tokens` to compute (`max_num_scheduled_tokens`) and model `inputs`
/// (`max_num_batched_tokens`), of which every scheduled request also takes `slots` (`draft_slots`: the query
/// rows a drafter adds). With no draft slots and one budget the two stay equal.
#[derive(Clone, Copy)]
struct Budget {
    tokens: u32,
    inputs: u32,
    slots: u32,
}

impl Budget {
    /// Whether one more request can be scheduled.
    #[inline(always)]
    fn open(&self) -> bool {
        self.tokens > 0 && self.inputs > self.slots
    }

    /// The most tokens the next request can be given (0 when not `open`).
    #[inline(always)]
    fn chunk(&self) -> u32 {
        self.tokens.min(self.inputs.saturating_sub(self.slots))
    }

    /// How many one-token decodes in a row the budgets allow.
    #[inline(always)]
    fn decodes(&self) -> u32 {
        self.tokens.min(self.inputs / (1 + self.slots))
    }

    #[inline(always)]
    fn take(&mut self, n: u32) {
        self.tokens -= n;
        self.inputs -= n + self.slots;
    }

    /// `k` one-token decodes (at most `decodes()`).
    #[inline(always)]
    fn take_decodes(&mut self, k: u32) {
        self.tokens -= k;
        self.inputs -= k * (1 + self.slots);
    }

    /// A request scheduled with `n` tokens leaves the step (a preemption victim).
    #[inline(always)]
    fn give(&mut self, n: u32) {
        self.tokens += n;
        self.inputs += n + self.slots;
    }
}

/// Phase B's state for one admission pass (`admit_waiting`).
struct AdmissionPass {
    /// The per-request token cap of the step (0: none).
    threshold: u32,
    /// A request scheduled in phase A is still prefilling (vLLM's `prefill_scheduled`): no admission is padded
    /// with placeholder drafts.
    prefill_scheduled: bool,
    /// Prefill is deferred this step: the pass stops at the first request with prompt left to compute.
    defer_prefills: bool,
    /// Phase A scheduled some running request.
    any_running_scheduled: bool,
    /// A request that cannot fit however many prefix hits it finds may end the pass before its lookup: not
    /// with a connector (it is asked about every request) or drafts (admissions may be padded with them).
    quick_reject: bool,
    /// The watermark: blocks an admission leaves free while anything runs.
    watermark: usize,
    /// LoRA adapters of the running requests, then of each admission.
    loras: Vec<String>,
    /// Requests taken out of `waiting` / `kv_waiting` for the pass; they go back to the front at its end.
    skipped: Vec<ReqHandle>,
    skipped_kv: Vec<ReqHandle>,
    /// The candidate's prefix hits (the scheduler's buffer, kept across steps: grown once, not per step).
    hits: Vec<u32>,
    /// Aging picked the current candidate out of its place in `waiting` (it is taken out with `remove`).
    aged: bool,
    /// `sjf`: requests re-keyed in this pass (at most `SJF_MAX_REKEYS_PER_PASS`).
    sjf_rekeys: u32,
}

/// A waiting request that phase B admits if its blocks can be allocated (`Scheduler::admission_candidate`).
/// Invariant: `computed = computed_before` if that is nonzero (a loaded request keeps its count), else
/// `restored + ext` with `restored >= num_hit_tokens`; `n` is 0 exactly for an asynchronous load.
struct Admission {
    h: ReqHandle,
    /// Encoder-decoder: its encoder tokens (given back to the slot count if its allocation fails), and those
    /// charged to the step's encoder budget and the slot count at its admission (`encoder_dec.rs`).
    enc_dec_tokens: u32,
    enc_dec_charge: u32,
    /// It is the head of `kv_waiting` (it holds KV blocks), not of `waiting`.
    from_kv: bool,
    /// Its computed tokens before the step (nonzero only for a request whose load is over).
    computed_before: u32,
    /// The local prefix hit, in tokens.
    num_hit_tokens: u32,
    /// Tokens in KV from the hits, or from its swapped-out copy when that reaches further.
    restored: u32,
    /// Tokens in KV (or arriving) before this step (with bounded prefix replay, from where the replay starts).
    computed: u32,
    /// Bounded prefix replay: the hit's tokens recomputed this step (their slots are the hit's), where the
    /// replay starts (set at the commit; `None` without a replay window or for an asynchronous load), the local
    /// hit before a hit no longer than the window was dropped (for the connector's stats), and whether the load
    /// restores the replayed windows.
    replay: u32,
    replay_start: Option<u32>,
    local_before_drop: Option<u32>,
    window_loaded: bool,
    /// Tokens the connector supplies beyond the local hit, and whether they load asynchronously.
    ext: u32,
    load_async: bool,
    /// Prompt left beyond its last token.
    has_prefill: bool,
    /// Tokens it computes this step, with placeholder drafts if `pad`.
    n: u32,
    pad: bool,
    /// Its encoder inputs are planned in the step's encoder budget (rolled back if it is not admitted).
    planned_encoder: bool,
    /// Free blocks its allocation must leave.
    reserved: usize,
}

/// What phase B does with the request at the head of its queue.
enum Candidate {
    Admit(Admission),
    /// It cannot run yet: taken out of its queue for the pass, it keeps its place.
    Skip,
    /// It cannot be admitted now: the pass ends.
    Stop,
}

impl Scheduler {
    /// One step (`schedule_with(false)`).
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        self.schedule_with(false)
    }

    /// One step. `throttle_prefills` is vLLM's data-parallel prefill balancing: on a step the DP coordinator
    /// marks as throttled, prefill compute is deferred while something decodes, unless the last released step
    /// could not drain the waiting queue (`prefill_capacity_bound`). The local cadence gate
    /// (`prefill_schedule_interval > 1`) defers prefill the same way until the interval since the last
    /// prefill-carrying step has passed.
    pub fn schedule_with(&mut self, throttle_prefills: bool) -> Result<SchedulerOutput> {
        self.schedule_boxed(throttle_prefills).map(|out| *out)
    }

    /// Hands back an output of `schedule_boxed` the caller is done with: the next step is built in it, reusing
    /// its vectors' capacity instead of allocating them again (one is kept; another is dropped).
    pub fn recycle_output(&mut self, out: Box<SchedulerOutput>) {
        if self.spare_output.is_none() {
            self.spare_output = Some(out);
        }
    }

    /// `schedule_with`, the output boxed as it was built (no copy of it on the way out: the bindings' path).
    #[inline(never)]
    pub fn schedule_boxed(&mut self, throttle_prefills: bool) -> Result<Box<SchedulerOutput>> {
        if !self.newly_ready.is_empty() {
            self.queue_newly_ready()?;
        }
        // From here on a request entering `waiting` first waits in the next step (aging).
        self.in_schedule = true;
        let paused_all = self.pause_state == PauseState::PausedAll;
        let mut budget = Budget {
            tokens: if paused_all { 0 } else { self.config.token_budget() },
            inputs: self.config.max_num_batched_tokens,
            slots: self.config.draft_slots,
        };
        // vLLM 0.33: the per-request cap guards other requests from starvation, so it applies only when more
        // than one request is running or waiting (blocked ones included).
        let num_eligible = self.num_live_requests();
        let mut threshold = if num_eligible > 1 { self.config.long_prefill_token_threshold } else { 0 };
        if threshold > 0 && self.config.long_prefill_token_threshold_adaptive {
            // Floored at a fair share of the budget (vLLM's long_prefill_token_threshold_adaptive).
            threshold = threshold.max((self.config.max_num_batched_tokens as usize / num_eligible) as u32);
        }
        // Prefill deferral (vLLM 0.33): only while some running request decodes, so the model never idles.
        let interval = i64::from(self.config.prefill_schedule_interval);
        let anyone_decoding =
            || self.running.iter().any(|&s| self.slab.get(s).is_ok_and(|r| !r.is_prefill_chunk));
        let mut defer_prefills = throttle_prefills && !self.prefill_capacity_bound && anyone_decoding();
        if !defer_prefills
            && interval > 1
            && !self.prefill_capacity_bound
            // This call becomes executed step num_executed_steps + 1 if it schedules anything.
            && (self.num_executed_steps as i64 + 1) - self.last_prefill_step < interval
            && anyone_decoding()
        {
            defer_prefills = true;
        }
        let mut rec = self.spare_record.take().unwrap_or_default();
        let mut b = Builder::with_capacity(self.running.len() + 8, &mut rec, self.spare_output.take());
        self.kv.newly_cached.clear(); // what updates cached since the previous step is not this step's
        if let Some(hy) = self.kv.hybrid.as_deref_mut() {
            hy.mamba_cached_step.clear();
        }
        let mut preempted: Vec<ReqHandle> = Vec::new();
        // Prompt chunks scheduled in phase A, charged to their tenants once phase A is final (a victim's refund
        // must not have been charged).
        let mut prompt_chunks: Vec<(u32, u32, u32)> = Vec::new();
        let mut enc = EncoderStep { budget: self.config.max_num_encoder_input_tokens, ..Default::default() };
        let prefill_scheduled = self.schedule_running(
            &mut b,
            &mut budget,
            threshold,
            defer_prefills,
            &mut preempted,
            &mut prompt_chunks,
            &mut enc,
        )?;
        let mut prefill_admitted = false;
        for (slot, start, n) in prompt_chunks {
            let req = self.slab.get_mut(slot)?;
            if req.status == RequestStatus::Running {
                self.tenants.charge_prompt(req, start, n);
            }
        }
        // Phase B: waiting requests, only if nobody was preempted in this step and admissions are not paused.
        if preempted.is_empty() && !paused_all {
            // No probing when nobody can be admitted (a full batch or no budget): nothing would move.
            let can_admit = budget.open()
                && self.running.len() + self.num_waiting_for_input < self.config.max_active_seqs();
            let plan = if can_admit { self.begin_admission() } else { None };
            let num_skipped;
            (prefill_admitted, num_skipped) = self.admit_waiting(
                &mut b,
                &mut budget,
                threshold,
                prefill_scheduled,
                defer_prefills,
                &mut enc,
            )?;
            self.end_admission(plan, num_skipped);
            // A released step records whether it drained the waiting queue (vLLM's prefill_capacity_bound):
            // if it could not, throttling and the cadence stop deferring until a released step drains it.
            if !defer_prefills {
                self.prefill_capacity_bound = self.num_waiting_reqs() > self.num_deferred;
            }
        }
        if b.out.total_num_scheduled_tokens > 0 {
            self.num_executed_steps += 1;
        }
        // The cadence restarts from any executed step that carried prefill (a running chunk or an admission).
        if interval > 1 && (prefill_scheduled || prefill_admitted) {
            self.last_prefill_step = self.num_executed_steps as i64;
        }
        if self.kv.partial_unit != 0 {
            // The copies queued by hits ending inside a block, their blocks' extra references released.
            self.kv.take_block_copies(&mut b.out.kv_cache_block_copies);
        }
        self.finish_step(&mut b, rec, preempted, &enc)?;
        if self.kv.hybrid.is_some() {
            self.group_new_block_ids(&mut b.out)?;
            if let Some(hy) = self.kv.hybrid.as_deref_mut() {
                for ids in &mut hy.zero_ids {
                    b.out.zero_block_ids.extend(ids.drain(..).map(|b| b as i32));
                }
            }
        }
        Ok(b.out)
    }

    /// With several KV cache groups: each group's new block ids but the primary group's (`new_block_ids`), in
    /// group order, laid out as the primary group's. Every group's table but a cross-attention or Mamba one is as
    /// long as the primary's and grows at its end, so a request's `k` new ids in the primary group are the last
    /// `k` entries of each table (its whole table when it is new or resumed). A cross-attention or Mamba table is
    /// taken whole at a new or resumed request's allocation and never grows: its whole table then, nothing
    /// otherwise; an align-mode Mamba table (`mamba_align`) gives the entries its allocation appended otherwise.
    #[cold]
    fn group_new_block_ids(&self, out: &mut SchedulerOutput) -> Result<()> {
        let windows = &self.config.kv_cache_groups;
        let ngroups = windows.len();
        let primary = self.kv.hybrid.as_deref().map_or(0, |hy| hy.primary);
        let align = self.config.mamba_align;
        let sizes = self.kv.hybrid.as_deref().map(|hy| hy.block_sizes.clone()).unwrap_or_default();
        let bs = self.kv.block_size;
        let mut groups = vec![Vec::with_capacity(out.new_block_ids.len()); ngroups - 1];
        let mut indptrs = vec![Vec::with_capacity(out.handles.len() + 1); ngroups - 1];
        let mut whole = vec![false; out.handles.len()];
        for &i in out.new_reqs.iter().chain(&out.resumed_reqs) {
            whole[i as usize] = true;
        }
        for ptr in indptrs.iter_mut() {
            ptr.push(0);
        }
        for (i, h) in out.handles.iter().enumerate() {
            let k = (out.new_block_ids_indptr[i + 1] - out.new_block_ids_indptr[i]) as usize;
            let req = self.slab.get(h.slot)?;
            for (g, ids) in groups.iter_mut().enumerate() {
                let t = &req.groups[g].blocks;
                let gi = if g < primary { g } else { g + 1 };
                let w = windows[gi];
                let k = if w == Some(crate::config::RING) {
                    // A ring's one block, new with the table only.
                    if whole[i] {
                        t.len()
                    } else {
                        0
                    }
                } else if w == Some(CROSS_ATTENTION) || w == Some(MAMBA) {
                    if whole[i] {
                        t.len()
                    } else if align {
                        // Align mode: the entries its allocation appended.
                        req.groups[g].mamba_appended as usize
                    } else {
                        0
                    }
                } else if whole[i] {
                    t.len()
                } else if sizes.get(gi).is_some_and(|&s| s != bs) {
                    // Another block size than the primary group's: the blocks its allocation appended (none when
                    // the primary group's appended none and its blocks are the smaller; a replayed window's may be
                    // smaller still).
                    if k == 0 && sizes[gi] % bs == 0 {
                        0
                    } else {
                        req.groups[g].mamba_appended as usize
                    }
                } else {
                    k
                };
                ids.extend(t[t.len() - k..].iter().map(|&b| b as i32));
                indptrs[g].push(ids.len() as i32);
            }
        }
        out.group_new_block_ids = groups;
        out.group_new_block_ids_indptr = indptrs;
        out.primary_group = primary;
        Ok(())
    }

    /// Phase A: the running requests, in order. Returns whether a request scheduled here is still prefilling
    /// (vLLM's `prefill_scheduled`, which disables spec-decode padding of admissions).
    #[allow(clippy::too_many_arguments)]
    fn schedule_running(
        &mut self,
        b: &mut Builder,
        budget: &mut Budget,
        threshold: u32,
        defer_prefills: bool,
        preempted: &mut Vec<ReqHandle>,
        prompt_chunks: &mut Vec<(u32, u32, u32)>,
        enc: &mut EncoderStep,
    ) -> Result<bool> {
        let max_model_len = i64::from(self.config.max_model_len);
        let max_slots = i64::from(self.kv.max_slots);
        let lookahead = self.config.num_lookahead_tokens;
        let prefill_lookahead = self.config.prefill_lookahead_tokens;
        // Requests carry encoder inputs only with an encoder cache: without one their (cold) field is not read.
        let has_encoder = self.encoder.capacity() > 0;
        let has_ec = has_encoder && self.ec_connector.is_some();
        let mut prefill_scheduled = false;
        // Prefetching ahead (the per-request path below) pays when running requests do their block work in
        // runs of neighbours (a group admitted together, a batch in lock-step), whose misses it overlaps. Where
        // the requests at a block boundary lie scattered among plain decodes (prompts of random lengths) the
        // batched plain-decode runs are faster than the per-request path with prefetching (docs/benchmarks.md
        // compares the two on the workloads). So three neighbours near a boundary turn it on: with many
        // running requests at any of `PREFETCH_SAMPLES` evenly spaced places, with few at the head of the list
        // (a plain step pays a few checks, not one per request).
        let near = |k: usize| {
            self.running.get(k).is_some_and(|&s| self.kv.near_block_boundary(self.slab.computed(s)))
        };
        let run = |k: usize| near(k) && near(k + 1) && near(k + 2);
        let n = self.running.len();
        let prefetch = if n >= PREFETCH_MIN_RUNNING {
            (0..PREFETCH_SAMPLES).any(|k| run(k * n / PREFETCH_SAMPLES))
        } else {
            run(0)
        };
        // decode_stagger: a request decoded within the last `decode_stagger` calls is skipped (checked on the
        // record, so the hot-column paths that would schedule it without reading the record are off).
        let staggered = self.config.decode_stagger > 1;
        let prefetch = prefetch && !staggered;
        let step_id = self.next_step_id;
        let mut i = 0;
        while i < self.running.len() && budget.open() {
            if staggered && self.slab.get(self.running[i])?.decode_ready_step > step_id {
                i += 1;
                continue;
            }
            if !prefetch && !staggered {
                // A run of plain decodes, from the hot columns alone (the check below, batched); it stops at
                // the first request that takes the general path.
                let start = i;
                let mut decodes = budget.decodes();
                i = self.slab.plain_decode_run(
                    &self.running,
                    i,
                    &mut decodes,
                    &mut b.out.handles,
                    &mut b.out.num_computed_tokens,
                );
                budget.take_decodes((i - start) as u32);
                b.add_decodes(i - start);
                if i == self.running.len() || !budget.open() {
                    break;
                }
            }
            let slot = self.running[i];
            if prefetch {
                self.prefetch_ahead(i);
            }
            // A plain decode that needs no block work (no new block, no full block to cache) is decided and
            // scheduled from the hot columns alone: its record is not touched. Anything else takes the general
            // path below, which gives such a request exactly the same result.
            let s = slot as usize;
            let hot = &mut self.slab.hot;
            let computed = hot.computed[s];
            // (Without prefetching, the run above has just found that this request is not one.)
            if prefetch && hot.fits(s, computed) {
                hot.computed[s] = computed + 1;
                hot.in_flight[s] += 1;
                b.push_decode(ReqHandle { slot, gen: self.slab.gen(slot) }, computed);
                budget.take(1);
                i += 1;
                continue;
            }
            // A plain decode at a block boundary (its token completes a block to cache, or needs a new block):
            // one token and `allocate_slots`' block work, the general path's result without its other cases
            // (the mirrors say it is plain and one token behind; the record says it is past its prompt and
            // the token fits the model length and the KV cache). If the pool cannot supply the block, nothing
            // changed and the general path preempts.
            if hot.plain[s] && computed + 1 == hot.num_tokens[s] {
                let (req, hot) = self.slab.get_mut_hot(slot)?;
                if computed >= req.num_prompt_tokens
                    && i64::from(computed) + 2 <= max_model_len
                    && i64::from(computed) < max_slots
                {
                    let first_new_block = req.blocks.len();
                    if self.kv.allocate_slots(req, computed, 1, &[], lookahead, 0, hot.in_flight[s]).is_some()
                    {
                        match req.blocks[first_new_block..] {
                            [] => b.push_decode(req.handle, computed),
                            [block] => b.push_decode_with_block(req.handle, computed, block),
                            ref blocks => b.push(req.handle, 1, computed, blocks, &[], false),
                        }
                        hot.computed[s] = computed + 1;
                        hot.in_flight[s] += 1;
                        hot.sync(s, req);
                        budget.take(1);
                        i += 1;
                        continue;
                    }
                }
            }
            let in_flight = self.slab.hot.in_flight[s];
            let req = self.slab.get_mut(slot)?;
            let ph = i64::from(req.num_output_placeholders);
            // Async scheduling: the steps in flight already produce the request's last token (tested with the
            // `max_tokens` given, as vLLM does: one given past `max_model_len` passes here and is held back by the
            // `max_model_len` cap below, after the EC connector gate has been asked).
            if ph > 0
                && i64::from(computed) + 2 - ph
                    >= i64::from(req.num_prompt_tokens) + i64::from(req.requested_max_tokens)
            {
                i += 1;
                continue;
            }
            // Deferred prefill: an unfinished prompt waits for a cadence-aligned step; decodes still run.
            if defer_prefills && req.is_prefill_chunk {
                i += 1;
                continue;
            }
            // The EC connector's gate: an encoder output still in transit defers the request for this step.
            if has_ec && !req.encoder_inputs.is_empty() {
                let upto = u32::try_from((i64::from(computed) - ph).max(0)).unwrap_or(0);
                if !self.ec_cache_available(slot, upto)? {
                    i += 1;
                    continue;
                }
            }
            let req = self.slab.get_mut(slot)?;
            let mut n = i64::from(req.num_tokens_with_spec()) + ph - i64::from(computed);
            if threshold > 0 && n > i64::from(threshold) {
                n = i64::from(threshold);
            }
            n = n.min(i64::from(budget.chunk()));
            n = n.min(max_model_len - 1 - i64::from(computed));
            // A KV cache smaller than max_model_len: never past what the request can hold (no effect for a
            // request without drafts or placeholders: add_request checked that all its tokens fit). Except for a
            // request rolled back by invalid blocks with async placeholders left (vLLM keeps them): vLLM's
            // allocation then fails and it preempts down to the request itself, as below.
            let beyond = ph > 0 && computed < req.num_tokens() && i64::from(computed) + n > max_slots;
            if !beyond {
                n = n.min(max_slots - i64::from(computed));
            }
            if n <= 0 {
                i += 1;
                continue;
            }
            let mut n = n as u32;
            // Align-mode Mamba groups: a prefill chunk ends where a state must be written; none: skipped.
            if let Some(split) = &self.mamba_split {
                n = split.split(
                    req.num_prompt_tokens,
                    req.num_tokens(),
                    computed,
                    n,
                    req.shared_prefix_boundary,
                );
                if n == 0 {
                    i += 1;
                    continue;
                }
            }
            // A multi-module MTP drafter's prefill lookahead: the chunk never ends within it of the known tokens.
            // With encoder inputs that cut comes after theirs (whose window the lookahead widens), as in vLLM.
            let planned = has_encoder && !req.encoder_inputs.is_empty();
            if !planned {
                n = reserve_prefill_lookahead(prefill_lookahead, req.num_tokens(), computed, n);
                if n == 0 {
                    i += 1;
                    continue;
                }
            }
            // Encoder inputs the chunk reaches: computed, reused from the cache, or the chunk is cut before them.
            // (Text-only requests keep their borrow: no second slab lookup on the common path.)
            let req = if planned {
                let num_tokens = req.num_tokens();
                n = self.plan_encoder(enc, slot, computed, n)?;
                n = reserve_prefill_lookahead(prefill_lookahead, num_tokens, computed, n);
                if n == 0 {
                    self.rollback_encoder(enc, slot)?;
                    i += 1;
                    continue;
                }
                self.slab.get_mut(slot)?
            } else {
                req
            };
            let first_new_block = req.blocks.len();
            let mut req = req;
            if beyond || self.kv.allocate_slots(req, computed, n, &[], lookahead, 0, in_flight).is_none() {
                // Preempt until the allocation succeeds or `req` itself is the victim.
                let mut self_preempted = false;
                let mut gave_up = false;
                loop {
                    // A connector whose transfers will release blocks stops the preemptions (vLLM 0.33).
                    if self.connector.is_some() && self.connector_has_pending_block_frees() {
                        gave_up = true;
                        break;
                    }
                    let j = self.pick_victim(&b.out.handles, &b.out.num_computed_tokens)?;
                    if self.config.defer_block_free {
                        // A victim whose blocks a step in flight still writes would free them too late.
                        let victim = self.running[j];
                        let in_step = match b.out.handles.iter().position(|h| h.slot == victim) {
                            Some(pos) => {
                                b.write_everything();
                                b.out.num_scheduled_tokens[pos] as u32
                            }
                            None => 0,
                        };
                        if !self.victim_blocks_can_be_freed(victim, in_step) {
                            gave_up = true;
                            break;
                        }
                    }
                    let victim = self.running.remove(j);
                    let mut computed_before = None;
                    if let Some(pos) = b.out.handles.iter().position(|h| h.slot == victim) {
                        computed_before = Some(b.out.num_computed_tokens[pos] as u32);
                        // Its tokens of this step leave the step, and its in-flight count.
                        let refund = b.remove(pos);
                        self.slab.hot.in_flight[victim as usize] -= refund;
                        budget.give(refund);
                    }
                    if j < i {
                        i -= 1;
                    }
                    // Its encoder budget of this step comes back; what it was to compute is handed over or dropped.
                    self.abandon_encoder(enc, victim, slot)?;
                    preempted.push(self.preempt_victim(victim, computed_before, &mut b.out.swap_out)?);
                    if victim == slot {
                        self_preempted = true;
                        break;
                    }
                    let req = self.slab.get_mut(slot)?;
                    if !beyond
                        && self.kv.allocate_slots(req, computed, n, &[], lookahead, 0, in_flight).is_some()
                    {
                        break;
                    }
                }
                if gave_up {
                    // `req` was not preempted: its encoder plan goes, and the pass ends under every policy
                    // (vLLM 0.33).
                    if planned {
                        self.rollback_encoder(enc, slot)?;
                    }
                    break;
                }
                if self_preempted {
                    // vLLM 0.33: under PRIORITY the requests after it rank higher and may still fit (`i` already
                    // points at the next one; FAIR: they belong to tenants with smaller counters; `lcf` and
                    // `cost`: they rank above it). The default victim of FCFS, SJF and SLO is the tail: nothing
                    // follows it. vLLM 0.32 ends the pass under PRIORITY (`continue_after_self_preemption`).
                    if self.config.policy == Policy::Priority && !self.config.continue_after_self_preemption {
                        break;
                    }
                    continue;
                }
                req = self.slab.get_mut(slot)?;
            }
            prefill_scheduled |= req.is_prefill_chunk;
            if computed < req.num_prompt_tokens {
                prompt_chunks.push((slot, computed, n));
            }
            if planned {
                if let Some(conn) = self.ec_connector.as_mut() {
                    crate::encoder_sched::notify_ec_alloc(conn, req, enc);
                }
                Self::commit_encoder(&mut self.counters, enc);
            }
            req.is_prefill_chunk = i64::from(computed + n) < i64::from(req.num_tokens()) + ph;
            // Drafts ride along only as far as this step reaches past the known tokens and placeholders.
            let num_spec = (i64::from(computed) + i64::from(n) - i64::from(req.num_tokens()) - ph)
                .clamp(0, req.spec_token_ids.len() as i64) as usize;
            b.push(
                req.handle,
                n,
                computed,
                &req.blocks[first_new_block..],
                &req.spec_token_ids[..num_spec],
                req.is_prefill_chunk,
            );
            req.spec_token_ids.clear();
            req.chunk_step = (self.next_step_id, computed);
            self.slab.hot.computed[s] = computed + n;
            self.slab.hot.in_flight[s] += n;
            self.slab.sync(slot);
            budget.take(n);
            i += 1;
        }
        Ok(prefill_scheduled)
    }

    /// Prefetching for a step in which many running requests do block work (see `schedule_running`): the
    /// records of the requests `3 * PREFETCH_AHEAD` after position `i`, their block-table and hash-list lines
    /// `2 *` after, the cache-table slot of their next full block `1 *` after (each stage reads what the
    /// previous one fetched). Requests not near a block boundary are left out (their hot columns say so).
    #[inline(always)]
    fn prefetch_ahead(&self, i: usize) {
        let near = |k: usize| {
            self.running
                .get(i + k * PREFETCH_AHEAD)
                .copied()
                .filter(|&s| self.kv.near_block_boundary(self.slab.computed(s)))
        };
        if let Some(s) = near(3) {
            self.slab.prefetch_record(s);
        }
        if let Some(s) = near(2) {
            if let Some(ahead) = self.slab.peek(s) {
                self.kv.prefetch_block_work(ahead, self.slab.computed(s));
            }
        }
        if let Some(s) = near(1) {
            if let Some(ahead) = self.slab.peek(s) {
                self.kv.prefetch_cache_slot(ahead, self.slab.computed(s));
            }
        }
    }

    /// Phase B: admits waiting requests in policy order while `max_num_seqs`, the budget and the free blocks
    /// allow; it never preempts. Requests that cannot run yet (grammar not ready, output of a step from before
    /// their preemption still in flight, a LoRA over `max_loras`) are skipped and keep their place. With
    /// `defer_prefills` admission stops at the first request with more than one token to compute. Returns
    /// whether it admitted such a request (vLLM's `prefill_admitted`).
    ///
    /// Each admission is three steps: `admission_candidate` decides whether the request at the head of its
    /// queue can run now and with how many tokens, `allocate_admission` gets its blocks, and
    /// `commit_admission` makes it running (or parks it while its KV loads). The pass ends at the first
    /// candidate that cannot be admitted and is not skipped; the skipped requests then go back to the front.
    /// Also returns how many went back to the front of `waiting`.
    fn admit_waiting(
        &mut self,
        b: &mut Builder,
        budget: &mut Budget,
        threshold: u32,
        prefill_scheduled: bool,
        defer_prefills: bool,
        enc: &mut EncoderStep,
    ) -> Result<(bool, usize)> {
        let max_active = self.config.max_active_seqs();
        let mut pass = AdmissionPass {
            threshold,
            prefill_scheduled,
            defer_prefills,
            any_running_scheduled: !b.out.handles.is_empty(),
            quick_reject: self.connector.is_none()
                && self.hit_cap.is_none()
                && self.config.num_spec_tokens() == 0
                && self.config.prefill_lookahead_tokens <= 1
                // Bounded prefix replay: an admission allocates for its replayed tokens beyond the bound's.
                && self.config.prefix_replay_groups.is_empty(),
            watermark: self.config.watermark_blocks(),
            loras: self.running_loras(&b.out.handles)?,
            skipped: Vec::new(),
            skipped_kv: Vec::new(),
            hits: std::mem::take(&mut self.hits_buf),
            aged: false,
            sjf_rekeys: 0,
        };
        let mut prefill_admitted = false;
        // Sessions waiting for their next input part keep a slot (vLLM 0.33: the runner still holds them).
        while budget.open() && self.running.len() + self.num_waiting_for_input < max_active {
            // Requests holding KV blocks (their asynchronous load is over) go first, and are the only ones
            // admitted under `paused_new` (vLLM 0.33's `kv_holding_waiting`).
            let from_kv = !self.kv_waiting.is_empty();
            if !from_kv && self.pause_state != PauseState::Unpaused {
                break;
            }
            // `waiting`: the policy's order, with aging and the `sjf` re-keying (`admission.rs`).
            let peeked = if from_kv {
                self.kv_waiting.peek(&self.tenants).map(|h| (h, false))
            } else {
                self.peek_waiting(&pass.skipped, &mut pass.sjf_rekeys, &mut pass.hits)?
            };
            let Some((h, aged)) = peeked else { break };
            pass.aged = aged;
            let a = match self.admission_candidate(&mut pass, h, from_kv, budget.chunk(), enc)? {
                Candidate::Admit(a) => a,
                Candidate::Skip => continue,
                Candidate::Stop => break,
            };
            if !self.allocate_admission(&pass, &a, enc)? {
                break;
            }
            prefill_admitted |= self.commit_admission(b, &mut pass, &a, budget, enc)?;
        }
        // Skipped requests go back to the front in their order (FCFS), or by their key (PRIORITY).
        // A request that comes back from `kv_waiting` (its failed load left nothing) enters `waiting` anew.
        let policy = self.config.policy;
        for &h in pass.skipped.iter().rev() {
            let req = self.slab.get(h.slot)?;
            let (key, entering) = (Self::order_key(policy, req), req.wait_seq == 0);
            self.waiting.push_preempted(h, key);
            if entering {
                self.enter_waiting(h.slot)?;
            }
        }
        for &h in pass.skipped_kv.iter().rev() {
            let key = Self::order_key(policy, self.slab.get(h.slot)?);
            self.kv_waiting.push_preempted(h, key);
        }
        pass.hits.clear();
        self.hits_buf = pass.hits;
        Ok((prefill_admitted, pass.skipped.len()))
    }

    /// The LoRA adapters counted against `max_loras` at admission (none asked for without `max_loras`): those
    /// of all running requests, scheduled this step or not, or with `max_loras_counts_unscheduled` off only
    /// those of the requests `scheduled` so far in this step (vLLM 0.32).
    fn running_loras(&self, scheduled: &[ReqHandle]) -> Result<Vec<String>> {
        let mut loras: Vec<String> = Vec::new();
        if self.config.max_loras > 0 {
            let scheduled_slots: Vec<u32>;
            let counted: &[u32] = if self.config.max_loras_counts_unscheduled {
                &self.running
            } else {
                scheduled_slots = scheduled.iter().map(|h| h.slot).collect();
                &scheduled_slots
            };
            for &s in counted {
                if let Some(l) = &self.slab.get(s)?.extra_keys.lora_name {
                    if !loras.iter().any(|x| x == l) {
                        loras.push(l.clone());
                    }
                }
            }
        }
        Ok(loras)
    }

    /// Phase B's first step for the request `h` at the head of its queue (`kv_waiting` if `from_kv`): whether
    /// it can run now, and with how many tokens. Finds its prefix hits (into `pass.hits`) and asks the connector
    /// about it. `Skip`: it cannot run yet; it is out of its queue until the end of the pass and counts as
    /// deferred. `Stop`: the pass ends. Neither leaves anything to undo (what may have changed stands either
    /// way: a status moved on, grammar ready or load over, and the probe's hit count). `Admit` may have planned
    /// its encoder inputs in `enc`, which `allocate_admission` rolls back if the allocation fails.
    fn admission_candidate(
        &mut self,
        pass: &mut AdmissionPass,
        h: ReqHandle,
        from_kv: bool,
        budget: u32,
        enc: &mut EncoderStep,
    ) -> Result<Candidate> {
        let bs = self.config.kv_block_size();
        let lookahead = self.config.num_lookahead_tokens;
        let max_loras = self.config.max_loras as usize;
        let threshold = pass.threshold;
        let hs = h.slot as usize;
        // Bounded prefix replay (`prefix_replay_groups`): the replay window.
        let replay_window = self.config.replay_window();
        let (req, hot) = self.slab.get_mut_hot(h.slot)?;
        if req.status == RequestStatus::WaitingForGrammar && req.grammar_ready {
            req.status = RequestStatus::Waiting;
        }
        if req.status == RequestStatus::WaitingForRemoteKvs && req.kv_load_done {
            Self::promote_loaded(&mut self.kv, req, &mut hot.computed[hs], replay_window);
        }
        let lora_blocked = max_loras > 0
            && pass.loras.len() >= max_loras
            && req.extra_keys.lora_name.as_ref().is_some_and(|l| !pass.loras.contains(l));
        let mut blocked = req.status == RequestStatus::WaitingForGrammar
            || req.status == RequestStatus::WaitingForRemoteKvs
            || req.status == RequestStatus::WaitingForInput
            || (hot.stale[hs] > 0 && !req.drop_stale_output)
            || lora_blocked
            // Per-tenant admission filter: a tenant at its running limit waits, the others go past it.
            || self.tenants.at_running_limit(req.tenant);
        // Tokens beyond the local prefix hit that the connector supplies, and whether they load
        // asynchronously (asked only of requests with nothing computed: a loaded request keeps its count).
        let mut ext = 0u32;
        let mut load_async = false;
        // Bounded prefix replay: whether the admission's load restores the replayed windows, and the local hit
        // before a hit no longer than the window is dropped.
        let mut window_loaded = false;
        let mut local_before_drop = None;
        let computed_before = hot.computed[hs];
        // Blocks the admission must leave free (the watermark), unless nothing runs.
        let reserved = if self.running.is_empty() { 0 } else { pass.watermark };
        let hits = &mut pass.hits;
        hits.clear();
        if !blocked && computed_before == 0 {
            // The cache-hit cap (`hit_cap.rs`) bounds the lookup: `max` tokens allow `max / bs` blocks, and the
            // lookup leaves out the block of the last of the tokens it is given.
            let mut lookup_tokens = req.num_tokens();
            let mut cached = Vec::new();
            if let Some(cap) = self.hit_cap.as_mut() {
                cached = crate::hit_cap::cached_mask(&self.kv, req);
                let max = cap.0.max_cache_hit(req, &cached);
                lookup_tokens = lookup_tokens.min(max.saturating_add(1));
            }
            // A request that cannot get the blocks it needs however many prefix hits it finds ends the pass
            // (every way its admission can fail ends the pass, and none changes anything): one lookup past
            // its last probe's hits bounds them, instead of a lookup per block. Under memory pressure the
            // head of the queue is probed in almost every step and does not fit. Only for the plain case:
            // no connector, encoder inputs, swapped blocks or drafts, where nothing else decides the outcome.
            if pass.quick_reject
                && self.kv.partial_unit == 0
                && req.encoder_inputs.is_empty()
                // Encoder-decoder: slots short skip the request before its allocation could end the pass.
                && (req.cross_attention_tokens == 0 || !self.config.encoder_decoder)
                && req.cpu_blocks.is_empty()
                && req.num_swapped_tokens == 0
            {
                let bound = if req.skip_reading_prefix_cache {
                    Some(0)
                } else {
                    self.kv.cache_hit_upper_bound(&req.block_hashes, req.num_tokens(), req.probe_hits)
                };
                if let Some(max_hits) = bound {
                    let max_new = if threshold > 0 { threshold.min(budget) } else { budget };
                    let least = self.kv.min_blocks_to_admit(req, max_hits, max_new, lookahead);
                    if least + reserved > self.kv.pool.num_free_blocks() {
                        return Ok(Candidate::Stop);
                    }
                }
            }
            // A request that skips reading the prefix cache (prompt logprobs) gets no hits.
            req.shared_prefix_boundary = 0;
            // With a connector that completes divergent local hits: each group's own hit (see
            // `find_hybrid_hit_per_group`), whether a group's is shorter than full attention's.
            let mut diverged = false;
            if !req.skip_reading_prefix_cache {
                let per_group = if self.config.divergent_local_hits && self.connector.is_some() {
                    self.kv.find_hybrid_hit_per_group(&req.block_hashes, lookup_tokens, hits)
                } else {
                    None
                };
                match per_group {
                    // The per-group lookup leaves the shared-prefix junction at 0.
                    Some(d) => diverged = d,
                    // Hits can end inside a block.
                    None if self.kv.partial_unit != 0 => {
                        self.kv.find_partial_admission_hit(req, lookup_tokens, hits);
                    }
                    None => {
                        self.kv.find_longest_cache_hit(&req.block_hashes, lookup_tokens, hits);
                        req.shared_prefix_boundary = self.kv.shared_prefix_boundary(hits.len());
                    }
                }
                req.probe_hits = hits.len() as u32;
            }
            // A swapped-out request resumes from its CPU copy: the connector is not asked.
            if let (Some(conn), true) = (self.connector.as_mut(), req.cpu_blocks.is_empty()) {
                let local = hits.len() as u32 * bs;
                let matched = conn.0.get_num_new_matched_tokens(req, local);
                match matched {
                    // vLLM asks the connector, then loads nothing for such a request.
                    _ if req.skip_reading_prefix_cache => {}
                    None => blocked = true,
                    Some((e, a)) => {
                        // Never more than the request has; a synchronous load leaves at least one token to
                        // compute (vLLM asserts both of its connectors).
                        let room = req.num_tokens() - local;
                        ext = e.min(room);
                        load_async = a && ext > 0;
                        if !load_async && ext == room {
                            ext = room - 1;
                        }
                    }
                }
                // Bounded prefix replay: a load that does not restore the replayed windows is taken in whole
                // blocks (the replay starts in the block of the hit's last window's first token, which a hit
                // ending inside a block could have retired).
                if replay_window > 0 && !blocked && ext > 0 {
                    window_loaded =
                        restores_window(conn.0.loaded_groups(req), &self.config.prefix_replay_groups);
                    if !window_loaded {
                        let align = self.kv.hybrid.as_deref().map_or(bs, |hy| hy.align);
                        ext -= ext % align;
                        load_async &= ext > 0;
                    }
                }
                // The cap on the external hit, asked whenever the connector answered (an answer of 0 too).
                if let (false, Some(cap)) = (blocked, self.hit_cap.as_mut()) {
                    ext = cap.0.cap_external_hit(req, &cached, local, ext).min(ext);
                    load_async &= ext > 0;
                }
                // A diverged hit the connector adds nothing to has no state where it ends: the usual hit, which
                // every group agrees on, replaces it (the connector is not asked again).
                if diverged && !blocked && ext == 0 {
                    hits.clear();
                    self.kv.find_longest_cache_hit(&req.block_hashes, lookup_tokens, hits);
                    req.probe_hits = hits.len() as u32;
                    req.shared_prefix_boundary = self.kv.shared_prefix_boundary(hits.len());
                    conn.0.local_hit_replaced(req, hits.len() as u32 * bs);
                }
            }
        }
        // Bounded prefix replay: a hit no longer than the window would be recomputed whole; it is dropped (an
        // asynchronous load of it is not started), unless its load restores the replayed windows.
        window_loaded &= ext > 0;
        if replay_window > 0 && !blocked && computed_before == 0 && !window_loaded {
            let local = self.kv.hit_tokens(hits);
            if local + ext > 0 && local + ext <= replay_window {
                local_before_drop = Some(local);
                hits.clear();
                ext = 0;
                load_async = false;
            }
        }
        // The EC connector's gate, with the tokens the request has (a loaded one) or the lookups cover: an
        // encoder output still in transit skips it (it keeps its place).
        if !blocked && !req.encoder_inputs.is_empty() && self.encoder.capacity() > 0 {
            if let Some(conn) = self.ec_connector.as_mut() {
                let covered = if computed_before > 0 {
                    computed_before
                } else {
                    let covered = restored_tokens(req, hits.len() as u32 * bs) + ext;
                    // A replay recomputes the encoder inputs of its window.
                    if window_loaded {
                        covered
                    } else {
                        covered.saturating_sub(replay_window)
                    }
                };
                blocked = !conn.0.ensure_cache_available(req, covered);
            }
        }
        if blocked {
            mark_deferred(req, &mut self.num_deferred);
            // Back among the requests holding KV blocks if it holds some (vLLM's `_holds_kv_blocks`: a
            // load in progress or over); a request whose failed load left nothing goes back to `waiting`.
            let holds_kv = req.status == RequestStatus::WaitingForRemoteKvs
                || hot.computed[hs] > 0
                || !req.blocks.is_empty();
            self.pop_candidate(h, from_kv, pass.aged)?;
            if holds_kv {
                pass.skipped_kv.push(h);
            } else {
                pass.skipped.push(h);
            }
            return Ok(Candidate::Skip);
        }
        let num_hit_tokens = self.kv.hit_tokens(hits);
        // A swapped-out request resumes from its swapped tokens when they reach past the hits.
        let restored = restored_tokens(req, num_hit_tokens);
        // Tokens already in KV (or arriving) before this step: a loaded request's count, else the local hit
        // (or a swapped-out request's swapped tokens when they reach past it) plus the connector's.
        let mut computed = if computed_before > 0 { computed_before } else { restored + ext };
        // Deferred prefill: stop at a request with prompt left beyond its last token (an asynchronous load
        // computes nothing this step, so it is not deferred).
        if pass.defer_prefills && !load_async && computed + 1 < req.num_tokens() {
            return Ok(Candidate::Stop);
        }
        // Bounded prefix replay: the hit's last window is recomputed (unless its load restores the replayed
        // windows); the computed count starts there, the replayed tokens' slots are the hit's.
        let mut replay = 0;
        let mut replay_start = None;
        if replay_window > 0 && computed_before == 0 && !load_async {
            if !window_loaded {
                replay = replay_window.min(computed);
            }
            // (0 when the load restores the windows: nothing replays.)
            replay_start = Some(if window_loaded { 0 } else { computed - replay });
            computed -= replay;
        }
        let has_prefill = computed + 1 < req.num_tokens();
        let planned_encoder = self.encoder.capacity() > 0 && !load_async && !req.encoder_inputs.is_empty();
        let num_tokens = req.num_tokens();
        let num_prompt = req.num_prompt_tokens;
        let junction = req.shared_prefix_boundary;
        // Encoder-decoder: the encoder output is computed at the admission of a request with nothing computed
        // (`encoder_dec.rs`); a failed allocation gives its slots back all the same.
        let enc_dec_tokens = if self.config.encoder_decoder { req.cross_attention_tokens } else { 0 };
        let (mut n, mut pad) = if load_async {
            (0, false)
        } else {
            match self.admission_tokens(pass, computed, num_tokens, budget) {
                Some(tokens) => tokens,
                None => return Ok(Candidate::Stop),
            }
        };
        if let (false, Some(split)) = (load_async, &self.mamba_split) {
            // Align-mode Mamba groups: a prefill chunk ends where a state must be written; none ends the pass.
            // A padded decode keeps its drafts or loses them all.
            n = split.split(num_prompt, num_tokens, computed, n, junction);
            if n == 0 {
                return Ok(Candidate::Stop);
            }
            if pad && n != 1 + self.config.num_spec_tokens() {
                (n, pad) = (1, false);
            }
        }
        if planned_encoder {
            n = self.plan_encoder(enc, h.slot, computed, n)?;
            if n == 0 {
                // vLLM 0.33: an admission whose first encoder input does not fit is skipped (it keeps its
                // place); vLLM 0.32 ends the pass there.
                self.rollback_encoder(enc, h.slot)?;
                if !self.config.skip_encoder_blocked_admissions {
                    return Ok(Candidate::Stop);
                }
                return self.skip_admission(h, from_kv, pass);
            }
        }
        if !load_async {
            // The drafter's prefill lookahead (see `schedule_running`, after the encoder plan): a chunk cut to
            // nothing is skipped (vLLM 0.33), or ends the pass (vLLM 0.32).
            n = reserve_prefill_lookahead(self.config.prefill_lookahead_tokens, num_tokens, computed, n);
            if n == 0 {
                if planned_encoder {
                    self.rollback_encoder(enc, h.slot)?;
                }
                if !self.config.skip_lookahead_cut_admissions {
                    return Ok(Candidate::Stop);
                }
                return self.skip_admission(h, from_kv, pass);
            }
        }
        let mut enc_dec_charge = 0;
        if enc_dec_tokens > 0 && computed == 0 && !load_async {
            if enc_dec_tokens > enc.budget || i64::from(enc_dec_tokens) > self.enc_dec_free_slots {
                // vLLM 0.33: the encoder budget or the slots are short: 0 tokens, skipped (it keeps its place);
                // vLLM 0.32 ends the pass there.
                if !self.config.skip_encoder_blocked_admissions {
                    return Ok(Candidate::Stop);
                }
                return self.skip_admission(h, from_kv, pass);
            }
            enc_dec_charge = enc_dec_tokens;
        }
        Ok(Candidate::Admit(Admission {
            h,
            enc_dec_tokens,
            enc_dec_charge,
            from_kv,
            computed_before,
            num_hit_tokens,
            restored,
            computed,
            replay,
            replay_start,
            local_before_drop,
            window_loaded,
            ext,
            load_async,
            has_prefill,
            n,
            pad,
            planned_encoder,
            reserved,
        }))
    }

    /// The tokens an admission with `computed` of its `num_tokens` tokens in KV computes this step (it loads
    /// nothing asynchronously), and whether they are padded with placeholder drafts; `None` when they do not
    /// fit `budget` and the pass must end.
    fn admission_tokens(
        &self,
        pass: &AdmissionPass,
        computed: u32,
        num_tokens: u32,
        budget: u32,
    ) -> Option<(u32, bool)> {
        let threshold = pass.threshold;
        let num_spec = self.config.num_spec_tokens();
        let mut n = num_tokens - computed;
        // Spec decoding: a request with one token to compute, admitted into a batch of decodes, gets
        // placeholder drafts so that every decode in the batch has the same shape (vLLM 0.33).
        let padded = 1 + num_spec;
        let pad = num_spec > 0
            && n == 1
            && !pass.prefill_scheduled
            && (pass.any_running_scheduled || computed > 0)
            && computed + padded < self.config.max_model_len // room for the token this step samples
            && computed + padded <= self.kv.max_slots // and in a KV cache below max_model_len
            && (threshold == 0 || threshold >= padded);
        if pad {
            if padded > budget {
                return None;
            }
            n = padded;
        }
        if threshold > 0 && n > threshold {
            n = threshold;
        }
        if !self.config.enable_chunked_prefill && n > budget {
            return None;
        }
        Some((n.min(budget), pad))
    }

    /// Phase B's second step: the candidate's blocks (its prefix hits, then fresh blocks for what it loads
    /// and computes), leaving `a.reserved` free. Returns whether it got them; if not, nothing changed (its
    /// planned encoder inputs are rolled back) and the pass ends.
    fn allocate_admission(
        &mut self,
        pass: &AdmissionPass,
        a: &Admission,
        enc: &mut EncoderStep,
    ) -> Result<bool> {
        let lookahead = self.config.num_lookahead_tokens;
        // An asynchronous load with new attention blocks zeroed: the groups it writes keep their loaded tokens'
        // blocks out of the zeroing (asked before the allocation, as vLLM asks).
        let zeroes = self.kv.hybrid.as_deref().is_some_and(|hy| !hy.zero_ids.is_empty());
        if a.load_async && a.ext > 0 && zeroes {
            let ngroups = self.config.kv_cache_groups.len();
            let loaded = match (self.connector.as_mut(), self.slab.get(a.h.slot)) {
                (Some(conn), Ok(req)) => conn.0.loaded_groups(req),
                _ => None,
            };
            if let Some(hy) = self.kv.hybrid.as_deref_mut() {
                hy.skip_zero = loaded.unwrap_or_else(|| (0..ngroups).collect());
            }
        }
        let allocated = self.allocate_admission_inner(pass, a, enc, lookahead);
        if let Some(hy) = self.kv.hybrid.as_deref_mut() {
            hy.skip_zero.clear();
        }
        allocated
    }

    fn allocate_admission_inner(
        &mut self,
        pass: &AdmissionPass,
        a: &Admission,
        enc: &mut EncoderStep,
        lookahead: u32,
    ) -> Result<bool> {
        let hs = a.h.slot as usize;
        if self.config.scheduler_reserve_full_isl
            && !self.kv.full_sequence_fits(
                self.slab.get(a.h.slot)?,
                &pass.hits,
                a.computed_before,
                a.ext,
                a.reserved,
            )
        {
            if a.planned_encoder {
                self.rollback_encoder(enc, a.h.slot)?;
            }
            self.enc_dec_free_slots += i64::from(a.enc_dec_tokens);
            return Ok(false);
        }
        // vLLM 0.33: an asynchronous load leaves free what the in-flight prefills still need.
        let extra = if a.load_async && self.config.reserve_inflight_prefills {
            let cap =
                if self.config.sliding_window.is_some() { self.kv.admission_cap_blocks } else { usize::MAX };
            inflight_reserved_blocks(&self.slab, &self.config, &self.kv, cap, self.next_step_id)
        } else {
            0
        };
        let (req, hot) = self.slab.get_mut_hot(a.h.slot)?;
        // `allocate_slots` counts the slots from `computed + hits`: `restored` for a swapped-in request.
        if a.computed_before == 0 {
            hot.computed[hs] = a.restored - a.num_hit_tokens;
        }
        let at = hot.computed[hs];
        let in_flight = hot.in_flight[hs];
        let allocated = if a.ext > 0 {
            // Loads are allocated like computed tokens; an asynchronous load gets no lookahead slots and its
            // blocks enter the prefix cache only once it has arrived.
            let la = if a.load_async { 0 } else { lookahead };
            let reserved = a.reserved + extra;
            self.kv.allocate_slots_ext(
                req,
                at,
                a.n.saturating_sub(a.replay),
                &pass.hits,
                a.ext,
                la,
                reserved,
                !a.load_async,
                in_flight,
            )
        } else {
            self.kv.allocate_slots(
                req,
                at,
                a.n.saturating_sub(a.replay),
                &pass.hits,
                lookahead,
                a.reserved,
                in_flight,
            )
        };
        if allocated.is_none() {
            if a.computed_before == 0 {
                hot.computed[hs] = 0;
            }
            if a.planned_encoder {
                self.rollback_encoder(enc, a.h.slot)?;
            }
            self.enc_dec_free_slots += i64::from(a.enc_dec_tokens);
            return Ok(false);
        }
        Ok(true)
    }

    /// Phase B's last step, once the candidate holds its blocks: its encoder plan, swap-in, connector state
    /// and prefix-cache stats are committed, and it leaves its queue, either running (its tokens pushed to the
    /// step and charged to its tenant) or, for an asynchronous load, waiting for the load. Returns whether it
    /// was admitted with prompt left to compute (vLLM's `prefill_admitted`).
    fn commit_admission(
        &mut self,
        b: &mut Builder,
        pass: &mut AdmissionPass,
        a: &Admission,
        budget: &mut Budget,
        enc: &mut EncoderStep,
    ) -> Result<bool> {
        let (h, hs, computed, n) = (a.h, a.h.slot as usize, a.computed, a.n);
        // The EC connector hears of the request's encoder allocations after the KV connector of its blocks.
        let mut ec_allocated = Vec::new();
        if a.planned_encoder {
            if self.ec_connector.is_some() {
                ec_allocated = enc.pending.iter().chain(enc.pending_loads.iter()).map(|w| w.1).collect();
            }
            Self::commit_encoder(&mut self.counters, enc);
        }
        enc.budget -= a.enc_dec_charge;
        self.enc_dec_free_slots -= i64::from(a.enc_dec_charge);
        let (req, hot) = self.slab.get_mut_hot(h.slot)?;
        complete_resume(
            &mut self.cpu,
            &mut self.counters,
            req,
            pass.hits.len(),
            computed,
            &mut b.out.swap_in,
        )?;
        if let Some(conn) = self.connector.as_mut() {
            // (A hit dropped for bounded prefix replay was asked with its local part.)
            let local = a.local_before_drop.unwrap_or(a.num_hit_tokens);
            let queries =
                (a.computed_before == 0).then(|| (u64::from(req.num_tokens() - local), u64::from(a.ext)));
            let defer = a.load_async
                && self.config.defer_block_free
                && self.config.defer_async_loads
                && self.sched_step_seq > self.processed_step_seq;
            let tables = self.config.kv_connector_groups.then(|| self.kv.group_tables(req));
            if defer {
                conn.deferred(req, tables.as_ref(), a.ext);
                let fence = self.sched_step_seq;
                self.deferred_loads.push_back(DeferredLoad {
                    fence,
                    handle: h,
                    num_external_tokens: a.ext,
                    queries,
                });
            } else {
                conn.after_alloc(req, tables.as_ref(), a.ext);
                if let Some((q, hits)) = queries {
                    self.counters.connector_prefix_cache_queries += q;
                    self.counters.connector_prefix_cache_hits += hits;
                }
            }
        }
        if let (false, Some(conn)) = (ec_allocated.is_empty(), self.ec_connector.as_mut()) {
            for &i in &ec_allocated {
                conn.0.update_state_after_alloc(req, i);
            }
        }
        // No lookup, no query: vLLM leaves a request that skips reading the cache out of the stats.
        if a.computed_before == 0 && !req.skip_reading_prefix_cache {
            let c = &mut self.counters;
            if req.num_preemptions > 0 {
                c.prefix_cache_preempted_queries += u64::from(req.num_tokens());
                c.prefix_cache_preempted_hits += u64::from(a.num_hit_tokens);
            } else {
                c.prefix_cache_queries += u64::from(req.num_tokens());
                c.prefix_cache_hits += u64::from(a.num_hit_tokens);
            }
        }
        if a.load_async {
            // Holds its blocks until the engine reports the load finished (`update_kv_transfers`): parked,
            // or (vLLM 0.33's rule) back among the skipped requests that hold KV blocks.
            req.status = RequestStatus::WaitingForRemoteKvs;
            req.load_restores_window = a.window_loaded;
            hot.computed[hs] = computed;
            req.kv_load_done = false;
            req.inflight_prefill = true;
            req.parked = self.config.park_kv_loads;
            req.wait_seq = 0;
            mark_deferred(req, &mut self.num_deferred);
            self.pop_candidate(h, a.from_kv, pass.aged)?;
            if self.config.park_kv_loads {
                self.num_parked += 1;
                self.num_loading += 1;
            } else {
                pass.skipped_kv.push(h);
            }
            return Ok(false);
        }
        let resumed = req.status == RequestStatus::Preempted;
        req.status = RequestStatus::Running;
        req.chunk_step = (self.next_step_id, computed);
        hot.computed[hs] = computed + n;
        req.is_prefill_chunk = computed + n < req.num_tokens();
        // Leaves vLLM's in-flight prefill set only after the step (finish_step), as vLLM discards it there.
        req.inflight_prefill |= req.is_prefill_chunk;
        if req.num_cached_tokens < 0 {
            req.num_cached_tokens = i64::from(computed + a.replay);
        }
        if let Some(start) = a.replay_start {
            req.replay_start = start;
        }
        if req.deferred {
            req.deferred = false;
            self.num_deferred -= 1;
        }
        if self.config.max_loras > 0 {
            if let Some(l) = &req.extra_keys.lora_name {
                if !pass.loras.contains(l) {
                    pass.loras.push(l.clone());
                }
            }
        }
        req.wait_seq = 0;
        if req.session != NO_SESSION {
            self.sessions.on_run(req.session);
        }
        let idx = b.out.handles.len() as u32;
        if resumed {
            b.out.resumed_reqs.push(idx);
        } else {
            b.out.new_reqs.push(idx);
        }
        let spec =
            if a.pad { vec![SPEC_PLACEHOLDER; self.config.num_spec_tokens() as usize] } else { Vec::new() };
        b.push(req.handle, n, computed, &req.blocks, &spec, req.is_prefill_chunk);
        let tenant = req.tenant;
        self.pop_candidate(h, a.from_kv, pass.aged)?;
        let req = self.slab.get_mut(h.slot)?;
        self.tenants.on_admit(tenant);
        self.tenants.charge_prompt(req, computed, n);
        self.running.push(h.slot);
        self.slab.hot.in_flight[hs] += n;
        self.slab.sync(h.slot);
        budget.take(n);
        Ok(a.has_prefill)
    }

    /// Takes the candidate `h` out of the queue it came from: the head of `kv_waiting` if `from_kv`, else of
    /// `waiting`, or its place in `waiting` if aging picked it (`aged`).
    /// An admission candidate skipped for this pass: deferred, taken off its queue, and put back after the pass
    /// where it was (it keeps its place).
    fn skip_admission(&mut self, h: ReqHandle, from_kv: bool, pass: &mut AdmissionPass) -> Result<Candidate> {
        mark_deferred(self.slab.get_mut(h.slot)?, &mut self.num_deferred);
        self.pop_candidate(h, from_kv, pass.aged)?;
        if from_kv {
            pass.skipped_kv.push(h);
        } else {
            pass.skipped.push(h);
        }
        Ok(Candidate::Skip)
    }

    fn pop_candidate(&mut self, h: ReqHandle, from_kv: bool, aged: bool) -> Result<()> {
        if from_kv {
            self.kv_waiting.pop(&self.tenants);
        } else if aged {
            let req = self.slab.get(h.slot)?;
            let (tier, tenant) = (req.order_key, req.tenant);
            if !self.waiting.remove(h, tier, tenant) {
                return Err(SchedError::Internal(format!("aged request {:?} is not in waiting", req.id)));
            }
        } else {
            self.waiting.pop(&self.tenants);
        }
        Ok(())
    }

    /// A request whose asynchronous load is over becomes WAITING (PREEMPTED if it was preempted before): the
    /// loaded blocks enter the prefix cache (after a failure only the valid prefix; with nothing valid its
    /// blocks are freed and it is admitted afresh), and a fully loaded prompt recomputes its last token.
    fn promote_loaded(
        kv: &mut crate::kv_cache_manager::KvCacheManager,
        req: &mut crate::request::Request,
        computed: &mut u32,
        replay_window: u32,
    ) {
        if req.kv_load_failed && *computed == 0 {
            kv.free(req);
        } else {
            kv.cache_blocks(req, *computed);
        }
        // Bounded prefix replay: a load that did not restore the replayed windows (or failed) recomputes its last
        // window; the replay covers the last token.
        let mut replay = 0;
        if replay_window > 0 {
            if req.load_restores_window && !req.kv_load_failed {
                req.replay_start = 0;
            } else {
                replay = replay_window.min(*computed);
                req.replay_start = *computed - replay;
            }
        }
        if replay > 0 {
            *computed -= replay;
            if *computed == 0 && !req.blocks.is_empty() {
                // Nothing computed is left: admitted afresh, like a load with nothing valid.
                kv.free(req);
            }
        } else if *computed == req.num_tokens() {
            *computed -= 1;
            if *computed == 0 && !req.blocks.is_empty() {
                // A one-token prompt keeps nothing computed: it is admitted afresh, like a load with nothing valid.
                kv.free(req);
            }
        }
        req.kv_load_done = false;
        req.kv_load_failed = false;
        req.status = if req.num_preemptions > 0 { RequestStatus::Preempted } else { RequestStatus::Waiting };
    }

    /// Frees the request's KV and sends it back to waiting; its outputs are kept and recomputed on resume.
    /// The output of steps still in flight becomes stale: applied when it arrives (or dropped, with
    /// `drop_stale_output`), but it rolls nothing back and the request is not resumed before then.
    /// With `drop_preempted_output` (vLLM's `requires_kv_delivery`) the output of steps in flight is always
    /// dropped. With `defer_block_free` the blocks wait for the steps in flight (`free_request_blocks`).
    pub(crate) fn preempt(&mut self, slot: u32, drop_stale_output: bool) -> Result<ReqHandle> {
        let drop_stale_output = drop_stale_output || self.config.drop_preempted_output;
        self.free_request_blocks(slot, false)?;
        let (req, hot) = self.slab.get_mut_hot(slot)?;
        release_encoder_refs(&mut self.encoder, req);
        if self.config.encoder_decoder {
            // vLLM's EncoderDecoderCacheManager frees a preempted request's inputs (`encoder_dec.rs`).
            self.enc_dec_free_slots += i64::from(req.cross_attention_tokens);
        }
        req.num_lost_tokens = std::mem::take(&mut hot.computed[slot as usize]);
        req.spec_token_ids.clear();
        req.inflight_prefill = false;
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        req.drop_stale_output = drop_stale_output || (req.drop_stale_output && hot.stale[slot as usize] > 0);
        hot.stale[slot as usize] = hot.in_flight[slot as usize];
        req.num_output_placeholders = 0;
        let handle = req.handle;
        if req.session != NO_SESSION {
            self.sessions.on_leave_running(req.session, self.next_step_id);
        }
        let key = Self::order_key(self.config.policy, req);
        self.waiting.push_preempted(handle, key);
        self.tenants.on_requeue(req.tenant);
        self.enter_waiting(slot)?;
        self.counters.num_preemptions += 1;
        Ok(handle)
    }

    fn finish_step(
        &mut self,
        b: &mut Builder,
        mut rec: Box<StepRecord>,
        preempted: Vec<ReqHandle>,
        enc: &EncoderStep,
    ) -> Result<()> {
        b.write_everything();
        let Builder { out, is_chunk, num_spec, mixed, general, .. } = b;
        let mut enc_hashes = Vec::new();
        if !enc.work.is_empty() {
            let (enc_ids, enc_indptr, hashes) = self.encoder_output(&enc.work, &out.handles)?;
            out.scheduled_encoder_inputs = enc_ids;
            out.scheduled_encoder_inputs_indptr = enc_indptr;
            enc_hashes = hashes;
            self.counters.num_encoder_inputs_computed += enc_hashes.len() as u64;
            for &(slot, i) in &enc.work {
                let t = self.slab.get(slot)?.encoder_inputs[i as usize].num_tokens;
                self.counters.num_encoder_tokens_computed += u64::from(t);
            }
        }
        if !enc.loads.is_empty() {
            // A failed step's loads never arrived either: `fail_step` treats them as its computes.
            let (ids, indptr, hashes) = self.encoder_output(&enc.loads, &out.handles)?;
            out.scheduled_encoder_loads = ids;
            out.scheduled_encoder_loads_indptr = indptr;
            enc_hashes.extend(hashes);
        }
        if self.encoder.has_freed() {
            out.free_encoder_hashes = self.encoder.take_freed();
        }
        let swapped_out: Vec<ReqHandle> = if out.swap_out.is_empty() {
            Vec::new()
        } else {
            let slab = &self.slab;
            preempted
                .iter()
                .copied()
                .filter(|&h| slab.resolve(h).is_some_and(|r| !r.cpu_blocks.is_empty()))
                .collect()
        };
        // vLLM's `_update_after_schedule` (and `AsyncScheduler`'s): in-flight tokens (raised as the entries were
        // pushed), then placeholders for the tokens each decode will sample and its next drafts. A step of plain
        // decodes only, without async scheduling, has nothing left to do here.
        let async_scheduling = self.config.async_scheduling;
        let num_spec_tokens = self.config.num_spec_tokens() as usize;
        let stagger = u64::from(self.config.decode_stagger);
        let entries = if *general || async_scheduling || stagger > 1 { out.handles.len() } else { 0 };
        for (k, &h) in out.handles[..entries].iter().enumerate() {
            let s = h.slot as usize;
            if is_chunk[k] {
                continue;
            }
            if stagger > 1 {
                // vLLM's next_decode_eligible_step: this call's number plus the stagger.
                self.slab.get_mut(h.slot)?.decode_ready_step = self.next_step_id + stagger;
            }
            // A plain decode is not in the in-flight prefill set: without async scheduling nothing to do.
            if self.slab.hot.plain[s] {
                if !async_scheduling {
                    continue;
                }
                if num_spec_tokens == 0 {
                    // Nor does it hold drafts: only its placeholder, which makes it not plain (its token count
                    // unchanged).
                    let (req, hot) = self.slab.get_mut_hot(h.slot)?;
                    req.num_output_placeholders += 1;
                    hot.set_not_plain(s);
                    continue;
                }
            }
            let req = self.slab.get_mut(h.slot)?;
            req.inflight_prefill = false;
            if async_scheduling {
                req.num_output_placeholders += 1 + num_spec[k];
                req.spec_token_ids.clear();
                req.spec_token_ids.resize(num_spec_tokens, SPEC_PLACEHOLDER);
            }
            self.slab.sync(h.slot);
        }
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        if !out.handles.is_empty() {
            self.sched_step_seq += 1;
        }
        out.scheduler_id = self.scheduler_id;
        out.step_id = step_id;
        out.preempted = preempted;
        out.preempted_before_step = std::mem::take(&mut self.preempted_since_step);
        out.finished_req_ids = std::mem::take(&mut self.finished_since_step);
        self.counters.last_num_scheduled_reqs = out.handles.len();
        self.counters.last_num_scheduled_tokens = out.total_num_scheduled_tokens;
        self.epoch += 1;
        // The record reuses the buffers of an applied step's record (copies into kept capacity, no allocation).
        fn refill<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
            dst.clear();
            dst.extend_from_slice(src);
        }
        rec.step_id = step_id;
        rec.epoch = self.epoch;
        refill(&mut rec.handles, &out.handles);
        rec.num_finished_at_schedule = self.counters.num_finished_reqs;
        rec.is_prefill_chunk = std::mem::take(is_chunk);
        rec.num_spec_tokens = std::mem::take(num_spec);
        rec.one_token_each = !*mixed;
        out.one_token_each = !*mixed;
        refill(&mut rec.num_computed_tokens, &out.num_computed_tokens);
        refill(&mut rec.num_scheduled_tokens, &out.num_scheduled_tokens);
        refill(&mut rec.spec_token_ids, &out.spec_token_ids);
        refill(&mut rec.spec_token_ids_indptr, &out.spec_token_ids_indptr);
        // This step's cached blocks go to the record; the kv manager keeps the old record's (emptied) buffer.
        rec.cached_blocks.clear();
        rec.kv_skipped.clear();
        std::mem::swap(&mut rec.cached_blocks, &mut self.kv.newly_cached);
        rec.swapped_out = swapped_out;
        rec.encoder_hashes = enc_hashes;
        self.in_flight.push_back(rec);
        self.in_schedule = false;
        Ok(())
    }
}

/// Whether a KV load writing the `loaded` groups (`None`: every group) restores every group of `replay`.
fn restores_window(loaded: Option<Vec<usize>>, replay: &[u32]) -> bool {
    loaded.is_none_or(|l| replay.iter().all(|&g| l.contains(&(g as usize))))
}

/// vLLM's `_reserve_prefill_lookahead`: a chunk of `n` tokens from `computed` that would end fewer than
/// `lookahead` tokens (`prefill_lookahead_tokens`) before the request's `num_tokens` known tokens end is shortened
/// to leave that many (possibly to 0); a chunk that reaches the end is kept.
#[inline(always)]
fn reserve_prefill_lookahead(lookahead: u32, num_tokens: u32, computed: u32, n: u32) -> u32 {
    let remaining = i64::from(num_tokens) - i64::from(computed) - i64::from(n);
    if remaining > 0 && remaining < i64::from(lookahead) {
        (i64::from(n) - (i64::from(lookahead) - remaining)).max(0) as u32
    } else {
        n
    }
}

/// Counts a waiting request among the deferred ones (vLLM's `deferred_waiting`), once.
fn mark_deferred(req: &mut crate::request::Request, num_deferred: &mut usize) {
    if !req.deferred {
        req.deferred = true;
        *num_deferred += 1;
    }
}

/// vLLM 0.33's `_inflight_prefill_reserved_blocks` (+ `_spec_decode_step_blocks`): the blocks the requests in its
/// in-flight prefill set still need for their whole sequence (capped at `max_model_len`; with speculative
/// decoding plus one decode step's `1 + k + lookahead` slots), plus one decode step's blocks.
fn inflight_reserved_blocks(
    slab: &crate::slab::Slab,
    config: &crate::config::SchedulerConfig,
    kv: &crate::kv_cache_manager::KvCacheManager,
    window_cap: usize,
    step_id: u64,
) -> usize {
    let hybrid = kv.hybrid.as_deref();
    let bs = config.kv_block_size();
    let k = config.num_spec_tokens();
    let step = if k > 0 { 1 + k + config.num_lookahead_tokens } else { 0 };
    if let Some(hy) = hybrid {
        use crate::config::{MAMBA, RING};
        // Every group: its blocks, a window's (or chunked-local group's) capped at its admission cap; a Mamba
        // group's as its allocation counts them (mode "none": the state block of `max_model_len` tokens and the
        // speculative blocks; "align": the entries of the tokens without the decode step, at most one more,
        // summed as they are), and no decode step's blocks (vLLM's Mamba groups hold theirs).
        // (A ring's decode step counts by its rows: vLLM's ring is an attention spec of that block size.)
        let ring_rows = config.ring_block_size.unwrap_or(bs);
        let mut total: i64 = hy
            .windows
            .iter()
            .zip(&hy.block_sizes)
            .filter(|(&w, _)| w != MAMBA)
            .map(|(&w, &gbs)| step.div_ceil(if w == RING { ring_rows } else { gbs }) as i64)
            .sum();
        let spec = hy.mamba_blocks - 1;
        let mml = config.max_model_len.max(1);
        for r in slab.iter().filter(|r| r.inflight_prefill) {
            let tokens = r.num_tokens().min(config.max_model_len);
            for (g, &w) in hy.windows.iter().enumerate() {
                let required = (tokens + step).div_ceil(hy.block_sizes[g]) as usize;
                let (held, allocated) = match hy.slot(g) {
                    None => (r.blocks.len(), true),
                    Some(i) => (r.groups[i].blocks.len(), r.groups[i].mamba_allocated),
                };
                total += if w == RING {
                    // A ring's one block, held from the first allocation on.
                    i64::from(held == 0)
                } else if w == MAMBA && hy.mamba_align {
                    let entries = tokens.div_ceil(bs) as usize + spec;
                    // (With a prefill checkpoint the rest of the prefill can still export, its block too: from the
                    // tokens computed before this step, as vLLM counts while it schedules.)
                    let start = match r.chunk_step {
                        (s, before) if s == step_id => before,
                        _ => slab.computed(r.handle.slot),
                    };
                    let checkpoint = kv.align_checkpoint_of(r, g, allocated, start, tokens);
                    crate::hybrid_kv::align_need(entries, held, hy.mamba_blocks, allocated, checkpoint, false)
                } else if w == MAMBA {
                    ((tokens + step).div_ceil(mml) as usize + spec).saturating_sub(held) as i64
                } else {
                    required.min(hy.caps[g]).saturating_sub(held) as i64
                };
            }
        }
        return total.max(0) as usize;
    }
    let mut total = step.div_ceil(bs) as usize;
    for r in slab.iter().filter(|r| r.inflight_prefill) {
        let tokens = r.num_tokens().min(config.max_model_len) + step;
        // A sliding window's capped at its admission cap (`usize::MAX` without a window).
        total += (tokens.div_ceil(bs) as usize).min(window_cap).saturating_sub(r.blocks.len());
    }
    total
}

#[cfg(test)]
mod tests {
    use super::reserve_prefill_lookahead;

    #[test]
    fn a_chunk_never_ends_within_the_prefill_lookahead() {
        // 20 known tokens, 3 of lookahead: a chunk of 18 from 0 would leave 2, so it stops at 17.
        assert_eq!(reserve_prefill_lookahead(3, 20, 0, 18), 17);
        // One that leaves exactly 3, or reaches the end, or a decode past it, is kept.
        assert_eq!(reserve_prefill_lookahead(3, 20, 0, 17), 17);
        assert_eq!(reserve_prefill_lookahead(3, 20, 5, 15), 15);
        assert_eq!(reserve_prefill_lookahead(3, 20, 19, 4), 4);
        // Cut to nothing (1 token that would leave 2), never below.
        assert_eq!(reserve_prefill_lookahead(3, 20, 17, 1), 0);
        assert_eq!(reserve_prefill_lookahead(4, 20, 16, 1), 0);
        // A lookahead of 0 or 1 changes nothing.
        assert_eq!(reserve_prefill_lookahead(1, 20, 0, 19), 19);
        assert_eq!(reserve_prefill_lookahead(0, 20, 0, 19), 19);
    }
}
