"""KV connectors with several KV cache groups and sliding windows (``kv_connector_groups``, vLLM's ``SupportsHMA``
connectors): the hooks get one block table per group, a window's skipped tokens are null blocks in its table, a
finish frees the blocks that left a window before the connector sees the tables, and held or deferred frees cover
every group. Each test runs on the Rust core and on the pure-Python reference."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import InvalidConfigError, InvalidRequestError, RequestStatus, SchedulerConfig, UnknownRequestError
from kvsched.reference import ReferenceScheduler

IMPLS = [pytest.param("rust", marks=requires_rust), "reference"]
S = RequestStatus


class Conn:
    """A scripted connector: ``answers[req_id]`` is what get_num_new_matched_tokens returns (default (0, False));
    ``send`` lists requests whose blocks are kept for a send; the allocation and finish calls are logged (the match
    queries are not)."""

    def __init__(self, answers: dict[str, Any] | None = None, send: tuple[str, ...] = ()) -> None:
        self.answers = answers or {}
        self.send = send
        self.log: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> Any:
        return self.answers.get(req_id, (0, False))

    def update_state_after_alloc(self, req_id: str, block_ids: Any, num_external_tokens: int) -> None:
        self.log.append(("alloc", req_id, [list(t) for t in block_ids], num_external_tokens))

    def request_finished(self, req_id: str, block_ids: Any) -> Any:
        self.log.append(("finished", req_id, [list(t) for t in block_ids]))
        return (req_id in self.send, None)


class FlatConn(Conn):
    """``Conn`` for hooks that get one table (the default): logs it as a list of one table."""

    def update_state_after_alloc(self, req_id: str, block_ids: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(req_id, [block_ids], num_external_tokens)

    def request_finished(self, req_id: str, block_ids: Any) -> Any:
        return super().request_finished(req_id, [block_ids])


def make(impl: str, conn: Any = None, **fields: Any) -> Any:
    base = {"block_size": 4, "num_blocks": 60, "max_model_len": 64, "prefix_hash_seed": 0}
    cfg = SchedulerConfig(**{**base, "kv_connector_groups": True, **fields})
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(cfg, kv_connector=conn)
    return ReferenceScheduler(cfg, kv_connector=conn)


def run(s: Any, steps: int, token: int = 5) -> None:
    """Schedule and apply ``steps`` steps; a request whose prompt is complete samples ``token``."""
    for _ in range(steps):
        out = s.schedule()
        s.check_invariants()
        sampled = []
        for rid, comp, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
            done = comp + n >= PROMPTS[rid] + len(s.get_output_token_ids(rid))
            sampled.append([token] if done else [])
        s.update_from_output(out, sampled)
        s.check_invariants()


PROMPTS: dict[str, int] = {"a": 0, "b": 0}


def add(s: Any, rid: str, first: int, n: int, **kw: Any) -> None:
    PROMPTS[rid] = n
    s.add_request(rid, list(range(first, first + n)), **kw)


def tables(s: Any, rid: str, groups: int) -> list[list[int]]:
    return [s.get_block_ids(rid, group=g).tolist() for g in range(groups)]


@pytest.mark.parametrize("impl", IMPLS)
def test_several_groups_need_kv_connector_groups(impl: str) -> None:
    """Without ``kv_connector_groups`` (the default) a connector with several groups is refused as before; with it,
    Mamba, cross-attention and chunked-local groups are refused by name."""
    with pytest.raises(InvalidConfigError, match="unless kv_connector_groups"):
        make(impl, Conn(), kv_cache_groups=(None, 8), kv_connector_groups=False)
    for bad in [(None, "cross"), (None, "chunked:16")]:
        with pytest.raises(InvalidConfigError, match="no cross-attention or chunked-local"):
            make(impl, Conn(), kv_cache_groups=bad, enable_prefix_caching=False)
    make(impl, Conn(), kv_cache_groups=(None, 8), defer_block_free=True)
    make(impl, Conn(), kv_cache_groups=(None, "mamba"), enable_prefix_caching=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_ring_group_hands_its_block_to_the_connector(impl: str) -> None:
    """A connector beside a compressor ring: every allocation hook gets the ring's one block, which a load's
    admission takes with the external blocks, and the finish hands it over with the other tables."""
    conn = Conn(answers={"a": (8, False)}, send=("a",))
    s = make(impl, conn, kv_cache_groups=("ring", None), max_num_batched_tokens=8)
    add(s, "a", 100, 14, max_tokens=1)
    free0 = s.num_free_blocks
    run(s, 4)
    assert s.num_unfinished_requests == 0
    (_, rid, (ring, full), ext), *_ = [e for e in conn.log if e[0] == "alloc"]
    assert (rid, ext) == ("a", 8) and len(ring) == 1 and ring[0] != 0 and len(full) == 4
    (_, rid, (ring_done, full_done)), *_ = [e for e in conn.log if e[0] == "finished"]
    assert ring_done == ring and full_done == full
    s.update_kv_transfers(finished_sending=["a"])
    s.check_invariants()
    assert s.num_free_blocks == free0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("align", [False, True])
def test_mamba_groups_hand_their_state_blocks_to_the_connector(impl: str, align: bool) -> None:
    """A connector with a Mamba group (vLLM's ``MambaManager``): every allocation hook gets the Mamba table too;
    at the finish the connector gets it whole. In mode "none" it is the one state block; in mode "align" the states
    below the last processed token's block (``(22 - 1) // 4`` = 5 entries) left the table first (vLLM's
    ``remove_skipped_blocks`` in ``_connector_finished``) and go back at the finish, the rest once the send is
    over."""
    conn = Conn(send=("a",))
    s = make(impl, conn, kv_cache_groups=(None, "mamba"), enable_prefix_caching=False, mamba_align=align,
             max_num_batched_tokens=8)  # fmt: skip
    add(s, "a", 100, 22, max_tokens=1)
    free0 = s.num_free_blocks
    run(s, 4)
    assert s.num_unfinished_requests == 0
    allocs = [e for e in conn.log if e[0] == "alloc"]
    assert len(allocs) == 1 and len(allocs[0][2]) == 2
    (_, rid, (full, mamba)), *_ = [e for e in conn.log if e[0] == "finished"]
    assert rid == "a" and len(full) == 6 and 0 not in full
    if not align:
        assert len(mamba) == 1 and mamba[0] != 0
        s.free_held_window_blocks("a")
        assert s.num_free_blocks == free0 - 6 - 1
    else:
        # Entries 0-4 are null (the state at entry 4 went back at the finish), entry 5 holds the last state.
        assert len(mamba) == 6 and mamba[:5] == [0] * 5 and mamba[5] != 0
        assert s.num_free_blocks == free0 - 6 - 2
        s.free_held_window_blocks("a")
        s.check_invariants()
        assert s.num_free_blocks == free0 - 6 - 1
    s.update_kv_transfers(finished_sending=["a"])
    s.check_invariants()
    assert s.num_free_blocks == free0


@pytest.mark.parametrize("impl", IMPLS)
def test_external_tokens_before_the_window_are_null_blocks(impl: str) -> None:
    """vLLM's ``add_local_computed_blocks`` / ``allocate_external_computed_blocks``: a synchronous load of 32
    tokens gives the window group (8 tokens) null blocks for the 6 blocks wholly before the window of token 33, and
    the connector gets both groups' tables."""
    conn = Conn({"a": (32, False)})
    s = make(impl, conn, kv_cache_groups=(None, 8))
    add(s, "a", 100, 40, max_tokens=2)
    run(s, 1)
    full, window = tables(s, "a", 2)
    assert len(full) == len(window) == 10 and 0 not in full
    assert window[:6] == [0] * 6 and 0 not in window[6:]
    assert conn.log == [("alloc", "a", [full, window], 32)]
    assert s.get_num_computed_tokens("a") == 40


@pytest.mark.parametrize("impl", IMPLS)
def test_finish_frees_the_blocks_that_left_the_window_first(impl: str) -> None:
    """vLLM's ``_connector_finished``: ``remove_skipped_blocks`` on the processed tokens, then
    ``request_finished_all_groups`` with each group's blocks of the computed tokens; a held request's blocks of
    every group go back once the send is over."""
    conn = Conn(send=("a",))
    s = make(impl, conn, kv_cache_groups=(None, 8))
    add(s, "a", 100, 22, max_tokens=1)
    free0 = s.num_free_blocks
    run(s, 1)
    assert s.num_unfinished_requests == 0
    (_, rid, (full, window)), *_ = [e for e in conn.log if e[0] == "finished"]
    assert rid == "a" and len(full) == 6 and len(window) == 6
    # 22 computed tokens: the window of token 23 starts at token 15, so blocks 0-2 (tokens 0-11) left it.
    assert window[:3] == [0, 0, 0] and 0 not in window[3:] and 0 not in full
    # Held: the blocks that left the window too, until free_held_window_blocks (vLLM frees them at the finish).
    assert s.num_free_blocks == free0 - 6 - 6
    s.free_held_window_blocks("a")
    s.check_invariants()
    assert s.num_free_blocks == free0 - 6 - 3
    with pytest.raises(UnknownRequestError):
        s.free_held_window_blocks("nope")
    s.update_kv_transfers(finished_sending=["a"])
    s.check_invariants()
    assert s.num_free_blocks == free0


@pytest.mark.parametrize("impl", IMPLS)
def test_async_load_with_groups_caches_every_group_once_loaded(impl: str) -> None:
    """vLLM's ``_update_waiting_for_remote_kv``: the loaded blocks of every group enter the prefix cache when the
    load is over, not before; a failed load (``failed_recving``) frees every group's blocks."""
    conn = Conn({"a": (16, True), "b": (16, True)})
    s = make(impl, conn, kv_cache_groups=(None, 8), enable_prefix_caching=True)
    add(s, "a", 100, 20, max_tokens=2)
    run(s, 1)
    assert s.get_request_status("a") == S.WAITING_FOR_REMOTE_KVS
    full, window = tables(s, "a", 2)
    assert len(full) == len(window) == 4 and window[:2] == [0, 0]
    assert s.get_num_cached_tokens(list(range(100, 120))) == 0
    s.update_kv_transfers(finished_recving=["a"])
    run(s, 1)
    assert s.get_num_cached_tokens(list(range(100, 120))) == 16
    add(s, "b", 200, 20, max_tokens=2)
    run(s, 1)
    assert s.get_request_status("b") == S.WAITING_FOR_REMOTE_KVS
    s.update_kv_transfers(failed_recving=["b"], finished_recving=["b"])
    conn.answers["b"] = (0, False)
    run(s, 1)
    # Its blocks went back (nothing valid was loaded) and it was admitted again, computing its prompt itself.
    assert s.get_request_status("b") == S.RUNNING and s.get_num_computed_tokens("b") == 20
    assert [e[3] for e in conn.log if e[:2] == ("alloc", "b")] == [16, 0]
    assert [len(t) for t in tables(s, "b", 2)] == [5, 5]


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_block_ids_are_refused_with_groups(impl: str) -> None:
    """vLLM raises for ``invalid_block_ids`` with several groups (block ids are unique within a group only)."""
    s = make(impl, Conn({"a": (16, True)}), kv_cache_groups=(None, 8))
    add(s, "a", 100, 20, max_tokens=2)
    run(s, 1)
    b = s.get_block_ids("a").tolist()[0]
    with pytest.raises(InvalidRequestError, match="failed_recving"):
        s.update_kv_transfers(invalid_block_ids=[b])
    s.check_invariants()
    assert s.get_request_status("a") == S.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("impl", IMPLS)
def test_one_sliding_window_hands_one_table_with_nulls(impl: str) -> None:
    """One sliding-window group (``sliding_window``): the hooks get a list of one table, and the finish frees the
    blocks that left the window before ``request_finished``; without ``kv_connector_groups`` the hook gets the
    table as it stands."""
    for on in (True, False):
        conn = Conn() if on else FlatConn()
        s = make(impl, conn, sliding_window=8, kv_connector_groups=on)
        add(s, "a", 100, 22, max_tokens=1)
        run(s, 1)
        (_, _, (table,)) = next(e for e in conn.log if e[0] == "finished")
        assert len(table) == 6
        assert table[:3] == ([0, 0, 0] if on else table[:3]) and (on or 0 not in table)
        s.check_invariants()
        assert s.num_free_blocks == 59


@pytest.mark.parametrize("impl", IMPLS)
def test_deferred_frees_cover_every_group(impl: str) -> None:
    """vLLM 0.33's ``_free_request_blocks`` with a step in flight (``defer_block_free``): every group's blocks, in
    group order, wait in one deferred free until the steps scheduled before it are applied."""
    conn = Conn()
    s = make(impl, conn, kv_cache_groups=(None, 8), async_scheduling=True, defer_block_free=True)
    add(s, "a", 100, 10, max_tokens=8)
    out1 = s.schedule()
    out2 = s.schedule()
    s.abort_requests(["a"])
    s.check_invariants()
    ((fence, blocks),) = s.deferred_frees()
    assert fence == 2 and len(blocks) == 6 and s.num_free_blocks == 59 - 6
    s.update_from_output(out1, [[5]])
    s.update_from_output(out2, [[]])
    s.check_invariants()
    assert s.deferred_frees() == [] and s.num_free_blocks == 59


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("layout", "need"),
    [
        # One window of 4 tokens: loading 36 of 40 tokens leaves tokens 0-32 (blocks 0-7) before the window of
        # token 37, so the whole sequence needs 2 blocks.
        (dict(sliding_window=4), 2),
        # The same window beside full attention: the full-attention group needs all 10 blocks.
        (dict(kv_cache_groups=(4, None)), 12),
    ],
)
def test_loaded_tokens_before_the_window_need_no_blocks_at_admission(impl: str, layout: Any, need: int) -> None:
    """vLLM's full-sequence admission gate (``scheduler_reserve_full_isl``) counts the tokens the KV connector
    loads as computed when it finds the blocks before a window: they become null blocks, so a request that loads
    36 of its 40 tokens is admitted with ``need`` blocks free, and is not with one fewer."""
    for free in (need, need - 1):
        conn = Conn({"a": (36, False)}, send=("b",))
        groups = len(layout.get("kv_cache_groups", (None,)))
        # "b" keeps its 9 blocks (per group) for a send, so that the pool has ``free`` blocks left when "a" arrives.
        s = make(impl, conn, num_blocks=1 + free + 9 * groups, **layout)
        add(s, "b", 500, 36, max_tokens=1)
        run(s, 1)
        add(s, "a", 100, 40, max_tokens=1)
        assert s.num_free_blocks == free
        out = s.schedule()
        s.check_invariants()
        if free < need:
            assert list(out.req_ids) == [] and s.get_request_status("a") == S.WAITING
            continue
        assert list(out.req_ids) == ["a"] and list(out.num_scheduled_tokens) == [4]
        window = tables(s, "a", groups)[0]
        assert window[:8] == [0] * 8 and 0 not in window[8:] and s.num_free_blocks == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_async_load_caches_each_groups_blocks_from_its_own_count(impl: str) -> None:
    """vLLM's ``cache_blocks`` once an asynchronous load is over goes group by group from each group's own count
    of cached blocks: the window group (3 tokens, first) counts its 4 null blocks before the window of token 19
    as cached, the full-attention group none, so the full-attention group's 4 loaded full blocks enter the prefix
    cache (and the connector hears of them as cached when the rest of the prompt is admitted)."""

    class CountingConn(Conn):
        wants_num_cached_blocks = True

        def update_state_after_alloc(self, req_id: str, block_ids: Any, num_external: int, cached: Any = 0) -> None:
            super().update_state_after_alloc(req_id, block_ids, num_external)
            self.log[-1] = (*self.log[-1], cached)

    conn = CountingConn({"a": (18, True)})
    s = make(impl, conn, kv_cache_groups=(3, None), enable_prefix_caching=True)
    add(s, "a", 100, 19, max_tokens=2)
    run(s, 1)
    assert s.get_request_status("a") == S.WAITING_FOR_REMOTE_KVS
    window, full = tables(s, "a", 2)
    assert window[:4] == [0] * 4 and len(window) == len(full) == 5
    assert [s.get_block_hash(b) for b in full] == [None] * 5
    s.update_kv_transfers(finished_recving=["a"])
    run(s, 1)
    assert s.get_num_computed_tokens("a") == 19
    assert [s.get_block_hash(b) is not None for b in full] == [True] * 4 + [False]
    assert s.get_block_hash(window[4]) is None
    # Per group, the tokens of each block's cache key (0: not cached, null blocks among them): none at the load's
    # admission, the full-attention group's 4 loaded blocks once the rest of the prompt is admitted.
    assert [e[4] for e in conn.log] == [[[0] * 5, [0] * 5], [[0] * 5, [4, 8, 12, 16, 0]]]
