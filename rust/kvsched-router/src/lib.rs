//! kvsched-router: routes LLM requests across engine replicas by what each one has in its prefix cache.
//!
//! The router keeps an index of the prefix blocks every replica caches, fed by the replicas' block events
//! (stored / removed / cleared, in the shape of vLLM's KV cache events), and load signals per replica (waiting
//! and running requests, queued prefill tokens, KV usage) that the caller reports, corrected by the requests the
//! router itself sent since. A prompt is looked up as the chain of its block hashes: either hashed from its
//! tokens with kvsched's own chained block hash, or given by the caller. Five policies read this state:
//! round robin, least loaded, the cache-aware rule of vllm-router and SGLang, llm-d's weighted overlap score,
//! and a predictive one that estimates each replica's time to first token with `kvsched simulate`'s step-time
//! model. No Python here: `kvsched-py` binds it as `kvsched.router`.
//!
//! ```
//! use kvsched_router::{KvEvent, PolicyKind, Prompt, Router, RouterConfig, StepTimeCoefficients};
//!
//! let step_time = StepTimeCoefficients { step_s: 0.01, prefill_token_s: 1e-4, ..Default::default() };
//! let mut config = RouterConfig::new(PolicyKind::CacheAware, step_time);
//! config.block_size = 4;
//! let mut router = Router::new(config).unwrap();
//! router.add_replica("a").unwrap();
//! router.add_replica("b").unwrap();
//! // Replica b cached the blocks 11 -> 12 (keys as its events name them).
//! let stored = KvEvent::Stored { block_hashes: &[11, 12], parent_block_hash: None, token_ids: &[], block_size: 4 };
//! router.apply_events("b", &[stored]).unwrap();
//! let prompt = Prompt::BlockHashes { block_hashes: &[11, 12, 13], num_tokens: Some(14) };
//! let d = router.route("req-0", &prompt, None, None).unwrap();
//! assert_eq!((router.replica_name(d.slot), d.num_overlap_blocks), ("b", 2));
//! assert_eq!(router.remove_replica("b").unwrap(), vec!["req-0".to_string()]);
//! ```

pub mod config;
pub mod error;
pub mod event;
pub mod index;
pub mod load;
pub mod policy;
pub mod predict;
pub mod prompt;
pub mod router;
pub mod session;

pub use config::RouterConfig;
pub use error::{Result, RouterError};
pub use event::KvEvent;
pub use index::MAX_REPLICAS;
pub use load::LoadReport;
pub use policy::{PolicyKind, PolicyParams, Reason};
pub use predict::{estimate_ttft, StepTimeCoefficients};
pub use prompt::{key_of_bytes, Prompt, PromptKeys};
pub use router::{Decision, Ranking, Router};

#[cfg(test)]
mod tests;
