#!/usr/bin/env bash
# Sourced by run_demo.sh and run_tests.sh: picks the Python to use and installs what is missing.
#
# - A host whose python3 already has a CUDA torch with 2+ GPUs (GPU hosts may have no package
#   registry) reuses it: the project is put on PYTHONPATH, nothing is installed.
# - Otherwise a venv in .venv: torch==2.13.0 first (on the CPU machines that takes the CPU build on
#   disk; a plain 'torch' would pull a multi-GB CUDA build), then the package with its dev extras.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
  PY=$(command -v python3)
  echo "setup: using $PY (torch $($PY -c 'import torch; print(torch.__version__)'), $($PY -c 'import torch; print(torch.cuda.device_count())') GPUs)"
else
  VENV="${FASTVIDEO_VENV:-$ROOT/.venv}"
  PY="$VENV/bin/python"
  if [ ! -x "$PY" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
  fi
  if ! "$PY" -c 'import torch, safetensors, pytest, pytest_timeout, xdist, ruff, clang_format, fastvideo' 2>/dev/null; then
    echo "setup: installing torch==2.13.0 and the project (dev extras) into $VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "torch==2.13.0"
    "$PY" -m pip install -q -e "$ROOT[dev]"
  fi
  echo "setup: using $PY (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
fi
export PY
