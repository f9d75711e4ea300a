#!/usr/bin/env bash
# The one-GPU kernel check, on any CUDA host, from the repository root (no network needed):
#
#   OUT=/tmp/kernel-check bash scripts/gpu_kernel_check.sh
#
# Versions, the kernel wheel built from this tree, installed and checked to be what Python imports (a development
# build where the build, the install or that check fails: scripts/gpu_lib.sh's gpu_kernel_wheel), the test library
# built beside it, both libraries' info, the simulated-peers check (the test library's fvk_sim_a2a; the even split
# tables' cases and the uneven ones' as two steps), a 1-rank NCCL smoke on the test library (construction, P = 1
# executes, the epoch-checked launch and the fabric copy, destroy) and on the product library (its refusal of the
# test launches), and tests/kernel. Every step runs under a time limit (the whole script well inside 10 minutes)
# and a failing step does not stop the later ones; the exit status is non-zero if any failed. Logs in
# $OUT/logs.tar.gz, the simulation's JSON beside it (scripts/gpu_lib.sh). Run by other scripts with KEEP_WORK=1 it adds its steps to
# theirs and leaves the finishing to them.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
if [[ -z "${KEEP_WORK:-}" ]]; then
  gpu_init kernel-check
fi

info() {  # both checks count: the second runs only where the first passed
  (cd /tmp && "$python" -c 'import fastvideo_kernel, json; i = fastvideo_kernel.info(); print(json.dumps(i, indent=1)); assert "error" not in i and "problem" not in i') &&
  (cd /tmp && "$python" -c 'from fastvideo_kernel import testing; import json; i = testing.info(); print(json.dumps(i, indent=1)); assert "error" not in i and "problem" not in i')
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
gpu_testing_library
step "fastvideo_kernel.info()" 60 versions.log bash -c info
step "simulated peers" 200 sim_peers.log "$python" tests/kernel/check_sim_peers.py --set even \
  --json "$WORK/logs/sim_peers.json"
step "simulated peers (uneven splits)" 150 sim_peers_uneven.log "$python" tests/kernel/check_sim_peers.py --set uneven \
  --json "$WORK/logs/sim_peers_uneven.json"
step "1-rank smoke (test library)" 120 smoke_native.log \
  env FASTVIDEO_KERNEL_LIBRARY="$FASTVIDEO_KERNEL_TESTING_LIBRARY" "$python" tests/kernel/smoke_native_single_rank.py
step "1-rank smoke (product)" 120 smoke_native.log "$python" tests/kernel/smoke_native_single_rank.py
step "pytest tests/kernel" 300 pytest_kernel.log "$python" -m pytest -q -p no:cacheprovider tests/kernel
if [[ -z "${KEEP_WORK:-}" ]]; then
  gpu_finish logs/sim_peers.json logs/sim_peers_uneven.json
fi
