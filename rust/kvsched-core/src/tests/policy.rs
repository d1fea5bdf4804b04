//! Behaviour tests of the admission policies (the cache-aware window, fair share (VTC), priority aging), of the
//! waiting orders sjf and slo, `order_key` tiers, `max_wait_steps` aging and session affinity, and of the victim
//! rules (`preemption_victim`).

use std::collections::HashMap;

use proptest::prelude::*;

use super::helpers::{add, feed, ids, live_ids, params, prompt, step_ids};
use crate::{
    Policy, PreemptionMode, PreemptionVictim, Request, RequestParams, Scheduler, SchedulerConfig,
    SchedulerOutput,
};

/// `params(max_tokens)` arriving at `arrival_time`.
fn params_at(max_tokens: u32, arrival_time: f64) -> RequestParams {
    RequestParams { arrival_time, ..params(max_tokens) }
}

/// The canonical case: block size 16; 8 usable blocks, 4 held by a running request (KV usage 0.5, the default
/// threshold), so the free pool holds only the warm 3-block prefix plus one block. A cold 48-token request
/// arrives before a warm one whose 48-token prompt is cached. Returns (admitted in that step, warm request's
/// prefix hit in tokens, cached tokens of the warm prompt right after that step).
fn canonical(window: u32, threshold: f64) -> (Vec<String>, i64, u32) {
    let config = SchedulerConfig {
        block_size: 16,
        num_blocks: 9,
        max_num_seqs: 2,
        max_num_batched_tokens: 256,
        max_model_len: 128,
        cache_aware_admission_window: window,
        cache_aware_admission_threshold: threshold,
        prefix_hash_seed: Some(b"c".to_vec()),
        ..Default::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    let warm: Vec<i64> = (100..148).collect();
    s.add_request("seed", &warm, params_at(1, 0.0)).unwrap(); // computes and caches the warm prompt, then ends
    s.add_request("busy", &(500..560).collect::<Vec<_>>(), params_at(4, 1.0)).unwrap(); // 4 blocks throughout
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    assert_eq!(s.get_num_cached_tokens(&warm, None, None).unwrap(), 32); // a hit never covers the last token
    s.add_request("cold", &(900..948).collect::<Vec<_>>(), params_at(1, 2.0)).unwrap();
    s.add_request("warm", &warm, params_at(1, 3.0)).unwrap();
    let mut admitted = Vec::new();
    let mut cached_after = 0;
    let mut hit = -1;
    for step in 0..10 {
        let out = s.schedule().unwrap();
        if step == 0 {
            admitted = ids(&s, &out)[1..].to_vec();
            cached_after = s.get_num_cached_tokens(&warm, None, None).unwrap();
        }
        if let Ok(r) = s.get_request("warm") {
            hit = r.num_cached_tokens;
        }
        feed(&mut s, &out, |_| vec![7]);
    }
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.num_free_blocks(), 8);
    (admitted, hit, cached_after)
}

#[test]
fn admission_window_admits_the_warm_request_first_and_it_reuses_its_prefix() {
    assert_eq!(canonical(4, 0.5), (vec!["warm".to_string()], 32, 32));
}

#[test]
fn without_a_window_the_cold_request_goes_first_and_evicts_the_warm_prefix() {
    // The cold request takes the free block and 2 of the warm prefix's 3 blocks: only 16 tokens stay cached.
    assert_eq!(canonical(0, 0.5), (vec!["cold".to_string()], 16, 16));
}

#[test]
fn below_the_threshold_the_window_does_not_reorder() {
    assert_eq!(canonical(4, 0.6), (vec!["cold".to_string()], 16, 16));
}

fn fair_config(weights: Vec<(String, f64)>) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 200,
        max_num_seqs: 2,
        max_num_batched_tokens: 64,
        max_model_len: 128,
        policy: Policy::Fair,
        tenant_weights: weights,
        prefix_hash_seed: Some(b"f".to_vec()),
        ..Default::default()
    }
}

/// An 8-token request of `tenant` (prompts never share a prefix: no cache hits).
fn add_for(s: &mut Scheduler, id: &str, tenant: &str, t: f64) {
    let p = RequestParams { tenant: Some(tenant.into()), ..params_at(4, t) };
    let first = 1000 * (s.num_unfinished_requests() as i64 + 1) + (t * 10.0) as i64;
    s.add_request(id, &(first..first + 8).collect::<Vec<_>>(), p).unwrap();
}

#[test]
fn fair_admits_the_tenant_with_the_smallest_counter_despite_arrival_order() {
    let mut s = Scheduler::new(fair_config(vec![])).unwrap();
    for k in 0..6 {
        add_for(&mut s, &format!("a{k}"), "a", f64::from(k));
    }
    add_for(&mut s, "b0", "b", 10.0);
    let out = s.schedule().unwrap();
    // a0 first (equal counters, earlier head); a is then charged 8, so b0 is next.
    assert_eq!(ids(&s, &out), vec!["a0", "b0"]);
    let counters: Vec<f64> = s.tenant_stats().map(|t| t.counter).collect();
    assert_eq!(counters, vec![8.0, 8.0]);
}

#[test]
fn fair_victim_is_the_newest_request_of_the_tenant_with_the_largest_counter() {
    let config = SchedulerConfig { num_blocks: 9, max_num_seqs: 4, max_model_len: 32, ..fair_config(vec![]) };
    let mut s = Scheduler::new(config).unwrap();
    add_for(&mut s, "a0", "a", 0.0);
    add_for(&mut s, "a1", "a", 1.0);
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]); // a: 2 * 8 prompt + 2 * 2 decode = 20
    add_for(&mut s, "b0", "b", 2.0);
    let out = s.schedule().unwrap(); // running [a0, a1, b0]: 3 + 3 + 2 = all 8 blocks
    assert_eq!(ids(&s, &out), vec!["a0", "a1", "b0"]);
    feed(&mut s, &out, |_| vec![7]);
    let out = s.schedule().unwrap(); // b0 needs a 3rd block: the victim is a1, not the last request (b0)
    let victims: Vec<String> =
        out.preempted.iter().filter_map(|&h| s.request_id(h)).map(|x| x.to_string()).collect();
    assert_eq!(victims, vec!["a1"]);
    assert_eq!(ids(&s, &out), vec!["a0", "b0"]);
}

#[test]
fn weights_scale_the_charges() {
    let mut s = Scheduler::new(fair_config(vec![("heavy".into(), 4.0)])).unwrap();
    add_for(&mut s, "h", "heavy", 0.0);
    add_for(&mut s, "l", "light", 0.0);
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    let st: Vec<(String, f64, u64, u64)> = s
        .tenant_stats()
        .map(|t| (t.name.to_string(), t.counter, t.num_prefill_tokens, t.num_decode_tokens))
        .collect();
    assert_eq!(st, vec![("heavy".into(), 8.0 / 4.0 + 2.0 / 4.0, 8, 1), ("light".into(), 8.0 + 2.0, 8, 1)]);
    s.set_tenant_weight("light", 2.0).unwrap();
    assert!(s.set_tenant_weight("light", -1.0).is_err());
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    assert_eq!(s.tenant_stats().nth(1).map(|t| t.counter), Some(10.0 + 1.0));
}

/// One low-priority request and a stream of high-priority ones, one slot: how long the low one waits.
fn low_priority_wait(aging_steps: u32) -> Option<u64> {
    let config = SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 1,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        policy: Policy::Priority,
        priority_aging_steps: aging_steps,
        prefix_hash_seed: Some(b"a".to_vec()),
        ..Default::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    let low = RequestParams { priority: 5, ..params_at(1, 0.0) };
    s.add_request("low", &[1, 2, 3], low).unwrap();
    for step in 0..200u64 {
        // A new high-priority request every step: each takes the only slot for one step.
        let hi = RequestParams { priority: 0, ..params_at(1, 1.0 + step as f64) };
        s.add_request(&format!("hi{step}"), &[4, 5, 6], hi).unwrap();
        let out = s.schedule().unwrap();
        if ids(&s, &out).iter().any(|x| x == "low") {
            return Some(step);
        }
        feed(&mut s, &out, |_| vec![7]);
    }
    None
}

#[test]
fn aging_bounds_the_wait_of_a_low_priority_request() {
    assert_eq!(low_priority_wait(0), None); // starves for the whole run
                                            // Priority 5 at step 0 vs priority 0 at step s: equal keys at s = 5 * 4; earlier arrival wins the tie.
    assert_eq!(low_priority_wait(4), Some(20));
}

#[test]
fn fair_self_preemption_lets_the_requests_after_it_run() {
    let config = SchedulerConfig {
        num_blocks: 5,
        max_num_seqs: 4,
        max_model_len: 16,
        ..fair_config(vec![("b".into(), 2.0)])
    };
    let mut s = Scheduler::new(config).unwrap();
    add_for(&mut s, "a0", "a", 0.0);
    add_for(&mut s, "b0", "b", 1.0);
    let out = s.schedule().unwrap();
    assert_eq!(ids(&s, &out), vec!["a0", "b0"]); // all 4 blocks held; a's counter 8 + 2, b's (8 + 2) / 2
    feed(&mut s, &out, |_| vec![7]);
    // a0 needs a 3rd block: its own tenant has the largest counter, so it preempts itself; b0 then fits.
    let out = s.schedule().unwrap();
    let victims: Vec<String> =
        out.preempted.iter().filter_map(|&h| s.request_id(h)).map(|x| x.to_string()).collect();
    assert_eq!(victims, vec!["a0"]);
    assert_eq!(ids(&s, &out), vec!["b0"]);
}

// ---- the waiting orders: sjf, slo, tiers, aging, session affinity ---------------------------------------

fn order_config(policy: Policy) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 1,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        policy,
        prefix_hash_seed: Some(b"o".to_vec()),
        ..Default::default()
    }
}

fn with(p: RequestParams, f: impl FnOnce(&mut RequestParams)) -> RequestParams {
    let mut p = p;
    f(&mut p);
    p
}

/// Steps until nothing is left; the ids admitted (new or resumed), in order.
fn admissions(s: &mut Scheduler) -> Vec<String> {
    let mut order = Vec::new();
    for _ in 0..500 {
        if !s.has_unfinished_requests() {
            return order;
        }
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        let all = ids(s, &out);
        let fresh: Vec<usize> = out.new_reqs.iter().chain(&out.resumed_reqs).map(|&i| i as usize).collect();
        order.extend(all.iter().enumerate().filter(|(i, _)| fresh.contains(i)).map(|(_, x)| x.clone()));
        feed(s, &out, |_| vec![7]);
    }
    panic!("requests left after 500 steps");
}

/// The cached 40-token prompt LONG (10 blocks), then behind a running request: a cold 12-token request and a
/// 44-token continuation of LONG (1 block beyond its hit).
fn warm_long_vs_cold_short(policy: Policy) -> Vec<String> {
    let mut s = Scheduler::new(order_config(policy)).unwrap();
    let long: Vec<i64> = (100..140).collect();
    add(&mut s, "seed", &long, params_at(1, 0.0));
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    add(&mut s, "busy", &prompt(300, 8), params_at(3, 1.0));
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    add(&mut s, "cold", &prompt(500, 12), params_at(1, 2.0));
    let warm: Vec<i64> = long.iter().copied().chain([1, 2, 3, 4]).collect();
    add(&mut s, "warm", &warm, params_at(1, 3.0));
    admissions(&mut s)
}

#[test]
fn sjf_prefers_a_warm_long_prompt_over_a_cold_shorter_one() {
    assert_eq!(warm_long_vs_cold_short(Policy::Sjf), vec!["warm", "cold"]);
    assert_eq!(warm_long_vs_cold_short(Policy::Fcfs), vec!["cold", "warm"]);
}

#[test]
fn sjf_re_keys_the_head_when_its_prefix_was_evicted() {
    let mut s = Scheduler::new(order_config(Policy::Sjf)).unwrap();
    let long: Vec<i64> = (100..140).collect();
    add(&mut s, "seed", &long, params_at(1, 0.0));
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]);
    s.set_pause_state(crate::PauseState::PausedNew);
    let warm: Vec<i64> = long.iter().copied().chain([1, 2, 3, 4]).collect();
    add(&mut s, "warm", &warm, params_at(1, 1.0));
    add(&mut s, "cold", &prompt(500, 12), params_at(1, 2.0));
    assert!(s.reset_prefix_cache(false).unwrap());
    assert_eq!(s.waiting_req_ids(), vec!["warm".into(), "cold".into()] as Vec<std::sync::Arc<str>>);
    s.set_pause_state(crate::PauseState::Unpaused);
    assert_eq!(admissions(&mut s), vec!["cold", "warm"]);
}

#[test]
fn slo_admits_by_deadline_then_arrival_and_requests_without_a_target_last() {
    for (default, want) in [
        (None, vec!["b", "d", "a", "none"]),
        (Some(2.5), vec!["none", "b", "d", "a"]), // none: 0.2 + 2.5
    ] {
        let config = SchedulerConfig { default_ttft_slo_s: default, ..order_config(Policy::Slo) };
        let mut s = Scheduler::new(config).unwrap();
        add(&mut s, "busy", &prompt(1, 4), params_at(2, 0.0));
        let out = s.schedule().unwrap();
        feed(&mut s, &out, |_| vec![7]);
        let slo = |t: f64, slo: Option<f64>| with(params_at(1, t), |p| p.ttft_slo_s = slo);
        add(&mut s, "a", &prompt(10, 4), slo(0.0, Some(10.0)));
        add(&mut s, "none", &prompt(20, 4), slo(0.2, None));
        add(&mut s, "b", &prompt(30, 4), slo(1.0, Some(2.0)));
        add(&mut s, "d", &prompt(40, 4), slo(2.0, Some(1.0))); // the same deadline as b, a later arrival
        assert_eq!(admissions(&mut s), want);
    }
}

#[test]
fn order_key_is_a_tier_before_every_policys_order() {
    for policy in [Policy::Fcfs, Policy::Priority, Policy::Fair, Policy::Sjf, Policy::Slo] {
        let mut s = Scheduler::new(order_config(policy)).unwrap();
        add(&mut s, "busy", &prompt(1, 4), params_at(2, 0.0));
        let out = s.schedule().unwrap();
        feed(&mut s, &out, |_| vec![7]);
        for (k, tier) in [Some(1), None, Some(-1), Some(0), Some(1), Some(-1)].into_iter().enumerate() {
            let p = with(params_at(1, k as f64), |p| p.order_key = tier);
            add(&mut s, &format!("r{k}"), &prompt(10 * k as i64 + 10, 4), p);
        }
        assert_eq!(admissions(&mut s), vec!["r2", "r5", "r1", "r3", "r0", "r4"], "{policy:?}");
    }
}

/// sjf, one slot: a 40-token request waits while a 4-token one arrives before every step.
fn sjf_long_wait(max_wait_steps: Option<u32>) -> Option<u64> {
    let mut s = Scheduler::new(SchedulerConfig { max_wait_steps, ..order_config(Policy::Sjf) }).unwrap();
    add(&mut s, "long", &prompt(100, 40), params_at(1, 0.0));
    for step in 0..60u64 {
        add(
            &mut s,
            &format!("short{step}"),
            &prompt(step as i64 * 8 % 60, 4),
            params_at(1, 1.0 + step as f64),
        );
        let out = s.schedule().unwrap();
        if ids(&s, &out).iter().any(|x| x == "long") {
            return Some(step);
        }
        feed(&mut s, &out, |_| vec![7]);
    }
    None
}

#[test]
fn max_wait_steps_admits_a_starving_request_once_it_has_waited_that_long() {
    assert_eq!(sjf_long_wait(None), None);
    for n in [1, 3, 10] {
        assert_eq!(sjf_long_wait(Some(n)), Some(u64::from(n)));
    }
}

#[test]
fn a_session_promotion_stops_behind_a_preempted_request() {
    let config = SchedulerConfig {
        cache_aware_admission_window: 8,
        cache_aware_admission_threshold: 1.0, // warm-before-cold off: only the promotion moves
        max_num_seqs: 2,
        ..order_config(Policy::Fcfs)
    };
    let mut s = Scheduler::new(config).unwrap();
    let turn1 = prompt(200, 16);
    let session = |t: f64| with(params_at(1, t), |p| p.session_id = Some("s".into()));
    add(&mut s, "turn1", &turn1, session(0.0));
    add(&mut s, "victim", &prompt(400, 8), params_at(8, 0.5));
    let out = s.schedule().unwrap();
    feed(&mut s, &out, |_| vec![7]); // turn1 finishes: session "s" was active at step 1
    s.set_pause_state(crate::PauseState::PausedNew);
    add(&mut s, "c1", &prompt(500, 8), params_at(1, 1.0));
    add(&mut s, "c2", &prompt(600, 8), params_at(1, 2.0));
    let turn2: Vec<i64> = turn1.iter().copied().chain([7, 7, 9, 9]).collect();
    add(&mut s, "turn2", &turn2, session(3.0));
    let slot = s.slot_of("victim").unwrap();
    s.running.retain(|&x| x != slot);
    s.preempt(slot, false).unwrap(); // waiting: [victim (preempted), c1, c2, turn2]
    s.check_invariants().unwrap();
    let plan = s.begin_admission();
    assert!(plan.is_some());
    let order: Vec<String> = s
        .waiting
        .handles_in_order(&s.tenants)
        .iter()
        .map(|&h| s.request_id(h).unwrap().to_string())
        .collect();
    assert_eq!(order, vec!["victim", "turn2", "c1", "c2"]);
    s.end_admission(plan, 0);
    assert_eq!(s.waiting_req_ids(), ["victim", "c1", "c2", "turn2"].map(std::sync::Arc::from).to_vec());
    s.set_pause_state(crate::PauseState::Unpaused);
    assert_eq!(admissions(&mut s), vec!["victim", "turn2", "c1", "c2"]);
}

// ---- victim selection (`preemption_victim`, `victim.rs`) -------------------------------------------------

fn victim_config(rule: PreemptionVictim, num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        preemption_victim: rule,
        prefix_hash_seed: Some(b"v".to_vec()),
        ..Default::default()
    }
}

/// Steps (token 7 for every sampling entry) until one preempts; that step's output, not applied, and its
/// victims.
fn until_preemption(s: &mut Scheduler) -> (SchedulerOutput, Vec<String>) {
    for _ in 0..40 {
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        if !out.preempted.is_empty() {
            let victims =
                out.preempted.iter().filter_map(|&h| s.request_id(h)).map(|x| x.to_string()).collect();
            return (out, victims);
        }
        feed(s, &out, |_| vec![7]);
    }
    panic!("no preemption");
}

fn drain(s: &mut Scheduler, pending: &SchedulerOutput) {
    feed(s, pending, |_| vec![7]);
    for _ in 0..400 {
        if !s.has_unfinished_requests() {
            return;
        }
        step_ids(s, 7);
    }
    panic!("the requests did not finish");
}

/// 10 usable blocks of 4 tokens; a (13-token prompt), b (5) and c (7), 24 tokens each at most. In step 4 a takes
/// the last free block (its 5th) and b needs its 3rd. Before it a, b, c computed 16, 8, 10 tokens.
fn three_requests(rule: PreemptionVictim) -> (Vec<String>, Vec<String>, u64) {
    let mut s = Scheduler::new(victim_config(rule, 11)).unwrap();
    for (k, (id, n)) in [("a", 13), ("b", 5), ("c", 7)].into_iter().enumerate() {
        add(&mut s, id, &prompt(100 * k as i64, n), params_at(24, k as f64));
    }
    let (out, victims) = until_preemption(&mut s);
    assert_eq!(out.step_id, 4);
    let scheduled = ids(&s, &out);
    let tokens = out.total_num_scheduled_tokens;
    drain(&mut s, &out);
    assert_eq!(s.num_free_blocks(), 10);
    (victims, scheduled, tokens)
}

#[test]
fn each_rule_takes_its_own_victim() {
    let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // default: the tail.
    assert_eq!(three_requests(PreemptionVictim::Default), (v(&["c"]), v(&["a", "b"]), 2));
    // lcf: b computed the fewest; it preempts itself and c, after it, still runs.
    assert_eq!(three_requests(PreemptionVictim::Lcf), (v(&["b"]), v(&["a", "c"]), 2));
    // cost: a frees 5 blocks for 17 tokens (its block of this step counts), b 2/9, c 3/11: a, scheduled earlier
    // in the step, is taken back out of it with its token, and b and c fit.
    assert_eq!(three_requests(PreemptionVictim::Cost), (v(&["a"]), v(&["b", "c"]), 2));
}

#[test]
fn lcf_counts_the_tokens_before_the_step() {
    // a runs one token behind b; in step 4 b needs a block and none is free. Before the step a has 11 tokens,
    // b 12: a (whose token of this step does not count) is the victim, not b (12 and 12 would take the later).
    let mut s = Scheduler::new(victim_config(PreemptionVictim::Lcf, 7)).unwrap();
    add(&mut s, "a", &prompt(0, 8), params_at(10, 0.0));
    add(&mut s, "b", &prompt(100, 9), params_at(10, 1.0));
    let (out, victims) = until_preemption(&mut s);
    assert_eq!((victims, ids(&s, &out)), (vec!["a".to_string()], vec!["b".to_string()]));
    drain(&mut s, &out);
}

/// The victim a rule names, computed from the requests' public state: the policy's lowest level, then the rule;
/// a block counts for `cost` when no other live request's table holds it.
fn brute_force_victim(s: &Scheduler) -> Option<String> {
    let running: Vec<&Request> = s.running_req_ids().iter().map(|id| s.get_request(id).unwrap()).collect();
    if running.is_empty() {
        return None;
    }
    let counters: Vec<f64> = s.tenant_stats().map(|t| t.counter).collect();
    let cfg = s.config();
    let level: Vec<usize> = match cfg.policy {
        Policy::Priority => {
            let top = running.iter().map(|r| r.effective_priority).max()?;
            (0..running.len()).filter(|&j| running[j].effective_priority == top).collect()
        }
        Policy::Fair => {
            let c = |j: usize| counters[running[j].tenant as usize];
            let top = (0..running.len()).map(c).fold(f64::NEG_INFINITY, f64::max);
            (0..running.len()).filter(|&j| c(j) == top).collect()
        }
        _ => (0..running.len()).collect(),
    };
    let mut holders: HashMap<u32, u32> = HashMap::new();
    for id in live_ids(s) {
        for &b in &s.get_request(&id).unwrap().blocks {
            *holders.entry(b).or_default() += 1;
        }
    }
    // cost as (numerator, denominator); a >= b by cross-multiplication.
    let score = |r: &Request| {
        let own = r.blocks.iter().filter(|b| holders[b] == 1).count() as u128;
        let m = u128::from(r.max_tokens.max(1));
        let left = m - u128::from(r.num_output_tokens()).min(m);
        (own * left, u128::from(r.num_tokens().max(1)) * m)
    };
    let j = match cfg.preemption_victim {
        PreemptionVictim::Lcf => {
            let fewest = level.iter().map(|&j| s.get_num_computed_tokens(&running[j].id).unwrap()).min()?;
            *level.iter().rev().find(|&&j| s.get_num_computed_tokens(&running[j].id).unwrap() == fewest)?
        }
        PreemptionVictim::Cost => {
            let mut best = level[0];
            for &j in &level[1..] {
                let ((a, ad), (b, bd)) = (score(running[j]), score(running[best]));
                if a * bd >= b * ad {
                    best = j;
                }
            }
            best
        }
        PreemptionVictim::Default if cfg.policy == Policy::Priority => {
            let key = |j: usize| (running[j].effective_priority, running[j].arrival_time);
            let mut best = level[0];
            for &j in &level[1..] {
                if key(j).0 > key(best).0 || (key(j).0 == key(best).0 && key(j).1 > key(best).1) {
                    best = j;
                }
            }
            best
        }
        PreemptionVictim::Default => *level.last()?,
    };
    Some(running[j].id.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, .. ProptestConfig::default() })]

    /// Random arrivals (shared prefixes, priorities, tenants) and steps in a tight pool, under every policy, rule
    /// and preemption mode: before every step the victim the scheduler would take is the one computed from the
    /// requests' public state; every invariant holds after each operation and everything drains with every
    /// block (and CPU block) back.
    #[test]
    fn the_victim_is_the_rule_s_choice_and_nothing_leaks(
        policy in prop_oneof![Just(Policy::Fcfs), Just(Policy::Priority), Just(Policy::Fair)],
        rule in prop_oneof![Just(PreemptionVictim::Default), Just(PreemptionVictim::Lcf), Just(PreemptionVictim::Cost)],
        mode in prop_oneof![Just(PreemptionMode::Recompute), Just(PreemptionMode::Swap), Just(PreemptionMode::Auto)],
        aging in prop_oneof![Just(0u32), Just(2)],
        ops in prop::collection::vec((0u8..5, 0usize..3, 0usize..13, 1i64..9, 1u32..16), 1..120),
    ) {
        let config = SchedulerConfig {
            num_blocks: 14,
            max_num_seqs: 8,
            max_num_batched_tokens: 24,
            max_model_len: 48,
            policy,
            priority_aging_steps: if policy == Policy::Priority { aging } else { 0 },
            preemption_mode: mode,
            num_cpu_blocks: if mode == PreemptionMode::Recompute { 0 } else { 8 },
            swap_cost_per_block: 0.5,
            ..victim_config(rule, 14)
        };
        let mut s = Scheduler::new(config).unwrap();
        for (k, (op, family, shared, tail, max_tokens)) in ops.into_iter().enumerate() {
            if op < 2 {
                let mut p: Vec<i64> = prompt(1000 * family as i64, shared);
                p.extend(prompt(100_000 + 100 * k as i64, tail as usize));
                let params = RequestParams {
                    priority: (k % 3) as i64,
                    tenant: Some(format!("t{}", k % 3)),
                    ..params_at(max_tokens, k as f64)
                };
                add(&mut s, &format!("r{k}"), &p, params);
                continue;
            }
            prop_assert_eq!(s.next_victim().unwrap().map(|x| x.to_string()), brute_force_victim(&s));
            step_ids(&mut s, 7);
        }
        for _ in 0..400 {
            if !s.has_unfinished_requests() {
                break;
            }
            prop_assert_eq!(s.next_victim().unwrap().map(|x| x.to_string()), brute_force_victim(&s));
            step_ids(&mut s, 7);
        }
        prop_assert!(!s.has_unfinished_requests());
        prop_assert_eq!(s.num_free_blocks(), 13);
        prop_assert_eq!(s.num_free_cpu_blocks(), s.config().num_cpu_blocks as usize);
    }
}
