"""Tiny random-weight Hugging Face checkpoints for tests, device checks and trying kvsched (needs ``transformers``).

As a command, ``python -m kvsched.runner.testing DIR`` writes one to ``DIR``: ``config.json``,
``model.safetensors`` and a word-level ``tokenizer.json`` (token ``i`` is the word ``wi``), ready for
``kvsched generate --model DIR``. The same ``--seed`` gives the same weights, hence the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["TINY_KINDS", "main", "prefill_logits", "save_tiny_hf_model", "save_word_tokenizer"]

TINY_KINDS = ("llama", "llama-tied", "llama3-rope", "qwen2", "mistral")


def save_tiny_hf_model(path: str | os.PathLike[str], kind: str = "llama", *, seed: int = 0, **overrides: Any) -> Any:
    """Build a tiny ``transformers`` model of ``kind``, save it (safetensors) to ``path``; return it (eval).

    Weights are drawn with a larger spread than the default initialiser so greedy argmaxes are not near-ties.
    """
    import torch
    import transformers

    common: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 512,
        "initializer_range": 0.15,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }
    if kind in ("llama", "llama-tied", "llama3-rope"):
        extra: dict[str, Any] = {"tie_word_embeddings": kind == "llama-tied"}
        if kind == "llama3-rope":
            extra["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
            extra["rope_theta"] = 500000.0
        config: Any = transformers.LlamaConfig(**{**common, **extra, **overrides})
        model_cls: Any = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
        model_cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{**common, "sliding_window": None, **overrides})
        model_cls = transformers.MistralForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {TINY_KINDS}")
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    if kind == "qwen2":
        # Give the q/k/v biases non-zero values so the test proves they are loaded.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    model.save_pretrained(os.fspath(path), safe_serialization=True)
    return model


def save_word_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> None:
    """Write a word-level ``tokenizer.json`` to ``path``: token ``i`` is the word ``wi``, words are split on
    whitespace and an unknown word is ``w0``, so ``"w5 w6 w7"`` encodes to ``[5, 6, 7]`` (needs ``tokenizers``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment, unused-ignore]
    tok.decoder = decoders.WordPiece()  # type: ignore[assignment, unused-ignore]
    tok.save(os.path.join(os.fspath(path), "tokenizer.json"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvsched.runner.testing DIR``: write a tiny random-weight model to ``DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvsched.runner.testing",
        description="Write a tiny random-weight Hugging Face model to DIR (config.json, model.safetensors and a "
        "word-level tokenizer.json whose token i is the word 'wi'), to try kvsched generate and kvsched.LLM "
        "without a download. The same seed gives the same weights. Needs torch and transformers.",
    )
    parser.add_argument("dir", help="the directory to write (created if missing)")
    parser.add_argument("--kind", choices=TINY_KINDS, default="llama", help="architecture (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    parser.add_argument(
        "--max-position-embeddings", type=int, default=512, help="the model's positions (default %(default)s)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer.json (token-id prompts only)")
    args = parser.parse_args(argv)
    prog = parser.prog
    if args.max_position_embeddings < 2:
        print(f"{prog}: --max-position-embeddings must be >= 2, got {args.max_position_embeddings}", file=sys.stderr)
        return 2
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        print(f"{prog}: {args.dir!r} exists and is not a directory", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print(f"{prog}: needs transformers and torch: pip install transformers torch", file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call, unused-ignore]
    try:
        model = save_tiny_hf_model(
            args.dir, args.kind, seed=args.seed, max_position_embeddings=args.max_position_embeddings
        )
        if not args.no_tokenizer:
            save_word_tokenizer(args.dir, int(model.config.vocab_size))
    except OSError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    prompt = "--prompt-ids 5,6,7" if args.no_tokenizer else "--prompt 'w5 w6 w7'"
    print(f"wrote a tiny {args.kind} model to {args.dir}; try:")
    print(f"  kvsched generate --model {args.dir} {prompt} --max-tokens 8 --temperature 0")
    return 0


def prefill_logits(model: Any, token_ids: list[int], *, block_size: int = 8, backend: Any = None) -> Any:
    """Float32 logits at every position of one prompt, run as a single prefill through our paged path."""
    import numpy as np
    import torch

    from .attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_cache

    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_cache(
        num_layers=cfg.num_hidden_layers,
        num_blocks=num_blocks + 1,
        block_size=block_size,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
        device=device,
    )
    # Blocks 1..num_blocks in reverse order, so a wrong block-table lookup cannot pass by accident.
    blocks = np.arange(num_blocks, 0, -1, dtype=np.int32)
    positions = np.arange(n)
    slots = blocks[positions // block_size].astype(np.int64) * block_size + positions % block_size
    qsl = np.array([0, n], np.int32)
    seq_lens = np.array([n], np.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.from_numpy(blocks[None, :].copy()).to(device),
        num_reqs=1,
        max_query_len=n,
        max_seq_len=n,
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    with torch.inference_mode():
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        hidden = model(ids, torch.arange(n, device=device), caches, meta, backend or TorchReferenceBackend())
        return model.compute_logits(hidden)


if __name__ == "__main__":
    sys.exit(main())
