//! Times the core alone on a steady-decode workload (256 requests, prompt 512, 256 outputs):
//! `cargo run --release -p kvsched-core --example decode_loop`.
#![allow(clippy::expect_used)]

use std::time::Instant;

use kvsched_core::{Ragged, RequestParams, Scheduler, SchedulerConfig};

fn main() {
    let (mut ts, mut tu) = (Vec::new(), Vec::new());
    let reps: usize = std::env::var("KV_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    for _ in 0..reps {
        run(&mut ts, &mut tu);
    }
    if std::env::var("KV_MOD").is_ok() {
        let mut by: Vec<Vec<f64>> = vec![Vec::new(); 16];
        for (i, (a, b)) in ts.iter().zip(tu.iter()).enumerate() {
            by[i % 16].push(a + b);
        }
        let med: Vec<String> = by
            .iter_mut()
            .map(|v| {
                v.sort_by(f64::total_cmp);
                format!("{:.1}", v[v.len() / 2])
            })
            .collect();
        println!("by step mod 16 (median total): {}", med.join(" "));
    }
    ts.sort_by(f64::total_cmp);
    tu.sort_by(f64::total_cmp);
    println!(
        "{} steps: schedule median {:.2} us, update median {:.2} us",
        ts.len(),
        ts[ts.len() / 2],
        tu[tu.len() / 2]
    );
}

fn run(ts: &mut Vec<f64>, tu: &mut Vec<f64>) {
    let cfg = SchedulerConfig {
        num_blocks: std::env::var("KV_BLOCKS").ok().and_then(|v| v.parse().ok()).unwrap_or(32768),
        max_num_seqs: 256,
        max_num_batched_tokens: std::env::var("KV_BUDGET").ok().and_then(|v| v.parse().ok()).unwrap_or(8192),
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).expect("config");
    let mut x: u64 = 12345;
    for i in 0..256 {
        let prompt: Vec<i64> = (0..512)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 40) as i64 % 32000
            })
            .collect();
        let p = RequestParams {
            max_tokens: Some(std::env::var("KV_MAXTOK").ok().and_then(|v| v.parse().ok()).unwrap_or(256)),
            arrival_time: i as f64,
            ..Default::default()
        };
        s.add_request(&format!("r{i}"), &prompt, p).expect("add");
    }
    while s.has_unfinished_requests() {
        let t0 = Instant::now();
        let out = s.schedule().expect("schedule");
        let t1 = t0.elapsed();
        let n = out.num_reqs();
        let mut indptr = vec![0i64; n + 1];
        let mut k = 0;
        for i in 0..n {
            if out.num_computed_tokens[i] + out.num_scheduled_tokens[i] >= 512 {
                k += 1;
            }
            indptr[i + 1] = k;
        }
        let values = vec![7i64; k as usize];
        let t2 = Instant::now();
        s.update_from_output(
            out.scheduler_id,
            out.step_id,
            Ragged { values: &values, indptr: &indptr },
            None,
        )
        .expect("update");
        tu.push(t2.elapsed().as_nanos() as f64 / 1e3);
        ts.push(t1.as_nanos() as f64 / 1e3);
    }
}
