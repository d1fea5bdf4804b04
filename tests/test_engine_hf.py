"""``kvsched.LLM`` greedy outputs equal transformers' ``generate`` token for token, through prefix-cache hits,
chunked prefill, mixed prefill+decode steps and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead on small CI machines
transformers = pytest.importorskip("transformers")

from conftest import all_scheduler_classes, default_scheduler_cls, hf_greedy  # noqa: E402
from kvsched.engine import LLM, SamplingParams  # noqa: E402
from kvsched.runner.testing import save_tiny_hf_model  # noqa: E402

SCHEDULER_CLS = default_scheduler_cls()
# Parity tests run on every implementation present: the Rust core (when built) and the reference.
ALL_SCHEDULERS = all_scheduler_classes()


class RecordingScheduler:
    """Wraps a scheduler and keeps (num_scheduled_tokens, num_computed_tokens) of every step."""

    def __init__(self, config: Any, inner_cls: Any) -> None:
        self.inner = inner_cls(config)
        self.steps: list[tuple[list[int], list[int]]] = []  # (num_scheduled, num_computed) per step

    def schedule(self) -> Any:
        out = self.inner.schedule()
        self.steps.append((out.num_scheduled_tokens.tolist(), out.num_computed_tokens.tolist()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)

    def rnd(n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=g).tolist()

    shared = rnd(24)
    return [
        rnd(5),
        [*shared, *rnd(6)],  # shares three 8-token blocks with the next two
        [*shared, *rnd(11)],
        [*shared, *rnd(3)],
        rnd(70),  # longer than the step budget: chunked prefill
        rnd(1),
    ]


@pytest.mark.parametrize("scheduler_cls", ALL_SCHEDULERS, ids=lambda c: c.__name__)
def test_greedy_matches_transformers_with_prefix_hits_chunking_and_mixed_steps(
    tiny_llama: tuple[Path, Any], scheduler_cls: Any
) -> None:
    path, hf = tiny_llama
    prompts = _prompts(0)
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=128,
        max_num_batched_tokens=32,
        scheduler_cls=lambda config: RecordingScheduler(config, scheduler_cls),
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    expected = hf_greedy(hf, prompts, 10)
    assert [o.output_token_ids for o in outs] == expected
    assert [o.prompt_token_ids for o in outs] == prompts
    stats = llm.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    steps = llm.scheduler.steps
    # chunked prefill: the 70-token prompt was split over steps (a later chunk starts after computed tokens)
    assert any(c > 0 and s > 1 for sched, comp in steps for s, c in zip(sched, comp, strict=True))
    # mixed steps: a decode (one token) next to a prefill (several) in the same step
    assert any(1 in sched and max(sched) > 1 for sched, _ in steps)
    for o in outs:
        assert o.finish_reason in ("length", "stop")
        assert o.metrics.time_to_first_token is not None and o.metrics.time_to_first_token >= 0
        if len(o.output_token_ids) > 1:
            assert o.metrics.time_per_output_token is not None


@pytest.mark.parametrize("scheduler_cls", ALL_SCHEDULERS, ids=lambda c: c.__name__)
def test_greedy_matches_transformers_under_preemption(tiny_llama: tuple[Path, Any], scheduler_cls: Any) -> None:
    path, hf = tiny_llama
    prompts = _prompts(1)
    # 15 usable 8-token blocks (120 tokens of KV) for ~200 tokens of prompts: requests must be preempted.
    # Prompts are admitted for their first chunk (full-prompt gate off), so running requests run out of blocks.
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=16,
        max_num_batched_tokens=48,
        scheduler_reserve_full_isl=False,
        scheduler_cls=scheduler_cls,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert llm.scheduler.stats().num_preemptions > 0
    assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 12)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("scheduler_cls", ALL_SCHEDULERS, ids=lambda c: c.__name__)
def test_greedy_matches_transformers_under_each_preemption_mode(
    tiny_llama: tuple[Path, Any], scheduler_cls: Any, mode: str
) -> None:
    """The same tight pool as above: victims' KV goes to the runner's CPU pool and comes back (swap), or each
    victim is recomputed or swapped by the cost rule (auto, with constants that favour swapping long private
    contexts), and the greedy tokens are still transformers' own."""
    path, hf = tiny_llama
    prompts = _prompts(1)
    extra: dict[str, Any] = {}
    if mode != "recompute":
        extra = {"num_cpu_blocks": 64}
    if mode == "auto":
        extra |= {"recompute_cost_per_token": 1.0, "swap_cost_per_block": 2.0}
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=16,
        max_num_batched_tokens=48,
        scheduler_reserve_full_isl=False,
        scheduler_cls=scheduler_cls,
        preemption_mode=mode,
        **extra,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    st = llm.scheduler.stats()
    assert st.num_preemptions > 0
    if mode == "recompute":
        assert st.num_swapped_out_reqs == 0 and st.num_recomputed_tokens > 0
    else:
        assert st.num_swapped_out_reqs > 0 and st.num_swapped_in_blocks > 0, st
        assert st.num_free_cpu_blocks == 64
    assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 12)


def test_auto_measures_its_cost_constants_at_start_up(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64, preemption_mode="auto",
              num_cpu_blocks=16, scheduler_cls=SCHEDULER_CLS)  # fmt: skip
    recompute, swap = llm.scheduler.preemption_costs
    assert 0 < recompute < 1 and 0 < swap < 1  # seconds per token / per block copied one way
    assert llm.runner.cpu_pool is not None and llm.runner.cpu_pool.num_blocks == 16
    # a model shorter than the 256-token timed prefill: it is capped at max_model_len
    short = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64, max_model_len=40,
                preemption_mode="auto", num_cpu_blocks=4, scheduler_cls=SCHEDULER_CLS)  # fmt: skip
    assert all(c > 0 for c in short.scheduler.preemption_costs)


@pytest.mark.parametrize("kind", ["qwen2", "llama-tied"])
def test_other_model_shapes_match_transformers(tmp_path: Path, kind: str) -> None:
    hf = save_tiny_hf_model(tmp_path, kind)
    prompts = _prompts(2)[:4]
    llm = LLM(
        tmp_path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=64,
        max_num_batched_tokens=24,
        scheduler_cls=SCHEDULER_CLS,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 6)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    prompts = _prompts(3)[:3]
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=s) for s in (11, 12, 13)]
    kw: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "block_size": 8,
        "num_blocks": 64,
        "scheduler_cls": SCHEDULER_CLS,
    }
    together = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    alone = LLM(path, **kw).generate(prompts[1], params[1], use_tqdm=False)
    assert alone[0].output_token_ids == together[1].output_token_ids
    again = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in together]


def test_stop_tokens_min_tokens_and_text(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64, scheduler_cls=SCHEDULER_CLS)
    prompt = _prompts(4)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    first = free.output_token_ids[0]
    stopped = llm.generate(
        prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,)), use_tqdm=False
    )[0]
    assert stopped.output_token_ids == [first]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", first)
    # min_tokens masks stop tokens until it is reached, so the first token differs
    held = llm.generate(
        prompt,
        SamplingParams(max_tokens=3, min_tokens=2, temperature=0.0, stop_token_ids=(first,)),
        use_tqdm=False,
    )[0]
    assert held.output_token_ids[0] != first and len(held.output_token_ids) >= 2
    assert free.text is None  # no tokenizer.json in the directory


def _vllm_style(outputs: list[Any]) -> list[tuple[Any, ...]]:
    """What code written against ``vllm.LLM.generate`` typically reads from its results."""
    return [
        (o.request_id, o.prompt, o.prompt_token_ids, o.finished, len(o.outputs), o.outputs[0].index,
         o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason,
         o.outputs[0].cumulative_logprob, o.outputs[0].logprobs, o.outputs[0].finished())
        for o in outputs
    ]  # fmt: skip


def test_outputs_have_vllms_shape(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64, scheduler_cls=SCHEDULER_CLS)
    prompts = _prompts(5)[:2]
    free = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    stop = free[1].output_token_ids[2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop,)), use_tqdm=False)
    assert [o.finish_reason for o in free] == ["length", "length"]
    assert outs[1].output_token_ids == free[1].output_token_ids[:3]
    assert [(o.finish_reason, o.stop_reason) for o in outs][1] == ("stop", stop)
    assert _vllm_style(outs) == [
        (o.request_id, None, p, True, 1, 0, "", o.output_token_ids, o.finish_reason, o.stop_reason, None, None, True)
        for o, p in zip(outs, prompts, strict=True)
    ]
    # The view shares the token list: it always says what the flat fields say.
    assert outs[0].outputs[0].token_ids is outs[0].output_token_ids


def test_text_prompts_with_a_tokenizer_json(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    import shutil

    path, _ = tiny_llama
    model_dir = tmp_path / "with_tok"
    shutil.copytree(path, model_dir)
    vocab = {f"w{i}": i for i in range(300)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(model_dir / "tokenizer.json"))
    llm = LLM(model_dir, dtype="float32", device="cpu", block_size=8, num_blocks=64, scheduler_cls=SCHEDULER_CLS)
    out = llm.generate(["w5 w6 w7 w8", "w9 w10"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert out[0].prompt_token_ids == [5, 6, 7, 8]
    assert out[0].prompt == "w5 w6 w7 w8"
    assert out[0].text == " ".join(f"w{t}" for t in out[0].output_token_ids)
    assert [o.outputs[0].text for o in out] == [o.text for o in out]


def test_sampling_params_are_validated() -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_runner_returns_empty_entries_for_prefill_chunks(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=8,
        num_blocks=64,
        max_num_batched_tokens=16,
        scheduler_cls=SCHEDULER_CLS,
    )
    llm.add_request(list(range(3, 43)), SamplingParams(max_tokens=2, temperature=0.0))
    out = llm.scheduler.schedule()
    values, indptr = llm.runner.execute(out, llm.scheduler.prepare_model_inputs(out))
    assert values.size == 0 and indptr.tolist() == [0, 0]
    assert values.dtype == np.int32 and indptr.dtype == np.int32
    llm.scheduler.update_from_output(out, (values, indptr))


def _near_argmax_fraction(hf: Any, prompts: list[list[int]], outs: list[Any], slack: float) -> tuple[float, bool]:
    """Teacher-force transformers (float32) on our outputs: the share of our tokens that are its argmax, and
    whether every one of our tokens is within ``slack`` of its best logit."""
    same = total = 0
    all_close = True
    for p, o in zip(prompts, outs, strict=True):
        seq = torch.tensor([p + o.output_token_ids], device=hf.device)
        with torch.no_grad():
            logits = hf(seq).logits[0, len(p) - 1 : -1].float()
        chosen = torch.tensor(o.output_token_ids, device=logits.device)
        best = logits.max(dim=-1)
        same += int((logits.argmax(dim=-1) == chosen).sum())
        total += len(o.output_token_ids)
        all_close &= bool((logits.gather(1, chosen[:, None])[:, 0] >= best.values - slack).all())
    return same / total, all_close


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bfloat16_engine_tracks_transformers(tmp_path: Path, device: str) -> None:
    """In bfloat16 our greedy tokens are (nearly always) transformers' float32 argmax, never far from it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = save_tiny_hf_model(
        tmp_path,
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ).to(device)
    prompts = _prompts(5)
    llm = LLM(
        tmp_path,
        dtype="bfloat16",
        device=device,
        block_size=16,
        num_blocks=256,
        max_num_batched_tokens=64,
        scheduler_cls=SCHEDULER_CLS,
    )
    if device == "cuda":
        assert llm.runner.backend.name == "triton"
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    # bf16 flips near-ties (about 5% of tokens here; logits have std ~2.4): a wrong kernel would match ~0.1%.
    share, close = _near_argmax_fraction(hf, prompts, outs, slack=0.5)
    assert share >= 0.8 and close, share


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_float32_gpu_engine_matches_transformers(tmp_path: Path, backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = save_tiny_hf_model(
        tmp_path,
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    prompts = _prompts(6)
    expected = hf_greedy(hf, prompts, 12)
    # A small pool and step budget, so the GPU path also sees prefix hits, chunks, mixed steps and preemption.
    llm = LLM(
        tmp_path,
        dtype="float32",
        device="cuda",
        block_size=16,
        num_blocks=12,
        max_num_batched_tokens=48,
        attention_backend=backend,
        scheduler_cls=SCHEDULER_CLS,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert llm.scheduler.stats().num_preemptions > 0


_TRITON_ENGINE_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_engine_hf import _hf_greedy, _prompts, SCHEDULER_CLS
from kvsched.engine import LLM, SamplingParams
from kvsched.runner.testing import save_tiny_hf_model
hf = save_tiny_hf_model({path!r}, "llama", hidden_size=128)
prompts = _prompts(7)
llm = LLM({path!r}, dtype="float32", device="cpu", block_size=16, num_blocks=14, max_num_batched_tokens=40,
          attention_backend="triton", scheduler_cls=SCHEDULER_CLS)
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
assert llm.runner.backend.name == "triton"
assert llm.scheduler.stats().prefix_cache_hits > 0
assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 8)
print("ok")
"""


@pytest.mark.slow
def test_engine_with_triton_kernel_in_interpreter_matches_transformers(tmp_path: Path) -> None:
    """The whole engine on the Triton kernel, run by the Triton interpreter on the CPU (about 10 s)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    script = _TRITON_ENGINE_SCRIPT.format(tests=os.path.dirname(__file__), path=str(tmp_path / "m"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_bad_prompt_adds_nothing(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, num_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.add_request(list(range(3, 100)), SamplingParams(max_tokens=2))
    assert not llm.has_unfinished_requests() and llm.runner.num_requests == 0
    # generate() fails it alone: the good prompt beside it runs.
    good, bad = llm.generate([[5, 6, 7], list(range(3, 100))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert good.finish_reason == "length" and len(good.output_token_ids) == 2
    assert bad.finish_reason == "error" and bad.error is not None and "max_model_len=64" in bad.error
    assert not llm.has_unfinished_requests() and llm.runner.num_requests == 0
    outs = llm.generate(np.array([5, 6, 7]), SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].output_token_ids) == 2


_GRAPHS_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_engine_hf import _hf_greedy, _prompts, SCHEDULER_CLS
from kvsched.engine import LLM, SamplingParams
from kvsched.runner.cuda_graphs import DecodeGraphs
from kvsched.runner.testing import save_tiny_hf_model


class ReplayByRerun(DecodeGraphs):
    # No CUDA here: "capture" runs the forward once; "replay" runs it again into the captured output.
    def _capture(self, bs, pool):
        self.outputs[bs] = self._forward(bs)
        self.graphs[bs] = None
    def _replay(self, bs):
        self.outputs[bs].copy_(self._forward(bs))
        self.replays.append(bs)


hf = save_tiny_hf_model({path!r}, "llama", hidden_size=128)
prompts = _prompts(8)[:3]
llm = LLM({path!r}, dtype="float32", device="cpu", block_size=16, num_blocks=32, attention_backend="triton",
          scheduler_cls=SCHEDULER_CLS, max_model_len=128)
r = llm.runner
graphs = ReplayByRerun.__new__(ReplayByRerun)
graphs.replays = []
DecodeGraphs.__init__(graphs, r.model, r.kv_caches, r.backend, max_batch_size=4, max_blocks_per_seq=8,
                      block_size=16, device=r.device)
r.decode_graphs = graphs
outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
assert 4 in graphs.replays, graphs.replays  # three requests padded to a graph of four
assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 6)
print("ok", graphs.replays)
"""


@pytest.mark.slow
def test_decode_graph_padding_in_interpreter_matches_transformers(tmp_path: Path) -> None:
    """The CUDA-graph input/padding path (capture and replay stubbed out) on the Triton interpreter."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    script = _GRAPHS_SCRIPT.format(tests=os.path.dirname(__file__), path=str(tmp_path / "m"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
def test_cuda_graphs_give_the_same_greedy_tokens(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = save_tiny_hf_model(
        tmp_path,
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    prompts = _prompts(9)
    kw: dict[str, Any] = {
        "dtype": "float32",
        "device": "cuda",
        "block_size": 16,
        "num_blocks": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "scheduler_cls": SCHEDULER_CLS,
    }
    graphed = LLM(tmp_path, enable_cuda_graphs=True, **kw)
    assert graphed.runner.decode_graphs is not None
    outs = graphed.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == hf_greedy(hf, prompts, 12)
