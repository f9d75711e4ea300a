#!/usr/bin/env bash
# Sourced by run_demo.sh, run_tests.sh and run_sp_attention_check.sh: picks the Python to use, installs what is
# missing where it may, and says what is missing where it may not.
#
# - FASTVIDEO_PYTHON=/path/to/python: that interpreter as it is (nothing installed).
# - A host whose python3 has a CUDA torch that sees a GPU (GPU hosts may have no package registry, one GPU or
#   several) reuses it as it is: nothing installed, the project put on PYTHONPATH.
# - Otherwise a venv in .venv (or FASTVIDEO_VENV): torch==2.13.0 first (on the CPU machines that takes the CPU
#   build on disk; a plain 'torch' would pull a multi-GB CUDA build), then the package with its dev extras,
#   whenever one of them is missing; FASTVIDEO_NO_INSTALL=1 installs nothing (the venv is then used as it is).
#
# A python used as it is may lack the dev tools: FASTVIDEO_MISSING lists what it lacks (pytest-timeout,
# pytest-xdist, ruff, clang-format, matplotlib, safetensors, ninja), printed here; run_tests.sh skips each step that
# needs one with a note saying so, and the recipe skips its plot with a note. torch itself is required.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# The dev extras and the dependencies, by import name and by package name.
source "$(dirname "${BASH_SOURCE[0]}")/ci.sh"  # _fv_ci: whether this runs under CI
_fv_missing() {
  "$1" - <<'PY' 2>/dev/null || echo "torch"
import importlib.util
names = {"torch": "torch", "safetensors": "safetensors", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
         "xdist": "pytest-xdist", "ruff": "ruff", "clang_format": "clang-format", "matplotlib": "matplotlib",
         "ninja": "ninja"}
print(" ".join(pkg for mod, pkg in names.items() if importlib.util.find_spec(mod) is None))
PY
}

_fv_as_is() {  # use $1 as it is
  PY="$1"
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "setup: $PY has no torch; install torch there, or unset FASTVIDEO_PYTHON to use a venv" >&2
    exit 1
  fi
}

if [ -n "${FASTVIDEO_PYTHON:-}" ]; then
  _fv_as_is "$(command -v "$FASTVIDEO_PYTHON" || echo "$FASTVIDEO_PYTHON")"
elif python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else 1)' 2>/dev/null; then
  _fv_as_is "$(command -v python3)"
else
  VENV="${FASTVIDEO_VENV:-$ROOT/.venv}"
  PY="$VENV/bin/python"
  if [ "${FASTVIDEO_NO_INSTALL:-0}" = 1 ]; then
    [ -x "$PY" ] || { echo "setup: FASTVIDEO_NO_INSTALL=1 but there is no venv at $VENV" >&2; exit 1; }
    _fv_as_is "$PY"
  else
    if [ ! -x "$PY" ]; then
      echo "setup: creating $VENV"
      python3 -m venv "$VENV"
    fi
    if [ -n "$(_fv_missing "$PY")" ]; then
      echo "setup: installing torch==2.13.0 and the project (dev extras) into $VENV"
      # torch is the one thing nothing runs without: where it cannot be installed (no package registry), say how
      # to use a python that has it instead.
      if ! { "$PY" -m pip install -q --upgrade pip && "$PY" -m pip install -q "torch==2.13.0" &&
        "$PY" -m pip install -q -e "$ROOT[dev]"; }; then
        if "$PY" -c 'import torch' 2>/dev/null; then
          echo "setup: NOTE: the install into $VENV failed (no package registry?); going on with what it has"
        else
          echo "setup: could not install torch into $VENV (no package registry?): set FASTVIDEO_PYTHON to a python" \
            "that has torch (its missing tools are then skipped with a note)" >&2
          exit 1
        fi
      fi
    fi
  fi
fi
FASTVIDEO_MISSING="$(_fv_missing "$PY")"
echo "setup: using $PY ($("$PY" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs")'))"
if [ -n "$FASTVIDEO_MISSING" ]; then
  echo "setup: NOTE: $PY lacks: $FASTVIDEO_MISSING (what needs them is skipped with a note; install them to run it)"
fi
export PY FASTVIDEO_MISSING
