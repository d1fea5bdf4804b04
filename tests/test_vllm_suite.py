"""vLLM 0.33's own ``tests/v1/core/test_scheduler.py`` against kvsched.vllm.Scheduler (``tests/vllm_suite/``).

Runs the harness's kvsched run in a subprocess and fails when a test function listed as passing in
``tests/vllm_suite/STATUS.md`` no longer passes, or when a function fails for a reason the harness cannot explain
(see ``tests/vllm_suite/README.md``). Needs vLLM 0.33 in this interpreter and vLLM's sdist (``$KVSCHED_VLLM_SDIST``,
or ``vllm-sdist/vllm-0.33.0.tar.gz`` in the temporary directory; ``KVSCHED_VLLM_SUITE_DOWNLOAD=1`` lets it download
the sdist from PyPI); skipped otherwise. A few minutes: marked ``vllm`` and ``slow``, so the default
suite never runs it; run it with ``pytest -m vllm tests/test_vllm_suite.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SUITE = Path(__file__).resolve().parent / "vllm_suite"


def _harness() -> object:
    spec = importlib.util.spec_from_file_location("kvsched_vllm_suite_run", SUITE / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_vllm_scheduler_suite_against_kvsched(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:  # find_spec: importing vLLM here would cost the suite seconds
        pytest.skip("vLLM is optional: pip install '.[vllm]'")
    run = _harness()
    download = os.environ.get("KVSCHED_VLLM_SUITE_DOWNLOAD") == "1"
    try:
        run.find_sdist(None, tmp_path, allow_download=download)  # type: ignore[attr-defined]
    except SystemExit as e:
        pytest.skip(f"vLLM 0.33.0's sdist is not available: {e}")
    status = run.main(  # type: ignore[attr-defined]
        ["--python", sys.executable, "--impl", "kvsched", "--workdir", str(tmp_path), "--no-write"]
        + ([] if download else ["--no-download"])
    )
    assert status == 0, "see the harness output above"
