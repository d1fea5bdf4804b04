//! `KvCacheManager` with several KV cache groups (`hybrid.rs` describes the groups and the rules).

use crate::block_pool::NULL_BLOCK;
use crate::config::{CROSS_ATTENTION, MAMBA, RING};
use crate::connector::GroupTables;
use crate::hashing::BlockHash;
use crate::hybrid::{checkpoint_valid_in_units, mamba_checkpoint, mamba_retained, Hybrid};
use crate::hybrid::{chunk_size, group_key, group_skipped, group_slot, is_window};
use crate::hybrid::{window_kept, window_reachable, window_reachable_at, window_retained};
use crate::kv_cache_manager::KvCacheManager;
use crate::request::{GroupTable, Request};

/// An align-mode Mamba group's blocks to allocate (vLLM's `get_num_blocks_to_allocate`) when the allocation
/// wants `entries` entries and the table holds `held`: the missing ones, capped at one (`mamba_blocks`, one plus
/// the speculative blocks, before the first allocation), one more with a prefill checkpoint (`checkpoint`);
/// negative when the table is longer. With a block to copy (`copy`: a hit ending inside a block, or the request's
/// own prompt tail cached inside one), one more, never below 1.
pub(crate) fn align_need(
    entries: usize,
    held: usize,
    mamba_blocks: usize,
    allocated: bool,
    checkpoint: bool,
    copy: bool,
) -> i64 {
    let mut need = entries as i64 - held as i64;
    if copy {
        need = need.max(0) + 1;
    }
    if need > 0 {
        need.min(if allocated { 1 } else { mamba_blocks as i64 } + i64::from(checkpoint) + i64::from(copy))
    } else {
        need
    }
}

/// The prefill checkpoint an align-mode Mamba group's allocation computing tokens `start..end` reserves a block
/// for (vLLM's `_needs_internal_checkpoint`), as (position, table index), `table` being the group's table before
/// the allocation: with checkpoints on, the checkpoint of `end` (`mamba_checkpoint`) when the chunk can export it
/// (`checkpoint_valid`) and, under retention 0 only, the chunk reaches the prefill's end
/// (`max(num_prompt, num_tokens - 1)`); its index `ceil(end / bs) - 2` must be past the table, a null block, or
/// one of an allocated table's speculative blocks. With prefix hits inside a block (`unit` tokens per unit; 0:
/// none) the checkpoint is a unit boundary.
#[allow(clippy::too_many_arguments)]
fn align_checkpoint(
    hy: &Hybrid,
    bs: u32,
    unit: u32,
    drop: bool,
    req: &Request,
    table: &[u32],
    allocated: bool,
    start: u32,
    end: u32,
) -> Option<(u32, usize)> {
    if hy.checkpoint_align == 0 {
        return None;
    }
    let prefill_end = if hy.retention == Some(0) {
        req.num_prompt_tokens.max(req.num_tokens().saturating_sub(1))
    } else {
        0
    };
    let unit = if unit == 0 { bs } else { unit };
    let checkpoint = mamba_checkpoint(end, unit, drop, hy.hash_lookahead);
    if end < prefill_end || !checkpoint_valid_in_units(start, end, checkpoint, unit, bs, hy.checkpoint_align)
    {
        return None;
    }
    // `checkpoint_valid` puts the index past the initial state's (at least 0).
    let idx = (end.div_ceil(bs) - 2) as usize;
    let spec = hy.mamba_blocks - 1;
    let free = idx >= table.len() || table[idx] == NULL_BLOCK || (allocated && idx + spec >= table.len());
    free.then_some((checkpoint, idx))
}

/// A ring group's or a replayed window's hit (never looked up: vLLM's is empty) as `n` null blocks, the primary
/// group's length; the allocation takes nothing from it.
fn fill_ring_hits(hy: &Hybrid, hits: &mut [Vec<u32>], n: usize) {
    for (g, &w) in hy.windows.iter().enumerate() {
        if w == RING || hy.is_replay(g) {
            hits[g].clear();
            hits[g].resize(n, NULL_BLOCK);
        }
    }
}

/// A request's table of the group at `slot` (`Hybrid::slot`; `None`: the primary group) and its cached-block
/// count.
fn table(req: &mut Request, slot: Option<usize>) -> (&mut Vec<u32>, &mut u32) {
    match slot {
        None => (&mut req.blocks, &mut req.num_cached_blocks),
        Some(i) => {
            let t = &mut req.groups[i];
            (&mut t.blocks, &mut t.num_cached_blocks)
        }
    }
}

fn table_ref(req: &Request, slot: Option<usize>) -> &[u32] {
    match slot {
        None => &req.blocks,
        Some(i) => &req.groups[i].blocks,
    }
}

impl KvCacheManager {
    /// The block cached under the hash of block `i` of `k`-unit blocks (`hashes[(i + 1) * k - 1]`: a block of a
    /// group whose block size is `k` times the manager's is keyed by the hash of its last unit) for every group of
    /// `ids`, appended to `found`; false if one of them misses.
    fn hit_all(&self, hashes: &[BlockHash], i: usize, k: usize, ids: &[usize], found: &mut Vec<u32>) -> bool {
        found.clear();
        for &g in ids {
            match self.pool.get_cached_block(&group_key(&hashes[(i + 1) * k - 1], g)) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        true
    }

    /// `find_longest_cache_hit` over every group: the primary group's hits go to `out` (their length, at
    /// `block_size`, is the hit's), every group's to `last_hits`.
    ///
    /// Lengths are in tokens: each set looks its blocks up at its own block size (`Hybrid::block_sizes`, keyed by
    /// the hash of a block's last unit), and a hit is aligned to `Hybrid::align` (a full-attention hit rounded
    /// down to it; a window's rightmost run must end on it, and a run from block 0 gives up blocks until it does).
    ///
    /// With the trailing-block drop (`drop_trailing_hit`, vLLM's EAGLE rules over several groups): a full-attention
    /// or window set not yet *verified* at the current candidate looks one block further (capped at the hashes)
    /// and gives up its hit's last block (a window's run needs one block more); it is then verified, and a set
    /// that shortens the candidate without dropping makes every set unverified again. A Mamba set is verified
    /// without looking further or dropping; with `Hybrid::mamba_eagle` off it is none of the drop's sets (never
    /// verified, so one that shortens the candidate makes every set unverified again).
    #[cold]
    pub(crate) fn find_hybrid_hit(&self, hashes: &[BlockHash], num_tokens: u32, out: &mut Vec<u32>) {
        let Some(hy) = self.hybrid.as_deref() else { return };
        let ngroups = hy.windows.len();
        let bs = self.block_size;
        let mut hits = hy.hits();
        for h in hits.iter_mut() {
            h.clear();
        }
        let mut done = vec![false; ngroups];
        // Candidate and hit lengths in tokens.
        let mut hit_len = self.max_hit_blocks(hashes, num_tokens) as u32 * bs;
        let mut found = Vec::new();
        let mut longest = 0;
        let mut verified = vec![false; hy.lookups.len()];
        loop {
            let mut curr = hit_len;
            for (idx, (w, ids)) in hy.lookups.iter().enumerate() {
                let (w, first) = (*w, ids[0]);
                if w == 0 && done[first] {
                    curr = curr.min(hits[first].len() as u32 * hy.block_sizes[first]);
                    continue;
                }
                // A Mamba set takes no part in the drop unless the Mamba groups take its rules.
                let eagle = self.drop_trailing_hit && !verified[idx] && (w != MAMBA || hy.mamba_eagle);
                let before = curr;
                let got = self.set_hit(hy, idx, hashes, curr, eagle, &mut hits, &mut found);
                for &g in ids {
                    done[g] = true;
                }
                if eagle {
                    verified[idx] = true;
                } else if got < before {
                    verified.fill(false);
                }
                curr = got;
                longest = longest.max(curr);
            }
            if curr >= hit_len {
                break;
            }
            hit_len = curr;
            if hy.lookups.len() == 2 && hy.lookups[0].0 == 0 {
                // One full-attention set and one window set: the window's lookup was capped at the full hit,
                // so the pass agrees (vLLM stops after one pass too).
                break;
            }
        }
        for (g, h) in hits.iter_mut().enumerate() {
            h.truncate((hit_len / hy.block_sizes[g]) as usize);
        }
        fill_ring_hits(hy, &mut hits, (hit_len / bs) as usize);
        hy.set_last_longest((longest / bs) as usize);
        hy.set_last_per_group(false);
        out.extend_from_slice(&hits[hy.primary]);
    }

    /// The blocks filed under unit `f`'s key (`units[f]`, as a hash or an extra key) for every group of `ids`,
    /// into `found`; false if one of them misses.
    fn hit_unit(&self, units: &[BlockHash], f: usize, ids: &[usize], found: &mut Vec<u32>) -> bool {
        found.clear();
        for &g in ids {
            match self.pool.get_cached_key(&group_key(&units[f], g)) {
                Some(b) => found.push(b),
                None => return false,
            }
        }
        true
    }

    /// vLLM's hybrid lookup when a prefix hit can end inside a block (`partial_unit` tokens per unit: full-attention
    /// and align-mode Mamba groups only, no trailing-block drop), over the request's unit hashes `units` and capped
    /// at `max_len` tokens. A full-attention set takes whole blocks from the start, then probes the first missing
    /// block's unit boundaries high to low: the first found ends the hit there (its block the hit's last). A Mamba
    /// set probes unit boundaries right to left: the first found ends the hit, null blocks before its block. The
    /// sets run in order to a fixed point (one pass with a full-attention set and one other), and full-attention
    /// hits are then cut to the blocks the hit touches. Fills `hits` per group; returns the hit in tokens.
    pub fn find_partial_hit(&self, units: &[BlockHash], max_len: u32, hits: &mut Vec<Vec<u32>>) -> u32 {
        self.find_partial_hit_longest(units, max_len, hits).0
    }

    /// `find_partial_hit`, and the longest hit one lookup set found (vLLM's `longest_hit_length`).
    fn find_partial_hit_longest(
        &self,
        units: &[BlockHash],
        max_len: u32,
        hits: &mut Vec<Vec<u32>>,
    ) -> (u32, u32) {
        let (Some(hy), unit) = (self.hybrid.as_deref(), self.partial_unit) else { return (0, 0) };
        if unit == 0 {
            return (0, 0);
        }
        let bs = self.block_size;
        let k = (bs / unit) as usize;
        let ngroups = hy.windows.len();
        hits.resize(ngroups, Vec::new());
        for h in hits.iter_mut() {
            h.clear();
        }
        let mut len_of: Vec<Option<u32>> = vec![None; ngroups];
        let mut found = Vec::new();
        let mut hit_len = max_len;
        let mut longest = 0;
        loop {
            let mut curr = hit_len;
            for (w, ids) in &hy.lookups {
                let first = ids[0];
                if let (0, Some(l)) = (*w, len_of[first]) {
                    curr = curr.min(l);
                    continue;
                }
                for &g in ids {
                    hits[g].clear();
                }
                let mut got = 0;
                if *w == MAMBA {
                    let num_units = ((curr / unit) as usize).min(units.len());
                    for f in (0..num_units).rev() {
                        if self.hit_unit(units, f, ids, &mut found) {
                            for (&g, &b) in ids.iter().zip(found.iter()) {
                                hits[g].resize(f / k, NULL_BLOCK);
                                hits[g].push(b);
                            }
                            got = (f as u32 + 1) * unit;
                            break;
                        }
                    }
                } else {
                    let num_blocks = ((curr / bs) as usize).min(units.len() / k);
                    for i in 0..num_blocks {
                        if !self.hit_unit(units, (i + 1) * k - 1, ids, &mut found) {
                            break;
                        }
                        for (&g, &b) in ids.iter().zip(found.iter()) {
                            hits[g].push(b);
                        }
                    }
                    let whole = hits[first].len();
                    got = whole as u32 * bs;
                    // The first missing block's unit boundaries, high to low.
                    let lo = whole * k;
                    let hi = (lo + k - 1).min((curr / unit) as usize).min(units.len());
                    for f in (lo..hi).rev() {
                        if self.hit_unit(units, f, ids, &mut found) {
                            for (&g, &b) in ids.iter().zip(found.iter()) {
                                hits[g].push(b);
                            }
                            got = (f as u32 + 1) * unit;
                            break;
                        }
                    }
                }
                for &g in ids {
                    len_of[g] = Some(got);
                }
                curr = got;
                longest = longest.max(curr);
            }
            if curr >= hit_len {
                break;
            }
            hit_len = curr;
            if hy.lookups.len() == 2 && hy.lookups[0].0 == 0 {
                break;
            }
        }
        for (w, ids) in &hy.lookups {
            if *w == 0 {
                for &g in ids {
                    hits[g].truncate(hit_len.div_ceil(bs) as usize);
                }
            }
        }
        let n = hits[hy.primary].len();
        fill_ring_hits(hy, hits, n);
        (hit_len, longest)
    }

    /// An admission's lookup when prefix hits can end inside a block (`find_partial_hit` over the request's unit
    /// hashes, leaving out the last of `num_tokens` tokens): group 0's hits go to `out`, every group's to the last
    /// hits, the hit in tokens to `Hybrid::partial_hit_tokens`; the request's shared-prefix junction is the
    /// longest set's hit when it is longer (in tokens, not rounded to a block).
    #[cold]
    pub(crate) fn find_partial_admission_hit(
        &mut self,
        req: &mut Request,
        num_tokens: u32,
        out: &mut Vec<u32>,
    ) {
        let max_len = if self.enable_caching { num_tokens.saturating_sub(1) } else { 0 };
        let mut hits = Vec::new();
        let (hit, longest) = self.find_partial_hit_longest(&req.unit_hashes, max_len, &mut hits);
        req.shared_prefix_boundary = if longest > hit { longest } else { 0 };
        let Some(hy) = self.hybrid.as_deref_mut() else { return };
        if let Some(first) = hits.first() {
            out.extend_from_slice(first);
        }
        hy.partial_hit_tokens = hit;
        hy.partial_longest = longest;
        hy.set_last_longest(0);
        hy.set_last_per_group(false);
        *hy.hits() = hits;
    }

    /// The tokens group 0's `hits` (from the last lookup) cover: its blocks', or with prefix hits inside a block
    /// the lookup's hit.
    pub(crate) fn hit_tokens(&self, hits: &[u32]) -> u32 {
        match self.hybrid.as_deref() {
            Some(hy) if self.partial_unit != 0 && !hits.is_empty() => hy.partial_hit_tokens,
            _ => hits.len() as u32 * self.block_size,
        }
    }

    /// The key an align-mode Mamba group's hit `ghits` is checked under for a state this step writes
    /// (`Hybrid::mamba_cached_step`): its block's key at its position, or with prefix hits inside a block the hit
    /// block's own hash.
    fn mamba_hit_key(&self, req: &Request, g: usize, ghits: &[u32]) -> Option<BlockHash> {
        let &b = ghits.last()?;
        if self.partial_unit != 0 {
            return self.pool.block_hash(b).copied();
        }
        Some(group_key(&req.block_hashes[ghits.len() - 1], g))
    }

    /// The hit of lookup set `idx` (`Hybrid::lookups`) capped at `curr` tokens, into `hits` for each of its groups
    /// (see `find_hybrid_hit`; `eagle`: the set applies the trailing-block drop). Returns its length in tokens.
    #[allow(clippy::too_many_arguments)]
    fn set_hit(
        &self,
        hy: &Hybrid,
        idx: usize,
        hashes: &[BlockHash],
        curr: u32,
        eagle: bool,
        hits: &mut [Vec<u32>],
        found: &mut Vec<u32>,
    ) -> u32 {
        let (bs, align) = (self.block_size, hy.align);
        let hashed = hashes.len() as u32 * bs;
        let (w, ids) = (hy.lookups[idx].0, &hy.lookups[idx].1);
        let first = ids[0];
        let gbs = hy.block_sizes[first];
        let k = (gbs / bs) as usize;
        for &g in ids {
            hits[g].clear();
        }
        // The drop's extra block (none for Mamba).
        let drop = usize::from(eagle && w != MAMBA);
        let cap = if drop == 1 { (curr + gbs).min(hashed) } else { curr };
        let nblocks = (cap / gbs) as usize;
        if w == MAMBA {
            // Right to left: the first block every Mamba group has cached, null blocks before it.
            for i in (0..nblocks).rev() {
                if self.hit_all(hashes, i, k, ids, found) {
                    for (&g, &b) in ids.iter().zip(found.iter()) {
                        hits[g].resize(i, NULL_BLOCK);
                        hits[g].push(b);
                    }
                    break;
                }
            }
        } else if w == 0 {
            for i in 0..nblocks {
                if !self.hit_all(hashes, i, k, ids, found) {
                    break;
                }
                for (&g, &b) in ids.iter().zip(found.iter()) {
                    hits[g].push(b);
                }
            }
        } else if let Some(c) = chunk_size(w) {
            // Null blocks before the chunk that holds token `nblocks * bs`, then the cached blocks from there on,
            // up to the first miss.
            let end = u64::from(gbs) * nblocks as u64;
            let start = (end / u64::from(c) * u64::from(c) / u64::from(gbs)) as usize;
            for &g in ids {
                hits[g].resize(start, NULL_BLOCK);
            }
            for i in start..nblocks {
                if !self.hit_all(hashes, i, k, ids, found) {
                    break;
                }
                for (&g, &b) in ids.iter().zip(found.iter()) {
                    hits[g].push(b);
                }
            }
        } else {
            // Right to left: the first run of `need` cached blocks whose end (after the drop) lies on the
            // alignment, nulls before it; else the run from block 0, cut to the alignment. `run` counts the
            // current run, which ends at `end` (exclusive).
            let need = (w - 1).div_ceil(gbs) as usize + drop;
            let mut run = 0usize;
            let mut end = 0usize;
            let mut matched = false;
            for i in (0..nblocks).rev() {
                if self.hit_all(hashes, i, k, ids, found) {
                    if run == 0 {
                        if (i + 1 - drop) as u32 * gbs % align != 0 {
                            continue;
                        }
                        end = i + 1;
                    }
                    run += 1;
                    if run >= need {
                        matched = true;
                        break;
                    }
                } else {
                    run = 0;
                }
            }
            let (start, mut len) = if matched { (end - run, end) } else { (0, run) };
            if !matched {
                while len as u32 * gbs % align != 0 {
                    len -= 1;
                }
            }
            for &g in ids {
                hits[g].resize(start.min(len), NULL_BLOCK);
                for i in start..len {
                    let b = self.pool.get_cached_block(&group_key(&hashes[(i + 1) * k - 1], g));
                    hits[g].push(b.unwrap_or(NULL_BLOCK));
                }
            }
        }
        for &g in ids {
            if drop == 1 && !hits[g].is_empty() {
                hits[g].pop();
            }
            if w != 0 && w != MAMBA {
                // A window's run after the drop: back to the alignment.
                while hits[g].len() as u32 * gbs % align != 0 {
                    hits[g].pop();
                }
            }
        }
        let mut got = hits[first].len() as u32 * gbs;
        if w == 0 {
            // A full-attention hit rounded down to the alignment.
            got -= got % align;
            for &g in ids {
                hits[g].truncate((got / gbs) as usize);
            }
        }
        got
    }

    /// The local hit of a request admitted with a KV connector that completes divergent local hits
    /// (`SchedulerConfig::divergent_local_hits`, vLLM's `get_computed_blocks_for_connector`), with Mamba groups
    /// and a full-attention set: every set looked up alone, capped at the same `num_tokens` (with the drop, each
    /// set but a Mamba set looks one block further and gives up its hit's last block), each group keeping its own
    /// hit. `None` (nothing written) when a group's hit runs deeper than the full-attention set's, or without
    /// Mamba groups or full attention: the caller takes `find_longest_cache_hit`. Otherwise `out` gets as many
    /// entries as the full-attention hit has blocks (group 0's hits where it has them, null blocks after), and
    /// the answer is whether some group's hit (0 for a group outside every lookup set) is shorter: the hit
    /// *diverged*.
    #[cold]
    pub(crate) fn find_hybrid_hit_per_group(
        &self,
        hashes: &[BlockHash],
        num_tokens: u32,
        out: &mut Vec<u32>,
    ) -> Option<bool> {
        let hy = self.hybrid.as_deref()?;
        if !hy.windows.contains(&MAMBA) || hy.lookups.first().is_none_or(|l| l.0 != 0) {
            return None;
        }
        let bs = self.block_size;
        let max = self.max_hit_blocks(hashes, num_tokens) as u32 * bs;
        let mut hits = hy.hits();
        for h in hits.iter_mut() {
            h.clear();
        }
        let mut found = Vec::new();
        let mut lens = vec![0u32; hy.windows.len()];
        for (idx, (_, ids)) in hy.lookups.iter().enumerate() {
            let got = self.set_hit(hy, idx, hashes, max, self.drop_trailing_hit, &mut hits, &mut found);
            for &g in ids {
                lens[g] = got;
            }
        }
        let fa = lens[hy.lookups[0].1[0]];
        // A ring or a replayed window takes no part in the hit.
        for (g, &w) in hy.windows.iter().enumerate() {
            if w == RING || hy.is_replay(g) {
                lens[g] = fa;
            }
        }
        fill_ring_hits(hy, &mut hits, (fa / bs) as usize);
        if lens.iter().any(|&l| l > fa) {
            return None;
        }
        let n = (fa / bs) as usize;
        let start = out.len();
        out.extend(hits[0].iter().take(n));
        out.resize(start + n, NULL_BLOCK);
        hy.set_last_longest(0);
        hy.set_last_per_group(true);
        Some(lens.iter().any(|&l| l < fa))
    }

    /// The other groups' hits that go with group 0's `hits` (from the lookup that found them).
    pub(crate) fn hybrid_hits(&self, hits: &[u32]) -> Vec<Vec<u32>> {
        let Some(hy) = self.hybrid.as_deref() else { return Vec::new() };
        if hits.is_empty() {
            return vec![Vec::new(); hy.windows.len()];
        }
        let last = hy.hits();
        // (A lookup whose hits can end inside a block hands out group 0's hits, the others the primary group's.)
        debug_assert!(
            hy.last_per_group() || last[0] == hits || last[hy.primary] == hits,
            "the hits come from the last lookup"
        );
        last.clone()
    }

    /// `has_cached_prefix` over every group: a hit of at least one block valid for every group.
    #[cold]
    pub(crate) fn hybrid_has_cached_prefix(&self, hashes: &[BlockHash], num_tokens: u32) -> bool {
        let mut out = Vec::new();
        self.find_hybrid_hit(hashes, num_tokens, &mut out);
        !out.is_empty()
    }

    /// Whether an align-mode Mamba group `g`'s allocation computing `req`'s tokens `start..end` reserves a prefill
    /// checkpoint block (`align_checkpoint` with this manager's settings and the group's table).
    pub(crate) fn align_checkpoint_of(
        &self,
        req: &Request,
        g: usize,
        allocated: bool,
        start: u32,
        end: u32,
    ) -> bool {
        let Some(hy) = self.hybrid.as_deref() else { return false };
        let table = table_ref(req, hy.slot(g));
        align_checkpoint(
            hy,
            self.block_size,
            self.partial_unit,
            self.drop_trailing_hit,
            req,
            table,
            allocated,
            start,
            end,
        )
        .is_some()
    }

    /// `full_sequence_fits`' blocks over every group: each group's as with one group (a window's capped at its
    /// admission cap, its blocks before the window of the first computed token, after the hits and the `ext`
    /// loaded tokens, becoming null blocks; an align-mode Mamba group's prefill checkpoint after `computed`).
    #[cold]
    pub(crate) fn hybrid_sequence_need(&self, req: &Request, hits: &[u32], computed: u32, ext: u32) -> usize {
        let Some(hy) = self.hybrid.as_deref() else { return 0 };
        let all_hits = self.hybrid_hits(hits);
        let num_slots = req.num_tokens().min(self.max_slots);
        let hit_tokens = self.hit_tokens(hits);
        // (The tokens computed once the hit and the loaded tokens are in: an align-mode Mamba group's checkpoint
        // chunk starts there.)
        let total_computed = (computed + hit_tokens + ext).min(num_slots);
        // A hit ending inside a block: one more block per group, the copy of the hit's last.
        let partial = hit_tokens % self.block_size != 0;
        let mut total = 0;
        for (g, &w) in hy.windows.iter().enumerate() {
            let gbs = hy.block_sizes[g];
            let required = num_slots.div_ceil(gbs) as usize;
            let held = table_ref(req, hy.slot(g)).len();
            if w == CROSS_ATTENTION {
                total += if req.blocks.is_empty() { self.cross_blocks_to_add(req, held) } else { 0 };
                continue;
            }
            if w == RING {
                // A ring's one block, if the request holds none.
                total += usize::from(held == 0);
                continue;
            }
            if w == MAMBA && hy.mamba_align {
                let ghits = &all_hits[g];
                if let Some(&b) = ghits.last() {
                    // A hit on a state this step writes: never fits in this step.
                    if self.mamba_hit_key(req, g, ghits).is_some_and(|k| hy.mamba_cached_step.contains(&k)) {
                        return self.pool.num_blocks() as usize + 1;
                    }
                    total += usize::from(self.pool.ref_cnt(b) == 0);
                }
                let allocated = hy.slot(g).is_some_and(|i| req.groups[i].mamba_allocated);
                let entries = required + hy.mamba_blocks - 1;
                let checkpoint = self.align_checkpoint_of(req, g, allocated, total_computed, num_slots);
                let copy = partial || req.partial_hits.iter().any(|p| p.0 == g);
                total += align_need(entries, held + ghits.len(), hy.mamba_blocks, allocated, checkpoint, copy)
                    .max(0) as usize;
                continue;
            }
            if w == MAMBA {
                total += if req.blocks.is_empty() { hy.mamba_blocks.saturating_sub(held) } else { 0 };
                continue;
            }
            // A replayed window takes nothing from its hit (its null blocks only carry the hit's length).
            let hits: &[u32] = if hy.is_replay(g) { &[] } else { &all_hits[g] };
            if w == 0 {
                let evictable = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
                total += required.saturating_sub(held + hits.len()) + evictable + usize::from(partial);
                continue;
            }
            let required = required.min(hy.caps[g]);
            if held > 0 {
                total += required.saturating_sub(held);
                continue;
            }
            let computed = hit_tokens + ext;
            let skipped = (group_skipped(w, computed, self.extra_retained) / gbs) as usize;
            let kept = &hits[skipped.min(hits.len())..];
            let evictable = kept.iter().filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0).count();
            total += required.saturating_sub(skipped.max(hits.len())) + evictable;
        }
        total
    }

    /// `allocate_slots` over every group (see the module's comment); `hits` are the primary group's.
    #[allow(clippy::too_many_arguments)]
    #[cold]
    pub(crate) fn allocate_hybrid_slots(
        &mut self,
        req: &mut Request,
        computed: u32,
        num_new_tokens: u32,
        hits: &[u32],
        num_lookahead_tokens: u32,
        reserved: usize,
        cache: bool,
        in_flight: u32,
    ) -> Option<usize> {
        let all_hits = self.hybrid_hits(hits);
        let hy = self.hybrid.as_deref()?;
        let (windows, mamba_blocks, align) = (hy.windows.clone(), hy.mamba_blocks, hy.mamba_align);
        let replay: Vec<bool> = (0..windows.len()).map(|g| hy.is_replay(g)).collect();
        let slots: Vec<Option<usize>> = (0..windows.len()).map(|g| hy.slot(g)).collect();
        let (bs, eagle, unit) = (self.block_size, self.drop_trailing_hit, self.partial_unit);
        let hit_tokens = self.hit_tokens(hits);
        let total_computed = computed + hit_tokens;
        let processed = total_computed.saturating_sub(in_flight);
        // A hit ending inside a block: each group copies that block into a block of its own before writing to it.
        let partial = hit_tokens % bs != 0;
        let sizes = hy.block_sizes.clone();
        for (g, &w) in windows.iter().enumerate() {
            if is_window(w) {
                self.remove_group_skipped(req, slots[g], w, sizes[g], processed);
            } else if w == MAMBA && align {
                self.remove_mamba_skipped(req, slots[g], processed);
            }
        }
        let fresh = req.blocks.is_empty();
        let num_slots = total_computed + num_new_tokens + num_lookahead_tokens;
        // Align-mode Mamba groups: the state's tokens (no lookahead) and the entries that wants.
        let mamba_tokens = total_computed + num_new_tokens;
        let mamba_entries = mamba_tokens.div_ceil(bs) as usize + (mamba_blocks - 1);
        // Per group: the null blocks before the window (a new request's), and the blocks to pop.
        let mut plan: Vec<(usize, usize)> = Vec::with_capacity(windows.len());
        // Per group: the blocks of the external tokens, popped for every group before the other new blocks, and
        // (align-mode Mamba groups) the null blocks before them.
        let mut ext_plan: Vec<(usize, usize, usize)> = Vec::new();
        // A new request's tokens computed before its allocation are the KV connector's (external).
        let ext_tokens = if fresh { computed } else { 0 };
        let mut total_need = 0;
        // Align-mode Mamba groups' counts, which can be negative (vLLM sums them as they are).
        let mut mamba_need: i64 = 0;
        // The blocks align-mode Mamba groups pop beyond their counts (a load's state block, see below).
        let mut mamba_uncounted: i64 = 0;
        let mut evictable = 0;
        // Evictable hits counted but never touched (a local hit's state below a load's): they stay free.
        let mut untouched = 0;
        // Each group's table length before the allocation (an attention group of another block size than the
        // primary's reports the blocks it appended as its new block ids).
        let before: Vec<usize> = slots.iter().map(|&slot| table_ref(req, slot).len()).collect();
        for (g, &w) in windows.iter().enumerate() {
            let held = before[g];
            let gbs = sizes[g];
            if w == MAMBA && align {
                // A prefix hit (a new request's): the state block at its end, null blocks before it.
                let ghits = &all_hits[g];
                if let Some(&b) = ghits.last() {
                    // Its state is written by this step (another request cached it): not before the next step.
                    let key = self.mamba_hit_key(req, g, ghits);
                    if key.is_some_and(|k| {
                        self.hybrid.as_deref().is_some_and(|hy| hy.mamba_cached_step.contains(&k))
                    }) {
                        return None;
                    }
                    evictable += usize::from(self.pool.ref_cnt(b) == 0);
                }
                let allocated = slots[g].is_some_and(|i| req.groups[i].mamba_allocated);
                // The prefill checkpoint, kept for `grow_mamba_align` and the caching (even if the allocation
                // fails: the next one replaces it).
                let checkpoint = match (self.hybrid.as_deref(), slots[g]) {
                    (Some(hy), Some(i)) => {
                        let t = &req.groups[i].blocks;
                        let c = align_checkpoint(
                            hy,
                            bs,
                            unit,
                            eagle,
                            req,
                            t,
                            allocated,
                            total_computed,
                            mamba_tokens,
                        );
                        req.groups[i].mamba_checkpoint = c;
                        c.is_some()
                    }
                    _ => false,
                };
                let copy = partial || req.partial_hits.iter().any(|p| p.0 == g);
                let counted =
                    align_need(mamba_entries, held + ghits.len(), mamba_blocks, allocated, checkpoint, copy);
                mamba_need += counted;
                if ext_tokens > 0 && held == 0 {
                    // A load's state (vLLM's `allocate_external_computed_blocks`): null blocks before the block
                    // of the last loaded token, which is popped with the other groups' external blocks. The
                    // growth then pops the rest; its count above does not include that block when the chunk
                    // reaches a later block (vLLM counts it so too). A local hit's state lies below the loaded
                    // tokens: counted above as vLLM counts it, but neither touched nor kept.
                    let pad = ((total_computed - 1) / bs) as usize;
                    ext_plan.push((g, pad, 1));
                    let skipped = mamba_entries - mamba_blocks;
                    let popped = 1 + mamba_entries - (pad + 1).max(skipped);
                    mamba_uncounted += popped as i64 - counted;
                    untouched += ghits.last().map_or(0, |&b| usize::from(self.pool.ref_cnt(b) == 0));
                }
                plan.push((ghits.len().saturating_sub(1), 0));
                continue;
            }
            if w == CROSS_ATTENTION || w == MAMBA || w == RING {
                // The encoder output's, the state's or the ring's blocks, at the first allocation only.
                let need = match (fresh, w) {
                    (false, _) => 0,
                    (true, CROSS_ATTENTION) => self.cross_blocks_to_add(req, held),
                    (true, RING) => usize::from(held == 0),
                    (true, _) => mamba_blocks.saturating_sub(held),
                };
                if (w == MAMBA || w == RING) && ext_tokens > 0 && need > 0 {
                    // A load's state block is popped with the other groups' external blocks (vLLM's
                    // `allocate_external_computed_blocks`: the state's one block of `max_model_len` tokens), the
                    // speculative blocks after them.
                    ext_plan.push((g, 0, 1));
                }
                total_need += need;
                plan.push((0, need));
                continue;
            }
            let skipped_tokens =
                if fresh && w != 0 { group_skipped(w, total_computed, self.extra_retained) } else { 0 };
            let skipped = (skipped_tokens / gbs) as usize;
            // A replayed window takes nothing from its hit (its null blocks only carry the hit's length): the
            // hit's window gets fresh blocks.
            let ghits: &[u32] = if replay[g] { &[] } else { &all_hits[g] };
            let need = self.blocks_to_add_sized(held + skipped.max(ghits.len()), num_slots, gbs)
                + usize::from(partial);
            let kept = &ghits[skipped.min(ghits.len())..];
            evictable += kept.iter().filter(|&&b| b != NULL_BLOCK && self.pool.ref_cnt(b) == 0).count();
            total_need += need;
            // The external tokens' blocks: vLLM pops them for every group first (`allocate_external_computed_blocks`),
            // unless the window skips them all.
            let ext =
                if skipped_tokens > 0 { ext_tokens.min(total_computed - skipped_tokens) } else { ext_tokens };
            if ext > 0 {
                let held_after_hits = held + skipped.max(ghits.len());
                let ext_need =
                    (total_computed.div_ceil(gbs) as usize).saturating_sub(held_after_hits).min(need);
                ext_plan.push((g, 0, ext_need));
            }
            plan.push((skipped, need));
        }
        let free = self.pool.num_free_blocks() as i64;
        if (total_need + evictable + reserved) as i64 + mamba_need > free {
            return None;
        }
        if mamba_uncounted > 0
            && (total_need + evictable - untouched) as i64 + mamba_need + mamba_uncounted > free
        {
            // The pool lacks the block the count left out (the blocks popped and touched exceed the free ones):
            // vLLM's pool raises there; the allocation fails.
            return None;
        }
        for (g, &(skipped, _)) in plan.iter().enumerate() {
            let loaded_state = windows[g] == MAMBA && align && ext_tokens > 0;
            if windows[g] == CROSS_ATTENTION
                || windows[g] == RING
                || (windows[g] == MAMBA && all_hits[g].is_empty())
                || loaded_state
            {
                continue;
            }
            let ghits: &[u32] = if replay[g] { &[] } else { &all_hits[g] };
            let kept = &ghits[skipped.min(ghits.len())..];
            // A chunked-local hit can hold null blocks past the skipped ones (its nulls end at a chunk, the
            // skipped blocks at the chunk of the hit's end, which may start lower): never touched.
            let nulls = kept.iter().take_while(|&&b| b == NULL_BLOCK).count();
            self.pool.touch(&kept[nulls..]);
            let (blocks, num_cached) = table(req, slots[g]);
            blocks.extend(std::iter::repeat_n(NULL_BLOCK, skipped));
            blocks.extend_from_slice(kept);
            *num_cached += (skipped + kept.len()) as u32;
            if let (true, Some(&last)) = (partial, kept.last()) {
                // The block the hit ends inside, copied by the growth below; cached once its copy is full.
                let idx = (hit_tokens / bs) as usize;
                *num_cached = idx as u32;
                req.partial_hits.push((g, idx, last));
            }
        }
        let mut popped = total_need;
        for &(g, pad, ext_need) in &ext_plan {
            let (blocks, _) = table(req, slots[g]);
            if pad > blocks.len() {
                blocks.resize(pad, NULL_BLOCK);
            }
            if ext_need > 0 {
                self.pool.allocate_into(ext_need, blocks);
                // Zeroed unless the group holds no attention blocks or an asynchronous load writes them.
                if let Some(hy) = self.hybrid.as_deref_mut() {
                    if windows[g] != MAMBA && windows[g] != RING && !hy.skip_zero.contains(&g) {
                        if let Some(zero) = hy.zero_ids.get_mut(g) {
                            zero.extend_from_slice(&blocks[blocks.len() - ext_need..]);
                        }
                    }
                }
            }
            if windows[g] == MAMBA && align {
                popped += ext_need;
            } else {
                plan[g].1 -= ext_need;
            }
        }
        for (g, &(_, need)) in plan.iter().enumerate() {
            let copy = req.partial_hits.iter().position(|p| p.0 == g).map(|j| req.partial_hits.remove(j));
            if windows[g] == MAMBA && align {
                if let Some(i) = slots[g] {
                    let copy = copy.map(|(_, idx, b)| (idx, b));
                    popped +=
                        self.grow_mamba_align(&mut req.groups[i], g, mamba_entries, mamba_blocks - 1, copy);
                }
                continue;
            }
            if let Some((_, idx, source)) = copy {
                // The first block popped is the copy of the block the hit ends inside.
                let mut cow = Vec::with_capacity(1);
                self.pool.allocate_into(1, &mut cow);
                self.apply_copy(table(req, slots[g]).0, g, idx, source, cow[0]);
                if let Some(zero) = self.hybrid.as_deref_mut().and_then(|hy| hy.zero_ids.get_mut(g)) {
                    zero.push(cow[0]);
                }
            }
            let need = need - usize::from(copy.is_some());
            if need > 0 {
                let (blocks, _) = table(req, slots[g]);
                self.pool.allocate_into(need, blocks);
                if let Some(zero) = self.hybrid.as_deref_mut().and_then(|hy| hy.zero_ids.get_mut(g)) {
                    if windows[g] != MAMBA && windows[g] != RING {
                        zero.extend_from_slice(&blocks[blocks.len() - need..]);
                    }
                }
            }
        }
        for (g, &slot) in slots.iter().enumerate() {
            if windows[g] != MAMBA && windows[g] != CROSS_ATTENTION && windows[g] != RING && sizes[g] != bs {
                if let Some(i) = slot {
                    req.groups[i].mamba_appended = (req.groups[i].blocks.len() - before[g]) as u32;
                }
            }
        }
        // Each group from its own count of cached blocks (see `cache_blocks`).
        if cache && self.enable_caching {
            self.cache_hybrid_blocks(req, (total_computed + num_new_tokens).min(req.num_tokens()));
        }
        Some(popped)
    }

    /// An align-mode Mamba group's `remove_skipped_blocks` with `processed` tokens processed: the entries below
    /// `(processed - 1) / bs` go back to the pool (deepest first, null blocks skipped, one call). (vLLM then also
    /// frees the state entry its allocation before the last kept, `last_state_block_idx`, when it lies below
    /// `ceil(processed / bs) - 1`: always one of those entries, already freed.)
    fn remove_mamba_skipped(&mut self, req: &mut Request, slot: Option<usize>, processed: u32) {
        let Some(i) = slot else { return };
        let bs = self.block_size;
        let t = &mut req.groups[i];
        if processed > 1 {
            let last = ((processed - 1) / bs) as usize;
            let last = last.min(t.blocks.len());
            let freed: Vec<u32> = t.blocks[..last].iter().copied().filter(|&b| b != NULL_BLOCK).collect();
            if !freed.is_empty() {
                self.pool.free_blocks(&freed);
                t.blocks[..last].fill(NULL_BLOCK);
            }
        }
    }

    /// An align-mode Mamba group's `allocate_new_blocks`: grows table `t` to `entries` entries (see `hybrid.rs`),
    /// `spec` of them speculative. With a prefill checkpoint (`t.mamba_checkpoint`) the entry below the running
    /// state's stays a real block: the padding stops one short, and a speculative block there stays. Returns the
    /// blocks popped.
    fn grow_mamba_align(
        &mut self,
        t: &mut GroupTable,
        g: usize,
        entries: usize,
        spec: usize,
        copy: Option<(usize, u32)>,
    ) -> usize {
        let prev = t.blocks.len();
        t.mamba_appended = 0;
        let checkpoint = usize::from(t.mamba_checkpoint.is_some());
        if entries <= prev && checkpoint == 0 && copy.is_none() {
            t.mamba_allocated = true;
            return 0;
        }
        let skipped = entries - spec - 1;
        let null_end = skipped.saturating_sub(checkpoint);
        if prev < null_end {
            t.blocks.resize(null_end, NULL_BLOCK);
        }
        if t.mamba_allocated {
            for idx in prev - spec..prev {
                if idx + checkpoint >= skipped {
                    break;
                }
                let b = t.blocks[idx];
                t.blocks.push(b);
                t.blocks[idx] = NULL_BLOCK;
            }
        }
        let mut copied = 0;
        if let Some((idx, source)) = copy {
            let mut cow = Vec::with_capacity(1);
            self.pool.allocate_into(1, &mut cow);
            let cow = cow[0];
            copied = 1;
            if t.mamba_allocated {
                // The request's own cached prompt tail: it keeps writing into its block, so the cache entry moves
                // to the copy (filled by this step's copy: a hit on it waits for the next step).
                self.pool.move_block_hashes(source, cow);
                self.pool.touch(&[source]);
                let moved = self.pool.block_hash(cow).copied();
                if let Some(hy) = self.hybrid.as_deref_mut() {
                    hy.cow_copies[g].push((source, cow));
                    if let Some(k) = moved {
                        hy.mamba_cached_step.insert(k);
                    }
                }
            } else {
                self.apply_copy(&mut t.blocks, g, idx, source, cow);
            }
        }
        let need = entries.saturating_sub(t.blocks.len());
        self.pool.allocate_into(need, &mut t.blocks);
        t.mamba_allocated = true;
        t.mamba_appended = (t.blocks.len() - prev) as u32;
        need + copied
    }

    /// A hit ending inside block `source` (entry `idx` of group `g`'s table `blocks`): `cow` takes its place and
    /// a copy `source -> cow` is queued; both stay referenced until the copies are handed out (the source keeps
    /// the hit's reference, `cow` takes one more).
    fn apply_copy(&mut self, blocks: &mut [u32], g: usize, idx: usize, source: u32, cow: u32) {
        blocks[idx] = cow;
        self.pool.touch(&[cow]);
        if let Some(hy) = self.hybrid.as_deref_mut() {
            hy.cow_copies[g].push((source, cow));
        }
    }

    /// The copies queued since the current `schedule()` call began, group by group, into `out` as `(source,
    /// destination)`; the extra references of their blocks go back (source, destination, source, ...), as vLLM
    /// frees them after the step's admissions.
    #[cold]
    pub(crate) fn take_block_copies(&mut self, out: &mut Vec<(u32, u32)>) {
        let Some(hy) = self.hybrid.as_deref_mut() else { return };
        let start = out.len();
        for per_group in &mut hy.cow_copies {
            out.append(per_group);
        }
        if out.len() > start {
            // `free_blocks` releases its list from the end.
            let retained: Vec<u32> = out[start..].iter().rev().flat_map(|&(s, d)| [d, s]).collect();
            self.pool.free_blocks(&retained);
        }
    }

    /// The blocks a cross-attention group's table of `held` blocks still needs for the request's encoder output.
    fn cross_blocks_to_add(&self, req: &Request, held: usize) -> usize {
        (req.cross_attention_tokens.div_ceil(self.block_size) as usize).saturating_sub(held)
    }

    /// `remove_skipped_blocks` of the group at `slot` with window (or chunked-local entry) `w`.
    fn remove_group_skipped(
        &mut self,
        req: &mut Request,
        slot: Option<usize>,
        w: u32,
        block_size: u32,
        processed: u32,
    ) {
        let (blocks, _) = table(req, slot);
        let last =
            ((group_skipped(w, processed, self.extra_retained) / block_size) as usize).min(blocks.len());
        let mut first = last;
        while first > 0 && blocks[first - 1] != NULL_BLOCK {
            first -= 1;
        }
        if first < last {
            self.pool.free_blocks(&blocks[first..last]);
            blocks[first..last].fill(NULL_BLOCK);
        }
    }

    /// Enters each group's full blocks among the first `computed` tokens, less the reprefillable tail (see
    /// `cacheable`), into the prefix cache under the group's keys (null blocks skipped; a window of one token
    /// caches nothing; an align-mode Mamba group under sparse retention caches the states `mamba_retained` keeps,
    /// and the prompt's checkpoint when the tokens being cached end there), group by group, each group's run
    /// recorded as one stored event with events on. Mamba groups outside the trailing-block drop's rules
    /// (`mamba_eagle` off) keep the reprefillable tail: vLLM's hybrid coordinator cuts it in the drop's groups
    /// only.
    #[cold]
    pub(crate) fn cache_hybrid_blocks(&mut self, req: &mut Request, computed: u32) {
        let Some(hy) = self.hybrid.as_deref() else { return };
        let windows = hy.windows.clone();
        let slots: Vec<Option<usize>> = (0..windows.len()).map(|g| hy.slot(g)).collect();
        // The tokens every group caches: the tokens rounded down to the alignment (vLLM's hybrid coordinator caches
        // a scheduler-block-aligned prefix in each group), of which each group caches the full blocks whose hashes
        // exist (`hashed`: look-ahead hashes can end before them, and a group of smaller blocks then caches more).
        let aligned_of =
            |tokens: u32| tokens.min(req.blocks.len() as u32 * self.block_size) / hy.align * hy.align;
        let hashed = req.block_hashes.len() as u32 * self.block_size;
        let num_tokens = self.cacheable(computed);
        let aligned_tokens = aligned_of(num_tokens);
        let sizes = hy.block_sizes.clone();
        let align = hy.mamba_align;
        let defer_new_states_only = hy.defer_new_states_only;
        let bs = self.block_size;
        // Sparse retention: the positions a later request can resume at, and the prompt's checkpoint block when
        // the tokens being cached end there (vLLM's `_cache_partial_tail_block` with whole-block hashes).
        // With the trailing-block drop, Mamba groups resume where the windows do (`window_reachable`: a resend's
        // and a longer sibling's positions and the junction, each also one block lower), and the prompt's
        // checkpoint lies one block lower.
        let eagle = self.drop_trailing_hit;
        // Mamba groups that do not take the drop's rules (`mamba_eagle` off) cache their tokens floored to a block
        // and keep no state one block below the junction.
        let mamba_eagle = eagle && hy.mamba_eagle;
        let retention = hy.retention.filter(|_| align);
        let prompt_checkpoint = mamba_checkpoint(req.num_prompt_tokens, bs, eagle, hy.hash_lookahead);
        // A prefill checkpoint is the prompt's when it lies at its last unit boundary with prefix hits inside a block.
        let checkpoint_of_prompt = if self.partial_unit != 0 {
            mamba_checkpoint(req.num_prompt_tokens, self.partial_unit, eagle, hy.hash_lookahead)
        } else {
            prompt_checkpoint
        };
        // Sparse retention of the window groups' blocks (`window_retained`) and the Mamba groups' states.
        let window_retention = hy.retention;
        let (junction, below) = (req.shared_prefix_boundary, hy.junction_below);
        let window_reach =
            window_retention.map(|_| window_reachable(req.num_prompt_tokens, junction, bs, eagle, below));
        // Groups of different block sizes: a window keeps the blocks a hit aligned to `hy.align` can use.
        let (hit_align, sized) = (hy.align, sizes.iter().any(|&s| s != bs));
        // (vLLM's `get_num_cacheable_tokens` for a group that takes the drop, once an aligned prefix is computed.)
        let eagle_extra = eagle && sized && aligned_of(computed) > 0;
        // The Mamba groups resume where the windows do, but for groups outside the drop's rules, which keep
        // nothing one block below the junction.
        let mamba_reach = window_reach
            .as_ref()
            .filter(|_| below && !hy.mamba_eagle)
            .map(|_| window_reachable(req.num_prompt_tokens, junction, bs, eagle, false));
        let window_positions: &[u32] = window_reach.as_deref().unwrap_or(&[]);
        let reachable: &[u32] = mamba_reach.as_deref().unwrap_or(window_positions);
        // Mamba groups outside the drop's rules: the computed tokens with the reprefillable tail.
        let (mamba_tokens, mamba_aligned) = if eagle && !mamba_eagle {
            (computed / bs * bs, aligned_of(computed))
        } else {
            (num_tokens, aligned_tokens)
        };
        // (With prefix hits inside a block the prompt's tail is keyed at its unit instead: `cache_partial_tail`.)
        let tail = retention.filter(|_| self.partial_unit == 0).and_then(|_| {
            (mamba_tokens > 0 && mamba_tokens == prompt_checkpoint)
                .then(|| (prompt_checkpoint / bs) as usize - 1)
        });
        let replay: Vec<bool> = (0..windows.len()).map(|g| hy.is_replay(g)).collect();
        for (g, &w) in windows.iter().enumerate() {
            // Never cached: cross attention, rings, Mamba groups outside align mode, replayed windows.
            if w == CROSS_ATTENTION || w == RING || (w == MAMBA && !align) || replay[g] {
                continue;
            }
            // A prefill checkpoint of the group's last allocation: re-keyed below, and no prompt tail then.
            let checkpoint = slots[g].and_then(|i| req.groups[i].mamba_checkpoint).filter(|_| w == MAMBA);
            let tail = if checkpoint.is_some() { None } else { tail };
            let first = *table(req, slots[g]).1 as usize;
            let k = (sizes[g] / bs) as usize;
            // With the trailing-block drop a group also caches the block of its own size past the aligned tokens
            // (vLLM's hit looks one block further, then gives it up).
            let group_tokens = if w == MAMBA {
                mamba_aligned
            } else if eagle_extra {
                num_tokens.min(aligned_tokens + sizes[g])
            } else {
                aligned_tokens
            };
            let num_full = (group_tokens.min(hashed) / sizes[g]) as usize;
            if w == MAMBA && checkpoint.is_none() && !defer_new_states_only && self.partial_unit == 0 {
                // With the drop vLLM hands a Mamba group its cacheable tokens unfloored: only a call whose tokens
                // end at the checkpoint itself re-keys it.
                let exact = !mamba_eagle || num_tokens % bs == 0;
                let num_tokens = if exact { mamba_tokens } else { 0 };
                self.mark_prompt_checkpoint(req, slots[g], g, num_tokens, prompt_checkpoint);
            }
            // A full-attention group of blocks larger than the hash block files the prompt's tail.
            let tail_entry = w == 0 && sizes[g] != bs;
            if num_full <= first {
                if let Some(c) = checkpoint {
                    self.cache_mamba_checkpoint(req, slots[g], g, c, checkpoint_of_prompt);
                }
                if tail_entry {
                    self.cache_prompt_tail(req, slots[g], g, group_tokens);
                }
                if self.partial_unit != 0 {
                    self.cache_partial_tail(req, slots[g], g, w, num_tokens);
                }
                continue;
            }
            let sparse = if w == MAMBA { retention } else { None };
            let window_sparse = match (&window_reach, window_retention) {
                (Some(reach), Some(r)) if is_window(w) && chunk_size(w).is_none() => {
                    Some((r, reach.as_slice()))
                }
                _ => None,
            };
            let window_sized = sized && is_window(w) && chunk_size(w).is_none();
            let gbs = sizes[g];
            // (Among groups of different block sizes the resend and sibling positions are at the scheduler block,
            // the junction's lower one at the group's block.)
            let sized_positions = match window_retention {
                Some(_) if window_sized => {
                    window_reachable_at(req.num_prompt_tokens, junction, hit_align, gbs, eagle, below)
                }
                _ => Vec::new(),
            };
            let kept = |i: usize| match (sparse, window_sparse) {
                _ if window_sized => {
                    window_kept(i, gbs, hit_align, w, eagle, window_retention, &sized_positions)
                }
                (Some(r), _) => mamba_retained(i, bs, r, reachable) || tail == Some(i),
                (None, Some((r, reach))) => window_retained(i, bs, w, eagle, r, reach),
                (None, None) => true,
            };
            // (A window of one token caches nothing, no block being able to start a hit, but with the drop, whose
            // hit reads one block past the boundary.)
            let caches = w != 1 || eagle;
            if caches {
                for i in first..num_full {
                    let b = table_ref(req, slots[g])[i];
                    if b != NULL_BLOCK && kept(i) {
                        let key = group_key(&req.block_hashes[(i + 1) * k - 1], g);
                        if let Some(h) = self.pool.block_hash(b).copied() {
                            // A prefill checkpoint keyed one block lower (with the drop) moves up to its entry.
                            self.pool.uncache(b, &h);
                        }
                        self.pool.cache_block_rekey(b, key);
                        self.pool.set_event_group(b, g);
                        self.newly_cached.push((b, key));
                        if w == MAMBA {
                            if let Some(hy) = self.hybrid.as_deref_mut() {
                                hy.mamba_cached_step.insert(key);
                            }
                        }
                    }
                }
            }
            *table(req, slots[g]).1 = num_full as u32;
            if self.pool.events_mut().is_some() {
                let blocks = table_ref(req, slots[g]).to_vec();
                self.record_group_stored(req, &blocks, first, num_full, g, &|i| caches && kept(i));
            }
            if tail_entry {
                self.cache_prompt_tail(req, slots[g], g, group_tokens);
            }
            if let Some(c) = checkpoint {
                self.cache_mamba_checkpoint(req, slots[g], g, c, checkpoint_of_prompt);
            }
            if self.partial_unit != 0 {
                self.cache_partial_tail(req, slots[g], g, w, num_tokens);
            }
            if w == MAMBA {
                self.offer_boundary_states(req, slots[g], g, first, num_full);
            }
        }
    }

    /// With prefix hits inside a block, after group `g`'s full blocks among `num_tokens` were cached: the prompt's
    /// last unit boundary short of its last token, when it ends inside a block, files that block under the
    /// boundary's key (vLLM's `_cache_partial_tail_block`). Full attention does so once the tokens reach the
    /// boundary; an align-mode Mamba group only when the tokens end exactly there (its state block then holds the
    /// state at the boundary): the key joins this step's cached states, and when it lies inside a block, the
    /// request's next allocation copies that block and moves the key to the copy (it keeps writing into its own).
    #[cold]
    fn cache_partial_tail(
        &mut self,
        req: &mut Request,
        slot: Option<usize>,
        g: usize,
        w: u32,
        num_tokens: u32,
    ) {
        let (unit, bs) = (self.partial_unit, self.block_size);
        let num_units = req.unit_hashes.len() as u32;
        if w == 0 {
            let boundary = (req.num_prompt_tokens.saturating_sub(1) / unit).min(num_units) * unit;
            if boundary == 0 || boundary > num_tokens || boundary % bs == 0 {
                return;
            }
            let Some(&b) = table_ref(req, slot).get((boundary / bs) as usize) else { return };
            let key = group_key(&req.unit_hashes[(boundary / unit) as usize - 1], g);
            self.pool.cache_partial_block(b, key, boundary, false);
            return;
        }
        let prompt_tail = mamba_checkpoint(req.num_prompt_tokens, unit, false, 0);
        if num_tokens == 0
            || num_tokens % unit != 0
            || num_tokens != prompt_tail
            || num_tokens / unit > num_units
        {
            return;
        }
        let idx = (num_tokens.div_ceil(bs) - 1) as usize;
        let Some(&source) = table_ref(req, slot).get(idx) else { return };
        if source == NULL_BLOCK {
            return;
        }
        // Keyed there already (by a hit or an earlier step); vLLM 0.32 (`defer_new_states_only` off) keys it
        // again.
        let hashed = match (self.pool.block_hash(source), self.pool.partial_tokens(source)) {
            (None, _) => None,
            (Some(_), Some(t)) => Some(t),
            (Some(_), None) => Some((idx as u32 + 1) * bs),
        };
        let defer_new_only = self.hybrid.as_deref().is_none_or(|hy| hy.defer_new_states_only);
        if defer_new_only && hashed == Some(num_tokens) {
            return;
        }
        let key = group_key(&req.unit_hashes[(num_tokens / unit) as usize - 1], g);
        self.pool.cache_partial_block(source, key, num_tokens, false);
        if let Some(hy) = self.hybrid.as_deref_mut() {
            hy.mamba_cached_step.insert(key);
        }
        if num_tokens % bs != 0 {
            req.partial_hits.push((g, idx, source));
            *table(req, slot).1 = idx as u32;
        }
    }

    /// A full-attention group `g` whose blocks are larger than the hash block, after its full blocks among
    /// `num_tokens` (the cacheable tokens rounded down to the alignment) were cached: the prompt's last full hash
    /// block short of its last token, when it ends inside one of the group's blocks and within `num_tokens`, is
    /// filed as a key of that block (`BlockPool::add_second_key`: its key when it has none, so that a block not
    /// cached whole yet, as look-ahead hashes leave it, is cached all the same; a second key otherwise, with
    /// events) and recorded as a stored event of that one hash block (vLLM's partial prefix-cache entry of a
    /// prompt's tail; no lookup can use it with groups of different block sizes: their hits are aligned to every
    /// group's blocks).
    #[cold]
    fn cache_prompt_tail(&mut self, req: &Request, slot: Option<usize>, g: usize, num_tokens: u32) {
        let (bs, gbs) = (self.block_size, self.group_block_size(g));
        // (With the trailing-block drop the lookup reads the whole prompt before giving a block up.)
        let limit = if self.drop_trailing_hit {
            req.num_prompt_tokens
        } else {
            req.num_prompt_tokens.saturating_sub(1)
        };
        let units = (limit / bs).min(req.block_hashes.len() as u32);
        let boundary = units * bs;
        if boundary == 0 || boundary > num_tokens || boundary % gbs == 0 {
            return;
        }
        let Some(&b) = table_ref(req, slot).get((boundary / gbs) as usize) else { return };
        let i = units as usize - 1;
        let key = group_key(&req.block_hashes[i], g);
        if self.pool.add_second_key(b, key, g) && self.pool.events_mut().is_some() {
            self.record_block_stored(req, i, g);
        }
    }

    /// With a KV connector (`Hybrid::boundary_offers` recorded): a Mamba group's blocks `first..num_full` that
    /// hold a cached state once the caching is done are offered to the connector, in table order, each with the
    /// tokens its key covers (vLLM's boundary-state hand-offs: a block cached at its own position, the prompt's
    /// checkpoint re-keyed there, or a prefill checkpoint re-keyed at its position).
    #[cold]
    fn offer_boundary_states(
        &mut self,
        req: &Request,
        slot: Option<usize>,
        g: usize,
        first: usize,
        num_full: usize,
    ) {
        if self.hybrid.as_deref().is_none_or(|hy| hy.boundary_offers.is_none()) {
            return;
        }
        let bs = self.block_size;
        let mut offers = Vec::new();
        let tbl = table_ref(req, slot);
        for (i, &b) in tbl.iter().enumerate().take(num_full).skip(first) {
            let Some(h) = (b != NULL_BLOCK).then(|| self.pool.block_hash(b)).flatten() else { continue };
            // The key's position: the block's own, else wherever the request's hashes give it.
            let own = req.block_hashes.get(i).is_some_and(|x| group_key(x, g) == *h);
            let pos = if own { Some(i) } else { req.block_hashes.iter().position(|x| group_key(x, g) == *h) };
            if let Some(j) = pos {
                offers.push((req.id.clone(), g as u32, b, (j as u32 + 1) * bs));
            }
        }
        if let Some(list) = self.hybrid.as_deref_mut().and_then(|hy| hy.boundary_offers.as_mut()) {
            list.extend(offers);
        }
    }

    /// Drops the boundary states still to be offered for request `id` (its blocks go back to the pool: vLLM
    /// withdraws its hand-offs not yet taken).
    pub(crate) fn drop_boundary_offers(&mut self, id: &str) {
        if let Some(list) = self.hybrid.as_deref_mut().and_then(|hy| hy.boundary_offers.as_mut()) {
            list.retain(|o| &*o.0 != id);
        }
    }

    /// vLLM 0.32's re-keying of the state at the prompt's checkpoint (`_cache_partial_tail_block` without the
    /// check for a block already keyed there; `SchedulerConfig::mamba_defer_new_states_only` off): when the
    /// `num_tokens` being cached, floored to a block, end at `prompt_checkpoint` and the request holds a state
    /// there already cached under its key (by a hit or an earlier allocation), the key counts as cached in the
    /// current `schedule()` call, so a same-step hit on it is deferred. A state not yet cached there is left to
    /// the caching that both releases share.
    fn mark_prompt_checkpoint(
        &mut self,
        req: &Request,
        slot: Option<usize>,
        g: usize,
        num_tokens: u32,
        prompt_checkpoint: u32,
    ) {
        let bs = self.block_size;
        let aligned = num_tokens / bs * bs;
        if aligned == 0 || aligned != prompt_checkpoint {
            return;
        }
        let i = (aligned / bs) as usize - 1;
        let (Some(&b), Some(hash)) = (table_ref(req, slot).get(i), req.block_hashes.get(i)) else { return };
        if b == NULL_BLOCK {
            return;
        }
        let key = group_key(hash, g);
        if self.pool.block_hash(b) == Some(&key) {
            if let Some(hy) = self.hybrid.as_deref_mut() {
                hy.mamba_cached_step.insert(key);
            }
        }
    }

    /// An align-mode Mamba group's prefill checkpoint `(position, index)` after its blocks were cached (vLLM's
    /// `_cache_partial_tail_block` with a checkpoint, whole-block hashes): the block at the index enters the cache
    /// under the position's key, unless the position is neither the prompt's checkpoint (`prompt_checkpoint`),
    /// nor a state the retention keeps by its interval, nor the shared-prefix junction: then the block leaves the
    /// cache (the running state overwrites it). A block already cached under that key stays as it is.
    fn cache_mamba_checkpoint(
        &mut self,
        req: &Request,
        slot: Option<usize>,
        g: usize,
        (position, idx): (u32, usize),
        prompt_checkpoint: u32,
    ) {
        let bs = self.block_size;
        let Some(&b) = table_ref(req, slot).get(idx) else { return };
        if self.partial_unit != 0 {
            self.cache_unit_checkpoint(req, g, b, position, prompt_checkpoint);
            return;
        }
        let i = (position / bs) as usize;
        if b == NULL_BLOCK || i == 0 {
            return;
        }
        let i = i - 1;
        let retention = self.hybrid.as_deref().and_then(|hy| hy.retention);
        let retained = retention.is_none_or(|r| mamba_retained(i, bs, r, &[]));
        let current = self.pool.block_hash(b).copied();
        if position != prompt_checkpoint && !retained && position != req.shared_prefix_boundary {
            if let Some(h) = current {
                self.pool.uncache(b, &h);
            }
            return;
        }
        // A position past the hashed tokens (drafts can reach it): nothing to key it by.
        let Some(hash) = req.block_hashes.get(i) else { return };
        let key = group_key(hash, g);
        match current {
            Some(h) if h == key => return,
            Some(h) => {
                self.pool.uncache(b, &h);
            }
            None => {}
        }
        self.pool.cache_block_rekey(b, key);
        self.pool.set_event_group(b, g);
        self.newly_cached.push((b, key));
        if let Some(hy) = self.hybrid.as_deref_mut() {
            hy.mamba_cached_step.insert(key);
        }
        if self.pool.events_mut().is_some() {
            self.record_block_stored(req, i, g);
        }
    }

    /// `cache_mamba_checkpoint` with prefix hits inside a block: the checkpoint at `position`, a unit boundary, in
    /// block `b`: keyed there (replacing its keys) unless already, or, when it is neither the prompt's checkpoint,
    /// nor a block-boundary state the retention keeps, nor the shared-prefix junction, out of the cache.
    #[cold]
    fn cache_unit_checkpoint(
        &mut self,
        req: &Request,
        g: usize,
        b: u32,
        position: u32,
        prompt_checkpoint: u32,
    ) {
        let (unit, bs) = (self.partial_unit, self.block_size);
        if b == NULL_BLOCK || position == 0 {
            return;
        }
        let retention = self.hybrid.as_deref().and_then(|hy| hy.retention);
        let retained = position % bs == 0
            && retention.is_none_or(|r| mamba_retained((position / bs - 1) as usize, bs, r, &[]));
        let current = self.pool.block_hash(b).copied();
        if position != prompt_checkpoint && !retained && position != req.shared_prefix_boundary {
            if let Some(h) = current {
                self.pool.uncache(b, &h);
            }
            return;
        }
        let Some(hash) = req.unit_hashes.get((position / unit) as usize - 1) else { return };
        let key = group_key(hash, g);
        if current == Some(key) {
            return;
        }
        self.pool.cache_partial_block(b, key, position, true);
        self.newly_cached.push((b, key));
        if let Some(hy) = self.hybrid.as_deref_mut() {
            hy.mamba_cached_step.insert(key);
        }
    }

    /// vLLM's `remove_skipped_blocks` over every window group (the one `sliding_window` without groups) and
    /// align-mode Mamba group with `processed` tokens processed, in group order, without freeing: the blocks become null blocks in the tables
    /// and come back per group, each in the order the pool takes them (`BlockPool::free_blocks`).
    pub(crate) fn take_all_skipped(&mut self, req: &mut Request, processed: u32) -> Vec<Vec<u32>> {
        let bs = self.block_size;
        let groups: Vec<(u32, Option<usize>)> = match self.hybrid.as_deref() {
            None if self.sliding_window != 0 => vec![(self.sliding_window, None)],
            None => return Vec::new(),
            Some(hy) => hy.windows.iter().enumerate().map(|(g, &w)| (w, hy.slot(g))).collect(),
        };
        let sizes: Vec<u32> =
            self.hybrid.as_deref().map_or_else(|| vec![bs; groups.len()], |hy| hy.block_sizes.clone());
        let align = self.hybrid.as_deref().is_some_and(|hy| hy.mamba_align);
        let mut out = Vec::with_capacity(groups.len());
        for ((w, slot), gbs) in groups.into_iter().zip(sizes) {
            let mut removed = Vec::new();
            if w == MAMBA && align && processed > 1 {
                // An align-mode Mamba group: its states below the one of the last processed token.
                let (blocks, _) = table(req, slot);
                let last = (((processed - 1) / bs) as usize).min(blocks.len());
                removed.extend(blocks[..last].iter().copied().filter(|&b| b != NULL_BLOCK));
                blocks[..last].fill(NULL_BLOCK);
            } else if is_window(w) {
                let (blocks, _) = table(req, slot);
                let last =
                    ((group_skipped(w, processed, self.extra_retained) / gbs) as usize).min(blocks.len());
                let mut first = last;
                while first > 0 && blocks[first - 1] != NULL_BLOCK {
                    first -= 1;
                }
                removed.extend_from_slice(&blocks[first..last]);
                blocks[first..last].fill(NULL_BLOCK);
            }
            out.push(removed);
        }
        out
    }

    /// Every group's table in group order (one table without groups), each attention group's cut to the blocks
    /// of the first `computed` tokens (vLLM's `get_block_ids_for_computed_tokens`: Mamba and cross-attention
    /// tables whole).
    pub(crate) fn computed_tables(&self, req: &Request, computed: u32) -> Vec<Vec<u32>> {
        let n = computed.div_ceil(self.block_size) as usize;
        let Some(hy) = self.hybrid.as_deref() else {
            return vec![req.blocks[..n.min(req.blocks.len())].to_vec()];
        };
        hy.windows
            .iter()
            .enumerate()
            .map(|(g, &w)| {
                let t = table_ref(req, hy.slot(g));
                if w == MAMBA || w == CROSS_ATTENTION {
                    t.to_vec()
                } else {
                    let n = computed.div_ceil(hy.block_sizes[g]) as usize;
                    t[..n.min(t.len())].to_vec()
                }
            })
            .collect()
    }

    /// Every group's table in group order (one table without groups), with the tokens of the key each of its
    /// blocks is cached under (`key_tokens`; 0: not cached). vLLM's connectors read `KVCacheBlock.block_hash`; the
    /// cached blocks need not lead a table (sparse retention and a window among groups of different block sizes
    /// leave some out) and a block's key need not be its own block's hash (a Mamba prefill checkpoint keyed below
    /// its entry, a larger block keyed by the prompt's tail inside it).
    pub(crate) fn group_tables<'a>(&self, req: &'a Request) -> GroupTables<'a> {
        let tables: Vec<&[u32]> = match self.hybrid.as_deref() {
            None => vec![&req.blocks[..]],
            Some(hy) => (0..hy.windows.len())
                .map(|g| match hy.slot(g) {
                    None => &req.blocks[..],
                    Some(i) => &req.groups[i].blocks[..],
                })
                .collect(),
        };
        let keys = tables.iter().enumerate().map(|(g, t)| self.key_tokens(req, g, t)).collect();
        (tables, keys)
    }

    /// For each block of `table` (KV cache group `group`'s of `req`), the tokens the hash it is cached under covers
    /// (vLLM's `block_hash_num_tokens`; 0 for a null block or one not cached): the end of the request's hash block
    /// of that key. That is the block's own end, except for an align-mode Mamba group's prefill checkpoint under
    /// the trailing-block drop, keyed by the hash of the block below its entry until the request caches that
    /// entry, a block of a group of larger blocks whose key is the prompt's tail entry inside it (the end of that
    /// hash block), and a partial entry (prefix hits inside a block: its own tokens).
    pub(crate) fn key_tokens(&self, req: &Request, group: usize, table: &[u32]) -> Vec<u32> {
        let hashes = &req.block_hashes;
        let bs = self.block_size;
        // Hash blocks per block of the group (more than one in a group of larger blocks).
        let k = match self.hybrid.as_deref().and_then(|hy| hy.block_sizes.get(group)) {
            Some(&s) if s > bs => (s / bs) as usize,
            _ => 1,
        };
        let num_tokens = |j: usize, b: u32| {
            let Some(key) = self.pool.block_hash(b).filter(|_| b != NULL_BLOCK) else { return 0 };
            if let Some(t) = self.pool.partial_tokens(b) {
                return t;
            }
            let keyed_at = |i: usize| hashes.get(i).is_some_and(|h| group_key(h, group) == *key);
            let end = if k > 1 {
                // Keyed at its last hash block, or (the prompt's tail entry) inside it.
                let last = (j + 1) * k - 1;
                (j * k..=last).rev().find(|&u| keyed_at(u)).unwrap_or(last) + 1
            } else if j > 0 && !keyed_at(j) && keyed_at(j - 1) {
                j
            } else {
                j + 1
            };
            u32::try_from(end).map_or(u32::MAX, |e| e.saturating_mul(bs))
        };
        table.iter().enumerate().map(|(j, &b)| num_tokens(j, b)).collect()
    }

    /// Takes every group's table out of `req` in group order (one table without groups), leaving them empty.
    pub(crate) fn take_tables(&mut self, req: &mut Request) -> Vec<Vec<u32>> {
        let n = req.groups.len() + 1;
        let primary = self.hybrid.as_deref().map_or(0, |hy| hy.primary);
        let tables = (0..n)
            .map(|g| {
                let (blocks, num_cached) = table(req, group_slot(primary, g));
                *num_cached = 0;
                std::mem::take(blocks)
            })
            .collect();
        for t in &mut req.groups {
            t.mamba_allocated = false;
            t.mamba_appended = 0;
            t.mamba_checkpoint = None;
        }
        req.partial_hits.clear();
        tables
    }

    /// `free` over every group, in group order, each table deepest first.
    #[cold]
    pub(crate) fn free_groups(&mut self, req: &mut Request) {
        self.drop_boundary_offers(&req.id);
        let n = req.groups.len() + 1;
        let primary = self.hybrid.as_deref().map_or(0, |hy| hy.primary);
        for g in 0..n {
            let (blocks, num_cached) = table(req, group_slot(primary, g));
            self.pool.free_blocks(blocks);
            blocks.clear();
            *num_cached = 0;
        }
        for t in &mut req.groups {
            t.mamba_allocated = false;
            t.mamba_appended = 0;
            t.mamba_checkpoint = None;
        }
        req.partial_hits.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::BlockPool;
    use crate::config::HashAlgo;
    use crate::hashing::BlockHasher;

    fn unit_hash(i: usize) -> BlockHash {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 7)).to_le_bytes());
        BlockHash(b)
    }

    /// A full-attention group and an align-mode Mamba group, blocks of 8 tokens, a prefix-match unit of 4.
    fn manager() -> KvCacheManager {
        let hy = Hybrid::new(&[None, Some(MAMBA)], &[8, 8], 0, 0, |_, _| usize::MAX).with_mamba_lookup();
        KvCacheManager {
            pool: BlockPool::new(16, true).with_block_groups(true),
            hasher: BlockHasher::new(HashAlgo::Xxh3_128, Some(b"test")).unwrap(),
            block_size: 8,
            max_slots: 8 * 16,
            enable_caching: true,
            newly_cached: Vec::new(),
            hash_buf: Vec::new(),
            sliding_window: 0,
            admission_cap_blocks: usize::MAX,
            retention: None,
            hybrid: Some(Box::new(hy)),
            special: true,
            drop_trailing_hit: false,
            reprefillable: 0,
            extra_retained: 0,
            partial_unit: 4,
        }
    }

    /// Hits ending inside a block: full attention's whole blocks then a unit boundary inside the next block,
    /// Mamba's rightmost unit boundary, the shorter deciding and full attention cut to the blocks it touches.
    #[test]
    fn partial_hits_end_on_unit_boundaries() {
        let mut kv = manager();
        let units: Vec<BlockHash> = (0..7).map(unit_hash).collect();
        let mut b = Vec::new();
        kv.pool.allocate_into(6, &mut b);
        // Full attention: blocks 0 and 1 whole (keyed by their last unit), block 2 keyed at unit 4 (20 tokens).
        kv.pool.cache_block_rekey(b[0], units[1]);
        kv.pool.cache_block_rekey(b[1], units[3]);
        kv.pool.cache_partial_block(b[2], units[4], 20, false);
        // Mamba: a state at 20 tokens and one at 12.
        kv.pool.cache_partial_block(b[3], group_key(&units[4], 1), 20, false);
        kv.pool.cache_partial_block(b[4], group_key(&units[2], 1), 12, false);
        let mut hits = Vec::new();
        assert_eq!(kv.find_partial_hit(&units, 27, &mut hits), 20);
        assert_eq!(hits, vec![vec![b[0], b[1], b[2]], vec![NULL_BLOCK, NULL_BLOCK, b[3]]]);
        // Capped below the unit at 20: full attention stops at 16, Mamba falls back to 12 (full attention cut to
        // the two blocks 12 tokens touch).
        assert_eq!(kv.find_partial_hit(&units, 19, &mut hits), 12);
        assert_eq!(hits, vec![vec![b[0], b[1]], vec![NULL_BLOCK, b[4]]]);
        // Without the Mamba state at 20 the hit is 12 again; without any, nothing.
        kv.pool.free_blocks(&[b[3]]);
        let mut more = Vec::new();
        kv.pool.allocate_into(10, &mut more);
        assert!(more.contains(&b[3]));
        assert_eq!(kv.find_partial_hit(&units, 27, &mut hits), 12);
        kv.pool.free_blocks(&[b[4]]);
        kv.pool.allocate_into(1, &mut more);
        assert_eq!(kv.find_partial_hit(&units, 27, &mut hits), 0);
        assert_eq!(hits, vec![Vec::<u32>::new(), vec![]]);
        // A block-aligned Mamba state (its key the full block's) with full attention's block 2 whole.
        kv.pool.cache_block_rekey(b[2], units[5]);
        kv.pool.cache_partial_block(b[5], group_key(&units[5], 1), 24, false);
        assert_eq!(kv.find_partial_hit(&units, 27, &mut hits), 24);
        assert_eq!(hits, vec![vec![b[0], b[1], b[2]], vec![NULL_BLOCK, NULL_BLOCK, b[5]]]);
    }
}
