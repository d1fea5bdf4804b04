//! Streaming-input sessions (vLLM 0.33's resumable requests): a request added with `resumable` whose input
//! arrives in parts. A stop (EOS, a stop id, `max_tokens`) ends only the current part: the request keeps its
//! blocks and its computed tokens and waits for the next part (`WaitingForInput`), which `append_input` gives;
//! `finish_input` ends the streaming-input session. A part given while the streaming-input session still runs is queued and taken at its next
//! stop. See docs/semantics.md, Streaming input.

use std::sync::Arc;

use crate::config::PreemptionMode;
use crate::error::{Result, SchedError};
use crate::output::UpdateResult;
use crate::request::{InputPart, RequestParams, RequestStatus, NO_SESSION};
use crate::scheduler::Scheduler;

fn bad_request(msg: String) -> SchedError {
    SchedError::InvalidRequest(msg)
}

impl Scheduler {
    /// `add_request`'s checks of a `resumable` request: features streaming input is not implemented with.
    pub(crate) fn check_resumable(&self, req_id: &str, params: &RequestParams) -> Result<()> {
        let what = if !params.encoder_inputs.is_empty() {
            Some("encoder inputs")
        } else if self.config.preemption_mode != PreemptionMode::Recompute {
            Some("preemption_mode other than 'recompute'")
        } else if params.waiting_for_grammar {
            Some("ready=False")
        } else if self.config.hash_lookahead_tokens > 0 {
            // A part drops the last sampled token, which the hash of the block before it may cover.
            Some("hash_lookahead_tokens > 0")
        } else {
            None
        };
        match what {
            Some(w) => Err(bad_request(format!("request {req_id:?}: a resumable request cannot have {w}"))),
            None => Ok(()),
        }
    }

    /// The next input part of the streaming-input session `req_id`. A streaming-input session waiting for input takes it at
    /// once (status `Waiting`, at its place in its queue); one still running queues it for its following stop.
    /// Errors (nothing changes): unknown id, a request that is not resumable or whose input is finished, an
    /// empty or out-of-range part, or a part that could make the streaming-input session too long for `max_model_len` or the KV
    /// cache (checked against the most tokens the streaming-input session can reach with the parts given so far).
    pub fn append_input(&mut self, req_id: &str, part: InputPart) -> Result<()> {
        let slot = self.slot_of(req_id)?;
        let req = self.slab.get(slot)?;
        if !req.resumable {
            return Err(bad_request(format!(
                "request {req_id:?} is not a streaming-input (resumable) request"
            )));
        }
        if req.input_closed {
            return Err(bad_request(format!("request {req_id:?}: its input was finished (finish_input)")));
        }
        if part.token_ids.is_empty() {
            return Err(bad_request(format!("request {req_id:?}: an input part needs at least one token")));
        }
        if part.max_tokens == Some(0) {
            return Err(bad_request(format!("request {req_id:?}: max_tokens must be >= 1, got 0")));
        }
        if !part.arrival_time.is_finite() {
            return Err(bad_request(format!(
                "request {req_id:?}: arrival_time must be finite, got {}",
                part.arrival_time
            )));
        }
        let waiting = req.status == RequestStatus::WaitingForInput;
        // The streaming-input session's prompt once the part is taken: everything but the last sampled token, plus the part.
        let base = if waiting { req.num_tokens() } else { req.max_len_bound };
        let prompt = u64::from(base) - 1 + part.token_ids.len() as u64;
        let max_model_len = u64::from(self.config.max_model_len);
        if prompt >= max_model_len {
            return Err(bad_request(format!(
                "request {req_id:?}: with this part the streaming-input session's prompt can reach {prompt} tokens, which leaves \
                 no room in max_model_len={max_model_len}"
            )));
        }
        let bound = part.max_tokens.map_or(max_model_len, |m| (prompt + u64::from(m)).min(max_model_len));
        let longest = bound - 1;
        let capacity = u64::from(self.config.kv_capacity_tokens());
        if longest > capacity {
            return Err(bad_request(format!(
                "request {req_id:?}: with this part the streaming-input session can reach {longest} KV slots, more than the KV \
                 cache holds ({capacity}); lower max_tokens"
            )));
        }
        if !self.config.enable_chunked_prefill && longest > u64::from(self.config.max_chunk_tokens()) {
            return Err(bad_request(format!(
                "request {req_id:?}: with this part the streaming-input session can reach {longest} KV slots, more than \
                 {} without chunked prefill",
                self.config.chunk_limit_text()
            )));
        }
        let req = self.slab.get_mut(slot)?;
        req.max_len_bound = bound as u32;
        if waiting {
            self.take_part(slot, part)?;
        } else {
            req.input_queue.push_back(Some(part));
        }
        self.epoch += 1;
        Ok(())
    }

    /// Ends the input of the streaming-input session `req_id`: a streaming-input session waiting for input is aborted (`FinishedAborted`,
    /// reported in the next output, as vLLM does), one still running finishes at its following stop.
    pub fn finish_input(&mut self, req_id: &str) -> Result<()> {
        let slot = self.slot_of(req_id)?;
        let req = self.slab.get_mut(slot)?;
        if !req.resumable {
            return Err(bad_request(format!(
                "request {req_id:?} is not a streaming-input (resumable) request"
            )));
        }
        if req.input_closed {
            return Err(bad_request(format!("request {req_id:?}: its input was already finished")));
        }
        req.input_closed = true;
        if req.status == RequestStatus::WaitingForInput {
            self.finish(slot, RequestStatus::FinishedAborted)?;
            self.remove_finished_from_queues(true);
        } else {
            req.input_queue.push_back(None);
        }
        self.epoch += 1;
        Ok(())
    }

    /// Whether the request `req_id` is known (live, or its blocks held for a KV transfer): vLLM's
    /// `has_request`, true for a streaming-input session waiting for its next part.
    pub fn has_request(&self, req_id: &str) -> bool {
        self.ids.contains_key(req_id) || self.held.contains_key(req_id)
    }

    /// A part of the streaming-input session in `slot` stopped with `status` (vLLM's `_handle_stopped_request` for a resumable
    /// request). Returns `false` when the streaming-input session is over (its input finished): the caller finishes it as any
    /// stopped request. Otherwise the part's stop is reported in `res`, the streaming-input session resumes from its
    /// materialized tokens (in-flight work dropped), takes its queued next part or waits for one, leaves its
    /// queue and is queued again at the end of the update.
    pub(crate) fn stop_part(
        &mut self,
        res: &mut UpdateResult,
        slot: u32,
        status: RequestStatus,
        stop_reason: i64,
    ) -> Result<bool> {
        let s = slot as usize;
        let (req, hot) = self.slab.get_mut_hot(slot)?;
        // The part's in-flight work is dropped first, also when the input is over (the finish then hands a KV
        // connector the blocks of the computed tokens left), as vLLM does.
        hot.computed[s] = hot.computed[s].saturating_sub(req.num_output_placeholders);
        req.spec_token_ids.clear();
        req.drop_stale_output = true;
        hot.stale[s] = hot.in_flight[s];
        req.num_output_placeholders = 0;
        req.inflight_prefill = false;
        if matches!(req.input_queue.front(), Some(None)) {
            req.input_queue.pop_front();
            return Ok(false);
        }
        let id: Arc<str> = req.id.clone();
        let (handle, tenant, tier, prev) = (req.handle, req.tenant, req.order_key, req.status);
        // Out of its queue (re-queued at the end of the update, as vLLM does).
        if prev == RequestStatus::Running {
            self.running.retain(|&x| x != slot);
            self.tenants.on_requeue(tenant);
            if req.session != NO_SESSION {
                self.sessions.on_leave_running(req.session, self.next_step_id);
            }
        } else if !self.waiting.remove(handle, tier, tenant) {
            self.kv_waiting.remove(handle, tier, tenant);
        }
        let req = self.slab.get_mut(slot)?;
        req.wait_seq = 0;
        if req.deferred {
            req.deferred = false;
            self.num_deferred -= 1;
        }
        match req.input_queue.pop_front() {
            Some(Some(part)) => {
                req.status = RequestStatus::Waiting;
                self.take_part(slot, part)?;
            }
            _ => {
                req.status = RequestStatus::WaitingForInput;
                self.num_waiting_for_input += 1;
            }
        }
        self.slab.sync(slot);
        self.continuing.push(slot);
        res.part_finished_req_ids.push(id);
        res.part_finish_reasons.push(Self::finish_reason(status));
        res.part_stop_reasons.push(stop_reason);
        Ok(true)
    }

    /// Queues the streaming requests whose part stopped in this update, in order (vLLM's `_enqueue_waiting_request`):
    /// one holding blocks at the back of `kv_waiting`, another at the back of `waiting`; deferred while it
    /// waits for input.
    pub(crate) fn queue_continuing(&mut self) -> Result<()> {
        let slots = std::mem::take(&mut self.continuing);
        let policy = self.config.policy;
        for &slot in &slots {
            let computed = self.slab.computed(slot);
            let req = self.slab.get_mut(slot)?;
            if req.status == RequestStatus::WaitingForInput && !req.deferred {
                req.deferred = true;
                self.num_deferred += 1;
            }
            let holds_kv = computed > 0 || !req.blocks.is_empty();
            let key = Self::order_key(policy, req);
            let h = req.handle;
            if holds_kv {
                self.kv_waiting.push(h, key);
            } else {
                self.waiting.push(h, key);
                self.enter_waiting(slot)?;
            }
        }
        self.continuing = slots;
        self.continuing.clear();
        Ok(())
    }

    /// Makes `part` the streaming-input session's current input (vLLM's `_update_request_as_session`): its last sampled token
    /// is dropped, the rest of its output joins the prompt, then the part's tokens; the part's limits and stop
    /// conditions replace the previous ones; status `Waiting`, at its place in its queue (its queue key is not
    /// recomputed). Blocks and computed tokens stay (the computed count capped at the tokens kept).
    fn take_part(&mut self, slot: u32, part: InputPart) -> Result<()> {
        let max_model_len = self.config.max_model_len;
        let bs = self.kv.block_size as usize;
        let (req, hot) = self.slab.get_mut_hot(slot)?;
        let keep = req.token_ids.len() - 1;
        // Without `trim_computed_on_stop` a stop inside a step's tokens leaves the computed count past the
        // tokens kept; the KV of the positions the part now fills is recomputed.
        let s = slot as usize;
        hot.computed[s] = hot.computed[s].min(keep as u32);
        // Nothing computed is left (a runner sampled tokens for a partial prefill, and the stop dropped them as
        // in flight): the blocks the streaming session holds keep no valid KV; they are freed and its next
        // admission looks its prefix up afresh.
        let drop_blocks = hot.computed[s] == 0 && !req.blocks.is_empty();
        req.token_ids.truncate(keep);
        req.block_hashes.truncate(keep / bs);
        if self.kv.partial_unit != 0 {
            req.unit_hashes.truncate(keep / self.kv.partial_unit as usize);
        }
        req.token_ids.extend_from_slice(&part.token_ids);
        let prompt = req.token_ids.len() as u32;
        req.num_prompt_tokens = prompt;
        let room = max_model_len - prompt;
        req.max_tokens = part.max_tokens.map_or(room, |m| m.min(room));
        req.requested_max_tokens = part.max_tokens.unwrap_or(req.max_tokens);
        req.min_tokens = 0;
        req.eos_token_id = part.eos_token_id.unwrap_or(crate::request::NO_EOS);
        req.ignore_eos = part.ignore_eos;
        req.stop_token_ids =
            if part.stop_token_ids.is_empty() { None } else { Some(Box::new(part.stop_token_ids)) };
        req.arrival_time = part.arrival_time + 0.0;
        req.stop_reason = -1;
        req.probe_hits = 0;
        if req.status == RequestStatus::WaitingForInput {
            self.num_waiting_for_input -= 1;
        }
        req.status = RequestStatus::Waiting;
        self.kv.extend_hashes(req);
        if drop_blocks {
            self.free_request_blocks(slot, false)?;
        }
        self.slab.sync(slot);
        Ok(())
    }
}
