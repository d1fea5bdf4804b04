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
from kvsched.sim.steptime import new_size_flags  # noqa: E402
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
    sim = simulate(w, CONFIG, PRESETS["llama-3.2-1b-h100"], record_batches=True, keep_records=True, prompt_fn=fn)
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
    # No lone-prefill premium in the truth: the fit adds at most a trace of one (lone prefills here are <=200 tokens).
    assert fitted.lone_prefill_token_s < 0.05 * truth.prefill_token_s


@pytest.mark.parametrize("slow_share", [0.4, 0.1])
def test_calibration_fit_predicts_the_mean_step_time_under_noise(slow_share: float) -> None:
    # Timings on a shared machine: a share of the steps run 1.75x slower (other work on the machine), the rest
    # with 3% noise. The simulator adds step times up, so the fit must price a composition at the mean of its
    # timings, not below it as a fit weighted by each step's own measured time does (1.18x instead of 1.3x with
    # 40% slow steps), nor by dropping the slow steps as outliers (what a cut at 5x the median residual did with
    # 10% slow steps).
    truth = StepTimeModel(step_s=1e-3, prefill_token_s=2e-5, prefill_req_s=3e-4, decode_req_s=2e-4, name="t")
    rng = np.random.default_rng(2)
    steps = []
    for _ in range(600):
        preq, dec = int(rng.integers(0, 3)), int(rng.integers(0, 32))
        pre = preq * int(rng.integers(16, 400))
        slow = 1.75 if rng.random() < slow_share else 1.0
        t = truth.step_time(pre, dec, prefill_reqs=preq) * slow * (1 + rng.normal(0, 0.03))
        steps.append((t, pre, preq, dec, 0, 0.0))
    fitted, fit = fit_step_time_model(steps)
    assert fit["total_time_rel_error"] < 0.02 and fit["num_outliers_dropped"] == 0
    mean_factor = 1 + 0.75 * slow_share
    for name in ("step_s", "prefill_token_s", "decode_req_s"):
        assert getattr(fitted, name) == pytest.approx(mean_factor * getattr(truth, name), rel=0.1), name


def test_calibration_fit_recovers_the_lone_prefill_term() -> None:
    # Steps where a prefill chunk alone in its step costs 1.5e-6 s more per token than the linear terms say: the
    # fit recovers that price and the others; on steps without it (the test above) it stays near 0.
    truth = StepTimeModel(
        step_s=1e-3, prefill_token_s=3e-6, prefill_req_s=3e-4, decode_req_s=2e-4, kv_token_s=5e-7,
        lone_prefill_token_s=1.5e-6, name="t",
    )  # fmt: skip
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(400):
        kind = rng.integers(0, 3)  # a lone prefill; several prefills; prefills and decodes
        preq = 1 if kind == 0 else int(rng.integers(1 if kind == 2 else 2, 4))
        dec = 0 if kind < 2 else int(rng.integers(1, 32))
        pre = int(rng.integers(16, 512, size=preq).sum())
        kv = dec * int(rng.integers(16, 512))
        lone = pre if (preq == 1 and dec == 0) else 0
        t = truth.step_time(pre, dec, kv, prefill_reqs=preq, lone_prefill_tokens=lone) * (1 + rng.normal(0, 0.01))
        steps.append((t, pre, preq, dec, kv, 0.0))
    for _ in range(200):  # decode-only steps
        dec = int(rng.integers(1, 64))
        kv = dec * int(rng.integers(16, 1024))
        steps.append((truth.step_time(0, dec, kv) * (1 + rng.normal(0, 0.01)), 0, 0, dec, kv, 0.0))
    fitted, fit = fit_step_time_model(steps)
    assert "lone_prefill_tokens" in fit["features"] and fit["median_rel_error"] < 0.02
    for name in ("step_s", "prefill_token_s", "decode_req_s", "kv_token_s", "lone_prefill_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    resid = residuals(fitted, steps)
    assert np.median(np.abs(resid) / np.array([s[0] for s in steps])) < 0.02


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


def test_timed_steps_skip_the_untimed_lead_in(tmp_path: Path) -> None:
    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    llm = LLM(path, device="cpu", seed=0, **CONFIG)
    # A 20-token request decoding for 4 steps (steps 0-3, untimed), then a 100-token prompt at step 4.
    steps = run_timed_steps(llm, [(0, list(range(3, 23)), 4), (4, list(range(5, 105)), 3)], untimed_steps=4)
    assert steps[0][1:4] == (96, 1, 0)  # the first timed step is the prompt's first chunk, alone
    assert sum(s[1] for s in steps) == 100 and sum(s[3] for s in steps) == 3 - 1


def test_real_run_clock_counts_the_engine_not_the_harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake clock that only the engine's steps and the harness's own work move: each step 1 ms, adding a request
    # 5 ms, recording a step 7 ms, and the work run at idle points (calibration workloads in --validate) its own
    # steps plus 11 ms. The run's clock must count the real run's steps only, so the real run and a simulation
    # with a constant 1 ms step agree exactly: same batches, same first-token and finish times.
    import kvsched.sim.calibrate as calibrate_mod
    import kvsched.sim.steptime as steptime_mod

    now = [0.0]
    monkeypatch.setattr(calibrate_mod, "clock_fn", lambda clock: lambda: now[0])
    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    w = _workload()
    w.arrival_time = np.arange(len(w)) * 0.03  # 30 ms apart: the engine goes idle between some of them
    llm = LLM(path, device="cpu", seed=0, **CONFIG)

    def advance(fn, dt):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            now[0] += dt
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(llm.runner, "execute", advance(llm.runner.execute, 1e-3))
    monkeypatch.setattr(llm, "add_request", advance(llm.add_request, 5e-3))
    monkeypatch.setattr(steptime_mod, "step_features", advance(steptime_mod.step_features, 7e-3))
    idle_calls = []

    def idle_work() -> None:
        idle_calls.append(run_timed_steps(llm, [(0, list(range(3, 40)), 3)], clock="cpu"))
        now[0] += 11e-3

    fn = prompt_fn_for_vocab(w, int(llm.model_config.vocab_size))
    real = run_real(llm, w, fn, clock="cpu", idle_work=idle_work)
    n = len(real.step_times)
    assert n > len(w) and real.step_times == pytest.approx([1e-3] * n)
    assert real.between_steps_s == pytest.approx(0.0, abs=1e-12) and len(idle_calls) > 1
    sim = simulate(
        w, CONFIG, StepTimeModel(step_s=1e-3, name="1ms"), record_batches=True, keep_records=True, prompt_fn=fn
    )
    assert sim.batches == real.batches
    rec = request_records(sim)
    np.testing.assert_allclose(real.first_token - w.arrival_time, rec.ttft, atol=1e-9)
    np.testing.assert_allclose(real.finish - w.arrival_time, rec.e2e, atol=1e-9)
    with pytest.raises(ValueError, match="idle_work"):
        run_real(llm, w, fn, clock="wall", idle_work=idle_work)


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


def test_validate_warms_up_with_the_workloads_longest_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first request of a trace is the engine's first long prefill unless the warm-up ran one: the warm-up must
    # include a prompt as long as the workload's longest, run alone (as the first request runs at low load).
    from kvsched.config import SchedulerConfig
    from kvsched.sim.validate import validate, warmup_prompts

    calls: list[list[int]] = []
    generate = LLM.generate

    def recording(self, prompts, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append([len(p) for p in prompts])
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", recording)
    path = tmp_path / "m"
    save_tiny_hf_model(path, "llama", max_position_embeddings=512)
    w = _workload()
    w.arrival_time = np.arange(len(w)) * 0.01
    longest = int(w.prompt_len.max())
    report = validate(path, w, CONFIG, PRESETS["llama-3.2-1b-h100"])
    assert report["real_steps"] > 0
    assert [longest] in calls and calls[0] == [48] * 4

    # Capped where such a prompt could not run: below max_model_len, within the KV cache (a warm-up request holds
    # prompt + 3 slots), within the budget without chunked prefill; none when the workload's prompts are short.
    rng = np.random.default_rng(0)
    w.prompt_len[0] = 2000
    cases = [
        (SchedulerConfig(max_model_len=1024), 1023),
        (SchedulerConfig(max_model_len=4096, num_blocks=101, block_size=16), 1597),
        (SchedulerConfig(max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=4096), 2000),
        (SchedulerConfig(max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=1500), 1497),
    ]
    for cfg, want in cases:
        batches = warmup_prompts(w, cfg, 300, rng)
        assert [len(p) for p in batches[-1]] == [want], cfg
        assert all(3 <= t < 300 for b in batches for p in b for t in p)
    w.prompt_len[:] = 40
    assert [[len(p) for p in b] for b in warmup_prompts(w, SchedulerConfig(), 300, rng)] == [[48] * 4]


@pytest.mark.parametrize("capacity", [32, 64])
def test_calibration_fit_recovers_the_new_size_term(capacity: int) -> None:
    # Steps drawn from 80 compositions in random order: a step costs 3 ms more when its size (scheduled tokens) is
    # not among the last `capacity` distinct sizes. Some steps run untimed (a lead-in): they still set sizes up.
    truth = StepTimeModel(
        step_s=1e-3, prefill_token_s=3e-6, prefill_req_s=3e-4, decode_req_s=2e-4, kv_token_s=5e-7,
        new_size_step_s=3e-3, step_size_cache=capacity, name="t",
    )  # fmt: skip
    rng = np.random.default_rng(11)
    pool = []
    while len(pool) < 80:
        dec = int(rng.integers(0, 24))
        preq = int(rng.integers(0 if dec else 1, 3))
        pre = int(rng.integers(16, 400, size=preq).sum())
        if pre + dec not in {p + d for p, _, d in pool}:
            pool.append((pre, preq, dec))
    draws = [pool[i] for i in rng.integers(0, len(pool), size=2000)]
    sizes = [p + d for p, _, d in draws]
    new = new_size_flags(sizes, capacity)
    steps, index = [], []
    for i, ((pre, preq, dec), is_new) in enumerate(zip(draws, new, strict=True)):
        if i % 5 == 4:
            continue  # untimed
        kv = dec * int(rng.integers(16, 512))
        t = truth.step_time(pre, dec, kv, prefill_reqs=preq, new_size_steps=float(is_new))
        steps.append((t * (1 + rng.normal(0, 0.01)), pre, preq, dec, kv, 0.0))
        index.append(i)
    fitted, fit = fit_step_time_model(steps, step_sizes=sizes, timed_index=index)
    assert fitted.step_size_cache == capacity and fit["step_size_cache"] == capacity
    assert "new_size_steps" in fit["features"] and 0.02 < fit["new_size_share"] < 0.95
    for name in ("step_s", "prefill_token_s", "decode_req_s", "kv_token_s", "new_size_step_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert fit["median_rel_error"] < 0.02
    resid = residuals(fitted, steps, new_sizes=new_size_flags(sizes, capacity)[index])
    assert np.median(np.abs(resid) / np.array([s[0] for s in steps])) < 0.02
    # Without the sizes the fit has no such term, and is the fit it was before the term existed.
    plain, plain_fit = fit_step_time_model(steps)
    assert plain.new_size_step_s == 0 and plain.step_size_cache == 0 and "step_size_cache" not in plain_fit
    assert plain_fit["median_rel_error"] > 2 * fit["median_rel_error"]


def test_calibration_fit_leaves_the_new_size_term_off_when_sizes_cost_nothing() -> None:
    rng = np.random.default_rng(12)
    truth = StepTimeModel(step_s=1e-3, prefill_token_s=3e-6, decode_req_s=2e-4, name="t")
    steps, sizes = [], []
    for _ in range(600):
        dec, pre = int(rng.integers(1, 32)), int(rng.integers(0, 300))
        steps.append((truth.step_time(pre, dec) * (1 + rng.normal(0, 0.01)), pre, int(pre > 0), dec, 0, 0.0))
        sizes.append(pre + dec)
    fitted, _ = fit_step_time_model(steps, step_sizes=sizes, timed_index=list(range(len(steps))))
    assert fitted.new_size_step_s < 0.05 * truth.step_s
    with pytest.raises(ValueError, match="go together"):
        fit_step_time_model(steps, step_sizes=sizes)
    with pytest.raises(ValueError, match="timed_index"):
        fit_step_time_model(steps, step_sizes=sizes[:10], timed_index=list(range(len(steps))))
