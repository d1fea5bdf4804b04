"""The encoder-cache (EC) connector's scheduler hooks: ``has_cache_item`` (a load takes encoder-cache space but
no encoder budget) and ``ensure_cache_available`` (a transfer in progress defers the request), each run on the
Rust core and on the pure-Python reference. docs/semantics.md, "Encoder-cache connector", is the contract.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import requires_rust
from kvsched import SchedulerTypeError
from kvsched.reference import ReferenceScheduler

pytestmark = requires_rust

IMPLS = ["reference", "rust"]


def make(impl: str, **fields: Any) -> Any:
    from kvsched import Scheduler

    cls = ReferenceScheduler if impl == "reference" else Scheduler
    base: dict[str, Any] = {
        "block_size": 4,
        "num_blocks": 64,
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_encoder_input_tokens": 8,
        "encoder_cache_size": 16,
    }
    return cls(**{**base, **fields})


class FakeEc:
    """Holds the encoder outputs of ``items``; requests in ``in_transit`` wait for theirs. Records the calls."""

    def __init__(self, items: set[int] = frozenset(), in_transit: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.items, self.in_transit = set(items), set(in_transit)
        self.calls: list[tuple[Any, ...]] = []

    def has_cache_item(self, mm_hash: int) -> bool:
        self.calls.append(("has", mm_hash))
        return mm_hash in self.items

    def ensure_cache_available(self, req_id: str, num_computed_tokens: int) -> bool:
        self.calls.append(("ensure", req_id, num_computed_tokens))
        return req_id not in self.in_transit

    def update_state_after_alloc(self, req_id: str, input_index: int) -> None:
        self.calls.append(("alloc", req_id, input_index))


def csr(out: Any, name: str) -> tuple[list[int], list[int]]:
    return getattr(out, name).tolist(), getattr(out, f"{name}_indptr").tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_loaded_input_takes_cache_space_but_no_encoder_budget(impl: str) -> None:
    """vLLM 0.33's _try_schedule_encoder_inputs: an input the connector holds is loaded, not computed, so the
    budget (8 tokens) still computes b's input in the same step; both entries are cached."""
    s = make(impl)
    ec = FakeEc(items={1})
    s.set_ec_connector(ec)
    assert s.ec_connector is ec
    s.add_request("a", list(range(10)), encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    s.add_request("b", list(range(100, 110)), encoder_inputs=[(0, 8, 2)], arrival_time=1.0)
    out = s.schedule()
    s.check_invariants()
    assert out.num_scheduled_tokens.tolist() == [10, 10]
    assert csr(out, "scheduled_encoder_loads") == ([0], [0, 1, 1])
    assert csr(out, "scheduled_encoder_inputs") == ([0], [0, 0, 1])
    st = s.stats()
    assert (st.num_encoder_cache_entries, st.num_encoder_inputs_computed) == (2, 1)
    assert ec.calls == [
        ("ensure", "a", 0),
        ("has", 1),
        ("alloc", "a", 0),
        ("ensure", "b", 0),
        ("has", 2),
        ("alloc", "b", 0),
    ]


@pytest.mark.parametrize("impl", IMPLS)
def test_without_the_connector_the_budget_takes_one_input_per_step(impl: str) -> None:
    """The same requests without a connector: b waits for the next step's budget; no loads."""
    s = make(impl)
    s.add_request("a", list(range(10)), encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    s.add_request("b", list(range(100, 110)), encoder_inputs=[(0, 8, 2)], arrival_time=1.0)
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [10]
    assert csr(out, "scheduled_encoder_loads") == ([], [0, 0])
    assert s.ec_connector is None


@pytest.mark.parametrize("impl", IMPLS)
def test_the_connector_is_not_asked_about_a_locally_cached_or_unfitting_input(impl: str) -> None:
    """Local cache first, then the fit check, then the connector: c finds 1 cached, b's input does not fit the
    cache (b runs up to it), so only a's input is asked about."""
    s = make(impl, encoder_cache_size=8)
    ec = FakeEc(items={1, 2})
    s.set_ec_connector(ec)
    s.add_request("a", list(range(12)), encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    s.add_request("b", list(range(100, 112)), encoder_inputs=[(4, 8, 2)], arrival_time=1.0)
    s.add_request("c", list(range(200, 212)), encoder_inputs=[(0, 8, 1)], arrival_time=2.0)
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [12, 4, 12]
    assert csr(out, "scheduled_encoder_loads") == ([0], [0, 1, 1, 1])
    assert [c for c in ec.calls if c[0] == "has"] == [("has", 1)]


@pytest.mark.parametrize("impl", IMPLS)
def test_ensure_cache_available_defers_a_waiting_request_which_keeps_its_place(impl: str) -> None:
    """vLLM 0.33: a waiting request whose encoder outputs are in transit is skipped (asked with the tokens its
    lookups cover), the text-only request behind it runs, and it is admitted first once they arrive."""
    s = make(impl)
    ec = FakeEc(in_transit={"a"})
    s.set_ec_connector(ec)
    s.add_request("a", list(range(12)), encoder_inputs=[(4, 4, 1)], arrival_time=0.0)
    s.add_request("t", list(range(100, 104)), arrival_time=1.0)
    out = s.schedule()
    assert out.req_ids == ["t"]
    assert ec.calls == [("ensure", "a", 0)]
    s.update_from_output(out, [[5]])
    s.add_request("u", list(range(200, 204)), arrival_time=2.0)
    ec.in_transit.clear()
    out = s.schedule()
    assert out.req_ids == ["t", "a", "u"]
    assert ec.calls[-1] == ("alloc", "a", 0)  # computed (the connector does not hold it), told once a is scheduled
    s.check_invariants()


@pytest.mark.parametrize("impl", IMPLS)
def test_ensure_cache_available_holds_a_running_request_out_of_the_step(impl: str) -> None:
    """A running request is asked with its computed tokens; false leaves it out of the step (not preempted)."""
    s = make(impl, max_num_batched_tokens=8)
    ec = FakeEc()
    s.set_ec_connector(ec)
    s.add_request("a", list(range(20)), encoder_inputs=[(10, 4, 1)], arrival_time=0.0)
    out = s.schedule()
    s.update_from_output(out, [[]])
    ec.in_transit.add("a")
    out = s.schedule()
    assert out.req_ids == []
    assert ec.calls[-1] == ("ensure", "a", 8)
    ec.in_transit.clear()
    out = s.schedule()
    assert out.req_ids == ["a"] and out.num_computed_tokens.tolist() == [8]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_text_only_request_never_asks_the_connector(impl: str) -> None:
    s = make(impl)
    ec = FakeEc()
    s.set_ec_connector(ec)
    s.add_request("t", list(range(10)), arrival_time=0.0)
    out = s.schedule()
    assert out.req_ids == ["t"] and ec.calls == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_bad_hook_answer_is_raised_after_the_step_with_the_conservative_answer(impl: str) -> None:
    """A hook that does not answer a bool: the step completes as if it had answered conservatively (computed,
    not deferred) and the error is raised after it; the scheduler stays consistent."""

    class Bad:
        def has_cache_item(self, mm_hash: int) -> Any:
            return "yes"

    s = make(impl)
    s.set_ec_connector(Bad())
    s.add_request("a", list(range(10)), encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    with pytest.raises(SchedulerTypeError, match="has_cache_item must return a bool"):
        s.schedule()
    s.check_invariants()
    with pytest.raises(SchedulerTypeError, match="has_cache_item"):
        s.set_ec_connector(object())
    s.set_ec_connector(None)
    assert s.ec_connector is None


@pytest.mark.parametrize("impl", IMPLS)
def test_encoder_cache_entries_list_loaded_and_computed_entries_with_their_requests(impl: str) -> None:
    """encoder_cache_entries(): every cached entry (loaded or computed) with the requests referencing it; an
    entry whose last reference went stays listed, freeable, with no request."""
    s = make(impl)
    s.set_ec_connector(FakeEc(items={1}))
    s.add_request("a", list(range(10)), encoder_inputs=[(0, 8, 1)], arrival_time=0.0)
    s.add_request("b", list(range(100, 114)), encoder_inputs=[(0, 4, 2), (5, 8, 1)], arrival_time=1.0)
    assert s.encoder_cache_entries() == {}
    out = s.schedule()
    assert s.encoder_cache_entries() == {1: ["a", "b"], 2: ["b"]}
    s.update_from_output(out, [[5], [5]])
    assert s.encoder_cache_entries() == {1: [], 2: []}


@pytest.mark.parametrize("impl", IMPLS)
def test_a_max_tokens_past_max_model_len_is_tested_as_given_under_async_scheduling(impl: str) -> None:
    """Async scheduling skips a request whose steps in flight already produce its last token. vLLM tests that with
    ``max_tokens`` as given: given past ``max_model_len``, the request reaches the EC connector's gate once more in
    its last step (and the ``max_model_len`` cap then gives it nothing). Same tokens either way."""

    def run(max_tokens: int) -> tuple[list[str], list[tuple[Any, ...]]]:
        s = make(impl, max_model_len=32, async_scheduling=True)
        ec = FakeEc()
        s.set_ec_connector(ec)
        s.add_request("a", list(range(20)), encoder_inputs=[(10, 4, 1)], max_tokens=max_tokens, arrival_time=0.0)
        finished: list[str] = []
        in_flight: list[Any] = []
        for _ in range(40):
            in_flight.append(s.schedule())
            if len(in_flight) == 2 or not s.has_unfinished_requests():
                out = in_flight.pop(0)
                res = s.update_from_output(out, [[7]] * len(out.req_ids))
                finished += list(res.finished_req_ids)
            if not s.has_unfinished_requests():
                break
        s.check_invariants()
        return finished, [c for c in ec.calls if c[0] == "ensure"]

    finished_given, asked_given = run(100)  # the effective limit is 32 - 20 = 12
    finished_exact, asked_exact = run(12)
    assert finished_given == finished_exact == ["a"]
    assert len(asked_given) == len(asked_exact) + 1
    assert asked_given[: len(asked_exact)] == asked_exact
