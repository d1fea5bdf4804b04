"""``kvsched simulate --replicas N --routers POLICY,...``: a fleet behind a router (:mod:`kvsched.sim.cluster`).

Runs every (replica count, router) on the same requests, prints one table row per run and writes to ``--out``:

- ``cluster.json``: every run's :func:`~kvsched.sim.cluster.summarize_cluster` (the fleet, every replica, the
  hit rate, the imbalance, the routing reasons) and the command;
- ``cluster.csv``: one row per run (the table's columns, and more);
- ``cluster_replicas.csv``: one row per run and replica;
- with ``--plot``, ``cluster.png``: hit rate, mean and p99 TTFT, goodput (with an SLO) and load imbalance,
  against the replica count (one line per router), or per router when there is one replica count.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._cliutil import UsageError, check_output_dir, parse_csv_numbers, print_error

__all__ = ["CLUSTER_COLUMNS", "format_cluster_table", "plot_cluster", "run_cluster"]


def _err(msg: str) -> int:
    return print_error("simulate", msg)


CLUSTER_COLUMNS = (
    "replicas",
    "router",
    "num_finished",
    "prefix_cache_hit_rate",
    "ttft_mean",
    "ttft_p50",
    "ttft_p99",
    "tpot_mean",
    "e2e_mean",
    "goodput",
    "slo_attainment",
    "output_token_throughput",
    "num_preemptions",
    "request_imbalance",
    "token_imbalance",
    "requests_per_replica",
    "ttft_estimate_median_abs_error",
)


def _row(s: dict[str, Any]) -> dict[str, Any]:
    o = s["fleet"]["overall"]
    return {
        "replicas": s["num_replicas"],
        "router": s["router"],
        "num_finished": o["num_finished"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "ttft_mean": o["ttft"]["mean"],
        "ttft_p50": o["ttft"]["p50"],
        "ttft_p99": o["ttft"]["p99"],
        "tpot_mean": o["tpot"]["mean"],
        "e2e_mean": o["e2e"]["mean"],
        "goodput": o["goodput"],
        "slo_attainment": o["slo_attainment"],
        "output_token_throughput": o["output_token_throughput"],
        "num_preemptions": o["num_preemptions"],
        "request_imbalance": s["request_imbalance"],
        "token_imbalance": s["token_imbalance"],
        "requests_per_replica": "/".join(str(k) for k in s["requests_per_replica"]),
        "ttft_estimate_median_abs_error": s["ttft_estimate_error"]["median_abs"],
    }


def format_cluster_table(summaries: list[dict[str, Any]], *, slo: bool) -> str:
    """A Markdown table, one row per run: hit rate, TTFT (ms), TPOT (ms), goodput (with an SLO), imbalance."""

    def ms(x: float) -> str:
        return "-" if not math.isfinite(x) else f"{1000 * x:.1f}"

    head = ["replicas", "router", "prefix hit rate", "mean TTFT (ms)", "p50 TTFT (ms)", "p99 TTFT (ms)",
            "mean TPOT (ms)"]  # fmt: skip
    if slo:
        head += ["goodput (req/s)", "SLO attainment"]
    head += ["token imbalance", "requests per replica"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        r = _row(s)
        cells = [str(r["replicas"]), f"`{r['router']}`", f"{100 * r['prefix_cache_hit_rate']:.1f}%",
                 ms(r["ttft_mean"]), ms(r["ttft_p50"]), ms(r["ttft_p99"]), ms(r["tpot_mean"])]  # fmt: skip
        if slo:
            cells += [f"{r['goodput']:.2f}", f"{100 * r['slo_attainment']:.1f}%"]
        cells += [f"{r['token_imbalance']:.2f}", r["requests_per_replica"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_cluster(summaries: list[dict[str, Any]], out_dir: Path) -> Path:
    """``cluster.png`` (see the module docstring)."""
    from .plot import _pyplot

    plt = _pyplot()
    rows = [_row(s) for s in summaries]
    routers = list(dict.fromkeys(r["router"] for r in rows))
    counts = sorted({r["replicas"] for r in rows})
    panels = [
        ("prefix_cache_hit_rate", "prefix hit rate", 1.0),
        ("ttft_mean", "mean TTFT (ms)", 1000.0),
        ("ttft_p99", "p99 TTFT (ms)", 1000.0),
        ("token_imbalance", "token imbalance (max / mean)", 1.0),
    ]
    if any(s["fleet"]["slo_ttft"] is not None or s["fleet"]["slo_tpot"] is not None for s in summaries):
        panels.append(("goodput", "goodput (req/s)", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (key, label, scale) in zip(axes[0], panels, strict=True):
        if len(counts) > 1:
            for router in routers:
                pts = sorted((r["replicas"], r[key] * scale) for r in rows if r["router"] == router)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=router)
            ax.set_xlabel("replicas")
            ax.set_xticks(counts)
        else:
            vals = [next(r[key] for r in rows if r["router"] == router) * scale for router in routers]
            ax.bar(range(len(routers)), vals)
            ax.set_xticks(range(len(routers)))
            ax.set_xticklabels(routers, rotation=30, ha="right")
        if key.startswith("ttft"):
            ax.set_yscale("log")  # overloaded and idle fleets differ by orders of magnitude
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if len(counts) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "cluster.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_cluster(
    args: argparse.Namespace, spec_or_trace: Any, step_model: Any, *, warm_step_sizes: Sequence[int] | None = None
) -> int:
    """The fleet sweep of ``kvsched simulate --replicas ...``, on the workload (a ``WorkloadSpec`` or a trace) and
    step-time model that ``kvsched simulate`` built from the same flags."""
    from .._errors import InvalidConfigError, SchedulerError
    from .cluster import ROUTERS, SessionSpec, session_workload, simulate_cluster, summarize_cluster
    from .simulator import make_config
    from .sweep import parse_set
    from .workload import TraceFormatError, WorkloadSpec, generate_workload, parse_length

    try:
        counts = [
            int(c) for c in parse_csv_numbers(args.replicas, "--replicas", integer=True, minimum=1, inclusive=True)
        ]
        routers = [r.strip() for r in args.routers.split(",") if r.strip()]
        if not routers:
            raise UsageError("--routers is empty")
        bad = [r for r in routers if r not in ROUTERS]
        if bad:
            raise UsageError(f"--routers: unknown router(s) {', '.join(bad)}; known: {', '.join(ROUTERS)}")
        if any(c > 128 for c in counts):
            raise UsageError("--replicas: at most 128")
        for flag, value in (("--rates", args.rates), ("--validate", args.validate), ("--calibrate", args.calibrate)):
            if value:
                raise UsageError(f"{flag} does not apply to a fleet (--replicas)")
        if "," in args.policies:
            raise UsageError("--policies: a fleet runs one scheduler policy (set it with --policies P)")
        axes = parse_set(args.set)
        if any(len(v) > 1 for v in axes.values()):
            raise UsageError("--set: a fleet takes one value per field")
        config: dict[str, Any] = {k: v[0] for k, v in axes.items()}
        config["policy"] = args.policies.strip()
        router_config: dict[str, Any] = {}
        for field, values in parse_set(args.router_set).items():
            if len(values) > 1:
                raise UsageError("--router-set: one value per field")
            router_config[field] = values[0]
        if args.sticky_sessions:
            router_config["sticky_sessions"] = True
        if args.conversations and (args.tenants or args.priorities or args.trace is not None):
            raise UsageError("--conversations makes its own requests: no --tenants, --priorities or --trace with it")
        max_model_len = make_config(config).max_model_len
        check_output_dir(args.out, "--out")
        workload: Any
        if args.conversations:
            workload = session_workload(
                SessionSpec(
                    rate=args.rate or 1.0,
                    duration=args.duration,
                    num_sessions=args.num_requests,
                    turns=parse_length(args.turns),
                    user_len=parse_length(args.prompt_len),
                    output_len=parse_length(args.output_len),
                    think_time=args.think_time,
                    num_groups=args.prefix_groups,
                    system_len=args.prefix_len,
                    max_context_len=max_model_len,
                    seed=args.seed,
                )
            )
        elif isinstance(spec_or_trace, WorkloadSpec):
            workload = generate_workload(spec_or_trace, max_model_len=max_model_len)
        else:
            workload = spec_or_trace
    except (UsageError, TraceFormatError, ValueError) as exc:
        return _err(str(exc))
    summaries: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        for n in counts:
            for router in routers:
                res = simulate_cluster(
                    workload,
                    config,
                    step_model,
                    replicas=n,
                    router=router,
                    router_config=router_config,
                    scheduler=args.scheduler,
                    horizon=args.horizon,
                    slo_ttft=args.slo_ttft,
                    slo_tpot=args.slo_tpot,
                    seed=args.seed,
                    warm_step_sizes=warm_step_sizes,
                )
                s = summarize_cluster(res, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
                summaries.append(s)
                if not args.no_progress:
                    print(f"{n} replicas, {router}: {res.wall_s:.1f}s", file=sys.stderr)
    except InvalidConfigError as exc:
        return _err(f"bad config: {exc}")
    except (SchedulerError, ValueError) as exc:
        return _err(str(exc))
    wall = time.perf_counter() - t0
    slo = args.slo_ttft is not None or args.slo_tpot is not None
    print(format_cluster_table(summaries, slo=slo))
    doc = {"argv": sys.argv, "step_model": step_model.to_dict(), "wall_s": wall, "runs": summaries}
    (args.out / "cluster.json").write_text(json.dumps(doc, indent=1, default=float) + "\n")
    with (args.out / "cluster.csv").open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=CLUSTER_COLUMNS)
        wr.writeheader()
        for s in summaries:
            wr.writerow(_row(s))
    with (args.out / "cluster_replicas.csv").open("w", newline="") as f:
        cols = ["replicas", "router", "replica", "num_routed", "computed_tokens", "prefix_cache_hit_rate",
                "ttft_mean", "ttft_p99", "tpot_mean", "num_preemptions"]  # fmt: skip
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        for s in summaries:
            for r in s["replicas"]:
                o = r["overall"]
                wr.writerow({"replicas": s["num_replicas"], "router": s["router"], "replica": r["replica"],
                             "num_routed": r["num_routed"], "computed_tokens": r["computed_tokens"],
                             "prefix_cache_hit_rate": o["prefix_cache_hit_rate"], "ttft_mean": o["ttft"]["mean"],
                             "ttft_p99": o["ttft"]["p99"], "tpot_mean": o["tpot"]["mean"],
                             "num_preemptions": o["num_preemptions"]})  # fmt: skip
    if args.plot:
        from .plot import MatplotlibMissingError

        try:
            png = plot_cluster(summaries, args.out)
        except MatplotlibMissingError as exc:
            return _err(str(exc))
        if not args.no_progress:
            print(f"wrote {png}", file=sys.stderr)
    if not args.no_progress:
        print(f"wrote cluster.json, cluster.csv, cluster_replicas.csv to {args.out} ({wall:.1f}s)", file=sys.stderr)
    return 0
