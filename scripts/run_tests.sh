#!/usr/bin/env bash
# The test command (README, .ci/run): set-up, ruff, clang-format, the kernel build, then pytest over the whole
# suite (one session; two on a host with GPUs, below). Each test runs once; a test marked `ambient` (code under
# test reads FASTVIDEO_ULYSSES_A2A or _LONG_TRAINING without the test setting it) runs once per value of each
# variable it names, and every other test sees both pinned to their defaults (tests/conftest.py). Exit code 5
# (no tests collected) is a failure (see the two sessions below). On a python used as it is (scripts/setup_env.sh:
# a GPU host's) a step whose tool is not installed, or whose NCCL release cannot be downloaded, is skipped with a
# note, and the last line names what did not run; under CI=true either is a failure (CI installs and downloads
# them). On a host with GPUs and pytest-xdist the GPU tests run first, in a serial session of their own (below).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
phase() { echo "== $*  [${SECONDS}s]"; }
skipped=()
lacks() { [[ " ${FASTVIDEO_MISSING:-} " == *" $1 "* ]]; }
# CI installs every tool the steps below need (the dev extras): there a missing one is a failure, never a skip.
if _fv_ci && [[ -n "${FASTVIDEO_MISSING:-}" ]]; then
  echo "CI=true but $PY lacks: $FASTVIDEO_MISSING (CI installs them: pip install -e '.[dev]'); failing instead of" \
    "skipping what needs them" >&2
  exit 1
fi
if lacks ruff; then
  phase "ruff: SKIPPED, not installed on $PY (pip install ruff)"; skipped+=(ruff)
else
  phase "ruff"
  "$PY" -m ruff check .
fi
clang_format="$(dirname "$PY")/clang-format"
if [[ ! -x $clang_format ]]; then
  if _fv_ci; then
    echo "CI=$CI but no clang-format beside $PY (pip install clang-format): failing instead of skipping" >&2
    exit 1
  fi
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
  # property checks run on the test library, the ABI and vote tests on the product one). A release whose headers
  # cannot be had here (no package registry, no carried wheel in .whl/, another installed version) is skipped with
  # build_kernel.sh's note (exit 3); under CI=true that is a failure (build_kernel.sh exits 1).
  # FASTVIDEO_KERNEL_NCCL_VERSIONS: the releases to build, newest first (tests of this script set it).
  for version in ${FASTVIDEO_KERNEL_NCCL_VERSIONS:-2.30.7 2.28.9}; do
    dir=build/kernel-$version
    [[ $version == 2.28.9 ]] && dir=build/kernel
    phase "kernel build against NCCL $version ($dir)"
    rc=0
    PYTHON="$PY" bash scripts/build_kernel.sh "$version" "$dir" || rc=$?
    if ((rc == 3)); then
      phase "kernel build against NCCL $version: SKIPPED, its headers are not available here (the note above)"
      skipped+=("kernel build against NCCL $version (nvidia-nccl-cu13==$version unavailable offline)")
    elif ((rc != 0)); then
      exit "$rc"
    fi
  done
else
  if _fv_ci; then
    echo "CI=$CI but nvcc is not on PATH: the kernel builds and the tests of them cannot run; failing" >&2
    exit 1
  fi
  phase "kernel build: SKIPPED, nvcc not found (tests that need build/kernel skip, saying so)"
  skipped+=("kernel build (no nvcc)")
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
# Pytest workers (pytest-xdist): most of the suite waits on process start-up, gloo rendezvous and deliberate vote
# timeouts, so even 2 workers on 2 cores roughly halve the wall time; one per 2 cores (2 to 12) by default, handed
# tests by work stealing, so that the few long ones (the overlay, the nested test commands) do not all queue at the
# end of one worker. On a host
# with GPUs the suite runs in two sessions, so that the GPU tests (marked `gpu`: each takes every GPU) run one at a
# time with the GPUs visible: first the GPU tests serially (what only this host can run comes first, so a run cut
# short by a time limit loses tests that CI runs too), then every other test on the workers with the GPUs hidden
# (as on a machine without any). Each test runs once. Serial where xdist is missing.
cores=$(nproc 2>/dev/null || echo 2)
default_workers=$((cores / 2)); ((default_workers > 12)) && default_workers=12; ((default_workers < 2)) && default_workers=2
workers=()
gpus=0
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
    2>/dev/null; then
  gpus=1
fi
if lacks pytest-xdist; then
  skipped+=("parallel pytest workers (pytest-xdist)")
else
  workers=(-n "${FASTVIDEO_PYTEST_WORKERS:-$default_workers}" --dist worksteal)
fi
timeout=(--timeout=300)
if lacks pytest-timeout; then
  timeout=(); skipped+=("per-test timeouts (pytest-timeout)")
fi
# FASTVIDEO_PYTEST_ARGS: what to collect instead of the whole suite (tests of this script use it, and a GPU host's run
# split over two time-limited calls: scripts/gpu_fresh_export.sh).
read -r -a targets <<<"${FASTVIDEO_PYTEST_ARGS:-tests}"
common=(-q "${timeout[@]}" --ulysses-ambient=all --progress-every=30)
if ((gpus == 0)) || ((${#workers[@]} == 0)); then
  phase "pytest ${workers[*]} (ambient-marked tests under every value of the variables they read)"
  run_pytest "${common[@]}" "${workers[@]}" "${targets[@]}"
else
  # The GPU tests load the kernel libraries built above (the test library is the file beside the product one), not
  # an installed wheel's, unless FASTVIDEO_KERNEL_LIBRARY names others.
  library=()
  built="$ROOT/build/kernel/libfastvideo_ulysses_a2a.so"
  if [[ -n "${FASTVIDEO_KERNEL_LIBRARY:-}" ]]; then
    using="\$FASTVIDEO_KERNEL_LIBRARY=$FASTVIDEO_KERNEL_LIBRARY"
  elif [[ -f $built ]]; then
    library=(FASTVIDEO_KERNEL_LIBRARY="$built"); using="$built, this command's build"
  else
    using="none built here: the installed fastvideo-kernel wheel's, if any"
  fi
  phase "pytest, serial, the GPUs visible: the tests marked gpu (kernel library: $using)"
  rc_gpu=0
  env "${library[@]}" "$PY" -m pytest "${common[@]}" -m gpu "${targets[@]}" || rc_gpu=$?
  phase "pytest ${workers[*]}, the GPUs hidden: every test not marked gpu (ambient-marked ones under every value)"
  rc_cpu=0
  CUDA_VISIBLE_DEVICES= "$PY" -m pytest "${common[@]}" "${workers[@]}" -m "not gpu" "${targets[@]}" || rc_cpu=$?
  # Exit code 5 (nothing collected): over the whole suite, which holds tests of both kinds, from either session a
  # failure (a GPU host that ran no GPU test has not tested what only it can); over FASTVIDEO_PYTEST_ARGS's subset,
  # which may hold none of one kind, only where neither session collected anything, either alone said.
  if ((rc_cpu == 5 && rc_gpu == 5)); then echo "pytest collected no tests: failing"; exit 1; fi
  if [[ -z "${FASTVIDEO_PYTEST_ARGS:-}" ]] && ((rc_cpu == 5 || rc_gpu == 5)); then
    echo "pytest collected no tests $( ((rc_gpu == 5)) && echo "marked gpu" || echo "not marked gpu") in the whole" \
      "suite: failing" >&2
    exit 1
  fi
  ((rc_cpu == 5)) && phase "pytest, the GPUs hidden: no test collected among ${targets[*]}"
  ((rc_gpu == 5)) && phase "pytest, the GPUs visible: no test marked gpu among ${targets[*]}"
  for rc in "$rc_gpu" "$rc_cpu"; do
    if ((rc != 0 && rc != 5)); then exit "$rc"; fi
  done
fi
if (( ${#skipped[@]} )); then
  printf -v list '%s, ' "${skipped[@]}"
  phase "done; NOT RUN here: ${list%, }"
else
  phase "done"
fi
