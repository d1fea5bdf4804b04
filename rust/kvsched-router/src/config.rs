//! The router's configuration. Defaults follow the routers it learns from: cache threshold 0.3 and balance
//! thresholds 64 / 1.5 (vllm-router, SGLang), score weights 3 / 2 / 2 (llm-d). The step-time coefficients of the
//! predictive policy have no default here: the Python API passes `kvsched.sim.steptime`'s default preset.

use kvsched_core::HashAlgo;

use crate::error::{Result, RouterError};
use crate::policy::{PolicyKind, PolicyParams};
use crate::predict::StepTimeCoefficients;

#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    pub policy: PolicyKind,
    /// Tokens per block, as the replicas cache them.
    pub block_size: usize,
    pub prefix_hash_algo: HashAlgo,
    /// The seed bytes as `SchedulerConfig.prefix_hash_seed` reaches the core; `None` draws a random seed, so
    /// token lookups only match what this router itself records.
    pub prefix_hash_seed: Option<Vec<u8>>,
    pub params: PolicyParams,
    /// Route requests sharing a `session_id` to the replica the previous one went to, while that replica is
    /// healthy and not overloaded by the balance rule.
    pub sticky_sessions: bool,
    pub max_sessions: usize,
    /// Record a routed prompt's full blocks as cached on its replica at once, as routers that guess the cache from
    /// the requests they routed do. For replicas that publish no block events.
    pub record_routed_prefixes: bool,
}

impl RouterConfig {
    pub fn new(policy: PolicyKind, step_time: StepTimeCoefficients) -> Self {
        RouterConfig {
            policy,
            block_size: 16,
            prefix_hash_algo: HashAlgo::Xxh3_128,
            prefix_hash_seed: None,
            params: PolicyParams {
                cache_threshold: 0.3,
                balance_abs_threshold: 64,
                balance_rel_threshold: 1.5,
                overlap_weight: 3.0,
                queue_weight: 2.0,
                kv_usage_weight: 2.0,
                step_time,
                max_num_batched_tokens: 8192,
            },
            sticky_sessions: false,
            max_sessions: 100_000,
            record_routed_prefixes: false,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(RouterError::InvalidConfig(msg));
        let p = &self.params;
        if self.block_size == 0 {
            return bad("block_size must be >= 1".into());
        }
        if !(p.cache_threshold.is_finite() && (0.0..=1.0).contains(&p.cache_threshold)) {
            return bad(format!("cache_threshold must be in [0, 1], got {}", p.cache_threshold));
        }
        if !(p.balance_rel_threshold.is_finite() && p.balance_rel_threshold >= 1.0) {
            return bad(format!(
                "balance_rel_threshold must be a finite number >= 1, got {}",
                p.balance_rel_threshold
            ));
        }
        for (name, w) in [
            ("overlap_weight", p.overlap_weight),
            ("queue_weight", p.queue_weight),
            ("kv_usage_weight", p.kv_usage_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return bad(format!("{name} must be a finite number >= 0, got {w}"));
            }
        }
        if p.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be >= 1".into());
        }
        p.step_time.validate()?;
        Ok(())
    }
}
