"""The ``kvsched`` commands answer a user error with one line on stderr and exit status 2, before doing any work,
and never with a traceback; a bug in kvsched keeps its traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_rust
from kvsched.cli import BENCH_IMPLS, build_parser, main


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``kvsched <argv>``; it must exit 2 with one line on stderr and no traceback. Returns that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (argv, code, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def _must_not_run(monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> None:
    def boom(*args: Any, **kw: Any) -> Any:
        raise AssertionError(f"{name} ran although the command was bad")

    monkeypatch.setattr(target, name, boom)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--impl", "cuda"], "--impl: unknown implementation 'cuda'; choose from rust, reference, vllm, "
         "vllm-adapter"),
        (["bench", "--max-steps", "-1"], "argument --max-steps: must be an integer >= 1, got -1"),
        (["bench", "--max-steps", "x"], "argument --max-steps: must be an integer >= 1, got 'x'"),
        (["bench", "--repeat", "0"], "argument --repeat: must be an integer >= 1, got 0"),
        (["bench", "--scaling", "--scaling-sizes", "0,-5"], "--scaling-sizes: each value must be >= 1, got 0"),
        (["bench", "--scaling", "--scaling-sizes", "64,abc"], "--scaling-sizes: 'abc' is not an integer"),
        (["bench", "--impl", ","], "--impl is empty"),
        (["bench", "-w", "z"], "unknown workload 'z'"),
        (["simulate", "--rates", "4,abc"], "--rates: 'abc' is not a number"),
        (["simulate", "--rates", "4,-1"], "--rates: each value must be > 0, got -1"),
        (["simulate", "--step-model", "/nonexistent.json"], "--step-model: step-time model file /nonexistent.json "
         "does not exist"),
        (["simulate", "--step-model", "nope"], "--step-model: unknown step-time preset 'nope'"),
        (["simulate", "--num-requests", "0"], "argument --num-requests: must be an integer >= 1, got 0"),
        (["simulate", "--validate", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
        (["simulate", "--calibrate", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such "
         "directory"),
        (["simulate", "--validate"], "--validate needs --model DIR"),
    ],
)  # fmt: skip
def test_bad_arguments_get_one_line_and_status_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvsched.bench.harness as harness
    import kvsched.sim.sweep as sweep

    _must_not_run(monkeypatch, harness, "run_workload")
    _must_not_run(monkeypatch, harness, "run_scaling")
    _must_not_run(monkeypatch, sweep, "run_sweep")
    line = _fails([*argv, "--no-progress"] if argv[0] in ("bench", "simulate") else argv, capsys)
    assert line.startswith(f"kvsched {argv[0]}: ") and expected in line, line


def test_bench_help_and_the_unknown_impl_message_name_the_same_implementations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvsched.bench.harness import IMPLS

    assert list(BENCH_IMPLS) == list(IMPLS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in IMPLS:
        assert f"{name} (" in help_text, name


@requires_rust
def test_output_paths_are_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvsched.bench.harness as harness
    import kvsched.sim.sweep as sweep

    _must_not_run(monkeypatch, harness, "run_workload")
    _must_not_run(monkeypatch, sweep, "run_sweep")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    bad = blocker / "sub"  # a directory cannot be made under a file
    line = _fails(["simulate", "--out", str(bad), "--no-progress"], capsys)
    assert f"--out {bad}: cannot create the directory" in line
    line = _fails(["simulate", "--out", str(blocker), "--no-progress"], capsys)
    assert f"--out {blocker}: exists and is not a directory" in line
    for flag in ("--json", "--markdown", "--plot"):
        line = _fails(["bench", "-w", "a", "--quick", flag, str(bad / "x.out"), "--no-progress"], capsys)
        assert line.startswith(f"kvsched bench: {flag} {bad / 'x.out'}: ") and "cannot create" in line
    line = _fails(["bench", "--json", str(tmp_path), "--no-progress"], capsys)
    assert "is a directory, not a file" in line
    if Path("/proc").is_dir():
        assert "cannot create the directory" in _fails(["simulate", "--out", "/proc/forbidden"], capsys)
    # The checks leave nothing behind: a file that did not exist is not created.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def _cell(header: str, row: str, name: str) -> str:
    """The cell of the right-aligned column ``name`` of a table row."""
    end = header.index(name) + len(name)
    return row[:end].split()[-1]


@requires_rust
def test_simulate_table_without_slos_shows_no_slo_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--rate", "30", "--num-requests", "100", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert _cell(out[0], out[1], "goodput") == "-" and _cell(out[0], out[1], "SLO %") == "-"
    assert any("without --slo-ttft / --slo-tpot" in line for line in out)
    assert main([*base, "--slo-ttft", "0.5", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out.splitlines()
    overall = json.loads((tmp_path / "b" / "sim.json").read_text())["runs"][0]["overall"]
    assert _cell(out[0], out[1], "SLO %") == f"{100 * overall['slo_attainment']:.0f}"
    assert _cell(out[0], out[1], "goodput") == f"{overall['goodput']:.2f}"
    assert not any("without --slo-ttft" in line for line in out)


def _raising(exc: BaseException) -> Callable[[Any], int]:
    def run(args: Any) -> int:
        raise exc

    return run


def test_the_entry_point_prints_kvsched_errors_on_one_line_and_lets_bugs_through(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvsched.cli as cli
    from kvsched import InternalError, InvalidConfigError, InvalidRequestError
    from kvsched._cliutil import UsageError
    from kvsched.bench.driver import ImplUnavailableError
    from kvsched.sim import TraceFormatError

    user_errors = [
        InvalidConfigError("num_blocks must be >= 1\n(got 0)"),
        InvalidRequestError("prompt too long"),
        TraceFormatError("t.jsonl:3: not JSON"),
        UsageError("--x: bad"),
        ImplUnavailableError("vLLM is not installed"),
    ]
    for exc in user_errors:
        monkeypatch.setattr(cli, "_run_simulate", _raising(exc))
        line = _fails(["simulate"], capsys)
        assert line == f"kvsched simulate: {'; '.join(str(exc).splitlines())}"
    for bug in (InternalError("invariant"), RuntimeError("boom"), ValueError("numpy said no"), KeyError("k")):
        monkeypatch.setattr(cli, "_run_simulate", _raising(bug))
        with pytest.raises(type(bug)):
            main(["simulate"])


def test_validate_and_calibrate_without_torch_say_so_in_one_line(tmp_path: Path) -> None:
    # A base install: torch cannot be imported (a package that raises ImportError shadows it).
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    env_path = [str(tmp_path / "shim"), *sys.path]
    for flag in ("--validate", "--calibrate"):
        argv = ["simulate", flag, "--model", str(model), "--num-requests", "4", "--out", str(tmp_path / "out")]
        proc = subprocess.run(
            [sys.executable, "-m", "kvsched.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": ":".join(p for p in env_path if p), "PATH": ""},
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (
            f"kvsched simulate: {flag} needs torch, which is not installed here (kvsched's torch extra): "
            "No module named torch"
        ), proc.stderr


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="needs torch (to see that it has no GPU)"
)
def test_a_cuda_device_without_one_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    line = _fails(["simulate", "--validate", "--model", str(model), "--device", "cuda", "--no-progress"], capsys)
    assert "--device cuda: torch sees no CUDA device" in line
    line = _fails(["simulate", "--validate", "--model", str(model), "--device", "tpu9", "--no-progress"], capsys)
    assert line.startswith("kvsched simulate: --device tpu9: ")


def test_default_output_directories_are_git_ignored() -> None:
    import shutil

    from kvsched.cli import DEFAULT_JSON

    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    sim_out = build_parser().parse_args(["simulate"]).out
    for path in (Path(DEFAULT_JSON), sim_out / "sim.json"):
        proc = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=root, timeout=30, check=False)
        assert proc.returncode == 0, f"{path} is not git-ignored"
