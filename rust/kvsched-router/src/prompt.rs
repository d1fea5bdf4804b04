//! Prompts as block keys: the same keys the replicas' block events name, so a lookup finds what they stored.
//!
//! A key is 64 bits. A byte hash becomes a key the way vLLM turns its hashes into ints for its KV events
//! (`int.from_bytes(hash, "big") & (2**64 - 1)`: the last 8 bytes, big-endian), so vLLM's events, whether they
//! carry bytes or ints, and kvsched's hashes (16 bytes under xxh3-128, 32 under SHA-256, as
//! `Scheduler.get_block_hashes` shows them) all map the same way. A prompt's keys come either from its tokens,
//! hashed with kvsched's chained block hash (the replicas must share the router's hash algorithm and seed), or
//! from the caller (hashes computed elsewhere, e.g. by vLLM's own hash function).

use kvsched_core::hashing::{BlockHasher, ExtraKeys};
use kvsched_core::{BlockHash, HashAlgo};

use crate::error::{Result, RouterError};

/// A request's prompt, as the router reads it.
#[derive(Clone, Copy, Debug)]
pub enum Prompt<'a> {
    /// Token ids, hashed by the router (only full blocks have keys).
    Tokens { token_ids: &'a [u32], lora_name: Option<&'a str>, cache_salt: Option<&'a str> },
    /// Keys of the prompt's full blocks, in order. `num_tokens`: the prompt's length; `None` counts the full
    /// blocks only.
    BlockHashes { block_hashes: &'a [u64], num_tokens: Option<usize> },
}

/// A prompt reduced to what the policies need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptKeys {
    pub keys: Vec<u64>,
    pub num_tokens: usize,
}

/// The key of a byte hash: its last 8 bytes read big-endian (shorter hashes are zero-extended on the left).
pub fn key_of_bytes(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

#[derive(Clone, Debug)]
pub struct PromptHasher {
    hasher: BlockHasher,
    width: usize,
    block_size: usize,
}

impl PromptHasher {
    /// `seed`: as `SchedulerConfig.prefix_hash_seed` reaches the core; `None` draws a random one.
    pub fn new(algo: HashAlgo, seed: Option<&[u8]>, block_size: usize) -> Result<Self> {
        let hasher = BlockHasher::new(algo, seed).map_err(|e| RouterError::InvalidConfig(e.to_string()))?;
        let width = match algo {
            HashAlgo::Xxh3_128 => 16,
            HashAlgo::Sha256 | HashAlgo::Sha256Pickle => 32,
        };
        Ok(PromptHasher { hasher, width, block_size })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The key of a core block hash (the bytes `Scheduler.get_block_hashes` returns).
    pub fn key(&self, hash: &BlockHash) -> u64 {
        key_of_bytes(&hash.0[..self.width])
    }

    pub fn keys(&self, prompt: &Prompt<'_>) -> Result<PromptKeys> {
        let bs = self.block_size;
        let out = match *prompt {
            Prompt::Tokens { token_ids, lora_name, cache_salt } => {
                let extra = ExtraKeys {
                    cache_salt: cache_salt.map(str::to_owned),
                    lora_name: lora_name.map(str::to_owned),
                };
                let mut hashes = Vec::with_capacity(token_ids.len() / bs);
                self.hasher.extend_hashes(&mut hashes, token_ids, bs, &extra, &[], &mut Vec::new());
                PromptKeys { keys: hashes.iter().map(|h| self.key(h)).collect(), num_tokens: token_ids.len() }
            }
            Prompt::BlockHashes { block_hashes, num_tokens } => {
                let full = block_hashes.len() * bs;
                let n = num_tokens.unwrap_or(full);
                if n < full || n >= full + bs {
                    return Err(RouterError::InvalidArgument(format!(
                        "num_prompt_tokens {n} does not fit {} full blocks of {bs} tokens",
                        block_hashes.len()
                    )));
                }
                PromptKeys { keys: block_hashes.to_vec(), num_tokens: n }
            }
        };
        if out.num_tokens == 0 {
            return Err(RouterError::InvalidArgument("the prompt is empty".into()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_hashes_become_keys_as_vllm_makes_int_hashes() {
        assert_eq!(key_of_bytes(&[]), 0);
        assert_eq!(key_of_bytes(&[1, 2]), 0x0102);
        let h: Vec<u8> = (1..=32).collect();
        assert_eq!(key_of_bytes(&h), u64::from_be_bytes([25, 26, 27, 28, 29, 30, 31, 32]));
    }

    #[test]
    fn token_prompts_hash_like_the_core_and_only_full_blocks() {
        for algo in [HashAlgo::Xxh3_128, HashAlgo::Sha256] {
            let ph = PromptHasher::new(algo, Some(b"s:seed"), 4).unwrap();
            let tokens: Vec<u32> = (0..10).collect();
            let got =
                ph.keys(&Prompt::Tokens { token_ids: &tokens, lora_name: None, cache_salt: None }).unwrap();
            let core = BlockHasher::new(algo, Some(b"s:seed")).unwrap();
            let b0 = core.hash_block(None, &tokens[..4], &ExtraKeys::default());
            let b1 = core.hash_block(Some(&b0), &tokens[4..8], &ExtraKeys::default());
            assert_eq!(got, PromptKeys { keys: vec![ph.key(&b0), ph.key(&b1)], num_tokens: 10 });
            let salted = ph
                .keys(&Prompt::Tokens { token_ids: &tokens, lora_name: None, cache_salt: Some("x") })
                .unwrap();
            assert_ne!(salted.keys[0], got.keys[0]);
        }
    }

    #[test]
    fn caller_hashes_must_agree_with_the_token_count() {
        let ph = PromptHasher::new(HashAlgo::Xxh3_128, Some(b"x"), 4).unwrap();
        let ok = ph.keys(&Prompt::BlockHashes { block_hashes: &[5, 6], num_tokens: Some(11) }).unwrap();
        assert_eq!(ok, PromptKeys { keys: vec![5, 6], num_tokens: 11 });
        assert_eq!(
            ph.keys(&Prompt::BlockHashes { block_hashes: &[5], num_tokens: None }).unwrap().num_tokens,
            4
        );
        assert!(ph.keys(&Prompt::BlockHashes { block_hashes: &[5, 6], num_tokens: Some(12) }).is_err());
        assert!(ph.keys(&Prompt::BlockHashes { block_hashes: &[5, 6], num_tokens: Some(7) }).is_err());
        assert!(ph.keys(&Prompt::BlockHashes { block_hashes: &[], num_tokens: None }).is_err());
        assert!(ph.keys(&Prompt::Tokens { token_ids: &[], lora_name: None, cache_salt: None }).is_err());
        assert_eq!(
            ph.keys(&Prompt::BlockHashes { block_hashes: &[], num_tokens: Some(3) }).unwrap().keys,
            vec![]
        );
    }
}
