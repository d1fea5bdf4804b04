//! The cache-hit cap (`hit_cap.rs`): the local prefix hit stops at the cap's blocks, the external hit is
//! what the cap lets through, the hook sees which of the request's blocks are cached, and it is asked only at
//! the lookup of a request with nothing computed.

use std::sync::{Arc, Mutex};

use super::helpers::{params, prompt, schedule, step_with};
use crate::{CacheHitCap, KvConnector, Request, Scheduler, SchedulerConfig};

/// Caps the local hit at `max` tokens and lets an external hit through only when it ends at or before `max`
/// on a block boundary; logs every question with the cached mask it got.
struct Cap {
    max: u32,
    log: Arc<Mutex<Vec<String>>>,
}

fn mask(cached: &[bool]) -> String {
    cached.iter().map(|&c| if c { '1' } else { '0' }).collect()
}

impl CacheHitCap for Cap {
    fn max_cache_hit(&mut self, req: &Request, cached: &[bool]) -> u32 {
        self.log.lock().unwrap().push(format!("max {} {}", req.id, mask(cached)));
        self.max
    }
    fn cap_external_hit(&mut self, req: &Request, cached: &[bool], local: u32, ext: u32) -> u32 {
        self.log.lock().unwrap().push(format!("ext {} {} {local} {ext}", req.id, mask(cached)));
        if (local + ext) % 4 == 0 && local + ext <= self.max {
            ext
        } else {
            0
        }
    }
}

/// Offers `ext` tokens synchronously to every admission.
struct Offer(u32);

impl KvConnector for Offer {
    fn get_num_new_matched_tokens(&mut self, _req: &Request, _n: u32) -> Option<(u32, bool)> {
        Some((self.0, false))
    }
    fn update_state_after_alloc(&mut self, _req: &Request, _ext: u32) {}
    fn request_finished(&mut self, _req: &Request, _blocks: &[u32]) -> bool {
        false
    }
}

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 32,
        max_model_len: 64,
        enable_prefix_caching: true,
        prefix_hash_seed: Some(b"cap".to_vec()),
        ..Default::default()
    }
}

/// Runs `a` (20 tokens: 5 full blocks) to its end so its blocks stay cached, then admits `b` with the same
/// prompt under `cap` (None: no cap) and `offer` external tokens (None: no connector); `b`'s scheduled tokens
/// and the cap's log.
fn second_admission(cap: Option<u32>, offer: Option<u32>, warm: bool) -> (i32, Vec<String>) {
    let mut s = Scheduler::new(cfg()).unwrap();
    if let Some(e) = offer {
        s.set_kv_connector(Some(Box::new(Offer(e)))).unwrap();
    }
    if warm {
        s.add_request("a", &prompt(0, 20), params(1)).unwrap();
        step_with(&mut s, 7);
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    if let Some(max) = cap {
        s.set_cache_hit_cap(Some(Box::new(Cap { max, log: log.clone() })));
    }
    s.add_request("b", &prompt(0, 20), params(1)).unwrap();
    let p = schedule(&mut s);
    s.check_invariants().unwrap();
    let log = log.lock().unwrap().clone();
    (p.out.num_scheduled_tokens[0], log)
}

/// Without a cap the hit is every block but the last token's (16 of 20 tokens); a cap of 9 tokens allows two
/// blocks (8 tokens), a cap of 0 none, and a cap above the prompt changes nothing.
#[test]
fn the_local_hit_stops_at_the_caps_blocks() {
    assert_eq!(second_admission(None, None, true).0, 4);
    assert_eq!(second_admission(Some(100), None, true).0, 4);
    assert_eq!(second_admission(Some(9), None, true).0, 12);
    assert_eq!(second_admission(Some(8), None, true).0, 12);
    assert_eq!(second_admission(Some(7), None, true).0, 16);
    assert_eq!(second_admission(Some(0), None, true).0, 20);
}

/// The hook sees which of the request's full blocks are cached: all five after `a`, none on a cold cache.
#[test]
fn the_hook_sees_the_requests_cached_blocks() {
    assert_eq!(second_admission(Some(9), None, true).1, vec!["max b 11111"]);
    assert_eq!(second_admission(Some(9), None, false).1, vec!["max b 00000"]);
}

/// With a KV connector the external hit is asked of the cap after the connector's answer, with the local hit
/// (already capped); an answer of 0 loads nothing.
#[test]
fn the_external_hit_is_what_the_cap_lets_through() {
    // Cold cache, 8 external tokens: allowed under a cap of 19, dropped under a cap of 4.
    let (n, log) = second_admission(Some(19), Some(8), false);
    assert_eq!((n, log), (12, vec!["max b 00000".to_string(), "ext b 00000 0 8".to_string()]));
    assert_eq!(second_admission(Some(4), Some(8), false).0, 20);
    // Not on a block boundary: dropped by this cap.
    assert_eq!(second_admission(Some(19), Some(7), false).0, 20);
    // Warm cache: 8 local tokens under a cap of 8, then 4 external end at 12 > 8: dropped.
    let (n, log) = second_admission(Some(8), Some(4), true);
    assert_eq!((n, log), (12, vec!["max b 11111".to_string(), "ext b 11111 8 4".to_string()]));
    // No cap: the connector's tokens stand.
    assert_eq!(second_admission(None, Some(8), false).0, 12);
}

/// A cap answer above what the connector offers cannot raise the external hit.
#[test]
fn the_external_cap_never_raises_the_hit() {
    struct Raise;
    impl CacheHitCap for Raise {
        fn max_cache_hit(&mut self, _req: &Request, _cached: &[bool]) -> u32 {
            u32::MAX
        }
        fn cap_external_hit(&mut self, _req: &Request, _cached: &[bool], _local: u32, _ext: u32) -> u32 {
            1000
        }
    }
    let mut s = Scheduler::new(cfg()).unwrap();
    s.set_kv_connector(Some(Box::new(Offer(8)))).unwrap();
    s.set_cache_hit_cap(Some(Box::new(Raise)));
    s.add_request("b", &prompt(0, 20), params(1)).unwrap();
    assert_eq!(schedule(&mut s).out.num_scheduled_tokens, vec![12]);
}

/// The cap is asked only at the lookup of a request with nothing computed: not while it runs, and again when
/// it is admitted after a preemption. Removing it restores the plain hits.
#[test]
fn the_cap_is_asked_only_at_a_lookup() {
    let mut s = Scheduler::new(cfg()).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    s.set_cache_hit_cap(Some(Box::new(Cap { max: 0, log: log.clone() })));
    assert!(s.has_cache_hit_cap());
    s.add_request("a", &prompt(0, 10), params(3)).unwrap();
    for _ in 0..3 {
        step_with(&mut s, 1);
    }
    assert_eq!(*log.lock().unwrap(), vec!["max a 00"]);
    s.set_cache_hit_cap(None);
    assert!(!s.has_cache_hit_cap());
    s.add_request("b", &prompt(0, 10), params(1)).unwrap();
    assert_eq!(schedule(&mut s).out.num_scheduled_tokens, vec![2]);
}
