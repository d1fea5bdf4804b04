"""pytest-benchmark cases for one routing decision through ``kvsched.router`` at 16 replicas x 100k cached blocks.

The same cases as the Rust crate's criterion bench (``cargo bench -p kvsched-router --bench router``); the
difference between the two is the cost of the Python API. Each replica caches 100k blocks, the first quarter a
prefix shared by all; the prompt is 2,048 tokens (128 blocks) whose first 100 blocks one replica caches. A
decision is ``route`` then ``finish`` (so the load does not grow across rounds); the token case ranks a token
prompt, which the router hashes itself.

By default (``--benchmark-disable`` in pyproject's addopts) each case runs once, as a smoke test. To measure::

    pytest benches/test_bench_router.py --benchmark-enable
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import numpy as np
import pytest
from kvsched.router import POLICIES, BlockStored, Router, RouterConfig

REPLICAS = 16
BLOCKS_PER_REPLICA = 100_000
BLOCK_SIZE = 16
PROMPT_BLOCKS = 128


def _keys(replica: int, start: int, stop: int) -> np.ndarray:
    """Uniform 64-bit keys for a replica's blocks (splitmix64 of (replica, block)), like real block hashes."""
    x = np.arange(start, stop, dtype=np.uint64) + np.uint64(replica * 0x9E3779B97F4A7C15 % (1 << 64))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@functools.cache
def _fleet(policy: str) -> Router:
    router = Router(RouterConfig(policy=policy, block_size=BLOCK_SIZE, prefix_hash_seed="bench"))  # type: ignore[arg-type]
    shared = _keys(999, 0, BLOCKS_PER_REPLICA // 4)
    for r in range(REPLICAS):
        name = f"replica-{r}"
        router.add_replica(name)
        own = _keys(r, BLOCKS_PER_REPLICA // 4, BLOCKS_PER_REPLICA)
        router.apply_events(name, [BlockStored(shared, None, [], BLOCK_SIZE), BlockStored(own, None, [], BLOCK_SIZE)])
        router.update_load(
            name,
            num_waiting=r % 5,
            num_running=20 + r,
            num_waiting_tokens=500 * (r % 5),
            num_running_tokens=40_000,
            kv_usage=0.5,
        )
    return router


PROMPT_HASHES = np.concatenate([_keys(3, 25_000, 25_100), _keys(77, 0, PROMPT_BLOCKS - 100)])
PROMPT_TOKENS = (3 + np.arange(PROMPT_BLOCKS * BLOCK_SIZE, dtype=np.int64) * 7 % 32_000).astype(np.int64)


@pytest.mark.parametrize("policy", POLICIES)
def test_route_16_replicas_100k_blocks(benchmark: Any, policy: str) -> None:
    router = _fleet(policy)
    assert all(router.num_cached_blocks(f"replica-{r}") == BLOCKS_PER_REPLICA for r in range(REPLICAS))
    ids = (f"q{i}" for i in itertools.count())
    benchmark.group = "route 16 replicas x 100k blocks"

    def decide() -> Any:
        req = next(ids)
        d = router.route(req, block_hashes=PROMPT_HASHES)
        router.finish(req)
        return d

    d = benchmark(decide)
    assert d.num_prompt_blocks == PROMPT_BLOCKS
    if policy in ("cache_aware", "kv_overlap", "predictive"):
        assert (d.replica, d.num_overlap_blocks) == ("replica-3", 100)


def test_rank_a_token_prompt_16_replicas_100k_blocks(benchmark: Any) -> None:
    router = _fleet("kv_overlap")
    benchmark.group = "route 16 replicas x 100k blocks"
    ranked = benchmark(router.rank, PROMPT_TOKENS)
    assert len(ranked) == REPLICAS
