"""``kvsched._core.vllm_sha256_block_hashes`` is vLLM's default block hash: the SHA-256 of
``pickle.dumps((parent, tuple(block), None), protocol=5)``, chained over the full blocks (no vLLM needed)."""

from __future__ import annotations

import hashlib
import pickle

import kvsched
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
