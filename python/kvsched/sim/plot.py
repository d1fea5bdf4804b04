"""PNG figures of a sweep (needs matplotlib, kvsched's ``plot`` extra; imported only when called).

- ``latency.png``: TTFT and end-to-end latency (p50, p99) against request rate, one line per policy/config;
- ``goodput.png``: goodput and SLO attainment against request rate;
- ``ttft_cdf.png``: TTFT CDFs (at the highest rate, or of every run when there is one rate);
- ``tenant_service.png``: per-tenant service (tokens per second) over time and Jain's index, per policy
  (at the highest rate);
- ``timeseries.png``: queue length, KV usage and cumulative preemptions over time (at the highest rate).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .sweep import RunOutput

__all__ = ["MatplotlibMissingError", "plot_sweep"]


class MatplotlibMissingError(RuntimeError):
    """Plots were asked for but matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MatplotlibMissingError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib; kvsched's plot extra)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(runs: Sequence[RunOutput]) -> dict[str, list[RunOutput]]:
    by: dict[str, list[RunOutput]] = defaultdict(list)
    for r in runs:
        by[r.label()].append(r)
    for v in by.values():
        v.sort(key=lambda r: r.rate or 0.0)
    return dict(by)


def _at_top_rate(runs: Sequence[RunOutput]) -> list[RunOutput]:
    rates = [r.rate for r in runs if r.rate is not None]
    if not rates:
        return list(runs)
    top = max(rates)
    return [r for r in runs if r.rate == top]


def plot_sweep(runs: Sequence[RunOutput], out_dir: str | Path, *, title: str = "") -> list[Path]:
    """Write the PNGs listed in the module docstring; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    series = _series(runs)
    suffix = f" — {title}" if title else ""

    def save(fig: Any, name: str) -> None:
        p = out / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    # Latency against rate.
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "e2e", "end-to-end latency")):
        for label, rs in series.items():
            x = [r.rate for r in rs]
            for stat, style in (("p50", "-o"), ("p99", "--s")):
                y = [r.summary["overall"][metric][stat] for r in rs]
                ax.plot(x, y, style, label=f"{label} {stat}", markersize=4)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (s)")
        ax.set_yscale("log")
        ax.set_title(f"{name} against load{suffix}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, "latency.png")

    # Goodput against rate.
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rs in series.items():
        x = [r.rate for r in rs]
        axes[0].plot(x, [r.summary["overall"]["goodput"] for r in rs], "-o", label=label, markersize=4)
        axes[1].plot(x, [100 * r.summary["overall"]["slo_attainment"] for r in rs], "-o", label=label, markersize=4)
    if runs:
        s0 = runs[0].summary
        slo = f"TTFT <= {s0['slo_ttft']} s, TPOT <= {s0['slo_tpot']} s"
    else:
        slo = ""
    rates = sorted({r.rate for r in runs if r.rate is not None})
    if rates:
        axes[0].plot(rates, rates, ":", color="gray", label="offered load")
    axes[0].set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("goodput (req/s meeting the SLOs)")
    axes[0].set_title(f"goodput ({slo})")
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("requests meeting the SLOs (%)")
    axes[1].set_ylim(0, 105)
    axes[1].set_title("SLO attainment")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, "goodput.png")

    # TTFT CDFs.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = _at_top_rate(runs)
    for r in top:
        qs, v = r.ttft_cdf
        if v:
            ax.plot(v, qs, label=r.label())
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    rate_txt = f" at {top[0].rate:g} req/s" if top and top[0].rate is not None else ""
    ax.set_title(f"TTFT CDF{rate_txt}{suffix}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "ttft_cdf.png")

    # Per-tenant service over time, one panel per run at the top rate.
    n = len(top)
    if n:
        ncols = min(n, 3)
        nrows = -(-n // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        for ax, r in zip(axes.flat, top, strict=False):
            svc = r.service
            t = np.asarray(svc["time"])
            w = float(svc["window"])
            for i, name in enumerate(r.result.workload.tenant_names):
                ax.plot(t + w / 2, svc["service"][:, i] / w, label=f"tenant {name}")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("service (tokens/s)")
            jain = r.summary["fairness"]["jain_mean"]
            ax.set_title(f"{r.label()}: Jain {jain:.3f}" if jain == jain else r.label())
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        save(fig, "tenant_service.png")

        # Queue, KV usage and preemptions over time.
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for r in top:
            ts = r.result.timeseries
            axes[0].plot(ts["time"], ts["num_waiting"], label=r.label())
            axes[1].plot(ts["time"], 100 * ts["kv_cache_usage"], label=r.label())
            axes[2].plot(ts["time"], ts["num_preemptions"], label=r.label())
        for ax, ylabel in zip(
            axes, ("waiting requests", "KV cache usage (%)", "preemptions (cumulative)"), strict=True
        ):
            ax.set_xlabel("time (s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        axes[0].set_title(f"queue length{rate_txt}")
        axes[1].set_title("KV cache usage")
        axes[2].set_title("preemptions")
        save(fig, "timeseries.png")
    return paths
