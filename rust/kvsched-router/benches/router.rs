//! Criterion benchmarks of one routing decision at 16 replicas x 100k cached blocks each: every policy, the
//! prompt given as block hashes or as tokens hashed by the router, and applying a batch of block events.
//!
//! Run with `cargo bench -p kvsched-router --bench router` (add `-- --quick` for a fast pass). The same
//! decision through the Python API is `benches/test_bench_router.py`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvsched_router::{KvEvent, LoadReport, PolicyKind, Prompt, Router, RouterConfig, StepTimeCoefficients};

const REPLICAS: usize = 16;
const BLOCKS_PER_REPLICA: u64 = 100_000;
const BLOCK_SIZE: usize = 16;
/// A 2,048-token prompt: 128 blocks.
const PROMPT_BLOCKS: usize = 128;

fn key(replica: u64, i: u64) -> u64 {
    // splitmix64 of a (replica, block) pair: uniform like a real block hash.
    let mut x = replica.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_add(0x632b_e59b_d9b4_e019);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// 16 replicas with 100k blocks each; the first quarter of each replica's blocks is a prefix shared by all
/// (a common system prompt), so keys overlap as in a fleet serving one application.
fn fleet(policy: PolicyKind) -> Router {
    let st = StepTimeCoefficients {
        step_s: 0.0107,
        prefill_token_s: 3.2e-5,
        decode_req_s: 3.2e-5,
        kv_token_s: 4.9e-8,
        prefill_attn_s: 1.1e-11,
        ..Default::default()
    };
    let mut c = RouterConfig::new(policy, st);
    c.block_size = BLOCK_SIZE;
    c.prefix_hash_seed = Some(b"s:bench".to_vec());
    let mut r = Router::new(c).unwrap();
    for rep in 0..REPLICAS as u64 {
        let name = format!("replica-{rep}");
        r.add_replica(&name).unwrap();
        let keys: Vec<u64> = (0..BLOCKS_PER_REPLICA)
            .map(|i| if i < BLOCKS_PER_REPLICA / 4 { key(999, i) } else { key(rep, i) })
            .collect();
        for chunk in keys.chunks(1024) {
            let ev = KvEvent::Stored {
                block_hashes: chunk,
                parent_block_hash: None,
                token_ids: &[],
                block_size: BLOCK_SIZE,
            };
            r.apply_events(&name, &[ev]).unwrap();
        }
        let load = LoadReport {
            num_waiting: rep % 5,
            num_running: 20 + rep,
            num_waiting_tokens: 500 * (rep % 5),
            num_running_tokens: 40_000,
            kv_usage: 0.5,
        };
        r.update_load(&name, load).unwrap();
    }
    r
}

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_16x100k");
    // The prompt's first 100 blocks are cached on replica 3, the rest nowhere.
    let mut prompt_keys: Vec<u64> = (25_000..25_100).map(|i| key(3, i)).collect();
    prompt_keys.extend((0..(PROMPT_BLOCKS - 100) as u64).map(|i| key(77, i)));
    let tokens: Vec<u32> = (0..(PROMPT_BLOCKS * BLOCK_SIZE) as u32).map(|t| 3 + t * 7 % 32_000).collect();
    for policy in PolicyKind::NAMES {
        let kind = PolicyKind::parse(policy).unwrap();
        let mut r = fleet(kind);
        let mut i = 0u64;
        g.bench_function(BenchmarkId::new("hashes", policy), |b| {
            b.iter(|| {
                let id = format!("q{i}");
                i += 1;
                let p = Prompt::BlockHashes { block_hashes: &prompt_keys, num_tokens: None };
                let d = r.route(&id, &p, None, None).unwrap();
                r.finish(&id).unwrap();
                black_box(d)
            })
        });
        if kind == PolicyKind::KvOverlap {
            g.bench_function(BenchmarkId::new("tokens", policy), |b| {
                b.iter(|| {
                    let p = Prompt::Tokens { token_ids: &tokens, lora_name: None, cache_salt: None };
                    black_box(r.rank(&p, None, None).unwrap())
                })
            });
        }
    }
    g.finish();

    let mut r = fleet(PolicyKind::KvOverlap);
    let keys: Vec<u64> = (0..64).map(|i| key(5000, i)).collect();
    c.bench_function("apply_events_64_blocks_stored_and_removed", |b| {
        b.iter(|| {
            let s = KvEvent::Stored {
                block_hashes: &keys,
                parent_block_hash: None,
                token_ids: &[],
                block_size: BLOCK_SIZE,
            };
            let rm = KvEvent::Removed { block_hashes: &keys };
            r.apply_events("replica-7", &[s, rm]).unwrap();
        })
    });
}

criterion_group!(benches, decisions);
criterion_main!(benches);
