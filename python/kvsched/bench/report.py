"""Turn run results into figures: summaries, the printed tables, the JSON document, ratios and targets."""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import math
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .harness import RunResult, ScalingPoint, cpu_count, cpu_model_name

__all__ = [
    "SCHEMA_VERSION",
    "TARGETS",
    "build_document",
    "format_markdown",
    "format_ratios",
    "format_scaling",
    "format_table",
    "format_target_legend",
    "ratios",
    "result_to_dict",
    "scaling_summary",
    "scaling_verdict",
    "summarize_ns",
    "write_json",
]

SCHEMA_VERSION = 1

# Targets for the Rust scheduler through the Python API (benchmarks, not tests): median schedule+update per
# step in µs, and the most p99 may be as a multiple of the median (None: no p99 target).
TARGETS: dict[str, tuple[float, float | None]] = {
    "a": (10.0, None),
    "b": (40.0, None),
    "c": (50.0, 5.0),
    "d": (50.0, 5.0),
}
# Rust must be at least this many times faster than the reference (median total) on these workloads.
RATIO_TARGETS: dict[str, float] = {"a": 50.0, "b": 50.0}


def summarize_ns(ns: npt.NDArray[np.int64]) -> dict[str, float]:
    """median / p99 / max / mean / min of nanosecond samples, in microseconds."""
    if len(ns) == 0:
        return {"median": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan, "min": math.nan}
    us = ns.astype(np.float64) / 1000.0
    return {
        "median": float(np.median(us)),
        "p99": float(np.percentile(us, 99)),
        "max": float(us.max()),
        "mean": float(us.mean()),
        "min": float(us.min()),
    }


def _binned(result: RunResult, num_bins: int = 16) -> list[dict[str, float]]:
    """Median total µs per bin of running-request count (for plots and quick reading)."""
    running = result.num_running_reqs
    total = result.total_ns
    if len(running) == 0:
        return []
    hi = int(running.max())
    edges = np.unique(np.linspace(0, hi + 1, num_bins + 1).astype(np.int64))
    rows = []
    for lo, up in itertools.pairwise(edges):
        mask = (running >= lo) & (running < up)
        if mask.any():
            s = summarize_ns(total[mask])
            rows.append(
                {
                    "running_lo": int(lo),
                    "running_hi": int(up - 1),
                    "num_steps": int(mask.sum()),
                    "total_median_us": s["median"],
                    "total_p99_us": s["p99"],
                }
            )
    return rows


def _target_check(result: RunResult, total: dict[str, float]) -> dict[str, Any] | None:
    """The workload's target and whether the run met it; None when it has none. A run the targets are not for
    (another implementation, a scaled workload, --cold) gets ``{"applies": False, "why": ...}``."""
    target = TARGETS.get(result.workload)
    if target is None:
        return None
    median_max, p99_factor = target
    why = []
    if result.impl != "rust":
        why.append(f"impl {result.impl}")
    scale = result.scenario.get("scale", 1.0)
    if scale != 1.0:
        why.append(f"scale {scale:g}")
    if result.cold_mb:
        why.append(f"--cold {result.cold_mb:g}")
    if why:  # the targets are for the Rust scheduler on the full-size workloads, in the tight loop
        return {"applies": False, "why": why, "median_max_us": median_max, "p99_max_factor": p99_factor}
    ok = total["median"] <= median_max
    check: dict[str, Any] = {"applies": True, "median_max_us": median_max, "median_ok": ok}
    if p99_factor is not None:
        p99_ok = total["p99"] <= p99_factor * total["median"]
        check.update({"p99_max_factor": p99_factor, "p99_ok": p99_ok})
        ok = ok and p99_ok
    check["ok"] = ok
    return check


def result_to_dict(result: RunResult, *, per_step: bool = False) -> dict[str, Any]:
    total = summarize_ns(result.total_ns)
    c = result.counters
    busy_s = float(result.total_ns.sum()) / 1e9
    hit_rate = c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0
    doc: dict[str, Any] = {
        "workload": result.workload,
        "impl": result.impl,
        "scenario": result.scenario,
        "num_requests": result.num_requests,
        "num_steps": result.num_steps,
        "warmup_steps": result.warmup_steps,
        "cold_mb": result.cold_mb,
        "schedule_us": summarize_ns(result.schedule_ns),
        "update_us": summarize_ns(result.update_ns),
        "total_us": total,
        "output_access_us": summarize_ns(result.access_ns),
        "add_request_us": summarize_ns(result.add_request_ns),
        "steps_per_s": result.num_steps / busy_s if busy_s > 0 else math.nan,
        "loop_steps_per_s": result.num_steps / result.wall_s if result.wall_s > 0 else math.nan,
        "wall_s": result.wall_s,
        "num_preemptions": c.num_preemptions,
        "prefix_cache_queries": c.prefix_cache_queries,
        "prefix_cache_hits": c.prefix_cache_hits,
        "prefix_cache_hit_rate": hit_rate,
        "prefix_cache_preempted_queries": c.prefix_cache_preempted_queries,
        "prefix_cache_preempted_hits": c.prefix_cache_preempted_hits,
        "preemption_mode": result.scenario.get("preemption_mode", "recompute"),
        "num_recomputed_tokens": c.num_recomputed_tokens,
        "num_swapped_out_blocks": c.num_swapped_out_blocks,
        "num_swapped_in_blocks": c.num_swapped_in_blocks,
        "num_swap_fallbacks": c.num_swap_fallbacks,
        "num_output_tokens": result.num_output_tokens,
        "num_prompt_tokens_computed": result.num_prompt_tokens_computed,
        # Prompt tokens computed beyond what an infinite prefix cache would compute (evictions, preemptions);
        # None when the run was cut short.
        "num_recomputed_prompt_tokens": (
            result.num_prompt_tokens_computed - result.num_min_prompt_tokens if result.completed else None
        ),
        "num_scheduled_tokens_total": int(result.num_scheduled_tokens.sum()),
        "max_running_reqs": int(result.num_running_reqs.max()) if len(result.num_running_reqs) else 0,
        "peak_rss_mib": result.peak_rss_bytes / 2**20,
        "rss_before_mib": result.rss_before_bytes / 2**20,
        "schedule_digest": result.digest,
        "total_us_by_running": _binned(result),
        "target": _target_check(result, total),
    }
    doc.update(result.extra)
    if per_step:
        doc["per_step"] = {
            "schedule_ns": result.schedule_ns.tolist(),
            "update_ns": result.update_ns.tolist(),
            "num_running_reqs": result.num_running_reqs.tolist(),
            "num_scheduled_reqs": result.num_scheduled_reqs.tolist(),
            "num_scheduled_tokens": result.num_scheduled_tokens.tolist(),
        }
    return doc


def ratios(results: Sequence[RunResult], base: str = "rust") -> list[dict[str, Any]]:
    """For each workload run by ``base`` and another implementation: how many times slower the other is."""
    by_key = {(r.workload, r.impl): r for r in results}
    rows = []
    for (workload, impl), other in by_key.items():
        fast = by_key.get((workload, base))
        if impl == base or fast is None:
            continue
        f_tot = summarize_ns(fast.total_ns)
        o_tot = summarize_ns(other.total_ns)
        row: dict[str, Any] = {
            "workload": workload,
            "impl": impl,
            "base": base,
            "base_median_us": f_tot["median"],
            "impl_median_us": o_tot["median"],
            "ratio_median": o_tot["median"] / f_tot["median"] if f_tot["median"] > 0 else math.nan,
            "ratio_mean": o_tot["mean"] / f_tot["mean"] if f_tot["mean"] > 0 else math.nan,
            "same_schedule": fast.digest == other.digest and fast.num_steps == other.num_steps,
        }
        full_size = fast.scenario.get("scale", 1.0) == 1.0
        target = RATIO_TARGETS.get(workload) if impl == "reference" and full_size else None
        if target is not None:
            row["ratio_target"] = target
            row["ratio_ok"] = row["ratio_median"] >= target
        rows.append(row)
    return rows


def scaling_summary(points: Sequence[ScalingPoint]) -> dict[str, Any]:
    """Per size: median/p99 step cost and cost per request; plus the log-log slope (1.0 = linear)."""
    out: dict[str, Any] = {}
    for impl in dict.fromkeys(p.impl for p in points):
        rows: list[dict[str, Any]] = []
        for p in (p for p in points if p.impl == impl):
            total = summarize_ns(p.total_ns)
            rows.append(
                {
                    "num_running": p.num_running,
                    "num_steps": p.num_steps,
                    "schedule_us": summarize_ns(p.schedule_ns),
                    "update_us": summarize_ns(p.update_ns),
                    "total_us": total,
                    "us_per_request": total["median"] / p.num_running,
                }
            )
        slope = math.nan
        if len(rows) >= 2:
            x = np.log([r["num_running"] for r in rows])
            y = np.log([r["total_us"]["median"] for r in rows])
            slope = float(np.polyfit(x, y, 1)[0])
        for prev, cur in itertools.pairwise(rows):
            cur["growth_vs_previous"] = cur["total_us"]["median"] / prev["total_us"]["median"]
        out[impl] = {"points": rows, "loglog_slope": slope, "at_most_linear": bool(slope <= 1.1)}
    return out


def build_document(
    results: Sequence[RunResult],
    *,
    scaling: Sequence[ScalingPoint] = (),
    per_step: bool = False,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(argv) if argv is not None else None,
        "machine": {
            "cpu_model": cpu_model_name(),
            "num_cpus": cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "numpy": np.__version__,
        },
        "timing": {
            "clock": "time.perf_counter_ns",
            "total": "schedule() + update_from_output(); building the fake sampled output is not timed",
            "units": "microseconds",
        },
        "results": [result_to_dict(r, per_step=per_step) for r in results],
        "ratios": ratios(results),
        "scaling": scaling_summary(scaling) if scaling else None,
    }


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NaN is not valid JSON: write null instead.
    text = json.dumps(_nan_to_none(doc), indent=1)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if x >= 10000:
        return f"{x / 1000:.0f}k"
    if x >= 1000:
        return f"{x / 1000:.1f}k"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def _triple(s: dict[str, float]) -> str:
    return f"{_fmt(s['median'])}/{_fmt(s['p99'])}/{_fmt(s['max'])}"


def format_table(docs: Sequence[dict[str, Any]]) -> str:
    """The results table (one row per workload x implementation); times in µs as median/p99/max."""
    header = (
        "wl",
        "impl",
        "reqs",
        "steps",
        "schedule µs",
        "update µs",
        "total µs",
        "steps/s",
        "preempt",
        "hit%",
        "recomp tok",
        "RSS MiB",
        "target",
    )
    units = ("", "", "", "", "med/p99/max", "med/p99/max", "med/p99/max", "", "", "", "", "", "")
    rows: list[tuple[str, ...]] = [header, units]
    for d in docs:
        target = _target_cell(d.get("target"))
        rows.append(
            (
                d["workload"],
                d["impl"],
                str(d["num_requests"]),
                str(d["num_steps"]),
                _triple(d["schedule_us"]),
                _triple(d["update_us"]),
                _triple(d["total_us"]),
                f"{d['steps_per_s']:.0f}",
                str(d["num_preemptions"]),
                f"{100 * d['prefix_cache_hit_rate']:.1f}",
                "-" if d.get("num_recomputed_prompt_tokens") is None else str(d["num_recomputed_prompt_tokens"]),
                f"{d['peak_rss_mib']:.0f}",
                target,
            )
        )
    if any(d.get("cold_mb") for d in docs):
        # --cold: the memory touched between steps, after the implementation (0 = the tight loop).
        cold_cells = ["cold MB", "", *(f"{d.get('cold_mb', 0):g}" for d in docs)]
        rows = [(*r[:2], c, *r[2:]) for r, c in zip(rows, cold_cells, strict=True)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if j == 1:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _target_cell(t: dict[str, Any] | None) -> str:
    if t is None:
        return "-"
    if not t.get("applies", True):
        return "n/a"
    if t["ok"]:
        return "ok"
    missed = [name for name, key in (("median", "median_ok"), ("p99", "p99_ok")) if not t.get(key, True)]
    return "MISS " + "+".join(missed)


def format_target_legend(docs: Sequence[dict[str, Any]]) -> list[str]:
    """The lines under :func:`format_table` that say what its target column checks, why a cell is n/a, and by
    how much each MISS missed."""
    if not any(d.get("target") is not None for d in docs):
        return []
    medians = ", ".join(f"{name} {m:g}" for name, (m, _) in TARGETS.items())
    tails = ", ".join(name for name, (_, f) in TARGETS.items() if f is not None)
    factors = {f for _, f in TARGETS.values() if f is not None}
    lines = [
        f"target: median schedule+update per step <= {medians} µs"
        + (f"; p99 <= {'/'.join(f'{f:g}' for f in sorted(factors))}x the median for {tails}" if tails else ""),
        "        (for rust on the full-size workloads in the tight loop; '-': the workload has no target)",
    ]
    not_applied = [d["target"]["why"] for d in docs if d.get("target") and not d["target"].get("applies", True)]
    if not_applied:
        why = ", ".join(dict.fromkeys(w for ws in not_applied for w in ws))
        lines.append(f"target n/a: the targets are for rust at scale 1 without --cold; these runs have {why}")
    for d in docs:
        t = d.get("target")
        if not t or not t.get("applies", True) or t["ok"]:
            continue
        total = d["total_us"]
        parts = []
        if not t["median_ok"]:
            parts.append(f"median {_fmt(total['median'])} µs > {t['median_max_us']:g} µs")
        if not t.get("p99_ok", True):
            ratio = total["p99"] / total["median"] if total["median"] > 0 else math.inf
            parts.append(
                f"p99 {_fmt(total['p99'])} µs is {ratio:.1f}x the median {_fmt(total['median'])} µs "
                f"(at most {t['p99_max_factor']:g}x)"
            )
        lines.append(f"target MISS {d['workload']} ({d['impl']}): " + "; ".join(parts))
    return lines


def format_preemption(docs: Sequence[dict[str, Any]]) -> str:
    """What preemption cost each run: blocks swapped, victims recomputed because the CPU pool was full, tokens
    computed again after a preemption, and every token computed (prefill, recompute and decode)."""
    header = ("wl", "impl", "mode", "preempt", "swap out blk", "swap in blk", "fallbacks", "recomputed tok",
              "tokens computed", "steps")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for d in docs:
        rows.append(
            (
                d["workload"],
                d["impl"],
                str(d.get("preemption_mode", "recompute")),
                str(d["num_preemptions"]),
                str(d.get("num_swapped_out_blocks", 0)),
                str(d.get("num_swapped_in_blocks", 0)),
                str(d.get("num_swap_fallbacks", 0)),
                str(d.get("num_recomputed_tokens", 0)),
                str(d["num_scheduled_tokens_total"]),
                str(d["num_steps"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, r in enumerate(rows):
        cells = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_ratios(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = []
    for r in rows:
        check = ""
        if "ratio_ok" in r:
            check = f"  (target >= {r['ratio_target']:.0f}x: {'ok' if r['ratio_ok'] else 'MISS'})"
        same = "" if r["same_schedule"] else "  [schedules differ!]"
        lines.append(
            f"{r['workload']}: {r['impl']} {_fmt(r['impl_median_us'])} µs / {r['base']} "
            f"{_fmt(r['base_median_us'])} µs = {r['ratio_median']:.1f}x (mean {r['ratio_mean']:.1f}x)"
            f"{check}{same}"
        )
    return "\n".join(lines)


def scaling_verdict(slope: float) -> str:
    """The fitted exponent of step time against the number of running requests n, in words."""
    if not math.isfinite(slope):
        return "step time against n: too few sizes to fit"
    if slope < 0.9:
        words = "less than linear: the cost per request falls as n grows"
    elif slope <= 1.1:
        words = "about linear: a constant cost per request"
    elif slope <= 1.3:
        words = "slightly faster than linear: the cost per request grows with n"
    else:
        words = "faster than linear: the cost per request grows with n"
    return f"step time grows as n^{slope:.2f} ({words})"


def format_scaling(summary: dict[str, Any]) -> str:
    lines = []
    for impl, s in summary.items():
        lines.append(f"scaling ({impl}): pure decode, step cost vs running requests")
        lines.append(
            f"  {'running':>7}  {'steps':>5}  {'sched med':>9}  {'upd med':>8}  {'total med':>9}  "
            f"{'total p99':>9}  {'µs/req':>7}  {'x prev':>6}"
        )
        for p in s["points"]:
            growth = p.get("growth_vs_previous")
            lines.append(
                f"  {p['num_running']:>7}  {p['num_steps']:>5}  {_fmt(p['schedule_us']['median']):>9}  "
                f"{_fmt(p['update_us']['median']):>8}  {_fmt(p['total_us']['median']):>9}  "
                f"{_fmt(p['total_us']['p99']):>9}  {p['us_per_request']:>7.3f}  "
                f"{'' if growth is None else f'{growth:.2f}':>6}"
            )
        lines.append(f"  {scaling_verdict(s['loglog_slope'])}")
    return "\n".join(lines)


def _md_triple(s: dict[str, Any]) -> str:
    return f"{_fmt(s['median'])} / {_fmt(s['p99'])} / {_fmt(s['max'])}"


def format_markdown(doc: dict[str, Any]) -> str:
    """The results as Markdown tables (for docs/benchmarks.md and the README)."""
    m = doc["machine"]
    lines = [
        f"Machine: {m['cpu_model']}, {m['num_cpus']} CPUs; Python {m['python']}, numpy {m['numpy']}. "
        "Times in µs per step: median / p99 / max.",
        "",
    ]
    if doc["results"]:
        cold = any(r.get("cold_mb") for r in doc["results"])
        lines += [
            "| workload | impl |" + (" cold MB |" if cold else "") + " steps | schedule | update | schedule + update "
            "| steps/s | preemptions | prefix hit | peak RSS |",
            "|---|---|" + ("--:|" if cold else "") + "--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for r in doc["results"]:
            cold_cell = f" {r.get('cold_mb', 0):g} |" if cold else ""
            lines.append(
                f"| {r['workload']} | {r['impl']} |{cold_cell} {r['num_steps']} | {_md_triple(r['schedule_us'])} "
                f"| {_md_triple(r['update_us'])} | **{_md_triple(r['total_us'])}** | {r['steps_per_s']:,.0f} "
                f"| {r['num_preemptions']} | {100 * r['prefix_cache_hit_rate']:.1f}% "
                f"| {r['peak_rss_mib']:.0f} MiB |"
            )
    if any(r.get("preemption_mode", "recompute") != "recompute" for r in doc["results"]):
        lines += [
            "",
            "| workload | impl | mode | preemptions | blocks swapped out / in | fallbacks | recomputed tokens "
            "| tokens computed | steps |",
            "|---|---|---|--:|--:|--:|--:|--:|--:|",
        ]
        for r in doc["results"]:
            lines.append(
                f"| {r['workload']} | {r['impl']} | {r.get('preemption_mode', 'recompute')} | {r['num_preemptions']} "
                f"| {r.get('num_swapped_out_blocks', 0)} / {r.get('num_swapped_in_blocks', 0)} "
                f"| {r.get('num_swap_fallbacks', 0)} | {r.get('num_recomputed_tokens', 0)} "
                f"| {r['num_scheduled_tokens_total']} | {r['num_steps']} |"
            )
    if doc["ratios"]:
        lines += ["", "| workload | ratio (median) | ratio (mean) | same schedule |", "|---|--:|--:|---|"]
        for q in doc["ratios"]:
            lines.append(
                f"| {q['workload']}: {q['impl']} / {q['base']} | {q['ratio_median']:.0f}x | "
                f"{q['ratio_mean']:.0f}x | {'yes' if q['same_schedule'] else 'NO'} |"
            )
    if doc.get("scaling"):
        for impl, sc in doc["scaling"].items():
            lines += [
                "",
                f"Scaling ({impl}): {scaling_verdict(sc['loglog_slope'])}",
                "",
                "| running | schedule | update | total (median / p99) | µs per request | × previous |",
                "|--:|--:|--:|--:|--:|--:|",
            ]
            for p in sc["points"]:
                growth = p.get("growth_vs_previous")
                lines.append(
                    f"| {p['num_running']} | {_fmt(p['schedule_us']['median'])} | {_fmt(p['update_us']['median'])} "
                    f"| {_fmt(p['total_us']['median'])} / {_fmt(p['total_us']['p99'])} "
                    f"| {p['us_per_request']:.3f} | {'' if growth is None else f'{growth:.2f}'} |"
                )
    return "\n".join(lines) + "\n"
