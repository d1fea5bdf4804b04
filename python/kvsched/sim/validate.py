"""Validation: the same trace through the real engine (:class:`kvsched.LLM`, wall-clock time) and through the
simulator (simulated time), then the scheduled batches and the latency percentiles are compared.

Both sides add a request once its arrival time has passed, at the start of a step, with the same token ids
and id (``r<index>``), and stop it at its drawn output length (``ignore_eos``). With identical arrival
interleavings the scheduler makes identical decisions; when the arrival times are spread out, which step a
request joins depends on how long earlier steps took, so batches match until the first step where the
simulated and the measured clocks put an arrival on different sides of a step boundary.
Needs the ``torch`` extra.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import SchedulerConfig
from .metrics import percentiles
from .simulator import make_config, simulate
from .steptime import StepTimeModel, lone_prefill_tokens, spill_pairs
from .summary import request_records
from .workload import PromptFactory, Workload

__all__ = ["RealRun", "compare", "prompt_fn_for_vocab", "run_real", "step_model_on_steps", "validate", "warmup_prompts"]

Batch = tuple[tuple[int, ...], tuple[int, ...]]

# Tokens each warm-up prompt generates (see warmup_prompts).
WARMUP_MAX_TOKENS = 4


class RealRun:
    """What the real engine did: per request arrival/first-token/finish times (seconds from the start of the
    trace), and each step's batch and duration."""

    def __init__(self, n: int) -> None:
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.batches: list[Batch] = []
        self.step_times: list[float] = []
        # Each step's composition as the simulator measures it: prefill tokens, prefill requests, decode
        # requests, KV tokens, prefill pairs.
        self.features: list[tuple[int, int, int, int, float]] = []
        self.request_pairs: list[npt.NDArray[np.float64]] = []  # each step's per-prefill-chunk pairs
        self.wall_s = 0.0
        # Clock time between consecutive steps (the engine loop's work outside a step; idle gaps excluded).
        self.between_steps_s = 0.0


def prompt_fn_for_vocab(workload: Workload, vocab_size: int) -> Callable[[int], npt.NDArray[np.int32]]:
    """The simulator's prompts folded into ``[3, vocab_size)`` (a tiny test model has a tiny vocabulary)."""
    factory = PromptFactory(workload.seed)
    span = vocab_size - 3

    def fn(i: int) -> npt.NDArray[np.int32]:
        toks = factory.tokens(
            i, int(workload.prompt_len[i]), int(workload.prefix_group[i]), int(workload.prefix_len[i])
        )
        out: npt.NDArray[np.int32] = ((toks.astype(np.int64) - 3) % span + 3).astype(np.int32)
        return out

    return fn


def warmup_prompts(
    workload: Workload, config: SchedulerConfig, vocab_size: int, rng: np.random.Generator
) -> list[list[list[int]]]:
    """The warm-up before the real run, as batches of prompts (random token ids), each run to its end on its own:
    four 48-token prompts together, then one prompt alone as long as the workload's longest (capped so that it
    fits: below ``max_model_len``, within the KV cache, and within the token budget without chunked prefill).

    The first request of a trace arrives at time 0, right after the warm-ups. Without a warm-up prompt as long as
    the workload's longest, it could be the process's first long prefill and pay for that, so that its measured
    TTFT would sit above the simulated one for a reason the simulator does not model."""
    batches = [[rng.integers(3, vocab_size, size=48).tolist() for _ in range(4)]]
    longest = int(workload.prompt_len.max()) if len(workload) else 0
    # A request holds at most prompt + max_tokens - 1 KV slots (add_request refuses it beyond the cache, or beyond
    # the budget without chunked prefill; docs/semantics.md).
    room = WARMUP_MAX_TOKENS - 1
    cap = min(config.max_model_len - 1, config.kv_capacity_tokens - room)
    if not config.enable_chunked_prefill:
        cap = min(cap, config.max_num_batched_tokens - room)
    n = min(longest, cap)
    if n > 48:
        batches.append([rng.integers(3, vocab_size, size=n).tolist()])
    return batches


def _llm_kwargs(cfg: SchedulerConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    d.pop("prefix_hash_seed", None)
    return d


def run_real(
    llm: Any,
    workload: Workload,
    prompt_fn: Callable[[int], npt.NDArray[np.int32]],
    *,
    time_scale: float = 1.0,
    clock: str = "wall",
    idle_work: Callable[[], object] | None = None,
) -> RealRun:
    """Replay ``workload`` through ``llm`` (arrival times multiplied by ``time_scale``).

    ``clock="wall"``: real time; the loop sleeps until the next arrival when idle. ``clock="cpu"``: a clock that
    advances by the CPU time each step takes on this thread (and jumps to the next arrival when idle), so that
    other processes on a shared machine do not distort the measurement (CPU device, torch single-threaded).
    The harness's own work is not charged to either clock: adding a request (``LLM.add_request``; a server
    ingests requests off the step loop, and the simulator does not charge it either) and recording each step
    (its batch, composition and the requests' token times, a small fraction of a decode step of the tiny test
    model). What the clock does count between steps is the engine loop's own work
    (``has_unfinished_requests``), in ``RealRun.between_steps_s``.

    ``idle_work``: called, off the clock, whenever the engine is idle before an arrival (``--validate`` runs its
    calibration workloads there; it must leave the engine idle). Only with the virtual clock."""
    if idle_work is not None and clock != "cpu":
        raise ValueError("idle_work needs clock='cpu' (the wall clock cannot leave it out)")
    from ..engine import SamplingParams
    from .calibrate import clock_fn
    from .steptime import request_pairs, step_features

    tick = clock_fn(clock)
    virtual = clock == "cpu"

    sched = llm.scheduler
    n = len(workload)
    arrival = (workload.arrival_time * time_scale).tolist()
    prompts = [prompt_fn(i) for i in range(n)]
    real = RealRun(n)
    idx_of = {f"r{i}": i for i in range(n)}
    known = np.zeros(n, dtype=np.int64)  # prompt + outputs so far
    i = 0
    wall0 = time.monotonic()
    t0 = tick()
    # The run's clock is tick() - t0 + offset: offset takes off the harness's own work and, on the virtual
    # clock, adds the idle time skipped to reach the next arrival.
    offset = 0.0
    last_end: float | None = None  # clock at the end of the previous step (None after an idle gap)
    while i < n or llm.has_unfinished_requests():
        now = tick() - t0 + offset
        a0 = tick()
        while i < n and arrival[i] <= now:
            params = SamplingParams(max_tokens=int(workload.output_len[i]), temperature=0.0, ignore_eos=True)
            llm.add_request(prompts[i].tolist(), params, request_id=f"r{i}")
            known[i] = len(prompts[i])
            i += 1
        offset -= tick() - a0
        if not llm.has_unfinished_requests():
            if idle_work is not None:
                w0 = tick()
                idle_work()
                offset -= tick() - w0
            if virtual:
                offset += max(0.0, arrival[i] - now)
            else:
                time.sleep(max(0.0, arrival[i] - now))
            last_end = None
            continue
        s0 = tick() - t0 + offset
        out = sched.schedule()
        sampled = llm.runner.execute(out, sched.prepare_model_inputs(out))
        res = sched.update_from_output(out, sampled)
        finished = llm._postprocess(out, sampled, res)
        s1 = tick() - t0 + offset
        b0 = tick()  # the harness's recording, off the clock
        if last_end is not None:
            real.between_steps_s += s0 - last_end
        last_end = s1
        got = np.asarray(res.num_new_tokens)
        if out.req_ids:
            idx = np.fromiter((idx_of[r] for r in out.req_ids), np.int64, len(out.req_ids))
            nst = np.asarray(out.num_scheduled_tokens)
            nct = np.asarray(out.num_computed_tokens)
            real.batches.append((tuple(idx.tolist()), tuple(nst.tolist())))
            real.step_times.append(s1 - s0)
            is_dec = nct == known[idx] - 1
            real.features.append(step_features(nst, nct, is_dec))
            real.request_pairs.append(request_pairs(nst, nct, is_dec))
            known[idx] += got
        for k in np.flatnonzero(got).tolist():
            j = idx_of[out.req_ids[k]]
            if np.isnan(real.first_token[j]):
                real.first_token[j] = s1
        for req in finished:
            real.finish[idx_of[req.request_id]] = s1
        offset -= tick() - b0
    real.wall_s = time.monotonic() - wall0
    return real


def step_model_on_steps(
    model: StepTimeModel,
    features: list[tuple[int, int, int, int, float]],
    pairs: list[npt.NDArray[np.float64]],
    step_times: list[float],
    new_sizes: npt.NDArray[np.bool_] | None = None,
) -> dict[str, dict[str, float]]:
    """The step-time model on measured steps (each step's composition: prefill tokens, prefill requests, decode
    requests, KV tokens, prefill pairs; its prefill chunks' query-key pairs; its measured time): per kind of step
    (all, with a prefill chunk, lone prefill, decode only; with ``new_sizes``, per step whether its size was new
    to the engine under the model's step-size cache, also steps with a prefill of a new size and of a size run
    recently) the number of steps and the measured and predicted mean time."""
    f = np.asarray(features, dtype=np.float64).reshape(-1, 5)
    spill = np.array([spill_pairs(p, model.attn_spill_pairs) for p in pairs], dtype=np.float64)
    lone = lone_prefill_tokens(f[:, 0], f[:, 1], f[:, 2])
    new = np.zeros(len(f), dtype=np.bool_) if new_sizes is None else np.asarray(new_sizes, dtype=np.bool_)
    pred = model.predict(np.column_stack([np.ones(len(f)), f, np.zeros(len(f)), spill, lone, new]))
    meas = np.asarray(step_times, dtype=np.float64)
    has_prefill = f[:, 1] > 0
    kinds = {
        "all": np.ones(len(f), dtype=np.bool_),
        "with_prefill": has_prefill,
        "lone_prefill": (f[:, 1] == 1) & (f[:, 2] == 0),
        "decode_only": ~has_prefill,
    }
    if new_sizes is not None:
        kinds["prefill_new_size"] = has_prefill & new
        kinds["prefill_recent_size"] = has_prefill & ~new
    return {
        k: {
            "num_steps": int(m.sum()),
            "measured_mean": float(meas[m].mean()) if m.any() else float("nan"),
            "predicted_mean": float(pred[m].mean()) if m.any() else float("nan"),
        }
        for k, m in kinds.items()
    }


def compare(real: RealRun, workload: Workload, sim_res: Any, *, time_scale: float = 1.0) -> dict[str, Any]:
    """Batches (how many steps agree before the first difference), TTFT/e2e percentiles real vs simulated, and
    the step-time model's error on the real run's own steps (their measured composition)."""
    sim_batches = sim_res.batches or []
    same = 0
    for a, b in zip(real.batches, sim_batches, strict=False):
        if a != b:
            break
        same += 1
    identical = same == len(real.batches) == len(sim_batches)
    rec = request_records(sim_res)
    arrival = workload.arrival_time * time_scale
    real_ttft = real.first_token - arrival
    real_e2e = real.finish - arrival
    out: dict[str, Any] = {
        "num_requests": len(workload),
        "real_steps": len(real.batches),
        "sim_steps": len(sim_batches),
        "batches_identical": identical,
        "steps_identical_before_first_difference": same,
        "real_wall_s": real.wall_s,
        "real_between_steps_s": real.between_steps_s,
        "real_step_time_sum": float(np.sum(real.step_times)),
        "real_step_time_mean": float(np.mean(real.step_times)) if real.step_times else float("nan"),
        "sim_step_time_mean": float(sim_res.step_time.mean()) if sim_res.num_steps else float("nan"),
    }
    if real.features:
        out["step_model_on_real_steps"] = step_model_on_steps(
            sim_res.step_model, real.features, real.request_pairs, real.step_times
        )
    for name, r, s in (("ttft", real_ttft, rec.ttft), ("e2e", real_e2e, rec.e2e)):
        pr, ps = percentiles(r), percentiles(s)
        out[name] = {
            "real": pr,
            "sim": ps,
            "rel_error": {k: (ps[k] - pr[k]) / pr[k] if pr[k] else float("nan") for k in ("mean", "p50", "p90", "p99")},
        }
    return out


def validate(
    model: str | os.PathLike[str],
    workload: Workload,
    config: SchedulerConfig | dict[str, Any],
    step_model: StepTimeModel | None,
    *,
    device: str = "cpu",
    num_threads: int | None = 1,
    seed: int = 0,
    clock: str | None = None,
) -> dict[str, Any]:
    """Run ``workload`` through :class:`kvsched.LLM` on ``model`` and through the simulator; compare.

    ``step_model=None`` calibrates one on the same engine instance (:class:`kvsched.sim.calibrate.CalibrationSession`):
    on the virtual (``"cpu"``) clock its workloads run at the real run's idle points, off the clock, and any left
    over after it; on the wall clock all of them run just before the real run."""
    import torch

    from ..engine import LLM, SamplingParams
    from ..runner.host_memory import keep_freed_memory

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    cfg = make_config(config)
    # On the CPU, freed memory stays in the process: otherwise a prefill after a run of decode steps faults its
    # activations in again and costs more, by an amount that varies from run to run (runner/host_memory.py).
    kept = keep_freed_memory() if torch.device(device).type == "cpu" else False
    llm = LLM(model, device=device, seed=seed, **_llm_kwargs(cfg))
    vocab = int(llm.model_config.vocab_size)
    fn = prompt_fn_for_vocab(workload, vocab)
    # Warm up (first calls allocate), then drop what the warm-up cached so both runs start from an empty cache.
    rng = np.random.default_rng(seed + 1)
    warm_params = SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for batch in warmup_prompts(workload, llm.scheduler.config, vocab, rng):
        llm.generate(batch, warm_params, use_tqdm=False)
    if clock is None:
        clock = "cpu" if llm.device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    fit: dict[str, Any] | None = None
    session = None
    if step_model is None:
        from .calibrate import CalibrationSession

        session = CalibrationSession(llm, seed=seed, clock=clock)
        if clock != "cpu":  # the wall clock cannot leave calibration work out: calibrate first
            while session.run_next():
                pass
    llm.scheduler.reset_prefix_cache()
    idle_work: Callable[[], object] | None = None
    if session is not None and not session.done:
        # On the virtual clock the calibration workloads run at the real run's idle points (one each, with a
        # decode run after it, off the clock), so that both measure the machine over the same stretch of time:
        # a shared VM's speed can change markedly within seconds. What is left runs after the real run.
        idle_work = functools.partial(session.run_next, trailer=True)
    real = run_real(llm, workload, fn, clock=clock, idle_work=idle_work)
    if session is not None:
        interleaved = session.next
        while session.run_next():
            pass
        step_model, fit = session.fit(os.path.basename(os.fspath(model)))
        fit["workloads_during_real_run"] = interleaved if idle_work is not None else 0
        fit["workloads"] = len(session.work)
    assert step_model is not None
    sim = simulate(workload, cfg, step_model, record_batches=True, keep_records=True, prompt_fn=fn)
    report = compare(real, workload, sim)
    report["device"] = str(llm.device)
    report["torch_threads"] = torch.get_num_threads()
    report["clock"] = clock
    report["keep_freed_memory"] = kept
    report["step_model"] = step_model.to_dict()
    if fit is not None:
        report["calibration"] = fit
    return report
