//! Block pins (`pins.rs`): references by block id outside any request, released where vLLM's `free_blocks`
//! puts a block, and the block-hash reads that go with them.

use super::helpers::{add, free_order, params, prompt, step_with};
use crate::{SchedError, Scheduler, SchedulerConfig};

fn cfg(num_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        prefix_hash_seed: Some(b"test".to_vec()),
        ..Default::default()
    }
}

#[test]
fn a_pinned_block_leaves_the_free_queue_and_comes_back_where_free_blocks_puts_it() {
    let mut s = Scheduler::new(cfg(16)).unwrap(); // 15 usable
    add(&mut s, "a", &prompt(0, 9), params(1));
    let (out, _) = step_with(&mut s, 7); // a finishes: 2 hashed blocks and its unhashed tail are freed
    let a: Vec<u32> = out.new_block_ids[..3].iter().map(|&b| b as u32).collect();
    let hashed = [a[0], a[1]];
    assert!(s.get_block_hash(a[0]).unwrap().is_some() && s.get_block_hash(a[2]).unwrap().is_none());
    let h0 = *s.get_block_hash(a[0]).unwrap().as_ref().unwrap();
    assert_eq!(s.get_cached_block_id(&h0), Some(a[0]));
    let before = free_order(&s);
    // Pinning a free cached block takes it out of the free queue; it stays cached.
    s.pin_blocks(&[hashed[0], hashed[0], a[2]]).unwrap();
    assert_eq!(s.get_block_ref_cnt(hashed[0]).unwrap(), 2);
    assert_eq!(s.get_block_pin_cnt(hashed[0]).unwrap(), 2);
    assert!(!free_order(&s).contains(&hashed[0]) && !free_order(&s).contains(&a[2]));
    assert_eq!(s.get_cached_block_id(&h0), Some(a[0]));
    s.check_invariants().unwrap();
    // Unpins are checked as a whole: one bad id and nothing changes.
    for bad in [vec![hashed[0], 16], vec![hashed[0], 0], vec![hashed[1]], vec![hashed[0]; 3]] {
        let err = s.unpin_blocks(&bad).unwrap_err();
        assert!(matches!(err, SchedError::InvalidRequest(_)), "{bad:?}: {err:?}");
        assert_eq!(s.get_block_ref_cnt(hashed[0]).unwrap(), 2);
    }
    assert!(s.pin_blocks(&[hashed[1], 16]).is_err());
    assert_eq!(s.get_block_ref_cnt(hashed[1]).unwrap(), 0);
    s.unpin_blocks(&[hashed[0]]).unwrap(); // still pinned once: not free
    assert!(!free_order(&s).contains(&hashed[0]));
    // The last references: the unhashed block to the head, the hashed one to the tail.
    s.unpin_blocks(&[a[2], hashed[0]]).unwrap();
    let after = free_order(&s);
    assert_eq!(s.free_block_ids(), after);
    assert_eq!(after[0], a[2]);
    assert_eq!(*after.last().unwrap(), hashed[0]);
    let mut rest: Vec<u32> = before.iter().copied().filter(|b| *b != a[2] && *b != hashed[0]).collect();
    rest.insert(0, a[2]);
    rest.push(hashed[0]);
    assert_eq!(after, rest);
    assert_eq!(s.get_block_pin_cnt(hashed[0]).unwrap(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn unpinned_blocks_go_back_in_the_order_given_and_a_pin_outlives_its_request() {
    let mut s = Scheduler::new(cfg(16)).unwrap();
    add(&mut s, "a", &prompt(0, 13), params(3));
    let (out, _) = step_with(&mut s, 7);
    let a: Vec<u32> = out.new_block_ids[..4].iter().map(|&b| b as u32).collect();
    // A connector pins the request's blocks while it copies them; the request then finishes.
    s.pin_blocks(&a[..3]).unwrap();
    step_with(&mut s, 7);
    step_with(&mut s, 7);
    assert_eq!(s.num_running_reqs(), 0);
    for &b in &a[..3] {
        assert_eq!(s.get_block_ref_cnt(b).unwrap(), 1);
        assert!(!free_order(&s).contains(&b));
    }
    // Hashed blocks reach the tail in the order given.
    s.unpin_blocks(&[a[2], a[0], a[1]]).unwrap();
    let order = free_order(&s);
    assert_eq!(order[order.len() - 3..], [a[2], a[0], a[1]]);
    s.check_invariants().unwrap();
    // A pinned cached block is not evicted by allocation: the pool has one block fewer.
    s.pin_blocks(&[a[0]]).unwrap();
    add(&mut s, "big", &prompt(1000, 57), params(1));
    step_with(&mut s, 7);
    assert!(s.get_block_hash(a[0]).unwrap().is_some());
    s.check_invariants().unwrap();
    // A pin keeps a block in use: the prefix cache cannot be reset until it is given back.
    assert!(!s.reset_prefix_cache(false).unwrap());
    s.unpin_blocks(&[a[0]]).unwrap();
    assert!(s.reset_prefix_cache(false).unwrap());
    assert!(matches!(s.get_block_hash(16), Err(SchedError::InvalidRequest(_))));
    assert_eq!(s.get_block_hash(0).unwrap(), None);
}

#[test]
fn with_several_groups_a_cached_block_names_its_group_and_the_request_hash() {
    // Full attention and a window of 4 tokens, each block of either group from one pool; events off, so the
    // group is filed for the block reads alone.
    let config =
        SchedulerConfig { kv_cache_groups: vec![None, Some(4)], enable_prefix_caching: true, ..cfg(32) };
    let mut s = Scheduler::new(config).unwrap();
    add(&mut s, "a", &prompt(0, 13), params(2));
    step_with(&mut s, 7);
    let hashes = s.get_request("a").unwrap().block_hashes.clone();
    assert_eq!(hashes.len(), 3);
    let mut seen = 0;
    for g in 0..2 {
        let table = s.get_group_block_ids("a", g).unwrap().to_vec();
        for (i, &b) in table.iter().enumerate().take(3) {
            if b == 0 {
                continue; // a window's block that left it
            }
            assert_eq!(s.get_block_hash_group(b).unwrap(), Some((hashes[i], g)), "group {g} block {i}");
            assert_eq!(s.get_group_cached_block_id(&hashes[i], g).unwrap(), Some(b));
            seen += 1;
        }
    }
    assert!(seen >= 4, "{seen}");
    // Group 0's key is the hash itself; the window's key of a hash it never cached finds nothing.
    let full0 = s.get_group_block_ids("a", 0).unwrap()[0];
    assert_eq!(s.get_cached_block_id(&hashes[0]), Some(full0));
    assert_eq!(s.get_block_hash(full0).unwrap(), Some(hashes[0]));
    let window0 = s.get_group_block_ids("a", 1).unwrap()[0];
    if window0 == 0 {
        assert_eq!(s.get_group_cached_block_id(&hashes[0], 1).unwrap(), None);
    }
    assert!(s.get_block_hash_group(0).unwrap().is_none());
    let err = s.get_group_cached_block_id(&hashes[0], 2).unwrap_err();
    assert!(matches!(err, SchedError::InvalidRequest(ref m) if m.contains("[0, 2)")), "{err:?}");
    // One group: the plain reads, group 0.
    let mut one = Scheduler::new(SchedulerConfig { enable_prefix_caching: true, ..cfg(16) }).unwrap();
    add(&mut one, "b", &prompt(0, 9), params(3));
    step_with(&mut one, 7);
    let b0 = one.get_group_block_ids("b", 0).unwrap()[0];
    let h = one.get_request("b").unwrap().block_hashes[0];
    assert_eq!(one.get_block_hash_group(b0).unwrap(), Some((h, 0)));
    assert!(one.get_group_cached_block_id(&h, 1).is_err());
    s.check_invariants().unwrap();
}
