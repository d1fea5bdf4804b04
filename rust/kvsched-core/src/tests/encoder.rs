//! Encoder inputs in the step loop (`encoder_sched.rs`): the rules one by one, then a proptest of random
//! operation sequences with encoder inputs, tight encoder budgets and preemption, checking every invariant
//! after every operation.

use proptest::prelude::*;

use super::helpers::{add, apply, live_ids, prompt, schedule, step_with, Pending};
use crate::{EncoderInput, Policy, RequestParams, SchedError, Scheduler, SchedulerConfig};

fn cfg(budget: u32, cache: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_model_len: 128,
        max_num_batched_tokens: 16,
        max_num_encoder_input_tokens: budget,
        encoder_cache_size: cache,
        prefix_hash_seed: Some(b"enc".to_vec()),
        ..Default::default()
    }
}

fn inp(start: u32, num_tokens: u32, hash: u64) -> EncoderInput {
    EncoderInput { start, num_tokens, hash }
}

/// A request with encoder inputs `inputs` (up to 2 tokens).
fn with_inputs(inputs: Vec<EncoderInput>, arrival_time: f64) -> RequestParams {
    RequestParams { max_tokens: Some(2), arrival_time, encoder_inputs: inputs, ..Default::default() }
}

/// vLLM `_try_schedule_encoder_inputs`: an input beyond the remaining encoder budget cuts the chunk before it.
#[test]
fn chunk_stops_before_an_input_over_the_budget() {
    let mut s = Scheduler::new(cfg(8, 12)).unwrap();
    add(&mut s, "a", &prompt(0, 30), with_inputs(vec![inp(2, 6, 11), inp(10, 6, 12)], 0.0));
    let out = step_with(&mut s, 5).0;
    assert_eq!(out.num_scheduled_tokens, vec![10]);
    assert_eq!((out.scheduled_encoder_inputs, out.scheduled_encoder_inputs_indptr), (vec![0], vec![0, 1]));
    let out = step_with(&mut s, 5).0;
    assert_eq!(out.scheduled_encoder_inputs, vec![1]);
}

/// A step without encoder work leaves the CSR empty (the binding shows zeros): no cost for text-only steps.
#[test]
fn a_step_without_encoder_work_leaves_the_csr_empty() {
    let mut s = Scheduler::new(cfg(8, 12)).unwrap();
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![], 0.0));
    let out = step_with(&mut s, 5).0;
    assert!(out.scheduled_encoder_inputs.is_empty() && out.scheduled_encoder_inputs_indptr.is_empty());
    assert!(out.free_encoder_hashes.is_empty());
}

/// vLLM `check_and_update_cache`: a hash allocated earlier in the step (or cached before) is referenced, not
/// recomputed; duplicates within one request are computed once too.
#[test]
fn shared_hashes_are_computed_once() {
    let mut s = Scheduler::new(SchedulerConfig { max_num_batched_tokens: 64, ..cfg(8, 8) }).unwrap();
    add(&mut s, "a", &prompt(0, 12), with_inputs(vec![inp(0, 4, 42), inp(6, 4, 42)], 0.0));
    add(&mut s, "b", &prompt(0, 12), with_inputs(vec![inp(1, 4, 42)], 1.0));
    let out = step_with(&mut s, 5).0;
    assert_eq!(out.scheduled_encoder_inputs, vec![0]);
    assert_eq!(out.scheduled_encoder_inputs_indptr, vec![0, 1, 1]);
    let st = s.stats();
    assert_eq!(
        (st.num_encoder_inputs_computed, st.encoder_cache_hits, st.num_encoder_cache_entries),
        (1, 2, 1)
    );
}

/// vLLM `_free_encoder_inputs`: references go once the input is consumed and the step applied; the entry stays
/// cached (freeable) and is evicted only for space, then reported once.
#[test]
fn consumed_entries_become_freeable_and_are_evicted_for_space() {
    let mut s = Scheduler::new(cfg(8, 8)).unwrap();
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![inp(0, 8, 1)], 0.0));
    let o1 = schedule(&mut s);
    add(&mut s, "b", &prompt(0, 10), with_inputs(vec![inp(0, 8, 2)], 1.0));
    let o2 = schedule(&mut s); // a still references 1 (its step is in flight): b gets nothing
    assert!(o2.out.handles.is_empty() && o2.out.free_encoder_hashes.is_empty());
    apply(&mut s, &o1, |_| vec![5]);
    apply(&mut s, &o2, |_| vec![5]);
    let o3 = s.schedule().unwrap();
    assert_eq!(o3.free_encoder_hashes, vec![1]);
    assert_eq!(o3.scheduled_encoder_inputs_indptr, vec![0, 0, 1]);
    s.check_invariants().unwrap();
}

/// Deliberate difference from vLLM: a PRIORITY victim scheduled earlier in the step hands the input it was to
/// compute to the request that referenced the same entry (vLLM leaves the entry cached with nobody computing it).
#[test]
fn in_step_victim_hands_its_encoder_work_to_the_sharer() {
    let config = SchedulerConfig {
        num_blocks: 24,
        max_model_len: 96,
        max_num_batched_tokens: 40,
        long_prefill_token_threshold: 20,
        policy: Policy::Priority,
        scheduler_reserve_full_isl: false,
        ..cfg(8, 8)
    };
    let mut s = Scheduler::new(config).unwrap();
    let p = |prio: i64, t: f64, inputs: Vec<EncoderInput>, ready: bool| RequestParams {
        max_tokens: Some(1),
        priority: prio,
        arrival_time: t,
        encoder_inputs: inputs,
        waiting_for_grammar: !ready,
        ..Default::default()
    };
    s.add_request("v", &(0..80).collect::<Vec<i64>>(), p(5, 0.0, vec![inp(40, 8, 7)], true)).unwrap();
    s.add_request("d", &[1, 2, 3], p(0, 0.5, vec![], false)).unwrap();
    assert_eq!(step_with(&mut s, 5).0.num_scheduled_tokens, vec![20]);
    s.add_request("r", &(200..240).collect::<Vec<i64>>(), p(0, 1.0, vec![inp(20, 8, 7)], true)).unwrap();
    assert_eq!(step_with(&mut s, 5).0.num_scheduled_tokens, vec![20, 20]);
    let st = schedule(&mut s);
    let out = &st.out;
    assert_eq!(out.preempted.len(), 1);
    assert_eq!(out.handles.len(), 1);
    assert_eq!(s.request_id(out.handles[0]).map(|x| x.to_string()), Some("r".to_string()));
    assert_eq!(
        (out.scheduled_encoder_inputs.clone(), out.scheduled_encoder_inputs_indptr.clone()),
        (vec![0], vec![0, 1])
    );
    apply(&mut s, &st, |_| vec![5]);
}

/// A failed step's entries leave the cache and are reported freed.
#[test]
fn a_failed_step_drops_its_entries() {
    let mut s = Scheduler::new(cfg(8, 8)).unwrap();
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![inp(0, 4, 1)], 0.0));
    let out = s.schedule().unwrap();
    s.fail_step(out.scheduler_id, out.step_id).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_encoder_cache_entries, 0);
    assert_eq!(s.schedule().unwrap().free_encoder_hashes, vec![1]);
}

/// Bad inputs are refused and change nothing.
#[test]
fn bad_encoder_inputs_are_refused() {
    let mut s = Scheduler::new(cfg(8, 12)).unwrap();
    add(&mut s, "a", &prompt(0, 20), with_inputs(vec![inp(0, 4, 1)], 0.0));
    for bad in [
        vec![inp(0, 0, 2)],
        vec![inp(18, 4, 2)],
        vec![inp(0, 4, 2), inp(3, 2, 3)],
        vec![inp(0, 9, 2)],
        vec![inp(0, 3, 1)],
        vec![inp(0, 2, 5), inp(4, 3, 5)],
    ] {
        let p = RequestParams { encoder_inputs: bad.clone(), ..Default::default() };
        let err = s.add_request("x", &(0..20).collect::<Vec<i64>>(), p);
        assert!(matches!(err, Err(SchedError::InvalidRequest(_))), "{bad:?}: {err:?}");
        assert!(s.get_request("x").is_err());
        s.check_invariants().unwrap();
    }
    let mut plain = Scheduler::new(cfg(0, 0)).unwrap();
    let p = RequestParams { encoder_inputs: vec![inp(0, 1, 1)], ..Default::default() };
    assert!(matches!(plain.add_request("x", &[1, 2], p), Err(SchedError::InvalidRequest(_))));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, .. ProptestConfig::default() })]

    /// Random adds (with encoder inputs from a small hash pool), steps with one or two steps in flight,
    /// aborts and failed steps under tight encoder budgets and KV pressure: every invariant (the encoder cache's
    /// accounting, references = the requests' held inputs, only running requests hold any) after each operation,
    /// and everything drains.
    #[test]
    fn random_encoder_operations_keep_every_invariant(
        budget in prop_oneof![Just(4u32), Just(8), Just(16)],
        cache in prop_oneof![Just(8u32), Just(12), Just(32)],
        num_blocks in 10u32..40,
        priority in any::<bool>(),
        no_chunk in any::<bool>(),
        ops in prop::collection::vec((0u8..6, 0u64..16, 4i64..40), 1..100),
    ) {
        let config = SchedulerConfig {
            block_size: 4,
            num_blocks,
            max_model_len: 40,
            max_num_batched_tokens: 16,
            max_num_seqs: 6,
            max_num_encoder_input_tokens: budget,
            encoder_cache_size: cache,
            disable_chunked_mm_input: no_chunk,
            policy: if priority { Policy::Priority } else { Policy::Fcfs },
            scheduler_reserve_full_isl: false,
            prefix_hash_seed: Some(b"p".to_vec()),
            ..Default::default()
        };
        let cap = budget.min(cache);
        let mut s = Scheduler::new(config).unwrap();
        let mut pending: Vec<Pending> = Vec::new();
        for (k, (op, x, len)) in ops.into_iter().enumerate() {
            match op {
                0 | 1 => {
                    let mut inputs = Vec::new();
                    let mut pos = (x % 3) as u32;
                    for j in 0..(x % 4) {
                        let h = (x + j * 5) % 9;
                        let n = 1 + (h as u32 * 5) % cap;
                        if pos + n > len as u32 {
                            break;
                        }
                        inputs.push(EncoderInput { start: pos, num_tokens: n, hash: h });
                        pos += n + (j as u32 % 2);
                    }
                    let p = RequestParams {
                        max_tokens: Some(1 + (x % 4) as u32),
                        priority: (x % 3) as i64,
                        arrival_time: k as f64,
                        encoder_inputs: inputs,
                        ..Default::default()
                    };
                    let prompt: Vec<i64> = (0..len).map(|t| (t + x as i64) % 11).collect();
                    let _ = s.add_request(&format!("r{k}"), &prompt, p);
                }
                2 | 3 => {
                    if pending.len() < 2 {
                        pending.push(schedule(&mut s));
                    } else {
                        let out = pending.remove(0);
                        apply(&mut s, &out, |_| vec![5]);
                    }
                }
                4 => {
                    if !pending.is_empty() {
                        let out = pending.remove(0);
                        apply(&mut s, &out, |_| vec![5]);
                    }
                }
                _ => {
                    if pending.len() == 1 && x % 2 == 0 {
                        let out = pending.remove(0).out;
                        s.fail_step(out.scheduler_id, out.step_id).unwrap();
                    } else {
                        let live = live_ids(&s);
                        if !live.is_empty() {
                            s.abort_requests(&[live[x as usize % live.len()].clone()]).unwrap();
                        }
                    }
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        for out in std::mem::take(&mut pending) {
            apply(&mut s, &out, |_| vec![5]);
        }
        for _ in 0..500 {
            if !s.has_unfinished_requests() {
                break;
            }
            step_with(&mut s, 5);
        }
        prop_assert!(!s.has_unfinished_requests());
        prop_assert_eq!(s.stats().encoder_cache_usage <= 1.0, true);
        s.check_invariants().map_err(TestCaseError::fail)?;
    }
}
