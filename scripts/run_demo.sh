#!/usr/bin/env bash
# The main job: upstream FastVideo's own Wan DiT trained on this package's Ulysses all-to-all
# (examples/training/wan/compare_switches.sh): builds the overlay (upstream fastvideo==0.2.1 with this tree's
# fastvideo/ copied over it, in a cache outside the tree), trains with FASTVIDEO_ULYSSES_A2A=off, =auto, and auto
# resumed from its middle checkpoint, then the closing table (identical losses asserted, the backend and route of each
# run named) and the plot. 2+ GPUs: one rank per GPU over NCCL. Otherwise (a CPU machine, or a host with one GPU):
# 2 ranks over gloo on the CPU. Arguments go to every training run (e.g. --steps 10).
#
# Offline without the overlay's wheels (no package registry and no .whl/overlay/), upstream's model cannot be
# installed: the Wan job is then skipped with a note naming what is missing, and the in-house video DiT recipe
# (examples/training/video_dit/compare_routes.sh: the same off/auto/resumed comparison and closing table on a model
# of this package, nothing to download) runs in its place. Under CI=true that is a failure instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
rc=0
bash "$ROOT/examples/training/wan/compare_switches.sh" "$@" || rc=$?
if ((rc == 3)) && ! _fv_ci; then
  echo "main job: SKIPPED upstream's Wan DiT: the overlay needs upstream fastvideo==0.2.1 and the packages of its" \
       "model path, and this machine can neither download them nor find them in .whl/overlay/ (fill it with" \
       "'bash scripts/upstream_overlay.sh --download-to .whl/overlay' where there is a registry, and carry it)." \
       "Running the in-house video DiT recipe instead (no downloads)." >&2
  exec bash "$ROOT/examples/training/video_dit/compare_routes.sh" "$@"
fi
exit "$rc"
