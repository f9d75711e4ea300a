#!/usr/bin/env bash
# What a 2-GPU host runs, in stages that each stay inside 10 minutes, on any host with 2 NVLink-joined CUDA GPUs,
# from the repository root:
#
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh gate       # the native gate (plan sweep, epoch checker) and the
#                                                         #   watchdog SIGKILL check
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh floor      # the fabric's floor per geometry: bidirectional peer
#                                                         #   copy, copy-engine and SM-store pushes, NCCL send/recv
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh a2a        # the transport benchmark: NCCL, fused and (PEER_SDIST)
#                                                         #   fast-ulysses rows rotated in one run, the floor beside
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh tune       # the tuner over both engines, then the transport benchmark
#                                                         #   planning from the tuner's rows (--tuned-from)
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh graphs     # tests/distributed/check_ulysses_graphs.py
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh graphs-ce  # the same with --capture-engines ce,sm
#   OUT=/tmp/sp2 BASE=.revs/base bash scripts/gpu_sp2_suite.sh compare
#                                                         # --compare-revs of an exported older tree (e.g.
#                                                         #   `git archive REV | tar -x -C .revs/base`) against this
#                                                         #   one, each tree on its own loader and library build
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh dit        # scripts/gpu_dit_step.sh, its dense part (32k, 128k)
#   OUT=/tmp/sp2 bash scripts/gpu_sp2_suite.sh dit-sparse # its sparse part (32k, 128k, 250k, offload, both
#                                                         #   long-training policies): the two parts together
#                                                         #   outlast a stage's 10 minutes (benchmark_dit_step.py
#                                                         #   --estimate)
#
# PEER_SDIST=PATH (the fast-ulysses 0.2.1 sdist, which is never part of this repository): built for sm_90 with this
# host's torch (gpu_fast_ulysses, scripts/gpu_lib.sh), so the a2a stage times it beside our routes; without it
# those rows are skipped with the reason. Each stage installs the kernel wheel first (scripts/gpu_lib.sh) and
# keeps going after a failed step; the exit status is non-zero if any step failed. $OUT: summary.txt,
# commit.txt, logs.tar.gz and the stage's JSONs.
set -uo pipefail
stage="${1:-gate}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init "sp2-$stage"
echo "stage $stage" | tee -a "$WORK/logs/commit.txt"
export -f gpu_versions
step versions 40 versions.log bash -c gpu_versions
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
  echo "fewer than 2 GPUs visible: stage $stage needs 2" | tee -a "$WORK/logs/summary.txt"
  failed=1
  gpu_finish
fi
gpu_kernel_wheel
# The test library (the product sources plus the epoch-checked launch and the fabric copy) for the stages that
# use them: the gate's --epoch-check and the benchmarks' fabric references. The product wheel stays installed.
case "$stage" in
  gate | floor | a2a | compare) gpu_testing_library && export FASTVIDEO_KERNEL_LIBRARY="$FASTVIDEO_KERNEL_TESTING_LIBRARY" ;;
esac
L="$WORK/logs"
TORCHRUN=("$python" -m torch.distributed.run --standalone --nproc_per_node=2)
case "$stage" in
  gate)
    step "native gate" 420 gate.log "${TORCHRUN[@]}" tests/distributed/check_ulysses_h3_native.py --epoch-check \
      --json "$L/gate.json"
    step "watchdog SIGKILL" 90 gate.log "$python" tests/distributed/check_ulysses_watchdog_sigkill.py --timeout 20
    gpu_finish logs/gate.json
    ;;
  floor)
    step "floor" 240 floor.log "${TORCHRUN[@]}" benchmarks/run.py floor --json "$L/floor.json"
    step "floor, flat sizes" 120 floor.log "${TORCHRUN[@]}" benchmarks/run.py floor --mib 64,256,1024 \
      --json "$L/floor_mib.json"
    gpu_finish logs/floor.json logs/floor_mib.json
    ;;
  a2a)
    gpu_fast_ulysses
    step "a2a" 480 a2a.log "${TORCHRUN[@]}" benchmarks/benchmark_ulysses_a2a.py --overlap --require-fused \
      --json "$L/a2a.json"
    step "verdicts" 30 a2a.log "$python" benchmarks/check_results.py "$L/a2a.json"
    gpu_finish logs/a2a.json
    ;;
  tune)
    step "tuner (sm, ce)" 240 tune.log "${TORCHRUN[@]}" benchmarks/tune_ulysses_a2a.py --geometry wan720p \
      --geometry h3-32k --ctas 144 --ce-ctas 66,132 --row-splits 2,4,8 --engines sm,ce --json "$L/tune.json"
    tuned=()
    [[ -s $L/tune.json ]] && tuned=(--tuned-from "$L/tune.json")
    step "a2a on the tuned rows" 300 tune.log "${TORCHRUN[@]}" benchmarks/benchmark_ulysses_a2a.py --routes nccl,fused \
      --require-fused "${tuned[@]}" --json "$L/a2a_tuned.json"
    gpu_finish logs/tune.json logs/a2a_tuned.json
    ;;
  graphs)
    step "graphs" 280 graphs.log "${TORCHRUN[@]}" tests/distributed/check_ulysses_graphs.py --json "$L/graphs.json"
    gpu_finish logs/graphs.json
    ;;
  graphs-ce)
    step "graphs, copy-engine captures" 280 graphs.log "${TORCHRUN[@]}" tests/distributed/check_ulysses_graphs.py \
      --capture-engines ce,sm --json "$L/graphs_ce.json"
    gpu_finish logs/graphs_ce.json
    ;;
  compare)
    base="${BASE:-.revs/base}"
    if [[ ! -d $base/fastvideo ]]; then
      echo "compare: no exported tree at $base" | tee -a "$WORK/logs/summary.txt"
      failed=1
    else
      step "build base library" 200 compare.log bash -c "cd '$base' && '$python' fastvideo-kernel/build_lib.py --out build/kernel"
      step "build head library" 200 compare.log "$python" fastvideo-kernel/build_lib.py --out build/kernel
      step "compare-revs" 420 compare.log "$python" benchmarks/benchmark_ulysses_a2a.py --compare-revs "$base" . \
        --tree-libraries --rounds 2 --nproc 2 --json "$L/compare.json" -- --geometry wan720p --geometry h3-32k \
        --routes nccl,fused
    fi
    gpu_finish logs/compare.json
    ;;
  dit | dit-sparse)
    part=dense
    [[ $stage == dit-sparse ]] && part=sparse
    step "DiT step, $part" 560 dit.log env PARTS=$part BUDGET_S=530 WORK="$WORK/dit" OUT="$WORK/dit/out" \
      bash scripts/gpu_dit_step.sh
    gpu_finish "dit/logs/dit_$part.json" dit/logs/dit.png
    ;;
  *) echo "unknown stage $stage (gate|floor|a2a|tune|graphs|graphs-ce|compare|dit|dit-sparse)" >&2; exit 2 ;;
esac
