#!/usr/bin/env bash
# The test command (README, .ci/run): set-up, ruff, clang-format, the kernel build, then one pytest
# session over the whole suite. Each test runs once; a test marked `ambient` (code under test reads
# FASTVIDEO_ULYSSES_A2A or _LONG_TRAINING without the test setting it) runs once per value of each
# variable it names, and every other test sees both pinned to their defaults (tests/conftest.py). Exit
# code 5 (no tests collected) is a failure. On a python used as it is (scripts/setup_env.sh: a GPU host's)
# a step whose tool is not installed is skipped with a note, and the last line names what did not run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
phase() { echo "== $*  [${SECONDS}s]"; }
skipped=()
lacks() { [[ " ${FASTVIDEO_MISSING:-} " == *" $1 "* ]]; }
if lacks ruff; then
  phase "ruff: SKIPPED, not installed on $PY (pip install ruff)"; skipped+=(ruff)
else
  phase "ruff"
  "$PY" -m ruff check .
fi
clang_format="$(dirname "$PY")/clang-format"
if [[ ! -x $clang_format ]]; then
  phase "clang-format (csrc/): SKIPPED, not installed beside $PY (pip install clang-format)"; skipped+=(clang-format)
else
  phase "clang-format (csrc/)"
  "$clang_format" --dry-run --Werror csrc/ulysses_a2a/*.cu csrc/ulysses_a2a/*.cuh csrc/ulysses_a2a/*.cpp \
    csrc/ulysses_a2a/*.h csrc/ulysses_a2a/testing/*.cu csrc/ulysses_a2a/testing/*.cuh csrc/ulysses_a2a/testing/*.cpp \
    csrc/ulysses_a2a/testing/*.h csrc/ulysses_hot/*.cpp
fi
if lacks pytest; then
  echo "pytest is not installed on $PY: the test suite cannot run (pip install pytest)" >&2
  exit 1
fi
run_pytest() {
  local rc=0
  "$PY" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
  if [ "$rc" -ne 0 ]; then exit "$rc"; fi
}
if [[ "${FASTVIDEO_SKIP_KERNEL_BUILD:-0}" == 1 ]]; then
  phase "kernel build: SKIPPED (FASTVIDEO_SKIP_KERNEL_BUILD=1; tests that need build/kernel skip, saying so)"
  skipped+=("kernel build")
elif command -v nvcc >/dev/null 2>&1; then
  # Both kernel libraries (product and test) must compile against both pinned NCCL releases (the GPU hosts'
  # and a newer one); the 2.28.9 builds stay in build/kernel for the host-side tests in tests/kernel (the
  # property checks run on the test library, the ABI and vote tests on the product one).
  phase "kernel build against NCCL 2.30.7 and 2.28.9"
  PYTHON="$PY" bash scripts/build_kernel.sh 2.30.7 build/kernel-2.30.7
  PYTHON="$PY" bash scripts/build_kernel.sh 2.28.9 build/kernel
else
  phase "nvcc not found: skipping the kernel build (CI machines have it)"
fi
# The hot-path extension (csrc/ulysses_hot/) against this torch, beside the 2.28.9 build the tests load.
if [[ "${FASTVIDEO_SKIP_KERNEL_BUILD:-0}" == 1 ]]; then
  :
elif lacks ninja; then
  phase "hot-path extension: SKIPPED, ninja is not installed on $PY (pip install ninja)"; skipped+=("hot-path extension")
else
  phase "hot-path extension (torch's extension builder)"
  # A CUDA torch without CUDA's toolkit cannot build it: its tests then skip, saying why (and fail under CI).
  if ! "$PY" fastvideo-kernel/build_hot.py --out build/kernel; then
    phase "hot-path extension: the build FAILED (above)"; skipped+=("hot-path extension")
  fi
fi
# Two workers (pytest-xdist) on a machine without GPUs: most of the suite waits on process start-up,
# gloo rendezvous and deliberate vote timeouts, so two at a time roughly halve the wall time even on
# 2 cores. Serial where GPUs are present (GPU tests each take every GPU) or xdist is missing.
workers=()
if "$PY" -c 'import sys, torch, xdist; sys.exit(1 if torch.cuda.is_available() else 0)' 2>/dev/null; then
  workers=(-n "${FASTVIDEO_PYTEST_WORKERS:-2}")  # more on a bigger host (scripts/gpu_cpu_suite.sh)
elif lacks pytest-xdist; then
  skipped+=("parallel pytest workers (pytest-xdist)")
fi
timeout=(--timeout=300)
if lacks pytest-timeout; then
  timeout=(); skipped+=("per-test timeouts (pytest-timeout)")
fi
phase "pytest ${workers[*]} (ambient-marked tests under every value of the variables they read)"
# FASTVIDEO_PYTEST_ARGS: what to collect instead of the whole suite (tests of this script use it).
read -r -a targets <<<"${FASTVIDEO_PYTEST_ARGS:-tests}"
run_pytest -q "${timeout[@]}" --ulysses-ambient=all --progress-every=30 "${workers[@]}" "${targets[@]}"
if (( ${#skipped[@]} )); then
  printf -v list '%s, ' "${skipped[@]}"
  phase "done; NOT RUN here: ${list%, }"
else
  phase "done"
fi
