//! Session stickiness: each `session_id` remembers the replica its last request went to.
//!
//! At most `max_sessions` sessions are kept; past that the least recently used one is forgotten. Recency is a
//! stamp per touch; the queue holds (session, stamp) in touch order and entries whose stamp is stale are skipped
//! when evicting, and dropped in bulk when the queue outgrows twice the map. Invariant: every `session_id` kept has
//! exactly one queue entry with its current stamp.

use std::collections::{HashMap, VecDeque};

#[derive(Clone, Debug)]
pub struct Sessions {
    map: HashMap<String, (usize, u64)>,
    order: VecDeque<(String, u64)>,
    max_sessions: usize,
    next_stamp: u64,
}

impl Sessions {
    pub fn new(max_sessions: usize) -> Self {
        Sessions { map: HashMap::new(), order: VecDeque::new(), max_sessions, next_stamp: 0 }
    }

    pub fn get(&self, session: &str) -> Option<usize> {
        self.map.get(session).map(|&(slot, _)| slot)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn touch(&mut self, session: &str, slot: usize) {
        if self.max_sessions == 0 {
            return;
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.map.insert(session.to_owned(), (slot, stamp));
        self.order.push_back((session.to_owned(), stamp));
        while self.map.len() > self.max_sessions {
            match self.order.pop_front() {
                Some((s, st)) => {
                    if self.map.get(&s).is_some_and(|&(_, cur)| cur == st) {
                        self.map.remove(&s);
                    }
                }
                None => break,
            }
        }
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order.retain(|(s, st)| map.get(s).is_some_and(|&(_, cur)| cur == *st));
        }
    }

    /// Forgets every `session_id` pinned to `slot` (its replica is gone).
    pub fn forget_slot(&mut self, slot: usize) {
        self.map.retain(|_, &mut (s, _)| s != slot);
    }

    pub fn check_invariants(&self) -> bool {
        let live =
            self.order.iter().filter(|(s, st)| self.map.get(s).is_some_and(|&(_, cur)| cur == *st)).count();
        live == self.map.len() && self.map.len() <= self.max_sessions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_session_goes_first() {
        let mut s = Sessions::new(2);
        s.touch("a", 0);
        s.touch("b", 1);
        s.touch("a", 2); // a is now the most recent
        s.touch("c", 3);
        assert_eq!((s.get("a"), s.get("b"), s.get("c")), (Some(2), None, Some(3)));
        assert!(s.check_invariants());
        s.forget_slot(2);
        assert_eq!((s.get("a"), s.len()), (None, 1));
        for i in 0..100 {
            s.touch("c", i);
        }
        assert!(s.order.len() <= 2 * s.len() + 17);
        assert!(s.check_invariants());
        let mut off = Sessions::new(0);
        off.touch("a", 1);
        assert!(off.is_empty());
    }
}
