"""Encoder-cache (EC) connectors in kvsched.vllm.Scheduler: vLLM's ``ec_transfer_config``.

Needs vLLM (``pip install '.[vllm]'``); skipped otherwise. The model is a tiny LLaVA written on the fly
(``kvsched.vllm.testing``: 16 tokens per image). Each scheduler gets its own seeded
:class:`~kvsched.vllm.testing.RandomECConnector` (it holds about half the images and sometimes says a request's
are still in transit); every output is compared field by field with vLLM's own scheduler, and so is every call
the schedulers make on their connectors.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm_driver import compare, run_seed, step_pair

pytestmark = pytest.mark.vllm

BLOCK = 16


def _pair(seed: int, **fields: Any) -> tuple[Any, Any]:
    cfg = make_vllm_config(
        multimodal=True,
        block_size=BLOCK,
        num_blocks=64,
        max_model_len=256,
        max_num_seqs=8,
        ec_connector_seed=seed,
        **fields,
    )
    return make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg)


def _step(scheds: tuple[Any, ...]) -> Any:
    """One synchronous step on each scheduler, outputs and connector calls compared; returns kvsched's output."""
    outs, _ = step_pair(scheds)
    compare("EC connector metadata", outs[0].ec_connector_metadata, outs[1].ec_connector_metadata)
    compare("EC connector calls", scheds[0].ec_connector.calls, scheds[1].ec_connector.calls)
    return outs[1]


def _images(i: int, n: int) -> list[tuple[int, int, str]]:
    return [(4 + 20 * k, 16, f"img{(i * 3 + k) % 7}") for k in range(n)]


@pytest.mark.parametrize(("seed", "async_scheduling"), [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_loads_deferrals_and_frees_follow_vllm(seed: int, async_scheduling: bool) -> None:
    """Requests with one to three images (some shared) under a tight encoder budget: which images are computed
    and which loaded, which requests wait for their images in transit, the connector's metadata, its
    update_state_after_alloc / _free calls and request_finished (its transfer parameters in the last output) are
    vLLM's, step by step (with async scheduling too: one step in flight at a time here)."""
    scheds = _pair(seed, max_num_batched_tokens=48, async_scheduling=async_scheduling)
    computed = loaded = 0
    for i in range(6):
        for s in scheds:
            s.add_request(
                make_request(f"r{i}", list(range(100 * i, 100 * i + 70)), max_tokens=3, block_size=BLOCK,
                             images=_images(i, 1 + i % 3))
            )  # fmt: skip
        for _ in range(2):
            out = _step(scheds)
            computed += sum(map(len, out.scheduled_encoder_inputs.values()))
            loaded += sum(held for _, held in out.ec_connector_metadata.allocated)
    for _ in range(40):
        if not scheds[1].has_requests():
            break
        out = _step(scheds)
        computed += sum(map(len, out.scheduled_encoder_inputs.values()))
        loaded += sum(held for _, held in out.ec_connector_metadata.allocated)
    assert not scheds[1].has_requests()
    calls = scheds[1].ec_connector.calls
    deferred = sum(1 for c in calls if c[0] == "ensure_cache_available" and not c[3])
    assert computed > 0 and loaded > 0 and deferred > 0, (computed, loaded, deferred)
    assert any(c[0] == "update_state_after_free" for c in calls)
    assert any(c[0] == "request_finished" for c in calls)


def test_encoder_cache_manager_view_shows_the_cached_identifiers() -> None:
    """``encoder_cache_manager.cached`` (vLLM's tests read it) shows the core's entries by identifier with the
    requests referencing them, as vLLM's manager does; the view is read-only."""
    scheds = _pair(5, max_num_batched_tokens=256)
    for s in scheds:
        s.add_request(make_request("a", list(range(60)), max_tokens=2, block_size=BLOCK, images=_images(0, 2)))
    _step(scheds)
    vllm_s, ours = scheds
    assert ours.encoder_cache_manager.cached == vllm_s.encoder_cache_manager.cached
    assert ours.encoder_cache_manager.cached
    assert ours.encoder_cache_manager.cache_size == vllm_s.encoder_cache_manager.cache_size
    with pytest.raises(AttributeError, match="read-only"):
        ours.encoder_cache_manager.cached = {}
    with pytest.raises(AttributeError, match="it has no 'allocate'"):
        ours.encoder_cache_manager.allocate  # noqa: B018


def test_a_text_only_model_accepts_an_ec_connector() -> None:
    """A text-only model with an EC connector (vLLM's tests add one to KV connector scenarios): built as vLLM
    builds it, asked nothing about encoder inputs, its metadata in every step's output."""
    cfg = make_vllm_config(block_size=BLOCK, num_blocks=64, max_model_len=256, ec_connector_seed=1)
    scheds = make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg)
    for s in scheds:
        s.add_request(make_request("a", list(range(40)), max_tokens=2, block_size=BLOCK))
    out = _step(scheds)
    assert out.ec_connector_metadata is not None and out.ec_connector_metadata.allocated == []
    assert scheds[1].get_ec_connector() is scheds[1].ec_connector


@pytest.mark.parametrize(("seed", "kv_role"), [(0, None), (2, "kv_both"), (3, "kv_consumer")])
def test_identical_to_vllm_with_an_ec_connector(seed: int, kv_role: str | None) -> None:
    """The differential driver with images and a RandomECConnector (with a RandomKVConnector too in some runs):
    every output, request state and call on both connectors is vLLM's, step by step. (Seed 2 with the KV
    connector: a request the EC connector defers right after its KV lookup keeps the KV-fetch stage it had.)"""
    cfg = run_seed(
        seed, 120, async_scheduling=False, v2=False, multimodal=True, ec_connector=True,
        connector=kv_role is not None, kv_role=kv_role or "kv_both",
    )  # fmt: skip
    assert cfg.ec_connector_seed == seed


def test_identical_to_vllm_with_an_ec_connector_and_rolled_back_requests() -> None:
    """The driver with images, the RandomECConnector and a RandomKVConnector that reports invalid blocks of
    synchronous loads: a request rolled back to before an image its load had covered references that image again
    when its steps go over it, and vLLM tells the EC connector of its free once consumed (seed 1 rolls one back
    below an image)."""
    from kvsched.vllm.testing import RandomKVConnector

    before = RandomKVConnector.num_sync_invalid_reported
    cfg = run_seed(
        1, 120, async_scheduling=False, v2=False, multimodal=True, ec_connector=True,
        connector=True, kv_role="kv_consumer", sync_invalid=True,
    )  # fmt: skip
    assert cfg.ec_connector_seed == 1 and RandomKVConnector.num_sync_invalid_reported > before
