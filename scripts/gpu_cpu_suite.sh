#!/usr/bin/env bash
# The whole CPU suite on a GPU host's own python and torch (torch 2.11 on the project's GPU hosts; no package
# registry there), from the repository root:
#
#   OUT=/tmp/cpu-suite bash scripts/gpu_cpu_suite.sh
#
# The test command (scripts/run_tests.sh) with the GPUs hidden, so every test runs as in CI (over gloo, pytest
# workers) but on this torch, with the host's python as it is (nothing installed; a tool it lacks skips its step
# with a note). First the kernel libraries (product and test), built offline with the host's own NCCL
# (fastvideo-kernel/build_lib.py), so that the shared-memory vote and kernel host tests run too; if that build
# fails they skip, saying why (SKIP_KERNEL=1 skips it), and the hot-path extension against the host's torch. Both steps fit one 10-minute device call. $OUT: summary.txt, commit.txt, logs.tar.gz, versions.log and
# cpu_suite.log, whose last lines count what passed and name what did not run (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init cpu-suite
L="$WORK/logs"
{
  gpu_python '^(torch|safetensors|numpy|pytest|pytest-timeout|pytest-xdist|ruff|clang-format|matplotlib|nvidia-nccl)'
  nproc
} >"$L/versions.log" 2>&1
cat "$L/versions.log"
if [[ -z "${SKIP_KERNEL:-}" ]]; then
  step "kernel libraries (host NCCL)" 200 build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel --testing
  step "hot-path extension (host torch)" 200 build.log "$python" fastvideo-kernel/build_hot.py --out build/kernel
fi
# A worker per 2 cores (at most 8): most of the suite waits on rendezvous and deliberate timeouts, not on CPU.
workers=$(( $(nproc) / 2 )); (( workers > 8 )) && workers=8; (( workers < 2 )) && workers=2
step "CPU suite (GPUs hidden)" 420 cpu_suite.log env CUDA_VISIBLE_DEVICES= FASTVIDEO_PYTHON="$python" \
  FASTVIDEO_NO_INSTALL=1 FASTVIDEO_SKIP_KERNEL_BUILD=1 FASTVIDEO_PYTEST_WORKERS="$workers" bash scripts/run_tests.sh
gpu_finish logs/versions.log logs/cpu_suite.log
