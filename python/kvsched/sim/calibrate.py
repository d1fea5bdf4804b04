"""Fit a :class:`StepTimeModel` to the real engine: time steps of :class:`kvsched.LLM` and least-squares fit.

A grid of small workloads (single prefills of growing length, decode batches of growing size and context,
and a mix with arrivals during decoding) runs through the real scheduler and torch runner; every step is timed
from ``schedule()`` to the end of ``update_from_output()`` and its composition measured exactly as the
simulator measures it. The coefficients are a non-negative least-squares fit (terms that would come out
negative are dropped and the rest refitted). Needs the ``torch`` extra; imports torch only when called.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import DEFAULT_BLOCK_SIZE
from .steptime import FEATURES, StepTimeModel, fit_step_noise, lone_prefill_tokens, new_size_flags, spill_pairs

__all__ = ["CalibrationSession", "TimedStep", "calibrate", "calibrate_llm", "fit_step_time_model", "run_timed_steps"]

# seconds, prefill tokens, prefill requests, decode requests, KV tokens, prefill query-key pairs
TimedStep = tuple[float, int, int, int, int, float]

# Refits of fit_step_time_model weighted by the predicted (not the measured) step time.
IRLS_ROUNDS = 3
# fit_step_time_model drops steps more than this many times slower (or faster) than its first fit predicts.
OUTLIER_FACTOR = 3.0
# The step-size cache capacities fit_step_time_model tries for the new-size term (distinct step sizes).
SIZE_CACHE_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024)

# The untimed lead-in before each calibration workload: a request of this many prompt tokens decoding for this
# many steps (see calibrate_llm).
LEAD_IN_PROMPT = 32
LEAD_IN_STEPS = 32


def fit_step_time_model(
    steps: list[TimedStep],
    *,
    name: str = "calibrated",
    source: str = "",
    request_pairs: list[npt.NDArray[np.float64]] | None = None,
    fit_noise: bool = False,
    segments: list[int] | None = None,
    step_sizes: list[int] | None = None,
    timed_index: list[int] | None = None,
) -> tuple[StepTimeModel, dict[str, Any]]:
    """Non-negative least squares of step time on (1, prefill tokens, prefill requests, decode requests, KV tokens,
    prefill pairs, lone prefill tokens: see :func:`kvsched.sim.steptime.lone_prefill_tokens`), on relative error
    (each row divided by its measured time, so short steps count as much as long ones). After a first fit, gross
    outliers (steps more than ``OUTLIER_FACTOR`` times slower or faster than it predicts) are dropped and the fit
    is repeated; a step slowed by other work on a shared machine is kept, since a real run on that machine is
    slowed by it too. The final coefficients come from
    ``IRLS_ROUNDS`` refits with each row divided by the previous fit's predicted time instead of its measured one,
    so that the model predicts the mean step time of a composition (dividing by the measured time biases it low).

    With ``request_pairs`` (each step's per-prefill-chunk query-key pairs, :func:`run_timed_steps`'s
    ``request_pairs_out``), the attention hinge is fitted too: for each threshold among percentiles 5-99 of the
    chunks' pair counts, the fit gets a ``prefill_attn_spill_pairs`` column; the threshold with the smallest
    relative squared error wins, if it beats the fit without a hinge.

    ``fit_noise``: also fit the model's step-time noise (``noise_sigma``, ``noise_rho``: see
    :mod:`kvsched.sim.steptime`) from the log-ratio of each kept step's measured to predicted time; ``segments``:
    the lengths of the runs of consecutive steps that ``steps`` is made of (for the lag-one correlation; default:
    one run).

    With ``step_sizes`` (the size, in scheduled tokens, of every step the engine ran, in order, timed or not) and
    ``timed_index`` (the position in it of each of ``steps``), the new-size term is fitted too: for each capacity
    in ``SIZE_CACHE_CANDIDATES`` the fit gets a column that is 1 for a timed step whose size was not among that
    many distinct sizes before it (:func:`kvsched.sim.steptime.new_size_flags`); the capacity with the smallest
    relative squared error wins, if it beats the fit without the term."""
    if len(steps) < 8:
        raise ValueError(f"need at least 8 timed steps to fit, got {len(steps)}")
    if request_pairs is not None and len(request_pairs) != len(steps):
        raise ValueError(f"request_pairs has {len(request_pairs)} entries for {len(steps)} steps")
    if segments is not None and (sum(segments) != len(steps) or any(k < 0 for k in segments)):
        raise ValueError(f"segments must be run lengths >= 0 adding up to {len(steps)} steps, got {sum(segments)}")
    if (step_sizes is None) != (timed_index is None):
        raise ValueError("step_sizes and timed_index go together")
    if timed_index is not None and step_sizes is not None:
        if len(timed_index) != len(steps):
            raise ValueError(f"timed_index has {len(timed_index)} entries for {len(steps)} steps")
        if len(timed_index) and not (min(timed_index) >= 0 and max(timed_index) < len(step_sizes)):
            raise ValueError(f"timed_index must be positions in step_sizes (0 to {len(step_sizes) - 1})")
    arr = np.asarray(steps, dtype=np.float64)
    y_all = np.maximum(arr[:, 0], 1e-9)
    # Columns: 1, prefill tokens, prefill requests, decode requests, KV tokens, prefill pairs, lone prefill tokens.
    lone = lone_prefill_tokens(arr[:, 1], arr[:, 2], arr[:, 3]).astype(np.float64)
    x_all = np.column_stack([np.ones(len(arr)), arr[:, 1:6], lone])

    def nnls(
        x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], scale: npt.NDArray[np.float64] | None = None
    ) -> npt.NDArray[np.float64]:
        # Each row divided by ``scale`` (default: the measured time itself).
        d = y if scale is None else scale
        xw, yw = x / d[:, None], y / d
        active = list(range(x.shape[1]))
        coef = np.zeros(x.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return coef

    def rel_sse(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], coef: npt.NDArray[np.float64]) -> float:
        return float(((((x @ coef) - y) / y) ** 2).sum())

    coef = nnls(x_all, y_all)
    ratio0 = y_all / np.maximum(x_all @ coef, 1e-12)
    keep = (ratio0 <= OUTLIER_FACTOR) & (ratio0 >= 1.0 / OUTLIER_FACTOR)
    if keep.sum() < 8:
        keep[:] = True
    # The hinge: one more column per candidate threshold (no hinge = a column of zeros).
    threshold, spill_col = 0.0, np.zeros(len(arr))
    if request_pairs is not None:
        pooled = np.concatenate([np.asarray(p, dtype=np.float64) for p in request_pairs] + [np.zeros(0)])
        pooled = pooled[pooled > 0]
        best = rel_sse(x_all[keep], y_all[keep], nnls(x_all[keep], y_all[keep]))
        for th in np.unique(np.percentile(pooled, np.linspace(5, 99, 48)).round()) if pooled.size else ():
            col = np.array([spill_pairs(np.asarray(p, dtype=np.float64), float(th)) for p in request_pairs])
            if not col[keep].any():
                continue
            x = np.column_stack([x_all, col])
            err = rel_sse(x[keep], y_all[keep], nnls(x[keep], y_all[keep]))
            if err < best:
                best, threshold, spill_col = err, float(th), col
    # The new-size term: one more column per candidate capacity of the step-size cache.
    cache, new_col = 0, np.zeros(len(arr))
    if step_sizes is not None and timed_index is not None:
        x = np.column_stack([x_all, spill_col])
        best = rel_sse(x[keep], y_all[keep], nnls(x[keep], y_all[keep]))
        idx = np.asarray(timed_index, dtype=np.int64)
        for k in SIZE_CACHE_CANDIDATES:
            col = new_size_flags(step_sizes, k)[idx].astype(np.float64)
            if not col[keep].any():
                continue
            xk = np.column_stack([x, col])
            err = rel_sse(xk[keep], y_all[keep], nnls(xk[keep], y_all[keep]))
            if err < best:
                best, cache, new_col = err, k, col
    # (Without the term no column is added: a fit without it is the fit as it was before the term existed.)
    x, y = np.column_stack([x_all, spill_col, *([new_col] if cache else [])]), y_all
    coef = nnls(x[keep], y[keep])
    # Dividing each row by its own measured time biases the fit low: a step that happened to run slow gets less
    # weight than one that ran fast, so the fitted time of a composition sits below the mean of its timings (for
    # timings spread by a coefficient of variation c, by about c^2, which a shared machine makes large). The
    # simulator adds step times up, so it needs the mean: refit with each row divided by the previous fit's
    # prediction instead, which does not depend on the row's own noise (iteratively reweighted least squares).
    for _ in range(IRLS_ROUNDS):
        coef = nnls(x[keep], y[keep], np.maximum(x[keep] @ coef, 1e-9))
    pred = x @ coef
    c_new = float(coef[8]) if cache else 0.0
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    noise_sigma = noise_rho = 0.0
    if fit_noise:
        seg = np.repeat(np.arange(len(segments)), segments) if segments is not None else np.zeros(len(y), np.int64)
        ok = keep & (pred > 0)
        noise_sigma, noise_rho = fit_step_noise(np.log(y[ok] / pred[ok]), seg[ok])
    model = StepTimeModel(
        step_s=float(coef[0]),
        prefill_token_s=float(coef[1]),
        prefill_req_s=float(coef[2]),
        decode_req_s=float(coef[3]),
        kv_token_s=float(coef[4]),
        prefill_attn_s=float(coef[5]),
        swap_block_s=0.0,
        prefill_attn_spill_s=float(coef[7]),
        lone_prefill_token_s=float(coef[6]),
        new_size_step_s=c_new,
        attn_spill_pairs=threshold if coef[7] > 0 else 0.0,
        step_size_cache=cache if c_new > 0 else 0,
        noise_sigma=noise_sigma,
        noise_rho=noise_rho,
        name=name,
        source=source,
    )
    fit = {
        "num_steps": len(steps),
        "num_outliers_dropped": int((~keep).sum()),
        "features": [
            *FEATURES[:6],
            *(["prefill_attn_spill_pairs"] if coef[7] > 0 else []),
            *(["lone_prefill_tokens"] if coef[6] > 0 else []),
            *(["new_size_steps"] if c_new > 0 else []),
        ],
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.percentile(rel, 90)),
        "total_time_rel_error": float(abs(pred.sum() - y.sum()) / y.sum()),
        "mean_step_s": float(y.mean()),
        **({"noise_sigma": noise_sigma, "noise_rho": noise_rho} if fit_noise else {}),
        **(
            {"step_size_cache": model.step_size_cache, "new_size_share": float(new_col.mean())}
            if step_sizes is not None
            else {}
        ),
    }
    return model, fit


def clock_fn(clock: str) -> Callable[[], float]:
    """``"wall"``: ``time.perf_counter``; ``"cpu"``: ``time.thread_time`` (CPU time of the calling thread)."""
    if clock == "wall":
        return time.perf_counter
    if clock == "cpu":
        return time.thread_time
    raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")


def run_timed_steps(
    llm: Any,
    adds: list[tuple[int, list[int], int]],
    *,
    on_step: Callable[[], None] | None = None,
    max_steps: int = 100_000,
    clock: str = "wall",
    request_pairs_out: list[npt.NDArray[np.float64]] | None = None,
    untimed_steps: int = 0,
) -> list[TimedStep]:
    """Drive ``llm`` step by step; ``adds`` = (step number, prompt token ids, output length), added before that
    step. Returns each step's (duration, prefill tokens, prefill requests, decode requests, KV tokens, prefill
    pairs). ``clock``: ``"wall"`` (``time.perf_counter``) or ``"cpu"`` (this thread's CPU time: immune to other
    processes on a shared machine; only meaningful on the CPU with torch single-threaded). With
    ``request_pairs_out``, each timed step's per-prefill-chunk query-key pairs are appended to it (for the
    attention hinge of :func:`fit_step_time_model`). The steps numbered below ``untimed_steps`` run but are not
    returned (a lead-in, see :func:`calibrate_llm`)."""
    from ..engine import SamplingParams
    from .steptime import request_pairs, step_features

    now = clock_fn(clock)
    sched = llm.scheduler
    known: dict[str, int] = {}
    out_steps: list[TimedStep] = []
    pending = sorted(adds, key=lambda a: a[0])
    k = 0
    step = 0
    while (k < len(pending) or llm.has_unfinished_requests()) and step < max_steps:
        while k < len(pending) and pending[k][0] <= step:
            _, prompt, out_len = pending[k]
            rid = llm.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
            known[rid] = len(prompt)
            k += 1
        if not llm.has_unfinished_requests():
            step += 1
            continue
        t0 = now()
        out = sched.schedule()
        sampled = llm.runner.execute(out, sched.prepare_model_inputs(out))
        res = sched.update_from_output(out, sampled)
        llm._postprocess(out, sampled, res)
        dt = now() - t0
        rids = out.req_ids
        if rids and step >= untimed_steps:
            nst = np.asarray(out.num_scheduled_tokens)
            nct = np.asarray(out.num_computed_tokens)
            kl = np.fromiter((known[r] for r in rids), np.int64, len(rids))
            is_dec = nct == kl - 1
            pre, preq, dec, kv, pairs = step_features(nst, nct, is_dec)
            out_steps.append((dt, pre, preq, dec, kv, pairs))
            if request_pairs_out is not None:
                request_pairs_out.append(request_pairs(nst, nct, is_dec))
        for rid, n_new in zip(rids, np.asarray(res.num_new_tokens).tolist(), strict=True):
            known[rid] += int(n_new)
        step += 1
        if on_step is not None:
            on_step()
    return out_steps


def _grid(
    vocab: int, max_len: int, max_seqs: int, quick: bool, rng: np.random.Generator, *, fresh_lengths: bool = False
) -> list[list[tuple[int, list[int], int]]]:
    """The calibration workloads. ``fresh_lengths``: each prompt's length is drawn within a quarter of the grid's
    length, so that the grid's steps seldom repeat a step size (tokens in the step), as those of a served workload
    with varied prompt lengths seldom do (an engine that sets its kernels up per step size pays for that on each
    new one; see :mod:`kvsched.sim.vllm_engine`)."""

    def prompt(n: int) -> list[int]:
        if fresh_lengths:
            n = int(np.clip(rng.integers(n - n // 4, n + n // 4 + 1), 1, max(1, max_len - 2)))
        return [int(t) for t in rng.integers(3, vocab, size=n)]

    scale = 1 if quick else 2
    lens = [n for n in (16, 64, 128, 256, 512, 1024, 2048) if n < max_len // 2]
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_seqs]
    work: list[list[tuple[int, list[int], int]]] = []
    # Prefill-heavy: a few requests of one length at once, short outputs.
    for n in lens[:: 2 if quick else 1]:
        work.append([(0, prompt(n), 2) for _ in range(2)])
    # Single prompts alone in the engine (how a prefill runs at low load), across the whole length range: long
    # chunks cost more per query-key pair than short ones (the attention hinge).
    for n in (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1024)[:: 2 if quick else 1]:
        if n <= max_len // 2:
            work.append([(0, prompt(n), 2)])
    # Decode-heavy: a batch at two context lengths.
    for b in batches[:: 2 if quick else 1]:
        for ctx in (32, min(256, max_len // 4)):
            work.append([(0, prompt(ctx), 8 * scale) for _ in range(b)])
    # Mixed: arrivals during decoding (every 2, 4 or 8 steps), so prefills of all lengths share steps with
    # decode batches of all sizes: the composition of a served workload.
    for spacing in (2, 4, 8):
        work.append(
            [
                (spacing * i, prompt(int(rng.integers(16, max(17, max_len // 2)))), int(rng.integers(4, 48)))
                for i in range(12 * scale)
            ]
        )
    return work


def calibrate(
    model: str | os.PathLike[str] | Any,
    *,
    device: str | None = None,
    quick: bool = False,
    progress: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    repeats: int = 2,
    seed: int = 0,
    num_threads: int | None = 1,
    clock: str | None = None,
) -> tuple[StepTimeModel, dict[str, Any]]:
    """Time the real engine on ``model`` (a model directory, or a runner ``ModelConfig`` for a random-weight
    model) and fit a step-time model. Returns the model and a dict describing the fit. ``num_threads``: torch's
    intra-op threads (1 by default: steadier timings on a small shared CPU; None leaves torch's default).
    ``clock``: how steps are timed, ``"wall"`` or ``"cpu"`` (thread CPU time, see :func:`run_timed_steps`);
    default ``"cpu"`` on the CPU with one thread, else ``"wall"``."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)

    from ..engine import LLM

    llm = LLM(
        model,
        device=device,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=False,  # every prompt token is computed, so prefill timings are real
        seed=seed,
    )
    label = os.path.basename(os.path.normpath(os.fspath(model))) if isinstance(model, (str, os.PathLike)) else "random"
    # On the CPU, freed memory stays in the process, as in --validate (see kvsched/runner/host_memory.py).
    from ..runner.host_memory import keep_freed_memory

    kept = keep_freed_memory() if llm.device.type == "cpu" else False
    fitted, fit = calibrate_llm(
        llm, quick=quick, progress=progress, repeats=repeats, seed=seed, clock=clock, label=label
    )
    fit["keep_freed_memory"] = kept
    return fitted, fit


class CalibrationSession:
    """The calibration grid (:func:`calibrate_llm`) on an existing :class:`kvsched.LLM`, one workload at a time, so
    that a caller can spread it over time (``--validate`` runs one workload at each idle point of the real run).

    Each workload starts the way a request meets the engine at low load: right after another request's run of
    decode steps (a lead-in of ``LEAD_IN_STEPS`` steps, not timed). A prefill right after a decode run costs more
    than one right after another prefill (the tiny test model on the CPU shows it for a lone prompt), and a served
    engine runs its prefills after decode runs.
    The workloads (``repeats`` times the grid) run in a shuffled order, so that any stretch of time sees a mix."""

    def __init__(
        self, llm: Any, *, quick: bool = False, repeats: int = 2, seed: int = 0, clock: str | None = None
    ) -> None:
        import torch

        self.llm = llm
        if clock is None:
            clock = "cpu" if llm.device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.vocab = int(llm.model_config.vocab_size)
        max_len = int(llm.scheduler.config.max_model_len)
        grid = _grid(self.vocab, max_len, int(llm.scheduler.config.max_num_seqs), quick, self.rng)
        self.work = [grid[i] for i in self.rng.permutation(len(grid) * repeats) % len(grid)]
        self.lead_len = max(1, min(LEAD_IN_PROMPT, max_len // 4))
        self.lead_steps = max(0, min(LEAD_IN_STEPS, max_len - self.lead_len - 1))
        self.next = 0
        self.steps: list[TimedStep] = []
        self.pairs: list[npt.NDArray[np.float64]] = []
        # Warm-up (first calls allocate and pick kernels); not timed.
        run_timed_steps(llm, [(0, self.rng.integers(3, self.vocab, size=64).tolist(), 4) for _ in range(4)])

    @property
    def done(self) -> bool:
        return self.next >= len(self.work)

    def _decode_run(self) -> tuple[int, list[int], int]:
        return (0, [int(t) for t in self.rng.integers(3, self.vocab, size=self.lead_len)], self.lead_steps)

    def run_next(self, *, trailer: bool = False) -> bool:
        """Run the next workload (after its lead-in); False when none is left. ``trailer``: end with one more
        untimed decode run, so that what the engine runs next finds it as after a decode run."""
        if self.done:
            return False
        adds = self.work[self.next]
        self.next += 1
        if self.lead_steps:
            adds = [self._decode_run(), *((at + self.lead_steps, toks, n) for at, toks, n in adds)]
        self.steps.extend(
            run_timed_steps(
                self.llm, adds, clock=self.clock, request_pairs_out=self.pairs, untimed_steps=self.lead_steps
            )
        )
        if trailer and self.lead_steps:
            run_timed_steps(self.llm, [self._decode_run()], clock=self.clock, untimed_steps=self.lead_steps)
        return True

    def fit(self, label: str = "model") -> tuple[StepTimeModel, dict[str, Any]]:
        import torch

        llm = self.llm
        where = str(llm.device)
        source = (
            f"calibrated on this machine ({where}, torch {torch.__version__}, dtype {llm.dtype}, {self.clock} clock) "
            f"from {len(self.steps)} timed steps of kvsched.LLM on {label}"
        )
        fitted, fit = fit_step_time_model(
            self.steps, name=f"calibrated-{label}-{llm.device.type}", source=source, request_pairs=self.pairs
        )
        fit.update(
            {
                "device": where,
                "torch_threads": torch.get_num_threads(),
                "clock": self.clock,
                "model": label,
                "block_size": int(llm.scheduler.config.block_size),
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
        )
        return fitted, fit


def calibrate_llm(
    llm: Any,
    *,
    quick: bool = False,
    progress: bool = False,
    repeats: int = 2,
    seed: int = 0,
    clock: str | None = None,
    label: str = "model",
) -> tuple[StepTimeModel, dict[str, Any]]:
    """:func:`calibrate` on an existing :class:`kvsched.LLM` (its scheduler config decides batch limits)."""
    session = CalibrationSession(llm, quick=quick, repeats=repeats, seed=seed, clock=clock)
    bar = None
    if progress:
        import sys

        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(session.work), desc="calibrate", unit="workload", file=sys.stderr, leave=False)
    try:
        while session.run_next():
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return session.fit(label)


def residuals(
    model: StepTimeModel,
    steps: list[TimedStep],
    request_pairs: list[npt.NDArray[np.float64]] | None = None,
    new_sizes: npt.NDArray[np.bool_] | None = None,
) -> npt.NDArray[np.float64]:
    """Predicted minus measured step time for each timed step (the hinge term needs ``request_pairs``, the new-size
    term ``new_sizes``: per step whether its size was new to the engine)."""
    arr = np.asarray(steps, dtype=np.float64)
    spill = np.zeros(len(arr))
    if request_pairs is not None:
        spill = np.array([spill_pairs(np.asarray(p, dtype=np.float64), model.attn_spill_pairs) for p in request_pairs])
    lone = lone_prefill_tokens(arr[:, 1], arr[:, 2], arr[:, 3])
    new = np.zeros(len(arr)) if new_sizes is None else np.asarray(new_sizes, dtype=np.float64)
    feats = np.column_stack([np.ones(len(arr)), arr[:, 1:6], np.zeros(len(arr)), spill, lone, new])
    out: npt.NDArray[np.float64] = model.predict(feats) - arr[:, 0]
    return out
