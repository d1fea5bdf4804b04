"""A torch model runner for kvsched: a Llama-family decoder over a paged KV cache.

Needs the ``torch`` extra (``pip install '.[torch]'`` in kvsched's repository root). Names are loaded lazily, so
importing the package does not import torch. The runner sits below the engine: nothing here imports
:mod:`kvsched.engine`, the CLI, the benchmarks or the simulator (``tests/test_layering.py`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention import (
        AttentionMetadata,
        TorchReferenceBackend,
        allocate_kv_cache,
        kv_cache_bytes_per_block,
        num_blocks_for_memory,
    )
    from .config import ModelConfig, llama_3_2_1b_config, tiny_config
    from .host_memory import keep_freed_memory
    from .loader import load_model, resolve_dtype
    from .model import LlamaForCausalLM
    from .model_runner import ModelRunner
    from .sampler import apply_top_k_top_p, sample

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelRunner",
    "TorchReferenceBackend",
    "allocate_kv_cache",
    "apply_top_k_top_p",
    "keep_freed_memory",
    "kv_cache_bytes_per_block",
    "llama_3_2_1b_config",
    "load_model",
    "num_blocks_for_memory",
    "resolve_dtype",
    "sample",
    "tiny_config",
]

_LAZY = {
    "AttentionMetadata": "attention",
    "TorchReferenceBackend": "attention",
    "allocate_kv_cache": "attention",
    "kv_cache_bytes_per_block": "attention",
    "num_blocks_for_memory": "attention",
    "ModelConfig": "config",
    "llama_3_2_1b_config": "config",
    "tiny_config": "config",
    "keep_freed_memory": "host_memory",
    "load_model": "loader",
    "resolve_dtype": "loader",
    "LlamaForCausalLM": "model",
    "ModelRunner": "model_runner",
    "apply_top_k_top_p": "sampler",
    "sample": "sampler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsched.runner' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
