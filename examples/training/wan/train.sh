#!/usr/bin/env bash
# One training run of the Wan recipe (examples/sp_recipes/train_wan.py) inside the overlay: exports the Ulysses
# switches as a FastVideo recipe does, then launches one rank per GPU with torchrun (2 gloo ranks on the CPU where
# there are not 2 GPUs to use).
#
#   FASTVIDEO_ULYSSES_A2A=auto bash examples/training/wan/train.sh --out-dir build/wan/auto
#   FASTVIDEO_RECIPE_DEVICE=cpu NPROC=3 bash examples/training/wan/train.sh --out-dir /tmp/r --steps 10
#
# Every argument goes to `train_wan train`. The switches are agreed across the SP group when it is initialised,
# so they are exported before the launch, never changed inside the job:
#   FASTVIDEO_ULYSSES_A2A               auto (fused route where every rank agrees) or off (the NCCL route)
#   FASTVIDEO_ULYSSES_A2A_LONG_TRAINING chunked (grad-tracked planes over 512 MiB may use tuned chunks) or auto
#   FASTVIDEO_ULYSSES_A2A_OVERLAP       0 (default) or N: attention heads in N groups, exchanges under compute
#   FASTVIDEO_ATTENTION_BACKEND         TORCH_SDPA (upstream's attention backend selector; on the CPU the recipe
#                                       names the same backend itself)
# FASTVIDEO_RECIPE_DEVICE: auto (default: every GPU, one rank each, on a host with 2+; else 2 gloo ranks on the
# CPU), cuda (every GPU, also one: SP1), cpu. NPROC overrides the rank count. PY: the Python to use.
# FASTVIDEO_OVERLAY_PYTHONPATH: the overlay (compare_switches.sh builds it with scripts/upstream_overlay.sh and sets it).
set -euo pipefail
PY="${PY:-python3}"
if [ -z "${FASTVIDEO_OVERLAY_PYTHONPATH:-}" ]; then
  echo "train.sh: FASTVIDEO_OVERLAY_PYTHONPATH is not set: the Wan recipe runs inside the overlay (upstream" \
       "fastvideo 0.2.1 with this package over it); run examples/training/wan/compare_switches.sh or" \
       "scripts/run_demo.sh, which build it" >&2
  exit 2
fi
# The overlay's fastvideo, never the tree's alone; then the recipes (sp_recipes, which the overlay does not copy):
# examples/ holds no fastvideo, so it shadows nothing of the overlay's. torchrun's ranks inherit this PYTHONPATH.
EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$FASTVIDEO_OVERLAY_PYTHONPATH:$EXAMPLES"
export FASTVIDEO_ATTENTION_BACKEND="${FASTVIDEO_ATTENTION_BACKEND:-TORCH_SDPA}"
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_env.sh"  # the switches, NCCL, cuBLAS; sets device and nproc
# `python -m` puts the working directory first on sys.path: in the tree that is the tree's fastvideo/ alone, which
# would shadow the overlay's. So the paths given become absolute and the launch runs in the overlay.
args=()
while (($#)); do
  case "$1" in
    --out-dir|--resume) args+=("$1" "$(realpath -m "$2")"); shift 2 ;;
    --out-dir=*|--resume=*) args+=("${1%%=*}=$(realpath -m "${1#*=}")"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "${FASTVIDEO_OVERLAY_PYTHONPATH%%:*}"
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" -m sp_recipes.train_wan \
  train --device "$device" "${args[@]}"
