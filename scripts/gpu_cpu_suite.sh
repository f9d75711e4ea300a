#!/usr/bin/env bash
# The whole CPU suite on a GPU host's own python and torch (torch 2.11 on the project's GPU hosts; no package
# registry there): the test command with the GPUs hidden, so every test runs as it does in CI (over gloo, two
# pytest workers) but on this torch. Logs under $OUT (run from the repository root):
#
#   OUT=/tmp/gpu-cpu-suite bash scripts/gpu_cpu_suite.sh
#
# $OUT/versions.log (python, torch, what the python lacks), $OUT/kernel_build.log, $OUT/cpu_suite.log (the test
# command's output; its last lines count what passed and name what was skipped), $OUT/summary.txt. The kernel
# library is built first with the host's own NCCL headers (fastvideo-kernel/build_lib.py, offline) so that the
# shared-memory vote tests run too; if that build fails, they skip, saying why. Nothing is installed.
# COMMIT (git-ignored) carries the commit id into $OUT/commit.txt: pass it with the device call's carry.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init /tmp/fastvideo-gpu-cpu-suite
python="${PYTHON:-python3}"
{
  command -v "$python"
  "$python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  "$python" -m pip list 2>/dev/null | grep -iE '^(torch|safetensors|numpy|pytest|pytest-timeout|pytest-xdist|ruff|clang-format|matplotlib|nvidia-nccl)' || true
} 2>&1 | tee "$OUT/versions.log"
# Both steps fit one 10-minute device call together. SKIP_KERNEL=1 skips the build (the shm tests then skip).
if [[ -z "${SKIP_KERNEL:-}" ]]; then
  step "kernel library (host NCCL)" 150 kernel_build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
fi
# The GPUs hidden: GPU tests skip, the CPU tests run over gloo as in CI, a worker per 2 cores (at most 8: most
# of the suite waits on rendezvous and deliberate timeouts). The host's python as it is.
workers=$(( $(nproc) / 2 )); (( workers > 8 )) && workers=8; (( workers < 2 )) && workers=2
step "CPU suite" 420 cpu_suite.log env CUDA_VISIBLE_DEVICES= FASTVIDEO_PYTHON="$python" FASTVIDEO_NO_INSTALL=1 \
  FASTVIDEO_SKIP_KERNEL_BUILD=1 FASTVIDEO_PYTEST_WORKERS="$workers" bash scripts/run_tests.sh
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
