//! The CPU block pool that preemption by swapping copies victims' KV into (`swap_sched.rs` decides who is
//! swapped, and emits the copies; the runner executes them).
//!
//! Invariant (checked by `check`, called from `Scheduler::check_invariants`): every block `0..num_blocks` is
//! either in the free queue exactly once or held by exactly one request.

use std::collections::VecDeque;

/// The CPU swap pool: blocks `0..num_blocks` (no null block), a FIFO of free ids. Allocation pops from the
/// head, release appends to the tail in the order given, so both implementations hand out the same ids.
#[derive(Debug, Clone)]
pub struct CpuBlockPool {
    free: VecDeque<u32>,
    num_blocks: u32,
}

impl CpuBlockPool {
    pub fn new(num_blocks: u32) -> Self {
        CpuBlockPool { free: (0..num_blocks).collect(), num_blocks }
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// `n` blocks from the head, or `None` (nothing taken) when fewer are free.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.drain(..n).collect())
    }

    /// Share of the CPU blocks held by swapped-out requests, in [0, 1] (0 for an empty pool).
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / f64::from(self.num_blocks)
    }

    pub(crate) fn release(&mut self, blocks: &[u32]) {
        self.free.extend(blocks.iter().copied());
    }

    /// Every block free exactly once or held exactly once (`held[b]` counts the holders of block `b`).
    pub(crate) fn check(&self, held: &[u32]) -> std::result::Result<(), String> {
        let mut seen = held.to_vec();
        for &b in &self.free {
            match seen.get_mut(b as usize) {
                Some(x) => *x += 1,
                None => return Err(format!("CPU block {b} out of range")),
            }
        }
        match seen.iter().position(|&x| x != 1) {
            Some(b) => Err(format!("CPU block {b} is free or held {} times, not once", seen[b])),
            None => Ok(()),
        }
    }
}
