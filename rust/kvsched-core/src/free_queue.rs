//! The free block queue: a doubly linked list over block ids stored in two index arrays, so popping the head,
//! unlinking any block (a prefix hit reviving a cached free block), appending and prepending are all O(1) and
//! allocation-free. Invariant: a block is linked iff `in_queue[b]`; following `next` from the head visits
//! exactly `len` blocks and ends at the tail.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue over `capacity` block ids holding `ids` in the given order.
    pub fn new(capacity: usize, ids: impl IntoIterator<Item = u32>) -> Self {
        let mut q = FreeBlockQueue {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            in_queue: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in ids {
            q.push_back(id);
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, block: u32) -> bool {
        self.in_queue.get(block as usize).copied().unwrap_or(false)
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Unlinks `block`; a no-op if it is not in the queue.
    pub fn remove(&mut self, block: u32) {
        if !self.contains(block) {
            return;
        }
        let i = block as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_queue[i] = false;
        self.len -= 1;
    }

    pub fn push_back(&mut self, block: u32) {
        let i = block as usize;
        debug_assert!(!self.in_queue[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.in_queue[i] = true;
        self.len += 1;
    }

    pub fn push_front(&mut self, block: u32) {
        let i = block as usize;
        debug_assert!(!self.in_queue[i]);
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = block;
        } else {
            self.prev[self.head as usize] = block;
        }
        self.head = block;
        self.in_queue[i] = true;
        self.len += 1;
    }

    /// Head-to-tail order (tests and invariant checks only: O(n)).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let b = cur;
            cur = self.next[b as usize];
            Some(b)
        })
    }

    /// Checks the links against `len` and `in_queue`.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        for b in self.iter() {
            if !self.in_queue[b as usize] {
                return Err(format!("block {b} is linked but not marked free"));
            }
            if self.prev[b as usize] != prev {
                return Err(format!("block {b} has a wrong prev link"));
            }
            prev = b;
            count += 1;
            if count > self.len {
                return Err("free queue longer than its length (cycle?)".into());
            }
        }
        if prev != self.tail {
            return Err("free queue tail does not match the last linked block".into());
        }
        if count != self.len {
            return Err(format!("free queue links {count} blocks but len is {}", self.len));
        }
        let marked = self.in_queue.iter().filter(|&&x| x).count();
        if marked != self.len {
            return Err(format!("{marked} blocks marked free but len is {}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pop_remove_push_keep_order() {
        let mut q = FreeBlockQueue::new(6, 1..6);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
        assert_eq!(q.pop_front(), Some(1));
        q.remove(4);
        q.remove(4); // idempotent
        q.push_back(1);
        q.push_front(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![4, 2, 3, 5, 1]);
        assert_eq!(q.len(), 5);
        q.check().unwrap();
        q.remove(1);
        q.remove(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![2, 3, 5]);
        q.check().unwrap();
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        q.check().unwrap();
        q.push_front(3);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![3]);
        q.check().unwrap();
    }
}
