//! `schedule()`: the vLLM v1 token-budget loop.
//!
//! Phase A walks `running` in order and gives each request `min(remaining, threshold, budget, model-length
//! cap)` tokens; when its KV slots cannot be allocated, a victim is preempted (FCFS: the last running request;
//! PRIORITY: the largest `(priority, arrival_time)`, refunded if it was already scheduled this step) until the
//! allocation succeeds or the request itself is the victim, which ends phase A. Phase B, only when nothing was
//! preempted, admits waiting requests in policy order with their prefix-cache hits while `max_num_seqs`, the
//! budget and the free blocks allow; it never preempts. Requests with nothing to do are skipped, not blocking.

use crate::config::Policy;
use crate::error::Result;
use crate::output::{SchedulerOutput, StepRecord};
use crate::request::{ReqHandle, RequestStatus};
use crate::scheduler::Scheduler;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Running,
    New,
    Resumed,
}

struct Entry {
    slot: u32,
    num_new_tokens: u32,
    /// Index in the request's block table where this step's new blocks start (0 for new/resumed).
    first_new_block: usize,
    kind: Kind,
    /// This request's scheduled drafts: `spec[spec_start..spec_end]` of the step's shared buffer.
    spec_start: u32,
    spec_end: u32,
}

impl Scheduler {
    #[inline(never)]
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        let bs = self.config.block_size;
        let threshold = self.config.long_prefill_token_threshold;
        let max_model_len = self.config.max_model_len;
        let lookahead = self.config.num_lookahead_tokens;
        let max_num_seqs = self.config.max_num_seqs as usize;
        let chunked = self.config.enable_chunked_prefill;
        let mut budget = self.config.max_num_batched_tokens;
        let mut entries: Vec<Entry> = Vec::with_capacity(self.running.len() + 8);
        let mut preempted: Vec<ReqHandle> = Vec::new();
        let mut spec_buf: Vec<u32> = Vec::new();

        // Phase A: running requests.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let req = self.slab.get(slot)?;
            let mut n = i64::from(req.num_tokens_with_spec()) - i64::from(req.num_computed_tokens);
            if threshold > 0 && n > i64::from(threshold) {
                n = i64::from(threshold);
            }
            n = n.min(i64::from(budget));
            n = n.min(i64::from(max_model_len) - 1 - i64::from(req.num_computed_tokens));
            if n <= 0 {
                i += 1;
                continue;
            }
            let n = n as u32;
            let first_new_block = req.blocks.len();
            let mut self_preempted = false;
            loop {
                let req = self.slab.get_mut(slot)?;
                if self.kv.allocate_slots(req, n, &[], lookahead).is_some() {
                    break;
                }
                let j = self.pick_victim()?;
                let victim = self.running.remove(j);
                if let Some(pos) = entries.iter().position(|e| e.slot == victim) {
                    budget += entries[pos].num_new_tokens;
                    entries.remove(pos);
                }
                if j < i {
                    i -= 1;
                }
                preempted.push(self.preempt(victim)?);
                if victim == slot {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let req = self.slab.get_mut(slot)?;
            let num_spec = (i64::from(req.num_computed_tokens) + i64::from(n) - i64::from(req.num_tokens()))
                .clamp(0, req.spec_token_ids.len() as i64) as usize;
            let spec_start = spec_buf.len() as u32;
            if !req.spec_token_ids.is_empty() {
                spec_buf.extend_from_slice(&req.spec_token_ids[..num_spec]);
                req.spec_token_ids.clear();
            }
            let spec_end = spec_buf.len() as u32;
            entries.push(Entry {
                slot,
                num_new_tokens: n,
                first_new_block,
                kind: Kind::Running,
                spec_start,
                spec_end,
            });
            budget -= n;
            i += 1;
        }

        // Phase B: waiting requests, only if nobody was preempted.
        if preempted.is_empty() {
            let mut hits: Vec<u32> = Vec::new();
            while budget > 0 && self.running.len() < max_num_seqs {
                let Some(h) = self.waiting.peek() else { break };
                let req = self.slab.get_mut(h.slot)?;
                hits.clear();
                self.kv.find_longest_cache_hit(&req.block_hashes, req.num_tokens(), &mut hits);
                let num_hit_tokens = hits.len() as u32 * bs;
                let mut n = req.num_tokens() - num_hit_tokens;
                if threshold > 0 && n > threshold {
                    n = threshold;
                }
                if !chunked && n > budget {
                    break;
                }
                n = n.min(budget);
                if self.kv.allocate_slots(req, n, &hits, 0).is_none() {
                    break;
                }
                let kind = if req.status == RequestStatus::Preempted { Kind::Resumed } else { Kind::New };
                req.status = RequestStatus::Running;
                req.num_computed_tokens = num_hit_tokens;
                if req.num_cached_tokens < 0 {
                    req.num_cached_tokens = i64::from(num_hit_tokens);
                }
                let c = &mut self.counters;
                if req.num_preemptions > 0 {
                    c.prefix_cache_preempted_queries += u64::from(req.num_tokens());
                    c.prefix_cache_preempted_hits += u64::from(num_hit_tokens);
                } else {
                    c.prefix_cache_queries += u64::from(req.num_tokens());
                    c.prefix_cache_hits += u64::from(num_hit_tokens);
                }
                self.waiting.pop();
                self.running.push(h.slot);
                let at = spec_buf.len() as u32;
                entries.push(Entry {
                    slot: h.slot,
                    num_new_tokens: n,
                    first_new_block: 0,
                    kind,
                    spec_start: at,
                    spec_end: at,
                });
                budget -= n;
            }
        }

        self.build_output(entries, &spec_buf, preempted)
    }

    /// Index in `running` of the next preemption victim.
    fn pick_victim(&self) -> Result<usize> {
        match self.config.policy {
            Policy::Fcfs => Ok(self.running.len() - 1),
            Policy::Priority => {
                let mut best = 0;
                let mut best_key = None;
                for (j, &s) in self.running.iter().enumerate() {
                    let r = self.slab.get(s)?;
                    let key = (r.priority, r.arrival_time);
                    let better = match best_key {
                        None => true,
                        Some((p, t)) => key.0 > p || (key.0 == p && key.1.total_cmp(&t).is_gt()),
                    };
                    if better {
                        best = j;
                        best_key = Some(key);
                    }
                }
                Ok(best)
            }
        }
    }

    /// Frees the request's KV and sends it back to waiting; its outputs are kept and recomputed on resume.
    fn preempt(&mut self, slot: u32) -> Result<ReqHandle> {
        let req = self.slab.get_mut(slot)?;
        self.kv.free(req);
        req.num_computed_tokens = 0;
        req.spec_token_ids.clear();
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        req.is_prefill_chunk = false;
        let handle = req.handle;
        let key = Self::priority_key(req);
        self.waiting.push_preempted(handle, key);
        self.counters.num_preemptions += 1;
        Ok(handle)
    }

    fn build_output(
        &mut self,
        entries: Vec<Entry>,
        spec_buf: &[u32],
        preempted: Vec<ReqHandle>,
    ) -> Result<SchedulerOutput> {
        let n = entries.len();
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        let mut out = SchedulerOutput {
            scheduler_id: self.scheduler_id,
            step_id,
            handles: Vec::with_capacity(n),
            num_scheduled_tokens: Vec::with_capacity(n),
            num_computed_tokens: Vec::with_capacity(n),
            new_block_ids_indptr: Vec::with_capacity(n + 1),
            spec_token_ids_indptr: Vec::with_capacity(n + 1),
            preempted,
            finished_req_ids: std::mem::take(&mut self.finished_since_step),
            ..Default::default()
        };
        out.new_block_ids_indptr.push(0);
        out.spec_token_ids_indptr.push(0);
        let mut is_chunk = Vec::with_capacity(n);
        let mut num_spec = Vec::with_capacity(n);
        let mut total: u64 = 0;
        for (idx, e) in entries.iter().enumerate() {
            let req = self.slab.get_mut(e.slot)?;
            out.handles.push(req.handle);
            out.num_scheduled_tokens.push(e.num_new_tokens as i32);
            out.num_computed_tokens.push(req.num_computed_tokens as i32);
            match e.kind {
                Kind::New => out.new_reqs.push(idx as u32),
                Kind::Resumed => out.resumed_reqs.push(idx as u32),
                Kind::Running => {}
            }
            out.new_block_ids.extend(req.blocks[e.first_new_block..].iter().map(|&b| b as i32));
            out.new_block_ids_indptr.push(out.new_block_ids.len() as i32);
            let spec = &spec_buf[e.spec_start as usize..e.spec_end as usize];
            out.spec_token_ids.extend(spec.iter().map(|&t| t as i32));
            out.spec_token_ids_indptr.push(out.spec_token_ids.len() as i32);
            req.num_computed_tokens += e.num_new_tokens;
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens();
            is_chunk.push(req.is_prefill_chunk);
            num_spec.push(spec.len() as u32);
            total += u64::from(e.num_new_tokens);
        }
        out.total_num_scheduled_tokens = total;
        self.counters.last_num_scheduled_reqs = n;
        self.counters.last_num_scheduled_tokens = total;
        self.epoch += 1;
        self.in_flight.push_back(StepRecord {
            step_id,
            epoch: self.epoch,
            handles: out.handles.clone(),
            is_prefill_chunk: is_chunk,
            num_spec_tokens: num_spec,
            num_computed_tokens: out.num_computed_tokens.clone(),
            num_scheduled_tokens: out.num_scheduled_tokens.clone(),
            spec_token_ids: out.spec_token_ids.clone(),
            spec_token_ids_indptr: out.spec_token_ids_indptr.clone(),
        });
        Ok(out)
    }
}
