#!/usr/bin/env bash
# The one-GPU kernel check (run from the repository root on a CUDA host, no network needed):
# versions, wheel build + install, library info, the simulated-peers check, a 1-rank real NCCL
# smoke (construction, P=1 executes, destroy), and the kernel pytest files. Logs go to $OUT.
#
#   OUT=/tmp/kernel-check bash scripts/device_kernel_check.sh
#
# Every step runs under a time limit (the whole script stays well inside 8 minutes); a failing
# step does not stop the later ones; the exit status is non-zero if any step failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init /tmp/fastvideo-kernel-check
python="${PYTHON:-python3}"
export python
summary="$OUT/summary.txt"
[[ -n "${KEEP_SUMMARY:-}" ]] || : >"$summary"  # a calling script that ran steps before keeps them

versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m || true
  nvcc --version | tail -n 2
  "$python" - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "setuptools"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        pass
PY
}

info() {
  (cd /tmp && "$python" -c 'import fastvideo_kernel, json; i = fastvideo_kernel.info(); print(json.dumps(i, indent=1)); assert "error" not in i')
}

# `timeout` runs programs, not shell functions: the two functions above run in a child bash.
export -f versions info
step versions 60 versions.log bash -c versions
if ! step "build+install wheel" 300 pip_install.log \
    "$python" -m pip install --no-build-isolation --no-deps -v ./fastvideo-kernel; then
  # Keep checking the kernel itself: a development build, picked up through FASTVIDEO_KERNEL_LIBRARY.
  step "fallback dev build" 200 pip_install.log "$python" fastvideo-kernel/build_lib.py --out /tmp/fvk-dev-build
  export FASTVIDEO_KERNEL_LIBRARY=/tmp/fvk-dev-build/libfastvideo_ulysses_a2a.so
fi
step "fastvideo_kernel.info()" 60 versions.log bash -c info
step "simulated peers" 200 sim_peers.log "$python" tests/kernel/check_sim_peers.py --json "$OUT/sim_peers.json"
step "1-rank NCCL smoke" 120 smoke_native.log "$python" tests/kernel/smoke_native_single_rank.py
step "pytest tests/kernel" 200 pytest_kernel.log \
  "$python" -m pytest -q -p no:cacheprovider tests/kernel/test_sim_peers_gpu.py tests/kernel/test_kernel_host.py \
  tests/kernel/test_native_capture_gpu.py

echo "=== summary"
cat "$summary"
exit "$failed"
