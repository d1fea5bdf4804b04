//! Block pins: references a host takes on blocks by id, outside any request's block table (vLLM's
//! `BlockPool.touch` / `BlockPool.free_blocks` as a KV connector calls them to keep blocks it is copying), and
//! the two reads that go with them: which hash a block carries, and which block the prefix cache returns for a
//! hash. With several KV cache groups a block is cached under its group's key of a request block's hash: the
//! reads name the group and the request hash (`get_block_hash_group`, `get_group_cached_block_id`).
//!
//! A pin is a reference like a request's: a block at reference count 0 leaves the free queue when pinned (a
//! cached block stays cached and can still be hit, but is never evicted or reused while pinned), and a block
//! whose last reference an unpin drops goes back to the free queue where vLLM's `free_blocks` puts it: to the
//! tail when it carries a hash (evicted last, in the order given), to the head when it does not (reused first,
//! the blocks of one call as one group in the order given). Each call checks all of its ids before changing
//! anything: on an error the scheduler is unchanged.

use std::collections::HashMap;

use crate::block_pool::NULL_BLOCK;
use crate::error::{Result, SchedError};
use crate::hashing::BlockHash;
use crate::hybrid::group_key;
use crate::scheduler::Scheduler;

impl Scheduler {
    fn check_block_id(&self, block: u32, what: &str) -> Result<()> {
        let num_blocks = self.kv.pool.num_blocks();
        if block >= num_blocks {
            return Err(SchedError::InvalidRequest(format!(
                "block id {block} is outside the KV cache pool (block ids 0..{num_blocks})"
            )));
        }
        if block == NULL_BLOCK {
            return Err(SchedError::InvalidRequest(format!(
                "block 0 is the null block: it cannot be {what}"
            )));
        }
        Ok(())
    }

    /// Takes one reference on each block of `blocks` (an id listed twice takes two): vLLM's `BlockPool.touch`.
    /// `InvalidRequest` for an id outside the pool or the null block 0 (nothing pinned then).
    pub fn pin_blocks(&mut self, blocks: &[u32]) -> Result<()> {
        for &b in blocks {
            self.check_block_id(b, "pinned")?;
        }
        self.kv.pool.touch(blocks);
        for &b in blocks {
            *self.pins.entry(b).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Gives back one pin of each block of `blocks`, in eviction priority order (the first is evicted first):
    /// vLLM's `BlockPool.free_blocks`. `InvalidRequest` for an id outside the pool, the null block, or a block
    /// listed more often than it is pinned (nothing unpinned then).
    pub fn unpin_blocks(&mut self, blocks: &[u32]) -> Result<()> {
        let mut wanted: HashMap<u32, u32> = HashMap::new();
        for &b in blocks {
            self.check_block_id(b, "unpinned")?;
            let n = wanted.entry(b).or_insert(0);
            *n += 1;
            let pinned = self.pins.get(&b).copied().unwrap_or(0);
            if *n > pinned {
                return Err(SchedError::InvalidRequest(if pinned == 0 {
                    format!("block {b} is not pinned")
                } else {
                    format!("block {b} is unpinned {n} times but pinned only {pinned} times")
                }));
            }
        }
        for (b, n) in wanted {
            let left = self.pins[&b] - n;
            if left == 0 {
                self.pins.remove(&b);
            } else {
                self.pins.insert(b, left);
            }
        }
        // The pool frees a request's table deepest block first (it walks the list backwards): given reversed,
        // it frees in the order given.
        let reversed: Vec<u32> = blocks.iter().rev().copied().collect();
        self.kv.pool.free_blocks(&reversed);
        Ok(())
    }

    /// How many pins block `block` carries (0 for the null block); `InvalidRequest` outside the pool.
    pub fn get_block_pin_cnt(&self, block: u32) -> Result<u32> {
        if block != NULL_BLOCK {
            self.check_block_id(block, "pinned")?;
        }
        Ok(self.pins.get(&block).copied().unwrap_or(0))
    }

    /// The hash block `block` is cached under, or `None` if it is not in the prefix cache (the null block never
    /// is); `InvalidRequest` outside the pool.
    pub fn get_block_hash(&self, block: u32) -> Result<Option<BlockHash>> {
        if block != NULL_BLOCK {
            self.check_block_id(block, "read")?;
        }
        Ok(self.kv.pool.block_hash(block).copied())
    }

    /// The request block hash block `block` is cached under and the KV cache group whose key of it that is (group
    /// 0's key is the hash itself, so with one group this is `(get_block_hash, 0)`), or `None` if it is not in
    /// the prefix cache; `InvalidRequest` outside the pool.
    pub fn get_block_hash_group(&self, block: u32) -> Result<Option<(BlockHash, usize)>> {
        if block != NULL_BLOCK {
            self.check_block_id(block, "read")?;
        }
        Ok(self.kv.pool.block_hash(block).map(|key| {
            let g = self.kv.pool.block_group(block);
            (group_key(key, g), g)
        }))
    }

    /// The block a prefix lookup of KV cache group `group`'s key of the request block hash `hash` returns now,
    /// if any (group 0: `get_cached_block_id`). `InvalidRequest` for a group the config does not have. Changes
    /// nothing.
    pub fn get_group_cached_block_id(&self, hash: &BlockHash, group: usize) -> Result<Option<u32>> {
        let num_groups = self.config.kv_cache_groups.len().max(1);
        if group >= num_groups {
            return Err(SchedError::InvalidRequest(format!(
                "group must be in [0, {num_groups}), got {group}"
            )));
        }
        Ok(self.get_cached_block_id(&group_key(hash, group)))
    }

    /// The free blocks in eviction order, head first: the order the next allocations take them (vLLM's
    /// `free_block_queue`, which a connector walks to offload the blocks about to be evicted). O(free blocks).
    pub fn free_block_ids(&self) -> Vec<u32> {
        self.kv.pool.free_order()
    }

    /// The block a prefix lookup of `hash` returns now (the first block filed under it, as its hash or as an
    /// extra key), if any. Changes
    /// nothing.
    pub fn get_cached_block_id(&self, hash: &BlockHash) -> Option<u32> {
        if !self.config.enable_prefix_caching {
            return None;
        }
        self.kv.pool.get_cached_key(hash)
    }
}
