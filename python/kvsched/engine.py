"""``kvsched.LLM``: a small offline engine, the scheduler plus the torch runner.

A step is three calls: ``schedule()``, the runner's ``execute()`` on ``prepare_model_inputs()``, and
``update_from_output()``; everything else here is bookkeeping for the caller (texts, finish reasons, timings).
If the runner raises, the scheduler's ``fail_step()`` takes the step back instead: the requests of that step
finish with ``finish_reason="error"`` (and the exception's text in ``error``), the others go on.
torch is imported only when an :class:`LLM` is built, so ``import kvsched`` and :class:`SamplingParams` stay
torch-free.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._types import FinishReason
from .config import SchedulerConfig

if TYPE_CHECKING:
    from .runner.config import ModelConfig
    from .runner.model_runner import ModelRunner

__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` are off."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two)."""
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    """One generated sequence of a request, with vLLM's field names (``vllm.CompletionOutput``).

    kvsched samples one sequence per request, so ``index`` is always 0. ``text`` is ``""`` when the model
    directory has no tokenizer (as in vLLM without detokenisation); ``cumulative_logprob`` and ``logprobs`` are
    not computed (None)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id, when a stop_token_ids entry ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result. ``outputs[0]`` gives it in vLLM's shape (``outputs[0].text``, ``.token_ids``,
    ``.finish_reason``), so code written against ``vllm.LLM.generate`` reads it unchanged; the flat fields
    (``output_token_ids``, ``text``, ``finish_reason``, ``stop_reason``) say the same."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None without a tokenizer
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (the runner failed its step)
    stop_reason: int | None = None  # the stop token id, when a stop_token_ids entry ended it
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    error: str | None = None  # with finish_reason "error": the runner's exception, as "Type: message"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The request's one sequence as vLLM's ``outputs`` list, built from the fields above on each access
        (``outputs[0].token_ids`` is ``output_token_ids`` itself, not a copy)."""
        return [
            CompletionOutput(
                index=0,
                text=self.text if self.text is not None else "",
                token_ids=self.output_token_ids,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
            )
        ]


def _progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar on stderr for :meth:`LLM.generate`: only on a terminal, and only once a generation has run
    for a second (tqdm's ``delay``)."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", file=sys.stderr, delay=1.0, dynamic_ncols=True)


class LLM:
    """Offline generation with a Llama-family model from a local Hugging Face directory.

    ``model`` is a directory (``config.json`` + ``*.safetensors``, optional ``tokenizer.json``) or a
    :class:`~kvsched.runner.ModelConfig`, which builds a random-weight model (benchmarks, tests).
    ``num_blocks=None`` sizes the KV cache from ``gpu_memory_fraction`` on CUDA, and from ``cpu_kv_cache_gib``
    (capped at what ``max_num_seqs`` full-length requests need) on the CPU. ``max_model_len=None`` is the
    model's ``max_position_embeddings`` capped at 8192 and at what the KV cache holds.

    ``preemption_mode`` is the scheduler's (``"recompute"``, ``"swap"`` or ``"auto"``). With swap or auto the
    runner keeps a CPU KV pool of ``swap_space_gib`` GiB (pinned on CUDA; ``num_cpu_blocks=`` gives its size in
    blocks instead); this is not ``cpu_kv_cache_gib``, the KV cache of a model that runs on the CPU. Under auto
    the engine measures the scheduler's two cost constants at start-up (``ModelRunner.measure_preemption_costs``:
    seconds per token of a timed 256-token prefill, seconds per block of a timed copy of 8 blocks out and back)
    unless both ``recompute_cost_per_token`` and ``swap_cost_per_block`` are given.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | ModelConfig,
        *,
        dtype: str = "auto",
        device: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_fraction: float = 0.85,
        cpu_kv_cache_gib: float = 2.0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        attention_backend: str = "auto",
        enable_cuda_graphs: bool = False,
        scheduler_cls: Any = None,
        seed: int | None = None,
        preemption_mode: Literal["recompute", "swap", "auto"] = "recompute",
        swap_space_gib: float = 4.0,
        **scheduler_kwargs: Any,
    ) -> None:
        import torch

        from .runner.config import ModelConfig
        from .runner.loader import load_model, resolve_dtype
        from .runner.model_runner import ModelRunner

        if seed is not None:
            torch.manual_seed(seed)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer: Any = None
        if isinstance(model, ModelConfig):
            config = model
        else:
            model_dir = os.fspath(model)
            config = ModelConfig.from_pretrained(model_dir)
            self.tokenizer = _load_tokenizer(model_dir)
        # "auto" is the checkpoint's dtype, but float32 on the CPU (half precision is slow there).
        torch_dtype = resolve_dtype("float32" if dtype == "auto" and dev.type == "cpu" else dtype, config)
        self.model_config = config
        max_len = max_model_len or min(config.max_position_embeddings, 8192)
        if isinstance(model, ModelConfig):
            net = _random_model(config, max_len, torch_dtype, dev)
        else:
            net = load_model(model_dir, dtype=torch_dtype, device=dev, max_model_len=max_len, config=config)

        if num_blocks is None:
            num_blocks = _default_num_blocks(
                config, dev, torch_dtype, block_size, max_len, max_num_seqs, max_num_batched_tokens,
                gpu_memory_fraction, cpu_kv_cache_gib,
            )  # fmt: skip
        if max_model_len is None:
            # Unless asked for, no request may be longer than the whole KV cache holds.
            max_len = min(max_len, (num_blocks - 1) * block_size)
        num_cpu_blocks = int(scheduler_kwargs.pop("num_cpu_blocks", 0))
        if preemption_mode != "recompute" and num_cpu_blocks == 0:
            num_cpu_blocks = _num_cpu_blocks(config, torch_dtype, block_size, swap_space_gib)
        sched_config = SchedulerConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode,
            num_cpu_blocks=num_cpu_blocks,
            **scheduler_kwargs,
        )
        if scheduler_cls is None:
            from .scheduler import Scheduler

            scheduler_cls = Scheduler
        self.scheduler: Any = scheduler_cls(sched_config)
        self.runner: ModelRunner = ModelRunner(
            net,
            block_size=block_size,
            num_blocks=num_blocks,
            device=dev,
            dtype=torch_dtype,
            attention_backend=attention_backend,
            cuda_graph_max_batch_size=min(max_num_seqs, 512) if enable_cuda_graphs else 0,
            max_model_len=max_len,
            num_cpu_blocks=num_cpu_blocks,
        )
        given = {"recompute_cost_per_token", "swap_cost_per_block"} <= scheduler_kwargs.keys()
        if preemption_mode == "auto" and not given:
            self.scheduler.set_preemption_costs(*self.runner.measure_preemption_costs())
        self.device = dev
        self.dtype = torch_dtype
        self._requests: dict[str, RequestOutput] = {}
        self._next_id = 0
        self.num_steps = 0
        self.num_failed_steps = 0  # steps the runner raised in (their requests finished with "error")

    # -- requests ------------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer.json in the model directory; pass token ids")
            text: str | None = prompt
            token_ids = list(self.tokenizer.encode(prompt).ids)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        req_id = request_id if request_id is not None else str(self._next_id)
        self._next_id += 1
        eos_ids = () if params.ignore_eos else self.model_config.eos_token_ids
        self.scheduler.add_request(
            req_id,
            np.asarray(token_ids, dtype=np.int32),
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            eos_token_id=eos_ids[0] if eos_ids else None,
            ignore_eos=params.ignore_eos,
            stop_token_ids=tuple(eos_ids[1:]) + params.stop_token_ids,
        )
        self.runner.add_request(
            req_id,
            len(token_ids),
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            min_tokens=params.min_tokens,
            stop_ids=tuple(eos_ids) + params.stop_token_ids,
        )
        self._requests[req_id] = RequestOutput(req_id, text, token_ids)
        return req_id

    def abort_requests(self, req_ids: Sequence[str]) -> None:
        """Drop requests that have not finished (they get no output)."""
        req_ids = [r for r in req_ids if r in self._requests]
        self.scheduler.abort_requests(req_ids)
        self.runner.remove_requests(req_ids)
        for req_id in req_ids:
            del self._requests[req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    # -- the step loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it.

        If the runner raises, the step is failed instead of applied (``Scheduler.fail_step``): its requests
        finish with ``finish_reason="error"`` and the exception's text in ``error`` (their tokens so far are kept),
        the blocks they held are freed (the ones this step filled leave the prefix cache), and every other request
        goes on with the next step."""
        out = self.scheduler.schedule()
        inputs = self.scheduler.prepare_model_inputs(out)
        try:
            sampled = self.runner.execute(out, inputs)
        except Exception as exc:  # the runner's failure ends its step's requests, not the engine
            return self._fail_step(out, exc)
        result = self.scheduler.update_from_output(out, sampled)
        return self._postprocess(out, sampled, result)

    def _fail_step(self, out: Any, exc: Exception) -> list[RequestOutput]:
        self.num_steps += 1
        self.num_failed_steps += 1
        failed_ids = self.scheduler.fail_step(out)
        self.runner.remove_requests(failed_ids)
        now = time.monotonic()
        error = f"{type(exc).__name__}: {exc}"
        finished = []
        for req_id in failed_ids:
            req = self._requests.pop(req_id)
            req.finish_reason = "error"
            req.error = error
            req.metrics.finish_time = now
            req.metrics.num_output_tokens = len(req.output_token_ids)
            if self.tokenizer is not None:
                req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            finished.append(req)
        return finished

    def _postprocess(self, out: Any, sampled: tuple[np.ndarray, np.ndarray], result: Any) -> list[RequestOutput]:
        self.num_steps += 1
        now = time.monotonic()
        values, indptr = sampled
        num_new = np.asarray(result.num_new_tokens)
        for i in np.flatnonzero(num_new):
            req = self._requests[out.req_ids[i]]
            start = int(indptr[i])
            req.output_token_ids.extend(values[start : start + int(num_new[i])].tolist())
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        finished = []
        for req_id, reason, stop in zip(
            result.finished_req_ids, result.finish_reasons, result.stop_reasons, strict=True
        ):
            req = self._requests.pop(req_id)
            req.finish_reason = str(FinishReason(int(reason)))
            req.stop_reason = None if int(stop) < 0 else int(stop)
            req.metrics.finish_time = now
            req.metrics.num_output_tokens = len(req.output_token_ids)
            if self.tokenizer is not None:
                req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            finished.append(req)
        if result.finished_req_ids:
            self.runner.remove_requests(result.finished_req_ids)
        return finished

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        Runs until no request is left, including any added earlier with :meth:`add_request` (their outputs are
        returned by :meth:`step`, not here). A runner failure does not raise here: the requests of the failed
        step come back with ``finish_reason == "error"`` and the exception in ``error`` (see :meth:`step`), the
        others complete normally."""
        single = isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1)
        if single or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompt_list: list[Any] = [prompts]
        else:
            prompt_list = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                ids.append(self.add_request(prompt, params))
        except Exception:
            self.abort_requests(ids)  # all or nothing
            raise
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids), use_tqdm)
        num_output_tokens = 0
        start = time.monotonic()
        try:
            while self.has_unfinished_requests():
                finished = self.step()
                for req in finished:
                    done[req.request_id] = req
                    num_output_tokens += len(req.output_token_ids)
                if bar is not None and finished:
                    rate = num_output_tokens / max(1e-9, time.monotonic() - start)
                    bar.set_postfix_str(f"{rate:,.0f} output tok/s", refresh=False)
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _load_tokenizer(model_dir: str) -> Any:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _random_model(config: ModelConfig, max_model_len: int, dtype: Any, device: Any) -> Any:
    """A random-weight model (std 0.02 normal weights, unit norms), built directly on ``device``."""
    import torch

    from .runner.model import LlamaForCausalLM

    with torch.device(device):
        net = LlamaForCausalLM(config, max_model_len)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return net.to(dtype).eval()


def _default_num_blocks(
    config: ModelConfig,
    device: Any,
    dtype: Any,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    gpu_memory_fraction: float,
    cpu_kv_cache_gib: float,
) -> int:
    """KV blocks: what fits in ``gpu_memory_fraction`` on CUDA; on the CPU what ``max_num_seqs`` full-length
    requests need, capped at ``cpu_kv_cache_gib``."""
    from .runner.attention import kv_cache_bytes_per_block, num_blocks_for_memory

    kv = {"block_size": block_size, "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim}
    if device.type == "cuda":
        reserve = _activation_reserve_bytes(config, max_num_batched_tokens, max_num_seqs, dtype)
        return num_blocks_for_memory(
            num_layers=config.num_hidden_layers,
            dtype=dtype,
            gpu_memory_fraction=gpu_memory_fraction,
            activation_reserve_bytes=reserve,
            device=device,
            **kv,
        )
    per_block = kv_cache_bytes_per_block(config.num_hidden_layers, dtype=dtype, **kv)
    needed = max_num_seqs * -(-max_model_len // block_size) + 1
    return max(2, min(needed, int(cpu_kv_cache_gib * 2**30) // per_block))


def _num_cpu_blocks(config: ModelConfig, dtype: Any, block_size: int, swap_space_gib: float) -> int:
    """CPU swap-pool blocks that fit in ``swap_space_gib`` (at least 1)."""
    from .runner.attention import kv_cache_bytes_per_block

    if not (math.isfinite(swap_space_gib) and swap_space_gib > 0):
        raise ValueError(f"swap_space_gib must be a finite number > 0, got {swap_space_gib}")
    per_block = kv_cache_bytes_per_block(
        config.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=dtype,
    )
    return max(1, int(swap_space_gib * 2**30) // per_block)


def _activation_reserve_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: Any) -> int:
    """A generous estimate of the peak activation memory of one step, kept out of the KV budget."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = elem * (4 * config.hidden_size + 2 * qkv + 3 * config.intermediate_size)
    logits = max_num_seqs * config.vocab_size * 4 * 4  # float32 logits, sorted copy, probs, noise
    return 2 * (max_num_batched_tokens * per_token + logits) + 512 * 2**20
