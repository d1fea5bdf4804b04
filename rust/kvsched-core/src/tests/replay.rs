//! Bounded prefix replay (`SchedulerConfig::prefix_replay_groups`, vLLM's DeepSeek V4.1 sliding windows with
//! `bounded_replay`): a prefix hit recomputes its last window to rebuild the replayed window groups, which are
//! never cached nor looked up.

use super::helpers::{apply, params, prompt, run_to_completion, schedule, step_with};
use crate::{KvConnector, KvTransferReport, Request, Scheduler, SchedulerConfig};

const BS: u32 = 16;
const WINDOW: u32 = 32;
const FULL: usize = 0;
const SWA: usize = 1;

/// Full attention and a replayed window of 32 tokens, blocks of 16 tokens, prefix caching on.
fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        max_model_len: 256,
        enable_prefix_caching: true,
        prefix_hash_seed: Some(b"replay".to_vec()),
        kv_cache_groups: vec![None, Some(WINDOW)],
        prefix_replay_groups: vec![SWA as u32],
        ..Default::default()
    }
}

/// Runs `id` (a prompt of `len` shared tokens) through its prefill and one decode step.
fn prefill(s: &mut Scheduler, id: &str, len: usize) {
    s.add_request(id, &prompt(0, len), params(3)).unwrap();
    let (out, _) = step_with(s, 7);
    assert_eq!(out.num_scheduled_tokens, vec![len as i32]);
}

#[test]
fn a_hit_recomputes_its_last_window_and_shares_only_the_full_attention_blocks() {
    let mut s = Scheduler::new(cfg()).unwrap();
    let free = s.num_free_blocks();
    prefill(&mut s, "a", 100);
    s.add_request("b", &prompt(0, 100), params(2)).unwrap();
    let (out, _) = step_with(&mut s, 7);
    // 96 tokens hit (6 blocks); the last 32 are recomputed: 64 computed, 36 scheduled.
    assert_eq!(out.num_computed_tokens, vec![100, 64]);
    assert_eq!(out.num_scheduled_tokens, vec![1, 36]);
    assert_eq!(s.get_replay_start("b").unwrap(), 64);
    assert_eq!(s.get_replay_start("a").unwrap(), 0, "a request without a hit replays nothing");
    let (a_full, b_full) = (
        s.get_group_block_ids("a", FULL).unwrap().to_vec(),
        s.get_group_block_ids("b", FULL).unwrap().to_vec(),
    );
    assert_eq!(b_full[..6], a_full[..6], "the full-attention hit is shared, replayed tokens included");
    assert_eq!(b_full.len(), 7);
    let (a_swa, b_swa) = (
        s.get_group_block_ids("a", SWA).unwrap().to_vec(),
        s.get_group_block_ids("b", SWA).unwrap().to_vec(),
    );
    // The window group never hits: the 4 blocks below the window of token 96 are null blocks, the window's
    // blocks (replayed and new tokens) are fresh ones.
    assert_eq!(b_swa.len(), 7);
    assert_eq!(b_swa[..4], [0, 0, 0, 0]);
    assert!(b_swa[4..].iter().all(|b| *b != 0 && !a_swa.contains(b)));
    s.check_invariants().unwrap();
    run_to_completion(&mut s);
    assert_eq!(s.num_free_blocks(), free);
}

#[test]
fn a_chunk_cap_below_the_window_schedules_replay_only_chunks() {
    // The cap applies with more than one request live: "a" keeps decoding.
    let mut s = Scheduler::new(SchedulerConfig { long_prefill_token_threshold: BS, ..cfg() }).unwrap();
    s.add_request("a", &prompt(0, 100), params(40)).unwrap();
    while s.get_num_computed_tokens("a").unwrap() < 100 {
        step_with(&mut s, 7);
    }
    s.add_request("b", &prompt(0, 100), params(2)).unwrap();
    let mut chunks = Vec::new();
    loop {
        let (out, _) = step_with(&mut s, 7);
        if chunks.is_empty() {
            assert_eq!(out.num_computed_tokens[1], 64);
            // A replay-only chunk adopts the hit and needs no new block.
            assert_eq!(s.get_group_block_ids("b", FULL).unwrap().len(), 6);
        }
        chunks.push(out.num_scheduled_tokens[1]);
        s.check_invariants().unwrap();
        if s.get_num_computed_tokens("b").unwrap() >= 100 {
            break;
        }
    }
    assert_eq!(chunks, vec![16, 16, 4]);
    assert_eq!(s.get_group_block_ids("b", FULL).unwrap().len(), 7);
}

#[test]
fn a_hit_no_longer_than_the_window_is_dropped() {
    let mut s = Scheduler::new(cfg()).unwrap();
    s.add_request("a", &prompt(0, WINDOW as usize), params(1)).unwrap();
    run_to_completion(&mut s);
    let before = s.stats().prefix_cache_hits;
    s.add_request("b", &prompt(0, 100), params(2)).unwrap();
    let (out, _) = step_with(&mut s, 7);
    assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![0], vec![100]));
    assert_eq!(s.get_replay_start("b").unwrap(), 0);
    assert_eq!(s.stats().prefix_cache_hits, before, "a dropped hit counts no hit");
    s.check_invariants().unwrap();
}

#[test]
fn without_replay_groups_a_window_group_hits_as_before() {
    let mut s = Scheduler::new(SchedulerConfig { prefix_replay_groups: Vec::new(), ..cfg() }).unwrap();
    prefill(&mut s, "a", 100);
    s.add_request("b", &prompt(0, 100), params(2)).unwrap();
    let (out, _) = step_with(&mut s, 7);
    assert_eq!(out.num_computed_tokens, vec![100, 96]);
    assert_eq!(s.get_replay_start("b").unwrap(), 0);
}

/// Answers every admission with `ext` tokens and names the groups its loads write.
struct Loader {
    ext: u32,
    load_async: bool,
    loaded: Option<Vec<usize>>,
}

impl KvConnector for Loader {
    fn get_num_new_matched_tokens(&mut self, _req: &Request, _n: u32) -> Option<(u32, bool)> {
        Some((self.ext, self.load_async))
    }
    fn update_state_after_alloc(&mut self, _req: &Request, _ext: u32) {}
    fn loaded_groups(&mut self, _req: &Request) -> Option<Vec<usize>> {
        self.loaded.clone()
    }
    fn request_finished(&mut self, _req: &Request, _blocks: &[u32]) -> bool {
        false
    }
}

fn loading(ext: u32, load_async: bool, loaded: Option<Vec<usize>>) -> Scheduler {
    let mut s =
        Scheduler::new(SchedulerConfig { enable_prefix_caching: false, kv_connector_groups: true, ..cfg() })
            .unwrap();
    s.set_kv_connector(Some(Box::new(Loader { ext, load_async, loaded }))).unwrap();
    s.add_request("r", &prompt(0, 100), params(2)).unwrap();
    s
}

/// The first step of a request whose load is over (after the load's step when it is asynchronous).
fn first_run(s: &mut Scheduler, load_async: bool) -> (i32, i32) {
    if load_async {
        let p = schedule(s);
        assert!(p.out.num_scheduled_tokens.is_empty(), "the load's step computes nothing");
        apply(s, &p, |_| Vec::new());
        let report = KvTransferReport {
            finished_recving: &["r"],
            finished_sending: &[],
            failed_recving: &[],
            invalid_block_ids: &[],
        };
        s.update_kv_transfers(report).unwrap();
    }
    let (out, _) = step_with(s, 7);
    (out.num_computed_tokens[0], out.num_scheduled_tokens[0])
}

#[test]
fn a_load_without_the_windows_replays_after_it_in_whole_blocks() {
    // 64 tokens load (the store holds full attention only): replayed from 32. 63 tokens are cut to 48.
    for load_async in [false, true] {
        for (ext, hit) in [(64, 64), (63, 48)] {
            let mut s = loading(ext, load_async, Some(vec![FULL]));
            let got = first_run(&mut s, load_async);
            assert_eq!(
                got,
                ((hit - WINDOW) as i32, (100 - hit + WINDOW) as i32),
                "async {load_async} ext {ext}"
            );
            assert_eq!(s.get_replay_start("r").unwrap(), hit - WINDOW);
            let swa = s.get_group_block_ids("r", SWA).unwrap();
            assert_ne!(swa[((hit - WINDOW) / BS) as usize], 0, "the replay's first block is held");
            s.check_invariants().unwrap();
        }
    }
}

#[test]
fn a_load_carrying_the_windows_neither_replays_nor_is_cut() {
    // A transfer of the request's own blocks (every group, or the default: every group) is taken as it is, a
    // load no longer than the window too.
    for load_async in [false, true] {
        for loaded in [None, Some(vec![FULL, SWA])] {
            for ext in [WINDOW, 63] {
                let mut s = loading(ext, load_async, loaded.clone());
                let got = first_run(&mut s, load_async);
                assert_eq!(got, (ext as i32, (100 - ext) as i32), "async {load_async} {loaded:?} ext {ext}");
                assert_eq!(s.get_replay_start("r").unwrap(), 0);
                s.check_invariants().unwrap();
            }
        }
    }
}

#[test]
fn a_load_no_longer_than_the_window_is_not_started() {
    for load_async in [false, true] {
        let mut s = loading(WINDOW, load_async, Some(vec![FULL]));
        let (out, _) = step_with(&mut s, 7);
        assert_eq!((out.num_computed_tokens.clone(), out.num_scheduled_tokens.clone()), (vec![0], vec![100]));
        assert_eq!(s.get_replay_start("r").unwrap(), 0);
    }
}

#[test]
fn replay_groups_are_validated() {
    let bad = |c: SchedulerConfig| Scheduler::new(c).err().map(|e| e.to_string()).unwrap_or_default();
    let cases: Vec<(SchedulerConfig, &str)> = vec![
        (
            SchedulerConfig { kv_cache_groups: Vec::new(), sliding_window: Some(32), ..cfg() },
            "needs kv_cache_groups",
        ),
        (SchedulerConfig { prefix_replay_groups: vec![2], ..cfg() }, "entry 2 is not a group"),
        (SchedulerConfig { prefix_replay_groups: vec![1, 1], ..cfg() }, "lists group 1 more than once"),
        (
            SchedulerConfig { prefix_replay_groups: vec![1, 0], ..cfg() },
            "entry 0 is not a sliding-window group",
        ),
        (
            SchedulerConfig {
                kv_cache_groups: vec![None, Some(32), Some(16)],
                prefix_replay_groups: vec![1, 2],
                ..cfg()
            },
            "windows must agree, got 32 and 16",
        ),
        (
            SchedulerConfig {
                kv_cache_groups: vec![Some(32), Some(32)],
                prefix_replay_groups: vec![0, 1],
                ..cfg()
            },
            "lists every attention group",
        ),
        (
            SchedulerConfig {
                kv_cache_groups: vec![Some(32), None],
                prefix_replay_groups: vec![0],
                kv_cache_group_block_sizes: vec![8, 32],
                ..cfg()
            },
            "must give block_size (16) to a group that is not Mamba, ring or replayed",
        ),
        (
            SchedulerConfig {
                kv_cache_groups: vec![None, Some(32)],
                prefix_replay_groups: vec![],
                kv_cache_group_block_sizes: vec![16, 8],
                ..cfg()
            },
            "must be multiples of block_size (16)",
        ),
        (SchedulerConfig { num_cpu_blocks: 8, ..cfg() }, "cannot be combined with swap"),
    ];
    for (c, want) in cases {
        let got = bad(c);
        assert!(got.contains(want), "{got:?} does not say {want:?}");
    }
}

#[test]
fn a_replayed_window_first_with_smaller_blocks_is_not_the_primary_group() {
    // DeepSeek V4.1's layout: the replayed window comes first with blocks of 8 tokens, the full-attention group
    // (the primary group, which hashes) has blocks of 16.
    let c = SchedulerConfig {
        kv_cache_groups: vec![Some(WINDOW), None],
        prefix_replay_groups: vec![0],
        kv_cache_group_block_sizes: vec![8, BS],
        ..cfg()
    };
    let mut s = Scheduler::new(c).unwrap();
    let free = s.num_free_blocks();
    prefill(&mut s, "a", 100);
    // 100 tokens: 13 window blocks of 8, 7 full-attention blocks of 16.
    assert_eq!(s.get_group_block_ids("a", 0).unwrap().len(), 13);
    assert_eq!(s.get_group_block_ids("a", 1).unwrap().len(), 7);
    s.add_request("b", &prompt(0, 100), params(2)).unwrap();
    let (out, _) = step_with(&mut s, 7);
    // 96 tokens hit; the last 32 are recomputed: 64 computed, 36 scheduled.
    assert_eq!(out.num_computed_tokens, vec![100, 64]);
    assert_eq!(out.num_scheduled_tokens, vec![1, 36]);
    assert_eq!(s.get_replay_start("b").unwrap(), 64);
    let (a_full, b_full) =
        (s.get_group_block_ids("a", 1).unwrap().to_vec(), s.get_group_block_ids("b", 1).unwrap().to_vec());
    assert_eq!(b_full[..6], a_full[..6], "the full-attention hit is shared");
    let b_swa = s.get_group_block_ids("b", 0).unwrap().to_vec();
    // The window of token 96 starts at token 65: the 8 blocks below it are null blocks, the 5 blocks of tokens
    // 64..100 fresh ones.
    assert_eq!(b_swa.len(), 13);
    assert_eq!(b_swa[..8], [0; 8]);
    assert!(b_swa[8..].iter().all(|&b| b != 0));
    s.check_invariants().unwrap();
    // "c" decodes past token 104: a new window block (8 tokens) while its full-attention block still has room.
    s.add_request("c", &prompt(5000, 100), params(12)).unwrap();
    let mut saw_window_only = false;
    while s.has_unfinished_requests() {
        let (out, _) = step_with(&mut s, 7);
        // The window's ids are the first of the other groups' (group 0 comes before the primary group).
        assert_eq!(out.primary_group, 1);
        let (full, window) = (&out.new_block_ids_indptr, &out.group_new_block_ids_indptr[0]);
        for i in 0..out.num_reqs() {
            saw_window_only |= full[i + 1] == full[i] && window[i + 1] > window[i];
        }
        s.check_invariants().unwrap();
    }
    assert!(saw_window_only, "a window block appended alone is reported");
    assert_eq!(s.num_free_blocks(), free);
}
