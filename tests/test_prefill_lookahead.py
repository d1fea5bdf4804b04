"""A multi-module MTP drafter's prefill lookahead (``prefill_lookahead_tokens``): docs/semantics.md's "Prefill
lookahead", on the Rust core and on the reference. An admission whose chunk the lookahead cuts to nothing is skipped
and keeps its place (vLLM 0.33), or ends the admission pass (``skip_lookahead_cut_admissions=False``, vLLM 0.32)."""

from __future__ import annotations

from typing import Any

import pytest
from kvsched import Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **fields: Any) -> Any:
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 40,
        "max_model_len": 64,
        "max_num_batched_tokens": 18,
        "enable_prefix_caching": False,
        "num_lookahead_tokens": 3,
        "prefill_lookahead_tokens": 3,
    }
    cfg.update(fields)
    config = SchedulerConfig(**cfg)
    return Scheduler(config) if impl == "rust" else ReferenceScheduler(config)


def scheduled(out: Any) -> dict[str, int]:
    return dict(zip(out.req_ids, out.num_scheduled_tokens, strict=True))


def add_three(s: Any) -> None:
    # "a" takes 17 of the 18 tokens; "b" (3 tokens) would leave 2 of them, fewer than the lookahead: cut to 0;
    # "c" (1 token) reaches its end with the token left.
    s.add_request("a", list(range(10, 27)), max_tokens=4)
    s.add_request("b", [5, 6, 7], max_tokens=4)
    s.add_request("c", [8], max_tokens=4)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_admission_cut_to_nothing_is_skipped_and_keeps_its_place(impl: str) -> None:
    s = make(impl)
    add_three(s)
    out = s.schedule()
    assert scheduled(out) == {"a": 17, "c": 1}
    assert s.stats().num_skipped_waiting_reqs == 1
    s.update_from_output(out, [[1], [2]])
    out = s.schedule()
    assert scheduled(out)["b"] == 3
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_without_skip_lookahead_cut_admissions_an_admission_cut_to_nothing_ends_the_pass(impl: str) -> None:
    s = make(impl, skip_lookahead_cut_admissions=False)
    add_three(s)
    out = s.schedule()
    assert scheduled(out) == {"a": 17}
    assert s.stats().num_skipped_waiting_reqs == 0
    s.update_from_output(out, [[1]])
    out = s.schedule()
    assert scheduled(out)["b"] == 3 and "c" in scheduled(out)  # ("c" a decode padded with the drafts' slots)
    s.check_invariants()
