//! vLLM's SHA-256 prefix-cache block hash, computed without Python.
//!
//! vLLM 0.33's default block hash (`prefix_caching_hash_algo="sha256"`) is the SHA-256 of
//! `pickle.dumps((parent_hash, tuple(block_token_ids), extra_keys), protocol=5)`. For a block whose extra keys
//! are `None` (no LoRA, multimodal input, prompt embeddings, and a cache salt only enters block 0) the pickle
//! stream is fixed by the three values, so it can be written here byte for byte: CPython's pickler emits
//! `PROTO 5`, one `FRAME` around the whole payload (it is far below the 64 KiB frame target), `SHORT_BINBYTES`
//! for the parent hash, the token tuple (`TUPLE1..3` or `MARK ... TUPLE`) with each int as the smallest of
//! `BININT1`/`BININT2`/`BININT`/`LONG1`, `NONE`, `TUPLE3`, a `MEMOIZE` after each of the bytes and the two
//! tuples, and `STOP`. kvsched.vllm uses this for the hashes vLLM's `Request.block_hashes` must hold (a block
//! that fills during decoding), after checking once that it agrees with vLLM's own hasher.
//!
//! The core keys its prefix cache with its own hash (`hashing.rs`); with `prefix_hash_algo = "sha256_pickle"` that
//! hash is this one for every block without extra keys.

use sha2::{Digest, Sha256};

use crate::error::{Result, SchedError};

/// The largest block this encodes: its pickle stays one frame well below CPython's 64 KiB frame target.
pub const MAX_PICKLE_BLOCK_TOKENS: usize = 4096;

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE3: u8 = 0x87;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const NONE: u8 = b'N';
const STOP: u8 = b'.';

/// Appends pickle's encoding of one int (protocol >= 2).
fn push_int(buf: &mut Vec<u8>, v: i64) {
    if (0..=0xff).contains(&v) {
        buf.push(BININT1);
        buf.push(v as u8);
    } else if (0..=0xffff).contains(&v) {
        buf.push(BININT2);
        buf.extend_from_slice(&(v as u16).to_le_bytes());
    } else if let Ok(v32) = i32::try_from(v) {
        buf.push(BININT);
        buf.extend_from_slice(&v32.to_le_bytes());
    } else {
        // LONG1: the shortest little-endian two's complement that keeps the sign.
        let bytes = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let top = bytes[n - 1];
            let below_sign = bytes[n - 2] & 0x80;
            if (top == 0 && below_sign == 0) || (top == 0xff && below_sign != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        buf.push(LONG1);
        buf.push(n as u8);
        buf.extend_from_slice(&bytes[..n]);
    }
}

/// The pickle stream of `(parent, tuple(tokens), None)`, protocol 5, into `buf` (cleared first). `parent` is 1 to
/// 255 bytes and `tokens` at most `MAX_PICKLE_BLOCK_TOKENS` (the callers check).
pub(crate) fn encode<T: Copy + Into<i64>>(buf: &mut Vec<u8>, parent: &[u8], tokens: &[T]) {
    buf.clear();
    buf.push(PROTO);
    buf.push(5);
    buf.push(FRAME);
    let frame_len_at = buf.len();
    buf.extend_from_slice(&[0; 8]);
    let payload_at = buf.len();
    buf.push(SHORT_BINBYTES);
    buf.push(parent.len() as u8);
    buf.extend_from_slice(parent);
    buf.push(MEMOIZE);
    if tokens.len() > 3 {
        buf.push(MARK);
    }
    for &t in tokens {
        push_int(buf, t.into());
    }
    buf.push(if tokens.len() > 3 { TUPLE } else { TUPLE1 + tokens.len() as u8 - 1 });
    buf.push(MEMOIZE);
    buf.push(NONE);
    buf.push(TUPLE3);
    buf.push(MEMOIZE);
    buf.push(STOP);
    let frame_len = (buf.len() - payload_at) as u64;
    buf[frame_len_at..payload_at].copy_from_slice(&frame_len.to_le_bytes());
}

/// vLLM's SHA-256 hashes of the full blocks of `tokens`, chained from `parent` (the hash of the block before
/// them): `hash(i) = sha256(pickle((hash(i - 1), tuple(block i), None)))`. A trailing partial block is left
/// out. The blocks must have no extra keys (see the module doc).
pub fn sha256_pickle_block_hashes(parent: &[u8], tokens: &[i64], block_size: usize) -> Result<Vec<[u8; 32]>> {
    if block_size == 0 || block_size > MAX_PICKLE_BLOCK_TOKENS {
        return Err(SchedError::InvalidRequest(format!(
            "block_size must be in 1..={MAX_PICKLE_BLOCK_TOKENS}, got {block_size}"
        )));
    }
    if parent.is_empty() || parent.len() > 0xff {
        return Err(SchedError::InvalidRequest(format!(
            "the parent block hash must be 1 to 255 bytes, got {}",
            parent.len()
        )));
    }
    let num_blocks = tokens.len() / block_size;
    let mut hashes: Vec<[u8; 32]> = Vec::with_capacity(num_blocks);
    let mut buf = Vec::with_capacity(64 + 10 * block_size);
    for block in tokens.chunks_exact(block_size) {
        encode(&mut buf, hashes.last().map_or(parent, |h| &h[..]), block);
        hashes.push(Sha256::digest(&buf).into());
    }
    Ok(hashes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn encodes_like_cpython_pickle() {
        // `pickle.dumps((bytes(range(32)), (1, 300, 70000, -1, 2**31, -2**31 - 1, 2**40, 0, 255, 256, 65535,
        // 65536, 2**31 - 1, -2**31), None), protocol=5).hex()` on CPython 3.11.
        let parent: Vec<u8> = (0..32).collect();
        let tokens: [i64; 14] = [
            1,
            300,
            70000,
            -1,
            1 << 31,
            -(1 << 31) - 1,
            1 << 40,
            0,
            255,
            256,
            65535,
            65536,
            (1 << 31) - 1,
            -(1 << 31),
        ];
        let mut buf = Vec::new();
        encode(&mut buf, &parent, &tokens);
        let want = hex(concat!(
            "80059568000000000000004320000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f9428",
            "4b014d2c014a701101004affffffff8a0500000080008a05ffffff7fff8a060000000000014b004bff4d00014dffff4a",
            "000001004affffff7f4a0000008074944e87942e"
        ));
        assert_eq!(buf, want);
        // A one-token tuple: TUPLE1, no MARK.
        encode(&mut buf, &parent, &[5]);
        let want = hex(concat!(
            "8005952b000000000000004320000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f94",
            "4b0585944e87942e"
        ));
        assert_eq!(buf, want);
    }

    #[test]
    fn long1_is_minimal() {
        for (v, want) in [
            (i64::MAX, "8a08ffffffffffffff7f"),
            (i64::MIN, "8a080000000000000080"),
            (-(1 << 31) - 1, "8a05ffffff7fff"),
            (1 << 32, "8a050000000001"),
            (-(1 << 40), "8a060000000000ff"),
        ] {
            let mut buf = Vec::new();
            push_int(&mut buf, v);
            assert_eq!(buf, hex(want), "{v}");
        }
    }

    #[test]
    fn chains_full_blocks_only() {
        let parent = [7u8; 32];
        let tokens: Vec<i64> = (0..10).collect();
        let all = sha256_pickle_block_hashes(&parent, &tokens, 4).unwrap();
        assert_eq!(all.len(), 2);
        let first = sha256_pickle_block_hashes(&parent, &tokens[..4], 4).unwrap();
        assert_eq!(first[..], all[..1]);
        let second = sha256_pickle_block_hashes(&all[0], &tokens[4..8], 4).unwrap();
        assert_eq!(second[..], all[1..]);
        assert!(sha256_pickle_block_hashes(&parent, &tokens[..3], 4).unwrap().is_empty());
    }

    #[test]
    fn refuses_bad_sizes() {
        assert!(sha256_pickle_block_hashes(&[1; 32], &[1], 0).is_err());
        assert!(sha256_pickle_block_hashes(&[1; 32], &[1], MAX_PICKLE_BLOCK_TOKENS + 1).is_err());
        assert!(sha256_pickle_block_hashes(&[], &[1], 1).is_err());
        assert!(sha256_pickle_block_hashes(&[1; 256], &[1], 1).is_err());
    }
}
