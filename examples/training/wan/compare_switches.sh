#!/usr/bin/env bash
# The whole Wan recipe (the README's first command runs it): build the overlay, train upstream's Wan DiT with
# FASTVIDEO_ULYSSES_A2A=off, then with =auto (each its own launch: the switch is agreed at initialisation), resume
# the auto run from its middle checkpoint in a third launch, then print the closing table (asserts identical losses,
# names the backend and route of each run) and plot loss and step time per run. Arguments go to every training run
# (e.g. --steps 10).
#
#   bash examples/training/wan/compare_switches.sh [--steps N ...]
#
# Outputs under FASTVIDEO_RECIPE_OUT (default build/wan): off/, auto/, auto_resumed/ (run.json, checkpoints/),
# closing_table.txt and loss_and_step_time.png. The overlay: FASTVIDEO_OVERLAY_PYTHONPATH where it is set (an overlay
# built before), else the overlay builder (scripts/upstream_overlay.sh: upstream's pinned wheel and the pinned
# packages of its model path in a cache outside the tree, from .whl/overlay/ where it exists, this tree's fastvideo/
# over it). Exit status 3: the overlay needs a download this machine cannot make (offline, no wheel folder).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PY="${PY:-python3}"
out="${FASTVIDEO_RECIPE_OUT:-$ROOT/build/wan}"
out=$(realpath -m "$out")
export PY ROOT
# Upstream's noise, which is no failure: its platform probe logs "ERROR ... NPU detection failed: PyTorch or
# PyTorch_NPU is not installed" in every process on a machine without an Ascend NPU (filtered from stdout, where its
# logger writes), and the overlay's requests package warns that no optional charset detector is installed.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Unable to find acceptable character detection"
exec > >(grep -v --line-buffered -F "NPU detection failed: PyTorch or PyTorch_NPU is not installed")
start=$SECONDS
if [ -n "${FASTVIDEO_OVERLAY_PYTHONPATH:-}" ]; then
  echo "recipe: using the overlay given in FASTVIDEO_OVERLAY_PYTHONPATH=$FASTVIDEO_OVERLAY_PYTHONPATH" >&2
else
  # The overlay builder prints the overlay's PYTHONPATH on its last line (progress and errors on stderr).
  rc=0
  built=$(PYTHON="$PY" bash "$ROOT/scripts/upstream_overlay.sh") || rc=$?
  if ((rc != 0)); then
    echo "recipe: the overlay could not be built (above: why; offline, put its wheels in .whl/overlay/ with" \
         "'bash scripts/upstream_overlay.sh --download-to .whl/overlay' on a machine with a registry)" >&2
    exit "$rc"  # 3: a download it needs is missing (offline, no wheel folder)
  fi
  FASTVIDEO_OVERLAY_PYTHONPATH=$(tail -n 1 <<<"$built")
fi
export FASTVIDEO_OVERLAY_PYTHONPATH
setup=$((SECONDS - start))
rm -rf "$out/off" "$out/auto" "$out/auto_resumed" "$out/loss_and_step_time.png" "$out/closing_table.txt"
FASTVIDEO_ULYSSES_A2A=off bash "$HERE/train.sh" --out-dir "$out/off" "$@"
FASTVIDEO_ULYSSES_A2A=auto bash "$HERE/train.sh" --out-dir "$out/auto" "$@"
middle=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoints"][0]["path"])' "$out/auto/run.json")
echo "recipe: resuming the auto run from $middle" >&2
FASTVIDEO_ULYSSES_A2A=auto bash "$HERE/train.sh" --out-dir "$out/auto_resumed" --resume "$middle" "$@"
status=0
(cd "${FASTVIDEO_OVERLAY_PYTHONPATH%%:*}" && PYTHONPATH="$FASTVIDEO_OVERLAY_PYTHONPATH:$ROOT/examples" "$PY" -m sp_recipes.train_wan compare "$out/off/run.json" \
  "$out/auto/run.json" --resumed "$out/auto_resumed/run.json" --plot "$out/loss_and_step_time.png" \
  --table "$out/closing_table.txt") || status=$?
echo "recipe: done in $((SECONDS - start)) s (overlay set-up ${setup} s); runs under $out"
exit "$status"
