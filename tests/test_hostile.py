"""Hostile callers: garbage arguments, threads, and prefix-cache isolation on the Rust scheduler.

Whatever a caller passes, a public method either works or raises a :class:`kvsched.SchedulerError` subclass
(never a bare TypeError/OverflowError/PanicException), and the scheduler's invariants still hold afterwards.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched import SchedulerError

pytestmark = requires_rust


def new_scheduler(**cfg: Any) -> Any:
    from kvsched import Scheduler

    cfg = {"block_size": 4, "num_blocks": 32, "max_model_len": 64, "max_num_batched_tokens": 64, **cfg}
    return Scheduler(**cfg)


class RaisingIndex:
    """An int-like object whose conversion fails."""

    def __index__(self) -> int:
        raise ValueError("no")

    def __float__(self) -> float:
        raise ValueError("no")


class ReentrantIndex:
    """An int-like object that calls back into the scheduler while its argument is being converted."""

    sched: Any = None

    def __index__(self) -> int:
        if self.sched is not None:
            with contextlib.suppress(SchedulerError):
                self.sched.schedule()
        return 1


def arrays() -> st.SearchStrategy[np.ndarray]:
    base = st.sampled_from([
        np.arange(6, dtype=np.int32),
        np.arange(12, dtype=np.int64)[::2],  # non-contiguous
        np.arange(6, dtype=np.int32).reshape(2, 3),  # 2-D
        np.zeros(0, dtype=np.int32),
        np.array([1.5, 2.0]),
        np.array([True, False]),
        np.array([2**63 + 5], dtype=np.uint64),
        np.array([-1, 3], dtype=np.int8),
        np.array([1, 2], dtype=">i4"),  # big-endian
        np.array(["a", "b"]),
        np.array([1, "x"], dtype=object),
        np.array([1, 2], dtype=np.uint16),
        np.int32(5),  # a 0-d scalar
    ])  # fmt: skip
    return base.map(lambda a: a.copy() if hasattr(a, "copy") else a)


def garbage() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
        st.sampled_from(["", "r0", "\ud800", "é🙂", "r1\x00"]),
        st.binary(max_size=4),
        st.builds(RaisingIndex),
        st.builds(ReentrantIndex),
        st.builds(object),
    )
    return st.one_of(
        scalars,
        arrays(),
        st.lists(scalars, max_size=4),
        st.lists(st.integers(0, 40), max_size=6),
        st.lists(st.lists(st.integers(-3, 40), max_size=3), max_size=4),
        st.lists(st.lists(scalars, max_size=3), max_size=4),  # lists of lists off the binding's fast path
        st.tuples(arrays(), arrays()),
        st.tuples(scalars, scalars),
        st.dictionaries(st.text(max_size=2), scalars, max_size=2),
        st.frozensets(st.integers(0, 5), max_size=3),
    )


ADD_PARAMS = ("max_tokens", "min_tokens", "eos_token_id", "ignore_eos", "stop_token_ids", "priority",
              "arrival_time", "cache_salt", "lora_name")  # fmt: skip
METHODS = ["add", "add_kw", "schedule", "update", "prepare", "abort", "get", "probe", "reset", "read"]


def call(sched: Any, other: Any, outs: list[Any], method: str, g: list[Any], data: Any) -> None:
    """One public call with garbage mixed into otherwise plausible arguments."""
    if method == "add":
        sched.add_request(g[0], g[1])
    elif method == "add_kw":
        name = data.draw(st.sampled_from(ADD_PARAMS))
        sched.add_request(data.draw(st.sampled_from(["x", "y", "r0"])), [1, 2, 3], **{name: g[0]})
    elif method == "schedule":
        outs.append(sched.schedule())
    elif method == "update":
        out = data.draw(st.sampled_from([*outs[-3:], other.schedule(), g[0]])) if outs else g[0]
        sched.update_from_output(out, g[1], *([g[2]] if data.draw(st.booleans()) else []))
    elif method == "prepare":
        sched.prepare_model_inputs(data.draw(st.sampled_from([*outs[-2:], g[0]])) if outs else g[0])
    elif method == "abort":
        sched.abort_requests(g[0])
    elif method == "get":
        name = data.draw(st.sampled_from(["get_block_ids", "get_block_hashes", "get_request_status",
                                          "get_num_computed_tokens", "get_output_token_ids"]))  # fmt: skip
        getattr(sched, name)(g[0])
    elif method == "probe":
        sched.get_num_cached_tokens(g[0], *g[1 : 1 + data.draw(st.integers(0, 2))])
    elif method == "reset":
        sched.reset_prefix_cache()
    else:
        sched.stats()
        assert isinstance(sched.has_unfinished_requests(), bool)
        assert sched.num_unfinished_requests >= 0 and sched.num_free_blocks >= 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_public_method_survives_garbage(data: Any) -> None:
    sched, other = new_scheduler(num_lookahead_tokens=data.draw(st.sampled_from([0, 2]))), new_scheduler()
    ReentrantIndex.sched = sched
    for rid in ("r0", "r1"):
        sched.add_request(rid, list(range(1, 10)), arrival_time=0.0)
    outs: list[Any] = []
    try:
        for _ in range(data.draw(st.integers(1, 12))):
            method = data.draw(st.sampled_from(METHODS))
            g = [data.draw(garbage()) for _ in range(3)]
            with contextlib.suppress(SchedulerError):
                call(sched, other, outs, method, g, data)
            sched.check_invariants()
    finally:
        ReentrantIndex.sched = None


@pytest.mark.parametrize(
    "kw",
    [
        {"arrival_time": math.nan}, {"arrival_time": math.inf}, {"arrival_time": -math.inf},
        {"arrival_time": 10**400}, {"priority": 2**64}, {"min_tokens": 2**64}, {"min_tokens": -(2**64)},
        {"eos_token_id": 2**40}, {"stop_token_ids": [2**64]}, {"cache_salt": "\udfff"}, {"lora_name": 3},
    ],
)  # fmt: skip
def test_extreme_add_request_arguments_raise_scheduler_errors(kw: dict[str, Any]) -> None:
    sched = new_scheduler()
    with pytest.raises(SchedulerError):
        sched.add_request("a", [1, 2, 3], **kw)
    assert not sched.has_unfinished_requests()
    sched.check_invariants()


def test_calls_after_abort_and_stale_outputs_raise_cleanly() -> None:
    from kvsched import InvalidOutputError, UnknownRequestError

    sched = new_scheduler()
    sched.add_request("a", [1, 2, 3], arrival_time=0.0)
    out = sched.schedule()
    sched.abort_requests(["a"])
    for name in ("get_block_ids", "get_request_status", "get_output_token_ids", "get_block_hashes"):
        with pytest.raises(UnknownRequestError):
            getattr(sched, name)("a")
    with pytest.raises(UnknownRequestError):
        sched.abort_requests(["a"])
    with pytest.raises(InvalidOutputError):
        sched.prepare_model_inputs(out)  # the abort changed the scheduler
    sched.update_from_output(out, [[1]])  # the aborted request's entry is ignored
    with pytest.raises(InvalidOutputError):
        sched.update_from_output(out, [[1]])  # stale: already applied
    sched.check_invariants()


def test_outputs_held_dropped_or_read_late_keep_their_own_contents() -> None:
    """A dropped output's vectors are reused for a later step (what numpy has not taken): outputs still held,
    read only later or dropped out of order, show what they showed when scheduled. Twin schedulers get the same
    calls; one reads each output at once, the other keeps some unread (and drops the rest at once)."""

    def snapshot(out: Any) -> tuple[Any, ...]:
        return (
            out.step_id,
            list(out.req_ids),
            out.num_scheduled_tokens.tolist(),
            out.num_computed_tokens.tolist(),
            out.new_block_ids.tolist(),
            out.new_block_ids_indptr.tolist(),
            out.spec_token_ids_indptr.tolist(),
            out.new_req_ids,
            out.finished_req_ids,
        )

    eager, late = new_scheduler(num_blocks=16), new_scheduler(num_blocks=16)
    seen: list[tuple[Any, ...]] = []
    kept: dict[int, Any] = {}
    for step in range(60):
        if step % 4 == 0 and step < 40:
            for s in (eager, late):
                s.add_request(f"r{step}", list(range(1, 6 + step % 9)), max_tokens=6 + step % 7, arrival_time=0.0)
        out = eager.schedule()
        seen.append(snapshot(out))
        eager.update_from_output(out, [[3]] * out.num_reqs)
        held = late.schedule()
        late.update_from_output(held, [[3]] * held.num_reqs)
        if step % 3 == 0:
            kept[step] = held
        del held
        if step % 5 == 4 and kept:
            kept.pop(min(kept))  # the oldest kept output goes first, out of order with the others
    assert kept
    for step, out in kept.items():
        assert snapshot(out) == seen[step], step
    eager.check_invariants()
    late.check_invariants()


def test_threads_calling_one_scheduler_get_clean_errors_or_serialised_behaviour() -> None:
    sched = new_scheduler(num_blocks=64, max_num_batched_tokens=512)
    unexpected: list[BaseException] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for i in range(300):
            try:
                if rng.random() < 0.4:
                    sched.add_request(f"t{t}-{i}", [1, 2, 3, 4, 5], max_tokens=4, arrival_time=float(i))
                out = sched.schedule()
                sched.update_from_output(out, [[int(rng.integers(0, 9))] for _ in out.req_ids])
                if rng.random() < 0.1:
                    sched.abort_requests([f"t{t}-{i}"])
                sched.stats()
            except SchedulerError:
                pass  # out-of-order outputs, unknown ids...: clean, expected
            except BaseException as e:  # anything else is a failure
                unexpected.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not unexpected, unexpected[:3]
    sched.check_invariants()
    st_ = sched.stats()
    assert st_.num_running_reqs + st_.num_waiting_reqs == sched.num_unfinished_requests


# ----------------------------------------------------------------------------------------------------------
# Prefix-cache isolation
# ----------------------------------------------------------------------------------------------------------


def test_different_cache_salts_never_share_blocks() -> None:
    sched = new_scheduler(max_num_batched_tokens=256)
    prompt = list(range(40))
    for rid, salt in (("a", "alice"), ("b", "bob"), ("c", None), ("d", "alice")):
        sched.add_request(rid, prompt, cache_salt=salt, arrival_time=0.0)
    out = sched.schedule()
    blocks = {rid: set(sched.get_block_ids(rid).tolist()) for rid in "abcd"}
    assert not blocks["a"] & blocks["b"] and not blocks["a"] & blocks["c"] and not blocks["b"] & blocks["c"]
    assert blocks["a"] & blocks["d"]  # the same salt does share
    assert out.num_computed_tokens.tolist() == [0, 0, 0, 36]
    hashes = {rid: sched.get_block_hashes(rid) for rid in "abcd"}
    assert not set(hashes["a"]) & set(hashes["b"]) and not set(hashes["a"]) & set(hashes["c"])
    assert hashes["a"] == hashes["d"]
    assert sched.get_num_cached_tokens(prompt, cache_salt="eve") == 0
    assert sched.get_num_cached_tokens(prompt, cache_salt="bob") == 36


def test_lora_name_isolates_the_prefix_cache() -> None:
    sched = new_scheduler()
    sched.add_request("a", list(range(20)), lora_name="L1", arrival_time=0.0)
    sched.schedule()
    assert sched.get_num_cached_tokens(list(range(20)), lora_name="L1") == 16
    assert sched.get_num_cached_tokens(list(range(20))) == 0
    assert sched.get_num_cached_tokens(list(range(20)), lora_name="L2") == 0


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_hash_seed_random_unless_fixed(algo: str) -> None:
    def hashes(seed: Any) -> list[bytes]:
        sched = new_scheduler(prefix_hash_algo=algo, prefix_hash_seed=seed)
        sched.add_request("a", list(range(12)), arrival_time=0.0)
        return sched.get_block_hashes("a")

    width = 32 if algo == "sha256" else 16
    first = hashes(None)
    assert len(first) == 3 and all(isinstance(h, bytes) and len(h) == width for h in first)
    assert len(set(first)) == 3
    assert first != hashes(None)  # no fixed seed: a random seed per scheduler
    assert hashes(7) == hashes(7) and hashes("s") == hashes("s") and hashes(b"s") == hashes(b"s")
    assert hashes(7) != hashes(8)


@pytest.mark.parametrize(
    "fields",
    [
        {"block_size": 4097}, {"block_size": True}, {"num_blocks": 1}, {"num_blocks": 2**40}, {"max_num_seqs": 0},
        {"max_model_len": -5}, {"policy": "lifo"}, {"prefix_hash_algo": "md5"}, {"prefix_hash_seed": 1.5},
        {"enable_prefix_caching": 1}, {"num_lookahead_tokens": 2000}, {"max_num_batched_tokens": None},
        {"bogus_field": 1},
    ],
)  # fmt: skip
def test_constructor_garbage_raises_scheduler_errors(fields: dict[str, Any]) -> None:
    from kvsched import Scheduler

    with pytest.raises(SchedulerError):
        Scheduler(**fields)
