//! Decode/prefill context parallelism: the block unit (`kv_block_size`), prefix hits in that unit, and the
//! per-rank slot mapping of `prepare_model_inputs_for_rank`, each checked against vLLM 0.33's rule.

use super::helpers::{add, one_token_each, params, prompt};
use crate::{SchedError, Scheduler, SchedulerConfig};

fn cp_cfg(dcp: u32, pcp: u32, interleave: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks: 17,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        prefix_hash_seed: Some(b"cp".to_vec()),
        dcp_world_size: dcp,
        pcp_world_size: pcp,
        cp_kv_cache_interleave_size: interleave,
        ..Default::default()
    }
}

/// vLLM 0.33 `SingleTypeKVCacheManager.__init__`: `block_size = spec.block_size * dcp_world_size`; a request
/// of n tokens holds `ceil(n / (block_size * dcp))` blocks.
#[test]
fn dcp_allocates_blocks_of_block_size_times_dcp_tokens() {
    for (dcp, expect) in [(1u32, 5usize), (2, 3), (4, 2)] {
        let mut s = Scheduler::new(cp_cfg(dcp, 1, 1)).unwrap();
        add(&mut s, "a", &prompt(100, 17), params(4));
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        assert_eq!(out.num_scheduled_tokens, vec![17]);
        assert_eq!(out.new_block_ids.len(), expect, "dcp {dcp}");
        assert_eq!(s.stats().num_free_blocks, 16 - expect);
    }
}

/// vLLM 0.33 `Scheduler.__init__` builds its `KVCacheManager` with `pcp_world_size=1`: PCP replicates the KV
/// cache over its ranks, so it does not change the block unit.
#[test]
fn pcp_does_not_change_the_block_unit() {
    let mut s = Scheduler::new(cp_cfg(1, 4, 1)).unwrap();
    add(&mut s, "a", &prompt(100, 17), params(4));
    let out = s.schedule().unwrap();
    assert_eq!(out.new_block_ids.len(), 5);
    let mut s = Scheduler::new(cp_cfg(2, 2, 1)).unwrap();
    add(&mut s, "a", &prompt(100, 17), params(4));
    assert_eq!(s.schedule().unwrap().new_block_ids.len(), 3);
}

/// vLLM 0.33 `FullAttentionManager.find_longest_cache_hit`: with DCP the hashes are viewed at the sharded block
/// size, so hits come in units of `block_size * dcp` tokens (and the last token is always computed).
#[test]
fn dcp_prefix_hits_count_in_kv_block_units() {
    for (dcp, hit) in [(1u32, 16u32), (2, 16), (4, 16)] {
        let mut s = Scheduler::new(cp_cfg(dcp, 1, 1)).unwrap();
        add(&mut s, "a", &prompt(100, 20), params(4));
        let out = s.schedule().unwrap();
        one_token_each(&mut s, &out, 7);
        // 20 tokens: full units below the last token are 4x4 (dcp 1), 2x8 (dcp 2), 1x16 (dcp 4).
        assert_eq!(s.get_num_cached_tokens(&prompt(100, 20), None, None).unwrap(), hit, "dcp {dcp}");
        // 16 tokens: the hit must leave the last token to compute.
        let hit16 = s.get_num_cached_tokens(&prompt(100, 16), None, None).unwrap();
        assert_eq!(hit16, 16 - s.config().kv_block_size(), "dcp {dcp}");
        add(&mut s, "b", &prompt(100, 20), params(4));
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        let k = out.num_reqs() - 1;
        assert_eq!((out.num_computed_tokens[k], out.num_scheduled_tokens[k]), (hit as i32, 20 - hit as i32));
    }
}

/// The KV cache holds `(num_blocks - 1) * block_size * dcp` tokens; `add_request` refuses longer requests.
#[test]
fn dcp_scales_the_cache_capacity() {
    let cfg = SchedulerConfig { max_model_len: 512, ..cp_cfg(4, 1, 1) };
    assert_eq!(cfg.kv_capacity_tokens(), 16 * 16);
    let mut s = Scheduler::new(cfg).unwrap();
    let p = params(1);
    assert!(s.add_request("fits", &prompt(100, 256), p.clone()).is_ok());
    assert!(matches!(s.add_request("too long", &prompt(100, 257), p), Err(SchedError::InvalidRequest(_))));
}

/// vLLM 0.33 `BlockTable.compute_slot_mapping` (worker side): position p is in block `p // (bs * dcp)` at
/// offset o; rank `(o // I) % dcp` stores it at slot `block * bs + o // (dcp * I) * I + o % I`, every other rank
/// gets the padding slot -1.
#[test]
fn slot_mapping_per_dcp_rank() {
    for (dcp, interleave) in [(1u32, 1u32), (2, 1), (2, 2), (4, 1), (4, 4), (2, 4)] {
        let mut s = Scheduler::new(cp_cfg(dcp, 1, interleave)).unwrap();
        add(&mut s, "a", &prompt(100, 37), params(4));
        let out = s.schedule().unwrap();
        let blocks: Vec<usize> = out.new_block_ids.iter().map(|&b| b as usize).collect();
        let (bs, kv_bs) = (4usize, 4 * dcp as usize);
        let mut owners = [0u32; 37];
        let mut seen = std::collections::HashSet::new();
        for rank in 0..dcp {
            let mi = s.prepare_model_inputs_for_rank(out.scheduler_id, out.step_id, rank).unwrap();
            assert_eq!(mi.input_positions, (0..37).collect::<Vec<i32>>());
            for (pos, &slot) in mi.slot_mapping.iter().enumerate() {
                if slot < 0 {
                    assert_eq!(slot, -1);
                    continue;
                }
                owners[pos] += 1;
                let slot = slot as usize;
                // The slot lies in this position's block, and no two positions share a (rank, slot).
                assert_eq!(slot / bs, blocks[pos / kv_bs], "dcp {dcp} I {interleave} pos {pos}");
                assert!(seen.insert((rank, slot)));
                let o = pos % kv_bs;
                let i = interleave as usize;
                assert_eq!((o / i) % dcp as usize, rank as usize);
                assert_eq!(slot % bs, o / (dcp as usize * i) * i + o % i);
            }
        }
        assert!(owners.iter().all(|&n| n == 1), "dcp {dcp} I {interleave}: each token on exactly one rank");
        if dcp == 2 && interleave == 1 {
            let mi = s.prepare_model_inputs_for_rank(out.scheduler_id, out.step_id, 1).unwrap();
            let b0 = blocks[0] as i32 * 4;
            assert_eq!(mi.slot_mapping[..8], [-1, b0, -1, b0 + 1, -1, b0 + 2, -1, b0 + 3]);
        }
    }
}

#[test]
fn bad_dcp_rank_is_refused() {
    let mut s = Scheduler::new(cp_cfg(2, 1, 1)).unwrap();
    add(&mut s, "a", &prompt(100, 9), params(4));
    let out = s.schedule().unwrap();
    let e = s.prepare_model_inputs_for_rank(out.scheduler_id, out.step_id, 2);
    assert!(matches!(e, Err(SchedError::InvalidRequest(_))), "{e:?}");
    // The same step is still preparable: nothing changed.
    assert!(s.prepare_model_inputs_for_rank(out.scheduler_id, out.step_id, 1).is_ok());
    s.check_invariants().unwrap();
}
