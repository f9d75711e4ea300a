#!/usr/bin/env bash
# The fused route's host-side costs on one GPU (no peer needed), on any CUDA host, from the repository root:
#
#   OUT=/tmp/host-path bash scripts/gpu_host_path.sh
#   OUT=/tmp/host-path BASE=/path/to/older/tree bash scripts/gpu_host_path.sh      # plus an A/B of two trees
#
# The kernel check (scripts/gpu_kernel_check.sh), then a development build in build/kernel, then the cases
# (docs/benchmarks.md): the helper's host path on this host's CPUs (shared-memory and gloo votes), the vote's
# cost, the line-up's exit skew, the public op's own cost, the fused launch's host cost per plan kind and chunk
# count at P = 1, the whole fused call's host overhead at P = 1, and the copy-engine rates of the relayout. With
# BASE (an exported older tree with its own build/kernel), the host path and the launch cost run A/B/A/B from
# both trees with this tree's benchmark code (--tree), one library, so the difference is the Python host path.
# $OUT: summary.txt, commit.txt, logs.tar.gz and the key JSONs (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init host-path
# The development build first: the kernel check's host tests (tests/kernel/test_kernel_host.py) use it too.
step "dev build" 200 build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
KEEP_WORK=1
source scripts/gpu_kernel_check.sh
unset KEEP_WORK
export FASTVIDEO_KERNEL_LIBRARY="$ROOT/build/kernel/libfastvideo_ulysses_a2a.so"
run=("$python" -m benchmarks.run)
L="$WORK/logs"
step "host path (shm vote)" 200 cases.log "${run[@]}" host_path --nproc 2 --vote shm --json "$L/host_path_shm.json"
step "host path (gloo vote)" 200 cases.log "${run[@]}" host_path --nproc 2 --vote gloo --iters 1000 \
  --json "$L/host_path_gloo.json"
step "vote cost" 120 cases.log "${run[@]}" vote_cost --nproc 2 --json "$L/vote_cost.json"
step "line-up skew" 120 cases.log "${run[@]}" lineup_skew --nproc 2 --json "$L/lineup_skew.json"
step "public op overhead" 150 cases.log "${run[@]}" public_op_overhead --nproc 2 --json "$L/public_op.json"
step "launch host cost (P=1)" 240 cases.log "${run[@]}" launch_host --json "$L/launch_host.json"
step "fused call host overhead (P=1)" 240 cases.log "${run[@]}" fused_host_overhead --json "$L/fused_host.json"
step "copy engine rates" 120 cases.log "${run[@]}" copy_engine --json "$L/copy_engine.json"
if [[ -n "${BASE:-}" ]]; then
  for round in 1 2; do
    for tree in "$BASE" "$ROOT"; do
      tag=$([[ $tree == "$ROOT" ]] && echo head || echo base)
      step "host path $tag #$round" 120 ab.log "${run[@]}" host_path --tree "$tree" --nproc 2 --vote shm \
        --json "$L/ab_host_path_${tag}_${round}.json"
      step "launch host $tag #$round" 200 ab.log "${run[@]}" launch_host --tree "$tree" --no-parts \
        --json "$L/ab_launch_${tag}_${round}.json"
    done
  done
fi
gpu_finish logs/host_path_shm.json logs/lineup_skew.json logs/launch_host.json logs/fused_host.json \
  logs/copy_engine.json
