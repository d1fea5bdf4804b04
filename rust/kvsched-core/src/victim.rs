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
//! reads the ref counts of the blocks of the candidates that could still win, best bound first), and `default`
//! keeps vLLM's code path. The step's entries so far (`scheduled`, `computed_before`) are phase A's,
//! a subsequence of `running` in running order, which `lcf`'s scan walks alongside `running`.

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

/// `cost`'s score as a fraction `num / den` (`den > 0`), ordered by value (`1/2 == 2/4`).
#[derive(Clone, Copy, Debug)]
struct Score {
    num: u64,
    den: u64,
}

impl Score {
    /// `reclaimable / max(1, num_tokens) * (1 - min(out, m) / m)` with `m = max(1, max_tokens)`.
    fn of(req: &Request, reclaimable: u32) -> Score {
        let m = req.max_tokens.max(1);
        let left = m - req.num_output_tokens().min(m);
        Score {
            num: u64::from(reclaimable) * u64::from(left),
            den: u64::from(req.num_tokens().max(1)) * u64::from(m),
        }
    }
}

/// Exact: the cross products of two `u64`s fit in 128 bits.
impl Ord for Score {
    fn cmp(&self, other: &Score) -> std::cmp::Ordering {
        (u128::from(self.num) * u128::from(other.den)).cmp(&(u128::from(other.num) * u128::from(self.den)))
    }
}

impl PartialOrd for Score {
    fn partial_cmp(&self, other: &Score) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Score {
    fn eq(&self, other: &Score) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Score {}

impl Scheduler {
    /// The running request a preemption would take now, before anything is scheduled in a step (`None` when
    /// nothing runs). Read-only: for tests, benchmarks and hosts that explain their preemptions.
    pub fn next_victim(&self) -> Result<Option<&std::sync::Arc<str>>> {
        if self.running.is_empty() {
            return Ok(None);
        }
        let j = self.pick_victim(&[], &[])?;
        Ok(Some(&self.slab.get(self.running[j])?.id))
    }

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

    /// `lcf` or `cost` inside the policy's lowest level.
    fn ranked_victim(
        &self,
        rule: PreemptionVictim,
        scheduled: &[ReqHandle],
        computed_before: &[i32],
    ) -> Result<usize> {
        let level = self.victim_level()?;
        match rule {
            PreemptionVictim::Cost => self.cost_victim(level),
            _ => self.lcf_victim(level, scheduled, computed_before),
        }
    }

    /// The fewest computed tokens before the step, the later in running order on ties.
    fn lcf_victim(&self, level: Level, scheduled: &[ReqHandle], computed_before: &[i32]) -> Result<usize> {
        let mut fewest: Option<(usize, u32)> = None;
        let mut next = 0; // the next entry of the step, in running order
        for (j, &s) in self.running.iter().enumerate() {
            let mut computed = self.slab.computed(s);
            if scheduled.get(next).is_some_and(|h| h.slot == s) {
                computed = computed_before.get(next).map_or(computed, |&c| c as u32);
                next += 1;
            }
            // Under `fcfs` the computed count alone decides: the record is not read.
            if !matches!(level, Level::All) && !self.in_level(level, self.slab.get(s)?) {
                continue;
            }
            if fewest.is_none_or(|(_, c)| computed <= c) {
                fewest = Some((j, computed));
            }
        }
        debug_assert_eq!(next, scheduled.len(), "the step's entries are not a subsequence of running");
        fewest.map(|b| b.0).ok_or_else(no_victim)
    }

    /// The largest score, the later in running order on ties. Counting a candidate's own blocks reads a ref count
    /// per block, so only the candidates that could still win are counted, best bound first (the bound counts
    /// all their blocks as their own; `largest_by_bound`): without shared blocks, one.
    fn cost_victim(&self, level: Level) -> Result<usize> {
        let mut bounds: Vec<(Score, usize)> = Vec::with_capacity(self.running.len());
        for (j, &s) in self.running.iter().enumerate() {
            let req = self.slab.get(s)?;
            if self.in_level(level, req) {
                bounds.push((Score::of(req, req.blocks.len() as u32), j));
            }
        }
        let own = |j: usize| -> Result<Score> {
            let req = self.slab.get(self.running[j])?;
            let own = req.blocks.iter().filter(|&&b| self.kv.pool.ref_cnt(b) == 1).count() as u32;
            Ok(Score::of(req, own))
        };
        largest_by_bound(bounds, own)?.ok_or_else(no_victim)
    }
}

/// The `j` of the largest `score(j)`, the largest `j` on ties, among `candidates` `(bound, j)` where
/// `bound >= score(j)`. The largest `(bound, j)` is tried first: without shared blocks its bound is its score and
/// no other candidate can beat it, which one more pass checks. Any that could are then tried largest `(bound, j)`
/// first (a heap), stopping once none left can: its bound is below the best score, or equal to it with an earlier
/// `j` (which would lose the tie).
fn largest_by_bound(
    candidates: Vec<(Score, usize)>,
    mut score: impl FnMut(usize) -> Result<Score>,
) -> Result<Option<usize>> {
    let Some(&(_, first)) = candidates.iter().max() else { return Ok(None) };
    let mut best = (first, score(first)?);
    let could_beat =
        |(bound, j): (Score, usize), (bj, b): (usize, Score)| bound > b || (bound == b && j > bj);
    let rest: Vec<(Score, usize)> = candidates.into_iter().filter(|&c| could_beat(c, best)).collect();
    let mut heap = std::collections::BinaryHeap::from(rest);
    while let Some(c) = heap.pop() {
        // Popped in decreasing (bound, j): once one cannot beat the best, none after it can.
        if !could_beat(c, best) {
            break;
        }
        let s = score(c.1)?;
        if (s, c.1) > (best.1, best.0) {
            best = (c.1, s);
        }
    }
    Ok(Some(best.0))
}

fn no_victim() -> SchedError {
    SchedError::Internal("no running request to preempt".into())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The bounded search finds what a scan of every candidate finds, ties (equal fractions written
        /// differently, equal bounds, bounds equal to the best score) included.
        #[test]
        fn the_bounded_search_finds_the_largest_score(
            cands in prop::collection::vec((0u64..6, 1u64..5, 0u64..4), 1..12),
        ) {
            // Candidate j: score num/den, bound (num + extra)/den.
            let score = |j: usize| Score { num: cands[j].0, den: cands[j].1 };
            let bounds = (0..cands.len()).map(|j| (Score { num: cands[j].0 + cands[j].2, den: cands[j].1 }, j));
            let got = largest_by_bound(bounds.collect(), |j| Ok(score(j)));
            let mut want = 0;
            for j in 1..cands.len() {
                if score(j) >= score(want) {
                    want = j;
                }
            }
            prop_assert_eq!(got, Ok(Some(want)));
        }
    }
}
