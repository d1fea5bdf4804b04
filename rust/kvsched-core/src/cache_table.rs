//! The prefix cache's primary table: block ids keyed by their hash, open addressing with linear probing.
//!
//! Each slot is 8 bytes: a 32-bit tag (the high half of the key, a block hash's first 8 bytes) and the block id.
//! An entry lives at or after its home slot `tag & mask`, with no empty slot in between; removal shifts the
//! following entries back (no tombstones, so the table never degrades with churn). The table is sized so that
//! the pool it serves fills at most half of it (it grows past 3/4) and a probe reads consecutive 8-byte slots
//! (8 to a cache line), so a probe is short, and unlike a SIMD-group table its slot for a key has a known
//! address: a block-boundary step (hundreds of inserts and evictions at random slots) prefetches it a few
//! requests ahead (`slot_addr`). Callers compare the full block hash on a tag match; the table only knows tags
//! and ids.

/// The block id of an empty slot (never a valid block: ids are below the pool size).
const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(8))]
struct Slot {
    tag: u32,
    block: u32,
}

const EMPTY_SLOT: Slot = Slot { tag: 0, block: EMPTY };

#[derive(Debug, Clone)]
pub(crate) struct CacheTable {
    slots: Vec<Slot>,
    mask: usize,
    len: usize,
}

#[inline(always)]
fn tag_of(key: u64) -> u32 {
    (key >> 32) as u32
}

impl CacheTable {
    /// A table holding `capacity` entries without growing, at most half full: linear probing's clusters (what
    /// a lookup miss and a removal's backward shift scan) grow fast past that (a pool of 6000 blocks in a
    /// table of 8192 slots scanned ~8 slots per removal).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let n = (capacity.max(8) * 2).next_power_of_two();
        CacheTable { slots: vec![EMPTY_SLOT; n], mask: n - 1, len: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask
    }

    /// The address of `key`'s home slot, for a prefetch hint.
    #[inline(always)]
    pub(crate) fn slot_addr(&self, key: u64) -> *const u8 {
        (&self.slots[self.home(tag_of(key))] as *const Slot).cast()
    }

    /// The first entry under `key`'s tag for which `eq(block)` holds.
    #[inline]
    pub(crate) fn find(&self, key: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = tag_of(key);
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s.block == EMPTY {
                return None;
            }
            if s.tag == tag && eq(s.block) {
                return Some(s.block);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The slot holding `block` (filed under `key`), if any.
    #[inline]
    fn position_of(&self, key: u64, block: u32) -> Option<usize> {
        let mut i = self.home(tag_of(key));
        loop {
            let s = self.slots[i];
            if s.block == EMPTY {
                return None;
            }
            if s.block == block {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Whether `block` is filed under `key`.
    pub(crate) fn contains_block(&self, key: u64, block: u32) -> bool {
        self.position_of(key, block).is_some()
    }

    /// One probe for both: the first entry under `key`'s tag for which `eq(block)` holds, or, when there is
    /// none, files `block` under `key` in the empty slot that ended the probe (`None`). `key_of` gives the key
    /// of an entry (only used to grow the table).
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        key: u64,
        block: u32,
        mut eq: impl FnMut(u32) -> bool,
        key_of: impl Fn(u32) -> u64,
    ) -> Option<u32> {
        debug_assert!(block != EMPTY);
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow(&key_of);
        }
        let tag = tag_of(key);
        let mut i = self.home(tag);
        loop {
            let s = self.slots[i];
            if s.block == EMPTY {
                self.slots[i] = Slot { tag, block };
                self.len += 1;
                return None;
            }
            if s.tag == tag && eq(s.block) {
                return Some(s.block);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Puts `s` in the first empty slot from its home (the table has room).
    #[inline]
    fn place(&mut self, s: Slot) {
        let mut i = self.home(s.tag);
        while self.slots[i].block != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = s;
        self.len += 1;
    }

    /// Replaces `old` (filed under `key`) by `new` with the same key, in place. Returns whether `old` was there.
    pub(crate) fn replace(&mut self, key: u64, old: u32, new: u32) -> bool {
        match self.position_of(key, old) {
            Some(i) => {
                self.slots[i].block = new;
                true
            }
            None => false,
        }
    }

    /// Removes `block` (filed under `key`). Returns whether it was there.
    pub(crate) fn remove(&mut self, key: u64, block: u32) -> bool {
        let Some(mut hole) = self.position_of(key, block) else { return false };
        // Backward shift: move each later entry of the cluster that may sit at `hole` (its home is not in
        // the cyclic range (hole, j]) into the hole, until an empty slot ends the cluster.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s.block == EMPTY {
                break;
            }
            let h = self.home(s.tag);
            let dist_home = j.wrapping_sub(h) & self.mask;
            let dist_hole = j.wrapping_sub(hole) & self.mask;
            if dist_home >= dist_hole {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY_SLOT;
        self.len -= 1;
        true
    }

    pub(crate) fn clear(&mut self) {
        self.slots.fill(EMPTY_SLOT);
        self.len = 0;
    }

    /// Every filed block (any order).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.slots.iter().filter(|s| s.block != EMPTY).map(|s| s.block)
    }

    #[cold]
    fn grow(&mut self, key_of: &impl Fn(u32) -> u64) {
        let old = std::mem::take(&mut self.slots);
        let n = old.len() * 2;
        self.slots = vec![EMPTY_SLOT; n];
        self.mask = n - 1;
        self.len = 0;
        for s in old.into_iter().filter(|s| s.block != EMPTY) {
            debug_assert_eq!(tag_of(key_of(s.block)), s.tag);
            self.place(s);
        }
    }

    /// Checks that every entry is reachable from its home slot (no empty slot in between) and `len`.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut count = 0;
        for (j, s) in self.slots.iter().enumerate() {
            if s.block == EMPTY {
                continue;
            }
            count += 1;
            let mut i = self.home(s.tag);
            while i != j {
                if self.slots[i].block == EMPTY {
                    return Err(format!("cache table entry {} is cut off from its home slot", s.block));
                }
                i = (i + 1) & self.mask;
            }
        }
        if count != self.len {
            return Err(format!("cache table holds {count} entries but len is {}", self.len));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A deterministic generator (xorshift) of keys whose tags share few low bits: few distinct home slots,
    /// so clusters are long and wrap around the end of the table.
    fn keys(seed: u64, n: usize, bits: u32) -> Vec<u64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let tag = ((x >> 24) as u32 & !0xFFF) | (x as u32 & ((1 << bits) - 1));
                (u64::from(tag) << 32) | (x & 0xFFFF_FFFF)
            })
            .collect()
    }

    #[test]
    fn insert_find_remove_match_a_map_under_churn() {
        for (seed, bits) in [(1u64, 2u32), (7, 4), (99, 10)] {
            let ks = keys(seed, 400, bits);
            let mut t = CacheTable::with_capacity(16); // grows
            let mut m: HashMap<u32, u64> = HashMap::new();
            let key_of = |m: &HashMap<u32, u64>, b: u32| m[&b];
            let mut x = seed;
            for step in 0..4000u32 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let b = (x >> 33) as u32 % 400;
                if let std::collections::hash_map::Entry::Vacant(e) = m.entry(b) {
                    e.insert(ks[b as usize]);
                    let snapshot = m.clone();
                    let found = t.find_or_insert(ks[b as usize], b, |y| y == b, |y| key_of(&snapshot, y));
                    assert_eq!(found, None, "step {step}: block {b} was not filed");
                } else {
                    // A lookup that matches an entry returns it and files nothing.
                    let len = t.len();
                    assert_eq!(t.find_or_insert(ks[b as usize], 1000, |y| y == b, |y| m[&y]), Some(b));
                    assert_eq!(t.len(), len);
                    assert!(t.remove(ks[b as usize], b), "step {step}: block {b} not found");
                    m.remove(&b);
                }
                if step % 97 == 0 {
                    t.check().unwrap();
                }
                assert_eq!(t.len(), m.len());
                let probe = (x >> 20) as u32 % 400;
                let found = t.find(ks[probe as usize], |y| y == probe).is_some();
                assert_eq!(found, m.contains_key(&probe));
            }
            t.check().unwrap();
            let mut all: Vec<u32> = t.iter().collect();
            all.sort_unstable();
            let mut want: Vec<u32> = m.keys().copied().collect();
            want.sort_unstable();
            assert_eq!(all, want);
            if let Some(&b) = want.first() {
                assert!(t.replace(m[&b], b, 1000));
                assert_eq!(t.find(m[&b], |y| y == 1000), Some(1000));
            }
            t.clear();
            assert_eq!(t.len(), 0);
            t.check().unwrap();
        }
    }
}
