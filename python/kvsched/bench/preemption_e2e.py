"""End-to-end tokens/s of the three preemption modes on a long-context pressure workload (the engine, not the
scheduler alone).

``python -m kvsched.bench.preemption_e2e`` builds a random-weight model with Llama-3.2-1B shapes (nothing is
downloaded) and a KV cache of ``--num-blocks`` blocks, too small for the batch, then runs the same requests
(``--num-requests`` prompts of ``--min-prompt``..``--max-prompt`` random tokens, ``--output-len`` output tokens,
all added at once) through :class:`kvsched.LLM` once per mode in ``--modes``. For each mode it reports output
tokens/s, wall time, steps, preemptions, blocks swapped out/in, tokens recomputed after preemptions, every token
computed, and (auto) the cost constants the engine measured at start-up. Meant for a GPU; ``--tiny`` runs a tiny
model on the CPU with small sizes (a smoke test).
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

__all__ = ["main", "run_modes"]


def run_modes(
    *,
    tiny: bool,
    modes: Sequence[str],
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: int,
    num_blocks: int,
    num_cpu_blocks: int,
    device: str | None,
    dtype: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
) -> dict[str, Any]:
    import torch

    from kvsched.engine import LLM, SamplingParams
    from kvsched.runner.config import llama_3_2_1b_config, tiny_config

    config = tiny_config() if tiny else llama_3_2_1b_config()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    prompts = [rng.integers(10, config.vocab_size - 10, size=int(n)).tolist() for n in lens]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    results = []
    for mode in modes:
        llm = LLM(
            config,
            dtype=dtype,
            device=dev,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=num_requests,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=prompt_len[1] + output_len,
            preemption_mode=mode,  # type: ignore[arg-type]
            num_cpu_blocks=num_cpu_blocks if mode != "recompute" else 0,
            seed=seed,
        )
        llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        before = llm.scheduler.stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        st = llm.scheduler.stats()
        num_out = sum(len(o.output_token_ids) for o in outs)
        results.append(
            {
                "mode": mode,
                "output_tokens_per_s": num_out / wall,
                "wall_s": wall,
                "num_output_tokens": num_out,
                "num_preemptions": st.num_preemptions - before.num_preemptions,
                "num_swapped_out_blocks": st.num_swapped_out_blocks - before.num_swapped_out_blocks,
                "num_swapped_in_blocks": st.num_swapped_in_blocks - before.num_swapped_in_blocks,
                "num_swap_fallbacks": st.num_swap_fallbacks - before.num_swap_fallbacks,
                "num_recomputed_tokens": st.num_recomputed_tokens - before.num_recomputed_tokens,
                "preemption_costs": list(llm.scheduler.preemption_costs),
            }
        )
        del llm
        if dev == "cuda":
            torch.cuda.empty_cache()
    return {
        "device": dev + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else ""),
        "model": "tiny" if tiny else "llama-3.2-1b-shapes (random weights)",
        "dtype": dtype,
        "num_requests": num_requests,
        "prompt_len": list(prompt_len),
        "output_len": output_len,
        "num_blocks": num_blocks,
        "num_cpu_blocks": num_cpu_blocks,
        "block_size": block_size,
        "results": results,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']} on {report['device']}, {report['dtype']}; {report['num_requests']} requests, prompts "
        f"{report['prompt_len'][0]}-{report['prompt_len'][1]}, {report['output_len']} outputs; "
        f"{report['num_blocks']} GPU blocks, {report['num_cpu_blocks']} CPU blocks of {report['block_size']}",
        "mode       out tok/s   wall s  preempt  swap out/in blk  fallbacks  recomputed tok  costs (recompute, swap)",
    ]
    for r in report["results"]:
        costs = ", ".join(f"{c:.3g}" for c in r["preemption_costs"])
        lines.append(
            f"{r['mode']:<9} {r['output_tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} {r['num_preemptions']:>8} "
            f"{r['num_swapped_out_blocks']:>8}/{r['num_swapped_in_blocks']:<8} {r['num_swap_fallbacks']:>9} "
            f"{r['num_recomputed_tokens']:>15}  {costs}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsched.bench.preemption_e2e", description=__doc__)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU with small sizes (smoke test)")
    p.add_argument("--modes", default="recompute,swap,auto")
    p.add_argument("--num-requests", type=int, default=None, help="default 64; --tiny: 8")
    p.add_argument("--min-prompt", type=int, default=None, help="default 2000; --tiny: 40")
    p.add_argument("--max-prompt", type=int, default=None, help="default 8000; --tiny: 120")
    p.add_argument("--output-len", type=int, default=None, help="default 256; --tiny: 24")
    p.add_argument("--num-blocks", type=int, default=None, help="GPU KV blocks (default 8000; --tiny: 20)")
    p.add_argument("--num-cpu-blocks", type=int, default=None, help="CPU swap-pool blocks (default 8000; --tiny: 64)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; --tiny: cpu)")
    p.add_argument("--dtype", default=None, help="default bfloat16; --tiny: float32")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    t = args.tiny

    def pick(value: Any, full: Any, tiny: Any) -> Any:
        return value if value is not None else (tiny if t else full)

    report = run_modes(
        tiny=t,
        modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        num_requests=pick(args.num_requests, 64, 8),
        prompt_len=(pick(args.min_prompt, 2000, 40), pick(args.max_prompt, 8000, 120)),
        output_len=pick(args.output_len, 256, 24),
        num_blocks=pick(args.num_blocks, 8000, 20),
        num_cpu_blocks=pick(args.num_cpu_blocks, 8000, 64),
        device=pick(args.device, None, "cpu"),
        dtype=pick(args.dtype, "bfloat16", "float32"),
        max_num_batched_tokens=2048 if t else 8192,
    )
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
