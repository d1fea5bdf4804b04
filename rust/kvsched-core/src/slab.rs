//! Dense storage for live requests. A slot is reused after its request finishes; each reuse bumps the slot's
//! generation so stale handles (from steps still in flight) are recognised as gone.
//!
//! The per-request fields the decode path reads and writes every step live apart from the request records, in
//! struct-of-arrays columns indexed by slot (`Hot`): a lock-step decode step streams these few contiguous
//! arrays (4 bytes a request per column) instead of touching two cache lines of every request's record.
//! Slots are dense (a freed slot is reused first), so the running requests' entries sit close together.

use std::sync::Arc;

use crate::error::{Result, SchedError};
use crate::request::{ReqHandle, Request};

/// Hot state, one entry per slot. `computed` and `in_flight` are the only copies of the request's computed and
/// in-flight token counts; the other columns are derived from fields of the record (`Slab::sync` refreshes them
/// from it, `check_hot` verifies them), so the decode path can decide from the columns alone that a running
/// request needs nothing but one more token: no new block, no block to cache, no drafts, placeholders, encoder
/// input or pending prefill.
#[derive(Clone, Debug, Default)]
pub struct Hot {
    /// Tokens whose KV is computed (vLLM's `num_computed_tokens`).
    pub computed: Vec<u32>,
    /// Tokens scheduled in steps whose output is not yet applied.
    pub in_flight: Vec<u32>,
    /// In-flight tokens of steps scheduled before the request was preempted: their output is still applied
    /// (or, with the record's `drop_stale_output`, discarded) but rolls nothing back; the request is not
    /// resumed meanwhile.
    pub stale: Vec<u32>,
    /// Mirror: `token_ids.len()`.
    pub num_tokens: Vec<u32>,
    /// The computed counts at which a decode of this request needs no block work (`DecodeLimits::span`):
    /// `decode_lo..=decode_hi`, empty (`1..=0`) for a request that is not plain. Derived from the record's
    /// prompt length, blocks, cached blocks and plain flag, and the scheduler's fixed limits.
    pub decode_lo: Vec<u32>,
    pub decode_hi: Vec<u32>,
    /// Mirror: `Slab::is_plain` of the record.
    pub plain: Vec<bool>,
    /// The scheduler's bounds the decode spans are derived from (fixed for its lifetime).
    pub limits: DecodeLimits,
}

/// The derived values, in column order: tokens, decode span (lo, hi), plain.
type Mirrors = (u32, u32, u32, bool);

impl Hot {
    /// What the derived columns of a request's slot must hold: computed from `req`, its record.
    #[inline(always)]
    fn mirrors_of(&self, req: &Request) -> Mirrors {
        let plain = Slab::is_plain(req);
        let (lo, hi) = if plain {
            self.limits.span(req.num_prompt_tokens, req.blocks.len() as u32, req.num_cached_blocks)
        } else {
            EMPTY_SPAN
        };
        (req.token_ids.len() as u32, lo, hi, plain)
    }

    /// Refreshes the derived columns of slot `s` from `req`, its record.
    #[inline]
    pub fn sync(&mut self, s: usize, req: &Request) {
        let (tokens, lo, hi, plain) = self.mirrors_of(req);
        self.num_tokens[s] = tokens;
        self.decode_lo[s] = lo;
        self.decode_hi[s] = hi;
        self.plain[s] = plain;
    }

    /// What `sync` writes for a request that is not plain, its token count aside: for a plain request that just
    /// took an output placeholder (its tokens unchanged).
    #[inline(always)]
    pub fn set_not_plain(&mut self, s: usize) {
        self.plain[s] = false;
        (self.decode_lo[s], self.decode_hi[s]) = EMPTY_SPAN;
    }

    /// The derived columns of slot `s`, as `mirrors_of` orders them.
    fn mirrors_at(&self, s: usize) -> Mirrors {
        (self.num_tokens[s], self.decode_lo[s], self.decode_hi[s], self.plain[s])
    }

    /// Whether the running request in slot `s`, with `computed` tokens computed, needs exactly its next token
    /// and no block work: a plain decode `schedule()` serves from the columns alone (`DecodeLimits::fits` on
    /// its record's values, precomputed as a span).
    #[inline(always)]
    pub fn fits(&self, s: usize, computed: u32) -> bool {
        in_decode_span(computed, self.num_tokens[s], self.decode_lo[s], self.decode_hi[s])
    }
}

/// The plain-decode check on a slot's columns: the next token is the last known one and `computed` lies in the
/// decode span (`Hot::fits`, and `Slab::plain_decode_run` on its pre-sliced columns).
#[inline(always)]
fn in_decode_span(computed: u32, tokens: u32, lo: u32, hi: u32) -> bool {
    computed + 1 == tokens && computed >= lo && computed <= hi
}

/// The span of a request that never fits (`lo > hi`).
const EMPTY_SPAN: (u32, u32) = (1, 0);

/// The bounds of the plain-decode check of `schedule()`, fixed for a scheduler's lifetime. The default fits
/// nothing (every request takes the general path) until the scheduler sets its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeLimits {
    pub max_model_len: i64,
    pub max_slots: u32,
    pub lookahead: u32,
    pub block_size: u32,
    pub caching: bool,
}

impl DecodeLimits {
    /// Whether a running request with these values needs exactly its next token and no block work (no new
    /// block, no full block to cache). The reference form of the check: the decode path reads the same
    /// answer from the span `span` precomputes (`Hot::fits`); a test checks that the two agree.
    #[cfg(test)]
    pub fn fits(
        &self,
        plain: bool,
        computed: u32,
        tokens: u32,
        prompt: u32,
        blocks: u32,
        cached: u32,
    ) -> bool {
        plain
            && computed + 1 == tokens
            && computed >= prompt
            && i64::from(computed) + 2 <= self.max_model_len
            && computed < self.max_slots
            && (computed + 1 + self.lookahead).min(self.max_slots).div_ceil(self.block_size) <= blocks
            && (!self.caching || (computed + 1) / self.block_size <= cached)
    }

    /// The computed counts `lo..=hi` at which a plain request with this prompt length, block count and cached
    /// block count needs no block work for its next token (`fits` with `computed + 1 == tokens`, solved for
    /// `computed`): at least its prompt; room for the token within `max_model_len` and `max_slots`; its blocks
    /// hold `computed + 1 + lookahead` slots (capped at `max_slots`); with caching, the token completes no
    /// block beyond the cached ones. `(1, 0)` when there is none.
    pub fn span(&self, prompt: u32, blocks: u32, cached: u32) -> (u32, u32) {
        let bs = i64::from(self.block_size);
        let mut hi = (self.max_model_len - 2).min(i64::from(self.max_slots) - 1);
        let room = i64::from(blocks) * bs;
        if i64::from(self.max_slots) > room {
            hi = hi.min(room - 1 - i64::from(self.lookahead));
        }
        if self.caching {
            hi = hi.min((i64::from(cached) + 1) * bs - 2);
        }
        let lo = i64::from(prompt);
        if self.block_size == 0 || hi < lo {
            return EMPTY_SPAN;
        }
        (prompt, hi.min(i64::from(u32::MAX - 1)) as u32)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Slab {
    slots: Vec<Option<Request>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    live: usize,
    pub hot: Hot,
}

impl Slab {
    /// An empty slab for a scheduler with these decode limits.
    pub fn new(limits: DecodeLimits) -> Self {
        Slab { hot: Hot { limits, ..Hot::default() }, ..Slab::default() }
    }

    /// The handle the next `insert` will use.
    pub fn next_handle(&self) -> ReqHandle {
        match self.free.last() {
            Some(&slot) => ReqHandle { slot, gen: self.gens[slot as usize] },
            None => ReqHandle { slot: self.slots.len() as u32, gen: 0 },
        }
    }

    /// Stores `req` at `req.handle`, which must come from `next_handle()`, with nothing computed or in flight.
    pub fn insert(&mut self, req: Request) {
        let slot = req.handle.slot as usize;
        if slot == self.slots.len() {
            self.slots.push(Some(req));
            self.gens.push(0);
            let h = &mut self.hot;
            h.computed.push(0);
            h.in_flight.push(0);
            h.stale.push(0);
            h.num_tokens.push(0);
            h.decode_lo.push(EMPTY_SPAN.0);
            h.decode_hi.push(EMPTY_SPAN.1);
            h.plain.push(false);
        } else {
            self.free.pop();
            self.slots[slot] = Some(req);
            self.hot.computed[slot] = 0;
            self.hot.in_flight[slot] = 0;
            self.hot.stale[slot] = 0;
        }
        self.live += 1;
        self.sync(slot as u32);
    }

    /// Whether the decode path may treat `req` as a plain decode: nothing but its next token to schedule (no
    /// prefill chunk pending, no drafts, no async placeholders, no encoder inputs, not in the in-flight prefill
    /// set).
    #[inline(always)]
    pub fn is_plain(req: &Request) -> bool {
        !req.is_prefill_chunk
            && req.num_output_placeholders == 0
            && req.spec_token_ids.is_empty()
            && req.encoder_inputs.is_empty()
            // Encoder-decoder: every output gives its slots back (`encoder_dec.rs`).
            && req.cross_attention_tokens == 0
            && !req.inflight_prefill
    }

    /// Refreshes the mirror columns of `slot` from its record (after anything that may change them).
    #[inline]
    pub fn sync(&mut self, slot: u32) {
        if let Some(Some(req)) = self.slots.get(slot as usize) {
            self.hot.sync(slot as usize, req);
        }
    }

    /// Starts fetching the first two cache lines of the record in `slot` (a hint: no load, no effect).
    #[inline(always)]
    pub fn prefetch_record(&self, slot: u32) {
        let p = self.slots.as_ptr().wrapping_add(slot as usize).cast::<u8>();
        crate::block_pool::prefetch(p);
        crate::block_pool::prefetch(p.wrapping_add(64));
    }

    /// The mirror columns of the running requests (those the decode path reads them for) agree with their
    /// records.
    pub fn check_hot(&self, running: &[u32]) -> std::result::Result<(), String> {
        for &slot in running {
            let s = slot as usize;
            let Some(Some(req)) = self.slots.get(s) else { continue };
            let (got, want) = (self.hot.mirrors_at(s), self.hot.mirrors_of(req));
            if got != want {
                return Err(format!(
                    "request {:?}: hot columns (tokens, decode span lo and hi, plain) {got:?} != record {want:?}",
                    req.id
                ));
            }
        }
        Ok(())
    }

    /// The generation of `slot` (that of its request while one is live).
    #[inline(always)]
    pub fn gen(&self, slot: u32) -> u32 {
        self.gens[slot as usize]
    }

    /// Schedules the plain decodes (`DecodeLimits::fits`) at `running[i..]` from the hot columns alone, one
    /// token each, until a request that is not one or the end of `budget`: advances their computed count and
    /// appends their handle and computed count before the step to `handles` and `computed_before`. Returns the
    /// position of the first request it left. The columns are sliced to one length up front, so a request
    /// costs one bounds check instead of one per column.
    #[inline]
    pub(crate) fn plain_decode_run(
        &mut self,
        running: &[u32],
        mut i: usize,
        budget: &mut u32,
        handles: &mut Vec<ReqHandle>,
        computed_before: &mut Vec<i32>,
    ) -> usize {
        let m = self.gens.len();
        let gens = &self.gens[..m];
        let h = &mut self.hot;
        let computed_col = &mut h.computed[..m];
        let in_flight = &mut h.in_flight[..m];
        let (tokens, lo, hi) = (&h.num_tokens[..m], &h.decode_lo[..m], &h.decode_hi[..m]);
        while *budget > 0 {
            let Some(&slot) = running.get(i) else { break };
            let s = slot as usize;
            if s >= m {
                break;
            }
            let computed = computed_col[s];
            if !in_decode_span(computed, tokens[s], lo[s], hi[s]) {
                break;
            }
            computed_col[s] = computed + 1;
            in_flight[s] += 1;
            handles.push(ReqHandle { slot, gen: gens[s] });
            computed_before.push(computed as i32);
            *budget -= 1;
            i += 1;
        }
        i
    }

    /// A request's computed tokens.
    #[inline(always)]
    pub fn computed(&self, slot: u32) -> u32 {
        self.hot.computed[slot as usize]
    }

    /// The request in `slot` and the hot columns (to read and write its computed / in-flight counts with it).
    pub fn get_mut_hot(&mut self, slot: u32) -> Result<(&mut Request, &mut Hot)> {
        let req = self
            .slots
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| SchedError::Internal(format!("no live request in slot {slot}")))?;
        Ok((req, &mut self.hot))
    }

    /// The records (by slot) and the hot columns, borrowed apart (for loops that read and write both).
    #[inline(always)]
    pub fn parts_mut(&mut self) -> (&mut [Option<Request>], &mut Hot) {
        (&mut self.slots, &mut self.hot)
    }

    /// `resolve_mut` with the hot columns.
    pub fn resolve_mut_hot(&mut self, h: ReqHandle) -> Option<(&mut Request, &mut Hot)> {
        let req = self.slots.get_mut(h.slot as usize).and_then(Option::as_mut).filter(|r| r.handle == h)?;
        Some((req, &mut self.hot))
    }

    /// Frees `slot` and drops its request where it lies (a record is a few hundred bytes: moving it out to drop
    /// it costs more than the drop). Returns the request's id, or `None` for an empty slot.
    pub fn remove(&mut self, slot: u32) -> Option<Arc<str>> {
        let entry = self.slots.get_mut(slot as usize)?;
        let id = entry.as_ref()?.id.clone();
        *entry = None;
        self.gens[slot as usize] = self.gens[slot as usize].wrapping_add(1);
        self.free.push(slot);
        self.live -= 1;
        Some(id)
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn get(&self, slot: u32) -> Result<&Request> {
        self.slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| SchedError::Internal(format!("no live request in slot {slot}")))
    }

    pub fn get_mut(&mut self, slot: u32) -> Result<&mut Request> {
        self.slots
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| SchedError::Internal(format!("no live request in slot {slot}")))
    }

    /// The request in `slot`, if any (no error path: for hints such as prefetching).
    #[inline]
    pub fn peek(&self, slot: u32) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// The request behind `h`, if it is still the same live request.
    pub fn resolve(&self, h: ReqHandle) -> Option<&Request> {
        self.slots.get(h.slot as usize).and_then(Option::as_ref).filter(|r| r.handle == h)
    }

    pub fn resolve_mut(&mut self, h: ReqHandle) -> Option<&mut Request> {
        self.slots.get_mut(h.slot as usize).and_then(Option::as_mut).filter(|r| r.handle == h)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().filter_map(Option::as_ref)
    }
}

#[cfg(test)]
mod tests {
    use super::{DecodeLimits, EMPTY_SPAN};

    /// The precomputed span answers exactly what the direct check answers, for every computed count, over
    /// block sizes, lookahead, caching on and off, and a KV cache smaller than `max_model_len`.
    #[test]
    fn decode_span_agrees_with_the_direct_check() {
        let mut checked = 0u64;
        for block_size in [1u32, 2, 4, 16] {
            for (max_model_len, max_slots) in [(64i64, 64u32), (64, 40), (40, 64), (1, 64), (2, 64)] {
                for lookahead in [0u32, 1, 3, 17] {
                    for caching in [false, true] {
                        let lim = DecodeLimits { max_model_len, max_slots, lookahead, block_size, caching };
                        for prompt in [0u32, 1, 5, 16, 63] {
                            for blocks in 0..=(70 / block_size + 1) {
                                for cached in 0..=blocks {
                                    let (lo, hi) = lim.span(prompt, blocks, cached);
                                    for plain in [false, true] {
                                        let (lo, hi) = if plain { (lo, hi) } else { EMPTY_SPAN };
                                        for computed in 0..80u32 {
                                            let want = lim.fits(
                                                plain,
                                                computed,
                                                computed + 1,
                                                prompt,
                                                blocks,
                                                cached,
                                            );
                                            let got = computed >= lo && computed <= hi;
                                            assert_eq!(
                                                got, want,
                                                "{lim:?} prompt {prompt} blocks {blocks} cached {cached} \
                                                 plain {plain} computed {computed}"
                                            );
                                            checked += u64::from(want);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 10_000, "the check must cover many fitting cases, got {checked}");
    }

    #[test]
    fn default_limits_fit_nothing() {
        assert_eq!(DecodeLimits::default().span(0, 100, 100), EMPTY_SPAN);
    }
}
