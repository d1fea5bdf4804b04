//! KV cache events (`events.rs`): what a step records, one rule at a time, then a proptest of random operation
//! sequences checking after every operation that replaying the events reproduces the prefix cache, and that a
//! scheduler with events on decides exactly as one with them off.

use std::collections::HashMap;

use proptest::prelude::*;

use super::helpers::{add, apply, live_ids, params, prompt, schedule, step_with, Pending};
use crate::config::CHUNKED_LOCAL;
use crate::events::{CLEARED, REMOVED, STORED};
use crate::hashing::ExtraKeys;
use crate::hybrid::group_key;
use crate::{BlockHash, KvCacheEvents, RequestParams, Scheduler, SchedulerConfig};

fn cfg(num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_model_len: 64,
        max_num_batched_tokens: 64,
        prefix_hash_seed: Some(b"events".to_vec()),
        enable_kv_cache_events: true,
        ..Default::default()
    }
}

/// Replays `ev` into `counts` (blocks per cache key: the hash in its event's group), checking each block's
/// `num_copies` against the replayed count, and that a stored run's blocks sit in order within the run, each at
/// the index in its request's block table whose hash it carries (while `s` still knows the request). Returns the
/// stored runs with a hole (a block of the run between two stored ones not stored).
fn replay(counts: &mut HashMap<BlockHash, u32>, ev: &KvCacheEvents, s: &Scheduler) -> usize {
    ev.check().unwrap();
    let mut holes = 0;
    for e in 0..ev.len() {
        if ev.kinds[e] == CLEARED {
            counts.clear();
        }
        let (lo, hi) = (ev.block_indptr[e] as usize, ev.block_indptr[e + 1] as usize);
        if ev.kinds[e] == STORED {
            let pos = &ev.block_positions[lo..hi];
            let first = ev.num_cached_blocks[e];
            let end = first + (ev.token_indptr[e + 1] - ev.token_indptr[e]) / 4;
            assert!(pos.windows(2).all(|w| w[0] < w[1]), "event {e}: positions out of order: {pos:?}");
            assert!(
                pos.iter().all(|&i| (first..end).contains(&i)),
                "event {e}: {pos:?} not in {first}..{end}"
            );
            holes += usize::from(
                pos.first().is_some_and(|&a| pos.last().is_some_and(|&b| b - a + 1 > pos.len() as u32)),
            );
            if let Some(req) = ev.req_ids[e].as_deref().and_then(|id| s.get_request(id).ok()) {
                for (i, &p) in pos.iter().enumerate() {
                    assert_eq!(
                        req.block_hashes[p as usize],
                        ev.block_hashes[lo + i],
                        "event {e}: block at {p}"
                    );
                }
            }
        } else {
            assert!(ev.block_positions[lo..hi].iter().all(|&p| p == 0));
        }
        for i in ev.block_indptr[e] as usize..ev.block_indptr[e + 1] as usize {
            let key = group_key(&ev.block_hashes[i], ev.groups[e] as usize);
            let n = counts.entry(key).or_default();
            if ev.kinds[e] == STORED {
                *n += 1;
            } else {
                *n -= 1;
            }
            assert_eq!(*n, ev.num_copies[i], "event {e}: num_copies disagrees with the replay");
        }
    }
    counts.retain(|_, n| *n > 0);
    holes
}

/// The scheduler's prefix cache as blocks per hash.
fn cached(s: &Scheduler) -> HashMap<BlockHash, u32> {
    let mut m = HashMap::new();
    for h in s.cached_block_hashes() {
        *m.entry(h).or_default() += 1;
    }
    m
}

#[test]
fn a_prefill_stores_its_full_blocks_as_one_run_and_a_decode_the_block_it_completes() {
    let mut s = Scheduler::new(cfg(16)).unwrap();
    let p = RequestParams { cache_salt: Some("s".into()), lora_name: Some("L".into()), ..params(4) };
    add(&mut s, "a", &prompt(10, 10), p);
    let (out, _) = step_with(&mut s, 7);
    let ev = s.take_kv_cache_events();
    assert_eq!(ev.kinds, vec![STORED]);
    let a = s.get_request("a").unwrap().block_hashes.clone();
    assert_eq!(ev.block_hashes, a[..2].to_vec());
    assert_eq!((ev.parents[0], ev.num_copies.clone()), (None, vec![1, 1]));
    assert_eq!(ev.token_ids, (10..18).collect::<Vec<u32>>());
    assert_eq!(ev.extra_keys[0], ExtraKeys { cache_salt: Some("s".into()), lora_name: Some("L".into()) });
    assert!(s.take_kv_cache_events().is_empty(), "a take leaves nothing");
    // 11 tokens; the next two decodes complete block 2 (tokens 8..12) when 12 are computed.
    step_with(&mut s, 7);
    assert!(s.take_kv_cache_events().is_empty());
    step_with(&mut s, 7);
    let ev = s.take_kv_cache_events();
    let a = s.get_request("a").unwrap().block_hashes.clone();
    assert_eq!((ev.kinds.clone(), ev.block_hashes.clone()), (vec![STORED], vec![a[2]]));
    assert_eq!(ev.parents[0], Some(a[1]));
    assert_eq!(ev.token_ids, vec![18, 19, 7, 7]);
    drop(out);
}

#[test]
fn reuse_removes_a_block_a_reset_clears_and_a_hash_cached_twice_counts_its_copies() {
    let mut s = Scheduler::new(cfg(6)).unwrap(); // 5 usable blocks
    add(&mut s, "a", &prompt(0, 8), params(1)); // 2 full blocks: the last is recomputed by a second "a"
    step_with(&mut s, 1);
    let stored = s.take_kv_cache_events();
    assert_eq!(stored.num_copies, vec![1, 1]);
    add(&mut s, "b", &prompt(0, 8), params(1)); // hits block 0, recomputes block 1 in a new block
    step_with(&mut s, 1);
    let ev = s.take_kv_cache_events();
    assert_eq!((ev.kinds.clone(), ev.block_hashes.clone()), (vec![STORED], vec![stored.block_hashes[1]]));
    assert_eq!((ev.parents[0], ev.num_copies.clone()), (Some(stored.block_hashes[0]), vec![2]));
    // A 20-token prompt takes all 5 blocks: the free ones carrying hashes are reused, one removal each.
    step_with(&mut s, 1); // a and b finish
    s.take_kv_cache_events();
    add(&mut s, "c", &prompt(100, 19), params(1));
    step_with(&mut s, 1);
    let ev = s.take_kv_cache_events();
    let removed: Vec<(BlockHash, u32)> = (0..ev.len())
        .filter(|&e| ev.kinds[e] == REMOVED)
        .map(|e| (ev.block_hashes[ev.block_indptr[e] as usize], ev.num_copies[ev.block_indptr[e] as usize]))
        .collect();
    let (h0, h1) = (stored.block_hashes[0], stored.block_hashes[1]);
    let mut copies_left: Vec<(BlockHash, u32)> = removed.clone();
    copies_left.sort();
    let mut want = vec![(h0, 0), (h1, 1), (h1, 0)];
    want.sort();
    assert_eq!(copies_left, want, "each block of a hash leaves once, the last leaves no copy");
    assert_eq!(
        ev.kinds.last(),
        Some(&STORED),
        "the removals come before the store of the run that caused them"
    );
    step_with(&mut s, 1);
    assert!(s.reset_prefix_cache(false).unwrap());
    let ev = s.take_kv_cache_events();
    assert_eq!(ev.kinds, vec![CLEARED]);
    assert!(s.cached_block_hashes().is_empty());
}

#[test]
fn sparse_retention_stores_a_windows_kept_blocks_with_their_places_in_the_run() {
    // A window of 5 tokens needs one block before a hit; an interval of 8 tokens (two blocks) keeps the last
    // block of each segment, 1 and 3, and the prompt's last token (17) keeps block 3: blocks 0 and 2 are holes.
    let retained =
        SchedulerConfig { sliding_window: Some(5), prefix_cache_retention_interval: Some(8), ..cfg(16) };
    let mut s = Scheduler::new(retained).unwrap();
    add(&mut s, "a", &prompt(0, 18), params(4));
    step_with(&mut s, 1);
    let ev = s.take_kv_cache_events();
    let a = s.get_request("a").unwrap().block_hashes.clone();
    assert_eq!(ev.kinds, vec![STORED]);
    assert_eq!(ev.block_hashes, vec![a[1], a[3]]);
    assert_eq!(ev.block_positions, vec![1, 3]);
    assert_eq!((ev.num_cached_blocks[0], ev.parents[0]), (0, None));
    assert_eq!(ev.token_ids, (0..16).collect::<Vec<u32>>(), "the tokens span the whole run, holes too");
    let mut counts = HashMap::new();
    assert_eq!(replay(&mut counts, &ev, &s), 1);
}

#[test]
fn events_off_record_nothing() {
    let mut s = Scheduler::new(SchedulerConfig { enable_kv_cache_events: false, ..cfg(16) }).unwrap();
    add(&mut s, "a", &prompt(0, 12), params(2));
    step_with(&mut s, 1);
    assert!(s.reset_prefix_cache(false).is_ok());
    assert!(s.take_kv_cache_events().is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, .. ProptestConfig::default() })]

    /// Random adds (whole-block prompts of three families, so hashes get cached twice), steps with up to two in
    /// flight, aborts, failed steps and resets, with a tight pool, with one full-attention group, a sliding
    /// window or several KV cache groups (windows, chunked-local): after every operation the events replayed from
    /// the start (per block, in its group) equal the prefix cache, and a twin scheduler with events off made the
    /// same decisions.
    #[test]
    fn replaying_the_events_reproduces_the_prefix_cache(
        num_blocks in 8u32..30,
        layout in 0usize..9,
        ops in prop::collection::vec((0u8..8, 0u64..64), 1..120),
    ) {
        let (window, groups) = match layout {
            0 | 1 => (None, vec![]),
            2 | 6 => (Some(5), vec![]),
            3 | 7 => (None, vec![None, Some(3)]),
            4 => (None, vec![Some(6), None, Some(1)]),
            8 => (None, vec![None, Some(5), Some(5)]),
            _ => (None, vec![None, Some(CHUNKED_LOCAL | 8), Some(5)]),
        };
        // Sparse retention of the windows' blocks: stored runs with holes.
        let retention = (layout >= 6).then_some(if layout == 7 { 8 } else { 0 });
        // Each group takes its own blocks: a pool as tight per group.
        let pool = num_blocks * groups.len().max(1) as u32;
        let on = SchedulerConfig {
            sliding_window: window, kv_cache_groups: groups, prefix_cache_retention_interval: retention, ..cfg(pool)
        };
        let mut s = Scheduler::new(SchedulerConfig { max_num_batched_tokens: 16, max_num_seqs: 4, ..on.clone() }).unwrap();
        let mut off = Scheduler::new(SchedulerConfig {
            enable_kv_cache_events: false, max_num_batched_tokens: 16, max_num_seqs: 4, ..on
        }).unwrap();
        let mut counts = HashMap::new();
        let mut pending: Vec<(Pending, Pending)> = Vec::new();
        for (k, (op, x)) in ops.into_iter().enumerate() {
            match op {
                0 | 1 => {
                    let family = (x % 3) as i64 * 100;
                    let len = 4 * (1 + (x / 3) % 5) as usize + usize::from(x % 7 == 0);
                    let p = prompt(family, len.min(40));
                    for t in [&mut s, &mut off] {
                        let _ = t.add_request(&format!("r{k}"), &p, params(1 + (x % 4) as u32));
                    }
                }
                2..=4 => {
                    if pending.len() < 2 {
                        let (a, b) = (schedule(&mut s), schedule(&mut off));
                        prop_assert_eq!(&a.out.new_block_ids, &b.out.new_block_ids);
                        prop_assert_eq!(&a.out.num_scheduled_tokens, &b.out.num_scheduled_tokens);
                        pending.push((a, b));
                    } else {
                        let (a, b) = pending.remove(0);
                        apply(&mut s, &a, |_| vec![5]);
                        apply(&mut off, &b, |_| vec![5]);
                    }
                }
                5 => {
                    let live = live_ids(&s);
                    if !live.is_empty() {
                        let id = live[x as usize % live.len()].clone();
                        s.abort_requests(&[&id]).unwrap();
                        off.abort_requests(&[&id]).unwrap();
                    }
                }
                6 => {
                    if pending.len() == 1 {
                        let (a, b) = pending.remove(0);
                        s.fail_step(a.out.scheduler_id, a.out.step_id).unwrap();
                        off.fail_step(b.out.scheduler_id, b.out.step_id).unwrap();
                    }
                }
                _ => {
                    let running = x % 2 == 0;
                    prop_assert_eq!(s.reset_prefix_cache(running).unwrap(), off.reset_prefix_cache(running).unwrap());
                }
            }
            s.check_invariants().unwrap();
            replay(&mut counts, &s.take_kv_cache_events(), &s);
            prop_assert_eq!(&counts, &cached(&s));
            prop_assert_eq!(s.num_free_blocks(), off.num_free_blocks());
            prop_assert!(off.take_kv_cache_events().is_empty());
        }
    }
}
