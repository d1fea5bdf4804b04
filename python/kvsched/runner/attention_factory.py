"""The attention backend a runner uses, by name: the factory, kept apart from the backends it chooses among.

The backends live in :mod:`kvsched.runner.attention` (the interface, the batch metadata and the torch reference)
and :mod:`kvsched.runner.triton_attention` (the Triton kernel, which builds on the first). Choosing between them
needs both, so it sits above both: no backend module imports the module that selects it.
"""

from __future__ import annotations

import os

import torch

from .attention import AttentionBackend, TorchReferenceBackend

__all__ = ["make_backend"]


def make_backend(name: str, device: torch.device, block_size: int, head_dim: int) -> AttentionBackend:
    """``"auto"`` picks the Triton kernel on CUDA when it applies, else the reference."""
    if name == "auto":
        usable = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        name = "triton" if usable and block_size >= 16 and _triton_available() else "torch"
    if name == "torch":
        return TorchReferenceBackend()
    if name == "triton":
        # Imported on use: triton is optional (a CPU install of torch comes without it).
        from .triton_attention import TritonPagedBackend

        return TritonPagedBackend()
    raise ValueError(f"unknown attention backend {name!r} (auto, torch, triton)")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
