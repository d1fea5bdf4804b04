//! Criterion benchmarks of the core alone (no Python): one decode step at 64/256/1024 running requests,
//! block-boundary decode steps vs plain ones, a decode step with cold caches, choosing a preemption victim (per
//! policy and victim rule), prefix-cache lookup at 0/50/90% hit rates, block alloc/free churn, and hashing a batch's blocks
//! at a boundary.
//!
//! Run with `cargo bench -p kvsched-core --bench core` (add `-- --quick` for a fast pass). The same cases
//! through the Python API live in `benches/` (pytest-benchmark) and `kvsched bench`; the difference between
//! the two is the cost of the binding.

// Benchmark set-up is not reachable by callers; failing loudly is the right thing here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvsched_core::block_pool::BlockPool;
use kvsched_core::{
    BlockHash, HashAlgo, Policy, PreemptionVictim, Ragged, RequestParams, Scheduler, SchedulerConfig,
};

const PROMPT_LEN: usize = 32;

/// A small deterministic generator (xorshift64*), so the benches need no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn tokens(&mut self, n: usize) -> Vec<i64> {
        (0..n).map(|_| 3 + (self.next() % 31_997) as i64).collect()
    }
}

/// A uniformly distributed 32-byte hash for `i` (splitmix64 per word), like a real block hash.
fn fake_hash(i: u64) -> BlockHash {
    let mut h = [0u8; 32];
    let mut x = i;
    for word in h.chunks_exact_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        word.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    BlockHash(h)
}

/// One sampled token for every entry, or none for a partial prefill.
fn sampled_for(computed: &[i32], scheduled: &[i32], known_len: usize) -> (Vec<i64>, Vec<i64>) {
    let mut values = Vec::with_capacity(computed.len());
    let mut indptr = Vec::with_capacity(computed.len() + 1);
    indptr.push(0);
    for (&c, &s) in computed.iter().zip(scheduled) {
        if (c + s) as usize >= known_len {
            values.push(7);
        }
        indptr.push(values.len() as i64);
    }
    (values, indptr)
}

/// A scheduler with `n` requests, all past their prefill: every following step is `n` decodes.
fn decoding_scheduler(n: usize) -> Scheduler {
    let config = SchedulerConfig {
        num_blocks: (n * (8192 / 16) + 1) as u32,
        max_num_seqs: n as u32,
        max_num_batched_tokens: 8192.max(n as u32),
        prefix_hash_seed: Some(b"bench".to_vec()),
        ..Default::default()
    };
    let mut sched = Scheduler::new(config).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for i in 0..n {
        sched.add_request(&format!("r{i:06}"), &rng.tokens(PROMPT_LEN), RequestParams::default()).unwrap();
    }
    loop {
        let out = sched.schedule().unwrap();
        let (values, indptr) = sampled_for(&out.num_computed_tokens, &out.num_scheduled_tokens, PROMPT_LEN);
        let sampled = Ragged { values: &values, indptr: &indptr };
        sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap();
        if out.num_reqs() == n && out.total_num_scheduled_tokens == n as u64 {
            return sched;
        }
    }
}

fn decode_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_step");
    for &n in &[64usize, 256, 1024] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            let values = vec![7i64; n];
            let indptr: Vec<i64> = (0..=n as i64).collect();
            // Each step appends one token per request; a scheduler lasts ~8000 steps before its requests reach
            // max_model_len. One scheduler serves every sample until it has run STEPS_PER_SCHEDULER steps, then
            // a fresh one is built outside the timed region (so set-up and cold caches are amortised as in a
            // long-running engine, not paid by each sample).
            const STEPS_PER_SCHEDULER: u64 = 4000;
            let mut sched = decoding_scheduler(n);
            let mut used: u64 = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    if used >= STEPS_PER_SCHEDULER {
                        sched = decoding_scheduler(n);
                        used = 0;
                    }
                    let run = left.min(STEPS_PER_SCHEDULER - used);
                    let start = Instant::now();
                    for _ in 0..run {
                        let out = sched.schedule().unwrap();
                        let sampled = Ragged { values: &values, indptr: &indptr };
                        black_box(
                            sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap(),
                        );
                    }
                    total += start.elapsed();
                    left -= run;
                    used += run;
                }
                total
            });
        });
    }
    group.finish();
}

/// Which step of a lockstep decode (block_size 16) does per-request block work, by the requests' computed
/// count `c` at schedule time: the update of `c % 16 == 14` fills a block (hashing it), the schedule of
/// `c % 16 == 15` caches it, the schedule of `c % 16 == 0` allocates the next block.
fn is_boundary_step(computed: i32) -> bool {
    matches!(computed % 16, 14 | 15 | 0)
}

/// `n` requests decoding in lockstep: the mean time of a whole step (schedule + update) over only the steps
/// that cross a block boundary (`boundary`), or over only the plain steps (`plain`). The other steps run
/// untimed. Comparing the two shows what a block boundary adds to a step.
fn boundary_step(c: &mut Criterion) {
    const N: usize = 256;
    const STEPS_PER_SCHEDULER: u64 = 4000;
    let mut group = c.benchmark_group("boundary_step");
    group.throughput(Throughput::Elements(N as u64));
    for (name, want_boundary) in [("plain", false), ("boundary", true)] {
        group.bench_function(BenchmarkId::new(name, N), |b| {
            let values = vec![7i64; N];
            let indptr: Vec<i64> = (0..=N as i64).collect();
            let mut sched = decoding_scheduler(N);
            let mut used: u64 = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut timed = 0;
                while timed < iters {
                    if used >= STEPS_PER_SCHEDULER {
                        sched = decoding_scheduler(N);
                        used = 0;
                    }
                    let start = Instant::now();
                    let out = sched.schedule().unwrap();
                    let sampled = Ragged { values: &values, indptr: &indptr };
                    black_box(
                        sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap(),
                    );
                    let elapsed = start.elapsed();
                    used += 1;
                    if is_boundary_step(out.num_computed_tokens[0]) == want_boundary {
                        total += elapsed;
                        timed += 1;
                    }
                }
                total
            });
        });
    }
    group.finish();
}

/// One decode step of 256 requests after 8 MiB of unrelated memory traffic (outside the timed region), as when
/// the model's forward pass ran between two scheduler steps: the step's data comes from DRAM, not the caches.
fn decode_step_cold(c: &mut Criterion) {
    const N: usize = 256;
    const STEPS_PER_SCHEDULER: u64 = 4000;
    let mut group = c.benchmark_group("decode_step_cold");
    group.throughput(Throughput::Elements(N as u64));
    group.bench_function(BenchmarkId::from_parameter(N), |b| {
        let values = vec![7i64; N];
        let indptr: Vec<i64> = (0..=N as i64).collect();
        let mut sched = decoding_scheduler(N);
        let mut used: u64 = 0;
        let mut scratch = vec![0u8; 8 << 20];
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                if used >= STEPS_PER_SCHEDULER {
                    sched = decoding_scheduler(N);
                    used = 0;
                }
                for line in scratch.chunks_mut(64) {
                    line[0] = line[0].wrapping_add(i as u8 | 1);
                }
                black_box(&scratch);
                let start = Instant::now();
                let out = sched.schedule().unwrap();
                let sampled = Ragged { values: &values, indptr: &indptr };
                black_box(sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap());
                total += start.elapsed();
                used += 1;
            }
            total
        });
    });
    group.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    const PROMPT: usize = 2048;
    let mut group = c.benchmark_group("prefix_lookup");
    group.throughput(Throughput::Elements(PROMPT as u64));
    let config =
        SchedulerConfig { num_blocks: 4096, prefix_hash_seed: Some(b"bench".to_vec()), ..Default::default() };
    let mut sched = Scheduler::new(config).unwrap();
    let mut rng = Rng(42);
    let cached = rng.tokens(PROMPT);
    // Run one request with `cached` as its prompt to completion: its full blocks stay in the prefix cache.
    sched.add_request("warm", &cached, RequestParams { max_tokens: Some(1), ..Default::default() }).unwrap();
    while sched.has_unfinished_requests() {
        let out = sched.schedule().unwrap();
        let (values, indptr) = sampled_for(&out.num_computed_tokens, &out.num_scheduled_tokens, PROMPT);
        let sampled = Ragged { values: &values, indptr: &indptr };
        sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap();
    }
    for &hit_pct in &[0usize, 50, 90] {
        // Share the first hit_pct% of the blocks with the cached prompt, then diverge.
        let shared = (PROMPT / 16) * hit_pct / 100 * 16;
        let mut probe = cached[..shared].to_vec();
        probe.extend(rng.tokens(PROMPT - shared));
        let hit = sched.get_num_cached_tokens(&probe, None, None).unwrap() as usize;
        assert_eq!(hit, shared, "expected {shared} cached tokens for {hit_pct}%");
        group.bench_with_input(BenchmarkId::new("hit_pct", hit_pct), &probe, |b, probe| {
            b.iter(|| sched.get_num_cached_tokens(black_box(probe), None, None).unwrap());
        });
    }
    group.finish();
}

fn alloc_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_free");
    for &hashed in &[false, true] {
        for &n in &[1usize, 16, 256] {
            group.throughput(Throughput::Elements(n as u64));
            let name = if hashed { "hashed" } else { "plain" };
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                // With `hashed`, every allocated block is entered into the prefix cache before it is freed,
                // so later allocations evict (remove from the hash map) as they pop the free queue.
                // The blocks are cached in one run, as a prefill chunk's full blocks are (`cache_run`).
                let mut pool = BlockPool::new(65_536, true);
                let mut blocks = Vec::with_capacity(n);
                let mut hashes = Vec::with_capacity(n);
                let mut counter: u64 = 0;
                b.iter(|| {
                    blocks.clear();
                    pool.allocate_into(n, &mut blocks);
                    if hashed {
                        hashes.clear();
                        hashes.extend((0..n).map(|_| {
                            counter += 1;
                            fake_hash(counter)
                        }));
                        pool.cache_run(&blocks, &hashes);
                    }
                    pool.free_blocks(black_box(&blocks));
                });
            });
        }
    }
    group.finish();
}

/// Hashing the blocks of a batch at a block boundary: one 16-token block for each of 256 requests, chained to a
/// parent hash (what the update that fills a block does per request), with each algorithm.
fn block_hashing(c: &mut Criterion) {
    use kvsched_core::hashing::{BlockHasher, ExtraKeys};
    let mut group = c.benchmark_group("block_hashing");
    let mut rng = Rng(11);
    // Each request: 32 tokens, its first block's hash known; the call hashes the second block (scratch buffer
    // reused across requests, as the core does).
    let tokens: Vec<Vec<u32>> =
        (0..256).map(|_| rng.tokens(32).into_iter().map(|t| t as u32).collect()).collect();
    let extra = ExtraKeys::default();
    for (name, algo) in [("xxh3_128", HashAlgo::Xxh3_128), ("sha256", HashAlgo::Sha256)] {
        let hasher = BlockHasher::new(algo, None).unwrap();
        let mut hashes: Vec<Vec<BlockHash>> = (0..256u64).map(|i| vec![fake_hash(i)]).collect();
        let mut buf = Vec::new();
        group.throughput(Throughput::Elements(256));
        group.bench_function(BenchmarkId::new(name, 256), |b| {
            b.iter(|| {
                for (h, t) in hashes.iter_mut().zip(&tokens) {
                    h.truncate(1);
                    hasher.extend_hashes(h, t, 16, &extra, &[], &mut buf);
                    black_box(&h[1]);
                }
            })
        });
    }
    group.finish();
}

/// `n` requests of 1023 prompt tokens (1024 for the first) with one output token each, decoding in a pool with
/// no free block (64 blocks of 16 each): the next step's first decode needs a 65th block, so that step preempts
/// one request, chosen by `rule`. `max_tokens` differs by request (distinct cost scores), or is the same for
/// all (`uniform`: every cost score ties, the most work for the bounded search).
fn full_pool_scheduler(n: usize, policy: Policy, rule: PreemptionVictim, uniform: bool) -> Scheduler {
    let config = SchedulerConfig {
        num_blocks: (n * 64 + 1) as u32,
        max_num_seqs: n as u32,
        max_num_batched_tokens: (n * 1024) as u32,
        policy,
        preemption_victim: rule,
        prefix_hash_seed: Some(b"bench".to_vec()),
        ..Default::default()
    };
    let mut sched = Scheduler::new(config).unwrap();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    for i in 0..n {
        let max_tokens = if uniform { 500 } else { 100 + (i as u32 * 7919) % 1000 };
        let p = RequestParams {
            max_tokens: Some(max_tokens),
            arrival_time: i as f64,
            tenant: Some(format!("t{}", i % 4)),
            ..Default::default()
        };
        sched.add_request(&format!("r{i:06}"), &rng.tokens(if i == 0 { 1024 } else { 1023 }), p).unwrap();
    }
    let out = sched.schedule().unwrap(); // every prompt in one step
    assert_eq!((out.num_reqs(), sched.num_free_blocks()), (n, 0));
    let values = vec![7i64; n];
    let indptr: Vec<i64> = (0..=n as i64).collect();
    let sampled = Ragged { values: &values, indptr: &indptr };
    sched.update_from_output(out.scheduler_id, out.step_id, sampled, None).unwrap();
    sched
}

/// Choosing the victim of the step that would preempt in a `full_pool_scheduler` of 256 requests, per policy
/// and victim rule (`Scheduler::next_victim`, the same choice without preempting: it is called again and again
/// on one state). What a preempting step adds for the choice; steps that do not preempt never make it.
fn victim_choice(c: &mut Criterion) {
    const N: usize = 256;
    let mut group = c.benchmark_group("victim_choice");
    let cases = [
        ("fcfs-default", Policy::Fcfs, PreemptionVictim::Default, false),
        ("fcfs-lcf", Policy::Fcfs, PreemptionVictim::Lcf, false),
        ("fcfs-cost", Policy::Fcfs, PreemptionVictim::Cost, false),
        ("fcfs-cost-uniform", Policy::Fcfs, PreemptionVictim::Cost, true),
        ("priority-default", Policy::Priority, PreemptionVictim::Default, false),
        ("priority-lcf", Policy::Priority, PreemptionVictim::Lcf, false),
        ("priority-cost", Policy::Priority, PreemptionVictim::Cost, false),
        ("fair-default", Policy::Fair, PreemptionVictim::Default, false),
        ("fair-lcf", Policy::Fair, PreemptionVictim::Lcf, false),
        ("fair-cost", Policy::Fair, PreemptionVictim::Cost, false),
    ];
    for (name, policy, rule, uniform) in cases {
        let sched = full_pool_scheduler(N, policy, rule, uniform);
        group.bench_function(BenchmarkId::new(name, N), |b| {
            b.iter(|| black_box(sched.next_victim().unwrap()))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    decode_step,
    boundary_step,
    decode_step_cold,
    victim_choice,
    prefix_lookup,
    alloc_free,
    block_hashing
);
criterion_main!(benches);
