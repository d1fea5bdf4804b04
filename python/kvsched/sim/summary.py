"""What a finished simulated run adds up to: :func:`summarize` (every per-run, per-tenant and per-priority figure,
from the run's streamed :class:`~kvsched.sim.metrics.RunMetrics`), and, from a run's raw record
(``simulate(..., keep_records=True)``), :func:`request_records` (every per-request and per-token figure) and
:func:`tenant_service` (service and queue per tenant and window, for another fairness window than the run's).

The figures themselves are defined in :mod:`kvsched.sim.metrics`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .metrics import _LATENCIES, PERCENTILES, RequestRecords, _fairness, _Group, _segment_starts

if TYPE_CHECKING:
    from .simulator import SimResult

__all__ = ["request_records", "summarize", "tenant_service"]


def request_records(result: SimResult) -> RequestRecords:
    """Per-request records of a run kept with ``simulate(..., keep_records=True)`` (vectorised; O(tokens log
    tokens))."""
    if not result.has_records:
        raise ValueError("this run kept no raw record: simulate(..., keep_records=True) keeps it")
    w = result.workload
    n = len(w)
    step_end = result.step_start + result.step_time

    # Tokens: which request got a token at which step; stable-sorted by request keeps step order within one.
    tok_step = np.repeat(np.arange(result.num_steps, dtype=np.int64), result.step_num_sampled)
    tok_idx = result.token_idx.astype(np.int64)
    order = np.argsort(tok_idx, kind="stable")
    tok_time = step_end[tok_step[order]]
    counts = np.bincount(tok_idx, minlength=n).astype(np.int64)
    starts = _segment_starts(counts)
    has = counts > 0
    first_tok = np.full(n, np.nan)
    last_tok = np.full(n, np.nan)
    first_tok[has] = tok_time[starts[:-1][has]]
    last_tok[has] = tok_time[starts[1:][has] - 1]
    gaps = np.diff(tok_time)
    same = np.ones(len(gaps), dtype=np.bool_)
    if len(gaps):
        bounds = starts[1:-1]
        bounds = bounds[(bounds > 0) & (bounds <= len(gaps))]
        same[bounds - 1] = False
    itl = gaps[same] if len(gaps) else np.zeros(0)
    itl_counts = np.maximum(counts - 1, 0)
    itl_indptr = _segment_starts(itl_counts)

    # Scheduled entries: first scheduling, tokens computed, recomputation and prefix-cache skips.
    sch_step = np.repeat(np.arange(result.num_steps, dtype=np.int64), result.step_num_reqs)
    s_idx = result.sched_idx.astype(np.int64)
    s_order = np.argsort(s_idx, kind="stable")
    s_idx_s = s_idx[s_order]
    nst = result.sched_num_tokens.astype(np.int64)[s_order]
    nct = result.sched_num_computed.astype(np.int64)[s_order]
    end = nct + nst
    # High-water mark of computed tokens before each entry: a segmented running max (the request index in the
    # high bits keeps segments apart), shifted by one within each request.
    key = (s_idx_s << 32) + end
    run_max = np.maximum.accumulate(key) if len(key) else key
    prev = np.empty_like(end)
    if len(end):
        prev[0] = 0
        prev[1:] = run_max[:-1] - (s_idx_s[1:] << 32)
        prev = np.maximum(prev, 0)
        new_seg = np.ones(len(end), dtype=np.bool_)
        new_seg[1:] = s_idx_s[1:] != s_idx_s[:-1]
        prev[new_seg] = 0
    recomputed = np.maximum(np.minimum(end, prev) - nct, 0)
    skipped = np.maximum(nct - prev, 0)
    num_sched = np.bincount(s_idx, weights=result.sched_num_tokens, minlength=n).astype(np.int64)
    num_rec = np.bincount(s_idx_s, weights=recomputed, minlength=n).astype(np.int64)
    num_cached = np.bincount(s_idx_s, weights=skipped, minlength=n).astype(np.int64)
    sched_counts = np.bincount(s_idx, minlength=n)
    s_starts = _segment_starts(sched_counts.astype(np.int64))
    scheduled = sched_counts > 0
    first_sched = np.full(n, np.nan)
    first_step_of = sch_step[s_order][s_starts[:-1][scheduled]]
    first_sched[scheduled] = result.step_start[first_step_of]

    preempts = np.bincount(result.preempt_idx, minlength=n).astype(np.int64)
    finished = result.added & (counts == result.target_output_len)
    arrival = w.arrival_time
    finish = np.where(finished, last_tok, np.nan)
    ttft = first_tok - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(finished & (counts > 1), (finish - first_tok) / (counts - 1), np.nan)
    return RequestRecords(
        arrival_time=arrival,
        prompt_len=w.prompt_len,
        output_len=result.target_output_len,
        tenant=w.tenant,
        priority=w.priority,
        prefix_group=w.prefix_group,
        added=result.added,
        finished=finished,
        num_output_tokens=counts,
        first_scheduled_time=first_sched,
        first_token_time=first_tok,
        finish_time=finish,
        ttft=ttft,
        tpot=tpot,
        e2e=e2e,
        queue_delay=first_sched - arrival,
        num_preemptions=preempts,
        num_scheduled_tokens=num_sched,
        num_recomputed_tokens=num_rec,
        num_cached_tokens=num_cached,
        itl=itl,
        itl_indptr=itl_indptr,
    )


def _group_summary(g: _Group, num_good: int, duration: float) -> dict[str, Any]:
    return {
        "num_requests": g.num_requests,
        "num_finished": g.num_finished,
        "num_unfinished": g.num_requests - g.num_finished,
        "request_throughput": g.num_finished / duration if duration > 0 else math.nan,
        "output_token_throughput": g.num_output_tokens / duration if duration > 0 else math.nan,
        **{key: g.lat[key].summary(PERCENTILES) for key in _LATENCIES},
        "num_good": num_good,
        "goodput": num_good / duration if duration > 0 else math.nan,
        "slo_attainment": num_good / g.num_requests if g.num_requests else math.nan,
        "num_preemptions": g.num_preemptions,
        "num_recomputed_tokens": g.num_recomputed_tokens,
        "num_output_tokens": g.num_output_tokens,
    }


def summarize(
    result: SimResult,
    records: RequestRecords | None = None,
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    window: float | None = None,
) -> dict[str, Any]:
    """Every per-run, per-tenant and per-priority figure of ``result`` as a JSON-ready dict, from its streamed
    metrics. Goodput counts the SLOs given here: those the run was given, or any while the run finished at most
    :data:`~kvsched.sim.sketch.EXACT_LIMIT` requests. ``window``: the fairness window; another width than the
    run's needs its raw record (``simulate(..., keep_records=True)``; ``records`` saves rebuilding them)."""
    m = result.metrics
    if m is None:
        raise ValueError("this result's metrics were dropped after it was summarized (a sweep's RunOutput)")
    w = result.workload
    duration = max(result.end_time - m.first_arrival, 1e-12)
    service = m.service if m.service is not None else m.windows.result(result.end_time, m.tenant_weights)
    if window is not None and window != service["window"]:
        if not result.has_records:
            raise ValueError(
                f"this run summed service over windows of {service['window']:g} s; for {window:g} s windows pass "
                "window= to simulate() (or run_sweep), or keep its raw record (keep_records=True)"
            )
        service = tenant_service(result, window, records if records is not None else request_records(result))
    good, good_tenants, good_prios = m.num_good(slo_ttft, slo_tpot)
    overall = _group_summary(m.overall, good, duration)
    overall["total_token_throughput"] = m.overall.finished_tokens / duration
    overall["duration"] = duration
    overall["num_steps"] = m.num_steps
    overall["wall_s"] = result.wall_s
    overall["sim_speed"] = duration / result.wall_s if result.wall_s > 0 else math.nan
    fs = result.final_stats
    overall["prefix_cache_hit_rate"] = float(fs.get("prefix_cache_hit_rate", math.nan))
    overall["num_cached_tokens"] = m.overall.num_cached_tokens
    kv = result.timeseries.get("kv_cache_usage", np.zeros(0))
    overall["kv_cache_usage"] = {
        "mean": float(kv.mean()) if kv.size else math.nan,
        "max": float(kv.max()) if kv.size else math.nan,
    }
    overall["batch_size_mean"] = m.num_scheduled_entries / m.num_steps if m.num_steps else math.nan
    overall["step_time_mean"] = m.step_time_sum / m.num_steps if m.num_steps else math.nan
    # Lengths cut to fit max_model_len: prompts clipped when the workload was drawn (generate_workload's
    # max_model_len), outputs capped by the simulator at max_model_len - prompt_len.
    overall["num_clipped_prompts"] = int(w.num_clipped_prompts)
    overall["num_capped_outputs"] = m.num_capped_outputs

    tenants = []
    share_total = float(service["service"].sum())
    for i, name in enumerate(w.tenant_names):
        g = _group_summary(m.tenants[i], good_tenants[i], duration)
        g["tenant"] = name
        g["weight"] = w.tenant_weights[i]
        g["service_tokens"] = float(service["service"][:, i].sum())
        g["service_share"] = g["service_tokens"] / share_total if share_total > 0 else math.nan
        tenants.append(g)
    prios = []
    for i, p in enumerate(m.prio_values.tolist()):
        if m.priorities[i].num_requests:
            g = _group_summary(m.priorities[i], good_prios[i], duration)
            g["priority"] = int(p)
            prios.append(g)
    jain = service["jain"]
    finite = jain[np.isfinite(jain)]
    return {
        "scheduler": result.scheduler,
        "policy": result.config.policy,
        "step_model": result.step_model.name,
        "slo_ttft": slo_ttft,
        "slo_tpot": slo_tpot,
        "overall": overall,
        "tenants": tenants,
        "priorities": prios,
        "fairness": {
            "window": service["window"],
            "jain_mean": float(finite.mean()) if finite.size else math.nan,
            "jain_min": float(finite.min()) if finite.size else math.nan,
        },
    }


def tenant_service(result: SimResult, window: float, records: RequestRecords) -> dict[str, Any]:
    """Per window and tenant: tokens computed (``service``), the mean number of the tenant's requests waiting
    for admission (``queue``), whether it was backlogged (``backlogged``: ``queue >= 1``, at least one request
    waiting on average), and Jain's index of ``service / weight`` over the backlogged tenants (``jain``; NaN
    where fewer than two were backlogged: fairness is only at stake when tenants compete for the engine)."""
    w = result.workload
    nt = w.num_tenants
    end_time = max(result.end_time, 1e-12)
    nwin = max(1, math.ceil(end_time / window))
    sch_step = np.repeat(np.arange(result.num_steps, dtype=np.int64), result.step_num_reqs)
    t_entry = (result.step_start + result.step_time)[sch_step]
    win_of = np.minimum((t_entry / window).astype(np.int64), nwin - 1)
    ten = w.tenant[result.sched_idx.astype(np.int64)]
    flat = np.bincount(win_of * nt + ten, weights=result.sched_num_tokens, minlength=nwin * nt)
    service = flat.reshape(nwin, nt).astype(np.float64)
    # Queue-seconds: the integral of "requests waiting" over each window, from each request's wait
    # [arrival, first scheduled). F(T) = sum over requests of the part of its wait before T.
    added = records.added
    start = w.arrival_time[added]
    stop = np.where(np.isfinite(records.first_scheduled_time), records.first_scheduled_time, end_time)[added]
    ten_a = w.tenant[added]
    bounds = np.arange(nwin + 1, dtype=np.float64) * window
    queue = np.zeros((nwin, nt))
    for i in range(nt):
        mask = ten_a == i
        a, b = start[mask], stop[mask]
        f = np.array([float(np.clip(np.minimum(b, t) - a, 0.0, None).sum()) for t in bounds])
        queue[:, i] = np.diff(f) / window
    return _fairness(window, service, queue, np.asarray(w.tenant_weights, dtype=np.float64))
