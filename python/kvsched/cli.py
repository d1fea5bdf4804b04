"""The ``kvsched`` command line.

Subcommands:

- ``kvsched bench``: per-step scheduling latency on the standard workloads (see ``docs/benchmarks.md``).
- ``kvsched simulate``: a serving simulator driven by the real scheduler (see ``docs/simulator.md``).
- ``kvsched generate``: generate with :class:`kvsched.LLM` from a local checkpoint (:mod:`kvsched.cli_generate`;
  needs the ``torch`` extra when it runs).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ._cliutil import (
    OneLineArgumentParser,
    UsageError,
    check_output_dir,
    check_output_file,
    int_at_least,
    one_line,
    parse_csv_numbers,
)
from .config import POLICIES

__all__ = ["BENCH_IMPLS", "build_parser", "main"]

DEFAULT_JSON = "bench-results/bench.json"
DEFAULT_PLOT = "bench-results/bench.png"
QUICK_SCALE = 0.05
QUICK_SCALING_SIZES = "16,32,64,128"
# What `kvsched bench --impl` accepts (kvsched.bench.harness.IMPLS; a test keeps the two the same).
BENCH_IMPLS = {
    "rust": "kvsched.Scheduler",
    "reference": "the pure-Python reference scheduler",
    "vllm": "vLLM's own v1 scheduler",
    "vllm-adapter": "kvsched.vllm.Scheduler, kvsched behind vLLM's scheduler interface",
    "vllm-async": "vLLM's AsyncScheduler (asynchronous scheduling)",
    "vllm-adapter-async": "kvsched.vllm.Scheduler with asynchronous scheduling",
}


def _bench_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items as scenario overrides (``LO:HI`` for a range field); ValueError names a bad
    one."""
    from dataclasses import fields

    from .bench.workloads import Scenario
    from .config import SchedulerConfig

    scenario_fields = {f.name for f in fields(Scenario)} - {"name", "description", "config", "scale"}
    config_fields = {f.name for f in fields(SchedulerConfig)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key or not text:
            raise ValueError(f"--set takes FIELD=VALUE, got {item!r}")
        if key not in scenario_fields | config_fields:
            raise ValueError(f"--set: unknown field {key!r} (a workload field or a SchedulerConfig field)")
        if key in ("prompt_len", "output_len", "prefix_len"):
            lo, colon, hi = text.partition(":")
            try:
                out[key] = (int(lo), int(hi if colon else lo))
            except ValueError:
                raise ValueError(f"--set {key} takes N or LO:HI, got {text!r}") from None
            continue
        low = text.lower()
        value: Any = text
        if low in ("true", "false"):
            value = low == "true"
        elif low == "none":
            value = None
        else:
            for conv in (int, float):
                try:
                    value = conv(text)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="per-step scheduling latency on the standard workloads",
        description=(
            "Replay seeded workloads through one or more scheduler implementations and time schedule() "
            "and update_from_output() per step. Workloads: a steady decode, b large batch, c mixed "
            "prefill+decode with chunked prefill and shared prefixes, d = c under memory pressure, "
            "e = d with priorities, f shared prefixes in a tight pool with bursty arrivals (cache-aware "
            "admission window 16), g long contexts (2-8k-token prompts) in a tight pool, for the preemption modes; "
            "h (only when named) 256 running with about 1,000 waiting, for the cost of each policy."
        ),
    )
    p.add_argument(
        "--workloads",
        "-w",
        default=None,
        help="comma-separated subset of a,b,c,d,e,f,g (default: all), or h (policy step cost: 256 running, about "
        "1,000 waiting; run only when named)",
    )
    p.add_argument(
        "--impl",
        default="rust",
        help="comma-separated implementations: "
        + "; ".join(f"{name} ({what})" for name, what in BENCH_IMPLS.items())
        + ". Default rust; the vllm ones need vLLM installed. With several, the same trace runs through "
        "each and the ratios to rust are printed",
    )
    p.add_argument(
        "--scale",
        type=_positive_float,
        default=None,
        help=f"multiply request and block counts by this (default 1.0; --quick uses {QUICK_SCALE})",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"a fast smoke run: --scale {QUICK_SCALE}, --repeat 1, short warm-up"
    )
    p.add_argument("--trace", type=Path, action="append", help="replay this JSONL trace (repeatable)")
    p.add_argument("--dump-trace", type=Path, metavar="DIR", help="write each workload's trace to DIR/<name>.jsonl")
    p.add_argument("--dump-only", action="store_true", help="with --dump-trace: write the traces and stop")
    p.add_argument("--json", type=Path, default=Path(DEFAULT_JSON), help="where to write results (%(default)s)")
    p.add_argument("--no-json", action="store_true", help="do not write the JSON file")
    p.add_argument("--per-step", action="store_true", help="include every step's timings in the JSON")
    p.add_argument("--markdown", type=Path, default=None, metavar="MD", help="also write the tables as Markdown")
    p.add_argument(
        "--plot",
        nargs="?",
        const=Path(DEFAULT_PLOT),
        type=Path,
        default=None,
        metavar="PNG",
        help=f"also write a PNG of latency vs running requests (default {DEFAULT_PLOT}; needs matplotlib)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="run the scaling check (pure decode at 64..2048 running); alone unless --workloads is given",
    )
    p.add_argument("--scaling-sizes", default=None, help="comma-separated running counts for --scaling")
    p.add_argument(
        "--scaling-steps", type=int_at_least(1), default=200, help="timed decode steps per size (%(default)s)"
    )
    p.add_argument(
        "--warmup-steps", type=int_at_least(0), default=None, help="warm-up steps per run (default 50; quick 10)"
    )
    p.add_argument("--max-steps", type=int_at_least(1), default=None, help="stop each run after this many steps")
    p.add_argument(
        "--cold",
        type=_non_negative_float,
        default=0.0,
        metavar="MB",
        help="touch this many MiB of other memory between steps, outside the timed region, as a model runner "
        "does in an engine (evicts the scheduler's state from the CPU caches; default 0: the tight loop)",
    )
    p.add_argument(
        "--repeat",
        type=int_at_least(1),
        default=None,
        help="run each workload this many times and keep the run with the lowest median (default 3; quick 1); "
        "several implementations take turns run by run",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.add_argument("--policy", choices=POLICIES, default=None, help="override the workloads' policy")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a workload field (num_requests, prompt_len=LO:HI, output_len=LO:HI, arrival_rate, ...) or "
        "a scheduler config field (max_num_seqs=256, max_wait_steps=50, ...) in every workload; repeatable, "
        "applied after the other options",
    )
    p.add_argument(
        "--admission-window",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="override cache_aware_admission_window (fcfs only; workload f uses 16, the others 0)",
    )
    p.add_argument(
        "--tenants",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="spread each workload's requests over N tenants",
    )
    p.add_argument(
        "--admission-threshold", type=float, default=None, metavar="X", help="override cache_aware_admission_threshold"
    )
    p.add_argument(
        "--preemption-mode",
        default=None,
        metavar="MODES",
        help="comma-separated preemption modes (recompute, swap, auto): each workload runs once per mode, named "
        "<workload>-<mode>, and a preemption table follows (workload g is the long-context case)",
    )
    p.add_argument(
        "--cpu-blocks",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="CPU swap-pool blocks for swap/auto (default: the workload's, else as many as its GPU pool)",
    )
    p.add_argument("--recompute-cost", type=_non_negative_float, default=None, help="auto: recompute_cost_per_token")
    p.add_argument("--swap-cost", type=_non_negative_float, default=None, help="auto: swap_cost_per_block")
    p.add_argument(
        "--preemption-victim",
        choices=("default", "lcf", "cost"),
        default=None,
        help="override the victim rule (preemption_victim): vLLM's, least computed first, or the cost score",
    )
    p.set_defaults(func=_run_bench)


def _add_simulate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate serving traffic in simulated time with the real scheduler (policies, SLOs, fairness)",
        description=(
            "Requests arrive in simulated time, the real scheduler decides every step, and a linear step-time "
            "model (a preset, or one calibrated with --calibrate) says how long each step takes. Sweeps every "
            "combination of --rates, --policies and --set values; prints a table and writes JSON, CSV and "
            "(with --plot) PNGs to --out. See docs/simulator.md."
        ),
    )
    w = p.add_argument_group("workload")
    w.add_argument("--rate", type=_positive_float, default=None, help="requests per second (default 4)")
    w.add_argument("--rates", default=None, help="comma-separated request rates to sweep (overrides --rate)")
    w.add_argument("--duration", type=_positive_float, default=60.0, help="seconds of arrivals (%(default)s)")
    w.add_argument(
        "--num-requests", type=int_at_least(1), default=None, help="this many requests instead of --duration"
    )
    w.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    w.add_argument("--cv", type=_positive_float, default=1.0, help="gamma arrivals: CV of the gaps (>1: bursty)")
    w.add_argument("--prompt-len", default="1024", help="N, uniform:LO:HI or lognormal:MEAN:CV (%(default)s)")
    w.add_argument("--output-len", default="200", help="same forms as --prompt-len (%(default)s)")
    w.add_argument(
        "--tenants", default=None, help="name:share[:weight[:priority]],... e.g. a:0.8,b:0.1,c:0.1:2 (default one)"
    )
    w.add_argument("--priorities", default=None, help="priority classes value:fraction,... e.g. 0:0.2,1:0.8")
    w.add_argument("--prefix-groups", type=int_at_least(0), default=0, help="number of shared-prefix groups")
    w.add_argument("--prefix-len", type=int_at_least(0), default=0, help="tokens of each group's shared prefix")
    w.add_argument("--prefix-fraction", type=float, default=0.0, help="share of requests in a prefix group")
    w.add_argument(
        "--sessions",
        default=None,
        metavar="N[:TURNS]",
        help="multi-turn conversations: N open at a time, each arrival the next turn of one of them, TURNS turns "
        "each (default 4); a turn's prompt is the previous turn's prompt and output plus a drawn --prompt-len",
    )
    w.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace instead (see docs)")
    w.add_argument("--seed", type=int_at_least(0), default=0)
    w.add_argument("--dump-trace", type=Path, default=None, metavar="JSONL", help="write the generated workload")
    w.add_argument("--dump-only", action="store_true", help="with --dump-trace: write it and stop")
    f = p.add_argument_group("a fleet of replicas behind a router (docs/routing.md)")
    f.add_argument(
        "--replicas",
        default=None,
        metavar="N[,N]",
        help="simulate this many replicas (comma-separated counts to sweep), each the real scheduler, behind a router",
    )
    f.add_argument(
        "--routers",
        "--router",
        dest="routers",
        default="cache_aware",
        help="with --replicas: routing policies to compare: round_robin, least_loaded, cache_aware, kv_overlap, "
        "predictive, random, pow2 (%(default)s)",
    )
    f.add_argument(
        "--sticky-sessions",
        action="store_true",
        help="with --replicas: send every turn of a conversation to one replica",
    )
    f.add_argument(
        "--conversations",
        action="store_true",
        help="with --replicas: multi-turn conversations with think times (--rate conversations/s, --num-requests "
        "conversations, --prompt-len per user message, --output-len per answer, --prefix-groups/--prefix-len system "
        "prompts)",
    )
    f.add_argument(
        "--router-set",
        action="append",
        default=[],
        metavar="FIELD=V",
        help="with --replicas: a RouterConfig field (repeatable), e.g. cache_threshold=0.5, balance_abs_threshold=16",
    )
    f.add_argument("--turns", default="uniform:1:8", help="with --conversations: turns per conversation (%(default)s)")
    f.add_argument(
        "--think-time", type=float, default=10.0, help="with --conversations: mean seconds between turns (%(default)s)"
    )
    s = p.add_argument_group("scheduler and model")
    s.add_argument("--policies", default="fcfs", help="comma-separated policies to compare (%(default)s)")
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=V1[,V2]",
        help="a scheduler config field, one value or several to sweep (repeatable), e.g. num_blocks=2000,4000",
    )
    s.add_argument("--scheduler", choices=("rust", "reference"), default="rust", help="%(default)s")
    s.add_argument(
        "--step-model",
        default=None,
        help="step-time preset name or JSON file (default llama-3.1-8b-h100); --list-presets shows them",
    )
    s.add_argument(
        "--warm-step-sizes",
        default=None,
        metavar="SPEC",
        help="with a step model that has a new-size term (a calibration against vLLM's CPU build): the step sizes "
        "the engine has run before the traffic, so they are not new to it: 'calibration' (the sizes the --step-model "
        "file's calibration ran), a JSON list of sizes, or sizes and LO:HI ranges, e.g. 1:1024 (default: none, a "
        "freshly started engine)",
    )
    s.add_argument("--list-presets", action="store_true", help="print the step-time presets and stop")
    s.add_argument("--horizon", type=_positive_float, default=None, help="stop at this simulated time (s)")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo-ttft", type=_positive_float, default=None, help="TTFT target for goodput and SLO %% (s)")
    m.add_argument(
        "--slo-tpot",
        type=_positive_float,
        default=None,
        help="TPOT target for goodput and SLO %% (s); without either, the table shows '-' for both",
    )
    m.add_argument(
        "--class-ttft-slo",
        default=None,
        metavar="PRIO:S,...",
        help="a TTFT target (s) per priority class: passed to the scheduler as each request's ttft_slo_s (the "
        "deadlines of policy slo), and goodput counts each request of the class against it (others: --slo-ttft)",
    )
    m.add_argument("--window", type=_positive_float, default=None, help="fairness window (s; default run/20)")
    m.add_argument(
        "--prompt-buckets",
        default=None,
        metavar="N1,N2,...",
        help="upper edges (tokens, inclusive) of the prompt-length buckets TTFT is reported by "
        "(default 128,256,512,1024,2048,4096,8192; one more bucket holds the longer prompts)",
    )
    m.add_argument(
        "--out", type=Path, default=Path("sim-results"), help="output directory, created if needed (%(default)s)"
    )
    m.add_argument("--per-request", action="store_true", help="also write one CSV row per request")
    m.add_argument(
        "--jobs",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="run the sweep's points in N worker processes (default: the number of cores; 1: in this process)",
    )
    m.add_argument(
        "--ray",
        action="store_true",
        help="run the sweep's points as Ray tasks (a local Ray cluster, or RAY_ADDRESS's; the ray extra)",
    )
    m.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --ray: join this Ray cluster (e.g. auto, ray://h:10001)",
    )
    m.add_argument("--plot", action="store_true", help="write PNG figures to --out (needs matplotlib)")
    m.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (default: one bar over all the runs on a terminal, a line per run elsewhere)",
    )
    c = p.add_argument_group("calibration (needs the torch extra)")
    c.add_argument("--calibrate", action="store_true", help="fit a step-time model to the real runner and stop")
    c.add_argument("--model", default=None, help="with --calibrate: a Hugging Face model directory")
    c.add_argument("--device", default=None, help="with --calibrate: cpu or cuda (default: cuda if available)")
    c.add_argument("--calibrate-out", type=Path, default=None, help="with --calibrate: the JSON preset to write")
    c.add_argument("--calibrate-quick", action="store_true", help="with --calibrate: fewer, smaller timed steps")
    c.add_argument(
        "--validate",
        action="store_true",
        help="run the workload through kvsched.LLM on --model and through the simulator (--step-model; "
        "'--step-model calibrate' calibrates on the same engine first); compare batches and TTFT/e2e "
        "percentiles, write --out/validate.json",
    )
    c.add_argument(
        "--engine",
        choices=("kvsched", "vllm"),
        default="kvsched",
        help="with --calibrate/--validate: the engine timed and replayed: kvsched.LLM, or a vLLM engine (vLLM's "
        "LLMEngine on --model, its scheduler timed by a subclass; --set max_num_seqs, max_num_batched_tokens, "
        "max_model_len, num_blocks pass to it)",
    )
    c.add_argument(
        "--vllm-scheduler",
        default="vllm,kvsched",
        metavar="S",
        help="with --engine vllm: vllm (its own), kvsched (kvsched.vllm.Scheduler) or both, comma-separated "
        "(--validate runs each; --calibrate the first) (%(default)s)",
    )
    c.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None,
        help="with --calibrate/--validate: time steps by wall clock or by this thread's CPU time (immune to other "
        "processes; default cpu on the CPU, wall on CUDA)",
    )
    p.set_defaults(func=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    from kvsched.sim.cli import run_simulate

    return run_simulate(args)


def _add_optional_subcommands(subparsers: Any) -> None:
    # ---- `kvsched generate` (kvsched.cli_generate) ----------------------------------------------------------
    # Its module imports torch only when the command runs: the scheduler never needs it.
    from kvsched.cli_generate import add_generate_parser

    add_generate_parser(subparsers)
    # ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="kvsched", description="kvsched: a microsecond LLM scheduler core")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_bench_parser(subparsers)
    _add_simulate_parser(subparsers)
    _add_optional_subcommands(subparsers)
    return parser


def _run_bench(args: argparse.Namespace) -> int:
    # BLAS thread pools only add noise on a small machine (the harness does no linear algebra); this takes
    # effect only if numpy has not been imported yet.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    # The scheduler's rate-limited "requests preempted" warning is expected here (workloads d and e).
    logging.getLogger("kvsched").setLevel(logging.ERROR)
    # Imported here so that `kvsched --help` stays instant.
    from kvsched.bench.harness import (
        ImplUnavailableError,
        RunResult,
        ScalingPoint,
        best_of,
        make_driver,
        run_scaling,
        run_workload,
    )
    from kvsched.bench.progress import Progress
    from kvsched.bench.report import (
        build_document,
        format_markdown,
        format_preemption,
        format_ratios,
        format_scaling,
        format_table,
        format_target_legend,
        write_json,
    )
    from kvsched.bench.trace import TraceFormatError, dump_trace, load_trace
    from kvsched.bench.workloads import SCENARIOS, Workload, generate, get_scenario
    from kvsched.config import SchedulerConfig

    err = sys.stderr
    scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    warmup = args.warmup_steps if args.warmup_steps is not None else (10 if args.quick else 50)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    impls = _csv(args.impl)
    if not impls:
        print("kvsched bench: --impl is empty", file=err)
        return 2
    for impl in impls:
        if impl not in BENCH_IMPLS:
            print(f"kvsched bench: --impl: unknown implementation {impl!r}; choose from {', '.join(BENCH_IMPLS)}",
                  file=err)  # fmt: skip
            return 2
    sizes: list[int] = []
    try:
        if args.scaling:
            sizes_text = args.scaling_sizes or (QUICK_SCALING_SIZES if args.quick else "64,128,256,512,1024,2048")
            sizes = [int(n) for n in parse_csv_numbers(sizes_text, "--scaling-sizes", integer=True, minimum=1,
                                                       inclusive=True)]  # fmt: skip
    except UsageError as exc:
        print(f"kvsched bench: {exc}", file=err)
        return 2
    progress = Progress(enabled=not args.no_progress)

    workloads: list[Workload] = []
    try:
        if args.trace:
            workloads = [load_trace(path) for path in args.trace]
        elif args.workloads is not None or not args.scaling:
            names = _csv(args.workloads) if args.workloads is not None else list(SCENARIOS)
            overrides: dict[str, Any] = {}
            if args.policy is not None:
                overrides["policy"] = args.policy
                overrides["cache_aware_admission_window"] = 0  # a window needs fcfs (set it again below)
            if args.admission_window is not None:
                overrides["cache_aware_admission_window"] = args.admission_window
            if args.tenants is not None:
                overrides["num_tenants"] = args.tenants
            if args.admission_threshold is not None:
                overrides["cache_aware_admission_threshold"] = args.admission_threshold
            if args.recompute_cost is not None:
                overrides["recompute_cost_per_token"] = args.recompute_cost
            if args.swap_cost is not None:
                overrides["swap_cost_per_block"] = args.swap_cost
            if args.preemption_victim is not None:
                overrides["preemption_victim"] = args.preemption_victim
            overrides.update(_bench_sets(args.set))
            scenarios = [replace(get_scenario(n), **overrides) for n in names]
            if args.preemption_mode is not None:
                scenarios = [
                    _with_mode(sc, mode, args.cpu_blocks) for sc in scenarios for mode in _csv(args.preemption_mode)
                ]
            scenarios = [sc.scaled(scale) for sc in scenarios]
            for sc in scenarios:
                sc.scheduler_config()  # a bad combination fails here, before anything runs
            workloads = [generate(sc) for sc in scenarios]
    except (ValueError, OSError, TraceFormatError) as exc:  # InvalidConfigError is a ValueError
        print(f"kvsched bench: {exc}", file=err)
        return 2
    try:
        # Every output path is checked before anything runs (a run can take minutes).
        if args.dump_trace is not None:
            check_output_dir(args.dump_trace, "--dump-trace")
        if not (args.dump_trace is not None and args.dump_only):
            if not args.no_json:
                check_output_file(args.json, "--json")
            if args.markdown is not None:
                check_output_file(args.markdown, "--markdown")
            if args.plot is not None:
                check_output_file(args.plot, "--plot")
    except UsageError as exc:
        print(f"kvsched bench: {exc}", file=err)
        return 2

    if args.dump_trace is not None:
        for w in workloads:
            path = dump_trace(w, args.dump_trace / f"{w.name}.jsonl")
            progress.message(f"wrote {path} ({len(w.requests)} requests)")
        if args.dump_only:
            return 0

    results: list[RunResult] = []
    scaling: list[ScalingPoint] = []
    try:
        # vLLM's schedulers run in this process: import vLLM and build one of its schedulers before timing anything,
        # so that every run, the first workload's kvsched run included, is timed in the same process ("in one
        # process with vLLM imported"), and a missing vLLM stops the command before anything runs.
        for impl in impls:
            if impl.startswith("vllm"):
                make_driver(impl, SchedulerConfig(num_blocks=1024))
        for w in workloads:
            # The implementations take turns, run by run (A B A B ...), so that a drift of the machine's speed
            # over the minutes of a workload reaches all of them alike, and the ratios between them with it.
            runs: dict[str, list[RunResult]] = {impl: [] for impl in impls}
            for _ in range(repeat):
                for impl in impls:
                    runs[impl].append(
                        run_workload(
                            impl, w, warmup_steps=warmup, max_steps=args.max_steps, progress=progress, cold_mb=args.cold
                        )
                    )
            results.extend(best_of(runs[impl]) for impl in impls)
        if args.scaling:
            steps = min(args.scaling_steps, 50) if args.quick else args.scaling_steps
            for impl in impls:
                scaling.extend(run_scaling(impl, sizes, num_steps=steps, progress=progress))
    except ImplUnavailableError as exc:
        print(f"kvsched bench: {exc}", file=err)
        return 2

    doc = build_document(results, scaling=scaling, per_step=args.per_step, argv=sys.argv)
    if results:
        print(format_table(doc["results"]))
        for line in format_target_legend(doc["results"]):
            print(line)
        text = format_ratios(doc["ratios"])
        if text:
            print()
            print(text)
        if args.preemption_mode is not None:
            print()
            print(format_preemption(doc["results"]))
    if doc["scaling"]:
        print()
        print(format_scaling(doc["scaling"]))
    if not args.no_json:
        path = write_json(doc, args.json)
        progress.message(f"wrote {path}")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(format_markdown(doc), encoding="utf-8")
        progress.message(f"wrote {args.markdown}")
    if args.plot is not None:
        from kvsched.bench.plot import MatplotlibMissingError, plot_results

        try:
            png = plot_results(results, args.plot, scaling=scaling)
        except MatplotlibMissingError as exc:
            print(f"kvsched bench: {exc}", file=err)
            return 2
        progress.message(f"wrote {png}")
    return 0


def _with_mode(scenario: Any, mode: str, cpu_blocks: int | None) -> Any:
    """``scenario`` under preemption mode ``mode``, renamed ``<name>-<mode>``; swap and auto get a CPU pool
    (``cpu_blocks``, else the scenario's own, else as many blocks as its GPU pool)."""
    num_cpu = scenario.num_cpu_blocks if cpu_blocks is None else cpu_blocks
    if mode != "recompute" and num_cpu == 0:
        num_cpu = scenario.num_blocks
    return replace(scenario, name=f"{scenario.name}-{mode}", preemption_mode=mode, num_cpu_blocks=num_cpu)


def _is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a mistake in what the user asked for (printed on one line, exit status 2) rather than a
    bug in kvsched (which keeps its traceback): kvsched's typed errors other than ``InternalError``, a bad trace
    or workload option, a bad argument, an implementation that is not installed."""
    from ._errors import InternalError, SchedulerError
    from ._jsonl import TraceFormatError

    if isinstance(exc, (UsageError, TraceFormatError)):
        return True
    if isinstance(exc, SchedulerError):
        return not isinstance(exc, InternalError)
    if type(exc).__name__ == "ImplUnavailableError":
        from kvsched.bench.driver import ImplUnavailableError

        return isinstance(exc, ImplUnavailableError)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        result = func(args)
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        print(f"kvsched {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return int(result) if result is not None else 0


if __name__ == "__main__":
    sys.exit(main())
