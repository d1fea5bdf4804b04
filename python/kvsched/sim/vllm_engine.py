"""The simulator against vLLM itself: fit the step-time model to a vLLM engine's own steps, then replay a workload
through that engine and through the simulator and compare what they measure.

**Timing hook.** vLLM's scheduler is replaced by a subclass of itself (:func:`timed_scheduler`, passed as
``scheduler_cls``) that notes, at each ``schedule()``, the step's composition exactly as the simulator measures it
(prefill tokens, prefill and decode requests, KV tokens of the decodes, query-key pairs of the prefill chunks;
:func:`kvsched.sim.steptime.step_features`): vLLM has advanced each scheduled request's ``num_computed_tokens`` by
the step's tokens when ``schedule()`` returns, so what it had computed before is that minus its scheduled tokens,
and a request decodes when that is its known length (``num_tokens``) minus one. vLLM is not patched; the same
subclass wraps vLLM's own ``Scheduler`` or ``kvsched.vllm.Scheduler``. The driver (:class:`VllmDriver`) times each
``LLMEngine.step()`` (schedule, model, update and output processing: the engine loop), with vLLM's engine core in
this process so that a step is one call.

**Calibration** (:func:`calibrate_engine`): the calibration grid of ``kvsched simulate --calibrate``
(:mod:`kvsched.sim.calibrate`: pairs of prefills, lone prompts, decode batches, mixed arrivals), each workload
after an untimed decode lead-in, twice in a shuffled order, fitted by
:func:`~kvsched.sim.calibrate.fit_step_time_model`, with the step-time noise of the engine (the spread of its
steps' times around the model and how long slow stretches last: ``noise_sigma``, ``noise_rho`` in
:mod:`kvsched.sim.steptime`) unless ``fit_noise=False``.

**Fresh prompt lengths** (``fresh_lengths=True``, the default): the grid is drawn twice, each prompt's length
within a quarter of the grid's length, so that the calibration's prefill steps seldom repeat a step size (tokens
in the step), as a served workload with varied prompt lengths seldom does. The engine's cost depends on it: vLLM's
CPU build runs each linear layer through a oneDNN matmul primitive made for the step's number of tokens on the
first step of that size and kept in caches (per layer the last 32 sizes, and oneDNN's own cache of 1,024
primitives by default), so a step of a size not run recently costs more (on a tiny Llama a lone prefill of a new
length takes about 1.6 times as long as the same length run again). Decode steps (batch sizes) repeat in both.
With ``fresh_lengths=False`` the grid's fixed lengths run, each workload twice: its prefill steps are then mostly
sizes run before, and the model prices a served workload's prefill steps low. The fit prices the set-up itself
with the step-time model's new-size term: :class:`StepLog` records the size of every step the engine runs (timed
or not), and the fit tries capacities of the engine's cache of recent sizes
(:func:`~kvsched.sim.calibrate.fit_step_time_model` with ``step_sizes``).

**Validation** (:func:`validate_engine`): the workload's requests are added when their arrival time has passed on
the run's clock (``"wall"``: real time, sleeping when the engine is idle; ``"cpu"``: the CPU time the engine's
steps take, jumping idle gaps, so that other processes on a shared machine do not slow the run), each with its
drawn output length (``ignore_eos``); then the simulator runs the same workload with the fitted model and the
engine's scheduler configuration (block size, KV blocks, batch limits). TTFT, TPOT and e2e (mean, p50, p90, p99)
and request and output-token throughput are compared. With a noisy step-time model the simulator's figures are
the means over ``sim_repeats`` runs with different noise seeds (the expected figure, not one draw of it).

vLLM is imported only by :func:`make_vllm_engine`; the rest works on any engine with vLLM's ``LLMEngine`` surface
(``add_request``, ``step``, ``has_unfinished_requests``) and a scheduler with vLLM's (``requests``,
``schedule()`` returning ``num_scheduled_tokens``), which the tests use with a stand-in.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from .calibrate import LEAD_IN_PROMPT, LEAD_IN_STEPS, TimedStep, _grid, fit_step_time_model
from .metrics import PERCENTILES
from .simulator import make_config, simulate
from .steptime import StepTimeModel, new_size_flags, request_pairs, step_features
from .workload import Workload

__all__ = [
    "ENGINE_ENV",
    "FIGURES",
    "EngineCalibration",
    "StepLog",
    "VllmDriver",
    "calibrate_engine",
    "compare_runs",
    "make_vllm_engine",
    "run_engine",
    "timed_scheduler",
    "validate_engine",
]

# vLLM's engine core in this process (one engine step per call), request ids as given, no network.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    "HF_HUB_OFFLINE": "1",
}
# The figures compared (each "<metric> <stat>").
FIGURES = (
    *(f"{m} {s}" for m in ("ttft", "tpot", "e2e") for s in ("mean", *(f"p{p}" for p in PERCENTILES))),
    "request_throughput",
    "output_token_throughput",
)


class StepLog:
    """Each scheduler step's composition, noted by :func:`timed_scheduler`'s subclass (``entries``: per step the
    scheduled request ids, scheduled tokens, tokens computed before, and which requests decode; ``sizes``: the
    size in scheduled tokens of every step noted since the log was made, which :meth:`take` keeps: the history
    of step sizes that the new-size term of the step-time model is fitted from)."""

    def __init__(self) -> None:
        self.entries: list[tuple[list[str], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]] = []
        self.sizes: list[int] = []

    def note(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Any]) -> None:
        rids = list(num_scheduled_tokens)
        nst = np.fromiter((num_scheduled_tokens[r] for r in rids), np.int64, len(rids))
        after = np.fromiter((requests[r].num_computed_tokens for r in rids), np.int64, len(rids))
        known = np.fromiter((requests[r].num_tokens for r in rids), np.int64, len(rids))
        nct = after - nst
        self.entries.append((rids, nst, nct, nct == known - 1))
        self.sizes.append(int(nst.sum()))

    def take(self) -> list[tuple[list[str], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]]:
        out, self.entries = self.entries, []
        return out


def timed_scheduler(base: type, log: StepLog) -> type:
    """A subclass of the scheduler class ``base`` (vLLM's ``Scheduler`` or ``kvsched.vllm.Scheduler``) that notes
    each step's composition in ``log`` (see the module docstring); it changes no decision."""

    class TimedScheduler(base):  # type: ignore[misc]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            if out.num_scheduled_tokens:
                log.note(out.num_scheduled_tokens, self.requests)
            return out

    TimedScheduler.__name__ = f"Timed{base.__name__}"
    TimedScheduler.__qualname__ = TimedScheduler.__name__
    return TimedScheduler


def _clock(name: str) -> Callable[[], float]:
    if name == "wall":
        return time.perf_counter
    if name == "cpu":
        return time.process_time
    raise ValueError(f"clock must be 'wall' or 'cpu', got {name!r}")


class VllmDriver:
    """Drives an engine with vLLM's ``LLMEngine`` surface one step at a time and times each step.

    ``engine``: the engine; ``log``: the :class:`StepLog` its scheduler notes into; ``config``: the scheduler's
    limits as :class:`kvsched.SchedulerConfig` fields (for the simulator); ``sampling_params(max_tokens)``: the
    engine's sampling parameters for a request that runs to exactly ``max_tokens`` tokens; ``vocab_size``;
    ``clock``: ``"wall"`` or ``"cpu"`` (this process's CPU time), read by ``clock_fn`` if given."""

    def __init__(
        self,
        engine: Any,
        log: StepLog,
        config: dict[str, Any],
        sampling_params: Callable[[int], Any],
        vocab_size: int,
        *,
        clock: str = "cpu",
        clock_fn: Callable[[], float] | None = None,
        name: str = "vllm",
    ) -> None:
        self.engine = engine
        self.log = log
        self.config = config
        self.sampling_params = sampling_params
        self.vocab_size = vocab_size
        self.clock_name = clock
        self.clock = clock_fn if clock_fn is not None else _clock(clock)
        self.name = name

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.engine.add_request(req_id, {"prompt_token_ids": prompt}, self.sampling_params(max_tokens))

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> tuple[float, list[Any]]:
        """One engine step: its duration on the driver's clock, and the engine's outputs."""
        t0 = self.clock()
        outputs = self.engine.step()
        return self.clock() - t0, outputs

    def timed_steps(
        self,
        adds: list[tuple[int, list[int], int]],
        *,
        untimed_steps: int = 0,
        tag: str = "c",
        index_out: list[int] | None = None,
    ) -> tuple[list[TimedStep], list[npt.NDArray[np.float64]]]:
        """Run ``adds`` (step number, prompt, output length) to completion; each step numbered from
        ``untimed_steps`` on as (duration, composition), and its prefill chunks' query-key pairs. ``index_out``:
        each such step's position in the log's ``sizes`` is appended to it."""
        steps: list[TimedStep] = []
        pairs: list[npt.NDArray[np.float64]] = []
        pending = sorted(adds, key=lambda a: a[0])
        k = step = 0
        self.log.take()
        while k < len(pending) or self.has_unfinished():
            while k < len(pending) and pending[k][0] <= step:
                _, prompt, n = pending[k]
                self.add(f"{tag}{_next_id()}", prompt, n)
                k += 1
            if self.has_unfinished():
                dt, _ = self.step()
                noted = self.log.take()
                if step >= untimed_steps and len(noted) == 1:
                    _, nst, nct, is_dec = noted[0]
                    steps.append((dt, *step_features(nst, nct, is_dec)))
                    pairs.append(request_pairs(nst, nct, is_dec))
                    if index_out is not None:
                        index_out.append(len(self.log.sizes) - 1)
            step += 1
        return steps, pairs


_ids = iter(range(1 << 62))


def _next_id() -> int:
    return next(_ids)


class EngineCalibration:
    """The calibration grid on ``driver``'s engine, one workload at a time (each after an untimed decode lead-in),
    so that a replay can run them at its idle points (:func:`validate_engine`); :meth:`fit` fits the model."""

    def __init__(
        self,
        driver: VllmDriver,
        *,
        quick: bool = False,
        repeats: int = 2,
        seed: int = 0,
        fit_noise: bool = True,
        fresh_lengths: bool = True,
    ) -> None:
        self.driver = driver
        self.fit_noise = fit_noise
        self.rng = np.random.default_rng(seed)
        vocab = driver.vocab_size
        max_len = int(driver.config["max_model_len"])
        seqs = int(driver.config["max_num_seqs"])
        if fresh_lengths:  # each repeat of the grid drawn anew: no workload runs twice
            work = [w for _ in range(repeats) for w in _grid(vocab, max_len, seqs, quick, self.rng, fresh_lengths=True)]
            self.work = [work[i] for i in self.rng.permutation(len(work))]
        else:
            grid = _grid(vocab, max_len, seqs, quick, self.rng)
            self.work = [grid[i] for i in self.rng.permutation(len(grid) * repeats) % len(grid)]
        self.lead_len = max(1, min(LEAD_IN_PROMPT, max_len // 4))
        self.lead_steps = max(0, min(LEAD_IN_STEPS, max_len - self.lead_len - 1))
        self.fresh_lengths = fresh_lengths
        self.next = 0
        self.steps: list[TimedStep] = []
        self.pairs: list[npt.NDArray[np.float64]] = []
        self.segments: list[int] = []  # timed steps per workload (runs of consecutive steps)
        self.timed_index: list[int] = []  # each timed step's position in the driver log's sizes
        # Warm-up: first calls allocate and pick kernels; not timed.
        driver.timed_steps([(0, self.rng.integers(3, vocab, size=64).tolist(), 4) for _ in range(4)])

    @property
    def done(self) -> bool:
        return self.next >= len(self.work)

    def _lead(self) -> tuple[int, list[int], int]:
        return (0, self.rng.integers(3, self.driver.vocab_size, size=self.lead_len).tolist(), self.lead_steps)

    def run_next(self, *, trailer: bool = False) -> bool:
        """Run the next workload; False when none is left. ``trailer``: then one more untimed decode run, so that
        what the engine runs next finds it as after a decode run."""
        if self.done:
            return False
        adds = self.work[self.next]
        self.next += 1
        s, p = self.driver.timed_steps(
            [self._lead(), *((at + self.lead_steps, toks, n) for at, toks, n in adds)],
            untimed_steps=self.lead_steps,
            index_out=self.timed_index,
        )
        self.steps += s
        self.pairs += p
        self.segments.append(len(s))
        if trailer and self.lead_steps:
            self.driver.timed_steps([self._lead()], untimed_steps=self.lead_steps)
        return True

    def fit(self, label: str = "model") -> tuple[StepTimeModel, dict[str, Any]]:
        d = self.driver
        source = f"calibrated on {d.name} ({d.clock_name} clock) from {len(self.steps)} timed engine steps on {label}"
        model, fit = fit_step_time_model(
            self.steps,
            name=f"calibrated-{d.name}-{label}",
            source=source,
            request_pairs=self.pairs,
            fit_noise=self.fit_noise,
            segments=self.segments,
            step_sizes=d.log.sizes,
            timed_index=self.timed_index,
        )
        fit.update({"engine": d.name, "clock": d.clock_name, "model": label, "fresh_lengths": self.fresh_lengths})
        fit.update(d.config)
        return model, fit


def calibrate_engine(
    driver: VllmDriver,
    *,
    quick: bool = False,
    repeats: int = 2,
    seed: int = 0,
    label: str = "model",
    fit_noise: bool = True,
    fresh_lengths: bool = True,
) -> tuple[StepTimeModel, dict[str, Any]]:
    """Fit a step-time model to ``driver``'s engine (see the module docstring); ``fit_noise``: with its step-time
    noise (:mod:`kvsched.sim.steptime`); ``fresh_lengths``: the grid's prompt lengths drawn anew for each workload
    (see the module docstring)."""
    session = EngineCalibration(
        driver, quick=quick, repeats=repeats, seed=seed, fit_noise=fit_noise, fresh_lengths=fresh_lengths
    )
    while session.run_next():
        pass
    return session.fit(label)


class EngineRun:
    """What the engine did with a workload: per request first-token and finish times and output tokens (seconds
    on the run's clock from the first arrival), and its steps."""

    def __init__(self, n: int) -> None:
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.num_tokens = np.zeros(n, dtype=np.int64)
        self.first_scheduled = np.full(n, np.nan)  # start of the first step that schedules the request
        self.num_steps = 0
        self.step_time_sum = 0.0
        self.wall_s = 0.0
        # Per step: start and end on the run's clock, duration, composition (prefill tokens, prefill requests,
        # decode requests, KV tokens, prefill pairs) and its prefill chunks' query-key pairs.
        self.step_start: list[float] = []
        self.step_end: list[float] = []
        self.step_times: list[float] = []
        self.features: list[tuple[int, int, int, int, float]] = []
        self.request_pairs: list[npt.NDArray[np.float64]] = []
        self.size_index: list[int] = []  # each step's position in the driver log's sizes
        # Clock time between consecutive steps (the engine loop's own work outside a step; idle gaps excluded).
        self.between_steps_s = 0.0


def run_engine(
    driver: VllmDriver,
    workload: Workload,
    prompt_fn: Callable[[int], npt.NDArray[np.int32]],
    target: npt.NDArray[np.int64],
    *,
    idle_work: Callable[[], object] | None = None,
) -> EngineRun:
    """Replay ``workload`` through ``driver``'s engine: request ``i`` (id ``r<i>``, prompt ``prompt_fn(i)``, run to
    ``target[i]`` tokens) is added once its arrival time has passed on the driver's clock. On the ``"cpu"`` clock
    time moves by the CPU time of the engine's steps and jumps to the next arrival when the engine is idle; on the
    ``"wall"`` clock it is real time and the loop sleeps. Adding a request is not counted on either.
    ``idle_work``: called, off the clock, whenever the engine is idle before an arrival (the CPU clock only; it
    must leave the engine idle)."""
    if idle_work is not None and driver.clock_name != "cpu":
        raise ValueError("idle_work needs the cpu clock (the wall clock cannot leave it out)")
    n = len(workload)
    arrival = workload.arrival_time.tolist()
    prompts = [prompt_fn(i).tolist() for i in range(n)]
    run = EngineRun(n)
    index = {f"r{i}": i for i in range(n)}
    virtual = driver.clock_name == "cpu"
    tick = driver.clock
    wall0 = time.monotonic()
    t0 = tick()
    offset = 0.0  # idle time skipped on the virtual clock, less the harness's own work
    last_end: float | None = None  # the clock at the end of the previous step (None after an idle gap)
    i = 0
    driver.log.take()
    while i < n or driver.has_unfinished():
        now = tick() - t0 + offset
        a0 = tick()
        while i < n and arrival[i] <= now:
            driver.add(f"r{i}", prompts[i], int(target[i]))
            i += 1
        # Adding requests is off the clock: a server's front end takes them in beside the engine's step loop (vLLM's
        # AsyncLLM processes inputs in its own process), and the simulator does not charge it either.
        offset -= tick() - a0
        if not driver.has_unfinished():
            if idle_work is not None:
                w0 = tick()
                idle_work()
                offset -= tick() - w0
                now = tick() - t0 + offset
            gap = max(0.0, arrival[i] - now)
            if virtual:
                offset += gap
            else:
                time.sleep(gap)
            last_end = None
            continue
        s0 = tick() - t0 + offset
        dt, outputs = driver.step()
        end = tick() - t0 + offset
        b0 = tick()  # the harness's recording, off the clock
        if last_end is not None:
            run.between_steps_s += s0 - last_end
        last_end = end
        run.num_steps += 1
        run.step_time_sum += dt
        noted = driver.log.take()
        for k, (rids, nst, nct, is_dec) in enumerate(noted):
            run.step_start.append(s0)
            run.step_end.append(end)
            run.step_times.append(dt)
            run.features.append(step_features(nst, nct, is_dec))
            run.request_pairs.append(request_pairs(nst, nct, is_dec))
            run.size_index.append(len(driver.log.sizes) - len(noted) + k)
            for r in rids:
                j = index.get(r)
                if j is not None and np.isnan(run.first_scheduled[j]):
                    run.first_scheduled[j] = s0
        for out in outputs:
            j = index.get(out.request_id)
            if j is None:
                continue
            got = len(out.outputs[0].token_ids) if out.outputs else 0
            if got and np.isnan(run.first_token[j]):
                run.first_token[j] = end
            run.num_tokens[j] = max(run.num_tokens[j], got)
            if out.finished:
                run.finish[j] = end
        offset -= tick() - b0
    run.wall_s = time.monotonic() - wall0
    return run


def _figures(
    first_token: npt.NDArray[np.float64],
    finish: npt.NDArray[np.float64],
    num_tokens: npt.NDArray[np.int64],
    arrival: npt.NDArray[np.float64],
) -> dict[str, float]:
    ttft = first_token - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(num_tokens > 1, (finish - first_token) / (num_tokens - 1), np.nan)
    out: dict[str, float] = {}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        v = v[np.isfinite(v)]
        out[f"{name} mean"] = float(v.mean()) if v.size else float("nan")
        for p in PERCENTILES:
            out[f"{name} p{p}"] = float(np.percentile(v, p)) if v.size else float("nan")
    done = np.isfinite(finish)
    span = float(np.nanmax(finish) - arrival[0]) if done.any() else float("nan")
    out["request_throughput"] = float(done.sum()) / span if span > 0 else float("nan")
    out["output_token_throughput"] = float(num_tokens[done].sum()) / span if span > 0 else float("nan")
    return out


def _ttft_parts(
    arrival: npt.NDArray[np.float64], first_scheduled: npt.NDArray[np.float64], first_token: npt.NDArray[np.float64]
) -> tuple[float, float]:
    ok = np.isfinite(first_scheduled) & np.isfinite(first_token)
    if not ok.any():
        return float("nan"), float("nan")
    return float((first_scheduled - arrival)[ok].mean()), float((first_token - first_scheduled)[ok].mean())


def compare_runs(real: dict[str, float], sim: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per figure: the engine's value, the simulator's, and the relative error (sim - real) / real."""
    return {
        k: {"real": real[k], "sim": sim[k], "rel_error": (sim[k] - real[k]) / real[k] if real[k] else float("nan")}
        for k in FIGURES
    }


def validate_engine(
    driver: VllmDriver,
    workload: Workload,
    step_model: StepTimeModel | None,
    *,
    prompt_fn: Callable[[int], npt.NDArray[np.int32]],
    quick: bool = False,
    seed: int = 0,
    label: str = "model",
    fit_noise: bool = True,
    sim_repeats: int = 8,
    fresh_lengths: bool = True,
) -> dict[str, Any]:
    """Replay ``workload`` through the engine (:func:`run_engine`) and through the simulator with ``step_model`` and
    the engine's scheduler configuration; the figures of both and their relative errors.

    ``step_model=None`` calibrates on the same engine during the replay: on the CPU clock one calibration workload
    runs at each point where the engine is idle before an arrival, off the clock, and the rest after it (so that
    the model and the replay measure the machine over the same stretch of time: a shared VM's speed changes by
    up to 2x within seconds); on the wall clock all of it runs first."""
    cfg = make_config(driver.config)
    target = np.minimum(workload.output_len, cfg.max_model_len - workload.prompt_len).astype(np.int64)
    session = None
    idle_work: Callable[[], object] | None = None
    if step_model is None:
        session = EngineCalibration(driver, quick=quick, seed=seed, fit_noise=fit_noise, fresh_lengths=fresh_lengths)
        if driver.clock_name == "cpu":
            idle_work = functools.partial(session.run_next, trailer=True)
        else:
            while session.run_next():
                pass
    real = run_engine(driver, workload, prompt_fn, target, idle_work=idle_work)
    fit: dict[str, Any] | None = None
    if session is not None:
        during = session.next if idle_work is not None else 0
        while session.run_next():
            pass
        step_model, fit = session.fit(label)
        fit["workloads_during_replay"] = during
        fit["workloads"] = len(session.work)
    assert step_model is not None
    from .summary import request_records
    from .validate import step_model_on_steps

    arrival = workload.arrival_time
    real_fig = _figures(real.first_token, real.finish, real.num_tokens, arrival)
    repeats = max(1, sim_repeats) if step_model.noise_sigma > 0 else 1
    draws: list[dict[str, float]] = []
    sim_ttft_parts: list[tuple[float, float]] = []
    for k in range(repeats):
        sim = simulate(workload, cfg, step_model, keep_records=True, prompt_fn=prompt_fn, noise_seed=seed * 1000 + k)
        rec = request_records(sim)
        draws.append(_figures(rec.first_token_time, rec.finish_time, rec.num_output_tokens, arrival))
        sim_ttft_parts.append(_ttft_parts(arrival, rec.first_scheduled_time, rec.first_token_time))
    sim_fig = {f: float(np.mean([d[f] for d in draws])) for f in FIGURES}
    real_wait, real_first = _ttft_parts(arrival, real.first_scheduled, real.first_token)
    sim_wait, sim_first = (float(np.mean(v)) for v in zip(*sim_ttft_parts, strict=True))
    figures = compare_runs(real_fig, sim_fig)
    within = sum(1 for v in figures.values() if abs(v["rel_error"]) <= 0.15)
    return {
        "engine": driver.name,
        "clock": driver.clock_name,
        "num_requests": len(workload),
        "config": driver.config,
        "step_model": step_model.to_dict(),
        "real_steps": real.num_steps,
        "sim_steps": sim.num_steps,
        "real_step_time_mean": real.step_time_sum / real.num_steps if real.num_steps else float("nan"),
        "sim_step_time_mean": float(sim.step_time.mean()) if sim.num_steps else float("nan"),
        "real_wall_s": real.wall_s,
        "real_between_steps_s": real.between_steps_s,
        "sim_repeats": repeats,
        # TTFT in two parts, means over requests: arrival to the start of the first step that schedules the
        # request, and from there to its first token.
        "ttft_parts": {
            "real": {"wait_mean": real_wait, "first_step_mean": real_first},
            "sim": {"wait_mean": sim_wait, "first_step_mean": sim_first},
        },
        "step_model_on_real_steps": step_model_on_steps(
            step_model,
            real.features,
            real.request_pairs,
            real.step_times,
            new_size_flags(driver.log.sizes, step_model.step_size_cache)[real.size_index]
            if step_model.charges_new_sizes
            else None,
        ),
        "figures": figures,
        "within_15_percent": within,
        "num_figures": len(figures),
        **({"calibration": fit} if fit is not None else {}),
    }


# -- a real vLLM engine -----------------------------------------------------------------------------------------


@contextmanager
def engine_env(extra: dict[str, str] | None = None) -> Iterator[None]:
    """:data:`ENGINE_ENV` (and ``extra``) in the environment while vLLM is set up."""
    env = {**ENGINE_ENV, **(extra or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_vllm_engine(
    model: str | os.PathLike[str],
    *,
    scheduler: str = "vllm",
    clock: str = "cpu",
    seed: int = 0,
    **engine_kwargs: Any,
) -> VllmDriver:
    """vLLM's ``LLMEngine`` on ``model`` (engine core in this process, float32, eager, no tokenizer: token-id
    prompts) with its own scheduler (``scheduler="vllm"``) or ``kvsched.vllm.Scheduler`` (``"kvsched"``), wrapped
    by :func:`timed_scheduler`; ``engine_kwargs`` go to vLLM's ``EngineArgs`` (e.g. ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``num_gpu_blocks_override``)."""
    if scheduler not in ("vllm", "kvsched"):
        raise ValueError(f"scheduler must be 'vllm' or 'kvsched', got {scheduler!r}")
    with engine_env({"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}):
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor.abstract import Executor

        base: type
        if scheduler == "kvsched":
            from ..vllm import Scheduler as kvsched_scheduler

            base = kvsched_scheduler
        else:
            from vllm.v1.core.sched.scheduler import Scheduler as vllm_scheduler

            base = vllm_scheduler
        log = StepLog()
        kwargs: dict[str, Any] = {
            "model": os.fspath(model),
            "dtype": "float32",
            "enforce_eager": True,
            # On vLLM's CPU backend this is the share of host memory it reserves at start-up (the KV cache itself
            # is VLLM_CPU_KVCACHE_SPACE GiB, or num_gpu_blocks_override blocks).
            "gpu_memory_utilization": 0.05,
            "seed": seed,
            "skip_tokenizer_init": True,
            "scheduler_cls": timed_scheduler(base, log),
            **engine_kwargs,
        }
        config = EngineArgs(**kwargs).create_engine_config()
        engine = LLMEngine(config, executor_class=Executor.get_class(config), log_stats=False, multiprocess_mode=False)
    sc, cc = config.scheduler_config, config.cache_config
    sim_config = {
        "block_size": int(cc.block_size),
        "num_blocks": int(cc.num_gpu_blocks),
        "max_num_seqs": int(sc.max_num_seqs),
        "max_num_batched_tokens": int(sc.max_num_batched_tokens),
        "max_model_len": int(config.model_config.max_model_len),
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
        "long_prefill_token_threshold": int(sc.long_prefill_token_threshold or 0),
    }

    def params(max_tokens: int) -> Any:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    vocab = int(config.model_config.get_vocab_size())
    return VllmDriver(engine, log, sim_config, params, vocab, clock=clock, name=f"vllm-{scheduler}-scheduler")
