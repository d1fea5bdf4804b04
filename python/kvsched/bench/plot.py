"""``--plot``: a PNG of per-step latency against the number of running requests (needs matplotlib)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .harness import RunResult, ScalingPoint

__all__ = ["MatplotlibMissingError", "plot_results"]

_COLORS = {"rust": "tab:orange", "reference": "tab:blue", "vllm": "tab:green"}


class MatplotlibMissingError(RuntimeError):
    """--plot was asked for but matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MatplotlibMissingError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or pip install '.[plot]' in "
            "kvsched's repository root)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _binned_median(
    x: npt.NDArray[np.int64], y: npt.NDArray[np.float64], num_bins: int = 24
) -> tuple[list[float], list[float]]:
    if len(x) == 0:
        return [], []
    edges = np.unique(np.linspace(int(x.min()), int(x.max()) + 1, num_bins + 1).astype(np.int64))
    xs, ys = [], []
    for lo, hi in itertools.pairwise(edges):
        mask = (x >= lo) & (x < hi)
        if mask.any():
            xs.append(float(np.median(x[mask])))
            ys.append(float(np.median(y[mask])))
    return xs, ys


def plot_results(results: Sequence[RunResult], path: str | Path, *, scaling: Sequence[ScalingPoint] = ()) -> Path:
    """One panel per workload (every step: schedule+update µs against running requests, one colour per
    implementation, log scale when implementations differ a lot), plus a panel for the scaling check."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.workload for r in results))
    panels = len(workloads) + (1 if scaling else 0)
    cols = min(3, max(panels, 1))
    rows = math.ceil(panels / cols) if panels else 1
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    flat = list(axes.flat)

    for ax, workload in zip(flat, workloads, strict=False):
        runs = [r for r in results if r.workload == workload]
        for r in runs:
            us = r.total_ns / 1000.0
            color = _COLORS.get(r.impl)
            ax.scatter(r.num_running_reqs, us, s=2, alpha=0.25, color=color, rasterized=True)
            med = float(np.median(us)) if len(us) else math.nan
            p99 = float(np.percentile(us, 99)) if len(us) else math.nan
            # The median step cost per number of running requests, as a line over the cloud.
            xs, ys = _binned_median(r.num_running_reqs, us)
            label = f"{r.impl}: median {med:.1f} µs, p99 {p99:.0f} µs"
            ax.plot(xs, ys, "-", color=color, lw=1.5, label=label)
        # Log scale: outliers (OS preemption on a shared machine) would flatten a linear axis.
        ax.set_yscale("log")
        sc = runs[0].scenario
        description = str(sc.get("description", ""))
        if len(description) > 48:
            description = description[:47] + "…"
        ax.set_title(f"{workload}: {description}", fontsize=9)
        ax.set_xlabel("running requests")
        ax.set_ylabel("schedule + update per step (µs)")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7, loc="upper left")

    if scaling:
        ax = flat[len(workloads)]
        for impl in dict.fromkeys(p.impl for p in scaling):
            pts = [p for p in scaling if p.impl == impl]
            n = np.array([p.num_running for p in pts], dtype=np.float64)
            meds = np.array([np.median(p.total_ns) / 1000.0 for p in pts])
            ax.plot(n, meds, "o-", color=_COLORS.get(impl), label=f"{impl} (median)")
            # A linear reference through the smallest point.
            ax.plot(n, meds[0] * n / n[0], ":", color=_COLORS.get(impl), alpha=0.6, label=f"{impl}: linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title("scaling: pure decode step cost", fontsize=9)
        ax.set_xlabel("running decode requests")
        ax.set_ylabel("schedule + update per step (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    for ax in flat[panels:]:
        ax.set_visible(False)
    fig.suptitle("kvsched: per-step scheduling latency", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
