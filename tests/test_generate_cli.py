"""``kvsched generate`` and ``python -m kvsched.bench.engine_throughput --tiny`` run end to end on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: intra-op threads only add overhead on small CI machines
transformers = pytest.importorskip("transformers")

from kvsched.cli_generate import add_generate_parser  # noqa: E402
from kvsched.runner.testing import save_tiny_hf_model  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def test_generate_command_prints_greedy_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = save_tiny_hf_model(tmp_path, "llama")
    args = _parse(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--prompt-ids",
            "5,6,7,8",
            "--prompt-ids",
            "9, 10",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--device",
            "cpu",
            "--json",
            "--num-blocks",
            "32",
        ]
    )
    assert args.func(args) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == [[5, 6, 7, 8], [9, 10]]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
    assert records[0]["output_token_ids"] == expected


def test_generate_command_without_prompts_fails(tmp_path: Path) -> None:
    args = _parse(["generate", "--model", str(tmp_path)])
    assert args.func(args) == 2


def test_throughput_tiny_runs_and_reports_shares(tmp_path: Path) -> None:
    from kvsched.bench.engine_throughput import main

    out = tmp_path / "tp.json"
    assert main(["--tiny", "--batch-sizes", "1,4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert r["num_output_tokens"] == r["batch_size"] * r["output_len"]
        assert r["output_tokens_per_s"] > 0
        assert abs(sum(r["phase_share"].values()) - 1.0) < 1e-6


def test_preemption_e2e_tiny_runs_each_mode_and_swaps(tmp_path: Path) -> None:
    from kvsched.bench.preemption_e2e import main

    out = tmp_path / "pe.json"
    argv = ["--tiny", "--modes", "recompute,swap", "--num-requests", "6", "--output-len", "16", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    rec, swap = report["results"]
    assert (rec["mode"], swap["mode"]) == ("recompute", "swap")
    assert rec["num_output_tokens"] == swap["num_output_tokens"] == 6 * 16
    assert rec["num_preemptions"] > 0 and rec["num_swapped_out_blocks"] == 0
    assert swap["num_swapped_out_blocks"] > 0 and swap["num_recomputed_tokens"] <= rec["num_recomputed_tokens"]


def test_throughput_module_is_runnable() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.bench.engine_throughput", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--tiny" in proc.stdout
