#!/usr/bin/env bash
# The overlap measurements on 2 GPUs of one host (for later), from the repository root:
#
#   OUT=/tmp/overlap_sp2 [GEOMETRIES="wan720p h3-32k h3-128k"] bash scripts/gpu_overlap_sp2.sh
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
for g in ${GEOMETRIES:-}; do  # before anything runs: a name no step knows would measure nothing
  case "$g" in
    wan720p | h3-32k | h3-128k) ;;
    *) echo "GEOMETRIES: unknown geometry '$g' (known: wan720p h3-32k h3-128k)" >&2; exit 2 ;;
  esac
done
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init overlap_sp2
BUDGET_S="${BUDGET_S:-1500}"
L="$WORK/logs"
TORCHRUN=("$python" -m torch.distributed.run --standalone --nproc_per_node=2)
GEOMETRIES="${GEOMETRIES:-wan720p h3-32k h3-128k}"
want() { [[ " $GEOMETRIES " == *" $1 "* ]]; }
CASE=(benchmarks/run.py overlap --groups 1,2,4,8 --direction fwd,fwd_bwd --group-rows derive --iters 5 --warmup 2)
export -f gpu_versions  # step runs its command under timeout, which cannot see a shell function
step "versions" 60 versions.log bash -c gpu_versions
gpu_kernel_wheel  # the fused route's library (installed, or a development build through FASTVIDEO_KERNEL_LIBRARY)
step "check_overlap SP2" 300 check.log "${TORCHRUN[@]}" tests/distributed/check_overlap.py \
  --json "$L/overlap_check_sp2.json"
if want wan720p; then
  step "overlap wan720p off+ce" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry wan720p --routes off,auto \
    --engine ce --json "$L/overlap_wan720p_ce.json"
  step "overlap wan720p sm" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry wan720p --routes auto --engine sm \
    --json "$L/overlap_wan720p_sm.json"
fi
if want h3-32k; then
  step "overlap h3-32k off+ce" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry h3-32k --routes off,auto \
    --engine ce --json "$L/overlap_h3-32k_ce.json"
  step "overlap h3-32k sm" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry h3-32k --routes auto --engine sm \
    --json "$L/overlap_h3-32k_sm.json"
fi
if want h3-128k; then
  step "overlap h3-128k off+ce" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry h3-128k --routes off,auto \
    --engine ce --json "$L/overlap_h3-128k_ce.json"
  step "overlap h3-128k sm" 600 case.log "${TORCHRUN[@]}" "${CASE[@]}" --geometry h3-128k --routes auto --engine sm \
    --json "$L/overlap_h3-128k_sm.json"
fi
gpu_finish logs/overlap_check_sp2.json logs/overlap_wan720p_ce.json logs/overlap_wan720p_sm.json \
  logs/overlap_h3-32k_ce.json logs/overlap_h3-128k_ce.json
