#!/usr/bin/env bash
# The whole recipe (the README's first command runs it): train the video DiT with FASTVIDEO_ULYSSES_A2A=off, then
# with =auto (each its own launch: the switch is agreed at initialisation), resume the auto run from its middle
# checkpoint in a third launch, then print the closing table, assert that every run has the same losses, and
# plot loss and step time per route. Arguments go to every training run (e.g. --steps 10).
#
#   bash examples/training/video_dit/compare_routes.sh [--steps N ...]
#
# Outputs under FASTVIDEO_RECIPE_OUT (default build/video_dit): off/, auto/, auto_resumed/ (run.json, checkpoints/)
# and loss_and_step_time.png. A GPU host with one GPU trains over gloo on the CPU (SP needs 2+ ranks; set
# FASTVIDEO_RECIPE_DEVICE=cuda for SP1 on the GPU).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PY="${PY:-python3}"
export PY PYTHONPATH="$ROOT:$ROOT/examples${PYTHONPATH:+:$PYTHONPATH}"  # the package and the recipes
out="${FASTVIDEO_RECIPE_OUT:-$ROOT/build/video_dit}"
rm -rf "$out/off" "$out/auto" "$out/auto_resumed" "$out/loss_and_step_time.png"
start=$SECONDS
FASTVIDEO_ULYSSES_A2A=off bash "$HERE/train.sh" --out-dir "$out/off" "$@"
FASTVIDEO_ULYSSES_A2A=auto bash "$HERE/train.sh" --out-dir "$out/auto" "$@"
middle=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoints"][0]["path"])' "$out/auto/run.json")
echo "recipe: resuming the auto run from $middle" >&2
FASTVIDEO_ULYSSES_A2A=auto bash "$HERE/train.sh" --out-dir "$out/auto_resumed" --resume "$middle" "$@"
"$PY" -m sp_recipes.train_video_dit compare "$out/off/run.json" "$out/auto/run.json" \
  --resumed "$out/auto_resumed/run.json" --plot "$out/loss_and_step_time.png"
echo "recipe: done in $((SECONDS - start)) s; runs under $out"
