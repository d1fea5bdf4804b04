//! Preemption that keeps work: a victim's KV is copied to the CPU block pool (`swap.rs`) and back on resume,
//! instead of being dropped and recomputed (`preemption_mode`: `recompute`, `swap`, or `auto`, which chooses
//! per victim by cost). The scheduler only decides; the runner executes the `swap_out` / `swap_in` pairs of
//! each `SchedulerOutput` before that step's forward pass.
//!
//! Invariants (checked by `check_swap_invariants`): every CPU block is either in the free queue (once) or held
//! by exactly one waiting request with status PREEMPTED; a swapped request holds no GPU blocks and exactly
//! `ceil(num_swapped_tokens / block_size)` CPU blocks; a running request holds none (they are released in the
//! step whose `swap_in` copies them back, so a swapped request is never scheduled before its swap-in).
//! Only victims with no step in flight are swapped: their KV is final (no rejected drafts or placeholder
//! positions still to roll back), so what is copied is exactly what the request has computed.

use crate::config::PreemptionMode;
use crate::error::{Result, SchedError};
use crate::request::{ReqHandle, Request};
use crate::scheduler::{Counters, Scheduler};
use crate::swap::CpuBlockPool;

/// Phase B: the tokens of a waiting request already in KV when it is admitted with `num_hit_tokens` of prefix
/// hits: its swapped-out tokens when they reach further than the hits (the rest comes back by `swap_in`).
#[inline]
pub(crate) fn restored_tokens(req: &Request, num_hit_tokens: u32) -> u32 {
    req.num_swapped_tokens.max(num_hit_tokens)
}

/// Phase B, after `req` was admitted (its table: the `num_hits` hit blocks, then fresh blocks): emits a
/// `swap_in` pair for each of its swapped blocks past the hits that the hits do not cover, releases its CPU
/// blocks, and counts the tokens it lost at its last preemption and did not get back.
/// Runs at every admission, so the swap-in itself is kept out of line (never reached under `recompute`).
#[inline]
pub(crate) fn complete_resume(
    cpu: &mut CpuBlockPool,
    counters: &mut Counters,
    req: &mut Request,
    num_hits: usize,
    restored: u32,
    swap_in: &mut Vec<i32>,
) -> Result<()> {
    counters.num_recomputed_tokens += u64::from(req.num_lost_tokens.saturating_sub(restored));
    req.num_lost_tokens = 0;
    if req.cpu_blocks.is_empty() {
        return Ok(());
    }
    resume_swapped(cpu, counters, req, num_hits, restored, swap_in)
}

#[inline(never)]
fn resume_swapped(
    cpu: &mut CpuBlockPool,
    counters: &mut Counters,
    req: &mut Request,
    num_hits: usize,
    restored: u32,
    swap_in: &mut Vec<i32>,
) -> Result<()> {
    if req.num_swapped_tokens == restored {
        for i in num_hits..req.cpu_blocks.len() {
            let gpu = req.blocks.get(i).ok_or_else(|| {
                SchedError::Internal(format!(
                    "request {:?} resumed without a block for swapped block {i}",
                    req.id
                ))
            })?;
            swap_in.push(req.cpu_blocks[i] as i32);
            swap_in.push(*gpu as i32);
            counters.num_swapped_in_blocks += 1;
        }
    }
    counters.num_swapped_in_reqs += 1;
    cpu.release(&req.cpu_blocks);
    req.cpu_blocks.clear();
    req.num_swapped_tokens = 0;
    Ok(())
}

impl Scheduler {
    /// Preempts `slot` (phase A's victim, already out of `running`), swapping its KV out when the mode says
    /// so and the CPU pool can hold it (`swap_out` gets the GPU -> CPU pairs), recomputing it otherwise.
    /// `computed_before`: its computed tokens before this step when it had been scheduled earlier in it (the
    /// tokens of this step were refunded, never computed).
    pub(crate) fn preempt_victim(
        &mut self,
        slot: u32,
        computed_before: Option<u32>,
        swap_out: &mut Vec<i32>,
    ) -> Result<ReqHandle> {
        let req = self.slab.get(slot)?;
        let computed = computed_before.unwrap_or(self.slab.computed(slot));
        // The KV worth keeping: computed tokens, never the last known token (its KV is computed next step).
        let saved = computed.min(req.num_tokens().saturating_sub(1));
        let num_blocks = saved.div_ceil(self.config.kv_block_size()) as usize;
        let wants_swap = saved > 0
            && self.slab.hot.in_flight[slot as usize] == 0
            && match self.config.preemption_mode {
                PreemptionMode::Recompute => false,
                PreemptionMode::Swap => true,
                PreemptionMode::Auto => self.swap_is_cheaper(req, saved, num_blocks),
            };
        let cpu_blocks = if wants_swap {
            let got = self.cpu.allocate(num_blocks);
            if got.is_none() {
                self.counters.num_swap_fallbacks += 1;
            }
            got
        } else {
            None
        };
        if let Some(cpu_blocks) = &cpu_blocks {
            let req = self.slab.get(slot)?;
            for (i, &c) in cpu_blocks.iter().enumerate() {
                let gpu = req.blocks.get(i).ok_or_else(|| {
                    SchedError::Internal(format!("request {:?} has no block {i} to swap out", req.id))
                })?;
                swap_out.push(*gpu as i32);
                swap_out.push(c as i32);
            }
        }
        let handle = self.preempt(slot, false)?;
        let req = self.slab.get_mut(slot)?;
        req.num_lost_tokens = computed;
        if let Some(cpu_blocks) = cpu_blocks {
            self.counters.num_swapped_out_reqs += 1;
            self.counters.num_swapped_out_blocks += cpu_blocks.len() as u64;
            req.cpu_blocks = cpu_blocks;
            req.num_swapped_tokens = saved;
        }
        Ok(handle)
    }

    /// Auto's rule: swap when copying the victim's `num_blocks` blocks out and back,
    /// `swap_cost_per_block * 2 * num_blocks`, costs strictly less than recomputing its uncached context,
    /// `recompute_cost_per_token * (saved - bs * blocks shared with another request)` (shared blocks stay
    /// resident and come back as prefix hits; the rest may be evicted while it waits).
    fn swap_is_cheaper(&self, req: &Request, saved: u32, num_blocks: usize) -> bool {
        let shared =
            req.blocks.iter().take(num_blocks).filter(|&&b| self.kv.pool.ref_cnt(b) > 1).count() as u32;
        let uncached = saved.saturating_sub(shared * self.config.kv_block_size());
        let swap_cost = self.swap_cost_per_block * (2 * num_blocks) as f64;
        let recompute_cost = self.recompute_cost_per_token * f64::from(uncached);
        swap_cost < recompute_cost
    }

    /// Sets auto's cost constants from now on (the engine measures them). On error nothing changes.
    pub fn set_preemption_costs(
        &mut self,
        recompute_cost_per_token: f64,
        swap_cost_per_block: f64,
    ) -> Result<()> {
        crate::config::check_preemption_costs(recompute_cost_per_token, swap_cost_per_block)
            .map_err(SchedError::InvalidRequest)?;
        self.recompute_cost_per_token = recompute_cost_per_token;
        self.swap_cost_per_block = swap_cost_per_block;
        Ok(())
    }

    /// Gives a finishing request's CPU blocks back (a swapped-out request aborted while it waits).
    pub(crate) fn release_cpu_blocks(&mut self, slot: u32) -> Result<()> {
        let req = self.slab.get_mut(slot)?;
        if !req.cpu_blocks.is_empty() {
            self.cpu.release(&req.cpu_blocks);
            req.cpu_blocks.clear();
            req.num_swapped_tokens = 0;
        }
        Ok(())
    }

    /// `(recompute_cost_per_token, swap_cost_per_block)` now in force.
    pub fn preemption_costs(&self) -> (f64, f64) {
        (self.recompute_cost_per_token, self.swap_cost_per_block)
    }

    /// CPU blocks holding a swapped-out request's KV (empty unless it is swapped).
    pub fn get_cpu_block_ids(&self, req_id: &str) -> Result<&[u32]> {
        Ok(&self.get_request(req_id)?.cpu_blocks)
    }

    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free_blocks()
    }

    /// The swap part of `check_invariants`.
    pub(crate) fn check_swap_invariants(&self) -> std::result::Result<(), String> {
        let bs = self.config.kv_block_size();
        let mut held = vec![0u32; self.cpu.num_blocks() as usize];
        for r in self.slab.iter() {
            if r.cpu_blocks.is_empty() != (r.num_swapped_tokens == 0) {
                return Err(format!("request {:?}: CPU blocks and swapped tokens disagree", r.id));
            }
            if r.cpu_blocks.is_empty() {
                continue;
            }
            if r.status != crate::request::RequestStatus::Preempted || !r.blocks.is_empty() {
                return Err(format!(
                    "request {:?} holds CPU blocks but is not a swapped-out waiting request",
                    r.id
                ));
            }
            if r.cpu_blocks.len() != r.num_swapped_tokens.div_ceil(bs) as usize
                || r.num_swapped_tokens >= r.num_tokens()
            {
                return Err(format!("request {:?}: CPU blocks do not match its swapped tokens", r.id));
            }
            for &b in &r.cpu_blocks {
                match held.get_mut(b as usize) {
                    Some(x) => *x += 1,
                    None => return Err(format!("request {:?} holds CPU block {b} out of range", r.id)),
                }
            }
        }
        self.cpu.check(&held)
    }
}
