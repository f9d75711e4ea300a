#!/usr/bin/env bash
# The one-GPU kernel check (run from the repository root on a CUDA host, no network needed):
# versions, wheel build + install (the product library), the test library build (the product sources plus
# csrc/ulysses_a2a/testing/, against the same NCCL wheel), both libraries' info, the simulated-peers check
# (12945 cases, the test library's fvk_sim_a2a), the 1-rank real NCCL smoke on the test library
# (construction, P=1 executes, the epoch-checked launch and the fabric copy, destroy) and on the product
# library (its refusal of the test launches), and tests/kernel (GPU tests and the CPU tests against these
# builds). Logs go to $OUT.
#
#   OUT=/tmp/kernel-check bash scripts/device_kernel_check.sh
#
# FASTVIDEO_KERNEL_TESTING_BUILD: where the libraries are built (default /tmp/fvk-testing-build; outside $OUT,
# which comes back from the device).
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
  (cd /tmp && "$python" -c 'import fastvideo_kernel, json; i = fastvideo_kernel.info(); print(json.dumps(i, indent=1)); assert "error" not in i and "problem" not in i')
  (cd /tmp && "$python" -c 'from fastvideo_kernel import testing; import json; i = testing.info(); print(json.dumps(i, indent=1)); assert "error" not in i and "problem" not in i')
}

# `timeout` runs programs, not shell functions: the two functions above run in a child bash.
export -f versions info
build="${FASTVIDEO_KERNEL_TESTING_BUILD:-/tmp/fvk-testing-build}"
step versions 60 versions.log bash -c versions
wheel=1
step "build+install wheel" 300 pip_install.log \
  "$python" -m pip install --no-build-isolation --no-deps -v ./fastvideo-kernel || wheel=0
# Both libraries from one compile (the wheel ships the product one only); CPU tests of tests/kernel use this
# build through FASTVIDEO_KERNEL_TEST_BUILD.
step "build test library" 300 build_testing.log "$python" fastvideo-kernel/build_lib.py --out "$build" --testing
export FASTVIDEO_KERNEL_TESTING_LIBRARY="$build/libfastvideo_ulysses_a2a_testing.so"
export FASTVIDEO_KERNEL_TEST_BUILD="$build/libfastvideo_ulysses_a2a.so"
# Without the wheel, keep checking the kernel itself: the development build, through FASTVIDEO_KERNEL_LIBRARY.
[[ $wheel == 1 ]] || export FASTVIDEO_KERNEL_LIBRARY="$FASTVIDEO_KERNEL_TEST_BUILD"
step "fastvideo_kernel.info()" 60 versions.log bash -c info
step "simulated peers" 200 sim_peers.log "$python" tests/kernel/check_sim_peers.py --json "$OUT/sim_peers.json"
step "1-rank smoke (test lib)" 120 smoke_native.log \
  env FASTVIDEO_KERNEL_LIBRARY="$FASTVIDEO_KERNEL_TESTING_LIBRARY" "$python" tests/kernel/smoke_native_single_rank.py
step "1-rank smoke (product)" 120 smoke_native.log "$python" tests/kernel/smoke_native_single_rank.py
step "pytest tests/kernel" 300 pytest_kernel.log "$python" -m pytest -q -p no:cacheprovider tests/kernel

echo "=== summary"
cat "$summary"
exit "$failed"
