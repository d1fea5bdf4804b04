"""Load a local Hugging Face checkpoint (``config.json`` + ``*.safetensors``) into :class:`LlamaForCausalLM`.

Single files and sharded checkpoints (``model.safetensors.index.json``) are read tensor by tensor with
``safetensors``; nothing is downloaded. Hugging Face's separate q/k/v and gate/up projections are copied into
slices of our fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch

from .config import ModelConfig
from .model import LlamaForCausalLM, RotaryEmbedding

__all__ = ["iter_checkpoint_tensors", "load_model", "resolve_dtype"]

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """``"auto"`` = the checkpoint's ``torch_dtype`` (bfloat16 if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = (config.torch_dtype if config is not None else None) or "bfloat16"
        return _DTYPES.get(str(name).replace("torch.", ""), torch.bfloat16)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    return _DTYPES[dtype]


def _checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(os.path.join(model_dir, name) for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir!r}")
    return files


def iter_checkpoint_tensors(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the checkpoint, on the CPU, one shard open at a time."""
    from safetensors import safe_open

    for path in _checkpoint_files(os.fspath(model_dir)):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    config: ModelConfig | None = None,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir`` and copy its weights in; returns it in eval mode on ``device``."""
    config = config or ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    max_len = max_model_len or config.max_position_embeddings
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_len)
    model = model.to_empty(device=device).to(torch_dtype)
    # The rope table is a non-persistent buffer: rebuild it (in float32) now that the module is materialised.
    model.rotary_emb = RotaryEmbedding(config, max_len).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_size, kv_size),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }
    with torch.no_grad():
        for name, tensor in iter_checkpoint_tensors(model_dir):
            if "rotary_emb" in name:
                continue
            target, start, size = _map_name(name, fused)
            if target == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint (mapped to {target!r})")
            param = params[target]
            dst = param if start is None else param.narrow(0, start, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {target} {tuple(dst.shape)}")
            dst.copy_(tensor.to(device=device, dtype=torch_dtype))
            loaded.add(target if start is None else f"{target}[{start}]")
    expected: set[str] = set()
    for pname in params:
        if config.tie_word_embeddings and pname == "lm_head.weight":
            continue
        slices = [
            f"{pname}[{start}]"
            for ours, start, _ in fused.values()
            if pname.endswith((f"{ours}.weight", f"{ours}.bias"))
        ]
        expected.update(slices or [pname])
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {os.fspath(model_dir)!r} lacks {len(missing)} tensors, e.g. {missing[:4]}")
    return model.eval()


def _map_name(name: str, fused: dict[str, tuple[str, int, int]]) -> tuple[str, int | None, int]:
    """Our parameter name for a Hugging Face tensor name, and its row slice if it is fused."""
    if name.startswith("model."):
        name = name[len("model.") :]
    m = _LAYER.match(name)
    if m is None:
        return name, None, 0
    layer, rest = m.groups()
    for hf_prefix, (ours, start, size) in fused.items():
        if rest.startswith(hf_prefix + "."):
            return f"layers.{layer}.{ours}{rest[len(hf_prefix) :]}", start, size
    return f"layers.{layer}.{rest}", None, 0
