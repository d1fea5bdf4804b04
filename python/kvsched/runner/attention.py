"""Paged attention over a ragged batch of mixed prefill and decode requests.

The KV cache of a layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. Request
``i`` owns the query rows ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch; its keys are the
first ``seq_lens[i]`` slots of its block table, and its queries are its *last* ``q_len`` positions, so query
``t`` (0-based within the request) sees keys ``0 ..= seq_lens[i] - q_len + t``.

Backends:

* :class:`TorchReferenceBackend` gathers each request's K/V through its block table and runs a masked causal
  softmax in float32, one request at a time. Works anywhere; it is the ground truth for the others.
* :class:`TritonPagedBackend` (``kvsched.runner.triton_attention``) reads the paged cache directly in one
  kernel launch per layer for the whole batch; GPU (or ``TRITON_INTERPRET=1`` on the CPU for tests).

``kvsched.runner.attention_factory.make_backend`` chooses one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchReferenceBackend",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "num_blocks_for_memory",
]


@dataclass
class AttentionMetadata:
    """Device tensors (and a few host copies) describing one step's batch."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [n+1]
    seq_lens: torch.Tensor  # int32 [n]
    block_table: torch.Tensor  # int32 [n, max_blocks]
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so a per-request loop needs no device sync.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]`` for queries ``q`` ``[T, num_heads, head_dim]``."""
        ...


class TorchReferenceBackend:
    """Gather K/V by block table, masked causal attention in float32; a loop over requests."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        num_heads = q.shape[1]
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        group = num_heads // num_kv_heads
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_reqs):
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q_len = end - start
            if q_len == 0:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_table[i, :num_blocks].long()
            k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
            v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
            k = k.repeat_interleave(group, dim=1)  # [S, H, D]
            v = v.repeat_interleave(group, dim=1)
            qi = q[start:end].float()  # [q_len, H, D]
            scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        return out


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_memory(
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gpu_memory_fraction: float,
    activation_reserve_bytes: int = 0,
    device: torch.device | None = None,
) -> int:
    """Number of KV blocks (including the null block) that fit in ``gpu_memory_fraction`` of the GPU.

    Call it after the weights are loaded: ``budget = total * fraction - in_use - activation_reserve``, where
    ``in_use`` is what the device already holds (weights, other processes).
    """
    if not 0.0 < gpu_memory_fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
    torch.cuda.empty_cache()  # blocks cached by the allocator (e.g. float32 weights before a cast) are free
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_fraction) - (total - free) - activation_reserve_bytes
    per_block = kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    num_blocks = budget // per_block
    if num_blocks < 2:
        raise RuntimeError(
            f"no room for the KV cache: budget {budget} bytes at gpu_memory_fraction={gpu_memory_fraction}, "
            f"{per_block} bytes per block; raise gpu_memory_fraction or lower max_num_batched_tokens"
        )
    return int(num_blocks)


def allocate_kv_cache(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_dim]``, zero-filled."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
