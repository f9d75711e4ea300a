#!/usr/bin/env bash
# One-GPU measurements for the fused route's speed work (issue 12), in one device call; logs under $OUT:
# the helper's host path on this host's CPUs (shared-memory vote), copy-engine pitched-copy rates, and
# the benchmark's fabric-limit reference path (CUDA IPC) with two ranks sharing the GPU.
set -uo pipefail
OUT="${OUT:-/tmp/fastvideo-perf}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
echo "commit $(cat COMMIT 2>/dev/null || echo unknown)" | tee "$OUT/commit.txt"
failed=0
run() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/perf.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/perf.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc" | tee -a "$OUT/summary.txt"
  [[ $rc == 0 ]] || failed=1
}
run "dev build" 200 python3 fastvideo-kernel/build_lib.py --out build/kernel
nproc | tee -a "$OUT/perf.log"
run "host path (shm vote)" 200 python3 benchmarks/measure_host_path.py --iters 5000 --vote shm --json "$OUT/host_path.json"
run "host path (gloo vote)" 200 python3 benchmarks/measure_host_path.py --iters 2000 --vote gloo
run "copy engine rates" 200 python3 benchmarks/measure_copy_engine.py --json "$OUT/copy_engine.json"
run "fabric reference path" 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  benchmarks/check_fabric_reference.py --mib 256
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
