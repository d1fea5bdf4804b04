"""vLLM 0.33's auxiliary output connector (``aux_output_connector``: routed-experts capture) on
``kvsched.vllm.Scheduler``, compared with vLLM's own scheduler.

Both schedulers get a connector of vLLM's class (set on the built scheduler, as vLLM's tests do) and the same
calls: prompts that share prefixes in a KV cache small enough to evict them, aborts, stops. After every step the
scheduled tokens, the connector's metadata (requests, block hashes sent, finished requests, retained and released
hashes) and the routed experts each output carries must be the same. A capped prefix hit changes the scheduled
tokens, so this also checks the core's cache-hit cap against vLLM's ``max_cache_hit``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

import numpy as np
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_driver import compare
from vllm_driver import runner_output as model_runner_output

aux_connector = pytest.importorskip(
    "vllm.distributed.aux_output_connector.connector", reason="vLLM 0.33's auxiliary output connector"
)

from kvsched.vllm import RULES, UnsupportedFeatureError  # noqa: E402

pytestmark = pytest.mark.vllm
on_032 = pytest.mark.skipif(RULES.version == "0.32", reason="vLLM 0.32's connector has another interface (refused)")

BS = 16


def meta_view(m: Any) -> Any:
    """The metadata as plain values (hashes as bytes lists)."""
    if m is None:
        return None
    packed = lambda p: None if p is None else list(p)  # noqa: E731
    return (
        m.generation,
        dict(m.requests),
        {rid: list(h) for rid, h in m.block_hashes.items()},
        m.finished_requests,
        packed(m.retained_block_hashes),
        packed(m.released_block_hashes),
    )


def runner_output(sched: Any, so: Any) -> ModelRunnerOutput:
    """One sampled token per request whose prompt is done; routed experts (one row per token) for every
    scheduled request from token 0."""
    req_ids = list(so.num_scheduled_tokens)
    sampled, aux = [], {}
    for rid in req_ids:
        request = sched.requests[rid]
        done = request.num_computed_tokens  # after the step's update
        sampled.append([7] if done >= request.num_tokens else [])
        aux[rid] = aux_connector.AuxRequestOutput(0, np.arange(done, dtype=np.uint8).reshape(done, 1, 1))
    return model_runner_output(req_ids, sampled, aux_output_connector_output=aux)


def experts(outputs: dict[int, Any]) -> list[tuple[str, list[int], Any]]:
    return sorted(
        (o.request_id, list(o.new_token_ids), None if o.routed_experts is None else o.routed_experts.ravel().tolist())
        for eco in outputs.values()
        for o in eco.outputs
    )


@on_032
@pytest.mark.parametrize("seed", range(4))
def test_aux_output_connector_matches_vllm(seed: int) -> None:
    rng = random.Random(seed)
    config = make_vllm_config(num_blocks=24 + seed * 4, max_num_batched_tokens=96, max_num_seqs=6)
    a = make_scheduler("vllm", config)
    b = make_scheduler("kvsched", config)
    for s in (a, b):
        s.aux_output_connector = aux_connector.AuxOutputSchedulerConnector(s.kv_cache_manager)
    stems = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    n = 0
    seen = {"retained": 0, "released": 0}
    for step in range(80):
        if rng.random() < 0.4 and n < 30:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(16, 49)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            max_tokens = rng.randrange(1, 24)
            for s in (a, b):
                s.add_request(make_request(f"r{n}", prompt, max_tokens=max_tokens, arrival_time=float(n)))
            n += 1
        if rng.random() < 0.08 and a.requests:
            victim = rng.choice(sorted(a.requests))
            for s in (a, b):
                s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        so_a, so_b = a.schedule(), b.schedule()
        when = f"seed {seed} step {step}"
        compare(f"{when}: scheduled", so_a.num_scheduled_tokens, so_b.num_scheduled_tokens)
        compare(f"{when}: preempted", so_a.preempted_req_ids, so_b.preempted_req_ids)
        compare(
            f"{when}: aux metadata",
            meta_view(so_a.aux_output_connector_metadata),
            meta_view(so_b.aux_output_connector_metadata),
        )
        meta = so_a.aux_output_connector_metadata
        seen["retained"] += meta.retained_block_hashes is not None
        seen["released"] += meta.released_block_hashes is not None
        out_a = a.update_from_output(so_a, runner_output(a, so_a))
        out_b = b.update_from_output(so_b, runner_output(b, so_b))
        compare(f"{when}: outputs", experts(out_a), experts(out_b))
    assert n > 10
    # The workload reaches the connector's retention and its releases past capacity.
    assert seen["retained"] and seen["released"], seen


@on_032
@pytest.mark.parametrize("max_hit", [79, 40, 0])
def test_the_prefix_hit_is_capped_as_in_vllm(max_hit: int) -> None:
    """vLLM's ``max_cache_hit`` caps the local hit (here replaced by a fixed answer, as vLLM's tests do)."""
    from unittest.mock import Mock

    config = make_vllm_config()
    scheduled = []
    for impl in ("vllm", "kvsched"):
        s = make_scheduler(impl, config)
        prompt = list(range(80))
        s.add_request(make_request("first", prompt))
        s.schedule()
        s.finish_requests("first", RequestStatus.FINISHED_ABORTED)
        connector = aux_connector.AuxOutputSchedulerConnector(s.kv_cache_manager)
        connector.max_cache_hit = Mock(return_value=max_hit)
        s.aux_output_connector = connector
        s.add_request(make_request("second", prompt))
        scheduled.append(s.schedule().num_scheduled_tokens["second"])
    assert scheduled[0] == scheduled[1] == 80 - max_hit // BS * BS


@pytest.mark.skipif(RULES.version != "0.32", reason="the refusal is vLLM 0.32's")
def test_vllm_032s_auxiliary_output_connector_is_refused_by_name() -> None:
    cfg = make_vllm_config()
    cfg.aux_output_config.enable_return_routed_experts = True
    with pytest.raises(UnsupportedFeatureError, match=r"auxiliary output connector on vLLM 0\.32"):
        make_scheduler("kvsched", cfg)
