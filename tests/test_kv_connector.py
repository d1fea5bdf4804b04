"""KV connector (scheduler side) and blocked requests: one test per vLLM 0.33 rule kvsched follows (named in the
docstring) and per deliberate difference, each run on the Rust core and on the pure-Python reference."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import FinishReason, KVConnectorError, RequestStatus, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = [pytest.param("rust", marks=requires_rust), "reference"]
S = RequestStatus


class Conn:
    """A scripted connector: ``answers[req_id]`` is what get_num_new_matched_tokens returns (default (0, False));
    ``send`` lists requests whose blocks are kept for a send; every call is logged."""

    def __init__(self, answers: dict[str, Any] | None = None, send: tuple[str, ...] = ()) -> None:
        self.answers = answers or {}
        self.send = send
        self.log: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(self, req_id: str, num_computed_tokens: int) -> Any:
        self.log.append(("match", req_id, num_computed_tokens))
        return self.answers.get(req_id, (0, False))

    def update_state_after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        self.log.append(("alloc", req_id, list(block_ids), num_external_tokens))

    def request_finished(self, req_id: str, block_ids: list[int]) -> Any:
        self.log.append(("finished", req_id, list(block_ids)))
        return (req_id in self.send, {"req": req_id})

    def build_connector_meta(self, out: Any) -> Any:
        return {"step": out.step_id, "reqs": list(out.req_ids)}


def make(impl: str, conn: Any = None, **fields: Any) -> Any:
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 40, "max_model_len": 64, "prefix_hash_seed": 0, **fields})
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(cfg, kv_connector=conn)
    return ReferenceScheduler(cfg, kv_connector=conn)


def step(s: Any, token: int = 5) -> Any:
    """Schedule and apply one step; each request whose prompt is complete samples ``token``."""
    out = s.schedule()
    s.check_invariants()
    sampled = []
    for rid, comp, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True):
        num_tokens = len(s.get_output_token_ids(rid)) + PROMPTS[rid]
        sampled.append([token] if comp + n >= num_tokens else [])
    res = s.update_from_output(out, sampled)
    s.check_invariants()
    return out, res


PROMPTS: dict[str, int] = {}


def add(s: Any, rid: str, n: int, **kw: Any) -> None:
    PROMPTS[rid] = n
    s.add_request(rid, list(range(100, 100 + n)), arrival_time=float(len(PROMPTS)), **kw)
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_async_load_parks_the_request_until_finished_recving(impl: str) -> None:
    """vLLM `_update_waiting_for_remote_kv`: an async load allocates the blocks, parks the request in
    WAITING_FOR_REMOTE_KVS (no forward pass), and promotes it when the worker reports `finished_recving`; a prompt
    loaded in full recomputes its last token."""
    conn = Conn({"a": (12, True)})
    s = make(impl, conn)
    add(s, "a", 12, max_tokens=3)
    out, _ = step(s)
    assert out.req_ids == [] and s.get_request_status("a") == S.WAITING_FOR_REMOTE_KVS
    assert s.get_num_computed_tokens("a") == 12 and len(s.get_block_ids("a")) == 3
    assert conn.log == [("match", "a", 0), ("alloc", "a", s.get_block_ids("a").tolist(), 12)]
    assert s.stats().num_skipped_waiting_reqs == 1 and s.num_unfinished_requests == 1
    out, _ = step(s)
    assert out.req_ids == [], "not schedulable before the load is reported over"
    s.update_kv_transfers(finished_recving=["a"])
    out, _ = step(s)
    assert out.req_ids == ["a"] and out.new_req_ids == ["a"]
    assert out.num_computed_tokens.tolist() == [11] and out.num_scheduled_tokens.tolist() == [1]
    stats = s.stats()
    assert (stats.connector_prefix_cache_queries, stats.connector_prefix_cache_hits) == (12, 12)


@pytest.mark.parametrize("impl", IMPLS)
def test_loaded_blocks_enter_the_prefix_cache_only_after_the_load(impl: str) -> None:
    """vLLM `allocate_slots(delay_cache_blocks=True)` for async loads, `cache_blocks` once they arrive: a twin
    prompt admitted while the load is in progress gets no hit on the blocks being written."""
    s = make(impl, Conn({"a": (12, True)}))
    add(s, "a", 13, max_tokens=2)
    step(s)
    assert s.get_num_cached_tokens(list(range(100, 113))) == 0
    s.update_kv_transfers(finished_recving=["a"])
    step(s)
    assert s.get_num_cached_tokens(list(range(100, 113))) == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_sync_load_counts_as_computed_and_leaves_one_token(impl: str) -> None:
    """vLLM: a synchronous external hit is added to the computed tokens at admission
    (`num_computed_tokens = local + external`) and the prompt's last token is still computed."""
    s = make(impl, Conn({"a": (50, False)}))
    add(s, "a", 10)
    out, _ = step(s)
    assert out.num_computed_tokens.tolist() == [9] and out.num_scheduled_tokens.tolist() == [1]


@pytest.mark.parametrize("impl", IMPLS)
def test_connector_sees_the_local_hit_and_loads_only_beyond_it(impl: str) -> None:
    """vLLM: `get_num_new_matched_tokens(request, num_local_computed_tokens)` after the local prefix hit; the
    external tokens follow the local ones in the block table."""
    conn = Conn({"b": (4, True)})
    s = make(impl, conn)
    add(s, "a", 13, max_tokens=1)
    step(s)
    add(s, "b", 13, max_tokens=1)  # the same prompt: 12 tokens hit locally
    conn.answers["b"] = (1, False)
    out, _ = step(s)
    assert ("match", "b", 12) in conn.log
    assert out.num_computed_tokens.tolist() == [12], "the last token is computed, never loaded"


@pytest.mark.parametrize("impl", IMPLS)
def test_unknown_match_skips_the_request_this_step(impl: str) -> None:
    """vLLM: `get_num_new_matched_tokens` returning None skips the request (skip_request) without blocking the
    ones behind it; it is asked again next step."""
    conn = Conn({"a": (None, False)})
    s = make(impl, conn)
    add(s, "a", 5)
    add(s, "b", 5)
    out, _ = step(s)
    assert out.req_ids == ["b"] and s.stats().num_skipped_waiting_reqs == 1
    conn.answers["a"] = (0, False)
    out, _ = step(s)
    assert out.req_ids == ["b", "a"]


@pytest.mark.parametrize("impl", IMPLS)
def test_delayed_free_holds_blocks_until_finished_sending(impl: str) -> None:
    """vLLM `request_finished` -> (delay_free_blocks, kv_transfer_params): the blocks of a finished request are
    kept until the worker reports `finished_sending`; the params are returned with the finished request."""
    conn = Conn(send=("a",))
    s = make(impl, conn)
    add(s, "a", 9, max_tokens=1)
    _, res = step(s)
    assert res.finished_req_ids == ["a"] and res.kv_transfer_params == {"a": {"req": "a"}}
    assert conn.log[-1] == ("finished", "a", conn.log[1][2])
    assert s.num_held_kv_requests == 1 and s.num_free_blocks == 39 - 3
    assert not s.has_unfinished_requests()
    s.update_kv_transfers(finished_sending=["a"])
    assert s.num_held_kv_requests == 0 and s.num_free_blocks == 39
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_request_finished_clips_at_the_spec_block_under_decode_context_parallelism(impl: str) -> None:
    """vLLM `get_block_ids_for_computed_tokens`: the blocks handed to `request_finished` cover the computed tokens
    counted in the spec's (per-rank) block size. Under DCP 2 a block id holds 8 tokens of block size 4, so a
    7-token prompt with 4 lookahead slots finishes holding 2 blocks, and both go to the connector (not
    ceil(7 / 8) = 1)."""
    conn = Conn()
    s = make(impl, conn, dcp_world_size=2, num_lookahead_tokens=4)
    add(s, "a", 7, max_tokens=1)
    _, res = step(s)
    assert res.finished_req_ids == ["a"]
    (alloc,) = [e for e in conn.log if e[0] == "alloc"]
    assert len(alloc[2]) == 2
    assert conn.log[-1] == ("finished", "a", alloc[2])
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_abort_during_load_frees_when_the_receive_ends(impl: str) -> None:
    """vLLM `finish_requests`: aborting a request in WAITING_FOR_REMOTE_KVS delays the free of its blocks until
    `finished_recving` names it (the worker may still be writing them); nothing leaks."""
    s = make(impl, Conn({"a": (8, True)}))
    add(s, "a", 12)
    step(s)
    s.abort_requests(["a"])
    s.check_invariants()
    assert s.num_held_kv_requests == 1 and s.num_free_blocks < 39
    out, _ = step(s)
    assert out.finished_req_ids == ["a"]
    s.update_kv_transfers(finished_recving=["a"])
    assert s.num_held_kv_requests == 0 and s.num_free_blocks == 39


@pytest.mark.parametrize("impl", IMPLS)
def test_abort_during_send_frees_on_finished_sending(impl: str) -> None:
    """vLLM `_free_request` asks the connector on abort too: an aborted request whose blocks are being sent keeps
    them until `finished_sending`."""
    s = make(impl, Conn(send=("a",)))
    add(s, "a", 9)
    step(s)
    s.abort_requests(["a"])
    assert s.num_held_kv_requests == 1
    s.update_kv_transfers(finished_sending=["a"])
    assert s.num_held_kv_requests == 0 and s.num_free_blocks == 39
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_failed_load_recomputes_from_the_first_invalid_block(impl: str) -> None:
    """vLLM `_update_requests_with_invalid_blocks` with kv_load_failure_policy="recompute": computed tokens are
    cut to the first invalid block; only the valid prefix is cached; the rest is recomputed."""
    s = make(impl, Conn({"a": (12, True)}))
    add(s, "a", 14, max_tokens=1)
    step(s)
    blocks = s.get_block_ids("a").tolist()
    s.update_kv_transfers(finished_recving=["a"], invalid_block_ids=[blocks[2]])
    out, _ = step(s)
    assert out.num_computed_tokens.tolist() == [8] and out.num_scheduled_tokens.tolist() == [6]


@pytest.mark.parametrize("impl", IMPLS)
def test_whole_load_failure_recomputes_everything(impl: str) -> None:
    """vLLM `_handle_failed_recving` (recompute): the request's computed tokens go to 0, its blocks are freed at
    promotion and it is admitted afresh (prefix lookup and connector query again)."""
    conn = Conn({"a": (12, True)})
    s = make(impl, conn)
    add(s, "a", 14, max_tokens=1)
    step(s)
    conn.answers["a"] = (0, False)
    s.update_kv_transfers(failed_recving=["a"], finished_recving=["a"])
    out, _ = step(s)
    assert out.num_computed_tokens.tolist() == [0] and out.num_scheduled_tokens.tolist() == [14]
    assert [c[0] for c in conn.log].count("match") == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_failed_load_with_policy_fail_finishes_with_an_error(impl: str) -> None:
    """vLLM kv_load_failure_policy="fail": the request finishes with FINISHED_ERROR; its blocks are freed when
    the receive ends (it may still be writing them)."""
    s = make(impl, Conn({"a": (12, True)}), kv_load_failure_policy="fail")
    add(s, "a", 14)
    step(s)
    assert s.update_kv_transfers(failed_recving=["a"]) == ["a"]
    out, _ = step(s)
    assert out.finished_req_ids == ["a"]
    assert s.num_held_kv_requests == 1
    s.update_kv_transfers(finished_recving=["a"])
    assert s.num_free_blocks == 39
    assert RequestStatus.FINISHED_ERROR.is_finished and str(FinishReason.ERROR) == "error"


@pytest.mark.parametrize("impl", IMPLS)
def test_loaded_requests_go_before_waiting_and_drain_when_paused_new(impl: str) -> None:
    """vLLM 0.33 `kv_holding_waiting`: requests holding KV blocks are drained first, and are the only ones
    admitted under PAUSED_NEW (they count as unfinished then)."""
    s = make(impl, Conn({"a": (8, True)}))
    add(s, "a", 10)
    step(s)
    add(s, "b", 10)
    s.set_pause_state("paused_new")
    assert s.num_unfinished_requests == 1
    s.update_kv_transfers(finished_recving=["a"])
    out, _ = step(s)
    assert out.req_ids == ["a"]
    s.set_pause_state("unpaused")
    out, _ = step(s)
    assert out.req_ids == ["a", "b"]


@pytest.mark.parametrize("impl", IMPLS)
def test_grammar_blocked_requests_are_parked_and_retried_first_in_order(impl: str) -> None:
    """vLLM's skipped-waiting queue (newest, reference digest 2.1): blocked requests are not walked by admission;
    once ready they are retried before the waiting queue, in their original order; stats count running, waiting
    and skipped-waiting separately."""
    s = make(impl, max_num_seqs=1)
    add(s, "run", 4, max_tokens=3)
    step(s)
    add(s, "g1", 4, ready=False)
    add(s, "w", 4)
    add(s, "g2", 4, ready=False)
    st = s.stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_skipped_waiting_reqs) == (1, 1, 2)
    assert s.waiting_req_ids() == ["w", "g1", "g2"]  # parked ones last: admission does not walk them
    s.set_ready("g2")
    s.set_ready("g1")
    step(s)
    assert s.waiting_req_ids() == ["g1", "g2", "w"]
    for _ in range(3):
        step(s)
    assert s.running_req_ids() == ["g1"]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_hook_answer_raises_kv_connector_error_after_the_step(impl: str) -> None:
    """A hook answering the wrong type raises KVConnectorError once the call is over; the scheduler stays
    consistent (the request was skipped) and runs on when the connector behaves."""
    conn = Conn({"a": ("many", False)})
    s = make(impl, conn)
    add(s, "a", 5)
    with pytest.raises(KVConnectorError, match="int or None"):
        s.schedule()
    s.check_invariants()
    conn.answers["a"] = (0, False)
    out = s.schedule()
    assert out.req_ids == ["a"] and out.kv_connector_metadata == {"step": 1, "reqs": ["a"]}


@pytest.mark.parametrize("impl", IMPLS)
def test_hook_exception_propagates_after_the_call(impl: str) -> None:
    """An exception raised by request_finished is raised from the call that finished the request, after the
    request was finished and freed (taken as "no delayed free")."""

    class Boom(Conn):
        def request_finished(self, req_id: str, block_ids: list[int]) -> Any:
            raise RuntimeError("boom")

    s = make(impl, Boom())
    add(s, "a", 5)
    s.schedule()
    with pytest.raises(RuntimeError, match="boom"):
        s.abort_requests(["a"])
    s.check_invariants()
    assert s.num_free_blocks == 39 and s.num_held_kv_requests == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("upto_in_flight", [True, False], ids=["v033", "v032"])
def test_a_rolled_back_request_caches_at_update_up_to_its_steps_in_flight_or_its_placeholders(
    impl: str, upto_in_flight: bool
) -> None:
    """Async scheduling: a synchronous load's block reported invalid with the output of the step that loaded it,
    while a second step of the request is in flight, rolls the request back and drops its output of that step,
    leaving one output placeholder no step in flight accounts for. When its last token completes a block, vLLM
    0.33 caches that block at the update (up to the computed tokens less the steps in flight:
    `cache_upto_in_flight`), vLLM 0.32 does not (less the placeholders left): a later prompt hits it or not."""
    s = make(impl, Conn({"a": (4, False)}), async_scheduling=True, cache_upto_in_flight=upto_in_flight)
    add(s, "a", 6, max_tokens=2)  # 4 tokens loaded into block 0, 2 computed
    pending = [s.schedule()]
    loaded = s.get_block_ids("a").tolist()[0]
    pending.append(s.schedule())
    s.update_kv_transfers(invalid_block_ids=[loaded])
    assert s.get_num_computed_tokens("a") == 0
    outputs: list[int] = []
    for token in range(7, 20):
        out = pending.pop(0)
        sampled = [
            [token] if c + n >= PROMPTS[r] else []
            for r, c, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, strict=True)
        ]
        res = s.update_from_output(out, sampled)
        s.check_invariants()
        if "a" in res.finished_req_ids:
            outputs = [t for t in range(8, token + 1)]
            break
        pending.append(s.schedule())
    assert outputs == [8, 9], "the output of the rolled-back step (7) is dropped"
    while pending:
        out = pending.pop(0)
        s.update_from_output(out, [[] for _ in out.req_ids])
    # The prompt and both outputs: 8 tokens, blocks 0 and 1 full.
    assert s.get_num_cached_tokens([*range(100, 106), *outputs, 0]) == (8 if upto_in_flight else 4)
