"""Engine faults: a runner that raises in the middle of ``LLM.step()`` ends that step's requests with an error and
the engine goes on (``Scheduler.fail_step``): the other requests match transformers' greedy output, the scheduler
stays consistent, no block leaks, and nothing the failed step never computed is served from the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")

from conftest import all_scheduler_classes, default_scheduler_cls, hf_greedy  # noqa: E402
from kvsched.engine import LLM, SamplingParams  # noqa: E402

SCHEDULER_CLS = default_scheduler_cls()
SCHEDULERS = all_scheduler_classes()
NUM_BLOCKS = 64
MAX_TOKENS = 6


class RunnerFault(RuntimeError):
    pass


def fail_on_steps(llm: LLM, steps: set[int] | Callable[[Any], bool]) -> list[list[str]]:
    """Make ``llm``'s runner raise on the given engine steps (1-based numbers, or a predicate of the step's
    ``SchedulerOutput``), before it runs anything; returns, per failed step, the ids it held."""
    execute: Callable[..., Any] = llm.runner.execute
    calls = [0]
    failed: list[list[str]] = []

    def flaky(out: Any, inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] in steps if isinstance(steps, set) else steps(out):
            failed.append(list(out.req_ids))
            raise RunnerFault(f"injected fault in step {calls[0]}")
        return execute(out, inputs)

    llm.runner.execute = flaky  # type: ignore[method-assign]
    return failed


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 300, (16,), generator=g).tolist()  # two full 8-token blocks
    return [
        [*shared, *torch.randint(3, 300, (5,), generator=g).tolist()],
        torch.randint(3, 300, (19,), generator=g).tolist(),
        [*shared, *torch.randint(3, 300, (3,), generator=g).tolist()],
        torch.randint(3, 300, (9,), generator=g).tolist(),
        torch.randint(3, 300, (12,), generator=g).tolist(),
    ]


def _llm(path: Path, scheduler_cls: Any, async_scheduling: bool) -> LLM:
    # Two requests run at a time, so a failed step holds some requests and others are still waiting.
    return LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=NUM_BLOCKS,
        max_num_seqs=2,
        scheduler_cls=scheduler_cls,
        async_scheduling=async_scheduling,
    )


@pytest.mark.parametrize("scheduler_cls", SCHEDULERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail_step", [1, 4], ids=["prefill-step", "decode-step"])
def test_a_runner_fault_ends_its_step_with_an_error_and_the_rest_goes_on(
    tiny_llama: tuple[Path, Any], scheduler_cls: Any, async_scheduling: bool, fail_step: int
) -> None:
    path, hf = tiny_llama
    prompts = _prompts()
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    llm = _llm(path, scheduler_cls, async_scheduling)
    failed_steps = fail_on_steps(llm, {fail_step})
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)

    assert llm.num_failed_steps == 1 and len(failed_steps) == 1
    failed = set(failed_steps[0])
    assert failed, "the failed step scheduled nothing"
    assert len(failed) < len(prompts)
    for rid, o, want in zip([o.request_id for o in outs], outs, expected, strict=True):
        if rid in failed:
            assert o.finish_reason == "error" and o.outputs[0].finish_reason == "error"
            assert o.error is not None and "RunnerFault: injected fault in step" in o.error
            # Tokens sampled before the fault are kept, and they are the right ones.
            assert o.output_token_ids == want[: len(o.output_token_ids)]
            assert len(o.output_token_ids) < MAX_TOKENS
        else:
            assert o.error is None and o.finish_reason in ("length", "stop")
            assert o.output_token_ids == want
    sched = llm.scheduler
    sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == NUM_BLOCKS - 1  # nothing leaked
    assert llm.runner.num_requests == 0

    # The failed requests' prompts again: whatever the failed step cached was taken out of the prefix cache, so
    # they are recomputed (or hit only blocks computed by successful steps) and give transformers' tokens.
    retry = [p for p, o in zip(prompts, outs, strict=True) if o.request_id in failed]
    again = llm.generate(retry, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    assert [o.output_token_ids for o in again] == hf_greedy(hf, retry, MAX_TOKENS)
    sched.check_invariants()
    assert sched.num_free_blocks == NUM_BLOCKS - 1


@pytest.mark.parametrize("scheduler_cls", SCHEDULERS, ids=lambda c: c.__name__)
def test_a_failed_prefill_leaves_nothing_in_the_prefix_cache(tiny_llama: tuple[Path, Any], scheduler_cls: Any) -> None:
    path, _ = tiny_llama
    prompts = _prompts()
    llm = _llm(path, scheduler_cls, False)
    fail_on_steps(llm, {1})
    llm.add_request(prompts[0], SamplingParams(max_tokens=3, temperature=0.0))
    (out,) = llm.step()
    assert out.finish_reason == "error" and out.output_token_ids == []
    # Its two full blocks were entered into the cache when the step was scheduled; the failure took them out.
    assert llm.scheduler.get_num_cached_tokens(prompts[0]) == 0
    assert llm.scheduler.get_num_cached_tokens(prompts[2]) == 0
    # A successful prefill of the same prompt caches them again.
    llm.add_request(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
    (done,) = llm.step()
    assert done.finish_reason == "length"
    assert llm.scheduler.get_num_cached_tokens(prompts[2]) == 16
    llm.scheduler.check_invariants()


def test_every_step_failing_ends_every_request_with_an_error(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    llm = _llm(path, SCHEDULER_CLS, False)
    fail_on_steps(llm, set(range(1, 100)))
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error"] * len(outs)
    assert llm.num_failed_steps == 3  # two requests per step
    assert llm.scheduler.num_free_blocks == NUM_BLOCKS - 1
    llm.scheduler.check_invariants()


@pytest.mark.parametrize("scheduler_cls", SCHEDULERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("copy", ["swap_out", "swap_in"])
def test_a_fault_with_swaps_in_flight(tiny_llama: tuple[Path, Any], scheduler_cls: Any, copy: str) -> None:
    """A tight pool that swaps victims to the CPU pool; the runner fails the first step with a ``copy`` to do
    (before doing it). swap_out: the step's victims give their CPU blocks back and recompute when resumed (their
    copy never ran). swap_in: the resumed request is in the failed step, so it ends with the error. Every other
    request still gets transformers' tokens; no GPU or CPU block leaks."""
    path, hf = tiny_llama
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (30, 26, 34, 22, 28, 18)]
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=16,
        max_num_batched_tokens=48,
        scheduler_reserve_full_isl=False,
        scheduler_cls=scheduler_cls,
        preemption_mode="swap",
        num_cpu_blocks=64,
    )
    victims: list[str] = []

    def first_with_copy(out: Any) -> bool:
        if not victims and len(getattr(out, copy)):
            victims.extend(out.preempted_req_ids)
            return True
        return False

    failed_steps = fail_on_steps(llm, first_with_copy)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert len(failed_steps) == 1, "no step had a swap to fail"
    failed = set(failed_steps[0])
    expected = hf_greedy(hf, prompts, 12)
    for o, want in zip(outs, expected, strict=True):
        if o.request_id in failed:
            assert o.finish_reason == "error"
            assert o.output_token_ids == want[: len(o.output_token_ids)]
        else:
            assert o.finish_reason == "length" and o.output_token_ids == want
    st = llm.scheduler.stats()
    if copy == "swap_out":
        # The victims of the failed step went on (recomputed) and got the right tokens.
        assert victims and not failed.intersection(victims)
        assert all(o.finish_reason == "length" for o in outs if o.request_id in victims)
        assert st.num_swapped_out_reqs > 0 and st.num_recomputed_tokens > 0, st
    else:
        assert st.num_swapped_in_blocks > 0, st
    sched = llm.scheduler
    sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == 15 and st.num_free_cpu_blocks == 64
