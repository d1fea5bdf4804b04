"""``import kvsched`` and ``kvsched.SamplingParams`` never import torch (the generate CLI parser neither), and
nothing but ``kvsched.vllm`` imports vLLM."""

from __future__ import annotations

import subprocess
import sys


def test_import_kvsched_and_sampling_params_do_not_import_torch() -> None:
    code = (
        "import sys, argparse, kvsched\n"
        "p = kvsched.SamplingParams(max_tokens=4, temperature=0.0)\n"
        "from kvsched.cli_generate import add_generate_parser\n"
        "add_generate_parser(argparse.ArgumentParser().add_subparsers())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_import_kvsched_does_not_import_vllm() -> None:
    """kvsched.vllm is the only module that imports vLLM (several GB, optional): plain kvsched stays light."""
    code = "import sys, kvsched, kvsched.cli\nassert 'vllm' not in sys.modules, 'vllm was imported'\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
