"""``kvsched simulate``: the command behind the parser in :mod:`kvsched.cli`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["run_simulate"]


def _err(msg: str) -> int:
    print(f"kvsched simulate: {msg}", file=sys.stderr)
    return 2


def _floats(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value = float(part)
        if not value > 0:
            raise ValueError(f"rates must be > 0, got {part}")
        out.append(value)
    if not out:
        raise ValueError("empty --rates")
    return out


def run_simulate(args: argparse.Namespace) -> int:
    from .._errors import SchedulerError
    from .steptime import DEFAULT_PRESET, PRESETS, load_step_time_model
    from .workload import (
        TraceFormatError,
        Workload,
        WorkloadSpec,
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
    if args.calibrate:
        return _calibrate(args)

    try:
        calibrate_first = args.validate and args.step_model == "calibrate"
        step_model = load_step_time_model(DEFAULT_PRESET if calibrate_first else (args.step_model or DEFAULT_PRESET))
    except ValueError as exc:
        return _err(str(exc))
    try:
        rates: list[float | None] = list(_floats(args.rates)) if args.rates else [args.rate]
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
                seed=args.seed,
            )
            if rates == [None]:
                rates = [spec_or_trace.rate]
        from .sweep import parse_set, run_sweep, scale_trace

        axes = parse_set(args.set)
    except (TraceFormatError, ValueError) as exc:
        return _err(str(exc))

    if args.dump_trace is not None:
        for rate in rates:
            if isinstance(spec_or_trace, WorkloadSpec):
                import dataclasses

                w = generate_workload(spec_or_trace if rate is None else dataclasses.replace(spec_or_trace, rate=rate))
            else:
                w = spec_or_trace if rate is None else scale_trace(spec_or_trace, rate)
            path = args.dump_trace
            if len(rates) > 1:
                path = path.with_name(f"{path.stem}_rate{rate:g}{path.suffix}")
            dump_trace(w, path)
            print(f"wrote {path} ({len(w)} requests)", file=sys.stderr)
        if args.dump_only:
            return 0

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        return _err("--policies is empty")
    if args.validate:
        return _validate(args, spec_or_trace, rates[0], policies[0], axes, step_model)
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
            progress=progress,
        )
    except SchedulerError as exc:
        return _err(f"bad scheduler config: {exc}")
    except (ValueError, TypeError) as exc:
        return _err(str(exc))
    wall = time.perf_counter() - t0

    from .report import format_table, write_outputs

    print(format_table(runs))
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
) -> int:
    import dataclasses
    import json

    from .report import _json_safe
    from .sweep import scale_trace
    from .workload import WorkloadSpec, generate_workload

    if not args.model:
        return _err("--validate needs --model DIR")
    if any(len(v) != 1 for v in axes.values()):
        return _err("--validate takes one value per --set field")
    if isinstance(spec_or_trace, WorkloadSpec):
        w = generate_workload(spec_or_trace if rate is None else dataclasses.replace(spec_or_trace, rate=rate))
    else:
        w = spec_or_trace if rate is None else scale_trace(spec_or_trace, rate)
    config = {k: v[0] for k, v in axes.items()} | {"policy": policy}
    try:
        from .validate import validate
    except ImportError as exc:
        return _err(f"--validate needs the torch extra (pip install 'kvsched[torch]'): {exc}")
    model = None if args.step_model == "calibrate" else step_model
    report = validate(args.model, w, config, model, device=args.device or "cpu", clock=args.clock)
    print(f"{report['num_requests']} requests, {report['real_steps']} real steps, {report['sim_steps']} simulated")
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
    doc = {"argv": sys.argv, "config": config, **report}
    path.write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if not args.model:
        return _err("--calibrate needs --model DIR (a Hugging Face model directory)")
    try:
        from .calibrate import calibrate
    except ImportError as exc:
        return _err(f"--calibrate needs the torch extra (pip install 'kvsched[torch]'): {exc}")
    out = args.calibrate_out
    try:
        model, fit = calibrate(
            args.model, device=args.device, quick=args.calibrate_quick, progress=not args.no_progress, clock=args.clock
        )
    except ImportError as exc:
        return _err(f"--calibrate needs the torch extra (pip install 'kvsched[torch]'): {exc}")
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    path = model.save(out or f"{model.name}.json", extra=fit)
    print(", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items() if k.endswith("_s")))
    print(
        f"fit: {fit['num_steps']} timed steps, R^2 {fit['r2']:.3f}, "
        f"median abs error {100 * fit['median_rel_error']:.1f}%"
    )
    print(f"wrote {path}; use it with: kvsched simulate --step-model {path}")
    return 0
