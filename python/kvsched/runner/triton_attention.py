"""A Triton paged-attention kernel for mixed prefill + decode batches, one launch per layer.

Grid: ``(request, query tile, kv head)``. A program loads ``BLOCK_Q`` query tokens of one request for all the
query heads that share one KV head (``BLOCK_Q * num_queries_per_kv`` rows, so a decode step still fills a
tensor-core tile with GQA), then walks the request's block table one KV block at a time with an online
softmax, reading K/V straight from the paged cache. Tiles past a request's query length exit at once, so the
grid can be sized by the longest query of the step. Needs ``block_size >= 16`` (the smallest ``tl.dot``
extent).

Tested on the CPU with ``TRITON_INTERPRET=1`` (tests/test_runner_attention.py) and against the reference
backend on a GPU (``-m gpu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import AttentionMetadata

__all__ = ["TritonPagedBackend", "paged_attention"]


# The block table width changes from step to step: do not compile a variant per divisibility of its stride.
@triton.jit(do_not_specialize=["stride_bt"])  # type: ignore[untyped-decorator, unused-ignore]
def _paged_attention_kernel(  # type: ignore[no-untyped-def, unused-ignore]
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (tok < q_len)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context_len + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)

    # Keys up to the last query position of this tile; key 0 is visible to every row, so m_i is finite after
    # the first block and fully masked later blocks contribute exp(-inf) = 0.
    last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_kv_blocks = tl.cdiv(context_len + last_tok + 1, BLOCK_SIZE)
    offs_s = tl.arange(0, BLOCK_SIZE)
    for j in range(0, num_kv_blocks):
        block_id = tl.load(block_table_ptr + req * stride_bt + j).to(tl.int64)
        k_offs = block_id * stride_k_b + offs_s[:, None] * stride_k_s + kv_head * stride_k_h + dims[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
        kv_pos = j * BLOCK_SIZE + offs_s
        s = tl.where(kv_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = block_id * stride_v_b + offs_s[:, None] * stride_v_s + kv_head * stride_v_h + dims[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, H, D]`` over the paged cache ``[num_blocks, block_size, KVH, D]``."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size < 16:
        raise ValueError(f"the Triton backend needs block_size >= 16, got {block_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV cache must be contiguous in head_dim")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    # Decode-only steps: one token per program, all of its query heads for this KV head in the rows.
    block_q = 1 if meta.max_query_len == 1 else max(1, 64 // group)
    block_m = max(16, _next_pow2(block_q * group))
    grid = (meta.num_reqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_table.stride(0),
        NUM_QUERIES_PER_KV=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, _next_pow2(head_dim)),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        enable_fp_fusion=True,  # explicit: Triton 3.9 warns when it is left to its changing default
    )
    return out


class TritonPagedBackend:
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale)
