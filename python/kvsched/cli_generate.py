"""``kvsched generate``: generate from a local Hugging Face model directory with :class:`kvsched.LLM`.

Exit status: 0 when every request finished; 1 when any request finished with an error (its message is on
stderr, and under ``--json`` in its record's ``error``; the other requests' outputs are printed as usual); 2 for
a bad command line, option or model directory (a one-line message on stderr, no traceback).

Nothing here imports torch until the command runs, so the ``kvsched`` parser stays fast and works without the
``torch`` extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_generate_parser", "run_generate"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty --prompt-ids")
    return ids


def add_generate_parser(subparsers: Any) -> None:
    """Add the ``generate`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "generate",
        help="generate text with a local Llama/Mistral/Qwen2 checkpoint (needs kvsched[torch])",
        description="Generate from a local Hugging Face directory (config.json + *.safetensors; "
        "tokenizer.json for text prompts) with the kvsched scheduler and its torch runner. "
        "No network access.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="model directory (a tiny random-weight one for trying things: python -m kvsched.runner.testing DIR)",
    )
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_token_ids, help='token ids "1,2,3" (repeatable)')
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (auto: float32 on cpu)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: SchedulerConfig's)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.85)
    p.add_argument("--json", action="store_true", help="one JSON object per output on stdout")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt and not args.prompt_ids:
        print("kvsched generate: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    try:
        from kvsched.engine import LLM, SamplingParams
    except ImportError as exc:  # pragma: no cover - depends on the environment
        print(f"kvsched generate: {exc}; install the torch extra: pip install 'kvsched[torch]'", file=sys.stderr)
        return 2
    from kvsched._errors import SchedulerError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            gpu_memory_fraction=args.gpu_memory_fraction,
        )
        prompts: list[Any] = [*args.prompt, *args.prompt_ids]
        outputs = llm.generate(prompts, params)
    except ImportError as exc:
        print(f"kvsched generate: {exc}; install the torch extra: pip install 'kvsched[torch]'", file=sys.stderr)
        return 2
    except (SchedulerError, ValueError, OSError) as exc:  # a bad option or model directory: no traceback
        print(f"kvsched generate: {exc}", file=sys.stderr)
        return 2
    num_errors = 0
    for i, o in enumerate(outputs):
        ttft, tpot = o.metrics.time_to_first_token, o.metrics.time_per_output_token
        if o.error is not None:
            num_errors += 1
            print(f"kvsched generate: request {i} failed: {o.error}", file=sys.stderr)
        if args.json:
            record = {
                "prompt": o.prompt,
                "prompt_token_ids": o.prompt_token_ids,
                "output_token_ids": o.output_token_ids,
                "text": o.text,
                "finish_reason": o.finish_reason,
                "error": o.error,
                "time_to_first_token_s": ttft,
                "time_per_output_token_s": tpot,
            }
            print(json.dumps(record))
            continue
        shown = o.prompt if o.prompt is not None else o.prompt_token_ids
        print(f"prompt: {shown!r}")
        print(f"output: {o.text!r}" if o.text is not None else f"output ids: {o.output_token_ids}")
        timing = f"ttft {1e3 * ttft:.1f} ms" if ttft is not None else "no tokens"
        if tpot is not None:
            timing += f", {1e3 * tpot:.1f} ms/token"
        print(f"  [{o.finish_reason}, {len(o.output_token_ids)} tokens, {timing}]")
    return 1 if num_errors else 0
