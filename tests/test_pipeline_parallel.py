"""Pipeline parallelism (docs/semantics.md, "Pipeline parallelism"): ``decode_stagger`` and
``max_concurrent_batches``, on the Rust core and on the reference."""

from __future__ import annotations

from typing import Any

import pytest
from kvsched import InvalidConfigError, Scheduler, SchedulerConfig
from kvsched.reference import ReferenceScheduler

IMPLS = ["rust", "reference"]


def make(impl: str, **fields: Any) -> Any:
    cfg: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 33,
        "max_model_len": 64,
        "max_num_batched_tokens": 64,
        "prefix_hash_seed": 0,
    }
    cfg.update(fields)
    config = SchedulerConfig(**cfg)
    return Scheduler(config) if impl == "rust" else ReferenceScheduler(config)


def scheduled(out: Any) -> dict[str, int]:
    return dict(zip(out.req_ids, out.num_scheduled_tokens.tolist(), strict=True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("stagger", [1, 3])
def test_a_decoded_request_waits_decode_stagger_calls_with_steps_in_flight(impl: str, stagger: int) -> None:
    # Async scheduling, nothing applied: a request whose step is not a prefill chunk is scheduled again only
    # decode_stagger schedule() calls later; the calls between schedule nothing for it.
    s = make(impl, async_scheduling=True, decode_stagger=stagger)
    s.add_request("a", list(range(8)), max_tokens=20)
    outs = [s.schedule() for _ in range(7)]
    got = [scheduled(o).get("a", 0) for o in outs]
    if stagger == 1:
        assert got == [8, 1, 1, 1, 1, 1, 1]
    else:
        assert got == [8, 0, 0, 1, 0, 0, 1]
    for out in outs:
        s.update_from_output(out, [[5]] * len(out.req_ids))
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_prefill_chunk_does_not_start_the_wait(impl: str) -> None:
    # Chunks of 4: the first leaves prompt to compute (no wait), the second completes the prompt (the wait starts).
    s = make(impl, async_scheduling=True, decode_stagger=2, long_prefill_token_threshold=4)
    s.add_request("a", list(range(8)), max_tokens=20)
    s.add_request("b", list(range(100, 104)), max_tokens=20)
    outs = [s.schedule() for _ in range(5)]
    assert [scheduled(o) for o in outs] == [{"a": 4, "b": 4}, {"a": 4}, {"b": 1}, {"a": 1}, {"b": 1}]
    for out in outs:
        s.update_from_output(out, [[5] if s.get_num_computed_tokens(r) >= 8 or r == "b" else [] for r in out.req_ids])
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_stagger_applies_without_async_scheduling_too(impl: str) -> None:
    # Each step applied before the next: the sampled token is there, yet the request waits out the stagger.
    s = make(impl, decode_stagger=2)
    s.add_request("a", list(range(8)), max_tokens=20)
    got = []
    for _ in range(5):
        out = s.schedule()
        got.append(scheduled(out).get("a", 0))
        s.update_from_output(out, [[5]] * len(out.req_ids))
    assert got == [8, 0, 1, 0, 1]
    s.check_invariants()


def admits_long_prompt(impl: str, free: int, **fields: Any) -> bool:
    """A window of 4 and a budget of 8, ``free`` blocks left by one-block requests (each scheduled once, nothing
    applied): is a 60-token prompt admitted? It needs ceil((3 + batches * 8) / 4) + 1 blocks at admission: 4 with
    one batch in flight, 6 with two, 8 with three."""
    s = make(impl, num_blocks=17, sliding_window=4, max_num_batched_tokens=8, **fields)
    for i in range(16 - free):
        s.add_request(f"x{i}", list(range(100 * i + 100, 100 * i + 104)), max_tokens=1)
    while s.num_free_blocks > free:
        s.schedule()
    s.add_request("a", list(range(60)), max_tokens=2)
    return "a" in s.schedule().req_ids


@pytest.mark.parametrize("impl", IMPLS)
def test_max_concurrent_batches_sizes_the_window_admission_cap(impl: str) -> None:
    for batches, admitted in ((1, True), (2, True), (3, False)):
        assert admits_long_prompt(impl, 6, max_concurrent_batches=batches) is admitted, batches
    assert admits_long_prompt(impl, 5, max_concurrent_batches=1, async_scheduling=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_max_concurrent_batches_defaults_to_two_with_async_scheduling_else_one(impl: str) -> None:
    assert admits_long_prompt(impl, 5)
    assert not admits_long_prompt(impl, 5, async_scheduling=True)
    assert admits_long_prompt(impl, 6, async_scheduling=True)


@pytest.mark.parametrize("field", ["decode_stagger", "max_concurrent_batches"])
@pytest.mark.parametrize("value", [0, 1025])
def test_out_of_range_values_are_refused(field: str, value: int) -> None:
    with pytest.raises(InvalidConfigError, match=field):
        SchedulerConfig(**{field: value})
