#!/usr/bin/env bash
# One-GPU measurements for the fused route's speed work (issue 12), in one device call; logs under $OUT:
# the helper's host path on this host's CPUs (shared-memory vote) and copy-engine pitched-copy rates.
# (The benchmark's fabric limit, benchmarks/check_fabric_reference.py, needs the native transport on two
# GPUs: it runs on the 2-GPU kind.)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init /tmp/fastvideo-perf
step "dev build" 200 perf.log python3 fastvideo-kernel/build_lib.py --out build/kernel
nproc | tee -a "$OUT/perf.log"
step "host path (shm vote)" 200 perf.log python3 benchmarks/measure_host_path.py --iters 5000 --vote shm --json "$OUT/host_path.json"
step "host path (gloo vote)" 200 perf.log python3 benchmarks/measure_host_path.py --iters 2000 --vote gloo
step "copy engine rates" 200 perf.log python3 benchmarks/measure_copy_engine.py --json "$OUT/copy_engine.json"
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
