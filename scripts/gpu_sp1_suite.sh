#!/usr/bin/env bash
# Everything one GPU can check, on any CUDA host, from the repository root:
#
#   OUT=/tmp/sp1 bash scripts/gpu_sp1_suite.sh
#
# The kernel check (scripts/gpu_kernel_check.sh), then the transport benchmark, the floor and the DiT step at SP1.
# At SP1 every route is the identity (its rows say so) and the floor has no peer: these rows check that the cases
# run on CUDA and record single-GPU step times, not the fused route's speed. $OUT: summary.txt, commit.txt,
# logs.tar.gz and the JSONs (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init sp1
KEEP_WORK=1
source scripts/gpu_kernel_check.sh
unset KEEP_WORK
L="$WORK/logs"
step "a2a SP1" 150 cases.log "$python" benchmarks/benchmark_ulysses_a2a.py --geometry wan720p --geometry h3-32k \
  --json "$L/a2a_sp1.json"
step "floor SP1" 60 cases.log "$python" -m benchmarks.run floor --geometry wan720p --json "$L/floor_sp1.json"
step "dit SP1" 240 cases.log "$python" benchmarks/benchmark_dit_step.py --tokens 32k --json "$L/dit_sp1.json"
gpu_finish logs/sim_peers.json logs/sim_peers_uneven.json logs/a2a_sp1.json logs/floor_sp1.json logs/dit_sp1.json
