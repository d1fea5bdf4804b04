"""kvsched.vllm.Scheduler with vLLM's streaming-input sessions (resumable requests), against vLLM's own scheduler.

A request added with ``resumable=True`` is a streaming session: a stop ends only its current part; the next request
of the same id is its next part (taken at once by a streaming session waiting for input, else queued for its
following stop), and a request of that id that is not resumable ends its input. Needs vLLM (0.32 or 0.33);
skipped otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

from kvsched.vllm import RULES
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm_driver import REQUEST_FIELDS, compare, runner_output

pytestmark = pytest.mark.vllm

EOS = 2


class _Pair:
    """vLLM's scheduler and kvsched's under the same calls, compared after each (outputs, request fields)."""

    def __init__(self, **fields: Any) -> None:
        cfg = make_vllm_config(**fields)
        self.scheds = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))

    @property
    def kv(self) -> Any:
        return self.scheds[1]

    def add(self, rid: str, prompt: list[int], **kw: Any) -> None:
        for s in self.scheds:
            s.add_request(make_request(rid, prompt, eos_token_id=EOS, **kw))
        self.check(f"add_request({rid})")

    def step(self, tokens: dict[str, int] | None = None) -> tuple[Any, dict[str, Any]]:
        """One synchronous step: each decoding request samples ``tokens.get(id, 9)``; returns kvsched's scheduler
        output and its engine outputs by request id."""
        tokens = tokens or {}
        outs = [s.schedule() for s in self.scheds]
        compare("SchedulerOutput", outs[0], outs[1])
        results = []
        for s, so in zip(self.scheds, outs, strict=True):
            ids = list(so.num_scheduled_tokens)
            sampled = [[] if s.requests[r].is_prefill_chunk else [tokens.get(r, 9)] for r in ids]
            results.append(s.update_from_output(so, runner_output(ids, sampled)))
        compare("EngineCoreOutputs", results[0], results[1])
        self.check("update_from_output")
        return outs[1], {o.request_id: o for e in results[1].values() for o in e.outputs}

    def check(self, when: str) -> None:
        a, b = self.scheds
        compare(f"{when}: live requests", sorted(a.requests), sorted(b.requests))
        for rid, ra in a.requests.items():
            for field in REQUEST_FIELDS:
                compare(f"{when}: {rid}.{field}", getattr(ra, field), getattr(b.requests[rid], field))
            known = a.has_request(rid) if hasattr(a, "has_request") else True  # vLLM 0.32 has no has_request
            compare(f"{when}: has_request({rid})", known, b.has_request(rid))
        compare(f"{when}: unfinished", a.get_num_unfinished_requests(), b.get_num_unfinished_requests())
        compare(f"{when}: counts", a.get_request_counts(), b.get_request_counts())
        compare(f"{when}: kv usage", a.get_kv_cache_usage(), b.get_kv_cache_usage())
        b.core.check_invariants()


def test_a_part_stops_and_the_next_part_resumes_the_session_with_its_kv() -> None:
    p = _Pair()
    p.add("s", [11, 12, 13, 14, 15], max_tokens=2, resumable=True)
    p.step()  # prefill, samples 9
    _, outs = p.step()  # second token: max_tokens reached, the part ends
    out = outs["s"]
    assert out.finish_reason == FinishReason.LENGTH and out.new_token_ids == [9]
    session = p.kv.requests["s"]
    # Not finished: it waits for input, keeps its blocks, is not unfinished work.
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert p.kv.has_request("s") and p.kv.get_num_unfinished_requests() == 0
    assert p.kv.num_waiting_for_streaming_input == 1 and p.kv.kv_holding_waiting == [session]
    assert "s" not in p.kv.finished_req_ids and p.kv.core.get_num_computed_tokens("s") == 6

    p.add("s", [21, 22, 23], max_tokens=4, resumable=True)
    # The part is taken at once: every output but the last sampled one joins the prompt, then the part.
    assert session.status == RequestStatus.WAITING
    assert list(session.prompt_token_ids) == [11, 12, 13, 14, 15, 9, 21, 22, 23]
    assert session.num_prompt_tokens == 9 and list(session.output_token_ids) == []
    assert session.max_tokens == 4 and session.sampling_params.max_tokens == 4
    assert session.num_computed_tokens == 6
    so, _ = p.step()
    # Re-sent to the worker as a new request that computed its kept tokens: only the new ones are scheduled.
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "s" and new.num_computed_tokens == 6 and so.num_scheduled_tokens == {"s": 3}


def test_parts_queued_while_running_and_the_end_of_input() -> None:
    p = _Pair(num_blocks=64)
    p.add("s", list(range(20, 40)), max_tokens=8, resumable=True)
    p.add("t", list(range(40, 50)), max_tokens=3)
    p.step()
    # A part and the end of the input arrive while the streaming session runs: both wait for its following stop.
    p.add("s", [61, 62], max_tokens=2, resumable=True)
    p.add("s", [0])  # not resumable: the end of the input
    assert p.kv.requests["s"].status == RequestStatus.RUNNING
    _, outs = p.step({"s": EOS})  # EOS ends the first part; the queued part is taken
    assert outs["s"].finish_reason == FinishReason.STOP
    assert p.kv.requests["s"].status == RequestStatus.WAITING
    assert list(p.kv.requests["s"].prompt_token_ids)[-3:] == [9, 61, 62]
    for _ in range(6):
        _, outs = p.step()
        if "s" in outs and outs["s"].finish_reason is not None:
            break
    # The second part's stop meets the end of the input: the streaming session finishes as any request.
    assert outs["s"].finish_reason == FinishReason.LENGTH
    assert not p.kv.has_request("s") and "s" in p.kv.finished_req_ids


def test_the_end_of_input_aborts_a_session_waiting_for_input() -> None:
    p = _Pair()
    p.add("s", [5, 6, 7], max_tokens=1, resumable=True)
    p.step()
    assert p.kv.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    free = p.kv.core.num_free_blocks
    p.add("s", [0])
    assert not p.kv.has_request("s") and "s" in p.kv.finished_req_ids
    assert p.kv.core.num_free_blocks > free
    so, outs = p.step()
    assert "s" in so.finished_req_ids and outs == {}


def test_with_a_kv_connector_an_ended_session_hands_its_blocks_over_and_a_late_part_is_dropped() -> None:
    """A KV connector that sends every finished request's KV: the end of the input finishes the streaming session
    through ``request_finished`` (its blocks wait for the send, it stays in ``requests``), and a part that still
    arrives for it is dropped, as vLLM queues it on the finished request where nothing takes it."""
    p = _Pair(kv_connector_seed=1)
    handed: list[list[list[int]]] = [[], []]
    for sched, seen in zip(p.scheds, handed, strict=True):

        def no_match(request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False

        def send(request: Any, block_ids: list[int], seen: list[list[int]] = seen) -> tuple[bool, dict[str, Any]]:
            seen.append(list(block_ids))
            return True, {"sent": len(block_ids)}

        sched.connector.get_num_new_matched_tokens = no_match
        sched.connector.request_finished = send
    p.add("s", [5, 6, 7, 8, 9], max_tokens=1, resumable=True)
    p.step()
    assert p.kv.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    p.add("s", [0])  # the end of the input: finished (aborted) with its KV sent
    assert handed[0] == handed[1] and len(handed[1]) == 1 and handed[1][0]
    assert p.kv.requests["s"].is_finished()  # blocks held for the send
    p.add("s", [11, 12], max_tokens=1, resumable=True)  # too late: dropped
    assert p.kv.requests["s"].is_finished()
    p.step()


def test_a_session_waiting_for_input_holds_its_run_slot() -> None:
    p = _Pair(max_num_seqs=1)
    p.add("s", [5, 6, 7], max_tokens=1, resumable=True)
    p.step()
    p.add("other", [8, 9, 10], max_tokens=1)
    so, _ = p.step()
    assert so.num_scheduled_tokens == {}  # the streaming session keeps the one slot while it waits for input
    p.add("s", [0])
    so, _ = p.step()
    assert list(so.num_scheduled_tokens) == ["other"]


def test_a_part_the_kv_cache_could_never_hold_fails_the_session_alone() -> None:
    """The core refuses a part that could make the streaming session too long for the KV cache; vLLM's engine must not
    see an exception from add_request, so the streaming session ends with an error output at the next update."""
    s = make_scheduler("kvsched", make_vllm_config(num_blocks=4, block_size=16, max_model_len=256))
    s.add_request(make_request("s", [1, 2, 3], max_tokens=1, resumable=True))
    so = s.schedule()
    s.update_from_output(so, runner_output(["s"], [[9]]))
    s.add_request(make_request("s", list(range(3, 80)), max_tokens=4, resumable=True))
    so = s.schedule()
    eco = s.update_from_output(so, runner_output(list(so.num_scheduled_tokens), [[9]] * len(so.num_scheduled_tokens)))
    (out,) = [o for e in eco.values() for o in e.outputs]
    assert out.request_id == "s" and out.finish_reason == FinishReason.ERROR
    if RULES.output_error:
        assert out.error.code == "validation_error"
    assert not s.has_request("s") and s.core.num_free_blocks == s.core.config.num_usable_blocks


def _engine(kind: str) -> tuple[Any, Any]:
    """vLLM's own EngineCore (what ``step()`` reads; no workers, no model) around scheduler ``kind``, with an
    executor that samples 9 for every decode, or EOS for ids listed in ``executor.eos``."""
    import queue
    from concurrent.futures import Future

    from vllm.v1.engine.core import EngineCore

    class Executor:
        def __init__(self) -> None:
            self.eos: set[str] = set()

        def execute_model(self, so: Any, non_block: bool = False) -> Future[Any]:
            ids = list(so.num_scheduled_tokens)
            done: Future[Any] = Future()
            sampled = [[] if sched.requests[r].is_prefill_chunk else [EOS if r in self.eos else 9] for r in ids]
            done.set_result(runner_output(ids, sampled))
            return done

    cfg = make_vllm_config()
    sched = make_scheduler(kind, cfg)
    engine = EngineCore.__new__(EngineCore)
    engine.scheduler, engine.model_executor, engine.vllm_config = sched, Executor(), cfg
    engine.log_stats, engine.aborts_queue, engine._weight_version = True, queue.Queue(), None
    return engine, sched


def test_a_session_through_vllms_engine_core_loop() -> None:
    """vLLM's EngineCore.add_request and step (the synchronous engine loop) with either scheduler: the same
    outputs (tokens, finish reasons of each part) and the same streaming session state at every step."""
    runs = []
    for kind in ("vllm", "kvsched"):
        engine, sched = _engine(kind)
        trace: list[Any] = []
        engine.add_request(make_request("s", [1, 2, 3, 4], max_tokens=3, eos_token_id=EOS, resumable=True))
        engine.add_request(make_request("o", [5, 6, 7], max_tokens=6, eos_token_id=EOS))
        for i in range(14):
            if i == 2:
                engine.model_executor.eos.add("s")  # the first part ends by EOS
            if i == 4:
                engine.model_executor.eos.clear()
                engine.add_request(make_request("s", [31, 32], max_tokens=2, eos_token_id=EOS, resumable=True))
            if i == 5:
                engine.add_request(make_request("s", [0], eos_token_id=EOS))  # the end of the input
            eco, _executed = engine.step()
            outs = sorted(
                (o.request_id, list(o.new_token_ids), o.finish_reason) for e in eco.values() for o in e.outputs
            )
            state = {r: (q.status, list(q.all_token_ids), q.num_computed_tokens) for r, q in sched.requests.items()}
            trace.append((outs, state))
        assert not sched.has_requests()
        runs.append(trace)
    compare("engine trace", runs[0], runs[1])
    flat = [o for outs, _ in runs[1] for o in outs]
    s_outs = [o for o in flat if o[0] == "s"]
    assert [o[2] for o in s_outs if o[2] is not None] == [FinishReason.STOP, FinishReason.LENGTH]
