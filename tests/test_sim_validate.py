"""The simulator schedules exactly what the real engine schedules: the same trace through ``kvsched.LLM`` (a
tiny random-weight model on the CPU) and through ``kvsched.sim`` gives the same sequence of batches, through
chunked prefill, prefix-cache hits and preemption. A calibration fit recovers known coefficients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
pytest.importorskip("transformers")

from conftest import requires_rust  # noqa: E402
from kvsched.engine import LLM  # noqa: E402
from kvsched.runner.testing import save_tiny_hf_model  # noqa: E402
from kvsched.sim import PRESETS, StepTimeModel, Workload, request_records, simulate  # noqa: E402
from kvsched.sim.calibrate import fit_step_time_model, residuals, run_timed_steps  # noqa: E402
from kvsched.sim.validate import prompt_fn_for_vocab, run_real  # noqa: E402

pytestmark = [pytest.mark.torch, requires_rust]

CONFIG = {
    "block_size": 16,
    "num_blocks": 40,  # 624 tokens: the batch below does not fit, so requests are preempted
    "max_num_seqs": 8,
    "max_num_batched_tokens": 96,  # long prompts are chunked
    "max_model_len": 512,
}


def _workload() -> Workload:
    rng = np.random.default_rng(5)
    n = 10
    group = np.where(np.arange(n) % 3 == 0, 0, -1)  # every third request shares a 48-token prefix
    return Workload(
        arrival_time=np.zeros(n),
        prompt_len=rng.integers(20, 200, size=n),
        output_len=rng.integers(4, 40, size=n),
        tenant=np.zeros(n, dtype=np.int64),
        priority=np.zeros(n, dtype=np.int64),
        prefix_group=group.astype(np.int64),
        prefix_len=np.where(group >= 0, 48, 0).astype(np.int64),
        seed=5,
    )


def test_simulated_batches_equal_the_real_engine(tmp_path: Path) -> None:
    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    w = _workload()
    llm = LLM(path, device="cpu", seed=0, **CONFIG)
    fn = prompt_fn_for_vocab(w, int(llm.model_config.vocab_size))
    real = run_real(llm, w, fn)
    sim = simulate(w, CONFIG, PRESETS["llama-3.2-1b-h100"], record_batches=True, prompt_fn=fn)
    assert sim.batches == real.batches
    rec = request_records(sim)
    assert rec.finished.all() and np.isfinite(real.finish).all()
    assert rec.num_preemptions.sum() > 0  # the comparison covered preemption...
    assert rec.num_cached_tokens.sum() > 0  # ...prefix hits...
    assert (sim.step_prefill_tokens > 0).sum() > len(w)  # ...and chunked prefills


def test_calibration_fit_recovers_known_coefficients() -> None:
    truth = StepTimeModel(
        step_s=2e-3, prefill_token_s=5e-5, prefill_req_s=4e-4, decode_req_s=3e-4, kv_token_s=1e-6, name="t"
    )
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(200):
        preq, dec = int(rng.integers(0, 4)), int(rng.integers(0, 64))
        pre = preq * int(rng.integers(1, 200))
        kv = dec * int(rng.integers(16, 1024))
        t = truth.step_time(pre, dec, kv, prefill_reqs=preq) * (1 + rng.normal(0, 0.01))
        steps.append((t, pre, preq, dec, kv, 0.0))
    fitted, fit = fit_step_time_model(steps)
    assert fit["r2"] > 0.99 and fit["median_rel_error"] < 0.02
    for name in ("step_s", "prefill_token_s", "prefill_req_s", "decode_req_s", "kv_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert fitted.prefill_attn_s >= 0 and fitted.swap_block_s == 0


def test_calibration_fit_finds_the_attention_hinge() -> None:
    # Steps whose long prefill chunks cost more per query-key pair past 30,000 pairs: the fit must find a
    # threshold near it (among the pooled percentiles it tries) and price the steps right; without the per-chunk
    # pairs it cannot, and its error is larger.
    truth = StepTimeModel(
        step_s=1e-3, prefill_token_s=2e-6, decode_req_s=2e-4, prefill_attn_s=5e-8, prefill_attn_spill_s=1.5e-7,
        attn_spill_pairs=30_000, name="t",
    )  # fmt: skip
    rng = np.random.default_rng(1)
    steps, pairs = [], []
    for _ in range(400):
        chunks = rng.integers(16, 600, size=int(rng.integers(0, 3)))
        dec = int(rng.integers(0, 32))
        per = chunks * (chunks + 1) / 2.0
        over = float(np.maximum(per - 30_000, 0).sum())
        t = truth.step_time(float(chunks.sum()), dec, 0, float(per.sum()), prefill_attn_spill_pairs=over)
        steps.append((t * (1 + rng.normal(0, 0.01)), int(chunks.sum()), len(chunks), dec, 0, float(per.sum())))
        pairs.append(per)
    fitted, fit = fit_step_time_model(steps, request_pairs=pairs)
    assert "prefill_attn_spill_pairs" in fit["features"]
    assert 20_000 < fitted.attn_spill_pairs < 40_000 and fitted.prefill_attn_spill_s > 0
    assert fit["median_rel_error"] < 0.02
    _, plain = fit_step_time_model(steps)
    assert plain["median_rel_error"] > fit["median_rel_error"]
    assert "prefill_attn_spill_pairs" not in plain["features"]
    resid = residuals(fitted, steps, pairs)
    assert np.median(np.abs(resid) / np.array([s[0] for s in steps])) < 0.02
    with pytest.raises(ValueError, match="request_pairs"):
        fit_step_time_model(steps, request_pairs=pairs[:-1])
    with pytest.raises(ValueError, match="attn_spill_pairs"):
        StepTimeModel(step_s=1e-3, attn_spill_pairs=-1.0)


def test_timed_steps_of_the_real_engine_have_the_simulator_composition(tmp_path: Path) -> None:
    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    llm = LLM(path, device="cpu", seed=0, **CONFIG)
    steps = run_timed_steps(llm, [(0, list(range(3, 103)), 3), (0, list(range(5, 45)), 5)])
    assert steps[0][1:4] == (96, 1, 0)  # 96 prefill tokens of one request (the budget), nothing decodes
    assert sum(s[1] for s in steps) == 140  # every prompt token once (no prefix cache hit between them)
    assert sum(s[3] for s in steps) == (3 - 1) + (5 - 1)  # decode steps after each request's first token
    assert all(s[0] > 0 for s in steps)


def test_validate_cli_compares_real_and_simulated(tmp_path: Path) -> None:
    import json

    from kvsched.cli import main

    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    out = tmp_path / "out"
    argv = ["simulate", "--validate", "--model", str(path), "--step-model", "llama-3.2-1b-h100",
            "--num-requests", "6", "--rate", "50", "--prompt-len", "uniform:8:64", "--output-len", "uniform:2:8",
            "--set", "max_model_len=512", "--set", "num_blocks=200", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "validate.json").read_text())
    assert report["num_requests"] == 6 and report["real_steps"] > 0 and report["sim_steps"] > 0
    assert report["ttft"]["real"]["p50"] > 0 and report["e2e"]["sim"]["p50"] > 0
    steps = report["step_model_on_real_steps"]["all"]
    assert steps["num_steps"] == report["real_steps"] and steps["predicted_mean"] > 0
