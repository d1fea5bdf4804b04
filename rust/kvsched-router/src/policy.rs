//! The routing policies: each orders the candidate replicas, most preferred first.
//!
//! A policy sees, per candidate, its longest cached prefix of the prompt, its block count and its load. Ties
//! always fall to the lower slot (the order replicas were added in), so a decision depends on the router's state
//! and nothing else.
//!
//! - `RoundRobin`: the candidates in slot order, rotated by a counter that every routed request advances.
//! - `LeastLoaded`: fewest requests (waiting + running), then lowest KV usage.
//! - `CacheAware`: the rule of vllm-router's and SGLang's `cache_aware` policy. When the load is imbalanced (the
//!   busiest candidate has more than `balance_abs_threshold` requests over the idlest and more than
//!   `balance_rel_threshold` times as many), fewest requests first. Otherwise, if some replica caches more than
//!   `cache_threshold` of the prompt, longest cached prefix first; else the replica caching the fewest blocks
//!   first (it has the most room for a new prefix). Those routers guess the cache from the requests they routed;
//!   here it is whatever the index holds.
//! - `KvOverlap`: the highest weighted score, as llm-d's scorers combine: `overlap_weight` times the share of the
//!   prompt's blocks cached, plus `queue_weight` times the waiting queue scaled to [0, 1] across the candidates
//!   (1 for the shortest, 0 for the longest), plus `kv_usage_weight` times the free share of the KV cache.
//!   Dynamo's KV router weighs the same two things, uncached prefill work against load.
//! - `Predictive`: the lowest estimated time to first token (`crate::predict`).

use std::cmp::Ordering;

use crate::load::LoadReport;
use crate::predict::{estimate_ttft, StepTimeCoefficients};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    RoundRobin,
    LeastLoaded,
    CacheAware,
    KvOverlap,
    Predictive,
}

impl PolicyKind {
    pub const NAMES: [&'static str; 5] =
        ["round_robin", "least_loaded", "cache_aware", "kv_overlap", "predictive"];

    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "round_robin" => PolicyKind::RoundRobin,
            "least_loaded" => PolicyKind::LeastLoaded,
            "cache_aware" => PolicyKind::CacheAware,
            "kv_overlap" => PolicyKind::KvOverlap,
            "predictive" => PolicyKind::Predictive,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoaded => "least_loaded",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::KvOverlap => "kv_overlap",
            PolicyKind::Predictive => "predictive",
        }
    }
}

/// Why the first replica of a ranking was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    RoundRobin,
    LeastLoaded,
    /// `CacheAware`: a replica caches more than the threshold of the prompt.
    CacheHit,
    /// `CacheAware`: no replica caches enough; the one with the fewest cached blocks.
    SmallestCache,
    /// `CacheAware`: the load is imbalanced; the least loaded.
    Imbalanced,
    /// `KvOverlap`: the highest score.
    Score,
    /// `Predictive`: the lowest estimated time to first token.
    Ttft,
    /// The replica the previous request with this `session_id` went to.
    Sticky,
    /// The caller chose the replica (`Router::assign`).
    Assigned,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoaded => "least_loaded",
            Reason::CacheHit => "cache_hit",
            Reason::SmallestCache => "smallest_cache",
            Reason::Imbalanced => "imbalanced",
            Reason::Score => "score",
            Reason::Ttft => "ttft",
            Reason::Sticky => "sticky",
            Reason::Assigned => "assigned",
        }
    }
}

/// The policy parameters (validated by `RouterConfig::validate`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyParams {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub overlap_weight: f64,
    pub queue_weight: f64,
    pub kv_usage_weight: f64,
    pub step_time: StepTimeCoefficients,
    pub max_num_batched_tokens: u64,
}

/// One candidate replica as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub slot: usize,
    pub overlap_blocks: usize,
    pub num_cached_blocks: usize,
    pub load: LoadReport,
}

/// The prompt as a policy sees it.
#[derive(Clone, Copy, Debug)]
pub struct PromptShape {
    pub num_blocks: usize,
    pub num_tokens: usize,
    pub block_size: usize,
}

impl PromptShape {
    /// Tokens of the prompt a replica with `overlap_blocks` cached blocks would not recompute.
    pub fn cached_tokens(&self, overlap_blocks: usize) -> u64 {
        (overlap_blocks * self.block_size).min(self.num_tokens) as u64
    }
}

/// The balance rule: is `busy` overloaded compared with `idle`?
pub fn imbalanced(busy: u64, idle: u64, p: &PolicyParams) -> bool {
    busy.saturating_sub(idle) > p.balance_abs_threshold && busy as f64 > p.balance_rel_threshold * idle as f64
}

pub fn ttft(c: &Candidate, prompt: &PromptShape, p: &PolicyParams) -> f64 {
    estimate_ttft(
        &p.step_time,
        p.max_num_batched_tokens,
        &c.load,
        prompt.num_tokens as u64,
        prompt.cached_tokens(c.overlap_blocks),
    )
}

fn by_load(a: &Candidate, b: &Candidate) -> Ordering {
    a.load.num_requests().cmp(&b.load.num_requests()).then(a.slot.cmp(&b.slot))
}

/// Orders `cands` (given in slot order), most preferred first, and says why the first was chosen.
pub fn rank(
    kind: PolicyKind,
    cands: &mut [Candidate],
    prompt: &PromptShape,
    p: &PolicyParams,
    round_robin_counter: u64,
) -> Reason {
    debug_assert!(cands.windows(2).all(|w| w[0].slot < w[1].slot));
    match kind {
        PolicyKind::RoundRobin => {
            if !cands.is_empty() {
                let k = (round_robin_counter % cands.len() as u64) as usize;
                cands.rotate_left(k);
            }
            Reason::RoundRobin
        }
        PolicyKind::LeastLoaded => {
            cands.sort_by(|a, b| {
                a.load
                    .num_requests()
                    .cmp(&b.load.num_requests())
                    .then(a.load.kv_usage.total_cmp(&b.load.kv_usage))
                    .then(a.slot.cmp(&b.slot))
            });
            Reason::LeastLoaded
        }
        PolicyKind::CacheAware => {
            let max = cands.iter().map(|c| c.load.num_requests()).max().unwrap_or(0);
            let min = cands.iter().map(|c| c.load.num_requests()).min().unwrap_or(0);
            if imbalanced(max, min, p) {
                cands.sort_by(by_load);
                return Reason::Imbalanced;
            }
            let best = cands.iter().map(|c| c.overlap_blocks).max().unwrap_or(0);
            let rate = prompt.cached_tokens(best) as f64 / prompt.num_tokens.max(1) as f64;
            if rate > p.cache_threshold {
                cands.sort_by(|a, b| b.overlap_blocks.cmp(&a.overlap_blocks).then_with(|| by_load(a, b)));
                Reason::CacheHit
            } else {
                cands.sort_by(|a, b| {
                    a.num_cached_blocks.cmp(&b.num_cached_blocks).then_with(|| by_load(a, b))
                });
                Reason::SmallestCache
            }
        }
        PolicyKind::KvOverlap => {
            let qmax = cands.iter().map(|c| c.load.num_waiting).max().unwrap_or(0);
            let qmin = cands.iter().map(|c| c.load.num_waiting).min().unwrap_or(0);
            let score = |c: &Candidate| {
                let overlap = if prompt.num_blocks == 0 {
                    0.0
                } else {
                    c.overlap_blocks as f64 / prompt.num_blocks as f64
                };
                let queue = if qmax == qmin {
                    1.0
                } else {
                    (qmax - c.load.num_waiting) as f64 / (qmax - qmin) as f64
                };
                p.overlap_weight * overlap
                    + p.queue_weight * queue
                    + p.kv_usage_weight * (1.0 - c.load.kv_usage)
            };
            let mut scored: Vec<(f64, Candidate)> = cands.iter().map(|c| (score(c), *c)).collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.slot.cmp(&b.1.slot)));
            for (dst, (_, c)) in cands.iter_mut().zip(scored) {
                *dst = c;
            }
            Reason::Score
        }
        PolicyKind::Predictive => {
            let mut timed: Vec<(f64, Candidate)> = cands.iter().map(|c| (ttft(c, prompt, p), *c)).collect();
            timed.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| by_load(&a.1, &b.1)));
            for (dst, (_, c)) in cands.iter_mut().zip(timed) {
                *dst = c;
            }
            Reason::Ttft
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PolicyParams {
        PolicyParams {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            overlap_weight: 3.0,
            queue_weight: 2.0,
            kv_usage_weight: 2.0,
            step_time: StepTimeCoefficients { step_s: 0.01, prefill_token_s: 1e-4, ..Default::default() },
            max_num_batched_tokens: 8192,
        }
    }

    fn cand(
        slot: usize,
        overlap_blocks: usize,
        num_cached_blocks: usize,
        waiting: u64,
        running: u64,
    ) -> Candidate {
        Candidate {
            slot,
            overlap_blocks,
            num_cached_blocks,
            load: LoadReport { num_waiting: waiting, num_running: running, ..Default::default() },
        }
    }

    fn order(
        kind: PolicyKind,
        mut cands: Vec<Candidate>,
        prompt: PromptShape,
        counter: u64,
    ) -> (Vec<usize>, Reason) {
        let reason = rank(kind, &mut cands, &prompt, &params(), counter);
        (cands.iter().map(|c| c.slot).collect(), reason)
    }

    const PROMPT: PromptShape = PromptShape { num_blocks: 10, num_tokens: 160, block_size: 16 };

    #[test]
    fn round_robin_rotates_by_the_counter() {
        let c = vec![cand(0, 0, 0, 0, 0), cand(2, 0, 0, 0, 0), cand(5, 0, 0, 0, 0)];
        assert_eq!(order(PolicyKind::RoundRobin, c.clone(), PROMPT, 4).0, vec![2, 5, 0]);
        assert_eq!(order(PolicyKind::RoundRobin, vec![], PROMPT, 4).0, Vec::<usize>::new());
    }

    #[test]
    fn cache_aware_follows_the_threshold_and_the_balance_rule() {
        // 4 of 10 blocks (0.4 > 0.3) on slot 1: a cache hit.
        let c = vec![cand(0, 0, 5, 0, 0), cand(1, 4, 50, 3, 0), cand(2, 2, 1, 0, 0)];
        assert_eq!(order(PolicyKind::CacheAware, c, PROMPT, 0), (vec![1, 2, 0], Reason::CacheHit));
        // 3 of 10 (0.3, not above): the smallest cache.
        let c = vec![cand(0, 3, 5, 0, 0), cand(1, 0, 2, 3, 0), cand(2, 0, 2, 0, 0)];
        assert_eq!(order(PolicyKind::CacheAware, c, PROMPT, 0), (vec![2, 1, 0], Reason::SmallestCache));
        // 100 vs 30 requests: 70 > 64 and 100 > 45: imbalanced, least loaded first despite the hit.
        let c = vec![cand(0, 10, 5, 60, 40), cand(1, 0, 2, 30, 0)];
        assert_eq!(order(PolicyKind::CacheAware, c, PROMPT, 0), (vec![1, 0], Reason::Imbalanced));
        // 100 vs 70: 30 is not over 64, so the hit stands.
        let c = vec![cand(0, 10, 5, 60, 40), cand(1, 0, 2, 70, 0)];
        assert_eq!(order(PolicyKind::CacheAware, c, PROMPT, 0).1, Reason::CacheHit);
    }

    #[test]
    fn kv_overlap_weighs_overlap_against_queue_and_kv_usage() {
        // Slot 0: all 10 blocks, longest queue: 3*1 + 2*0 + 2*1 = 5. Slot 1: nothing, empty queue: 0 + 2 + 2 = 4.
        let c = vec![cand(0, 10, 0, 4, 0), cand(1, 0, 0, 0, 0)];
        assert_eq!(order(PolicyKind::KvOverlap, c, PROMPT, 0).0, vec![0, 1]);
        // Half the blocks no longer outweigh the queue: 1.5 < 2.
        let c = vec![cand(0, 5, 0, 4, 0), cand(1, 0, 0, 0, 0)];
        assert_eq!(order(PolicyKind::KvOverlap, c, PROMPT, 0).0, vec![1, 0]);
        let mut c = vec![cand(0, 0, 0, 0, 0), cand(1, 0, 0, 0, 0)];
        c[0].load.kv_usage = 0.9;
        assert_eq!(order(PolicyKind::KvOverlap, c, PROMPT, 0).0, vec![1, 0]);
    }

    #[test]
    fn predictive_prefers_the_cached_replica_until_its_queue_costs_more() {
        // 10 ms per step + 0.1 ms per prefill token. Slot 0 caches 9 blocks (144 tokens): 1 step + 16 tokens.
        let c = vec![cand(0, 9, 0, 0, 0), cand(1, 0, 0, 0, 0)];
        assert_eq!(order(PolicyKind::Predictive, c, PROMPT, 0), (vec![0, 1], Reason::Ttft));
        let mut c = vec![cand(0, 9, 0, 1, 0), cand(1, 0, 0, 0, 0)];
        c[0].load.num_waiting_tokens = 1000; // 0.1 s of queued prefill outweighs 144 cached tokens
        assert_eq!(order(PolicyKind::Predictive, c, PROMPT, 0).0, vec![1, 0]);
    }

    #[test]
    fn names_round_trip() {
        for n in PolicyKind::NAMES {
            assert_eq!(PolicyKind::parse(n).map(PolicyKind::name), Some(n));
        }
        assert_eq!(PolicyKind::parse("random"), None);
        assert!(imbalanced(65, 0, &params()));
        assert!(!imbalanced(64, 0, &params()));
    }
}
