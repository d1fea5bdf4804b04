//! The prefix index: for every cached block key, the set of replicas holding it.
//!
//! One hash map from block key to a bit set of replica slots serves every replica at once, so the longest cached
//! prefix of a prompt on all replicas is one walk down the prompt's block keys: one lookup per block, however
//! many replicas there are, stopping at the first block no candidate holds. Invariants (`check_invariants`): no
//! entry has an empty set, and each slot's block count equals the number of entries whose set holds it.
//! Purging a slot visits every entry (a replica is lost or cleared rarely; lookups are the hot path).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{Result, RouterError};

/// A set of replica slots, one bit per slot.
pub type ReplicaSet = u128;

/// The most replicas one router indexes at a time.
pub const MAX_REPLICAS: usize = ReplicaSet::BITS as usize;

/// A `HashMap` hasher for 64-bit keys: the splitmix64 finaliser. Real block hashes are already uniform, but
/// caller-supplied keys may be small or sequential, and a swiss table keyed by their raw bits would crowd its
/// probe groups.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = mix(x);
    }
}

#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

#[derive(Clone, Debug)]
pub struct PrefixIndex {
    blocks: KeyMap<ReplicaSet>,
    num_blocks: Vec<usize>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex { blocks: KeyMap::default(), num_blocks: vec![0; MAX_REPLICAS] }
    }
}

#[inline]
fn bit(slot: usize) -> ReplicaSet {
    1 << slot
}

/// The slots of a set, lowest first.
pub fn slots(mut set: ReplicaSet) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if set == 0 {
            return None;
        }
        let s = set.trailing_zeros() as usize;
        set &= set - 1;
        Some(s)
    })
}

impl PrefixIndex {
    /// Records that `slot` caches the blocks `keys`.
    pub fn insert(&mut self, slot: usize, keys: &[u64]) {
        let b = bit(slot);
        for &k in keys {
            let set = self.blocks.entry(k).or_insert(0);
            if *set & b == 0 {
                *set |= b;
                self.num_blocks[slot] += 1;
            }
        }
    }

    /// Records that `slot` no longer caches `keys` (keys it did not cache are ignored).
    pub fn remove(&mut self, slot: usize, keys: &[u64]) {
        let b = bit(slot);
        for k in keys {
            if let Some(set) = self.blocks.get_mut(k) {
                if *set & b != 0 {
                    *set &= !b;
                    self.num_blocks[slot] -= 1;
                    if *set == 0 {
                        self.blocks.remove(k);
                    }
                }
            }
        }
    }

    /// Forgets every block of `slot`.
    pub fn clear(&mut self, slot: usize) {
        if self.num_blocks[slot] == 0 {
            return;
        }
        let keep = !bit(slot);
        self.blocks.retain(|_, set| {
            *set &= keep;
            *set != 0
        });
        self.num_blocks[slot] = 0;
    }

    pub fn num_blocks(&self, slot: usize) -> usize {
        self.num_blocks[slot]
    }

    /// Distinct block keys cached anywhere.
    pub fn num_keys(&self) -> usize {
        self.blocks.len()
    }

    pub fn holders(&self, key: u64) -> ReplicaSet {
        self.blocks.get(&key).copied().unwrap_or(0)
    }

    /// For each slot of `candidates`, the number of leading `keys` it caches (its longest cached prefix), written
    /// to `out[slot]`; slots outside `candidates` are left as they are.
    pub fn overlaps(&self, keys: &[u64], candidates: ReplicaSet, out: &mut [u32; MAX_REPLICAS]) {
        let mut alive = candidates;
        for (i, k) in keys.iter().enumerate() {
            if alive == 0 {
                return;
            }
            let held = self.holders(*k) & alive;
            for s in slots(alive & !held) {
                out[s] = i as u32;
            }
            alive = held;
        }
        for s in slots(alive) {
            out[s] = keys.len() as u32;
        }
    }

    pub fn check_invariants(&self) -> Result<()> {
        let mut counts = vec![0usize; MAX_REPLICAS];
        for (k, set) in &self.blocks {
            if *set == 0 {
                return Err(RouterError::Internal(format!("block {k:#x} has no holder")));
            }
            for s in slots(*set) {
                counts[s] += 1;
            }
        }
        if counts != self.num_blocks {
            return Err(RouterError::Internal("per-replica block counts drifted".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    fn overlap_of(index: &PrefixIndex, keys: &[u64], slot: usize) -> u32 {
        let mut out = [u32::MAX; MAX_REPLICAS];
        index.overlaps(keys, bit(slot), &mut out);
        out[slot]
    }

    #[test]
    fn the_overlap_is_the_longest_cached_prefix() {
        let mut ix = PrefixIndex::default();
        ix.insert(0, &[1, 2, 3]);
        ix.insert(1, &[1, 3]);
        ix.insert(5, &[7]);
        let mut out = [u32::MAX; MAX_REPLICAS];
        ix.overlaps(&[1, 2, 3, 4], bit(0) | bit(1) | bit(2) | bit(5), &mut out);
        assert_eq!((out[0], out[1], out[2], out[5]), (3, 1, 0, 0));
        assert_eq!(out[3], u32::MAX, "a slot outside the candidates is not written");
        ix.remove(0, &[2, 9]);
        assert_eq!(overlap_of(&ix, &[1, 2, 3], 0), 1);
        assert_eq!(ix.num_blocks(0), 2);
        ix.clear(0);
        assert_eq!((ix.num_blocks(0), ix.num_blocks(1)), (0, 2));
        assert_eq!(ix.holders(1), bit(1));
        assert_eq!(overlap_of(&ix, &[], 1), 0);
        ix.check_invariants().unwrap();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(usize, Vec<u64>),
        Remove(usize, Vec<u64>),
        Clear(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few slots and few keys, so that sets overlap, duplicates and removals of absent keys are common.
        let slot = prop_oneof![0usize..4, Just(MAX_REPLICAS - 1)];
        let keys = prop::collection::vec(0u64..24, 0..6);
        prop_oneof![
            4 => (slot.clone(), keys.clone()).prop_map(|(s, k)| Op::Insert(s, k)),
            3 => (slot.clone(), keys).prop_map(|(s, k)| Op::Remove(s, k)),
            1 => slot.prop_map(Op::Clear),
        ]
    }

    proptest! {
        /// The index agrees with a set per replica after any sequence of operations.
        #[test]
        fn matches_a_set_per_replica(ops in prop::collection::vec(op(), 0..60),
                                     queries in prop::collection::vec(prop::collection::vec(0u64..24, 0..8), 1..6)) {
            let mut ix = PrefixIndex::default();
            let mut model: BTreeMap<usize, BTreeSet<u64>> = BTreeMap::new();
            for op in &ops {
                match op {
                    Op::Insert(s, k) => { ix.insert(*s, k); model.entry(*s).or_default().extend(k); }
                    Op::Remove(s, k) => { ix.remove(*s, k); for x in k { model.entry(*s).or_default().remove(x); } }
                    Op::Clear(s) => { ix.clear(*s); model.remove(s); }
                }
                ix.check_invariants().unwrap();
            }
            let all: ReplicaSet = bit(0) | bit(1) | bit(2) | bit(3) | bit(MAX_REPLICAS - 1);
            for q in &queries {
                let mut out = [0u32; MAX_REPLICAS];
                ix.overlaps(q, all, &mut out);
                for s in slots(all) {
                    let set = model.get(&s).cloned().unwrap_or_default();
                    let want = q.iter().take_while(|k| set.contains(k)).count() as u32;
                    prop_assert_eq!(out[s], want);
                    prop_assert_eq!(ix.num_blocks(s), set.len());
                }
            }
        }
    }
}
