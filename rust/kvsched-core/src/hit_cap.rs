//! The cache-hit cap: an optional hook that bounds the prefix hit of a request at its admission (vLLM 0.33's
//! auxiliary output connector, `max_cache_hit` and `cap_external_hit`).
//!
//! A host that keeps something per KV block beside the KV itself (vLLM's routed-experts capture keeps the
//! experts each token was routed to) can only reuse a cached block whose extra data it still holds. The hook
//! tells the scheduler how far a request's hit may reach:
//!
//! - `max_cache_hit(req, cached)`: asked at the lookup of a request with nothing computed (not blocked for
//!   another reason), before the prefix cache is searched: the most tokens the local hit may cover. The lookup
//!   then stops at `max / block_size` blocks (and, as always, before the block of the request's last token).
//! - `cap_external_hit(req, cached, num_local, num_external)`: with a KV connector, after the connector's
//!   answer: the external tokens the request may load on top of `num_local` local hit tokens. The answer is
//!   clamped to `num_external`; 0 loads nothing (and an asynchronous load becomes none).
//!
//! `cached[i]` says whether the prefix cache holds a block with the hash of the request's full block `i` now
//! (one entry per full block of its tokens): what a host needs to answer without calling back into the
//! scheduler. With no hook set nothing is asked and the hits are the plain ones.

use crate::request::Request;

/// The hooks (see the module doc). A hook cannot fail from the core's point of view: an implementation that
/// hits an error answers conservatively (no hit: 0) and reports the error its own way.
pub trait CacheHitCap: Send + Sync {
    /// The most tokens the local prefix hit of `req` may cover.
    fn max_cache_hit(&mut self, req: &Request, cached: &[bool]) -> u32;

    /// The external tokens `req` may load beyond `num_local` local hit tokens, of the `num_external` the KV
    /// connector offers (the answer is clamped to `num_external`).
    fn cap_external_hit(&mut self, req: &Request, cached: &[bool], num_local: u32, num_external: u32) -> u32;
}

/// A cap in the scheduler (a newtype so the scheduler can stay `Debug`).
pub(crate) struct HitCap(pub Box<dyn CacheHitCap>);

impl std::fmt::Debug for HitCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheHitCap")
    }
}

/// For each full block of `req`, whether the prefix cache holds a block with its hash now.
pub(crate) fn cached_mask(kv: &crate::kv_cache_manager::KvCacheManager, req: &Request) -> Vec<bool> {
    req.block_hashes.iter().map(|h| kv.pool.get_cached_block(h).is_some()).collect()
}
