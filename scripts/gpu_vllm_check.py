"""GPU check of kvsched.vllm inside a real vLLM engine (run by scripts/gpu_vllm_check.sh on a CUDA machine).

Builds a Llama-3.2-1B-shaped model with dummy weights (``load_format="dummy"``: no download), generates greedily
from token-id prompts (``skip_tokenizer_init``) once with vLLM's own scheduler and once with
``scheduler_cls="kvsched.vllm.Scheduler"``, each in a fresh process, and compares the tokens and the
throughput. Prints one JSON line per run and a final verdict; exit status 1 if the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 16,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def run_one(model_dir: str, scheduler: str, num_prompts: int, max_tokens: int, out_path: str) -> None:
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if scheduler == "kvsched":
        kwargs["scheduler_cls"] = "kvsched.vllm.Scheduler"
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        seed=0,
        **kwargs,
    )
    rng = random.Random(0)
    shared = [rng.randrange(1000, 100000) for _ in range(256)]
    prompts = []
    for i in range(num_prompts):
        tail = [rng.randrange(1000, 100000) for _ in range(rng.randrange(16, 512))]
        prompts.append(TokensPrompt(prompt_token_ids=(shared if i % 2 else []) + tail))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:8], params)  # warm-up (CUDA graphs, compilation)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(
            {"scheduler": scheduler, "seconds": dt, "output_tokens": n, "tokens_per_s": n / dt, "tokens": tokens}, f
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--child", nargs=3, metavar=("MODEL_DIR", "SCHEDULER", "OUT"))
    args = p.parse_args()
    if args.child:
        run_one(args.child[0], args.child[1], args.num_prompts, args.max_tokens, args.child[2])
        return 0
    tmp = tempfile.mkdtemp(prefix="kvsched-gpu-vllm-")
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(LLAMA_1B, f)
    results = {}
    for sched in ("vllm", "kvsched"):
        out = os.path.join(tmp, f"{sched}.json")
        cmd = [sys.executable, __file__, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
        subprocess.run([*cmd, "--child", tmp, sched, out], check=True)
        with open(out, encoding="utf-8") as f:
            results[sched] = json.load(f)
        r = results[sched]
        print(json.dumps({k: r[k] for k in ("scheduler", "seconds", "output_tokens", "tokens_per_s")}))
    same = results["vllm"]["tokens"] == results["kvsched"]["tokens"]
    print(json.dumps({"identical_greedy_tokens": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
