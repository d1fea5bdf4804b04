"""The discrete-event loop: the real scheduler decides every step, a step-time model says how long it takes.

Simulated time ``t`` only moves forward. Each iteration:

1. every request whose arrival time is ``<= t`` is added to the scheduler (``arrival_time`` = its arrival);
2. ``out = schedule()``; if nothing is scheduled and nothing is unfinished, ``t`` jumps to the next arrival;
3. the step lasts ``StepTimeModel.step_time(composition of out)``; its tokens are emitted at its end;
4. the "model" samples one token for every scheduled request whose known tokens are all computed after the
   step (a prefill chunk gets none), and ``update_from_output()`` applies them. Each request is added with
   ``max_tokens`` = its drawn output length and no EOS, so it stops exactly at that length (the scheduler's
   own LENGTH stop, like an EOS at that position).

The loop keeps its per-step Python work O(1) numpy calls on the batch, and its memory flat in the length of the
run: the workload is read a chunk at a time, per-request state lives in slots only while the request is in the
scheduler, and every figure streams into a :class:`~kvsched.sim.metrics.RunMetrics` (exact counts and sums,
percentiles exact up to a size and then from a sketch, per-window sums). When a step schedules the same requests
as the previous one and that one was all decodes (the steady state), nothing per request is computed (the "fast
path"): the run of such steps is applied in one go when it ends. With ``keep_records=True`` the raw per-step
arrays are kept too (scheduled request indices, scheduled and computed token counts, which requests got a token),
from which :func:`kvsched.sim.summary.request_records` rebuilds every per-request and per-token figure.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import QueueFullError
from ..config import SchedulerConfig
from .metrics import PROMPT_BUCKETS, RunMetrics
from .progress import SimProgress
from .sketch import EXACT_LIMIT
from .steptime import StepNoise, StepSizeCache, StepTimeModel, request_pairs, spill_pairs
from .workload import PromptFactory, Workload, WorkloadStream

__all__ = ["SimResult", "StalledError", "defers_arrivals", "make_config", "simulate"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
_EMPTY_INT: IntArray = np.zeros(0, dtype=np.int64)
_EMPTY_FLOAT: FloatArray = np.zeros(0, dtype=np.float64)
_SAMPLED_TOKEN = 7  # the token the simulated model emits (no EOS is set, so its value never stops anything)


class StalledError(RuntimeError):
    """The scheduler scheduled nothing while requests were unfinished and none could arrive (a bug)."""


class _Buf:
    """A growable 1-D numpy buffer (amortised O(1) append of a small array)."""

    def __init__(self, dtype: Any, capacity: int = 1 << 16) -> None:
        self.data = np.empty(capacity, dtype=dtype)
        self.size = 0

    def extend(self, values: npt.NDArray[Any]) -> None:
        n = len(values)
        end = self.size + n
        if end > len(self.data):
            new = np.empty(max(2 * len(self.data), end), dtype=self.data.dtype)
            new[: self.size] = self.data[: self.size]
            self.data = new
        self.data[self.size : end] = values
        self.size = end

    def array(self) -> npt.NDArray[Any]:
        out: npt.NDArray[Any] = self.data[: self.size].copy()
        return out


@dataclass
class SimResult:
    """One simulated run: its streamed :class:`~kvsched.sim.metrics.RunMetrics` (what
    :func:`~kvsched.sim.summary.summarize` reads), time series, final scheduler stats, and, with
    ``keep_records=True`` (``has_records``), the raw record (empty arrays otherwise):

    Per step ``s``: ``step_start[s]``, ``step_time[s]``, ``step_num_reqs[s]``, ``step_num_tokens[s]``,
    ``step_prefill_tokens[s]``, ``step_decode_reqs[s]``, ``step_kv_tokens[s]``. Flat per scheduled entry (CSR by
    ``step_num_reqs``): ``sched_idx``, ``sched_num_tokens``, ``sched_num_computed``. Flat per sampled token (CSR
    by ``step_num_sampled``): ``token_idx``. ``preempt_step``/``preempt_idx``: one entry per preemption. Per
    request: ``target_output_len`` (output tokens it runs to: the drawn length, capped by ``max_model_len``) and
    ``added`` (it arrived before the run ended and ``add_request`` took it: a request refused with
    ``QueueFullError`` was not added).
    """

    workload: Any  # Workload | WorkloadStream (a Workload when the record is kept)
    config: SchedulerConfig
    step_model: StepTimeModel
    scheduler: str
    horizon: float | None
    metrics: RunMetrics | None  # None once a sweep has summarized it (RunOutput)
    timeseries: dict[str, FloatArray]
    final_stats: dict[str, Any]
    end_time: float
    wall_s: float
    batches: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    has_records: bool = False
    target_output_len: IntArray = field(default_factory=lambda: _EMPTY_INT)
    added: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    step_start: FloatArray = field(default_factory=lambda: _EMPTY_FLOAT)
    step_time: FloatArray = field(default_factory=lambda: _EMPTY_FLOAT)
    step_num_reqs: IntArray = field(default_factory=lambda: _EMPTY_INT)
    step_num_tokens: IntArray = field(default_factory=lambda: _EMPTY_INT)
    step_prefill_tokens: IntArray = field(default_factory=lambda: _EMPTY_INT)
    step_decode_reqs: IntArray = field(default_factory=lambda: _EMPTY_INT)
    step_kv_tokens: IntArray = field(default_factory=lambda: _EMPTY_INT)
    step_num_sampled: IntArray = field(default_factory=lambda: _EMPTY_INT)
    sched_idx: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    sched_num_tokens: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    sched_num_computed: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    token_idx: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    preempt_step: IntArray = field(default_factory=lambda: _EMPTY_INT)
    preempt_idx: IntArray = field(default_factory=lambda: _EMPTY_INT)

    @property
    def num_steps(self) -> int:
        return int(self.extra.get("num_steps", 0))


def make_config(base: SchedulerConfig | dict[str, Any] | None = None, **overrides: Any) -> SchedulerConfig:
    """A :class:`SchedulerConfig` from a config or a dict, with ``overrides`` applied (any config field).

    Unknown fields raise ``InvalidConfigError`` naming them; bad values raise the config's own validation error.
    A fixed ``prefix_hash_seed`` (0) is used unless one is given, so a run is reproducible.
    """
    from .._errors import InvalidConfigError

    fields = base.to_dict() if isinstance(base, SchedulerConfig) else dict(base or {})
    fields.update(overrides)
    if fields.get("prefix_hash_seed") is None:
        fields["prefix_hash_seed"] = 0
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidConfigError(
            f"unknown scheduler config field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return SchedulerConfig(**fields)


def _with_tenant_weights(config: SchedulerConfig, workload: Workload | WorkloadStream) -> SchedulerConfig:
    """Fill a ``tenant_weights`` config field (when the scheduler has one) from the workload, unless set."""
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    if "tenant_weights" not in names or getattr(config, "tenant_weights", None):
        return config
    if all(w == 1.0 for w in workload.tenant_weights):
        return config
    weights = dict(zip(workload.tenant_names, workload.tenant_weights, strict=True))
    return dataclasses.replace(config, tenant_weights=weights)  # type: ignore[call-arg, unused-ignore]


def _accepts(add_request: Callable[..., Any], name: str) -> bool:
    """Whether ``add_request`` takes the keyword ``name``."""
    try:
        params = inspect.signature(add_request).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _accepts_tenant(add_request: Callable[..., Any]) -> bool:
    return _accepts(add_request, "tenant")


def _make_scheduler(scheduler: str | Callable[[SchedulerConfig], Any], config: SchedulerConfig) -> tuple[str, Any]:
    if callable(scheduler):
        return getattr(scheduler, "__name__", "custom"), scheduler(config)
    if scheduler == "rust":
        from ..scheduler import Scheduler

        return "rust", Scheduler(config)
    if scheduler == "reference":
        from ..reference import ReferenceScheduler

        return "reference", ReferenceScheduler(config)
    raise ValueError(f"scheduler must be 'rust', 'reference' or a factory, got {scheduler!r}")


def _expand(
    fast: npt.NDArray[np.bool_],
    full: dict[str, IntArray],
    buf_idx: npt.NDArray[np.int32],
    buf_nst: npt.NDArray[np.int32],
    buf_nct: npt.NDArray[np.int32],
    buf_sel: npt.NDArray[np.int32],
) -> tuple[
    dict[str, IntArray], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]
]:
    """Per-step and per-entry arrays of every step, from the recorded ("full") steps. A fast step ``k`` steps
    after full step ``b`` repeats b's requests (b was all decodes): one token each, ``k`` more computed tokens
    per request, every entry samples, and the step's KV tokens grow by ``k * m``."""
    num_steps = len(fast)
    is_full = ~fast
    full_steps = np.flatnonzero(is_full)
    base = np.cumsum(is_full) - 1  # for each step: the index (among full steps) of the full step it repeats
    if num_steps and base[0] < 0:
        raise StalledError("internal: the first step cannot be a fast step")
    k = np.arange(num_steps, dtype=np.int64) - full_steps[base] if num_steps else np.zeros(0, dtype=np.int64)
    m = full["m"][base]
    per_step = {
        "m": m,
        "tok": np.where(fast, m, full["tok"][base]),
        "pre": np.where(fast, 0, full["pre"][base]),
        "kv": full["kv"][base] + k * m,
        "nsel": np.where(fast, m, full["nsel"][base]),
    }
    off_full = np.zeros(len(full_steps) + 1, dtype=np.int64)
    np.cumsum(full["m"], out=off_full[1:])
    soff_full = np.zeros(len(full_steps) + 1, dtype=np.int64)
    np.cumsum(full["nsel"], out=soff_full[1:])

    def positions(counts: IntArray) -> tuple[IntArray, IntArray]:
        steps = np.repeat(np.arange(num_steps, dtype=np.int64), counts)
        starts = np.zeros(num_steps + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        return steps, np.arange(len(steps), dtype=np.int64) - starts[steps]

    es, pos = positions(m)
    src = off_full[base[es]] + pos
    ke = k[es].astype(np.int32)
    sched_idx = buf_idx[src]
    sched_nct = (buf_nct[src] + ke).astype(np.int32)
    sched_nst = np.where(ke == 0, buf_nst[src], np.int32(1)).astype(np.int32)
    del es, pos, src, ke
    ts, pos = positions(per_step["nsel"])
    fast_t = fast[ts]
    bt = base[ts]
    token_idx = np.empty(len(ts), dtype=np.int32)
    slow_t = ~fast_t
    token_idx[slow_t] = buf_sel[soff_full[bt[slow_t]] + pos[slow_t]]
    token_idx[fast_t] = buf_idx[off_full[bt[fast_t]] + pos[fast_t]]
    return per_step, sched_idx, sched_nst, sched_nct, token_idx


class _Live:
    """Per-request state of the requests in the scheduler, in slots that finished requests free (struct of
    arrays; grows by doubling, never shrinks below the most requests in the scheduler at once)."""

    INT = ("idx", "known", "target", "output_len", "prompt_len", "tenant", "priority", "prefix_group", "code",
           "num_output_tokens", "num_scheduled_tokens", "high_water", "num_recomputed_tokens", "num_cached_tokens",
           "num_preemptions")  # fmt: skip
    FLOAT = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time")
    idx: IntArray  # the request's index in the workload
    known: IntArray  # prompt + outputs so far
    target: IntArray
    output_len: IntArray
    prompt_len: IntArray
    tenant: IntArray
    priority: IntArray
    prefix_group: IntArray
    code: IntArray  # tenant * (number of priority classes) + class index
    num_output_tokens: IntArray
    num_scheduled_tokens: IntArray
    high_water: IntArray  # most tokens computed so far (recomputation below it, prefix hits above it)
    num_recomputed_tokens: IntArray
    num_cached_tokens: IntArray
    num_preemptions: IntArray
    arrival_time: FloatArray
    first_scheduled_time: FloatArray
    first_token_time: FloatArray
    last_token_time: FloatArray

    def __init__(self, capacity: int = 1024) -> None:
        self.cap = capacity
        for k in self.INT:
            setattr(self, k, np.zeros(capacity, dtype=np.int64))
        for k in self.FLOAT:
            setattr(self, k, np.full(capacity, np.nan))
        self.free: list[int] = list(range(capacity - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            old = self.cap
            self.cap *= 2
            for k in self.INT + self.FLOAT:
                a = getattr(self, k)
                b = np.zeros(self.cap, dtype=a.dtype) if a.dtype == np.int64 else np.full(self.cap, np.nan)
                b[:old] = a
                setattr(self, k, b)
            self.free = list(range(self.cap - 1, old - 1, -1))
        return self.free.pop()

    def release(self, slots: npt.NDArray[np.int64]) -> None:
        for k in self.FLOAT:
            getattr(self, k)[slots] = np.nan
        for k in ("num_output_tokens", "num_scheduled_tokens", "high_water", "num_recomputed_tokens",
                  "num_cached_tokens", "num_preemptions"):  # fmt: skip
            getattr(self, k)[slots] = 0
        self.free.extend(slots.tolist())

    def columns(self, slots: npt.NDArray[np.int64], finished: bool) -> dict[str, npt.NDArray[Any]]:
        c: dict[str, npt.NDArray[Any]] = {
            "idx": self.idx[slots],
            "arrival_time": self.arrival_time[slots],
            "prompt_len": self.prompt_len[slots],
            "output_len": self.target[slots],
            "tenant": self.tenant[slots],
            "priority": self.priority[slots],
            "prefix_group": self.prefix_group[slots],
            "added": np.ones(len(slots), dtype=np.bool_),
            "finished": np.full(len(slots), finished),
            "num_output_tokens": self.num_output_tokens[slots],
            "first_scheduled_time": self.first_scheduled_time[slots],
            "first_token_time": self.first_token_time[slots],
            "finish_time": self.last_token_time[slots] if finished else np.full(len(slots), np.nan),
            "num_preemptions": self.num_preemptions[slots],
            "num_scheduled_tokens": self.num_scheduled_tokens[slots],
            "num_recomputed_tokens": self.num_recomputed_tokens[slots],
            "num_cached_tokens": self.num_cached_tokens[slots],
        }
        return c


def _waiting_columns(w: Workload, lo: int, hi: int, start: int, added: bool, target: IntArray) -> dict[str, Any]:
    """Columns of requests ``[lo, hi)`` of chunk ``w`` (starting at request ``start``) that never ran."""
    n = hi - lo
    nan = np.full(n, np.nan)
    zeros = np.zeros(n, dtype=np.int64)
    return {
        "idx": np.arange(start + lo, start + hi, dtype=np.int64),
        "arrival_time": w.arrival_time[lo:hi],
        "prompt_len": w.prompt_len[lo:hi],
        "output_len": target,
        "tenant": w.tenant[lo:hi],
        "priority": w.priority[lo:hi],
        "prefix_group": w.prefix_group[lo:hi],
        "added": np.full(n, added),
        "finished": np.zeros(n, dtype=np.bool_),
        "num_output_tokens": zeros,
        "first_scheduled_time": nan,
        "first_token_time": nan,
        "finish_time": nan,
        "num_preemptions": zeros,
        "num_scheduled_tokens": zeros,
        "num_recomputed_tokens": zeros,
        "num_cached_tokens": zeros,
    }


def defers_arrivals(scheduler: str | Callable[[SchedulerConfig], Any], config: SchedulerConfig) -> bool:
    """Whether :func:`simulate` may keep arrived requests out of the scheduler until they can matter (see
    :func:`simulate`): the built-in schedulers under FCFS, without the options that read the whole queue."""
    return (
        scheduler in ("rust", "reference")
        and config.policy == "fcfs"
        and not config.long_prefill_token_threshold_adaptive
        # per-tenant limits count the requests in the scheduler
        and config.max_running_per_tenant is None
        and not config.tenant_max_running
        and config.max_waiting_per_tenant is None
        and not config.tenant_max_waiting
    )


def simulate(
    workload: Workload | WorkloadStream,
    config: SchedulerConfig | dict[str, Any] | None,
    step_model: StepTimeModel,
    *,
    scheduler: str | Callable[[SchedulerConfig], Any] = "rust",
    horizon: float | None = None,
    timeseries_interval: float | None = None,
    record_batches: bool = False,
    keep_records: bool = False,
    progress: bool | SimProgress = False,
    progress_desc: str = "simulate",
    fast_path: bool = True,
    prompt_fn: Callable[[int], npt.NDArray[np.int32]] | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    window: float | None = None,
    exact_limit: int = EXACT_LIMIT,
    request_sink: Callable[[dict[str, npt.NDArray[Any]]], None] | None = None,
    defer_arrivals: bool | None = None,
    prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
    class_ttft_slo: Mapping[int, float] | None = None,
    noise_seed: int = 0,
) -> SimResult:
    """Run ``workload`` through a real scheduler in simulated time (see the module docstring).

    ``workload``: a :class:`Workload`, or a :class:`WorkloadStream` (drawn a chunk at a time: memory that does not
    grow with the number of requests). ``horizon``: stop at this simulated time (requests not finished by then
    are reported as unfinished); None runs until every request has finished. ``timeseries_interval``: seconds of
    simulated time between samples of the scheduler's stats (default: about 400 samples over the arrival window).
    ``slo_ttft``/``slo_tpot``: the SLOs goodput is counted for (any SLO works in :func:`summarize` while the
    run has at most ``exact_limit`` finished requests). ``window``: the fairness window (default: a twentieth of
    the arrival window). ``exact_limit``: values per figure kept exactly before percentiles come from a sketch
    (:mod:`kvsched.sim.sketch`). ``request_sink``: called with the columns of each batch of requests as they
    finish (and of the rest when the run ends), e.g. :class:`kvsched.sim.point.RequestCsvWriter`.
    ``prompt_buckets``: the upper edges (tokens) of the prompt-length buckets TTFT is reported by.
    ``class_ttft_slo``: a TTFT target (seconds) per priority value: each request of such a class is added with
    ``ttft_slo_s=`` its target (the deadline of ``policy="slo"``), and goodput counts it against that target instead
    of ``slo_ttft``. A workload of conversations (:attr:`Workload.sessions`) adds each request with ``session_id=`` its
    conversation. Both only when the scheduler's ``add_request`` takes the keyword.
    ``noise_seed``: the seed of the step-time noise, when ``step_model`` has any (``noise_sigma > 0``: each step's
    time is the model's times a factor of mean 1, see :mod:`kvsched.sim.steptime`); without noise it is unused.
    ``record_batches``: keep each step's (request indices, scheduled tokens), for validation.
    ``keep_records``: also keep the raw per-step record (O(tokens) memory) for :func:`request_records`.
    ``fast_path=False`` records every step in full (same results, slower; for tests).
    ``prompt_fn(i)``: the prompt token ids of request ``i`` (default: :class:`PromptFactory`'s).
    ``progress``: True draws a progress bar of this run on stderr (:class:`kvsched.sim.progress.SimProgress`);
    a ``SimProgress`` (a sweep's) gets this run as its next one, labelled ``progress_desc``.

    ``defer_arrivals`` (default: :func:`defers_arrivals`): an FCFS scheduler only ever looks at the head of its
    waiting queue (at most ``max_num_seqs`` admissions a step, plus the cache-aware admission window), so
    requests that arrive behind a long queue are added only once fewer than ``2 * max_num_seqs + window + 1``
    requests are in the scheduler: the same decisions (a test compares the batches), without the scheduler
    holding the prompts of a backlog that grows for as long as the engine is overloaded. They count as waiting
    in the time series and the metrics from their arrival.
    """
    cfg = _with_tenant_weights(make_config(config), workload)
    name, sched = _make_scheduler(scheduler, cfg)
    n = len(workload)
    if workload.max_prompt_len >= cfg.max_model_len:
        raise ValueError(
            f"the workload has prompts of up to {workload.max_prompt_len} tokens, not below max_model_len "
            f"({cfg.max_model_len}); raise max_model_len, shorten the prompts, or clip drawn ones with "
            f"generate_workload(spec, max_model_len={cfg.max_model_len})"
        )
    defer = defers_arrivals(scheduler, cfg) if defer_arrivals is None else defer_arrivals
    max_active = max(cfg.max_num_seqs, cfg.max_num_active_seqs or 0)
    room = (2 * max_active + cfg.cache_aware_admission_window + 1) if defer else n + 1
    first_arrival = workload.first_arrival
    span = workload.last_arrival
    interval = timeseries_interval if timeseries_interval else max(span / 400.0, 0.05)
    if window is None:
        window = (span - first_arrival) / 20.0 if span > first_arrival else 1.0
    prio_values = workload.priority_values()
    metrics = RunMetrics(
        tenant_names=workload.tenant_names,
        tenant_weights=workload.tenant_weights,
        priorities=prio_values,
        window=window,
        first_arrival=first_arrival,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        exact_limit=exact_limit,
        request_sink=request_sink,
        prompt_buckets=prompt_buckets,
        class_ttft_slo=class_ttft_slo,
    )
    num_prios = len(metrics.prio_values)
    prio_index = {int(p): i for i, p in enumerate(metrics.prio_values.tolist())}
    num_codes = workload.num_tenants * num_prios
    zero_code = np.zeros(1, dtype=np.int64)
    nt = workload.num_tenants
    factory = PromptFactory(workload.seed)
    tenant_kw = _accepts_tenant(sched.add_request) and (nt > 1 or cfg.policy not in ("fcfs", "priority"))
    class_slo = dict(class_ttft_slo or {}) if _accepts(sched.add_request, "ttft_slo_s") else {}
    session_kw = bool(getattr(workload, "sessions", False)) and _accepts(sched.add_request, "session_id")
    tenant_names = workload.tenant_names
    max_model_len = cfg.max_model_len
    live = _Live()
    slot_of: dict[str, int] = {}
    get_slot = slot_of.__getitem__
    pending: list[int] = []  # finished requests' slots, folded into the metrics in batches

    sample_at = 0.0
    ts: dict[str, list[float]] = {
        k: []
        for k in ("time", "num_running", "num_waiting", "kv_cache_usage", "num_preemptions", "prefix_cache_hit_rate")
    }

    # The raw record (keep_records): per step start, duration, whether it took the fast path; per recorded
    # ("full") step its composition and its entries in the buffers. A fast step is rebuilt from the full step it
    # repeats (see _expand).
    rec = keep_records
    step_start: list[float] = []
    step_time: list[float] = []
    step_fast: list[bool] = []
    f_m: list[int] = []
    f_tok: list[int] = []
    f_pre: list[int] = []
    f_kv: list[int] = []
    f_nsel: list[int] = []
    b_idx = _Buf(np.int32)
    b_nst = _Buf(np.int32)
    b_nct = _Buf(np.int32)
    b_sel = _Buf(np.int32)
    pre_step: list[int] = []
    pre_idx: list[int] = []
    batches: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = [] if record_batches else None
    all_target: list[IntArray] = []

    c0, c_pre, c_preq, c_dec, c_kv, c_attn = (
        step_model.step_s,
        step_model.prefill_token_s,
        step_model.prefill_req_s,
        step_model.decode_req_s,
        step_model.kv_token_s,
        step_model.prefill_attn_s,
    )
    # Swapped blocks (preemption_mode "swap" or "auto") cost swap_block_s each, out or in. The auto mode picks
    # recompute or swap per victim by the same model's costs: a recomputed token as a prefill token.
    c_swap = step_model.swap_block_s if cfg.preemption_mode != "recompute" else 0.0
    # The attention hinge: pairs of each prefill chunk beyond the threshold cost c_spill more.
    c_spill, spill_at = step_model.prefill_attn_spill_s, step_model.attn_spill_pairs
    # A lone prefill step (one scheduled request, computing a prefill chunk) costs c_lone more per prefill token.
    c_lone = step_model.lone_prefill_token_s
    # A step whose size (scheduled tokens) is not among the engine's recent sizes costs c_new more. A fast step
    # repeats the previous step's size, the most recent one, so only full steps are looked up.
    c_new = step_model.new_size_step_s
    sizes = StepSizeCache.of(step_model)
    new_size = sizes.new if sizes is not None else None
    if cfg.preemption_mode == "auto":
        sched.set_preemption_costs(step_model.prefill_token_s, step_model.swap_block_s)
    step_noise = StepNoise.of(step_model, noise_seed)
    noise = step_noise.next if step_noise is not None else None
    cap = max(cfg.max_num_seqs, 1)
    tokens = np.full(cap, _SAMPLED_TOKEN, dtype=np.int64)
    arange = np.arange(cap + 1, dtype=np.int64)
    schedule = sched.schedule
    update = sched.update_from_output
    add = sched.add_request
    count_nonzero = np.count_nonzero
    cumsum = np.cumsum
    fromiter = np.fromiter
    int64 = np.int64
    isnan = np.isnan
    windows = metrics.windows
    refused = [0] * workload.num_tenants  # requests add_request refused (QueueFullError), per tenant
    refused_idx: list[int] = []  # with records: which

    # The workload, a chunk at a time: chunks hold the requests from the first one not yet in the scheduler.
    chunk_iter = workload.chunks()
    chunks: list[tuple[int, Workload, IntArray]] = []
    scan: list[float] = []  # arrival times of the newest chunk, scanned for arrivals

    def load_chunk() -> bool:
        nxt_chunk = next(chunk_iter, None)
        if nxt_chunk is None:
            return False
        start, w = nxt_chunk
        target = np.minimum(w.output_len, max_model_len - w.prompt_len).astype(np.int64)
        metrics.num_capped_outputs += int(count_nonzero(target < w.output_len))
        if rec:
            all_target.append(target)
        chunks.append((start, w, target))
        scan[:] = w.arrival_time.tolist()
        return True

    # State of the fast path: the previous step's batch (slots), whether it was all decodes, and the durations of
    # the fast steps since (folded into the per-request state and the metrics in one go when the run of fast steps
    # ends, see fold_run).
    prev_all_dec, prev_rids, prev_m, prev_idx = False, None, -1, np.zeros(0, dtype=np.int64)
    prev_codes, prev_code_counts, prev_tenant_tokens = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(nt)
    run_dts: list[float] = []
    run_t0 = 0.0
    kv, c_fixed = 0, 0.0
    tok_view, ptr_view = tokens[:0], arange[:1]
    num_entries = 0  # scheduled entries over all steps
    step_time_sum = 0.0

    def fold_run() -> None:
        """Apply the fast steps since the last full step: each request of its batch decoded one more token per
        step, and every one of those tokens came one step time after the previous."""
        k = len(run_dts)
        dts = np.array(run_dts)
        ends = _cumsum_from(run_t0, dts)
        idx = prev_idx
        live.known[idx] += k
        live.num_output_tokens[idx] += k
        live.num_scheduled_tokens[idx] += k
        live.high_water[idx] += k
        live.last_token_time[idx] = ends[-1]
        gaps = np.diff(ends, prepend=run_t0)  # each token came one step after the previous (as the clock adds up)
        metrics.add_itl(np.repeat(gaps, len(prev_codes)), np.tile(prev_codes, k), np.tile(prev_code_counts, k))
        metrics.num_fast_steps += k
        windows.add_service_steps(ends, prev_tenant_tokens)
        run_dts.clear()

    def fold_finished(force: bool = False) -> None:
        if pending and (force or len(pending) >= 512):
            slots = np.array(pending, dtype=np.int64)
            metrics.add_requests(live.columns(slots, finished=True))
            live.release(slots)
            pending.clear()

    own_progress = progress is True
    prog = progress if isinstance(progress, SimProgress) else (SimProgress(1) if progress else None)
    if prog is not None:
        prog.start_run(progress_desc, n, horizon)
    logger = logging.getLogger("kvsched")
    old_level = logger.level
    logger.setLevel(logging.ERROR)  # the preemption warning is expected under load; the metrics count them
    wall0 = time.perf_counter()
    t = 0.0
    nxt_add = 0  # requests [0, nxt_add) were added to the scheduler
    nxt_arr = 0  # requests [0, nxt_arr) have arrived; [nxt_add, nxt_arr) wait outside it (deferred)
    next_arrival = math.inf
    if n:
        load_chunk()
        next_arrival = scan[0]
    in_sched = 0  # requests in the scheduler (added, not finished)
    max_in_sched = 0
    step = 0
    try:
        while True:
            if horizon is not None and t >= horizon:
                break
            if in_sched == 0 and nxt_add == nxt_arr:
                if nxt_arr >= n:
                    break
                t = max(t, next_arrival)
                if horizon is not None and t >= horizon:
                    break
            while next_arrival <= t:
                nxt_arr += 1
                if nxt_arr >= n:
                    next_arrival = math.inf
                    break
                start, w, _ = chunks[-1]
                if nxt_arr >= start + len(w):
                    load_chunk()
                    start = chunks[-1][0]
                next_arrival = scan[nxt_arr - start]
            while nxt_add < nxt_arr and in_sched < room:
                i = nxt_add
                start, w, target = chunks[0]
                if i >= start + len(w):
                    chunks.pop(0)
                    start, w, target = chunks[0]
                j = i - start
                arrival = float(w.arrival_time[j])
                prompt_len = int(w.prompt_len[j])
                group = int(w.prefix_group[j])
                ten = int(w.tenant[j])
                prio = int(w.priority[j])
                tgt = int(target[j])
                rid = f"r{i}"
                kw: dict[str, Any] = {"tenant": tenant_names[ten]} if tenant_kw else {}
                if class_slo and prio in class_slo:
                    kw["ttft_slo_s"] = class_slo[prio]
                if session_kw and group >= 0:
                    kw["session_id"] = f"s{group}"
                try:
                    add(
                        rid,
                        factory.tokens(i, prompt_len, group, int(w.prefix_len[j]))
                        if prompt_fn is None
                        else prompt_fn(i),
                        max_tokens=tgt,
                        priority=prio,
                        arrival_time=arrival,
                        **kw,
                    )
                except QueueFullError:
                    # Its tenant's waiting queue is full (tenant_max_waiting): refused at once, never added.
                    refused[ten] += 1
                    if rec:
                        refused_idx.append(i)
                    metrics.add_requests(_waiting_columns(w, j, j + 1, start, False, target[j : j + 1]))
                    nxt_add += 1
                    continue
                s = live.take()
                slot_of[rid] = s
                live.idx[s] = i
                live.known[s] = prompt_len
                live.target[s] = tgt
                live.prompt_len[s] = prompt_len
                live.tenant[s] = ten
                live.priority[s] = prio
                live.prefix_group[s] = group
                live.code[s] = ten * num_prios + prio_index[prio]
                live.arrival_time[s] = arrival
                nxt_add += 1
                in_sched += 1
                if in_sched > max_in_sched:
                    max_in_sched = in_sched
            if t >= sample_at:
                st = sched.stats()
                ts["time"].append(t)
                ts["num_running"].append(st.num_running_reqs)
                ts["num_waiting"].append(st.num_waiting_reqs + nxt_arr - nxt_add)
                ts["kv_cache_usage"].append(st.kv_cache_usage)
                ts["num_preemptions"].append(st.num_preemptions)
                ts["prefix_cache_hit_rate"].append(st.prefix_cache_hit_rate)
                sample_at = t + interval

            out = schedule()
            rids = out.req_ids
            m = len(rids)
            if (
                prev_all_dec
                and fast_path
                and m == prev_m
                and out.total_num_scheduled_tokens == m
                and rids == prev_rids
                and not out.preempted_req_ids
            ):
                # Fast path: the same requests as the previous all-decode step, one token each, none preempted:
                # all decode again, every one samples, each context one token longer. Nothing per request is
                # computed here; fold_run applies these steps when the run of them ends.
                kv += m
                dt = c_fixed + c_kv * kv
                if noise is not None:
                    dt *= noise()
                fin = update(out, (tok_view, ptr_view)).finished_req_ids
                run_dts.append(dt)
                if rec:
                    step_start.append(t)
                    step_time.append(dt)
                    step_fast.append(True)
                if batches is not None:
                    batches.append((tuple(live.idx[prev_idx].tolist()), (1,) * m))
                t += dt
                step += 1
                step_time_sum += dt
                num_entries += m
                if fin:
                    fold_run()
                    run_t0 = t
                    in_sched -= len(fin)
                    pending.extend(slot_of.pop(r) for r in fin)
                    fold_finished()
                if prog is not None and (step & 1023) == 0:
                    prog.update(t, nxt_add - in_sched)
                continue
            if run_dts:
                fold_run()
            if m == 0:
                pre_ids = out.preempted_req_ids
                prev_all_dec = False
                if nxt_arr < n:
                    t = max(t, next_arrival)
                    continue
                raise StalledError(
                    f"{name} scheduled nothing at t={t:.3f}s with {in_sched} request(s) unfinished"
                    + (f" (preempted: {pre_ids})" if pre_ids else "")
                )
            idx = fromiter(map(get_slot, rids), int64, m)
            nst = out.num_scheduled_tokens
            nct = out.num_computed_tokens
            kl = live.known[idx]
            complete = (nct + nst) >= kl
            is_dec = nct == kl - 1
            n_dec = int(count_nonzero(is_dec))
            n_tok = int(out.total_num_scheduled_tokens)
            kv = int(nct[is_dec].sum()) + n_dec
            if n_dec == m:
                n_pre, pairs, pairs_over = 0, 0.0, 0.0
            else:
                chunk_pairs = request_pairs(nst, nct, is_dec)
                pairs = float(chunk_pairs.sum())
                pairs_over = spill_pairs(chunk_pairs, spill_at) if c_spill else 0.0
                n_pre = n_tok - n_dec
            dt = c0 + c_pre * n_pre + c_preq * (m - n_dec) + c_dec * n_dec + c_kv * kv + c_attn * pairs
            if pairs_over:
                dt += c_spill * pairs_over
            if m == 1 and n_dec == 0:
                dt += c_lone * n_pre
            if new_size is not None and new_size(n_tok):
                dt += c_new
            if c_swap:
                dt += c_swap * (len(out.swap_out) + len(out.swap_in))
            if noise is not None:
                dt *= noise()
            sel = idx[complete]
            k = len(sel)
            if k == m:
                res = update(out, (tokens[:m], arange[: m + 1]))
            else:
                indptr = np.zeros(m + 1, dtype=int64)
                cumsum(complete, out=indptr[1:])
                res = update(out, (tokens[:k], indptr))
            live.known[sel] += 1
            t_end = t + dt

            # The per-request figures of this step (see summary.request_records for the same from the record).
            end = nct + nst
            hw = live.high_water[idx]
            live.num_recomputed_tokens[idx] += np.maximum(np.minimum(end, hw) - nct, 0)
            live.num_cached_tokens[idx] += np.maximum(nct - hw, 0)
            live.high_water[idx] = np.maximum(hw, end)
            live.num_scheduled_tokens[idx] += nst
            fs = live.first_scheduled_time[idx]
            new = isnan(fs)
            if new.any():
                first = idx[new]
                live.first_scheduled_time[first] = t
                windows.wait(live.arrival_time[first], np.full(len(first), t), live.tenant[first])
            if nt == 1:
                windows.step(t_end, float(n_tok))
            else:
                windows.step(t_end, np.bincount(live.tenant[idx], weights=nst, minlength=nt))
            last = live.last_token_time[sel]
            # Most tokens of a step come one step after the request's previous one (it sampled in the previous
            # step): one value, counted per group code; the others (first tokens aside) one by one.
            prev_step = last == t
            num_prev = int(count_nonzero(prev_step))
            if num_prev:
                if num_codes == 1:
                    metrics.add_itl(np.array([t_end - t]), zero_code, np.array([num_prev]))
                else:
                    by_code = np.bincount(live.code[sel[prev_step]], minlength=num_codes)
                    present = np.flatnonzero(by_code)
                    metrics.add_itl(np.full(len(present), t_end - t), present, by_code[present])
            if num_prev < k:
                had = ~isnan(last) & ~prev_step
                if had.any():
                    metrics.add_itl(t_end - last[had], live.code[sel[had]])
                new_tok = isnan(last)
                if new_tok.any():
                    live.first_token_time[sel[new_tok]] = t_end
            live.last_token_time[sel] = t_end
            live.num_output_tokens[sel] += 1
            pre_ids = out.preempted_req_ids
            if pre_ids:
                for rid in pre_ids:
                    live.num_preemptions[slot_of[rid]] += 1
                    if rec:
                        pre_step.append(step)
                        pre_idx.append(int(live.idx[slot_of[rid]]))
            if rec:
                step_start.append(t)
                step_time.append(dt)
                step_fast.append(False)
                f_m.append(m)
                f_tok.append(n_tok)
                f_pre.append(n_pre)
                f_kv.append(kv)
                f_nsel.append(k)
                b_idx.extend(live.idx[idx])
                b_nst.extend(nst)
                b_nct.extend(nct)
                b_sel.extend(live.idx[sel])
            if batches is not None:
                batches.append((tuple(live.idx[idx].tolist()), tuple(nst.tolist())))
            fin = res.finished_req_ids
            if fin:
                in_sched -= len(fin)
                pending.extend(slot_of.pop(r) for r in fin)
                fold_finished()
            prev_all_dec = n_dec == m and not pre_ids
            prev_rids, prev_m, prev_idx = rids, m, idx
            if prev_all_dec and fast_path:
                if num_codes == 1:
                    prev_codes, prev_code_counts = zero_code, np.array([m])
                else:
                    by_code = np.bincount(live.code[idx], minlength=num_codes)
                    prev_codes = np.flatnonzero(by_code)
                    prev_code_counts = by_code[prev_codes]
                prev_tenant_tokens = (
                    np.array([float(m)]) if nt == 1 else np.bincount(live.tenant[idx], minlength=nt).astype(np.float64)
                )
            c_fixed = c0 + c_dec * m
            tok_view, ptr_view = tokens[:m], arange[: m + 1]
            t = t_end
            run_t0 = t
            step += 1
            step_time_sum += dt
            num_entries += m
            if prog is not None and (step & 1023) == 0:
                prog.update(t, nxt_add - in_sched)
        if run_dts:
            fold_run()
    finally:
        logger.setLevel(old_level)
        if prog is not None:
            done_msg = f"{nxt_add - in_sched - sum(refused):,}/{n:,} requests finished"
            if any(refused):
                done_msg += f" ({sum(refused):,} refused: waiting queue full)"
            prog.finish_run(f"{done_msg}, {step:,} steps, {t:,.1f} s simulated")
            if own_progress:
                prog.close()
    wall = time.perf_counter() - wall0
    if horizon is None and (in_sched or nxt_add < n):
        raise StalledError(f"{n - nxt_add + in_sched} request(s) did not finish although the run drained")
    # Fold in what is left: finished requests not folded yet, requests still in the scheduler (unfinished), those
    # that arrived but waited outside it, and (for the per-request rows) those that never arrived.
    fold_finished(force=True)
    if slot_of:
        slots = np.array(sorted(slot_of.values()), dtype=np.int64)
        never = slots[np.isnan(live.first_scheduled_time[slots])]
        windows.add_waits(live.arrival_time[never], np.full(len(never), t), live.tenant[never])
        metrics.add_requests(live.columns(slots, finished=False))
    num_held = nxt_arr - nxt_add  # arrived, waiting outside the scheduler when the run ended
    done = nxt_add  # requests before this one are folded in
    while True:
        for start, w, target in chunks:
            lo = max(done - start, 0)
            mid = min(max(nxt_arr - start, lo), len(w))
            if mid > lo:
                cols = _waiting_columns(w, lo, mid, start, True, target[lo:mid])
                windows.add_waits(cols["arrival_time"], np.full(mid - lo, t), cols["tenant"])
                metrics.add_requests(cols)
            if len(w) > mid and request_sink is not None:
                metrics.add_requests(_waiting_columns(w, mid, len(w), start, False, target[mid:]))
        done = max(done, chunks[-1][0] + len(chunks[-1][1])) if chunks else done
        chunks.clear()
        if done >= n or (request_sink is None and not rec) or not load_chunk():
            break
    metrics.num_steps = step
    metrics.step_time_sum = step_time_sum
    metrics.num_scheduled_entries = num_entries
    metrics.finish(t)
    st = sched.stats()
    final_stats: dict[str, Any] = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    final_stats["prefix_cache_hit_rate"] = st.prefix_cache_hit_rate
    final_stats["num_waiting_reqs"] = st.num_waiting_reqs + num_held
    result = SimResult(
        workload=workload,
        config=cfg,
        step_model=step_model,
        scheduler=name,
        horizon=horizon,
        metrics=metrics,
        timeseries={k: np.asarray(v, dtype=np.float64) for k, v in ts.items()},
        final_stats=final_stats,
        end_time=t,
        wall_s=wall,
        batches=batches,
        extra={
            "tenant_passed": tenant_kw,
            "deferred_arrivals": defer,
            "num_steps": step,
            "num_fast_steps": metrics.num_fast_steps,
            "max_in_scheduler": max_in_sched,
            "num_refused": dict(zip(workload.tenant_names, refused, strict=True)),
        },
    )
    if rec:
        _attach_records(
            result,
            np.asarray(step_fast, dtype=np.bool_),
            {
                "m": np.asarray(f_m, dtype=np.int64),
                "tok": np.asarray(f_tok, dtype=np.int64),
                "pre": np.asarray(f_pre, dtype=np.int64),
                "kv": np.asarray(f_kv, dtype=np.int64),
                "nsel": np.asarray(f_nsel, dtype=np.int64),
            },
            (b_idx.array(), b_nst.array(), b_nct.array(), b_sel.array()),
            np.asarray(step_start, dtype=np.float64),
            np.asarray(step_time, dtype=np.float64),
            (np.asarray(pre_step, dtype=np.int64), np.asarray(pre_idx, dtype=np.int64)),
            np.concatenate(all_target) if all_target else np.zeros(0, dtype=np.int64),
            min(nxt_arr, n),
            np.asarray(refused_idx, dtype=np.int64),
        )
    return result


def _attach_records(
    result: SimResult,
    fast: npt.NDArray[np.bool_],
    full: dict[str, IntArray],
    bufs: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]],
    step_start: FloatArray,
    step_time: FloatArray,
    preempts: tuple[IntArray, IntArray],
    target: IntArray,
    num_added: int,
    refused_idx: IntArray,
) -> None:
    per_step, sched_idx, sched_nst, sched_nct, token_idx = _expand(fast, full, *bufs)
    n = len(result.workload)
    added = np.zeros(n, dtype=np.bool_)
    added[:num_added] = True
    added[refused_idx] = False  # refused by add_request: never in the scheduler
    if isinstance(result.workload, WorkloadStream):
        result.workload = result.workload.materialize()
    result.target_output_len = target
    result.added = added
    result.step_start = step_start
    result.step_time = step_time
    result.step_num_reqs = per_step["m"]
    result.step_num_tokens = per_step["tok"]
    result.step_prefill_tokens = per_step["pre"]
    result.step_decode_reqs = per_step["tok"] - per_step["pre"]
    result.step_kv_tokens = per_step["kv"]
    result.step_num_sampled = per_step["nsel"]
    result.sched_idx = sched_idx
    result.sched_num_tokens = sched_nst
    result.sched_num_computed = sched_nct
    result.token_idx = token_idx
    result.preempt_step, result.preempt_idx = preempts
    result.has_records = True


def _cumsum_from(carry: float, values: FloatArray) -> FloatArray:
    """``carry + values[0], carry + values[0] + values[1], ...`` in the order the loop adds them."""
    out: FloatArray = np.cumsum(np.concatenate(([carry], values)))[1:]
    return out
