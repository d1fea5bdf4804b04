"""Run one workload through a real vLLM engine twice, with vLLM's scheduler and with ``kvsched.vllm.Scheduler``.

Used by ``tests/test_vllm_e2e*.py`` and ``scripts/vllm_cpu_throughput.py``. The engine is vLLM's ``LLMEngine``
with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped one call at a time, so that
requests are added and aborted at the same engine step in both runs; request ids are not randomised, so both runs
see the same ids. A workload is a list of :class:`Req`: prompts that share prefixes, lengths, priorities, the step
at which each arrives and, for some, the step at which it is aborted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import time
from collections.abc import Iterator
from typing import Any

# The engine core in this process (deterministic steps), request ids as given, no GPU needed to import vLLM.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}

KVSCHED = "kvsched.vllm.Scheduler"


@dataclasses.dataclass
class Req:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True
    priority: int = 0
    arrival_time: float = 0.0
    add_at_step: int = 0
    abort_at_step: int | None = None


@dataclasses.dataclass
class Result:
    """What one run produced: per request, its output tokens and finish reason (None: aborted before it
    finished), and the engine's counters."""

    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str | None]
    num_steps: int
    wall_s: float
    num_preemptions: int
    scheduler_name: str


def make_workload(
    seed: int,
    num_requests: int,
    *,
    vocab_size: int = 512,
    prefix_lens: tuple[int, ...] = (40, 150, 300),
    suffix_len: tuple[int, int] = (1, 60),
    max_tokens: tuple[int, int] = (1, 48),
    arrive_over_steps: int = 0,
    priorities: bool = False,
    abort_fraction: float = 0.0,
    eos_fraction: float = 0.0,
) -> list[Req]:
    """Prompts built from a few shared prefixes plus a random suffix (about a quarter without a prefix)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, vocab_size) for _ in range(n)] for n in prefix_lens]
    reqs = []
    for i in range(num_requests):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.75 else []
        prompt += [rng.randrange(4, vocab_size) for _ in range(rng.randrange(*suffix_len))]
        add = rng.randrange(arrive_over_steps) if arrive_over_steps else 0
        abort = add + rng.randrange(1, 12) if rng.random() < abort_fraction else None
        reqs.append(
            Req(
                req_id=f"req-{i}",
                prompt_token_ids=prompt,
                max_tokens=rng.randrange(*max_tokens),
                ignore_eos=rng.random() >= eos_fraction,
                priority=rng.randrange(3) if priorities else 0,
                arrival_time=1000.0 + i,
                add_at_step=add,
                abort_at_step=abort,
            )
        )
    return reqs


@contextlib.contextmanager
def engine_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_engine(
    model: str,
    scheduler_cls: Any,
    *,
    async_scheduling: bool = False,
    executor: Any = None,
    **engine_kwargs: Any,
) -> Any:
    """vLLM's ``LLMEngine`` on ``model`` with its engine core in this process. ``async_scheduling`` is set after
    the configuration is built (vLLM's CPU platform turns it off); ``executor`` is an ``Executor`` class (None:
    vLLM's own for the platform)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import Executor

    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "enforce_eager": True,
        "gpu_memory_utilization": 0.05,
        "seed": 0,
        "disable_log_stats": False,
        **engine_kwargs,
    }
    if scheduler_cls is not None:
        kwargs["scheduler_cls"] = scheduler_cls
    if executor is not None:
        kwargs["distributed_executor_backend"] = executor
    config = EngineArgs(**kwargs).create_engine_config()
    config.scheduler_config.async_scheduling = async_scheduling
    return LLMEngine(config, executor_class=Executor.get_class(config), log_stats=True, multiprocess_mode=False)


def engine_scheduler(engine: Any) -> Any:
    """The scheduler object inside an in-process ``LLMEngine``."""
    return engine.engine_core.engine_core.scheduler


def _num_preemptions(engine: Any) -> int:
    for metric in engine.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(metric.value)
    raise AssertionError("the engine reports no vllm:num_preemptions metric")


def drive(engine: Any, workload: list[Req], *, max_steps: int = 20_000) -> Result:
    """Adds, aborts and steps as the workload says until every request is done; the outputs."""
    from vllm import SamplingParams

    by_add: dict[int, list[Req]] = {}
    by_abort: dict[int, list[str]] = {}
    for r in workload:
        by_add.setdefault(r.add_at_step, []).append(r)
        if r.abort_at_step is not None:
            by_abort.setdefault(r.abort_at_step, []).append(r.req_id)
    last_add = max(by_add) if by_add else 0
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    t0 = time.perf_counter()
    step = 0
    while True:
        for r in by_add.get(step, ()):
            params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, detokenize=False)
            engine.add_request(
                r.req_id,
                {"prompt_token_ids": r.prompt_token_ids},
                params,
                arrival_time=r.arrival_time,
                priority=r.priority,
            )
            tokens[r.req_id] = []
            reasons[r.req_id] = None
        aborts = [rid for rid in by_abort.get(step, ()) if reasons.get(rid) is None]
        if aborts:
            engine.abort_request(aborts)
        for out in engine.step():
            completion = out.outputs[0]
            tokens[out.request_id] = list(completion.token_ids)
            if out.finished:
                reasons[out.request_id] = completion.finish_reason
        step += 1
        if step > last_add and not engine.has_unfinished_requests():
            break
        if step >= max_steps:
            raise AssertionError(f"the workload did not finish in {max_steps} engine steps")
    wall = time.perf_counter() - t0
    return Result(
        tokens=tokens,
        finish_reasons=reasons,
        num_steps=step,
        wall_s=wall,
        num_preemptions=_num_preemptions(engine),
        scheduler_name=type(engine_scheduler(engine)).__module__,
    )


def shutdown(engine: Any) -> None:
    with contextlib.suppress(Exception):
        engine.engine_core.shutdown()
    del engine
    gc.collect()


def assert_clean(engine: Any) -> None:
    """Nothing leaked: no request left in the scheduler and every KV block back in the pool."""
    sched = engine_scheduler(engine)
    assert not sched.requests, f"requests left in the scheduler: {sorted(sched.requests)[:5]}"
    assert sched.get_num_unfinished_requests() == 0
    assert sched.get_kv_cache_usage() == 0.0
    if hasattr(sched, "core"):  # kvsched: the pool is whole
        assert sched.core.num_free_blocks == sched.kv_config.num_blocks - 1


def compare(a: Result, b: Result) -> None:
    """Every request got the same tokens and the same finish reason from both runs."""
    assert sorted(a.tokens) == sorted(b.tokens)
    diff = [rid for rid in a.tokens if a.tokens[rid] != b.tokens[rid] or a.finish_reasons[rid] != b.finish_reasons[rid]]
    if diff:
        rid = diff[0]
        raise AssertionError(
            f"{len(diff)} of {len(a.tokens)} requests differ; first {rid}:\n"
            f"  vLLM's scheduler ({a.finish_reasons[rid]}): {a.tokens[rid]}\n"
            f"  kvsched          ({b.finish_reasons[rid]}): {b.tokens[rid]}"
        )
