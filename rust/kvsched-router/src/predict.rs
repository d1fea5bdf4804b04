//! The predictive estimate: how long a request would wait for its first token on a replica.
//!
//! It prices the replica's work ahead of the request with the step-time model of `kvsched simulate`
//! (`kvsched.sim.steptime`, the same linear form and coefficient names), under a simple mirror of a vLLM-style
//! scheduler: first-come first-served prefill, a token budget of `max_num_batched_tokens` per step shared with
//! one decode token per running request, and the request's own cached prefix skipped. With `W` waiting requests
//! holding `P_w` uncached prompt tokens, `D` running requests attending to `K` context tokens, and the request's
//! own `u` uncached tokens after `c` cached ones:
//!
//! ```text
//! steps  n = ceil((P_w + u) / max(1, max_num_batched_tokens - D))
//! ttft     = n * (step_s + decode_req_s * D + kv_token_s * K)
//!          + prefill_token_s * (P_w + u)
//!          + prefill_req_s * max(n, W + 1)                                   (at least one chunk per step)
//!          + prefill_attn_s * (pairs(u, c) + W * pairs(P_w / W, 0))           (waiting prompts of mean length)
//!          + prefill_attn_spill_s * (spill(pairs(u, c)) + W * spill(pairs(P_w / W, 0)))
//!          + lone_prefill_token_s * u                                         (only when W = 0 and D = 0)
//! pairs(n, c) = n * (2c + n + 1) / 2,   spill(p) = max(0, p - attn_spill_pairs)
//! ```
//!
//! It leaves out swaps, preemption, `max_num_seqs` and the growth of contexts while the request waits: an
//! estimate for ranking replicas, not a simulation.

use crate::error::{Result, RouterError};
use crate::load::LoadReport;

/// Coefficients of the step-time model, in seconds per unit (names and units as `kvsched.sim.steptime`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimeCoefficients {
    pub step_s: f64,
    pub prefill_token_s: f64,
    pub prefill_req_s: f64,
    pub decode_req_s: f64,
    pub kv_token_s: f64,
    pub prefill_attn_s: f64,
    pub prefill_attn_spill_s: f64,
    pub lone_prefill_token_s: f64,
    pub attn_spill_pairs: f64,
}

impl StepTimeCoefficients {
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("step_s", self.step_s),
            ("prefill_token_s", self.prefill_token_s),
            ("prefill_req_s", self.prefill_req_s),
            ("decode_req_s", self.decode_req_s),
            ("kv_token_s", self.kv_token_s),
            ("prefill_attn_s", self.prefill_attn_s),
            ("prefill_attn_spill_s", self.prefill_attn_spill_s),
            ("lone_prefill_token_s", self.lone_prefill_token_s),
            ("attn_spill_pairs", self.attn_spill_pairs),
        ];
        for (name, v) in fields {
            if !(v.is_finite() && v >= 0.0) {
                return Err(RouterError::InvalidConfig(format!(
                    "step-time coefficient {name} must be a finite number >= 0, got {v}"
                )));
            }
        }
        Ok(())
    }

    fn spill(&self, pairs: f64) -> f64 {
        (pairs - self.attn_spill_pairs).max(0.0)
    }
}

fn pairs(n: f64, cached: f64) -> f64 {
    n * (2.0 * cached + n + 1.0) / 2.0
}

/// The estimated time to first token, in seconds, of a prompt of `num_tokens` tokens of which the replica caches
/// `num_cached_tokens` (at most `num_tokens - 1`: the last token is always computed).
pub fn estimate_ttft(
    m: &StepTimeCoefficients,
    max_num_batched_tokens: u64,
    load: &LoadReport,
    num_tokens: u64,
    num_cached_tokens: u64,
) -> f64 {
    let cached = num_cached_tokens.min(num_tokens.saturating_sub(1));
    let u = (num_tokens - cached).max(1) as f64;
    let c = cached as f64;
    let w = load.num_waiting as f64;
    let pw = load.num_waiting_tokens as f64;
    let d = load.num_running as f64;
    let k = load.num_running_tokens as f64;
    let per_step_budget = (max_num_batched_tokens.saturating_sub(load.num_running)).max(1) as f64;
    let steps = ((pw + u) / per_step_budget).ceil().max(1.0);
    let own_pairs = pairs(u, c);
    let (queued_pairs, queued_spill) = if load.num_waiting > 0 {
        let p = pairs(pw / w, 0.0);
        (w * p, w * m.spill(p))
    } else {
        (0.0, 0.0)
    };
    let lone = if load.num_waiting == 0 && load.num_running == 0 { u } else { 0.0 };
    steps * (m.step_s + m.decode_req_s * d + m.kv_token_s * k)
        + m.prefill_token_s * (pw + u)
        + m.prefill_req_s * steps.max(w + 1.0)
        + m.prefill_attn_s * (own_pairs + queued_pairs)
        + m.prefill_attn_spill_s * (m.spill(own_pairs) + queued_spill)
        + m.lone_prefill_token_s * lone
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coefs() -> StepTimeCoefficients {
        StepTimeCoefficients {
            step_s: 0.01,
            prefill_token_s: 1e-4,
            prefill_req_s: 1e-3,
            decode_req_s: 2e-4,
            kv_token_s: 1e-7,
            prefill_attn_s: 1e-9,
            prefill_attn_spill_s: 0.0,
            lone_prefill_token_s: 0.0,
            attn_spill_pairs: 0.0,
        }
    }

    #[test]
    fn a_hand_computed_case() {
        // 2 waiting requests with 1000 uncached tokens, 10 running over 5000 context tokens; our prompt has 600
        // tokens of which 256 are cached. Budget 512 per step, 502 after decodes: ceil(1344 / 502) = 3 steps.
        let load = LoadReport {
            num_waiting: 2,
            num_running: 10,
            num_waiting_tokens: 1000,
            num_running_tokens: 5000,
            kv_usage: 0.0,
        };
        let got = estimate_ttft(&coefs(), 512, &load, 600, 256);
        let steps = 3.0;
        let own_pairs = 344.0 * (512.0 + 344.0 + 1.0) / 2.0;
        let queued_pairs = 2.0 * (500.0 * 501.0 / 2.0);
        let want = steps * (0.01 + 2e-4 * 10.0 + 1e-7 * 5000.0)
            + 1e-4 * 1344.0
            + 1e-3 * 3.0
            + 1e-9 * (own_pairs + queued_pairs);
        assert!((got - want).abs() < 1e-12, "{got} != {want}");
        assert!((want - 0.175_297_904).abs() < 1e-12, "the hand arithmetic: {want}");
    }

    #[test]
    fn an_idle_replica_prices_the_lone_prefill_and_the_last_token() {
        let m = StepTimeCoefficients {
            lone_prefill_token_s: 1e-5,
            attn_spill_pairs: 10.0,
            prefill_attn_spill_s: 1e-6,
            ..coefs()
        };
        // Fully cached: one token is still computed, alone, in one step.
        let got = estimate_ttft(&m, 8192, &LoadReport::default(), 64, 64);
        let own = 1.0 * (2.0 * 63.0 + 2.0) / 2.0;
        let want = 0.01 + 1e-4 + 1e-3 + 1e-9 * own + 1e-6 * (own - 10.0) + 1e-5;
        assert!((got - want).abs() < 1e-12, "{got} != {want}");
        assert!(m.validate().is_ok());
        assert!(StepTimeCoefficients { step_s: -1.0, ..m }.validate().is_err());
        assert!(StepTimeCoefficients { kv_token_s: f64::NAN, ..m }.validate().is_err());
    }
}
