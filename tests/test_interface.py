"""``kvsched.interface``: both schedulers satisfy the protocols, and the protocols name exactly their public members.

mypy checks the signatures (the ``TYPE_CHECKING`` block at the end of ``kvsched/interface.py``); these tests check
at run time that the member sets cannot drift apart: a member added to one scheduler and not to the protocol (or
the other way round) fails here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from conftest import requires_rust
from kvsched import reference
from kvsched.interface import ModelInputsProtocol, SchedulerOutputProtocol, SchedulerProtocol, UpdateResultProtocol

PROTOCOLS = (SchedulerProtocol, SchedulerOutputProtocol, UpdateResultProtocol, ModelInputsProtocol)


def protocol_members(proto: type) -> set[str]:
    return {name for name in vars(proto) if not name.startswith("_")}


def public_members(cls: type) -> set[str]:
    names = {name for name in dir(cls) if not name.startswith("_")}
    if dataclasses.is_dataclass(cls):  # fields without a default are not class attributes
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def rust_classes() -> tuple[type, ...]:
    from kvsched import _core
    from kvsched.scheduler import Scheduler

    return (Scheduler, _core.SchedulerOutput, _core.UpdateResult, _core.ModelInputs)


def reference_classes() -> tuple[type, ...]:
    return (reference.ReferenceScheduler, reference.SchedulerOutput, reference.UpdateResult, reference.ModelInputs)


IMPLEMENTATIONS = [
    pytest.param(rust_classes, id="rust", marks=requires_rust),
    pytest.param(reference_classes, id="reference"),
]


def test_the_member_scan_sees_methods_and_properties() -> None:
    members = protocol_members(SchedulerProtocol)
    assert {"schedule", "update_from_output", "config", "num_free_blocks", "prefill_cadence"} <= members
    # 47 + append_input, finish_input, has_request (streaming input), set_encoder_sizes, the EC connector's 3
    # + the cache-hit cap's 2 and get_cached_block_mask + encoder-decoder scheduling's slot count and its reset
    # + preempt_request + block pins (pin_blocks, unpin_blocks, get_block_pin_cnt) and the block-hash reads
    # (get_block_hash, get_cached_block_id, free_block_ids) + free_held_window_blocks (KV connectors with windows)
    # + evict_cached_blocks (policy "fail" of invalid blocks of synchronous loads) + get_held_block_ids and
    # take_mamba_boundary_offers (KV connectors with Mamba prefix caching) + get_block_hash_num_tokens (the
    # trailing-block drop beside Mamba prefill checkpoints) + set_prefill_lookahead (the drafter's lookahead
    # changed on a built scheduler, as vLLM's tests change it) + get_block_hash_group (block pins with several
    # groups) + get_replay_start (bounded prefix replay)
    assert len(members) == 74
    assert "num_reqs" in protocol_members(SchedulerOutputProtocol)


@pytest.mark.parametrize("classes", IMPLEMENTATIONS)
@pytest.mark.parametrize("which", range(len(PROTOCOLS)), ids=[p.__name__ for p in PROTOCOLS])
def test_the_protocol_names_exactly_the_public_members(classes: Any, which: int) -> None:
    proto, cls = PROTOCOLS[which], classes()[which]
    members, public = protocol_members(proto), public_members(cls)
    assert public - members == set(), f"public members of {cls.__qualname__} missing from {proto.__name__}"
    assert members - public == set(), f"members of {proto.__name__} that {cls.__qualname__} lacks"


@pytest.mark.parametrize("classes", IMPLEMENTATIONS)
def test_a_run_through_the_protocol_gets_protocol_results(classes: Any) -> None:
    sched: SchedulerProtocol[Any] = classes()[0](block_size=4, num_blocks=16, max_model_len=32)
    assert isinstance(sched, SchedulerProtocol)
    sched.add_request("r0", [1, 2, 3, 4, 5], max_tokens=2)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert isinstance(out, SchedulerOutputProtocol)
        assert isinstance(sched.prepare_model_inputs(out), ModelInputsProtocol)
        res = sched.update_from_output(out, [[9]] * len(out))
        assert isinstance(res, UpdateResultProtocol)
        steps += 1
    assert steps == 2
    assert res.finished_req_ids == ["r0"]


@pytest.mark.parametrize("classes", IMPLEMENTATIONS)
def test_schedule_takes_none_for_throttle_prefills(classes: Any) -> None:
    """``throttle_prefills=None`` (the stub's default) is False in both schedulers; a non-bool is refused."""
    from kvsched import SchedulerTypeError

    sched: SchedulerProtocol[Any] = classes()[0](block_size=4, num_blocks=16, max_model_len=32)
    sched.add_request("r0", [1, 2, 3, 4, 5], max_tokens=2)
    assert list(sched.schedule(throttle_prefills=None).req_ids) == ["r0"]
    with pytest.raises(SchedulerTypeError, match="throttle_prefills must be a bool"):
        sched.schedule(throttle_prefills=0)  # type: ignore[arg-type]


def test_isinstance_needs_every_member() -> None:
    members = protocol_members(SchedulerProtocol)
    complete = type("Complete", (), dict.fromkeys(members, 0))
    assert isinstance(complete(), SchedulerProtocol)
    for missing in ("waiting_req_ids", "preemption_costs"):
        partial = type("Partial", (), dict.fromkeys(members - {missing}, 0))
        assert not isinstance(partial(), SchedulerProtocol), missing
