#!/usr/bin/env bash
# The main job: upstream FastVideo's own Wan DiT trained on this package's Ulysses all-to-all
# (examples/training/wan/compare_switches.sh): builds the overlay (upstream fastvideo==0.2.1 with this tree's
# fastvideo/ copied over it, in a cache outside the tree), trains with FASTVIDEO_ULYSSES_A2A=off, =auto, and auto
# resumed from its middle checkpoint, then the closing table (identical losses asserted, the backend and route of each
# run named) and the plot. 2+ GPUs: one rank per GPU over NCCL. Otherwise (a CPU machine, or a host with one GPU):
# 2 ranks over gloo on the CPU. Arguments go to every training run (e.g. --steps 10).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec bash "$ROOT/examples/training/wan/compare_switches.sh" "$@"
