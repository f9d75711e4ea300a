#!/usr/bin/env bash
# Everything the 2-GPU kind (nvidia-h200-x2) must run, in stages that each fit one device call
# (<= 10 minutes); logs and JSON under $OUT. The commit travels in COMMIT (git-ignored: pass it with
# the device tool's carry=["COMMIT"]).
#
#   OUT=$OUT bash scripts/device_sp2.sh gate        # issue 11: the native gate with the plan sweep and the
#                                                   #   epoch checker, and the watchdog SIGKILL check (issue 13)
#   OUT=$OUT bash scripts/device_sp2.sh speed       # issue 12: tuner sweep, then the transport benchmark
#   OUT=$OUT bash scripts/device_sp2.sh dit         # issue 14: scripts/device_issue14.sh (when present)
#
# Each stage installs the kernel wheel first (the machine starts bare) and keeps going after a failed
# step; the exit status is non-zero if any step failed.
set -uo pipefail
stage="${1:-gate}"
OUT="${OUT:-/tmp/fastvideo-sp2}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
echo "commit $(cat COMMIT 2>/dev/null || echo unknown) stage $stage" | tee "$OUT/commit.txt"
failed=0
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/$stage.log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$stage.log"
  local rc=${PIPESTATUS[0]}
  printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/summary.txt"
  [[ $rc == 0 ]] || failed=1
}
nvidia-smi topo -m | tee "$OUT/topo.txt"
step "install kernel wheel" 200 python3 -m pip install --no-build-isolation --no-deps -q ./fastvideo-kernel
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node=2)
case "$stage" in
  gate)
    step "native gate" 420 "${TORCHRUN[@]}" tests/distributed/check_ulysses_h3_native.py --epoch-check \
      --json "$OUT/gate.json"
    step "watchdog SIGKILL" 90 python3 tests/distributed/check_ulysses_watchdog_sigkill.py --timeout 20
    ;;
  speed)
    step "tuner" 300 "${TORCHRUN[@]}" benchmarks/tune_ulysses_a2a.py --json "$OUT/tune.json"
    step "benchmark" 240 "${TORCHRUN[@]}" benchmarks/benchmark_ulysses_a2a.py --overlap --require-fused \
      --json "$OUT/a2a.json"
    ;;
  dit)
    if [[ -f scripts/device_issue14.sh ]]; then
      step "DiT step" 560 env BUDGET_S=530 bash scripts/device_issue14.sh
    else
      echo "scripts/device_issue14.sh not found"; failed=1
    fi
    ;;
  *) echo "unknown stage $stage (gate|speed|dit)" >&2; exit 2 ;;
esac
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
