//! The free block queue: a doubly linked list over block ids stored in one array of `(prev, next)` links, so
//! popping the head, unlinking any block (a prefix hit reviving a cached free block), appending and prepending
//! are all O(1) and allocation-free, and each touches one cache line per block (the two links of a block sit
//! side by side). Invariant: a block is linked iff it is the head or its `prev` is set (an unlinked block has
//! both links `NIL`); following `next` from the head visits exactly `len` blocks and ends at the tail.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
#[repr(C, align(8))]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link { prev: NIL, next: NIL };

#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue over `capacity` block ids holding `ids` in the given order.
    pub fn new(capacity: usize, ids: impl IntoIterator<Item = u32>) -> Self {
        let mut q = FreeBlockQueue { links: vec![UNLINKED; capacity], head: NIL, tail: NIL, len: 0 };
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

    #[inline]
    pub fn contains(&self, block: u32) -> bool {
        // Only the head has no `prev` among linked blocks (`NIL` itself is never a valid index).
        self.links.get(block as usize).is_some_and(|l| l.prev != NIL || self.head == block)
    }

    /// The block `pop_front` would return next, if any.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// The block after `block` in the queue (`block` must be linked), if any.
    #[inline]
    pub fn next_of(&self, block: u32) -> Option<u32> {
        let n = self.links[block as usize].next;
        (n != NIL).then_some(n)
    }

    /// The link entry of `block`, for a prefetch hint.
    #[inline]
    pub fn link_addr(&self, block: u32) -> Option<*const u8> {
        self.links.get(block as usize).map(|l| (l as *const Link).cast())
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Pops up to `n` blocks from the head into `out`, in queue order: what `n` calls of `pop_front` return, in
    /// one walk that relinks only the new head (not each block's neighbour). Returns the number popped.
    pub fn pop_front_n(&mut self, n: usize, out: &mut Vec<u32>) -> usize {
        let n = n.min(self.len);
        out.reserve(n);
        let mut b = self.head;
        for _ in 0..n {
            let l = &mut self.links[b as usize];
            let next = l.next;
            *l = UNLINKED;
            out.push(b);
            b = next;
        }
        // `b` is the first block left (NIL when the queue is now empty).
        self.head = b;
        if b == NIL {
            self.tail = NIL;
        } else {
            self.links[b as usize].prev = NIL;
        }
        self.len -= n;
        n
    }

    /// Unlinks `block`; a no-op if it is not in the queue.
    pub fn remove(&mut self, block: u32) {
        if !self.contains(block) {
            return;
        }
        let i = block as usize;
        let Link { prev: p, next: n } = self.links[i];
        if p == NIL {
            self.head = n;
        } else {
            self.links[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.links[n as usize].prev = p;
        }
        self.links[i] = UNLINKED;
        self.len -= 1;
    }

    pub fn push_back(&mut self, block: u32) {
        let i = block as usize;
        debug_assert!(!self.contains(block));
        self.links[i] = Link { prev: self.tail, next: NIL };
        if self.tail == NIL {
            self.head = block;
        } else {
            self.links[self.tail as usize].next = block;
        }
        self.tail = block;
        self.len += 1;
    }

    pub fn push_front(&mut self, block: u32) {
        let i = block as usize;
        debug_assert!(!self.contains(block));
        self.links[i] = Link { prev: NIL, next: self.head };
        if self.head == NIL {
            self.tail = block;
        } else {
            self.links[self.head as usize].prev = block;
        }
        self.head = block;
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
            cur = self.links[b as usize].next;
            Some(b)
        })
    }

    /// Checks the links against `len` and `contains`.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        for b in self.iter() {
            if self.links[b as usize].prev != prev {
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
        let marked = (0..self.links.len() as u32).filter(|&b| self.contains(b)).count();
        if marked != self.len {
            return Err(format!("{marked} blocks marked free but len is {}", self.len));
        }
        let stray = self
            .links
            .iter()
            .enumerate()
            .any(|(b, l)| !self.contains(b as u32) && (l.prev != NIL || l.next != NIL));
        if stray {
            return Err("an unlinked block keeps a link".into());
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

    /// `pop_front_n` pops exactly what as many `pop_front` calls would, and leaves the same queue, through a
    /// churn of removals, pushes at both ends and pops of every size (past the end included).
    #[test]
    fn pop_front_n_matches_pop_front() {
        const N: u32 = 64;
        let mut a = FreeBlockQueue::new(N as usize, 0..N);
        let mut b = a.clone();
        let mut out = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d; // xorshift: a fixed, varied sequence of operations
        for round in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let block = (x % u64::from(N)) as u32;
            match x >> 60 {
                0..=5 => {
                    let n = (x >> 8) as usize % 9 + usize::from(round % 97 == 0) * 64;
                    out.clear();
                    let got = b.pop_front_n(n, &mut out);
                    let want: Vec<u32> = std::iter::from_fn(|| a.pop_front()).take(n).collect();
                    assert_eq!(out, want, "round {round}");
                    assert_eq!(got, want.len());
                }
                6..=8 => {
                    a.remove(block);
                    b.remove(block);
                }
                9..=12 if !a.contains(block) => {
                    a.push_back(block);
                    b.push_back(block);
                }
                _ if !a.contains(block) => {
                    a.push_front(block);
                    b.push_front(block);
                }
                _ => {}
            }
            b.check().unwrap();
            assert_eq!(a.iter().collect::<Vec<_>>(), b.iter().collect::<Vec<_>>(), "round {round}");
            assert_eq!(a.len(), b.len());
        }
    }
}
