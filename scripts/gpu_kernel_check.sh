#!/usr/bin/env bash
# The one-GPU kernel check, on any CUDA host, from the repository root (no network needed):
#
#   OUT=/tmp/kernel-check bash scripts/gpu_kernel_check.sh
#
# Versions, the kernel wheel built and installed (a development build where the install fails), the library's
# info, the simulated-peers check, a 1-rank NCCL smoke (construction, P = 1 executes, destroy) and the kernel
# pytest files. Every step runs under a time limit (the whole script well inside 10 minutes) and a failing step
# does not stop the later ones; the exit status is non-zero if any failed. Logs in $OUT/logs.tar.gz, the
# simulation's JSON beside it (scripts/gpu_lib.sh). Run by other scripts with KEEP_WORK=1 it adds its steps to
# theirs and leaves the finishing to them.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
if [[ -z "${KEEP_WORK:-}" ]]; then
  gpu_init kernel-check
fi

info() {
  (cd /tmp && "$python" -c 'import fastvideo_kernel, json; i = fastvideo_kernel.info(); print(json.dumps(i, indent=1)); assert "error" not in i')
}
versions() {
  gpu_versions
  nvcc --version | tail -n 2
  "$python" - <<'PY'
import importlib.metadata as md
import torch
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "setuptools"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        pass
PY
}
# `timeout` runs programs, not shell functions: these run in a child bash.
export -f info versions gpu_versions
step versions 60 versions.log bash -c versions
gpu_kernel_wheel
step "fastvideo_kernel.info()" 60 versions.log bash -c info
step "simulated peers" 200 sim_peers.log "$python" tests/kernel/check_sim_peers.py --json "$WORK/logs/sim_peers.json"
step "1-rank NCCL smoke" 120 smoke_native.log "$python" tests/kernel/smoke_native_single_rank.py
step "pytest tests/kernel" 200 pytest_kernel.log \
  "$python" -m pytest -q -p no:cacheprovider tests/kernel/test_sim_peers_gpu.py tests/kernel/test_kernel_host.py \
  tests/kernel/test_native_capture_gpu.py
if [[ -z "${KEEP_WORK:-}" ]]; then
  gpu_finish logs/sim_peers.json
fi
