"""Every accepted form of ``sampled_token_ids`` / ``draft_token_ids`` means the same tokens as the numpy pair.

The binding reads vLLM's form, exact lists of exact ints, on a fast path; anything else in the list (a tuple, a
list subclass, a numpy array or integer, an int subclass) goes through the general conversion. Each test drives
two schedulers through the same run, one fed ``(values, indptr)`` arrays and one fed the form under test, and
checks they agree on every step's result and on every request's final outputs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched import InvalidOutputError, SchedulerError

pytestmark = requires_rust

Rows = list[list[int]]


class SubList(list):  # type: ignore[type-arg]
    pass


class Token(enum.IntEnum):
    TWO = 2
    SEVEN = 7
    NINE = 9


def _pair(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=indptr[1:])
    return np.array([t for r in rows for t in r], dtype=np.int64), indptr


def _first_tuple(rows: Rows) -> list[Any]:
    """Fast-path rows, then (the last row) a tuple: the fast path has done work before it gives up."""
    return [*rows[:-1], tuple(rows[-1])] if rows else []


FORMS: dict[str, Callable[[Rows], Any]] = {
    "lists": lambda rows: [list(r) for r in rows],
    "tuples": lambda rows: [tuple(r) for r in rows],
    "list-subclass-rows": lambda rows: [SubList(r) for r in rows],
    "list-subclass-outer": lambda rows: SubList(list(r) for r in rows),
    "numpy-int-items": lambda rows: [[np.int64(t) for t in r] for r in rows],
    "numpy-int32-items": lambda rows: [[np.int32(t) for t in r] for r in rows],
    "int-subclass-items": lambda rows: [[Token(t) for t in r] for r in rows],
    "array-rows": lambda rows: [np.array(r, dtype=np.int32) for r in rows],
    "last-row-a-tuple": _first_tuple,
}


def _new(**cfg: Any) -> Any:
    from kvsched import Scheduler

    config = {"block_size": 4, "num_blocks": 64, "max_model_len": 64, "max_num_batched_tokens": 24,
              "max_num_seqs": 4, "prefix_hash_seed": 0, **cfg}  # fmt: skip
    return Scheduler(**config)


def _rows(sched: Any, out: Any, rng: np.random.Generator, prompt_lens: dict[str, int]) -> tuple[Rows, Rows]:
    """Sampled tokens (one per finished-prefill request, 1 + its drafts when it had drafts) and new drafts."""
    sampled: Rows = []
    drafts: Rows = []
    spec = out.spec_token_ids_indptr.tolist()
    for k, rid in enumerate(out.req_ids):
        num_tokens = prompt_lens[rid] + len(sched.get_output_token_ids(rid))
        done = out.num_computed_tokens[k] + out.num_scheduled_tokens[k] - (spec[k + 1] - spec[k]) >= num_tokens
        n = int(rng.integers(1, spec[k + 1] - spec[k] + 2)) if done else 0
        sampled.append([int(t) for t in rng.choice([7, 9, 2], size=n)])
        drafts.append([int(t) for t in rng.choice([7, 9], size=int(rng.integers(0, 3)))] if done else [])
    return sampled, drafts


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_accepted_form_schedules_like_the_numpy_pair(form: str, lookahead: int) -> None:
    convert = FORMS[form]
    ref, sched = _new(num_lookahead_tokens=lookahead), _new(num_lookahead_tokens=lookahead)
    prompt_lens = {}
    for i in range(6):
        prompt = list(range(10 + i, 10 + i + 5 + 3 * i))
        prompt_lens[f"r{i}"] = len(prompt)
        for s in (ref, sched):
            s.add_request(f"r{i}", prompt, max_tokens=6 + i, eos_token_id=2)
    rng = np.random.Generator(np.random.PCG64(5))
    steps = 0
    while ref.has_unfinished_requests():
        steps += 1
        assert steps < 200
        out_ref, out = ref.schedule(), sched.schedule()
        assert out.req_ids == out_ref.req_ids
        sampled, drafts = _rows(ref, out_ref, rng, prompt_lens)
        draft_args = (_pair(drafts),) if lookahead else ()
        res_ref = ref.update_from_output(out_ref, _pair(sampled), *draft_args)
        res = sched.update_from_output(out, convert(sampled), *((convert(drafts),) if lookahead else ()))
        assert res.finished_req_ids == res_ref.finished_req_ids
        assert res.num_new_tokens.tolist() == res_ref.num_new_tokens.tolist()
        assert res.finish_reasons.tolist() == res_ref.finish_reasons.tolist()
        sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert sched.stats() == ref.stats()


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ([[7], [True]], "sampled_token_ids[1] must be an int, got bool"),
        ([[2**63], []], "sampled_token_ids[0] is out of the int64 range: 9223372036854775808"),
        ([[-(2**63) - 1], []], "out of the int64 range: -9223372036854775809"),
        ([[7], (1.5,)], "sampled_token_ids[1] must be an int, got float"),
        ([[7], "ab"], "sampled_token_ids[1] must be a list of ints, got str"),
    ],
)
def test_a_bad_item_after_good_rows_is_reported_by_position(bad: Any, needle: str) -> None:
    sched = _new()
    sched.add_request("a", [1, 2, 3], max_tokens=4)
    sched.add_request("b", list(range(40)), max_tokens=4)  # a chunked prefill: its entry must be empty
    out = sched.schedule()
    assert out.req_ids == ["a", "b"]
    before = (sched.stats(), sched.get_output_token_ids("a"))
    with pytest.raises(SchedulerError) as exc:
        sched.update_from_output(out, bad)
    assert needle in str(exc.value)
    assert isinstance(exc.value, TypeError | InvalidOutputError)
    assert (sched.stats(), sched.get_output_token_ids("a")) == before
    sched.update_from_output(out, [[7], []])
    assert sched.get_output_token_ids("a") == [7]


class ClearingIndex:
    """An int-like item whose conversion empties the list of lists that holds it."""

    def __init__(self, outer: list[Any]) -> None:
        self.outer = outer

    def __index__(self) -> int:
        self.outer.clear()
        return 7


def test_an_item_that_empties_the_outer_list_mid_conversion_is_safe() -> None:
    sched = _new()
    for rid in ("a", "b"):
        sched.add_request(rid, [1, 2, 3], max_tokens=4)
    out = sched.schedule()
    # The first row's item empties the list: the second row is never read, so only one entry arrives.
    sampled: list[Any] = [[7], [7]]
    sampled[0] = [ClearingIndex(sampled)]
    with pytest.raises(InvalidOutputError, match="got 2"):
        sched.update_from_output(out, sampled)
    sched.check_invariants()
    # The last row's item empties the list after that row was taken: both rows arrive.
    sampled = [[7], [7]]
    sampled[1] = [ClearingIndex(sampled)]
    res = sched.update_from_output(out, sampled)
    assert res.num_new_tokens.tolist() == [1, 1]
    assert sched.get_output_token_ids("b") == [7]
    sched.check_invariants()
