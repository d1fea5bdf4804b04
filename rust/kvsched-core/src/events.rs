//! The prefix cache's block events, in the shape of vLLM's KV cache events (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), recorded only with `enable_kv_cache_events` and taken by the host (once per step, or
//! whenever it likes) in the order they happened.
//!
//! - stored: full blocks of one request entered the prefix cache of one KV cache group, a run of blocks each the
//!   child of the one before, the first the child of `parent` (`None` for the prompt's first block), with the
//!   tokens of the run and the request's LoRA name and cache salt (the extra keys of their hashes). In a
//!   sliding-window or chunked-local group, the run's blocks no longer in its window are null blocks and are not
//!   stored: the event lists the hashes of the others (the run's last ones; possibly none, as in vLLM) while its
//!   tokens and parent still span the whole run. An align-mode Mamba group's run lists its cached states the same
//!   way (the null blocks between them not stored), and a prefill checkpoint keyed apart from its run is a stored
//!   event of its one block;
//! - removed: one block left the prefix cache of its group (its block was reused, or a failed step took it out
//!   again);
//! - cleared: the whole prefix cache was dropped (`reset_prefix_cache`).
//!
//! Every stored and removed event names its KV cache group (`groups`, 0 with one group) and carries the blocks'
//! own hashes, the same in every group (vLLM's `group_idx` and block hashes); the cache keys them per group.
//!
//! As in vLLM, the events are per block, not per hash: two blocks cached under the same hash (two requests that
//! computed the same prefix) are stored twice and removed twice. `num_copies[i]` says how many blocks of the
//! event's group carry block `i`'s hash right after its event (>= 1 after a store, >= 0 after a removal), so a consumer that keeps a
//! set of hashes adds a hash when a store leaves 1 copy and drops it when a removal leaves 0.
//!
//! A stored event gives its blocks' size in tokens (`block_sizes`): its group's block size (KV cache groups may have
//! different ones, `SchedulerConfig::kv_cache_group_block_sizes`), or the hash block for a prompt's tail entry
//! (below). Its block hashes, parent and block indices are then the request's hashes at that group's block ends:
//! block `i` of a group whose blocks hold `k` hash blocks is keyed by the request's hash `(i + 1) * k - 1`.
//!
//! - tail entry (groups of different block sizes): a full-attention group whose blocks are larger than the hash
//!   block also files the prompt's last full hash block, when it ends inside one of its blocks, as a second key
//!   of that block (as vLLM does: a stored event of that one hash block, `block_sizes` the hash block, its index
//!   and first block counted in hash blocks). That key leaves the cache with its block (a removed event right
//!   after the block's own).
//!
//! A stored event also names the storing request, the index of the run's first block in its block table (the
//! request's blocks cached before it) and the index of each stored block in that table (`block_positions`:
//! sparse retention, `prefix_cache_retention_interval`, may leave holes anywhere in a window group's run), so that
//! a host which keys blocks by hashes of its own (vLLM's adapter) can translate the run from the request's hashes.
//!
//! Struct of arrays, ragged data as values plus offsets: event `e`'s blocks are
//! `block_hashes[block_indptr[e]..block_indptr[e + 1]]` and its tokens `token_ids[token_indptr[e]..
//! token_indptr[e + 1]]`. Invariant (`check`): every offset list starts at 0, has one entry per event plus one
//! and never decreases; removed events hold one block and no tokens, cleared events neither (and group 0).

use std::sync::Arc;

use crate::hashing::{BlockHash, ExtraKeys};

/// `KvCacheEvents::kinds`: full blocks entered the prefix cache.
pub const STORED: u8 = 0;
/// `KvCacheEvents::kinds`: one block left the prefix cache.
pub const REMOVED: u8 = 1;
/// `KvCacheEvents::kinds`: the whole prefix cache was dropped.
pub const CLEARED: u8 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheEvents {
    /// Per event: `STORED`, `REMOVED` or `CLEARED`.
    pub kinds: Vec<u8>,
    /// Offsets of each event's blocks in `block_hashes` (one more entry than events).
    pub block_indptr: Vec<u32>,
    pub block_hashes: Vec<BlockHash>,
    /// Per block: the blocks carrying its hash right after its event.
    pub num_copies: Vec<u32>,
    /// Per block: a stored block's index in its request's block table (0 for a removed block).
    pub block_positions: Vec<u32>,
    /// Per event: the hash of the block before a stored run (`None` for a prompt's first block, and for
    /// removed and cleared events).
    pub parents: Vec<Option<BlockHash>>,
    /// Offsets of each event's tokens in `token_ids` (one more entry than events).
    pub token_indptr: Vec<u32>,
    pub token_ids: Vec<u32>,
    /// Per event: the storing request's LoRA name and cache salt (empty for removed and cleared events).
    pub extra_keys: Vec<ExtraKeys>,
    /// Per event: the storing request (`None` for removed and cleared events).
    pub req_ids: Vec<Option<Arc<str>>>,
    /// Per event: the index of a stored run's first block in its request's block table (0 for the others).
    pub num_cached_blocks: Vec<u32>,
    /// Per event: the KV cache group of a stored run or a removed block (0 for cleared events).
    pub groups: Vec<u32>,
    /// Per event: tokens per block of a stored run (its group's block size, or the hash block for a prompt's
    /// tail entry; 0 for removed and cleared events).
    pub block_sizes: Vec<u32>,
}

impl Default for KvCacheEvents {
    fn default() -> Self {
        KvCacheEvents {
            kinds: Vec::new(),
            block_indptr: vec![0],
            block_hashes: Vec::new(),
            num_copies: Vec::new(),
            block_positions: Vec::new(),
            parents: Vec::new(),
            token_indptr: vec![0],
            token_ids: Vec::new(),
            extra_keys: Vec::new(),
            req_ids: Vec::new(),
            num_cached_blocks: Vec::new(),
            groups: Vec::new(),
            block_sizes: Vec::new(),
        }
    }
}

impl KvCacheEvents {
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Ends an event: closes its block and token ranges.
    fn close(
        &mut self,
        kind: u8,
        parent: Option<BlockHash>,
        extra: ExtraKeys,
        req: Option<(Arc<str>, u32)>,
        group: u32,
        block_size: u32,
    ) {
        self.kinds.push(kind);
        self.groups.push(group);
        self.block_sizes.push(block_size);
        let (req_id, first) = req.map_or((None, 0), |(id, first)| (Some(id), first));
        self.req_ids.push(req_id);
        self.num_cached_blocks.push(first);
        self.block_indptr.push(self.block_hashes.len() as u32);
        self.token_indptr.push(self.token_ids.len() as u32);
        self.parents.push(parent);
        self.extra_keys.push(extra);
    }

    /// A run of blocks of request `req_id`, from its block `first` on, entered the cache of group `group`:
    /// `blocks` gives each stored block's hash, its number of copies after the store and its index in the
    /// request's block table; `tokens` are the tokens of the whole run, `block_size` per block.
    #[allow(clippy::too_many_arguments)]
    pub fn push_stored(
        &mut self,
        blocks: impl Iterator<Item = (BlockHash, u32, u32)>,
        parent: Option<BlockHash>,
        tokens: &[u32],
        extra: &ExtraKeys,
        req_id: &Arc<str>,
        first: u32,
        group: u32,
        block_size: u32,
    ) {
        for (h, n, i) in blocks {
            self.block_hashes.push(h);
            self.num_copies.push(n);
            self.block_positions.push(i);
        }
        self.token_ids.extend_from_slice(tokens);
        self.close(STORED, parent, extra.clone(), Some((req_id.clone(), first)), group, block_size);
    }

    /// One block of group `group` carrying `hash` left the cache; `num_copies` blocks of the group still carry
    /// it.
    pub fn push_removed(&mut self, hash: BlockHash, num_copies: u32, group: u32) {
        self.block_hashes.push(hash);
        self.num_copies.push(num_copies);
        self.block_positions.push(0);
        self.close(REMOVED, None, ExtraKeys::default(), None, group, 0);
    }

    pub fn push_cleared(&mut self) {
        self.close(CLEARED, None, ExtraKeys::default(), None, 0, 0);
    }

    /// The events recorded so far, leaving none.
    pub fn take(&mut self) -> KvCacheEvents {
        std::mem::take(self)
    }

    /// Checks the layout (see the module docs).
    pub fn check(&self) -> Result<(), String> {
        let n = self.kinds.len();
        let lens = [self.block_indptr.len(), self.token_indptr.len()];
        let per_event = [
            self.parents.len(),
            self.extra_keys.len(),
            self.req_ids.len(),
            self.num_cached_blocks.len(),
            self.groups.len(),
            self.block_sizes.len(),
        ];
        if lens != [n + 1, n + 1] || per_event != [n; 6] {
            return Err(format!("{n} events but offsets / per-event lists of lengths {lens:?}"));
        }
        if self.num_copies.len() != self.block_hashes.len()
            || self.block_positions.len() != self.block_hashes.len()
        {
            return Err("num_copies, block_positions and block_hashes differ in length".into());
        }
        for (indptr, total) in
            [(&self.block_indptr, self.block_hashes.len()), (&self.token_indptr, self.token_ids.len())]
        {
            if indptr[0] != 0 || indptr[n] as usize != total || indptr.windows(2).any(|w| w[0] > w[1]) {
                return Err("event offsets do not cover their values in order".into());
            }
        }
        for e in 0..n {
            let blocks = self.block_indptr[e + 1] - self.block_indptr[e];
            let tokens = self.token_indptr[e + 1] - self.token_indptr[e];
            let ok = match self.kinds[e] {
                // A window group's run may store none of its blocks (all out of the window).
                STORED => {
                    self.req_ids[e].is_some() && self.block_sizes[e] > 0 && tokens % self.block_sizes[e] == 0
                }
                REMOVED => {
                    blocks == 1 && tokens == 0 && self.parents[e].is_none() && self.req_ids[e].is_none()
                }
                CLEARED => {
                    blocks == 0
                        && tokens == 0
                        && self.parents[e].is_none()
                        && self.req_ids[e].is_none()
                        && self.groups[e] == 0
                }
                _ => false,
            };
            if !ok {
                return Err(format!(
                    "event {e} (kind {}) has {blocks} blocks and {tokens} tokens",
                    self.kinds[e]
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u8) -> BlockHash {
        BlockHash([x; 32])
    }

    #[test]
    fn events_keep_their_order_and_layout() {
        let mut ev = KvCacheEvents::default();
        let salt = ExtraKeys { cache_salt: Some("s".into()), lora_name: None };
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        ev.push_stored([(h(1), 1, 0), (h(2), 2, 1)].into_iter(), None, &[5, 6, 7, 8], &salt, &a, 0, 0, 2);
        ev.push_removed(h(2), 1, 1);
        ev.push_cleared();
        ev.push_stored(
            [(h(3), 1, 4)].into_iter(),
            Some(h(2)),
            &[9, 9, 9, 9, 9, 9],
            &ExtraKeys::default(),
            &b,
            2,
            2,
            3,
        );
        ev.check().unwrap();
        assert_eq!(ev.kinds, vec![STORED, REMOVED, CLEARED, STORED]);
        assert_eq!(ev.block_indptr, vec![0, 2, 3, 3, 4]);
        assert_eq!(ev.token_indptr, vec![0, 4, 4, 4, 10]);
        assert_eq!(ev.num_copies, vec![1, 2, 1, 1]);
        assert_eq!(ev.block_positions, vec![0, 1, 0, 4]);
        assert_eq!(ev.parents, vec![None, None, None, Some(h(2))]);
        assert_eq!(ev.extra_keys[0], salt);
        assert_eq!(ev.req_ids, vec![Some(a), None, None, Some(b)]);
        assert_eq!(ev.num_cached_blocks, vec![0, 0, 0, 2]);
        assert_eq!(ev.groups, vec![0, 1, 0, 2]);
        assert_eq!(ev.block_sizes, vec![2, 0, 0, 3]);
        let taken = ev.take();
        assert_eq!(taken.len(), 4);
        assert!(ev.is_empty());
        ev.check().unwrap();
    }
}
