"""The hand-written stub of the native module matches what the extension really exports."""

import subprocess
import sys

import pytest


def test_core_stub_matches_the_extension() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvsched._core"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
