//! What the behaviour tests share: prompts, adding a request, scheduling and applying steps. Each helper that
//! changes the scheduler checks every invariant afterwards. The few reads of the scheduler's private state the
//! tests need (live requests, the free-block order, the oldest step in flight) are here too, so the test files
//! themselves go through the scheduler's API.

use crate::output::StepRecord;
use crate::{Ragged, ReqHandle, Request, RequestParams, Scheduler, SchedulerOutput, UpdateResult};

/// `len` consecutive token ids from `start` (prompts with different `start` share no prefix).
pub fn prompt(start: i64, len: usize) -> Vec<i64> {
    (start..start + len as i64).collect()
}

pub fn params(max_tokens: u32) -> RequestParams {
    RequestParams { max_tokens: Some(max_tokens), ..Default::default() }
}

pub fn add(s: &mut Scheduler, id: &str, prompt: &[i64], p: RequestParams) {
    s.add_request(id, prompt, p).unwrap();
    s.check_invariants().unwrap();
}

/// The ids of `out`'s entries, in order (empty for a request no longer live).
pub fn ids(s: &Scheduler, out: &SchedulerOutput) -> Vec<String> {
    out.handles.iter().map(|&h| s.request_id(h).map(|x| x.to_string()).unwrap_or_default()).collect()
}

/// A scheduled step not applied yet, and which of its entries sample a token (their request is live with its
/// prompt complete once the step is done), as of when it was scheduled.
pub struct Pending {
    pub out: SchedulerOutput,
    pub samples: Vec<bool>,
}

fn samples(s: &Scheduler, out: &SchedulerOutput) -> Vec<bool> {
    out.handles.iter().map(|&h| resolve(s, h).is_some_and(|r| !r.is_prefill_chunk)).collect()
}

/// Schedules a step.
pub fn schedule(s: &mut Scheduler) -> Pending {
    let out = s.schedule().unwrap();
    s.check_invariants().unwrap();
    let samples = samples(s, &out);
    Pending { out, samples }
}

/// Applies `out` with `tokens(i)` for each entry `i` marked in `samples`.
fn apply_with(
    s: &mut Scheduler,
    out: &SchedulerOutput,
    samples: &[bool],
    tokens: impl Fn(usize) -> Vec<i64>,
) -> UpdateResult {
    let mut values = Vec::new();
    let mut indptr = vec![0i64];
    for (i, &sample) in samples.iter().enumerate() {
        if sample {
            values.extend(tokens(i));
        }
        indptr.push(values.len() as i64);
    }
    let res = s
        .update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &indptr }, None)
        .unwrap();
    s.check_invariants().unwrap();
    res
}

/// Applies a step `schedule` returned: `tokens(i)` for each entry `i` that samples.
pub fn apply(s: &mut Scheduler, p: &Pending, tokens: impl Fn(usize) -> Vec<i64>) -> UpdateResult {
    apply_with(s, &p.out, &p.samples, tokens)
}

/// Applies `out`: `tokens(i)` for each entry `i` whose request samples, as of now.
pub fn feed(s: &mut Scheduler, out: &SchedulerOutput, tokens: impl Fn(usize) -> Vec<i64>) -> UpdateResult {
    let samples = samples(s, out);
    apply_with(s, out, &samples, tokens)
}

/// One step: every entry that samples gets the token `tok`.
pub fn step_with(s: &mut Scheduler, tok: i64) -> (SchedulerOutput, UpdateResult) {
    let p = schedule(s);
    let res = apply(s, &p, |_| vec![tok]);
    (p.out, res)
}

/// One step, as `step_with`; the ids it scheduled.
pub fn step_ids(s: &mut Scheduler, tok: i64) -> Vec<String> {
    let p = schedule(s);
    let scheduled = ids(s, &p.out);
    apply(s, &p, |_| vec![tok]);
    scheduled
}

/// Applies `out` with one token `token` for every entry, prefill chunks included.
pub fn one_token_each(s: &mut Scheduler, out: &SchedulerOutput, token: i64) -> UpdateResult {
    let values = vec![token; out.handles.len()];
    let indptr: Vec<i64> = (0..=out.handles.len() as i64).collect();
    let res = s
        .update_from_output(out.scheduler_id, out.step_id, Ragged { values: &values, indptr: &indptr }, None)
        .unwrap();
    s.check_invariants().unwrap();
    res
}

// ---- reads of private state ------------------------------------------------------------------------------

/// The live request of a handle, if it is still live.
pub fn resolve(s: &Scheduler, h: ReqHandle) -> Option<&Request> {
    s.slab.resolve(h)
}

/// The ids of every live request (running, waiting, parked), in slot order.
pub fn live_ids(s: &Scheduler) -> Vec<String> {
    s.slab.iter().map(|r| r.id.to_string()).collect()
}

/// The free blocks, in the order the pool hands them out.
pub fn free_order(s: &Scheduler) -> Vec<u32> {
    s.kv.pool.free_order()
}

/// The scheduler's record of the oldest step still in flight (the next one an update applies).
pub fn oldest_in_flight(s: &Scheduler) -> StepRecord {
    (**s.in_flight.front().unwrap()).clone()
}

/// Steps (feeding token 1) until every request has finished.
pub fn run_to_completion(s: &mut Scheduler) {
    while s.has_unfinished_requests() {
        step_with(s, 1);
    }
}
