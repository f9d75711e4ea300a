#!/usr/bin/env bash
# Everything that one GPU can check, in one device call (run from the repo root; logs under $OUT):
# the kernel check (wheel build, simulated peers, 1-rank NCCL smoke, kernel pytest), then the
# transport benchmark and the DiT-step benchmark at SP1 (routes degenerate at SP1: these rows check
# that the scripts run on CUDA and record single-GPU step times, not the fused route's speed).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init /tmp/fastvideo-one-gpu
bash scripts/device_kernel_check.sh || failed=1
step "a2a SP1" 150 benchmarks.log python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
  benchmarks/benchmark_ulysses_a2a.py --geometry wan720p --geometry h3-32k --json "$OUT/a2a_sp1.json"
step "dit SP1" 240 benchmarks.log python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
  benchmarks/benchmark_dit_step.py --tokens 32k --json "$OUT/dit_sp1.json"
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
