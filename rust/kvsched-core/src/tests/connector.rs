//! KV connector behaviour in the core: asynchronous loads, load failures, delayed frees, aborts mid-transfer.

use std::sync::{Arc, Mutex};

use super::helpers::{apply, ids, params, prompt, schedule, step_ids};
use crate::{
    KvConnector, KvLoadFailurePolicy, KvTransferReport, Request, RequestParams, RequestStatus, Scheduler,
    SchedulerConfig,
};

/// Answers every admission with `ext` tokens (async or not), delays the free of ids listed in `send`, and logs.
#[derive(Default)]
struct Fake {
    ext: u32,
    load_async: bool,
    send: Vec<String>,
    /// Only this request gets the `ext` tokens (every request when `None`).
    only: Option<String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl KvConnector for Fake {
    fn get_num_new_matched_tokens(&mut self, req: &Request, n: u32) -> Option<(u32, bool)> {
        self.log.lock().unwrap().push(format!("match {} {n}", req.id));
        if self.only.as_ref().is_some_and(|o| **o != *req.id) {
            return Some((0, false));
        }
        Some((self.ext, self.load_async))
    }
    fn update_state_after_alloc(&mut self, req: &Request, ext: u32) {
        self.log.lock().unwrap().push(format!("alloc {} {} {ext}", req.id, req.blocks.len()));
    }
    fn load_deferred(&mut self, req: &Request, ext: u32) {
        self.log.lock().unwrap().push(format!("deferred {} {} {ext}", req.id, req.blocks.len()));
    }
    fn request_finished(&mut self, req: &Request, blocks: &[u32]) -> bool {
        self.log.lock().unwrap().push(format!("finished {} {}", req.id, blocks.len()));
        self.send.iter().any(|s| **s == *req.id)
    }
}

fn sched(fake: Fake, policy: KvLoadFailurePolicy) -> Scheduler {
    let cfg = SchedulerConfig {
        block_size: 4,
        num_blocks: 32,
        max_model_len: 64,
        prefix_hash_seed: Some(b"t".to_vec()),
        kv_load_failure_policy: policy,
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.set_kv_connector(Some(Box::new(fake))).unwrap();
    s
}

fn report<'a>(recv: &'a [&'a str], send: &'a [&'a str]) -> KvTransferReport<'a, &'a str> {
    KvTransferReport {
        finished_recving: recv,
        finished_sending: send,
        failed_recving: &[],
        invalid_block_ids: &[],
    }
}

/// vLLM: an async load allocates the blocks, parks the request in WAITING_FOR_REMOTE_KVS, and it runs only after
/// `finished_recving`; a fully loaded prompt recomputes its last token.
#[test]
fn async_load_parks_until_the_load_is_reported_finished() {
    let mut s =
        sched(Fake { ext: 100, load_async: true, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 10), params(2)).unwrap();
    assert!(step_ids(&mut s, 1).is_empty());
    let r = s.get_request("a").unwrap();
    assert_eq!(
        (r.status, s.get_num_computed_tokens("a").unwrap(), r.blocks.len()),
        (RequestStatus::WaitingForRemoteKvs, 10, 3)
    );
    assert!(step_ids(&mut s, 1).is_empty(), "still loading");
    s.update_kv_transfers(report(&["a"], &[])).unwrap();
    s.check_invariants().unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![1]);
    assert_eq!(out.num_computed_tokens, vec![9]);
    assert_eq!(s.stats().connector_prefix_cache_hits, 10);
}

/// vLLM `kv_load_failure_policy="recompute"`: computed tokens are cut at the first invalid block, only the valid
/// prefix enters the prefix cache, the rest is recomputed.
#[test]
fn invalid_blocks_cut_the_load_back_to_the_valid_prefix() {
    let mut s =
        sched(Fake { ext: 12, load_async: true, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 14), params(1)).unwrap();
    step_ids(&mut s, 1);
    let bad = i64::from(s.get_request("a").unwrap().blocks[1]);
    let rep = KvTransferReport {
        finished_recving: &["a"],
        finished_sending: &[],
        failed_recving: &[],
        invalid_block_ids: &[bad],
    };
    s.update_kv_transfers(rep).unwrap();
    s.check_invariants().unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.num_computed_tokens[0], out.num_scheduled_tokens[0]), (4, 10));
    assert_eq!(s.get_request("a").unwrap().num_cached_blocks, 3, "block 0 valid, then the recomputed ones");
}

/// vLLM `kv_load_failure_policy="fail"`: the request finishes with an error; its blocks wait for the receive.
#[test]
fn failed_load_with_policy_fail_finishes_the_request() {
    let mut s = sched(Fake { ext: 8, load_async: true, ..Default::default() }, KvLoadFailurePolicy::Fail);
    s.add_request("a", &prompt(0, 12), RequestParams::default()).unwrap();
    step_ids(&mut s, 1);
    let free = s.num_free_blocks();
    let rep = KvTransferReport {
        finished_recving: &[],
        finished_sending: &[],
        failed_recving: &["a"],
        invalid_block_ids: &[],
    };
    let failed = s.update_kv_transfers(rep).unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!((s.num_held_kv_requests(), s.num_free_blocks()), (1, free));
    s.update_kv_transfers(report(&["a"], &[])).unwrap();
    assert_eq!((s.num_held_kv_requests(), s.num_free_blocks()), (0, 31));
    s.check_invariants().unwrap();
}

/// vLLM: aborting a request in WAITING_FOR_REMOTE_KVS delays the free until the receive finishes.
#[test]
fn abort_during_a_load_frees_when_the_load_ends() {
    let mut s =
        sched(Fake { ext: 8, load_async: true, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 12), RequestParams::default()).unwrap();
    step_ids(&mut s, 1);
    s.abort_requests(&["a"]).unwrap();
    s.check_invariants().unwrap();
    assert!(s.num_free_blocks() < 31);
    assert!(s.add_request("a", &prompt(0, 3), RequestParams::default()).is_err(), "its id is still in use");
    s.update_kv_transfers(report(&["a"], &[])).unwrap();
    assert_eq!(s.num_free_blocks(), 31);
    s.check_invariants().unwrap();
}

/// vLLM `request_finished` returning delay_free_blocks: the blocks stay until `finished_sending`.
#[test]
fn delayed_free_waits_for_finished_sending() {
    let fake = Fake { ext: 0, send: vec!["a".into()], ..Default::default() };
    let log = fake.log.clone();
    let mut s = sched(fake, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 9), params(1)).unwrap();
    step_ids(&mut s, 1);
    assert!(s.get_request("a").is_err(), "finished");
    assert_eq!((s.num_held_kv_requests(), s.num_free_blocks()), (1, 28));
    assert!(s.update_kv_transfers(report(&[], &["b"])).is_err(), "unknown id refused");
    s.update_kv_transfers(report(&[], &["a"])).unwrap();
    assert_eq!((s.num_held_kv_requests(), s.num_free_blocks()), (0, 31));
    s.check_invariants().unwrap();
    assert_eq!(*log.lock().unwrap(), vec!["match a 0", "alloc a 3 0", "finished a 3"]);
}

/// A synchronous external hit is computed like a prefix hit, leaving at least one token to compute.
#[test]
fn sync_load_leaves_one_token_to_compute() {
    let mut s =
        sched(Fake { ext: 100, load_async: false, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 10), RequestParams::default()).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!((out.num_computed_tokens[0], out.num_scheduled_tokens[0]), (9, 1));
    s.check_invariants().unwrap();
}

/// `defer_async_loads` (with `defer_block_free`, async scheduling): "a"'s prefill is in flight when "imp"'s
/// asynchronous load is admitted, so the connector hears of the load (`update_state_after_alloc`) only once
/// that step is applied; its connector stats are counted then.
fn deferred_load_setup(
    log: &Arc<Mutex<Vec<String>>>,
) -> (Scheduler, super::helpers::Pending, super::helpers::Pending) {
    let fake =
        Fake { ext: 8, load_async: true, only: Some("imp".into()), log: log.clone(), ..Default::default() };
    let cfg = SchedulerConfig {
        block_size: 4,
        num_blocks: 32,
        max_model_len: 64,
        async_scheduling: true,
        defer_block_free: true,
        defer_async_loads: true,
        park_kv_loads: false,
        prefix_hash_seed: Some(b"t".to_vec()),
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.set_kv_connector(Some(Box::new(fake))).unwrap();
    s.add_request("a", &prompt(0, 10), params(4)).unwrap();
    let p0 = schedule(&mut s);
    s.add_request("imp", &prompt(100, 12), params(2)).unwrap();
    let p1 = schedule(&mut s);
    assert_eq!(s.get_request("imp").unwrap().status, RequestStatus::WaitingForRemoteKvs);
    assert_eq!(s.deferred_load_ids(), vec![Arc::<str>::from("imp")]);
    assert!(log.lock().unwrap().iter().any(|l| l == "deferred imp 2 8"), "{:?}", log.lock().unwrap());
    assert!(!log.lock().unwrap().iter().any(|l| l.starts_with("alloc imp")));
    assert_eq!(s.stats().connector_prefix_cache_hits, 0);
    (s, p0, p1)
}

#[test]
fn deferred_load_is_registered_once_the_steps_in_flight_are_applied() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (mut s, p0, p1) = deferred_load_setup(&log);
    apply(&mut s, &p0, |_| vec![1]);
    assert!(log.lock().unwrap().iter().any(|l| l == "alloc imp 2 8"), "its fence is the step in flight");
    apply(&mut s, &p1, |_| vec![1]);
    assert!(s.deferred_load_ids().is_empty());
    assert_eq!(s.stats().connector_prefix_cache_hits, 8);
    s.update_kv_transfers(report(&["imp"], &[])).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn aborted_deferred_load_frees_behind_the_steps_in_flight() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (mut s, p0, p1) = deferred_load_setup(&log);
    let free = s.num_free_blocks();
    s.abort_requests(&["imp"]).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.num_held_kv_requests(), 0, "no load was posted: nothing holds its blocks for a receive");
    assert_eq!(s.deferred_free_block_ids().len(), 2);
    assert_eq!(s.num_free_blocks(), free);
    // Fenced by every step scheduled at the abort (both in flight).
    apply(&mut s, &p0, |_| vec![1]);
    assert_eq!(s.deferred_free_block_ids().len(), 2);
    apply(&mut s, &p1, |_| vec![1]);
    assert!(s.deferred_free_block_ids().is_empty());
    assert_eq!(s.num_free_blocks(), free + 2);
    assert!(
        !log.lock().unwrap().iter().any(|l| l.starts_with("alloc imp")),
        "an aborted load is never registered"
    );
}

fn invalid<'a>(blocks: &'a [i64]) -> KvTransferReport<'a, &'a str> {
    KvTransferReport {
        finished_recving: &[],
        finished_sending: &[],
        failed_recving: &[],
        invalid_block_ids: blocks,
    }
}

/// vLLM's `_handle_invalid_blocks` for a synchronous load (policy "recompute"): reported with the output of the
/// load's step, an invalid block cuts the running request's computed count to that block, its output of the step
/// is dropped, and the next step recomputes from there; its blocks stay cached (they are recomputed in place).
#[test]
fn invalid_blocks_of_a_synchronous_load_roll_the_running_request_back() {
    let mut s =
        sched(Fake { ext: 8, load_async: false, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 10), params(3)).unwrap();
    let p = schedule(&mut s);
    assert_eq!((p.out.num_computed_tokens[0], p.out.num_scheduled_tokens[0]), (8, 2));
    let bad = i64::from(s.get_request("a").unwrap().blocks[1]);
    let cached = s.get_request("a").unwrap().num_cached_blocks;
    s.update_kv_transfers(invalid(&[bad])).unwrap();
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 4, "cut to block 1 (of the 8 loaded tokens)");
    let res = apply(&mut s, &p, |_| vec![7]);
    s.check_invariants().unwrap();
    assert_eq!(res.num_new_tokens, vec![0], "the step's token is dropped");
    assert_eq!(s.get_request("a").unwrap().token_ids.len(), 10);
    assert!(s.block_hash_of(bad as u32).is_some(), "recompute keeps the block cached");
    let p = schedule(&mut s);
    assert_eq!((p.out.num_computed_tokens[0], p.out.num_scheduled_tokens[0]), (4, 6));
    apply(&mut s, &p, |_| vec![7]);
    assert_eq!(s.get_request("a").unwrap().token_ids.len(), 11);
    assert_eq!(s.get_request("a").unwrap().num_cached_blocks, cached.max(2));
    s.check_invariants().unwrap();
}

/// A block invalid for two running requests is recomputed by the first (in running order); the second keeps it
/// as computed and only loses the tokens of the step; a request holding no invalid block is untouched.
#[test]
fn an_invalid_block_shared_by_running_requests_is_recomputed_by_the_first() {
    let mut s = sched(Fake { ext: 0, ..Default::default() }, KvLoadFailurePolicy::Recompute);
    s.add_request("a", &prompt(0, 10), params(5)).unwrap();
    s.add_request("z", &prompt(50, 6), params(5)).unwrap();
    step_ids(&mut s, 1);
    s.add_request("b", &prompt(0, 10), params(5)).unwrap();
    let p = schedule(&mut s);
    let shared = s.get_request("a").unwrap().blocks[0];
    assert_eq!(s.get_request("b").unwrap().blocks[0], shared, "b hits a's cached block");
    let (ca, cb, cz) = (
        s.get_num_computed_tokens("a").unwrap(),
        s.get_num_computed_tokens("b").unwrap(),
        s.get_num_computed_tokens("z").unwrap(),
    );
    s.update_kv_transfers(invalid(&[i64::from(shared)])).unwrap();
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 0, "a claims the block");
    let in_step_b = p.out.num_scheduled_tokens[ids(&s, &p.out).iter().position(|i| i == "b").unwrap()];
    assert_eq!(s.get_num_computed_tokens("b").unwrap(), cb - in_step_b as u32, "b drops its step only");
    assert_eq!(s.get_num_computed_tokens("z").unwrap(), cz);
    let res = apply(&mut s, &p, |_| vec![9]);
    s.check_invariants().unwrap();
    assert!(ca > 0);
    assert_eq!(res.num_new_tokens.iter().filter(|&&n| n > 0).count(), 1, "only z takes its token");
}

/// Policy "fail": the rolled-back running request finishes with an error, its invalid block and the blocks after
/// it leave the prefix cache.
#[test]
fn invalid_blocks_of_a_synchronous_load_fail_the_request_with_policy_fail() {
    let mut s = sched(Fake { ext: 8, load_async: false, ..Default::default() }, KvLoadFailurePolicy::Fail);
    s.add_request("a", &prompt(0, 10), params(3)).unwrap();
    let p = schedule(&mut s);
    let blocks = s.get_request("a").unwrap().blocks.clone();
    assert!(s.block_hash_of(blocks[1]).is_some());
    let failed = s.update_kv_transfers(invalid(&[i64::from(blocks[1])])).unwrap();
    assert_eq!(failed.len(), 1);
    assert!(s.block_hash_of(blocks[0]).is_some(), "the valid prefix stays cached");
    assert!(s.block_hash_of(blocks[1]).is_none());
    let res = apply(&mut s, &p, |_| vec![7]);
    assert_eq!(res.num_new_tokens, vec![0]);
    s.check_invariants().unwrap();
    assert_eq!(s.num_free_blocks(), 31);
}

/// `Fake` naming the groups its asynchronous loads write.
struct Loading {
    fake: Fake,
    loaded: Option<Vec<usize>>,
}

impl KvConnector for Loading {
    fn get_num_new_matched_tokens(&mut self, req: &Request, n: u32) -> Option<(u32, bool)> {
        self.fake.get_num_new_matched_tokens(req, n)
    }
    fn update_state_after_alloc(&mut self, req: &Request, ext: u32) {
        self.fake.update_state_after_alloc(req, ext)
    }
    fn loaded_groups(&mut self, _req: &Request) -> Option<Vec<usize>> {
        self.loaded.clone()
    }
    fn request_finished(&mut self, req: &Request, blocks: &[u32]) -> bool {
        self.fake.request_finished(req, blocks)
    }
}

fn mamba_sched(align: bool, load_async: bool, loaded: Option<Vec<usize>>) -> Scheduler {
    let cfg = SchedulerConfig {
        block_size: 4,
        num_blocks: 40,
        max_model_len: 64,
        prefix_hash_seed: Some(b"t".to_vec()),
        enable_prefix_caching: false,
        kv_cache_groups: vec![Some(crate::MAMBA), None, None],
        kv_connector_groups: true,
        mamba_speculative_blocks: 1,
        mamba_align: align,
        ..Default::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    let fake = Fake { ext: 9, load_async, ..Default::default() };
    s.set_kv_connector(Some(Box::new(Loading { fake, loaded }))).unwrap();
    s
}

/// vLLM pops a load's Mamba state block with every group's external blocks, before any group's other new blocks
/// (mode "align": null blocks before it, at the block of the last loaded token); the blocks an asynchronous load
/// writes stay out of the blocks to zero, a synchronous load's are zeroed.
#[test]
fn a_load_takes_its_mamba_state_block_with_the_external_blocks() {
    // 9 loaded tokens of 12: blocks 1 (Mamba state), 2-4 and 5-7 (the attention groups' external blocks) are
    // popped first, then the speculative state block 8; a synchronous load's 3 computed tokens need no new block.
    for (align, mamba_table) in [(false, vec![1, 8]), (true, vec![0, 0, 1, 8])] {
        for load_async in [false, true] {
            for loaded in [None, Some(vec![2])] {
                let mut s = mamba_sched(align, load_async, loaded.clone());
                s.add_request("a", &prompt(0, 12), params(2)).unwrap();
                let p = schedule(&mut s);
                let tables: Vec<Vec<u32>> =
                    (0..3).map(|g| s.get_group_block_ids("a", g).unwrap().to_vec()).collect();
                assert_eq!(tables, vec![mamba_table.clone(), vec![2, 3, 4], vec![5, 6, 7]], "align {align}");
                let zeroed: Vec<i32> = match (load_async, &loaded) {
                    (false, _) => vec![2, 3, 4, 5, 6, 7],
                    (true, None) => vec![],
                    (true, Some(_)) => vec![2, 3, 4], // only group 2 is loaded
                };
                assert_eq!(p.out.zero_block_ids, zeroed, "align {align} async {load_async} {loaded:?}");
            }
        }
    }
}

/// Full attention and an align-mode Mamba group with prefix caching, for a connector with every group's tables.
fn mamba_caching_cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 40,
        max_model_len: 64,
        enable_prefix_caching: true,
        kv_cache_groups: vec![None, Some(crate::MAMBA)],
        mamba_align: true,
        kv_connector_groups: true,
        prefix_hash_seed: Some(b"t".to_vec()),
        ..Default::default()
    }
}

/// Align-mode Mamba groups with prefix caching and a connector: the states the caching enters are offered once
/// (`take_mamba_boundary_offers`), with the tokens they cover; a request's offers not yet taken are withdrawn
/// when its blocks go back to the pool. Without a connector nothing is recorded.
#[test]
fn cached_mamba_states_are_offered_to_the_connector_once() {
    let cfg = mamba_caching_cfg();
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    s.set_kv_connector(Some(Box::new(Fake::default()))).unwrap();
    s.add_request("a", &prompt(0, 13), params(3)).unwrap();
    assert_eq!(step_ids(&mut s, 1), ["a"]); // 12 tokens: the state at 12 is cached
    let state = s.get_group_block_ids("a", 1).unwrap()[2];
    let offers: Vec<(String, u32, u32, u32)> =
        s.take_mamba_boundary_offers().into_iter().map(|(id, g, b, n)| (id.to_string(), g, b, n)).collect();
    assert_eq!(offers, [("a".to_string(), 1, state, 12)]);
    assert!(s.take_mamba_boundary_offers().is_empty(), "taken once");
    // "b" and "c" cache their states at 8; "b" is aborted before the offers are taken: its offer is withdrawn.
    s.add_request("b", &prompt(100, 9), params(3)).unwrap();
    s.add_request("c", &prompt(200, 9), params(3)).unwrap();
    step_ids(&mut s, 1);
    s.abort_requests(&["b"]).unwrap();
    let offered: Vec<(String, u32)> =
        s.take_mamba_boundary_offers().into_iter().map(|(id, _, _, n)| (id.to_string(), n)).collect();
    assert_eq!(offered, [("c".to_string(), 8)]);
    s.check_invariants().unwrap();
    // Without a connector: none.
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("a", &prompt(0, 13), params(3)).unwrap();
    step_ids(&mut s, 1);
    assert!(s.take_mamba_boundary_offers().is_empty());
}

/// `divergent_local_hits`: a full-attention hit deeper than the Mamba group's is the local hit the connector is
/// asked with; it stands when the connector adds tokens and gives way to the hit both groups agree on (the
/// connector told, `local_hit_replaced`) when it adds none. Without the flag the usual hit is asked about.
#[test]
fn a_diverged_local_hit_stands_only_with_external_tokens() {
    struct Replaced {
        fake: Fake,
    }
    impl KvConnector for Replaced {
        fn get_num_new_matched_tokens(&mut self, req: &Request, n: u32) -> Option<(u32, bool)> {
            self.fake.get_num_new_matched_tokens(req, n)
        }
        fn update_state_after_alloc(&mut self, req: &Request, ext: u32) {
            self.fake.update_state_after_alloc(req, ext)
        }
        fn request_finished(&mut self, req: &Request, blocks: &[u32]) -> bool {
            self.fake.request_finished(req, blocks)
        }
        fn local_hit_replaced(&mut self, req: &Request, n: u32) {
            self.fake.log.lock().unwrap().push(format!("replaced {} {n}", req.id));
        }
    }
    for divergent in [true, false] {
        let cfg = SchedulerConfig { divergent_local_hits: divergent, ..mamba_caching_cfg() };
        let log = Arc::new(Mutex::new(Vec::new()));
        let fake = Fake { ext: 8, only: Some("b".into()), log: log.clone(), ..Default::default() };
        let mut s = Scheduler::new(cfg).unwrap();
        s.set_kv_connector(Some(Box::new(Replaced { fake }))).unwrap();
        // "a" caches 6 full-attention blocks and Mamba states at 20 and 24 tokens only.
        s.add_request("a", &prompt(0, 24), params(1)).unwrap();
        while s.has_unfinished_requests() {
            step_ids(&mut s, 1);
        }
        // "b" and "c" share 3 blocks with "a": a full-attention hit of 12 tokens, none in the Mamba group.
        let mut admitted = Vec::new();
        for (id, tail) in [("b", 90), ("c", 120)] {
            let mut p = prompt(0, 12);
            p.extend(prompt(tail, 10));
            s.add_request(id, &p, params(1)).unwrap();
            let out = schedule(&mut s).out;
            admitted.push(out.num_computed_tokens[0]);
            s.check_invariants().unwrap();
        }
        let log: Vec<String> = log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| !l.contains(" a ") && !l.starts_with("alloc"))
            .cloned()
            .collect();
        if divergent {
            assert_eq!(admitted, [20, 0]);
            assert_eq!(log, ["match b 12", "match c 12", "replaced c 0"]);
        } else {
            // The usual hit: none for "b" (the Mamba group has no state at 12), which loads 8 tokens and caches
            // its state at 12, which "c" then hits.
            assert_eq!(admitted, [8, 12]);
            assert_eq!(log, ["match b 0", "match c 12"]);
        }
    }
}

/// Groups of different block sizes: the connector is told, group by group, the tokens of each block's cache key (0:
/// not cached), and a window of smaller blocks caches only the blocks a hit aligned to the largest block can use
/// (vLLM's reachable-block mask), so its cached blocks need not lead its table.
#[test]
fn the_connector_sees_the_key_of_each_groups_cached_blocks() {
    struct Flags(Arc<Mutex<Vec<Vec<u32>>>>);
    impl KvConnector for Flags {
        fn get_num_new_matched_tokens(&mut self, _req: &Request, _n: u32) -> Option<(u32, bool)> {
            Some((0, false))
        }
        fn update_state_after_alloc(&mut self, _req: &Request, _ext: u32) {
            unreachable!("kv_connector_groups calls the per-group hook")
        }
        fn update_state_after_alloc_groups(
            &mut self,
            _req: &Request,
            tables: &[&[u32]],
            key_tokens: &[Vec<u32>],
            _ext: u32,
        ) {
            assert!(tables.iter().zip(key_tokens).all(|(t, c)| t.len() == c.len()));
            self.0.lock().unwrap().extend(key_tokens.iter().cloned());
        }
        fn request_finished(&mut self, _req: &Request, _blocks: &[u32]) -> bool {
            false
        }
    }
    // A window of 3 tokens in blocks of 4 and full attention in blocks of 12: hits align to 12 tokens.
    let cfg = SchedulerConfig {
        block_size: 4,
        num_blocks: 40,
        max_model_len: 64,
        enable_prefix_caching: true,
        kv_cache_groups: vec![Some(3), None],
        kv_cache_group_block_sizes: vec![4, 12],
        kv_connector_groups: true,
        prefix_hash_seed: Some(b"t".to_vec()),
        ..Default::default()
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut s = Scheduler::new(cfg).unwrap();
    s.set_kv_connector(Some(Box::new(Flags(log.clone())))).unwrap();
    // 14 tokens in one step: 12 are cached; the window keeps block 2 (tokens 8-11) only, the full-attention
    // group its first block.
    s.add_request("a", &prompt(0, 14), params(2)).unwrap();
    assert_eq!(step_ids(&mut s, 1), ["a"]);
    assert_eq!(*log.lock().unwrap(), [vec![0, 0, 12, 0], vec![12, 0]]);
    // The same prompt hits 12 tokens: the window's hit block and the full-attention block are cached, the null
    // blocks before the window are not, nor the new blocks.
    log.lock().unwrap().clear();
    s.add_request("b", &prompt(0, 14), params(2)).unwrap();
    assert_eq!(step_ids(&mut s, 1), ["a", "b"]);
    assert_eq!(*log.lock().unwrap(), [vec![0, 0, 12, 0], vec![12, 0]]);
    s.check_invariants().unwrap();
}

/// vLLM starts an admission's chunk after the loaded tokens too: a load ending inside a block leaves the chunk no
/// prefill checkpoint to export, so the full-sequence check reserves no checkpoint block for it (a chunk from the
/// local hit, token 0, would reserve one).
#[test]
fn a_load_ending_inside_a_block_reserves_no_prefill_checkpoint_block() {
    // A 30-token prompt, 10 tokens loaded: 8 attention blocks and the Mamba state fill the 9 free blocks exactly.
    let cfg = SchedulerConfig {
        num_blocks: 10,
        mamba_prefill_checkpoint_alignment: Some(4),
        ..mamba_caching_cfg()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.set_kv_connector(Some(Box::new(Fake { ext: 10, ..Default::default() }))).unwrap();
    s.add_request("a", &prompt(0, 30), params(2)).unwrap();
    assert_eq!(step_ids(&mut s, 1), ["a"]);
    // The chunk after the load stops at the next block boundary (12 tokens computed).
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 12);
    assert_eq!(s.get_request("a").unwrap().status, RequestStatus::Running);
}
