"""The figures of docs/policies.md, one per study, from the CSV files a `kvsched simulate` sweep writes.

    python scripts/policy_plots.py victim docs/sim/policies/victim docs/img/policies_victim.png

STUDY is one of victim, sjf, slo, fair, session; DIR the sweep's --out directory (its summary.csv, and
prompt_buckets.csv, priorities.csv or tenants.csv as the study needs); PNG the figure to write. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, str]


def _read(path: Path) -> list[Row]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _overrides(row: Row) -> dict[str, str]:
    return dict(item.split("=", 1) for item in row["overrides"].split(";") if item)


def _num(text: str) -> float:
    return float(text) if text not in ("", "None") else math.nan


def victim(d: Path, ax: Any) -> None:
    """Recompute tax and recomputed tokens per preemption, per KV pool size and victim rule."""
    rows = _read(d / "summary.csv")
    pools = sorted({int(_overrides(r)["num_blocks"]) for r in rows}, reverse=True)
    rules = list(dict.fromkeys(_overrides(r)["preemption_victim"] for r in rows))
    get = {(int(_overrides(r)["num_blocks"]), _overrides(r)["preemption_victim"]): r for r in rows}
    width = 0.8 / len(rules)
    for k, (key, label, scale) in enumerate(
        (("recompute_tax", "recompute tax (%)", 100.0), ("recomputed_tokens_per_preemption", "tokens / preemption", 1))
    ):
        for j, rule in enumerate(rules):
            xs = [i + (j - (len(rules) - 1) / 2) * width for i in range(len(pools))]
            ax[k].bar(xs, [scale * _num(get[(p, rule)][key]) for p in pools], width, label=rule)
        ax[k].set_xticks(range(len(pools)), [f"{p} blocks" for p in pools])
        ax[k].set_ylabel(label)
    ax[0].legend(title="preemption_victim", loc="lower right", fontsize=8)


def sjf(d: Path, ax: Any) -> None:
    """TTFT p99 per prompt-length bucket at the middle rate, and the longest TTFT against rate."""
    rows = _read(d / "summary.csv")
    runs = {r["run_id"]: r for r in rows}
    rates = sorted({_num(r["rate"]) for r in rows})
    mid = rates[len(rates) // 2]
    buckets: dict[str, list[Row]] = defaultdict(list)
    for b in _read(d / "prompt_buckets.csv"):
        buckets[b["run_id"]].append(b)

    def label(r: Row) -> str:
        aging = _overrides(r).get("max_wait_steps", "None")
        return r["policy"] + ("" if aging == "None" else f", max_wait_steps={aging}")

    seen = set()
    for r in rows:
        name = label(r)
        if r["policy"] == "fcfs" and name != "fcfs":
            continue  # aging does not change FCFS's order
        if _num(r["rate"]) == mid:
            bs = [b for b in buckets[r["run_id"]] if int(b["num_requests"])]
            ax[0].plot([b["bucket"] for b in bs], [_num(b["ttft_p99"]) for b in bs], marker="o", label=name)
        if name not in seen:
            seen.add(name)
            same = [x for x in rows if label(x) == name]
            ax[1].plot([_num(x["rate"]) for x in same], [_num(x["ttft_max"]) for x in same], marker="o", label=name)
    assert runs
    ax[0].set_yscale("log")
    ax[0].set_xlabel("prompt tokens")
    ax[0].set_ylabel(f"TTFT p99 at {mid:g} req/s (s)")
    ax[0].tick_params(axis="x", rotation=30)
    ax[1].set_yscale("log")
    ax[1].set_xlabel("rate (req/s)")
    ax[1].set_ylabel("longest TTFT (s)")
    ax[1].legend()


def slo(d: Path, ax: Any) -> None:
    """Goodput against rate per policy, and each class's SLO attainment."""
    rows = _read(d / "summary.csv")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        same = [r for r in rows if r["policy"] == policy]
        ax[0].plot([_num(r["rate"]) for r in same], [_num(r["goodput"]) for r in same], marker="o", label=policy)
    prios = _read(d / "priorities.csv")
    rate_of = {r["run_id"]: (_num(r["rate"]), r["policy"]) for r in rows}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        for prio, style in (("0", "-"), ("1", "--")):
            pts = sorted(
                (rate_of[p["run_id"]][0], 100 * _num(p["slo_attainment"]))
                for p in prios
                if rate_of[p["run_id"]][1] == policy and p["priority"] == prio
            )
            ax[1].plot(*zip(*pts, strict=True), style, marker="o", label=f"{policy}, class {prio}")
    ax[0].set_xlabel("rate (req/s)")
    ax[0].set_ylabel("goodput (req/s)")
    ax[0].legend()
    ax[1].set_xlabel("rate (req/s)")
    ax[1].set_ylabel("within SLO (%)")
    ax[1].legend(fontsize=7)


def fair(d: Path, ax: Any) -> None:
    """Jain's index against rate, and each tenant's TTFT p50 against rate, per policy."""
    rows = _read(d / "summary.csv")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for policy in policies:
        same = [r for r in rows if r["policy"] == policy and r["jain_mean"]]
        ax[0].plot([_num(r["rate"]) for r in same], [_num(r["jain_mean"]) for r in same], marker="o", label=policy)
    rate_of = {r["run_id"]: (_num(r["rate"]), r["policy"]) for r in rows}
    tenants = _read(d / "tenants.csv")
    for policy, style in zip(policies, ("-", "--", ":"), strict=False):
        for name in dict.fromkeys(t["tenant"] for t in tenants):
            pts = sorted(
                (rate_of[t["run_id"]][0], _num(t["ttft_p50"]))
                for t in tenants
                if rate_of[t["run_id"]][1] == policy and t["tenant"] == name
            )
            ax[1].plot(*zip(*pts, strict=True), style, marker="o", label=f"{policy}, {name}")
    ax[0].set_xlabel("rate (req/s)")
    ax[0].set_ylabel("Jain's index (backlogged tenants)")
    ax[0].legend()
    ax[1].set_yscale("log")
    ax[1].set_xlabel("rate (req/s)")
    ax[1].set_ylabel("TTFT p50 (s)")
    ax[1].legend(fontsize=7)


def session(d: Path, ax: Any) -> None:
    """Prefix-cache hit rate and TTFT p50 per configuration, at each rate."""
    rows = _read(d / "summary.csv")

    def label(r: Row) -> str:
        o = _overrides(r)
        if o.get("cache_aware_admission_window", "0") == "0":
            return "fcfs"
        if _num(o.get("cache_aware_admission_threshold", "0.5")) >= 1.0:
            return f"session affinity (window {o['cache_aware_admission_window']})"
        return f"window {o['cache_aware_admission_window']} + session affinity"

    configs = list(dict.fromkeys(label(r) for r in rows))
    rates = sorted({_num(r["rate"]) for r in rows})
    width = 0.8 / len(configs)
    for k, (key, ylabel, scale) in enumerate(
        (("prefix_cache_hit_rate", "prefix-cache hit rate (%)", 100.0), ("ttft_p50", "TTFT p50 (s)", 1.0))
    ):
        for j, cfg in enumerate(configs):
            vals = {_num(r["rate"]): scale * _num(r[key]) for r in rows if label(r) == cfg}
            xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(rates))]
            ax[k].bar(xs, [vals[x] for x in rates], width, label=cfg)
        ax[k].set_xticks(range(len(rates)), [f"{x:g} req/s" for x in rates])
        ax[k].set_ylabel(ylabel)
    ax[0].legend(fontsize=7)


STUDIES: dict[str, Callable[[Path, Any], None]] = {
    "victim": victim,
    "sjf": sjf,
    "slo": slo,
    "fair": fair,
    "session": session,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=sorted(STUDIES))
    p.add_argument("dir", type=Path, help="the sweep's --out directory")
    p.add_argument("png", type=Path, help="the figure to write")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    STUDIES[args.study](args.dir, ax)
    fig.suptitle((STUDIES[args.study].__doc__ or "").strip().rstrip("."), fontsize=10)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
