//! Block events: what a replica's prefix cache did, in the shape of vLLM's KV cache events
//! (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`), so kvsched's events and vLLM's stream both map onto them.
//!
//! A block is named by a 64-bit key (see [`crate::prompt::key_of_bytes`] for how a byte hash becomes one). A
//! `Stored` event carries a run of blocks, each the child of the one before it and the first the child of
//! `parent_block_hash`. The index needs neither the parent nor the tokens: block hashes are chained, so a key
//! already names its whole prefix. They are kept so events convert losslessly and are checked for shape only.
//! Events are applied as set updates, so duplicates are harmless, removing a block that is not there is a no-op,
//! and a child may arrive before its parent.

use crate::error::{Result, RouterError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEvent<'a> {
    /// The replica cached these full blocks.
    Stored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        /// The tokens of all the blocks, in order; may be empty when the publisher leaves them out.
        token_ids: &'a [u32],
        /// Tokens per block as the publisher counts them; it must be the router's.
        block_size: usize,
    },
    /// The replica evicted these blocks from its prefix cache.
    Removed { block_hashes: &'a [u64] },
    /// The replica dropped its whole prefix cache (a reset, or a restart).
    AllCleared,
}

impl KvEvent<'_> {
    /// Checks the event's shape against the router's block size.
    pub fn validate(&self, block_size: usize) -> Result<()> {
        if let KvEvent::Stored { block_hashes, token_ids, block_size: bs, .. } = self {
            if *bs != block_size {
                return Err(RouterError::InvalidArgument(format!(
                    "a stored event has block_size {bs}, the router's block_size is {block_size}"
                )));
            }
            if !token_ids.is_empty() && token_ids.len() != block_hashes.len() * block_size {
                return Err(RouterError::InvalidArgument(format!(
                    "a stored event of {} blocks of {block_size} tokens carries {} token ids",
                    block_hashes.len(),
                    token_ids.len()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_events_must_match_the_block_size() {
        let ok = KvEvent::Stored {
            block_hashes: &[1, 2],
            parent_block_hash: None,
            token_ids: &[0; 8],
            block_size: 4,
        };
        assert_eq!(ok.validate(4), Ok(()));
        assert!(ok.validate(8).is_err());
        let short = KvEvent::Stored {
            block_hashes: &[1, 2],
            parent_block_hash: Some(9),
            token_ids: &[0; 7],
            block_size: 4,
        };
        assert!(short.validate(4).is_err());
        let no_tokens =
            KvEvent::Stored { block_hashes: &[1], parent_block_hash: None, token_ids: &[], block_size: 4 };
        assert_eq!(no_tokens.validate(4), Ok(()));
        assert_eq!(KvEvent::Removed { block_hashes: &[3] }.validate(4), Ok(()));
        assert_eq!(KvEvent::AllCleared.validate(4), Ok(()));
    }
}
