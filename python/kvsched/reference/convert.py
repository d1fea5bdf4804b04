"""Argument conversion: ints, token lists, ragged ``(values, indptr)`` inputs, encoder inputs and ids.

Mirrors ``rust/kvsched-py/src/convert.rs`` (the binding's side: the core itself takes typed values). Everything
is validated before any state changes; bools are never ints; a wrong type raises ``SchedulerTypeError``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._errors import InvalidOutputError, InvalidRequestError, SchedulerTypeError

_TOKEN_LIMIT = 2**31  # token ids live in [0, 2**31)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U32_LIMIT = 2**32  # block ids are u32 in the core


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _block_id(x: Any, name: str = "block_id", item: bool = False) -> int:
    """A block id argument (``item``: one of an iterable's): an int, not bool, within the int64 range and a
    u32. Whether the pool has that block is the scheduler's check (``_check_in_pool``)."""
    if isinstance(x, (bool, np.bool_)):
        raise SchedulerTypeError(f"{name} must hold ints, got bool" if item else f"{name} must be an int, got bool")
    if not _is_int(x):
        raise SchedulerTypeError(f"{name} must be an int, got {type(x).__name__}")
    b = int(x)
    if not _I64_MIN <= b <= _I64_MAX:
        raise InvalidRequestError(f"{name} is out of the int64 range: {b}")
    if not 0 <= b < _U32_LIMIT:
        raise InvalidRequestError(f"block id {b} is outside the KV cache pool")
    return b


def _block_ids(block_ids: Any) -> list[int]:
    """An iterable of block ids, each as :func:`_block_id` takes it."""
    try:
        items = list(block_ids)
    except TypeError:
        raise SchedulerTypeError(f"block_ids must be an iterable of int, got {type(block_ids).__name__}") from None
    return [_block_id(x, "block_ids", item=True) for x in items]


def _int_array(value: object, what: str, range_error: type[Exception] = InvalidRequestError) -> np.ndarray:
    """A 1-D int64 array from a list/tuple of ints or a 1-D integer numpy array; SchedulerTypeError else."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise SchedulerTypeError(f"{what} must be a 1-D integer array, got {value.dtype}[{value.shape}]")
        return value.astype(np.int64)
    if isinstance(value, (list, tuple)):
        if not all(_is_int(t) for t in value):
            raise SchedulerTypeError(f"{what} must hold ints")
        try:
            return np.array([int(t) for t in value], dtype=np.int64)
        except OverflowError:  # beyond int64: certainly out of range
            raise range_error(f"{what} holds an out-of-range token id") from None
    raise SchedulerTypeError(f"{what} must be a list of ints or a 1-D integer numpy array, got {type(value)}")


def _check_tokens(arr: np.ndarray, what: str, error: type[Exception]) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= _TOKEN_LIMIT):
        raise error(f"{what}: token ids must be in [0, 2**31)")


def _ragged(value: object, n: int, what: str) -> list[list[int]]:
    """Parse a ``(values, indptr)`` pair of 1-D integer arrays, or a list of ``n`` lists of ints."""
    if isinstance(value, tuple):
        if len(value) != 2 or not all(isinstance(v, np.ndarray) for v in value):
            raise SchedulerTypeError(f"{what}: a tuple must be (values, indptr), two 1-D integer arrays")
        values, indptr = (_int_array(v, what, InvalidOutputError) for v in value)
        if len(indptr) != n + 1 or indptr[0] != 0 or indptr[-1] != len(values) or np.any(np.diff(indptr) < 0):
            raise InvalidOutputError(f"{what}: indptr must have {n + 1} non-decreasing offsets from 0 to len")
        return [values[indptr[i] : indptr[i + 1]].tolist() for i in range(n)]
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidOutputError(f"{what} has {len(value)} entries, the step scheduled {n} requests")
        return [_int_array(entry, what, InvalidOutputError).tolist() for entry in value]
    raise SchedulerTypeError(f"{what} must be a (values, indptr) pair of arrays or a list of lists")


def _opt_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise SchedulerTypeError(f"{what} must be None or a str, got {type(value).__name__}")
    if value is not None and not _is_utf8(value):
        raise InvalidRequestError(f"{what} is not valid unicode (a lone surrogate)")
    return value


def _is_utf8(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def _encoder_inputs(x: object) -> list[tuple[int, int, int]]:
    """``encoder_inputs``: None, or a list/tuple of (start, num_tokens, hash) lists/tuples, or an (m, 3) int array."""
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise SchedulerTypeError(f"encoder_inputs must be a list of (start, num_tokens, hash), got {type(x).__name__}")
    out = []
    for i, item in enumerate(x):
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise SchedulerTypeError(f"encoder_inputs[{i}] must be a (start, num_tokens, hash) triple")
        if not all(_is_int(v) for v in item):
            raise SchedulerTypeError(f"encoder_inputs[{i}] must hold ints")
        start, size, h = (int(v) for v in item)
        if not (0 <= start < 2**31 and 0 <= size < 2**31):
            raise InvalidRequestError(f"encoder_inputs[{i}]: start and num_tokens must be in [0, 2**31)")
        if not 0 <= h < 2**64:
            raise InvalidRequestError(f"encoder_inputs[{i}]: hash must be in [0, 2**64)")
        out.append((start, size, h))
    return out


def _as_sequence(x: object, what: str) -> list[Any]:
    """An iterable argument as a list; a str, bytes or non-iterable is a SchedulerTypeError."""
    if isinstance(x, (str, bytes)):
        raise SchedulerTypeError(f"{what} must be an iterable of ids, not a single {type(x).__name__}")
    try:
        return list(x)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise SchedulerTypeError(f"{what} must be iterable, got {type(x).__name__}") from None


def _to_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:  # an int beyond the float range
        return math.inf


def _indptr(counts: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int32)
