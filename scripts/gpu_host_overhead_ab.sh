#!/usr/bin/env bash
# The fused call's host overhead at P = 1 on one GPU, A/B between an older tree and this one, in one run, each tree
# on its own loader and kernel library build (their library ABIs may differ). From the repository root:
#
#   git archive REV | (mkdir -p .revs/base && tar -x -C .revs/base) && echo REV > .revs/base/COMMIT
#   OUT=/tmp/ab BASE=.revs/base ROUNDS=3 bash scripts/gpu_host_overhead_ab.sh
#
# The fused_host_overhead case (docs/benchmarks.md) under --compare-revs BASE . --tree-libraries: the same benchmark
# code against each tree's fastvideo, interleaved A, B, A, B for ROUNDS rounds; per row the host-to-completion
# time of the whole fused call through a one-rank helper on the real library, the launch's device time, their
# difference, and #wrong. $OUT: summary.txt, commit.txt, logs.tar.gz, ab.json (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init host-overhead-ab
BASE="${BASE:?BASE=path of the older tree (an exported revision)}"
export -f gpu_versions
step versions 60 versions.log bash -c gpu_versions
step "build base library" 240 build.log "$python" "$BASE/fastvideo-kernel/build_lib.py" --out "$BASE/build/kernel"
step "build this library" 240 build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
step "fused host overhead A/B" "${AB_LIMIT_S:-300}" ab.log "$python" -m benchmarks.run fused_host_overhead \
  --compare-revs "$BASE" "$ROOT" --nproc 1 --tree-libraries --rounds "${ROUNDS:-3}" --json "$WORK/logs/ab.json"
gpu_finish logs/ab.json
