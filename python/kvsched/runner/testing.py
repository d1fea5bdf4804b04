"""Tiny random-weight Hugging Face checkpoints for tests and device checks (needs ``transformers``)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["TINY_KINDS", "prefill_logits", "save_tiny_hf_model"]

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
