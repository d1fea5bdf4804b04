//! Chained block hashes for prefix caching.
//!
//! `hash(i) = H(parent, tokens of block i, extra keys)` where `parent` is `hash(i - 1)`, or the scheduler's seed
//! hash for block 0. Extra keys: the LoRA/adapter name on every block, the cache salt on block 0 only, so
//! different salts or adapters never share a block. `H` is xxh3-128 (fast, seeded by the random parent so it is
//! not predictable across schedulers) or SHA-256 (collision resistant, for adversarial multi-tenant use). Every
//! field is length- or tag-prefixed so distinct inputs can never encode to the same bytes.
//!
//! With look-ahead (`hash_lookahead_tokens` `L > 0`), block `i`'s hash also covers the `L` tokens after it (a
//! tagged field after the extra keys, whose encoder inputs include those reaching the `L` tokens), and exists
//! only once those tokens do.
//!
//! Tenant cache isolation (`isolate_tenant_cache`) keys block 0 by the tenant the same way: the request's salt
//! becomes `tenant_cache_salt(tenant, cache_salt)`, a string that is distinct for every distinct pair, so two
//! tenants never share a chain whatever salts their clients pick. The string (not a separate hash field) is the
//! salt so that a caller outside the core, e.g. vLLM's hasher through `Request.cache_salt`, keys its own hashes
//! the same way.
//!
//! `HashAlgo::Sha256Pickle` keys a block without extra keys (no LoRA name, no salt on block 0, no encoder input
//! reaching it, no look-ahead tokens) with vLLM's default block hash: the SHA-256 of the pickle (protocol 5) of
//! `(parent, tuple(tokens), None)` (`pickle_hash.rs`), and block 0's parent is the seed itself (vLLM's
//! `NONE_HASH`), so such a request's hashes are the ones vLLM's own hasher gives it. A block with extra keys takes
//! the tagged SHA-256 encoding above. The two encodings never produce the same bytes (a pickle ends with `.`, the
//! tagged encoding with `0xff`), so a pickle hash and a tagged hash collide only if SHA-256 does.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::config::HashAlgo;
use crate::encoder::EncoderInput;
use crate::error::{Result, SchedError};
use crate::pickle_hash;

/// A block hash: 32 bytes for SHA-256; xxh3-128 fills the first 16 and leaves the rest zero.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct BlockHash(pub [u8; 32]);

/// The per-request keys mixed into its block hashes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    pub cache_salt: Option<String>,
    pub lora_name: Option<String>,
}

#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    seed_hash: BlockHash,
    /// Tokens after each block its hash covers (`hash_lookahead_tokens`).
    lookahead: usize,
    /// Tokens per hash unit (`hash_block_size`) when a block's hash chains over several units; 0: one unit per
    /// block.
    unit: usize,
}

const TAG_LORA: u8 = 1;
const TAG_SALT: u8 = 2;
const TAG_MM: u8 = 3;
const TAG_LOOKAHEAD: u8 = 4;
const TAG_END: u8 = 0xff;

impl BlockHasher {
    /// `seed`: `None` draws 32 random bytes from the OS, so two schedulers never agree on hashes.
    /// With `HashAlgo::Sha256Pickle` a seed is block 0's parent itself and must be 32 bytes.
    pub fn new(algo: HashAlgo, seed: Option<&[u8]>) -> Result<Self> {
        let seed_hash = match seed {
            Some(bytes) if algo == HashAlgo::Sha256Pickle => {
                BlockHash(bytes.try_into().map_err(|_| {
                    SchedError::InvalidConfig(format!(
                        "prefix_hash_seed must be None or 32 bytes (block 0's parent hash) with prefix_hash_algo \
                         'sha256_pickle', got {} bytes",
                        bytes.len()
                    ))
                })?)
            }
            Some(bytes) => {
                let mut h = Sha256::new();
                h.update(b"kvsched-prefix-hash-seed");
                h.update((bytes.len() as u64).to_le_bytes());
                h.update(bytes);
                BlockHash(h.finalize().into())
            }
            None => {
                let mut buf = [0u8; 32];
                getrandom::fill(&mut buf)
                    .map_err(|e| SchedError::Internal(format!("cannot draw a random hash seed: {e}")))?;
                BlockHash(buf)
            }
        };
        Ok(BlockHasher { algo, seed_hash, lookahead: 0, unit: 0 })
    }

    /// This hasher with each block's hash also covering the `lookahead` tokens after the block.
    pub fn with_lookahead(mut self, lookahead: usize) -> Self {
        self.lookahead = lookahead;
        self
    }

    /// This hasher chaining over units of `unit` tokens (`hash_block_size`; `None`: one unit per block): a
    /// block's hash is the hash of its last unit, each unit's parent the unit before it (block 0's first unit's
    /// the seed), and the extra keys go per unit (the cache salt on the request's first unit only, the encoder
    /// inputs each unit overlaps, the look-ahead tokens after each unit). The block size must be a multiple of it.
    pub fn with_unit(mut self, unit: Option<u32>) -> Self {
        self.unit = unit.map_or(0, |u| u as usize);
        self
    }

    /// Tokens after each block its hash covers.
    #[inline]
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Full blocks of `num_tokens` tokens that have a hash: those followed by `lookahead` tokens.
    #[inline]
    pub fn num_hashable(&self, num_tokens: usize, block_size: usize) -> usize {
        num_tokens.saturating_sub(self.lookahead) / block_size
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// Serialises one block's hash input into `buf` (cleared first).
    /// `mm`: the encoder inputs of the request; those overlapping the block at `block_start` or the look-ahead
    /// tokens after it are encoded as (content hash, start relative to the block), as vLLM's multimodal extra
    /// keys. With `Sha256Pickle`, a block without extra keys is vLLM's pickle of it instead.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn encode(
        &self,
        buf: &mut Vec<u8>,
        parent: &BlockHash,
        tokens: &[u32],
        extra: &ExtraKeys,
        first: bool,
        mm: &[EncoderInput],
        block_start: u32,
    ) {
        if self.algo == HashAlgo::Sha256Pickle
            && self.lookahead == 0
            && extra.lora_name.is_none()
            && !(first && extra.cache_salt.is_some())
            && !Self::mm_overlaps(mm, block_start, block_start + tokens.len() as u32)
        {
            pickle_hash::encode(buf, &parent.0, tokens);
            return;
        }
        // The tagged encoding: parent, token count, tokens, tagged extra keys, `TAG_END`.
        buf.clear();
        buf.extend_from_slice(&parent.0);
        buf.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        Self::encode_tokens(buf, tokens);
        if let Some(lora) = &extra.lora_name {
            buf.push(TAG_LORA);
            buf.extend_from_slice(&(lora.len() as u32).to_le_bytes());
            buf.extend_from_slice(lora.as_bytes());
        }
        if first {
            if let Some(salt) = &extra.cache_salt {
                buf.push(TAG_SALT);
                buf.extend_from_slice(&(salt.len() as u32).to_le_bytes());
                buf.extend_from_slice(salt.as_bytes());
            }
        }
        if !mm.is_empty() {
            let end = block_start + (tokens.len() + self.lookahead) as u32;
            Self::encode_mm(buf, mm, block_start, end);
        }
        buf.push(TAG_END);
    }

    /// Whether an encoder input overlaps `block_start..block_end`.
    #[inline]
    fn mm_overlaps(mm: &[EncoderInput], block_start: u32, block_end: u32) -> bool {
        !mm.is_empty()
            && mm.get(mm.partition_point(|e| e.end() <= block_start)).is_some_and(|e| e.start < block_end)
    }

    /// The tokens as little-endian u32s. On a little-endian machine that is their memory: one copy.
    #[inline]
    fn encode_tokens(buf: &mut Vec<u8>, tokens: &[u32]) {
        #[cfg(target_endian = "little")]
        {
            // SAFETY: a u32 slice is readable as the bytes of its memory: u32 has no padding, u8 has alignment 1,
            // and the byte slice covers exactly `tokens` (size_of_val) for the borrow's lifetime.
            let bytes = unsafe {
                std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
            };
            buf.extend_from_slice(bytes);
        }
        #[cfg(not(target_endian = "little"))]
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
    }

    /// The encoder inputs overlapping `block_start..block_end`: (content hash, start relative to the block).
    #[cold]
    fn encode_mm(buf: &mut Vec<u8>, mm: &[EncoderInput], block_start: u32, block_end: u32) {
        for e in mm.iter().skip(mm.partition_point(|e| e.end() <= block_start)) {
            if e.start >= block_end {
                break;
            }
            buf.push(TAG_MM);
            buf.extend_from_slice(&e.hash.to_le_bytes());
            buf.extend_from_slice(&(i64::from(e.start) - i64::from(block_start)).to_le_bytes());
        }
    }

    fn digest(&self, bytes: &[u8]) -> BlockHash {
        match self.algo {
            HashAlgo::Xxh3_128 => {
                let mut out = [0u8; 32];
                out[..16].copy_from_slice(&xxh3_128(bytes).to_le_bytes());
                BlockHash(out)
            }
            HashAlgo::Sha256 | HashAlgo::Sha256Pickle => BlockHash(Sha256::digest(bytes).into()),
        }
    }

    /// Hash of one full block. `parent` is `None` for block 0. Without look-ahead tokens (a hasher with look-ahead
    /// hashes blocks through `extend_hashes`).
    pub fn hash_block(&self, parent: Option<&BlockHash>, tokens: &[u32], extra: &ExtraKeys) -> BlockHash {
        let mut buf = Vec::with_capacity(64 + 4 * tokens.len());
        self.encode(&mut buf, parent.unwrap_or(&self.seed_hash), tokens, extra, parent.is_none(), &[], 0);
        self.digest(&buf)
    }

    /// Appends to `hashes` the hashes of every full block of `tokens` not hashed yet. `buf` is scratch space
    /// the caller keeps between calls: a block boundary hashes one block for every request in the batch, and
    /// a buffer allocated and freed per request would cost as much as the hashing itself.
    #[allow(clippy::too_many_arguments)]
    pub fn extend_hashes(
        &self,
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKeys,
        mm: &[EncoderInput],
        buf: &mut Vec<u8>,
    ) {
        let num_full = self.num_hashable(tokens.len(), block_size);
        if hashes.len() >= num_full {
            return;
        }
        hashes.reserve(num_full - hashes.len());
        // Units per block: one unless the hash unit is finer than the block (a divisor of it).
        let unit = if self.unit == 0 || self.unit >= block_size { block_size } else { self.unit };
        while hashes.len() < num_full {
            let i = hashes.len();
            let mut parent = *hashes.last().unwrap_or(&self.seed_hash);
            for start in (i * block_size..(i + 1) * block_size).step_by(unit) {
                let end = start + unit;
                self.encode(buf, &parent, &tokens[start..end], extra, start == 0, mm, start as u32);
                if self.lookahead > 0 {
                    buf.pop(); // TAG_END: the look-ahead tokens come before it
                    buf.push(TAG_LOOKAHEAD);
                    Self::encode_tokens(buf, &tokens[end..end + self.lookahead]);
                    buf.push(TAG_END);
                }
                parent = self.digest(buf);
            }
            hashes.push(parent);
        }
    }

    /// Appends to `units` the hashes of every full hash unit of `tokens` not hashed yet (vLLM's request block
    /// hashes at `hash_block_size`: also the units of a block not full yet), each chained on the one before. A
    /// block's hash (`extend_hashes`) is its last unit's. Without a unit finer than the block, a unit is a block.
    #[allow(clippy::too_many_arguments)]
    pub fn extend_unit_hashes(
        &self,
        units: &mut Vec<BlockHash>,
        tokens: &[u32],
        block_size: usize,
        extra: &ExtraKeys,
        mm: &[EncoderInput],
        buf: &mut Vec<u8>,
    ) {
        let unit = if self.unit == 0 || self.unit >= block_size { block_size } else { self.unit };
        let num_full = self.num_hashable(tokens.len(), unit);
        while units.len() < num_full {
            let start = units.len() * unit;
            let end = start + unit;
            let parent = *units.last().unwrap_or(&self.seed_hash);
            self.encode(buf, &parent, &tokens[start..end], extra, start == 0, mm, start as u32);
            if self.lookahead > 0 {
                buf.pop(); // TAG_END: the look-ahead tokens come before it
                buf.push(TAG_LOOKAHEAD);
                Self::encode_tokens(buf, &tokens[end..end + self.lookahead]);
                buf.push(TAG_END);
            }
            units.push(self.digest(buf));
        }
    }
}

/// The block-0 salt of a request of `tenant` with `cache_salt` under tenant cache isolation:
/// `kvsched-tenant:<n>:<tenant>`, then `:<cache_salt>` if one is given, where `<n>` is the tenant's length in
/// UTF-8 bytes. Injective: the length delimits the tenant, and a salt (even an empty one) adds a `:`.
pub fn tenant_cache_salt(tenant: &str, cache_salt: Option<&str>) -> String {
    let mut out = format!("kvsched-tenant:{}:{tenant}", tenant.len());
    if let Some(salt) = cache_salt {
        out.push(':');
        out.push_str(salt);
    }
    out
}

/// A `HashMap` hasher for keys that are already uniformly distributed hashes: it takes 8 of their bytes.
#[derive(Default, Clone, Copy)]
pub struct PrehashedHasher(u64);

impl std::hash::Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // `[u8; 32]` hashes as its length prefix then its bytes; keep the first 8 content bytes seen.
        for &b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_usize(&mut self, _: usize) {}
}

pub type PrehashedBuild = std::hash::BuildHasherDefault<PrehashedHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(salt: Option<&str>, lora: Option<&str>) -> ExtraKeys {
        ExtraKeys { cache_salt: salt.map(Into::into), lora_name: lora.map(Into::into) }
    }

    #[test]
    fn chain_depends_on_parent_tokens_and_keys() {
        for algo in [HashAlgo::Xxh3_128, HashAlgo::Sha256] {
            let h = BlockHasher::new(algo, Some(b"seed")).unwrap();
            let none = keys(None, None);
            let a = h.hash_block(None, &[1, 2, 3, 4], &none);
            assert_eq!(a, h.hash_block(None, &[1, 2, 3, 4], &none));
            assert_ne!(a, h.hash_block(None, &[1, 2, 3, 5], &none));
            assert_ne!(a, h.hash_block(None, &[1, 2, 3, 4], &keys(Some("s"), None)));
            assert_ne!(a, h.hash_block(None, &[1, 2, 3, 4], &keys(None, Some("l"))));
            let b = h.hash_block(Some(&a), &[1, 2, 3, 4], &none);
            assert_ne!(a, b);
            // The salt only enters block 0.
            assert_eq!(b, h.hash_block(Some(&a), &[1, 2, 3, 4], &keys(Some("s"), None)));
        }
    }

    #[test]
    fn tenant_salts_are_distinct_for_distinct_pairs() {
        let pairs = [
            ("a", None),
            ("a", Some("")),
            ("a", Some("b")),
            ("a:b", None),
            ("a:1:b", None),
            ("ab", None),
            ("b", Some("a")),
            ("\u{e9}", None),
            ("e", Some("")),
        ];
        let salts: Vec<String> = pairs.iter().map(|(t, s)| tenant_cache_salt(t, *s)).collect();
        for i in 0..salts.len() {
            for j in 0..i {
                assert_ne!(salts[i], salts[j], "{:?} vs {:?}", pairs[i], pairs[j]);
            }
        }
        assert_eq!(tenant_cache_salt("\u{e9}", Some("x")), "kvsched-tenant:2:\u{e9}:x");
        // A client-chosen salt cannot forge another tenant's: the tenant prefix comes first.
        let forged = tenant_cache_salt("b", None);
        assert_ne!(tenant_cache_salt("a", Some(&forged)), forged);
    }

    /// Hash units finer than the block: a block's hash is vLLM's hash of its last unit (each unit's parent the
    /// unit before it), a unit of the block's size is the plain chain, and a salt keys the first unit only.
    /// Every unit's hash (vLLM's request block hashes at the hash unit): the units of a block not full yet too,
    /// each block's hash its last unit's, and a unit of the block's size the block chain.
    #[test]
    fn unit_hashes_cover_every_full_unit() {
        let root = [3u8; 32];
        let tokens: Vec<u32> = (0..22).map(|t| t * 7 + 1).collect();
        let wide: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        for unit in [1usize, 2, 4, 8] {
            let h =
                BlockHasher::new(HashAlgo::Sha256Pickle, Some(&root)).unwrap().with_unit(Some(unit as u32));
            let want = pickle_hash::sha256_pickle_block_hashes(&root, &wide, unit).unwrap();
            let mut units = Vec::new();
            h.extend_unit_hashes(&mut units, &tokens[..13], 8, &ExtraKeys::default(), &[], &mut Vec::new());
            assert_eq!(units.len(), 13 / unit);
            h.extend_unit_hashes(&mut units, &tokens, 8, &ExtraKeys::default(), &[], &mut Vec::new());
            assert_eq!(units.iter().map(|b| b.0).collect::<Vec<_>>(), want, "unit {unit}");
            let mut blocks = Vec::new();
            h.extend_hashes(&mut blocks, &tokens, 8, &ExtraKeys::default(), &[], &mut Vec::new());
            let k = 8 / unit;
            assert_eq!(blocks, (0..blocks.len()).map(|i| units[(i + 1) * k - 1]).collect::<Vec<_>>());
        }
        // Salted, with look-ahead tokens: the same units as the block chain's at a unit of the block.
        let h = BlockHasher::new(HashAlgo::Sha256, Some(b"s")).unwrap().with_lookahead(2).with_unit(Some(2));
        let k = keys(Some("salt"), None);
        let (mut units, mut blocks) = (Vec::new(), Vec::new());
        h.extend_unit_hashes(&mut units, &tokens, 4, &k, &[], &mut Vec::new());
        h.extend_hashes(&mut blocks, &tokens, 4, &k, &[], &mut Vec::new());
        assert_eq!(units.len(), 10);
        assert_eq!(blocks, (0..blocks.len()).map(|i| units[2 * i + 1]).collect::<Vec<_>>());
    }

    #[test]
    fn unit_hashes_chain_over_the_block_and_keep_its_last() {
        let root = [7u8; 32];
        let tokens: Vec<u32> = (0..26).map(|i| (i * 37) % 1000).collect();
        let wide: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        for unit in [1usize, 2, 4, 8] {
            let h =
                BlockHasher::new(HashAlgo::Sha256Pickle, Some(&root)).unwrap().with_unit(Some(unit as u32));
            let units = pickle_hash::sha256_pickle_block_hashes(&root, &wide, unit).unwrap();
            let k = 8 / unit;
            let want: Vec<[u8; 32]> = (0..units.len() / k).map(|i| units[(i + 1) * k - 1]).collect();
            let mut v = Vec::new();
            // Two calls: the second goes on from the first's last block.
            h.extend_hashes(&mut v, &tokens[..12], 8, &ExtraKeys::default(), &[], &mut Vec::new());
            assert_eq!(v.len(), 1);
            h.extend_hashes(&mut v, &tokens, 8, &ExtraKeys::default(), &[], &mut Vec::new());
            assert_eq!(v.iter().map(|b| b.0).collect::<Vec<_>>(), want, "unit {unit}");
            let mut salted = Vec::new();
            h.extend_hashes(&mut salted, &tokens, 8, &keys(Some("s"), None), &[], &mut Vec::new());
            assert_ne!(salted[0].0, want[0]);
            if unit < 8 {
                // The block's later units chain vLLM's hash from the salted first unit.
                let mut first = Vec::new();
                BlockHasher::new(HashAlgo::Sha256Pickle, Some(&root))
                    .unwrap()
                    .with_unit(Some(unit as u32))
                    .extend_hashes(
                        &mut first,
                        &tokens[..unit],
                        unit,
                        &keys(Some("s"), None),
                        &[],
                        &mut Vec::new(),
                    );
                let rest =
                    pickle_hash::sha256_pickle_block_hashes(&first[0].0, &wide[unit..8], unit).unwrap();
                assert_eq!(salted[0].0, *rest.last().unwrap());
            }
        }
    }

    /// `Sha256Pickle`: a block without extra keys is vLLM's pickle hash chained from the seed as it is; a block
    /// with a salt, a LoRA name, an encoder input or look-ahead tokens takes the tagged encoding.
    #[test]
    fn pickle_mode_keys_plain_blocks_with_vllms_hash() {
        let root = [7u8; 32];
        let h = BlockHasher::new(HashAlgo::Sha256Pickle, Some(&root)).unwrap();
        let tagged = BlockHasher::new(HashAlgo::Sha256, Some(b"s")).unwrap();
        let tokens: Vec<u32> = vec![1, 300, 70000, 0, 5, 65536, 9, 2_000_000_000];
        let wide: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let want = pickle_hash::sha256_pickle_block_hashes(&root, &wide, 4).unwrap();
        let mut v = Vec::new();
        h.extend_hashes(&mut v, &tokens, 4, &ExtraKeys::default(), &[], &mut Vec::new());
        assert_eq!(v.iter().map(|b| b.0).collect::<Vec<_>>(), want);
        assert_eq!(h.hash_block(None, &tokens[..4], &ExtraKeys::default()).0, want[0]);
        // A salt keys block 0 only: block 1 chains vLLM's hash from the salted block.
        let mut salted = Vec::new();
        h.extend_hashes(&mut salted, &tokens, 4, &keys(Some("s"), None), &[], &mut Vec::new());
        assert_ne!(salted[0].0, want[0]);
        assert_eq!(
            salted[1].0,
            pickle_hash::sha256_pickle_block_hashes(&salted[0].0, &wide[4..], 4).unwrap()[0]
        );
        let mut lora = Vec::new();
        h.extend_hashes(&mut lora, &tokens, 4, &keys(None, Some("l")), &[], &mut Vec::new());
        assert!(lora.iter().all(|b| !want.contains(&b.0)));
        // An encoder input reaching block 1 only.
        let mm = [EncoderInput { start: 5, num_tokens: 2, hash: 3 }];
        let mut with_mm = Vec::new();
        h.extend_hashes(&mut with_mm, &tokens, 4, &ExtraKeys::default(), &mm, &mut Vec::new());
        assert_eq!(with_mm[0].0, want[0]);
        assert_ne!(with_mm[1].0, want[1]);
        let la = BlockHasher::new(HashAlgo::Sha256Pickle, Some(&root)).unwrap().with_lookahead(1);
        let mut ahead = Vec::new();
        la.extend_hashes(&mut ahead, &tokens, 4, &ExtraKeys::default(), &[], &mut Vec::new());
        assert_ne!(ahead[0].0, want[0]);
        // Different from the tagged hashes, and a seed that is not 32 bytes is refused.
        assert_ne!(tagged.hash_block(None, &tokens[..4], &ExtraKeys::default()).0, want[0]);
        assert!(BlockHasher::new(HashAlgo::Sha256Pickle, Some(b"short")).is_err());
        assert_ne!(
            BlockHasher::new(HashAlgo::Sha256Pickle, None)
                .unwrap()
                .hash_block(None, &tokens[..4], &ExtraKeys::default())
                .0,
            want[0]
        );
    }

    #[test]
    fn seeds_decide_the_chain() {
        let a = BlockHasher::new(HashAlgo::Xxh3_128, Some(b"x")).unwrap();
        let b = BlockHasher::new(HashAlgo::Xxh3_128, Some(b"x")).unwrap();
        let c = BlockHasher::new(HashAlgo::Xxh3_128, None).unwrap();
        let d = BlockHasher::new(HashAlgo::Xxh3_128, None).unwrap();
        let k = ExtraKeys::default();
        assert_eq!(a.hash_block(None, &[7], &k), b.hash_block(None, &[7], &k));
        assert_ne!(c.hash_block(None, &[7], &k), d.hash_block(None, &[7], &k));
    }

    #[test]
    fn extend_hashes_is_incremental() {
        let h = BlockHasher::new(HashAlgo::Sha256, Some(b"s")).unwrap();
        let k = ExtraKeys::default();
        let tokens: Vec<u32> = (0..10).collect();
        let mut v = Vec::new();
        h.extend_hashes(&mut v, &tokens[..5], 4, &k, &[], &mut Vec::new());
        assert_eq!(v.len(), 1);
        h.extend_hashes(&mut v, &tokens, 4, &k, &[], &mut Vec::new());
        let mut w = Vec::new();
        h.extend_hashes(&mut w, &tokens, 4, &k, &[], &mut Vec::new());
        assert_eq!(v, w);
        assert_eq!(v.len(), 2);
    }

    /// With look-ahead, a block's hash waits for the tokens after it and depends on them; the blocks before
    /// keep the hashes they would have chained without them.
    #[test]
    fn lookahead_hashes_wait_for_and_cover_the_next_tokens() {
        let h = BlockHasher::new(HashAlgo::Sha256, Some(b"s")).unwrap().with_lookahead(1);
        let plain = BlockHasher::new(HashAlgo::Sha256, Some(b"s")).unwrap();
        let k = ExtraKeys::default();
        let hashes = |hasher: &BlockHasher, tokens: &[u32]| {
            let mut v = Vec::new();
            hasher.extend_hashes(&mut v, tokens, 4, &k, &[], &mut Vec::new());
            v
        };
        assert!(hashes(&h, &[1, 2, 3, 4]).is_empty());
        let a = hashes(&h, &[1, 2, 3, 4, 5]);
        assert_eq!(a.len(), 1);
        assert_ne!(a, hashes(&h, &[1, 2, 3, 4, 6]));
        assert_ne!(a, hashes(&plain, &[1, 2, 3, 4, 5]));
        let mut v = Vec::new();
        h.extend_hashes(&mut v, &[1, 2, 3, 4, 5], 4, &k, &[], &mut Vec::new());
        h.extend_hashes(&mut v, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, &k, &[], &mut Vec::new());
        assert_eq!(v, hashes(&h, &[1, 2, 3, 4, 5, 6, 7, 8, 9]));
        assert_eq!(v[0], a[0]);
        assert_eq!(h.with_lookahead(3).num_hashable(10, 4), 1);
    }
}
