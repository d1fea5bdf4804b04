//! The encoder-cache connector's hooks in the step loop (`ec_connector.rs`, `encoder_sched.rs`): a load takes
//! cache space but no encoder budget, the connector is asked only about inputs not cached locally that fit,
//! and its deferral gate holds a request out of a step (a waiting one keeps its place).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::helpers::{add, apply, prompt, schedule, step_with};
use crate::{EcConnector, EncoderInput, Request, RequestParams, Scheduler, SchedulerConfig};

fn cfg(budget: u32, cache: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 64,
        max_model_len: 128,
        max_num_batched_tokens: 32,
        max_num_encoder_input_tokens: budget,
        encoder_cache_size: cache,
        prefix_hash_seed: Some(b"ec".to_vec()),
        ..Default::default()
    }
}

fn inp(start: u32, num_tokens: u32, hash: u64) -> EncoderInput {
    EncoderInput { start, num_tokens, hash }
}

fn with_inputs(inputs: Vec<EncoderInput>, arrival_time: f64) -> RequestParams {
    RequestParams { max_tokens: Some(2), arrival_time, encoder_inputs: inputs, ..Default::default() }
}

/// What the fake connector holds and what it was asked.
#[derive(Default)]
struct Shared {
    items: HashSet<u64>,
    /// Requests whose encoder outputs are in transit.
    in_transit: HashSet<String>,
    asked_items: Vec<u64>,
    asked_available: Vec<(String, u32)>,
    allocated: Vec<(String, u32)>,
}

struct FakeEc(Arc<Mutex<Shared>>);

impl EcConnector for FakeEc {
    fn has_cache_item(&mut self, hash: u64) -> bool {
        let mut s = self.0.lock().unwrap();
        s.asked_items.push(hash);
        s.items.contains(&hash)
    }

    fn ensure_cache_available(&mut self, req: &Request, num_computed_tokens: u32) -> bool {
        let mut s = self.0.lock().unwrap();
        s.asked_available.push((req.id.to_string(), num_computed_tokens));
        !s.in_transit.contains(&*req.id)
    }

    fn update_state_after_alloc(&mut self, req: &Request, input: u32) {
        self.0.lock().unwrap().allocated.push((req.id.to_string(), input));
    }
}

fn with_ec(config: SchedulerConfig, items: &[u64]) -> (Scheduler, Arc<Mutex<Shared>>) {
    let shared =
        Arc::new(Mutex::new(Shared { items: items.iter().copied().collect(), ..Default::default() }));
    let mut s = Scheduler::new(config).unwrap();
    s.set_ec_connector(Some(Box::new(FakeEc(shared.clone())))).unwrap();
    (s, shared)
}

/// vLLM 0.33: an input the connector holds is loaded, not computed: it takes cache space but leaves the step's
/// encoder budget to others (here `b`'s input, which would not fit after a computed `a`).
#[test]
fn a_loaded_input_takes_cache_space_but_no_encoder_budget() {
    let (mut s, _) = with_ec(cfg(8, 16), &[1]);
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![inp(0, 8, 1)], 0.0));
    add(&mut s, "b", &prompt(100, 10), with_inputs(vec![inp(0, 8, 2)], 1.0));
    let out = step_with(&mut s, 5).0;
    assert_eq!(out.num_scheduled_tokens, vec![10, 10]);
    assert_eq!((out.scheduled_encoder_loads, out.scheduled_encoder_loads_indptr), (vec![0], vec![0, 1, 1]));
    assert_eq!((out.scheduled_encoder_inputs, out.scheduled_encoder_inputs_indptr), (vec![0], vec![0, 0, 1]));
    let st = s.stats();
    assert_eq!(
        (st.num_encoder_cache_entries, st.num_encoder_inputs_computed, st.encoder_cache_hits),
        (2, 1, 0)
    );
    s.check_invariants().unwrap();
}

/// Without the connector the same two requests need two steps (the budget fits one input): the test above
/// depends on the load.
#[test]
fn without_a_connector_the_budget_serialises_the_inputs() {
    let mut s = Scheduler::new(cfg(8, 16)).unwrap();
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![inp(0, 8, 1)], 0.0));
    add(&mut s, "b", &prompt(100, 10), with_inputs(vec![inp(0, 8, 2)], 1.0));
    let out = step_with(&mut s, 5).0;
    assert_eq!(out.num_scheduled_tokens, vec![10]);
    assert!(out.scheduled_encoder_loads.is_empty() && out.scheduled_encoder_loads_indptr.is_empty());
}

/// The connector is asked only about inputs not in the local cache, and a load still needs cache space: with
/// the cache full the chunk stops before the input, and nothing is asked.
#[test]
fn the_connector_is_asked_only_about_uncached_inputs_that_fit() {
    let (mut s, shared) = with_ec(cfg(8, 8), &[1, 2]);
    add(&mut s, "a", &prompt(0, 12), with_inputs(vec![inp(0, 8, 1)], 0.0));
    add(&mut s, "b", &prompt(100, 12), with_inputs(vec![inp(4, 8, 2)], 1.0));
    add(&mut s, "c", &prompt(200, 12), with_inputs(vec![inp(0, 8, 1)], 2.0));
    let out = step_with(&mut s, 5).0;
    // a loads 1; b's input does not fit the cache (b runs up to it); c finds 1 cached.
    assert_eq!(out.num_scheduled_tokens, vec![12, 4, 12]);
    assert_eq!(out.scheduled_encoder_loads, vec![0]);
    assert_eq!(shared.lock().unwrap().asked_items, vec![1]);
    s.check_invariants().unwrap();
}

/// `ensure_cache_available` false: a waiting request is skipped (the one behind it still runs) and keeps its
/// place; once it answers true the request is admitted. A running request is held out of the step, asked with
/// its computed tokens.
#[test]
fn ensure_cache_available_defers_waiting_and_running_requests() {
    let (mut s, shared) = with_ec(SchedulerConfig { max_num_batched_tokens: 8, ..cfg(8, 16) }, &[]);
    shared.lock().unwrap().in_transit.insert("a".into());
    add(&mut s, "a", &prompt(0, 12), with_inputs(vec![inp(4, 4, 1)], 0.0));
    add(&mut s, "t", &prompt(100, 4), with_inputs(vec![], 1.0));
    let o = schedule(&mut s);
    assert_eq!(o.out.num_scheduled_tokens, vec![4]);
    assert_eq!(shared.lock().unwrap().asked_available, vec![("a".to_string(), 0)]);
    apply(&mut s, &o, |_| vec![5]);
    shared.lock().unwrap().in_transit.clear();
    let o = schedule(&mut s);
    assert_eq!(s.request_id(o.out.handles[1]).map(|x| x.to_string()), Some("a".to_string()));
    assert_eq!(o.out.num_scheduled_tokens, vec![1, 7]);
    apply(&mut s, &o, |_| vec![5]);
    shared.lock().unwrap().in_transit.insert("a".into());
    let o = schedule(&mut s);
    assert!(o.out.handles.is_empty()); // t finished; a is held out
    assert_eq!(shared.lock().unwrap().asked_available.last(), Some(&("a".to_string(), 7)));
    s.check_invariants().unwrap();
}

/// A failed step's loads never arrived: their entries leave the cache, as its computes do.
#[test]
fn a_failed_step_drops_its_loaded_entries() {
    let (mut s, _) = with_ec(cfg(8, 8), &[1]);
    add(&mut s, "a", &prompt(0, 10), with_inputs(vec![inp(0, 4, 1)], 0.0));
    let out = s.schedule().unwrap();
    assert_eq!(out.scheduled_encoder_loads, vec![0]);
    s.fail_step(out.scheduler_id, out.step_id).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.stats().num_encoder_cache_entries, 0);
    assert_eq!(s.schedule().unwrap().free_encoder_hashes, vec![1]);
}
