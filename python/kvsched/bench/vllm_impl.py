"""``--impl vllm`` and ``--impl vllm-adapter``: replay a trace through vLLM 0.33's own v1 ``Scheduler``, or through
``kvsched.vllm.Scheduler`` (kvsched's core behind vLLM's scheduler interface), with vLLM's own request, output and
model-runner-output objects (optional; needs ``vllm`` importable). ``vllm-async`` and ``vllm-adapter-async`` are
the same with asynchronous scheduling on (vLLM's ``AsyncScheduler``; kvsched.vllm with ``async_scheduling``): the
bench loop still applies each step before scheduling the next, so both schedule the same steps as without it,
with the output placeholders and in-flight bookkeeping of asynchronous scheduling.

No model and no GPU: :mod:`kvsched.vllm.testing` builds the scheduler the way vLLM's engine core does, on a tiny
Llama ``config.json`` (no weights, no tokenizer) and a hand-built ``KVCacheConfig`` with one full-attention group
of ``num_blocks`` blocks; requests get the SHA-256 block hasher vLLM's engine core attaches.

Only ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` are timed. Building vLLM ``Request``
objects (in ``add``), reading the scheduled ids/counts out of vLLM's ``SchedulerOutput`` and building its
``ModelRunnerOutput`` from the fake model's tokens all happen outside the timed region.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.config import SchedulerConfig

from .driver import Counters, ImplUnavailableError
from .workloads import TraceRequest

__all__ = ["VllmDriver"]


class VllmDriver:
    """Drives vLLM's own v1 ``Scheduler`` (``impl="vllm"``) or ``kvsched.vllm.Scheduler`` (``impl="vllm-adapter"``,
    kvsched's core behind vLLM's scheduler interface, with vLLM's request and output objects) through the
    benchmark loop."""

    def __init__(self, config: SchedulerConfig, impl: str = "vllm") -> None:
        if impl not in ("vllm", "vllm-adapter", "vllm-async", "vllm-adapter-async"):
            raise ValueError(f"impl must be vllm, vllm-adapter, vllm-async or vllm-adapter-async, got {impl!r}")
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            from vllm.sampling_params import SamplingParams
            from vllm.v1.outputs import ModelRunnerOutput
            from vllm.v1.request import Request

            from kvsched.vllm.testing import make_scheduler, make_vllm_config, request_block_hasher
        except ImportError as exc:
            raise ImplUnavailableError(f"vllm is not importable here ({exc}); it is optional") from exc

        self.impl = impl
        self._config = config
        self._Request = Request
        self._SamplingParams = SamplingParams
        self._ModelRunnerOutput = ModelRunnerOutput
        self._preemptions = 0
        self._prefix = Counters()
        vllm_config = make_vllm_config(
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.policy,
            scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
            watermark=config.watermark,
            async_scheduling=impl.endswith("-async"),
        )
        kind = "kvsched" if impl.startswith("vllm-adapter") else "vllm"
        self._sched = make_scheduler(kind, vllm_config, log_stats=True)
        self._block_hasher: Callable[[Any], Any] | None = (
            request_block_hasher(config.block_size) if config.enable_prefix_caching else None
        )

    # ---- Driver protocol --------------------------------------------------------------------------------

    def add(self, req: TraceRequest, rid: str) -> None:
        params = self._SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        request = self._Request(
            request_id=rid,
            prompt_token_ids=req.prompt_token_ids.tolist(),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(req.arrival_step),
            priority=req.priority,
            block_hasher=self._block_hasher,
        )
        self._sched.add_request(request)

    def schedule_fn(self) -> Callable[[], Any]:
        fn: Callable[[], Any] = self._sched.schedule
        return fn

    def update_fn(self) -> Callable[[Any, Any], Any]:
        fn: Callable[[Any, Any], Any] = self._sched.update_from_output
        return fn

    def view(self, out: Any) -> tuple[Sequence[str], npt.NDArray[Any], npt.NDArray[Any]]:
        # vLLM lists new requests in scheduled_new_reqs and running/resumed ones in scheduled_cached_reqs,
        # each with num_computed_tokens as of before this step.
        # Running (and resumed) requests first, then new ones: the order kvsched uses.
        cached = out.scheduled_cached_reqs
        req_ids: list[str] = list(cached.req_ids)
        computed: list[int] = list(cached.num_computed_tokens)
        for new in out.scheduled_new_reqs:
            req_ids.append(new.req_id)
            computed.append(new.num_computed_tokens)
        counts = out.num_scheduled_tokens
        scheduled = np.fromiter((counts[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        self._preemptions += len(getattr(out, "preempted_req_ids", None) or ())
        return req_ids, scheduled, np.asarray(computed, dtype=np.int64)

    def model_output(
        self, out: Any, req_ids: Sequence[str], values: npt.NDArray[np.int64], indptr: npt.NDArray[np.int64]
    ) -> Any:
        flat = values.tolist()
        bounds = indptr.tolist()
        sampled = [flat[bounds[i] : bounds[i + 1]] for i in range(len(req_ids))]
        ids = list(req_ids)
        return self._ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )

    def after_update(self, result: Any) -> None:
        # vLLM's update_from_output drains the prefix-cache counters into the stats it returns every step
        # (log_stats=True), so they are summed here, outside the timed call.
        for outputs in (result or {}).values():
            self._add_prefix_stats(getattr(outputs, "scheduler_stats", None))

    def _add_prefix_stats(self, stats: Any) -> None:
        prefix = getattr(stats, "prefix_cache_stats", None) if stats is not None else None
        if prefix is None:
            return
        c = self._prefix
        c.prefix_cache_queries += int(getattr(prefix, "queries", 0))
        c.prefix_cache_hits += int(getattr(prefix, "hits", 0))
        c.prefix_cache_preempted_queries += int(getattr(prefix, "preempted_queries", 0))
        c.prefix_cache_preempted_hits += int(getattr(prefix, "preempted_hits", 0))

    def has_unfinished(self) -> bool:
        return bool(self._sched.has_unfinished_requests())

    def num_unfinished(self) -> int:
        return int(self._sched.get_num_unfinished_requests())

    def num_running(self) -> int:
        return len(self._sched.running)

    def counters(self) -> Counters:
        self._add_prefix_stats(self._sched.make_stats())  # whatever the last step left undrained
        c = self._prefix
        return Counters(
            num_preemptions=self._preemptions,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            prefix_cache_preempted_queries=c.prefix_cache_preempted_queries,
            prefix_cache_preempted_hits=c.prefix_cache_preempted_hits,
        )
