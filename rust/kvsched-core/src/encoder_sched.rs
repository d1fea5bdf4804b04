//! Encoder inputs in the step loop: which inputs a step computes, how far a prefill chunk may reach, and when
//! a request's references to the encoder cache (`encoder.rs`) are taken and dropped.
//!
//! The rules follow vLLM 0.33's `_try_schedule_encoder_inputs` (learned from reading it): a step walks the
//! inputs that overlap the request's chunk `[computed, computed + n)` widened by the drafter's prefill lookahead
//! (`prefill_lookahead_tokens`, the tokens past the chunk the drafter reads); an input whose hash is cached only
//! adds a reference; any other input is computed this step if it fits the step's encoder budget and the cache
//! (evicting freeable entries, oldest first), else the chunk is cut just before it (to 0 tokens when the chunk
//! starts inside it). With `disable_chunked_mm_input` a chunk that would cover only part of an input stops
//! before it, by the lookahead too. A request drops its reference to an input once its computed tokens (less output placeholders)
//! pass the input's end, after the step's output is applied; preemption, finishing and aborting drop them all.
//!
//! Invariants (checked by `check_encoder_invariants`): the cache's references are exactly the `encoder_held`
//! flags of live requests; a request holds no reference unless it is running; the cache's accounting holds.
//!
//! One deliberate difference from vLLM: here an entry is allocated when a request's plan takes it (vLLM
//! allocates after the request's KV slots are allocated). So when a request scheduled earlier in the step is
//! preempted (PRIORITY or FAIR victims), the entries it was to compute are not left cached without anyone
//! computing them: each goes to the first request still referencing it (whose step output then lists it and
//! whose encoder budget pays for it), or, with no reference left, leaves the cache at once. vLLM leaves such an
//! entry cached, so a request sharing its hash would find no encoder output at the runner.

use crate::encoder::EncoderInput;
use crate::error::{Result, SchedError};
use crate::request::Request;
use crate::scheduler::Scheduler;

/// The step's encoder bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct EncoderStep {
    /// Encoder tokens the step may still compute.
    pub budget: u32,
    /// Inputs the step computes, of requests already scheduled in it: (slot, input index).
    pub work: Vec<(u32, u32)>,
    /// The request being planned: inputs it computes if it is scheduled.
    pub pending: Vec<(u32, u32)>,
    /// The request being planned: inputs it started referencing in its plan.
    pub newly: Vec<u32>,
    /// Inputs the EC connector loads this step (allocated, not computed, not charged), of requests already
    /// scheduled in it: (slot, input index).
    pub loads: Vec<(u32, u32)>,
    /// The request being planned: inputs the EC connector loads if it is scheduled.
    pub pending_loads: Vec<(u32, u32)>,
}

fn internal(msg: String) -> SchedError {
    SchedError::Internal(msg)
}

impl Scheduler {
    /// Checks a request's encoder inputs against its prompt, the config, and the sizes other live requests and
    /// the cache give the same hashes.
    pub(crate) fn check_encoder_inputs(
        &self,
        req_id: &str,
        prompt_len: usize,
        inputs: &[EncoderInput],
    ) -> std::result::Result<(), String> {
        if inputs.is_empty() {
            return Ok(());
        }
        let cfg = &self.config;
        let limit = cfg.max_num_encoder_input_tokens.min(cfg.encoder_cache_size);
        if limit == 0 {
            return Err(format!(
                "request {req_id:?} has encoder inputs, but max_num_encoder_input_tokens={} and \
                 encoder_cache_size={} (both must be > 0 for encoder inputs)",
                cfg.max_num_encoder_input_tokens, cfg.encoder_cache_size
            ));
        }
        let mut prev_end = 0u64;
        for (i, e) in inputs.iter().enumerate() {
            let end = u64::from(e.start) + u64::from(e.num_tokens);
            if e.num_tokens == 0 {
                return Err(format!(
                    "request {req_id:?}: encoder input {i} has no tokens (num_tokens must be >= 1)"
                ));
            }
            if end > prompt_len as u64 {
                return Err(format!(
                    "request {req_id:?}: encoder input {i} covers prompt positions {}..{end}, beyond the prompt of \
                     {prompt_len} tokens",
                    e.start
                ));
            }
            if i > 0 && u64::from(e.start) < prev_end {
                return Err(format!(
                    "request {req_id:?}: encoder input {i} starts at {} before the end of input {} ({prev_end}): \
                     inputs must be sorted by start and must not overlap",
                    e.start,
                    i - 1
                ));
            }
            prev_end = end;
            if e.num_tokens > limit {
                return Err(format!(
                    "request {req_id:?}: encoder input {i} has {} tokens, more than a step can compute or the \
                     encoder cache can hold (max_num_encoder_input_tokens={}, encoder_cache_size={})",
                    e.num_tokens, cfg.max_num_encoder_input_tokens, cfg.encoder_cache_size
                ));
            }
            if cfg.disable_chunked_mm_input {
                let threshold = cfg.long_prefill_token_threshold;
                let chunk = if threshold > 0 {
                    threshold.min(cfg.max_chunk_tokens())
                } else {
                    cfg.max_chunk_tokens()
                };
                // A chunk stopped before `e` ends the drafter's prefill lookahead before it (or at the prompt's
                // start): the next chunk must cover those tokens and `e`.
                let lead = e.start.min(cfg.prefill_lookahead_tokens);
                if u64::from(e.num_tokens) + u64::from(lead) > u64::from(chunk) {
                    let before =
                        if lead > 0 { format!(" and the {lead} tokens before it") } else { String::new() };
                    return Err(format!(
                        "request {req_id:?}: encoder input {i} has {} tokens; with disable_chunked_mm_input a \
                         chunk must cover it whole{before}, but chunks stop at {chunk} tokens \
                         (max_num_batched_tokens, max_num_scheduled_tokens, draft_slots, \
                         long_prefill_token_threshold, prefill_lookahead_tokens)",
                        e.num_tokens
                    ));
                }
            }
            let known = inputs[..i]
                .iter()
                .find(|o| o.hash == e.hash)
                .map(|o| u64::from(o.num_tokens))
                .or_else(|| self.encoder_sizes.get(&e.hash).map(|&(s, _)| u64::from(s)))
                .or_else(|| self.encoder.size_of(e.hash));
            if let Some(size) = known {
                if size != u64::from(e.num_tokens) {
                    return Err(format!(
                        "request {req_id:?}: encoder input {i} has hash {} with {} tokens, but that hash is known \
                         with {size} tokens (equal hashes must mean equal content)",
                        e.hash, e.num_tokens
                    ));
                }
            }
        }
        Ok(())
    }

    /// Re-sizes the encoder compute budget and the encoder cache (vLLM's `max_num_encoder_input_tokens` and a
    /// new `EncoderCacheManager`, which tools and tests may set on vLLM's scheduler between steps). The budget
    /// applies from the next step. The cache can change size only while it holds no entry (a new manager starts
    /// empty; the core's entries belong to requests and to the workers' tensors). Neither may drop below a live
    /// request's largest encoder input, which could then never be scheduled. On error nothing changes.
    pub fn set_encoder_sizes(
        &mut self,
        max_num_encoder_input_tokens: u32,
        encoder_cache_size: u32,
    ) -> Result<()> {
        let bad = |msg: String| Err(SchedError::InvalidConfig(msg));
        for (name, v) in [
            ("max_num_encoder_input_tokens", max_num_encoder_input_tokens),
            ("encoder_cache_size", encoder_cache_size),
        ] {
            if v > i32::MAX as u32 {
                return bad(format!("{name} must be in [0, {}], got {v}", i32::MAX));
            }
        }
        if u64::from(encoder_cache_size) != self.encoder.capacity() && self.encoder.num_entries() > 0 {
            return bad(format!(
                "encoder_cache_size can change ({} -> {encoder_cache_size}) only while the encoder cache is empty; it \
                 holds {} entries",
                self.encoder.capacity(),
                self.encoder.num_entries()
            ));
        }
        let limit = max_num_encoder_input_tokens.min(encoder_cache_size);
        if let Some((&hash, &(size, _))) =
            self.encoder_sizes.iter().filter(|(_, &(s, _))| s > limit).max_by_key(|(_, &(s, _))| s)
        {
            return bad(format!(
                "a live request has an encoder input (hash {hash}) of {size} tokens, more than a step could compute \
                 or the cache hold with max_num_encoder_input_tokens={max_num_encoder_input_tokens} and \
                 encoder_cache_size={encoder_cache_size}"
            ));
        }
        self.check_encoder_decoder_budget(max_num_encoder_input_tokens).map_err(SchedError::InvalidConfig)?;
        if u64::from(encoder_cache_size) != self.encoder.capacity()
            && !self.encoder.resize_empty(u64::from(encoder_cache_size))
        {
            return Err(internal("the encoder cache could not be re-sized though it holds no entry".into()));
        }
        self.config.max_num_encoder_input_tokens = max_num_encoder_input_tokens;
        self.config.encoder_cache_size = encoder_cache_size;
        self.epoch += 1;
        Ok(())
    }

    /// Sets the drafter's prefill lookahead (`prefill_lookahead_tokens`) of the chunk rules and the encoder window
    /// from the next step (vLLM's tests set `num_prefill_lookahead` on a built scheduler), only while the
    /// scheduler holds no request. The prefix cache's not-final tail stays the one the scheduler was built with
    /// (vLLM's KV cache manager keeps its own). On error nothing changes.
    pub fn set_prefill_lookahead(&mut self, prefill_lookahead_tokens: u32) -> Result<()> {
        if prefill_lookahead_tokens > 1024 {
            return Err(SchedError::InvalidConfig(format!(
                "prefill_lookahead_tokens must be in [0, 1024], got {prefill_lookahead_tokens}"
            )));
        }
        if !self.slab.is_empty() {
            return Err(SchedError::InvalidConfig(format!(
                "prefill_lookahead_tokens can change only while no request is live ({} are)",
                self.slab.len()
            )));
        }
        let mut config = self.config.clone();
        config.prefill_lookahead_tokens = prefill_lookahead_tokens;
        config.validate()?;
        self.config = config;
        self.epoch += 1;
        Ok(())
    }

    /// Sets (or with `None` removes) the EC connector. It applies from the next step.
    pub fn set_ec_connector(
        &mut self,
        connector: Option<Box<dyn crate::ec_connector::EcConnector>>,
    ) -> Result<()> {
        self.ec_connector = connector.map(crate::ec_connector::EcConn);
        self.epoch += 1;
        Ok(())
    }

    /// Whether an EC connector is set.
    pub fn has_ec_connector(&self) -> bool {
        self.ec_connector.is_some()
    }

    /// The EC connector's deferral gate for the request in `slot`; `true` without a connector or encoder inputs.
    pub(crate) fn ec_cache_available(&mut self, slot: u32, num_computed_tokens: u32) -> Result<bool> {
        let Some(conn) = self.ec_connector.as_mut() else { return Ok(true) };
        let req = self.slab.get(slot)?;
        if req.encoder_inputs.is_empty() {
            return Ok(true);
        }
        Ok(conn.0.ensure_cache_available(req, num_computed_tokens))
    }

    /// Records a new live request's input hashes (for the size check of later requests).
    #[cold]
    #[inline(never)]
    pub(crate) fn register_encoder_inputs(&mut self, inputs: &[EncoderInput]) {
        for e in inputs {
            self.encoder_sizes.entry(e.hash).or_insert((e.num_tokens, 0)).1 += 1;
        }
    }

    /// A finished request: drops its references and its hashes' live counts.
    #[cold]
    #[inline(never)]
    pub(crate) fn forget_encoder_inputs(&mut self, slot: u32) -> Result<()> {
        let req = self.slab.get_mut(slot)?;
        if req.encoder_inputs.is_empty() {
            return Ok(());
        }
        release_all(&mut self.encoder, req);
        for e in req.encoder_inputs.iter() {
            if let Some(v) = self.encoder_sizes.get_mut(&e.hash) {
                v.1 -= 1;
                if v.1 == 0 {
                    self.encoder_sizes.remove(&e.hash);
                }
            }
        }
        Ok(())
    }

    /// Plans the encoder inputs of `slot`'s chunk of `n` tokens from `computed` (its window widened by the
    /// drafter's `prefill_lookahead_tokens`): takes references to cached inputs, allocates (and charges the
    /// budget for) the inputs to compute, and returns the chunk length, cut before the first input that does
    /// not fit. The plan lives in `st.pending`/`st.newly` until
    /// `commit_encoder` or `rollback_encoder`.
    #[cold]
    #[inline(never)]
    pub(crate) fn plan_encoder(
        &mut self,
        st: &mut EncoderStep,
        slot: u32,
        computed: u32,
        n: u32,
    ) -> Result<u32> {
        let req = self.slab.get_mut(slot)?;
        if n == 0 || req.encoder_inputs.is_empty() {
            return Ok(n);
        }
        let mut n = n;
        let chunk_end = computed + n;
        // The drafter's prefill lookahead reads that many tokens past the chunk: the window reaches them.
        let shift = self.config.prefill_lookahead_tokens;
        let end = chunk_end + shift;
        let first = req.encoder_inputs.partition_point(|e| e.end() <= computed);
        let key = u64::from(slot);
        for i in first..req.encoder_inputs.len() {
            let e = req.encoder_inputs[i];
            if e.start >= end {
                break;
            }
            if self.config.disable_chunked_mm_input && computed <= e.start && chunk_end < e.end() {
                // The chunk stops before `e` with the drafter's read-ahead too.
                n = e.start.saturating_sub(computed + shift);
                break;
            }
            if self.encoder.check_and_reference(e.hash, key, i as u32) {
                if !req.encoder_held[i] {
                    req.encoder_held[i] = true;
                    req.num_encoder_held += 1;
                    st.newly.push(i as u32);
                }
                continue;
            }
            let size = u64::from(e.num_tokens);
            if !self.encoder.can_allocate(size, u64::from(st.budget), 0) {
                n = if self.config.exact_encoder_cut_and_release {
                    // The drafter's read-ahead into an input not encoded yet falls back to token embeddings.
                    if computed < e.start {
                        n.min(e.start - computed)
                    } else {
                        0
                    }
                } else {
                    // vLLM 0.32: the read-ahead stops before the input too.
                    e.start.saturating_sub(computed + shift)
                };
                break;
            }
            // The EC connector is asked only once the input fits (vLLM 0.33): a load takes cache space but no
            // encoder budget.
            let load = match self.ec_connector.as_mut() {
                Some(conn) => conn.0.has_cache_item(e.hash),
                None => false,
            };
            if !self.encoder.allocate(e.hash, size, key, i as u32) {
                return Err(internal(format!(
                    "encoder input {i} of {:?} fit but could not be allocated",
                    req.id
                )));
            }
            if !req.encoder_held[i] {
                req.encoder_held[i] = true;
                req.num_encoder_held += 1;
            }
            st.newly.push(i as u32);
            if load {
                st.pending_loads.push((slot, i as u32));
            } else {
                st.budget -= e.num_tokens;
                st.pending.push((slot, i as u32));
            }
        }
        Ok(n)
    }

    /// The planned request is scheduled: its computes join the step's.
    #[cold]
    #[inline(never)]
    pub(crate) fn commit_encoder(counters: &mut crate::scheduler::Counters, st: &mut EncoderStep) {
        let hits = st.newly.len().saturating_sub(st.pending.len() + st.pending_loads.len());
        counters.encoder_cache_hits += hits as u64;
        st.work.append(&mut st.pending);
        st.loads.append(&mut st.pending_loads);
        st.newly.clear();
    }

    /// The planned request `slot` is not scheduled: the references its plan took are dropped, the inputs it was
    /// to compute are refunded and leave the cache (nobody else can reference them).
    #[cold]
    #[inline(never)]
    pub(crate) fn rollback_encoder(&mut self, st: &mut EncoderStep, slot: u32) -> Result<()> {
        if st.newly.is_empty() {
            return Ok(());
        }
        let req = self.slab.get_mut(slot)?;
        let key = u64::from(slot);
        for &i in &st.newly {
            let i = i as usize;
            if req.encoder_held[i] {
                req.encoder_held[i] = false;
                req.num_encoder_held -= 1;
                self.encoder.release(req.encoder_inputs[i].hash, key, i as u32);
            }
        }
        st.newly.clear();
        let pending = std::mem::take(&mut st.pending);
        let loads = std::mem::take(&mut st.pending_loads);
        self.settle_uncomputed(st, pending, slot, slot, false)?;
        self.settle_uncomputed(st, loads, slot, slot, true)
    }

    /// Victim `victim` is preempted in the step (`current` is the request whose allocation preempts it, still
    /// being planned): all its references go, its encoder budget of this step is refunded, and what it was to
    /// compute this step is handed to another referencing request or leaves the cache.
    #[cold]
    #[inline(never)]
    pub(crate) fn abandon_encoder(&mut self, st: &mut EncoderStep, victim: u32, current: u32) -> Result<()> {
        let (removed, removed_loads) = if victim == current {
            st.newly.clear();
            (std::mem::take(&mut st.pending), std::mem::take(&mut st.pending_loads))
        } else {
            (take_of(&mut st.work, victim), take_of(&mut st.loads, victim))
        };
        let req = self.slab.get_mut(victim)?;
        if req.num_encoder_held > 0 {
            release_all(&mut self.encoder, req);
        }
        self.settle_uncomputed(st, removed, victim, current, false)?;
        self.settle_uncomputed(st, removed_loads, victim, current, true)
    }

    /// Inputs (of `owner`) that were to be computed (or, with `load`, loaded by the EC connector) this step but
    /// no longer are: a compute's budget is refunded; an entry still referenced is computed (loaded) by its
    /// first referrer instead (a compute charged again), an unreferenced one leaves the cache.
    #[cold]
    #[inline(never)]
    fn settle_uncomputed(
        &mut self,
        st: &mut EncoderStep,
        items: Vec<(u32, u32)>,
        owner: u32,
        current: u32,
        load: bool,
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let req = self.slab.get(owner)?;
        let inputs: Vec<EncoderInput> = items.iter().map(|&(_, i)| req.encoder_inputs[i as usize]).collect();
        if !load {
            for e in &inputs {
                st.budget += e.num_tokens;
            }
        }
        for e in inputs {
            match self.encoder.first_referrer(e.hash) {
                Some((r, ri)) => {
                    let r = r as u32;
                    if !load {
                        st.budget = st.budget.checked_sub(e.num_tokens).ok_or_else(|| {
                            internal("encoder budget overdrawn while handing over an input".into())
                        })?;
                    }
                    let current_plan = r == current && owner != current;
                    match (load, current_plan) {
                        (false, true) => st.pending.push((r, ri)),
                        (false, false) => st.work.push((r, ri)),
                        (true, true) => st.pending_loads.push((r, ri)),
                        (true, false) => st.loads.push((r, ri)),
                    }
                }
                None => {
                    self.encoder.remove_unreferenced(e.hash, false);
                }
            }
        }
        Ok(())
    }

    /// The tokens past an input's end its release waits for: 0, or the drafter's prefill lookahead without
    /// `exact_encoder_cut_and_release` (vLLM 0.32).
    #[inline]
    pub(crate) fn encoder_release_delay(config: &crate::config::SchedulerConfig) -> u32 {
        if config.exact_encoder_cut_and_release {
            0
        } else {
            config.prefill_lookahead_tokens
        }
    }

    /// After a step's output is applied to `req`: drops its references to inputs it has consumed (vLLM's
    /// `_free_encoder_inputs`: the input ends at or before its computed tokens less output placeholders, less
    /// `delay`).
    #[cold]
    #[inline(never)]
    pub(crate) fn release_consumed(
        encoder: &mut crate::encoder::EncoderCache,
        req: &mut Request,
        computed: u32,
        delay: u32,
    ) {
        let upto = computed.saturating_sub(req.num_output_placeholders);
        let key = u64::from(req.handle.slot);
        for i in 0..req.encoder_inputs.len() {
            let e = req.encoder_inputs[i];
            if e.end() + delay > upto {
                break;
            }
            if req.encoder_held[i] {
                req.encoder_held[i] = false;
                req.num_encoder_held -= 1;
                encoder.release(e.hash, key, i as u32);
            }
        }
    }

    /// The CSR of the step's computed inputs aligned with `handles` (inputs ascending per request), and their
    /// hashes in that order. All empty when the step computes no input (the common case costs nothing; the
    /// binding shows an indptr of zeros).
    #[cold]
    #[inline(never)]
    pub(crate) fn encoder_output(
        &self,
        items: &[(u32, u32)],
        handles: &[crate::request::ReqHandle],
    ) -> Result<(Vec<i32>, Vec<i32>, Vec<u64>)> {
        if items.is_empty() {
            return Ok((Vec::new(), Vec::new(), Vec::new()));
        }
        let mut indptr = Vec::with_capacity(handles.len() + 1);
        indptr.push(0i32);
        let mut work = items.to_vec();
        work.sort_unstable();
        let mut ids = Vec::with_capacity(work.len());
        let mut hashes = Vec::with_capacity(work.len());
        for h in handles {
            let a = work.partition_point(|w| w.0 < h.slot);
            let b = work.partition_point(|w| w.0 <= h.slot);
            if a < b {
                let req = self.slab.get(h.slot)?;
                for &(_, i) in &work[a..b] {
                    ids.push(i as i32);
                    hashes.push(req.encoder_inputs[i as usize].hash);
                }
            }
            indptr.push(ids.len() as i32);
        }
        if ids.len() != work.len() {
            return Err(internal("an encoder input is computed by a request not in the step".into()));
        }
        Ok((ids, indptr, hashes))
    }

    /// The encoder cache's references agree with the requests' `encoder_held` flags, and only running requests
    /// hold any.
    pub(crate) fn check_encoder_invariants(&self) -> std::result::Result<(), String> {
        self.encoder.check_invariants()?;
        let mut n = 0usize;
        for r in self.slab.iter() {
            let held = r.encoder_held.iter().filter(|&&h| h).count();
            if held != r.num_encoder_held as usize {
                return Err(format!(
                    "request {:?}: {held} encoder inputs held, counted {}",
                    r.id, r.num_encoder_held
                ));
            }
            if held > 0 && r.status != crate::request::RequestStatus::Running {
                return Err(format!(
                    "request {:?} holds encoder-cache references but is {:?}",
                    r.id, r.status
                ));
            }
            n += held;
        }
        let mut refs = 0usize;
        for (hash, req, input) in self.encoder.references() {
            refs += 1;
            let ok = self.slab.get(req as u32).ok().is_some_and(|r| {
                r.encoder_held.get(input as usize) == Some(&true)
                    && r.encoder_inputs.get(input as usize).is_some_and(|e| e.hash == hash)
            });
            if !ok {
                return Err(format!(
                    "encoder entry {hash} is referenced by slot {req} input {input}, which does not hold it"
                ));
            }
        }
        if refs != n {
            return Err(format!("{refs} encoder-cache references, {n} held by requests"));
        }
        Ok(())
    }
}

/// Tells the EC connector of the encoder inputs the planned request `req` computes, then of those it loads
/// (vLLM's `_allocate_encoder_inputs`), once it is scheduled.
pub(crate) fn notify_ec_alloc(conn: &mut crate::ec_connector::EcConn, req: &Request, st: &EncoderStep) {
    for &(_, i) in st.pending.iter().chain(st.pending_loads.iter()) {
        conn.0.update_state_after_alloc(req, i);
    }
}

/// Removes and returns the items of `slot` from a step's list.
fn take_of(items: &mut Vec<(u32, u32)>, slot: u32) -> Vec<(u32, u32)> {
    let mut removed = Vec::new();
    items.retain(|&w| {
        if w.0 == slot {
            removed.push(w);
            false
        } else {
            true
        }
    });
    removed
}

/// Drops every reference `req` holds, in input order.
fn release_all(encoder: &mut crate::encoder::EncoderCache, req: &mut Request) {
    let key = u64::from(req.handle.slot);
    for i in 0..req.encoder_inputs.len() {
        if req.encoder_held[i] {
            req.encoder_held[i] = false;
            encoder.release(req.encoder_inputs[i].hash, key, i as u32);
        }
    }
    req.num_encoder_held = 0;
}

/// `release_all` for callers outside this module (preemption).
#[cold]
#[inline(never)]
pub(crate) fn release_encoder_refs(encoder: &mut crate::encoder::EncoderCache, req: &mut Request) {
    if req.num_encoder_held > 0 {
        release_all(encoder, req);
    }
}
