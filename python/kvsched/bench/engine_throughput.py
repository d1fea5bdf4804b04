"""Offline throughput of the engine (:class:`kvsched.LLM`) on a random-weight model, and where each step's time goes.

``python -m kvsched.bench.engine_throughput`` builds a model with Llama-3.2-1B shapes and random weights (nothing is
downloaded), then for each batch size runs that many requests (random prompts of ``--input-len`` tokens,
exactly ``--output-len`` output tokens each) through the scheduler + runner step loop and reports output
tokens/s and the share of step time spent in ``schedule()``, ``prepare_model_inputs()``, the runner's host-
side input staging, the model (forward + sampling, synchronised), ``update_from_output()`` and the engine's
bookkeeping. ``--tiny`` runs a tiny model on the CPU with small sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsched.config import DEFAULT_BLOCK_SIZE

__all__ = ["main", "run_throughput"]

PHASES = ("schedule", "prepare_inputs", "input_staging", "model", "update", "postprocess")


def _run_batch(llm: Any, batch_size: int, input_len: int, output_len: int, rng: np.random.Generator) -> dict[str, Any]:
    from kvsched.engine import SamplingParams

    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch_size):
        llm.add_request(rng.integers(10, vocab - 10, size=input_len).tolist(), params)
    totals = dict.fromkeys(PHASES, 0.0)
    sched, runner = llm.scheduler, llm.runner
    num_steps = 0
    num_output_tokens = 0
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        inputs = sched.prepare_model_inputs(out)
        t2 = time.perf_counter()
        sampled = runner.execute(out, inputs)
        t3 = time.perf_counter()
        result = sched.update_from_output(out, sampled)
        t4 = time.perf_counter()
        llm._postprocess(out, sampled, result)
        t5 = time.perf_counter()
        totals["schedule"] += t1 - t0
        totals["prepare_inputs"] += t2 - t1
        totals["input_staging"] += runner.last_prep_s
        totals["model"] += (t3 - t2) - runner.last_prep_s
        totals["update"] += t4 - t3
        totals["postprocess"] += t5 - t4
        num_output_tokens += int(np.asarray(result.num_new_tokens).sum())
        num_steps += 1
    elapsed = time.perf_counter() - start
    step_total = sum(totals.values())
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "num_steps": num_steps,
        "num_output_tokens": num_output_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_output_tokens / elapsed,
        "mean_step_ms": 1e3 * elapsed / max(1, num_steps),
        "phase_s": totals,
        "phase_share": {k: v / step_total for k, v in totals.items()} if step_total else {},
        "scheduler_share": (totals["schedule"] + totals["update"] + totals["prepare_inputs"] + totals["input_staging"])
        / step_total
        if step_total
        else 0.0,
    }


def run_throughput(
    *,
    tiny: bool,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    device: str | None,
    dtype: str,
    block_size: int,
    attention_backend: str,
    scheduler: str,
    cuda_graphs: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    import torch

    from kvsched.engine import LLM
    from kvsched.runner.config import llama_3_2_1b_config, tiny_config

    config = tiny_config() if tiny else llama_3_2_1b_config()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    scheduler_cls: Any = None
    if scheduler == "reference":
        from kvsched.reference import ReferenceScheduler

        scheduler_cls = ReferenceScheduler
    max_seqs = max(batch_sizes)
    kv_blocks_needed = max_seqs * -(-(input_len + output_len) // block_size) + 1
    llm = LLM(
        config,
        dtype=dtype,
        device=dev,
        block_size=block_size,
        num_blocks=kv_blocks_needed if dev == "cpu" else None,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(8192, input_len),
        max_model_len=input_len + output_len,
        attention_backend=attention_backend,
        enable_cuda_graphs=cuda_graphs,
        scheduler_cls=scheduler_cls,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    _run_batch(llm, 2, min(input_len, 32), 4, rng)  # warm-up: kernel compilation, allocator
    results = [_run_batch(llm, b, input_len, output_len, rng) for b in batch_sizes]
    return {
        "device": str(llm.device) + (f" ({torch.cuda.get_device_name()})" if llm.device.type == "cuda" else ""),
        "dtype": str(llm.dtype).replace("torch.", ""),
        "model": "tiny" if tiny else "llama-3.2-1b-shapes (random weights)",
        "attention_backend": llm.runner.backend.name,
        "cuda_graphs": llm.runner.decode_graphs is not None,
        "scheduler": type(llm.scheduler).__name__,
        "num_blocks": llm.runner.num_blocks,
        "block_size": block_size,
        "results": results,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"model: {report['model']} | device: {report['device']} | dtype: {report['dtype']} | "
        f"attention: {report['attention_backend']} | cuda graphs: {report['cuda_graphs']} | "
        f"scheduler: {report['scheduler']} | "
        f"KV blocks: {report['num_blocks']} x {report['block_size']}",
        f"{'batch':>6} {'in/out':>9} {'steps':>6} {'out tok/s':>11} {'step ms':>8} "
        + " ".join(f"{p:>14}" for p in PHASES)
        + f" {'sched+prep':>10}",
    ]
    for r in report["results"]:
        shares = " ".join(f"{100 * r['phase_share'].get(p, 0):13.1f}%" for p in PHASES)
        lines.append(
            f"{r['batch_size']:>6} {r['input_len']:>4}/{r['output_len']:<4} {r['num_steps']:>6} "
            f"{r['output_tokens_per_s']:>11,.1f} {r['mean_step_ms']:>8.2f} {shares} "
            f"{100 * r['scheduler_share']:9.1f}%"
        )
    lines.append(
        "shares are of summed step time; sched+prep = schedule + prepare_inputs + input_staging + update "
        "(everything but the model and the engine's bookkeeping)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsched.bench.engine_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU with small sizes (smoke test)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,64,256; --tiny: 1,4,8)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128; --tiny: 16)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 128; --tiny: 8)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; --tiny: cpu)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16, float32 (default bfloat16; cpu: float32)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--attention-backend", default="auto", help="auto, triton or torch")
    p.add_argument("--scheduler", default="rust", choices=("rust", "reference"))
    p.add_argument("--cuda-graphs", action="store_true", help="replay CUDA graphs for decode-only steps")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    tiny = bool(args.tiny)
    batch_sizes = [int(x) for x in (args.batch_sizes or ("1,4,8" if tiny else "1,64,256")).split(",")]
    device = args.device or ("cpu" if tiny else None)
    dtype = args.dtype or ("float32" if tiny or device == "cpu" else "bfloat16")
    report = run_throughput(
        tiny=tiny,
        batch_sizes=batch_sizes,
        input_len=args.input_len or (16 if tiny else 128),
        output_len=args.output_len or (8 if tiny else 128),
        device=device,
        dtype=dtype,
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        scheduler=args.scheduler,
        cuda_graphs=args.cuda_graphs,
    )
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
