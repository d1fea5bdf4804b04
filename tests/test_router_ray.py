"""``kvsched.ray``: the Ray Serve request router, alone and in front of a local Serve deployment of ``kvsched.LLM``.

Needs Ray Serve (``pip install '.[ray]'``); skipped without it. The end-to-end case also needs torch and
transformers (for the tiny model) and starts a local Ray cluster (about a minute on two cores).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
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
        rr.initialize_state(policy="cache_aware", block_size=4, kv_events=False)  # tracks what it routed
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


@pytest.mark.parametrize("isolate", [False, True])
def test_the_router_passes_the_tenant_so_isolated_tenants_never_follow_each_others_prefixes(isolate: bool) -> None:
    """With ``isolate_tenant_cache`` the Ray router hashes each prompt with the request's tenant (a field, or
    kvsched's key in ``vllm_xargs``, flat or in its ``"kvsched"`` mapping), as isolating replicas do: a tenant
    follows its own cached prefix, never another tenant's. Without isolation every tenant follows it."""
    from kvsched.ray import KvschedRequestRouter
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    prefix = list(range(10, 30))

    async def scenario() -> list[str]:
        rr = KvschedRequestRouter(DeploymentID(name="llm"), DeploymentHandleSource.UNKNOWN)
        rr.initialize_state(policy="cache_aware", block_size=4, kv_events=False, isolate_tenant_cache=isolate)
        a, b = _fake_replica("a"), _fake_replica("b")
        chosen = []
        for i, payload in enumerate(
            [
                {"prompt_token_ids": [*prefix, 1], "tenant": "team-a"},
                {"prompt_token_ids": [*prefix, 2], "vllm_xargs": {"tenant": "team-b"}},
                {"prompt_token_ids": [*prefix, 3], "vllm_xargs": {"kvsched": {"tenant": "team-a"}}},
            ]
        ):
            ranked = await rr.choose_replicas([a, b], _pending(f"q{i}", payload))
            chosen.append(ranked[0][0].replica_id.unique_id)
        overlaps = rr.kv_router.overlaps(prefix, tenant="team-b")
        assert overlaps == ({"a": 0, "b": len(prefix) // 4} if isolate else {"a": len(prefix) // 4, "b": 0})
        return chosen

    # team-a's prompt goes to a (a tie), and its blocks are recorded there. team-b's shares the prefix: without
    # isolation it follows it to a; isolated it sees nothing cached and goes to b, the idler replica. team-a's
    # next prompt follows team-a's own prefix to a either way.
    assert asyncio.run(scenario()) == (["a", "b", "a"] if isolate else ["a", "a", "a"])


def test_the_router_reads_the_tenant_and_cache_salt_of_a_request() -> None:
    from kvsched.ray import prompt_of

    async def scenario() -> None:  # a PendingRequest needs a running loop
        routed = prompt_of(_pending("x", {"prompt_token_ids": [1], "vllm_xargs": {"tenant": "t"}, "cache_salt": "s"}))
        assert (routed.tenant, routed.cache_salt) == ("t", "s")
        assert prompt_of(_pending("x", {"prompt": "hi", "extra_args": {"kvsched": {"tenant": "u"}}})).tenant == "u"
        assert prompt_of(_pending("x", {"prompt": "hi", "tenant": "v", "vllm_xargs": {"tenant": "w"}})).tenant == "v"
        assert prompt_of(_pending("x", [5, 6, 7])).tenant is None
        assert prompt_of(_pending("x", {"prompt_token_ids": [1]})).cache_salt is None

    asyncio.run(scenario())


class _InProcessLog:
    """A :class:`kvsched.ray.events.KvEventLog` called in process, with a Ray actor handle's ``.remote`` shape."""

    def __init__(self, log: Any) -> None:
        self.log = log

        class Method:
            def __init__(self, fn: Any) -> None:
                self.fn = fn

            def remote(self, *args: Any) -> Any:
                async def call() -> Any:
                    return self.fn(*args)

                return call()

        self.pull, self.publish = Method(log.pull), Method(log.publish)


def _router_view(router: Any, replica: str, keys: set[int]) -> bool:
    """Whether the router's index of ``replica`` holds exactly ``keys``."""
    if router.num_cached_blocks(replica) != len(keys):
        return False
    return all(router.overlaps(block_hashes=[k])[replica] == 1 for k in keys)


def test_the_router_pulls_each_replicas_published_events_and_sees_evictions(caplog: Any) -> None:
    """Two kvsched schedulers publish their KV cache events to logs (in process here, Ray actors in a deployment);
    the Ray request router pulls them before each ranking, so a shared prefix goes where it is cached, and after
    evictions the router's view of each replica is exactly its cached hashes. A router that starts late, or falls
    behind the log's window, starts from the log's set of hashes. A replica hashing with another seed is named
    in a warning."""
    from kvsched import Scheduler
    from kvsched.ray import KvschedRequestRouter
    from kvsched.ray.events import KvEventLog, default_hash_seed
    from kvsched.router import block_key
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    deployment = DeploymentID(name="llm")
    seed = default_hash_seed(deployment.app_name, deployment.name)  # what the deployment's replicas use

    def replica(seed: str = seed) -> Any:
        return Scheduler(block_size=4, num_blocks=12, max_model_len=40, prefix_hash_seed=seed,
                         enable_kv_cache_events=True)  # fmt: skip

    async def scenario() -> None:
        rr = KvschedRequestRouter(deployment, DeploymentHandleSource.UNKNOWN)
        rr.initialize_state(policy="cache_aware", block_size=4)
        a, b = _fake_replica("a"), _fake_replica("b")
        scheds = {"a": replica(), "b": replica()}
        logs = {name: KvEventLog(block_size=4, max_batches=3) for name in scheds}
        seqs = dict.fromkeys(scheds, 0)
        rr._sync_adding({"a": a.replica_id, "b": b.replica_id})
        for name in scheds:  # what the subscriber would look up by name in a cluster
            rr._kv_events._sources[name].handle = _InProcessLog(logs[name])

        def run(name: str, req: str, prompt: list[int]) -> None:
            s = scheds[name]
            s.add_request(req, prompt, max_tokens=1)
            while s.has_unfinished_requests():
                out = s.schedule()
                s.update_from_output(out, [[1] for _ in out.req_ids])
                events = s.take_kv_cache_events()
                if len(events):
                    logs[name].publish(seqs[name], events)
                    seqs[name] += 1

        prefix = list(range(10, 26))  # 4 blocks
        first = await rr.choose_replicas([a, b], _pending("q0", {"prompt_token_ids": [*prefix, 1]}))
        where = first[0][0].replica_id.unique_id
        run(where, "q0", [*prefix, 1])
        rr.on_request_completed(first[0][0].replica_id, "q0")
        again = await rr.choose_replicas([a, b], _pending("q1", {"prompt_token_ids": [*prefix, 2]}))
        assert again[0][0].replica_id.unique_id == where  # it learned the blocks from the events
        run(where, "q1", [*prefix, 2])
        rr.on_request_completed(again[0][0].replica_id, "q1")
        # Fill the replica with other prompts: its prefix blocks are evicted, and the router sees it.
        for k in range(3):
            run(where, f"fill{k}", list(range(100 + 40 * k, 100 + 40 * k + 30)))
        await rr.pull_kv_events()
        for name, s in scheds.items():
            truth = {block_key(h) for h in s.cached_block_hashes()}
            assert _router_view(rr.kv_router, name, truth), name
        assert rr.kv_router.overlaps([*prefix, 3])[where] < 4
        # A router that starts now reads the logs' sets (the first batches left the 3-batch window).
        late = KvschedRequestRouter(deployment, DeploymentHandleSource.UNKNOWN)
        late.initialize_state(policy="cache_aware", block_size=4)
        late._sync_adding({"a": a.replica_id, "b": b.replica_id})
        for name in scheds:
            late._kv_events._sources[name].handle = _InProcessLog(logs[name])
        await late.pull_kv_events()
        for name, s in scheds.items():
            assert _router_view(late.kv_router, name, {block_key(h) for h in s.cached_block_hashes()}), name
        # A replica with another hash seed: its first stored run does not hash like the router's.
        scheds["b"] = replica(seed="other")
        run("b", "odd", list(range(300, 310)))
        with caplog.at_level("WARNING", logger="kvsched"):
            await rr.pull_kv_events()
        assert any("hashes its blocks differently" in r.getMessage() for r in caplog.records)

    asyncio.run(scenario())


def test_a_serve_deployment_keeps_each_shared_prefix_on_one_replica(tmp_path: Path) -> None:
    """Two replicas of LLMServer behind KvschedRequestRouter fed by their published KV cache events: each shared
    prefix stays on one replica and hits there, and after long prompts evict cached prefixes the router's view of
    each replica is exactly the hashes that replica caches."""
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

        def ask(p: list[int]) -> dict[str, Any]:
            request = {"prompt_token_ids": p, "max_tokens": 2, "return_cached_block_keys": True}
            reply: dict[str, Any] = handle.remote(request).result(timeout_s=120)
            return reply

        replies = [ask(p) for p in prompts]
        # Long prompts of their own evict cached prefixes on both replicas (64 blocks each).
        rng = np.random.default_rng(5)
        fills = [ask([int(t) for t in rng.integers(3, 250, 400)]) for _ in range(6)]
        # The router in this process (Ray's handle internals): after one more pull its view of each replica is
        # that replica's cached hashes as its last reply gave them (requests ran one at a time: nothing changed
        # since). Publishing is asynchronous, so the pull is retried for a while.
        rr = handle._router._asyncio_router.request_router
        truth: dict[str, set[int]] = {r["replica"]: set(r["cached_block_keys"]) for r in [*replies, *fills]}
        for _ in range(50):
            asyncio.run_coroutine_threadsafe(rr.pull_kv_events(), rr._event_loop).result(timeout=30)
            same = all(_router_view(rr.kv_router, rep, keys) for rep, keys in truth.items())
            if same:
                break
            time.sleep(0.2)
        views = {rep: (rr.kv_router.num_cached_blocks(rep), len(keys)) for rep, keys in truth.items()}
        serve.delete("router-test")
    finally:
        ray.shutdown()
    assert len(truth) == 2 and same, f"the router's view / the replica's cache, in blocks: {views}"
    seen = set().union(*(r["cached_block_keys"] for r in replies))
    assert seen - set().union(*truth.values()), "the long prompts evicted some cached prefix blocks"
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
