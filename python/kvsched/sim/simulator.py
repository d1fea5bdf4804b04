"""The discrete-event loop: the real scheduler decides every step, a step-time model says how long it takes.

Simulated time ``t`` only moves forward. Each iteration:

1. every request whose arrival time is ``<= t`` is added to the scheduler (``arrival_time`` = its arrival);
2. ``out = schedule()``; if nothing is scheduled and nothing is unfinished, ``t`` jumps to the next arrival;
3. the step lasts ``StepTimeModel.step_time(composition of out)``; its tokens are emitted at its end;
4. the "model" samples one token for every scheduled request whose known tokens are all computed after the
   step (a prefill chunk gets none), and ``update_from_output()`` applies them. Each request is added with
   ``max_tokens`` = its drawn output length and no EOS, so it stops exactly at that length (the scheduler's
   own LENGTH stop, like an EOS at that position).

The loop keeps its per-step Python work O(1) numpy calls on the batch: it records the raw per-step arrays
(scheduled request indices, scheduled and computed token counts, which requests got a token) in growable
buffers, and :mod:`kvsched.sim.metrics` derives every per-request and per-token figure from them afterwards.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import SchedulerConfig
from .progress import SimProgress
from .steptime import StepTimeModel, request_pairs, spill_pairs
from .workload import PromptFactory, Workload

__all__ = ["SimResult", "StalledError", "make_config", "simulate"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
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
    """Raw record of one simulated run; :func:`kvsched.sim.metrics.summarize` turns it into metrics.

    Per step ``s``: ``step_start[s]``, ``step_time[s]``, ``step_num_reqs[s]``, ``step_num_tokens[s]``,
    ``step_prefill_tokens[s]``, ``step_decode_reqs[s]``, ``step_kv_tokens[s]``. Flat per scheduled entry (CSR by
    ``step_num_reqs``): ``sched_idx``, ``sched_num_tokens``, ``sched_num_computed``. Flat per sampled token (CSR
    by ``step_num_sampled``): ``token_idx``. ``preempt_step``/``preempt_idx``: one entry per preemption.
    """

    workload: Workload
    config: SchedulerConfig
    step_model: StepTimeModel
    scheduler: str
    horizon: float | None
    target_output_len: IntArray  # output tokens each request runs to (drawn length, capped by max_model_len)
    added: npt.NDArray[np.bool_]  # request was added to the scheduler before the run ended
    step_start: FloatArray
    step_time: FloatArray
    step_num_reqs: IntArray
    step_num_tokens: IntArray
    step_prefill_tokens: IntArray
    step_decode_reqs: IntArray
    step_kv_tokens: IntArray
    step_num_sampled: IntArray
    sched_idx: npt.NDArray[np.int32]
    sched_num_tokens: npt.NDArray[np.int32]
    sched_num_computed: npt.NDArray[np.int32]
    token_idx: npt.NDArray[np.int32]
    preempt_step: IntArray
    preempt_idx: IntArray
    timeseries: dict[str, FloatArray]
    final_stats: dict[str, Any]
    end_time: float
    wall_s: float
    batches: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.step_start)


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


def _with_tenant_weights(config: SchedulerConfig, workload: Workload) -> SchedulerConfig:
    """Fill a ``tenant_weights`` config field (when the scheduler has one) from the workload, unless set."""
    names = {f.name for f in dataclasses.fields(SchedulerConfig)}
    if "tenant_weights" not in names or getattr(config, "tenant_weights", None):
        return config
    if all(w == 1.0 for w in workload.tenant_weights):
        return config
    weights = dict(zip(workload.tenant_names, workload.tenant_weights, strict=True))
    return dataclasses.replace(config, tenant_weights=weights)  # type: ignore[call-arg, unused-ignore]


def _accepts_tenant(add_request: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(add_request).parameters
    except (TypeError, ValueError):
        return False
    return "tenant" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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


def simulate(
    workload: Workload,
    config: SchedulerConfig | dict[str, Any] | None,
    step_model: StepTimeModel,
    *,
    scheduler: str | Callable[[SchedulerConfig], Any] = "rust",
    horizon: float | None = None,
    timeseries_interval: float | None = None,
    record_batches: bool = False,
    progress: bool | SimProgress = False,
    progress_desc: str = "simulate",
    fast_path: bool = True,
    prompt_fn: Callable[[int], npt.NDArray[np.int32]] | None = None,
) -> SimResult:
    """Run ``workload`` through a real scheduler in simulated time (see the module docstring).

    ``horizon``: stop at this simulated time (requests not finished by then are reported as unfinished);
    None runs until every request has finished. ``timeseries_interval``: seconds of simulated time between
    samples of the scheduler's stats (default: about 400 samples over the arrival window).
    ``record_batches``: keep each step's (request indices, scheduled tokens), for validation.
    ``fast_path=False`` records every step in full (same results, slower; for tests).
    ``prompt_fn(i)``: the prompt token ids of request ``i`` (default: :class:`PromptFactory`'s).
    ``progress``: True draws a progress bar of this run on stderr (:class:`kvsched.sim.progress.SimProgress`);
    a ``SimProgress`` (a sweep's) gets this run as its next one, labelled ``progress_desc``.
    """
    cfg = _with_tenant_weights(make_config(config), workload)
    name, sched = _make_scheduler(scheduler, cfg)
    n = len(workload)
    prompt_len = workload.prompt_len
    too_long = np.flatnonzero(prompt_len >= cfg.max_model_len)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"{too_long.size} request(s) have prompt_len >= max_model_len ({cfg.max_model_len}), e.g. request {i} "
            f"with {int(prompt_len[i])} tokens; raise max_model_len, shorten the prompts, or clip drawn ones with "
            f"generate_workload(spec, max_model_len={cfg.max_model_len})"
        )
    target = np.minimum(workload.output_len, cfg.max_model_len - prompt_len).astype(np.int64)
    final_len = prompt_len + target
    known = prompt_len.astype(np.int64).copy()  # prompt + outputs so far, by request index
    arrival = workload.arrival_time
    arrival_list = arrival.tolist()
    ids = [f"r{i}" for i in range(n)]
    idx_of = {rid: i for i, rid in enumerate(ids)}
    get_idx = idx_of.__getitem__
    factory = PromptFactory(workload.seed)
    tenant_kw = _accepts_tenant(sched.add_request) and (
        workload.num_tenants > 1 or cfg.policy not in ("fcfs", "priority")
    )
    tenant_names = workload.tenant_names
    tenants = workload.tenant.tolist()
    priorities = workload.priority.tolist()
    groups = workload.prefix_group.tolist()
    plens = workload.prefix_len.tolist()
    prompts = prompt_len.tolist()
    targets = target.tolist()
    added = np.zeros(n, dtype=np.bool_)

    span = float(arrival[-1]) if n else 0.0
    interval = timeseries_interval if timeseries_interval else max(span / 400.0, 0.05)
    sample_at = 0.0
    ts: dict[str, list[float]] = {
        k: []
        for k in ("time", "num_running", "num_waiting", "kv_cache_usage", "num_preemptions", "prefix_cache_hit_rate")
    }

    # Per step: start, duration, whether it took the fast path. Per recorded ("full") step: its composition,
    # and its entries in the buffers. A fast step is rebuilt from the full step it repeats (see _expand).
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
    if cfg.preemption_mode == "auto":
        sched.set_preemption_costs(step_model.prefill_token_s, step_model.swap_block_s)
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
    append_start, append_time, append_fast = step_start.append, step_time.append, step_fast.append

    # State of the fast path: the previous step's batch, whether it was all decodes, and how many fast steps
    # have run since (their tokens are added to ``known`` in one go when the run ends).
    prev_all_dec, prev_rids, prev_m, prev_idx = False, None, -1, np.zeros(0, dtype=np.int64)
    kv, run, c_fixed = 0, 0, 0.0
    tok_view, ptr_view = tokens[:0], arange[:1]

    own_progress = progress is True
    prog = progress if isinstance(progress, SimProgress) else (SimProgress(1) if progress else None)
    if prog is not None:
        prog.start_run(progress_desc, n, horizon)
    logger = logging.getLogger("kvsched")
    old_level = logger.level
    logger.setLevel(logging.ERROR)  # the preemption warning is expected under load; the metrics count them
    wall0 = time.perf_counter()
    t = 0.0
    nxt = 0
    unfinished = 0
    step = 0
    try:
        while True:
            if horizon is not None and t >= horizon:
                break
            if unfinished == 0:
                if nxt >= n:
                    break
                t = max(t, arrival_list[nxt])
                if horizon is not None and t >= horizon:
                    break
            while nxt < n and arrival_list[nxt] <= t:
                i = nxt
                kw: dict[str, Any] = {"tenant": tenant_names[tenants[i]]} if tenant_kw else {}
                add(
                    ids[i],
                    factory.tokens(i, prompts[i], groups[i], plens[i]) if prompt_fn is None else prompt_fn(i),
                    max_tokens=targets[i],
                    priority=priorities[i],
                    arrival_time=arrival_list[i],
                    **kw,
                )
                nxt += 1
                unfinished += 1
            if t >= sample_at:
                st = sched.stats()
                ts["time"].append(t)
                ts["num_running"].append(st.num_running_reqs)
                ts["num_waiting"].append(st.num_waiting_reqs)
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
                # recorded here; _expand rebuilds it and ``known`` catches up when the run ends.
                run += 1
                kv += m
                dt = c_fixed + c_kv * kv
                fin = update(out, (tok_view, ptr_view)).finished_req_ids
                if fin:
                    unfinished -= len(fin)
                append_start(t)
                append_time(dt)
                append_fast(True)
                if batches is not None:
                    batches.append((tuple(prev_idx.tolist()), (1,) * m))
                t += dt
                step += 1
                if prog is not None and (step & 1023) == 0:
                    prog.update(t, nxt - unfinished)
                continue
            if run:
                known[prev_idx] += run
                run = 0
            if m == 0:
                pre_ids = out.preempted_req_ids
                prev_all_dec = False
                if nxt < n:
                    t = max(t, arrival_list[nxt])
                    continue
                raise StalledError(
                    f"{name} scheduled nothing at t={t:.3f}s with {unfinished} request(s) unfinished"
                    + (f" (preempted: {pre_ids})" if pre_ids else "")
                )
            idx = fromiter(map(get_idx, rids), int64, m)
            nst = out.num_scheduled_tokens
            nct = out.num_computed_tokens
            kl = known[idx]
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
            if c_swap:
                dt += c_swap * (len(out.swap_out) + len(out.swap_in))
            sel = idx[complete]
            k = len(sel)
            if k == m:
                res = update(out, (tokens[:m], arange[: m + 1]))
            else:
                indptr = np.zeros(m + 1, dtype=int64)
                cumsum(complete, out=indptr[1:])
                res = update(out, (tokens[:k], indptr))
            known[sel] += 1
            unfinished -= len(res.finished_req_ids)

            append_start(t)
            append_time(dt)
            append_fast(False)
            f_m.append(m)
            f_tok.append(n_tok)
            f_pre.append(n_pre)
            f_kv.append(kv)
            f_nsel.append(k)
            b_idx.extend(idx)
            b_nst.extend(nst)
            b_nct.extend(nct)
            b_sel.extend(sel)
            pre_ids = out.preempted_req_ids
            if pre_ids:
                for rid in pre_ids:
                    pre_step.append(step)
                    pre_idx.append(idx_of[rid])
            if batches is not None:
                batches.append((tuple(idx.tolist()), tuple(nst.tolist())))
            prev_all_dec = n_dec == m and not pre_ids
            prev_rids, prev_m, prev_idx = rids, m, idx
            c_fixed = c0 + c_dec * m
            tok_view, ptr_view = tokens[:m], arange[: m + 1]
            t += dt
            step += 1
            if prog is not None and (step & 1023) == 0:
                prog.update(t, nxt - unfinished)
        if run:
            known[prev_idx] += run
    finally:
        logger.setLevel(old_level)
        if prog is not None:
            prog.finish_run(f"{nxt - unfinished:,}/{n:,} requests finished, {step:,} steps, {t:,.1f} s simulated")
            if own_progress:
                prog.close()
    wall = time.perf_counter() - wall0
    added[:nxt] = True
    finished_by_us = added & (known == final_len)
    if horizon is None and int(finished_by_us.sum()) != n:
        raise StalledError(f"{n - int(finished_by_us.sum())} request(s) did not finish although the run drained")
    fast = np.asarray(step_fast, dtype=np.bool_)
    per_step, sched_idx, sched_nst, sched_nct, token_idx = _expand(
        fast,
        {
            "m": np.asarray(f_m, dtype=np.int64),
            "tok": np.asarray(f_tok, dtype=np.int64),
            "pre": np.asarray(f_pre, dtype=np.int64),
            "kv": np.asarray(f_kv, dtype=np.int64),
            "nsel": np.asarray(f_nsel, dtype=np.int64),
        },
        b_idx.array(),
        b_nst.array(),
        b_nct.array(),
        b_sel.array(),
    )
    st = sched.stats()
    final_stats: dict[str, Any] = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    final_stats["prefix_cache_hit_rate"] = st.prefix_cache_hit_rate
    return SimResult(
        workload=workload,
        config=cfg,
        step_model=step_model,
        scheduler=name,
        horizon=horizon,
        target_output_len=target,
        added=added,
        step_start=np.asarray(step_start, dtype=np.float64),
        step_time=np.asarray(step_time, dtype=np.float64),
        step_num_reqs=per_step["m"],
        step_num_tokens=per_step["tok"],
        step_prefill_tokens=per_step["pre"],
        step_decode_reqs=per_step["tok"] - per_step["pre"],
        step_kv_tokens=per_step["kv"],
        step_num_sampled=per_step["nsel"],
        sched_idx=sched_idx,
        sched_num_tokens=sched_nst,
        sched_num_computed=sched_nct,
        token_idx=token_idx,
        preempt_step=np.asarray(pre_step, dtype=np.int64),
        preempt_idx=np.asarray(pre_idx, dtype=np.int64),
        timeseries={k: np.asarray(v, dtype=np.float64) for k, v in ts.items()},
        final_stats=final_stats,
        end_time=t,
        wall_s=wall,
        batches=batches,
        extra={"tenant_passed": tenant_kw, "num_fast_steps": int(fast.sum())},
    )
