//! The encoder-cache (EC) connector, scheduler side: the two hooks of vLLM's `ECConnectorBase` (scheduler role)
//! that change what a step schedules.
//!
//! - `has_cache_item(hash)`: asked for an encoder input that is not in the local encoder cache, once it fits the
//!   step's encoder budget and the cache (vLLM 0.33's `_try_schedule_encoder_inputs`). `true`: the connector
//!   loads its output, so it is allocated in the cache (it takes space) but not computed and not charged to the
//!   budget; the step lists it in `scheduled_encoder_loads` instead of `scheduled_encoder_inputs`.
//! - `ensure_cache_available(req, num_computed_tokens)`: asked of a request with encoder inputs before each
//!   step plans it (a running request with its computed tokens less output placeholders; a waiting one after
//!   its prefix-cache and KV-connector lookups, with the tokens they cover). `false`: a transfer is still in
//!   progress; the request is not scheduled in this step (a waiting one keeps its place).
//!
//! The rest of vLLM's EC connector interface (metadata, allocation and free notifications, worker output) does
//! not change a scheduling decision; a host calls it around the core's calls. `encoder_sched.rs` asks the hooks;
//! with no connector set, the step loop never calls one.

use crate::request::Request;

/// The hooks the scheduler calls (vLLM's `ECConnectorBase`, scheduler role). A hook cannot fail from the
/// core's point of view: an implementation that hits an error answers conservatively (`has_cache_item`:
/// `false`, the input is computed; `ensure_cache_available`: `true`) and reports the error its own way.
pub trait EcConnector: Send + Sync {
    /// Whether the connector can supply the encoder output of `hash`.
    fn has_cache_item(&mut self, hash: u64) -> bool;

    /// Whether every encoder output `req` needs from `num_computed_tokens` on is available (or needs no
    /// transfer); `false` defers the request for this step.
    fn ensure_cache_available(&mut self, _req: &Request, _num_computed_tokens: u32) -> bool {
        true
    }

    /// Once a request with encoder work is scheduled: each input it computes, then each it loads (vLLM's
    /// `update_state_after_alloc`, in the same place of the step). Decides nothing.
    fn update_state_after_alloc(&mut self, _req: &Request, _input: u32) {}
}

/// An EC connector in the scheduler (a newtype so the scheduler can stay `Debug`).
pub(crate) struct EcConn(pub Box<dyn EcConnector>);

impl std::fmt::Debug for EcConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EcConnector")
    }
}
