//! Behaviour tests of the whole scheduler, and a proptest of random operation sequences that checks every
//! invariant after every operation.

use proptest::prelude::*;

use super::helpers::{
    add, apply, feed, free_order, ids, live_ids, oldest_in_flight, one_token_each, params, prompt, resolve,
    run_to_completion, schedule, step_with,
};
use crate::{
    FinishReason, PauseState, Policy, PreemptionMode, Ragged, RequestParams, RequestStatus, SchedError,
    Scheduler, SchedulerConfig, SchedulerOutput, SPEC_PLACEHOLDER,
};

fn cfg(block_size: u32, num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 64,
        max_model_len: ((num_blocks - 1) * block_size).min(256),
        prefix_hash_seed: Some(b"test".to_vec()),
        ..Default::default()
    }
}

#[test]
fn chunked_prefill_splits_a_long_prompt_by_budget() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 150), params(2));
    let (out, res) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![64]);
    assert_eq!(res.num_new_tokens, vec![0]); // partial prefill: no token
    let (out, _) = step_with(&mut s, 1);
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![64], vec![64]));
    let (out, res) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![22]);
    assert_eq!(res.num_new_tokens, vec![1]);
    let (out, res) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![1]);
    assert_eq!(res.finish_reasons, vec![FinishReason::Length]);
    assert_eq!(s.num_free_blocks(), 63);
}

#[test]
fn full_prompt_gate_waits_until_the_whole_prompt_fits() {
    // vLLM 0.33 `scheduler_reserve_full_isl`: 7 usable blocks of 4; "a" holds 2, "b" needs 6 for its prompt.
    for gate in [true, false] {
        let mut s = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: 8,
            scheduler_reserve_full_isl: gate,
            ..cfg(4, 8)
        })
        .unwrap();
        add(&mut s, "a", &prompt(0, 5), params(3));
        step_with(&mut s, 1);
        add(&mut s, "b", &prompt(100, 24), params(1));
        let (out, _) = step_with(&mut s, 1);
        // Without the gate "b" gets a first chunk of 7 tokens (2 blocks); with it, 6 blocks > 5 free: it waits.
        let expect: Vec<&str> = if gate { vec!["a"] } else { vec!["a", "b"] };
        assert_eq!(ids(&s, &out), expect, "gate={gate}");
    }
}

#[test]
fn threshold_caps_tokens_per_request_and_decodes_share_the_budget() {
    let mut c = cfg(4, 128);
    c.long_prefill_token_threshold = 16;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 10), params(5));
    add(&mut s, "b", &prompt(100, 40), params(5));
    let (out, _) = step_with(&mut s, 7);
    assert_eq!(ids(&s, &out), vec!["a", "b"]);
    assert_eq!(out.num_scheduled_tokens, vec![10, 16]);
    let (out, _) = step_with(&mut s, 7);
    assert_eq!(out.num_scheduled_tokens, vec![1, 16]);
    assert!(out.new_reqs.is_empty());
}

#[test]
fn chunking_disabled_stops_admission_at_a_prompt_over_budget() {
    let mut c = cfg(4, 128);
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 256;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 200), params(5));
    add(&mut s, "b", &prompt(500, 100), params(5));
    add(&mut s, "c", &prompt(900, 10), params(5));
    let (out, _) = step_with(&mut s, 7);
    // b does not fit the 56 tokens left; c behind it must wait too (no skipping in FCFS admission).
    assert_eq!(ids(&s, &out), vec!["a"]);
}

#[test]
fn fcfs_preempts_the_last_running_request_and_resumes_it_first() {
    // 8 usable blocks of 4 tokens.
    let mut c = cfg(4, 9);
    c.max_num_batched_tokens = 256;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 12), params(20));
    add(&mut s, "b", &prompt(100, 12), params(20));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![12, 12]);
    assert_eq!(s.num_free_blocks(), 2);
    // Each decode past a block boundary needs a new block; after a few steps b is preempted.
    let mut preempted_at = None;
    for step in 0..12 {
        let (out, _) = step_with(&mut s, 1);
        if !out.preempted.is_empty() {
            let victims: Vec<_> = out.preempted.iter().map(|&h| h.slot).collect();
            assert_eq!(victims, vec![s.slot_of("b").unwrap()]);
            preempted_at = Some(step);
            break;
        }
    }
    assert!(preempted_at.is_some());
    let b = s.get_request("b").unwrap();
    assert_eq!(b.status, RequestStatus::Preempted);
    assert_eq!(s.get_num_computed_tokens("b").unwrap(), 0);
    assert!(b.num_output_tokens() > 0, "outputs are kept across preemption");
    assert_eq!(s.stats().num_preemptions, 1);
    // Drive to completion: b comes back as resumed with a full block table.
    let mut resumed = false;
    while s.has_unfinished_requests() {
        let (out, _) = step_with(&mut s, 1);
        if !out.resumed_reqs.is_empty() {
            resumed = true;
            let i = out.resumed_reqs[0] as usize;
            let n_blocks = out.new_block_ids_indptr[i + 1] - out.new_block_ids_indptr[i];
            assert_eq!(n_blocks as usize, resolve(&s, out.handles[i]).unwrap().blocks.len());
        }
    }
    assert!(resumed);
    assert_eq!(s.num_free_blocks(), 8);
}

#[test]
fn priority_preempts_the_lowest_priority_and_refunds_it() {
    let mut c = cfg(4, 8); // 7 usable blocks
    c.policy = Policy::Priority;
    c.max_num_batched_tokens = 256;
    let mut s = Scheduler::new(c).unwrap();
    let p = |prio: i64, t: f64| RequestParams {
        max_tokens: Some(30),
        priority: prio,
        arrival_time: t,
        ..Default::default()
    };
    add(&mut s, "low", &prompt(0, 8), p(5, 0.0));
    add(&mut s, "high", &prompt(100, 8), p(0, 1.0));
    let (out, _) = step_with(&mut s, 1);
    // Priority order of admission: high first.
    assert_eq!(ids(&s, &out), vec!["high", "low"]);
    let mut saw = false;
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        if !out.preempted.is_empty() && !saw {
            // The first victim is `low`: the largest (priority, arrival_time) among the running.
            assert_eq!(resolve(&s, out.preempted[0]).map(|r| r.id.to_string()), Some("low".into()));
            assert!(!ids(&s, &out).contains(&"low".to_string()), "the victim is refunded from this step");
            saw = true;
        }
        feed(&mut s, &out, |_| vec![1]);
    }
    assert!(saw);
}

#[test]
fn priority_victim_scheduled_earlier_is_refunded_and_index_adjusts() {
    // Running order [low, high]: when high cannot grow, low (already scheduled this step) is the victim.
    let mut c = cfg(4, 6); // 5 usable
    c.policy = Policy::Priority;
    c.max_num_batched_tokens = 256;
    let mut s = Scheduler::new(c).unwrap();
    let p = |prio: i64, t: f64| RequestParams {
        max_tokens: Some(30),
        priority: prio,
        arrival_time: t,
        ..Default::default()
    };
    add(&mut s, "low", &prompt(0, 8), p(0, 0.0));
    let (_, _) = step_with(&mut s, 1);
    add(&mut s, "high", &prompt(100, 8), p(-1, 1.0));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(ids(&s, &out), vec!["low", "high"]);
    let mut refunded = false;
    for _ in 0..20 {
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        if !out.preempted.is_empty() {
            assert_eq!(ids(&s, &out), vec!["high"]);
            let total: i32 = out.num_scheduled_tokens.iter().sum();
            assert_eq!(total as u64, out.total_num_scheduled_tokens);
            refunded = true;
            feed(&mut s, &out, |_| vec![1]);
            break;
        }
        feed(&mut s, &out, |_| vec![1]);
    }
    assert!(refunded);
}

#[test]
fn identical_prompts_in_one_step_share_cached_blocks() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 16), params(3));
    add(&mut s, "b", &prompt(0, 16), params(3));
    let out = s.schedule().unwrap();
    // a caches its 4 full blocks at allocation; b hits 3 (capped at 15 tokens) and computes the last 4.
    assert_eq!(out.num_computed_tokens, vec![0, 12]);
    assert_eq!(out.num_scheduled_tokens, vec![16, 4]);
    let a_blocks = &out.new_block_ids[0..4];
    let b_blocks = &out.new_block_ids[4..8];
    assert_eq!(a_blocks[..3], b_blocks[..3]);
    assert_ne!(a_blocks[3], b_blocks[3]);
    let st = s.stats();
    assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (32, 12));
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 16), None, None).unwrap(), 12);
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 17), None, None).unwrap(), 16);
    // A different salt never hits.
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 17), Some("tenant"), None).unwrap(), 0);
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 17), None, Some("lora")).unwrap(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn probe_is_side_effect_free() {
    let mut s = Scheduler::new(cfg(4, 16)).unwrap();
    add(&mut s, "a", &prompt(0, 9), params(1));
    step_with(&mut s, 1);
    let before = (s.stats(), s.num_free_blocks());
    let order = free_order(&s);
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 9), None, None).unwrap(), 8);
    assert_eq!((s.stats(), s.num_free_blocks()), before);
    assert_eq!(free_order(&s), order);
}

#[test]
fn freed_blocks_are_evicted_deepest_first_and_lru_across_requests() {
    let mut s = Scheduler::new(cfg(4, 9)).unwrap(); // 8 usable
    add(&mut s, "a", &prompt(0, 8), params(1));
    step_with(&mut s, 1); // a finishes: its 2 hashed blocks (+1 tail block unhashed) are freed
    add(&mut s, "b", &prompt(100, 8), params(1));
    step_with(&mut s, 1);
    // Free order now: unhashed blocks at the head, then a's blocks deepest first, then b's.
    let order = free_order(&s);
    let hashed: Vec<u32> = order.iter().copied().filter(|&b| s.block_hash_of(b).is_some()).collect();
    assert_eq!(hashed.len(), 4);
    // a was freed first, so a's blocks are older: they come first in eviction order, deepest first.
    let a2 = hashed[0];
    let a1 = hashed[1];
    assert!(a2 > a1, "deepest block of a (allocated second) is evicted first: {hashed:?}");
    // Allocating everything evicts all cached blocks; a probe then misses.
    add(&mut s, "c", &prompt(1000, 30), params(1));
    step_with(&mut s, 1);
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 8), None, None).unwrap(), 0);
}

#[test]
fn stop_conditions_follow_vllm_order() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    let eos =
        RequestParams { max_tokens: Some(10), eos_token_id: Some(2), min_tokens: 2, ..Default::default() };
    add(&mut s, "eos", &prompt(10, 4), eos.clone());
    add(&mut s, "ign", &prompt(20, 4), RequestParams { ignore_eos: true, ..eos.clone() });
    add(
        &mut s,
        "stop",
        &prompt(30, 4),
        RequestParams { stop_token_ids: vec![2], max_tokens: Some(10), ..Default::default() },
    );
    // Step 1: EOS as the first output. vLLM 0.33's check_stop tests EOS and stop ids before min_tokens (the
    // sampler masks them until then): eos stops although min_tokens=2; ign ignores EOS; stop has stop_reason 2.
    let (_, res) = step_with(&mut s, 2);
    assert_eq!(res.finished_req_ids.iter().map(|x| x.to_string()).collect::<Vec<_>>(), vec!["eos", "stop"]);
    assert_eq!(res.finish_reasons, vec![FinishReason::Stop, FinishReason::Stop]);
    assert_eq!(res.stop_reasons, vec![-1, 2]);
    while s.has_unfinished_requests() {
        let (_, res) = step_with(&mut s, 2);
        if !res.finished_req_ids.is_empty() {
            assert_eq!(res.finish_reasons, vec![FinishReason::Length]);
        }
    }
    assert_eq!(s.stats().num_finished_reqs, 3);
}

#[test]
fn kv_cache_below_max_model_len_refuses_only_requests_that_cannot_fit() {
    // vLLM's test_preempt_during_execution: 10 usable blocks of 16 (160 tokens), max_model_len 2048.
    let c = SchedulerConfig {
        block_size: 16,
        num_blocks: 11,
        max_model_len: 2048,
        max_num_batched_tokens: 100,
        enable_prefix_caching: false,
        ..Default::default()
    };
    let mut s = Scheduler::new(c).unwrap();
    let p: Vec<i64> = (0..80).collect();
    // 80 + 81 - 1 = 160 tokens fit exactly; one more does not; no max_tokens means up to max_model_len.
    let up_to = |m: Option<u32>| RequestParams { max_tokens: m, ..Default::default() };
    s.add_request("fits", &p, up_to(Some(81))).unwrap();
    for (id, m) in [("over", Some(82)), ("unbounded", None)] {
        let err = s.add_request(id, &p, up_to(m)).unwrap_err();
        assert!(
            matches!(&err, SchedError::InvalidRequest(m) if m.contains("do not fit the KV cache")),
            "{err:?}"
        );
    }
    assert_eq!(live_ids(&s).len(), 1);
    // Alone, it runs to its last token: 79 decodes after the prefill, never preempted.
    let mut steps = 0;
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        let n = out.handles.len();
        let values = vec![7i64; n];
        let indptr: Vec<i64> = (0..=n as i64).collect();
        s.update_from_output(
            out.scheduler_id,
            out.step_id,
            Ragged { values: &values, indptr: &indptr },
            None,
        )
        .unwrap();
        steps += 1;
        assert!(steps < 200);
    }
    assert_eq!(s.stats().num_preemptions, 0);
    assert_eq!(s.num_free_blocks(), 10);
}

#[test]
fn budget_below_max_model_len_without_chunking_refuses_only_requests_that_cannot_fit() {
    let c = SchedulerConfig {
        max_num_batched_tokens: 64,
        max_model_len: 256,
        enable_chunked_prefill: false,
        ..Default::default()
    };
    let mut s = Scheduler::new(c).unwrap();
    let p: Vec<i64> = (0..40).collect();
    s.add_request("a", &p, params(25)).unwrap();
    let err = s.add_request("b", &p, params(26)).unwrap_err();
    assert!(
        matches!(&err, SchedError::InvalidRequest(m) if m.contains("max_num_batched_tokens=64")),
        "{err:?}"
    );
}

#[test]
fn a_priority_request_that_preempts_itself_ends_the_pass_only_without_continue_after_self_preemption() {
    for goes_on in [true, false] {
        let mut c = cfg(4, 5); // 4 usable blocks
        c.policy = Policy::Priority;
        c.max_num_batched_tokens = 256;
        c.continue_after_self_preemption = goes_on;
        let mut s = Scheduler::new(c).unwrap();
        let p = |prio: i64, t: f64| RequestParams {
            max_tokens: Some(5),
            priority: prio,
            arrival_time: t,
            ..Default::default()
        };
        // Running order [low, high], all four blocks in use, both one token into a new block.
        add(&mut s, "low", &prompt(0, 7), p(5, 0.0));
        step_with(&mut s, 1);
        add(&mut s, "high", &prompt(100, 8), p(0, 1.0));
        let (out, _) = step_with(&mut s, 1);
        assert_eq!(ids(&s, &out), vec!["low", "high"]);
        // `low` cannot get a block and ranks lowest: it preempts itself. `high` fits in the blocks it freed, but
        // is scheduled in the same step only when the pass goes on (vLLM 0.33), not when it ends there (0.32).
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        assert_eq!(
            out.preempted.iter().map(|&h| s.request_id(h).unwrap().to_string()).collect::<Vec<_>>(),
            ["low"]
        );
        let want: Vec<String> = if goes_on { vec!["high".into()] } else { vec![] };
        assert_eq!(ids(&s, &out), want, "continue_after_self_preemption={goes_on}");
        feed(&mut s, &out, |_| vec![1]);
    }
}

#[test]
fn max_loras_counts_a_running_request_not_scheduled_in_the_step_only_with_max_loras_counts_unscheduled() {
    for counts_unscheduled in [true, false] {
        let mut c = cfg(4, 32);
        c.async_scheduling = true;
        c.max_loras = 1;
        c.max_loras_counts_unscheduled = counts_unscheduled;
        let mut s = Scheduler::new(c).unwrap();
        let lora = |name: &str, max_tokens: u32| RequestParams {
            max_tokens: Some(max_tokens),
            lora_name: Some(name.into()),
            ..Default::default()
        };
        add(&mut s, "a", &prompt(0, 6), lora("x", 1));
        let first = s.schedule().unwrap();
        assert_eq!(ids(&s, &first), vec!["a"]);
        // `a` is running, but the step in flight already produces its only token: it is not scheduled again.
        add(&mut s, "b", &prompt(100, 6), lora("y", 4));
        let second = s.schedule().unwrap();
        s.check_invariants().unwrap();
        // With one LoRA slot, `b` (another adapter) is admitted only when `a`'s adapter does not count (vLLM 0.32).
        let want: Vec<String> = if counts_unscheduled { vec![] } else { vec!["b".into()] };
        assert_eq!(ids(&s, &second), want, "max_loras_counts_unscheduled={counts_unscheduled}");
    }
}

#[test]
fn max_num_active_seqs_caps_admission_not_running() {
    // vLLM's test_max_num_active_seqs_caps_admission: 2 active of 4 slots.
    let c = SchedulerConfig { max_num_seqs: 4, max_num_active_seqs: 2, ..Default::default() };
    let mut s = Scheduler::new(c).unwrap();
    for i in 0..4 {
        add(&mut s, &format!("r{i}"), &[1, 2, 3, i], params(5));
    }
    let out = step_with(&mut s, 7).0;
    assert_eq!(out.handles.len(), 2);
    assert_eq!(s.num_running_reqs(), 2);
    s.abort_requests(&["r0".to_string()]).unwrap();
    let out = step_with(&mut s, 7).0;
    assert_eq!(out.new_reqs.len(), 1, "one slot freed, one admission");
    assert_eq!(s.num_running_reqs(), 2);
}

#[test]
fn adaptive_threshold_is_floored_by_the_fair_share() {
    // Budget 100, threshold 10, 2 requests: the adaptive cap is max(10, 100 / 2) = 50.
    for (adaptive, want) in [(false, vec![10, 10]), (true, vec![50, 50])] {
        let c = SchedulerConfig {
            max_num_batched_tokens: 100,
            long_prefill_token_threshold: 10,
            long_prefill_token_threshold_adaptive: adaptive,
            ..Default::default()
        };
        let mut s = Scheduler::new(c).unwrap();
        let pa: Vec<i64> = (0..80).collect();
        let pb: Vec<i64> = (100..180).collect();
        add(&mut s, "a", &pa, params(5));
        add(&mut s, "b", &pb, params(5));
        let out = step_with(&mut s, 7).0;
        assert_eq!(out.num_scheduled_tokens, want, "adaptive={adaptive}");
    }
}

#[test]
fn skip_reading_prefix_cache_gets_no_hits_and_no_stats() {
    let c = SchedulerConfig { block_size: 4, prefix_hash_seed: Some(b"s".to_vec()), ..Default::default() };
    let mut s = Scheduler::new(c).unwrap();
    let p: Vec<i64> = (0..17).collect();
    add(&mut s, "warm", &p, params(1));
    step_with(&mut s, 7);
    let q0 = s.stats().prefix_cache_queries;
    let skip = RequestParams { skip_reading_prefix_cache: true, ..params(1) };
    s.add_request("skip", &p, skip).unwrap();
    let out = step_with(&mut s, 7).0;
    assert_eq!((out.num_computed_tokens[0], out.num_scheduled_tokens[0]), (0, 17), "no prefix hit");
    assert_eq!(s.stats().prefix_cache_queries, q0, "not counted as a query");
    add(&mut s, "reader", &p, params(1));
    let out = step_with(&mut s, 7).0;
    assert_eq!(out.num_computed_tokens[0], 16, "a normal request still hits the cached blocks");
}

/// vLLM's test_local_prefill_interval_holds_prefill_between_bursts: with interval k, a waiting prefill is held
/// for k - 1 executed steps after the last prefill-carrying one while a request decodes, then admitted.
#[test]
fn prefill_cadence_holds_prefill_between_bursts() {
    for interval in [2u32, 4] {
        let c = SchedulerConfig { prefill_schedule_interval: interval, ..Default::default() };
        let mut s = Scheduler::new(c).unwrap();
        add(&mut s, "run0", &[1, 2, 3, 4, 5, 6, 7, 8], params(100));
        step_with(&mut s, 7);
        let (executed, last, _) = s.prefill_cadence();
        assert_eq!(last, executed as i64);
        add(&mut s, "new0", &[9, 9, 9, 9, 9, 9, 9, 9], params(5));
        for _ in 0..interval - 1 {
            let out = step_with(&mut s, 7).0;
            assert_eq!((out.handles.len(), out.new_reqs.len()), (1, 0), "held (interval {interval})");
        }
        // An empty schedule() (everything in flight) does not count as an executed step.
        let before = s.prefill_cadence().0;
        let out = s.schedule().unwrap();
        let empty = s.schedule().unwrap();
        assert_eq!(empty.total_num_scheduled_tokens, 0);
        assert_eq!(s.prefill_cadence().0, before + 1);
        assert_eq!(out.new_reqs.len(), 1, "admitted once the interval has passed");
        assert_eq!(s.prefill_cadence().1, s.prefill_cadence().0 as i64);
    }
}

/// vLLM's test_schedule_prefills_gating and test_throttle_capacity_bound_guard_admits.
#[test]
fn throttled_steps_defer_prefill_unless_the_last_release_was_capacity_bound() {
    let mut s = Scheduler::new(SchedulerConfig::default()).unwrap();
    add(&mut s, "run0", &[1, 2, 3, 4, 5, 6, 7, 8], params(100));
    step_with(&mut s, 7);
    add(&mut s, "new0", &[9; 8], params(5));
    let out = s.schedule_with(true).unwrap();
    assert_eq!((out.handles.len(), out.new_reqs.len()), (1, 0), "deferred: run0 decodes alone");
    // Nothing decoding to protect: a throttled step admits.
    let mut s = Scheduler::new(SchedulerConfig::default()).unwrap();
    add(&mut s, "new0", &[9; 8], params(5));
    assert_eq!(s.schedule_with(true).unwrap().new_reqs.len(), 1);
    // A release that cannot drain the queue makes the next throttled step admit anyway.
    let c = SchedulerConfig { max_num_batched_tokens: 200, ..Default::default() };
    let mut s = Scheduler::new(c).unwrap();
    let p: Vec<i64> = (0..200).collect();
    let q: Vec<i64> = (1000..1200).collect();
    add(&mut s, "a", &p, params(5));
    add(&mut s, "b", &q, params(5));
    let out = s.schedule().unwrap();
    assert_eq!(out.handles.len(), 1);
    assert!(s.prefill_cadence().2, "capacity bound");
    let out = s.schedule_with(true).unwrap();
    assert_eq!(out.new_reqs.len(), 1, "b admitted although throttled");
}

#[test]
fn max_model_len_caps_generation() {
    let mut c = cfg(4, 64);
    c.max_model_len = 10;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 8), RequestParams::default());
    let mut outs = 0;
    while s.has_unfinished_requests() {
        let (_, res) = step_with(&mut s, 5);
        outs += res.num_new_tokens.iter().sum::<i32>();
    }
    assert_eq!(outs, 2);
    let err = s.add_request("b", &prompt(0, 10), RequestParams::default()).unwrap_err();
    assert!(matches!(err, SchedError::InvalidRequest(_)));
}

#[test]
fn speculative_tokens_roll_back_when_rejected() {
    let mut c = cfg(4, 64);
    c.num_lookahead_tokens = 3;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(20));
    let out = s.schedule().unwrap();
    let drafts_v = vec![7i64, 8, 9];
    let values = vec![5i64];
    s.update_from_output(
        out.scheduler_id,
        out.step_id,
        Ragged { values: &values, indptr: &[0, 1] },
        Some(Ragged { values: &drafts_v, indptr: &[0, 3] }),
    )
    .unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![4]); // 1 + 3 drafts
    assert_eq!(out.spec_token_ids, vec![7, 8, 9]);
    // Lookahead slots: 6 + 1 + 4 + 3 = 14 -> 4 blocks.
    assert_eq!(s.get_request("a").unwrap().blocks.len(), 4);
    // Accept one draft (two tokens back): computed rolls back by 2.
    let values = vec![7i64, 11];
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &[0, 2] }, None)
        .unwrap();
    let r = s.get_request("a").unwrap();
    assert_eq!(r.output_token_ids(), &[5, 7, 11]);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 8);
    s.check_invariants().unwrap();
    // More tokens than the drafts scheduled (none here) are taken as they come, as vLLM's scheduler takes what
    // its runner returns: both are appended, and the computed count stays the scheduled one.
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![1]);
    let values = vec![1i64, 2];
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &[0, 2] }, None)
        .unwrap();
    assert_eq!(s.get_request("a").unwrap().output_token_ids(), &[5, 7, 11, 1, 2]);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 9);
    s.check_invariants().unwrap();
}

#[test]
fn drafts_set_after_the_update_ride_the_next_step_without_lookahead_slots() {
    // An n-gram drafter: 2 drafts per step, no KV lookahead; drafts arrive after the update (vLLM's engine).
    let mut c = cfg(4, 64);
    c.num_speculative_tokens = Some(2);
    c.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(20));
    add(&mut s, "b", &prompt(100, 12), params(20));
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![6, 2]); // b is a prefill chunk
    let values = vec![5i64];
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &[0, 1, 1] }, None)
        .unwrap();
    let ids = vec!["a".to_string(), "b".to_string()];
    let drafts = vec![7i64, -1, 9];
    // Validated first: a third draft for a is refused and b's entry is not applied either.
    let err = s.set_draft_token_ids(&ids, Ragged { values: &[1, 2, 3, 4], indptr: &[0, 1, 4] });
    assert!(matches!(err, Err(SchedError::InvalidOutput(_))));
    assert!(s.get_request("a").unwrap().spec_token_ids.is_empty());
    s.set_draft_token_ids(&ids, Ragged { values: &drafts, indptr: &[0, 2, 3] }).unwrap();
    assert_eq!(s.get_request("a").unwrap().spec_token_ids, vec![7, SPEC_PLACEHOLDER]);
    assert!(s.get_request("b").unwrap().spec_token_ids.is_empty()); // a prefill chunk gets none
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![3, 5]);
    assert_eq!(out.spec_token_ids, vec![7, -1]);
    // 6 + 1 + 2 drafts = 9 tokens, no lookahead: 3 blocks.
    assert_eq!(s.get_request("a").unwrap().blocks.len(), 3);
    // The first draft accepted, the padding rejected: computed rolls back by one.
    let values = vec![7i64, 11];
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &[0, 2, 2] }, None)
        .unwrap();
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 8);
    s.check_invariants().unwrap();
}

#[test]
fn outputs_apply_in_order_once_and_only_to_their_scheduler() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    let other = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(5));
    let o1 = s.schedule().unwrap();
    let o2 = s.schedule().unwrap(); // async: scheduled before o1 is applied; nothing to do for a
    assert!(o2.handles.is_empty());
    let one = Ragged { values: &[3], indptr: &[0, 1] };
    let empty = Ragged { values: &[], indptr: &[0] };
    let e = s.update_from_output(other.scheduler_id(), o1.step_id, one, None);
    assert!(matches!(e, Err(SchedError::InvalidOutput(_))));
    let e = s.update_from_output(o2.scheduler_id, o2.step_id, empty, None);
    assert!(matches!(e, Err(SchedError::InvalidOutput(_))), "out of order");
    s.update_from_output(o1.scheduler_id, o1.step_id, one, None).unwrap();
    let e = s.update_from_output(o1.scheduler_id, o1.step_id, one, None);
    assert!(matches!(e, Err(SchedError::InvalidOutput(_))), "applied twice");
    s.update_from_output(o2.scheduler_id, o2.step_id, empty, None).unwrap();
    s.check_invariants().unwrap();
}

/// An output handed back with `recycle_output` changes nothing in the steps built in it: two schedulers fed the
/// same requests and tokens, one recycling every output once it is applied, schedule the same steps (admissions,
/// chunks, preemptions with swapping, finished and aborted requests).
#[test]
fn recycled_outputs_build_the_same_steps() {
    let config = SchedulerConfig { preemption_mode: PreemptionMode::Swap, num_cpu_blocks: 8, ..cfg(4, 24) };
    let mut plain = Scheduler::new(config.clone()).unwrap();
    let mut recycling = Scheduler::new(config).unwrap();
    let mut preempted = 0;
    for step in 0..240usize {
        if step % 3 == 0 && step < 60 {
            let id = format!("r{step}");
            let p = RequestParams { eos_token_id: Some(9), ..params(12 + (step % 19) as u32) };
            for s in [&mut plain, &mut recycling] {
                add(s, &id, &prompt(step as i64, 5 + step % 13), p.clone());
            }
        }
        if step == 40 {
            for s in [&mut plain, &mut recycling] {
                s.abort_requests(&["r36".to_string()]).unwrap();
            }
        }
        let mut shown = Vec::new();
        for (recycle, s) in [(false, &mut plain), (true, &mut recycling)] {
            let out = s.schedule_boxed(false).unwrap();
            s.check_invariants().unwrap();
            let res =
                feed(s, &out, |i| vec![if (step + i) % 29 == 0 { 9 } else { 1 + (step + i) as i64 % 5 }]);
            let view = SchedulerOutput { scheduler_id: 0, ..(*out).clone() };
            shown.push((format!("{view:?}"), format!("{res:?}"), ids(s, &out)));
            preempted += out.preempted.len();
            if recycle {
                s.recycle_output(out);
            }
        }
        assert_eq!(shown[0], shown[1], "step {step}");
    }
    assert!(preempted > 0, "the pool is small enough to preempt");
    assert!(!plain.has_unfinished_requests() && !recycling.has_unfinished_requests());
}

#[test]
fn abort_in_every_state_frees_everything_and_reports_it() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "w", &prompt(0, 6), params(5));
    add(&mut s, "r", &prompt(10, 6), params(5));
    let out = s.schedule().unwrap();
    add(&mut s, "w2", &prompt(20, 6), params(5));
    // r is in flight; abort it and the waiting one.
    s.abort_requests(&["r", "w2"]).unwrap();
    s.check_invariants().unwrap();
    assert!(matches!(s.abort_requests(&["nope"]), Err(SchedError::UnknownRequest(_))));
    // The in-flight output for r is ignored; w still gets its token.
    let res = s
        .update_from_output(
            out.scheduler_id,
            out.step_id,
            Ragged { values: &[1, 1], indptr: &[0, 1, 2] },
            None,
        )
        .unwrap();
    assert_eq!(res.num_new_tokens, vec![1, 0]);
    let out = s.schedule().unwrap();
    let mut finished: Vec<String> = out.finished_req_ids.iter().map(|x| x.to_string()).collect();
    finished.sort();
    assert_eq!(finished, vec!["r", "w2"]);
    s.abort_requests(&["w"]).unwrap();
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.num_free_blocks(), 63);
    assert!(s.reset_prefix_cache(false).unwrap());
    s.check_invariants().unwrap();
}

#[test]
fn a_failed_step_aborts_its_requests_and_uncaches_what_it_cached() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    // "a" decodes in step 2 (its 4-token block was cached and computed in step 1); "b" is admitted in step 2
    // and its two full prompt blocks are cached at that step's schedule.
    add(&mut s, "a", &prompt(0, 4), params(5));
    step_with(&mut s, 1);
    add(&mut s, "b", &prompt(20, 9), params(5));
    add(&mut s, "late", &prompt(40, 6), params(5));
    s.abort_requests(&["late"]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(ids(&s, &out), vec!["a", "b"]);
    assert_eq!(s.get_num_cached_tokens(&prompt(20, 9), None, None).unwrap(), 8);
    // Wrong scheduler, wrong step: refused, nothing changes.
    assert!(matches!(s.fail_step(out.scheduler_id + 1, out.step_id), Err(SchedError::InvalidOutput(_))));
    assert!(matches!(s.fail_step(out.scheduler_id, out.step_id + 1), Err(SchedError::InvalidOutput(_))));
    assert_eq!(s.num_unfinished_requests(), 2);
    s.abort_requests(&["a"]).unwrap(); // gone before the failure: skipped
    let failed = s.fail_step(out.scheduler_id, out.step_id).unwrap();
    assert_eq!(failed.iter().map(|x| x.to_string()).collect::<Vec<_>>(), vec!["b"]);
    s.check_invariants().unwrap();
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.num_free_blocks(), 63);
    // b's blocks were never computed: no hit. a's first block was computed in step 1: still a hit.
    assert_eq!(s.get_num_cached_tokens(&prompt(20, 9), None, None).unwrap(), 0);
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 9), None, None).unwrap(), 4);
    // The step counts as applied (once), and reports b as finished.
    assert!(matches!(s.fail_step(out.scheduler_id, out.step_id), Err(SchedError::InvalidOutput(_))));
    let empty = Ragged { values: &[], indptr: &[0, 0, 0] };
    assert!(matches!(
        s.update_from_output(out.scheduler_id, out.step_id, empty, None),
        Err(SchedError::InvalidOutput(_))
    ));
    let next = s.schedule().unwrap();
    let mut finished: Vec<String> = next.finished_req_ids.iter().map(|x| x.to_string()).collect();
    finished.sort();
    assert_eq!(finished, vec!["a", "b"]);
}

#[test]
fn only_the_last_step_in_flight_can_fail() {
    let mut s = Scheduler::new(SchedulerConfig { async_scheduling: true, ..cfg(4, 64) }).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(5));
    let o1 = s.schedule().unwrap();
    let o2 = s.schedule().unwrap();
    assert!(matches!(s.fail_step(o1.scheduler_id, o1.step_id), Err(SchedError::InvalidOutput(_))));
    assert!(matches!(s.fail_step(o2.scheduler_id, o2.step_id), Err(SchedError::InvalidOutput(_))));
    s.check_invariants().unwrap();
    feed(&mut s, &o1, |_| vec![1]);
    assert_eq!(s.fail_step(o2.scheduler_id, o2.step_id).unwrap().len(), usize::from(!o2.handles.is_empty()));
    s.check_invariants().unwrap();
    assert_eq!(s.num_free_blocks(), 63);
}

#[test]
fn reset_prefix_cache_only_when_idle() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 9), params(3));
    step_with(&mut s, 1);
    assert!(!s.reset_prefix_cache(false).unwrap());
    while s.has_unfinished_requests() {
        step_with(&mut s, 1);
    }
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 9), None, None).unwrap(), 8);
    assert!(s.reset_prefix_cache(false).unwrap());
    assert_eq!(s.get_num_cached_tokens(&prompt(0, 9), None, None).unwrap(), 0);
}

#[test]
fn bad_requests_change_nothing() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(5));
    let bad: Vec<(&str, Vec<i64>, RequestParams)> = vec![
        ("a", prompt(0, 3), params(1)),
        ("", prompt(0, 3), params(1)),
        ("b", vec![], params(1)),
        ("b", vec![-1], params(1)),
        ("b", vec![1 << 40], params(1)),
        ("b", prompt(0, 256), params(1)),
        ("b", prompt(0, 3), params(0)),
        ("b", prompt(0, 3), RequestParams { max_tokens: Some(2), min_tokens: 3, ..Default::default() }),
        ("b", prompt(0, 3), RequestParams { arrival_time: f64::NAN, ..Default::default() }),
    ];
    for (id, p, params) in bad {
        assert!(s.add_request(id, &p, params).is_err(), "{id:?} {p:?}");
        assert_eq!(s.num_unfinished_requests(), 1);
        s.check_invariants().unwrap();
    }
}

#[test]
fn model_inputs_match_the_block_tables() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 6), params(5));
    add(&mut s, "b", &prompt(50, 3), params(5));
    let out = s.schedule().unwrap();
    let mi = s.prepare_model_inputs(out.scheduler_id, out.step_id).unwrap();
    assert_eq!(mi.query_start_loc, vec![0, 6, 9]);
    assert_eq!(mi.seq_lens, vec![6, 3]);
    assert_eq!(mi.logits_indices, vec![5, 8]);
    assert_eq!(mi.input_positions, vec![0, 1, 2, 3, 4, 5, 0, 1, 2]);
    assert_eq!(mi.input_token_ids, vec![0, 1, 2, 3, 4, 5, 50, 51, 52]);
    let a_blocks = &s.get_request("a").unwrap().blocks;
    assert_eq!(mi.slot_mapping[4], a_blocks[1] as i32 * 4);
    assert_eq!(mi.max_num_blocks, 2);
    assert_eq!(mi.block_table[2..4], [s.get_request("b").unwrap().blocks[0] as i32, 0]);
    // Stale after any change.
    feed(&mut s, &out, |_| vec![9]);
    assert!(s.prepare_model_inputs(out.scheduler_id, out.step_id).is_err());
    let out = s.schedule().unwrap();
    let mi = s.prepare_model_inputs(out.scheduler_id, out.step_id).unwrap();
    assert_eq!(mi.input_token_ids, vec![9, 9]);
    assert_eq!(mi.input_positions, vec![6, 3]);
}

// --- property test -------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Add { prefix: u8, len: u16, max_tokens: u8, prio: i8, salt: bool, stop: bool },
    Step { eos: bool },
    ScheduleOnly,
    ApplyPending,
    Abort(u8),
    Reset,
    ResetRunning,
    Preempt(u8, bool),
    Pause(u8),
    Ready(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 1u16..120, 1u8..40, -2i8..3, any::<bool>(), any::<bool>())
            .prop_map(|(prefix, len, max_tokens, prio, salt, stop)| Op::Add { prefix, len, max_tokens, prio, salt, stop }),
        6 => any::<bool>().prop_map(|eos| Op::Step { eos }),
        1 => Just(Op::ScheduleOnly),
        1 => Just(Op::ApplyPending),
        1 => any::<u8>().prop_map(Op::Abort),
        1 => Just(Op::Reset),
        1 => Just(Op::ResetRunning),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(k, drop)| Op::Preempt(k, drop)),
        1 => (0u8..4).prop_map(Op::Pause),
        2 => any::<u8>().prop_map(Op::Ready),
    ]
}

fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    (
        // Any block size: powers of two, others (3, 12, ...) and a hybrid Mamba model's attention block (272).
        prop_oneof![2 => prop_oneof![Just(1u32), Just(2), Just(4), Just(16)], 2 => 1u32..=24, 1 => Just(272)],
        3u32..80,
        1u32..8,
        prop_oneof![Just(8u32), Just(32), Just(200)],
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(0u32), Just(5)],
        0u8..6,
        prop_oneof![Just(0u32), Just(2)],
        any::<bool>(),
        (
            any::<bool>(),
            prop_oneof![Just(0u32), Just(1), Just(2)],
            prop_oneof![Just(0.0f64), Just(0.2)],
            (
                0u8..3,
                prop_oneof![Just(1u32), Just(4), Just(64)],
                prop_oneof![Just(0.5f64), Just(4.0)],
                // Whether max_model_len may exceed the KV cache and (without chunked prefill) the budget.
                any::<bool>(),
            ),
            // max_num_active_seqs (0: max_num_seqs, else min(it, max_num_seqs)), the adaptive threshold.
            // ... and the prefill cadence.
            // ... and the DCP world size (the block unit is block_size * dcp).
            // ... and vLLM 0.32's rules where they differ from 0.33's (the four flags off).
            (
                prop_oneof![Just(0u32), Just(1), Just(2)],
                any::<bool>(),
                prop_oneof![Just(1u32), Just(3)],
                prop_oneof![3 => Just(1u32), 1 => Just(2), 1 => Just(3), 1 => Just(4)],
                any::<bool>(),
            ),
        ),
    )
        .prop_map(
            |(
                bs,
                nb,
                seqs,
                budget,
                caching,
                chunked,
                thr,
                mode,
                la,
                full_isl,
                (asy, loras, wm, (pm, cpu, cost, big_len), (active, adaptive, interval, dcp, v032)),
            )| {
                let max_model_len = if big_len { 200 } else { ((nb - 1) * bs * dcp).min(200) };
                SchedulerConfig {
                    block_size: bs,
                    num_blocks: nb,
                    max_num_seqs: seqs,
                    max_num_batched_tokens: if chunked || big_len { budget } else { max_model_len },
                    max_model_len,
                    enable_prefix_caching: caching,
                    enable_chunked_prefill: chunked,
                    long_prefill_token_threshold: thr,
                    // 0: fcfs, 1: fcfs + admission window, 2: priority, 3: priority + aging, 4-5: fair.
                    policy: [
                        Policy::Fcfs,
                        Policy::Fcfs,
                        Policy::Priority,
                        Policy::Priority,
                        Policy::Fair,
                        Policy::Fair,
                    ][mode as usize],
                    cache_aware_admission_window: if mode == 1 { 3 } else { 0 },
                    cache_aware_admission_threshold: if mode == 1 { 0.2 } else { 0.5 },
                    priority_aging_steps: if mode == 3 { 2 } else { 0 },
                    tenant_weights: if mode == 5 { vec![("t1".into(), 3.0)] } else { vec![] },
                    num_lookahead_tokens: la,
                    prefix_hash_seed: Some(b"p".to_vec()),
                    scheduler_reserve_full_isl: full_isl,
                    async_scheduling: asy,
                    max_loras: loras,
                    watermark: wm,
                    max_num_active_seqs: active.min(seqs),
                    long_prefill_token_threshold_adaptive: adaptive,
                    prefill_schedule_interval: interval,
                    preemption_mode: [PreemptionMode::Recompute, PreemptionMode::Swap, PreemptionMode::Auto]
                        [pm as usize],
                    num_cpu_blocks: cpu,
                    swap_cost_per_block: cost,
                    dcp_world_size: dcp,
                    max_loras_counts_unscheduled: !v032,
                    continue_after_self_preemption: !v032,
                    skip_encoder_blocked_admissions: !v032,
                    skip_lookahead_cut_admissions: !v032,
                    cache_drafts_at_update: !v032,
                    trim_computed_on_stop: !v032,
                    cache_upto_in_flight: !v032,
                    ..Default::default()
                }
            },
        )
}

fn apply_pending(s: &mut Scheduler, pending: &mut Vec<SchedulerOutput>, eos: bool, n_drafts: u32) {
    if pending.is_empty() {
        return;
    }
    let out = pending.remove(0);
    let rec = oldest_in_flight(s);
    let mut values = Vec::new();
    let mut indptr = vec![0i64];
    let mut dvals = Vec::new();
    let mut dptr = vec![0i64];
    for i in 0..out.handles.len() {
        if !rec.is_prefill_chunk[i] {
            let k = 1 + (i as u32 % (rec.num_spec_tokens[i] + 1));
            for j in 0..k {
                values.push(if eos && j == 0 && i % 3 == 0 { 2 } else { 10 + i as i64 });
            }
            for j in 0..n_drafts {
                dvals.push(20 + j as i64);
            }
        }
        indptr.push(values.len() as i64);
        dptr.push(dvals.len() as i64);
    }
    let drafts = (n_drafts > 0).then_some(Ragged { values: &dvals, indptr: &dptr });
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &indptr }, drafts)
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_invariant(config in config_strategy(), ops in prop::collection::vec(op(), 1..120)) {
        let mut s = Scheduler::new(config.clone()).unwrap();
        let mut pending: Vec<SchedulerOutput> = Vec::new();
        let mut next_id = 0u32;
        let mut added = 0u64;
        for op in ops {
            match op {
                Op::Add { prefix, len, max_tokens, prio, salt, stop } => {
                    let mut p: Vec<i64> = (0..len as i64).map(|t| (t * 7 + i64::from(prefix) * 1000) % 97).collect();
                    p.truncate(config.max_model_len as usize - 1);
                    let params = RequestParams {
                        max_tokens: Some(u32::from(max_tokens)),
                        eos_token_id: Some(2),
                        priority: i64::from(prio),
                        arrival_time: f64::from(next_id),
                        cache_salt: salt.then(|| "s".to_string()),
                        stop_token_ids: if stop { vec![13] } else { vec![] },
                        tenant: (prefix % 3 != 0).then(|| format!("t{}", prefix % 3)),
                        lora_name: (prefix % 3 != 0).then(|| format!("L{}", prefix % 3)),
                        waiting_for_grammar: len % 5 == 0,
                        skip_reading_prefix_cache: len % 7 == 3,
                        ..Default::default()
                    };
                    // A request that could never fit (the cache or, without chunked prefill, the budget below
                    // its length) is refused, and nothing changes.
                    let longest = (p.len() as u32 + u32::from(max_tokens).min(config.max_model_len - p.len() as u32)) - 1;
                    let fits = longest <= config.kv_capacity_tokens()
                        && (config.enable_chunked_prefill || longest <= config.max_num_batched_tokens);
                    let before = live_ids(&s).len();
                    match s.add_request(&format!("r{next_id}"), &p, params) {
                        Ok(()) => {
                            prop_assert!(fits);
                            added += 1;
                        }
                        Err(SchedError::InvalidRequest(_)) => {
                            prop_assert!(!fits);
                            prop_assert_eq!(live_ids(&s).len(), before);
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{e:?}"))),
                    }
                    next_id += 1;
                }
                Op::Step { eos } => {
                    pending.push(s.schedule().unwrap());
                    s.check_invariants().map_err(TestCaseError::fail)?;
                    let n_drafts = if config.async_scheduling { 0 } else { config.num_lookahead_tokens };
                    while !pending.is_empty() {
                        apply_pending(&mut s, &mut pending, eos, n_drafts);
                    }
                }
                Op::ScheduleOnly => pending.push(s.schedule_with(next_id % 2 == 1).unwrap()),
                Op::ApplyPending => apply_pending(&mut s, &mut pending, false, 0),
                Op::Abort(k) => {
                    let live = live_ids(&s);
                    if !live.is_empty() {
                        let id = live[k as usize % live.len()].clone();
                        s.abort_requests(&[id]).unwrap();
                    }
                }
                Op::Reset => {
                    let idle = s.num_free_blocks() == config.num_blocks as usize - 1;
                    prop_assert_eq!(s.reset_prefix_cache(false).unwrap(), idle);
                }
                Op::ResetRunning => {
                    prop_assert!(s.reset_prefix_cache(true).unwrap());
                    prop_assert_eq!(s.num_running_reqs(), 0);
                }
                Op::Preempt(k, drop) => {
                    let running = s.running_req_ids();
                    if running.is_empty() {
                        let live = live_ids(&s);
                        if let Some(id) = live.first() {
                            // A request that is not running: refused, nothing changes.
                            let before = s.num_preemptions();
                            prop_assert!(matches!(s.preempt_request(id, drop), Err(SchedError::InvalidRequest(_))));
                            prop_assert_eq!(s.num_preemptions(), before);
                        }
                    } else {
                        let id = running[k as usize % running.len()].to_string();
                        let before = s.num_preemptions();
                        s.preempt_request(&id, drop).unwrap();
                        prop_assert_eq!(s.num_preemptions(), before + 1);
                        prop_assert!(!s.running_req_ids().iter().any(|r| r.as_ref() == id.as_str()));
                    }
                }
                Op::Pause(k) => s.set_pause_state(match k {
                    0 => PauseState::PausedNew,
                    1 => PauseState::PausedAll,
                    _ => PauseState::Unpaused,
                }),
                Op::Ready(k) => {
                    let live = live_ids(&s);
                    if !live.is_empty() {
                        s.set_ready(&live[k as usize % live.len()]).unwrap();
                    }
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
            let st = s.stats();
            prop_assert!(st.num_running_reqs <= config.max_num_seqs as usize);
        }
        // Drain: every request finishes, every block comes back.
        s.set_pause_state(PauseState::Unpaused);
        let live = live_ids(&s);
        for id in &live {
            s.set_ready(id).unwrap();
        }
        while !pending.is_empty() {
            apply_pending(&mut s, &mut pending, false, 0);
        }
        let mut guard = 0;
        while s.has_unfinished_requests() {
            pending.push(s.schedule().unwrap());
            apply_pending(&mut s, &mut pending, false, 0);
            s.check_invariants().map_err(TestCaseError::fail)?;
            guard += 1;
            prop_assert!(guard < 20_000, "scheduler made no progress");
        }
        prop_assert_eq!(s.num_free_blocks(), config.num_blocks as usize - 1);
        prop_assert_eq!(s.num_free_cpu_blocks(), config.num_cpu_blocks as usize);
        prop_assert_eq!(s.stats().num_finished_reqs, added);
    }
}

#[test]
fn swap_mode_copies_a_victim_out_and_back_instead_of_recomputing() {
    let mut s = Scheduler::new(SchedulerConfig {
        preemption_mode: PreemptionMode::Swap,
        num_cpu_blocks: 8,
        enable_prefix_caching: false,
        ..cfg(4, 6) // 5 usable blocks
    })
    .unwrap();
    let p = |t: i64| RequestParams { max_tokens: Some(2), arrival_time: t as f64, ..Default::default() };
    s.add_request("a", &[1; 8], p(0)).unwrap();
    s.add_request("b", &[2; 8], p(1)).unwrap();
    let out = s.schedule().unwrap(); // a: 2 blocks, b: 2 blocks
    let b_blocks = s.get_request("b").unwrap().blocks.clone();
    one_token_each(&mut s, &out, 5);
    let out = s.schedule().unwrap(); // a takes the last free block; b (the tail) must go
    assert_eq!(out.preempted.len(), 1);
    assert_eq!(out.swap_out, vec![b_blocks[0] as i32, 0, b_blocks[1] as i32, 1]);
    assert!(out.swap_in.is_empty());
    assert_eq!(s.get_cpu_block_ids("b").unwrap(), &[0, 1]);
    assert_eq!(s.get_request("b").unwrap().status, RequestStatus::Preempted);
    s.check_invariants().unwrap();
    one_token_each(&mut s, &out, 5); // a reaches max_tokens and finishes
    let out = s.schedule().unwrap();
    assert_eq!(out.resumed_reqs, vec![0]);
    let b = s.get_request("b").unwrap();
    assert_eq!((out.num_computed_tokens[0], out.num_scheduled_tokens[0]), (8, 1));
    assert_eq!(out.swap_in, vec![0, b.blocks[0] as i32, 1, b.blocks[1] as i32]);
    assert!(b.cpu_blocks.is_empty());
    let st = s.stats();
    assert_eq!((st.num_swapped_out_reqs, st.num_swapped_out_blocks), (1, 2));
    assert_eq!((st.num_swapped_in_reqs, st.num_swapped_in_blocks), (1, 2));
    assert_eq!((st.num_recomputed_tokens, st.num_free_cpu_blocks), (0, 8));
    s.check_invariants().unwrap();
}

#[test]
fn a_full_cpu_pool_falls_back_to_recompute_and_abort_frees_cpu_blocks() {
    let mut s = Scheduler::new(SchedulerConfig {
        preemption_mode: PreemptionMode::Swap,
        num_cpu_blocks: 1,
        enable_prefix_caching: false,
        ..cfg(4, 6)
    })
    .unwrap();
    let p = |t: i64| RequestParams { max_tokens: Some(2), arrival_time: t as f64, ..Default::default() };
    s.add_request("a", &[1; 8], p(0)).unwrap();
    s.add_request("b", &[2; 8], p(1)).unwrap();
    let out = s.schedule().unwrap();
    one_token_each(&mut s, &out, 5);
    let out = s.schedule().unwrap(); // b needs 2 CPU blocks, the pool has 1: recomputed
    assert_eq!(out.preempted.len(), 1);
    assert!(out.swap_out.is_empty());
    let st = s.stats();
    assert_eq!((st.num_swap_fallbacks, st.num_swapped_out_reqs), (1, 0));
    s.check_invariants().unwrap();

    let mut s = Scheduler::new(SchedulerConfig {
        preemption_mode: PreemptionMode::Swap,
        num_cpu_blocks: 4,
        enable_prefix_caching: false,
        ..cfg(4, 6)
    })
    .unwrap();
    s.add_request("a", &[1; 8], p(0)).unwrap();
    s.add_request("b", &[2; 8], p(1)).unwrap();
    let out = s.schedule().unwrap();
    one_token_each(&mut s, &out, 5);
    s.schedule().unwrap();
    assert_eq!(s.num_free_cpu_blocks(), 2);
    s.abort_requests(&["b"]).unwrap();
    assert_eq!(s.num_free_cpu_blocks(), 4);
    s.check_invariants().unwrap();
}

/// Plain decodes are served from the slab's hot columns; a step that needs block work (a new block, a full block
/// to cache) goes through the general path. Both must leave the same state: a new block exactly when the step's
/// token starts one, each block cached once it is full, and the mirror columns checked by `check_invariants`.
#[test]
fn decode_steps_from_the_hot_columns_allocate_and_cache_at_block_boundaries() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(1, 4), params(20));
    add(&mut s, "b", &prompt(100, 6), params(20));
    step_with(&mut s, 7); // both prompts in one step
    for _ in 0..16 {
        let before: Vec<u32> = ["a", "b"].iter().map(|id| s.get_num_computed_tokens(id).unwrap()).collect();
        let (out, _) = step_with(&mut s, 7);
        assert_eq!(out.num_scheduled_tokens, vec![1, 1]);
        for (k, id) in ["a", "b"].iter().enumerate() {
            let computed = before[k];
            let new_blocks = (out.new_block_ids_indptr[k + 1] - out.new_block_ids_indptr[k]) as u32;
            assert_eq!(new_blocks, u32::from(computed % 4 == 0), "{id} at {computed}");
            let r = s.get_request(id).unwrap();
            assert_eq!(r.blocks.len() as u32, (computed + 1).div_ceil(4), "{id} at {computed}");
            assert_eq!(r.num_cached_blocks, (computed + 1) / 4, "{id} at {computed}");
            assert_eq!(s.get_num_computed_tokens(id).unwrap(), computed + 1);
        }
    }
    // A mirror out of step with its record is reported.
    let slot = s.slot_of("a").unwrap() as usize;
    s.slab.hot.decode_hi[slot] += 1;
    assert!(s.check_invariants().unwrap_err().contains("hot columns"));
}

#[test]
fn cached_block_ids_and_ref_counts_follow_the_pool() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 16), params(3));
    let out = s.schedule().unwrap();
    let a_blocks: Vec<u32> = out.new_block_ids[0..4].iter().map(|&b| b as u32).collect();
    // All but the last token by default: 3 of a's 4 cached blocks; a bound in tokens cuts at a full block.
    assert_eq!(s.get_cached_block_ids(&prompt(0, 16), None, None, None).unwrap(), a_blocks[..3]);
    assert_eq!(s.get_cached_block_ids(&prompt(0, 17), None, None, None).unwrap(), a_blocks);
    assert_eq!(s.get_cached_block_ids(&prompt(0, 17), None, None, Some(11)).unwrap(), a_blocks[..2]);
    assert_eq!(s.get_cached_block_ids(&prompt(0, 17), None, None, Some(100)).unwrap(), a_blocks);
    assert!(s.get_cached_block_ids(&prompt(0, 17), Some("salt"), None, None).unwrap().is_empty());
    assert!(s.get_cached_block_ids(&prompt(1, 17), None, None, None).unwrap().is_empty());
    assert!(s.get_cached_block_ids(&[-1], None, None, None).is_err());
    for &b in &a_blocks {
        assert_eq!(s.get_block_ref_cnt(b).unwrap(), 1);
    }
    assert_eq!(s.get_block_ref_cnt(0).unwrap(), 0);
    assert!(matches!(s.get_block_ref_cnt(64), Err(SchedError::InvalidRequest(_))));
    s.abort_requests(&["a"]).unwrap();
    for &b in &a_blocks {
        assert_eq!(s.get_block_ref_cnt(b).unwrap(), 0);
    }
    // Freed blocks keep their hashes until reused: still hit.
    assert_eq!(s.get_cached_block_ids(&prompt(0, 17), None, None, None).unwrap(), a_blocks);
    s.check_invariants().unwrap();
}

#[test]
fn one_token_each_marks_steps_without_chunks_or_drafts() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 100), params(4));
    let (out, _) = step_with(&mut s, 1); // 64 of 100 prompt tokens: a chunk
    assert!(!out.one_token_each);
    let (out, _) = step_with(&mut s, 1); // the last 36: complete, samples one token
    assert_eq!(out.num_scheduled_tokens, vec![36]);
    assert!(out.one_token_each);
    add(&mut s, "b", &prompt(200, 8), params(4));
    let (out, _) = step_with(&mut s, 1); // a decodes, b's whole prompt: one token each
    assert_eq!(out.num_scheduled_tokens, vec![1, 8]);
    assert!(out.one_token_each);
    add(&mut s, "c", &prompt(300, 100), params(4));
    let (out, _) = step_with(&mut s, 1); // c is chunked by the budget
    assert!(!out.one_token_each);
    let (out, _) = step_with(&mut s, 1);
    assert!(out.one_token_each);
}

#[test]
fn step_num_output_tokens_counts_outputs_and_earlier_placeholders() {
    for async_scheduling in [false, true] {
        let mut s = Scheduler::new(SchedulerConfig { async_scheduling, ..cfg(4, 64) }).unwrap();
        add(&mut s, "a", &prompt(0, 8), params(8));
        let out1 = s.schedule().unwrap();
        assert_eq!(s.step_num_output_tokens(out1.scheduler_id, out1.step_id).unwrap(), vec![0]);
        let (out2, expected) = if async_scheduling {
            // Scheduled before step 1's token is known: its placeholder counts.
            (s.schedule().unwrap(), vec![1])
        } else {
            feed(&mut s, &out1, |_| vec![7]);
            (s.schedule().unwrap(), vec![1])
        };
        assert_eq!(s.step_num_output_tokens(out2.scheduler_id, out2.step_id).unwrap(), expected);
        // Only for the most recent step, before anything changes the scheduler.
        assert!(s.step_num_output_tokens(out1.scheduler_id, out1.step_id).is_err());
        add(&mut s, "b", &prompt(100, 8), params(8));
        assert!(matches!(
            s.step_num_output_tokens(out2.scheduler_id, out2.step_id),
            Err(SchedError::InvalidOutput(_))
        ));
    }
}

#[test]
fn draft_slots_and_a_token_budget_apart_from_the_inputs() {
    // Two 10-token prompts, 20 inputs, 3 draft slots per request: 10 (13 inputs), then 20 - 13 - 3 = 4.
    let budgets = SchedulerConfig {
        max_num_batched_tokens: 20,
        num_speculative_tokens: Some(4),
        draft_slots: 3,
        ..cfg(16, 64)
    };
    let mut s = Scheduler::new(budgets.clone()).unwrap();
    add(&mut s, "a", &prompt(1, 10), params(4));
    add(&mut s, "b", &prompt(101, 10), params(4));
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![10, 4]);
    s.check_invariants().unwrap();
    // A token budget of 12 under the same 20 inputs, no slots: 10, then 2.
    let mut s =
        Scheduler::new(SchedulerConfig { draft_slots: 0, max_num_scheduled_tokens: 12, ..budgets.clone() })
            .unwrap();
    add(&mut s, "a", &prompt(1, 10), params(4));
    add(&mut s, "b", &prompt(101, 10), params(4));
    assert_eq!(s.schedule().unwrap().num_scheduled_tokens, vec![10, 2]);
    // Decodes: 1 + 2 inputs each, so 20 / 3 = 6 of 8 running requests per step (the run of plain decodes
    // counts them as the general path does).
    let mut s = Scheduler::new(SchedulerConfig { draft_slots: 2, ..budgets.clone() }).unwrap();
    for k in 0..8 {
        add(&mut s, &format!("r{k}"), &prompt(100 * k + 1, 2), params(30));
    }
    for _ in 0..4 {
        let out = s.schedule().unwrap();
        one_token_each(&mut s, &out, 7);
    }
    assert_eq!(s.schedule().unwrap().num_scheduled_tokens, vec![1; 6]);
    s.check_invariants().unwrap();
    // The rules: slots below the inputs, the token budget at most the inputs.
    assert!(matches!(
        Scheduler::new(SchedulerConfig { draft_slots: 20, ..budgets.clone() }),
        Err(SchedError::InvalidConfig(_))
    ));
    assert!(matches!(
        Scheduler::new(SchedulerConfig { max_num_scheduled_tokens: 21, ..budgets }),
        Err(SchedError::InvalidConfig(_))
    ));
}

#[test]
fn preempt_request_by_hand_sends_a_running_request_to_the_front_of_waiting() {
    let mut s = Scheduler::new(cfg(4, 64)).unwrap();
    add(&mut s, "a", &prompt(0, 10), params(20));
    add(&mut s, "b", &prompt(1, 10), params(20));
    step_with(&mut s, 1);
    add(&mut s, "c", &prompt(2, 10), params(20));
    let free_before = s.num_free_blocks();
    assert!(matches!(s.preempt_request("zzz", false), Err(SchedError::UnknownRequest(_))));
    assert!(matches!(s.preempt_request("c", false), Err(SchedError::InvalidRequest(_))));
    assert_eq!(s.num_preemptions(), 0);
    s.preempt_request("a", false).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.num_free_blocks(), free_before + 3); // 11 tokens in blocks of 4
    assert_eq!(s.running_req_ids(), vec!["b".into()] as Vec<std::sync::Arc<str>>);
    assert_eq!(s.waiting_req_ids(), vec!["a".into(), "c".into()] as Vec<std::sync::Arc<str>>);
    assert_eq!(s.num_preemptions(), 1);
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.preempted_before_step, vec!["a".into()] as Vec<std::sync::Arc<str>>);
    // It resumes first: its two full blocks are a prefix hit, the last 3 of its 11 tokens are recomputed.
    assert_eq!(ids(&s, &out), ["b", "a", "c"]);
    assert_eq!(out.num_scheduled_tokens, vec![1, 3, 10]);
    let (out, _) = step_with(&mut s, 1);
    assert!(out.preempted_before_step.is_empty());
}

// --- align-mode Mamba groups (`mamba_align`) ---------------------------------------------------------------

fn align_config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop_oneof![Just(2u32), Just(4), Just(8)],
        20u32..60,
        1u32..6,
        prop_oneof![Just(8u32), Just(24), Just(64)],
        prop_oneof![Just(0u32), Just(3), Just(6)],
        0u32..3,
        0u8..4,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(bs, nb, seqs, budget, thr, spec, layout, asy, chunked)| {
            let groups = match layout {
                0 => vec![Some(crate::MAMBA), None],
                1 => vec![None, Some(crate::MAMBA)],
                2 => vec![Some(crate::MAMBA), Some(crate::MAMBA), None, Some(6)],
                // A ring before and after (vLLM's compressor rings of GLM-5 and Qwen4 style models).
                _ => vec![Some(crate::RING), Some(crate::MAMBA), None, Some(crate::RING)],
            };
            let max_model_len = 120;
            // Every request fits alone: its attention blocks, two states and the speculative blocks per Mamba
            // group (a request that never fits would be preempted and readmitted forever, as in vLLM).
            let room = (max_model_len / bs + 3 + spec) * groups.len() as u32;
            SchedulerConfig {
                block_size: bs,
                num_blocks: nb + room,
                max_num_seqs: seqs,
                max_num_batched_tokens: if chunked { budget } else { max_model_len },
                max_model_len,
                enable_prefix_caching: false,
                enable_chunked_prefill: chunked,
                long_prefill_token_threshold: thr,
                async_scheduling: asy,
                num_lookahead_tokens: spec,
                mamba_speculative_blocks: spec,
                kv_cache_groups: groups,
                mamba_align: true,
                ..Default::default()
            }
        })
}

/// Random operations `ops` on the align-mode Mamba config `config` keep every invariant (the tables' blocks held
/// once, counted in the pool, cached entries within the tables), every scheduled prefill chunk but a prompt's last
/// ends at a block boundary (or a shared-prefix junction's block-floored position, itself a block boundary from
/// the chunk's block-aligned start), and draining gives every block back. Returns the prefix hits of the Mamba
/// groups' admissions (entries scheduled with computed tokens and no table before).
fn align_soak(config: &SchedulerConfig, ops: Vec<Op>) -> Result<u32, TestCaseError> {
    let mut s = Scheduler::new(config.clone()).unwrap();
    let mut pending: Vec<SchedulerOutput> = Vec::new();
    let mut next_id = 0u32;
    let n_drafts = if config.async_scheduling { 0 } else { config.num_lookahead_tokens };
    let mut hits = 0u32;
    let check_chunks = |s: &Scheduler, out: &SchedulerOutput, hits: &mut u32| -> Result<(), TestCaseError> {
        for &i in out.new_reqs.iter().chain(&out.resumed_reqs) {
            *hits += u32::from(out.num_computed_tokens[i as usize] > 0);
        }
        for (i, h) in out.handles.iter().enumerate() {
            let Ok(req) = s.slab.get(h.slot) else { continue };
            let (start, n) = (out.num_computed_tokens[i] as u32, out.num_scheduled_tokens[i] as u32);
            let prefill_end = req.num_prompt_tokens.max(req.num_tokens() - 1);
            // With prefix hits inside a block a chunk also stops at the prompt's last unit boundary.
            let unit_tail = config.partial_hit_unit().map(|u| (req.num_prompt_tokens - 1) / u * u);
            if start < prefill_end
                && start + n < prefill_end
                && (start + n) % config.block_size != 0
                && unit_tail != Some(start + n)
            {
                // Only a block wider than the longest prefill chunk leaves a chunk end inside a block.
                let longest = if config.long_prefill_token_threshold > 0 {
                    config.long_prefill_token_threshold.min(config.max_num_batched_tokens)
                } else {
                    config.max_num_batched_tokens
                };
                prop_assert!(
                    config.block_size > longest
                        && (start + n) / config.block_size == start / config.block_size,
                    "chunk {start}..{} ends inside a block",
                    start + n
                );
            }
        }
        Ok(())
    };
    for op in ops {
        match op {
            Op::Add { prefix, len, max_tokens, .. } => {
                let p: Vec<i64> =
                    (0..i64::from(len.min(100))).map(|t| (t * 7 + i64::from(prefix) * 1000) % 97).collect();
                let params = RequestParams {
                    max_tokens: Some(u32::from(max_tokens)),
                    eos_token_id: Some(2),
                    arrival_time: f64::from(next_id),
                    ..Default::default()
                };
                let _ = s.add_request(&format!("r{next_id}"), &p, params);
                next_id += 1;
            }
            Op::Step { eos } => {
                let out = s.schedule().unwrap();
                check_chunks(&s, &out, &mut hits)?;
                pending.push(out);
                s.check_invariants().map_err(TestCaseError::fail)?;
                while !pending.is_empty() {
                    apply_pending(&mut s, &mut pending, eos, n_drafts);
                }
            }
            Op::ScheduleOnly => {
                let out = s.schedule().unwrap();
                check_chunks(&s, &out, &mut hits)?;
                pending.push(out);
            }
            Op::ApplyPending => apply_pending(&mut s, &mut pending, false, 0),
            Op::Abort(k) => {
                let live = live_ids(&s);
                if !live.is_empty() {
                    s.abort_requests(&[live[k as usize % live.len()].clone()]).unwrap();
                }
            }
            Op::Preempt(k, drop) => {
                let running = s.running_req_ids();
                if !running.is_empty() {
                    let id = running[k as usize % running.len()].to_string();
                    s.preempt_request(&id, drop).unwrap();
                }
            }
            _ => {}
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
    }
    while !pending.is_empty() {
        apply_pending(&mut s, &mut pending, false, 0);
    }
    let mut guard = 0;
    while s.has_unfinished_requests() {
        pending.push(s.schedule().unwrap());
        apply_pending(&mut s, &mut pending, false, 0);
        s.check_invariants().map_err(TestCaseError::fail)?;
        guard += 1;
        prop_assert!(guard < 20_000, "scheduler made no progress");
    }
    prop_assert_eq!(s.num_free_blocks(), config.num_blocks as usize - 1);
    Ok(hits)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, .. ProptestConfig::default() })]

    /// Random operations on align-mode Mamba configs without prefix caching (`align_soak`).
    #[test]
    fn align_mamba_random_operations_keep_every_invariant(
        config in align_config_strategy(),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        align_soak(&config, ops)?;
    }

    /// The same with prefix caching on: Mamba prefix hits, cached states, same-step hits deferred and
    /// shared-prefix junction stops (`align_soak`).
    #[test]
    fn align_mamba_prefix_caching_random_operations_keep_every_invariant(
        config in align_config_strategy(),
        ops in prop::collection::vec(op(), 1..100),
    ) {
        align_soak(&SchedulerConfig { enable_prefix_caching: true, ..config }, ops)?;
    }

    /// With prefix hits inside a block (a prefix-match unit of half the block, layouts of full attention and Mamba
    /// groups only): hits inside a block, the copies of the blocks they end inside, prompt tails keyed inside a
    /// block, dense and sparse retention.
    #[test]
    fn mamba_prefix_hits_inside_a_block_random_operations_keep_every_invariant(
        config in align_config_strategy(),
        retention in prop_oneof![Just(None), Just(Some(0u32))],
        ops in prop::collection::vec(op(), 1..100),
    ) {
        let groups: Vec<_> = config.kv_cache_groups.iter().copied().filter(|w| *w != Some(6)).collect();
        let config = SchedulerConfig {
            enable_prefix_caching: true,
            hash_block_size: Some(config.block_size / 2),
            kv_cache_groups: groups,
            prefix_cache_retention_interval: retention,
            ..config
        };
        prop_assert!(config.partial_hit_unit().is_some());
        align_soak(&config, ops)?;
    }

    /// With sparse retention of the cached states and window blocks too (0, or an interval of one to three
    /// blocks).
    #[test]
    fn sparse_mamba_retention_random_operations_keep_every_invariant(
        config in align_config_strategy(),
        blocks in 0u32..4,
        ops in prop::collection::vec(op(), 1..100),
    ) {
        let config = SchedulerConfig {
            enable_prefix_caching: true,
            prefix_cache_retention_interval: Some(blocks * config.block_size),
            ..config
        };
        align_soak(&config, ops)?;
    }
}

fn align_caching_cfg() -> SchedulerConfig {
    SchedulerConfig {
        enable_prefix_caching: true,
        kv_cache_groups: vec![None, Some(crate::MAMBA)],
        mamba_align: true,
        ..cfg(4, 64)
    }
}

#[test]
fn mamba_prefix_hit_takes_the_cached_state_block() {
    let mut s = Scheduler::new(align_caching_cfg()).unwrap();
    add(&mut s, "a", &prompt(0, 13), params(3));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![12]); // the last boundary that leaves a token
    let table = s.get_group_block_ids("a", 1).unwrap().to_vec();
    assert_eq!(table[..2], [0, 0]);
    let state = table[2];
    run_to_completion(&mut s);
    add(&mut s, "b", &prompt(0, 13), params(3));
    let (out, _) = step_with(&mut s, 1);
    // The hit: 12 tokens (the full-attention blocks and the Mamba state at 12), null blocks before the state.
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![12], vec![1]));
    let table = s.get_group_block_ids("b", 1).unwrap().to_vec();
    assert_eq!(table.len(), 4);
    assert_eq!(table[..3], [0, 0, state]);
}

#[test]
fn sparse_window_retention_caches_only_the_runs_a_hit_needs() {
    // A window of 6 tokens (a hit needs the 2 blocks before its end), one group and beside full attention. "a" (25
    // tokens) with retention 0 caches the window's blocks 4 and 5 only (a resend hits 24 tokens); "b", sharing 16
    // tokens, then hits nothing. Beside full attention 16 is "b"'s junction, whose run (blocks 2 and 3) "b" caches:
    // "c", sharing the same 16 tokens, hits 16. Segments of 3 blocks keep blocks 1 and 2 too ("b" hits 12).
    for groups in [vec![], vec![None, Some(6)]] {
        for (retention, b_hit, c_hit) in [(None, 16, 16), (Some(0), 0, 16), (Some(12), 12, 16)] {
            let cfg = SchedulerConfig {
                enable_prefix_caching: true,
                sliding_window: groups.is_empty().then_some(6),
                kv_cache_groups: groups.clone(),
                prefix_cache_retention_interval: retention,
                ..cfg(4, 40)
            };
            let mut s = Scheduler::new(cfg).unwrap();
            add(&mut s, "a", &prompt(0, 25), params(1));
            run_to_completion(&mut s);
            assert_eq!(s.get_num_cached_tokens(&prompt(0, 25), None, None).unwrap(), 24);
            let mut b = prompt(0, 16);
            b.extend(prompt(500, 9));
            add(&mut s, "b", &b, params(1));
            let (out, _) = step_with(&mut s, 1);
            assert_eq!(out.num_computed_tokens, vec![b_hit], "{groups:?} retention {retention:?}");
            run_to_completion(&mut s);
            let mut c = prompt(0, 16);
            c.extend(prompt(900, 9));
            add(&mut s, "c", &c, params(1));
            let (out, _) = step_with(&mut s, 1);
            let want = if groups.is_empty() { b_hit } else { c_hit };
            assert_eq!(out.num_computed_tokens, vec![want], "{groups:?} retention {retention:?}");
            s.check_invariants().unwrap();
        }
    }
}

#[test]
fn sparse_mamba_retention_caches_only_the_resumable_states() {
    // "a" (24 tokens) runs in chunks of 8: states after 8, 16 and 20 tokens. Dense retention caches the three
    // ("b", sharing 16 tokens, hits 16); retention 0 only the one after 20 (the prompt's last boundary before its
    // last token: "b" hits nothing, the resend of "a" hits 20).
    for (retention, hit) in [(None, 16), (Some(0), 0), (Some(8), 16)] {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 8,
            prefix_cache_retention_interval: retention,
            ..align_caching_cfg()
        };
        let mut s = Scheduler::new(cfg).unwrap();
        add(&mut s, "a", &prompt(0, 24), params(1));
        for _ in 0..3 {
            let p = super::helpers::schedule(&mut s);
            super::helpers::apply(&mut s, &p, |_| vec![]);
        }
        run_to_completion(&mut s);
        let mut b = prompt(0, 16);
        b.extend(prompt(500, 14));
        add(&mut s, "b", &b, params(1));
        let (out, _) = step_with(&mut s, 1);
        assert_eq!(out.num_computed_tokens, vec![hit], "retention {retention:?}");
        run_to_completion(&mut s);
        add(&mut s, "a2", &prompt(0, 24), params(1));
        let (out, _) = step_with(&mut s, 1);
        assert_eq!(out.num_computed_tokens, vec![20], "retention {retention:?}");
        s.check_invariants().unwrap();
    }
}

#[test]
fn mamba_hit_on_a_state_cached_in_the_same_step_waits_for_the_next_step() {
    // With the full-sequence gate (it fails there first) and without it (the allocation fails).
    for gate in [true, false] {
        let mut s =
            Scheduler::new(SchedulerConfig { scheduler_reserve_full_isl: gate, ..align_caching_cfg() })
                .unwrap();
        add(&mut s, "a", &prompt(0, 13), params(3));
        add(&mut s, "b", &prompt(0, 13), params(3));
        let (out, _) = step_with(&mut s, 1);
        // "b" would hit the state "a" caches in this step: its allocation fails, as a full pool's would.
        assert_eq!(ids(&s, &out), ["a"]);
        let (out, _) = step_with(&mut s, 1);
        assert_eq!(ids(&s, &out), ["a", "b"]);
        assert_eq!(out.num_computed_tokens, vec![12, 12]);
    }
}

#[test]
fn a_shared_prefix_junction_ends_the_chunk_where_its_state_can_be_cached() {
    let mut s = Scheduler::new(align_caching_cfg()).unwrap();
    add(&mut s, "a", &prompt(0, 24), params(1));
    run_to_completion(&mut s);
    // "b" shares 16 tokens with "a": the full-attention hit is 4 blocks, the Mamba hit none (no state of "a"
    // at 16), so the hit is 0 and 16 is the junction: the first chunk ends there (else at 28).
    let b: Vec<i64> = prompt(0, 16).into_iter().chain(prompt(500, 14)).collect();
    add(&mut s, "b", &b, params(1));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![0], vec![16]));
    run_to_completion(&mut s);
    // "c" shares the same 16 tokens: it resumes from the state "b" cached there.
    let c: Vec<i64> = prompt(0, 16).into_iter().chain(prompt(900, 10)).collect();
    add(&mut s, "c", &c, params(1));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_computed_tokens, vec![16]);
}

/// With async scheduling a decode holds output placeholders when its step is applied: runs of such entries take
/// `placeholder_decode_updates` (and plain ones `plain_decode_updates`) instead of the general path. Both ways
/// must leave the same state after every update: the same trace of schedules, update results, request records,
/// hot columns and free blocks, through block boundaries, stops (EOS, stop ids, length) and preemptions.
#[test]
fn async_decode_runs_match_the_general_path() {
    use crate::update::{GENERAL_ONLY, PLACEHOLDER_RUN_ENTRIES};
    // `ahead`: each step is scheduled before the one before it is applied (its decodes hold two placeholders
    // then, one left after the update); otherwise every step is applied before the next is scheduled (the
    // update takes each decode's only placeholder).
    fn trace(config: &SchedulerConfig, ahead: bool, general_only: bool) -> (Vec<String>, u64) {
        GENERAL_ONLY.with(|c| c.set(general_only));
        PLACEHOLDER_RUN_ENTRIES.with(|c| c.set(0));
        let mut s = Scheduler::new(config.clone()).unwrap();
        let shared = prompt(500, 9);
        for k in 0..8u32 {
            let mut p = if k % 3 == 0 { shared.clone() } else { prompt(100 * i64::from(k), 5 + k as usize) };
            p.push(i64::from(k));
            let params = RequestParams {
                max_tokens: Some(12 + 5 * k),
                eos_token_id: Some(7),
                stop_token_ids: if k == 5 { vec![33] } else { Vec::new() },
                ignore_eos: k % 2 == 1,
                // Two requests with an image each: the update of their prefill frees it.
                encoder_inputs: if k == 2 || k == 7 {
                    vec![crate::EncoderInput { start: 1, num_tokens: 3, hash: u64::from(k) }]
                } else {
                    Vec::new()
                },
                ..Default::default()
            };
            add(&mut s, &format!("r{k}"), &p, params);
        }
        let mut lines = Vec::new();
        let mut step = 0i64;
        let mut ahead_step = ahead.then(|| schedule(&mut s));
        while s.has_unfinished_requests() && step < 200 {
            let next = schedule(&mut s);
            let (pending, next) = match ahead_step.take() {
                Some(p) => (p, Some(next)),
                None => (next, None),
            };
            step += 1;
            // Token 7 (EOS) now and then, 33 (a stop id) once, otherwise distinct ids.
            let res = apply(&mut s, &pending, |i| {
                vec![if (step + i as i64) % 23 == 0 { 7 } else { 30 + (step * 3 + i as i64) % 5 }]
            });
            let mut out = pending.out.clone();
            out.scheduler_id = 0;
            lines.push(format!("step {step}: {out:?}\n{res:?}"));
            for r in s.slab.iter() {
                let slot = r.handle.slot as usize;
                let hot = &s.slab.hot;
                lines.push(format!(
                    "{r:?} hot {:?}",
                    (
                        hot.computed[slot],
                        hot.in_flight[slot],
                        hot.stale[slot],
                        hot.num_tokens[slot],
                        hot.plain[slot]
                    )
                ));
            }
            lines.push(format!("free {:?}, tenants {:?}", free_order(&s), s.tenants));
            ahead_step = next;
        }
        assert!(!s.has_unfinished_requests(), "the trace runs to its end");
        GENERAL_ONLY.with(|c| c.set(false));
        (lines, PLACEHOLDER_RUN_ENTRIES.with(std::cell::Cell::get))
    }
    // Room for all; a tight pool (preemptions, stale output); a token budget below the running decodes.
    for (num_blocks, budget, ahead) in
        [(64, 24, true), (12, 24, true), (64, 5, true), (64, 24, false), (12, 24, false), (64, 5, false)]
    {
        let config = SchedulerConfig {
            async_scheduling: true,
            max_num_batched_tokens: budget,
            max_num_encoder_input_tokens: 8,
            encoder_cache_size: 8,
            ..cfg(4, num_blocks)
        };
        let (general, none) = trace(&config, ahead, true);
        let (runs, taken) = trace(&config, ahead, false);
        assert_eq!(none, 0);
        assert!(
            taken >= 30,
            "{num_blocks} blocks, budget {budget}, ahead {ahead}: {taken} entries took the placeholder runs"
        );
        assert_eq!(general.len(), runs.len());
        for (g, r) in general.iter().zip(&runs) {
            assert_eq!(g, r, "{num_blocks} blocks, budget {budget}, ahead {ahead}");
        }
    }
}

#[test]
fn a_hit_inside_a_block_copies_the_block_it_ends_inside() {
    // Blocks of 8, a prefix-match unit of 2, full attention then a Mamba group. "a" (21 tokens) runs 16, then 4 (a
    // chunk ends at the prompt's last unit boundary, 20, inside its third block), then 1: its state at 20, keyed
    // there, moves to a copy before that last chunk overwrites it. "b" shares 20 tokens: its hit ends inside the
    // third block, which each group copies into a block of its own.
    let config = SchedulerConfig { hash_block_size: Some(2), ..align_caching_cfg() };
    let mut s = Scheduler::new(SchedulerConfig { block_size: 8, num_blocks: 32, ..config }).unwrap();
    add(&mut s, "a", &prompt(0, 21), params(3));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![16]);
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![4]);
    assert!(out.kv_cache_block_copies.is_empty());
    let attention = s.get_group_block_ids("a", 0).unwrap()[2];
    let state = s.get_group_block_ids("a", 1).unwrap()[2];
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![1]);
    // The request keeps writing into its own state block; the cache keeps the copy.
    assert_eq!(out.kv_cache_block_copies.len(), 1);
    let (source, copy) = out.kv_cache_block_copies[0];
    assert_eq!(source, state);
    assert_eq!(s.get_group_block_ids("a", 1).unwrap()[2], state);
    run_to_completion(&mut s);
    let mut b = prompt(0, 20);
    b.extend(prompt(500, 4));
    add(&mut s, "b", &b, params(1));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![20], vec![2]));
    let (fa, mamba) =
        (s.get_group_block_ids("b", 0).unwrap().to_vec(), s.get_group_block_ids("b", 1).unwrap().to_vec());
    assert_eq!(out.kv_cache_block_copies, vec![(attention, fa[2]), (copy, mamba[2])]);
    assert_eq!(mamba[..2], [0, 0]);
    // The copies go first in the blocks to zero (attention groups only).
    assert_eq!(out.zero_block_ids.first(), Some(&(fa[2] as i32)));
    s.check_invariants().unwrap();
}

#[test]
fn a_ring_group_holds_one_block_beside_prefix_caching() {
    // A ring first (as vLLM may list a compressor's ring), full attention and a window of 6 tokens, prefix caching
    // on: each request holds one ring block whatever its length, the ring takes no part in the hit, and every
    // block comes back at the end.
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        kv_cache_groups: vec![Some(crate::RING), None, Some(6)],
        ..cfg(4, 64)
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let free = s.num_free_blocks();
    add(&mut s, "a", &prompt(0, 13), params(6));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![13]);
    let ring = s.get_group_block_ids("a", 0).unwrap().to_vec();
    assert_eq!(ring.len(), 1);
    assert_eq!(s.get_group_block_ids("a", 1).unwrap().len(), 4);
    for _ in 0..4 {
        step_with(&mut s, 1);
        assert_eq!(s.get_group_block_ids("a", 0).unwrap(), ring.as_slice(), "the ring never grows");
    }
    run_to_completion(&mut s);
    assert_eq!(s.num_free_blocks(), free);
    add(&mut s, "b", &prompt(0, 13), params(2));
    let (out, _) = step_with(&mut s, 1);
    // The hit: 12 tokens of full attention and the window's last two blocks; the ring block is a fresh one.
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![12], vec![1]));
    let b_ring = s.get_group_block_ids("b", 0).unwrap().to_vec();
    assert_eq!(b_ring.len(), 1);
    assert_ne!(b_ring[0], 0, "a real block, not the null block");
    assert_eq!(s.get_group_block_ids("b", 1).unwrap().len(), 4);
    s.check_invariants().unwrap();
    run_to_completion(&mut s);
    assert_eq!(s.num_free_blocks(), free);
}

#[test]
fn the_larger_blocks_first_leave_the_primary_group_to_the_smallest() {
    // MiMo-V2's layout: the full-attention group comes first with blocks of 12 tokens (vLLM raised its block size,
    // its pages being the smaller), the window group of 4-token blocks is the primary group, which hashes. A hit
    // is the full-attention hit aligned to 12 tokens, whichever group comes first.
    let cfg = SchedulerConfig {
        enable_prefix_caching: true,
        kv_cache_groups: vec![None, Some(3)],
        kv_cache_group_block_sizes: vec![12, 4],
        ..cfg(4, 64)
    };
    assert_eq!(cfg.primary_group(), Some(1));
    let mut s = Scheduler::new(cfg).unwrap();
    let free = s.num_free_blocks();
    add(&mut s, "a", &prompt(0, 50), params(1));
    run_to_completion(&mut s);
    assert_eq!(s.num_free_blocks(), free);
    add(&mut s, "b", &prompt(0, 60), params(3));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.primary_group, 1);
    // 48 tokens of a's 50 are cached in 12-token blocks: 4 full-attention blocks, the window's last block.
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![48], vec![12]));
    assert_eq!(s.get_group_block_ids("b", 0).unwrap().len(), 5);
    assert_eq!(s.get_group_block_ids("b", 1).unwrap().len(), 15);
    s.check_invariants().unwrap();
    run_to_completion(&mut s);
    assert_eq!(s.num_free_blocks(), free);
}

#[test]
fn a_window_of_one_token_caches_its_blocks_only_under_the_trailing_block_drop() {
    // Full attention beside a window of one token: no block of the window can start a hit, so it caches none and
    // a second request with the same prompt gets no hit; with the drop a hit reads the block past the boundary,
    // so the window's blocks are cached and the second request hits (its last block given up).
    for drop in [false, true] {
        let cfg = SchedulerConfig {
            enable_prefix_caching: true,
            kv_cache_groups: vec![None, Some(1)],
            drop_trailing_hit_block: drop,
            ..cfg(4, 64)
        };
        let mut s = Scheduler::new(cfg).unwrap();
        let free = s.num_free_blocks();
        add(&mut s, "a", &prompt(0, 21), params(1));
        run_to_completion(&mut s);
        add(&mut s, "b", &prompt(0, 21), params(3));
        let (out, _) = step_with(&mut s, 1);
        // 20 tokens in full blocks; with the drop the hit gives up its last block.
        assert_eq!(out.num_computed_tokens, if drop { vec![16] } else { vec![0] }, "drop {drop}");
        s.check_invariants().unwrap();
        run_to_completion(&mut s);
        assert_eq!(s.num_free_blocks(), free);
    }
}

#[test]
fn a_ring_group_block_is_given_back_at_preemption_and_taken_again() {
    // Two requests in a pool that holds both only until they decode past their blocks: the one preempted gives its
    // ring block back and takes one block again when it is readmitted; a Mamba group's attention zeroing leaves
    // the ring's blocks out.
    let cfg = SchedulerConfig {
        kv_cache_groups: vec![None, Some(crate::RING), Some(crate::MAMBA)],
        enable_prefix_caching: false,
        ..cfg(4, 12)
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let free = s.num_free_blocks();
    add(&mut s, "a", &prompt(0, 8), params(12));
    add(&mut s, "b", &prompt(100, 8), params(12));
    let (out, _) = step_with(&mut s, 1);
    assert_eq!(out.num_scheduled_tokens, vec![8, 8]);
    let rings: Vec<u32> = ["a", "b"].iter().map(|r| s.get_group_block_ids(r, 1).unwrap()[0]).collect();
    for r in &rings {
        assert!(!out.zero_block_ids.contains(&(*r as i32)), "ring blocks are never zeroed");
    }
    assert_eq!(out.zero_block_ids.len(), 4, "the attention blocks of both requests");
    let mut preempted = false;
    while s.has_unfinished_requests() {
        let (out, _) = step_with(&mut s, 1);
        if !out.preempted.is_empty() {
            preempted = true;
            let victim = s.slab.get(out.preempted[0].slot).unwrap().id.clone();
            assert!(s.get_group_block_ids(&victim, 1).unwrap().is_empty(), "the ring block goes back");
        }
        for id in ["a", "b"] {
            if let Ok(t) = s.get_group_block_ids(id, 0) {
                let ring = s.get_group_block_ids(id, 1).unwrap();
                assert_eq!(
                    ring.len(),
                    usize::from(!t.is_empty()),
                    "{id}: one ring block while it holds blocks"
                );
            }
        }
        s.check_invariants().unwrap();
    }
    assert!(preempted);
    assert_eq!(s.num_free_blocks(), free);
}
