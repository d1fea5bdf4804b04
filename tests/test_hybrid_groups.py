"""Several KV cache groups (``kv_cache_groups``): the behaviour of docs/semantics.md's "Several KV cache groups",
on the Rust core and on the reference. Block size 4 and small pools keep every table traceable by hand; the
tables in the first test are those vLLM 0.33's ``KVCacheManager`` gives for the same calls with a
``FullAttentionSpec`` and a ``SlidingWindowSpec(sliding_window=8)`` group of block size 4 and 40 blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvsched import InvalidConfigError, InvalidRequestError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **fields: Any) -> Any:
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 40,
        "max_model_len": 128,
        "max_num_batched_tokens": 64,
        "prefix_hash_seed": 0,
    }
    cfg.update(fields)
    config = SchedulerConfig(**cfg)
    return Scheduler(config) if impl == "rust" else ReferenceScheduler(config)


def tables(s: Any, rid: str, num_groups: int) -> list[list[int]]:
    return [[int(b) for b in s.get_block_ids(rid, g)] for g in range(num_groups)]


def computed(out: Any, rid: str) -> int:
    return int(out.num_computed_tokens[list(out.req_ids).index(rid)])


def new_blocks(out: Any, rid: str, num_groups: int) -> list[list[int]]:
    k = list(out.req_ids).index(rid)
    p = out.new_block_ids_indptr
    return [[int(b) for b in out.group_new_block_ids(g)[p[k] : p[k + 1]]] for g in range(num_groups)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", ["full_first", "window_first"])
def test_groups_allocate_free_and_hit_in_vllms_order(impl: str, order: str) -> None:
    groups = (None, 8) if order == "full_first" else (8, None)
    full, window = (0, 1) if order == "full_first" else (1, 0)
    s = make(impl, kv_cache_groups=groups)
    s.add_request("a", list(range(22)), max_tokens=8)
    out = s.schedule()
    # Group 0 pops its blocks first, then group 1.
    expect = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert new_blocks(out, "a", 2) == expect
    assert out.new_block_ids.tolist() == expect[0]  # the single-group field is group 0's
    s.update_from_output(out, [[7]])
    out = s.schedule()
    # 22 computed: the window of token 22 is 15..22; the window group's blocks 0..2 left it.
    t = tables(s, "a", 2)
    assert t[full] == expect[full]
    assert t[window] == [0, 0, 0, *expect[window][3:]]
    assert new_blocks(out, "a", 2) == [[], []]
    s.update_from_output(out, [[7]])
    s.check_invariants()
    s.abort_requests(["a"])
    # Group 0's table is freed first, then group 1's: the uncached last blocks go to the head, group 1's on top.
    s.add_request("b", [*range(22), 99], max_tokens=4)
    out = s.schedule()
    assert computed(out, "b") == 20
    hit_full, hit_window = expect[full][:5], [0, 0, 0, *expect[window][3:5]]
    want = [[], []]
    want[full] = hit_full
    want[window] = hit_window
    want[0].append(12)  # group 0 pops the head first
    want[1].append(6)
    assert new_blocks(out, "b", 2) == want
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_hit_must_be_valid_for_every_group(impl: str) -> None:
    # The window group of 4 tokens needs 1 cached block at the end of the hit; the full group needs the run
    # from block 0. A second window of 12 tokens needs 3.
    s = make(impl, kv_cache_groups=(None, 4, 12), num_blocks=60)
    s.add_request("a", list(range(30)), max_tokens=1)
    out = s.schedule()
    assert new_blocks(out, "a", 3) == [list(range(1, 9)), list(range(9, 17)), list(range(17, 25))]
    s.update_from_output(out, [[5]])
    assert not s.has_unfinished_requests()
    s.add_request("b", list(range(30)), max_tokens=1)
    out = s.schedule()
    # 30 tokens: at most 7 blocks hit (the last token is computed); every group has all 7 cached, the windows
    # only need their tails.
    assert computed(out, "b") == 28
    assert new_blocks(out, "b", 3) == [
        [1, 2, 3, 4, 5, 6, 7, 24],
        [0, 0, 0, 0, 0, 0, 15, 16],
        [0, 0, 0, 0, 21, 22, 23, 8],
    ]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_lookup_gives_every_groups_blocks_of_the_hit(impl: str) -> None:
    # The blocks of test_a_hit_must_be_valid_for_every_group, read without admitting a request.
    s = make(impl, kv_cache_groups=(None, 4, 12), num_blocks=60)
    s.add_request("a", list(range(30)), max_tokens=1)
    s.update_from_output(s.schedule(), [[5]])
    tokens = list(range(30))
    assert [s.get_cached_block_ids(tokens, group=g).tolist() for g in range(3)] == [
        [1, 2, 3, 4, 5, 6, 7],
        [0, 0, 0, 0, 0, 0, 15],
        [0, 0, 0, 0, 21, 22, 23],
    ]
    assert s.get_cached_block_ids(tokens).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert s.get_cached_block_ids(tokens, max_hit_tokens=8, group=2).tolist() == [17, 18]
    assert s.get_cached_block_ids(list(range(100, 130)), group=1).tolist() == []
    with pytest.raises(InvalidRequestError, match="group must be in"):
        s.get_cached_block_ids(tokens, group=3)
    assert s.num_free_blocks == 59  # nothing was taken
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_hit_is_cut_to_the_shortest_group(impl: str) -> None:
    # Group 0 (a window of 4 tokens) is freed before group 1 (full attention), so its cached blocks are evicted
    # first: its hashes 3..5 go, the full group keeps all of them, and the hit stops at the window's run.
    s = make(impl, kv_cache_groups=(4, None), num_blocks=24, max_num_batched_tokens=128)
    s.add_request("a", list(range(24)), max_tokens=1)
    out = s.schedule()
    assert new_blocks(out, "a", 2) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    s.update_from_output(out, [[5]])
    # 25 tokens: 7 blocks per group; group 0 pops 13..19, group 1 pops 20..23, then blocks 6, 5 and 4.
    s.add_request("x", list(range(1000, 1025)), max_tokens=1)
    out = s.schedule()
    assert new_blocks(out, "x", 2) == [[13, 14, 15, 16, 17, 18, 19], [20, 21, 22, 23, 6, 5, 4]]
    s.update_from_output(out, [[5]])
    s.add_request("b", list(range(24)), max_tokens=1)
    out = s.schedule()
    # Full attention alone would hit 5 blocks; the window's rightmost cached block is block 2 (id 3).
    assert computed(out, "b") == 12
    # x's uncached last blocks went to the head of the free queue (group 0's 19, then group 1's 4 on top).
    assert new_blocks(out, "b", 2) == [[0, 0, 3, 4, 19, 2], [7, 8, 9, 1, 12, 11]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_group_ids_out_of_range_are_refused(impl: str) -> None:
    s = make(impl, kv_cache_groups=(None, 8))
    s.add_request("a", list(range(5)), max_tokens=2)
    out = s.schedule()
    with pytest.raises(IndexError):
        out.group_new_block_ids(2)
    with pytest.raises(InvalidRequestError):
        s.get_block_ids("a", 2)
    with pytest.raises(InvalidRequestError):
        s.prepare_model_inputs(out)
    with pytest.raises(InvalidConfigError):
        s.set_defer_block_free(True)
    assert s.config.defer_block_free is False


def test_one_group_keeps_its_outputs() -> None:
    s = make("rust")
    s.add_request("a", list(range(5)), max_tokens=2)
    out = s.schedule()
    assert out.group_new_block_ids(0).tolist() == out.new_block_ids.tolist() == [1, 2]
    with pytest.raises(IndexError):
        out.group_new_block_ids(1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_cache_groups": (None,)}, "must list 2 to 64 groups"),
        ({"kv_cache_groups": (None,) * 65}, "must list 2 to 64 groups"),
        ({"kv_cache_groups": (None, 0)}, "windows must be in"),
        ({"kv_cache_groups": (None, 2**31)}, "windows must be in"),
        ({"kv_cache_groups": (None, 8.0)}, "must be None or a list"),
        ({"kv_cache_groups": (None, True)}, "must be None or a list"),
        ({"kv_cache_groups": "full"}, "must be None or a list"),
        ({"kv_cache_groups": (None, "chunked:0")}, "must be None or a list"),
        ({"kv_cache_groups": (None, "chunked:08")}, "must be None or a list"),
        ({"kv_cache_groups": (None, "chunked:")}, "must be None or a list"),
        ({"kv_cache_groups": (None, f"chunked:{2**31 - 1}")}, "must be None or a list"),
        ({"kv_cache_groups": ("chunked:8", 8)}, "needs a full-attention group"),
        ({"kv_cache_groups": ("chunked:8", "chunked:16")}, "needs a full-attention group"),
        ({"kv_cache_groups": (None, 8), "sliding_window": 8}, "cannot be combined with sliding_window"),
        ({"kv_cache_groups": (None, 8), "dcp_world_size": 2}, "dcp_world_size == 1"),
        ({"kv_cache_groups": (None, 8), "preemption_mode": "swap", "num_cpu_blocks": 4}, "'recompute'"),
        ({"kv_cache_groups": (None, 8), "defer_block_free": True}, "defer_block_free"),
        ({"kv_cache_groups": (None, 8), "preemption_victim": "lcf"}, "preemption_victim"),
    ],
)
def test_bad_group_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        SchedulerConfig(**fields)


def test_the_core_refuses_what_the_config_refuses() -> None:
    """The core applies the same rules when a config skips the Python checks (a duck-typed config)."""
    from kvsched import _core

    good = SchedulerConfig(kv_cache_groups=(None, 8))
    for bad in [(None,), (None, 0), (8, "chunked:8"), (None, "chunked:0"), (None, 2**31)]:
        fake = type("Cfg", (), {**good.to_dict(), "kv_cache_groups": bad})()
        with pytest.raises(InvalidConfigError, match="kv_cache_groups"):
            _core.Scheduler(fake)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_kv_connector_is_refused(impl: str) -> None:
    class Conn:
        def get_num_new_matched_tokens(self, *a: Any) -> Any:
            return (0, False)

        def update_state_after_alloc(self, *a: Any) -> None:
            pass

        def request_finished(self, *a: Any) -> Any:
            return (False, None)

    cfg = SchedulerConfig(kv_cache_groups=(None, 8))
    cls = Scheduler if impl == "rust" else ReferenceScheduler
    with pytest.raises(InvalidConfigError, match="KV connector"):
        cls(cfg, kv_connector=Conn())


def test_usage_counts_every_group() -> None:
    s = make("rust", kv_cache_groups=(None, 8, None))
    s.add_request("a", np.arange(10, dtype=np.int32), max_tokens=2)
    s.schedule()
    assert s.num_free_blocks == 39 - 3 * 3


# --- cross-attention groups ("cross": vLLM's CrossAttentionSpec, encoder-decoder models)


def group_new(out: Any, rid: str, g: int) -> list[int]:
    k = list(out.req_ids).index(rid)
    p = out.group_new_block_ids_indptr(g)
    return [int(b) for b in out.group_new_block_ids(g)[p[k] : p[k + 1]]]


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention_blocks_follow_the_encoder_length(impl: str) -> None:
    # vLLM 0.33 (CrossAttentionManager): ceil(encoder tokens / block size) blocks at the first allocation, in
    # group order after the decoder's; none for a request without encoder output; nothing more while it decodes.
    s = make(impl, kv_cache_groups=(None, "cross"), enable_prefix_caching=False)
    assert s.config.kv_cache_groups == (None, "cross")
    s.add_request("a", list(range(6)), max_tokens=8, cross_attention_tokens=9)
    s.add_request("b", list(range(5)), max_tokens=8)
    s.add_request("c", list(range(3)), max_tokens=8, cross_attention_tokens=4)
    out = s.schedule()
    assert tables(s, "a", 2) == [[1, 2], [3, 4, 5]]
    assert tables(s, "b", 2) == [[6, 7], []]
    assert tables(s, "c", 2) == [[8], [9]]
    assert [group_new(out, r, 1) for r in "abc"] == [[3, 4, 5], [], [9]]
    assert [group_new(out, r, 0) for r in "abc"] == [[1, 2], [6, 7], [8]]
    s.check_invariants()
    for _ in range(4):  # decodes: group 0 grows, the cross-attention tables do not
        s.update_from_output(out, [[7], [7], [7]])
        out = s.schedule()
        assert [group_new(out, r, 1) for r in "abc"] == [[], [], []]
    assert tables(s, "a", 2) == [[1, 2, 11], [3, 4, 5]]
    assert tables(s, "c", 2) == [[8, 10], [9]]
    s.check_invariants()
    s.update_from_output(out, [[7], [7], [7]])
    num_free = s.num_free_blocks
    s.abort_requests(["a"])
    assert s.num_free_blocks == num_free + 6
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention_blocks_count_against_the_pool_and_come_back_after_preemption(impl: str) -> None:
    # 9 usable blocks of 4 tokens: "a" takes 2 decoder + 3 cross blocks, "b" 1 + 3; when "a" needs a third
    # decoder block the pool is empty and "b" (the last admitted) is preempted, freeing its cross-attention
    # blocks too; readmitted, it takes them anew.
    s = make(impl, num_blocks=10, kv_cache_groups=(None, "cross"), enable_prefix_caching=False)
    s.add_request("a", list(range(7)), max_tokens=8, cross_attention_tokens=12)
    s.add_request("b", list(range(3)), max_tokens=8, cross_attention_tokens=9)
    out = s.schedule()
    assert tables(s, "a", 2) == [[1, 2], [3, 4, 5]]
    assert tables(s, "b", 2) == [[6], [7, 8, 9]]
    assert s.num_free_blocks == 0
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()  # both still fit their blocks
    assert not list(out.preempted_req_ids)
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()  # "a" needs a third decoder block for its 9th token
    assert list(out.preempted_req_ids) == ["b"]
    assert tables(s, "b", 2) == [[], []]
    assert s.num_free_blocks == 3  # its 4 blocks back, one of them now "a"'s
    s.check_invariants()
    s.update_from_output(out, [[7]])
    s.abort_requests(["a"])
    out = s.schedule()
    assert list(out.resumed_req_ids) == ["b"]
    assert len(group_new(out, "b", 1)) == 3 and len(group_new(out, "b", 0)) == 2
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_cross_attention_tokens_and_groups_are_checked(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="enable_prefix_caching=False"):
        make(impl, kv_cache_groups=(None, "cross"))
    with pytest.raises(InvalidConfigError, match="cannot start with a cross-attention group"):
        make(impl, kv_cache_groups=("cross", None), enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match="'cross'"):
        make(impl, kv_cache_groups=(None, "crossattn"), enable_prefix_caching=False)
    plain = make(impl, kv_cache_groups=(None, 8))
    with pytest.raises(InvalidRequestError, match="needs a cross-attention group"):
        plain.add_request("a", [1, 2], cross_attention_tokens=4)
    s = make(impl, kv_cache_groups=(None, "cross"), enable_prefix_caching=False)
    with pytest.raises(InvalidRequestError, match="more than the KV cache"):
        s.add_request("a", [1, 2], cross_attention_tokens=4 * 40)
    with pytest.raises(InvalidRequestError, match="must be in"):
        s.add_request("a", [1, 2], cross_attention_tokens=-1)
    with pytest.raises(InvalidRequestError, match="streaming-input session"):
        s.add_request("a", [1, 2], cross_attention_tokens=4, resumable=True)
    assert s.num_unfinished_requests == 0


# --- Mamba groups ("mamba": vLLM's MambaSpec with mamba_cache_mode "none", hybrid Mamba models)


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_state_blocks_are_taken_once_in_group_order(impl: str) -> None:
    # vLLM 0.33 (MambaManager, mamba_cache_mode "none", a block of max_model_len tokens): one state block at the
    # first allocation, popped in group order (vLLM lists the groups in layer order: Mamba first for Qwen3-Next,
    # Jamba, Nemotron-H, Granite 4); nothing more while the request decodes. The first group that is not Mamba
    # holds the tokens: its ids are new_block_ids.
    s = make(impl, kv_cache_groups=("mamba", None, "mamba"), enable_prefix_caching=False)
    assert s.config.kv_cache_groups == ("mamba", None, "mamba")
    s.add_request("a", list(range(6)), max_tokens=8)
    s.add_request("b", list(range(3)), max_tokens=8)
    out = s.schedule()
    assert tables(s, "a", 3) == [[1], [2, 3], [4]]
    assert tables(s, "b", 3) == [[5], [6], [7]]
    assert [group_new(out, r, g) for r in "ab" for g in range(3)] == [[1], [2, 3], [4], [5], [6], [7]]
    assert out.new_block_ids.tolist() == [2, 3, 6]
    assert out.group_new_block_ids(1).tolist() == out.new_block_ids.tolist()
    s.check_invariants()
    for _ in range(3):  # decodes: the attention group grows, the Mamba tables do not
        s.update_from_output(out, [[7], [7]])
        out = s.schedule()
        assert [group_new(out, r, g) for r in "ab" for g in (0, 2)] == [[], [], [], []]
    assert tables(s, "a", 3) == [[1], [2, 3, 9], [4]]
    assert tables(s, "b", 3) == [[5], [6, 8], [7]]
    s.check_invariants()
    s.update_from_output(out, [[7], [7]])
    # Freed group by group in group order, each table deepest first, unhashed blocks to the head: "a"'s Mamba
    # block 1, then 9, 3, 2, then 4 (the new head).
    s.abort_requests(["a"])
    assert s.num_free_blocks == 39 - 4
    s.add_request("c", list(range(9)), max_tokens=2)
    out = s.schedule()
    assert tables(s, "c", 3) == [[4], [9, 3, 2], [1]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_speculative_blocks_and_preemption(impl: str) -> None:
    # num_speculative_blocks: 1 + 2 state blocks per Mamba group. 10 usable blocks: "a" takes 3 + 2, "b" 3 + 1;
    # "a" takes the last free block for its 9th token, "b" needs one for its 5th, so "b" (the last admitted) is
    # preempted, its Mamba blocks freed with its tables; readmitted, it takes them anew.
    s = make(impl, num_blocks=11, kv_cache_groups=("mamba", None), enable_prefix_caching=False,
             mamba_speculative_blocks=2)  # fmt: skip
    assert s.config.mamba_speculative_blocks == 2
    s.add_request("a", list(range(7)), max_tokens=8)
    s.add_request("b", list(range(3)), max_tokens=8)
    out = s.schedule()
    assert tables(s, "a", 2) == [[1, 2, 3], [4, 5]]
    assert tables(s, "b", 2) == [[6, 7, 8], [9]]
    assert s.num_free_blocks == 1
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()  # "a" needs a third block for its 9th token, "b" a second for its 5th
    assert list(out.preempted_req_ids) == ["b"]
    assert tables(s, "b", 2) == [[], []]
    s.check_invariants()
    s.update_from_output(out, [[7]])
    s.abort_requests(["a"])
    out = s.schedule()
    assert list(out.resumed_req_ids) == ["b"]
    assert len(group_new(out, "b", 0)) == 3 and len(group_new(out, "b", 1)) == 2
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_blocks_count_in_the_full_sequence_check(impl: str) -> None:
    # 9 usable blocks: "a" holds 1 + 4; "b" (16 tokens: 4 attention blocks + 1 state block) does not fit the 4
    # left, though its first chunk would.
    s = make(impl, num_blocks=10, kv_cache_groups=(None, "mamba"), enable_prefix_caching=False,
             max_num_batched_tokens=24)  # fmt: skip
    s.add_request("a", list(range(13)), max_tokens=2)
    s.add_request("b", list(range(16)), max_tokens=2)
    out = s.schedule()
    assert list(out.req_ids) == ["a"]
    assert s.num_free_blocks == 4
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_groups_are_checked(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="Mamba group needs enable_prefix_caching=False"):
        make(impl, kv_cache_groups=("mamba", None))
    with pytest.raises(InvalidConfigError, match="needs a group that is not Mamba"):
        make(impl, kv_cache_groups=("mamba", "mamba"), enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match="cannot start with a cross-attention group"):
        make(impl, kv_cache_groups=("mamba", "cross", None), enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match="mamba_speculative_blocks"):
        make(impl, kv_cache_groups=(None, 8), mamba_speculative_blocks=1)
    with pytest.raises(InvalidConfigError, match="mamba_speculative_blocks"):
        make(impl, mamba_speculative_blocks=1)
    with pytest.raises(InvalidConfigError, match="'mamba'"):
        make(impl, kv_cache_groups=(None, "mamba2"), enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match="mamba_speculative_blocks"):
        make(impl, kv_cache_groups=(None, "mamba"), enable_prefix_caching=False, mamba_speculative_blocks=-1)
    s = make(impl, kv_cache_groups=("mamba", None), enable_prefix_caching=False)
    s.add_request("a", list(range(5)), max_tokens=2)
    out = s.schedule()
    with pytest.raises(IndexError):
        out.group_new_block_ids(2)
    with pytest.raises(InvalidRequestError):
        s.get_block_ids("a", 2)


def test_the_core_refuses_mamba_groups_the_config_refuses() -> None:
    from kvsched import _core

    good = SchedulerConfig(kv_cache_groups=(None, "mamba"), enable_prefix_caching=False)
    for fields in [
        {"kv_cache_groups": ("mamba", "mamba")},
        {"kv_cache_groups": ("mamba", None), "enable_prefix_caching": True},
        {"kv_cache_groups": (None, 8), "mamba_speculative_blocks": 1},
    ]:
        fake = type("Cfg", (), {**good.to_dict(), **fields})()
        with pytest.raises(InvalidConfigError, match=r"kv_cache_groups|mamba_speculative_blocks"):
            _core.Scheduler(fake)


# --- Mamba groups in align mode (mamba_align: vLLM's mamba_cache_mode "align", block-sized state blocks). The
# tables and new ids are those vLLM 0.33's Scheduler gives for the same calls with a MambaSpec(block_size=4,
# mamba_cache_mode="align") group beside a FullAttentionSpec group of block size 4 (tests/vllm_driver.py
# --mamba --mamba-align runs the two side by side).


def align(impl: str, **fields: Any) -> Any:
    return make(impl, enable_prefix_caching=False, mamba_align=True, **fields)


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_tables_keep_the_running_state_and_free_the_one_before(impl: str) -> None:
    # Block size 4. "a" (10 tokens) runs 8 (the chunk stops at block 2's boundary, the last that leaves a token to
    # compute), "b" (3) all: the Mamba tables hold null blocks up to the state's entry. Each allocation that
    # crosses a block boundary appends the next state's entry (a running request's new ids in the group); the
    # state two allocations old goes back to the pool once the request is a block past it.
    s = align(impl, kv_cache_groups=("mamba", None))
    s.add_request("a", list(range(10)), max_tokens=8)
    s.add_request("b", list(range(100, 103)), max_tokens=8)
    out = s.schedule()
    assert [computed(out, r) + int(out.num_scheduled_tokens[k]) for k, r in enumerate(out.req_ids)] == [8, 3]
    assert tables(s, "a", 2) == [[0, 1], [2, 3]] and tables(s, "b", 2) == [[4], [5]]
    assert [group_new(out, r, g) for r in "ab" for g in range(2)] == [[0, 1], [2, 3], [4], [5]]
    assert out.zero_block_ids.tolist() == [2, 3, 5]  # the attention blocks only
    s.check_invariants()
    s.update_from_output(out, [[], [7]])
    out = s.schedule()  # "a" computes 2 tokens: its state moves to block 2's entry
    assert tables(s, "a", 2) == [[0, 1, 6], [2, 3, 7]]
    assert [group_new(out, r, g) for r in "ab" for g in range(2)] == [[6], [7], [], []]
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()  # 10 computed: block 1 (the state after 8 tokens) goes back; "b" takes it for its state
    assert tables(s, "a", 2) == [[0, 0, 6], [2, 3, 7]]
    assert tables(s, "b", 2) == [[4, 1], [5, 8]]
    assert [group_new(out, r, g) for r in "ab" for g in range(2)] == [[], [], [1], [8]]
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    assert tables(s, "b", 2) == [[0, 1], [5, 8]]
    assert s.num_free_blocks == 32
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_speculative_blocks_move_forward(impl: str) -> None:
    # One speculative state block: "a" (21 tokens) runs 12, then 8 (stopping at token 20, the last boundary that
    # leaves a token); the second chunk's state entry is 4, so the speculative block at entry 3 moves to the end
    # and a new one follows it. "b" (6 tokens) gets the 4 tokens left of the budget: a whole block.
    s = align(impl, kv_cache_groups=(None, "mamba"), max_num_batched_tokens=12, max_num_seqs=4,
              mamba_speculative_blocks=1)  # fmt: skip
    s.add_request("a", list(range(21)), max_tokens=3)
    s.add_request("b", list(range(100, 106)), max_tokens=3)
    out = s.schedule()
    assert list(out.req_ids) == ["a"] and tables(s, "a", 2) == [[1, 2, 3], [0, 0, 4, 5]]
    s.update_from_output(out, [[]])
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [8, 4]
    assert tables(s, "a", 2) == [[1, 2, 3, 6, 7], [0, 0, 4, 0, 5, 8]]
    assert tables(s, "b", 2) == [[9], [10, 11]]
    assert [group_new(out, r, g) for r in "ab" for g in range(2)] == [[6, 7], [5, 8], [9], [10, 11]]
    assert out.zero_block_ids.tolist() == [6, 7, 9]
    s.update_from_output(out, [[], []])
    out = s.schedule()
    assert tables(s, "a", 2) == [[1, 2, 3, 6, 7, 4], [0, 0, 0, 0, 5, 8, 12]]
    assert tables(s, "b", 2) == [[9, 13], [10, 11, 14]]
    s.update_from_output(out, [[7], [7]])
    out = s.schedule()
    assert tables(s, "a", 2) == [[1, 2, 3, 6, 7, 4], [0, 0, 0, 0, 0, 8, 12]]
    assert tables(s, "b", 2) == [[9, 13], [0, 11, 14]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_chunks_end_at_block_boundaries(impl: str) -> None:
    # A chunk that ends before the prompt's end is floored to a block boundary (budget 10: 8 tokens), and no chunk
    # runs past the last boundary that leaves a token to compute (a 17-token prompt: 16, then 1).
    s = align(impl, kv_cache_groups=("mamba", None), max_num_batched_tokens=10, max_num_seqs=4)
    s.add_request("a", list(range(17)), max_tokens=2)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(list(out.num_scheduled_tokens))
        s.update_from_output(out, [[] if n < 9 and computed(out, "a") + n < 17 else [7] for n in chunks[-1]])
    assert chunks == [[8], [8], [1]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_chunk_started_inside_a_block_stops_at_its_end(impl: str) -> None:
    # Block size 8 wider than the prefill threshold (6): "a"'s first chunk (6 tokens, two requests eligible) keeps
    # its unaligned end. Next step, alone (no threshold), it could run to its prompt's end (20) but stops at the
    # end of the block it started in (8), then at 16, the last boundary that leaves a token to compute.
    s = align(impl, kv_cache_groups=("mamba", None), block_size=8, long_prefill_token_threshold=6, max_num_seqs=4)
    s.add_request("a", list(range(20)), max_tokens=2)
    s.add_request("b", [50, 51], max_tokens=1)
    chunks = []
    for _ in range(4):
        out = s.schedule()
        chunks.append(dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True)))
        s.update_from_output(out, [[7] if computed(out, r) + n >= (20 if r == "a" else 2) else []
                                   for r, n in chunks[-1].items()])  # fmt: skip
    assert chunks == [{"a": 6, "b": 2}, {"a": 2}, {"a": 8}, {"a": 4}]
    assert tables(s, "a", 2) == [[0, 4, 1], [2, 3, 5]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_split_to_nothing_skips_a_running_request_and_stops_admissions(impl: str) -> None:
    # Budget 6, block size 4. "a" (12 tokens) runs 4; "b" would get 2, floored to nothing: the admissions stop
    # ("c", behind it, waits too). Next step "a" gets 4 (up to the last boundary that leaves a token), "b" 2:
    # floored to nothing again.
    s = align(impl, kv_cache_groups=("mamba", None), max_num_batched_tokens=6, max_num_seqs=4)
    s.add_request("a", list(range(12)), max_tokens=2)
    s.add_request("b", list(range(100, 110)), max_tokens=2)
    s.add_request("c", [1, 2], max_tokens=2)
    out = s.schedule()
    assert dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True)) == {"a": 4}
    s.update_from_output(out, [[]])
    out = s.schedule()
    assert dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True)) == {"a": 4}
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_is_checked(impl: str) -> None:
    with pytest.raises(InvalidConfigError, match="mamba_align needs a Mamba group"):
        make(impl, mamba_align=True)
    with pytest.raises(InvalidConfigError, match="mamba_align needs a Mamba group"):
        make(impl, kv_cache_groups=(None, 8), mamba_align=True)
    with pytest.raises(InvalidConfigError, match="Mamba group needs enable_prefix_caching=False or mamba_align"):
        make(impl, kv_cache_groups=("mamba", None))
    assert make(impl, kv_cache_groups=("mamba", None), mamba_align=True).config.enable_prefix_caching is True
    events = make(impl, kv_cache_groups=("mamba", None), mamba_align=True, enable_kv_cache_events=True)
    assert events.config.enable_kv_cache_events and events.config.enable_prefix_caching
    assert align(impl, kv_cache_groups=("mamba", None), enable_kv_cache_events=True).config.enable_kv_cache_events
    with pytest.raises(InvalidConfigError, match="disable_chunked_mm_input"):
        align(impl, kv_cache_groups=("mamba", None), disable_chunked_mm_input=True)
    assert align(impl, kv_cache_groups=("mamba", None)).config.mamba_align is True


def test_the_core_refuses_align_mamba_configs_the_config_refuses() -> None:
    from kvsched import _core

    good = SchedulerConfig(kv_cache_groups=(None, "mamba"), enable_prefix_caching=False, mamba_align=True)
    for fields in [
        {"kv_cache_groups": (None, 8)},
        {"kv_cache_groups": None},
        {"disable_chunked_mm_input": True},
    ]:
        fake = type("Cfg", (), {**good.to_dict(), **fields})()
        with pytest.raises(InvalidConfigError, match="mamba_align"):
            _core.Scheduler(fake)


# --- align-mode Mamba groups with prefix caching (vLLM's default for hybrid Mamba models): Mamba prefix hits, cached
# states, same-step hits deferred, shared-prefix junction stops. The tables are those vLLM 0.33's Scheduler gives
# for the same calls (tests/vllm_driver.py --mamba --mamba-align runs the two side by side with prefix caching on).


def align_cached(impl: str, **fields: Any) -> Any:
    return make(impl, enable_prefix_caching=True, mamba_align=True, **fields)


def run_all(s: Any) -> None:
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, [[7] for _ in out.req_ids])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", ["mamba_first", "mamba_last"])
def test_align_mamba_prefix_hit_takes_the_cached_state_block(impl: str, order: str) -> None:
    # "a" (13 tokens) runs 12 (the last boundary that leaves a token): its Mamba state after 12 tokens sits at
    # entry 2 and enters the cache with the attention blocks. "b", the same prompt later, hits 12 tokens: the
    # attention blocks and that state block, after two null entries; its own state follows at entry 3.
    groups, m = (("mamba", None), 0) if order == "mamba_first" else ((None, "mamba"), 1)
    s = align_cached(impl, kv_cache_groups=groups)
    s.add_request("a", list(range(13)), max_tokens=3)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [12]
    state = tables(s, "a", 2)[m]
    assert state[:2] == [0, 0] and len(state) == 3
    s.update_from_output(out, [[]])
    run_all(s)
    s.add_request("b", list(range(13)), max_tokens=3)
    out = s.schedule()
    assert computed(out, "b") == 12 and list(out.num_scheduled_tokens) == [1]
    t = tables(s, "b", 2)[m]
    assert t[:3] == [0, 0, state[2]] and len(t) == 4
    assert new_blocks(out, "b", 2)[m] == t  # a new request's whole table, null entries included
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate", [True, False])
def test_align_mamba_hit_on_a_state_cached_this_step_waits(impl: str, gate: bool) -> None:
    # "b" would hit the state "a" caches in the same step (computed by that step): its allocation (or the
    # full-sequence check before it) fails as a full pool's would, ending the admissions; next step it is admitted
    # with the hit.
    s = align_cached(impl, kv_cache_groups=(None, "mamba"), scheduler_reserve_full_isl=gate)
    s.add_request("a", list(range(13)), max_tokens=3)
    s.add_request("b", list(range(13)), max_tokens=3)
    s.add_request("c", list(range(50, 54)), max_tokens=3)
    out = s.schedule()
    assert list(out.req_ids) == ["a"]
    s.update_from_output(out, [[]])
    out = s.schedule()
    assert list(out.req_ids) == ["a", "b", "c"] and computed(out, "b") == 12
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("retention", [None, 0])
def test_align_mamba_shared_prefix_junction_ends_the_chunk(impl: str, retention: int | None) -> None:
    # "b" shares 16 tokens with "a": the attention hit is 4 blocks, but "a" cached no Mamba state at 16, so the
    # hit is 0 and 16 is the junction: "b"'s first chunk ends there (else at 28) and caches its state, which "c"
    # (the same 16 tokens, another tail) then hits. With sparse retention (prefix_cache_retention_interval 0) the
    # junction's state is cached too.
    s = align_cached(impl, kv_cache_groups=(None, "mamba"), prefix_cache_retention_interval=retention)
    s.add_request("a", list(range(24)), max_tokens=1)
    run_all(s)
    s.add_request("b", list(range(16)) + list(range(500, 514)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == 0 and list(out.num_scheduled_tokens) == [16]
    s.update_from_output(out, [[]])
    run_all(s)
    s.add_request("c", list(range(16)) + list(range(900, 910)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "c") == 16
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("retention", "b_hit"), [(None, 16), (0, 0), (8, 16), (12, 12)])
def test_sparse_window_retention_caches_the_shared_prefix_junction(
    impl: str, retention: int | None, b_hit: int
) -> None:
    # A full-attention group and a window of 6 tokens (a hit needs the window's 2 blocks before its end). "a" (25
    # tokens) with retention 0 caches the window's blocks 4 and 5 only: "b", sharing 16 tokens, hits 16 tokens of
    # full attention but none of the window, so its hit is 0 and 16 is its junction: "b" caches the window's blocks
    # 2 and 3, which "c" (the same 16 tokens, another tail) then hits. Segments of 3 blocks keep blocks 1 and 2
    # ("b" hits 12); dense retention, or segments no longer than the run (8), keep every block.
    s = make(impl, kv_cache_groups=(None, 6), prefix_cache_retention_interval=retention)
    s.add_request("a", list(range(25)), max_tokens=1)
    run_all(s)
    s.add_request("b", list(range(16)) + list(range(500, 509)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == b_hit
    s.update_from_output(out, [[7]])
    run_all(s)
    s.add_request("c", list(range(16)) + list(range(900, 909)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "c") == 16
    s.check_invariants()


# --- sparse retention of cached Mamba states (prefix_cache_retention_interval, vLLM 0.33's engine default 0): only
# the states a later request can resume at, and one every `interval` tokens.


def run_chunked(s: Any, lengths: dict[str, int]) -> None:
    """Steps until every request is done, each sampling a token only once its prompt (``lengths``) is computed."""
    while s.has_unfinished_requests():
        out = s.schedule()
        ends = [computed(out, r) + int(n) for r, n in zip(out.req_ids, out.num_scheduled_tokens, strict=True)]
        s.update_from_output(out, [[7] if e >= lengths[r] else [] for r, e in zip(out.req_ids, ends, strict=True)])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("retention", "hit"), [(None, 16), (0, 0), (4, 16), (8, 16), (12, 0)])
def test_align_mamba_sparse_retention_caches_fewer_states(impl: str, retention: int | None, hit: int) -> None:
    # "a" (24 tokens) runs in chunks of 8: its states after 8, 16 and 20 tokens (the last boundary before its last
    # token) sit at entries 1, 3 and 4. Dense retention caches the three; 0 only the one after 20; 8 those at
    # multiples of 8 too; 12 those at multiples of 12 (none of a's). "b" shares 16 tokens: it hits them only when the
    # state after 16 is cached; "a"'s resend hits 20 tokens whatever the interval.
    s = align_cached(
        impl, kv_cache_groups=(None, "mamba"), max_num_batched_tokens=8, prefix_cache_retention_interval=retention
    )
    s.add_request("a", list(range(24)), max_tokens=1)
    run_chunked(s, {"a": 24})
    s.add_request("b", list(range(16)) + list(range(500, 514)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == hit
    s.update_from_output(out, [[]])
    s.abort_requests(["b"])
    s.add_request("a2", list(range(24)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "a2") == 20
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_align_mamba_sparse_retention_keeps_the_prompt_checkpoint(impl: str) -> None:
    # With 2 hash look-ahead tokens a 13-token prompt's checkpoint is 8 (two tokens left for the hash): the first
    # chunk ends there and its state is cached though 8 is not the last boundary before the last token (12), which
    # has no hash yet; the resend hits it.
    s = align_cached(impl, kv_cache_groups=(None, "mamba"), hash_lookahead_tokens=2, prefix_cache_retention_interval=0)
    s.add_request("a", list(range(13)), max_tokens=1)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [8]
    s.update_from_output(out, [[]])
    run_all(s)
    s.add_request("b", list(range(13)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == 8
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("mamba_eagle_group", "drop_junction_below"), [(True, True), (False, True), (True, False)])
def test_the_drop_keeps_a_mamba_state_below_a_junction_for_groups_that_take_its_rules(
    impl: str, mamba_eagle_group: bool, drop_junction_below: bool
) -> None:
    # The trailing-block drop under retention 0: "a" (40 tokens) caches every attention block but Mamba states only
    # at 32 and 36. "b" shares 24 tokens: its attention hit (20 tokens after the drop) passes its Mamba hit (none),
    # so 20 is its junction, and its first chunk (the budget) ends at 16, a block below. That state is kept only
    # when the Mamba group takes the drop's rules and the junction rule is vLLM 0.33's; "c", which diverges right
    # after the junction (its attention hit gives up the block past 16), then hits it.
    s = align_cached(
        impl,
        kv_cache_groups=("mamba", None),
        max_num_batched_tokens=16,
        num_blocks=80,
        prefix_cache_retention_interval=0,
        drop_trailing_hit_block=True,
        mamba_eagle_group=mamba_eagle_group,
        drop_junction_below=drop_junction_below,
    )
    base = list(range(100, 140))
    s.add_request("a", base, max_tokens=1)
    while s.has_unfinished_requests():  # its prefill in chunks: a token only at the last
        out = s.schedule()
        done = int(out.num_computed_tokens[0] + out.num_scheduled_tokens[0]) == len(base)
        s.update_from_output(out, [[7] if done else []])
    s.add_request("b", [*base[:24], *range(300, 316)], max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == 0 and list(out.num_scheduled_tokens) == [16]
    s.update_from_output(out, [[]])
    s.add_request("c", [*base[:20], *range(500, 508)], max_tokens=1)
    out = s.schedule()
    assert computed(out, "c") == (16 if mamba_eagle_group and drop_junction_below else 0)
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_retention_interval_is_checked(impl: str) -> None:
    mamba = {"kv_cache_groups": (None, "mamba"), "mamba_align": True}
    with pytest.raises(InvalidConfigError, match="must be a multiple of block_size"):
        make(impl, prefix_cache_retention_interval=6, **mamba)
    with pytest.raises(InvalidConfigError, match="needs a sliding window or a Mamba group"):
        make(impl, prefix_cache_retention_interval=8)
    with pytest.raises(InvalidConfigError, match="needs a sliding window or a Mamba group"):
        make(impl, kv_cache_groups=(None, "chunked:8"), prefix_cache_retention_interval=8)
    with pytest.raises(InvalidConfigError, match="must be a multiple of block_size"):
        make(impl, sliding_window=8, prefix_cache_retention_interval=6)
    assert (
        make(impl, kv_cache_groups=(None, 8), prefix_cache_retention_interval=0).config.prefix_cache_retention_interval
        == 0
    )
    assert make(impl, sliding_window=8, prefix_cache_retention_interval=8).config.prefix_cache_retention_interval == 8
    with pytest.raises(InvalidConfigError, match="prefix_cache_retention_interval"):
        make(impl, prefix_cache_retention_interval=-4, **mamba)
    assert make(impl, prefix_cache_retention_interval=0).config.prefix_cache_retention_interval == 0
    assert make(impl, prefix_cache_retention_interval=8, **mamba).config.prefix_cache_retention_interval == 8
    no_cache = make(impl, kv_cache_groups=(None, 8), enable_prefix_caching=False, prefix_cache_retention_interval=8)
    assert no_cache.config.prefix_cache_retention_interval == 8


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("retention", [None, 0], ids=["dense", "sparse"])
@pytest.mark.parametrize(("alignment", "first"), [(4, 13), (8, 12)])
def test_align_mamba_prefill_checkpoint_is_exported_from_inside_the_last_chunk(
    impl: str, retention: int | None, alignment: int, first: int
) -> None:
    # "a" (13 tokens) with prefill checkpoints: with an alignment of 4 its one chunk runs all 13 tokens, the state
    # after 12 tokens (the checkpoint, 12 tokens from the chunk's start) exported to an extra block at entry 2
    # (ceil(13 / 4) - 2), the running state at entry 3: the first allocation pops both. With 8 (12 is not a
    # multiple of it) the chunk stops at 12 as without checkpoints; that chunk can export the state after 8 (its
    # checkpoint) to entry 1, which dense retention reserves (vLLM reserves on any chunk then), retention 0 not
    # (only on the chunk that reaches the prefill's end). Either way the state after 12 is cached and "b", the same
    # prompt later, hits it.
    s = align_cached(
        impl,
        kv_cache_groups=(None, "mamba"),
        mamba_prefill_checkpoint_alignment=alignment,
        prefix_cache_retention_interval=retention,
    )
    s.add_request("a", list(range(13)), max_tokens=1)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [first]
    mamba = tables(s, "a", 2)[1]
    if first == 13:
        assert len(mamba) == 4 and mamba[:2] == [0, 0] and 0 not in mamba[2:]
    else:
        assert len(mamba) == 3 and mamba[0] == 0 and 0 not in mamba[2:]
        assert (mamba[1] != 0) == (retention is None)
    s.update_from_output(out, [[7] if first == 13 else []])
    run_all(s)
    s.add_request("b", list(range(13)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "b") == 12
    s.check_invariants()


def test_prefill_checkpoints_need_align_mode() -> None:
    from kvsched import _core

    with pytest.raises(InvalidConfigError, match="mamba_prefill_checkpoint_alignment needs mamba_align"):
        SchedulerConfig(
            kv_cache_groups=(None, "mamba"), enable_prefix_caching=False, mamba_prefill_checkpoint_alignment=4
        )
    with pytest.raises(InvalidConfigError, match="mamba_prefill_checkpoint_alignment"):
        SchedulerConfig(kv_cache_groups=(None, "mamba"), mamba_align=True, mamba_prefill_checkpoint_alignment=0)
    good = SchedulerConfig(kv_cache_groups=(None, "mamba"), mamba_align=True, mamba_prefill_checkpoint_alignment=4)
    fake = type("Cfg", (), {**good.to_dict(), "mamba_align": False, "enable_prefix_caching": False})()
    with pytest.raises(InvalidConfigError, match="mamba_prefill_checkpoint_alignment needs mamba_align"):
        _core.Scheduler(fake)


def test_the_core_refuses_retention_intervals_the_config_refuses() -> None:
    from kvsched import _core

    good = SchedulerConfig(kv_cache_groups=(None, "mamba"), mamba_align=True, prefix_cache_retention_interval=0)
    for fields, match in [
        ({"prefix_cache_retention_interval": 6, "block_size": 4}, "multiple of block_size"),
        ({"kv_cache_groups": None, "mamba_align": False, "prefix_cache_retention_interval": 32}, "Mamba group"),
        ({"kv_cache_groups": (None, "chunked:8"), "mamba_align": False, "prefix_cache_retention_interval": 8}, "Mamba"),
    ]:
        fake = type("Cfg", (), {**good.to_dict(), **fields})()
        with pytest.raises(InvalidConfigError, match=match):
            _core.Scheduler(fake)


# --- chunked-local attention groups ("chunked:<c>": vLLM's ChunkedLocalAttentionSpec, Llama 4). The tables are those
# vLLM 0.33's Scheduler gives for the same calls with a FullAttentionSpec and a ChunkedLocalAttentionSpec
# (attention_chunk_size=8) group of block size 4 (tests/test_vllm_differential.py runs the second side by side).


def step(s: Any, token: int = 9) -> Any:
    out = s.schedule()
    s.update_from_output(out, [[token]] * len(out.req_ids))
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_local_frees_the_blocks_before_the_chunk_and_hits_from_its_start(impl: str) -> None:
    s = make(impl, kv_cache_groups=(None, "chunked:8"))
    assert s.config.kv_cache_groups == (None, "chunked:8")
    s.add_request("a", list(range(22)), max_tokens=8)
    out = step(s, 7)
    expect = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert new_blocks(out, "a", 2) == expect
    out = s.schedule()
    # 22 computed: token 22 attends to its chunk 16..22 only; blocks 0..3 (tokens 0..15) go back to the pool.
    assert tables(s, "a", 2) == [expect[0], [0, 0, 0, 0, 11, 12]]
    assert new_blocks(out, "a", 2) == [[], []]
    s.update_from_output(out, [[7]])
    s.check_invariants()
    s.abort_requests(["a"])
    # A hit of 5 blocks (20 tokens): token 20's chunk starts at 16, so the chunked group's hit is 4 null blocks and
    # its cached block 4; the uncached last blocks were freed to the head (group 1's on top) and are popped again.
    s.add_request("b", [*range(22), 99], max_tokens=4)
    out = s.schedule()
    assert computed(out, "b") == 20
    assert new_blocks(out, "b", 2) == [[1, 2, 3, 4, 5, 12], [0, 0, 0, 0, 11, 6]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_chunked_local_hit_needs_the_cached_blocks_from_its_chunks_start(impl: str) -> None:
    """The chunked group's block 4 was freed early (it left the chunk while "a" decoded) and evicted by "c": the
    full-attention hit of 5 blocks is cut to the chunk's start, 4 blocks, every one of them a null block in the
    chunked group."""
    s = make(impl, kv_cache_groups=(None, "chunked:8"), num_blocks=21, max_num_seqs=4)
    a = list(range(100, 124))
    s.add_request("a", a, max_tokens=10)
    step(s)
    assert tables(s, "a", 2) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    step(s)
    # 24 computed, token 24 opens a chunk: the chunked group's blocks 0..5 leave it.
    assert tables(s, "a", 2) == [[1, 2, 3, 4, 5, 6, 13], [0, 0, 0, 0, 0, 0, 14]]
    for _ in range(8):
        step(s)
    assert s.num_free_blocks == 20
    s.add_request("c", list(range(300, 316)), max_tokens=1)
    out = step(s)
    assert new_blocks(out, "c", 2) == [[18, 17, 19, 20], [12, 11, 10, 9]]
    step(s)
    s.add_request("b", [*a[:22], 99], max_tokens=2)
    out = s.schedule()
    assert computed(out, "b") == 16
    assert new_blocks(out, "b", 2) == [[1, 2, 3, 4, 8, 7], [0, 0, 0, 0, 16, 14]]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_local_caps_the_full_sequence_check(impl: str) -> None:
    """With scheduler_reserve_full_isl a chunked group needs at most ceil(min(c + in-flight tokens, max_model_len) /
    bs) blocks for the whole sequence (vLLM's admission cap): a 120-token prompt is admitted with 36 free blocks,
    30 full-attention blocks and, for chunks of 8 with 16 tokens a step, ceil(24 / 4) = 6 chunked ones (a
    window's cap, one block more, would not fit)."""
    s = make(
        impl,
        kv_cache_groups=(None, "chunked:8"),
        num_blocks=37,
        max_num_batched_tokens=16,
        scheduler_reserve_full_isl=True,
    )
    s.add_request("a", list(range(120)), max_tokens=1)
    out = s.schedule()
    assert computed(out, "a") == 0 and list(out.req_ids) == ["a"]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_mamba_group_beside_a_chunked_local_group(impl: str) -> None:
    # A Mamba group first, then full attention (the primary group) and chunked-local attention in chunks of 8: the
    # state block is taken once, the chunked group frees the blocks before the chunk of the next token, and the
    # attention blocks (not the state block) are listed for zeroing.
    s = make(impl, kv_cache_groups=("mamba", None, "chunked:8"), enable_prefix_caching=False)
    s.add_request("a", list(range(22)), max_tokens=8)
    out = step(s, 7)
    assert new_blocks(out, "a", 3) == [[1], [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]]
    assert out.new_block_ids.tolist() == [2, 3, 4, 5, 6, 7]
    assert out.zero_block_ids.tolist() == list(range(2, 14))
    out = s.schedule()
    assert tables(s, "a", 3) == [[1], [2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 12, 13]]
    assert new_blocks(out, "a", 3) == [[], [], []]
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_largest_chunk_size_stops_below_the_mamba_encoding(impl: str) -> None:
    # The core spells a Mamba group CHUNKED_LOCAL | (2**31 - 2) and a ring CHUNKED_LOCAL | (2**31 - 3): chunk sizes
    # stop at 2**31 - 4.
    s = make(impl, kv_cache_groups=(None, f"chunked:{2**31 - 4}"))
    assert s.config.kv_cache_groups == (None, f"chunked:{2**31 - 4}")
    for size in (2**31 - 3, 2**31 - 2):
        with pytest.raises(InvalidConfigError, match="chunked"):
            make(impl, kv_cache_groups=(None, f"chunked:{size}"))


def test_the_core_refuses_the_chunk_size_of_the_mamba_encoding() -> None:
    from kvsched import _core

    good = SchedulerConfig(kv_cache_groups=(None, "chunked:8"))
    for size in (2**31 - 3, 2**31 - 2):  # the ring's and the Mamba group's encodings
        fake = type("Cfg", (), {**good.to_dict(), "kv_cache_groups": (None, f"chunked:{size}")})()
        with pytest.raises(InvalidConfigError, match="chunked"):
            _core.Scheduler(fake)
