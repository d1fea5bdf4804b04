"""kvsched.vllm.Scheduler inside vLLM's own engine (``LLMEngine`` and ``EngineCore``), with a model-free executor.

Needs vLLM (0.32 or 0.33) but no GPU, model weights or CPU build: the executor is
:class:`kvsched.vllm.testing.DeterministicExecutor`, which keeps each request's tokens and block table as vLLM's
model runner does, writes every scheduled token into a paged "KV cache" at the block ids the scheduler assigned,
and samples a hash of the context it reads back. Each workload runs twice, with vLLM's scheduler and with
kvsched's, through the same engine code: EngineCore's step (synchronous) or its batch queue (asynchronous
scheduling, a step scheduled before the previous one's output is applied), prefix caching, chunked prefill, a KV
cache small enough to preempt, priorities and aborts (also of requests in a step in flight). Every request must get
the same tokens and finish reason, the executor must see the same scheduler outputs step by step, no context it
read may be wrong, and kvsched's scheduler must end with no request and every block back.

Run: ``VLLM_TARGET_DEVICE=cpu PYTHONPATH=python:tests python -m pytest -m vllm_e2e tests/test_vllm_e2e_engine.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

from vllm_e2e import KVSCHED, assert_clean, compare, drive, engine_env, engine_scheduler, make_engine, make_workload

pytestmark = pytest.mark.vllm_e2e


def _run(scheduler_cls: Any, workload: Any, *, async_scheduling: bool, **engine_kwargs: Any) -> tuple[Any, list[Any]]:
    from kvsched.vllm.testing import DeterministicExecutor, _model_dir

    with engine_env():
        engine = make_engine(
            _model_dir(4096),
            scheduler_cls,
            async_scheduling=async_scheduling,
            executor=DeterministicExecutor,
            skip_tokenizer_init=True,
            max_model_len=512,
            **engine_kwargs,
        )
        executor = DeterministicExecutor.instances[-1]
        executor.trace = []
        result = drive(engine, workload)
        assert not executor.errors, executor.errors[:3]
        if scheduler_cls == KVSCHED:
            assert type(engine_scheduler(engine)).__module__ == "kvsched.vllm.scheduler"
            assert_clean(engine)
        trace = list(executor.trace)
        engine.engine_core.shutdown()
    return result, trace


CASES = {
    # name: (engine kwargs, workload kwargs)
    "chunked-prefix": (
        {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 256},
        {"abort_fraction": 0.1, "eos_fraction": 0.3},
    ),
    "no-prefix-cache": (
        {"enable_prefix_caching": False, "enable_chunked_prefill": True, "max_num_batched_tokens": 192},
        {"abort_fraction": 0.1},
    ),
    "no-chunked-prefill": (
        {"enable_prefix_caching": True, "enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
        {"abort_fraction": 0.05},
    ),
    "priority": (
        {"enable_prefix_caching": True, "max_num_batched_tokens": 256, "scheduling_policy": "priority"},
        {"priorities": True, "abort_fraction": 0.1},
    ),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_tokens_as_vllms_scheduler_in_the_engine(case: str, async_scheduling: bool) -> None:
    engine_kwargs, workload_kwargs = CASES[case]
    # 96 requests over 40 steps into 40 blocks of 16 tokens: admissions are limited by the pool, decodes preempt.
    workload = make_workload(7, 96, arrive_over_steps=40, **workload_kwargs)
    kwargs = {"block_size": 16, "num_gpu_blocks_override": 40, "max_num_seqs": 32, **engine_kwargs}
    ref, ref_trace = _run(None, workload, async_scheduling=async_scheduling, **kwargs)
    got, got_trace = _run(KVSCHED, workload, async_scheduling=async_scheduling, **kwargs)
    assert ref.scheduler_name.startswith("vllm."), ref.scheduler_name
    compare(ref, got)
    # Not only the tokens: the executor saw the same scheduler outputs (batch, chunks, block ids) at every step.
    assert len(ref_trace) == len(got_trace)
    first = next((i for i, (a, b) in enumerate(zip(ref_trace, got_trace, strict=True)) if a != b), None)
    assert first is None, f"step {first}:\n  vLLM:    {ref_trace[first]}\n  kvsched: {got_trace[first]}"
    assert ref.num_preemptions == got.num_preemptions
    # The workload does what it is for: preemptions happen, some requests are aborted, most finish.
    assert ref.num_preemptions > 0
    if workload_kwargs.get("abort_fraction"):
        assert any(reason is None or reason == "abort" for reason in ref.finish_reasons.values())
    assert sum(reason == "length" for reason in ref.finish_reasons.values()) > len(workload) // 2
