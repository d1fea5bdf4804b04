"""``--impl vllm``: replay a trace through vLLM's own v1 ``Scheduler`` (optional; needs ``vllm`` importable).

No model and no GPU: vLLM is told to target the CPU, its ``ModelConfig`` points at a temporary directory
holding only a tiny Llama ``config.json`` (no weights, no tokenizer), the KV cache layout is a hand-built
``KVCacheConfig`` with one full-attention group of ``num_blocks`` blocks, and requests get a block hasher set
up the way vLLM's engine core does it (SHA-256 here, like kvsched's ``prefix_hash_algo="sha256"`` option).

Only ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` are timed. Building vLLM ``Request``
objects (in ``add``), reading the scheduled ids/counts out of vLLM's ``SchedulerOutput`` and building its
``ModelRunnerOutput`` from the fake model's tokens all happen outside the timed region.

vLLM's constructors change between releases, so keyword arguments are passed only when the installed version
accepts them (checked with :func:`inspect.signature`); a missing required argument fails with a clear error.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.config import SchedulerConfig

from .driver import Counters, ImplUnavailableError
from .workloads import VOCAB_SIZE, TraceRequest

__all__ = ["VllmDriver"]

# A model config that vLLM can parse without downloading anything; the scheduler never looks at the weights.
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _call(fn: Callable[..., Any], what: str, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts (vLLM's signatures move)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = kwargs
    else:
        accepted = {k: v for k, v in kwargs.items() if k in params}
    try:
        return fn(**accepted)
    except TypeError as exc:
        raise ImplUnavailableError(f"this vLLM's {what} does not take the arguments we know ({exc})") from exc


def _hash_fn(name: str) -> Callable[[Any], Any]:
    for module in ("vllm.utils.hashing", "vllm.utils"):
        try:
            mod = __import__(module, fromlist=["get_hash_fn_by_name"])
            fn: Callable[[Any], Any] = mod.get_hash_fn_by_name(name)
            return fn
        except (ImportError, AttributeError):
            continue
    raise ImplUnavailableError("cannot find vLLM's get_hash_fn_by_name (vllm.utils.hashing)")


class VllmDriver:
    """Drives ``vllm.v1.core.sched.scheduler.Scheduler`` through the benchmark loop."""

    impl = "vllm"

    def __init__(self, config: SchedulerConfig) -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import torch
            from vllm.config import CacheConfig, ModelConfig, VllmConfig
            from vllm.config import SchedulerConfig as VllmSchedulerConfig
            from vllm.sampling_params import SamplingParams
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
            from vllm.v1.outputs import ModelRunnerOutput
            from vllm.v1.request import Request
            from vllm.v1.structured_output import StructuredOutputManager
        except ImportError as exc:
            raise ImplUnavailableError(f"vllm is not importable here ({exc}); it is optional") from exc

        self._config = config
        self._Request = Request
        self._SamplingParams = SamplingParams
        self._ModelRunnerOutput = ModelRunnerOutput
        self._preemptions = 0
        self._prefix = Counters()

        self._tmp = tempfile.TemporaryDirectory(prefix="kvsched-vllm-")
        model_cfg = dict(_TINY_LLAMA, max_position_embeddings=config.max_model_len)
        with open(os.path.join(self._tmp.name, "config.json"), "w", encoding="utf-8") as f:
            json.dump(model_cfg, f)

        model_config = _call(
            ModelConfig,
            "ModelConfig",
            model=self._tmp.name,
            tokenizer=self._tmp.name,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=config.max_model_len,
            trust_remote_code=False,
        )
        scheduler_config = _call(
            VllmSchedulerConfig,
            "SchedulerConfig",
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.policy,
            is_encoder_decoder=False,
            scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
            watermark=config.watermark,
        )
        cache_config = _call(
            CacheConfig,
            "CacheConfig",
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_caching_hash_algo="sha256",
            cache_dtype="auto",
        )
        cache_config.num_gpu_blocks = config.num_blocks
        vllm_config = _call(
            VllmConfig,
            "VllmConfig",
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
        )
        # The engine normally sizes the cache from GPU memory; make sure the config still says what we chose.
        vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        spec = _call(
            FullAttentionSpec,
            "FullAttentionSpec",
            block_size=config.block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
        )
        kv_cache_config = _call(
            KVCacheConfig,
            "KVCacheConfig",
            num_blocks=config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        self._sched = _call(
            Scheduler,
            "Scheduler",
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=config.block_size,
            hash_block_size=config.block_size,
            include_finished_set=False,
            log_stats=True,
        )

        self._block_hasher: Callable[[Any], Any] | None = None
        if config.enable_prefix_caching:
            hash_fn = _hash_fn("sha256")
            init_none_hash(hash_fn)
            self._block_hasher = get_request_block_hasher(config.block_size, hash_fn)

    # ---- Driver protocol --------------------------------------------------------------------------------

    def add(self, req: TraceRequest, rid: str) -> None:
        params = _call(self._SamplingParams, "SamplingParams", max_tokens=req.max_tokens, ignore_eos=True)
        request = _call(
            self._Request,
            "Request",
            request_id=rid,
            prompt_token_ids=req.prompt_token_ids.tolist(),
            sampling_params=params,
            pooling_params=None,
            eos_token_id=None,
            arrival_time=float(req.arrival_step),
            priority=req.priority,
            block_hasher=self._block_hasher,
            mm_features=None,
            multi_modal_inputs=None,
            multi_modal_hashes=None,
            multi_modal_placeholders=None,
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
        return _call(
            self._ModelRunnerOutput,
            "ModelRunnerOutput",
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
