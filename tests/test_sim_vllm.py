"""``kvsched.sim.vllm_engine``: the timing hook notes each step's composition as the simulator measures it, the
calibration recovers a known step-time model from an engine's steps, and the validation replays a workload through
the engine and the simulator and compares them, on a stand-in engine with vLLM's ``LLMEngine`` surface whose steps
take exactly a known linear model's time (the real vLLM engine runs in ``scripts/sim_vllm_validation.py``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import requires_rust
from kvsched.sim import StepTimeModel, WorkloadSpec, generate_workload, parse_length
from kvsched.sim.steptime import StepNoise, lone_prefill_tokens, request_pairs, spill_pairs, step_features
from kvsched.sim.validate import prompt_fn_for_vocab
from kvsched.sim.vllm_engine import FIGURES, StepLog, VllmDriver, calibrate_engine, timed_scheduler, validate_engine

pytestmark = requires_rust

CONFIG = {"block_size": 16, "num_blocks": 600, "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 1024}
TRUTH = StepTimeModel(
    step_s=2e-3, prefill_token_s=4e-5, prefill_req_s=3e-4, decode_req_s=2e-4, kv_token_s=1e-6, name="truth"
)


class _FakeRequest:
    def __init__(self, num_tokens: int) -> None:
        self.num_computed_tokens = 0
        self.num_tokens = num_tokens


class FakeVllmScheduler:
    """vLLM's scheduler surface over kvsched's scheduler: ``requests`` (with ``num_computed_tokens`` advanced by
    ``schedule()``, as vLLM does, and ``num_tokens``), ``schedule()`` returning ``num_scheduled_tokens``."""

    def __init__(self, config: dict[str, Any]) -> None:
        from kvsched import Scheduler
        from kvsched.sim import make_config

        self.core = Scheduler(make_config(config))
        self.requests: dict[str, _FakeRequest] = {}

    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.core.add_request(rid, prompt, max_tokens=max_tokens)
        self.requests[rid] = _FakeRequest(len(prompt))

    def schedule(self) -> Any:
        out = self.core.schedule()
        nst = out.num_scheduled_tokens.tolist()
        for rid, n, c in zip(out.req_ids, nst, out.num_computed_tokens.tolist(), strict=True):
            self.requests[rid].num_computed_tokens = c + n
        return SimpleNamespace(num_scheduled_tokens=dict(zip(out.req_ids, nst, strict=True)), core=out)

    def update_from_output(self, so: Any) -> tuple[list[str], list[str]]:
        out = so.core
        sampled = [
            rid for rid in out.req_ids if self.requests[rid].num_computed_tokens >= self.requests[rid].num_tokens
        ]
        got = np.array([int(rid in sampled) for rid in out.req_ids], dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(got)])
        res = self.core.update_from_output(out, (np.full(len(sampled), 7, dtype=np.int64), indptr))
        for rid in sampled:
            self.requests[rid].num_tokens += 1
        for rid in res.finished_req_ids:
            del self.requests[rid]
        return sampled, list(res.finished_req_ids)


class FakeEngine:
    """vLLM's ``LLMEngine`` surface; each step takes exactly ``model``'s time for its composition on ``now`` (times
    a factor drawn from ``noise``, if given)."""

    def __init__(self, scheduler_cls: type, model: StepTimeModel, noise: StepNoise | None = None) -> None:
        self.scheduler = scheduler_cls(CONFIG)
        self.model = model
        self.noise = noise
        self.now = 0.0
        self.tokens: dict[str, int] = {}

    def add_request(self, rid: str, prompt: dict[str, Any], params: Any) -> None:
        self.scheduler.add_request(rid, prompt["prompt_token_ids"], params.max_tokens)
        self.tokens[rid] = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def step(self) -> list[Any]:
        reqs = self.scheduler.requests
        before = {rid: (r.num_computed_tokens, r.num_tokens) for rid, r in reqs.items()}
        so = self.scheduler.schedule()
        rids = list(so.num_scheduled_tokens)
        nst = np.array([so.num_scheduled_tokens[r] for r in rids])
        nct = np.array([reqs[r].num_computed_tokens - so.num_scheduled_tokens[r] for r in rids])
        is_dec = nct == np.array([before[r][1] for r in rids]) - 1
        pre, preq, dec, kv, pairs = step_features(nst, nct, is_dec)
        self.step_tokens = int(nst.sum())
        m = self.model
        dt = m.step_time(
            pre, dec, kv, pairs, prefill_reqs=preq,
            prefill_attn_spill_pairs=spill_pairs(request_pairs(nst, nct, is_dec), m.attn_spill_pairs),
            lone_prefill_tokens=float(lone_prefill_tokens(pre, preq, dec)),
        )  # fmt: skip
        self.now += dt * (self.noise.next() if self.noise is not None else 1.0)
        sampled, finished = self.scheduler.update_from_output(so)
        outs = []
        for rid in sampled:
            self.tokens[rid] += 1
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    outputs=[SimpleNamespace(token_ids=[7] * self.tokens[rid])],
                    finished=rid in finished,
                )
            )
        return outs


def _driver(model: StepTimeModel = TRUTH, noise: StepNoise | None = None) -> tuple[VllmDriver, FakeEngine]:
    log = StepLog()
    engine = FakeEngine(timed_scheduler(FakeVllmScheduler, log), model, noise)
    params = lambda n: SimpleNamespace(max_tokens=n)  # noqa: E731
    driver = VllmDriver(engine, log, dict(CONFIG), params, 300, clock="cpu", clock_fn=lambda: engine.now, name="fake")
    return driver, engine


def test_the_hook_notes_each_step_as_the_simulator_measures_it() -> None:
    driver, _ = _driver()
    steps, pairs = driver.timed_steps([(0, list(range(3, 203)), 4), (1, list(range(240, 290)), 3), (2, [5] * 700, 2)])
    assert len(steps) == len(pairs) >= 4
    # Step 0: one 200-token prompt alone; step 1: its decode and a 50-token prompt.
    assert steps[0][1:5] == (200, 1, 0, 0)
    assert steps[1][1:5] == (50, 1, 1, 201)
    assert steps[0][0] == pytest.approx(TRUTH.step_time(200, prefill_reqs=1, prefill_attn_pairs=steps[0][5]))
    # The 700-token prompt is chunked by the 512-token budget: a prefill chunk, then the rest.
    assert any(s[1] > 0 and s[2] == 1 and s[3] > 0 for s in steps)


def test_calibration_on_the_engine_recovers_its_step_time_model() -> None:
    driver, _ = _driver()
    model, fit = calibrate_engine(driver, quick=True, repeats=1, label="fake")
    assert fit["num_steps"] > 100 and fit["r2"] > 0.999
    assert fit["engine"] == "fake" and fit["block_size"] == 16
    for name in ("step_s", "prefill_token_s", "decode_req_s", "kv_token_s"):
        assert getattr(model, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), name
    # An engine whose steps take exactly the model's time has no noise to fit.
    assert model.noise_sigma < 1e-6 and fit["noise_sigma"] == model.noise_sigma


def test_calibration_fits_the_engines_step_time_noise() -> None:
    driver, _ = _driver(noise=StepNoise(0.3, 0.8, seed=11))
    model, fit = calibrate_engine(driver, repeats=2, label="fake")
    assert fit["noise_sigma"] == model.noise_sigma and fit["noise_rho"] == model.noise_rho
    assert model.noise_sigma == pytest.approx(0.3, rel=0.25)
    assert model.noise_rho == pytest.approx(0.8, abs=0.15)
    # The mean step time stays the model's: the coefficients are still close to the truth.
    assert model.step_s == pytest.approx(TRUTH.step_s, rel=0.2)
    off, _ = calibrate_engine(_driver(noise=StepNoise(0.3, 0.8, seed=11))[0], repeats=2, fit_noise=False)
    assert off.noise_sigma == 0 and off.noise_rho == 0


def test_validation_against_a_noisy_engine_is_closer_with_the_fitted_noise() -> None:
    spec = WorkloadSpec(rate=20.0, num_requests=120, prompt_len=parse_length("uniform:16:400"),
                        output_len=parse_length("uniform:8:60"), seed=4)  # fmt: skip
    w = generate_workload(spec, max_model_len=CONFIG["max_model_len"])
    noisy = dataclasses.replace(TRUTH, noise_sigma=0.4, noise_rho=0.9)
    errors = {}
    for name, model in (("without", TRUTH), ("with", noisy)):
        driver, _ = _driver(noise=StepNoise(0.4, 0.9, seed=5))
        report = validate_engine(driver, w, model, prompt_fn=prompt_fn_for_vocab(w, 300), sim_repeats=16)
        assert report["sim_repeats"] == (16 if name == "with" else 1)
        errors[name] = report["figures"]["tpot p90"]["rel_error"]
    # Without noise the simulator's TPOT tail is short of the noisy engine's; the noise model widens it.
    assert errors["without"] < -0.1
    assert abs(errors["with"]) < abs(errors["without"])


@pytest.mark.parametrize("rate", [4.0, 40.0])
def test_validation_replays_the_workload_and_the_simulator_matches_an_engine_it_models_exactly(rate: float) -> None:
    driver, _ = _driver()
    spec = WorkloadSpec(
        rate=rate, num_requests=60, prompt_len=parse_length("uniform:16:400"), output_len=parse_length("uniform:2:40"),
        seed=2,
    )  # fmt: skip
    w = generate_workload(spec, max_model_len=CONFIG["max_model_len"])
    report = validate_engine(driver, w, TRUTH, prompt_fn=prompt_fn_for_vocab(w, 300))
    assert set(report["figures"]) == set(FIGURES)
    assert report["real_steps"] == report["sim_steps"]
    for name, v in report["figures"].items():
        assert abs(v["rel_error"]) < 1e-6, (name, v)
    # The per-kind pricing of the replay's own steps and TTFT's two parts agree too (the engine takes the model's time).
    kinds = report["step_model_on_real_steps"]
    assert kinds["all"]["num_steps"] == report["real_steps"] and kinds["with_prefill"]["num_steps"] > 0
    for k, v in kinds.items():
        if v["num_steps"]:
            assert v["measured_mean"] == pytest.approx(v["predicted_mean"], rel=1e-9), k
    real, sim = report["ttft_parts"]["real"], report["ttft_parts"]["sim"]
    assert real["first_step_mean"] > 0 and real["wait_mean"] >= 0
    assert real == pytest.approx(sim, rel=1e-9, abs=1e-12)
    # A model 30% off in its per-step cost shows in the figures.
    slow = dataclasses.replace(TRUTH, step_s=TRUTH.step_s * 1.3, decode_req_s=TRUTH.decode_req_s * 1.3)
    driver, _ = _driver()
    off = validate_engine(driver, w, slow, prompt_fn=prompt_fn_for_vocab(w, 300))
    assert off["figures"]["tpot mean"]["rel_error"] > 0.1


def test_validation_calibrates_on_the_engine_during_the_replay() -> None:
    driver, _ = _driver()
    spec = WorkloadSpec(rate=2.0, num_requests=30, prompt_len=parse_length("uniform:16:400"),
                        output_len=parse_length("uniform:2:40"), seed=3)  # fmt: skip
    w = generate_workload(spec, max_model_len=CONFIG["max_model_len"])
    report = validate_engine(driver, w, None, prompt_fn=prompt_fn_for_vocab(w, 300), quick=True)
    fit = report["calibration"]
    assert 0 < fit["workloads_during_replay"] <= fit["workloads"] and fit["r2"] > 0.999
    assert report["step_model"]["step_s"] == pytest.approx(TRUTH.step_s, rel=0.05)
    assert all(abs(v["rel_error"]) < 0.05 for v in report["figures"].values()), report["figures"]


class SetupCostEngine(FakeEngine):
    """A stand-in engine whose step costs ``setup_s`` more the first time it runs a step size (tokens in the step),
    as an engine that sets its kernels up per step size does (vLLM's CPU build: oneDNN matmuls)."""

    def __init__(self, scheduler_cls: type, model: StepTimeModel, setup_s: float, capacity: int = 0) -> None:
        super().__init__(scheduler_cls, model)
        self.setup_s = setup_s
        self.capacity = capacity  # sizes kept set up, least recently used dropped first (0: all of them)
        self.seen: list[int] = []

    def step(self) -> list[Any]:
        outs = super().step()
        size = self.step_tokens
        if size in self.seen:
            self.seen.remove(size)
        else:
            self.now += self.setup_s
        self.seen.append(size)
        if self.capacity:
            del self.seen[: -self.capacity]
        return outs


def test_the_calibration_grid_draws_its_prompt_lengths_anew_for_each_workload() -> None:
    from kvsched.sim.calibrate import _grid
    from kvsched.sim.vllm_engine import EngineCalibration

    fixed, fresh = (_grid(300, 1024, 16, False, np.random.default_rng(0), fresh_lengths=f) for f in (False, True))
    assert len(fixed) == len(fresh)
    lone = [len(w[0][1]) for w in fixed if len(w) == 1 and w[0][2] == 2]  # the single prompts
    lone_fresh = [len(w[0][1]) for w in fresh if len(w) == 1 and w[0][2] == 2]
    assert lone == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert lone_fresh != lone and all(n - n // 4 <= m <= n + n // 4 for n, m in zip(lone, lone_fresh, strict=True))
    # Each repeat of the grid is drawn anew: no workload runs twice (with the fixed grid each runs `repeats` times).
    for fresh_lengths, distinct in ((True, 2 * len(fixed)), (False, len(fixed))):
        work = EngineCalibration(_driver()[0], repeats=2, fresh_lengths=fresh_lengths).work
        assert len(work) == 2 * len(fixed)
        assert len({tuple(tuple(p) for _, p, _ in w) for w in work}) == distinct


def test_calibration_prices_per_step_size_setup_costs_as_a_replay_with_varied_prompts_meets_them() -> None:
    spec = WorkloadSpec(rate=2.0, num_requests=40, prompt_len=parse_length("uniform:32:400"),
                        output_len=parse_length("uniform:4:30"), seed=6)  # fmt: skip
    w = generate_workload(spec, max_model_len=CONFIG["max_model_len"])
    ratio, fitted = {}, {}
    for fresh in (False, True):
        log = StepLog()
        engine = SetupCostEngine(timed_scheduler(FakeVllmScheduler, log), TRUTH, setup_s=6e-3)
        params = lambda n: SimpleNamespace(max_tokens=n)  # noqa: E731
        driver = VllmDriver(engine, log, dict(CONFIG), params, 300, clock="cpu", clock_fn=lambda e=engine: e.now)
        report = validate_engine(
            driver, w, None, prompt_fn=prompt_fn_for_vocab(w, 300), quick=True, fit_noise=False, fresh_lengths=fresh
        )
        kind = report["step_model_on_real_steps"]["lone_prefill"]
        ratio[fresh] = kind["measured_mean"] / kind["predicted_mean"]
        fitted[fresh] = StepTimeModel.from_dict(report["step_model"])
        # The log holds every step's size, the replay's and the untimed lead-ins' too.
        assert len(log.sizes) > report["real_steps"] + report["calibration"]["num_steps"]
        assert report["step_model_on_real_steps"]["prefill_new_size"]["num_steps"] > 0
    # The engine pays the set-up on a size it never ran (an unbounded cache): the fit finds the price, with a cache
    # at least as large as the run's distinct sizes, from the fixed grid (which repeats its sizes) and the drawn one
    # alike, and prices the replay's lone prefills (new sizes) right.
    for fresh in (False, True):
        assert fitted[fresh].new_size_step_s == pytest.approx(6e-3, rel=0.05), fresh
        assert fitted[fresh].step_size_cache >= 128 and abs(ratio[fresh] - 1) < 0.05, (fresh, ratio)


def test_calibration_finds_an_engine_that_keeps_the_last_32_step_sizes() -> None:
    spec = WorkloadSpec(rate=2.0, num_requests=40, prompt_len=parse_length("uniform:32:400"),
                        output_len=parse_length("uniform:4:30"), seed=6)  # fmt: skip
    w = generate_workload(spec, max_model_len=CONFIG["max_model_len"])
    log = StepLog()
    engine = SetupCostEngine(timed_scheduler(FakeVllmScheduler, log), TRUTH, setup_s=6e-3, capacity=32)
    params = lambda n: SimpleNamespace(max_tokens=n)  # noqa: E731
    driver = VllmDriver(engine, log, dict(CONFIG), params, 300, clock="cpu", clock_fn=lambda e=engine: e.now)
    report = validate_engine(driver, w, None, prompt_fn=prompt_fn_for_vocab(w, 300), quick=True, fit_noise=False)
    model = StepTimeModel.from_dict(report["step_model"])
    assert model.step_size_cache == 32 and model.new_size_step_s == pytest.approx(6e-3, rel=0.05)
    kinds = report["step_model_on_real_steps"]
    for kind in ("all", "prefill_new_size", "prefill_recent_size"):
        assert kinds[kind]["measured_mean"] == pytest.approx(kinds[kind]["predicted_mean"], rel=0.02), kind
