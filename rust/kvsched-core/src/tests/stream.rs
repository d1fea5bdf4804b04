//! Streaming-input sessions (`stream.rs`): a part's stop keeps the streaming-input session with its blocks, the next part resumes
//! it with only the new tokens to compute, and the errors change nothing.

use super::helpers::{add, apply, one_token_each, params, prompt, schedule};
use crate::request::InputPart;
use crate::{Ragged, RequestParams, RequestStatus, SchedError, Scheduler, SchedulerConfig};

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 32,
        max_num_batched_tokens: 32,
        max_model_len: 64,
        ..Default::default()
    }
}

fn session(max_tokens: u32) -> RequestParams {
    RequestParams { resumable: true, ..params(max_tokens) }
}

fn part(tokens: &[u32], max_tokens: u32) -> InputPart {
    InputPart {
        token_ids: tokens.to_vec(),
        max_tokens: Some(max_tokens),
        arrival_time: 1.0,
        ..Default::default()
    }
}

#[test]
fn a_stopped_part_keeps_the_session_and_the_next_part_computes_only_its_tokens() {
    let mut s = Scheduler::new(cfg()).unwrap();
    add(&mut s, "a", &prompt(1, 5), session(1));
    let out = s.schedule().unwrap();
    let res = one_token_each(&mut s, &out, 7);
    assert!(res.finished_req_ids.is_empty());
    assert_eq!(res.part_finished_req_ids.len(), 1);
    assert_eq!(s.get_request("a").unwrap().status, RequestStatus::WaitingForInput);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 5);
    assert_eq!(s.num_unfinished_requests(), 0);
    assert!(s.has_request("a"));
    let out = s.schedule().unwrap();
    assert!(out.handles.is_empty());
    one_token_each(&mut s, &out, 7);
    s.append_input("a", part(&[9, 9], 1)).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.get_request("a").unwrap().num_prompt_tokens, 7); // 5 + 0 kept outputs + 2
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![2]);
    s.finish_input("a").unwrap();
    let res = one_token_each(&mut s, &out, 7);
    assert_eq!(res.finished_req_ids.len(), 1);
    assert!(!s.has_request("a"));
    assert_eq!(s.num_free_blocks(), 31);
}

#[test]
fn bad_parts_are_refused_and_change_nothing() {
    let mut s = Scheduler::new(cfg()).unwrap();
    add(&mut s, "plain", &prompt(1, 3), params(4));
    add(&mut s, "a", &prompt(1, 3), session(4));
    assert!(matches!(s.append_input("nope", part(&[1], 1)), Err(SchedError::UnknownRequest(_))));
    assert!(matches!(s.append_input("plain", part(&[1], 1)), Err(SchedError::InvalidRequest(_))));
    assert!(matches!(s.append_input("a", part(&[], 1)), Err(SchedError::InvalidRequest(_))));
    let long: Vec<u32> = (0..60).collect();
    assert!(matches!(s.append_input("a", part(&long, 1)), Err(SchedError::InvalidRequest(_))));
    assert!(s.get_request("a").unwrap().input_queue.is_empty());
    s.finish_input("a").unwrap();
    assert!(matches!(s.finish_input("a"), Err(SchedError::InvalidRequest(_))));
    assert!(matches!(s.append_input("a", part(&[1], 1)), Err(SchedError::InvalidRequest(_))));
    s.check_invariants().unwrap();
}

#[test]
fn a_part_after_a_stop_inside_accepted_drafts_recomputes_the_positions_it_fills() {
    // Without trim_computed_on_stop a stop on the first of three accepted tokens leaves the computed count two
    // tokens past the tokens kept; the next part must not start from it.
    let mut s = Scheduler::new(SchedulerConfig {
        num_speculative_tokens: Some(2),
        trim_computed_on_stop: false,
        ..cfg()
    })
    .unwrap();
    add(&mut s, "a", &prompt(1, 3), RequestParams { stop_token_ids: vec![9], ..session(10) });
    let out = s.schedule().unwrap();
    one_token_each(&mut s, &out, 5);
    s.set_draft_token_ids(&["a".to_string()], Ragged { values: &[6, 7], indptr: &[0, 2] }).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![3]);
    let res = s
        .update_from_output(
            out.scheduler_id,
            out.step_id,
            Ragged { values: &[9, 6, 7], indptr: &[0, 3] },
            None,
        )
        .unwrap();
    assert_eq!(res.part_finished_req_ids.len(), 1);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 6); // one past its 5 tokens (1, 2, 3, 5, 9)
    s.append_input("a", part(&[4], 2)).unwrap();
    s.check_invariants().unwrap();
    // 1, 2, 3, 5 kept (the sampled 9 dropped), then the part's 4: only position 4 is recomputed.
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 4);
    let out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    assert!(out.num_scheduled_tokens[0] >= 1);
    one_token_each(&mut s, &out, 8);
}

#[test]
fn a_part_that_leaves_nothing_computed_frees_the_blocks_it_held() {
    // One token a step; "p" caches the block [1, 2, 3, 4] and finishes.
    let mut s =
        Scheduler::new(SchedulerConfig { max_num_batched_tokens: 1, enable_prefix_caching: true, ..cfg() })
            .unwrap();
    add(&mut s, "p", &[1, 2, 3, 4, 9], params(1));
    let mut p_block = None;
    while s.has_request("p") {
        let p = schedule(&mut s);
        p_block = p_block.or(s.get_request("p").unwrap().blocks.first().copied());
        apply(&mut s, &p, |_| vec![0]);
    }
    // "a" computes one token of its prompt; the runner samples two tokens for it and the first stops the part:
    // the stop trims the second and its position, so nothing computed is left.
    add(&mut s, "a", &[1, 2, 3, 4], session(1));
    let out = s.schedule().unwrap();
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 1);
    assert!(!s.get_request("a").unwrap().blocks.is_empty());
    let (values, indptr) = ([7i64, 8], [0i64, 2]);
    s.update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &indptr }, None)
        .unwrap();
    assert_eq!(s.get_request("a").unwrap().status, RequestStatus::WaitingForInput);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 0);
    // The next part frees the blocks (they hold no valid KV); its admission finds p's cached block.
    s.append_input("a", part(&[5, 6], 1)).unwrap();
    assert!(s.get_request("a").unwrap().blocks.is_empty());
    s.schedule().unwrap();
    assert_eq!(s.get_request("a").unwrap().blocks.first().copied(), p_block);
    assert_eq!(s.get_num_computed_tokens("a").unwrap(), 5);
    s.check_invariants().unwrap();
}
