#!/usr/bin/env bash
# Everything that one GPU can check, in one device call (run from the repo root; logs under $OUT):
# the kernel check (wheel build, simulated peers, 1-rank NCCL smoke, kernel pytest), then the
# transport benchmark and the DiT-step benchmark at SP1 (routes degenerate at SP1: these rows check
# that the scripts run on CUDA and record single-GPU step times, not the fused route's speed).
set -uo pipefail
OUT="${OUT:-/tmp/fastvideo-one-gpu}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
echo "commit $(cat COMMIT 2>/dev/null || echo unknown)" | tee "$OUT/commit.txt"
failed=0
OUT="$OUT" bash scripts/device_kernel_check.sh || failed=1
run() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/benchmarks.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/benchmarks.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
  [[ $rc == 0 ]] || failed=1
}
run "a2a SP1" 150 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
  benchmarks/benchmark_ulysses_a2a.py --geometry wan720p --geometry h3-32k --json "$OUT/a2a_sp1.json"
run "dit SP1" 240 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
  benchmarks/benchmark_dit_step.py --tokens 32k --json "$OUT/dit_sp1.json"
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
