//! The router against a brute-force model: a set of block keys per replica and a list of in-flight requests,
//! under random streams of events (out of order, duplicated, cleared), routing, finishing and replica loss.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use crate::*;

#[derive(Clone, Debug)]
enum Op {
    Add(usize),
    Remove(usize),
    Healthy(usize, bool),
    Stored(usize, Vec<u64>),
    Removed(usize, Vec<u64>),
    Cleared(usize),
    Route(Vec<u64>, Option<usize>),
    Finish(usize),
    PrefillDone(usize),
    Load(usize, u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let r = 0usize..5;
    // Keys from a small pool: stores and removes collide, children arrive without parents.
    let keys = prop::collection::vec(0u64..16, 0..5);
    prop_oneof![
        2 => r.clone().prop_map(Op::Add),
        1 => r.clone().prop_map(Op::Remove),
        1 => (r.clone(), any::<bool>()).prop_map(|(r, h)| Op::Healthy(r, h)),
        4 => (r.clone(), keys.clone()).prop_map(|(r, k)| Op::Stored(r, k)),
        2 => (r.clone(), keys.clone()).prop_map(|(r, k)| Op::Removed(r, k)),
        1 => r.clone().prop_map(Op::Cleared),
        4 => (keys, prop::option::of(0usize..4)).prop_map(|(k, s)| Op::Route(k, s)),
        2 => (0usize..40).prop_map(Op::Finish),
        1 => (0usize..40).prop_map(Op::PrefillDone),
        1 => (r, 0u64..100, 0u64..100).prop_map(|(r, w, n)| Op::Load(r, w, n)),
    ]
}

fn config(policy: PolicyKind, sticky: bool) -> RouterConfig {
    let st = StepTimeCoefficients {
        step_s: 0.01,
        prefill_token_s: 1e-4,
        decode_req_s: 1e-4,
        ..Default::default()
    };
    let mut c = RouterConfig::new(policy, st);
    c.block_size = 4;
    c.sticky_sessions = sticky;
    c.params.balance_abs_threshold = 2;
    c
}

#[derive(Default)]
struct Model {
    replicas: BTreeMap<String, (bool, BTreeSet<u64>)>,
    in_flight: Vec<(String, String)>, // (request, replica), in routing order
}

fn name(r: usize) -> String {
    format!("r{r}")
}

fn longest_prefix(set: &BTreeSet<u64>, keys: &[u64]) -> usize {
    keys.iter().take_while(|k| set.contains(k)).count()
}

fn run(policy: PolicyKind, sticky: bool, ops: &[Op]) -> std::result::Result<(), TestCaseError> {
    let mut router = Router::new(config(policy, sticky)).unwrap();
    let mut model = Model::default();
    let mut next_req = 0usize;
    for op in ops {
        match op {
            Op::Add(r) => {
                let got = router.add_replica(&name(*r));
                let fresh = !model.replicas.contains_key(&name(*r));
                prop_assert_eq!(got.is_ok(), fresh);
                if fresh {
                    model.replicas.insert(name(*r), (true, BTreeSet::new()));
                }
            }
            Op::Remove(r) => {
                let got = router.remove_replica(&name(*r));
                if model.replicas.remove(&name(*r)).is_some() {
                    let want: Vec<String> = model
                        .in_flight
                        .iter()
                        .filter(|(_, rep)| *rep == name(*r))
                        .map(|(id, _)| id.clone())
                        .collect();
                    prop_assert_eq!(got.unwrap(), want);
                    model.in_flight.retain(|(_, rep)| *rep != name(*r));
                } else {
                    prop_assert_eq!(got, Err(RouterError::UnknownReplica(name(*r))));
                }
            }
            Op::Healthy(r, h) => {
                let got = router.set_healthy(&name(*r), *h);
                match model.replicas.get_mut(&name(*r)) {
                    Some(rep) => {
                        prop_assert!(got.is_ok());
                        rep.0 = *h;
                    }
                    None => prop_assert!(got.is_err()),
                }
            }
            Op::Stored(r, k) | Op::Removed(r, k) => {
                let ev = if matches!(op, Op::Stored(..)) {
                    KvEvent::Stored {
                        block_hashes: k,
                        parent_block_hash: k.first().copied(),
                        token_ids: &[],
                        block_size: 4,
                    }
                } else {
                    KvEvent::Removed { block_hashes: k }
                };
                // A duplicate of the same event in the same batch changes nothing.
                let got = router.apply_events(&name(*r), &[ev, ev]);
                match model.replicas.get_mut(&name(*r)) {
                    Some((_, set)) => {
                        prop_assert!(got.is_ok());
                        if matches!(op, Op::Stored(..)) {
                            set.extend(k);
                        } else {
                            k.iter().for_each(|x| {
                                set.remove(x);
                            });
                        }
                    }
                    None => prop_assert!(got.is_err()),
                }
            }
            Op::Cleared(r) => {
                let got = router.apply_events(&name(*r), &[KvEvent::AllCleared]);
                match model.replicas.get_mut(&name(*r)) {
                    Some((_, set)) => {
                        prop_assert!(got.is_ok());
                        set.clear();
                    }
                    None => prop_assert!(got.is_err()),
                }
            }
            Op::Route(k, session) => {
                let id = format!("q{next_req}");
                next_req += 1;
                let session = session.map(|s| format!("s{s}"));
                let prompt = Prompt::BlockHashes { block_hashes: k, num_tokens: Some(k.len() * 4 + 1) };
                let before = router.clone();
                let ranking = router.rank(&prompt, session.as_deref(), None);
                let got = router.route(&id, &prompt, session.as_deref(), None);
                if model.replicas.values().any(|(h, _)| *h) {
                    let d = got.unwrap();
                    let ranking = ranking.unwrap();
                    prop_assert_eq!(&ranking.decision, &d, "rank and route agree on the same state");
                    let chosen = router.replica_name(d.slot).to_owned();
                    let (healthy, set) = &model.replicas[&chosen];
                    prop_assert!(*healthy);
                    prop_assert_eq!(d.num_overlap_blocks, longest_prefix(set, k));
                    let healthy_names: BTreeSet<&str> =
                        model.replicas.iter().filter(|(_, (h, _))| *h).map(|(n, _)| n.as_str()).collect();
                    let ranked: BTreeSet<&str> =
                        ranking.slots.iter().map(|s| before.replica_name(*s)).collect();
                    prop_assert_eq!(ranked, healthy_names, "a ranking holds every healthy replica once");
                    model.in_flight.push((id, chosen));
                } else {
                    prop_assert!(matches!(got, Err(RouterError::NoReplica(_))));
                }
            }
            Op::Finish(i) | Op::PrefillDone(i) => {
                let id = format!("q{i}");
                let got =
                    if matches!(op, Op::Finish(_)) { router.finish(&id) } else { router.prefill_done(&id) };
                let pos = model.in_flight.iter().position(|(r, _)| *r == id);
                prop_assert_eq!(got.is_ok(), pos.is_some());
                if let (Some(p), Op::Finish(_)) = (pos, op) {
                    model.in_flight.remove(p);
                }
            }
            Op::Load(r, w, n) => {
                let report =
                    LoadReport { num_waiting: *w, num_running: *n, kv_usage: 0.5, ..Default::default() };
                prop_assert_eq!(
                    router.update_load(&name(*r), report).is_ok(),
                    model.replicas.contains_key(&name(*r))
                );
            }
        }
        if let Err(e) = router.check_invariants() {
            return Err(TestCaseError::fail(format!("{e} after {op:?}")));
        }
        prop_assert_eq!(router.num_in_flight(), model.in_flight.len());
        for (n, (_, set)) in &model.replicas {
            prop_assert_eq!(router.num_cached_blocks(n).unwrap(), set.len());
            for k in 0..16u64 {
                prop_assert_eq!(router.is_cached(n, k).unwrap(), set.contains(&k));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_router_matches_the_model(policy in 0usize..5, sticky in any::<bool>(),
                                    ops in prop::collection::vec(op(), 0..80)) {
        let policy = PolicyKind::parse(PolicyKind::NAMES[policy]).unwrap();
        run(policy, sticky, &ops)?;
    }
}

#[test]
fn a_lost_replica_hands_back_its_requests_and_its_blocks_go() {
    let mut r = Router::new(config(PolicyKind::CacheAware, false)).unwrap();
    r.add_replica("a").unwrap();
    r.add_replica("b").unwrap();
    let stored =
        KvEvent::Stored { block_hashes: &[1, 2, 3], parent_block_hash: None, token_ids: &[], block_size: 4 };
    r.apply_events("a", &[stored]).unwrap();
    let p = Prompt::BlockHashes { block_hashes: &[1, 2, 3], num_tokens: None };
    for i in 0..3 {
        let d = r.route(&format!("x{i}"), &p, None, None).unwrap();
        assert_eq!(r.replica_name(d.slot), "a");
    }
    r.finish("x1").unwrap();
    assert_eq!(r.remove_replica("a").unwrap(), vec!["x0".to_string(), "x2".to_string()]);
    assert_eq!(r.finish("x0"), Err(RouterError::UnknownRequest("x0".into())));
    let d = r.route("x0", &p, None, None).unwrap();
    assert_eq!((r.replica_name(d.slot), d.num_overlap_blocks), ("b", 0));
    // The slot is reused by the next replica, with an empty cache.
    r.add_replica("c").unwrap();
    assert_eq!((r.slot("c").unwrap(), r.num_cached_blocks("c").unwrap()), (0, 0));
    r.check_invariants().unwrap();
}

#[test]
fn sticky_sessions_hold_until_the_balance_rule_says_overloaded() {
    let mut r = Router::new(config(PolicyKind::RoundRobin, true)).unwrap();
    r.add_replica("a").unwrap();
    r.add_replica("b").unwrap();
    let p = Prompt::BlockHashes { block_hashes: &[7], num_tokens: None };
    let first = r.route("s0", &p, Some("chat"), None).unwrap();
    let home = r.replica_name(first.slot).to_owned();
    // Round robin alone would alternate; the `session_id` stays while the load gap is within 2 requests (abs
    // threshold 2 in this config).
    for i in 1..3 {
        let d = r.route(&format!("s{i}"), &p, Some("chat"), None).unwrap();
        assert_eq!((r.replica_name(d.slot), d.reason), (home.as_str(), Reason::Sticky));
    }
    // Now 3 vs 0: 3 - 0 > 2 and 3 > 1.5 * 0: overloaded, so the policy decides and the `session_id` moves.
    let d = r.route("s3", &p, Some("chat"), None).unwrap();
    assert_ne!(r.replica_name(d.slot), home);
    assert_eq!(d.reason, Reason::RoundRobin);
    let d = r.route("s4", &p, Some("chat"), None).unwrap();
    assert_eq!(d.reason, Reason::Sticky);
    assert_ne!(r.replica_name(d.slot), home);
}

#[test]
fn token_prompts_find_blocks_stored_under_the_core_hashes() {
    use kvsched_core::hashing::{BlockHasher, ExtraKeys};
    let mut c = config(PolicyKind::KvOverlap, false);
    c.prefix_hash_seed = Some(b"s:fleet".to_vec());
    let mut r = Router::new(c).unwrap();
    r.add_replica("a").unwrap();
    let core = BlockHasher::new(kvsched_core::HashAlgo::Xxh3_128, Some(b"s:fleet")).unwrap();
    let tokens: Vec<u32> = (100..110).collect();
    let h0 = core.hash_block(None, &tokens[..4], &ExtraKeys::default());
    // The replica publishes the 16 bytes `get_block_hashes` shows under xxh3-128.
    let key = key_of_bytes(&h0.0[..16]);
    let stored = KvEvent::Stored {
        block_hashes: &[key],
        parent_block_hash: None,
        token_ids: &tokens[..4],
        block_size: 4,
    };
    r.apply_events("a", &[stored]).unwrap();
    let p = Prompt::Tokens { token_ids: &tokens, lora_name: None, cache_salt: None };
    assert_eq!(r.overlaps(&p).unwrap(), vec![(0, 1)]);
    let salted = Prompt::Tokens { token_ids: &tokens, lora_name: None, cache_salt: Some("other") };
    assert_eq!(r.overlaps(&salted).unwrap(), vec![(0, 0)]);
}

#[test]
fn bad_input_changes_nothing() {
    let mut r = Router::new(config(PolicyKind::LeastLoaded, false)).unwrap();
    assert!(matches!(
        r.route("x", &Prompt::BlockHashes { block_hashes: &[1], num_tokens: None }, None, None),
        Err(RouterError::NoReplica(_))
    ));
    r.add_replica("a").unwrap();
    assert!(matches!(r.add_replica("a"), Err(RouterError::DuplicateReplica(_))));
    let good = KvEvent::Stored { block_hashes: &[1], parent_block_hash: None, token_ids: &[], block_size: 4 };
    let bad = KvEvent::Stored { block_hashes: &[2], parent_block_hash: None, token_ids: &[], block_size: 8 };
    assert!(r.apply_events("a", &[good, bad]).is_err());
    assert_eq!(r.num_cached_blocks("a").unwrap(), 0, "a batch with a bad event applies none");
    let p = Prompt::BlockHashes { block_hashes: &[1], num_tokens: None };
    r.route("x", &p, None, None).unwrap();
    assert_eq!(r.route("x", &p, None, None), Err(RouterError::DuplicateRequest("x".into())));
    assert!(matches!(r.route("y", &p, None, Some(&["zz"])), Err(RouterError::UnknownReplica(_))));
    r.set_healthy("a", false).unwrap();
    assert!(matches!(r.route("y", &p, None, Some(&["a"])), Err(RouterError::NoReplica(_))));
    assert!(r.update_load("a", LoadReport { kv_usage: 2.0, ..Default::default() }).is_err());
    assert_eq!(r.num_in_flight(), 1);
    let mut cfg = config(PolicyKind::LeastLoaded, false);
    cfg.params.cache_threshold = 1.5;
    assert!(matches!(Router::new(cfg), Err(RouterError::InvalidConfig(_))));
    r.check_invariants().unwrap();
}

#[test]
fn at_most_max_replicas() {
    let mut r = Router::new(config(PolicyKind::RoundRobin, false)).unwrap();
    for i in 0..MAX_REPLICAS {
        r.add_replica(&format!("r{i}")).unwrap();
    }
    assert!(matches!(r.add_replica("one-more"), Err(RouterError::InvalidArgument(_))));
    let p = Prompt::BlockHashes { block_hashes: &[1], num_tokens: None };
    let d = r.route("x", &p, None, None).unwrap();
    assert_eq!(d.slot, 0);
    assert_eq!(r.route("y", &p, None, None).unwrap().slot, 1);
}
