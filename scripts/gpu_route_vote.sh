#!/usr/bin/env bash
# What the per-call vote costs a call that takes the NCCL route under `auto`, on a GPU host's CPUs (no GPU is used:
# two gloo ranks on the host's cores), from the repository root:
#
#   OUT=/tmp/route-vote bash scripts/gpu_route_vote.sh
#
# A development build of the kernel library in build/kernel (the shared-memory vote lives in it), then
# route_vote at P = 2 over the shared-memory vote and over gloo (each rank naming a host of its own: the stand-in
# for ranks on several hosts; over loopback here), twice each, and vote_cost (the exchange alone) for reference;
# then the CPU tests of the vote on every route. Cases: docs/benchmarks.md; where the figures go:
# docs/ulysses_performance.md ("The vote on every route"). $OUT: summary.txt, commit.txt, logs.tar.gz and the
# JSONs (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init route-vote
export -f gpu_versions
step "versions" 60 versions.log bash -c gpu_versions
step "dev build" 200 build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
export FASTVIDEO_KERNEL_LIBRARY="$ROOT/build/kernel/libfastvideo_ulysses_a2a.so"
run=("$python" -m benchmarks.run)
L="$WORK/logs"
uptime | tee -a "$L/load.log"
for round in 1 2; do
  step "route vote shm #$round" 200 cases.log "${run[@]}" route_vote --nproc 2 --vote shm --iters 20000 \
    --json "$L/route_vote_shm_$round.json"
  step "route vote gloo #$round" 300 cases.log "${run[@]}" route_vote --nproc 2 --vote gloo --iters 4000 \
    --json "$L/route_vote_gloo_$round.json"
done
step "vote cost" 120 cases.log "${run[@]}" vote_cost --nproc 2 --json "$L/vote_cost.json"
uptime | tee -a "$L/load.log"
step "tests: vote on every route" 600 tests.log "$python" -m pytest -q -p no:cacheprovider \
  tests/distributed/test_ulysses_vote_every_route.py
gpu_finish logs/route_vote_shm_1.json logs/route_vote_gloo_1.json logs/route_vote_shm_2.json \
  logs/route_vote_gloo_2.json logs/vote_cost.json
