"""Streaming-input sessions (resumable requests, docs/semantics.md "Streaming input"): a stop ends only the
current part; the request keeps its blocks and computed tokens, waits for its next part (holding a run slot,
out of num_unfinished_requests), resumes with only the new tokens to compute, and ends with finish_input. Both
implementations, and the errors they raise alike."""

from __future__ import annotations

from typing import Any

import kvsched
import numpy as np
import pytest
from kvsched import InvalidRequestError, RequestStatus, SchedulerTypeError, UnknownRequestError
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **kw: Any) -> Any:
    cfg = kvsched.SchedulerConfig(
        **{"block_size": 4, "num_blocks": 32, "max_model_len": 64, "max_num_batched_tokens": 32, **kw}
    )
    return kvsched.Scheduler(cfg) if impl == "rust" else ReferenceScheduler(cfg)


def step(s: Any, token: int = 7) -> tuple[Any, Any]:
    out = s.schedule()
    res = s.update_from_output(out, [[token] for _ in out.req_ids])  # every prompt here fits one step
    s.check_invariants()
    return out, res


@pytest.mark.parametrize("impl", IMPLS)
def test_a_part_stops_the_session_waits_and_resumes_with_only_the_new_tokens(impl: str) -> None:
    s = make(impl)
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=2, resumable=True, arrival_time=0.0)
    step(s)  # prefill + first token
    blocks = list(s.get_block_ids("a"))
    _, res = step(s)  # second token: the part stops on max_tokens
    assert list(res.finished_req_ids) == [] and list(res.part_finished_req_ids) == ["a"]
    assert list(res.part_finish_reasons) == [int(kvsched.FinishReason.LENGTH)]
    assert s.get_request_status("a") == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert s.has_request("a") and s.num_unfinished_requests == 0 and not s.has_unfinished_requests()
    assert list(s.get_block_ids("a")) == blocks and s.get_num_computed_tokens("a") == 6
    out, _ = step(s)
    assert list(out.req_ids) == [] and list(out.finished_req_ids) == []  # never admitted while it waits
    assert s.stats().num_skipped_waiting_reqs == 1
    s.append_input("a", [9, 9, 9], max_tokens=3, arrival_time=1.0)
    # the last sampled token is dropped, the other output joins the prompt, then the part
    assert s.get_request_status("a") == RequestStatus.WAITING and s.get_output_token_ids("a") == []
    out, _ = step(s)
    assert list(out.new_req_ids) == ["a"] and list(out.num_scheduled_tokens) == [3]  # 5 + 1 kept + 3 - 6
    s.finish_input("a")
    step(s)
    _, res = step(s)  # the part's third token: the input is over, the streaming-input session finishes
    assert list(res.finished_req_ids) == ["a"] and list(res.part_finished_req_ids) == []
    assert not s.has_request("a") and s.num_free_blocks == 31


@pytest.mark.parametrize("impl", IMPLS)
def test_a_part_given_while_running_is_taken_at_the_stop(impl: str) -> None:
    s = make(impl)
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=1, resumable=True, arrival_time=0.0)
    s.add_request("b", [6, 7, 8], max_tokens=5, arrival_time=0.0)
    s.append_input("a", [11, 12], max_tokens=1, arrival_time=1.0)
    _, res = step(s)
    assert list(res.part_finished_req_ids) == ["a"]
    assert s.get_request_status("a") == RequestStatus.WAITING  # took its queued part
    out, _ = step(s)
    assert list(out.new_req_ids) == ["a"]  # back in, computing only the part
    assert dict(out.num_scheduled_tokens_by_id())["a"] == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_finish_input_aborts_a_waiting_session_and_frees_its_blocks(impl: str) -> None:
    s = make(impl)
    s.add_request("a", list(range(1, 10)), max_tokens=1, resumable=True, arrival_time=0.0)
    step(s)
    assert s.get_request_status("a") == RequestStatus.WAITING_FOR_STREAMING_REQ
    s.finish_input("a")
    assert not s.has_request("a") and s.num_free_blocks == 31
    out = s.schedule()
    assert list(out.finished_req_ids) == ["a"]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_waiting_session_holds_its_run_slot(impl: str) -> None:
    s = make(impl, max_num_seqs=1)
    s.add_request("a", [1, 2, 3], max_tokens=1, resumable=True, arrival_time=0.0)
    s.add_request("b", [4, 5, 6], max_tokens=1, arrival_time=1.0)
    step(s)
    out, _ = step(s)
    assert list(out.req_ids) == []  # "b" waits: the streaming-input session still has the only slot
    s.abort_requests(["a"])
    out, _ = step(s)
    assert list(out.req_ids) == ["b"]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_streaming_input_is_refused_alike_and_changes_nothing(impl: str) -> None:
    s = make(impl)
    s.add_request("plain", [1, 2, 3], max_tokens=4, arrival_time=0.0)
    s.add_request("a", [1, 2, 3], max_tokens=4, resumable=True, arrival_time=0.0)
    with pytest.raises(UnknownRequestError):
        s.append_input("nope", [1])
    with pytest.raises(UnknownRequestError):
        s.finish_input("nope")
    with pytest.raises(InvalidRequestError, match="not a streaming-input"):
        s.append_input("plain", [1])
    with pytest.raises(InvalidRequestError, match="not a streaming-input"):
        s.finish_input("plain")
    with pytest.raises(InvalidRequestError):
        s.append_input("a", [])
    with pytest.raises(InvalidRequestError):
        s.append_input("a", [1], max_tokens=0)
    with pytest.raises(InvalidRequestError):
        s.append_input("a", [2**31])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s.append_input("a", list(range(60)))  # 3 + 4 - 1 + 60 >= 64
    with pytest.raises(InvalidRequestError):
        s.add_request("g", [1, 2], resumable=True, ready=False)
    with pytest.raises(SchedulerTypeError):
        s.add_request("t", [1, 2], resumable=1)
    assert not s.has_request("g") and not s.has_request("t")
    s.finish_input("a")
    with pytest.raises(InvalidRequestError, match="finished"):
        s.append_input("a", [1])
    with pytest.raises(InvalidRequestError, match="finished"):
        s.finish_input("a")
    s.check_invariants()
    assert s.num_unfinished_requests == 2


def test_sessions_are_refused_with_swapping() -> None:
    for s in (make("rust", preemption_mode="swap", num_cpu_blocks=8),
              make("reference", preemption_mode="swap", num_cpu_blocks=8)):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="recompute"):
            s.add_request("a", np.array([1, 2, 3]), resumable=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_part_after_a_stop_inside_accepted_drafts_recomputes_the_positions_it_fills(impl: str) -> None:
    # trim_computed_on_stop=False (vLLM 0.32's rule): a stop on the first of three accepted tokens leaves the
    # computed count two positions past the tokens kept; the part's tokens must be computed, not skipped.
    s = make(impl, num_speculative_tokens=2, trim_computed_on_stop=False)
    s.add_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[9], resumable=True, arrival_time=0.0)
    step(s, token=5)
    s.set_draft_token_ids(["a"], [[6, 7]])
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [3]
    res = s.update_from_output(out, [[9, 6, 7]])
    assert list(res.part_finished_req_ids) == ["a"] and s.get_num_computed_tokens("a") == 6
    s.append_input("a", [4], max_tokens=2, arrival_time=1.0)
    s.check_invariants()
    assert s.get_num_computed_tokens("a") == 4  # 1, 2, 3 and 5 kept; the part's 4 fills position 4
    out, _ = step(s)
    assert list(out.req_ids) == ["a"] and int(out.num_scheduled_tokens[0]) >= 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_part_that_leaves_nothing_computed_frees_the_blocks_it_held(impl: str) -> None:
    """A runner that samples two tokens for a one-token partial prefill, and a stop at the first: the stop trims the
    second and its position, so nothing computed is left. The blocks the streaming session holds keep no valid KV:
    the next part frees them, and its admission looks the prompt up afresh (a hit on another request's block)."""
    s = make(impl, max_num_batched_tokens=1)  # one token a step
    s.add_request("p", [1, 2, 3, 4, 9], max_tokens=1, arrival_time=0.0)
    for _ in range(5):
        out = s.schedule()
        p_blocks = list(s.get_block_ids("p"))
        s.update_from_output(out, [[0]] if s.get_num_computed_tokens("p") == 5 else [[]])
    assert not s.has_request("p")  # finished; its first block [1, 2, 3, 4] stays cached
    s.add_request("a", [1, 2, 3, 4], max_tokens=1, resumable=True, arrival_time=1.0)
    out = s.schedule()
    assert out.req_ids == ["a"] and s.get_num_computed_tokens("a") == 1  # no hit: a whole block is the prompt
    assert list(s.get_block_ids("a")) != []
    s.update_from_output(out, [[7, 8]])
    assert s.get_request_status("a") == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert s.get_num_computed_tokens("a") == 0
    s.append_input("a", [5, 6])
    assert list(s.get_block_ids("a")) == []
    s.schedule()
    assert s.get_block_ids("a")[0] == p_blocks[0] and s.get_num_computed_tokens("a") == 5  # 4 hit + 1
    s.check_invariants()
