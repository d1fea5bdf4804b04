//! Session affinity's record (`admission.rs`): which `session_id`s ran recently.
//!
//! A request may name its conversation (`add_request(..., session_id=...)`); session ids are interned. A
//! `session_id` is *recently active* at step `s` when one of its requests is running, or when `s - active_until
//! <= session_ttl_steps`, where `active_until` is the number of `schedule()` calls made when its last running
//! request left `running` (finished, aborted or preempted). Only admissions and departures from `running` touch
//! its record, never a decode step. A `session_id` with no live request that is no longer recently active is
//! forgotten (its index reused) when the table has doubled since the last sweep: it can never become recently
//! active again without a new request, and a new request starts it afresh, which reads the same.
//! Invariants: per `session_id`, `num_live` counts the live requests naming it, `num_running` those in
//! `running`.

use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug)]
struct Session {
    name: Arc<str>,
    num_live: u32,
    num_running: u32,
    active_until: Option<u64>,
}

#[derive(Clone, Debug, Default)]
pub struct Sessions {
    by_name: HashMap<Arc<str>, u32>,
    list: Vec<Session>,
    free: Vec<u32>,
    /// Sessions in the table after the last sweep; the next sweep runs at twice as many.
    swept_at: usize,
}

impl Sessions {
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The index of `session_id` `name` for a new live request (interned on first sight); `now` and `ttl` let the table
    /// forget stale sessions first.
    pub fn add_request(&mut self, name: &str, now: u64, ttl: u32) -> u32 {
        if let Some(&id) = self.by_name.get(name) {
            self.list[id as usize].num_live += 1;
            return id;
        }
        if self.by_name.len() >= 2 * self.swept_at.max(32) {
            self.sweep(now, ttl);
        }
        let name: Arc<str> = Arc::from(name);
        let session = Session { name: name.clone(), num_live: 1, num_running: 0, active_until: None };
        let id = match self.free.pop() {
            Some(id) => {
                self.list[id as usize] = session;
                id
            }
            None => {
                self.list.push(session);
                (self.list.len() - 1) as u32
            }
        };
        self.by_name.insert(name, id);
        id
    }

    fn sweep(&mut self, now: u64, ttl: u32) {
        for id in 0..self.list.len() as u32 {
            let s = &self.list[id as usize];
            if s.num_live == 0 && !self.is_recent(id, now, ttl) && self.by_name.get(&s.name) == Some(&id) {
                self.by_name.remove(&s.name);
                self.free.push(id);
            }
        }
        self.swept_at = self.by_name.len();
    }

    /// A request of session `id` is forgotten.
    pub fn remove_request(&mut self, id: u32) {
        if let Some(s) = self.list.get_mut(id as usize) {
            s.num_live = s.num_live.saturating_sub(1);
        }
    }

    /// A request of session `id` entered `running`.
    pub fn on_run(&mut self, id: u32) {
        if let Some(s) = self.list.get_mut(id as usize) {
            s.num_running += 1;
        }
    }

    /// A request of session `id` left `running` when `now` `schedule()` calls had been made.
    pub fn on_leave_running(&mut self, id: u32, now: u64) {
        if let Some(s) = self.list.get_mut(id as usize) {
            s.num_running = s.num_running.saturating_sub(1);
            s.active_until = Some(now);
        }
    }

    /// Whether session `id` is recently active at step `now` (see the module doc).
    pub fn is_recent(&self, id: u32, now: u64, ttl: u32) -> bool {
        self.list.get(id as usize).is_some_and(|s| {
            s.num_running > 0 || s.active_until.is_some_and(|t| now.saturating_sub(t) <= u64::from(ttl))
        })
    }

    /// `check_invariants` helper: `(live, running)` requests per session must match `expected`.
    pub fn check(&self, expected: &HashMap<u32, (u32, u32)>) -> Result<(), String> {
        for &id in self.by_name.values() {
            let s = &self.list[id as usize];
            let want = expected.get(&id).copied().unwrap_or((0, 0));
            if (s.num_live, s.num_running) != want {
                return Err(format!(
                    "session {:?} counts {} live and {} running requests, holds {want:?}",
                    s.name, s.num_live, s.num_running
                ));
            }
        }
        for id in expected.keys() {
            if self.list.get(*id as usize).is_none_or(|s| self.by_name.get(&s.name) != Some(id)) {
                return Err(format!("a live request names session index {id}, which is unknown"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_while_running_and_for_ttl_steps_after() {
        let mut s = Sessions::default();
        let a = s.add_request("a", 0, 5);
        assert!(!s.is_recent(a, 0, 5)); // never ran
        s.on_run(a);
        assert!(s.is_recent(a, 100, 5));
        s.on_leave_running(a, 10);
        assert!(s.is_recent(a, 15, 5) && !s.is_recent(a, 16, 5));
        assert_eq!(s.add_request("a", 16, 5), a);
    }

    #[test]
    fn stale_sessions_are_forgotten_and_their_index_reused() {
        let mut s = Sessions::default();
        for k in 0..64 {
            let id = s.add_request(&format!("s{k}"), 0, 1);
            s.remove_request(id);
        }
        let kept = s.add_request("s0", 0, 1); // live again: never swept
        let x = s.add_request("new", 10, 1); // 64 sessions: the sweep forgets the other 63
        assert_eq!(s.by_name.len(), 2);
        assert!(x != kept && (x as usize) < 64);
        assert!(s.check(&HashMap::from([(kept, (1, 0)), (x, (1, 0))])).is_ok());
        assert!(s.check(&HashMap::from([(kept, (1, 0))])).is_err());
    }
}
