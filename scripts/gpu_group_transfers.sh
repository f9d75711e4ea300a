#!/usr/bin/env bash
# Upstream FastVideo's coordinator transfers over NCCL with CUDA tensors (tests/distributed/check_group_transfers_nccl.py)
# on a host with 2+ CUDA GPUs, from the repository root:
#
#   OUT=/tmp/transfers bash scripts/gpu_group_transfers.sh
#
# Installs the kernel wheel (scripts/gpu_lib.sh), then runs the check at SP = 2 under FASTVIDEO_ULYSSES_A2A=auto with
# --expect-fused (maybe_create_helper must return a helper whose call runs fused). $OUT: summary.txt, commit.txt,
# logs.tar.gz and transfers.json. The exit status is non-zero if a check failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init "group-transfers"
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
  echo "fewer than 2 GPUs visible: the check needs 2" | tee -a "$WORK/logs/summary.txt"
  failed=1
  gpu_finish
fi
gpu_kernel_wheel
FASTVIDEO_ULYSSES_A2A=auto step "coordinator transfers (NCCL)" 240 transfers.log \
  "$python" -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/check_group_transfers_nccl.py \
  --expect-fused --json "$WORK/logs/transfers.json"
gpu_finish logs/transfers.json
