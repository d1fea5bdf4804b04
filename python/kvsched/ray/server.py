"""A :class:`kvsched.LLM` as a Ray Serve deployment: requests come in on an asyncio loop, one thread runs the engine.

``LLM`` is a synchronous engine; the deployment keeps it on a single engine thread that adds the requests that
arrived, runs a step, and hands finished requests back to the callers' loop. A request is a dict
``{"prompt_token_ids": [...], "max_tokens": n}`` (optionally ``"session_id"``, read by the request router); the
answer is a dict with the output token ids, the finish reason and ``ttft_s``: seconds from the request reaching
the replica to its first token (waiting for the engine thread included). ``stats()`` returns the scheduler's
counters (the prefix cache's queries and hits among them); ``record_routing_stats()`` is Ray's hook for
replica-reported routing stats and returns the load of the last step.

Inside Serve the replica publishes its scheduler's KV cache events (``publish_kv_events=True``, the default): it
runs the scheduler with ``enable_kv_cache_events`` and, with no ``prefix_hash_seed`` given, the deployment's
:func:`~kvsched.ray.events.default_hash_seed` (the one :class:`~kvsched.ray.KvschedRequestRouter` uses), and after
every step that changed its prefix cache sends the step's events to its :class:`~kvsched.ray.events.KvEventLog`,
which the request routers read. A request with ``"return_cached_block_keys": True`` also gets, in its answer, the
router keys of every hash the replica's prefix cache holds when it finishes (a diagnostic: it walks the pool).

.. code-block:: python

    from ray import serve
    from kvsched.ray import KvschedRequestRouter, LLMServer

    app = serve.deployment(LLMServer, num_replicas=3).options(
        request_router_config={"request_router_class": KvschedRequestRouter},
    ).bind("path/to/model", device="cpu")
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
import uuid
from typing import Any

from ..router import block_key
from .events import SERVE_NAMESPACE, KvEventLog, default_hash_seed, log_name

__all__ = ["LLMServer"]


def _replica_id() -> Any:
    """This replica's ``ReplicaID`` in Serve (its ``unique_id`` is what the request router names it by), or None
    outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id
    except Exception:  # not inside a Serve replica
        return None


class LLMServer:
    """Serves :class:`kvsched.LLM` (``model`` and ``llm_kwargs`` as ``LLM`` takes them). ``num_threads`` caps
    torch's intra-op threads (replicas sharing a machine should not each take all its cores; None leaves it).
    ``publish_kv_events``: publish the scheduler's KV cache events for the request routers (inside Serve)."""

    def __init__(
        self, model: Any, *, num_threads: int | None = 1, publish_kv_events: bool = True, **llm_kwargs: Any
    ) -> None:
        import torch

        from ..engine import LLM

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        replica_id = _replica_id()
        publish = publish_kv_events and replica_id is not None
        if publish:
            llm_kwargs.setdefault("enable_kv_cache_events", True)
            deployment = replica_id.deployment_id
            llm_kwargs.setdefault("prefix_hash_seed", default_hash_seed(deployment.app_name, deployment.name))
        self._llm = LLM(model, **llm_kwargs)
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._load: dict[str, Any] = {"num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
        self._replica = None if replica_id is None else replica_id.unique_id
        self._kv_log: Any = None
        self._kv_seq = 0
        if publish and self._llm.scheduler.config.enable_kv_cache_events:
            import ray

            # Owned by this replica: the log dies with it.
            self._kv_log = (
                ray.remote(KvEventLog)
                .options(name=log_name(replica_id.to_full_id_str()), namespace=SERVE_NAMESPACE, num_cpus=0)
                .remote(self._llm.scheduler.config.kv_block_size)
            )
        self._thread = threading.Thread(target=self._run, name="kvsched-engine", daemon=True)
        self._thread.start()

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        from ..engine import SamplingParams

        received = time.monotonic()
        params = SamplingParams(max_tokens=int(request.get("max_tokens", 16)), temperature=0.0)
        keys = bool(request.get("return_cached_block_keys", False))
        out, (queries, hits), cached = await self._submit("generate", list(request["prompt_token_ids"]), params, keys)
        first = out.metrics.first_token_time
        answer = {
            "output_token_ids": list(out.output_token_ids),
            "finish_reason": out.finish_reason,
            "error": out.error,
            "ttft_s": None if first is None else first - received,
            "replica": self._replica,
            # The replica's prefix-cache counters (tokens) when this request finished.
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
        }
        if keys:
            answer["cached_block_keys"] = cached
        return answer

    async def stats(self) -> dict[str, Any]:
        """The scheduler's counters (``SchedulerStats`` as a dict)."""
        result: dict[str, Any] = await self._submit("stats")
        return result

    def record_routing_stats(self) -> dict[str, Any]:
        return dict(self._load)

    async def _submit(self, kind: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._inbox.put((kind, args, loop, fut))
        return await fut

    @staticmethod
    def _resolve(
        loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any, exc: BaseException | None
    ) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        llm = self._llm
        waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool]] = {}
        while True:
            block = not llm.has_unfinished_requests()
            while True:
                try:
                    kind, args, loop, fut = self._inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if kind == "stats":
                    self._resolve(loop, fut, dataclasses.asdict(llm.scheduler.stats()), None)
                    continue
                req_id = uuid.uuid4().hex
                try:
                    llm.add_request(args[0], args[1], request_id=req_id)
                except Exception as exc:
                    self._resolve(loop, fut, None, exc)
                    continue
                waiting[req_id] = (loop, fut, args[2])
            if not llm.has_unfinished_requests():
                continue
            finished = llm.step()
            self._publish_kv_events()
            s = llm.scheduler.stats()
            self._load = {
                "num_waiting": s.num_waiting_reqs,
                "num_running": s.num_running_reqs,
                "kv_usage": s.kv_cache_usage,
            }
            for out in finished:
                loop, fut, keys = waiting.pop(out.request_id)
                cached = sorted({block_key(h) for h in llm.scheduler.cached_block_hashes()}) if keys else None
                self._resolve(loop, fut, (out, (s.prefix_cache_queries, s.prefix_cache_hits), cached), None)

    def _publish_kv_events(self) -> None:
        """Sends the step's KV cache events, if any, to this replica's log (in order: one sender, numbered)."""
        if self._kv_log is None:
            return
        events = self._llm.scheduler.take_kv_cache_events()
        if len(events):
            self._kv_log.publish.remote(self._kv_seq, events)
            self._kv_seq += 1
