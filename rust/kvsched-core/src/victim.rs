//! Victim selection: which running request phase A of `schedule()` preempts when a request's KV slots cannot
//! be allocated (`preemption_victim`, docs/semantics.md "Victim selection").
//!
//! The policy first narrows the candidates to its lowest level: every running request under `fcfs`; those
//! with the largest effective priority under `priority`; those whose tenant has the largest counter under
//! `fair`. The rule then chooses inside the level:
//! - `default` (vLLM's): the last running request (`fcfs`, and the last of the level under `fair`); under
//!   `priority` the largest `(effective priority, arrival_time)`, the first in running order on ties;
//! - `lcf`: the fewest computed tokens, counted as before this step (a request scheduled earlier in the step
//!   counts its tokens before it: those are refunded, not lost, when it is the victim);
//! - `cost`: the largest `R / max(1, num_tokens) * (1 - min(O, M) / M)` with `R` its blocks whose ref count is
//!   1 (freed by its preemption), `O` its output tokens, `M = max(1, max_tokens)`; compared exactly, as
//!   fractions of integers, so no rounding decides.
//!
//! `lcf` and `cost` break ties by taking the later request in running order (the one `fcfs`'s default would
//! take first). Nothing here runs unless a preemption happens: the choice is one scan of `running` (`cost` also
//! reads the ref counts of the blocks of candidates that could still win), and `default` keeps vLLM's code
//! path. The step's entries so far (`scheduled`, `computed_before`) are phase A's, a subsequence of `running` in
//! running order, which the scan walks alongside `running`.

use crate::config::{Policy, PreemptionVictim};
use crate::error::{Result, SchedError};
use crate::request::{ReqHandle, Request};
use crate::scheduler::Scheduler;

/// The policy's lowest level, inside which a rule chooses.
#[derive(Clone, Copy)]
enum Level {
    All,
    /// The largest effective priority among running requests.
    Priority(i128),
    /// The largest counter among the tenants of running requests.
    Counter(f64),
}

/// `cost`'s score as a fraction `num / den` (`den > 0`).
#[derive(Clone, Copy)]
struct Score {
    num: u64,
    den: u128,
}

impl Score {
    /// `reclaimable / max(1, num_tokens) * (1 - min(out, m) / m)` with `m = max(1, max_tokens)`.
    fn of(req: &Request, reclaimable: u32) -> Score {
        let m = req.max_tokens.max(1);
        let left = m - req.num_output_tokens().min(m);
        Score {
            num: u64::from(reclaimable) * u64::from(left),
            den: u128::from(req.num_tokens().max(1)) * u128::from(m),
        }
    }

    /// `self >= other`, exactly (numerators below 2^56, denominators below 2^64: the products fit).
    fn at_least(self, other: Score) -> bool {
        u128::from(self.num) * other.den >= u128::from(other.num) * self.den
    }
}

impl Scheduler {
    /// Index in `running` of the next preemption victim. `scheduled` and `computed_before`: the step's entries
    /// so far and their computed tokens before the step.
    pub(crate) fn pick_victim(&self, scheduled: &[ReqHandle], computed_before: &[i32]) -> Result<usize> {
        match self.config.preemption_victim {
            PreemptionVictim::Default => self.default_victim(),
            rule => self.ranked_victim(rule, scheduled, computed_before),
        }
    }

    /// vLLM's choice.
    fn default_victim(&self) -> Result<usize> {
        match self.config.policy {
            Policy::Fair => self.tenants.pick_victim(&self.running, &self.slab),
            Policy::Priority => {
                let mut best = 0;
                let mut best_key = None;
                for (j, &s) in self.running.iter().enumerate() {
                    let r = self.slab.get(s)?;
                    let key = (r.effective_priority, r.arrival_time);
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
            // Every other order: the tail.
            _ => self.running.len().checked_sub(1).ok_or_else(no_victim),
        }
    }

    /// The policy's lowest level among the running requests.
    fn victim_level(&self) -> Result<Level> {
        Ok(match self.config.policy {
            Policy::Priority => {
                let mut top = None;
                for &s in &self.running {
                    let p = self.slab.get(s)?.effective_priority;
                    top = Some(top.map_or(p, |t: i128| t.max(p)));
                }
                Level::Priority(top.ok_or_else(no_victim)?)
            }
            Policy::Fair => {
                let mut top = None;
                for &s in &self.running {
                    let c = self.counter_of(self.slab.get(s)?);
                    top = Some(top.map_or(c, |t: f64| t.max(c)));
                }
                Level::Counter(top.ok_or_else(no_victim)?)
            }
            _ => Level::All,
        })
    }

    fn counter_of(&self, req: &Request) -> f64 {
        self.tenants.get(req.tenant).map_or(0.0, |t| t.counter)
    }

    fn in_level(&self, level: Level, req: &Request) -> bool {
        match level {
            Level::All => true,
            Level::Priority(p) => req.effective_priority == p,
            Level::Counter(c) => self.counter_of(req) == c,
        }
    }

    /// `lcf` or `cost` inside the policy's lowest level; ties to the later in running order.
    fn ranked_victim(
        &self,
        rule: PreemptionVictim,
        scheduled: &[ReqHandle],
        computed_before: &[i32],
    ) -> Result<usize> {
        let level = self.victim_level()?;
        let mut fewest: Option<(usize, u32)> = None;
        let mut largest: Option<(usize, Score)> = None;
        let mut next = 0; // the next entry of the step, in running order
        for (j, &s) in self.running.iter().enumerate() {
            let mut computed = self.slab.computed(s);
            if scheduled.get(next).is_some_and(|h| h.slot == s) {
                computed = computed_before.get(next).map_or(computed, |&c| c as u32);
                next += 1;
            }
            // `lcf` under `fcfs` needs the computed count alone, not the record.
            if matches!((rule, level), (PreemptionVictim::Lcf, Level::All)) {
                if fewest.is_none_or(|(_, c)| computed <= c) {
                    fewest = Some((j, computed));
                }
                continue;
            }
            let req = self.slab.get(s)?;
            if !self.in_level(level, req) {
                continue;
            }
            if rule == PreemptionVictim::Lcf {
                if fewest.is_none_or(|(_, c)| computed <= c) {
                    fewest = Some((j, computed));
                }
                continue;
            }
            // Counting its own blocks reads a ref count per block: skipped when even all of them could not
            // reach the best score so far.
            if let Some((_, best)) = largest {
                if !Score::of(req, req.blocks.len() as u32).at_least(best) {
                    continue;
                }
            }
            let own = req.blocks.iter().filter(|&&b| self.kv.pool.ref_cnt(b) == 1).count() as u32;
            let score = Score::of(req, own);
            if largest.is_none_or(|(_, best)| score.at_least(best)) {
                largest = Some((j, score));
            }
        }
        debug_assert_eq!(next, scheduled.len(), "the step's entries are not a subsequence of running");
        fewest.map(|b| b.0).or(largest.map(|b| b.0)).ok_or_else(no_victim)
    }
}

fn no_victim() -> SchedError {
    SchedError::Internal("no running request to preempt".into())
}
