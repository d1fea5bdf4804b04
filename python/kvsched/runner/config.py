"""The model shape a runner needs, read from a Hugging Face ``config.json``.

Covers the Llama family as Hugging Face writes it: Llama 2/3, Mistral, Qwen2/2.5. Both the older layout
(``rope_theta`` + ``rope_scaling``) and the transformers 5 layout (``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only SwiGLU / silu)")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or hidden // heads

        # transformers >= 5 nests rope settings in rope_parameters; older configs: rope_theta + rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling.pop("rope_theta", None)
            scaling.pop("type", None)
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))

        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            extra=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        path = os.path.join(os.fspath(model_dir), "config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        # generation_config.json often lists more EOS ids (Llama 3 instruct) than config.json.
        gen_path = os.path.join(os.fspath(model_dir), "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
            if gen.get("eos_token_id") is not None:
                cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
        return cls.from_dict(cfg)


def llama_3_2_1b_config() -> ModelConfig:
    """Llama-3.2-1B shapes (for random-weight benchmarks; no download)."""
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_ids=(128001,),
        bos_token_id=128000,
    )


def tiny_config(vocab_size: int = 512) -> ModelConfig:
    """A tiny Llama for CPU smoke tests and benchmarks."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    )
