"""Ray Serve's default router against kvsched's, on a shared-prefix workload: prefix hit rate and TTFT.

Starts a local Ray cluster, and for each router deploys ``--replicas`` replicas of :class:`kvsched.ray.LLMServer`
(a :class:`kvsched.LLM` on the CPU) and sends the same requests through a deployment handle: each request is one
of ``--groups`` shared prefixes (a system prompt of ``--prefix-len`` tokens) followed by ``--suffix-len`` tokens
of its own, from ``--concurrency`` clients in a closed loop. ``--num-blocks`` sizes each replica's KV cache; keep it
below what every prefix needs together, as a real cache is, so that where a request lands decides whether its
prefix is still cached there.

Reported per router: the prefix cache hit rate (prompt tokens served from the replicas' prefix caches, over all
prompt tokens, from the replicas' own counters), the mean, median and p95 time to first token measured on the
replica (from the request reaching it to its first token), the mean latency the client saw, and how many requests
each replica got. ``pow2`` is Ray Serve's default (power of two choices); the others are
:class:`kvsched.ray.KvschedRequestRouter` with that :mod:`kvsched.router` policy, fed by the replicas' KV cache
events, or, named ``POLICY:routed``, by the prompts it routed (``kv_events=False``: evictions unseen), or, named
``POLICY:both``, by both (each routed prompt counts as cached at once, the events correct it).

    python -m kvsched.runner.testing tiny-model --max-position-embeddings 2048
    python -m kvsched.ray.compare --model tiny-model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from ..config import DEFAULT_BLOCK_SIZE
from ..router import POLICIES
from ..sim.steptime import load_step_time_model

__all__ = ["RouterResult", "main", "run_comparison", "shared_prefix_requests"]

ROUTERS = ("pow2", *POLICIES, *(f"{p}:{feed}" for feed in ("routed", "both") for p in POLICIES))


@dataclass(frozen=True)
class RouterResult:
    router: str
    num_requests: int
    prefix_hit_rate: float
    mean_ttft_s: float
    median_ttft_s: float
    p95_ttft_s: float
    mean_latency_s: float
    requests_per_replica: list[int]
    wall_s: float


def shared_prefix_requests(
    *, groups: int, prefix_len: int, suffix_len: int, num_requests: int, vocab: int, seed: int
) -> list[list[int]]:
    """``num_requests`` prompts, each one of ``groups`` random prefixes (chosen uniformly) plus its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(groups)]
    return [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(num_requests)]


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


async def _drive(handle: Any, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in prompts]
    todo = iter(range(len(prompts)))

    async def client() -> None:
        for i in todo:
            t0 = time.perf_counter()
            r = await handle.remote({"prompt_token_ids": prompts[i], "max_tokens": max_tokens})
            r["latency_s"] = time.perf_counter() - t0
            results[i] = r

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def _counters(results: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """The latest (queries, hits) each replica reported (counters only grow)."""
    latest: dict[str, tuple[int, int]] = {}
    for r in results:
        q, h = r["prefix_cache_queries"], r["prefix_cache_hits"]
        if r["replica"] not in latest or q > latest[r["replica"]][0]:
            latest[r["replica"]] = (q, h)
    return latest


def run_router(router: str, args: argparse.Namespace, prompts: list[list[int]]) -> RouterResult:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .request_router import KvschedRequestRouter
    from .server import LLMServer

    options: dict[str, Any] = {
        "num_replicas": args.replicas,
        "max_ongoing_requests": max(8, args.concurrency),
        "ray_actor_options": {"num_cpus": 0.1},
    }
    policy, _, feed = router.partition(":")
    kv_events = router != "pow2" and feed != "routed"
    if router != "pow2":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=KvschedRequestRouter,
            request_router_kwargs={
                "policy": policy,
                "kv_events": kv_events,
                "record_routed_prefixes": feed != "",
                "block_size": args.block_size,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                **({"step_time": args.step_time.to_dict()} if args.step_time is not None else {}),
            },
        )
    app = (
        serve.deployment(LLMServer, name="llm")
        .options(**options)
        .bind(
            args.model,
            device="cpu",
            seed=0,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens,
            publish_kv_events=kv_events,
        )
    )
    app_name = f"routing-{router.replace(':', '-')}"
    handle = serve.run(app, name=app_name, route_prefix=None)
    # Warm every replica up (torch's first passes) with prompts shorter than a block: nothing enters the caches.
    warm = [[5 + i] * (args.block_size // 2) for i in range(4 * args.replicas)]
    baseline = _counters(asyncio.run(_drive(handle, warm, 2, args.replicas)))
    t0 = time.perf_counter()
    results = asyncio.run(_drive(handle, prompts, args.max_tokens, args.concurrency))
    wall = time.perf_counter() - t0
    serve.delete(app_name)
    bad = [r for r in results if r.get("finish_reason") not in ("length", "stop")]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed under {router}: {bad[0]}")
    final = _counters(results)
    queries = sum(q - baseline.get(rep, (0, 0))[0] for rep, (q, _) in final.items())
    hits = sum(h - baseline.get(rep, (0, 0))[1] for rep, (_, h) in final.items())
    ttfts = [r["ttft_s"] for r in results]
    per_replica = Counter(r["replica"] for r in results)
    return RouterResult(
        router=router,
        num_requests=len(results),
        prefix_hit_rate=hits / queries if queries else 0.0,
        mean_ttft_s=statistics.fmean(ttfts),
        median_ttft_s=statistics.median(ttfts),
        p95_ttft_s=_p95(ttfts),
        mean_latency_s=statistics.fmean(r["latency_s"] for r in results),
        requests_per_replica=sorted(per_replica.values(), reverse=True),
        wall_s=wall,
    )


def run_comparison(args: argparse.Namespace) -> list[RouterResult]:
    import ray

    from ..runner.config import ModelConfig

    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    prompts = shared_prefix_requests(
        groups=args.groups,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        num_requests=args.requests,
        vocab=vocab,
        seed=args.seed,
    )
    ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    try:
        return [run_router(r, args, prompts) for r in args.routers]
    finally:
        ray.shutdown()


def table(results: list[RouterResult]) -> str:
    lines = [
        "| router | prefix hit rate | mean TTFT (ms) | median TTFT (ms) | p95 TTFT (ms) | mean latency (ms) | "
        "requests per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.router} | {r.prefix_hit_rate:.1%} | {r.mean_ttft_s * 1e3:.0f} | {r.median_ttft_s * 1e3:.0f} | "
            f"{r.p95_ttft_s * 1e3:.0f} | {r.mean_latency_s * 1e3:.0f} | "
            f"{' / '.join(map(str, r.requests_per_replica))} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvsched.ray.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model directory (python -m kvsched.runner.testing DIR)")
    p.add_argument("--routers", default="pow2,cache_aware", help=f"comma-separated, of {', '.join(ROUTERS)}")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--groups", type=int, default=6, help="distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=6, help="clients in the closed loop")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--num-blocks", type=int, default=96, help="KV cache blocks per replica")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the local Ray cluster")
    p.add_argument(
        "--step-time",
        help="the predictive policy's step-time model: a preset or a JSON file from kvsched simulate --calibrate "
        "(default: the default preset)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    args.step_time = None if args.step_time is None else load_step_time_model(args.step_time)
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown router(s) {', '.join(unknown)}; choose from {', '.join(ROUTERS)}")
    results = run_comparison(args)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            params = {**vars(args), "step_time": None if args.step_time is None else args.step_time.to_dict()}
            json.dump({"args": params, "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
