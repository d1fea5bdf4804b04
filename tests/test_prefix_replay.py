"""Bounded prefix replay (``prefix_replay_groups``, vLLM 0.33's ``SlidingWindowMLASpec`` with ``bounded_replay``, as in
DeepSeek V4.1): a replay group is a sliding window that is never cached nor looked up. A request admitted with a
prefix hit computes the hit's last window W again (``get_replay_start`` says from where) to rebuild that group,
keeping the other groups' hit blocks; the replay group's table gets null blocks below the window and fresh blocks
from there. A hit of at most W tokens is dropped, a KV connector's hit is floored to whole blocks, and a load that
carries the window (every replay group among ``get_loaded_kv_cache_group_ids``) replays nothing. Each behaviour test
runs on the Rust core and on the pure-Python reference; the soaks compare the two step by step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched import InvalidConfigError, RequestStatus, SchedulerConfig, UnknownRequestError
from kvsched.reference import ReferenceScheduler

IMPLS = [pytest.param("rust", marks=requires_rust), "reference"]
S = RequestStatus

BS = 16  # block size
W = 32  # the replay window
PROMPT = 100  # tokens: 6 full blocks cached, a 96-token hit
HIT = PROMPT // BS * BS
FULL, SWA = 0, 1


class Conn:
    """A scripted KV connector: ``answers[req_id]`` is what get_num_new_matched_tokens returns (default (0, False));
    ``loaded`` (None: no hook) the groups a load restores."""

    def __init__(self, answers: dict[str, Any] | None = None, loaded: tuple[int, ...] | None = None) -> None:
        self.answers = answers or {}
        if loaded is not None:
            self.get_loaded_kv_cache_group_ids = lambda req_id: list(loaded)

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> Any:
        return self.answers.get(req_id, (0, False))

    def update_state_after_alloc(self, req_id: str, block_ids: Any, num_external_tokens: int) -> None:
        pass

    def request_finished(self, req_id: str, block_ids: Any) -> Any:
        return False


def make(impl: str, conn: Any = None, **fields: Any) -> Any:
    base: dict[str, Any] = {
        "block_size": BS,
        "num_blocks": 64,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "prefix_hash_seed": 0,
        "kv_cache_groups": (None, W),
        "prefix_replay_groups": (SWA,),
    }
    if conn is not None:
        base["kv_connector_groups"] = True  # the hooks get one table per group
    cfg = SchedulerConfig(**{**base, **fields})
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(cfg, kv_connector=conn)
    return ReferenceScheduler(cfg, kv_connector=conn)


def step(s: Any, prompts: dict[str, int]) -> Any:
    """One schedule() and its update: a request whose prompt is complete samples token 1000."""
    out = s.schedule()
    s.check_invariants()
    sampled = []
    for rid, comp, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
        sampled.append([1000] if comp + n >= prompts[rid] else [])
    s.update_from_output(out, sampled)
    s.check_invariants()
    return out


def scheduled(out: Any, rid: str) -> tuple[int, int]:
    """(num_computed_tokens, num_scheduled_tokens) of ``rid`` in ``out``."""
    k = list(out.req_ids).index(rid)
    return int(out.num_computed_tokens[k]), int(out.num_scheduled_tokens[k])


def table(s: Any, rid: str, g: int) -> list[int]:
    return [int(b) for b in s.get_block_ids(rid, g)]


def prefill(s: Any, rid: str, n: int, prompts: dict[str, int], **kw: Any) -> None:
    prompts[rid] = n
    s.add_request(rid, [7] * n, max_tokens=kw.pop("max_tokens", 20), **kw)
    while s.get_num_computed_tokens(rid) < n:
        step(s, prompts)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_hit_replays_its_last_window_sharing_the_full_groups_blocks(impl: str) -> None:
    # "b" repeats "a"'s prompt: full attention hits 96 tokens; the last 32 are computed again (replay_start 64), the
    # full group keeps every hit block (no new slots for the replayed tokens) and adds one; the window group takes
    # nothing from the hit: null blocks below the window of token 96, fresh blocks for the rest.
    s = make(impl)
    prompts: dict[str, int] = {}
    prefill(s, "a", PROMPT, prompts)
    a_full = table(s, "a", FULL)
    prompts["b"] = PROMPT
    s.add_request("b", [7] * PROMPT, max_tokens=5)
    assert s.get_replay_start("b") == 0  # not set before its admission
    out = step(s, prompts)
    assert scheduled(out, "b") == (HIT - W, PROMPT - HIT + W)
    assert s.get_replay_start("b") == HIT - W
    full, swa = table(s, "b", FULL), table(s, "b", SWA)
    num_hit = HIT // BS
    assert full[:num_hit] == a_full[:num_hit] and len(full) == num_hit + 1
    assert all(s.get_block_ref_cnt(b) == 2 for b in full[:num_hit])
    skipped = (HIT - W + 1) // BS
    assert swa[:skipped] == [0] * skipped
    assert len(swa) == -(-PROMPT // BS) and 0 not in swa[skipped:]
    assert not (set(swa) - {0}) & (set(table(s, "a", SWA)) | set(a_full))
    assert s.get_num_computed_tokens("b") == PROMPT
    stats = s.stats()
    assert stats.prefix_cache_hits == HIT  # the hit counts whole, replayed tokens included
    # the replay group is never cached: a lookup gives it null blocks as long as the hit
    assert s.get_cached_block_ids([7] * PROMPT, group=SWA).tolist() == [0] * num_hit


@pytest.mark.parametrize("impl", IMPLS)
def test_replay_only_chunks_make_progress(impl: str) -> None:
    # Chunks of one block (long_prefill_token_threshold with "a" still running): "b" first computes two chunks that
    # lie inside the replayed window, allocating nothing in the full group, then its 4 new tokens.
    s = make(impl, long_prefill_token_threshold=BS)
    prompts: dict[str, int] = {}
    prefill(s, "a", PROMPT, prompts, max_tokens=40)
    prompts["b"] = PROMPT
    s.add_request("b", [7] * PROMPT, max_tokens=5)
    chunks = []
    while s.get_num_computed_tokens("b") < PROMPT:
        out = step(s, prompts)
        comp, n = scheduled(out, "b")
        if not chunks:
            assert comp == HIT - W and s.get_replay_start("b") == HIT - W
            assert len(table(s, "b", FULL)) == HIT // BS  # the hit's blocks, nothing new
        chunks.append(n)
    assert chunks == [BS, BS, PROMPT - HIT]
    assert len(table(s, "b", FULL)) == -(-PROMPT // BS)
    assert s.get_request_status("b") == S.RUNNING


@pytest.mark.parametrize("impl", IMPLS)
def test_an_asynchronous_load_replays_once_it_is_over(impl: str) -> None:
    # A load of 64 tokens that restores the full group only: the request waits with 64 computed tokens, and once
    # the load is reported over it computes from 32 (the load's last window again).
    s = make(impl, Conn({"r": (64, True)}, loaded=(FULL,)))
    prompts = {"r": PROMPT}
    s.add_request("r", list(range(PROMPT)), max_tokens=3)
    out = step(s, prompts)
    assert out.req_ids == [] and s.get_request_status("r") == S.WAITING_FOR_REMOTE_KVS
    assert s.get_num_computed_tokens("r") == 64 and s.get_replay_start("r") == 0
    s.update_kv_transfers(finished_recving=["r"])
    out = step(s, prompts)
    assert scheduled(out, "r") == (64 - W, PROMPT - 64 + W)
    assert s.get_replay_start("r") == 64 - W


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_connector_hit_without_the_window_is_taken_in_whole_blocks(impl: str, is_async: bool) -> None:
    # 63 matched tokens become 48: a hit ending inside a block would start the replay in a block the window
    # group frees. The replay then starts at 16, in a real block of the window group.
    s = make(impl, Conn({"r": (4 * BS - 1, is_async)}, loaded=(FULL,)))
    prompts = {"r": PROMPT}
    s.add_request("r", list(range(PROMPT)), max_tokens=3)
    out = step(s, prompts)
    if is_async:
        assert s.get_num_computed_tokens("r") == 3 * BS
        s.update_kv_transfers(finished_recving=["r"])
        out = step(s, prompts)
    hit = 3 * BS
    assert scheduled(out, "r") == (hit - W, PROMPT - hit + W)
    assert s.get_replay_start("r") == hit - W
    assert table(s, "r", SWA)[(hit - W) // BS] != 0
    stats = s.stats()
    assert (stats.connector_prefix_cache_queries, stats.connector_prefix_cache_hits) == (PROMPT, hit)


@pytest.mark.parametrize("hook", ["every group", "no hook"])
@pytest.mark.parametrize("matched", [W, 4 * BS - 1])
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_load_carrying_the_window_is_taken_as_it_is(impl: str, is_async: bool, matched: int, hook: str) -> None:
    # A load of the request's own blocks (disaggregated prefill) restores every group, the window included: no
    # replay, no floor to whole blocks, and a hit no longer than the window is kept. A connector without the hook
    # restores every group.
    conn = Conn({"r": (matched, is_async)}, loaded=(FULL, SWA) if hook == "every group" else None)
    s = make(impl, conn)
    prompts = {"r": PROMPT}
    s.add_request("r", list(range(PROMPT)), max_tokens=3)
    out = step(s, prompts)
    if is_async:
        assert s.get_request_status("r") == S.WAITING_FOR_REMOTE_KVS
        s.update_kv_transfers(finished_recving=["r"])
        out = step(s, prompts)
    assert scheduled(out, "r") == (matched, PROMPT - matched)
    assert s.get_replay_start("r") == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_a_local_hit_no_longer_than_the_window_is_dropped(impl: str) -> None:
    # "a" (32 tokens) caches 2 blocks; "long" would hit exactly the window, which the replay would compute whole:
    # the hit is dropped (nothing shared, no hit counted) and "long" computes its prompt from 0.
    s = make(impl)
    prompts: dict[str, int] = {}
    prefill(s, "a", W, prompts)
    prompts["long"] = PROMPT
    s.add_request("long", [7] * PROMPT, max_tokens=3)
    queries = s.stats().prefix_cache_queries
    out = step(s, prompts)
    assert scheduled(out, "long") == (0, PROMPT)
    assert s.get_replay_start("long") == 0
    assert not set(table(s, "long", FULL)) & set(table(s, "a", FULL))
    stats = s.stats()
    assert (stats.prefix_cache_queries - queries, stats.prefix_cache_hits) == (PROMPT, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_connector_hit_no_longer_than_the_window_is_dropped(impl: str) -> None:
    # An asynchronous load of 32 tokens without the window is never started: the request runs at once from 0.
    # The connector's stats count the query and no hit.
    s = make(impl, Conn({"r": (W, True)}, loaded=(FULL,)))
    prompts = {"r": PROMPT}
    s.add_request("r", list(range(PROMPT)), max_tokens=3)
    out = step(s, prompts)
    assert s.get_request_status("r") == S.RUNNING
    assert scheduled(out, "r") == (0, PROMPT)
    assert s.get_replay_start("r") == 0
    stats = s.stats()
    assert (stats.connector_prefix_cache_queries, stats.connector_prefix_cache_hits) == (PROMPT, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_hit_just_past_the_window_replays_it_whole(impl: str) -> None:
    # A 48-token hit (3 blocks) is one block longer than the window: kept, replayed from 16.
    s = make(impl)
    prompts: dict[str, int] = {}
    prefill(s, "a", 3 * BS + 1, prompts)
    prompts["b"] = PROMPT
    s.add_request("b", [7] * PROMPT, max_tokens=3)
    out = step(s, prompts)
    assert scheduled(out, "b") == (3 * BS - W, PROMPT - 3 * BS + W)
    assert s.get_replay_start("b") == 3 * BS - W


class EcConn:
    """An encoder-cache connector that holds every output and logs the deferral gate's questions."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def has_cache_item(self, mm_hash: int) -> bool:
        return False

    def ensure_cache_available(self, req_id: str, num_computed_tokens: int) -> bool:
        self.asked.append((req_id, num_computed_tokens))
        return True


@pytest.mark.parametrize("impl", IMPLS)
def test_the_encoder_cache_gate_covers_the_replayed_window_too(impl: str) -> None:
    # The EC connector's gate is asked for the tokens before the replay: the replayed window's encoder inputs are
    # computed again.
    s = make(impl, max_num_encoder_input_tokens=256, encoder_cache_size=256)
    ec = EcConn()
    s.set_ec_connector(ec)
    prompts: dict[str, int] = {}
    prefill(s, "a", PROMPT, prompts, encoder_inputs=[(80, 8, 42)])
    prompts["b"] = PROMPT
    s.add_request("b", [7] * PROMPT, max_tokens=3, encoder_inputs=[(80, 8, 42)])
    out = step(s, prompts)
    assert scheduled(out, "b") == (HIT - W, PROMPT - HIT + W)
    assert [n for rid, n in ec.asked if rid == "b"][:1] == [HIT - W]


@pytest.mark.parametrize("impl", IMPLS)
def test_without_replay_groups_a_window_keeps_its_hit(impl: str) -> None:
    # The same layout without prefix_replay_groups: the window group is looked up and the hit is taken whole.
    s = make(impl, prefix_replay_groups=())
    prompts: dict[str, int] = {}
    prefill(s, "a", PROMPT, prompts)
    prompts["b"] = PROMPT
    s.add_request("b", [7] * PROMPT, max_tokens=3)
    out = step(s, prompts)
    assert scheduled(out, "b") == (HIT, PROMPT - HIT)
    assert s.get_replay_start("b") == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_replay_start_of_an_unknown_request_is_refused(impl: str) -> None:
    with pytest.raises(UnknownRequestError):
        make(impl).get_replay_start("nope")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefix_replay_groups": (1,)}, "prefix_replay_groups needs kv_cache_groups (several KV cache groups)"),
        (
            {"kv_cache_groups": (None, 8), "prefix_replay_groups": (2,)},
            "prefix_replay_groups entry 2 is not a group (kv_cache_groups has 2)",
        ),
        (
            {"kv_cache_groups": (None, 8), "prefix_replay_groups": (1, 1)},
            "prefix_replay_groups lists group 1 more than once",
        ),
        (
            {"kv_cache_groups": (None, 8, "ring"), "prefix_replay_groups": (2,)},
            "prefix_replay_groups entry 2 is not a sliding-window group",
        ),
        (
            {"kv_cache_groups": (None, 8, "chunked:8"), "prefix_replay_groups": (0,)},
            "prefix_replay_groups entry 0 is not a sliding-window group",
        ),
        (
            {"kv_cache_groups": (None, 8, 16), "prefix_replay_groups": (1, 2)},
            "prefix_replay_groups' windows must agree, got 8 and 16",
        ),
        (
            {"kv_cache_groups": ("ring", 8, 8), "prefix_replay_groups": (1, 2)},
            "prefix_replay_groups lists every attention group; a replayed window needs a full-attention or "
            "sliding-window group that is not replayed",
        ),
        (
            {"kv_cache_groups": (8, None), "prefix_replay_groups": (0,), "kv_cache_group_block_sizes": (2, 32)},
            "kv_cache_group_block_sizes must give block_size (16) to a group that is not Mamba, ring or replayed, "
            "got [2, 32]",
        ),
        (
            {"kv_cache_groups": (8, None), "kv_cache_group_block_sizes": (8, 16)},
            "kv_cache_group_block_sizes must be multiples of block_size (16) (a replayed window's any size) with "
            "num_blocks * size <= 2147483647, got 8 for group 0",
        ),
        (
            {"kv_cache_groups": (None, "mamba", 8), "mamba_align": True, "prefix_replay_groups": (2,)},
            "prefix_replay_groups cannot be combined with mamba_align",
        ),
        (
            {
                "kv_cache_groups": (None, "cross", 8),
                "enable_prefix_caching": False,
                "encoder_decoder": True,
                "prefix_replay_groups": (2,),
            },
            "prefix_replay_groups cannot be combined with encoder_decoder",
        ),
        (
            {"kv_cache_groups": (None, 8), "num_cpu_blocks": 4, "prefix_replay_groups": (1,)},
            "prefix_replay_groups cannot be combined with swap (num_cpu_blocks)",
        ),
        ({"kv_cache_groups": (None, 8), "prefix_replay_groups": (-1,)}, "must be a list of group indices"),
        ({"kv_cache_groups": (None, 8), "prefix_replay_groups": 1}, "must be a list of group indices"),
        ({"kv_cache_groups": (None, 8), "prefix_replay_groups": ("1",)}, "must be a list of group indices"),
    ],
)
def test_bad_replay_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError) as err:
        SchedulerConfig(**fields)
    assert message in str(err.value)


def test_a_list_of_replay_groups_is_kept_as_a_tuple() -> None:
    cfg = SchedulerConfig(kv_cache_groups=("ring", None, 8, 8), prefix_replay_groups=[3, 2])
    assert cfg.prefix_replay_groups == (3, 2) and cfg.replay_window == 8
    assert SchedulerConfig().replay_window == 0


# --- the Rust core against the reference, step by step (tests/test_differential.py's Twin)

# Prefix-heavy layouts: full attention and a replay window; a plain window beside the replay window (the plain one
# is looked up, the replay one not); a ring and a replay window of another block size, async scheduling and drafts;
# and a KV connector answering synchronous and asynchronous loads, some restoring the window (its hook draws the
# loaded groups), with zeroing on. Tight pools preempt.
REPLAY_CONFIGS = [
    SchedulerConfig(block_size=4, num_blocks=26, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, 8), prefix_replay_groups=(1,), prefix_hash_seed=301),
    SchedulerConfig(block_size=4, num_blocks=48, max_num_seqs=5, max_num_batched_tokens=20, max_model_len=64,
                    kv_cache_groups=(None, 12, 6, 6), prefix_replay_groups=(3, 2), policy="priority",
                    long_prefill_token_threshold=4, prefix_hash_seed=302),
    SchedulerConfig(block_size=2, num_blocks=60, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48,
                    kv_cache_groups=("ring", None, 5), prefix_replay_groups=(2,), async_scheduling=True,
                    num_speculative_tokens=2, prefix_hash_seed=303),
    SchedulerConfig(block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, 8), prefix_replay_groups=(1,), zero_new_blocks=True,
                    kv_connector_groups=True, prefix_hash_seed=304),
    # DeepSeek V4.1's order: the replayed window first, its blocks smaller than the hashed groups' (the primary
    # group is the full-attention one after it), a ring; then two replayed windows of blocks of 2 and 6 tokens
    # around a plain window of larger blocks, drafts and async scheduling.
    SchedulerConfig(block_size=4, num_blocks=52, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(8, None, "ring"), prefix_replay_groups=(0,),
                    kv_cache_group_block_sizes=(2, 4, 4), prefix_hash_seed=308),
    SchedulerConfig(block_size=4, num_blocks=80, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(12, None, 8, 12), prefix_replay_groups=(0, 3),
                    kv_cache_group_block_sizes=(2, 4, 8, 6), async_scheduling=True, num_speculative_tokens=2,
                    prefix_hash_seed=309),
    # ... with an EAGLE/MTP drafter's prefix-cache rules (the trailing-block drop; look-ahead hashes), which run when
    # the replayed blocks divide the block.
    SchedulerConfig(block_size=4, num_blocks=52, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(8, None, "ring"), prefix_replay_groups=(0,), kv_cache_group_block_sizes=(2, 4, 4),
                    num_speculative_tokens=2, drop_trailing_hit_block=True, prefix_hash_seed=311),
    SchedulerConfig(block_size=4, num_blocks=90, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(12, None, 8, 12), prefix_replay_groups=(0, 3),
                    kv_cache_group_block_sizes=(1, 4, 4, 1), num_speculative_tokens=1, hash_lookahead_tokens=1,
                    async_scheduling=True, prefix_hash_seed=312),
]  # fmt: skip


def _soak(cfg: SchedulerConfig, seed: int, steps: int, **twin: Any) -> Any:
    from test_differential import PREFIXES, VOCAB, Rand, Twin

    t = Twin(cfg, Rand(rng=np.random.default_rng(seed)), **twin)

    def prompt(max_len: int, r: Rand = t.rand) -> list[int]:
        # a shared family's first 8 to 40 tokens and up to 3 more: hits longer and shorter than the windows
        base = r.choice(PREFIXES)[: min(4 * r.int(2, 10), cfg.max_model_len - 4)]
        return base + [r.int(0, VOCAB - 1) for _ in range(r.int(0, 3))]

    t.make_prompt = prompt
    t.num_replays = 0  # admissions that replayed (the reference's requests whose replay start moved)
    starts: dict[str, int] = {}
    for _ in range(steps):
        try:
            t.step()
        except AssertionError as e:
            raise AssertionError(f"{e}\nconfig {cfg}\nlast ops: {t.log[-15:]}") from e
        for rid, r in t.ref._requests.items():
            got = t.rs.get_replay_start(rid)
            assert got == r.replay_start, f"{rid}: replay_start {got} (core), {r.replay_start} (reference)"
            if r.replay_start and starts.get(rid) != r.replay_start:
                t.num_replays += 1
            starts[rid] = r.replay_start
    t.drain()
    assert t.ref.stats().num_preemptions > 0, f"no preemption under {cfg}"
    assert t.num_replays > 0, f"no replay under {cfg}"
    return t


@requires_rust
@pytest.mark.parametrize("i", range(len(REPLAY_CONFIGS)))
def test_soak_replay_groups_match_reference_step_by_step(i: int) -> None:
    """Both implementations find the same hits, drop and floor the same ones, rewind to the same replay start and
    give every group the same tables and new blocks, step by step; requests are preempted and readmitted in each
    run, and some admissions replay."""
    cfg = REPLAY_CONFIGS[i]
    connector = 9100 + i if cfg.kv_connector_groups else None
    _soak(cfg, 7901 + i, 450, max_in_flight=1 + i % 3, connector_seed=connector, fail_steps=True)


# KV connectors beside replay windows in more modes: a ring and two replay groups with async scheduling, drafts and
# priority; deferred block frees and deferred asynchronous loads; the allocation hook told which blocks are cached,
# with the in-flight prefills' reservation and the full-sequence check off.
REPLAY_CONNECTOR_CONFIGS = [
    SchedulerConfig(block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=("ring", None, 8, 8), prefix_replay_groups=(2, 3), kv_connector_groups=True,
                    async_scheduling=True, num_speculative_tokens=2, policy="priority", prefix_hash_seed=305),
    SchedulerConfig(block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, 12, 8), prefix_replay_groups=(2,), kv_connector_groups=True,
                    async_scheduling=True, defer_block_free=True, defer_async_loads=True, prefix_hash_seed=306),
    SchedulerConfig(block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(None, 8), prefix_replay_groups=(1,), kv_connector_groups=True,
                    scheduler_reserve_full_isl=False, reserve_inflight_prefills=True, prefix_hash_seed=307),
    SchedulerConfig(block_size=4, num_blocks=40, max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64,
                    kv_cache_groups=(8, None, "ring"), prefix_replay_groups=(0,), kv_cache_group_block_sizes=(2, 4, 4),
                    kv_connector_groups=True, async_scheduling=True, prefix_hash_seed=310),
]  # fmt: skip


@requires_rust
@pytest.mark.parametrize("i", range(len(REPLAY_CONNECTOR_CONFIGS)))
def test_soak_replay_groups_with_connectors_match_reference_step_by_step(i: int) -> None:
    """The same with KV connectors in more modes (answers drawn per request, loads restoring the windows or not)."""
    cfg = REPLAY_CONNECTOR_CONFIGS[i]
    _soak(cfg, 101 + i, 450, max_in_flight=2 + i % 2, connector_seed=501 + i, fail_steps=True, cached_blocks=i == 2)


@requires_rust
def test_soak_replay_groups_with_streaming_input_match_reference_step_by_step() -> None:
    """With streaming-input sessions (a next part continues the request: no lookup, no replay) both agree too."""
    t = _soak(REPLAY_CONFIGS[2], 7951, 450, max_in_flight=2, streaming=True)
    assert t.session_ids, "no streaming-input session"
