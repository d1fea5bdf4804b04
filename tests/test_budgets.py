"""The step's two budgets (docs/semantics.md "Budgets"): a token budget (`max_num_scheduled_tokens`) apart from
the input budget (`max_num_batched_tokens`), of which every scheduled request also takes a drafter's query slots
(`draft_slots`). Both implementations, and the errors they raise alike."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import run_to_completion
from kvsched import InvalidConfigError, InvalidRequestError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **kw: Any) -> Any:
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 64, "max_model_len": 64, "max_num_seqs": 16, **kw})
    return Scheduler(cfg) if impl == "rust" else ReferenceScheduler(cfg)


def scheduled(out: Any) -> dict[str, int]:
    return {rid: int(n) for rid, n in out.num_scheduled_tokens_by_id().items()}


@pytest.mark.parametrize("impl", IMPLS)
def test_every_scheduled_request_takes_its_draft_slots_from_the_input_budget(impl: str) -> None:
    s = make(impl, max_num_batched_tokens=20, num_speculative_tokens=4, draft_slots=3)
    for k, rid in enumerate(("0", "1", "2")):
        s.add_request(rid, list(range(100 * k + 1, 100 * k + 11)), max_tokens=4, arrival_time=0.0)
    # 10 + 3 inputs for the first, then 20 - 13 - 3 = 4 tokens for the second; the third finds 0 < 3 + 1.
    assert scheduled(s.schedule()) == {"0": 10, "1": 4}
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_token_budget_caps_the_tokens_apart_from_the_inputs(impl: str) -> None:
    s = make(impl, max_num_batched_tokens=20, max_num_scheduled_tokens=12)
    for k, rid in enumerate(("0", "1")):
        s.add_request(rid, list(range(100 * k + 1, 100 * k + 11)), max_tokens=4, arrival_time=0.0)
    assert scheduled(s.schedule()) == {"0": 10, "1": 2}


@pytest.mark.parametrize("impl", IMPLS)
def test_decodes_stop_where_their_slots_use_up_the_inputs(impl: str) -> None:
    # Eight running decodes, 1 + 2 inputs each: 20 // 3 = 6 of them per step (in running order), which the
    # core's run of plain decodes counts as the general path does.
    s = make(impl, max_num_batched_tokens=20, draft_slots=2, num_speculative_tokens=2)
    for k in range(8):
        s.add_request(f"r{k}", [k + 1, 2], max_tokens=30, arrival_time=float(k))
    for _ in range(4):  # admissions: 2 tokens + 2 slots each, 5 per step
        out = s.schedule()
        s.update_from_output(out, [[7] for _ in out.req_ids])
        s.check_invariants()
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == [1] * 6
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_every_request_still_finishes_with_both_budgets(impl: str) -> None:
    s = make(impl, max_num_batched_tokens=16, max_num_scheduled_tokens=9, draft_slots=3, num_blocks=24)
    lens = {}
    for k in range(10):
        prompt = list(range(1 + k, 14 + 3 * k))
        s.add_request(f"r{k}", prompt, max_tokens=5, arrival_time=float(k))
        lens[f"r{k}"] = len(prompt)
    outs = run_to_completion(s, lens)
    assert all(int(o.total_num_scheduled_tokens) <= 9 for o in outs)
    assert all(int(o.total_num_scheduled_tokens) + 3 * len(o.req_ids) <= 16 for o in outs)
    assert s.num_free_blocks == 23


@pytest.mark.parametrize("impl", IMPLS)
def test_without_chunked_prefill_a_request_longer_than_a_step_gives_is_refused(impl: str) -> None:
    s = make(impl, max_num_batched_tokens=40, draft_slots=8, enable_chunked_prefill=False)
    s.add_request("fits", list(range(1, 30)), max_tokens=4, arrival_time=0.0)  # 32 slots <= 40 - 8
    with pytest.raises(InvalidRequestError):
        s.add_request("long", list(range(1, 32)), max_tokens=4, arrival_time=0.0)  # 34 > 32
    assert not s.has_request("long") and s.num_unfinished_requests == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_num_batched_tokens": 8, "draft_slots": 8}, "draft_slots must be below max_num_batched_tokens"),
        ({"max_num_batched_tokens": 8, "max_num_scheduled_tokens": 9}, r"max_num_scheduled_tokens must be in \[1, 8\]"),
        ({"max_num_scheduled_tokens": 0}, "max_num_scheduled_tokens"),
        ({"draft_slots": -1}, "draft_slots"),
    ],
)
def test_bad_budgets_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        SchedulerConfig(**fields)
