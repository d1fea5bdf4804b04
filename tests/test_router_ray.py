"""``kvsched.ray``: the Ray Serve request router, alone and in front of a local Serve deployment of ``kvsched.LLM``.

Needs Ray Serve (``pip install 'kvsched[ray]'``); skipped without it. The end-to-end case also needs torch and
transformers (for the tiny model) and starts a local Ray cluster (about a minute on two cores).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_rust

pytestmark = [pytest.mark.ray, requires_rust]

serve_router = pytest.importorskip("ray.serve.request_router", reason="needs Ray Serve (kvsched[ray])")


def _fake_replica(name: str) -> Any:
    from ray.serve._private.common import DeploymentID, ReplicaID

    class Replica:
        replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="llm"))

    return Replica()


def _pending(internal_id: str, payload: Any) -> Any:
    from ray.serve._private.common import RequestMetadata

    return serve_router.PendingRequest(
        args=[payload], kwargs={}, metadata=RequestMetadata(request_id=internal_id, internal_request_id=internal_id)
    )


def test_the_router_ranks_by_cached_prefix_and_tracks_requests_until_completed() -> None:
    from kvsched.ray import KvschedRequestRouter, prompt_of
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    async def scenario() -> None:
        rr = KvschedRequestRouter(DeploymentID(name="llm"), DeploymentHandleSource.UNKNOWN)
        rr.initialize_state(policy="cache_aware", block_size=4)
        a, b = _fake_replica("a"), _fake_replica("b")
        prefix = list(range(10, 30))
        first = await rr.choose_replicas([a, b], _pending("q0", {"prompt_token_ids": [*prefix, 1]}))
        assert [[r.replica_id.unique_id for r in rank] for rank in first] == [["a"], ["b"]]
        # The same prefix again follows the first request (its blocks are recorded on a).
        again = await rr.choose_replicas([a, b], _pending("q1", {"prompt_token_ids": [*prefix, 2]}))
        assert again[0][0].replica_id.unique_id == "a"
        assert rr.kv_router.in_flight("a") == ["q0", "q1"]
        # A cold prompt goes to the replica caching less.
        cold = await rr.choose_replicas([a, b], _pending("q2", {"prompt_token_ids": list(range(100, 120))}))
        assert cold[0][0].replica_id.unique_id == "b"
        rr.on_request_completed(a.replica_id, "q0")
        rr.on_request_completed(a.replica_id, "never-recorded")
        assert rr.kv_router.in_flight("a") == ["q1"]
        # Ray confirming another replica moves the request there.
        rr.on_request_routed(_pending("q1", {"prompt_token_ids": [*prefix, 2]}), b.replica_id, None)
        assert (rr.kv_router.in_flight("a"), rr.kv_router.in_flight("b")) == ([], ["q2", "q1"])
        # A replica that leaves the candidates' set stays known; one that dies is purged.
        rr.on_replica_actor_died(b.replica_id)
        assert rr.kv_router.replicas == ["a"] and rr.kv_router.num_in_flight == 0
        assert prompt_of(_pending("x", [5, 6, 7])).token_ids == [5, 6, 7]
        text = prompt_of(_pending("x", {"messages": [{"role": "user", "content": "hi"}]}))
        assert (text.token_ids, text.from_text) == (list(b"user:hi"), True)
        assert prompt_of(_pending("x", object())).token_ids is None
        assert prompt_of(_pending("x", {"prompt_token_ids": [1], "session_id": "s"})).session_id == "s"

    asyncio.run(scenario())


def test_a_serve_deployment_keeps_each_shared_prefix_on_one_replica(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import ray
    from kvsched.ray import KvschedRequestRouter, LLMServer
    from kvsched.ray.compare import shared_prefix_requests
    from kvsched.runner.testing import save_tiny_hf_model
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    save_tiny_hf_model(tmp_path, "llama", max_position_embeddings=1024)
    prompts = shared_prefix_requests(groups=3, prefix_len=128, suffix_len=8, num_requests=12, vocab=256, seed=1)
    groups = [tuple(p[:128]) for p in prompts]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        app = (
            serve.deployment(LLMServer, name="llm")
            .options(
                num_replicas=2,
                ray_actor_options={"num_cpus": 0.1},
                request_router_config=RequestRouterConfig(
                    request_router_class=KvschedRequestRouter,
                    request_router_kwargs={"policy": "cache_aware", "block_size": 16},
                ),
            )
            .bind(str(tmp_path), device="cpu", seed=0, block_size=16, num_blocks=64)
        )
        handle = serve.run(app, name="router-test", route_prefix=None)
        replies = [handle.remote({"prompt_token_ids": p, "max_tokens": 2}).result(timeout_s=120) for p in prompts]
        serve.delete("router-test")
    finally:
        ray.shutdown()
    assert all(r["finish_reason"] in ("length", "stop") and r["output_token_ids"] for r in replies), replies
    where: dict[tuple[int, ...], set[str]] = defaultdict(set)
    for g, r in zip(groups, replies, strict=True):
        where[g].add(r["replica"])
    assert all(len(reps) == 1 for reps in where.values()), where
    assert len({rep for reps in where.values() for rep in reps}) == 2, "the groups spread over both replicas"
    # Every request after its group's first hits its 8 cached prefix blocks: 128 of its 136 prompt tokens.
    last: dict[str, tuple[int, int]] = {}
    for r in replies:
        last[r["replica"]] = (r["prefix_cache_queries"], r["prefix_cache_hits"])
    hits = sum(h for _, h in last.values())
    assert hits == 128 * (len(prompts) - len(where))
