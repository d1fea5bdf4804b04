"""Throughput of a vLLM engine with its own scheduler and with ``kvsched.vllm.Scheduler``, in vLLM's CPU build.

The model is a tiny random Llama (2 layers, hidden 128, written on the fly by
``kvsched.vllm.testing.save_tiny_llama``), small enough that the scheduler is a visible share of each engine step.
For each concurrency (64 and 256 by default) every request is added at once (prompts of 32-64 tokens, greedy,
128 output tokens each, EOS ignored) and vLLM's ``LLMEngine`` is stepped until all are done, with its engine core in
this process so that each step can be timed. The KV cache holds every request (no preemption); both schedulers run
the same steps. Runs alternate between the schedulers (``--repeat`` rounds, after one warm-up round) and the table
gives the median of each metric, each both in wall-clock time and in the process's CPU time (on a machine shared
with other jobs the wall-clock figures include the time other processes had the CPU; the CPU-time ones do not):

- output tokens/s: output tokens over the time from the first step to the last;
- mean step time: that time over the number of ``engine.step()`` calls (schedule, model, output processing);
- scheduler time per step: ``schedule()`` plus ``update_from_output()`` (timed around the scheduler's two methods,
  in the engine thread's CPU time).

Usage (in an environment made by ``scripts/make_vllm_cpu_venv.sh``, from the repository root):

    PYTHONPATH=python VENV/bin/python scripts/vllm_cpu_throughput.py [--concurrency 64,256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.update(
    {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its steps can be timed
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
)

SCHEDULERS = {"vllm": None, "kvsched": "kvsched.vllm.Scheduler"}


def _engine(model: str, scheduler_cls: str | None, concurrency: int, args: argparse.Namespace) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.abstract import Executor

    block_size = 128  # the CPU backend's
    tokens_per_request = args.max_prompt_len + args.output_len
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "enforce_eager": True,
        "gpu_memory_utilization": 0.05,
        "seed": 0,
        "disable_log_stats": False,
        "max_model_len": 1024,
        "max_num_seqs": concurrency,
        "max_num_batched_tokens": max(8192, concurrency),
        "num_gpu_blocks_override": concurrency * -(-tokens_per_request // block_size) + 8,
        "enable_prefix_caching": True,
    }
    if scheduler_cls:
        kwargs["scheduler_cls"] = scheduler_cls
    config = EngineArgs(**kwargs).create_engine_config()
    config.scheduler_config.async_scheduling = args.async_scheduling
    return LLMEngine(config, executor_class=Executor.get_class(config), log_stats=True, multiprocess_mode=False)


def _timed(sched: Any, name: str, acc: list[float]) -> None:
    method = getattr(sched, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return method(*a, **k)
        finally:
            acc[0] += time.thread_time() - t

    setattr(sched, name, wrapper)


def run_once(model: str, scheduler: str, concurrency: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from vllm import SamplingParams

    engine = _engine(model, SCHEDULERS[scheduler], concurrency, args)
    try:
        sched = engine.engine_core.engine_core.scheduler
        sched_s = [0.0]
        _timed(sched, "schedule", sched_s)
        _timed(sched, "update_from_output", sched_s)
        rng = random.Random(seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        for i in range(concurrency):
            prompt = [rng.randrange(4, 512) for _ in range(rng.randrange(args.min_prompt_len, args.max_prompt_len + 1))]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        num_steps = 0
        num_tokens = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    num_tokens += len(out.outputs[0].token_ids)
            num_steps += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        preemptions = next(int(m.value) for m in engine.get_metrics() if m.name == "vllm:num_preemptions")
        return {
            "scheduler": scheduler,
            "concurrency": concurrency,
            "output_tokens": num_tokens,
            "steps": num_steps,
            "wall_s": wall,
            "cpu_s": cpu,
            "output_tokens_per_s": num_tokens / wall,
            "output_tokens_per_cpu_s": num_tokens / cpu,
            "mean_step_ms": 1e3 * wall / num_steps,
            "mean_step_cpu_ms": 1e3 * cpu / num_steps,
            "scheduler_cpu_us_per_step": 1e6 * sched_s[0] / num_steps,
            "preemptions": preemptions,
        }
    finally:
        engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="64,256", help="comma-separated numbers of concurrent requests")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds (each runs both schedulers)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=64)
    p.add_argument(
        "--async-scheduling", action="store_true", help="vLLM's batch queue (the CPU platform's default is off)"
    )
    p.add_argument("--json", help="also write every run as a JSON line to this file")
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads for the model")
    args = p.parse_args(argv)
    # Fixed before torch is imported. One by default: on a machine shared with other jobs, OpenMP threads that wait
    # for each other at every operator make the model's steps erratic.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from kvsched.vllm.testing import save_tiny_llama

    model = save_tiny_llama(tempfile.mkdtemp(prefix="kvsched-tiny-llama-"))
    import vllm

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(
        f"# {cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at start; "
        f"vLLM {vllm.__version__}, Python {platform.python_version()}, OMP_NUM_THREADS "
        f"{os.environ['OMP_NUM_THREADS']}, async scheduling {args.async_scheduling}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    for rnd in range(args.repeat + 1):  # round 0 warms up (imports, allocator, caches) and is not reported
        for c in concurrencies:
            order = list(SCHEDULERS) if rnd % 2 == 0 else list(reversed(SCHEDULERS))
            for scheduler in order:
                r = run_once(model, scheduler, c, args, seed=c)
                r["round"] = rnd
                print(json.dumps(r), file=sys.stderr, flush=True)
                if rnd:
                    runs.append(r)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end; medians of {args.repeat} rounds; wall clock / CPU time")
    print(
        "| concurrent requests | scheduler | output tokens/s | mean step time (ms) | scheduler time per step (µs, CPU) "
        "| scheduler share of the step (CPU) |"
    )
    print("|--:|---|--:|--:|--:|--:|")
    for c in concurrencies:
        for scheduler in SCHEDULERS:
            rs = [r for r in runs if r["concurrency"] == c and r["scheduler"] == scheduler]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
            share = med["scheduler_cpu_us_per_step"] / (1e3 * med["mean_step_cpu_ms"])
            print(
                f"| {c} | {scheduler} | {med['output_tokens_per_s']:,.0f} / {med['output_tokens_per_cpu_s']:,.0f} | "
                f"{med['mean_step_ms']:.1f} / {med['mean_step_cpu_ms']:.1f} | "
                f"{med['scheduler_cpu_us_per_step']:,.0f} | {share:.0%} |"
            )
        # Both schedulers ran the same steps (same batches), so the comparison is like for like.
        steps = {r["steps"] for r in runs if r["concurrency"] == c}
        preempted = sum(r["preemptions"] for r in runs if r["concurrency"] == c)
        print(f"# {c} concurrent: engine steps {sorted(steps)}, preemptions {preempted}")
    if args.json:
        with open(args.json, "w") as f:
            for r in runs:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
