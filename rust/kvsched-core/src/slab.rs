//! Dense storage for live requests. A slot is reused after its request finishes; each reuse bumps the slot's
//! generation so stale handles (from steps still in flight) are recognised as gone.

use crate::error::{Result, SchedError};
use crate::request::{ReqHandle, Request};

#[derive(Clone, Debug, Default)]
pub struct Slab {
    slots: Vec<Option<Request>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    live: usize,
}

impl Slab {
    /// The handle the next `insert` will use.
    pub fn next_handle(&self) -> ReqHandle {
        match self.free.last() {
            Some(&slot) => ReqHandle { slot, gen: self.gens[slot as usize] },
            None => ReqHandle { slot: self.slots.len() as u32, gen: 0 },
        }
    }

    /// Stores `req` at `req.handle`, which must come from `next_handle()`.
    pub fn insert(&mut self, req: Request) {
        let slot = req.handle.slot as usize;
        if slot == self.slots.len() {
            self.slots.push(Some(req));
            self.gens.push(0);
        } else {
            self.free.pop();
            self.slots[slot] = Some(req);
        }
        self.live += 1;
    }

    pub fn remove(&mut self, slot: u32) -> Option<Request> {
        let req = self.slots.get_mut(slot as usize)?.take()?;
        self.gens[slot as usize] = self.gens[slot as usize].wrapping_add(1);
        self.free.push(slot);
        self.live -= 1;
        Some(req)
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn get(&self, slot: u32) -> Result<&Request> {
        self.slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| SchedError::Internal(format!("no live request in slot {slot}")))
    }

    pub fn get_mut(&mut self, slot: u32) -> Result<&mut Request> {
        self.slots
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| SchedError::Internal(format!("no live request in slot {slot}")))
    }

    /// The request in `slot`, if any (no error path: for hints such as prefetching).
    #[inline]
    pub fn peek(&self, slot: u32) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// The request behind `h`, if it is still the same live request.
    pub fn resolve(&self, h: ReqHandle) -> Option<&Request> {
        self.slots.get(h.slot as usize).and_then(Option::as_ref).filter(|r| r.handle == h)
    }

    pub fn resolve_mut(&mut self, h: ReqHandle) -> Option<&mut Request> {
        self.slots.get_mut(h.slot as usize).and_then(Option::as_mut).filter(|r| r.handle == h)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Request> {
        self.slots.iter().filter_map(Option::as_ref)
    }
}
