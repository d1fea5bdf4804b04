"""Read-only queue views and the free order of unhashed blocks, the same in both implementations."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import SchedulerConfig
from kvsched.reference import ReferenceScheduler


def _impls() -> list[Any]:
    out: list[Any] = [pytest.param(ReferenceScheduler, id="reference")]
    out.append(pytest.param("rust", id="rust", marks=requires_rust))
    return out


def _make(impl: Any, **fields: Any) -> Any:
    config = SchedulerConfig(**fields)
    if impl == "rust":
        from kvsched import Scheduler

        return Scheduler(config)
    return impl(config)


@pytest.mark.parametrize("impl", _impls())
def test_views_follow_running_and_admission_order(impl: Any) -> None:
    s = _make(impl, block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=2, policy="priority")
    s.add_request("low", [1, 2, 3], priority=5, arrival_time=0.0)
    s.add_request("high", [1, 2, 3], priority=0, arrival_time=1.0)
    s.add_request("mid", [4, 5, 6], priority=1, arrival_time=2.0)
    s.add_request("mid-early", [4, 5, 7], priority=1, arrival_time=0.5)
    assert s.waiting_req_ids() == ["high", "mid-early", "mid", "low"]
    s.schedule()
    assert s.running_req_ids() == ["high", "mid-early"]
    assert s.waiting_req_ids() == ["mid", "low"]


@pytest.mark.parametrize("impl", _impls())
def test_num_cached_blocks_counts_the_blocks_entered_in_the_cache(impl: Any) -> None:
    s = _make(impl, block_size=4, num_blocks=64, max_model_len=64)
    s.add_request("a", list(range(10, 21)))  # 11 tokens: 2 full blocks
    assert s.get_num_cached_blocks("a") == 0
    s.schedule()
    assert s.get_num_cached_blocks("a") == 2
    off = _make(impl, block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=False)
    off.add_request("a", list(range(10, 21)))
    off.schedule()
    assert off.get_num_cached_blocks("a") == 0


@pytest.mark.parametrize("impl", _impls())
def test_unhashed_blocks_freed_together_go_to_the_head_deepest_first(impl: Any) -> None:
    """vLLM 0.33 BlockPool.free_blocks: blocks without a hash are prepended as one group in eviction order
    (deepest first), so the next allocation reuses the freed request's deepest block first."""
    s = _make(impl, block_size=4, num_blocks=16, max_model_len=32, enable_prefix_caching=False)
    s.add_request("a", list(range(10, 21)), max_tokens=1)  # 11 tokens -> blocks 1, 2, 3
    out = s.schedule()
    assert s.get_block_ids("a").tolist() == [1, 2, 3]
    s.update_from_output(out, [[5]])  # finishes: frees 3, 2, 1 -> head is 3, 2, 1
    s.add_request("b", list(range(30, 35)))  # 5 tokens -> 2 blocks
    s.schedule()
    assert s.get_block_ids("b").tolist() == [3, 2]
