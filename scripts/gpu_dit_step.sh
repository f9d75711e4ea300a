#!/usr/bin/env bash
# The DiT step benchmark on a 2-GPU host (any host with 2 NVLink-joined CUDA GPUs), from the repository root:
#
#   OUT=/tmp/dit bash scripts/gpu_dit_step.sh                       # PARTS="dense sparse", within BUDGET_S=575
#   OUT=/tmp/dit PARTS=sparse250k bash scripts/gpu_dit_step.sh      # the 250k offload rows alone
#
# Hidden 7168, 56 heads, 2 blocks (every block is the same, so the share and the gains are per-block
# properties; 2 keeps FSDP's neighbour prefetch and halves the time), NCCL route vs fused route:
#   dense        --tokens 32k,128k
#   sparse       --attention sparse --tokens 32k,128k,250000 --offload-activations --offload-above 131072
#                --long-training auto,chunked
#   sparse250k   --attention sparse --tokens 250000 --offload-activations --long-training auto,chunked
#   engines250k  the 250k offload chunked-training row with the SM kernel's plans (--engine sm), to set beside the
#                copy-engine plans the table picks there
# then a plot of every JSON (--plot-from) and their verdicts (benchmarks/check_results.py) in summary.txt.
#
# Time: the whole script stays inside BUDGET_S (default 575 s); every step's limit is the smaller of its plan
# and the time left, so a run stopped by its limit still leaves the token counts it finished (the benchmark
# rewrites its JSON after each one, header.complete false). `python benchmarks/benchmark_dit_step.py --estimate
# --blocks 2 ARGS` estimates each run beforehand, and each JSON header carries its estimate beside its wall time.
# $OUT: summary.txt, commit.txt, logs.tar.gz, the JSONs and the plot (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
export BUDGET_S="${BUDGET_S:-575}"
PARTS="${PARTS:-dense sparse}"
gpu_init dit-step
echo "parts: $PARTS, budget ${BUDGET_S}s" | tee -a "$WORK/logs/summary.txt"
export -f gpu_versions
step versions 40 versions.log bash -c gpu_versions
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
  echo "fewer than 2 GPUs visible: the DiT step runs at SP2" | tee -a "$WORK/logs/summary.txt"
  failed=1
  gpu_finish
fi
gpu_kernel_wheel
L="$WORK/logs"
bench=("$python" -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --blocks 2)
jsons=()
# dit NAME PLANNED_S RESERVE_S JSON ARGS...: one 2-rank run as a budgeted step (RESERVE_S kept for later parts).
dit() {
  local name=$1 planned=$2 reserve=$3 json=$4
  shift 4
  RESERVE_S=$reserve step "$name" "$planned" dit.log "${bench[@]}" "$@" --json "$L/$json"
  jsons+=("$L/$json")
}
for part in $PARTS; do
  case "$part" in
    dense)
      reserve=20
      [[ " $PARTS " == *" sparse "* ]] && reserve=200  # the sparse run's 32k and 128k rows when they follow
      dit "dit dense 32k,128k" 220 "$reserve" dit_dense.json --tokens 32k,128k ;;
    sparse)
      dit "dit sparse 32k,128k,250k" 600 20 dit_sparse.json --attention sparse --tokens 32k,128k,250000 \
        --offload-activations --offload-above 131072 --long-training auto,chunked ;;
    sparse250k)
      dit "dit sparse 250k" 600 20 dit_sparse250k.json --attention sparse --tokens 250000 --offload-activations \
        --long-training auto,chunked ;;
    engines250k)
      dit "dit sparse 250k, sm plans" 600 20 dit_sparse250k_sm.json --attention sparse --tokens 250000 \
        --offload-activations --long-training chunked --engine sm ;;
    *) echo "unknown part: $part" | tee -a "$WORK/logs/summary.txt"; failed=1 ;;
  esac
done
existing=()
for j in "${jsons[@]}"; do [[ -s $j ]] && existing+=("$j"); done
if ((${#existing[@]})); then
  step plot 30 dit.log "$python" benchmarks/benchmark_dit_step.py --plot-from "${existing[@]}" --plot "$L/dit.png"
  # The verdicts as the checker computes them from each JSON (a run its limit stopped included).
  timeout 60 "$python" benchmarks/check_results.py "${existing[@]}" 2>&1 | tee -a "$WORK/logs/summary.txt"
  rc=${PIPESTATUS[0]}  # 1: a FAIL verdict, 2: an invalid document, 124: the limit
  printf '%-34s rc=%-3s\n' "verdicts" "$rc" | tee -a "$WORK/logs/summary.txt"
  ((rc == 0)) || failed=1
fi
gpu_finish logs/dit_dense.json logs/dit_sparse.json logs/dit_sparse250k.json logs/dit_sparse250k_sm.json logs/dit.png
