"""The runner's CPU swap pool copies exactly the blocks a step's ``swap_out`` / ``swap_in`` pairs name, out first."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvsched.runner.attention import allocate_kv_cache  # noqa: E402
from kvsched.runner.swap import CpuKvPool  # noqa: E402


def _caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = allocate_kv_cache(
        num_layers=3,
        num_blocks=10,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    g = torch.Generator().manual_seed(0)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return caches


def test_swap_out_then_in_moves_exactly_the_named_blocks() -> None:
    dev = _caches()
    before = [(k.clone(), v.clone()) for k, v in dev]
    pool = CpuKvPool(dev, num_cpu_blocks=5)
    assert pool.caches[0][0].shape == (5, 4, 2, 8) and not pool.pin
    pool.execute(np.array([[3, 0], [7, 4], [1, 2]], np.int32), None)
    for (ck, cv), (k, v) in zip(pool.caches, before, strict=True):
        for gpu, cpu in ((3, 0), (7, 4), (1, 2)):
            assert torch.equal(ck[cpu], k[gpu]) and torch.equal(cv[cpu], v[gpu])
        assert not ck[1].any() and not ck[3].any()  # untouched CPU blocks
    # the device blocks are reused, then the swapped blocks come back into other device blocks
    for k, v in dev:
        k.zero_()
        v.zero_()
    pool.execute(None, np.array([[4, 9], [0, 5]], np.int32))
    for (k, v), (bk, bv) in zip(dev, before, strict=True):
        assert torch.equal(k[9], bk[7]) and torch.equal(v[5], bv[3])
        assert not k[[0, 1, 2, 3, 4, 6, 7, 8]].any()  # nothing else written


def test_swap_out_is_made_before_swap_in_in_one_step() -> None:
    """A CPU block released by a swap-in and reused by a swap-out of the same step: out reads first."""
    dev = _caches()
    pool = CpuKvPool(dev, num_cpu_blocks=2)
    pool.execute(np.array([[1, 0]], np.int32), None)
    old = dev[0][0][1].clone()
    new = dev[0][0][2].clone()
    pool.execute(np.array([[2, 1]], np.int32), np.array([[0, 6]], np.int32))
    assert torch.equal(dev[0][0][6], old) and torch.equal(pool.caches[0][0][1], new)
    pool.execute(np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32))  # nothing to do
