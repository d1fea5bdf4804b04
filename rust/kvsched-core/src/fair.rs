//! Tenants and weighted fair share: the Virtual Token Counter (VTC, Sheng et al., OSDI 2024).
//!
//! Every request belongs to a tenant (default `"default"`). Each tenant has a weight (config
//! `tenant_weights`, 1.0 when not listed, changeable at run time) and a *virtual counter* of the weighted
//! service it received: `(fair_prefill_weight / weight) * t` per `t` prompt tokens computed for the first time
//! (cached prefix tokens and recomputation after a preemption are free: the tenant did not ask for them) and
//! `(fair_decode_weight / weight) * t` for the `t` output tokens appended to its requests by one
//! `update_from_output` (summed over the call, charged once at its end: one multiply-add per tenant per step). A tenant whose waiting queue goes from
//! empty to non-empty on a new request is lifted to the smallest counter among the *other* tenants with waiting
//! requests (unchanged if there are none), so idle time banks no credit. The accounting runs under every
//! policy (it is what `tenant_stats()` reports); only policy `fair` admits by it:
//!
//! - waiting requests sit in one FIFO per tenant (a preempted request returns to the front of its tenant's;
//!   with `order_key`s, one FIFO per tier within the tenant's);
//! - phase B tries the head of the tenant with the smallest `(head tier, counter, head arrival_time, tenant
//!   name)`;
//!   when that request does not fit, admission stops for the step (no skipping to another tenant);
//! - the preemption victim is the last request in `running` among those whose tenant has the largest counter.
//!
//! Counters are `f64` and every charge is the one expression `rate * tokens` (`rate = w / weight`, computed when
//! the weight is set), applied in scheduling order, so the pure-Python reference computes bit-identical counters
//! (ties decide admissions).
//! Invariants: `num_waiting` of each tenant equals its requests in `waiting`; counters never decrease
//! (a lift only raises one); tenants are never forgotten (memory grows with the number of distinct names).

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{check_tenant_name, check_tenant_weight, SchedulerConfig};
use crate::error::{Result, SchedError};
use crate::order::TierQueue;
use crate::request::{ReqHandle, Request};
use crate::slab::Slab;

pub const DEFAULT_TENANT: &str = "default";

#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub name: Arc<str>,
    pub weight: f64,
    /// Weighted service received (plus lifts): what `fair` admission compares.
    pub counter: f64,
    /// Prompt tokens computed for the tenant's requests, first computation only.
    pub num_prefill_tokens: u64,
    /// Output tokens appended to the tenant's requests.
    pub num_decode_tokens: u64,
    /// The tenant's requests in `waiting` (WAITING or PREEMPTED).
    pub num_waiting: u32,
    /// `fair_prefill_weight / weight` and `fair_decode_weight / weight`.
    prefill_rate: f64,
    decode_rate: f64,
    /// Output tokens appended during the current `update_from_output`, charged by `flush_decode`.
    pending_decode: u32,
}

#[derive(Clone, Debug)]
pub struct Tenants {
    by_name: HashMap<Arc<str>, u32>,
    list: Vec<Tenant>,
    prefill_weight: f64,
    decode_weight: f64,
    /// Tenants with `pending_decode > 0`.
    pending: Vec<u32>,
}

impl Tenants {
    /// The tenants named in `tenant_weights` are registered up front (in that order) with their weights.
    pub fn new(config: &SchedulerConfig) -> Self {
        let mut t = Tenants {
            by_name: HashMap::new(),
            list: Vec::new(),
            prefill_weight: config.fair_prefill_weight,
            decode_weight: config.fair_decode_weight,
            pending: Vec::new(),
        };
        for (name, w) in &config.tenant_weights {
            let id = t.intern(name);
            t.assign_weight(id, *w);
        }
        t
    }

    /// The id of tenant `name`, registering it (weight 1.0, counter 0) if it is new.
    pub fn intern(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = self.list.len() as u32;
        let name: Arc<str> = Arc::from(name);
        self.by_name.insert(name.clone(), id);
        self.list.push(Tenant {
            name,
            weight: 1.0,
            counter: 0.0,
            num_prefill_tokens: 0,
            num_decode_tokens: 0,
            num_waiting: 0,
            prefill_rate: self.prefill_weight,
            decode_rate: self.decode_weight,
            pending_decode: 0,
        });
        id
    }

    fn assign_weight(&mut self, id: u32, weight: f64) {
        let (wp, wd) = (self.prefill_weight, self.decode_weight);
        let t = &mut self.list[id as usize];
        t.weight = weight;
        t.prefill_rate = wp / weight;
        t.decode_rate = wd / weight;
    }

    pub fn get(&self, id: u32) -> Option<&Tenant> {
        self.list.get(id as usize)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.list.iter()
    }

    /// Sets a tenant's weight (registering it if new); later charges use it, earlier ones stand.
    pub fn set_weight(&mut self, name: &str, weight: f64) -> Result<()> {
        check_tenant_name(name).map_err(SchedError::InvalidRequest)?;
        check_tenant_weight(name, weight).map_err(SchedError::InvalidRequest)?;
        let id = self.intern(name);
        self.assign_weight(id, weight);
        Ok(())
    }

    /// A new request of tenant `id` joins `waiting`: the VTC lift when its queue was empty, then the count.
    pub fn on_arrival(&mut self, id: u32) {
        let i = id as usize;
        if self.list[i].num_waiting == 0 {
            let floor = self
                .list
                .iter()
                .enumerate()
                .filter(|&(j, t)| j != i && t.num_waiting > 0)
                .map(|(_, t)| t.counter)
                .min_by(f64::total_cmp);
            if let Some(floor) = floor {
                let t = &mut self.list[i];
                t.counter = t.counter.max(floor);
            }
        }
        self.list[i].num_waiting += 1;
    }

    /// A preempted request of tenant `id` went back to `waiting` (no lift: the tenant did not arrive).
    pub fn on_requeue(&mut self, id: u32) {
        self.list[id as usize].num_waiting += 1;
    }

    /// A request of tenant `id` left `waiting` (admitted, aborted or finished while waiting).
    pub fn on_leave_waiting(&mut self, id: u32) {
        let t = &mut self.list[id as usize];
        t.num_waiting = t.num_waiting.saturating_sub(1);
    }

    /// Charges `tokens` prompt tokens computed for the first time.
    #[inline]
    pub fn charge_prefill(&mut self, id: u32, tokens: u32) {
        if tokens > 0 {
            let t = &mut self.list[id as usize];
            t.counter += t.prefill_rate * f64::from(tokens);
            t.num_prefill_tokens += u64::from(tokens);
        }
    }

    /// Counts `tokens` output tokens appended (charged by `flush_decode`).
    #[inline(always)]
    pub fn add_decode(&mut self, id: u32, tokens: u32) {
        let t = &mut self.list[id as usize];
        if t.pending_decode == 0 && tokens > 0 {
            self.pending.push(id);
        }
        t.pending_decode += tokens;
    }

    /// Charges the output tokens counted since the last flush, once per tenant.
    pub fn flush_decode(&mut self) {
        for id in self.pending.drain(..) {
            let t = &mut self.list[id as usize];
            t.counter += t.decode_rate * f64::from(t.pending_decode);
            t.num_decode_tokens += u64::from(t.pending_decode);
            t.pending_decode = 0;
        }
    }

    /// The prompt tokens of a step that computes positions `start..start + n` to charge, given the charged
    /// high-water mark `charged` and the prompt length; returns `(tokens to charge, new high-water mark)`.
    #[inline]
    pub fn new_prompt_tokens(start: u32, n: u32, charged: u32, num_prompt: u32) -> (u32, u32) {
        let end = start.saturating_add(n).min(num_prompt);
        let from = start.max(charged);
        (end.saturating_sub(from), charged.max(end))
    }

    /// Charges the prompt tokens among positions `start..start + n` of `req` not charged before.
    #[inline]
    pub fn charge_prompt(&mut self, req: &mut Request, start: u32, n: u32) {
        let (tokens, charged) =
            Self::new_prompt_tokens(start, n, req.num_charged_prompt_tokens, req.num_prompt_tokens);
        req.num_charged_prompt_tokens = charged;
        self.charge_prefill(req.tenant, tokens);
    }

    /// Index in `running` of the FAIR preemption victim: the last request whose tenant has the largest counter.
    pub fn pick_victim(&self, running: &[u32], slab: &Slab) -> Result<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (j, &s) in running.iter().enumerate().rev() {
            let c = self.list.get(slab.get(s)?.tenant as usize).map_or(0.0, |t| t.counter);
            if best.is_none_or(|(_, bc)| c > bc) {
                best = Some((j, c));
            }
        }
        best.map(|b| b.0).ok_or_else(|| SchedError::Internal("no running request to preempt".into()))
    }

    /// `check_invariants` helper: `num_waiting` per tenant must equal `expected`.
    pub fn check_waiting(&self, expected: &[u32]) -> std::result::Result<(), String> {
        for (t, &n) in self.list.iter().zip(expected) {
            if t.num_waiting != n {
                return Err(format!(
                    "tenant {:?} counts {} waiting requests, holds {n}",
                    t.name, t.num_waiting
                ));
            }
        }
        if self.list.iter().any(|t| t.counter.is_nan() || t.counter < 0.0) {
            return Err("a tenant counter is negative or NaN".into());
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

/// The `fair` waiting queue: one tiered FIFO per tenant (`order::TierQueue`: tiers by `order_key`, new requests
/// at the back of their tier, preempted ones at its front), entries `(handle, arrival_time)`.
#[derive(Clone, Debug, Default)]
pub struct FairQueue {
    queues: Vec<TierQueue<(ReqHandle, f64)>>,
    len: usize,
}

impl FairQueue {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn queue(&mut self, tenant: u32) -> &mut TierQueue<(ReqHandle, f64)> {
        let i = tenant as usize;
        if self.queues.len() <= i {
            self.queues.resize_with(i + 1, TierQueue::default);
        }
        &mut self.queues[i]
    }

    pub fn push_back(&mut self, tenant: u32, tier: i64, h: ReqHandle, arrival_time: f64) {
        self.queue(tenant).push_back(tier, (h, arrival_time));
        self.len += 1;
    }

    pub fn push_front(&mut self, tenant: u32, tier: i64, h: ReqHandle, arrival_time: f64) {
        self.queue(tenant).push_front(tier, (h, arrival_time));
        self.len += 1;
    }

    /// The tenant phase B serves next: smallest `(head tier, counter, head arrival_time, name)` among non-empty
    /// queues (the tier first: `order_key` comes before the policy's order). O(number of tenants).
    pub fn pick(&self, tenants: &Tenants) -> Option<u32> {
        let mut best: Option<(u32, i64, f64, f64, &str)> = None;
        for (i, q) in self.queues.iter().enumerate() {
            let (Some(&(_, arrival)), Some(tier), Some(t)) =
                (q.front(), q.first_tier(), tenants.get(i as u32))
            else {
                continue;
            };
            let better = match best {
                None => true,
                Some((_, bt, c, a, name)) => tier
                    .cmp(&bt)
                    .then(t.counter.total_cmp(&c))
                    .then(arrival.total_cmp(&a))
                    .then_with(|| (*t.name).cmp(name))
                    .is_lt(),
            };
            if better {
                best = Some((i as u32, tier, t.counter, arrival, &t.name));
            }
        }
        best.map(|b| b.0)
    }

    pub fn peek(&self, tenants: &Tenants) -> Option<ReqHandle> {
        let t = self.pick(tenants)?;
        self.queues[t as usize].front().map(|e| e.0)
    }

    pub fn pop(&mut self, tenants: &Tenants) -> Option<ReqHandle> {
        let t = self.pick(tenants)?;
        let h = self.queues[t as usize].pop_front().map(|e| e.0);
        if h.is_some() {
            self.len -= 1;
        }
        h
    }

    /// Takes `h` out of tenant `tenant`'s tier `tier` (a scan of that tier). Returns whether it was there.
    pub fn remove(&mut self, tenant: u32, tier: i64, h: ReqHandle) -> bool {
        let removed = self.queues.get_mut(tenant as usize).is_some_and(|q| q.remove(tier, |e| e.0 == h));
        self.len -= usize::from(removed);
        removed
    }

    pub fn retain(&mut self, mut keep: impl FnMut(ReqHandle) -> bool) {
        let mut len = 0;
        for q in &mut self.queues {
            q.retain(|e| keep(e.0));
            len += q.len();
        }
        self.len = len;
    }

    pub fn handles(&self) -> impl Iterator<Item = ReqHandle> + '_ {
        self.queues.iter().flat_map(|q| q.iter().map(|e| e.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(slot: u32) -> ReqHandle {
        ReqHandle { slot, gen: 0 }
    }

    #[test]
    fn lift_on_arrival_only_when_idle_and_only_to_others_with_waiting() {
        let mut t = Tenants::new(&SchedulerConfig::default());
        let (a, b, c) = (t.intern("a"), t.intern("b"), t.intern("c"));
        t.on_arrival(a);
        t.charge_prefill(a, 10); // a: 10
        t.on_arrival(b); // b lifted to 10
        assert_eq!(t.get(b).map(|x| x.counter), Some(10.0));
        t.add_decode(b, 1);
        t.flush_decode(); // b: 12
        t.on_leave_waiting(a);
        t.on_arrival(c); // only b waits: c lifted to 12
        assert_eq!(t.get(c).map(|x| x.counter), Some(12.0));
        t.on_arrival(c); // not idle: no lift
        t.on_leave_waiting(b);
        t.on_leave_waiting(c);
        t.on_leave_waiting(c);
        t.on_arrival(a); // nobody else waits: unchanged
        assert_eq!(t.get(a).map(|x| x.counter), Some(10.0));
    }

    #[test]
    fn weights_divide_charges_and_prompt_recompute_is_free() {
        let cfg = SchedulerConfig { tenant_weights: vec![("a".into(), 2.0)], ..Default::default() };
        let mut t = Tenants::new(&cfg);
        let a = t.intern("a");
        t.charge_prefill(a, 8);
        t.add_decode(a, 2);
        t.add_decode(a, 0);
        t.add_decode(a, 1);
        assert_eq!(t.get(a).map(|x| x.counter), Some(4.0));
        t.flush_decode();
        assert_eq!(t.get(a).map(|x| (x.counter, x.num_decode_tokens)), Some((4.0 + 3.0, 3)));
        assert_eq!(Tenants::new_prompt_tokens(0, 5, 0, 8), (5, 5));
        assert_eq!(Tenants::new_prompt_tokens(0, 6, 5, 8), (1, 6)); // recompute of 0..5 is free
        assert_eq!(Tenants::new_prompt_tokens(6, 4, 6, 8), (2, 8)); // decode positions are not prompt
        assert_eq!(Tenants::new_prompt_tokens(9, 1, 8, 8), (0, 8));
        assert!(t.set_weight("a", 0.0).is_err());
        assert!(t.set_weight("", 1.0).is_err());
    }

    #[test]
    fn fair_queue_picks_smallest_counter_then_arrival_then_name() {
        let mut t = Tenants::new(&SchedulerConfig::default());
        let (a, b) = (t.intern("b-tenant"), t.intern("a-tenant"));
        let mut q = FairQueue::default();
        q.push_back(a, 0, h(0), 1.0);
        q.push_back(b, 0, h(1), 1.0);
        q.push_back(b, 0, h(2), 0.0);
        assert_eq!(q.peek(&t), Some(h(1))); // equal counters and head arrivals: name order
        t.charge_prefill(b, 1);
        assert_eq!(q.pop(&t), Some(h(0)));
        q.push_front(a, 0, h(3), 5.0);
        t.charge_prefill(a, 1); // equal counters: earlier head arrival (b's 1.0) first
        assert_eq!(q.pop(&t), Some(h(1)));
        assert_eq!(q.len(), 2);
        q.retain(|x| x.slot != 2);
        assert_eq!(q.handles().collect::<Vec<_>>(), vec![h(3)]);
        q.push_back(b, -1, h(4), 9.0); // a smaller tier goes first, whatever the counters
        assert_eq!(q.peek(&t), Some(h(4)));
        assert!(q.remove(b, -1, h(4)) && !q.remove(b, -1, h(4)));
        assert_eq!((q.peek(&t), q.len()), (Some(h(3)), 1));
    }
}
