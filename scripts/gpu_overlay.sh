#!/usr/bin/env bash
# The upstream overlay's integration test (tests/test_upstream_overlay.py) on a GPU host's own python and torch
# (torch 2.11, Python 3.12, no package registry), from the repository root:
#
#   OUT=/tmp/overlay bash scripts/gpu_overlay.sh
#
# Offline: the overlay is built from the wheel folder .whl/overlay that travels with the tree (git-ignored; fill it
# where there is a network with `bash scripts/upstream_overlay.sh --download-to .whl/overlay`), into a cache under
# $WORK. The test runs with the GPUs hidden (CPU and gloo, as in CI) and with all four of upstream's SP tests
# (FASTVIDEO_OVERLAY_ALL_TESTS=1), each under FASTVIDEO_ULYSSES_A2A=off and auto; CI=true, so a missing wheel fails
# instead of skipping. $OUT: summary.txt, commit.txt, logs.tar.gz, versions.log, overlay_build.log and
# overlay_test.log (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init overlay
L="$WORK/logs"
WHEELS="${OVERLAY_WHEELS:-$ROOT/.whl/overlay}"
{
  gpu_python '^(torch|torchvision|scipy|numpy|pillow|safetensors|pytest|pytest-timeout|pytest-xdist|transformers|diffusers) '
  nproc
  echo "wheel folder $WHEELS:"; ls -la "$WHEELS" 2>&1
} >"$L/versions.log" 2>&1
cat "$L/versions.log"
export FASTVIDEO_OVERLAY_CACHE="$WORK/cache" CI=true
step "overlay build (offline)" 180 overlay_build.log \
  "$python" -m tests.overlay.build --python "$python" --wheels "$WHEELS"
workers=$(( $(nproc) / 4 )); (( workers > 4 )) && workers=4; (( workers < 1 )) && workers=1
xdist=()
"$python" -c 'import xdist' 2>/dev/null && xdist=(-n "$workers")
step "overlay integration test (GPUs hidden)" 540 overlay_test.log env CUDA_VISIBLE_DEVICES= \
  FASTVIDEO_OVERLAY_ALL_TESTS=1 FASTVIDEO_OVERLAY_WHEELS="$WHEELS" PYTHONPATH="$ROOT" "$python" -m pytest -q -rs \
  --ulysses-ambient=all "${xdist[@]}" tests/test_upstream_overlay.py
gpu_finish logs/versions.log logs/overlay_build.log logs/overlay_test.log
