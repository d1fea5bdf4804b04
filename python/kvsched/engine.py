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
import numbers
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._errors import InvalidConfigError, InvalidRequestError, SchedulerError, SchedulerTypeError
from ._types import FinishReason
from .config import SchedulerConfig

if TYPE_CHECKING:
    from .runner.config import ModelConfig
    from .runner.model_runner import ModelRunner

__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]

_I32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` are off.

    Checked on construction like :class:`~kvsched.SchedulerConfig`: a value of the wrong type raises
    :class:`~kvsched.SchedulerTypeError` (a ``TypeError``), one out of range :class:`~kvsched.InvalidRequestError`
    (a ``ValueError``); both name the field. Integers may be numpy integers, reals numpy floats; bools are not
    numbers here (as in ``Scheduler.add_request``). Stop token ids are checked against the model's vocabulary
    when the request is added."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        max_tokens = _int_arg("max_tokens", self.max_tokens, 1, None, InvalidRequestError)
        min_tokens = _int_arg("min_tokens", self.min_tokens, 0, None, InvalidRequestError)
        if min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
        temperature = _real_arg("temperature", self.temperature, InvalidRequestError)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        top_k = _int_arg("top_k", self.top_k, 0, _I32_MAX, InvalidRequestError)
        top_p = _real_arg("top_p", self.top_p, InvalidRequestError)
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        seed = None if self.seed is None else _int_arg("seed", self.seed, -(2**63), 2**64 - 1, InvalidRequestError)
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes, bytearray)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise SchedulerTypeError(f"stop_token_ids must be a sequence of int token ids, got {type(stop).__name__}")
        stop_ids = tuple(
            _int_arg(f"stop_token_ids[{i}]", t, 0, _I32_MAX, InvalidRequestError) for i, t in enumerate(stop)
        )
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SchedulerTypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # Stored as plain Python values, so the runner and the scheduler see ints and floats, not numpy scalars.
        for name, value in (
            ("max_tokens", max_tokens),
            ("min_tokens", min_tokens),
            ("temperature", temperature),
            ("top_k", top_k),
            ("top_p", top_p),
            ("seed", seed),
            ("stop_token_ids", stop_ids),
            ("ignore_eos", bool(self.ignore_eos)),
        ):
            object.__setattr__(self, name, value)


def _int_arg(
    name: str,
    value: Any,
    minimum: int,
    maximum: int | None,
    error: type[Exception],
    type_error: type[Exception] = SchedulerTypeError,
) -> int:
    """``value`` as an int (a Python or numpy integer, not a bool), else ``type_error``; out of
    ``[minimum, maximum]`` raises ``error``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise type_error(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    v = int(value)
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise error(f"{name} must be {'in ' if maximum is not None else ''}{bound}, got {v}")
    return v


def _real_arg(name: str, value: Any, error: type[Exception], type_error: type[Exception] = SchedulerTypeError) -> float:
    """``value`` as a float (an int or a float, Python or numpy, not a bool), else ``type_error``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise type_error(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        raise error(f"{name} must be a finite number, got {value!r}") from None


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
    # With finish_reason "error": why, as "Type: message" (the request was refused by generate(), or the runner
    # raised in a step of this request).
    error: str | None = None

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
    """A tqdm bar on stderr for :meth:`LLM.generate`, as vLLM's ``LLM.generate`` draws one: requests completed
    out of the call's prompts, with the prompt and output token rates. Only when stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", file=sys.stderr, dynamic_ncols=True)


# SchedulerConfig's defaults, read from the class itself so they are declared in one place.
_SCHEDULER_DEFAULTS = SchedulerConfig()
_SCHEDULER_FIELDS = frozenset(_SCHEDULER_DEFAULTS.to_dict())
_ATTENTION_BACKENDS = ("auto", "torch", "triton")


class LLM:
    """Offline generation with a Llama-family model from a local Hugging Face directory.

    ``model`` is a directory (``config.json`` + ``*.safetensors``, optional ``tokenizer.json``) or a
    :class:`~kvsched.runner.ModelConfig`, which builds a random-weight model (benchmarks, tests).

    The scheduler's configuration comes either from keywords (``block_size=``, ``max_num_seqs=`` and any other
    :class:`~kvsched.SchedulerConfig` field; the ones not given take ``SchedulerConfig``'s defaults) or whole
    from ``scheduler_config=``. Keywords: ``num_blocks=None`` sizes the KV cache from ``gpu_memory_fraction`` on
    CUDA, and from ``cpu_kv_cache_gib`` (capped at what ``max_num_seqs`` full-length requests need) on the CPU;
    ``max_model_len=None`` is the model's ``max_position_embeddings`` capped at ``SchedulerConfig``'s default
    ``max_model_len`` and at what the KV cache holds. A ``scheduler_config`` is used as given (its ``num_blocks``,
    ``max_model_len``, ``num_cpu_blocks`` and cost constants included); a keyword given beside it must agree
    with it. Either way ``max_model_len`` may not exceed the model's ``max_position_embeddings``.

    ``preemption_mode`` is the scheduler's (``"recompute"``, ``"swap"`` or ``"auto"``). With swap or auto the
    runner keeps a CPU KV pool of ``swap_space_gib`` GiB (pinned on CUDA; ``num_cpu_blocks=`` gives its size in
    blocks instead); this is not ``cpu_kv_cache_gib``, the KV cache of a model that runs on the CPU. Under auto
    the engine measures the scheduler's two cost constants at start-up (``ModelRunner.measure_preemption_costs``:
    seconds per token of a timed 256-token prefill, seconds per block of a timed copy of 8 blocks out and back)
    unless both ``recompute_cost_per_token`` and ``swap_cost_per_block`` are given as keywords (with
    ``scheduler_config=``, its constants are used; ``llm.scheduler.set_preemption_costs(
    *llm.runner.measure_preemption_costs())`` measures them).

    Bad options raise at construction, naming the option: :class:`~kvsched.InvalidConfigError` (a
    ``ValueError``) for a bad value or type of an option or of the model directory (missing, no
    ``config.json``, no weights, ``max_model_len`` beyond the model's positions, a device torch cannot use),
    :class:`~kvsched.SchedulerTypeError` for an unknown keyword or a ``scheduler_config`` that is not a
    ``SchedulerConfig``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | ModelConfig,
        *,
        scheduler_config: SchedulerConfig | None = None,
        dtype: str = "auto",
        device: str | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        gpu_memory_fraction: float = 0.85,
        cpu_kv_cache_gib: float = 2.0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool | None = None,
        enable_chunked_prefill: bool | None = None,
        attention_backend: str = "auto",
        enable_cuda_graphs: bool = False,
        scheduler_cls: Any = None,
        seed: int | None = None,
        preemption_mode: Literal["recompute", "swap", "auto"] | None = None,
        swap_space_gib: float = 4.0,
        **scheduler_kwargs: Any,
    ) -> None:
        import torch

        from .runner.model_runner import ModelRunner

        keywords = {
            "block_size": block_size,
            "num_blocks": num_blocks,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching,
            "enable_chunked_prefill": enable_chunked_prefill,
            "preemption_mode": preemption_mode,
        }
        given = _given_scheduler_fields(keywords, scheduler_kwargs, scheduler_config)
        _check_engine_options(
            gpu_memory_fraction=gpu_memory_fraction,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            swap_space_gib=swap_space_gib,
            attention_backend=attention_backend,
            enable_cuda_graphs=enable_cuda_graphs,
            seed=seed,
            scheduler_cls=scheduler_cls,
        )
        dev = _resolve_device(device)
        config, model_dir = _model_config(model)
        torch_dtype = _resolve_torch_dtype(dtype, dev, config)
        if seed is not None:
            torch.manual_seed(seed)
        self.tokenizer: Any = None if model_dir is None else _load_tokenizer(model_dir)
        self.model_config = config

        fixed = scheduler_config
        blk = fixed.block_size if fixed is not None else given.get("block_size", _SCHEDULER_DEFAULTS.block_size)
        if fixed is not None:
            max_len = fixed.max_model_len
        elif "max_model_len" in given:
            max_len = given["max_model_len"]
        else:
            max_len = min(config.max_position_embeddings, _SCHEDULER_DEFAULTS.max_model_len)
        if max_len > config.max_position_embeddings:
            where = "scheduler_config.max_model_len" if fixed is not None else "max_model_len"
            raise InvalidConfigError(
                f"{where}={max_len} is beyond the model's positions (max_position_embeddings="
                f"{config.max_position_embeddings} in its config); use max_model_len <= "
                f"{config.max_position_embeddings}"
            )
        net = _build_model(config if model_dir is None else model_dir, config, max_len, torch_dtype, dev)

        if fixed is not None:
            sched_config = fixed
            measure_costs = False
        else:
            seqs = given.get("max_num_seqs", _SCHEDULER_DEFAULTS.max_num_seqs)
            budget = given.get("max_num_batched_tokens", _SCHEDULER_DEFAULTS.max_num_batched_tokens)
            blocks = given.get("num_blocks")
            if blocks is None:
                blocks = _default_num_blocks(
                    config, dev, torch_dtype, blk, max_len, seqs, budget, gpu_memory_fraction, cpu_kv_cache_gib
                )
            if "max_model_len" not in given:
                # Unless asked for, no request may be longer than the whole KV cache holds.
                max_len = min(max_len, (blocks - 1) * blk)
            mode = given.get("preemption_mode", _SCHEDULER_DEFAULTS.preemption_mode)
            cpu_blocks = given.get("num_cpu_blocks", 0)
            if mode != "recompute" and cpu_blocks == 0:
                cpu_blocks = _num_cpu_blocks(config, torch_dtype, blk, swap_space_gib)
            sched_config = SchedulerConfig(
                **{**given, "num_blocks": blocks, "max_model_len": max_len, "num_cpu_blocks": cpu_blocks}
            )
            measure_costs = mode == "auto" and not {"recompute_cost_per_token", "swap_cost_per_block"} <= given.keys()
        self.scheduler_config = sched_config
        if scheduler_cls is None:
            from .scheduler import Scheduler

            scheduler_cls = Scheduler
        self.scheduler: Any = scheduler_cls(sched_config)
        self.runner: ModelRunner = ModelRunner(
            net,
            block_size=sched_config.block_size,
            num_blocks=sched_config.num_blocks,
            device=dev,
            dtype=torch_dtype,
            attention_backend=attention_backend,
            cuda_graph_max_batch_size=min(sched_config.max_num_seqs, 512) if enable_cuda_graphs else 0,
            max_model_len=sched_config.max_model_len,
            num_cpu_blocks=sched_config.num_cpu_blocks,
            # The engine removes a request from the runner when it sees it finish (step, abort_requests), not a
            # step later when the scheduler reports it, so that a new request reusing the id is not dropped.
            remove_finished_requests=False,
        )
        if measure_costs:
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
        """Add one request (a text prompt or token ids); returns its id. A request that cannot run raises and adds
        nothing: :class:`~kvsched.SchedulerTypeError` for a prompt that is not a str or a sequence of int token ids
        (numpy integers are ints, bools are not), :class:`~kvsched.InvalidRequestError` for an empty prompt, a
        token id outside the model's vocabulary (prompt or ``stop_token_ids``), a prompt that leaves no room for
        an output token within ``max_model_len``, or one the KV cache could never hold. (:meth:`generate`
        returns such a request as an output with ``finish_reason="error"`` instead.)"""
        text, token_ids = self._parse_prompt(prompt)
        req_id = self._new_request_id() if request_id is None else request_id
        self._add(req_id, text, token_ids, params)
        return req_id

    def _new_request_id(self) -> str:
        while str(self._next_id) in self._requests:  # taken by an id the caller chose
            self._next_id += 1
        self._next_id += 1
        return str(self._next_id - 1)

    def _parse_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids as Python ints; the types are checked here, the
        values by :meth:`_check_prompt`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer.json in the model directory; pass token ids")
            return prompt, list(self.tokenizer.encode(prompt).ids)
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1:
                raise SchedulerTypeError(f"a prompt array must be 1-D, got {prompt.ndim} dimensions")
            if prompt.dtype.kind not in "iu":
                raise SchedulerTypeError(f"a prompt array must have an integer dtype, got {prompt.dtype}")
            return None, prompt.tolist()
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise SchedulerTypeError(
                f"a prompt must be a str or a sequence of int token ids, got {type(prompt).__name__}"
            )
        for i, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise SchedulerTypeError(f"prompt token {i} must be an int, got {t!r} ({type(t).__name__})")
        return None, [int(t) for t in prompt]

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """The prompt's values against the model: its vocabulary and its positions."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            i = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"prompt token {i} is {token_ids[i]}, outside the model's vocabulary [0, {vocab})"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError(
                f"stop_token_ids holds {bad_stop[0]}, outside the model's vocabulary [0, {vocab})"
            )
        max_len = self.scheduler_config.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len={max_len} holds the prompt and at least "
                f"one output token, so a prompt may have at most {max_len - 1}"
            )

    def _add(self, req_id: str, text: str | None, token_ids: list[int], params: SamplingParams | None) -> None:
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise SchedulerTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        self._check_prompt(token_ids, params)
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
        try:
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
        except BaseException:
            self.scheduler.abort_requests([req_id])
            raise
        self._requests[req_id] = RequestOutput(req_id, text, token_ids)

    def _refused(self, req_id: str, prompt: Any, token_ids: list[int], exc: Exception) -> RequestOutput:
        """The output of a request :meth:`generate` could not add: finished with ``"error"`` and the reason."""
        now = time.monotonic()
        return RequestOutput(
            req_id,
            prompt if isinstance(prompt, str) else None,
            token_ids,
            text=None if self.tokenizer is None else "",
            finish_reason="error",
            metrics=RequestMetrics(now, finish_time=now),
            error=f"{type(exc).__name__}: {exc}",
        )

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Drop requests that have not finished (they get no output). Takes what ``Scheduler.abort_requests``
        takes and raises what it raises, leaving every request in place: :class:`~kvsched.SchedulerTypeError`
        for a single str or anything but an iterable of str, :class:`~kvsched.UnknownRequestError` for an id
        that is not running or waiting (never added, finished, or already aborted)."""
        # A str or a non-iterable goes to the scheduler as it is, so that it answers with its own error.
        ids: Any = req_ids if isinstance(req_ids, str) or not isinstance(req_ids, Iterable) else list(req_ids)
        self.scheduler.abort_requests(ids)
        self.runner.remove_requests(ids)
        for req_id in ids:
            self._requests.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    # -- the step loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it.

        If the runner raises, the step is failed instead of applied (``Scheduler.fail_step``): its requests
        finish with ``finish_reason="error"`` and the exception's text in ``error`` (their tokens so far are kept),
        the blocks they held are freed (the ones this step filled leave the prefix cache), and every other request
        goes on with the next step. (A runner exception cannot be traced to one request of the step; what one
        request can get wrong, its token ids and sampling parameters, is refused when it is added.)"""
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

        A bad request fails alone and does not raise: a prompt :meth:`add_request` would refuse (a token id
        outside the vocabulary, a float or str token, a prompt too long for ``max_model_len``...) comes back at
        once with ``finish_reason == "error"`` and the reason in ``error``, and so do the requests of a step the
        runner failed in (see :meth:`step`); every other request runs to its end. Only a wrong call raises:
        ``prompts`` that are not a str, a sequence of token ids or a sequence of those, or ``sampling_params``
        that are not a ``SamplingParams`` or one per prompt (:class:`~kvsched.SchedulerTypeError`,
        :class:`~kvsched.InvalidRequestError`).

        Runs until no request is left, including any added earlier with :meth:`add_request` (their outputs are
        returned by :meth:`step`, not here). ``use_tqdm``: a progress bar on stderr when it is a terminal."""
        prompt_list = _prompt_list(prompts)
        params_list = _params_list(sampling_params, len(prompt_list))
        done: dict[str, RequestOutput] = {}
        ids: list[str] = []
        added: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                req_id = self._new_request_id()
                ids.append(req_id)
                token_ids: list[int] = []
                try:
                    text, token_ids = self._parse_prompt(prompt)
                    self._add(req_id, text, token_ids, params)
                except SchedulerError as exc:  # this request is refused; the others go on
                    done[req_id] = self._refused(req_id, prompt, token_ids, exc)
                else:
                    added.append(req_id)
        except BaseException:
            self.abort_requests(added)  # anything else (a bug, KeyboardInterrupt) adds nothing
            raise
        wanted = set(added)
        bar = _progress_bar(len(ids), use_tqdm)
        num_prompt_tokens = num_output_tokens = 0
        start = time.monotonic()
        try:
            if bar is not None and done:
                bar.update(len(done))
            while self.has_unfinished_requests():
                finished = [req for req in self.step() if req.request_id in wanted]
                for req in finished:
                    done[req.request_id] = req
                    num_prompt_tokens += len(req.prompt_token_ids)
                    num_output_tokens += len(req.output_token_ids)
                if bar is not None and finished:
                    elapsed = max(1e-9, time.monotonic() - start)
                    rates = num_prompt_tokens / elapsed, num_output_tokens / elapsed
                    bar.set_postfix_str(
                        f"input {rates[0]:,.0f} tok/s, output {rates[1]:,.0f} tok/s",
                        refresh=False,
                    )
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s prompts as a list of single prompts (a lone prompt, text or token ids, is wrapped)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 0:
            raise SchedulerTypeError(
                "prompts must be a str, a sequence of token ids, or a sequence of those, got a 0-d array"
            )
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise SchedulerTypeError(
            f"prompts must be a str, a sequence of token ids, or a sequence of those, got {type(prompts).__name__}"
        )
    if len(prompts) > 0 and isinstance(prompts[0], (numbers.Number, np.number, np.bool_)):
        return [prompts]  # the token ids of one prompt (checked as such: a float among them is refused)
    return list(prompts)


def _params_list(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
        raise SchedulerTypeError(
            f"sampling_params must be a SamplingParams or a sequence of them, got {type(sampling_params).__name__}"
        )
    params = list(sampling_params)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise SchedulerTypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    if len(params) != num_prompts:
        raise InvalidRequestError(f"{len(params)} sampling params for {num_prompts} prompts")
    return params


def _given_scheduler_fields(
    keywords: dict[str, Any], scheduler_kwargs: dict[str, Any], scheduler_config: SchedulerConfig | None
) -> dict[str, Any]:
    """The SchedulerConfig fields given as keywords (the LLM's own that are not None, and the rest), checked: no
    unknown name, no disagreement with ``scheduler_config``, and the fields used before the scheduler exists."""
    unknown = sorted(scheduler_kwargs.keys() - _SCHEDULER_FIELDS)
    if unknown:
        raise SchedulerTypeError(
            f"LLM() got an unexpected keyword argument {unknown[0]!r}: "
            "neither an LLM option nor a SchedulerConfig field"
        )
    given = {name: value for name, value in keywords.items() if value is not None}
    given.update(scheduler_kwargs)
    if scheduler_config is not None:
        if not isinstance(scheduler_config, SchedulerConfig):
            raise SchedulerTypeError(
                f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}"
            )
        for name, value in given.items():
            if getattr(scheduler_config, name) != value:
                raise InvalidConfigError(
                    f"{name}={value!r} conflicts with scheduler_config.{name}={getattr(scheduler_config, name)!r}; "
                    f"give {name} in one place"
                )
        return given
    # SchedulerConfig's own checks and messages, before anything is loaded. The fields the engine derives later
    # stand in with values that pass (they are checked again once derived).
    stand_in = dict(given)
    stand_in.setdefault("num_blocks", _SCHEDULER_DEFAULTS.num_blocks)
    if stand_in.get("preemption_mode", "recompute") != "recompute" and not stand_in.get("num_cpu_blocks"):
        stand_in["num_cpu_blocks"] = 1
    SchedulerConfig(**stand_in)
    return given


def _check_engine_options(
    *,
    gpu_memory_fraction: Any,
    cpu_kv_cache_gib: Any,
    swap_space_gib: Any,
    attention_backend: Any,
    enable_cuda_graphs: Any,
    seed: Any,
    scheduler_cls: Any,
) -> None:
    """The LLM's options that are not SchedulerConfig fields, checked as SchedulerConfig checks its own."""
    fraction = _real_arg("gpu_memory_fraction", gpu_memory_fraction, InvalidConfigError, InvalidConfigError)
    if not 0 < fraction <= 1:
        raise InvalidConfigError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
    for name, gib in (("cpu_kv_cache_gib", cpu_kv_cache_gib), ("swap_space_gib", swap_space_gib)):
        value = _real_arg(name, gib, InvalidConfigError, InvalidConfigError)
        if not (math.isfinite(value) and value > 0):
            raise InvalidConfigError(f"{name} must be a finite number > 0, got {gib!r}")
    if attention_backend not in _ATTENTION_BACKENDS:
        raise InvalidConfigError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {attention_backend!r}")
    if not isinstance(enable_cuda_graphs, bool):
        raise InvalidConfigError(f"enable_cuda_graphs must be a bool, got {enable_cuda_graphs!r}")
    if seed is not None:
        _int_arg("seed", seed, -(2**63), 2**64 - 1, InvalidConfigError, InvalidConfigError)
    if scheduler_cls is not None and not callable(scheduler_cls):
        raise InvalidConfigError(
            f"scheduler_cls must be a class (or a callable taking a SchedulerConfig), got {scheduler_cls!r}"
        )


def _resolve_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (default: cuda if available), refused unless torch can use it here."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wrong = InvalidConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not isinstance(device, (str, torch.device)):
        raise wrong
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise wrong from None
    if dev.type not in ("cpu", "cuda"):
        raise wrong
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidConfigError(
                f"device={device!r}, but torch finds no CUDA device on this machine "
                "(torch.cuda.is_available() is False); use device='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise InvalidConfigError(f"device={device!r}, but torch finds {count} CUDA device(s)")
    return dev


def _model_config(model: Any) -> tuple[ModelConfig, str | None]:
    """The model's config, and its directory (None for a ModelConfig, a random-weight model)."""
    from .runner.config import ModelConfig

    if isinstance(model, ModelConfig):
        return model, None
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidConfigError(f"model must be a model directory or a ModelConfig, got {type(model).__name__}")
    model_dir = os.fspath(model)
    if not isinstance(model_dir, str):
        raise InvalidConfigError(f"model must be a str path, got {model_dir!r}")
    if not os.path.isdir(model_dir):
        what = "is not a directory" if os.path.exists(model_dir) else "does not exist"
        raise InvalidConfigError(
            f"model: {model_dir!r} {what}; give a local Hugging Face model directory (config.json, *.safetensors)"
        )
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise InvalidConfigError(f"model: no config.json in {model_dir!r}")
    names = os.listdir(model_dir)
    if not any(name.endswith(".safetensors") or name == "model.safetensors.index.json" for name in names):
        raise InvalidConfigError(f"model: no *.safetensors weights in {model_dir!r}")
    try:
        return ModelConfig.from_pretrained(model_dir), model_dir
    except KeyError as exc:
        raise InvalidConfigError(f"model: {path} lacks {exc}") from None
    except (ValueError, TypeError, OSError) as exc:  # bad JSON or values; an unreadable file
        raise InvalidConfigError(f"model: {path}: {exc}") from None


def _resolve_torch_dtype(dtype: Any, device: Any, config: ModelConfig) -> Any:
    """``"auto"`` is the checkpoint's dtype, but float32 on the CPU (half precision is slow there)."""
    import torch

    from .runner.loader import resolve_dtype

    if not isinstance(dtype, (str, torch.dtype)):
        raise InvalidConfigError(f"dtype must be a str or a torch.dtype, got {dtype!r}")
    try:
        return resolve_dtype("float32" if dtype == "auto" and device.type == "cpu" else dtype, config)
    except ValueError as exc:
        raise InvalidConfigError(f"dtype: {exc}") from None


def _build_model(model: str | ModelConfig, config: ModelConfig, max_model_len: int, dtype: Any, device: Any) -> Any:
    """The model: random weights for a ModelConfig, else the checkpoint's."""
    from .runner.loader import load_model

    if isinstance(model, str):
        return load_model(model, dtype=dtype, device=device, max_model_len=max_model_len, config=config)
    return _random_model(config, max_model_len, dtype, device)


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
