#!/usr/bin/env bash
# One-GPU device call for the fused route's host path (issue 12; needs no peers). Run from the repo root
# on a CUDA host, COMMIT carried:
#
#   OUT=$OUT bash scripts/device_host_path.sh
#
# The kernel check at this commit (scripts/device_kernel_check.sh: wheel, simulated peers, 1-rank NCCL smoke,
# kernel pytest), then a development build in build/kernel for the scripts below, the helper's host path on
# this host's CPUs (benchmarks/measure_host_path.py, shared-memory and gloo votes), the benchmarks' line-up
# exit skew (benchmarks/measure_lineup_skew.py) and the fused launch's host cost per plan kind and chunk count
# at P = 1 (benchmarks/measure_launch_host.py), the whole fused call's host overhead at P = 1
# (benchmarks/measure_fused_host_overhead.py); with BASE=DIR, the last two A/B against an exported older tree.
# The device returns at most 8 files: everything is packed into
# $OUT/all.tar.gz, and the summary and the JSONs are copied beside it.
set -uo pipefail
FINAL_OUT="${OUT:-/tmp/fastvideo-host-path}"
mkdir -p "$FINAL_OUT"
export OUT=/tmp/fastvideo-host-path-work
rm -rf "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init "$OUT"
# The development build first: the kernel check's host tests (tests/kernel/test_kernel_host.py) use it too.
step "dev build" 200 perf.log python3 fastvideo-kernel/build_lib.py --out build/kernel
KEEP_SUMMARY=1 bash scripts/device_kernel_check.sh || failed=1
export FASTVIDEO_KERNEL_LIBRARY="$ROOT/build/kernel/libfastvideo_ulysses_a2a.so"
nproc | tee -a "$OUT/perf.log"
step "host path (shm vote)" 200 perf.log python3 benchmarks/measure_host_path.py --iters 5000 --vote shm \
  --json "$OUT/host_path_shm.json"
step "host path (gloo vote)" 200 perf.log python3 benchmarks/measure_host_path.py --iters 1000 --vote gloo \
  --json "$OUT/host_path_gloo.json"
step "line-up skew" 120 perf.log python3 benchmarks/measure_lineup_skew.py --json "$OUT/lineup_skew.json"
step "launch host cost (P=1)" 240 perf.log python3 benchmarks/measure_launch_host.py --json "$OUT/launch_host.json"
step "fused call host overhead (P=1)" 240 perf.log python3 benchmarks/measure_fused_host_overhead.py \
  --json "$OUT/fused_host_overhead.json"
# BASE=DIR (an exported older tree, carried): the same host-path scripts run from both trees, A/B/A/B, with
# the one library built above, so the difference is the Python host path alone.
if [[ -n "${BASE:-}" ]]; then
  for round in 1 2; do
    for tree in "$BASE" "$ROOT"; do
      tag=$([[ $tree == "$ROOT" ]] && echo head || echo base)
      step "host path $tag #$round" 120 ab.log python3 "$tree/benchmarks/measure_host_path.py" --iters 5000 \
        --vote shm --json "$OUT/ab_host_path_${tag}_${round}.json"
      step "launch host $tag #$round" 200 ab.log python3 "$tree/benchmarks/measure_launch_host.py" --no-parts \
        --json "$OUT/ab_launch_${tag}_${round}.json"
    done
  done
fi
echo "=== summary"
cat "$OUT/summary.txt"
tar czf "$FINAL_OUT/all.tar.gz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL_OUT/"
for f in host_path_shm.json lineup_skew.json launch_host.json fused_host_overhead.json; do
  [[ -f "$OUT/$f" ]] && cp "$OUT/$f" "$FINAL_OUT/"
done
exit "$failed"
