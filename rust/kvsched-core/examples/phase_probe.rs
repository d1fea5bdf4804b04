#![allow(clippy::unwrap_used)]
use kvsched_core::{Ragged, RequestParams, Scheduler, SchedulerConfig};
use std::time::Instant;
fn main() {
    let n = 256usize;
    let config = SchedulerConfig {
        num_blocks: (n * (8192 / 16) + 1) as u32,
        max_num_seqs: n as u32,
        max_num_batched_tokens: 8192,
        prefix_hash_seed: Some(b"bench".to_vec()),
        ..Default::default()
    };
    let mut sched = Scheduler::new(config).unwrap();
    let values = vec![7i64; n];
    let indptr: Vec<i64> = (0..=n as i64).collect();
    let warm = std::env::args().nth(1).is_some();
    if warm {
        // A first generation of requests fills (and touches) the pool and the prefix-cache map, then finishes.
        for i in 0..n {
            let toks: Vec<i64> = (0..32).map(|j| (5 + (i * 17 + j * 3) % 30000) as i64).collect();
            sched.add_request(&format!("w{i:06}"), &toks, RequestParams::default()).unwrap();
        }
        for _ in 0..8000 {
            let out = sched.schedule().unwrap();
            if out.num_reqs() == 0 {
                break;
            }
            let m = out.num_reqs();
            let v = vec![7i64; m];
            let ip: Vec<i64> = (0..=m as i64).collect();
            sched
                .update_from_output(out.scheduler_id, out.step_id, Ragged { values: &v, indptr: &ip }, None)
                .unwrap();
        }
        println!("warm: free blocks {}", sched.num_free_blocks());
    }
    for i in 0..n {
        let toks: Vec<i64> = (0..32).map(|j| (3 + (i * 31 + j * 7) % 30000) as i64).collect();
        sched.add_request(&format!("r{i:06}"), &toks, RequestParams::default()).unwrap();
    }
    let out = sched.schedule().unwrap();
    sched
        .update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &indptr }, None)
        .unwrap();
    let mut by_phase = vec![Vec::new(); 16];
    let steps: usize = std::env::var("PROBE_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(3200);
    // PROBE_COLD_MB=8: that much other memory is written between steps (outside the timed calls), as when a
    // model's forward pass runs between two scheduler steps.
    let cold_mb: usize = std::env::var("PROBE_COLD_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut scratch = vec![0u8; cold_mb << 20];
    for k in 0..steps {
        for line in scratch.chunks_mut(64) {
            line[0] = line[0].wrapping_add(k as u8 | 1);
        }
        std::hint::black_box(&scratch);
        let t0 = Instant::now();
        let out = sched.schedule().unwrap();
        let t1 = Instant::now();
        sched
            .update_from_output(
                out.scheduler_id,
                out.step_id,
                Ragged { values: &values, indptr: &indptr },
                None,
            )
            .unwrap();
        let t2 = Instant::now();
        by_phase[k % 16].push(((t1 - t0).as_nanos() as u64, (t2 - t1).as_nanos() as u64));
    }
    let mut all: Vec<(u64, u64)> = by_phase.iter().flatten().copied().collect();
    if !all.is_empty() {
        let mean = all.iter().map(|x| x.0 + x.1).sum::<u64>() / all.len() as u64;
        let mut s: Vec<u64> = all.iter().map(|x| x.0).collect();
        let mut u: Vec<u64> = all.iter().map(|x| x.1).collect();
        s.sort();
        u.sort();
        all.sort_by_key(|x| x.0 + x.1);
        let (med, p99) = (all[all.len() / 2], all[all.len() * 99 / 100]);
        println!(
            "all steps: schedule median {} ns, update median {} ns, step median {} ns, mean {mean} ns, p99 {} ns",
            s[s.len() / 2],
            u[u.len() / 2],
            med.0 + med.1,
            p99.0 + p99.1
        );
    }
    for (p, v) in by_phase.iter_mut().enumerate() {
        let mut s: Vec<u64> = v.iter().map(|x| x.0).collect();
        let mut u: Vec<u64> = v.iter().map(|x| x.1).collect();
        s.sort();
        u.sort();
        if v.is_empty() {
            continue;
        }
        println!("phase {p:2}: schedule {:6} ns  update {:6} ns", s[s.len() / 2], u[u.len() / 2]);
    }
}
