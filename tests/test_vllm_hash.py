"""``kvsched._core.vllm_sha256_block_hashes`` is vLLM's default block hash: the SHA-256 of
``pickle.dumps((parent, tuple(block), None), protocol=5)``, chained over the full blocks (no vLLM needed)."""

from __future__ import annotations

import hashlib
import pickle

import kvsched
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvsched._core import vllm_sha256_block_hashes


def _python_chain(parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # the CI machine is shared
@given(
    parent=st.binary(min_size=1, max_size=255),
    tokens=st.lists(
        st.one_of(st.integers(0, 300), st.integers(0, 70_000), st.integers(-(2**63), 2**63 - 1)), max_size=70
    ),
    block_size=st.integers(1, 17),
)
def test_hashes_equal_sha256_of_the_pickled_block(parent: bytes, tokens: list[int], block_size: int) -> None:
    assert vllm_sha256_block_hashes(parent, tokens, block_size) == _python_chain(parent, tokens, block_size)


def test_a_partial_block_is_left_out_and_arrays_work() -> None:
    import numpy as np

    parent = hashlib.sha256(b"p").digest()
    assert vllm_sha256_block_hashes(parent, [1, 2, 3], 4) == []
    arr = np.arange(100, 110, dtype=np.int32)
    assert vllm_sha256_block_hashes(parent, arr, 4) == _python_chain(parent, arr.tolist(), 4)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((b"p", [1], 0), kvsched.InvalidRequestError),
        ((b"p", [1], -1), kvsched.InvalidRequestError),
        ((b"p", [1], 4097), kvsched.InvalidRequestError),
        ((b"", [1], 1), kvsched.InvalidRequestError),
        ((b"p" * 256, [1], 1), kvsched.InvalidRequestError),
        ((b"p", [2**64], 1), kvsched.InvalidRequestError),
        (("p", [1], 1), kvsched.SchedulerTypeError),
        ((b"p", "ab", 1), kvsched.SchedulerTypeError),
        ((b"p", [1.5], 1), kvsched.SchedulerTypeError),
        ((b"p", [1], True), kvsched.SchedulerTypeError),
    ],
)
def test_bad_arguments_raise_typed_errors(args: tuple[object, object, object], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        vllm_sha256_block_hashes(*args)  # type: ignore[arg-type]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # the CI machine is shared
@given(
    chains=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2**40), max_size=40)), min_size=0, max_size=6),
    block_size=st.integers(1, 9),
)
def test_batched_hashes_extend_each_list_as_the_single_call_does(
    chains: list[tuple[int, list[int]]], block_size: int
) -> None:
    """Each list gains exactly the hashes ``vllm_sha256_block_hashes`` gives for the blocks past those it holds;
    the empty ones are left alone and reported."""
    seed = hashlib.sha256(b"seed").digest()
    hash_lists: list[list[bytes]] = []
    token_lists: list[list[int]] = []
    want: list[list[bytes]] = []
    for num_hashed, tokens in chains:
        num_hashed = min(num_hashed, len(tokens) // block_size)
        full = _python_chain(seed, tokens, block_size)
        hash_lists.append(full[:num_hashed])
        token_lists.append(tokens)
        want.append(full if num_hashed else [])
    skipped = kvsched._core.vllm_sha256_extend_block_hashes(hash_lists, token_lists, block_size)
    assert hash_lists == want
    assert skipped == [i for i, (n, t) in enumerate(chains) if min(n, len(t) // block_size) == 0]


@pytest.mark.parametrize(
    ("hash_lists", "token_lists", "block_size", "exc"),
    [
        ([[b"p"]], [[1, 2]], 0, kvsched.InvalidRequestError),
        ([[b"p"]], [], 1, kvsched.InvalidRequestError),
        ([[b"p"]], [[1, 2]], True, kvsched.SchedulerTypeError),
        ([(b"p",)], [[1, 2]], 1, kvsched.SchedulerTypeError),
        ([["p"]], [[1, 2]], 1, kvsched.SchedulerTypeError),
        ([[b"p"], [b"p"]], [[1, 2, 3], [1, 2, 1.5]], 1, kvsched.SchedulerTypeError),
        ([[b"p"], [b"p"]], [[1, 2, 3], [1, 2**64]], 1, kvsched.InvalidRequestError),
        ([[b"p"], [b""]], [[1, 2], [1, 2]], 1, kvsched.InvalidRequestError),
    ],
)
def test_batched_hashes_bad_arguments_raise_and_change_nothing(
    hash_lists: list[list[object]], token_lists: list[list[object]], block_size: object, exc: type[Exception]
) -> None:
    before = [list(h) for h in hash_lists]
    with pytest.raises(exc):
        kvsched._core.vllm_sha256_extend_block_hashes(hash_lists, token_lists, block_size)  # type: ignore[arg-type]
    assert [list(h) for h in hash_lists] == before


def test_rows_extend_both_lists_or_nothing() -> None:
    extend = kvsched._core.extend_lists_by_rows
    first, second = [[1], [], [2, 3]], [[9, 1], [], [9, 2, 3]]
    assert extend(first, second, [[4], [5, 6], []])
    assert first == [[1, 4], [5, 6], [2, 3]]
    assert second == [[9, 1, 4], [5, 6], [9, 2, 3]]
    for rows in ([[7], (8,), [9]], [[7], [8]], ([7], [8], [9]), [[7], [8], None]):
        assert not extend(first, second, rows)  # type: ignore[arg-type]
    assert not extend(first, [[], [], ()], [[7], [8], [9]])  # type: ignore[list-item]

    class Sub(list):  # type: ignore[type-arg]
        pass

    assert not extend(first, second, [[7], Sub([8]), [9]])  # a list subclass: the caller's own way
    assert not extend([[1], Sub(), [2, 3]], second, [[7], [8], [9]])
    assert first == [[1, 4], [5, 6], [2, 3]]
    assert second == [[9, 1, 4], [5, 6], [9, 2, 3]]
    # A list that is also a row: its length is read before anything is appended to it.
    a = [5]
    outer, other = [a], [[]]
    assert extend(outer, other, [a])
    assert a == [5, 5] and other == [[5]]


def test_int_list_is_tolist() -> None:
    int_list = kvsched._core.int_list
    big = 1 << 17
    values = np.array([0, 1, 7, 300, 70_000, big - 1, big, big + 5, -1, -(2**31), 2**31 - 1], dtype=np.int32)
    got = int_list(values)
    assert type(got) is list and got == values.tolist()
    assert all(type(v) is int for v in got)
    # The ints of small values are shared between calls; the others are fresh.
    again = int_list(values.copy())
    assert again == got and again[3] is got[3] and again[4] is got[4]
    assert int_list(np.array([], dtype=np.int32)) == []
    # Other arrays: their own tolist().
    for other in (np.array([1, 2**40], dtype=np.int64), np.array([[1, 2]], dtype=np.int32), np.arange(4)[::2]):
        assert int_list(other) == other.tolist()
    sliced = np.arange(10, dtype=np.int32)[::3]
    assert int_list(sliced) == [0, 3, 6, 9]
