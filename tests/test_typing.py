"""The package type-checks under ``mypy --strict`` (the ``[tool.mypy]`` settings in pyproject.toml).

kvsched ships ``py.typed``: users' type checkers read its annotations, so an annotation that lies (an attribute a
mixin reads from a sibling, a wrong return type) is a bug users meet. This runs the same check as the GitHub
workflow, so the local test command catches it too.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_package_passes_strict_mypy() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
