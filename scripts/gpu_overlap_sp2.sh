#!/usr/bin/env bash
# The overlap measurements on 2 GPUs of one host (for later), from the repository root:
#
#   OUT=/tmp/overlap_sp2 bash scripts/gpu_overlap_sp2.sh [GEOMETRIES]      (default: wan720p h3-32k h3-128k)
#
# 1. tests/distributed/check_overlap.py at SP 2: the waits, the pipelined block captured and replayed exactly with
#    real exchanges, compile fullgraph.
# 2. The harness case `overlap` per geometry: the synchronous block against 2, 4 and 8 head groups, forward and
#    forward+backward, exposed exchange time (step minus the communication-free stand-in) and the share hidden,
#    on the NCCL route (`off`) and the fused route with copy-engine plans, then with SM plans (`--engine`).
#    `--group-rows derive` gives the groups' exchanges (H/N heads) the layer's tuned rows (TUNED_TABLE keys whole
#    layers; without it every group plans the original SM kind): say so with any number taken from these rows.
# Per geometry and engine one step; BUDGET_S (default 1500) bounds the whole script. $OUT: summary, commit,
# logs.tar.gz and up to 5 JSONs (all of them are in logs.tar.gz).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init overlap_sp2
BUDGET_S="${BUDGET_S:-1500}"
L="$WORK/logs"
TORCHRUN=("$python" -m torch.distributed.run --standalone --nproc_per_node=2)
geometries=("${@:-wan720p h3-32k h3-128k}")
# shellcheck disable=SC2206
geometries=(${geometries[*]})
step "versions" 60 versions.log gpu_versions
step "check_overlap SP2" 300 check.log "${TORCHRUN[@]}" tests/distributed/check_overlap.py \
  --json "$L/overlap_check_sp2.json"
for g in "${geometries[@]}"; do
  step "overlap $g off+ce" 600 case.log "${TORCHRUN[@]}" benchmarks/run.py overlap --geometry "$g" \
    --groups 1,2,4,8 --direction fwd,fwd_bwd --routes off,auto --engine ce --group-rows derive \
    --iters 5 --warmup 2 --json "$L/overlap_${g}_ce.json"
  step "overlap $g sm" 600 case.log "${TORCHRUN[@]}" benchmarks/run.py overlap --geometry "$g" \
    --groups 1,2,4,8 --direction fwd,fwd_bwd --routes auto --engine sm --group-rows derive \
    --iters 5 --warmup 2 --json "$L/overlap_${g}_sm.json"
done
gpu_finish logs/overlap_check_sp2.json "logs/overlap_${geometries[0]}_ce.json" "logs/overlap_${geometries[0]}_sm.json"
