"""End-to-end loop of the Rust scheduler: a few thousand steps of seeded random traffic.

Random arrivals over a handful of shared prefixes, random max_tokens / eos / priorities, occasional aborts
(some while their step is in flight), async scheduling (up to two steps in flight) and a KV cache tight enough
that requests get preempted. Every step checks the invariants; at the end every request is accounted for
(finished through an ``UpdateResult`` or aborted), every usable block is free and nothing is left.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from kvsched import FinishReason, Scheduler

EOS = 3
NUM_STEPS = 3000  # arrivals stop here; the loop then drains


def answer(
    s: Scheduler, out: Any, rng: random.Random, lookahead: int, min_tokens: dict[str, int]
) -> tuple[list[list[int]], Any]:
    """Random tokens (EOS now and then) for each entry that is not a prefill chunk, accepting a random number
    of its scheduled drafts, and new random drafts (when ``lookahead``); call right after schedule(). Like
    vLLM's sampler, it never emits EOS before ``min_tokens`` outputs (the scheduler does not hold EOS back)."""
    sampled: list[list[int]] = []
    drafts: list[list[int]] = []
    spec = out.spec_token_ids.tolist()
    spec_ptr = out.spec_token_ids_indptr.tolist()
    for k, rid in enumerate(out.req_ids):
        num_tokens = s._request_info(rid)[0] + len(s.get_output_token_ids(rid))
        scheduled_drafts = spec[spec_ptr[k] : spec_ptr[k + 1]]
        if s.get_num_computed_tokens(rid) - len(scheduled_drafts) < num_tokens:
            sampled.append([])
            drafts.append([])
        else:
            # a placeholder draft (-1, a padded admission) is verified as whatever the model samples there
            accepted = [t if t >= 0 else rng.randrange(0, 40) for t in scheduled_drafts]
            accepted = accepted[: rng.randrange(0, len(scheduled_drafts) + 1)]
            tokens = [*accepted, rng.randrange(0, 40)]
            known = len(s.get_output_token_ids(rid))  # a lower bound of the outputs before this entry
            sampled.append([EOS + 1 if t == EOS and known + i < min_tokens[rid] else t for i, t in enumerate(tokens)])
            drafts.append([rng.randrange(0, 40) for _ in range(rng.randrange(0, lookahead + 1))])
    return sampled, (drafts if lookahead else None)


@pytest.mark.parametrize(("policy", "lookahead"), [("fcfs", 0), ("priority", 0), ("fcfs", 2), ("priority", 3)])
def test_random_traffic_runs_to_completion_with_every_request_accounted_for(policy: str, lookahead: int):
    rng = random.Random(20260 + len(policy) + 10 * lookahead)
    cfg = {
        "block_size": 8,
        "num_blocks": 65,  # 64 usable blocks = 512 tokens for up to 12 requests of up to 128 tokens
        "max_model_len": 128,
        "max_num_batched_tokens": 96,
        "max_num_seqs": 12,
        "policy": policy,
        "prefix_hash_seed": 7,
        "num_lookahead_tokens": lookahead,
    }
    s = Scheduler(**cfg)
    prefixes = [[rng.randrange(100, 1000) for _ in range(rng.choice([8, 16, 24, 40]))] for _ in range(5)]

    params: dict[str, dict[str, Any]] = {}
    appended: dict[str, list[int]] = {}
    finished: dict[str, int] = {}  # id -> FinishReason
    aborted: set[str] = set()
    reported: set[str] = set()  # ids seen in SchedulerOutput.finished_req_ids
    pending: deque[tuple[Any, list[list[int]], Any]] = deque()
    num_steps = 0
    num_drafts_scheduled = 0
    next_id = 0

    def live() -> list[str]:
        return [r for r in params if r not in finished and r not in aborted]

    def apply_oldest() -> None:
        out, sampled, drafts = pending.popleft()
        res = s.update_from_output(out, sampled, drafts)
        s.check_invariants()
        for k, rid in enumerate(out.req_ids):
            n = int(res.num_new_tokens[k])
            assert n <= len(sampled[k])
            appended[rid] += sampled[k][:n]
        for rid, reason, stop in zip(
            res.finished_req_ids, res.finish_reasons.tolist(), res.stop_reasons.tolist(), strict=True
        ):
            assert rid not in finished and rid not in aborted
            finished[rid] = reason
            p = params[rid]
            out_toks = appended[rid]
            assert stop == -1
            if reason == FinishReason.STOP:
                assert out_toks[-1] == EOS and p["eos_token_id"] == EOS
                assert len(out_toks) >= p["min_tokens"]
            else:
                assert reason == FinishReason.LENGTH
                room = cfg["max_model_len"] - p["prompt_len"]
                assert len(out_toks) == min(p["max_tokens"], room)

    while num_steps < NUM_STEPS or s.has_unfinished_requests() or pending:
        assert num_steps < NUM_STEPS + 3000, "the loop did not drain"
        if num_steps < NUM_STEPS:
            for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 2])):
                rid = f"r{next_id}"
                next_id += 1
                prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
                prompt = prefix + [rng.randrange(100, 1000) for _ in range(rng.randrange(1, 40))]
                p = {
                    "prompt_len": len(prompt),
                    "max_tokens": rng.randrange(2, 40),
                    "min_tokens": rng.choice([0, 0, 2]),
                    "eos_token_id": rng.choice([EOS, None]),
                }
                s.add_request(
                    rid,
                    prompt,
                    max_tokens=p["max_tokens"],
                    min_tokens=p["min_tokens"],
                    eos_token_id=p["eos_token_id"],
                    priority=rng.randrange(0, 4),
                    arrival_time=float(num_steps) + rng.random(),
                )
                params[rid] = p
                appended[rid] = []
        out = s.schedule()
        num_steps += 1
        s.check_invariants()
        assert out.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert len(out.req_ids) <= cfg["max_num_seqs"]
        num_drafts_scheduled += len(out.spec_token_ids)
        for rid in out.finished_req_ids:
            assert rid in finished or rid in aborted
            assert rid not in reported
            reported.add(rid)
        pending.append((out, *answer(s, out, rng, lookahead, {r: p["min_tokens"] for r, p in params.items()})))
        if rng.random() < 0.02 and live():  # abort, possibly while its step is in flight
            victim = rng.choice(live())
            s.abort_requests([victim])
            aborted.add(victim)
            s.check_invariants()
        depth = 2 if rng.random() < 0.3 else 1
        while len(pending) >= depth or (pending and num_steps >= NUM_STEPS and not s.has_unfinished_requests()):
            apply_oldest()

    out = s.schedule()  # reports what finished since the last step
    reported.update(out.finished_req_ids)
    st = s.stats()
    assert len(params) > 1000
    assert len(finished) + len(aborted) == len(params)
    assert set(finished) | aborted == set(params)
    assert reported == set(params)
    assert st.num_finished_reqs == len(params)
    assert st.num_preemptions > 0
    assert (num_drafts_scheduled > 0) == (lookahead > 0)
    assert st.prefix_cache_hits > 0
    assert st.prefix_cache_preempted_queries > 0
    assert any(r == FinishReason.STOP for r in finished.values())
    assert any(r == FinishReason.LENGTH for r in finished.values())
    assert s.num_free_blocks == cfg["num_blocks"] - 1
    assert st.kv_cache_usage == 0.0
    assert (st.num_running_reqs, st.num_waiting_reqs) == (0, 0)
    assert not s.has_unfinished_requests()
    assert s.num_unfinished_requests == 0
    s.check_invariants()
