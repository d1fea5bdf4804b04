//! kvsched-core: the scheduler core of an LLM inference engine, in pure Rust.
//!
//! It decides, every engine step, which requests run, how many tokens each computes (prefill chunks and
//! decodes share one token budget), which KV-cache blocks they occupy, which prompt prefixes are reused from the
//! cache, and whom to preempt when blocks run out. The semantics follow vLLM v1's scheduler; `docs/semantics.md`
//! in the repository is the contract. No Python types appear here: the `kvsched-py` crate binds this to Python.
//!
//! ```
//! use kvsched_core::{Ragged, RequestParams, Scheduler, SchedulerConfig};
//!
//! let config = SchedulerConfig { num_blocks: 64, max_model_len: 512, ..Default::default() };
//! let mut sched = Scheduler::new(config).unwrap();
//! sched.add_request("r0", &[1, 2, 3, 4, 5], RequestParams { max_tokens: Some(2), ..Default::default() }).unwrap();
//! while sched.has_unfinished_requests() {
//!     let out = sched.schedule().unwrap();
//!     let indptr: Vec<i64> = (0..=out.num_reqs() as i64).collect();
//!     let values = vec![7i64; out.num_reqs()];
//!     let sampled = Ragged { values: &values, indptr: &indptr };
//!     sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap();
//! }
//! assert_eq!(sched.num_free_blocks(), 63);
//! ```

mod admission;
pub mod block_pool;
mod cache_table;
pub mod config;
pub mod connector;
mod connector_sched;
pub mod ec_connector;
pub mod encoder;
mod encoder_dec;
mod encoder_sched;
pub mod error;
pub mod events;
pub mod fair;
pub mod free_queue;
pub mod hashing;
pub mod hit_cap;
pub mod hybrid;
mod hybrid_kv;
mod introspect;
pub mod kv_cache_manager;
pub mod model_inputs;
pub mod order;
pub mod output;
pub mod pickle_hash;
mod pins;
pub mod queue;
pub mod request;
pub mod scheduler;
pub mod session;
pub mod slab;
mod step;
mod stream;
pub mod swap;
mod swap_sched;
mod update;
mod victim;

pub use config::{
    HashAlgo, KvLoadFailurePolicy, PauseState, Policy, PreemptionMode, PreemptionVictim, SchedulerConfig,
    CHUNKED_LOCAL, CROSS_ATTENTION, MAMBA, MAX_CHUNK_SIZE, RING,
};
pub use connector::{KvConnector, KvTransferReport};
pub use ec_connector::EcConnector;
pub use encoder::EncoderInput;
pub use error::{Result, SchedError};
pub use events::KvCacheEvents;
pub use fair::{Tenant, DEFAULT_TENANT};
pub use hashing::BlockHash;
pub use hit_cap::CacheHitCap;
pub use output::{ModelInputs, SchedulerOutput, SchedulerStats, UpdateResult};
pub use request::{
    FinishReason, InputPart, ReqHandle, Request, RequestParams, RequestStatus, SPEC_PLACEHOLDER,
};
pub use scheduler::{Scheduler, MAX_TOKEN_ID};
pub use update::Ragged;

#[cfg(test)]
mod tests;
