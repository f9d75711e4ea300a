#!/usr/bin/env bash
# One training run of the video DiT recipe (examples/sp_recipes/train_video_dit.py): exports the two Ulysses
# switches, then launches one rank per GPU with torchrun (2 gloo ranks on the CPU where there is no GPU to use).
#
#   FASTVIDEO_ULYSSES_A2A=auto bash examples/training/video_dit/train.sh --out-dir build/video_dit/auto
#   FASTVIDEO_RECIPE_DEVICE=cpu NPROC=3 bash examples/training/video_dit/train.sh --out-dir /tmp/r --steps 10
#
# Every argument goes to `train_video_dit train`. The switches are agreed across the SP group when it is
# initialised, so they are exported before the launch, never changed inside the job:
#   FASTVIDEO_ULYSSES_A2A               auto (fused route where every rank agrees) or off (the NCCL route)
#   FASTVIDEO_ULYSSES_A2A_LONG_TRAINING chunked (grad-tracked planes over 512 MiB may use tuned chunks) or auto
#   FASTVIDEO_ULYSSES_A2A_OVERLAP       0 (default) or N: attention heads in N groups, exchanges under compute
# FASTVIDEO_RECIPE_DEVICE: auto (default: every GPU, one rank each, on a host with 2+; else 2 gloo ranks on the
# CPU), cuda (every GPU, also one: SP1), cpu. NPROC overrides the rank count. PY: the Python to use.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PY="${PY:-python3}"
export PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}"  # the package and the recipes (sp_recipes)
source "$(dirname "${BASH_SOURCE[0]}")/../recipe_env.sh"  # the switches, NCCL, cuBLAS; sets device and nproc
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" -m sp_recipes.train_video_dit \
  train --device "$device" "$@"
