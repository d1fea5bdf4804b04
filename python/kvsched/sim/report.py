"""Reports of a sweep: a table for the terminal, one JSON document, and CSV files with the data of every figure.

Files written by :func:`write_outputs` into the output directory:

- ``sim.json``: every run's summary (overall, per tenant, per priority, fairness) and series;
- ``summary.csv``: one row per run (latency percentiles, throughput, goodput, preemptions, ...);
- ``tenants.csv`` / ``priorities.csv``: one row per run and tenant / priority class;
- ``timeseries.csv``: running, waiting, KV usage, preemptions over time, per run;
- ``tenant_service.csv``: tokens computed per tenant per window, its mean number of waiting requests, whether it
  was backlogged (>= 1 waiting on average), Jain's index of weighted service over the backlogged tenants;
- ``ttft_cdf.csv``: TTFT quantiles (the CDF figure), per run;
- ``requests_<run>.csv`` (``run_sweep(per_request_dir=...)``, ``--per-request``): one row per request, written by
  :class:`RequestCsvWriter` as the run goes (finished requests in the order they finish, then those the run ended
  with, then those that never arrived before it ended; the ``idx`` column is the request's index).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .point import RunOutput

__all__ = [
    "SUMMARY_COLUMNS",
    "format_notes",
    "format_table",
    "summary_row",
    "to_document",
    "write_outputs",
]

_METRICS = ("ttft", "tpot", "itl", "e2e", "queue_delay")
SUMMARY_COLUMNS = (
    "run_id",
    "rate",
    "policy",
    "overrides",
    "num_requests",
    "num_finished",
    "num_unfinished",
    "request_throughput",
    "output_token_throughput",
    "total_token_throughput",
    *(f"{m}_{s}" for m in _METRICS for s in ("mean", "p50", "p90", "p99")),
    "goodput",
    "slo_attainment",
    "num_preemptions",
    "num_recomputed_tokens",
    "prefix_cache_hit_rate",
    "num_clipped_prompts",
    "num_capped_outputs",
    "kv_cache_usage_mean",
    "kv_cache_usage_max",
    "batch_size_mean",
    "jain_mean",
    "duration",
    "num_steps",
    "wall_s",
)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _json_safe(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def summary_row(run: RunOutput) -> dict[str, Any]:
    s = run.summary
    o = s["overall"]
    row: dict[str, Any] = {
        "run_id": run.run_id,
        "rate": run.rate,
        "policy": run.policy,
        "overrides": ";".join(f"{k}={v}" for k, v in run.overrides.items()),
    }
    for key in ("num_requests", "num_finished", "num_unfinished", "request_throughput", "output_token_throughput"):
        row[key] = o[key]
    row["total_token_throughput"] = o["total_token_throughput"]
    for m in _METRICS:
        for stat in ("mean", "p50", "p90", "p99"):
            row[f"{m}_{stat}"] = o[m][stat]
    for key in ("goodput", "slo_attainment", "num_preemptions", "num_recomputed_tokens", "prefix_cache_hit_rate",
                "num_clipped_prompts", "num_capped_outputs"):  # fmt: skip
        row[key] = o[key]
    row["kv_cache_usage_mean"] = o["kv_cache_usage"]["mean"]
    row["kv_cache_usage_max"] = o["kv_cache_usage"]["max"]
    row["batch_size_mean"] = o["batch_size_mean"]
    row["jain_mean"] = s["fairness"]["jain_mean"]
    for key in ("duration", "num_steps", "wall_s"):
        row[key] = o[key]
    return row


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if x >= 10:
        return f"{x:.1f}s"
    if x >= 1:
        return f"{x:.2f}s"
    return f"{x * 1000:.0f}ms" if x >= 0.01 else f"{x * 1000:.1f}ms"


def _has_slo(run: RunOutput) -> bool:
    return run.summary.get("slo_ttft") is not None or run.summary.get("slo_tpot") is not None


def format_table(runs: Sequence[RunOutput]) -> str:
    """One line per run: the figures an operator reads first. Goodput and SLO % read "-" for a run without an
    SLO (every finished request would count); :func:`format_notes` says so under the table."""
    head = [
        "rate",
        "policy",
        "config",
        "done",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "e2e p50",
        "e2e p99",
        "goodput",
        "SLO %",
        "preempt",
        "wall",
    ]
    rows = []
    for r in runs:
        o = r.summary["overall"]
        slo = _has_slo(r)
        rows.append(
            [
                f"{r.rate:g}" if r.rate is not None else "-",
                r.policy,
                " ".join(f"{k}={v}" for k, v in r.overrides.items()) or "-",
                f"{o['num_finished']}/{o['num_requests']}",
                f"{o['request_throughput']:.2f}",
                f"{o['output_token_throughput']:,.0f}",
                _fmt_s(o["ttft"]["p50"]),
                _fmt_s(o["ttft"]["p99"]),
                _fmt_s(o["tpot"]["p50"]),
                _fmt_s(o["tpot"]["p99"]),
                _fmt_s(o["e2e"]["p50"]),
                _fmt_s(o["e2e"]["p99"]),
                f"{o['goodput']:.2f}" if slo and math.isfinite(o["goodput"]) else "-",
                f"{100 * o['slo_attainment']:.0f}" if slo and math.isfinite(o["slo_attainment"]) else "-",
                str(o["num_preemptions"]),
                f"{o['wall_s']:.1f}s",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def format_notes(runs: Sequence[RunOutput]) -> list[str]:
    """The lines printed under :func:`format_table`: why goodput and SLO % are empty, and how many lengths were
    cut to fit ``max_model_len``."""
    notes = []
    if runs and not any(_has_slo(r) for r in runs):
        notes.append(
            "goodput, SLO %: '-' without --slo-ttft / --slo-tpot (they count the finished requests that meet the SLOs)"
        )
    for key, what in (
        ("num_clipped_prompts", "prompt lengths drawn over max_model_len - 1 were clipped to it"),
        ("num_capped_outputs", "output lengths were capped at max_model_len - prompt_len"),
    ):
        counts = [(int(r.summary["overall"][key]), int(r.summary["overall"]["num_requests"])) for r in runs]
        hit = [(c, n) for c, n in counts if c]
        if hit:
            most, of = max(hit)
            notes.append(
                f"{what}: in {len(hit)} of {len(runs)} runs, at most {most:,} of {of:,} requests ({key} in summary.csv)"
            )
    return notes


def _ttft_cdf(run: RunOutput) -> tuple[list[float], list[float]]:
    return run.ttft_cdf


def to_document(
    runs: Sequence[RunOutput], *, argv: Sequence[str] | None = None, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON document of a sweep: summaries and the series behind every figure."""
    docs = []
    for r in runs:
        q, ttft = _ttft_cdf(r)
        svc = r.service
        docs.append(
            {
                **r.summary,
                "config": r.result.config.to_dict(),
                "step_model_coefficients": r.result.step_model.to_dict(),
                "workload": {
                    "num_requests": len(r.result.workload),
                    "tenants": list(r.result.workload.tenant_names),
                    "tenant_weights": list(r.result.workload.tenant_weights),
                    "source": r.result.workload.source,
                },
                "final_stats": r.result.final_stats,
                "series": {
                    "timeseries": {k: v.tolist() for k, v in r.result.timeseries.items()},
                    "ttft_cdf": {"quantile": q, "ttft": ttft},
                    "tenant_service": {
                        "window": svc.get("window"),
                        "time": np.asarray(svc.get("time", [])).tolist(),
                        "service": np.asarray(svc.get("service", [])).tolist(),
                        "jain": np.asarray(svc.get("jain", [])).tolist(),
                    },
                },
            }
        )
    doc = {"kind": "kvsched-simulate", "argv": list(argv) if argv is not None else None, **(meta or {}), "runs": docs}
    out: dict[str, Any] = _json_safe(doc)
    return out


def _write_csv(path: Path, header: Sequence[str], rows: Any) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        wr = csv.writer(f)
        wr.writerow(header)
        for row in rows:
            wr.writerow(["" if (isinstance(v, float) and not math.isfinite(v)) else v for v in row])
    return path


def write_outputs(
    runs: Sequence[RunOutput],
    out_dir: str | Path,
    *,
    per_request: bool = False,
    argv: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``sim.json`` and the CSV files (see the module docstring); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    doc = to_document(runs, argv=argv, meta=meta)
    p = out / "sim.json"
    p.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    paths.append(p)
    rows = [summary_row(r) for r in runs]
    paths.append(_write_csv(out / "summary.csv", SUMMARY_COLUMNS, ([row[c] for c in SUMMARY_COLUMNS] for row in rows)))

    group_cols = ("num_requests", "num_finished", "request_throughput", "output_token_throughput", "goodput",
                  "slo_attainment", "num_preemptions")  # fmt: skip
    lat_cols = tuple(f"{m}_{s}" for m in ("ttft", "tpot", "e2e", "queue_delay") for s in ("mean", "p50", "p90", "p99"))

    def group_row(run: RunOutput, g: dict[str, Any], key: str) -> list[Any]:
        return (
            [run.run_id, g[key]]
            + [g[c] for c in group_cols]
            + [g[c.rsplit("_", 1)[0]][c.rsplit("_", 1)[1]] for c in lat_cols]
        )

    ten_rows = []
    for r in runs:
        for g in r.summary["tenants"]:
            ten_rows.append([*group_row(r, g, "tenant"), g["weight"], g["service_tokens"], g["service_share"]])
    paths.append(
        _write_csv(
            out / "tenants.csv",
            ("run_id", "tenant", *group_cols, *lat_cols, "weight", "service_tokens", "service_share"),
            ten_rows,
        )
    )
    prio_rows = [group_row(r, g, "priority") for r in runs for g in r.summary["priorities"]]
    paths.append(_write_csv(out / "priorities.csv", ("run_id", "priority", *group_cols, *lat_cols), prio_rows))

    ts_keys = ("time", "num_running", "num_waiting", "kv_cache_usage", "num_preemptions", "prefix_cache_hit_rate")
    ts_rows = (
        [r.run_id, *(float(r.result.timeseries[k][i]) for k in ts_keys)]
        for r in runs
        for i in range(len(r.result.timeseries["time"]))
    )
    paths.append(_write_csv(out / "timeseries.csv", ("run_id", *ts_keys), ts_rows))

    svc_rows = []
    for r in runs:
        svc = r.service
        names = r.result.workload.tenant_names
        for k, t0 in enumerate(np.asarray(svc["time"]).tolist()):
            for i, name in enumerate(names):
                svc_rows.append(
                    [
                        r.run_id,
                        t0,
                        name,
                        float(svc["service"][k, i]),
                        float(svc["queue"][k, i]),
                        bool(svc["backlogged"][k, i]),
                        float(svc["jain"][k]),
                    ]
                )
    paths.append(
        _write_csv(
            out / "tenant_service.csv",
            ("run_id", "window_start", "tenant", "service_tokens", "mean_waiting", "backlogged", "jain"),
            svc_rows,
        )
    )
    cdf_rows: list[list[Any]] = []
    for r in runs:
        q, v = _ttft_cdf(r)
        cdf_rows.extend([r.run_id, qq, vv] for qq, vv in zip(q, v, strict=True))
    paths.append(_write_csv(out / "ttft_cdf.csv", ("run_id", "quantile", "ttft"), cdf_rows))

    if per_request:
        paths.extend(p for r in runs if (p := out / f"requests_{r.run_id}.csv").exists())
    return paths
