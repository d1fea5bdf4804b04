//! `update_from_output()`: applies the tokens sampled for one scheduled step.
//!
//! Steps are applied in the order they were scheduled, each once (the next may already be scheduled: async
//! scheduling). Everything is validated before anything changes. Per entry: requests that finished since the
//! step was scheduled are skipped; an entry with no token (a partial prefill, or a decode the runner returned
//! nothing for) changes nothing else; otherwise rejected drafts are rolled back (extra tokens beyond
//! `1 + drafts` move the computed count forward), tokens are appended one at a time with a stop check after each (the rest is discarded after a stop), new
//! full blocks are hashed, appended tokens are counted per tenant (charged once per tenant at the end, see
//! `fair.rs`), and stopped requests are freed and reported.

use crate::error::{Result, SchedError};
use crate::output::UpdateResult;
use crate::request::{ReqHandle, Request, RequestStatus, SPEC_PLACEHOLDER};
use crate::scheduler::{Scheduler, MAX_TOKEN_ID};

/// A ragged batch of token lists in CSR form.
#[derive(Clone, Copy, Debug)]
pub struct Ragged<'a> {
    pub values: &'a [i64],
    pub indptr: &'a [i64],
}

impl<'a> Ragged<'a> {
    fn check(&self, what: &str, n: usize) -> Result<()> {
        let bad = |m: String| Err(SchedError::InvalidOutput(format!("{what}: {m}")));
        if self.indptr.len() != n + 1 {
            return bad(format!(
                "expected {} offsets (one entry per scheduled request + 1), got {}",
                n + 1,
                self.indptr.len()
            ));
        }
        if self.indptr[0] != 0 {
            return bad(format!("offsets must start at 0, got {}", self.indptr[0]));
        }
        if self.indptr.windows(2).any(|w| w[1] < w[0]) {
            return bad("offsets must be non-decreasing".into());
        }
        if self.indptr[n] != self.values.len() as i64 {
            return bad(format!(
                "last offset {} does not match the {} values",
                self.indptr[n],
                self.values.len()
            ));
        }
        Ok(())
    }

    /// Whether the batch is exactly one token id for each of `n` entries (offsets `0, 1, ..., n`): the shape of
    /// a step of plain decodes. True implies that `check` passes and every entry holds a token id. Branch-free
    /// folds, so the compiler vectorizes both passes: every value lies in `0..=MAX_TOKEN_ID` exactly when their
    /// bitwise or does, as `MAX_TOKEN_ID + 1` is a power of two (a negative value sets the top bit).
    fn is_one_token_each(&self, n: usize) -> bool {
        const { assert!((MAX_TOKEN_ID as u64 + 1).is_power_of_two()) };
        self.values.len() == n
            && self.indptr.len() == n + 1
            && self.indptr.iter().zip(0i64..).fold(0, |acc, (&x, i)| acc | (x ^ i)) == 0
            && self.values.iter().fold(0u64, |acc, &t| acc | t as u64) <= MAX_TOKEN_ID as u64
    }

    /// Entry `i`, checked to hold token ids only (entries of requests gone since the step are never checked).
    fn checked(&self, what: &str, i: usize) -> Result<&'a [i64]> {
        let entry = self.get(i);
        match entry.iter().find(|&&t| !(0..=MAX_TOKEN_ID).contains(&t)) {
            Some(t) => Err(SchedError::InvalidOutput(format!(
                "{what}: token ids must be in [0, {MAX_TOKEN_ID}], got {t}"
            ))),
            None => Ok(entry),
        }
    }

    #[inline(always)]
    fn get(&self, i: usize) -> &'a [i64] {
        &self.values[self.indptr[i] as usize..self.indptr[i + 1] as usize]
    }
}

impl Scheduler {
    #[inline(never)]
    pub fn update_from_output(
        &mut self,
        scheduler_id: u64,
        step_id: u64,
        sampled: Ragged<'_>,
        drafts: Option<Ragged<'_>>,
    ) -> Result<UpdateResult> {
        if scheduler_id != self.scheduler_id {
            return Err(SchedError::InvalidOutput("this output was produced by another scheduler".into()));
        }
        let Some(rec) = self.in_flight.front() else {
            return Err(SchedError::InvalidOutput(format!(
                "step {step_id} was already applied (no step is awaiting its output)"
            )));
        };
        if step_id != rec.step_id {
            let msg = if step_id < rec.step_id {
                format!("step {step_id} was already applied")
            } else {
                format!("outputs must be applied in order: step {} comes before step {step_id}", rec.step_id)
            };
            return Err(SchedError::InvalidOutput(msg));
        }
        let n = rec.handles.len();
        // Fast path: a step of plain decodes (no prefill chunk, no drafts), no request finished since it was
        // scheduled (every entry belongs to a live request), and exactly one token id for each: nothing else to
        // check. Anything else takes the checks below, in the order their errors are reported.
        let all_live = rec.num_finished_at_schedule == self.counters.num_finished_reqs;
        let one_each = rec.one_token_each
            && all_live
            && rec.kv_skipped.is_empty()
            && drafts.is_none()
            && sampled.is_one_token_each(n);
        if !one_each {
            sampled.check("sampled_token_ids", n)?;
            if let Some(d) = &drafts {
                if self.config.async_scheduling {
                    return Err(SchedError::InvalidOutput(
                        "with async_scheduling the drafts stay with the runner (the scheduler schedules placeholders \
                         for them): pass draft_token_ids=None"
                            .into(),
                    ));
                }
                d.check("draft_token_ids", n)?;
            }
            let max_drafts = self.config.num_spec_tokens() as usize;
            // Any number of sampled tokens is taken for any entry, as vLLM's scheduler takes what the runner
            // returns: none (a partial prefill; a decode: nothing appended, its drafts stay counted as
            // computed), or more than `1 + drafts` (the extra ones are appended and counted as computed). Only
            // the token ids are checked. If no request finished since this step was scheduled, every entry
            // belongs to a live request and the checks need not touch the requests.
            let fast_ok = all_live
                && drafts.is_none()
                && sampled.values.iter().fold(0u64, |acc, &t| acc | t as u64) <= MAX_TOKEN_ID as u64
                && sampled
                    .indptr
                    .windows(2)
                    .zip(&rec.num_spec_tokens)
                    .all(|(w, &num_spec)| num_spec == 0 || w[1] - w[0] <= 1 + i64::from(num_spec));
            let bs = self.config.kv_block_size();
            for i in 0..if fast_ok { 0 } else { n } {
                let Some(req) = self.slab.resolve(rec.handles[i]) else {
                    continue;
                };
                let got = sampled.checked("sampled_token_ids", i)?.len() as u64;
                let num_spec = u64::from(rec.num_spec_tokens[i]);
                let s = rec.handles[i].slot as usize;
                if num_spec > 0
                    && got > 1 + num_spec
                    && self.slab.hot.stale[s] == 0
                    && self.slab.hot.computed[s] > 0
                {
                    // Tokens beyond the step's drafts count as computed: never past the KV slots it holds.
                    let computed = u64::from(self.slab.hot.computed[s]) + got - 1 - num_spec;
                    let slots = req.blocks.len() as u64 * u64::from(bs);
                    if computed > slots {
                        return Err(SchedError::InvalidOutput(format!(
                            "request {:?} got {got} sampled tokens in step {step_id} for {num_spec} drafts: its \
                             computed tokens would pass the {slots} KV slots it holds",
                            req.id
                        )));
                    }
                }
                if let Some(d) = &drafts {
                    let k = d.checked("draft_token_ids", i)?.len();
                    let allowed = if rec.is_prefill_chunk[i] { 0 } else { max_drafts };
                    if k > allowed {
                        return Err(SchedError::InvalidOutput(format!(
                            "request {:?} may receive at most {allowed} draft tokens in step {step_id}, got {k}",
                            req.id
                        )));
                    }
                }
            }
        }

        // Validated: apply.
        let Some(rec) = self.in_flight.pop_front() else {
            return Err(SchedError::Internal("in-flight step vanished".into()));
        };
        self.epoch += 1;
        // Every write of this step (and of the steps before it) is done: deferred frees fenced by it go back.
        self.on_step_applied(n);
        let max_model_len = self.config.max_model_len;
        let spec_decoding = self.config.num_spec_tokens() > 0;
        let mut res = UpdateResult { num_new_tokens: vec![0; n], ..Default::default() };
        let mut any_waiting_finished = false;
        // Spec decoding caches blocks in every update and drafts change the drafts: the general path for all.
        let plain_excluded = spec_decoding || drafts.is_some();
        // Stopped requests that were running leave `running` by the slots `finish` records; only a waiting one
        // needs the waiting queues searched.
        let mut tally = |done: Option<bool>| any_waiting_finished |= done == Some(false);
        if one_each && !plain_excluded {
            // A step of plain decodes with one token each: entry `i`'s token is `values[i]`, and no entry is a
            // prefill chunk or carries drafts (the checks above), so those columns need not be read.
            // Runs of the common case go through `plain_decode_updates`; it stops at the first entry with more
            // to do (a block to hash, a stop, anything not a live plain decode), which takes `apply_entry`.
            let (handles, num_scheduled, values) = (&rec.handles, &rec.num_scheduled_tokens, sampled.values);
            // With async scheduling a decode holds output placeholders: runs of those go through
            // `placeholder_decode_updates` (the same contract).
            let async_scheduling = self.config.async_scheduling;
            let runs = !general_only();
            let mut i = 0;
            while i < n {
                // Tests (`!runs`): every entry takes `apply_entry` (what the runs must match).
                if runs {
                    i = self.plain_decode_updates(
                        handles,
                        num_scheduled,
                        values,
                        &mut res.num_new_tokens,
                        i,
                        max_model_len,
                    );
                    if async_scheduling && i < n {
                        let next = self.placeholder_decode_updates(
                            handles,
                            num_scheduled,
                            values,
                            &mut res.num_new_tokens,
                            i,
                            max_model_len,
                        );
                        if next > i {
                            i = next;
                            continue;
                        }
                    }
                    if i == n {
                        break;
                    }
                }
                let e = Entry {
                    i,
                    handle: handles[i],
                    num_scheduled: num_scheduled[i] as u32,
                    is_chunk: false,
                    num_spec: 0,
                };
                tally(self.apply_entry(&mut res, e, &values[i..i + 1], None, false, max_model_len)?);
                i += 1;
            }
        } else {
            // The entries' columns side by side (no per-entry bounds checks; `check` guaranteed n + 1 offsets).
            let entries = (rec.handles.iter())
                .zip(&rec.num_scheduled_tokens)
                .zip(&rec.is_prefill_chunk)
                .zip(&rec.num_spec_tokens)
                .zip(sampled.indptr.windows(2))
                .enumerate();
            for (i, ((((&handle, &num_scheduled), &is_chunk), &num_spec), w)) in entries {
                if rec.kv_skipped.contains(&handle) {
                    self.skip_entry(handle, num_scheduled as u32);
                    continue;
                }
                let e = Entry { i, handle, num_scheduled: num_scheduled as u32, is_chunk, num_spec };
                let tokens = &sampled.values[w[0] as usize..w[1] as usize];
                tally(self.apply_entry(&mut res, e, tokens, drafts, plain_excluded, max_model_len)?);
            }
        }
        // The next step's record reuses this one's buffers.
        self.spare_record = Some(rec);
        self.tenants.flush_decode();
        self.remove_finished_from_queues(any_waiting_finished);
        if !self.continuing.is_empty() {
            self.queue_continuing()?;
        }
        Ok(res)
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: when set, a step of one-token decodes applies every entry through `apply_entry`, without the runs
    /// of `plain_decode_updates` and `placeholder_decode_updates`.
    pub(crate) static GENERAL_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Tests: the entries `placeholder_decode_updates` applied.
    pub(crate) static PLACEHOLDER_RUN_ENTRIES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
fn general_only() -> bool {
    GENERAL_ONLY.with(std::cell::Cell::get)
}

#[cfg(not(test))]
#[inline(always)]
fn general_only() -> bool {
    false
}

/// What `apply_decode` did with an entry.
enum Applied {
    /// Its request is gone (finished since the step was scheduled): nothing to apply.
    Gone,
    /// A plain decode: its token was appended; `true` if the request stopped (it was running).
    Decode(bool),
    /// Not a plain decode with one token: the entry takes `apply_general` (its in-flight count is released).
    General,
}

/// One entry of the step being applied, as its record has it.
#[derive(Clone, Copy)]
struct Entry {
    i: usize,
    handle: ReqHandle,
    num_scheduled: u32,
    is_chunk: bool,
    num_spec: u32,
}

impl Scheduler {
    /// Applies entry `e` with its sampled `tokens`: a plain decode (`apply_decode`) when it can be one, else the
    /// general path. Returns what `apply_general` returns: whether a stopped request was running (`Some(true)`)
    /// or waiting (`Some(false)`).
    #[inline(always)]
    fn apply_entry(
        &mut self,
        res: &mut UpdateResult,
        e: Entry,
        tokens: &[i64],
        drafts: Option<Ragged<'_>>,
        plain_excluded: bool,
        max_model_len: u32,
    ) -> Result<Option<bool>> {
        let applied = if !plain_excluded && !e.is_chunk && e.num_spec == 0 {
            self.apply_decode(res, e.i, e.handle, e.num_scheduled, tokens, max_model_len)?
        } else {
            self.release_in_flight(e.handle, e.num_scheduled)
        };
        match applied {
            Applied::Decode(stopped) => Ok(stopped.then_some(true)),
            Applied::Gone => Ok(None),
            Applied::General => self.apply_general(
                res,
                e.i,
                e.handle,
                e.num_scheduled,
                e.is_chunk,
                e.num_spec,
                tokens,
                drafts,
            ),
        }
    }

    /// An entry whose request invalid blocks rolled back (`update_kv_transfers`): its in-flight (and stale)
    /// tokens are released, its output is dropped (vLLM skips such a request in `update_from_output`).
    fn skip_entry(&mut self, handle: ReqHandle, num_scheduled: u32) {
        if let Some((_, hot)) = self.slab.resolve_mut_hot(handle) {
            let s = handle.slot as usize;
            hot.in_flight[s] = hot.in_flight[s].saturating_sub(num_scheduled);
            hot.stale[s] = hot.stale[s].saturating_sub(num_scheduled);
        }
    }

    /// Releases entry `handle`'s `num_scheduled` in-flight tokens; `General` unless its request is gone.
    #[inline(always)]
    fn release_in_flight(&mut self, handle: ReqHandle, num_scheduled: u32) -> Applied {
        let Some((_, hot)) = self.slab.resolve_mut_hot(handle) else {
            return Applied::Gone;
        };
        let s = handle.slot as usize;
        hot.in_flight[s] = hot.in_flight[s].saturating_sub(num_scheduled);
        Applied::General
    }

    /// Entry `i` of an update when it is neither a prefill chunk nor carries drafts (and no drafts came back):
    /// releases its in-flight tokens, then, for a running plain decode (no placeholders, encoder inputs or
    /// stale output) that sampled one token, appends it, hashes a block it completes and checks the stop
    /// conditions. Nothing else of the general path applies to such a request (it would do exactly this).
    #[inline(always)]
    fn apply_decode(
        &mut self,
        res: &mut UpdateResult,
        i: usize,
        handle: ReqHandle,
        num_scheduled: u32,
        tokens: &[i64],
        max_model_len: u32,
    ) -> Result<Applied> {
        let Some((req, hot)) = self.slab.resolve_mut_hot(handle) else {
            return Ok(Applied::Gone);
        };
        let s = handle.slot as usize;
        hot.in_flight[s] = hot.in_flight[s].saturating_sub(num_scheduled);
        let &[t] = tokens else {
            return Ok(Applied::General);
        };
        if !hot.plain[s] || hot.stale[s] != 0 || req.status != RequestStatus::Running {
            return Ok(Applied::General);
        }
        let t = t as u32;
        req.token_ids.push(t);
        res.num_new_tokens[i] = 1;
        self.tenants.add_decode(req.tenant, 1);
        // A block gets its hash once the look-ahead tokens after it exist (none without look-ahead).
        let block_size = self.kv.block_size as usize;
        if req.token_ids.len() % block_size == self.kv.hasher.lookahead() % block_size {
            self.kv.extend_hashes(req);
            self.kv.prefetch_next_caching(req);
        }
        match check_stop(req, t, max_model_len) {
            None => {
                hot.num_tokens[s] = req.token_ids.len() as u32;
                Ok(Applied::Decode(false))
            }
            Some((status, stop_reason)) => {
                req.stop_reason = stop_reason;
                self.finish_stopped(res, handle.slot, status, stop_reason)?;
                Ok(Applied::Decode(true))
            }
        }
    }

    /// From entry `i` of a step of one-token plain decodes, applies the entries whose request is a live, running
    /// plain decode (no stale output) whose token neither fills a block nor stops it: in-flight count released,
    /// token appended, one new token, the tenant's decode count, the token-count mirror. That is what
    /// `apply_decode` does for such an entry, decided before anything changes: the loop stops at the first entry
    /// that is anything else, untouched, and returns its index (`handles.len()` when none). Its columns and
    /// records are borrowed once for the run, not per entry.
    #[inline(never)]
    fn plain_decode_updates(
        &mut self,
        handles: &[ReqHandle],
        num_scheduled: &[i32],
        values: &[i64],
        num_new_tokens: &mut [i32],
        mut i: usize,
        max_model_len: u32,
    ) -> usize {
        let block_size = self.kv.block_size as usize;
        let hash_phase = self.kv.hasher.lookahead() % block_size;
        let (slots, hot) = self.slab.parts_mut();
        let m = slots.len().min(hot.in_flight.len());
        let (slots, in_flight) = (&mut slots[..m], &mut hot.in_flight[..m]);
        let (plain, stale, num_tokens) = (&hot.plain[..m], &hot.stale[..m], &mut hot.num_tokens[..m]);
        let n = handles.len().min(num_scheduled.len()).min(values.len()).min(num_new_tokens.len());
        while i < n {
            let h = handles[i];
            let s = h.slot as usize;
            if s >= m || !plain[s] || stale[s] != 0 {
                break;
            }
            let Some(req) = slots[s].as_mut().filter(|r| r.handle == h) else { break };
            let t = values[i] as u32;
            // The token count once `t` is appended.
            let len = req.token_ids.len() + 1;
            if req.status != RequestStatus::Running
                || len % block_size == hash_phase
                || check_stop_at(req, t, len as u32, max_model_len).is_some()
            {
                break;
            }
            in_flight[s] = in_flight[s].saturating_sub(num_scheduled[i] as u32);
            req.token_ids.push(t);
            num_new_tokens[i] = 1;
            self.tenants.add_decode(req.tenant, 1);
            num_tokens[s] = len as u32;
            i += 1;
        }
        i
    }

    /// `plain_decode_updates` for decodes holding output placeholders (async scheduling): from entry `i`,
    /// applies the entries whose request is live and running, with no stale output, a placeholder, no encoder
    /// input held and no cross-attention slots, whose token neither fills a block nor stops it and after which
    /// no block is left to cache: in-flight count released, token appended, one placeholder fewer, one new
    /// token, the tenant's decode count, the mirror columns (the token count; all of them when its last
    /// placeholder went, as the request may be plain now). That is what `apply_general` does for such an
    /// entry, decided before anything changes: the loop stops at the first entry that is anything else,
    /// untouched, and returns its index (`handles.len()` when none).
    #[inline(never)]
    fn placeholder_decode_updates(
        &mut self,
        handles: &[ReqHandle],
        num_scheduled: &[i32],
        values: &[i64],
        num_new_tokens: &mut [i32],
        mut i: usize,
        max_model_len: u32,
    ) -> usize {
        let block_size = self.kv.block_size as usize;
        let hash_phase = self.kv.hasher.lookahead() % block_size;
        let kv = &self.kv;
        let (slots, hot) = self.slab.parts_mut();
        let n = handles.len().min(num_scheduled.len()).min(values.len()).min(num_new_tokens.len());
        while i < n {
            let h = handles[i];
            let s = h.slot as usize;
            let (Some(Some(req)), Some(&in_flight), Some(&0)) =
                (slots.get_mut(s), hot.in_flight.get(s), hot.stale.get(s))
            else {
                break;
            };
            if req.handle != h {
                break;
            }
            let t = values[i] as u32;
            // The token count once `t` is appended, and the in-flight count once this entry is released.
            let len = req.token_ids.len() + 1;
            let left_in_flight = in_flight.saturating_sub(num_scheduled[i] as u32);
            if req.status != RequestStatus::Running
                || req.num_output_placeholders == 0
                || req.num_encoder_held != 0
                || req.cross_attention_tokens != 0
                || len % block_size == hash_phase
                || check_stop_at(req, t, len as u32, max_model_len).is_some()
                || !kv.caches_nothing(req, hot.computed[s].saturating_sub(left_in_flight))
            {
                break;
            }
            hot.in_flight[s] = left_in_flight;
            req.token_ids.push(t);
            req.num_output_placeholders -= 1;
            #[cfg(test)]
            PLACEHOLDER_RUN_ENTRIES.with(|c| c.set(c.get() + 1));
            num_new_tokens[i] = 1;
            self.tenants.add_decode(req.tenant, 1);
            if req.num_output_placeholders == 0 {
                hot.sync(s, req);
            } else {
                hot.num_tokens[s] = len as u32;
            }
            i += 1;
        }
        i
    }

    /// The general path of `update_from_output` for entry `i` (anything but a running plain decode that sampled
    /// one token): stale output, prefill chunks, drafts and placeholders, several tokens with a stop check after
    /// each, block caching. Returns whether a stopped request was running (`Some(true)`) or waiting
    /// (`Some(false)`); `None` when nothing stopped. Kept out of line so that the plain-decode loop stays small.
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn apply_general(
        &mut self,
        res: &mut UpdateResult,
        i: usize,
        handle: ReqHandle,
        num_scheduled: u32,
        is_chunk: bool,
        num_spec: u32,
        tokens: &[i64],
        drafts: Option<Ragged<'_>>,
    ) -> Result<Option<bool>> {
        let max_model_len = self.config.max_model_len;
        let block_size = self.config.kv_block_size() as usize;
        // A block's hash is known once its last token and `lookahead` more are: the token count is then
        // `lookahead` past a multiple of the block size.
        let hash_phase = self.kv.hasher.lookahead() % block_size;
        let spec_decoding = self.config.num_spec_tokens() > 0;
        // Only requests of a scheduler with an encoder cache can hold encoder-cache references.
        let has_encoder = self.encoder.capacity() > 0;
        let enc_dec = self.config.encoder_decoder;
        let Some((req, hot)) = self.slab.resolve_mut_hot(handle) else {
            return Ok(None);
        };
        let s = handle.slot as usize;
        // Output of a step scheduled before the request was preempted: delivered, but it rolls nothing
        // back (or, after a forced reset, it is dropped).
        let stale = hot.stale[s] > 0;
        if stale {
            hot.stale[s] = hot.stale[s].saturating_sub(num_scheduled);
            if req.drop_stale_output {
                return Ok(None);
            }
        }
        if tokens.is_empty() {
            // A partial prefill, or a decode the runner returned nothing for: nothing is appended and nothing
            // rolled back (a decode's scheduled drafts stay counted as computed, as in vLLM). vLLM frees the
            // encoder inputs a request has consumed once the step has run.
            if has_encoder && req.num_encoder_held > 0 {
                Self::release_consumed(
                    &mut self.encoder,
                    req,
                    hot.computed[s],
                    Self::encoder_release_delay(&self.config),
                );
            }
            if enc_dec && hot.computed[s] > 0 {
                self.enc_dec_free_slots += i64::from(req.cross_attention_tokens);
            }
            if let (Some(d), false, false) = (&drafts, stale, is_chunk) {
                req.spec_token_ids.clear();
                req.spec_token_ids.extend(d.get(i).iter().map(|&t| t as u32));
                hot.sync(s, req);
            }
            return Ok(None);
        }
        if num_spec > 0 && !stale {
            // Drafts the sampler rejected roll back; a runner that returns more than `1 + num_spec` tokens
            // moves the computed count (and placeholders) forward by the extra ones instead, as in vLLM.
            let accepted = tokens.len() as i64 - 1;
            let shift =
                |x: u32| (i64::from(x) - i64::from(num_spec) + accepted).clamp(0, i64::from(u32::MAX)) as u32;
            if hot.computed[s] > 0 {
                hot.computed[s] = shift(hot.computed[s]);
            }
            if req.num_output_placeholders > 0 {
                req.num_output_placeholders = shift(req.num_output_placeholders);
            }
        }
        if has_encoder && req.num_encoder_held > 0 {
            Self::release_consumed(
                &mut self.encoder,
                req,
                hot.computed[s],
                Self::encoder_release_delay(&self.config),
            );
        }
        if enc_dec && hot.computed[s] > 0 {
            // vLLM's EncoderDecoderCacheManager frees the request's inputs at every output once it has computed
            // tokens (`encoder_dec.rs`).
            self.enc_dec_free_slots += i64::from(req.cross_attention_tokens);
        }
        let was_running = req.status == RequestStatus::Running;
        let had_placeholders = req.num_output_placeholders > 0;
        let mut stopped = None;
        let mut appended = 0;
        let mut crossed_block = false;
        for &t in tokens {
            req.token_ids.push(t as u32);
            appended += 1;
            crossed_block |= req.token_ids.len() % block_size == hash_phase;
            stopped = check_stop(req, t as u32, max_model_len);
            if stopped.is_some() {
                break;
            }
        }
        res.num_new_tokens[i] = appended;
        self.tenants.add_decode(req.tenant, appended as u32);
        // Hash only when a block just became full (with look-ahead: its look-ahead tokens just became known): the
        // hash list sits in a colder part of the request.
        if crossed_block {
            self.kv.extend_hashes(req);
        }
        if !stale {
            // A stop cuts the rest of the entry: its computed count covers only what was kept (with
            // `trim_computed_on_stop`; the blocks cached below never cover the cut tokens).
            let mut cut = if stopped.is_some() { (tokens.len() - appended as usize) as u32 } else { 0 };
            if self.config.trim_computed_on_stop {
                hot.computed[s] = hot.computed[s].saturating_sub(cut);
                cut = 0;
            }
            // Every returned token resolves a placeholder, including those cut at a stop.
            req.num_output_placeholders = req.num_output_placeholders.saturating_sub(tokens.len() as u32);
            // vLLM caches the blocks this step completed (accepted drafts, placeholder positions) now,
            // up to what the applied steps computed (vLLM 0.32: up to the computed count less the placeholders
            // left, which a rollback of invalid blocks can leave above the tokens in flight).
            if was_running && (had_placeholders || (spec_decoding && self.config.cache_drafts_at_update)) {
                let pending = if self.config.cache_upto_in_flight {
                    hot.in_flight[s]
                } else {
                    req.num_output_placeholders
                };
                let upto = hot.computed[s].saturating_sub(cut).saturating_sub(pending);
                self.kv.cache_blocks(req, upto);
            }
        }
        match stopped {
            Some((status, stop_reason)) => {
                req.stop_reason = stop_reason;
                self.finish_stopped(res, handle.slot, status, stop_reason)?;
                return Ok(Some(was_running));
            }
            None => {
                if let (Some(d), false) = (&drafts, stale) {
                    req.spec_token_ids.clear();
                    req.spec_token_ids.extend(d.get(i).iter().map(|&t| t as u32));
                }
                // Drafts, placeholders or cached blocks may have changed: the mirrors are refreshed whole.
                hot.sync(s, req);
            }
        }
        Ok(None)
    }
}

impl Scheduler {
    /// Finishes the request in `slot`, stopped by a token of this update, and reports it in `res`.
    fn finish_stopped(
        &mut self,
        res: &mut UpdateResult,
        slot: u32,
        status: RequestStatus,
        stop_reason: i64,
    ) -> Result<()> {
        if self.slab.get(slot)?.resumable && self.stop_part(res, slot, status, stop_reason)? {
            return Ok(());
        }
        let id = self.finish(slot, status)?;
        res.finished_req_ids.push(id);
        res.finish_reasons.push(Self::finish_reason(status));
        res.stop_reasons.push(stop_reason);
        Ok(())
    }

    /// Sets the draft tokens each listed request proposes for its next step (vLLM's `update_draft_token_ids`,
    /// which its engine calls after `update_from_output`). Entry `i` of `drafts` belongs to `req_ids[i]`; an id
    /// listed twice keeps its last entry. A request whose last step was a partial prefill gets none (its
    /// drafts are cleared); any other live request keeps exactly the given drafts, which its next running step
    /// schedules as far as its budget reaches (they replace async scheduling's placeholders too). `-1` stands
    /// for a draft position the drafter left empty (n-gram padding): it is scheduled like a draft and always
    /// rejected by a sampler. Everything is validated first: an unknown id, more than `num_spec_tokens` drafts
    /// or a token id outside `[-1, MAX_TOKEN_ID]` changes nothing.
    pub fn set_draft_token_ids(&mut self, req_ids: &[String], drafts: Ragged<'_>) -> Result<()> {
        drafts.check("draft_token_ids", req_ids.len())?;
        let max_drafts = self.config.num_spec_tokens() as usize;
        let mut slots = Vec::with_capacity(req_ids.len());
        for (i, id) in req_ids.iter().enumerate() {
            slots.push(self.slot_of(id)?);
            let entry = drafts.get(i);
            if entry.len() > max_drafts {
                return Err(SchedError::InvalidOutput(format!(
                    "request {id:?} may hold at most num_spec_tokens={max_drafts} draft tokens, got {}",
                    entry.len()
                )));
            }
            if let Some(t) = entry.iter().find(|&&t| !(-1..=MAX_TOKEN_ID).contains(&t)) {
                return Err(SchedError::InvalidOutput(format!(
                    "draft_token_ids: draft token ids must be in [-1, {MAX_TOKEN_ID}], got {t}"
                )));
            }
        }
        for (i, slot) in slots.into_iter().enumerate() {
            let req = self.slab.get_mut(slot)?;
            req.spec_token_ids.clear();
            if !req.is_prefill_chunk {
                req.spec_token_ids.extend(drafts.get(i).iter().map(|&t| {
                    if t < 0 {
                        SPEC_PLACEHOLDER
                    } else {
                        t as u32
                    }
                }));
            }
            self.slab.sync(slot);
        }
        // The scheduled steps keep their drafts: `prepare_model_inputs` of the last step stays valid.
        Ok(())
    }
}

/// The stop check after each appended token, in vLLM 0.33's order (`check_stop`): EOS (unless ignore_eos), stop
/// token ids, then the length limits. `min_tokens` does not hold back EOS or stop ids here: the sampler masks
/// them until then (in vLLM 0.33 `min_tokens` only defers repetition detection, which kvsched does not do).
/// `last` is the token just appended. Returns the final status and the stop reason (stop token or -1).
#[inline(always)]
fn check_stop(req: &Request, last: u32, max_model_len: u32) -> Option<(RequestStatus, i64)> {
    check_stop_at(req, last, req.num_tokens(), max_model_len)
}

/// `check_stop` for `req` holding `num_tokens` tokens, `last` the last of them (possibly not appended yet:
/// `plain_decode_updates` decides before it changes anything).
#[inline(always)]
fn check_stop_at(
    req: &Request,
    last: u32,
    num_tokens: u32,
    max_model_len: u32,
) -> Option<(RequestStatus, i64)> {
    if !req.ignore_eos && req.eos_token_id == last {
        return Some((RequestStatus::FinishedStopped, -1));
    }
    if req.stop_token_ids.as_ref().is_some_and(|ids| ids.contains(&last)) {
        return Some((RequestStatus::FinishedStopped, i64::from(last)));
    }
    if num_tokens >= max_model_len || num_tokens - req.num_prompt_tokens >= req.max_tokens {
        return Some((RequestStatus::FinishedLengthCapped, -1));
    }
    None
}
