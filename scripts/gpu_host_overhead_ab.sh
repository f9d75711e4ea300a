#!/usr/bin/env bash
# The fused call's host overhead at P = 1 on one GPU, A/B between older trees and this one, in one run, each tree
# on its own loader, kernel library and hot-path extension builds (their ABIs may differ). From the repository root:
#
#   git archive REV | (mkdir -p .revs/base && tar -x -C .revs/base) && echo REV > .revs/base/COMMIT
#   OUT=/tmp/ab BASE=.revs/base ROUNDS=3 bash scripts/gpu_host_overhead_ab.sh
#
# BASE may name several exported trees (space-separated): each is compared with this one in turn. The
# fused_host_overhead case (docs/benchmarks.md) under --compare-revs BASE . --tree-libraries: the same benchmark
# code against each tree's fastvideo, both in each of ROUNDS rounds, the two runs of a round together, one row of
# each in turn, on the same CPUs (benchmarks/harness/turns.py: the leader swaps every row);
# per row the host-to-completion time of the whole fused call through a one-rank helper on the real library, the
# launch's device time, their difference (of the medians, and paired per iteration) and #wrong, after a floor row (a
# plain torch copy timed the same way). Then, unless TAGS=0, the same case on this tree alone with --tag both: an untagged and a tagged row per
# plan and mode back to back, what a call-site tag costs the host. With DECOMPOSE=1, --decompose in the A/B (both
# trees' rows cut at the call's layers: public checks, helper, the hot lane's native call, vote, launch) and, without
# HOT=1, on this tree alone. With
# HOT=1: the hot-path check (tests/distributed/check_hot_path.py) and the same case with --hot both (a row with the
# hot path off and one with it on per plan and mode, back to back; decomposed too with DECOMPOSE=1). With
# HOST_PATH_BASE (another exported tree, e.g. an older one), also the helper's host path at P = 2 over the
# shared-memory vote (host_path --vote shm), A/B between that tree and this one, each on its own library.
# $OUT: summary.txt, commit.txt, logs.tar.gz (with every round's JSON under ab-NAME/), ab-NAME.json per base,
# tags.json, decompose.json and host_path_ab.json (scripts/gpu_lib.sh). COMPARED_ONLY=1: the A/B times the compared
# metric alone (--compared-only), and HOT=1 runs the hot-path check without this tree's own hot table, so more
# rounds fit. More rounds than one call holds: run it again (an even ROUNDS each time) and compare the parts'
# ab-NAME.json as one with --compare-merge (docs/benchmarks.md).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init host-overhead-ab
BASE="${BASE:?BASE=path of the older tree (an exported revision; several: space-separated)}"
export -f gpu_versions
step versions 60 versions.log bash -c gpu_versions
step "build this library" 240 build.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
step "build the hot-path extension" 240 build.log "$python" fastvideo-kernel/build_hot.py --out build/kernel
results=()
if [[ "${HOT:-0}" == 1 ]]; then
  step "hot path check" 150 hot_check.log env FASTVIDEO_KERNEL_LIBRARY="$ROOT/build/kernel/libfastvideo_ulysses_a2a.so" \
    "$python" tests/distributed/check_hot_path.py
  if [[ "${COMPARED_ONLY:-0}" != 1 ]]; then  # this tree's own table; an A/B-only call spends its time on rounds
    decompose=()
    [[ "${DECOMPOSE:-0}" == 1 ]] && decompose=(--decompose)
    step "fused host overhead, hot path off and on" 240 hot.log "$python" -m benchmarks.run fused_host_overhead \
      --hot both "${decompose[@]}" --kernel-library dev --json "$WORK/logs/hot.json"
    results+=(logs/hot.json)
  fi
fi
lanes=()  # HOT=1: every A/B row twice, the Python lane and the hot lane of each tree
[[ "${HOT:-0}" == 1 ]] && lanes=(--hot both)
[[ "${DECOMPOSE:-0}" == 1 ]] && lanes+=(--decompose)  # each tree's rows cut at the call's layers, in turns too
[[ "${COMPARED_ONLY:-0}" == 1 ]] && lanes+=(--compared-only)  # the compared metric alone: shorter rounds
for base in $BASE; do
  name=$(basename "$base")
  step "build $name library" 240 build.log "$python" "$base/fastvideo-kernel/build_lib.py" --out "$base/build/kernel"
  if [[ -f $base/fastvideo-kernel/build_hot.py ]]; then  # a tree with a hot path runs it, as this one does
    step "build $name hot-path extension" 240 build.log "$python" "$base/fastvideo-kernel/build_hot.py" \
      --out "$base/build/kernel"
  fi
  # about 75 s a round on one H200 (both trees' rows in turns); AB_LIMIT_S overrides
  step "fused host overhead A/B ($name)" "${AB_LIMIT_S:-$((60 + 90 * ${ROUNDS:-3}))}" "ab-$name.log" \
    "$python" -m benchmarks.run \
    fused_host_overhead --compare-revs "$base" "$ROOT" --nproc 1 --tree-libraries --rounds "${ROUNDS:-3}" \
    --within 0.5,10 "${lanes[@]}" \
    --compare-out "$WORK/logs/ab-$name" --json "$WORK/logs/ab-$name.json"
  results+=("logs/ab-$name.json")
done
if [[ "${TAGS:-1}" != 0 ]]; then
  step "fused host overhead, tagged vs untagged" 200 tags.log "$python" -m benchmarks.run fused_host_overhead \
    --tag both --kernel-library dev --json "$WORK/logs/tags.json"
  results+=(logs/tags.json)
fi
if [[ "${HOT:-0}" != 1 && "${DECOMPOSE:-0}" == 1 ]]; then
  step "fused host overhead, decomposed" 120 decompose.log "$python" -m benchmarks.run fused_host_overhead \
    --decompose --kernel-library dev --json "$WORK/logs/decompose.json"
  results+=(logs/decompose.json)
fi
if [[ -n "${HOST_PATH_BASE:-}" ]]; then
  step "build host-path base library" 240 build.log "$python" "$HOST_PATH_BASE/fastvideo-kernel/build_lib.py" \
    --out "$HOST_PATH_BASE/build/kernel"
  step "host path A/B (P=2, shm vote)" 240 host_path_ab.log "$python" -m benchmarks.run host_path \
    --compare-revs "$HOST_PATH_BASE" "$ROOT" --nproc 2 --tree-libraries --rounds "${ROUNDS:-3}" \
    --json "$WORK/logs/host_path_ab.json" --vote shm
fi
gpu_finish "${results[@]}" logs/host_path_ab.json
