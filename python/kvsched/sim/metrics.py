"""Metrics of a simulated run, derived with numpy from the raw per-step record of :class:`SimResult`.

Per request (:class:`RequestRecords`): arrival, first scheduled, first token and finish times; TTFT (first
token - arrival), TPOT ((finish - first token) / (outputs - 1)), end-to-end latency (finish - arrival),
queueing delay (start of the first step that schedules it - arrival), preemptions, recomputed tokens (tokens
computed again after a preemption), cached tokens (prompt tokens skipped thanks to prefix-cache hits).

Per run (:func:`summarize`): mean/p50/p90/p99 of each, request and token throughput, goodput under SLOs,
preemptions, recomputed tokens, prefix-cache hit rate, KV usage, how many prompt lengths were clipped and output
lengths capped to fit ``max_model_len``; the same per tenant and per priority class;
per-tenant service (tokens computed for the tenant's requests) over time windows, its share, and Jain's
fairness index of weighted service per window over the tenants that were backlogged (on average at least one
request waiting for admission during the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .simulator import SimResult

__all__ = ["PERCENTILES", "RequestRecords", "jain_index", "percentiles", "request_records", "summarize"]

PERCENTILES = (50, 90, 99)
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass
class RequestRecords:
    """One entry per workload request (struct of arrays). Times are NaN where they did not happen."""

    arrival_time: FloatArray
    prompt_len: IntArray
    output_len: IntArray  # the length it runs to
    tenant: IntArray
    priority: IntArray
    prefix_group: IntArray
    added: npt.NDArray[np.bool_]
    finished: npt.NDArray[np.bool_]
    num_output_tokens: IntArray  # tokens generated (== output_len when finished)
    first_scheduled_time: FloatArray
    first_token_time: FloatArray
    finish_time: FloatArray
    ttft: FloatArray
    tpot: FloatArray
    e2e: FloatArray
    queue_delay: FloatArray
    num_preemptions: IntArray
    num_scheduled_tokens: IntArray  # every token computed for it, recomputation included
    num_recomputed_tokens: IntArray
    num_cached_tokens: IntArray
    itl: FloatArray  # every inter-token latency of every request, flattened
    itl_indptr: IntArray  # CSR offsets of each request's ITLs into ``itl``

    def __len__(self) -> int:
        return len(self.arrival_time)

    def columns(self) -> dict[str, npt.NDArray[Any]]:
        """The per-request columns (everything but the flattened ITLs)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("itl", "itl_indptr")}


def _segment_starts(counts: IntArray) -> IntArray:
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def request_records(result: SimResult) -> RequestRecords:
    """Per-request records of a run (vectorised; O(tokens log tokens))."""
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


def percentiles(values: FloatArray) -> dict[str, float]:
    """mean, p50, p90, p99 and max of the finite values (NaN when there are none)."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}, "max": math.nan}
    qs = np.percentile(v, PERCENTILES)
    return {
        "mean": float(v.mean()),
        **{f"p{p}": float(q) for p, q in zip(PERCENTILES, qs, strict=True)},
        "max": float(v.max()),
    }


def jain_index(x: FloatArray) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: 1 = equal, 1/n = one gets everything."""
    x = np.asarray(x, dtype=np.float64)
    sq = float((x * x).sum())
    if x.size == 0 or sq == 0.0:
        return math.nan
    return float(x.sum() ** 2 / (x.size * sq))


def _group_summary(
    rec: RequestRecords, mask: npt.NDArray[np.bool_], duration: float, slo: tuple[float | None, float | None]
) -> dict[str, Any]:
    fin = mask & rec.finished
    num = int(mask.sum())
    num_fin = int(fin.sum())
    out_tokens = int(rec.num_output_tokens[mask].sum())
    good = _good(rec, fin, slo)
    itl_mask = np.repeat(mask, np.diff(rec.itl_indptr))
    return {
        "num_requests": num,
        "num_finished": num_fin,
        "num_unfinished": num - num_fin,
        "request_throughput": num_fin / duration if duration > 0 else math.nan,
        "output_token_throughput": out_tokens / duration if duration > 0 else math.nan,
        "ttft": percentiles(rec.ttft[mask]),
        "tpot": percentiles(rec.tpot[mask]),
        "itl": percentiles(rec.itl[itl_mask]),
        "e2e": percentiles(rec.e2e[mask]),
        "queue_delay": percentiles(rec.queue_delay[mask]),
        "num_good": int(good.sum()),
        "goodput": float(good.sum()) / duration if duration > 0 else math.nan,
        "slo_attainment": float(good.sum()) / num if num else math.nan,
        "num_preemptions": int(rec.num_preemptions[mask].sum()),
        "num_recomputed_tokens": int(rec.num_recomputed_tokens[mask].sum()),
        "num_output_tokens": out_tokens,
    }


def _good(
    rec: RequestRecords, fin: npt.NDArray[np.bool_], slo: tuple[float | None, float | None]
) -> npt.NDArray[np.bool_]:
    good: npt.NDArray[np.bool_] = fin.copy()
    slo_ttft, slo_tpot = slo
    if slo_ttft is not None:
        good &= rec.ttft <= slo_ttft
    if slo_tpot is not None:
        # A one-token output has no TPOT; it meets any TPOT target.
        good &= ~(rec.tpot > slo_tpot)
    return good


def summarize(
    result: SimResult,
    records: RequestRecords | None = None,
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    window: float | None = None,
) -> dict[str, Any]:
    """Every per-run, per-tenant and per-priority figure of ``result`` as a JSON-ready dict."""
    rec = records if records is not None else request_records(result)
    w = result.workload
    slo = (slo_ttft, slo_tpot)
    start = float(w.arrival_time[0]) if len(w) else 0.0
    duration = max(result.end_time - start, 1e-12)
    added = rec.added
    overall = _group_summary(rec, added, duration, slo)
    overall["total_token_throughput"] = (
        float(rec.prompt_len[rec.finished].sum() + rec.output_len[rec.finished].sum()) / duration
    )
    overall["duration"] = duration
    overall["num_steps"] = result.num_steps
    overall["wall_s"] = result.wall_s
    overall["sim_speed"] = duration / result.wall_s if result.wall_s > 0 else math.nan
    fs = result.final_stats
    overall["prefix_cache_hit_rate"] = float(fs.get("prefix_cache_hit_rate", math.nan))
    overall["num_cached_tokens"] = int(rec.num_cached_tokens[added].sum())
    ts = result.timeseries
    kv = ts.get("kv_cache_usage", np.zeros(0))
    overall["kv_cache_usage"] = {
        "mean": float(kv.mean()) if kv.size else math.nan,
        "max": float(kv.max()) if kv.size else math.nan,
    }
    overall["batch_size_mean"] = float(result.step_num_reqs.mean()) if result.num_steps else math.nan
    overall["step_time_mean"] = float(result.step_time.mean()) if result.num_steps else math.nan
    # Lengths cut to fit max_model_len: prompts clipped when the workload was drawn (generate_workload's
    # max_model_len), outputs capped by the simulator at max_model_len - prompt_len.
    overall["num_clipped_prompts"] = int(w.num_clipped_prompts)
    overall["num_capped_outputs"] = int(np.count_nonzero(result.target_output_len < w.output_len))

    tenants = []
    win = window if window else max(duration / 20.0, 1e-9)
    service = tenant_service(result, win, rec)
    share_total = float(service["service"].sum())
    for i, name in enumerate(w.tenant_names):
        mask = added & (rec.tenant == i)
        g = _group_summary(rec, mask, duration, slo)
        g["tenant"] = name
        g["weight"] = w.tenant_weights[i]
        g["service_tokens"] = float(service["service"][:, i].sum())
        g["service_share"] = g["service_tokens"] / share_total if share_total > 0 else math.nan
        tenants.append(g)
    prios = []
    for p in sorted(set(rec.priority[added].tolist())):
        g = _group_summary(rec, added & (rec.priority == p), duration, slo)
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
            "window": win,
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
    service = flat.reshape(nwin, nt)
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
    backlogged = queue >= 1.0
    weights = np.asarray(w.tenant_weights, dtype=np.float64)
    jain = np.array(
        [
            jain_index(service[k, backlogged[k]] / weights[backlogged[k]]) if backlogged[k].sum() >= 2 else math.nan
            for k in range(nwin)
        ]
    )
    return {
        "window": window,
        "time": np.arange(nwin) * window,
        "service": service,
        "queue": queue,
        "backlogged": backlogged,
        "jain": jain,
    }
