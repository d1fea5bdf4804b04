"""The torch Llama-family model and the safetensors loader agree with Hugging Face transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead on small CI machines
transformers = pytest.importorskip("transformers")

from kvsched.runner.config import ModelConfig  # noqa: E402
from kvsched.runner.loader import load_model  # noqa: E402
from kvsched.runner.testing import prefill_logits, save_tiny_hf_model  # noqa: E402

PROMPT = [1, 17, 42, 99, 7, 250, 3, 3, 18, 77, 140, 201, 5, 9, 11, 64, 128, 255, 31, 44, 90, 12, 13]


def _hf_logits(hf: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "llama3-rope", "qwen2", "mistral"])
def test_prefill_logits_match_transformers(tmp_path: Path, kind: str) -> None:
    hf = save_tiny_hf_model(tmp_path, kind)
    model = load_model(tmp_path, dtype="float32")
    ours = prefill_logits(model, PROMPT, block_size=4)
    torch.testing.assert_close(ours, _hf_logits(hf, PROMPT), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        # Within max_position_embeddings dynamic NTK is the plain rope, in transformers and here.
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rope_scaling_variants_match_transformers(tmp_path: Path, rope_scaling: dict[str, Any]) -> None:
    hf = save_tiny_hf_model(tmp_path, "llama", rope_scaling=rope_scaling)
    model = load_model(tmp_path, dtype="float32")
    torch.testing.assert_close(prefill_logits(model, PROMPT), _hf_logits(hf, PROMPT), atol=2e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = save_tiny_hf_model(tmp_path / "one", "llama")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="60KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = load_model(tmp_path / "sharded", dtype="float32")
    single = load_model(tmp_path / "one", dtype="float32")
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_qwen2_config_has_qkv_bias_and_tied_embeddings(tmp_path: Path) -> None:
    save_tiny_hf_model(tmp_path, "qwen2")
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.model_type, cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == ("qwen2", True, False, True)
    model = load_model(tmp_path, dtype="float32")
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_hf_model(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(tmp_path, dtype="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_are_close(tmp_path: Path, dtype: str) -> None:
    hf = save_tiny_hf_model(tmp_path, "llama")
    model = load_model(tmp_path, dtype=dtype)
    assert model.embed_tokens.weight.dtype == getattr(torch, dtype)
    ours = prefill_logits(model, PROMPT)
    torch.testing.assert_close(ours, _hf_logits(hf, PROMPT), atol=0.1, rtol=0.05)


def test_transformers_4_style_config_is_understood() -> None:
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "eos_token_id": [5, 6],
        }
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.eos_token_ids == (5, 6)
    assert cfg.head_dim == 16
