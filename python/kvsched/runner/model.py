"""A Llama-family decoder in plain torch, over flat (ragged) token batches and a paged KV cache.

Every request's scheduled tokens are packed into one flat batch of ``T`` tokens; attention finds each token's
request and context through :class:`~kvsched.runner.attention.AttentionMetadata`. The projections are fused
(``qkv_proj``, ``gate_up_proj``) so a layer is five matmuls; the loader splits Hugging Face tensors into them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

if TYPE_CHECKING:
    from .attention import AttentionBackend, AttentionMetadata

__all__ = ["LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "write_kv"]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as the reference implementations do).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, max_model_len: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the configured scaling applied."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "dynamic":
        # Dynamic NTK, made static: frequencies are those for max_model_len. Identical to the unscaled rope
        # (and to Hugging Face) while max_model_len <= max_position_embeddings.
        orig = int(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
        factor = float(scaling["factor"])
        if max_model_len > orig:
            base = base * ((factor * max_model_len / orig) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        orig = int(scaling["original_max_position_embeddings"])
        low_freq_wavelen = orig / low_freq_factor
        high_freq_wavelen = orig / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept; the band between is interpolated.
        smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(mid, smoothed, out)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (default, linear, dynamic, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table indexed by position."""

    cos_sin: torch.Tensor

    def __init__(self, config: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config, max_model_len)
        t = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` for the positions, ``[T, 1, head_dim / 2]`` each; looked up once per step."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``[T, heads, head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_cache, v_cache = kv_cache
        # All new K/V of the step are written before any attention reads, so a request that hit blocks being
        # filled by another request in this same step sees them.
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        out: torch.Tensor = self.o_proj(o.reshape(-1, self.q_size))
        return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the step's new K/V into the paged cache at ``slot_mapping`` (flat slot ids)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaForCausalLM(nn.Module):
    """Llama 2/3, Mistral and Qwen2/2.5 decoders (the differences are config flags)."""

    def __init__(self, config: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_model_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states (after the final norm) of every token, ``[T, hidden_size]``."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta, backend)
        out: torch.Tensor = self.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden states (only the rows that are sampled)."""
        logits: torch.Tensor = self.lm_head(hidden).float()
        return logits
