#!/usr/bin/env bash
# The main job: the video DiT training recipe (examples/training/video_dit/compare_routes.sh) on both all-to-all
# routes, with the closing table (off against auto: identical losses, asserted), a resumed checkpoint and the plot.
# 2+ GPUs: one rank per GPU over NCCL. Otherwise (a CPU machine, or a host with one GPU): 2 ranks over gloo on
# the CPU, the tiny embedded config. Arguments go to every training run (e.g. --steps 10).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec bash "$ROOT/examples/training/video_dit/compare_routes.sh" "$@"
